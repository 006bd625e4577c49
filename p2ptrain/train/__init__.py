"""Training on top of the swarm: collaborative optimizer, DiLoCo, progress, state sync.

:class:`CollaborativeOptimizer` accumulates gradients until the swarm as a
whole has processed ``target_batch_size`` samples, then averages them in a
group and steps; :class:`DiLoCoOptimizer` averages a pseudo-gradient once per
H local steps. Both publish their progress in the DHT, serve their state to
late joiners and download the swarm's state when they fall behind. See
docs/training.md.
"""

from p2ptrain.errors import CheckpointError, StateSyncError, TrainingError
from p2ptrain.train.collaboration import TrainerStats
from p2ptrain.train.config import DiLoCoConfig, TrainerConfig
from p2ptrain.train.diloco import DiLoCoOptimizer
from p2ptrain.train.optimizer import CollaborativeOptimizer
from p2ptrain.train.progress import PeerProgress, ProgressConfig, SwarmProgress, aggregate
from p2ptrain.train.state import TrainingSnapshot, load_checkpoint, save_checkpoint
from p2ptrain.train.state_sync import StateSyncConfig

__all__ = [
    "CheckpointError",
    "CollaborativeOptimizer",
    "DiLoCoConfig",
    "DiLoCoOptimizer",
    "PeerProgress",
    "ProgressConfig",
    "StateSyncConfig",
    "StateSyncError",
    "SwarmProgress",
    "TrainerConfig",
    "TrainerStats",
    "TrainingError",
    "TrainingSnapshot",
    "aggregate",
    "load_checkpoint",
    "save_checkpoint",
]
