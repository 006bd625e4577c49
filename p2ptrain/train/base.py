"""What both trainers share: parameters, the state lock, lifecycle, snapshots, checkpoints.

A trainer wraps a torch optimizer whose parameters it trains with the swarm.
The training thread changes the parameters and optimizer state only while
holding the trainer's lock, and a snapshot is taken under the same lock, so
a peer downloading this trainer's state never sees half a step. The lock is
never held while waiting for the network.

Subclasses say what their state is (:meth:`SwarmTrainer._capture`), how to
install a received one (:meth:`SwarmTrainer._install`), and how a step is
applied (:meth:`SwarmTrainer._global_step`).
"""

from __future__ import annotations

import logging
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, Self

import torch

from p2ptrain.errors import CheckpointError, ConfigError, StateSyncError
from p2ptrain.metrics import Metrics
from p2ptrain.peer import Peer
from p2ptrain.train.averaging import RoundOutcome
from p2ptrain.train.collaboration import (
    Collaboration,
    StepRecord,
    SwarmSettings,
    TrainerStats,
)
from p2ptrain.train.policy import Action
from p2ptrain.train.progress import SwarmProgress
from p2ptrain.train.state import (
    TrainingSnapshot,
    clone_state,
    load_checkpoint,
    save_checkpoint,
)

__all__ = ["SwarmTrainer", "optimizer_parameters"]

logger = logging.getLogger(__name__)


def optimizer_parameters(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    """The parameters of ``optimizer``, in param-group order, each once.

    Raises:
        ConfigError: There are none, one repeats, or one is not floating-point.
    """
    params: list[torch.nn.Parameter] = [p for g in optimizer.param_groups for p in g["params"]]
    if not params:
        raise ConfigError("the optimizer has no parameters")
    if len({id(p) for p in params}) != len(params):
        raise ConfigError("a parameter appears twice in the optimizer")
    for p in params:
        if not p.is_floating_point():
            raise ConfigError(f"parameters must be floating-point, got {p.dtype}")
    return params


def check_params(received: object, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Check that a received parameter list matches the local parameters' shapes.

    Raises:
        StateSyncError: It does not.
    """
    if not isinstance(received, list) or len(received) != len(params):
        raise StateSyncError(f"expected {len(params)} parameter tensors")
    for index, (theirs, ours) in enumerate(zip(received, params, strict=True)):
        if not isinstance(theirs, torch.Tensor) or theirs.shape != ours.shape:
            raise StateSyncError(f"parameter {index} has another shape than {tuple(ours.shape)}")
        if not theirs.is_floating_point():
            raise StateSyncError(f"parameter {index} is not floating-point")
    return received


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: object, what: str) -> None:
    """``optimizer.load_state_dict(state)``, with failures as StateSyncError."""
    if not isinstance(state, dict):
        raise StateSyncError(f"the {what} state is not a dict")
    try:
        optimizer.load_state_dict(state)
    except (ValueError, KeyError, TypeError, RuntimeError, IndexError) as exc:
        raise StateSyncError(f"cannot load the {what} state: {exc}") from exc


class SwarmTrainer(ABC):
    """Base of the trainers (see the module docstring).

    Args:
        optimizer: The torch optimizer over the parameters to train.
        peer: The started peer to train through.
        metrics: Optional registry for the trainer's figures.
    """

    kind: ClassVar[str]
    """Names the state layout; a peer refuses another kind's state."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        peer: Peer,
        metrics: Metrics | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.peer = peer
        self.metrics = metrics
        self._params = optimizer_parameters(optimizer)
        self._lock = threading.Lock()
        self._step = 0
        self._samples = 0
        self._collab: Collaboration | None = None
        self._outcome: RoundOutcome | None = None

    @abstractmethod
    def step(self, batch_size: int) -> bool:
        """Account a local batch of ``batch_size`` samples after its ``backward()``.

        Returns:
            Whether the parameters changed by a swarm step or a downloaded state.
        """

    # -- what subclasses provide ----------------------------------------------------------

    @abstractmethod
    def _settings(self) -> SwarmSettings:
        """How the trainer takes part in the swarm (run id, target, configs)."""

    @abstractmethod
    def _capture(self) -> dict[str, Any]:
        """The state tree (called under the lock; tensors are cloned afterwards)."""

    @abstractmethod
    def _install(self, snapshot: TrainingSnapshot) -> None:
        """Install a state (called under the lock); StateSyncError if it does not fit."""

    @abstractmethod
    def _global_step(self) -> bool:
        """Average with the swarm and apply the step (the lock is not held).

        Returns:
            Whether the parameters changed (a trainer may average in the
            background and apply the step at a later call).
        """

    @property
    def _blocked(self) -> bool:
        return False

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Join the run: serve state, publish progress, download the state if behind.

        A failed download is logged and retried by later steps.
        """
        if self._collab is not None:
            raise RuntimeError("a trainer starts once")
        collab = Collaboration(
            peer=self.peer, settings=self._settings(), snapshot=self.snapshot, metrics=self.metrics
        )
        view = collab.start(self._step)
        self._collab = collab
        if view.global_step > self._step:
            self.sync_state()

    def close(self) -> None:
        """Leave the run (the peer stays up); the stats remain readable."""
        if self._collab is not None:
            self._collab.close()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- queries -----------------------------------------------------------------------

    @property
    def global_step(self) -> int:
        """The number of swarm steps applied."""
        return self._step

    @property
    def local_samples(self) -> int:
        """Samples accumulated toward the next step."""
        return self._samples

    @property
    def last_step(self) -> StepRecord | None:
        """The samples of the latest swarm step this peer applied (``None`` before one)."""
        return None if self._collab is None else self._collab.last_step

    @property
    def stats(self) -> TrainerStats:
        """What the trainer did so far."""
        return TrainerStats() if self._collab is None else self._collab.stats

    def swarm_progress(self) -> SwarmProgress:
        """The swarm's progress as last read."""
        return self._collaboration.view()

    @property
    def _collaboration(self) -> Collaboration:
        if self._collab is None or not self._collab.started:
            raise RuntimeError("the trainer is not running")
        return self._collab

    # -- state ---------------------------------------------------------------------------

    def snapshot(self) -> TrainingSnapshot:
        """A consistent copy of the trainer's state (thread-safe)."""
        with self._lock:
            return TrainingSnapshot(self._step, clone_state(self._capture()))

    def load_snapshot(self, snapshot: TrainingSnapshot) -> None:
        """Install ``snapshot``; what was accumulated toward the next step is dropped.

        Raises:
            StateSyncError: The snapshot does not fit this trainer.
        """
        state = snapshot.state
        if not isinstance(state, dict) or state.get("kind") != self.kind:
            raise StateSyncError(f"not a {self.kind} training state")
        with self._lock:
            self._install(snapshot)
            self._step = snapshot.step
        self._samples = 0
        if self._collab is not None and self._collab.started:
            self._collab.report(step=self._step, samples=0, blocked=False)

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Write the trainer's state to ``path`` atomically.

        Raises:
            CheckpointError: It cannot be written.
        """
        save_checkpoint(path, self.snapshot())

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Resume from a checkpoint written by :meth:`save_checkpoint`.

        Raises:
            CheckpointError: It cannot be read or does not fit this trainer.
        """
        snapshot = load_checkpoint(path)
        try:
            self.load_snapshot(snapshot)
        except StateSyncError as exc:
            raise CheckpointError(f"{path}: {exc}") from exc

    def sync_state(self) -> bool:
        """Download the state of the most advanced peer ahead of this one.

        Returns:
            Whether a state was installed (failures are logged).
        """
        try:
            self._collaboration.sync(local_step=self._step, apply=self.load_snapshot)
        except StateSyncError as exc:
            logger.warning("could not download the swarm's state: %s", exc)
            return False
        return True

    # -- the step loop -------------------------------------------------------------------

    def _advance(self, num_elements: int) -> bool:
        """Publish progress and act on the decision; whether the parameters changed."""
        collab = self._collaboration
        blocked = self._blocked
        collab.report(step=self._step, samples=self._samples, blocked=blocked)
        action = collab.advance(
            step=self._step, samples=self._samples, blocked=blocked, num_elements=num_elements
        )
        if action is Action.STEP:
            return self._global_step()
        if action is Action.SYNC:
            return self.sync_state()
        return False

    def _average(self, vector: torch.Tensor, weight: float) -> torch.Tensor | None:
        """Average ``vector`` for the current step.

        Returns:
            The average, or ``None`` when this peer missed the swarm's group
            and downloaded the swarm's state instead (then nothing is applied).
        """
        averaged, outcome = self._collaboration.average(self._step, vector, weight)
        return self._settle(averaged, outcome)

    def _settle(self, averaged: torch.Tensor, outcome: RoundOutcome) -> torch.Tensor | None:
        """What :meth:`_average` returns, given the all-reduce's result for the current step."""
        collab = self._collaboration
        step = self._step
        self._outcome = outcome
        if outcome.fallback is not None and collab.moved_past(step):
            logger.warning("step %d happened without this peer; downloading the state", step)
            if self.sync_state():
                return None
        return averaged

    def _stepped(self, *, carried: int = 0, step_samples: int | None = None, own: int = 0) -> None:
        """The step was applied; ``carried`` samples already count toward the next one."""
        self._samples = carried
        self._collaboration.stepped(self._step, samples=carried, step_samples=step_samples, own=own)
