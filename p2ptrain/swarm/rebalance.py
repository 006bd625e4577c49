"""Adaptive rebalancing: peers move from over-served stages to the bottleneck.

Theory of operation
-------------------
A pipeline runs no faster than its slowest stage, and a stage serves as
fast as the summed capacity of its peers (each peer's samples/s while busy;
the trainers' wiring shares the work in proportion to it). So the swarm's
throughput is ``min over stages of the summed capacity`` and the only way
to raise it is to add capacity to the stage holding that minimum.

Every period, each peer reads every peer's announcement (:class:`PeerLoad`:
stage, capacity, queue) and computes the same **plan** (:func:`plan_moves`):
greedily, while the best single move from any stage that keeps a peer to
the current bottleneck raises the predicted pipeline throughput by more
than ``min_gain`` (relative), apply it to the predicted assignment. The
plan is deterministic, so every peer that sees the same announcements
computes the same one; but a peer does not know whether the others will
act on it (their views differ by propagation delay), so peers do not take
"their" planned slot. Instead (:func:`decide`) each eligible peer of a
source stage moves to a target with probability ``planned capacity from
source to target ÷ eligible capacity of the source``: the expected capacity
that leaves equals the plan's, whichever peers end up moving, and the next
period corrects the random error. This staggers the moves: a rich stage
does not empty itself in one period because all its peers saw the same gap.

Guarantees, each checked by property tests:

* **never empties a stage**: the *keeper* of each stage (the peer with the
  smallest id among its announced peers) never moves, and the plan never
  takes a stage's last peer;
* **never moves without gain**: if no single move raises the predicted
  throughput by more than ``min_gain``, the plan is empty and no peer moves;
* **hysteresis**: a move is only planned when it beats ``min_gain``, and
  moving back would lower the minimum, so a settled swarm stays settled;
  a peer that moved also sits out ``cooldown_periods`` periods
  (:class:`Rebalancer`) while its new capacity gets measured.

A stage's cost (``stage_costs``, relative compute per sample) converts a
peer's capacity in its stage into its predicted capacity elsewhere: the
same device serves a stage twice as costly half as fast. Optionally
(DTFM's idea) a peer weighs its measured links: ``link_samples_per_s[t]``
caps what it could deliver in stage ``t`` (the samples/s its links to
``t``'s neighbouring stages carry), so a well-connected peer is preferred
for a stage whose traffic its links can carry.

A peer that has not measured its capacity yet (it announces 0 until its
first backward) counts at the median measured capacity
(:func:`estimate_unmeasured`): at a cold start, or when newcomers join, a
stage whose peers are warming up does not look unserved.

Queues break ties: among stages of equal capacity, the one with the longest
queue per unit of capacity counts as the bottleneck.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

from p2ptrain.dht.api import DHT
from p2ptrain.errors import ConfigError, P2PTrainError
from p2ptrain.swarm.directory import read_stage_or_empty

__all__ = [
    "Decision",
    "Move",
    "PeerLoad",
    "RebalanceConfig",
    "Rebalancer",
    "decide",
    "estimate_unmeasured",
    "newcomer_stage",
    "pipeline_throughput",
    "plan_moves",
    "read_loads",
    "stage_capacity",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PeerLoad:
    """One peer's announcement, as the rebalancing policy reads it.

    Attributes:
        peer: The peer's id (any string that orders the same for everyone,
            e.g. the PeerID's hex form).
        stage: The stage it serves, in ``[0, stages)``.
        throughput: Its capacity in that stage: samples/s while busy.
        queue: Micro-batches waiting at it (forward and backward).
    """

    peer: str
    stage: int
    throughput: float
    queue: int = 0

    def __post_init__(self) -> None:
        if self.stage < 0:
            raise ConfigError(f"stage must be >= 0, got {self.stage}")
        if not (math.isfinite(self.throughput) and self.throughput >= 0):
            raise ConfigError(f"throughput must be finite and >= 0, got {self.throughput!r}")
        if self.queue < 0:
            raise ConfigError(f"queue must be >= 0, got {self.queue}")


@dataclass(frozen=True)
class RebalanceConfig:
    """How peers rebalance.

    Attributes:
        stages: Number of stages.
        period_s: Seconds between two rebalancing decisions of a peer.
        min_gain: A move is planned only when it raises the predicted pipeline
            throughput by more than this fraction (0.05 = 5 %).
        cooldown_periods: Periods a peer that moved sits out before it may
            move again (its new capacity is being measured meanwhile).
        jitter: Each period lasts ``period_s`` times a uniform factor in
            ``[1 - jitter, 1 + jitter]``, so peers do not decide in lockstep.
        stage_costs: Relative compute per sample of each stage (empty: all
            equal). A peer's capacity in stage ``t`` is predicted as its
            capacity in its stage times ``cost[stage] / cost[t]``.
        max_moves: Most moves one plan may hold (bounds the planning work).
    """

    stages: int
    period_s: float = 30.0
    min_gain: float = 0.05
    cooldown_periods: int = 1
    jitter: float = 0.2
    stage_costs: tuple[float, ...] = ()
    max_moves: int = 256

    def __post_init__(self) -> None:
        if self.stages < 1:
            raise ConfigError(f"stages must be >= 1, got {self.stages}")
        if not (math.isfinite(self.period_s) and self.period_s > 0):
            raise ConfigError(f"period_s must be positive, got {self.period_s!r}")
        if not (math.isfinite(self.min_gain) and self.min_gain >= 0):
            raise ConfigError(f"min_gain must be >= 0, got {self.min_gain!r}")
        if self.cooldown_periods < 0:
            raise ConfigError(f"cooldown_periods must be >= 0, got {self.cooldown_periods}")
        if not 0 <= self.jitter < 1:
            raise ConfigError(f"jitter must be in [0, 1), got {self.jitter!r}")
        if self.stage_costs and len(self.stage_costs) != self.stages:
            raise ConfigError("stage_costs must be empty or hold one cost per stage")
        if any(not (math.isfinite(c) and c > 0) for c in self.stage_costs):
            raise ConfigError("stage_costs must be positive")
        if self.max_moves < 1:
            raise ConfigError(f"max_moves must be >= 1, got {self.max_moves}")

    def cost(self, stage: int) -> float:
        """Relative compute per sample of ``stage``."""
        return self.stage_costs[stage] if self.stage_costs else 1.0


@dataclass(frozen=True, slots=True)
class Move:
    """One planned move."""

    peer: str
    source: int
    target: int
    throughput: float
    """The peer's capacity in its source stage."""


@dataclass(frozen=True, slots=True)
class Decision:
    """What one peer decided this period.

    Attributes:
        target: The stage to move to, or None to stay.
        current: Predicted pipeline throughput now (samples/s).
        planned: Predicted pipeline throughput after the whole plan.
        probability: This peer's probability of moving (0 when it may not).
        reason: A short human-readable account.
    """

    target: int | None
    current: float
    planned: float
    probability: float
    reason: str


def stage_capacity(loads: Sequence[PeerLoad], stages: int) -> list[float]:
    """Summed capacity of each stage's announced peers."""
    totals = [0.0] * stages
    for load in loads:
        if load.stage < stages:
            totals[load.stage] += load.throughput
    return totals


def pipeline_throughput(loads: Sequence[PeerLoad], stages: int) -> float:
    """The pipeline's predicted throughput: the minimum over stages of summed capacity."""
    return min(stage_capacity(loads, stages))


def keepers(loads: Sequence[PeerLoad]) -> dict[int, str]:
    """Each stage's keeper: its announced peer with the smallest id (never moves)."""
    found: dict[int, str] = {}
    for load in loads:
        if load.stage not in found or load.peer < found[load.stage]:
            found[load.stage] = load.peer
    return found


def newcomer_stage(loads: Sequence[PeerLoad], stages: int, rng: random.Random | None = None) -> int:
    """The stage a peer that joins should serve.

    An unserved stage first; otherwise a stage of least summed capacity, where
    unmeasured peers count at the median measured capacity
    (:func:`estimate_unmeasured`), so a stage that newcomers just joined does
    not keep looking empty. With ``rng`` the choice is drawn among the stages
    within one typical peer (the median capacity) of the least, so peers that
    join together, from the same view of the directory, spread over the stages
    that need them instead of piling on one; without it, the lowest index wins.
    """
    estimated = estimate_unmeasured(loads)
    totals = stage_capacity(estimated, stages)
    counts = [0] * stages
    for load in loads:
        if load.stage < stages:
            counts[load.stage] += 1
    unserved = [s for s in range(stages) if counts[s] == 0]
    if unserved:
        return unserved[0] if rng is None else rng.choice(unserved)
    if rng is None:
        return min(range(stages), key=lambda s: (totals[s], counts[s], s))
    speeds = sorted(load.throughput for load in estimated if load.stage < stages)
    typical = speeds[len(speeds) // 2]
    least = min(totals)
    near = [s for s in range(stages) if totals[s] < least + typical or totals[s] == least]
    return rng.choice(near)


async def read_loads(dht: DHT, run_id: str, stages: int) -> list[PeerLoad]:
    """Every stage's announced peers from the stage directory, one :class:`PeerLoad`
    a peer (a peer that just moved and lingers under its old stage counts once; a
    stage that cannot be read counts as unserved)."""
    found = await asyncio.gather(*(read_stage_or_empty(dht, run_id, s) for s in range(stages)))
    loads: dict[str, PeerLoad] = {}
    for entries in found:
        for a in entries:
            load = PeerLoad(str(a.peer_id), a.stage, a.samples_per_s, a.queue)
            loads[load.peer] = load
    return list(loads.values())


def _predicted(
    load: PeerLoad,
    target: int,
    config: RebalanceConfig,
    links: Mapping[str, Mapping[int, float]],
) -> float:
    speed = load.throughput * config.cost(load.stage) / config.cost(target)
    cap = links.get(load.peer, {}).get(target)
    return speed if cap is None else min(speed, cap)


def _bottleneck(totals: Sequence[float], queues: Sequence[int]) -> int:
    def key(stage: int) -> tuple[float, float]:
        pressure = queues[stage] / totals[stage] if totals[stage] > 0 else math.inf
        return (totals[stage], -pressure)

    return min(range(len(totals)), key=key)


def estimate_unmeasured(loads: Sequence[PeerLoad]) -> list[PeerLoad]:
    """``loads`` with each unmeasured peer (capacity 0: no backward done yet, e.g. at a
    cold start or a newcomer) counted at the median measured capacity, so that a stage
    whose peers are still warming up does not look unserved and draw peers to it."""
    measured = sorted(load.throughput for load in loads if load.throughput > 0)
    if not measured or len(measured) == len(loads):
        return list(loads)
    median = measured[len(measured) // 2]
    return [
        load if load.throughput > 0 else PeerLoad(load.peer, load.stage, median, load.queue)
        for load in loads
    ]


def plan_moves(
    loads: Sequence[PeerLoad],
    config: RebalanceConfig,
    *,
    links: Mapping[str, Mapping[int, float]] | None = None,
) -> list[Move]:
    """The greedy plan every peer computes from the same announcements.

    Each round takes the bottleneck stage ``b`` and, trying the other stages
    from the richest down, the first that can give a peer (not its keeper,
    not already moved, not its last) whose move is *useful*: both ``b`` and
    the source end above ``b``'s old capacity. Among that stage's useful
    peers it moves the one that leaves the pair best balanced (the highest
    ``min(source after, b after)``). Several stages can tie at the bottom,
    so single moves may not raise the minimum at once; the plan is kept only
    if all its moves together raise the predicted pipeline throughput by
    more than ``min_gain`` (or serve a stage nobody served), else it is empty.

    Args:
        loads: Every announced peer (a peer announcing a stage outside
            ``[0, stages)`` is ignored).
        config: Stages, costs, threshold.
        links: Optional per-peer caps (peer -> stage -> samples/s its links
            to that stage's neighbours carry).
    """
    links = links or {}
    peers = [load for load in loads if load.stage < config.stages]
    stage_of = {load.peer: load.stage for load in peers}
    keep = set(keepers(peers).values())
    totals = stage_capacity(peers, config.stages)
    before = min(totals)
    unserved = sum(1 for t in totals if t <= 0)
    queues = [0] * config.stages
    counts = [0] * config.stages
    for load in peers:
        queues[load.stage] += load.queue
        counts[load.stage] += 1
    moves: list[Move] = []
    moved: set[str] = set()
    while len(moves) < config.max_moves:
        b = _bottleneck(totals, queues)
        pick = _useful_move(
            peers,
            stage_of=stage_of,
            b=b,
            totals=totals,
            counts=counts,
            fixed=keep | moved,
            config=config,
            links=links,
        )
        if pick is None:
            break
        load, gained = pick
        s = stage_of[load.peer]
        totals[s] -= load.throughput
        totals[b] += gained
        counts[s] -= 1
        counts[b] += 1
        moved.add(load.peer)
        stage_of[load.peer] = b
        moves.append(Move(peer=load.peer, source=s, target=b, throughput=load.throughput))
    after = min(totals)
    beats = after > before and after > before * (1 + config.min_gain)
    fills = sum(1 for t in totals if t <= 0) < unserved
    return moves if beats or fills else []


def _useful_move(
    peers: Sequence[PeerLoad],
    *,
    stage_of: Mapping[str, int],
    b: int,
    totals: Sequence[float],
    counts: Sequence[int],
    fixed: set[str],
    config: RebalanceConfig,
    links: Mapping[str, Mapping[int, float]],
) -> tuple[PeerLoad, float] | None:
    """The best useful move to ``b`` from the richest stage that has one."""
    for s in sorted((i for i in range(len(totals)) if i != b), key=lambda i: -totals[i]):
        if counts[s] <= 1 or totals[s] <= totals[b]:
            continue
        best: tuple[tuple[float, float], PeerLoad, float] | None = None
        for load in peers:
            if stage_of[load.peer] != s or load.peer in fixed:
                continue
            gained = _predicted(load, b, config, links)
            left = totals[s] - load.throughput
            if gained <= 0 or left <= totals[b]:
                continue
            score = (min(left, totals[b] + gained), -load.throughput)
            if best is None or score > best[0]:
                best = (score, load, gained)
        if best is not None:
            return best[1], best[2]
    return None


def decide(
    me: str,
    loads: Sequence[PeerLoad],
    config: RebalanceConfig,
    rng: random.Random,
    *,
    links: Mapping[str, Mapping[int, float]] | None = None,
    eagerness: float = 1.0,
    plan: Sequence[Move] | None = None,
) -> Decision:
    """Whether peer ``me`` moves this period, and where to (see the module docstring).

    Args:
        me: This peer's id; it must be among ``loads``.
        loads: Every announced peer, this one included.
        config: The rebalancing configuration.
        rng: The random source of the staggered draw.
        links: Optional link caps (see :func:`plan_moves`).
        eagerness: Factor in ``(0, 1]`` on every probability (below 1 the
            swarm moves more slowly but overshoots less).
        plan: The plan of these very ``loads`` when the caller already has
            it (a simulation deciding for many peers); computed otherwise.
    """
    if not 0 < eagerness <= 1:
        raise ConfigError(f"eagerness must be in (0, 1], got {eagerness!r}")
    peers = [load for load in loads if load.stage < config.stages]
    mine = next((load for load in peers if load.peer == me), None)
    if mine is None:
        raise ConfigError(f"peer {me!r} is not among the announcements")
    totals = stage_capacity(peers, config.stages)
    current = min(totals)
    moves = list(plan) if plan is not None else plan_moves(peers, config, links=links)
    planned = _after(totals, moves, peers, config, links or {})
    if not moves:
        return Decision(None, current, current, 0.0, "no move beats the threshold")
    if keepers(peers)[mine.stage] == me:
        return Decision(None, current, planned, 0.0, "keeper of its stage")
    leaving = [m for m in moves if m.source == mine.stage]
    if not leaving:
        return Decision(None, current, planned, 0.0, "its stage gives no peer")
    keep = keepers(peers)[mine.stage]
    eligible = sum(p.throughput for p in peers if p.stage == mine.stage and p.peer != keep)
    by_target: dict[int, float] = {}
    for m in leaving:
        by_target[m.target] = by_target.get(m.target, 0.0) + m.throughput
    draw = rng.random()
    total = 0.0
    for target, capacity in sorted(by_target.items()):
        share = eagerness * capacity / eligible if eligible > 0 else 0.0
        total += share
        if draw < total:
            return Decision(target, current, planned, share, f"drawn for stage {target}")
    return Decision(None, current, planned, min(1.0, total), "not drawn this period")


def _after(
    totals: Sequence[float],
    moves: Sequence[Move],
    loads: Sequence[PeerLoad],
    config: RebalanceConfig,
    links: Mapping[str, Mapping[int, float]],
) -> float:
    after = list(totals)
    by_peer = {load.peer: load for load in loads}
    for m in moves:
        after[m.source] -= m.throughput
        after[m.target] += _predicted(by_peer[m.peer], m.target, config, links)
    return min(after)


class Rebalancer:
    """Every period, read the announcements, decide, and call ``move_to`` on a move.

    Args:
        me: This peer's id (as in its announcements).
        config: The rebalancing configuration.
        read_loads: Returns every peer's current announcement.
        move_to: Moves this peer to a stage (e.g. ``StageServer.move_to``).
        rng: Random source (staggering and period jitter).
        links: Optional callable returning this swarm's link caps.
    """

    def __init__(
        self,
        *,
        me: str,
        config: RebalanceConfig,
        read_loads: Callable[[], Awaitable[Sequence[PeerLoad]]],
        move_to: Callable[[int], Awaitable[object]],
        rng: random.Random | None = None,
        links: Callable[[], Mapping[str, Mapping[int, float]]] | None = None,
    ) -> None:
        self.me = me
        self.config = config
        self._read = read_loads
        self._move_to = move_to
        self._rng = rng or random.Random()
        self._links = links
        self._cooldown = 0
        self.moves = 0
        self.last: Decision | None = None

    async def step(self) -> Decision | None:
        """One period's decision (and move); None while cooling down."""
        if self._cooldown > 0:
            self._cooldown -= 1
            return None
        loads = await self._read()
        if not any(load.peer == self.me for load in loads):
            return None  # not announced yet: nothing to decide from
        links = self._links() if self._links is not None else None
        loads = estimate_unmeasured(loads)
        decision = decide(self.me, loads, self.config, self._rng, links=links)
        self.last = decision
        if decision.target is not None:
            log.info(
                "rebalancing: moving to stage %d (pipeline %.2f -> planned %.2f samples/s)",
                decision.target,
                decision.current,
                decision.planned,
            )
            await self._move_to(decision.target)
            self.moves += 1
            self._cooldown = self.config.cooldown_periods
        return decision

    async def run(self) -> None:
        """Decide every period until cancelled (a failed read or move is logged; the
        next period tries again)."""
        jitter = self.config.jitter
        while True:
            await asyncio.sleep(self.config.period_s * self._rng.uniform(1 - jitter, 1 + jitter))
            try:
                await self.step()
            except P2PTrainError as exc:
                log.warning("rebalancing: this period's decision failed: %s", exc)
