"""What both trainers share: parameters, the state lock, lifecycle, snapshots, checkpoints.

A trainer wraps a torch optimizer whose parameters it trains with the swarm.
The training thread changes the parameters and optimizer state only while
holding the trainer's lock, and a snapshot is taken under the same lock, so
a peer downloading this trainer's state never sees half a step. The lock is
never held while waiting for the network.

Subclasses say what their state is (:meth:`SwarmTrainer._capture`), how to
install a received one (:meth:`SwarmTrainer._install`), and how a step is
applied (:meth:`SwarmTrainer._global_step`). The base adds what every state
carries: the model's buffers (e.g. BatchNorm statistics, when the trainer is
given the ``model``) and the state of registered objects such as learning-rate
schedulers and a ``GradScaler`` (:meth:`SwarmTrainer.register_state`).

A trainer is a ``torch.optim.Optimizer``: ``param_groups``, ``state`` and
``defaults`` are the inner optimizer's, so learning-rate schedulers and
``torch.amp.GradScaler`` drive it; ``step()`` takes the local batch size as
an argument or from ``batch_size=`` given at construction, and a closure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, ClassVar, Protocol, Self

import torch

from p2ptrain.errors import (
    CheckpointError,
    ConcurrentStepError,
    ConfigError,
    StateSyncError,
    TrainingStoppedError,
)
from p2ptrain.metrics import Metrics
from p2ptrain.peer import Peer
from p2ptrain.secure.identity import PeerID
from p2ptrain.train.averaging import RoundOutcome, counted_members
from p2ptrain.train.collaboration import (
    Collaboration,
    PendingAverage,
    StepRecord,
    SwarmSettings,
    TrainerStats,
)
from p2ptrain.train.fingerprint import model_digest
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


def _check_batch_size(batch_size: object) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0:
        raise ConfigError(f"batch_size must be an int >= 0, got {batch_size!r}")


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


class Stateful(Protocol):
    """An object whose state a trainer carries (a scheduler, a gradient scaler)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: object, what: str) -> None:
    """``optimizer.load_state_dict(state)``, with failures as StateSyncError."""
    if not isinstance(state, dict):
        raise StateSyncError(f"the {what} state is not a dict")
    try:
        optimizer.load_state_dict(state)
    except (ValueError, KeyError, TypeError, RuntimeError, IndexError) as exc:
        raise StateSyncError(f"cannot load the {what} state: {exc}") from exc


class SwarmTrainer(torch.optim.Optimizer, ABC):
    """Base of the trainers (see the module docstring).

    Args:
        optimizer: The torch optimizer over the parameters to train.
        peer: The started peer to train through.
        metrics: Optional registry for the trainer's figures.
        model: The model, if its buffers (e.g. BatchNorm statistics) belong
            in the state that late joiners download and checkpoints keep.
        batch_size: The local batch size ``step()`` uses when not given one
            (e.g. when a ``GradScaler`` calls it).
    """

    kind: ClassVar[str]
    """Names the state layout; a peer refuses another kind's state."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        peer: Peer,
        metrics: Metrics | None = None,
        model: torch.nn.Module | None = None,
        batch_size: int | None = None,
    ) -> None:
        # Not Optimizer.__init__: the inner optimizer owns param_groups and state.
        self._optimizer_step_pre_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict[int, Any] = OrderedDict()
        if batch_size is not None:
            _check_batch_size(batch_size)
        self.batch_size = batch_size
        self.optimizer = optimizer
        self._buffers: list[torch.Tensor] = [] if model is None else list(model.buffers())
        self._stateful: dict[str, Stateful] = {}
        self.peer = peer
        self.metrics = metrics
        self.before_average: Callable[[], Awaitable[object]] | None = None
        """Awaited on the peer's loop before each step this trainer averages with other
        peers (a pipeline stage server writes its receipts ahead there); set it
        before :meth:`start`."""
        self._params = optimizer_parameters(optimizer)
        self._lock = threading.Lock()
        self._step = 0
        self._samples = 0
        self._collab: Collaboration | None = None
        self._outcome: RoundOutcome | None = None
        self._stepping = threading.Lock()

    @abstractmethod
    def step(  # type: ignore[override]
        self, batch_size: int | None = None, closure: Callable[[], Any] | None = None
    ) -> bool:
        """Account a local batch of ``batch_size`` samples after its ``backward()``.

        Args:
            batch_size: Samples of the batch (default: the ``batch_size``
                given at construction).
            closure: Called first (with gradients enabled) to compute the
                loss and its gradients, as ``torch.optim`` closures do.

        Returns:
            Whether the parameters changed by a swarm step or a downloaded state.
        """

    @contextlib.contextmanager
    def _one_step_at_a_time(self) -> Iterator[None]:
        """Refuse a ``step()`` that enters while another one runs (from another thread)."""
        if not self._stepping.acquire(blocking=False):
            raise ConcurrentStepError(
                "step() was called while another step() of this optimizer was running;"
                " call it from one thread at a time"
            )
        try:
            yield
        finally:
            self._stepping.release()

    def _batch(self, batch_size: int | None, closure: Callable[[], Any] | None) -> int:
        """The batch size of a ``step()`` call, after running its closure."""
        if closure is not None:
            with torch.enable_grad():
                closure()
        if batch_size is None:
            if self.batch_size is None:
                raise ConfigError("step() needs a batch_size (or batch_size= at construction)")
            return self.batch_size
        _check_batch_size(batch_size)
        return batch_size

    # -- the torch.optim.Optimizer surface ------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's parameter groups (schedulers change their ``lr``)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self) -> Any:
        """The inner optimizer's per-parameter state."""
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        """The inner optimizer's defaults."""
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' gradients (not what was accumulated toward a step)."""
        for p in self._params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.detach_()
                p.grad.zero_()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused: a swarm trains a fixed set of parameters."""
        raise ConfigError("a swarm trainer's parameters are fixed; add them to the inner optimizer")

    def state_dict(self) -> dict[str, Any]:
        """The whole training state (as :meth:`snapshot`), for ``torch.save``."""
        snapshot = self.snapshot()
        return {"global_step": snapshot.step, "state": snapshot.state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Install a state returned by :meth:`state_dict`.

        Raises:
            StateSyncError: It does not fit this trainer.
        """
        step = state_dict.get("global_step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise StateSyncError("a trainer state_dict carries its global_step")
        self.load_snapshot(TrainingSnapshot(step, state_dict.get("state")))

    def register_state(self, name: str, obj: Stateful) -> None:
        """Carry ``obj``'s state (a scheduler, a ``GradScaler``) in snapshots and checkpoints.

        Register the same names in the same order on every peer.
        """
        if not isinstance(name, str) or not name:
            raise ConfigError("a registered state needs a name")
        if not callable(getattr(obj, "state_dict", None)) or not callable(
            getattr(obj, "load_state_dict", None)
        ):
            raise ConfigError(f"{name!r} has no state_dict() and load_state_dict()")
        self._stateful[name] = obj

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
        settings = dataclasses.replace(self._settings(), model=model_digest(self._params))
        collab = Collaboration(
            peer=self.peer,
            settings=settings,
            snapshot=self.snapshot,
            metrics=self.metrics,
            before_average=self.before_average,
        )
        view = collab.start(self._step)
        self._collab = collab
        if view.global_step > self._step:
            self.sync_state()

    def stop_at(self, deadline: float | None, *, event: threading.Event | None = None) -> None:
        """Stop waiting for the swarm at ``deadline`` (``time.monotonic()``; ``None``:
        never) or once ``event`` is set (e.g. by a signal handler).

        Past it, ``step()`` returns at once: a step that is due, or that
        waits for its group, is not applied (an average already running gets
        half a second more). Set it to the moment a training loop ends (the
        command line's ``--seconds``) so that the loop ends on time. Any
        thread may call it.
        """
        self._collaboration.stop_at(deadline, event=event)

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
    def state_lock(self) -> threading.Lock:
        """Held while the parameters change (a step, a downloaded state); code that
        reads the parameters from another thread holds it to see them whole."""
        return self._lock

    @property
    def local_samples(self) -> int:
        """Samples accumulated toward the next step."""
        return self._samples

    @property
    def last_step(self) -> StepRecord | None:
        """The samples of the latest swarm step this peer applied (``None`` before one)."""
        return None if self._collab is None else self._collab.last_step

    def wait_for_peers(self, count: int, timeout: float) -> bool:
        """Wait until ``count`` peers of the run (this one included) are online.

        Peers started together do not see each other's progress records at
        once; one whose view lacks a peer expects a smaller group for the
        first step, and a group may then form without that peer. Peers that
        must all take part from the first step (a fixed swarm, a test) call
        this after :meth:`start`.

        Returns:
            Whether they were within ``timeout`` seconds.
        """
        return self._collaboration.wait_for_peers(count, timeout)

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
            state = self._capture()
            state["buffers"] = [b.detach() for b in self._buffers]
            state["extra"] = {name: obj.state_dict() for name, obj in self._stateful.items()}
            return TrainingSnapshot(self._step, clone_state(state))

    def load_snapshot(self, snapshot: TrainingSnapshot) -> None:
        """Install ``snapshot``; what was accumulated toward the next step is dropped.

        Raises:
            StateSyncError: The snapshot does not fit this trainer.
        """
        state = snapshot.state
        if not isinstance(state, dict) or state.get("kind") != self.kind:
            raise StateSyncError(f"not a {self.kind} training state")
        buffers = self._check_buffers(state.get("buffers", []))
        extra = state.get("extra", {})
        if not isinstance(extra, dict) or set(extra) != set(self._stateful):
            raise StateSyncError(
                f"the state carries other registered states than {list(self._stateful)}"
            )
        with self._lock:
            self._install(snapshot)
            with torch.no_grad():
                for mine, value in zip(self._buffers, buffers, strict=True):
                    mine.copy_(value)
            for name, obj in self._stateful.items():
                try:
                    obj.load_state_dict(extra[name])
                except (ValueError, KeyError, TypeError, RuntimeError, AttributeError) as exc:
                    raise StateSyncError(f"cannot load the state of {name!r}: {exc}") from exc
            self._step = snapshot.step
        self._samples = 0
        if self._collab is not None and self._collab.started:
            self._collab.report(step=self._step, samples=0, blocked=False)

    def _check_buffers(self, received: object) -> list[torch.Tensor]:
        if not isinstance(received, list) or len(received) != len(self._buffers):
            raise StateSyncError(f"expected {len(self._buffers)} model buffers")
        for index, (theirs, ours) in enumerate(zip(received, self._buffers, strict=True)):
            if not isinstance(theirs, torch.Tensor) or theirs.shape != ours.shape:
                raise StateSyncError(f"buffer {index} has another shape than {tuple(ours.shape)}")
        return received

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
            try:
                return self._global_step()
            except TrainingStoppedError as exc:
                logger.info("%s", exc)
                return False
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

    def _end_average(self, average: PendingAverage) -> tuple[torch.Tensor, RoundOutcome] | None:
        """Wait for an average begun in the background; ``None`` if the stop time cut it off."""
        try:
            return self._collaboration.end_average(average)
        except TrainingStoppedError as exc:
            logger.info("%s", exc)
            return None

    def _settle(self, averaged: torch.Tensor, outcome: RoundOutcome) -> torch.Tensor | None:
        """What :meth:`_average` returns, given the all-reduce's result for the current step."""
        collab = self._collaboration
        step = self._step
        self._outcome = outcome
        if outcome.fallback is not None and collab.moved_past(step, wait=True):
            logger.info(  # normal for a late joiner or a slow peer: not a warning
                "step %d finished without this peer; downloading the swarm's state", step
            )
            if self.sync_state():
                return None
        return averaged

    def _stepped(
        self,
        *,
        carried: int = 0,
        step_samples: int | None = None,
        own: int = 0,
        length: int | None = None,
    ) -> None:
        """The step was applied; ``carried`` samples already count toward the next one.
        ``length``: the averaged vector's, when its last element is the count marker
        (then the step's record says whose samples it counted)."""
        self._samples = carried
        outcome = self._outcome
        group: tuple[PeerID, ...] = ()
        counted = None
        if outcome is not None and outcome.fallback is None and outcome.report is not None:
            group = outcome.report.members
            if length is not None:
                counted = counted_members(outcome, length=length)
        self._collaboration.stepped(
            self._step,
            samples=carried,
            step_samples=step_samples,
            own=own,
            group=group,
            counted=counted,
        )
