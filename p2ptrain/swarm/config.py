"""Configuration of pipeline training: stage servers and pipeline trainers."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from p2ptrain.errors import ConfigError
from p2ptrain.train.progress import ProgressConfig
from p2ptrain.train.state_sync import StateSyncConfig
from p2ptrain.validate import check_integer, check_number

__all__ = ["PipelineTrainerConfig", "StageServerConfig", "check_pipeline_run_id"]

_WIRE_DTYPES = ("float32", "float16", "bfloat16")


def check_pipeline_run_id(owner: str, run_id: object) -> None:
    """A pipeline run id: 1 to 150 bytes, no ``/`` (it prefixes DHT keys and stage runs)."""
    if not isinstance(run_id, str) or not 0 < len(run_id.encode("utf-8")) <= 150:
        raise ConfigError(f"{owner}.run_id must be a name of 1 to 150 bytes, got {run_id!r}")
    if "/" in run_id:
        raise ConfigError(f"{owner}.run_id must not contain '/' (it prefixes DHT keys)")


def _check_dtype(owner: str, value: object) -> None:
    if value not in _WIRE_DTYPES:
        raise ConfigError(f"{owner}.wire_dtype must be one of {_WIRE_DTYPES}, got {value!r}")


@dataclass(frozen=True)
class StageServerConfig:
    """How a :class:`~p2ptrain.swarm.server.StageServer` serves its stage.

    Attributes:
        run_id: Names the pipeline run; its stages train as the runs
            ``<run_id>-stage<i>`` of :class:`~p2ptrain.train.CollaborativeOptimizer`.
        target_batch_size: Samples the peers of one stage accumulate, all
            together, before that stage's global step.
        max_local_samples_per_step: If set, this peer adds at most this many
            samples to a stage step (see :class:`~p2ptrain.train.TrainerConfig`):
            with one peer per stage and ``target_batch_size`` equal to it,
            every step holds exactly that many samples.
        max_held_per_peer: Micro-batches of one trainer whose forward state
            (input and autograd graph) the server holds at once; one more is
            refused with ``resource_exhausted``.
        hold_timeout: Seconds a held micro-batch waits for its backward
            before it is dropped.
        min_compute_s: A floor on each micro-batch's compute time (forward
            and backward each), to emulate a slower device; 0: none.
        memory_budget_bytes: The most bytes this peer gives to a stage's
            parameters, gradient accumulator and optimizer state
            (:func:`~p2ptrain.swarm.stages.stage_memory_bytes`); ``None``: no cap.
        max_tensor_bytes: Largest activation or gradient tensor accepted.
        wire_dtype: Dtype of the floating tensors this server sends back
            (``float32``, ``float16``, ``bfloat16``).
        commit_margin: Seconds of a backward call's deadline that must remain
            for the server to add its gradient; later it refuses, so that a
            trainer that gave up and retried elsewhere never sees the
            micro-batch counted twice.
        step_interval: Seconds between looks at the stage's optimizer (it
            steps when the stage's batch is full) and hand-overs of the
            accumulated gradients to it.
        handover_samples: Samples a server gathers before it hands its
            gradients over (each hand-over is two passes over the stage's
            gradients); ``None``: a quarter of ``target_batch_size``.
        handover_max_s: Seconds after which whatever it gathered is handed
            over anyway (the stage's progress counts only what was handed over).
        announce_interval: Seconds between announcements in the DHT.
        announce_ttl: Seconds an announcement lives in the DHT.
        sync_tolerance: Steps a stage peer may lag and still average.
        progress: How the stage's progress is published and read.
        state: How a stage's state is served and downloaded.
    """

    run_id: str
    target_batch_size: int
    max_local_samples_per_step: int | None = None
    max_held_per_peer: int = 16
    hold_timeout: float = 60.0
    min_compute_s: float = 0.0
    memory_budget_bytes: int | None = None
    max_tensor_bytes: int = 64 << 20
    wire_dtype: str = "float32"
    commit_margin: float = 1.0
    step_interval: float = 0.25
    handover_samples: int | None = None
    handover_max_s: float = 1.0
    announce_interval: float = 1.0
    announce_ttl: float = 6.0
    sync_tolerance: int = 1
    progress: ProgressConfig = field(default_factory=ProgressConfig)
    state: StateSyncConfig = field(default_factory=StateSyncConfig)

    def __post_init__(self) -> None:
        owner = "StageServerConfig"
        check_pipeline_run_id(owner, self.run_id)
        check_integer(f"{owner}.target_batch_size", self.target_batch_size, at_least=1)
        check_integer(f"{owner}.max_held_per_peer", self.max_held_per_peer, at_least=1)
        check_integer(
            f"{owner}.max_local_samples_per_step",
            self.max_local_samples_per_step,
            at_least=1,
            allow_none=True,
        )
        check_integer(
            f"{owner}.memory_budget_bytes", self.memory_budget_bytes, at_least=1, allow_none=True
        )
        check_integer(f"{owner}.max_tensor_bytes", self.max_tensor_bytes, at_least=1)
        check_integer(f"{owner}.sync_tolerance", self.sync_tolerance, at_least=0)
        check_integer(
            f"{owner}.handover_samples", self.handover_samples, at_least=1, allow_none=True
        )
        for name in (
            "hold_timeout",
            "step_interval",
            "handover_max_s",
            "announce_interval",
            "announce_ttl",
        ):
            check_number(f"{owner}.{name}", getattr(self, name))
        for name in ("min_compute_s", "commit_margin"):
            value = getattr(self, name)
            check_number(f"{owner}.{name}", value, above=-math.inf)
            if value < 0:
                raise ConfigError(f"{owner}.{name} must be >= 0, got {value!r}")
        _check_dtype(owner, self.wire_dtype)
        if not isinstance(self.progress, ProgressConfig):
            raise ConfigError(f"{owner}.progress must be a ProgressConfig")
        if not isinstance(self.state, StateSyncConfig):
            raise ConfigError(f"{owner}.state must be a StateSyncConfig")


@dataclass(frozen=True)
class PipelineTrainerConfig:
    """How a :class:`~p2ptrain.swarm.trainer.PipelineTrainer` pushes micro-batches.

    Attributes:
        run_id: The pipeline run (the stage servers' ``run_id``).
        num_stages: Stages of the model, in order.
        call_timeout: Seconds one forward or backward call to a stage peer
            may take; past it the trainer retries on another peer of the stage.
        retry_interval: Seconds between looks for a peer of a stage that has none.
        stage_wait: Seconds a micro-batch waits for a stage with no live peer
            before :class:`~p2ptrain.errors.StageUnavailableError`; ``None``: forever.
        refresh_interval: Seconds between reads of a stage's announcements.
        jitter: Randomization of the wiring rule: each candidate's expected
            completion is multiplied by a factor drawn from ``[1, 1 + jitter]``.
        explore: Probability that a micro-batch goes to a uniformly drawn
            peer of the stage instead of the wiring rule's choice.
        latency_smoothing: Weight of a new latency sample in the moving average.
        avoid_s: Seconds a peer that failed a call is left out of the wiring.
        gone_after: Seconds a stage peer must stay unreachable before the
            passes it had not counted in a step are replayed elsewhere.
        wire_dtype: Dtype of the floating tensors the trainer sends.
        max_tensor_bytes: Largest tensor accepted back from a stage peer.
    """

    run_id: str
    num_stages: int
    call_timeout: float = 10.0
    retry_interval: float = 0.5
    stage_wait: float | None = None
    refresh_interval: float = 1.0
    jitter: float = 0.2
    explore: float = 0.05
    latency_smoothing: float = 0.3
    avoid_s: float = 5.0
    gone_after: float = 5.0
    wire_dtype: str = "float32"
    max_tensor_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        owner = "PipelineTrainerConfig"
        check_pipeline_run_id(owner, self.run_id)
        check_integer(f"{owner}.num_stages", self.num_stages, at_least=1)
        check_integer(f"{owner}.max_tensor_bytes", self.max_tensor_bytes, at_least=1)
        for name in ("call_timeout", "retry_interval", "refresh_interval", "avoid_s", "gone_after"):
            check_number(f"{owner}.{name}", getattr(self, name))
        check_number(f"{owner}.stage_wait", self.stage_wait, allow_none=True)
        check_number(f"{owner}.jitter", self.jitter, above=-math.inf)
        if self.jitter < 0:
            raise ConfigError(f"{owner}.jitter must be >= 0, got {self.jitter!r}")
        check_number(f"{owner}.explore", self.explore, above=-math.inf)
        if not 0 <= self.explore <= 1:
            raise ConfigError(f"{owner}.explore must be in [0, 1], got {self.explore!r}")
        check_number(f"{owner}.latency_smoothing", self.latency_smoothing)
        if self.latency_smoothing > 1:
            raise ConfigError(f"{owner}.latency_smoothing must be in (0, 1]")
        _check_dtype(owner, self.wire_dtype)
