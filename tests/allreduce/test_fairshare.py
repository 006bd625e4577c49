"""The fair-share round time: TCP's even split of each link among its connections."""

from __future__ import annotations

import random

import numpy as np
import pytest

from p2ptrain.allreduce import fairshare
from p2ptrain.allreduce.fairshare import MAX_PEERS, fair_share_round_time, pair_bytes
from p2ptrain.allreduce.lp import LoadBalancer
from p2ptrain.allreduce.partition import (
    PeerCapacity,
    equal_shares,
    evaluate_round_time,
    transfer_times,
)

MBIT = 1e6 / 8
V = float(16 << 20)


def _star(dc_mbit: float) -> list[PeerCapacity]:
    """bench_allreduce's shaped scenario: dc, lab, five homes, a client-mode home."""
    homes = [PeerCapacity(50 * MBIT, 100 * MBIT) for _ in range(5)]
    return [
        PeerCapacity(dc_mbit * MBIT, dc_mbit * MBIT),
        PeerCapacity(200 * MBIT, 200 * MBIT),
        *homes,
        PeerCapacity(50 * MBIT, 100 * MBIT, client_mode=True),
    ]


def test_pair_bytes_add_up_to_each_peers_traffic() -> None:
    peers = [
        PeerCapacity(4.0, 2.0),
        PeerCapacity(1.0, 3.0, client_mode=True),
        PeerCapacity(2.0, 2.0, computes=False),  # auxiliary: aggregates only
        PeerCapacity(3.0, 1.0),
    ]
    shares = [0.5, 0.0, 0.3, 0.2]
    flows = pair_bytes(shares, peers, 10.0)
    up_s, down_s = transfer_times(shares, peers, 10.0)
    rates_up = np.array([p.upload_bytes_per_s for p in peers])
    rates_down = np.array([p.download_bytes_per_s for p in peers])
    assert np.allclose(flows.sum(axis=1), np.array(up_s) * rates_up)
    assert np.allclose(flows.sum(axis=0), np.array(down_s) * rates_down)
    assert flows[2, 2] == 0 and flows[1, 0] == 5.0  # the client sends its part to 0
    assert flows[0, 2] == 3.0  # the auxiliary peer gets parts, no averages back


def test_one_binding_link_kind_gives_the_fluid_time() -> None:
    # Unthrottled: only the homes' uploads bind, so TCP's split changes nothing.
    peers = _star(1000)
    plan = LoadBalancer().plan(peers, vector_bytes=V, target_batch_size=1)
    assert fair_share_round_time(plan.shares, peers, V) == pytest.approx(plan.round_time_s)
    equal = equal_shares(peers)
    fluid = evaluate_round_time(equal, peers, V)
    assert fair_share_round_time(equal, peers, V) == pytest.approx(fluid)


def test_every_link_binding_is_slower_than_the_fluid_model() -> None:
    # The throttle scenario: dc at 100 Mbit/s, every peer binds in the fluid model.
    # The lab measured 1.35-1.5x the fluid time for p2ptrain, 1.25-1.48x for raw TCP.
    peers = _star(100)
    plan = LoadBalancer().plan(peers, vector_bytes=V, target_batch_size=1)
    fair = fair_share_round_time(plan.shares, peers, V)
    assert 1.2 < fair / plan.round_time_s < 1.35


def test_batched_ends_err_high_by_at_most_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(5)
    for _ in range(5):
        peers = [
            PeerCapacity(rng.uniform(1, 100) * MBIT, rng.uniform(1, 100) * MBIT) for _ in range(6)
        ]
        plan = LoadBalancer().plan(peers, vector_bytes=V, target_batch_size=1)
        batched = fair_share_round_time(plan.shares, peers, V)
        monkeypatch.setattr(fairshare, "BATCH", 0.0)
        exact = fair_share_round_time(plan.shares, peers, V)
        monkeypatch.undo()
        assert plan.round_time_s <= exact * (1 + 1e-9)
        assert exact * (1 - 1e-9) <= batched <= exact * (1 + fairshare.BATCH) + 1e-9


def test_latency_is_added_once() -> None:
    peers = [PeerCapacity(10 * MBIT, 10 * MBIT, rtt_s=0.04) for _ in range(4)]
    still = [PeerCapacity(10 * MBIT, 10 * MBIT) for _ in range(4)]
    shares = equal_shares(peers)
    size = float(1 << 20)
    gap = fair_share_round_time(shares, peers, size) - fair_share_round_time(shares, still, size)
    assert gap == pytest.approx(
        evaluate_round_time(shares, peers, size) - evaluate_round_time(shares, still, size)
    )


def test_large_groups_get_the_fluid_time() -> None:
    peers = [PeerCapacity(float(i + 1), float(i + 2)) for i in range(MAX_PEERS + 1)]
    shares = equal_shares(peers)
    assert fair_share_round_time(shares, peers, V) == evaluate_round_time(shares, peers, V)
