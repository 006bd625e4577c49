"""Averaging over a large swarm in groups, to the exact sample-weighted global average.

Theory of operation
-------------------
A swarm of at most ``group_size`` peers averages in one group, as before
(matchmaking under the step's key, then one butterfly all-reduce). A larger
swarm of about ``N`` peers splits into ``G = ceil(N / group_size)`` groups and
averages in three phases (a two-level hierarchy whose second level is
sharded, see docs/allreduce.md for why this and not Moshpit's grid):

1. **Group.** Each peer hashes its PeerID into one of ``G`` groups (the same
   group every step while ``G`` stays) and matchmakes under ``<key>/g<i>``,
   so a DHT dictionary holds one group's announcements. The group
   all-reduces ``[w·x, w]`` with equal weights (the DeDLOC LP plans it); from
   the average and the number of contributors each member gets the group's
   weighted average ``a`` and its total weight ``W``.
2. **Columns.** The vector is cut into ``S = group_size`` equal slices, the
   same cut in every group. The group's members deal the slices among
   themselves in proportion to their parts in the group's plan
   (:func:`slice_edges`). For each slice ``s`` it covers, a member
   matchmakes under ``<key>/s<s>`` (one member per group: ``G``
   announcements) while the group averages, then all-reduces its group's
   slice with weight ``W``. Every column holds one member of every group, so
   every slice comes out as ``Σ W_g a_g / Σ W_g``: the exact global weighted
   average.
3. **Gather.** The group all-gathers the slices (each member's own part is the
   slices it covered) under a plan every member derives from the group's
   plan, so this phase needs no matchmaking. Each slice travels with one
   more element, its **flag**: 1 when the member that covered it got the
   column's complete average with the group's full weight, else 0. So a
   member knows whether every slice it received is the global average, not
   only the slices it covered itself.

Each peer sends about ``2V`` (group) ``+ 2V/S`` (columns) ``+ V`` (gather),
and talks to its group and one member of every other group. A column or a
gather that fails leaves slices at the group's average: the result says so
(:attr:`GroupedResult.complete`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import logging
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from p2ptrain.allreduce.config import AllReduceConfig
from p2ptrain.allreduce.group import GroupPlan
from p2ptrain.allreduce.matchmaking import Matchmaker
from p2ptrain.allreduce.partition import shares_to_boundaries
from p2ptrain.allreduce.report import AllReduceReport
from p2ptrain.allreduce.service import AllReduceService
from p2ptrain.errors import ConfigError, P2PTrainError
from p2ptrain.secure.identity import PeerID

__all__ = [
    "GroupedAverager",
    "GroupedResult",
    "GroupingConfig",
    "group_count",
    "group_index",
    "slice_bounds",
    "slice_edges",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupingConfig:
    """When and how a swarm averages in groups.

    Attributes:
        group_size: Peers per group. A swarm of at most this many averages
            in one group; a larger one in ``ceil(N / group_size)`` groups, and
            the vector in ``group_size`` slices.
        group_window: Seconds to gather a group's announcements (group sizes
            vary, so groups form when this window ends).
        column_window: Seconds to gather a column's announcements (a column
            forms at once when every group's member has announced).
        max_group_factor: A group takes at most ``max_group_factor *
            group_size`` members (hashing makes some groups larger).
    """

    group_size: int = 32
    group_window: float = 1.0
    column_window: float = 10.0
    max_group_factor: float = 2.5

    def __post_init__(self) -> None:
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int):
            raise ConfigError("group_size must be an int")
        if not 2 <= self.group_size <= 256:
            raise ConfigError(f"group_size must be in [2, 256], got {self.group_size}")
        for name in ("group_window", "column_window"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be positive and finite, got {value!r}")
        if not (math.isfinite(self.max_group_factor) and self.max_group_factor >= 1):
            raise ConfigError("max_group_factor must be >= 1")


def group_count(swarm_size: int, group_size: int) -> int:
    """Groups a swarm of ``swarm_size`` peers averages in (1: a single group)."""
    if swarm_size <= group_size:
        return 1
    return -(-swarm_size // group_size)


def group_index(peer_id: PeerID, groups: int) -> int:
    """The group ``peer_id`` joins when the swarm splits into ``groups`` (uniform).

    The same at every step while the number of groups stays, so that a peer
    keeps its group mates and their connections from step to step.
    """
    digest = hashlib.sha256(b"p2ptrain-group\0" + peer_id.digest).digest()
    return int.from_bytes(digest[:8], "big") % groups


def slice_bounds(num_elements: int, slices: int) -> list[int]:
    """``slices + 1`` boundaries cutting ``num_elements`` into near-equal slices."""
    return [num_elements * s // slices for s in range(slices + 1)]


@dataclass(frozen=True)
class GroupedResult:
    """How one peer's grouped averaging went.

    Attributes:
        groups: Groups the swarm was split into (1: one group, no columns).
        group: The group plan (its members and the LP's shares).
        group_weight: Total weight the group's average holds.
        group_counted: Members of the group whose values are in every part of
            the group's average.
        complete: Every part of the result is the global average (every
            phase succeeded for every slice).
        failures: What failed, per phase and slice.
        bytes_sent: Tensor bytes this peer sent over all phases.
        reports: The all-reduce reports: group, columns, gather.
        represented: The group members whose values this peer's slices
            carried into their columns with the group's weight (empty when
            its weight was 0).
        settled: For each slice this peer covered and settled (its column
            complete, with the group's weight), the column's members: with
            every member's ``represented``, who is in that slice's average
            (the simulator measures each slice against it).
    """

    groups: int
    group: GroupPlan
    group_weight: float
    group_counted: tuple[PeerID, ...]
    complete: bool
    failures: tuple[str, ...] = ()
    bytes_sent: int = 0
    reports: tuple[AllReduceReport, ...] = field(default=(), repr=False)
    represented: tuple[PeerID, ...] = ()
    settled: tuple[tuple[int, tuple[PeerID, ...]], ...] = ()


class GroupedAverager:
    """Averages one vector per step with a swarm of any size (see the module docstring).

    Args:
        matchmaker: This peer's matchmaker (its ``config`` is adjusted per phase).
        service: This peer's all-reduce service.
        config: Group size and windows.
    """

    def __init__(
        self,
        *,
        matchmaker: Matchmaker,
        service: AllReduceService,
        config: GroupingConfig | None = None,
    ) -> None:
        self.matchmaker = matchmaker
        self.service = service
        self.config = config or GroupingConfig()
        self._base = matchmaker.config

    async def average(
        self,
        key: str,
        vector: torch.Tensor,
        weight: float,
        *,
        swarm_size: int,
        allreduce: AllReduceConfig | None = None,
    ) -> tuple[torch.Tensor, GroupedResult]:
        """Average ``vector`` (flat float32) with the swarm, weighted by ``weight``.

        Args:
            key: The step's matchmaking key; every peer of the step uses the same.
            vector: This peer's flat float32 vector (not modified).
            weight: Its weight (samples), finite and >= 0.
            swarm_size: The number of peers expected in the step (every peer
                should pass the same; it picks the number of groups).
            allreduce: Codec of the all-reduces (aggregation must be ``mean``).

        Raises:
            MatchmakingError: No group formed for this peer.
            ConfigError: Bad arguments.
        """
        if vector.dim() != 1 or vector.dtype != torch.float32:
            raise ConfigError("vector must be a flat float32 tensor")
        if not (math.isfinite(weight) and weight >= 0):
            raise ConfigError(f"weight must be finite and >= 0, got {weight!r}")
        if swarm_size < 1:
            raise ConfigError("swarm_size must be at least 1")
        config = allreduce or AllReduceConfig()
        if config.aggregation != "mean":
            raise ConfigError("grouped averaging needs the mean aggregation")
        cfg = self.config
        groups = group_count(swarm_size, cfg.group_size)
        me = self.matchmaker.dht.peer_id
        if groups == 1:
            self._set_target(swarm_size, self._base.window, alone_ok=False)
            plan = await self.matchmaker.form_group(key, num_elements=vector.numel())
            out, report = await self.service.allreduce(plan, vector, weight, config=config)
            counted = _counted(plan, report)
            return out, GroupedResult(
                groups=1,
                group=plan,
                group_weight=float("nan"),
                group_counted=counted,
                complete=report.complete,
                bytes_sent=report.bytes_sent,
                reports=(report,),
            )
        # 1. the group: average [w*x, w] with equal weights.
        index = group_index(me, groups)
        cap = math.ceil(cfg.max_group_factor * cfg.group_size)
        self._set_target(cap, cfg.group_window)
        n = vector.numel()
        plan = await self.matchmaker.form_group(f"{key}/g{index}", num_elements=n + 1)
        # The slices each member covers follow its share of the group's plan
        # (the LP's bandwidth balance carries over to the columns and the gather).
        slices = cfg.group_size
        bounds = slice_bounds(n, slices)
        edges = slice_edges(plan, slices)
        my_index = plan.index_of(me)
        if my_index is None:  # from_wire checked it; a plan always includes its receiver
            raise ConfigError("the group plan does not include this peer")
        mine = range(edges[my_index], edges[my_index + 1])
        # 2a. matchmake the columns while the group averages.
        self._set_target(groups, cfg.column_window)
        columns = {
            s: asyncio.get_running_loop().create_task(
                self._column_plan(key, s, bounds[s + 1] - bounds[s]), name=f"column:{s}"
            )
            for s in mine
        }
        try:
            augmented = torch.empty(n + 1, dtype=torch.float32)
            torch.mul(vector, weight, out=augmented[:n])
            augmented[n] = weight
            summed, group_report = await self.service.allreduce(plan, augmented, 1.0, config=config)
        except BaseException:
            for task in columns.values():
                task.cancel()
            await asyncio.gather(*columns.values(), return_exceptions=True)
            raise
        reports = [group_report]
        failures: list[str] = []
        settled: dict[int, tuple[PeerID, ...]] = {}  # covered slice -> its column's members
        contributors = _contributors_of(plan, group_report, n)
        if group_report.complete and contributors and summed[n] > 0:
            total = float(summed[n]) * len(contributors)
            average = summed[:n] / summed[n]
            counted = _counted(plan, group_report)
        else:  # take part in the columns without weight: receive the others' average
            failures.append("group: incomplete")
            total, average, counted = 0.0, vector.clone(), ()
        # 2b. one all-reduce per covered slice, weighted by the group's weight,
        # but only where this slice's average holds exactly the members the
        # weight counts: after a partial group round, members see different
        # parts averaged, and a slice paired with the wrong weight would
        # corrupt the column's result for every group.
        for s, task in columns.items():
            lo, hi = bounds[s], bounds[s + 1]
            slice_weight = total
            if total > 0 and _slice_contributors(plan, group_report, lo, hi) != contributors:
                slice_weight = 0.0
                failures.append(f"column {s}: the group's average of the slice is partial")
            try:
                column_plan = await task
                values, report = await self.service.allreduce(
                    column_plan, average[lo:hi].contiguous(), slice_weight, config=config
                )
            except P2PTrainError as exc:
                logger.info("column %d of %s failed: %s", s, key, exc)
                failures.append(f"column {s}: {exc}")
                continue
            reports.append(report)
            if not report.complete:
                failures.append(f"column {s}: incomplete")
            elif slice_weight > 0:
                settled[s] = tuple(m.peer_id for m in column_plan.members)
            average[lo:hi] = values
        # 3. the gather: each member's part is the slices it covered, each with its flag.
        gather = _gather_plan(plan, edges, bounds)
        flagged = _with_flags(average, bounds, settled)
        gathered, gather_report = await self.service.allreduce(
            gather, flagged, 1.0, config=config, gather_only=True
        )
        reports.append(gather_report)
        if not gather_report.complete:
            failures.append("gather: incomplete")
        out, flags = _without_flags(gathered, bounds)
        failures += [
            f"column {s}: not settled by the member that covered it"
            for s in range(slices)
            if s not in mine and flags[s] != 1.0 and gather_report.complete
        ]
        return out, GroupedResult(
            groups=groups,
            group=plan,
            group_weight=total,
            group_counted=counted,
            complete=not failures,
            failures=tuple(failures),
            bytes_sent=sum(r.bytes_sent for r in reports),
            reports=tuple(reports),
            represented=tuple(plan.members[i].peer_id for i in contributors) if total else (),
            settled=tuple(sorted(settled.items())),
        )

    async def _column_plan(self, key: str, index: int, num_elements: int) -> GroupPlan:
        return await self.matchmaker.form_group(f"{key}/s{index}", num_elements=num_elements)

    def _set_target(self, size: int, window: float, *, alone_ok: bool = True) -> None:
        """Gather up to ``size`` peers for ``window`` seconds.

        In the grouped phases a group or column of one is fine (hashing can
        leave a peer alone in its group; a column of one group is that group).
        """
        base = self._base
        low = 1 if alone_ok else base.min_group_size
        self.matchmaker.config = dataclasses.replace(
            base, target_group_size=max(low, size), min_group_size=low, window=window
        )


def slice_edges(plan: GroupPlan, slices: int) -> list[int]:
    """Which slices each member of ``plan`` covers: member ``i`` covers ``[e[i], e[i+1])``.

    Slices are dealt in proportion to the members' parts in the plan (largest
    remainder), so members without a part (client mode, or a zero share)
    cover none; every slice is covered exactly once.
    """
    sizes = [hi - lo for lo, hi in itertools.pairwise(plan.boundaries)]
    total = sum(sizes)
    if total == 0:
        raise ConfigError("the plan gives nobody a part")
    return shares_to_boundaries([size / total for size in sizes], slices)


def _gather_plan(plan: GroupPlan, edges: Sequence[int], bounds: Sequence[int]) -> GroupPlan:
    """The all-gather plan of a group: the same members, each owning its slices.

    The gathered vector holds every slice followed by its flag
    (:func:`_with_flags`), so slice ``s`` starts at ``bounds[s] + s``.
    """
    return dataclasses.replace(
        plan,
        round_id=hashlib.sha256(b"gather\0" + plan.round_id).digest()[:16],
        boundaries=tuple(bounds[e] + e for e in edges),
        predicted_time=None,
    )


def _with_flags(
    average: torch.Tensor, bounds: Sequence[int], settled: Collection[int]
) -> torch.Tensor:
    """``average`` with a flag after each slice: 1.0 for the ``settled`` slices, else 0.0."""
    slices = len(bounds) - 1
    flagged = torch.zeros(average.numel() + slices, dtype=average.dtype)
    for s in range(slices):
        lo, hi = bounds[s], bounds[s + 1]
        flagged[lo + s : hi + s] = average[lo:hi]
        flagged[hi + s] = 1.0 if s in settled else 0.0
    return flagged


def _without_flags(
    flagged: torch.Tensor, bounds: Sequence[int]
) -> tuple[torch.Tensor, list[float]]:
    """The inverse of :func:`_with_flags`: the vector and each slice's flag."""
    slices = len(bounds) - 1
    out = torch.empty(bounds[-1], dtype=flagged.dtype)
    flags = []
    for s in range(slices):
        lo, hi = bounds[s], bounds[s + 1]
        out[lo:hi] = flagged[lo + s : hi + s]
        flags.append(float(flagged[hi + s]))
    return out, flags


def _contributors_of(plan: GroupPlan, report: AllReduceReport, element: int) -> tuple[int, ...]:
    """Members whose values are in the average of ``element``."""
    for shard in report.shards:
        if shard.start <= element < shard.stop:
            found = shard.chunk_contributors[(element - shard.start) // plan.chunk_elements]
            return found or ()
    return ()


def _slice_contributors(
    plan: GroupPlan, report: AllReduceReport, lo: int, hi: int
) -> tuple[int, ...] | None:
    """The members in the average of every element of ``[lo, hi)``, if the same for all.

    ``None`` when some chunk there kept local values or chunks differ.
    """
    found: set[tuple[int, ...]] = set()
    step = plan.chunk_elements
    for shard in report.shards:
        if shard.stop <= lo or shard.start >= hi:
            continue
        first = (max(lo, shard.start) - shard.start) // step
        last = (min(hi, shard.stop) - 1 - shard.start) // step
        for chunk in shard.chunk_contributors[first : last + 1]:
            if not chunk:
                return None
            found.add(chunk)
    return found.pop() if len(found) == 1 else None


def _counted(plan: GroupPlan, report: AllReduceReport) -> tuple[PeerID, ...]:
    """Members whose values are in every part of the average."""
    sets = [set(c) for s in report.shards for c in s.chunk_contributors if c is not None]
    if not sets or len(sets) != sum(len(s.chunk_contributors) for s in report.shards):
        return ()
    common = set.intersection(*sets)
    return tuple(plan.members[i].peer_id for i in sorted(common))
