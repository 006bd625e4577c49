"""SWARM pipeline training: models larger than one peer, cut into stages served by many peers.

A model is an ordered list of blocks (torch modules, each built by a
factory under its own seed) cut into stages (:class:`PipelineModel`). Each
:class:`StageServer` serves one stage on a :class:`~p2ptrain.peer.Peer`:
``swarm.forward`` / ``swarm.backward`` RPCs, held activations under a
per-trainer cap, a stage-wise :class:`~p2ptrain.train.CollaborativeOptimizer`
(run ``<run_id>-stage<i>``) that averages the stage's gradients among its
peers and steps, and announcements (stage, samples/s, queue) in the DHT.
A :class:`PipelineTrainer` pushes micro-batches through one peer per stage,
chosen by the wiring rule of :mod:`p2ptrain.swarm.wiring`, and retries on
another peer when one dies, stalls or refuses. All blocks live in servers; the
trainer holds only the loss. See docs/pipeline.md.

Example (two peers in one process; docs/pipeline.md runs this in full)::

    model = PipelineModel.even([lambda: nn.Linear(4, 16), nn.Tanh, lambda: nn.Linear(16, 1)], 2)
    config = StageServerConfig(run_id="demo", target_batch_size=32)
    # first, second: started Peers of one swarm (second joined through first.address)
    servers = [StageServer(peer=p, model=model, stage=s, config=config,
                           make_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
               for s, p in enumerate((first, second))]
    for server in servers:
        server.start()                      # checks the memory budget, joins, announces
    trainer = PipelineTrainer(peer=first, loss=nn.functional.mse_loss,
                              config=PipelineTrainerConfig(run_id="demo", num_stages=2))
    loss = trainer.step(x, y, timeout=30)   # from a thread; on the loop:
    # loss = await trainer.train_micro_batch(x, y)

Stable names for other layers (rebalancing, benchmarks, simulator):
``StageServer.stage / samples_per_s / queue_length / global_step / stats /
move_to(stage)`` (async, on the peer's loop), ``StageServerConfig.min_compute_s``
(emulated device speed), ``read_stage(dht, run_id, stage)`` →
``StageAnnouncement`` (who serves a stage, their samples/s and queue),
``PipelineTrainer.stats`` (``samples_delivered``, ``retries``, ``replayed_samples``),
``PipelineTrainer.settle()`` / ``close()`` (replay what was lost, then stop),
``StageServer.on_event`` (``forward_started``, ``forward_done``,
``backward_done``, ``stepped``), ``StageServerStats.samples_in_steps``.
Exactly-once counting of samples across kills: :mod:`p2ptrain.swarm.ledger`.
A simulation runs the same :class:`StageServer` on its virtual clock through
``StageServer(device=..., stage_optimizer=...)`` and ``astart()`` / ``aclose()``
/ ``abort()`` (:mod:`p2ptrain.lab.swarm_sim`).
"""

from p2ptrain.errors import MemoryBudgetError, PipelineError, StageUnavailableError
from p2ptrain.swarm.config import PipelineTrainerConfig, StageServerConfig
from p2ptrain.swarm.directory import StageAnnouncement, read_stage, stage_key
from p2ptrain.swarm.server import StageServer, StageServerStats
from p2ptrain.swarm.stages import PipelineModel, even_bounds, stage_memory_bytes
from p2ptrain.swarm.trainer import PipelineTrainer, PipelineTrainerStats
from p2ptrain.swarm.wiring import Candidate, LinkStats, choose_peer, expected_completion

__all__ = [
    "Candidate",
    "LinkStats",
    "MemoryBudgetError",
    "PipelineError",
    "PipelineModel",
    "PipelineTrainer",
    "PipelineTrainerConfig",
    "PipelineTrainerStats",
    "StageAnnouncement",
    "StageServer",
    "StageServerConfig",
    "StageServerStats",
    "StageUnavailableError",
    "choose_peer",
    "even_bounds",
    "expected_completion",
    "read_stage",
    "stage_key",
    "stage_memory_bytes",
]
