"""One swarm step's averaging: matchmaking under the step's key, then the all-reduce.

:meth:`SwarmAverager.average` runs on the peer's loop. It forms a group under
``<run_id>/step-<step>`` (a group as large as the peers expected in it, so
it forms as soon as all of them announced), all-reduces the vector weighted by this
peer's samples, and returns the average with a :class:`RoundOutcome`. It
never raises for a network failure: when no group forms, or the all-reduce
fails, it returns this peer's own vector and says why in
``RoundOutcome.fallback``. A peer alone in the swarm does not matchmake.

:meth:`SwarmAverager.prepare` starts the matchmaking of a step early, in an
owned background task, so that it overlaps the last local batches; the
following :meth:`~SwarmAverager.average` for that step takes its plan (or
matchmakes again if the early attempt failed).

A step that expects more peers than ``GroupingConfig.group_size`` averages
in groups instead (:class:`~p2ptrain.allreduce.grouped.GroupedAverager`:
groups, then one all-reduce per slice across the groups, to the exact
weighted average); it matchmakes when it averages, not early.

The matchmaker's group size is set per step through its public ``config``
attribute (the :class:`~p2ptrain.peer.Peer` owns one matchmaker per node; the
trainer is its only user while it runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import torch

from p2ptrain.allreduce.config import AllReduceConfig
from p2ptrain.allreduce.group import GroupPlan
from p2ptrain.allreduce.grouped import GroupedAverager, GroupingConfig
from p2ptrain.allreduce.matchmaking import Matchmaker, MatchmakingConfig
from p2ptrain.allreduce.report import AllReduceReport
from p2ptrain.errors import ConfigError, MatchmakingError, P2PTrainError
from p2ptrain.peer import Peer
from p2ptrain.secure.identity import PeerID

__all__ = ["RoundOutcome", "SwarmAverager", "counted_members", "group_weight", "step_key"]

logger = logging.getLogger(__name__)


def step_key(run_id: str, step: int) -> str:
    """The matchmaking key of a run's step."""
    return f"{run_id}/step-{step}"


@dataclass(frozen=True)
class RoundOutcome:
    """How one step's averaging went, for this peer.

    Attributes:
        step: The step averaged for.
        group_size: Members of the group (1 when this peer averaged alone).
        weight: This peer's weight (its samples).
        fallback: Why this peer kept its own vector (``None`` when it averaged
            in a group): ``"alone"``, or the matchmaking or all-reduce error.
        complete: Every part of the vector was averaged by the whole group.
        matchmaking_s: Seconds from the start of matchmaking (early, if it
            was prepared) to the plan.
        allreduce_s: Seconds the all-reduce took.
        bytes_sent: Tensor bytes this peer sent.
        bytes_received: Tensor bytes it received.
        report: The all-reduce report, if an all-reduce ran (averaged in
            groups: this peer's group's).
        grouped: Averaged in groups (:mod:`p2ptrain.allreduce.grouped`).
    """

    step: int
    group_size: int
    weight: float
    fallback: str | None
    complete: bool
    matchmaking_s: float
    allreduce_s: float
    bytes_sent: int = 0
    bytes_received: int = 0
    report: AllReduceReport | None = None
    grouped: bool = False

    @property
    def averaged(self) -> bool:
        """Whether the vector was averaged in a group (not a local fallback)."""
        return self.fallback is None

    @property
    def dropped(self) -> dict[int, str]:
        """Members the all-reduce reported failed or left out of a shard, with why."""
        report = self.report
        if report is None:
            return {}
        dropped = dict(report.failed)
        for shard in report.shards:
            for index, reason in shard.excluded.items():
                dropped.setdefault(index, f"left out of member {shard.owner}'s shard: {reason}")
        return dropped


def group_weight(outcome: RoundOutcome, *, length: int, marker: float) -> int | None:
    """The group's total weight (samples) of a step, read from a marker element.

    A trainer that appends ``1 / weight`` to the vector it averages (weighted
    mean) gets back ``k / W`` in that element, where ``k`` members of total
    weight ``W`` contributed to it; the report says who contributed. A peer
    that averaged alone holds its own weight.

    Args:
        outcome: The step's outcome.
        length: Elements of the averaged vector (the marker is the last).
        marker: The marker element of the averaged vector.

    Returns:
        ``W`` rounded to an int, or ``None`` when the last chunk kept local
        values (its average did not arrive) or the marker is not positive.
    """
    report = outcome.report
    if report is None:
        return round(outcome.weight)
    contributors = _marker_contributors(report, length)
    if not contributors or not marker > 0:
        return None
    return round(len(contributors) / marker)


def counted_members(outcome: RoundOutcome, *, length: int) -> frozenset[PeerID] | None:
    """The members whose weight a step's count holds: the contributors of the marker
    element's chunk, as :func:`group_weight` reads them.

    ``None`` when unknown: averaged alone or in groups, or that chunk's average
    did not arrive.
    """
    report = outcome.report
    if report is None or outcome.grouped:
        return None
    contributors = _marker_contributors(report, length)
    if contributors is None:
        return None
    return frozenset(report.members[i] for i in contributors)


def _marker_contributors(report: AllReduceReport, length: int) -> tuple[int, ...] | None:
    """The member indices in the average of the chunk holding a vector's last element
    (the count marker); ``None`` when that chunk kept local values."""
    shard = next((s for s in report.shards if s.start < length <= s.stop), None)
    if shard is None or not shard.chunk_contributors:
        return None
    return shard.chunk_contributors[-1]


@dataclass
class _Early:
    """Matchmaking begun ahead of a step (:meth:`SwarmAverager.prepare`)."""

    step: int
    task: asyncio.Task[GroupPlan]
    started: float
    due: asyncio.Event


class SwarmAverager:
    """Averages a flat vector with the swarm at each step; one per trainer.

    Args:
        peer: The started peer (its matchmaker and all-reduce service).
        run_id: Names the run (prefix of the matchmaking keys).
        allreduce: Codec and aggregation rule of the all-reduce.
        grouping: Above which size a step averages in groups, and how.
    """

    def __init__(
        self,
        *,
        peer: Peer,
        run_id: str,
        allreduce: AllReduceConfig,
        grouping: GroupingConfig | None = None,
    ) -> None:
        if not run_id:
            raise ConfigError("run_id must not be empty")
        self.peer = peer
        self.run_id = run_id
        self.allreduce_config = allreduce
        self._matchmaker: Matchmaker = peer.matchmaker
        self._base: MatchmakingConfig = self._matchmaker.config
        self._pending: _Early | None = None
        self._last_members: tuple[PeerID, ...] = ()
        self.grouping = grouping or GroupingConfig()
        self._grouped = GroupedAverager(
            matchmaker=self._matchmaker, service=peer.allreduce, config=self.grouping
        )

    @property
    def deadline(self) -> float:
        """The longest one :meth:`average` call can take (matchmaking plus round)."""
        mm = self._base
        flat = mm.window + mm.lone_wait + 2 * mm.ready_timeout + mm.plan_timeout + mm.round_timeout
        g = self.grouping
        grouped = (
            g.group_window
            + g.column_window
            + 4 * mm.ready_timeout
            + 2 * mm.plan_timeout
            + 3 * mm.round_timeout
        )
        return max(flat, grouped)

    async def prepare(self, step: int, *, num_elements: int, group_size: int) -> None:
        """Start matchmaking for ``step`` in the background (no-op if already started)."""
        if group_size <= 1 or group_size > self.grouping.group_size:
            return
        pending = self._pending
        if pending is not None and pending.step == step:
            return
        await self._cancel_pending()
        due = asyncio.Event()
        task = asyncio.get_running_loop().create_task(
            self._form_group(step, num_elements, group_size, due=due), name=f"matchmaking:{step}"
        )
        self._pending = _Early(step, task, time.perf_counter(), due)

    async def average(
        self, step: int, vector: torch.Tensor, weight: float, *, group_size: int
    ) -> tuple[torch.Tensor, RoundOutcome]:
        """Average ``vector`` with the group of ``step``, weighted by ``weight``.

        Args:
            step: The step; every member uses the same.
            vector: A flat float tensor (not modified).
            weight: This peer's weight (samples behind the vector), >= 0.
            group_size: Peers expected in the group, this one included; 1
                means alone (no matchmaking).

        Returns:
            The average (or ``vector`` itself on a fallback) and the outcome.
        """
        if group_size <= 1:
            await self._cancel_pending()
            return vector, RoundOutcome(step, 1, weight, "alone", False, 0.0, 0.0)
        if group_size > self.grouping.group_size:
            await self._cancel_pending()
            return await self._average_grouped(step, vector, weight, group_size)
        started = time.perf_counter()
        plan: GroupPlan | None = None
        error: str | None = None
        pending, self._pending = self._pending, None
        if pending is not None and pending.step == step:
            started = min(started, pending.started)
            pending.due.set()
            try:
                plan = await pending.task
            except P2PTrainError as exc:
                logger.info("early matchmaking for step %d failed (%s); trying again", step, exc)
        elif pending is not None:
            pending.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, P2PTrainError):
                await pending.task
        if plan is None:
            try:
                plan = await self._form_group(step, vector.numel(), group_size)
            except P2PTrainError as exc:
                error = f"matchmaking: {exc}"
        matched = time.perf_counter()
        if plan is None:
            logger.warning("step %d: no group (%s); keeping the local average", step, error)
            return vector, RoundOutcome(step, 1, weight, error, False, matched - started, 0.0)
        try:
            averaged, report = await self.peer.allreduce.allreduce(
                plan, vector, weight, config=self.allreduce_config
            )
        except P2PTrainError as exc:
            finished = time.perf_counter()
            logger.warning("step %d: all-reduce failed (%s); keeping the local average", step, exc)
            return vector, RoundOutcome(
                step,
                plan.size,
                weight,
                f"allreduce: {exc}",
                False,
                matched - started,
                finished - matched,
            )
        finished = time.perf_counter()
        self.peer.throughput.record_round(report)
        outcome = RoundOutcome(
            step=step,
            group_size=plan.size,
            weight=weight,
            fallback=None,
            complete=report.complete,
            matchmaking_s=matched - started,
            allreduce_s=finished - matched,
            bytes_sent=report.bytes_sent,
            bytes_received=report.bytes_received,
            report=report,
        )
        _log_round(outcome, plan)
        return averaged, outcome

    async def _average_grouped(
        self, step: int, vector: torch.Tensor, weight: float, swarm_size: int
    ) -> tuple[torch.Tensor, RoundOutcome]:
        started = time.perf_counter()
        key = step_key(self.run_id, step)
        try:
            averaged, result = await self._grouped.average(
                key,
                vector.detach().float().flatten(),
                weight,
                swarm_size=swarm_size,
                allreduce=self.allreduce_config,
            )
        except P2PTrainError as exc:
            logger.warning(
                "step %d: grouped averaging failed (%s); keeping the local one", step, exc
            )
            elapsed = time.perf_counter() - started
            return vector, RoundOutcome(step, 1, weight, f"grouped: {exc}", False, elapsed, 0.0)
        elapsed = time.perf_counter() - started
        report = result.reports[0] if result.reports else None
        if report is not None:
            self.peer.throughput.record_round(report)
        level = logging.INFO if result.complete else logging.WARNING
        logger.log(
            level,
            "step %d: averaged in %d groups (mine: %d) in %.3g s%s",
            step,
            result.groups,
            result.group.size,
            elapsed,
            "" if result.complete else f"; incomplete: {'; '.join(result.failures)}",
        )
        outcome = RoundOutcome(
            step=step,
            group_size=result.group.size,
            weight=weight,
            fallback=None,
            complete=result.complete,
            matchmaking_s=0.0,
            allreduce_s=elapsed,
            bytes_sent=result.bytes_sent,
            bytes_received=sum(r.bytes_received for r in result.reports),
            report=report,
            grouped=True,
        )
        return averaged.view_as(vector).to(vector.dtype), outcome

    async def aclose(self) -> None:
        """Cancel early matchmaking, if any."""
        await self._cancel_pending()

    async def _cancel_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, P2PTrainError):
                await pending.task

    async def _form_group(
        self, step: int, num_elements: int, group_size: int, *, due: asyncio.Event | None = None
    ) -> GroupPlan:
        """Form the group of ``step``; ``due`` (early matchmaking) is set when the
        step is due, and the time limit counts from then."""
        base = self._base
        size = max(base.min_group_size, min(base.target_group_size, group_size))
        # The expected size ends gathering early; every peer that announced by
        # then joins (capped by the configured size): a view that had not yet
        # seen a peer starting at the same time used to cut it out of the group.
        self._matchmaker.config = base
        logger.debug("%s: matchmaking for step %d, group of %d", self.peer.peer_id, step, size)
        limit = base.window + base.lone_wait + 2 * base.ready_timeout + base.plan_timeout
        key = step_key(self.run_id, step)
        try:
            async with asyncio.timeout(None if due is not None else limit) as timeout:
                watch = None if due is None else _limit_from(due, timeout, limit)
                try:
                    plan = await self._matchmaker.form_group(
                        key, num_elements=num_elements, target_batch_size=1, expected=size, due=due
                    )
                finally:
                    if watch is not None:
                        watch.cancel()
        except TimeoutError:
            raise MatchmakingError(f"no group for step {step} within {limit:.1f} s") from None
        # INFO when the group changes; the same members again are routine.
        members = tuple(m.peer_id for m in plan.members)
        level = logging.DEBUG if members == self._last_members else logging.INFO
        self._last_members = members
        names = ", ".join(m.short for m in members)
        logger.log(level, "found a group of %d for %s: %s", plan.size, key, names)
        return plan


def _limit_from(due: asyncio.Event, timeout: asyncio.Timeout, limit: float) -> asyncio.Task[None]:
    """A task that sets ``timeout`` to ``limit`` seconds after ``due`` is set
    (cancel it when the timeout's block ends)."""

    async def watch() -> None:
        await due.wait()
        timeout.reschedule(asyncio.get_running_loop().time() + limit)

    return asyncio.get_running_loop().create_task(watch())


def _log_round(outcome: RoundOutcome, plan: GroupPlan) -> None:
    """One line for the round, one per dropped member.

    A complete round is routine (DEBUG: one line per step would scroll the
    progress display); an incomplete one is a WARNING; a dropped member is an
    event (INFO).
    """
    report = outcome.report
    if report is None:
        return
    predicted = "none" if report.predicted_s is None else _seconds(report.predicted_s)
    logger.log(
        logging.DEBUG if report.complete else logging.WARNING,
        "step %d: averaged%s in a group of %d in %s (predicted %s); sent %s, received %s",
        outcome.step,
        "" if report.complete else " only partly",
        plan.size,
        _seconds(report.total_s),
        predicted,
        _megabytes(report.bytes_sent),
        _megabytes(report.bytes_received),
    )
    for index, reason in sorted(outcome.dropped.items()):
        logger.info(
            "step %d: peer %s dropped: %s", outcome.step, plan.members[index].peer_id.short, reason
        )


def _seconds(value: float) -> str:
    return f"{value:.3g} s"


def _megabytes(count: int) -> str:
    return f"{count / 1e6:.2f} MB"
