"""The swarm side of a trainer: progress, the decision loop, averaging and state sync.

Both trainers (:class:`~p2ptrain.train.optimizer.CollaborativeOptimizer` and
:class:`~p2ptrain.train.diloco.DiLoCoOptimizer`) own one
:class:`Collaboration`. It runs in the training thread and reaches the
networking on the peer's loop through :meth:`~p2ptrain.peer.Peer.run`:

* :meth:`Collaboration.report` publishes the trainer's step and samples
  (through a :class:`~p2ptrain.train.tracker.ProgressTracker`);
* :meth:`Collaboration.advance` applies :func:`~p2ptrain.train.policy.decide`
  and handles waiting and early matchmaking itself, so the trainer only sees
  STEP, SYNC or CONTINUE;
* :meth:`Collaboration.average` averages a vector for a step
  (:class:`~p2ptrain.train.averaging.SwarmAverager`);
* :meth:`Collaboration.sync` downloads the state of the most advanced peer
  that serves one and hands it to the trainer, trying peers in turn;
* a :class:`~p2ptrain.train.state_sync.StateServer` serves the trainer's own
  snapshots to others.

It also keeps the figures of :class:`TrainerStats` and of its all-reduce
rounds (:class:`~p2ptrain.train.round_stats.RoundStats`) and, if given a
:class:`~p2ptrain.metrics.Metrics` registry, records them there (only from
the training thread) and registers a collector of the rounds' figures.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch

from p2ptrain.allreduce.config import AllReduceConfig
from p2ptrain.allreduce.grouped import GroupingConfig
from p2ptrain.errors import (
    ConfigError,
    RunMismatchError,
    StateSyncError,
    TrainingStoppedError,
)
from p2ptrain.metrics import Metrics
from p2ptrain.node.address import PeerAddress
from p2ptrain.peer import Peer
from p2ptrain.secure.identity import PeerID
from p2ptrain.train.averaging import RoundOutcome, SwarmAverager
from p2ptrain.train.cut import Placement, StepPolicy, place_batch
from p2ptrain.train.policy import Action, LeadTimer, decide, step_is_near
from p2ptrain.train.progress import ProgressConfig, RateMeter, SwarmProgress
from p2ptrain.train.round_stats import RoundStats, allreduce_collector
from p2ptrain.train.state import TrainingSnapshot
from p2ptrain.train.state_sync import StateServer, StateSyncConfig, download_state
from p2ptrain.train.tracker import ProgressTracker

__all__ = ["Collaboration", "StepRecord", "SwarmSettings", "TrainerStats"]

logger = logging.getLogger(__name__)

_RUN_MARGIN = 30.0  # seconds added to the averager's own deadline before giving up on the loop
_STOP_GRACE = 0.5  # seconds an average already running may go on past the stop time
_STOP_POLL = 0.1  # seconds between checks of the stop time while an average runs


@dataclass(frozen=True)
class SwarmSettings:
    """How a trainer takes part in the swarm; see :class:`~p2ptrain.train.config.TrainerConfig`.

    Attributes:
        run_id: Names the run.
        target_batch_size: Samples a step needs (``None``: every peer blocks).
        progress: Progress publication and reads.
        allreduce: Codec and aggregation of the all-reduce.
        state: State serving and downloading.
        matchmaking_lead: Seconds ahead of a step to matchmake (``None``:
            measured, see :class:`~p2ptrain.train.policy.LeadTimer`).
        sync_tolerance: Steps a peer may lag and still join a step.
        step_policy: How a step holds the target (:mod:`p2ptrain.train.cut`).
        carry_batches: Under ``carry``: batches a peer computes toward the next
            step while its step averages (the others' estimates count them).
        grouping: When and how a step averages in groups (``None``: the defaults).
        model: The model's digest (:func:`~p2ptrain.train.fingerprint.model_digest`);
            ``None``: not checked.
    """

    run_id: str
    target_batch_size: int | None
    progress: ProgressConfig
    allreduce: AllReduceConfig
    state: StateSyncConfig
    matchmaking_lead: float | None
    sync_tolerance: int
    step_policy: StepPolicy = StepPolicy.UNBOUNDED
    carry_batches: int = 0
    grouping: GroupingConfig | None = None
    model: str | None = None


@dataclass(frozen=True)
class PendingAverage:
    """An average running on the peer's loop (see :meth:`Collaboration.begin_average`)."""

    step: int
    future: concurrent.futures.Future[tuple[torch.Tensor, RoundOutcome]]
    started: float


@dataclass(frozen=True)
class StepRecord:
    """The samples of one swarm step this peer applied.

    Attributes:
        step: The step's index (the global step before it was applied).
        own: This peer's samples in it.
        samples: All the group's samples in it (the all-reduce's total
            weight), or ``None`` if unknown (e.g. a lossy codec).
        target: The target batch size.
        group: The members it was averaged with, this peer among them (empty:
            it stepped alone).
        counted: The members whose samples ``samples`` holds, if known.
    """

    step: int
    own: int
    samples: int | None
    target: int | None
    group: tuple[PeerID, ...] = ()
    counted: frozenset[PeerID] | None = None


@dataclass(frozen=True)
class TrainerStats:
    """What a trainer did so far.

    Attributes:
        global_step: Its global step.
        samples: Samples it computed (every ``step(batch_size)`` call).
        rounds: Steps averaged in a group.
        local_rounds: Steps it applied with its own average only (alone, or
            no group formed).
        syncs: States downloaded from other peers.
        bytes_sent: Tensor bytes sent by its all-reduces.
        bytes_received: Tensor bytes received by its all-reduces.
        averaging_s: Seconds the training thread spent in averaging (the
            part of matchmaking that early matchmaking did not hide, and the
            all-reduce).
        waiting_s: Seconds it spent waiting for the swarm while blocked.
        sync_s: Seconds it spent downloading state.
        matchmaking_s: Seconds from the start of matchmaking to the plan,
            summed over steps (early matchmaking overlaps computing).
        allreduce_s: Seconds the all-reduces took, summed over steps.
        steps_counted: Steps whose samples this peer learned (from the
            all-reduce's total weight, or its own when it stepped alone).
        step_samples: Those steps' samples summed: the samples the swarm
            trained on, as this peer saw its steps.
    """

    global_step: int = 0
    samples: int = 0
    rounds: int = 0
    local_rounds: int = 0
    syncs: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    averaging_s: float = 0.0
    waiting_s: float = 0.0
    sync_s: float = 0.0
    matchmaking_s: float = 0.0
    allreduce_s: float = 0.0
    steps_counted: int = 0
    step_samples: int = 0

    @property
    def communication_s(self) -> float:
        """Seconds the training thread did not compute: averaging, waiting, syncing."""
        return self.averaging_s + self.waiting_s + self.sync_s


class Collaboration:
    """The swarm side of one trainer (see the module docstring).

    Args:
        peer: The started peer.
        settings: Run id, target, configs.
        snapshot: Returns a consistent copy of the trainer's state; called
            from a worker thread when another peer downloads it.
        metrics: Optional registry for the trainer's figures.
        before_average: Awaited on the peer's loop before each average with
            other peers (a failure is logged and the step goes on).
    """

    def __init__(
        self,
        *,
        peer: Peer,
        settings: SwarmSettings,
        snapshot: Callable[[], TrainingSnapshot],
        metrics: Metrics | None = None,
        before_average: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        if not peer.running:
            raise ConfigError("the peer must be started before a trainer uses it")
        self.peer = peer
        self.settings = settings
        self.progress_config = settings.progress
        self.state_config = settings.state
        self.metrics = metrics
        self._snapshot = snapshot
        self._before_average = before_average
        window = peer.matchmaker.config.window
        self._lead: LeadTimer | None = None
        self._fixed_lead = settings.matchmaking_lead
        if self._fixed_lead is None:
            self._lead = LeadTimer(
                initial=window / 2,
                read_interval=settings.progress.min_fetch_interval,
                low=settings.progress.min_fetch_interval,
                high=window,
            )
        self._closed = False
        self.last_step: StepRecord | None = None
        self._close_estimate: int | None = None
        self._stepped_at: float | None = None  # Unix time of this peer's latest step
        self._closed_at: float | None = None  # Unix time it closed its current step
        self._previous_closed_at: float | None = None  # ... and the step before
        self._batch = 0
        self._tolerance = settings.sync_tolerance
        self._averager = SwarmAverager(
            peer=peer,
            run_id=settings.run_id,
            allreduce=settings.allreduce,
            grouping=settings.grouping,
        )
        self._tracker = ProgressTracker(
            dht=peer.dht,
            run_id=settings.run_id,
            config=settings.progress,
            target_batch_size=settings.target_batch_size,
            address=None if peer.client_mode else peer.address,
            reach=peer.reach,
            bandwidth=lambda: _bandwidth(peer),
            model=settings.model,
        )
        self._server: StateServer | None = None
        self._rate = RateMeter(settings.progress.smoothing)
        self._computing_since = time.perf_counter()
        self._fresh = False
        self._sync_retry_at = 0.0
        self._stats = TrainerStats()
        self.round_stats = RoundStats()
        if metrics is not None:
            metrics.add_collector(allreduce_collector(self.round_stats))
        self._started = False
        self._stop_at: float | None = None
        self._stop_event: threading.Event | None = None
        self._stop_seen: float | None = None

    # -- lifecycle ---------------------------------------------------------------------

    def start(self, step: int) -> SwarmProgress:
        """Serve state, publish the first record and read the swarm.

        Returns:
            The swarm's progress; if its global step is ahead of ``step`` the
            trainer should :meth:`sync` before computing.

        Raises:
            RunMismatchError: The run's peers train another model (other
                parameter shapes or dtypes) and none trains this one; this
                peer then leaves the run.
        """
        if self._started:
            raise RuntimeError("the trainer is already started")

        async def begin() -> None:
            self._server = StateServer(self.peer.node, self._snapshot, config=self.state_config)
            await self._tracker.start(step=step)

        self.peer.run(begin())
        view = self._tracker.view()
        foreign = self._tracker.foreign
        ours = [r for r in view.records if r.peer_id != self.peer.peer_id]
        if foreign and ours:
            logger.warning(
                "run %r: ignoring %d peers that train another model (digest %s)",
                self.settings.run_id,
                len(foreign),
                foreign[0].model,
            )
        elif foreign:
            self._started = True
            self.close()
            raise RunMismatchError(
                f"run {self.settings.run_id!r} trains another model: {len(foreign)} of its"
                f" peers have model digest {foreign[0].model}, this peer {self.settings.model}"
                " (another task? give it its own --run-id)"
            )
        self._started = True
        self._fresh = view.global_step > step
        self._stats = dataclasses.replace(self._stats, global_step=step)
        self._computing_since = time.perf_counter()
        if self._fresh:
            logger.info(
                "joined run %r at global step %d (%d peers online); downloading the swarm's state",
                self.settings.run_id,
                view.global_step,
                view.peers_online,
            )
        else:
            logger.info(
                "training run %r at global step %d: %d peers online",
                self.settings.run_id,
                step,
                view.peers_online,
            )
        return view

    def close(self) -> None:
        """Stop publishing and serving (the peer stays up)."""
        if not self._started:
            return
        self._started = False

        async def end() -> None:
            await self._averager.aclose()
            await self._tracker.aclose()
            if self._server is not None:
                self._server.close()

        if self.peer.running:
            self.peer.run(end(), timeout=self.peer.config.close_timeout)

    def stop_at(self, deadline: float | None, *, event: threading.Event | None = None) -> None:
        """Stop waiting for the swarm at ``deadline`` (``time.monotonic()``; ``None``:
        never) or once ``event`` is set, whichever comes first.

        From then on :meth:`advance` returns CONTINUE instead of waiting,
        stepping or syncing, and an average still running ``_STOP_GRACE``
        seconds after it is cancelled (:meth:`end_average` raises
        TrainingStoppedError). Any thread may call it or set the event, e.g.
        a signal handler.
        """
        self._stop_at = deadline
        self._stop_event = event
        self._stop_seen = None

    def _stop_time(self) -> float | None:
        """The stop time (``time.monotonic()``), or ``None`` while there is none."""
        event = self._stop_event
        if event is not None and event.is_set():
            if self._stop_seen is None:
                self._stop_seen = time.monotonic()
            if self._stop_at is None or self._stop_seen < self._stop_at:
                return self._stop_seen
        return self._stop_at

    @property
    def stopping(self) -> bool:
        """Whether the stop time (:meth:`stop_at`) has passed."""
        stop = self._stop_time()
        return stop is not None and time.monotonic() >= stop

    @property
    def started(self) -> bool:
        """Whether :meth:`start` ran and :meth:`close` did not."""
        return self._started

    @property
    def stats(self) -> TrainerStats:
        """The figures so far."""
        return self._stats

    @property
    def samples_per_s(self) -> float:
        """This peer's recent compute throughput."""
        return self._rate.value

    @property
    def lead_time(self) -> float:
        """Seconds before a step's estimated moment that matchmaking starts."""
        if self._lead is not None:
            return self._lead.value
        return self._fixed_lead or 0.0

    @property
    def closed(self) -> bool:
        """Whether this peer closed its current step (the step cut)."""
        return self._closed

    def place(self, *, step: int, own: int, batch: int) -> Placement:
        """Whether this peer closes its step after a local batch (:func:`place_batch`).

        Args:
            step: The trainer's step.
            own: Samples it holds toward ``step`` before the batch.
            batch: The batch's samples.
        """
        policy = self.settings.step_policy
        target = self.settings.target_batch_size
        if policy is StepPolicy.UNBOUNDED or target is None:
            return Placement(close=False)
        view = self._tracker.view()
        carry = policy is StepPolicy.CARRY
        others = view.estimate_samples(
            step,
            exclude=self.peer.peer_id,
            now=time.time(),
            stepped_at=self._stepped_at,
            partial=True,
            carry_batches=self.settings.carry_batches if carry else 0,
            closed_at=self._previous_closed_at,
        )
        swarm_closed = view.global_step == step and any(
            r.closed and r.peer_id != self.peer.peer_id for r in view.records if r.step == step
        )
        # This peer's rate as its latest record states it, like the others' (their
        # records are as old): on a shared machine a starved batch slows every
        # peer, and this peer's fresh rate against the others' older ones made a
        # starved peer expect the others to add 3-5 batches per batch of its own.
        published = self._tracker.local.samples_per_s
        own_rate = published if published > 0 else self._rate.value
        others_rate = max(0.0, view.samples_per_s - published)
        others_rate += view.unstated_rate(step, exclude=self.peer.peer_id)
        per_batch = others_rate * batch / own_rate if own_rate > 0 else 0.0
        placement = place_batch(
            policy=policy,
            target=target,
            own=own,
            batch=batch,
            others=others,
            swarm_closed=swarm_closed,
            others_per_batch=per_batch,
        )
        logger.debug(
            "cut step %d: own %d + batch %d, others %d (+%.1f per batch; %d records at the step,"
            " %d without a rate), closed by others %s: %s",
            step,
            own,
            batch,
            others,
            per_batch,
            sum(1 for r in view.records if r.step == step),
            sum(1 for r in view.records if r.step == step and r.samples_per_s <= 0),
            swarm_closed,
            placement,
        )
        if placement.close and not self._closed:
            self._closed = True
            self._closed_at = time.time()
            self._close_estimate = own + batch + others
        return placement

    def view(self) -> SwarmProgress:
        """The swarm's progress as last read, with this peer's latest record."""
        return self._tracker.view()

    # -- the decision loop -------------------------------------------------------------

    def record_batch(self, samples: int) -> None:
        """Count a local batch of ``samples``, computed since the trainer last returned."""
        now = time.perf_counter()
        rate = self._rate.update(samples, now - self._computing_since)
        self.peer.set_samples_per_s(rate)
        self._computing_since = now
        if samples > 0:
            self._batch = samples
        self._add(samples=samples)
        if self.metrics is not None:
            self.metrics.inc("p2ptrain_train_samples_total", samples)
            self.metrics.set("p2ptrain_train_samples_per_s", rate)

    def report(self, *, step: int, samples: int, blocked: bool) -> None:
        """Publish the trainer's step and samples toward the next step."""
        self._tracker.report(
            step=step,
            samples=samples,
            samples_per_s=self._rate.value,
            blocked=blocked,
            closed=self._closed,
            batch=self._batch,
        )

    def advance(self, *, step: int, samples: int, blocked: bool, num_elements: int) -> Action:
        """Decide what the trainer does next; waits while it is blocked.

        Returns:
            :attr:`Action.STEP`, :attr:`Action.SYNC` or :attr:`Action.CONTINUE`.
        """
        waited_since: float | None = None
        entered = time.monotonic()
        refreshed = False
        try:
            while True:
                if self.stopping:
                    return Action.CONTINUE
                view = self._tracker.view()
                action = decide(
                    local_step=step,
                    local_samples=samples,
                    blocked=blocked,
                    swarm=view,
                    lead_time=self.lead_time,
                    sync_tolerance=0 if self._fresh else self._tolerance,
                    closed=self._closed,
                )
                if action is Action.SYNC and time.monotonic() < self._sync_retry_at:
                    action = Action.WAIT if blocked else Action.CONTINUE
                if (
                    action is Action.STEP
                    and not refreshed
                    and self._tracker.fetched_since < entered
                    and not self._closed_with_partners(view, step)
                ):
                    # Step on what the others said after our latest report: an
                    # older view may miss peers (all "blocked" when alone). A
                    # step the cut closed with partners in view skips it: the
                    # cut counted their samples already, the read cost a DHT
                    # round trip (30-80 ms on 2 loaded cores) at every step, and
                    # a swarm that moved on meanwhile is caught by the average's
                    # outcome. A view without partners is read again: stepping
                    # alone on a stale view made peers of one swarm diverge.
                    self.peer.run(self._tracker.refresh(), timeout=_RUN_MARGIN)
                    refreshed = True
                    continue
                if action is Action.WAIT:
                    if waited_since is None:
                        waited_since = time.perf_counter()
                        self._tracker.set_waiting(True)
                    if step_is_near(view, self.lead_time):
                        self._prepare(step, num_elements, view)
                    wait = self.progress_config.max_fetch_interval
                    if (stop := self._stop_time()) is not None:
                        wait = max(0.0, min(wait, stop - time.monotonic()))
                    self.peer.run(self._tracker.wait_for_fetch(wait), timeout=wait + _RUN_MARGIN)
                    continue
                if action is Action.PREPARE:
                    self._prepare(step, num_elements, view)
                    action = Action.CONTINUE
                self._gauges(view)
                return action
        finally:
            if waited_since is not None:
                self._tracker.set_waiting(False)
                waited = time.perf_counter() - waited_since
                self._add(waiting_s=waited)
                if self.metrics is not None:
                    self.metrics.observe("p2ptrain_train_wait_seconds", waited)
            self._computing_since = time.perf_counter()

    def _closed_with_partners(self, view: SwarmProgress, step: int) -> bool:
        """This peer closed ``step`` by the cut, on a view of that step with partners."""
        return (
            self._closed
            and view.global_step == step
            and view.expected_in_group(step, exclude=self.peer.peer_id) > 0
        )

    def _prepare(self, step: int, num_elements: int, view: SwarmProgress) -> None:
        # Early groups are sized from the view of now: only form one when no
        # peer's record is so far behind that it may be stale (a peer that
        # just synced would be left out).
        group_size = 1 + view.expected_in_group(step, exclude=self.peer.peer_id)
        if group_size > 1 and view.lagging(step) == 0:
            self.peer.run(
                self._averager.prepare(step, num_elements=num_elements, group_size=group_size)
            )

    # -- averaging ---------------------------------------------------------------------

    def average(
        self, step: int, vector: torch.Tensor, weight: float
    ) -> tuple[torch.Tensor, RoundOutcome]:
        """Average ``vector`` with the swarm for ``step`` (see :class:`SwarmAverager`)."""
        started = time.perf_counter()
        pending = self.begin_average(step, vector, weight)
        return self.end_average(pending, blocked_since=started)

    def wait_for_peers(self, count: int, timeout: float) -> bool:
        """Wait until the swarm's view shows ``count`` peers online (this one included).

        Returns:
            Whether it did within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while self._tracker.view().peers_online < count:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.peer.run(self._tracker.wait_for_fetch(left), timeout=left + _RUN_MARGIN)
        return True

    def expects_group(self, step: int) -> bool:
        """Whether other live peers are expected in the group of ``step``."""
        return self._tracker.view().expected_in_group(step, exclude=self.peer.peer_id) > 0

    def begin_average(
        self,
        step: int,
        vector: torch.Tensor,
        weight: float,
        *,
        prepare: Callable[[], object] | None = None,
    ) -> PendingAverage:
        """Start averaging ``vector`` for ``step`` on the peer's loop; the trainer
        keeps computing and calls :meth:`end_average` (``vector`` must stay unchanged).

        Args:
            prepare: Called in a worker thread first (e.g. the codec's error
                feedback, which may change ``vector`` in place).
        """
        view = self._tracker.view()
        group_size = 1 + view.expected_in_group(step, exclude=self.peer.peer_id)
        averager = self._averager
        before = self._before_average if group_size > 1 else None

        async def run() -> tuple[torch.Tensor, RoundOutcome]:
            if prepare is not None:
                await asyncio.to_thread(prepare)
            if before is not None:
                try:
                    await before()
                except Exception:  # the step goes on without it
                    logger.exception("step %d: the before-average hook failed", step)
            return await averager.average(step, vector, weight, group_size=group_size)

        return PendingAverage(step, self.peer.submit(run()), time.perf_counter())

    def end_average(
        self, pending: PendingAverage, *, blocked_since: float | None = None
    ) -> tuple[torch.Tensor, RoundOutcome]:
        """Wait for an average begun by :meth:`begin_average` and count it.

        Args:
            pending: What :meth:`begin_average` returned.
            blocked_since: When the training thread began waiting for it
                (``None``: now); the wait counts as averaging time.
        """
        blocked = time.perf_counter() if blocked_since is None else blocked_since
        averaged, outcome = self._result(pending)
        self._add(
            rounds=int(outcome.averaged),
            local_rounds=int(not outcome.averaged),
            bytes_sent=outcome.bytes_sent,
            bytes_received=outcome.bytes_received,
            averaging_s=time.perf_counter() - blocked,
            matchmaking_s=outcome.matchmaking_s,
            allreduce_s=outcome.allreduce_s,
        )
        self.round_stats.record(outcome)
        if self._lead is not None and outcome.averaged:
            self._lead.record(outcome.matchmaking_s)
        if self.metrics is not None:
            labels = {"outcome": "group" if outcome.averaged else "local"}
            self.metrics.inc("p2ptrain_train_rounds_total", 1, labels)
            self.metrics.observe("p2ptrain_matchmaking_seconds", outcome.matchmaking_s)
            if outcome.report is not None:
                self.metrics.observe("p2ptrain_allreduce_seconds", outcome.allreduce_s)
        return averaged, outcome

    def _result(self, pending: PendingAverage) -> tuple[torch.Tensor, RoundOutcome]:
        """Wait for ``pending``; cancel it once the stop time plus a grace has passed."""
        future = pending.future
        give_up = time.monotonic() + self._averager.deadline + _RUN_MARGIN
        while True:
            # Short waits, so that a stop_at() from another thread is seen in time.
            done, _ = concurrent.futures.wait([future], timeout=_STOP_POLL)
            if done:
                return future.result()
            now, stop = time.monotonic(), self._stop_time()
            if stop is not None and now >= stop + _STOP_GRACE:
                future.cancel()
                raise TrainingStoppedError(
                    f"step {pending.step} was still averaging at the stop time; not applied"
                )
            if now >= give_up:
                return future.result(timeout=0)  # raises TimeoutError

    def stepped(
        self,
        step: int,
        *,
        samples: int = 0,
        step_samples: int | None = None,
        own: int = 0,
        group: tuple[PeerID, ...] = (),
        counted: frozenset[PeerID] | None = None,
    ) -> None:
        """The trainer applied a step and is now at ``step`` with ``samples`` carried over.

        Args:
            step: The trainer's new step.
            samples: Samples it already holds toward ``step`` (carried over).
            step_samples: Samples the swarm averaged in the step just applied,
                if known.
            own: This peer's samples in that step.
            group: Who it was averaged with (:class:`StepRecord`).
            counted: Whose samples ``step_samples`` holds, if known.
        """
        self._fresh = False
        self._closed = False
        self._stepped_at = time.time()
        self._previous_closed_at, self._closed_at = self._closed_at, None
        self._stats = dataclasses.replace(self._stats, global_step=step)
        close_estimate, self._close_estimate = self._close_estimate, None
        target = self.settings.target_batch_size
        self.last_step = StepRecord(step - 1, own, step_samples, target, group, counted)
        if step_samples is not None:
            self._step_done(step - 1, step_samples, own, close_estimate)
        self.report(step=step, samples=samples, blocked=False)
        self._computing_since = time.perf_counter()  # averaging is not computing
        if self.metrics is not None:
            self.metrics.set("p2ptrain_train_global_step", step)
        logger.debug("global step advanced to %d", step)  # the "averaged" line says it at INFO

    def _step_done(self, step: int, samples: int, own: int, estimate: int | None) -> None:
        target = self.settings.target_batch_size
        self._tracker.last_step_samples = samples
        self._add(steps_counted=1, step_samples=samples)
        if self.metrics is not None:
            self.metrics.observe("p2ptrain_train_step_samples", samples)
            self.metrics.set("p2ptrain_train_last_step_samples", samples)
            if target is not None:
                self.metrics.set("p2ptrain_train_target_batch_size", target)
        if target is not None and samples > 1.25 * target:
            logger.warning(
                "step %d held %d samples, %.2f× the target %d: %s",
                step,
                samples,
                samples / target,
                target,
                self._overshoot_cause(samples, own, estimate),
            )

    def _overshoot_cause(self, samples: int, own: int, estimate: int | None) -> str:
        policy = self.settings.step_policy
        if policy is StepPolicy.UNBOUNDED:
            return "the step cut is off (step_policy 'unbounded')"
        if estimate is None:
            return (
                f"this peer did not close the step itself; it added {own} samples "
                "before it saw the target reached"
            )
        return (
            f"when this peer closed the step ({own} of its samples) it estimated the "
            f"swarm at {estimate} samples: the others' progress records were "
            f"{samples - estimate} samples behind (stale records or a changed rate)"
        )

    def moved_past(self, step: int, *, wait: bool = False) -> bool:
        """Whether some peer already finished ``step`` (reads the swarm's records now).

        Args:
            wait: While other peers are at ``step``, read again until one
                finishes it, for up to a matchmaking window plus three times
                this peer's average all-reduce (at least 2 s). A peer that
                found no group while the others formed one asks this: they
                finish the step a round later, and a single read made such a
                peer apply its own gradient alone and leave the swarm's
                parameters.
        """
        if self._tracker.view().peers_online <= 1:
            return False
        rounds = self._stats.rounds
        average_round = self._stats.allreduce_s / rounds if rounds else 0.0
        window = self.peer.matchmaker.config.window
        deadline = time.monotonic() + (window + max(2.0, 3 * average_round) if wait else 0.0)
        while True:
            view = self.peer.run(self._tracker.refresh(), timeout=_RUN_MARGIN)
            if view.global_step > step:
                return True
            others = view.expected_in_group(step, exclude=self.peer.peer_id)
            left = deadline - time.monotonic()
            if others == 0 or left <= 0 or self.stopping:
                return False
            time.sleep(min(left, self.progress_config.min_fetch_interval))

    # -- state sync --------------------------------------------------------------------

    def sync(
        self, *, local_step: int, apply: Callable[[TrainingSnapshot], None]
    ) -> TrainingSnapshot:
        """Download the most advanced state that ``apply`` accepts, trying peers in turn.

        Args:
            local_step: The trainer's step; only peers ahead of it are asked.
            apply: Installs a snapshot in the trainer; raises StateSyncError
                to refuse it (e.g. another model).

        Raises:
            StateSyncError: No peer ahead provided a usable state; the trainer
                will not try again for ``state.retry_interval`` seconds.
        """
        started = time.perf_counter()
        view = self.peer.run(self._tracker.refresh(), timeout=_RUN_MARGIN)
        sources = [r for r in view.sources(exclude=self.peer.peer_id) if r.step > local_step]
        errors: list[str] = []
        for record in sources:
            address = PeerAddress.parse(record.address or "").with_peer(record.peer_id)
            try:
                snapshot = self.peer.run(
                    download_state(self.peer.node, address, config=self.state_config),
                    timeout=self.state_config.timeout + _RUN_MARGIN,
                )
                apply(snapshot)
            except StateSyncError as exc:
                logger.warning("state from %s refused: %s", record.peer_id.short, exc)
                errors.append(f"{record.peer_id.short}: {exc}")
                continue
            self._fresh = False
            self._closed = False
            self._close_estimate = None
            self._stepped_at = None  # it did not step with a group
            self._closed_at = self._previous_closed_at = None
            seconds = time.perf_counter() - started
            self._add(syncs=1, sync_s=seconds)
            self._stats = dataclasses.replace(self._stats, global_step=snapshot.step)
            self.report(step=snapshot.step, samples=0, blocked=False)
            if self.metrics is not None:
                self.metrics.inc("p2ptrain_state_downloads_total")
                self.metrics.observe("p2ptrain_state_download_seconds", seconds)
                self.metrics.set("p2ptrain_train_global_step", snapshot.step)
            logger.info(
                "downloaded the state of step %d from %s in %.2f s",
                snapshot.step,
                record.peer_id.short,
                seconds,
            )
            self._computing_since = time.perf_counter()
            return snapshot
        self._sync_retry_at = time.monotonic() + self.state_config.retry_interval
        self._add(sync_s=time.perf_counter() - started)
        reasons = "; ".join(errors) or "no peer ahead serves its state"
        raise StateSyncError(f"no usable state for step > {local_step} ({reasons})")

    # -- figures -----------------------------------------------------------------------

    def _add(self, **deltas: float) -> None:
        stats = self._stats
        self._stats = dataclasses.replace(
            stats, **{name: getattr(stats, name) + value for name, value in deltas.items()}
        )

    def _gauges(self, view: SwarmProgress) -> None:
        if self.metrics is not None:
            self.metrics.set("p2ptrain_swarm_samples_per_s", view.samples_per_s)
            self.metrics.set("p2ptrain_peers_online", view.peers_online)
            self.metrics.set("p2ptrain_swarm_global_step", view.global_step)


def _bandwidth(peer: Peer) -> tuple[float, float]:
    """The (upload, download) bytes per second the load balancer uses for ``peer``."""
    capacity = peer.capacity()
    return capacity.upload_bytes_per_s, capacity.download_bytes_per_s
