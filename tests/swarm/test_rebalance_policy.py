"""The rebalancing policy: never empties a stage, never moves without gain, converges."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.errors import ConfigError
from p2ptrain.swarm.rebalance import (
    PeerLoad,
    RebalanceConfig,
    Rebalancer,
    decide,
    estimate_unmeasured,
    newcomer_stage,
    pipeline_throughput,
    plan_moves,
    stage_capacity,
)


class _AlwaysDraw(random.Random):
    """A random source whose every draw is 0: each peer with any chance moves."""

    def random(self) -> float:
        return 0.0


def _loads(counts: Sequence[int], speeds: Sequence[float] | None = None) -> list[PeerLoad]:
    loads = []
    n = 0
    for stage, count in enumerate(counts):
        for _ in range(count):
            speed = speeds[n % len(speeds)] if speeds else 1.0
            loads.append(PeerLoad(peer=f"p{n:04d}", stage=stage, throughput=speed))
            n += 1
    return loads


def _period(
    loads: list[PeerLoad], config: RebalanceConfig, rng: random.Random
) -> tuple[list[PeerLoad], int]:
    """Every peer decides on the same snapshot; the moves apply together."""
    out = []
    moved = 0
    plan = plan_moves(loads, config)
    for load in loads:
        decision = decide(load.peer, loads, config, rng, plan=plan)
        if decision.target is not None:
            speed = load.throughput * config.cost(load.stage) / config.cost(decision.target)
            out.append(PeerLoad(load.peer, decision.target, speed))
            moved += 1
        else:
            out.append(load)
    return out, moved


swarms = st.integers(2, 6).flatmap(
    lambda stages: st.tuples(
        st.just(stages),
        st.lists(st.integers(1, 12), min_size=stages, max_size=stages),
        st.lists(st.floats(0.25, 8.0), min_size=1, max_size=16),
        st.floats(0.0, 0.5),
        st.integers(0, 2**32),
    )
)


@settings(max_examples=150, deadline=None)
@given(swarms)
def test_no_draw_ever_empties_a_stage(
    swarm: tuple[int, list[int], list[float], float, int],
) -> None:
    stages, counts, speeds, gain, _ = swarm
    config = RebalanceConfig(stages=stages, min_gain=gain)
    loads = _loads(counts, speeds)
    after, _ = _period(loads, config, _AlwaysDraw())  # the worst case: everyone drawn
    assert all(sum(1 for p in after if p.stage == s) >= 1 for s in range(stages))


@settings(max_examples=150, deadline=None)
@given(swarms)
def test_no_peer_moves_when_even_a_perfect_split_gains_less_than_the_threshold(
    swarm: tuple[int, list[int], list[float], float, int],
) -> None:
    stages, counts, speeds, _, seed = swarm
    loads = _loads(counts, speeds)
    current = pipeline_throughput(loads, stages)
    # no assignment can beat total / stages (equal costs), so this is the best gain there is
    best_gain = sum(stage_capacity(loads, stages)) / stages / current - 1
    config = RebalanceConfig(stages=stages, min_gain=best_gain + 1e-9)
    assert plan_moves(loads, config) == []
    after, moved = _period(loads, config, random.Random(seed))
    assert moved == 0 and after == loads


@settings(max_examples=150, deadline=None)
@given(swarms)
def test_a_plan_predicts_more_than_the_threshold(
    swarm: tuple[int, list[int], list[float], float, int],
) -> None:
    stages, counts, speeds, gain, _ = swarm
    loads = _loads(counts, speeds)
    config = RebalanceConfig(stages=stages, min_gain=gain)
    moves = plan_moves(loads, config)
    if moves:
        totals = stage_capacity(loads, stages)
        for m in moves:
            totals[m.source] -= m.throughput
            totals[m.target] += m.throughput
        assert min(totals) > pipeline_throughput(loads, stages) * (1 + gain)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 8).flatmap(
        lambda stages: st.tuples(
            st.just(stages),
            st.lists(st.integers(1, 30), min_size=stages, max_size=stages),
            st.integers(0, 2**32),
        )
    )
)
def test_equal_peers_converge_to_the_best_split_and_stay(
    swarm: tuple[int, list[int], int],
) -> None:
    stages, counts, seed = swarm
    rng = random.Random(seed)
    n = sum(counts)
    config = RebalanceConfig(stages=stages, min_gain=0.01)
    loads = _loads(counts)
    for _ in range(40):
        if not plan_moves(loads, config):
            break
        loads, _ = _period(loads, config, rng)
    # the best split gives every stage n // stages peers; a 1 % threshold lets
    # nothing smaller than one peer's gain stand
    assert pipeline_throughput(loads, stages) == n // stages
    settled, moved = _period(loads, config, rng)
    assert moved == 0 and settled == loads


def test_forty_eight_eight_eight_moves_in_expectation_what_fills_the_gap() -> None:
    config = RebalanceConfig(stages=4, min_gain=0.05)
    loads = _loads([40, 8, 8, 8])
    moves = plan_moves(loads, config)
    assert len(moves) == 24 and {m.target for m in moves} == {1, 2, 3}
    movers = [_period(loads, config, random.Random(seed))[1] for seed in range(200)]
    mean = sum(movers) / len(movers)
    assert 21 < mean < 27  # 39 eligible peers, each with probability 24 / 39
    assert max(movers) < 39  # staggered: never the whole rich stage at once


def test_a_slow_link_to_the_bottleneck_keeps_a_peer_home() -> None:
    config = RebalanceConfig(stages=2, min_gain=0.05)
    loads = [PeerLoad("a", 0, 1.0), PeerLoad("b", 0, 1.0), PeerLoad("c", 1, 0.5)]
    assert [m.peer for m in plan_moves(loads, config)] == ["b"]
    assert plan_moves(loads, config, links={"b": {1: 0.01}}) == []


def test_stage_costs_scale_the_predicted_capacity() -> None:
    # stage 1 costs twice as much: a peer serving 2 samples/s in stage 0 serves 1 there
    config = RebalanceConfig(stages=2, min_gain=0.05, stage_costs=(1.0, 2.0))
    loads = [PeerLoad("a", 0, 2.0), PeerLoad("b", 0, 2.0), PeerLoad("c", 0, 2.0)]
    loads.append(PeerLoad("d", 1, 1.0))
    decision = decide("b", loads, config, _AlwaysDraw())
    assert decision.current == 1.0 and decision.planned == 2.0 and decision.target == 1


def test_bad_input_is_refused() -> None:
    with pytest.raises(ConfigError):
        PeerLoad("a", 0, float("nan"))
    with pytest.raises(ConfigError):
        RebalanceConfig(stages=2, stage_costs=(1.0,))
    with pytest.raises(ConfigError):
        decide("zz", _loads([2, 2]), RebalanceConfig(stages=2), random.Random(0))


async def test_the_loop_moves_through_its_callback_and_then_cools_down() -> None:
    loads = _loads([5, 1])
    moved: list[int] = []
    second = asyncio.Event()

    async def read() -> list[PeerLoad]:
        return loads

    async def move_to(stage: int) -> None:
        moved.append(stage)
        if len(moved) == 2:
            second.set()

    config = RebalanceConfig(stages=2, period_s=0.01, jitter=0.0, cooldown_periods=2)
    rebalancer = Rebalancer(
        me="p0004", config=config, read_loads=read, move_to=move_to, rng=_AlwaysDraw()
    )
    first = await rebalancer.step()
    assert first is not None and first.target == 1 and moved == [1]
    assert await rebalancer.step() is None and await rebalancer.step() is None
    task = asyncio.get_running_loop().create_task(rebalancer.run())
    async with asyncio.timeout(5):
        await second.wait()
    task.cancel()
    assert moved == [1, 1]


def test_peers_still_unmeasured_count_at_the_median_and_draw_no_one() -> None:
    # Stage 1's two peers finished no backward yet (they announce 0): read as they
    # are, stage 1 looks unserved and the plan pulls peers to it; at the median, the
    # split is already even and nobody moves.
    loads = _loads([2, 2, 2], speeds=[1.0, 1.0, 0.0, 0.0, 1.0, 3.0])
    config = RebalanceConfig(stages=3)
    assert plan_moves(loads, config) != []
    estimated = estimate_unmeasured(loads)
    assert [load.throughput for load in estimated] == [1.0, 1.0, 1.0, 1.0, 1.0, 3.0]
    assert plan_moves(estimated, config) == []
    assert estimate_unmeasured(_loads([1, 1], speeds=[0.0])) == _loads([1, 1], speeds=[0.0])


def test_a_newcomer_takes_an_unserved_stage_first() -> None:
    loads = _loads([3, 0, 2, 0], speeds=[5.0])
    assert newcomer_stage(loads, 4) == 1
    drawn = {newcomer_stage(loads, 4, random.Random(seed)) for seed in range(40)}
    assert drawn == {1, 3}


def test_a_newcomer_goes_to_the_least_capacity_counting_unmeasured_peers_at_the_median() -> None:
    # Stage 0 holds two newcomers that announce 0 (no backward yet): read raw it
    # would look poorest (capacity 1) and draw every newcomer after them; at the
    # median it holds 3, and stage 2 (capacity 2) is the poorest.
    loads = _loads([3, 2, 2], speeds=[1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    loads[3] = PeerLoad(peer=loads[3].peer, stage=1, throughput=2.0)
    assert stage_capacity(loads, 3) == [1.0, 3.0, 2.0]
    assert newcomer_stage(loads, 3) == 2


def _stages(*speeds: Sequence[float]) -> list[PeerLoad]:
    return [
        PeerLoad(peer=f"s{stage}p{i}", stage=stage, throughput=speed)
        for stage, of_stage in enumerate(speeds)
        for i, speed in enumerate(of_stage)
    ]


def test_newcomers_that_join_together_spread_over_the_stages_near_the_least() -> None:
    # A typical peer serves 1.0. Stages 1 and 2 are within one typical peer of the
    # least (stage 0, 3.0), stage 3 (5.0) is not. Newcomers reading this same view
    # are drawn among 0, 1 and 2; without a random source the least (0) wins.
    loads = _stages([1, 1, 1], [1, 1, 1.5], [1, 1, 1.5], [1, 1, 1, 1, 1])
    assert stage_capacity(loads, 4) == [3.0, 3.5, 3.5, 5.0]
    assert newcomer_stage(loads, 4) == 0
    rng = random.Random(7)
    picks = [newcomer_stage(loads, 4, rng) for _ in range(3000)]
    assert picks.count(3) == 0
    assert all(900 < picks.count(s) < 1100 for s in range(3))
    much_richer = _stages([1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1])
    assert {newcomer_stage(much_richer, 4, random.Random(seed)) for seed in range(40)} == {0}
