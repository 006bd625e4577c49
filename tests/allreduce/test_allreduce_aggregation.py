"""Aggregation rules and their bounds, and the shard reducer's state machine: pure tests."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.allreduce import AllReduceConfig
from p2ptrain.allreduce.aggregation import (
    MeanAggregator,
    RobustAggregator,
    centered_clip,
    centered_clip_bound,
    trimmed_mean,
)
from p2ptrain.allreduce.reducer import ShardReducer
from p2ptrain.errors import ConfigError, RemoteProtocolError

MEAN = AllReduceConfig()


def test_the_mean_accumulates_in_place_relative_to_the_first_weight() -> None:
    out = torch.empty(5)
    parts = [torch.randn(5) for _ in range(3)]
    weights = [1e9, 3e9, 2e9]  # sample counts: the running sum stays at the values' scale
    mean = MeanAggregator(out)
    assert not mean.finish()
    for x, w in zip(parts, weights, strict=True):
        mean.add(x, w)
    assert mean.finish() and mean.count == 3 and mean.total_weight == 6e9
    expected = sum(w * x.double() for x, w in zip(parts, weights, strict=True)) / 6e9
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-7)
    single = MeanAggregator(torch.empty(5))
    single.add(parts[0], 7.0)
    assert single.finish() and torch.equal(single.out, parts[0])


Case = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@st.composite
def senders(draw: st.DrawFn, *, max_bad: int, min_honest: int) -> Case:
    """Honest values and weights, then bad ones (arbitrary scale, possibly lying weights)."""
    honest = draw(st.integers(min_honest, 6))
    bad = draw(st.integers(0, max_bad))
    size = draw(st.integers(1, 20))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    scale = draw(st.sampled_from([1e-3, 1.0, 1e6, 1e30]))
    lie = draw(st.sampled_from([1.0, 1e6]))
    good = torch.randn(honest, size, generator=generator, dtype=torch.float64).float()
    evil = (torch.randn(bad, size, generator=generator, dtype=torch.float64) * scale).float()
    good_w = torch.rand(honest, generator=generator, dtype=torch.float64) + 0.1
    evil_w = (torch.rand(bad, generator=generator, dtype=torch.float64) + 0.1) * lie
    return good, good_w, evil, evil_w


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_trimmed_mean_stays_within_the_honest_range(data: st.DataObject) -> None:
    trim = data.draw(st.integers(0, 3))
    good, good_w, evil, evil_w = data.draw(senders(max_bad=trim, min_honest=trim + 1))
    values = torch.cat([good, evil])
    weights = torch.cat([good_w, evil_w])
    order = torch.randperm(values.shape[0])  # bad senders anywhere in the order
    result = trimmed_mean(values[order], weights[order], trim)
    slack = 1e-6 * (1 + good.abs().max(dim=0).values)
    assert bool((result >= good.min(dim=0).values - slack).all())
    assert bool((result <= good.max(dim=0).values + slack).all())


def test_trimmed_mean_with_no_outlier_is_the_mean_of_the_middle() -> None:
    values = torch.tensor([[1.0], [2.0], [3.0], [100.0], [-50.0]])
    weights = torch.tensor([1.0, 1.0, 2.0, 1.0, 1.0], dtype=torch.float64)
    assert trimmed_mean(values, weights, 1).item() == pytest.approx((1 + 2 + 2 * 3) / 4)
    assert trimmed_mean(values[:2], weights[:2], 5).item() == pytest.approx(1.5)  # too few: mean
    with pytest.raises(ConfigError, match="positive"):
        trimmed_mean(values, -weights, 1)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_centered_clip_stays_within_its_bound_of_the_honest_mean(data: st.DataObject) -> None:
    good, good_w, evil, evil_w = data.draw(senders(max_bad=2, min_honest=3))
    assert evil.shape[0] < good.shape[0]  # a bad minority
    iterations = data.draw(st.integers(1, 5))
    radius = data.draw(st.sampled_from([None, 0.5, 3.0]))
    values = torch.cat([good, evil])
    weights = torch.cat([good_w, evil_w])
    result = centered_clip(values, weights, iterations=iterations, radius=radius)
    honest_mean = (good_w / good_w.sum()) @ good.double()
    distance = float((result.double() - honest_mean).norm())
    assert distance <= centered_clip_bound(good, good_w, iterations=iterations, radius=radius)


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_centered_clip_moves_at_most_2_alpha_tau_per_step_when_tau_covers_the_honest(
    data: st.DataObject,
) -> None:
    good, good_w, evil, evil_w = data.draw(senders(max_bad=1, min_honest=3))
    honest_mean = (good_w / good_w.sum()) @ good.double()
    reach = float((good.double() - honest_mean).norm(dim=1).max())
    radius = reach * data.draw(st.floats(1.0, 3.0)) + 1e-3
    iterations = data.draw(st.integers(1, 5))
    weights = torch.cat([good_w, evil_w])
    alpha = float(evil_w.sum() / weights.sum())
    result = centered_clip(torch.cat([good, evil]), weights, iterations=iterations, radius=radius)
    spread = float((good.max(dim=0).values - good.min(dim=0).values).double().norm())
    bound = spread + 2 * iterations * alpha * radius
    assert float((result.double() - honest_mean).norm()) <= bound * (1 + 1e-5) + 1e-5


def test_robust_aggregator_applies_the_configured_rule() -> None:
    parts = [torch.tensor([1.0, 2.0]), torch.tensor([2.0, 3.0]), torch.tensor([1e6, -1e6])]
    for rule in ("trimmed_mean", "centered_clip"):
        out = torch.empty(2)
        aggregator = RobustAggregator(out, AllReduceConfig(aggregation=rule))
        assert not aggregator.finish()
        for part in parts:
            aggregator.add(part, 1.0)
        assert aggregator.finish()
        assert float(out.abs().max()) < 10


def reducer(
    *,
    size: int = 10,
    chunk: int = 4,
    senders: tuple[int, ...] = (0, 1, 2),
    local_weight: float = 1.0,
    config: AllReduceConfig = MEAN,
) -> tuple[ShardReducer, torch.Tensor]:
    local = torch.arange(size, dtype=torch.float32)
    out = torch.full((size,), math.nan)
    return (
        ShardReducer(
            out=out,
            local=local,
            local_index=0,
            local_weight=local_weight,
            senders=senders,
            chunk_elements=chunk,
            config=config,
        ),
        out,
    )


def test_chunks_finalize_in_order_once_every_sender_delivered() -> None:
    shard, out = reducer()
    assert shard.num_chunks == 3 and shard.bounds == [(0, 4), (4, 8), (8, 10)]
    assert shard.join(1, 1.0) == []  # sender 2 has not joined: nothing is complete
    assert shard.join(2, 2.0) == []
    assert shard.add(2, 0, torch.full((4,), 3.0)) == []
    assert shard.add(2, 1, torch.full((4,), 3.0)) == []
    (first,) = shard.add(1, 0, torch.full((4,), 6.0))
    assert first.index == 0 and first.contributors == (0, 1, 2)
    # (local·1 + 6·1 + 3·2) / 4
    torch.testing.assert_close(out[:4], (torch.arange(4.0) + 12) / 4)
    done = shard.add(1, 1, torch.zeros(4)) + shard.add(1, 2, torch.zeros(2))
    assert [r.index for r in done] == [1]
    done = shard.add(2, 2, torch.zeros(2))
    assert [r.index for r in done] == [2] and shard.done


def test_protocol_violations_are_raised() -> None:
    shard, _ = reducer()
    with pytest.raises(RemoteProtocolError, match="not a sender"):
        shard.join(7, 1.0)
    with pytest.raises(RemoteProtocolError, match="not a sender"):
        shard.join(0, 1.0)  # the reducer itself
    with pytest.raises(RemoteProtocolError, match="without a positive weight"):
        shard.add(1, 0, torch.zeros(4))
    shard.join(1, 1.0)
    with pytest.raises(RemoteProtocolError, match="joined twice"):
        shard.join(1, 1.0)
    with pytest.raises(RemoteProtocolError, match="expected chunk 0"):
        shard.add(1, 1, torch.zeros(4))
    shard.add(1, 0, torch.zeros(4))
    with pytest.raises(RemoteProtocolError, match="expected chunk 1"):
        shard.add(1, 0, torch.zeros(4))  # a duplicate
    with pytest.raises(RemoteProtocolError, match="needs 4 values"):
        shard.add(1, 1, torch.zeros(3))


def test_non_finite_parts_exclude_the_sender_from_that_chunk_on() -> None:
    shard, out = reducer(senders=(0, 1))
    shard.join(1, 1.0)
    finalized = shard.add(1, 0, torch.ones(4))
    bad = torch.ones(4)
    bad[2] = math.inf
    finalized += shard.add(1, 1, bad)
    assert [r.index for r in finalized] == [0, 1, 2]
    assert [r.contributors for r in finalized] == [(0, 1), (0,), (0,)]
    assert finalized[1].excluded == ((1, "non-finite values in chunk 1"),)
    assert shard.exclusion(1) == "non-finite values in chunk 1"
    assert bool(out.isfinite().all())
    assert shard.add(1, 2, torch.ones(2)) == []  # later parts are ignored


def test_the_reducer_own_non_finite_values_are_left_out_too() -> None:
    local = torch.ones(8)
    local[5] = math.nan
    shard = ShardReducer(
        out=torch.empty(8),
        local=local,
        local_index=0,
        local_weight=1.0,
        senders=(0, 1),
        chunk_elements=4,
        config=MEAN,
    )
    shard.join(1, 1.0)
    results = shard.add(1, 0, torch.zeros(4)) + shard.add(1, 1, torch.zeros(4))
    assert [r.contributors for r in results] == [(0, 1), (1,)]
    assert results[1].excluded == ((0, "non-finite values in chunk 1"),)


def test_expire_finalizes_everything_and_names_who_was_missing() -> None:
    shard, out = reducer(senders=(0, 1, 2, 3))
    shard.join(1, 1.0)
    shard.join(3, 0.0)  # weight 0: never waited for
    shard.add(1, 0, torch.ones(4))
    results = shard.expire()
    assert shard.done and shard.expired
    assert [r.contributors for r in results] == [(0, 1), (0,), (0,)]
    excluded = dict(results[0].excluded) | dict(results[1].excluded)
    assert excluded == {
        1: "missed the reduce-scatter deadline",
        2: "did not join before the reduce-scatter deadline",
    }
    with pytest.raises(RemoteProtocolError, match="deadline"):
        shard.join(2, 1.0)
    torch.testing.assert_close(out[4:], torch.arange(4.0, 10.0))


def test_a_chunk_nobody_contributed_to_keeps_the_local_values() -> None:
    shard, out = reducer(senders=(0, 1), local_weight=0.0)
    shard.join(1, 1.0)
    results = shard.exclude(1, "gone")
    assert [r.values is None for r in results] == [True] * 3
    assert torch.equal(out, torch.arange(10.0))
    assert shard.exclude(1, "again") == []


def test_a_lone_reducer_is_complete_at_once() -> None:
    shard, out = reducer(senders=(0,), local_weight=3.0)
    assert shard.done and [r.contributors for r in shard.results] == [(0,)] * 3
    assert torch.equal(out, torch.arange(10.0))
    empty, _ = reducer(size=0, senders=(0, 1))
    assert empty.done and empty.num_chunks == 0


def test_robust_rules_in_the_reducer() -> None:
    config = AllReduceConfig(aggregation="trimmed_mean", trim=1)
    shard, out = reducer(size=4, chunk=4, senders=(0, 1, 2, 3), config=config)
    for index, value in ((1, 1.0), (2, 2.0), (3, 1e9)):
        shard.join(index, 1.0)
        shard.add(index, 0, torch.full((4,), value))
    assert shard.done
    honest = torch.stack([torch.arange(4.0), torch.full((4,), 1.0), torch.full((4,), 2.0)])
    assert bool((out >= honest.min(dim=0).values).all())
    assert bool((out <= honest.max(dim=0).values).all())
