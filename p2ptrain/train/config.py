"""Configuration of the trainers: :class:`TrainerConfig` and :class:`DiLoCoConfig`.

Both hold the run's name, how steps are triggered, and the configs of the
parts they use (progress tracking, all-reduce codec, state sync). Network
and matchmaking settings belong to the :class:`~p2ptrain.peer.PeerConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from p2ptrain.allreduce.config import AllReduceConfig
from p2ptrain.allreduce.grouped import GroupingConfig
from p2ptrain.errors import ConfigError
from p2ptrain.train.cut import STEP_POLICIES
from p2ptrain.train.progress import ProgressConfig
from p2ptrain.train.state_sync import StateSyncConfig
from p2ptrain.validate import check_integer, check_number

__all__ = ["DiLoCoConfig", "TrainerConfig"]

_MAX_SAMPLES = 2**62


def _check_run_id(owner: str, run_id: object) -> None:
    if not isinstance(run_id, str) or not 0 < len(run_id.encode("utf-8")) <= 200:
        raise ConfigError(f"{owner}.run_id must be a name of 1 to 200 bytes, got {run_id!r}")
    if "/" in run_id:
        raise ConfigError(f"{owner}.run_id must not contain '/' (it prefixes DHT keys)")


def _check_int(owner: str, name: str, value: object, *, low: int = 1) -> None:
    check_integer(f"{owner}.{name}", value, at_least=low, at_most=_MAX_SAMPLES)


def _check_lead(owner: str, value: object) -> None:
    check_number(f"{owner}.matchmaking_lead", value, at_least=0, allow_none=True)


def _check_parts(owner: str, allreduce: object, progress: object, state: object) -> None:
    if not isinstance(allreduce, AllReduceConfig):
        raise ConfigError(f"{owner}.allreduce must be an AllReduceConfig")
    if not isinstance(progress, ProgressConfig):
        raise ConfigError(f"{owner}.progress must be a ProgressConfig")
    if not isinstance(state, StateSyncConfig):
        raise ConfigError(f"{owner}.state must be a StateSyncConfig")


@dataclass(frozen=True)
class TrainerConfig:
    """How a :class:`~p2ptrain.train.optimizer.CollaborativeOptimizer` trains with the swarm.

    Attributes:
        run_id: Names the run; peers with the same run id train together.
            It prefixes the DHT keys (``<run_id>/progress``, ``<run_id>/step-<n>``).
        target_batch_size: Samples the swarm accumulates, all peers together,
            before each step.
        max_local_samples_per_step: If set, a peer that accumulated this many
            samples toward a step waits in ``step()`` until the step happens.
            That bounds each peer's share of a step; with ``target_batch_size``
            equal to peers × this, every step averages exactly one batch of
            each peer. When every live peer waits, the step happens even below
            the target.
        step_policy: What a peer does once it closed a step at the target
            (:mod:`p2ptrain.train.cut`): ``wait`` (default) waits for the
            step's average; ``carry`` computes batches toward the next
            step while the step averages in the background, on the
            parameters its own gradient predicts (``predict_weights``), and
            applies the update one ``step()`` later; ``unbounded`` adds
            batches until the swarm's reported samples reach the target
            (steps then hold more than the target; kept for comparison).
        carry_batches: Under ``carry``: how many local batches a peer may
            count toward the next step before the step it closed is applied.
            Past them it waits for the step's average. Each carried batch is
            one step stale, computed on predicted parameters. 0: wait for
            the average at once (as ``wait``).
        matchmaking_lead: Start matchmaking when the step is estimated to be
            this many seconds away, overlapping the last local batches.
            0: only when the step is due. ``None``: measured, from this
            peer's recent matchmaking durations (:class:`~p2ptrain.train.policy.LeadTimer`),
            or 0 with ``max_local_samples_per_step`` (an early group
            is sized from what the peer knows then, and may leave out a peer
            that joined meanwhile; a group formed when the step is due holds
            every contributor the step counted).
        sync_tolerance: Steps a peer may lag behind the swarm and still take
            part in a step; further behind, it downloads the swarm's state.
        allreduce: Codec and aggregation rule of the gradient all-reduce.
        progress: How often progress is published and read.
        state: How training state is served and downloaded.
        grouping: Above which swarm size a step averages in groups
            (:mod:`p2ptrain.allreduce.grouped`), and how.
        error_feedback: With a lossy codec, add the rounding error of each
            step's gradient to the next one (:mod:`p2ptrain.train.feedback`).
        predict_weights: Under ``carry``: while a step averages, install the
            parameters the inner optimizer would reach with this peer's own
            gradient, so that the carried batches are computed near the
            parameters to come (:mod:`p2ptrain.train.prediction`); the
            true parameters are put back before the averaged update. Code
            that reads the parameters between ``step()`` calls then sees
            the predicted ones while a step averages.
    """

    run_id: str
    target_batch_size: int
    max_local_samples_per_step: int | None = None
    step_policy: str = "wait"
    carry_batches: int = 1
    matchmaking_lead: float | None = None
    sync_tolerance: int = 1
    allreduce: AllReduceConfig = field(default_factory=AllReduceConfig)
    progress: ProgressConfig = field(default_factory=ProgressConfig)
    state: StateSyncConfig = field(default_factory=StateSyncConfig)
    grouping: GroupingConfig = field(default_factory=GroupingConfig)
    error_feedback: bool = True
    predict_weights: bool = True

    def __post_init__(self) -> None:
        _check_run_id("TrainerConfig", self.run_id)
        if not isinstance(self.error_feedback, bool):
            raise ConfigError("TrainerConfig.error_feedback must be a bool")
        if not isinstance(self.predict_weights, bool):
            raise ConfigError("TrainerConfig.predict_weights must be a bool")
        if self.step_policy not in STEP_POLICIES:
            raise ConfigError(
                f"TrainerConfig.step_policy must be one of {list(STEP_POLICIES)}, "
                f"got {self.step_policy!r}"
            )
        if not isinstance(self.grouping, GroupingConfig):
            raise ConfigError("TrainerConfig.grouping must be a GroupingConfig")
        _check_int("TrainerConfig", "target_batch_size", self.target_batch_size)
        if self.max_local_samples_per_step is not None:
            _check_int(
                "TrainerConfig", "max_local_samples_per_step", self.max_local_samples_per_step
            )
        _check_int("TrainerConfig", "carry_batches", self.carry_batches, low=0)
        _check_lead("TrainerConfig", self.matchmaking_lead)
        _check_int("TrainerConfig", "sync_tolerance", self.sync_tolerance, low=0)
        _check_parts("TrainerConfig", self.allreduce, self.progress, self.state)


@dataclass(frozen=True)
class DiLoCoConfig:
    """How a :class:`~p2ptrain.train.diloco.DiLoCoOptimizer` trains with the swarm.

    Every peer runs ``inner_steps`` steps of its inner optimizer (AdamW in
    DiLoCo), then the swarm averages the pseudo-gradients (parameters at the
    start of the round minus parameters now, weighted by samples) and every
    peer applies them with the outer optimizer, SGD with Nesterov momentum,
    to the start-of-round parameters.

    Attributes:
        run_id: Names the run (see :class:`TrainerConfig`).
        inner_steps: Inner optimizer steps per round (H).
        outer_lr: Learning rate of the outer SGD.
        outer_momentum: Momentum of the outer SGD.
        nesterov: Use Nesterov momentum.
        target_batch_size: Samples (all peers together) after which a round
            ends even if some peers have not finished their inner steps;
            ``None`` waits for every live peer.
        matchmaking_lead: See :class:`TrainerConfig`; default 0 (rounds end
            when every peer waits, so there is nothing to overlap).
        sync_tolerance: See :class:`TrainerConfig`.
        allreduce: Codec of the pseudo-gradient all-reduce (``fp16`` halves
            the bytes again).
        progress: How often progress is published and read.
        state: How training state is served and downloaded.
        overlap: Average each round's pseudo-gradient in the background while
            the next round's inner steps run, and apply the outer step when it
            arrives (one outer step of delay, see
            :mod:`p2ptrain.train.diloco`); ``False`` waits for it.
    """

    run_id: str
    inner_steps: int = 100
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    target_batch_size: int | None = None
    matchmaking_lead: float | None = 0.0
    sync_tolerance: int = 1
    allreduce: AllReduceConfig = field(default_factory=AllReduceConfig)
    progress: ProgressConfig = field(default_factory=ProgressConfig)
    state: StateSyncConfig = field(default_factory=StateSyncConfig)
    overlap: bool = False

    def __post_init__(self) -> None:
        _check_run_id("DiLoCoConfig", self.run_id)
        _check_int("DiLoCoConfig", "inner_steps", self.inner_steps)
        check_number("DiLoCoConfig.outer_lr", self.outer_lr)
        check_number("DiLoCoConfig.outer_momentum", self.outer_momentum, at_least=0)
        if not isinstance(self.nesterov, bool):
            raise ConfigError("DiLoCoConfig.nesterov must be a bool")
        if not isinstance(self.overlap, bool):
            raise ConfigError("DiLoCoConfig.overlap must be a bool")
        if self.nesterov and self.outer_momentum == 0:
            raise ConfigError("DiLoCoConfig.nesterov needs a positive outer_momentum")
        if self.target_batch_size is not None:
            _check_int("DiLoCoConfig", "target_batch_size", self.target_batch_size)
        _check_lead("DiLoCoConfig", self.matchmaking_lead)
        _check_int("DiLoCoConfig", "sync_tolerance", self.sync_tolerance, low=0)
        _check_parts("DiLoCoConfig", self.allreduce, self.progress, self.state)
