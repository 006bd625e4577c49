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
   slice with weight ``W``, followed by ``G`` profile entries: its part's
   tag at its group's index, zeros elsewhere. Every column holds one member
   of every group, so every slice comes out as ``Σ W_g a_g / Σ W_g``: the
   exact global weighted average, and its **profile** as ``Σ W_g t_g / Σ W_g``
   per group, which names the group parts and weights the column averaged.
3. **Gather.** The group all-gathers the slices (each member's own part is the
   slices it covered) under a plan every member derives from the group's
   plan, so this phase needs no matchmaking. Each slice travels with its
   **flag** (1 when the member that covered it got the column's average over
   the same members in every chunk, else 0) and its profile. So a member
   knows whether every slice it received is an exact average, and whether
   all slices hold the same group parts with the same weights (a group split
   in two by matchmaking has two parts, which a column can get one of).

A group enters the columns only when every chunk of its all-reduce averaged
the same members: each member decides from the contributors the owners
announced with their results, which are the same at every member, so the
group's slices all carry the same members with the same weight, or none does.

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
from collections.abc import Sequence
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
        max_share_factor: In the group phase no member aggregates more than
            this many equal shares of its group's vector
            (:attr:`~p2ptrain.allreduce.matchmaking.MatchmakingConfig.max_share_factor`).
            A member with share ``s`` of a group of ``n`` sends about
            ``(1 + s (2n - 1)) V`` in a grouped step (its parts out, its
            averages back in the group round and again in the gather, plus
            its columns), so the bound keeps the busiest peer's tensors near
            ``(1 + 2k) V``: 6.5 V at the default 2.75. Its DHT, matchmaking
            and handshakes add up to about 1 V more with a 1 MiB vector at
            512 peers, and issue 13 allows 8 V in all (at 3 the busiest
            simulated peer sent 8.003 V). ``None`` leaves the LP unbounded.
        min_part_share: A group part with fewer members than this share of
            the group's expected size (``swarm_size / groups``) stays out of
            the columns, and so out of the step (its members' results say
            so). Such a part split off its group in matchmaking (a peer that
            read its group's announcements after the leader had sealed it
            leads a part of its own). It covers every slice: with its
            weight, it reaches the columns that have not formed yet and
            misses the others, and every peer's result is incomplete; and
            even without weight, its announcement in every column counts
            toward the one-per-group that closes a column, which then forms
            without a group still on its way. Kept out, it costs only its own
            members' samples.
    """

    group_size: int = 32
    group_window: float = 1.0
    column_window: float = 10.0
    max_group_factor: float = 2.5
    max_share_factor: float | None = 2.75
    min_part_share: float = 0.5

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
        factor = self.max_share_factor
        if factor is not None and not (math.isfinite(factor) and factor >= 1):
            raise ConfigError(f"max_share_factor must be None or >= 1, got {factor!r}")
        if not (math.isfinite(self.min_part_share) and 0 <= self.min_part_share <= 1):
            raise ConfigError(f"min_part_share must be in [0, 1], got {self.min_part_share!r}")


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
            the group stayed out); every member that saw the whole group
            report names the same.
        settled: For each slice this peer covered and settled (its column
            averaged every chunk over the same members), those members.
        groups_in: When complete: the groups whose averages every slice of
            the result holds (the slices' profiles agree). The result is then
            the exact weighted average of those groups' ``represented``.
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
    groups_in: tuple[int, ...] = ()


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
        self._set_target(cap, cfg.group_window, max_share_factor=cfg.max_share_factor)
        n = vector.numel()
        plan = await self.matchmaker.form_group(f"{key}/g{index}", num_elements=n + 1)
        expected_size = swarm_size / groups
        if plan.size < cfg.min_part_share * expected_size:
            # A part split off its group: it stays out of the columns (see
            # GroupingConfig.min_part_share), and so out of the step.
            return vector.clone(), GroupedResult(
                groups=groups,
                group=plan,
                group_weight=0.0,
                group_counted=(),
                complete=False,
                failures=(
                    f"group: a part of {plan.size} split off its group (expected about "
                    f"{expected_size:.0f}): it stays out of the columns",
                ),
            )
        # The slices each member covers follow its share of the group's plan
        # (the LP's bandwidth balance carries over to the columns and the gather).
        slices = cfg.group_size
        bounds = slice_bounds(n, slices)
        edges = slice_edges(plan, slices)
        my_index = plan.index_of(me)
        if my_index is None:  # from_wire checked it; a plan always includes its receiver
            raise ConfigError("the group plan does not include this peer")
        mine = range(edges[my_index], edges[my_index + 1])
        # 2a. matchmake the columns while the group averages. A column gathers
        # until every group has a member in it, but takes every member that
        # announced by then (a group split in two by a late announcement
        # covers each slice twice; cutting one out would fail that column).
        # A column averages its slice followed by the groups' profile entries.
        self._set_target(2 * groups, cfg.column_window)
        columns = {
            s: asyncio.get_running_loop().create_task(
                self._column_plan(key, s, bounds[s + 1] - bounds[s] + groups, groups),
                name=f"column:{s}",
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
        settled: dict[int, tuple[PeerID, ...]] = {}  # covered slice -> its column's contributors
        # Whether the group's average enters the columns, decided by every
        # member from the same information: the contributors each owner
        # announced with each chunk's result (identical at every member that
        # received it). The group is in only when every chunk of the vector,
        # the weight's included, averaged the same members; otherwise every
        # member that saw the whole report joins its columns with weight 0.
        # A member that missed a result cannot tell and stays out too; should
        # its group mates be in, the slices' profiles (in the gather) show
        # the mismatch to every peer, whose result is then incomplete.
        contributors = _common_contributors(group_report)
        if contributors and summed[n] > 0:
            total = float(summed[n]) * len(contributors)
            average = summed[:n] / summed[n]
            counted = tuple(plan.members[i].peer_id for i in contributors)
        else:  # take part in the columns without weight: receive the others' average
            failures.append("group: not every part averaged the same members")
            total, average, counted = 0.0, vector.clone(), ()
        # This group part's entry in every column's weight profile (see _same_profiles).
        entry = torch.zeros(groups, dtype=torch.float32)
        entry[index] = _part_tag(plan)
        profiles: dict[int, list[float]] = {}  # covered slice -> its column's weight profile

        # 2b. one all-reduce per covered slice, weighted by the group's weight,
        # all at once: each waits for its column's slowest member, and a member
        # that covers several slices would otherwise add those waits up.
        async def column_round(s: int) -> tuple[GroupPlan, torch.Tensor, AllReduceReport]:
            lo, hi = bounds[s], bounds[s + 1]
            column_plan = await columns[s]
            values, report = await self.service.allreduce(
                column_plan, torch.cat([average[lo:hi], entry]), total, config=config
            )
            return column_plan, values, report

        outcomes = await asyncio.gather(*(column_round(s) for s in columns), return_exceptions=True)
        for s, outcome in zip(columns, outcomes, strict=True):
            lo, hi = bounds[s], bounds[s + 1]
            if isinstance(outcome, P2PTrainError):
                logger.info("column %d of %s failed: %s", s, key, outcome)
                failures.append(f"column {s}: {outcome}")
                continue
            if isinstance(outcome, BaseException):
                raise outcome
            column_plan, values, report = outcome
            reports.append(report)
            column = _common_contributors(report)
            if column is None:
                failures.append(f"column {s}: incomplete")
            elif column:  # every group's weight 0: the slice holds nobody's values
                settled[s] = tuple(column_plan.members[i].peer_id for i in column)
                profiles[s] = values[hi - lo :].tolist()
            average[lo:hi] = values[: hi - lo]
        # 3. the gather: each member's part is the slices it covered, each with
        # its flag and its column's weight profile.
        tail = 1 + groups
        gather = _gather_plan(plan, edges, bounds, tail)
        flagged = _with_tails(average, bounds, profiles, tail)
        gathered, gather_report = await self.service.allreduce(
            gather, flagged, 1.0, config=config, gather_only=True
        )
        reports.append(gather_report)
        if not gather_report.complete:
            failures.append("gather: incomplete")
        out, tails = _without_tails(gathered, bounds, tail)
        failures += [
            f"column {s}: not settled by the member that covered it"
            for s in range(slices)
            if s not in mine and tails[s][0] != 1.0 and gather_report.complete
        ]
        groups_in: tuple[int, ...] = ()
        if not failures:
            profile = [t[1:] for t in tails]
            if _same_profiles(profile):
                groups_in = tuple(g for g, value in enumerate(profile[0]) if value != 0.0)
            else:
                failures.append("gather: the slices hold different parts or weights of groups")
        return out, GroupedResult(
            groups=groups,
            group=plan,
            group_weight=total,
            group_counted=counted,
            complete=not failures,
            failures=tuple(failures),
            bytes_sent=sum(r.bytes_sent for r in reports),
            reports=tuple(reports),
            represented=counted,
            settled=tuple(sorted(settled.items())),
            groups_in=groups_in,
        )

    async def _column_plan(self, key: str, index: int, num_elements: int, groups: int) -> GroupPlan:
        # A column is due when every group has a member in it, not when G
        # members announced (two parts of a split group are two members).
        return await self.matchmaker.form_group(
            f"{key}/s{index}",
            num_elements=num_elements,
            expected=groups,
            count_by=lambda peer: group_index(peer, groups),
        )

    def _set_target(
        self,
        size: int,
        window: float,
        *,
        alone_ok: bool = True,
        max_share_factor: float | None = None,
    ) -> None:
        """Gather up to ``size`` peers for ``window`` seconds.

        In the grouped phases a group or column of one is fine (hashing can
        leave a peer alone in its group; a column of one group is that group).
        ``max_share_factor`` bounds the plan's shares in the group phase; the
        other phases keep the base configuration's.
        """
        base = self._base
        low = 1 if alone_ok else base.min_group_size
        factor = base.max_share_factor if max_share_factor is None else max_share_factor
        self.matchmaker.config = dataclasses.replace(
            base,
            target_group_size=max(low, size),
            min_group_size=low,
            window=window,
            max_share_factor=factor,
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


def _part_tag(plan: GroupPlan) -> float:
    """A number in [1, 2) naming the group part that ``plan`` formed (the same at every member)."""
    digest = hashlib.sha256(b"p2ptrain-part\0" + plan.round_id).digest()
    return 1.0 + int.from_bytes(digest[:3], "big") / (1 << 24)


PROFILE_TOLERANCE = 1e-5
"""Relative difference below which two columns' weight profiles count as equal.

A profile entry is ``Σ W·tag / Σ W`` over the column's parts of one group, in
float32: rounding differs between columns (their reducers add in arrival
order) by a few 1e-7; a part missing from one column changes its group's
entry by at least ``W_part / W_group`` of it (one sample in a group's
thousands: 1e-4 and more)."""


def _same_profiles(profiles: Sequence[Sequence[float]]) -> bool:
    """Whether every slice's column averaged the same group parts with the same weights.

    Each column averages, besides its slice, one entry per group: a part
    contributes its tag (:func:`_part_tag`) at its group's index, weighted by
    its weight like its values. Two columns that hold the same parts with the
    same weights get the same profile; a part of a group split in two by
    matchmaking that reached one column and not another changes its group's
    entry.
    """
    first = profiles[0]
    for other in profiles[1:]:
        for a, b in zip(first, other, strict=True):
            if (a == 0.0) != (b == 0.0) or abs(a - b) > PROFILE_TOLERANCE * max(abs(a), abs(b)):
                return False
    return True


def _gather_plan(
    plan: GroupPlan, edges: Sequence[int], bounds: Sequence[int], tail: int
) -> GroupPlan:
    """The all-gather plan of a group: the same members, each owning its slices.

    The gathered vector holds every slice followed by its ``tail`` floats
    (:func:`_with_tails`), so slice ``s`` starts at ``bounds[s] + s * tail``.
    """
    return dataclasses.replace(
        plan,
        round_id=hashlib.sha256(b"gather\0" + plan.round_id).digest()[:16],
        boundaries=tuple(bounds[e] + e * tail for e in edges),
        predicted_time=None,
    )


def _with_tails(
    average: torch.Tensor, bounds: Sequence[int], profiles: dict[int, list[float]], tail: int
) -> torch.Tensor:
    """``average`` with ``tail`` floats after each slice: its flag (1.0: settled) and profile.

    Slices not in ``profiles`` (not settled here) get zeros.
    """
    slices = len(bounds) - 1
    flagged = torch.zeros(average.numel() + slices * tail, dtype=average.dtype)
    for s in range(slices):
        lo, hi = bounds[s], bounds[s + 1]
        flagged[lo + s * tail : hi + s * tail] = average[lo:hi]
        profile = profiles.get(s)
        if profile is not None:
            at = hi + s * tail
            flagged[at : at + tail] = torch.tensor([1.0, *profile], dtype=average.dtype)
    return flagged


def _without_tails(
    flagged: torch.Tensor, bounds: Sequence[int], tail: int
) -> tuple[torch.Tensor, list[list[float]]]:
    """The inverse of :func:`_with_tails`: the vector and each slice's tail."""
    slices = len(bounds) - 1
    out = torch.empty(bounds[-1], dtype=flagged.dtype)
    tails = []
    for s in range(slices):
        lo, hi = bounds[s], bounds[s + 1]
        out[lo:hi] = flagged[lo + s * tail : hi + s * tail]
        at = hi + s * tail
        tails.append(flagged[at : at + tail].tolist())
    return out, tails


def _common_contributors(report: AllReduceReport) -> tuple[int, ...] | None:
    """The members in the average of every chunk of the vector, if the same for all.

    ``None`` when some chunk's result is missing or chunks differ; ``()``
    when every chunk was averaged over nobody (every weight 0).
    """
    found: set[tuple[int, ...]] = set()
    for shard in report.shards:
        for chunk in shard.chunk_contributors:
            if chunk is None:
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
