"""StageServer: one peer serving one stage of a pipeline.

Theory of operation. A server holds the modules of its stage and answers
``swarm.forward`` / ``swarm.backward`` / ``swarm.release``
(:mod:`p2ptrain.swarm.protocol`) on its peer's node:

* **forward** runs the stage on the received activations in the compute
  thread and keeps the input and the autograd graph ("held") until the
  micro-batch's backward arrives or ``hold_timeout`` passes. Each trainer may
  hold at most ``max_held_per_peer`` micro-batches here; one more is refused
  with ``resource_exhausted`` (a :class:`~p2ptrain.errors.ResourceExhaustedError`
  at the trainer), which retries elsewhere or later.
* **backward** computes the gradients of the stage's parameters (and of its
  input, sent back) with ``torch.autograd.grad``; if the stage stepped since
  the forward, the forward is recomputed from the held input first. It then
  *commits*: adds ``n × gradient`` to the server's accumulator and ``n`` to its
  sample count, once, and only while ``commit_margin`` seconds of the call's
  deadline remain (a trainer that gave up retries elsewhere; a late commit
  would count the micro-batch twice).
* every ``step_interval`` the accumulator is handed to the stage's
  :class:`~p2ptrain.train.CollaborativeOptimizer` (run ``<run_id>-stage<i>``)
  as one batch of ``n`` samples: that optimizer publishes the stage's
  progress, and when the peers of the stage together reached
  ``target_batch_size`` it averages their gradients, sample-weighted, with the
  butterfly all-reduce and steps the stage's optimizer. It also serves the
  stage's state and downloads it when this peer is behind (a joiner).
* every ``announce_interval`` the server announces stage, measured
  throughput (samples/s of its own compute) and queue (held micro-batches)
  in the DHT (:mod:`p2ptrain.swarm.directory`).

Bad requests (malformed or oversized tensors, a stage this peer does not
serve, an unknown micro-batch) get a typed error; the server keeps serving.
Compute runs on the server's :class:`~p2ptrain.swarm.device.Device` (by
default one worker thread, so the event loop stays free); the optimizer's
state lock keeps a step from changing the parameters under a forward or
backward. The stage's optimizer is made by ``stage_optimizer`` (by default
a :class:`~p2ptrain.train.CollaborativeOptimizer` on the peer); a
simulation passes a device and an optimizer on its virtual clock and runs
this same class (:mod:`p2ptrain.lab.swarm_sim`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeGuard

import torch
from torch import nn

from p2ptrain.errors import (
    ConfigError,
    DeadlineExceededError,
    InvalidArgumentError,
    P2PTrainError,
    ResourceExhaustedError,
    UnavailableError,
)
from p2ptrain.measure.meters import MovingAverage
from p2ptrain.peer import Peer
from p2ptrain.rpc.handlers import CallContext, Message
from p2ptrain.secure.identity import PeerID
from p2ptrain.swarm.compute import compute_pool
from p2ptrain.swarm.config import StageServerConfig
from p2ptrain.swarm.device import Device, ThreadDevice
from p2ptrain.swarm.directory import announce, withdraw
from p2ptrain.swarm.ledger import CommitLedger, Receipts, Vouch
from p2ptrain.swarm.protocol import (
    BACKWARD_METHOD,
    FORWARD_METHOD,
    RECEIPTS_METHOD,
    RELEASE_METHOD,
    StageRequest,
    encode_for_wire,
    parse_request,
)
from p2ptrain.swarm.stages import PipelineModel, check_budget, stage_memory_bytes
from p2ptrain.train.collaboration import StepRecord, TrainerStats
from p2ptrain.train.config import TrainerConfig
from p2ptrain.train.optimizer import CollaborativeOptimizer

__all__ = [
    "OptimizerFactory",
    "StageOptimizer",
    "StageOptimizerFactory",
    "StageServer",
    "StageServerStats",
]

logger = logging.getLogger(__name__)

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
_RATE_SMOOTHING = 0.2
_VOUCHES_KEPT = 64  # stage steps whose counted members a server keeps


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


class StageOptimizer(Protocol):
    """What a server needs of its stage's optimizer (a
    :class:`~p2ptrain.train.CollaborativeOptimizer` satisfies it)."""

    @property
    def state_lock(self) -> AbstractContextManager[Any]:
        """Held while the parameters change."""
        ...

    @property
    def global_step(self) -> int:
        """Stage steps applied."""
        ...

    @property
    def local_samples(self) -> int:
        """Samples handed over and not yet in a step."""
        ...

    @property
    def last_step(self) -> StepRecord | None:
        """The latest step applied."""
        ...

    @property
    def stats(self) -> TrainerStats:
        """Its counts (``syncs``: states downloaded)."""
        ...

    def start(self) -> None:
        """Join the stage's run (downloading its state if behind)."""
        ...

    def step(self, batch_size: int | None = None) -> bool:
        """Add the gradients of ``batch_size`` samples; step when the stage's batch is full."""
        ...

    def close(self) -> None:
        """Leave the stage's run."""
        ...


StageOptimizerFactory = Callable[[torch.optim.Optimizer, nn.Module, TrainerConfig], StageOptimizer]
"""``(optimizer, stage module, the stage's run config) -> StageOptimizer``."""


@dataclass
class StageServerStats:
    """What a server did (read from any thread; figures only grow)."""

    forwards: int = 0
    backwards: int = 0
    samples_committed: int = 0
    samples_in_steps: int = 0
    """This peer's samples in the stage steps it applied (each step's ``own``)."""
    refused_full: int = 0
    refused_late: int = 0
    bad_requests: int = 0
    expired: int = 0
    moves: int = 0
    samples_dropped_on_move: int = 0
    steps_by_stage: dict[int, int] = field(default_factory=dict)


_Grads = tuple[torch.Tensor | None, tuple[torch.Tensor | None, ...]]
"""A backward's gradient of the stage input (``None``: not floating) and of its parameters."""


def _same(value: Any) -> Any:
    return value


@dataclass
class _Held:
    state: _Stage
    x: torch.Tensor
    y: torch.Tensor
    step: int
    expires: float


class _Stage:
    """The modules, optimizer and accumulator of the stage a server serves now."""

    def __init__(
        self,
        *,
        model: PipelineModel,
        stage: int,
        make_optimizer: OptimizerFactory,
        stage_optimizer: StageOptimizerFactory,
        config: StageServerConfig,
    ) -> None:
        self.index = stage
        self.module = model.build_stage(stage)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        optimizer = make_optimizer(self.module.parameters())
        self.memory_bytes = stage_memory_bytes(self.module, optimizer)
        check_budget(stage, self.memory_bytes, config.memory_budget_bytes)
        self.sums = [torch.zeros_like(p) for p in self.params]
        self.spare: list[torch.Tensor] | None = None
        """The other buffer: the last hand-over's gradients (the optimizer read them)."""
        self.pending = 0
        self.sums_stale = False
        """Whether ``sums`` hold no commit yet (a handed-over or a fresh buffer): the
        next commit overwrites, not adds."""
        self.handed_at = -math.inf
        self.ledger = CommitLedger()
        self.withdrawn = False
        """The directory holds this stage's "left" record: announce it no more."""
        self.written_ahead = (0, 0)
        """(handed, step) of the receipts the directory last took."""
        self.vouches: dict[int, Vouch] = {}
        """Who the latest stage steps counted, by step (:mod:`p2ptrain.swarm.ledger`)."""
        self.copt = stage_optimizer(
            optimizer,
            self.module,
            TrainerConfig(
                run_id=f"{config.run_id}-stage{stage}",
                target_batch_size=config.target_batch_size,
                max_local_samples_per_step=config.max_local_samples_per_step,
                sync_tolerance=config.sync_tolerance,
                progress=config.progress,
                state=config.state,
            ),
        )


class StageServer:
    """Serves one stage of a pipeline run on a started :class:`~p2ptrain.peer.Peer`.

    Use as a context manager or call :meth:`start` and :meth:`close` (from
    ordinary threads, not the peer's loop); on the loop, :meth:`astart` and
    :meth:`aclose`. :meth:`move_to` runs on the loop.

    Args:
        peer: The started peer whose node serves the stage (a simulation
            passes an object with its ``node``, ``dht`` and ``address``).
        model: The model's blocks and stages.
        stage: The stage to serve first.
        make_optimizer: Builds the stage's optimizer from its parameters.
        config: The run and the server's limits.
        device: Where forwards and backwards run (default: a
            :class:`~p2ptrain.swarm.device.ThreadDevice` with
            ``config.min_compute_s``).
        stage_optimizer: Wraps the stage's optimizer for stage steps (default:
            a :class:`~p2ptrain.train.CollaborativeOptimizer` on ``peer``).

    Raises:
        MemoryBudgetError: (from :meth:`start`) the stage does not fit the budget.
    """

    def __init__(
        self,
        *,
        peer: Peer,
        model: PipelineModel,
        stage: int,
        make_optimizer: OptimizerFactory,
        config: StageServerConfig,
        device: Device | None = None,
        stage_optimizer: StageOptimizerFactory | None = None,
    ) -> None:
        if not isinstance(config, StageServerConfig):
            raise ConfigError("config must be a StageServerConfig")
        self.peer = peer
        self.model = model
        self.config = config
        self._first_stage = model.check_stage(stage)
        self._make_optimizer = make_optimizer
        self._stage_optimizer = stage_optimizer or self._collaborative
        self._state: _Stage | None = None
        self._moving = False
        self._held: dict[tuple[PeerID, bytes], _Held] = {}
        self._held_per_peer: Counter[PeerID] = Counter()
        self._device: Device = device or ThreadDevice(config.min_compute_s)
        self._stepper = compute_pool("stage-step")
        self._handing = threading.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._address = ""
        self._announcing = asyncio.Lock()
        self._past_receipts: dict[str, Receipts] = {}  # of stages this server left
        self._rate = MovingAverage()  # samples/s of forward plus backward
        self._forward_s = MovingAverage()
        self.stats = StageServerStats()
        self._closed = False
        self.on_event: Callable[[str, int], None] | None = None
        """Called on the peer's loop with (``forward_started`` | ``forward_done`` |
        ``backward_done`` | ``stepped`` | ``announced``, stage): for tests, demos and
        monitors. ``announced`` follows a ``stepped`` once the directory holds the
        receipts of that step."""

    # -- lifecycle ---------------------------------------------------------------------

    def _collaborative(
        self, optimizer: torch.optim.Optimizer, module: nn.Module, config: TrainerConfig
    ) -> StageOptimizer:
        copt = CollaborativeOptimizer(optimizer, peer=self.peer, config=config, model=module)
        copt.before_average = self._write_ahead
        return copt

    def start(self) -> None:
        """Build the stage (checking the memory budget), join its run, serve and announce.

        Raises:
            MemoryBudgetError: The stage does not fit ``config.memory_budget_bytes``.
        """
        state = self._open(self._first_stage)
        self._state = state
        self.peer.run(self._serve(), timeout=30)
        self._log_serving(state)

    async def astart(self) -> None:
        """:meth:`start` on the peer's loop (the stage is built in the stepper thread)."""
        loop = asyncio.get_running_loop()
        state = await loop.run_in_executor(self._stepper, self._open, self._first_stage)
        self._state = state
        await self._serve()
        self._log_serving(state)

    def _log_serving(self, state: _Stage) -> None:
        logger.info(
            "serving stage %d of %s (%.2f MB of parameters and optimizer state)",
            state.index,
            self.config.run_id,
            state.memory_bytes / 1e6,
        )

    def _open(self, stage: int) -> _Stage:
        state = _Stage(
            model=self.model,
            stage=stage,
            make_optimizer=self._make_optimizer,
            stage_optimizer=self._stage_optimizer,
            config=self.config,
        )
        state.copt.start()  # downloads the stage's state from a peer of it if behind
        return state

    async def _serve(self) -> None:
        self._address = self.peer.address
        handlers = self.peer.node.handlers
        handlers.add_unary(FORWARD_METHOD, self._forward)
        handlers.add_unary(BACKWARD_METHOD, self._backward)
        handlers.add_unary(RELEASE_METHOD, self._release)
        handlers.add_unary(RECEIPTS_METHOD, self._receipts)
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._step_loop(), name="stage-step"),
            loop.create_task(self._announce_loop(), name="stage-announce"),
            loop.create_task(self._expire_loop(), name="stage-expire"),
        ]

    def close(self) -> None:
        """Stop serving and leave the stage's run (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.peer.running:
            with contextlib.suppress(TimeoutError, RuntimeError):
                self.peer.run(self._stop_serving(), timeout=10)
        # In the stepper thread, as aclose: cancelling the step loop does not stop a
        # hand-over it left running there, and a second one beside it averaged the
        # same step twice and counted its samples twice.
        self._stepper.submit(self._last_hand_over).result()
        if self.peer.running:
            with contextlib.suppress(TimeoutError, RuntimeError):
                self.peer.run(self._withdraw_current(), timeout=10)
        self._stepper.submit(self._shut_down).result()
        self._stepper.shutdown(wait=True)

    async def aclose(self) -> None:
        """:meth:`close` on the peer's loop (idempotent)."""
        if self._closed:
            return
        self._closed = True
        await self._stop_serving()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._stepper, self._last_hand_over)
        await self._withdraw_current()
        await loop.run_in_executor(self._stepper, self._shut_down)
        self._stepper.shutdown(wait=False)

    async def abort(self) -> None:
        """Stop at once, as a crash would: no hand-over and no withdrawal (on the loop).

        What the server committed and had not yet stepped is lost; the
        trainers replay it once its receipts stop answering. For simulations
        of churn; a real process that dies needs no call.
        """
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._drop_held()
        self._device.shutdown()
        self._stepper.shutdown(wait=False)

    def _last_hand_over(self) -> None:
        """Hand over what was committed since the last hand-over (stepper thread).

        Before the withdrawal: the withdrawal announces every commit not yet
        in a step as lost, and trainers replay lost commits, so a hand-over
        after it could count in a step what a trainer also replays."""
        state = self._state
        if state is None:
            return
        pending = state.pending
        try:
            self._hand_over(state)
        except P2PTrainError as exc:  # e.g. the peer's node is gone: nobody to average with
            logger.warning(
                "stage %d: the last %d samples could not be handed over at close: %s",
                state.index,
                pending,
                exc,
            )

    async def _withdraw_current(self) -> None:
        if self._state is not None:
            await self._withdraw(self._state)

    def _shut_down(self) -> None:
        if self._state is not None:
            self._state.copt.close()
        self._device.shutdown()

    async def _stop_serving(self) -> None:
        """Stop the loops and take no more calls (nothing is committed after this)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        handlers = self.peer.node.handlers
        for method in (FORWARD_METHOD, BACKWARD_METHOD, RELEASE_METHOD, RECEIPTS_METHOD):
            handlers.remove(method)
        self._drop_held()

    async def _withdraw(self, state: _Stage) -> None:
        """Leave ``state``'s stage: what is not in a step yet is lost (the trainers replay it)."""
        with state.copt.state_lock:
            state.ledger.lose_unresolved()
            receipts = state.ledger.announced()
        self._past_receipts[receipts.incarnation] = receipts
        async with self._announcing:
            state.withdrawn = True
            with contextlib.suppress(P2PTrainError):
                await withdraw(
                    self.peer.dht,
                    self.config.run_id,
                    state.index,
                    ttl=self.config.announce_ttl,
                    address=self._address,
                    receipts=receipts,
                )

    def __enter__(self) -> StageServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- what others read --------------------------------------------------------------

    @property
    def stage(self) -> int:
        """The stage served now."""
        return self._current().index

    @property
    def global_step(self) -> int:
        """Steps the current stage's optimizer applied."""
        return self._current().copt.global_step

    @property
    def samples_per_s(self) -> float:
        """Measured compute throughput (forward plus backward), samples per second."""
        return self._rate.value or 0.0

    @property
    def queue_length(self) -> int:
        """Micro-batches held (forward done, backward pending)."""
        return len(self._held)

    @property
    def memory_bytes(self) -> int:
        """Bytes of the current stage's parameters, accumulators and optimizer state."""
        return self._current().memory_bytes

    @property
    def optimizer(self) -> StageOptimizer:
        """The current stage's optimizer (by default collaborative)."""
        return self._current().copt

    @property
    def module(self) -> nn.Module:
        """The current stage's modules."""
        return self._current().module

    def _current(self) -> _Stage:
        if self._state is None:
            raise RuntimeError("the stage server is not started")
        return self._state

    # -- moving ------------------------------------------------------------------------

    async def move_to(self, stage: int, *, drain_timeout: float = 30.0) -> None:
        """Leave the current stage for ``stage`` (call on the peer's loop).

        The new stage is built and checked against the budget first (a stage
        that does not fit raises :class:`~p2ptrain.errors.MemoryBudgetError`
        and the server stays where it is). Then the server stops taking
        micro-batches, drops those it holds (their trainers redo them on
        another peer), hands its committed gradients to the old stage's
        optimizer and waits up to ``drain_timeout`` seconds for that stage's
        next step (so committed samples count; past it they are dropped,
        counted in ``stats.samples_dropped_on_move`` and announced lost, and
        the trainers replay them), withdraws its announcement, leaves the old stage's run,
        joins the new one (downloading its state from a peer of it when the
        stage has stepped) and announces it.
        """
        stage = self.model.check_stage(stage)
        old = self._current()
        if stage == old.index or self._moving:
            return
        loop = asyncio.get_running_loop()
        self._moving = True
        try:
            self._drop_held()
            await self._device.idle()  # in-flight compute is done
            await loop.run_in_executor(self._stepper, self._drain, old, drain_timeout)
            await self._withdraw(old)
            new = await loop.run_in_executor(self._stepper, self._open, stage)
            self._state = new
            self.stats.moves += 1
            await self._announce()
            logger.info("moved from stage %d to stage %d", old.index, new.index)
        finally:
            self._moving = False

    def _drain(self, state: _Stage, timeout: float) -> None:
        """Hand the committed gradients over and wait for the stage's next step, then leave."""
        start_step = state.copt.global_step
        owed = state.pending + state.copt.local_samples
        deadline = time.monotonic() + timeout
        self._hand_over(state)
        while owed and state.copt.global_step == start_step and time.monotonic() < deadline:
            self._hand_over(state)  # steps (with nothing new) and accounts for the step
            if state.copt.global_step == start_step:
                time.sleep(self.config.step_interval)  # polls the stage's progress
        if owed and state.copt.global_step == start_step:
            self.stats.samples_dropped_on_move += state.copt.local_samples
            logger.warning(
                "left stage %d before its step: %d samples dropped",
                state.index,
                state.copt.local_samples,
            )
        state.copt.close()

    # -- background loops --------------------------------------------------------------

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.config.step_interval)
            state = self._state
            if state is None or self._moving:
                continue
            before = state.copt.global_step
            try:
                await loop.run_in_executor(
                    self._stepper, functools.partial(self._hand_over, state, everything=False)
                )
            except Exception:
                logger.exception("stage %d: handing gradients to the optimizer failed", state.index)
            if state.copt.global_step != before:
                self._emit("stepped", state.index)
                # Receipts out at once: a trainer that finds this peer dead
                # replays what its last receipts did not count.
                if await self._announce():
                    self._emit("announced", state.index)

    def _hand_over(self, state: _Stage, *, everything: bool = True) -> None:
        """Give the accumulated gradients to the stage's optimizer as one batch (stepper
        thread); unless ``everything``, only once ``handover_samples`` gathered or
        ``handover_max_s`` passed (each hand-over is two passes over the stage's
        gradients). The optimizer is told in any case, so that it steps when the
        stage's other peers fill its batch."""
        with self._handing:  # one at a time, whatever the thread (the optimizer is not re-entrant)
            self._hand_over_locked(state, everything=everything)

    def _hand_over_locked(self, state: _Stage, *, everything: bool) -> None:
        handed: list[torch.Tensor] | None = None
        with state.copt.state_lock:
            samples = state.pending
            limit = self.config.handover_samples or max(1, self.config.target_batch_size // 4)
            now = time.monotonic()
            due = now - state.handed_at >= self.config.handover_max_s
            if samples and (everything or samples >= limit or due):
                # Swap buffers: commits go on into the other one (overwritten, not
                # added to), while the optimizer reads this one outside the lock.
                handed = state.sums
                state.sums = state.spare or [torch.empty_like(t) for t in handed]
                state.spare = handed
                state.sums_stale = True
                state.pending = 0
                state.handed_at = now
                state.ledger.handed(samples)
            else:
                samples = 0
        if handed is not None:
            with torch.no_grad():
                torch._foreach_div_(handed, samples)
        for i, p in enumerate(state.params):
            p.grad = None if handed is None else handed[i]
        before, syncs = state.copt.last_step, state.copt.stats.syncs
        state.copt.step(batch_size=samples)
        record = state.copt.last_step
        if record is not None and record is not before:  # a step applied (not a download)
            steps = self.stats.steps_by_stage
            steps[state.index] = steps.get(state.index, 0) + 1
            self.stats.samples_in_steps += record.own
            with state.copt.state_lock:
                state.ledger.stepped(record.own)
            state.vouches[record.step] = Vouch(frozenset(record.group), record.counted)
            while len(state.vouches) > _VOUCHES_KEPT:
                del state.vouches[min(state.vouches)]
        elif state.copt.stats.syncs != syncs and not state.copt.local_samples:
            # The swarm's state replaced what we held, and the optimizer dropped it. (When
            # it keeps them toward the next step, a step the swarm took without this peer,
            # the chunks stay: that step counts them, and a replay would count them twice.)
            state.ledger.lose_handed()

    async def _write_ahead(self) -> None:
        """Before the stage's optimizer averages with other peers (on the loop): make
        sure the directory holds what was handed to it and toward which step. A
        server that dies after the step and before announcing its receipts leaves
        these, and the stage's other peers say whether the step counted it
        (:mod:`p2ptrain.swarm.ledger`)."""
        state = self._state
        if state is None:
            return
        with state.copt.state_lock:
            ahead = state.ledger.announced(state.copt.global_step)
        if ahead.handed == ahead.contributed or state.written_ahead == (ahead.handed, ahead.step):
            return
        if not await self._announce():
            logger.warning(
                "stage %d: the directory did not take the receipts written ahead of step %d;"
                " if this peer dies right after it, trainers replay what it counted",
                state.index,
                ahead.step,
            )

    async def _announce_loop(self) -> None:
        while True:
            await self._announce()
            await asyncio.sleep(self.config.announce_interval)

    async def _announce(self) -> bool:
        """Publish this server's entry with its receipts; whether the directory took it."""
        state = self._state  # while moving: still the old stage, whose receipts trainers read
        if state is None:
            return False
        # One store at a time, its receipts read when it begins: the directory keeps the
        # latest store, and one begun before a write-ahead must not land after it.
        async with self._announcing:
            if state.withdrawn:  # a move left it: its "left" record stays
                return False
            with state.copt.state_lock:
                step = state.copt.global_step
                receipts = state.ledger.announced(step)
            try:
                stored = await announce(
                    self.peer.dht,
                    self.config.run_id,
                    state.index,
                    address=self._address,
                    samples_per_s=self.samples_per_s,
                    queue=len(self._held),
                    step=step,
                    ttl=self.config.announce_ttl,
                    receipts=receipts,
                )
            except P2PTrainError as exc:
                logger.warning("could not announce stage %d: %s", state.index, exc)
                return False
        if stored:
            state.written_ahead = (receipts.handed, receipts.step)
        return stored

    async def _expire_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(1.0, self.config.hold_timeout / 4))
            now = loop.time()
            for key, held in list(self._held.items()):
                if held.expires <= now:
                    self._forget(key)
                    self.stats.expired += 1

    def _forget(self, key: tuple[PeerID, bytes]) -> _Held | None:
        held = self._held.pop(key, None)
        if held is not None:
            self._held_per_peer[key[0]] -= 1
            if self._held_per_peer[key[0]] <= 0:
                del self._held_per_peer[key[0]]
        return held

    def _drop_held(self) -> None:
        self._held.clear()
        self._held_per_peer.clear()

    # -- handlers ----------------------------------------------------------------------

    def _emit(self, event: str, stage: int) -> None:
        if self.on_event is not None:
            self.on_event(event, stage)

    def _parse(self, message: Message, tensor_key: str | None) -> tuple[StageRequest, _Stage]:
        try:
            request = parse_request(
                message.body,
                message.payload,
                tensor_key=tensor_key,
                max_bytes=self.config.max_tensor_bytes,
            )
        except P2PTrainError:
            self.stats.bad_requests += 1
            raise
        state = self._state
        if request.run != self.config.run_id:
            self.stats.bad_requests += 1
            raise InvalidArgumentError(
                f"this peer serves run {self.config.run_id!r}, not {request.run!r}"
            )
        if state is None or self._moving or self._closed:
            raise UnavailableError("this peer is moving between stages")
        if request.stage != state.index:
            raise UnavailableError(f"this peer serves stage {state.index}, not {request.stage}")
        return request, state

    async def _forward(self, ctx: CallContext, message: Message) -> Message:
        request, state = self._parse(message, "x")
        key = (ctx.peer, request.mb)
        if key in self._held:
            self._forget(key)  # a retried forward replaces the old state
        if self._held_per_peer[ctx.peer] >= self.config.max_held_per_peer:
            self.stats.refused_full += 1
            raise ResourceExhaustedError(
                f"stage {state.index} already holds {self.config.max_held_per_peer} of your"
                " micro-batches (the cap); send their backward first"
            )
        self._held_per_peer[ctx.peer] += 1  # reserved while computing
        self._emit("forward_started", state.index)
        loop = asyncio.get_running_loop()
        stored = False
        try:
            tensor = request.tensor
            assert tensor is not None
            (x, y, step), elapsed = await self._device.run(
                lambda: self._forward_job(state, tensor), _same
            )
            self._forward_s.update(elapsed, _RATE_SMOOTHING)
            if self._state is not state or self._moving:
                raise UnavailableError("this peer moved to another stage")
            expires = loop.time() + self.config.hold_timeout
            self._held[key] = _Held(state, x, y, step, expires)
            stored = True
        finally:
            if not stored:
                self._held_per_peer[ctx.peer] -= 1
                if self._held_per_peer[ctx.peer] <= 0:
                    del self._held_per_peer[ctx.peer]
        self.stats.forwards += 1
        self._emit("forward_done", state.index)
        header, view = encode_for_wire(y, self.config.wire_dtype)
        return Message({"y": header}, view)

    @staticmethod
    def _forward_job(state: _Stage, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        x = tensor.detach()
        if x.is_floating_point():
            x.requires_grad_(True)
        with state.copt.state_lock, torch.enable_grad():
            y = state.module(x)
            step = state.copt.global_step
        return x, y, step

    async def _backward(self, ctx: CallContext, message: Message) -> Message:
        request, state = self._parse(message, "g")
        held = self._forget((ctx.peer, request.mb))
        if held is None or held.state is not state:
            raise InvalidArgumentError(
                f"stage {state.index} holds no forward of this micro-batch"
                " (expired, released, or never sent): send its forward again"
            )
        loop = asyncio.get_running_loop()
        commit_by = math.inf
        if ctx.deadline is not None:
            remaining = ctx.deadline - loop.time()
            commit_by = self._device.now() + remaining - self.config.commit_margin
        grad_y, samples = request.tensor, request.samples
        assert grad_y is not None
        (grad_x, seq, receipts), elapsed = await self._device.run(
            lambda: self._backward_job(held, grad_y),
            lambda grads: self._commit(held.state, grads, samples, commit_by),
        )
        self.stats.samples_committed += samples
        self._observe_rate(samples, elapsed)
        self.stats.backwards += 1
        self._emit("backward_done", state.index)
        # The commit's number, and the receipts so far: a trainer learns of every step
        # with its next backward here, not only when it asks (swarm.receipts).
        receipt = {**receipts.to_wire(), "seq": seq}
        if grad_x is None:
            return Message({"g": None, **receipt})
        header, view = encode_for_wire(grad_x, self.config.wire_dtype)
        return Message({"g": header, **receipt}, view)

    @staticmethod
    def _backward_job(held: _Held, grad_y: torch.Tensor) -> _Grads:
        state = held.state
        with state.copt.state_lock, torch.enable_grad():
            x, y = held.x, held.y
            if held.step != state.copt.global_step:  # the stage stepped: recompute the forward
                x = x.detach()
                if x.is_floating_point():
                    x.requires_grad_(True)
                y = state.module(x)
            if grad_y.shape != y.shape:
                raise InvalidArgumentError(
                    f"the gradient has shape {tuple(grad_y.shape)}, the output {tuple(y.shape)}"
                )
            wants_x = x.requires_grad
            inputs = [x, *state.params] if wants_x else list(state.params)
            grads = torch.autograd.grad(y, inputs, grad_y.to(y.dtype), allow_unused=True)
        grad_x = grads[0].detach() if wants_x else None
        return grad_x, grads[1:] if wants_x else grads

    def _commit(
        self, state: _Stage, grads: _Grads, samples: int, commit_by: float
    ) -> tuple[torch.Tensor | None, int, Receipts]:
        """Add a backward's gradients to the stage's sums, once, if its deadline allows;
        with the commit's number and the ledger's receipts."""
        if self._device.now() > commit_by:
            self.stats.refused_late += 1
            raise DeadlineExceededError(
                "the backward finished too close to its deadline; not counted"
            )
        grad_x, param_grads = grads
        with state.copt.state_lock:
            stale, state.sums_stale = state.sums_stale, False
            for total, grad in zip(state.sums, param_grads, strict=True):
                if grad is None:
                    if stale:
                        total.zero_()
                elif stale:
                    torch.mul(grad, samples, out=total)  # = 0 + samples * grad, exactly
                else:
                    total.add_(grad, alpha=samples)
            state.pending += samples
            seq = state.ledger.commit()
            receipts = state.ledger.announced(state.copt.global_step)
        return grad_x, seq, receipts

    def _observe_rate(self, samples: int, backward_s: float) -> None:
        seconds = max(backward_s + (self._forward_s.value or 0.0), 1e-6)
        self._rate.update(samples / seconds, _RATE_SMOOTHING)

    async def _receipts(self, ctx: CallContext, message: Message) -> Message:
        body = message.body
        inc = body.get("inc") if isinstance(body, dict) else None
        if not isinstance(inc, str):
            self.stats.bad_requests += 1
            raise InvalidArgumentError("a receipts request names an incarnation")
        if "peer" in body:
            return self._vouch(body)
        state = self._state
        found = self._past_receipts.get(inc)
        if found is None and state is not None and state.ledger.incarnation == inc:
            with state.copt.state_lock:
                found = state.ledger.announced(state.copt.global_step)
        return Message({"unknown": True} if found is None else found.to_wire())

    def _vouch(self, body: dict[str, Any]) -> Message:
        """Whether this server's stage step ``step`` counted the samples of ``peer`` (a
        stage peer that vanished): ``{"counted": bool | None, "at": steps applied}``,
        ``None`` when this server cannot say (it was not in that step's group, or
        does not serve ``stage``)."""
        peer, stage, step = body.get("peer"), body.get("stage"), body.get("step")
        if not (isinstance(peer, str) and _is_int(stage) and _is_int(step)):
            self.stats.bad_requests += 1
            raise InvalidArgumentError("a vouch request names a peer, a stage and a step")
        try:
            peer_id = PeerID.from_string(peer)
        except (P2PTrainError, ValueError) as exc:
            self.stats.bad_requests += 1
            raise InvalidArgumentError(f"a vouch request names no peer: {exc}") from None
        state = self._state
        if state is None or state.index != stage:
            return Message({"counted": None, "at": -1})
        vouch = state.vouches.get(step)
        counted = None if vouch is None else vouch.answer(peer_id)
        return Message({"counted": counted, "at": state.copt.global_step})

    async def _release(self, ctx: CallContext, message: Message) -> Message:
        try:
            request = parse_request(message.body, message.payload, tensor_key=None, max_bytes=0)
        except P2PTrainError:
            self.stats.bad_requests += 1
            raise
        self._forget((ctx.peer, request.mb))
        return Message({})
