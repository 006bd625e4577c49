"""Tests of the load-balancing LP (p2ptrain.allreduce.lp and .partition).

The reference answers come from closed forms (docs/load-balancing.md) and from
an exact solver written here without cvxpy: the problem is separable (each
peer's time depends on its own share only), so for a given round time T every
share lies in an interval, T* is the smallest T whose intervals can sum to one
(found by bisection), and the tie-break is a projection onto a box and the
simplex (a bisection on one multiplier).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import cvxpy as cp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2ptrain.allreduce.lp import (
    LoadBalancer,
    LoadBalancerConfig,
    LoadBalancingError,
    PeerCapacity,
    equal_shares,
    evaluate_round_time,
    project_onto_capped_simplex,
    shares_to_boundaries,
    swarm_steps_per_s,
)
from p2ptrain.allreduce.partition import transfer_times
from p2ptrain.errors import AllReduceError, ConfigError

MB = 1e6
V = 100 * MB  # a 100 MB vector
TIE = LoadBalancerConfig().tie_tolerance
MARGIN = LoadBalancerConfig().binding_margin
BALANCER = LoadBalancer()  # shared, so the compiled problems are reused across tests
HIGHS_BALANCER = LoadBalancer(LoadBalancerConfig(solver="HIGHS"))

PROPERTY_SETTINGS = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)


# Random groups: 1 kB/s .. 1 GB/s links, a quarter of clients and of auxiliary peers.
_bandwidth = st.floats(3.0, 9.0).map(lambda e: 10.0**e)
_peer = st.builds(
    PeerCapacity,
    upload_bytes_per_s=_bandwidth,
    download_bytes_per_s=_bandwidth,
    samples_per_s=st.floats(0.0, 100.0),
    client_mode=st.sampled_from([False, False, False, True]),
    computes=st.sampled_from([True, True, True, False]),
)
_swarm = st.lists(_peer, min_size=1, max_size=9).filter(
    lambda peers: any(not p.client_mode for p in peers) and any(p.computes for p in peers)
)


def sym(*bandwidths_mb: float, **flags: bool) -> list[PeerCapacity]:
    """Peers with symmetric links of the given MB/s, computing 10 samples/s."""
    return [PeerCapacity(b * MB, b * MB, 10.0, **flags) for b in bandwidths_mb]


def plan(peers: Sequence[PeerCapacity], balancer: LoadBalancer = BALANCER) -> np.ndarray:
    result = balancer.plan(peers, vector_bytes=V, target_batch_size=1024)
    return np.array(result.shares)


# --- an exact reference solver, independent of cvxpy -----------------------------------


def _intervals(peers: Sequence[PeerCapacity], t: float) -> tuple[np.ndarray, np.ndarray]:
    """Bounds on each share so that the peer's transfers fit in time t (hi < lo: impossible)."""
    g = np.array([p.computes for p in peers], dtype=float)
    k = g.sum() - 2 * g  # per-share traffic, in vectors
    allowed = np.array([min(p.upload_bytes_per_s, p.download_bytes_per_s) for p in peers]) * t / V
    lo = np.zeros(len(peers))
    hi = np.array([0.0 if p.client_mode else 1.0 for p in peers])
    for i in range(len(peers)):
        if k[i] > 0:
            hi[i] = min(hi[i], (allowed[i] - g[i]) / k[i])
        elif k[i] < 0:
            lo[i] = max(lo[i], (g[i] - allowed[i]) / -k[i])
        elif g[i] > allowed[i]:
            hi[i] = -1.0
    return lo, hi


def _feasible(peers: Sequence[PeerCapacity], t: float) -> bool:
    lo, hi = _intervals(peers, t)
    return bool(np.all(lo <= hi)) and lo.sum() <= 1.0 <= hi.sum()


def exact_plan(
    peers: Sequence[PeerCapacity], tie: float = TIE, margin: float = MARGIN
) -> tuple[float, np.ndarray]:
    """(T*, tie-broken shares) by bisection, mirroring LoadBalancer's definition."""
    t_equal = evaluate_round_time(equal_shares(peers), peers, V)
    low, high = 0.0, max(t_equal, 1e-300)
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (low, mid) if _feasible(peers, mid) else (mid, high)
    t_star = high
    lo, hi = _intervals(peers, t_star * (1 + tie))
    b = np.array([min(p.upload_bytes_per_s, p.download_bytes_per_s) for p in peers])
    # Peers whose traffic grows with their share and that need t*(1 + tie)/(1 + margin)
    # already at their least share are held there, if the others can take the rest.
    g = np.array([p.computes for p in peers], dtype=float)
    k = g.sum() - 2 * g
    at_least = (g + k * lo) * V / b
    near = (k > 0) & (at_least * (1 + margin) >= t_star * (1 + tie))
    if margin > 0 and np.where(near, lo, hi).sum() >= 1.0:
        hi = np.where(near, lo, hi)
    ref = np.where([not p.client_mode for p in peers], b, 0.0)
    ref = ref / ref.sum()
    mu_lo, mu_hi = -2.0, 2.0
    for _ in range(200):
        mu = (mu_lo + mu_hi) / 2
        if np.clip(ref + mu, lo, hi).sum() < 1.0:
            mu_lo = mu
        else:
            mu_hi = mu
    return t_star, np.clip(ref + mu_hi, lo, hi)


def lower_bound(peers: Sequence[PeerCapacity]) -> float:
    """Round time no split can beat: every computing peer moves a whole vector
    (m >= 2), and all links together carry at least (2m - 2) vectors."""
    m = sum(p.computes for p in peers)
    b = [min(p.upload_bytes_per_s, p.download_bytes_per_s) for p in peers]
    per_peer = max((V / bi for p, bi in zip(peers, b, strict=True) if p.computes), default=0.0)
    return max(per_peer if m >= 2 else 0.0, V * (2 * m - 2) / sum(b))


# --- special cases with known answers -------------------------------------------------------


def test_equal_bandwidth_gives_butterfly() -> None:
    peers = sym(*[50.0] * 6)
    result = BALANCER.plan(peers, vector_bytes=V, target_batch_size=1024)
    np.testing.assert_allclose(result.shares, [1 / 6] * 6, atol=1e-6)
    assert result.round_time_s == pytest.approx(2 * 5 / 6 * V / (50 * MB), rel=1e-5)
    assert result.round_time_s == pytest.approx(result.equal_shares_round_time_s, rel=1e-5)


def test_dominant_peer_becomes_parameter_server() -> None:
    peers = sym(1000.0, 1.0, 1.0, 1.0, 1.0)
    result = BALANCER.plan(peers, vector_bytes=V, target_batch_size=1024)
    assert result.shares[0] > 0.999
    # Each slow peer still sends and receives one vector: that is the round time.
    assert result.round_time_s == pytest.approx(V / MB, rel=1e-5)
    # Equal shares would make every slow peer move (1 + 3/5) vectors.
    assert result.equal_shares_round_time_s == pytest.approx(1.6 * V / MB, rel=1e-9)


def test_client_peers_get_zero_share() -> None:
    peers = [*sym(100.0, 100.0, client_mode=True), *sym(10.0, 20.0, 30.0)]
    shares = plan(peers)
    assert shares[0] == 0.0 and shares[1] == 0.0
    assert shares.sum() == pytest.approx(1.0, abs=1e-12)


def test_peer_without_role_moves_nothing() -> None:
    idle = PeerCapacity(MB, MB, client_mode=True, computes=False)
    result = BALANCER.plan([*sym(10.0, 20.0, 30.0), idle], vector_bytes=V, target_batch_size=1)
    assert result.shares[3] == 0.0
    assert result.upload_time_s[3] == 0.0 and result.download_time_s[3] == 0.0


def test_client_transfer_time_counts() -> None:
    # Clients cannot aggregate but still send a vector and receive a vector.
    peers = [*sym(1.0, 1.0, 1.0, client_mode=True), PeerCapacity(1e4 * MB, 1e4 * MB)]
    result = BALANCER.plan(peers, vector_bytes=V, target_batch_size=1024)
    assert result.shares == pytest.approx((0.0, 0.0, 0.0, 1.0))
    assert result.round_time_s == pytest.approx(V / MB, rel=1e-9)


def test_auxiliary_peer_closed_form() -> None:
    # 3 computing peers: (1 + w) V <= b T;  1 auxiliary: 3 w V <= b T.
    # All four tight: 3 (x - 1) + x / 3 = 1 with x = b T / V, so x = 1.2.
    peers = [*sym(10.0, 10.0, 10.0), PeerCapacity(10 * MB, 10 * MB, 99.0, computes=False)]
    result = BALANCER.plan(peers, vector_bytes=V, target_batch_size=30)
    np.testing.assert_allclose(result.shares, [0.2, 0.2, 0.2, 0.4], atol=1e-5)
    assert result.round_time_s == pytest.approx(1.2 * V / (10 * MB), rel=1e-5)
    # The auxiliary peer needs no result: all it downloads is 3 parts of 0.4.
    assert result.download_time_s[3] == pytest.approx(3 * 0.4 * V / (10 * MB), rel=1e-4)
    # Its samples/s do not count: 30 samples at 3 x 10 samples/s.
    assert result.compute_time_s == pytest.approx(1.0)


def test_single_computing_peer_keeps_everything() -> None:
    peers = [PeerCapacity(MB, MB, 5.0), PeerCapacity(MB, MB, computes=False)]
    result = BALANCER.plan(peers, vector_bytes=V, target_batch_size=10)
    assert result.shares[0] == pytest.approx(1.0, abs=1e-6)
    assert result.round_time_s == pytest.approx(0.0, abs=1e-6)
    assert result.steps_per_s_overlapped == pytest.approx(0.5, rel=1e-6)


def test_lone_peer_needs_no_solver() -> None:
    result = BALANCER.plan([PeerCapacity(MB, MB, 4.0)], vector_bytes=V, target_batch_size=8)
    assert result.shares == (1.0,)
    assert result.round_time_s == 0.0
    assert (result.steps_per_s_sequential, result.steps_per_s_overlapped) == (0.5, 0.5)


def test_two_computing_peers_tie_break_is_bandwidth_proportional() -> None:
    # With two peers each moves exactly one vector whatever the split: every
    # split is optimal, and the tie-break returns the proportional one.
    result = BALANCER.plan(sym(10.0, 30.0), vector_bytes=V, target_batch_size=1)
    np.testing.assert_allclose(result.shares, [0.25, 0.75], atol=1e-6)
    assert result.round_time_s == pytest.approx(V / (10 * MB), rel=1e-9)


def test_asymmetric_links_matter() -> None:
    # Peers of 10..14 MB/s in the regime where every peer binds. The last
    # peer's upload is cut to 11 MB/s while its download is huge: it must now
    # get exactly the share of the 11 MB/s peer, less than before.
    before = plan(sym(10.0, 11.0, 12.0, 13.0, 14.0))
    fast_down = plan([*sym(10.0, 11.0, 12.0, 13.0), PeerCapacity(11 * MB, 1e5 * MB, 10.0)])
    fast_up = plan([*sym(10.0, 11.0, 12.0, 13.0), PeerCapacity(1e5 * MB, 11 * MB, 10.0)])
    t = 8 / 57 * V / MB  # 2(n-1)/sum(b) with b = 10, 11, 12, 13, 11
    expected = [(t * b * MB / V - 1) / 3 for b in (10, 11, 12, 13, 11)]
    np.testing.assert_allclose(fast_down, expected, atol=1e-5)
    np.testing.assert_allclose(fast_up, expected, atol=1e-5)
    assert fast_down[4] < before[4] - 0.1


def test_closed_form_when_total_bandwidth_binds() -> None:
    b = np.array([10.0, 11.0, 12.0, 13.0, 14.0])
    n = len(b)
    t_star = V * max(1 / (b.min() * MB), 2 * (n - 1) / (b.sum() * MB))
    assert t_star == pytest.approx(V * 2 * (n - 1) / (b.sum() * MB))  # this regime
    result = BALANCER.plan(sym(*b), vector_bytes=V, target_batch_size=1)
    assert result.round_time_s == pytest.approx(t_star, rel=1e-5)
    np.testing.assert_allclose(result.shares, (t_star * b * MB / V - 1) / (n - 2), atol=1e-5)


def test_closed_form_when_slowest_peer_binds() -> None:
    b = np.array([1.0, 10.0, 10.0, 10.0, 10.0])
    t_star = V * max(1 / (b.min() * MB), 2 * 4 / (b.sum() * MB))
    assert t_star == pytest.approx(V / MB)  # this regime: degenerate
    result = BALANCER.plan(sym(*b), vector_bytes=V, target_batch_size=1)
    assert result.round_time_s == pytest.approx(t_star, rel=1e-5)
    # Only upper bounds are known here; the tie-break must be symmetric.
    np.testing.assert_allclose(result.shares, [0.0, 0.25, 0.25, 0.25, 0.25], atol=1e-5)
    # No split beats equal shares by more than 2(n-1)/n in this regime.
    assert result.equal_shares_round_time_s / result.round_time_s <= 2 * 4 / 5 + 1e-9


@pytest.mark.parametrize(
    "bandwidths",
    [
        (10.0, 11.0, 12.0, 13.0, 14.0),  # unique optimum
        (1.0, 2.0, 10.0, 100.0),  # slowest binds: degenerate
        (5.0, 5.0, 5.0, 40.0, 80.0, 80.0),  # degenerate, ties between fast peers
    ],
)
@pytest.mark.parametrize("solver", ["HIGHS", "SCS"])
def test_solvers_agree(bandwidths: tuple[float, ...], solver: str) -> None:
    peers = sym(*bandwidths)
    reference = BALANCER.plan(peers, vector_bytes=V, target_batch_size=1)
    other = LoadBalancer(LoadBalancerConfig(solver=solver))
    result = other.plan(peers, vector_bytes=V, target_batch_size=1)
    assert (reference.solver, result.solver) == ("CLARABEL", solver)
    np.testing.assert_allclose(result.shares, reference.shares, atol=1e-7)
    assert result.round_time_s == pytest.approx(reference.round_time_s, rel=1e-7)


def test_near_binding_peers_get_no_share() -> None:
    # Two slow peers 5 % apart: the faster one's slack is within the margin.
    peers = sym(1.0, 1.05, 10.0, 100.0)
    shares = plan(peers)
    assert shares[0] == pytest.approx(0.0, abs=1e-6)
    assert shares[1] == pytest.approx(0.0, abs=1e-6)
    off = LoadBalancer(LoadBalancerConfig(binding_margin=0.0))
    loose = off.plan(peers, vector_bytes=V, target_batch_size=1)
    assert loose.shares[1] > 0.01  # without the margin it aggregates
    # Both plans are optimal: the margin only picks another point of the optimal face.
    pinned = BALANCER.plan(peers, vector_bytes=V, target_batch_size=1)
    assert pinned.round_time_s == pytest.approx(loose.round_time_s, rel=2 * TIE)
    # 20 % apart: real slack, the faster one aggregates again.
    assert plan(sym(1.0, 1.2, 10.0, 100.0))[1] > 0.01


def test_the_margin_gives_way_when_the_others_cannot_take_the_rest() -> None:
    # Three peers within 10 % of each other and no fast one: pinning them all
    # would leave nobody to aggregate, so the ordinary bounds apply.
    peers = sym(1.0, 1.04, 1.08)
    t_star, shares = exact_plan(peers)
    result = BALANCER.plan(peers, vector_bytes=V, target_batch_size=1)
    assert result.round_time_s == pytest.approx(t_star, rel=1e-5)
    np.testing.assert_allclose(result.shares, shares, atol=1e-6)
    assert sum(result.shares) == pytest.approx(1.0)


def test_matches_exact_solver_on_degenerate_case() -> None:
    peers = sym(1.0, 2.0, 10.0, 100.0)
    t_star, shares = exact_plan(peers)
    assert t_star == pytest.approx(V / MB, rel=1e-12)
    result = BALANCER.plan(peers, vector_bytes=V, target_batch_size=1)
    np.testing.assert_allclose(result.shares, shares, atol=1e-6)


@pytest.mark.parametrize(
    "peers",
    [
        # A peer without a role, with a 1 B/s link, next to 25 GB/s peers.
        [
            PeerCapacity(2.5e10, 2.5e10),
            PeerCapacity(1.0, 9e9, client_mode=True, computes=False),
            PeerCapacity(2.5e10, 2.5e10),
        ],
        # Auxiliary peers with 1 B/s and 30 B/s links among 10 GB/s peers.
        [
            PeerCapacity(1.0, 3e8, computes=False),
            PeerCapacity(1e10, 6e10),
            PeerCapacity(1e10, 31.6, computes=False),
            PeerCapacity(1e10, 6e10),
            PeerCapacity(10.0, 3e8, client_mode=True),
        ],
    ],
)
def test_extreme_bandwidth_ratios(peers: list[PeerCapacity]) -> None:
    # Such coefficients (1e10 apart) once made CLARABEL fail.
    result = BALANCER.plan(peers, vector_bytes=V, target_batch_size=1)
    t_star, shares = exact_plan(peers)
    assert result.round_time_s == pytest.approx(t_star, rel=1e-5)
    np.testing.assert_allclose(result.shares, shares, atol=1e-6)


def test_plan_fields_are_consistent() -> None:
    peers = [*sym(10.0, 25.0, 40.0), PeerCapacity(5 * MB, 50 * MB, 20.0, client_mode=True)]
    result = BALANCER.plan(peers, vector_bytes=V, target_batch_size=600)
    assert evaluate_round_time(result.shares, peers, V) == result.round_time_s
    upload_s, download_s = transfer_times(result.shares, peers, V)
    assert (result.upload_time_s, result.download_time_s) == (upload_s, download_s)
    assert result.round_time_s == max(*upload_s, *download_s)
    assert result.compute_time_s == pytest.approx(600 / 50)
    assert result.steps_per_s_sequential == pytest.approx(1 / (12 + result.round_time_s))
    assert result.steps_per_s_overlapped == pytest.approx(min(1 / 12, 1 / result.round_time_s))
    assert result.solver == "CLARABEL"
    assert 0 < result.solve_time_s < 10
    assert result.boundaries(1000) == shares_to_boundaries(result.shares, 1000)


def test_no_compute_throughput_means_zero_steps() -> None:
    peers = [PeerCapacity(MB, MB), PeerCapacity(MB, MB)]
    result = BALANCER.plan(peers, vector_bytes=V, target_batch_size=1)
    assert result.compute_time_s == math.inf
    assert result.steps_per_s_sequential == 0.0
    assert result.steps_per_s_overlapped == 0.0


def test_swarm_steps_per_s() -> None:
    assert swarm_steps_per_s(2.0, 3.0) == (0.2, 1 / 3)
    assert swarm_steps_per_s(4.0, 1.0) == (0.2, 0.25)
    assert swarm_steps_per_s(2.0, 0.0) == (0.5, 0.5)
    assert swarm_steps_per_s(math.inf, 1.0) == (0.0, 0.0)
    for bad in [(-1.0, 1.0), (1.0, math.nan), (0.0, 0.0)]:
        with pytest.raises(ConfigError):
            swarm_steps_per_s(*bad)


def test_bad_lp_answer_is_replaced_by_a_simple_split(monkeypatch: pytest.MonkeyPatch) -> None:
    # Should the solver return a poor split (all on the slowest peer), the
    # plan still does no worse than equal or proportional shares.
    from p2ptrain.allreduce import lp

    monkeypatch.setattr(lp._RoundTimeLP, "solve", lambda self, times, cap, solver: np.eye(4)[0])
    peers = sym(1.0, 10.0, 10.0, 10.0)
    result = LoadBalancer().plan(peers, vector_bytes=V, target_batch_size=1)
    proportional = np.array([1.0, 10.0, 10.0, 10.0]) / 31
    best_simple = min(
        evaluate_round_time(equal_shares(peers), peers, V),
        evaluate_round_time(tuple(proportional), peers, V),
    )
    assert result.round_time_s <= best_simple * (1 + 2 * TIE)


@PROPERTY_SETTINGS
@given(peers=_swarm, raw=st.lists(st.floats(0.0, 1.0), min_size=20, max_size=20))
def test_traffic_matches_message_count(peers: list[PeerCapacity], raw: list[float]) -> None:
    # Count every message of a round and compare with the closed-form traffic.
    weights = [0.0 if p.client_mode else x + 0.01 for p, x in zip(peers, raw, strict=False)]
    shares = [w / sum(weights) for w in weights]
    up, down = [0.0] * len(peers), [0.0] * len(peers)
    for j, sender in enumerate(peers):  # reduce-scatter: part k from j to k
        for k in range(len(peers)):
            if sender.computes and k != j:
                up[j] += shares[k] * V
                down[k] += shares[k] * V
    for k in range(len(peers)):  # all-gather: averaged part k from k to j
        for j, receiver in enumerate(peers):
            if receiver.computes and j != k:
                up[k] += shares[k] * V
                down[j] += shares[k] * V
    upload_s, download_s = transfer_times(shares, peers, V)
    for i, p in enumerate(peers):
        assert upload_s[i] == pytest.approx(up[i] / p.upload_bytes_per_s, rel=1e-9, abs=1e-9)
        assert download_s[i] == pytest.approx(down[i] / p.download_bytes_per_s, rel=1e-9, abs=1e-9)


# --- caching ------------------------------------------------------------------------------


def test_problems_are_dpp_and_cached_per_size() -> None:
    balancer = LoadBalancer(LoadBalancerConfig(max_cached_sizes=2))
    assert balancer._lp(5).problem.is_dpp()
    for n in (2, 3, 4):
        balancer.plan(sym(*[10.0] * n), vector_bytes=V, target_batch_size=1)
    assert balancer.cached_sizes == (3, 4)
    cached = balancer._lp(3)
    balancer.plan(sym(1.0, 2.0, 3.0), vector_bytes=V, target_batch_size=1)
    assert balancer._lp(3) is cached
    assert balancer.cached_sizes == (4, 3)


def test_resolve_gives_the_same_answer_as_a_fresh_build() -> None:
    warm = LoadBalancer()
    for bandwidths in [(3.0, 9.0, 27.0, 81.0), (80.0, 40.0, 20.0, 10.0)]:
        warm.plan(sym(*bandwidths), vector_bytes=V, target_batch_size=1)
    target = sym(1.0, 5.0, 25.0, 125.0)
    resolved = warm.plan(target, vector_bytes=V, target_batch_size=1)
    fresh = LoadBalancer().plan(target, vector_bytes=V, target_batch_size=1)
    np.testing.assert_allclose(resolved.shares, fresh.shares, rtol=0, atol=1e-12)


# --- properties ---------------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(peers=_swarm)
def test_plan_properties(peers: list[PeerCapacity]) -> None:
    result = BALANCER.plan(peers, vector_bytes=V, target_batch_size=256)
    shares = np.array(result.shares)
    assert np.all(shares >= 0)
    assert shares.sum() == pytest.approx(1.0, abs=1e-12)
    assert all(s == 0.0 for s, p in zip(shares, peers, strict=True) if p.client_mode)
    equal_time = evaluate_round_time(equal_shares(peers), peers, V)
    assert result.equal_shares_round_time_s == equal_time
    assert result.round_time_s <= equal_time * (1 + 1e-5) + 1e-12
    assert result.round_time_s >= lower_bound(peers) * (1 - 1e-9)
    assert evaluate_round_time(result.shares, peers, V) == result.round_time_s
    t_star, exact_shares = exact_plan(peers)
    assert result.round_time_s == pytest.approx(t_star, rel=1e-5, abs=1e-8 * equal_time)
    np.testing.assert_allclose(shares, exact_shares, atol=1e-6)
    # The order of the peers does not matter.
    reversed_plan = BALANCER.plan(peers[::-1], vector_bytes=V, target_batch_size=256)
    np.testing.assert_allclose(reversed_plan.shares[::-1], shares, atol=1e-6)


@PROPERTY_SETTINGS
@given(peers=_swarm)
def test_lp_solver_choice_does_not_change_the_plan(peers: list[PeerCapacity]) -> None:
    reference = BALANCER.plan(peers, vector_bytes=V, target_batch_size=1)
    result = HIGHS_BALANCER.plan(peers, vector_bytes=V, target_batch_size=1)
    np.testing.assert_allclose(result.shares, reference.shares, atol=1e-6)


# --- the exact tie-break --------------------------------------------------------------------


def test_projection_examples() -> None:
    zeros, ones = np.zeros(3), np.ones(3)
    ref = np.array([0.2, 0.3, 0.5])
    np.testing.assert_allclose(project_onto_capped_simplex(ref, zeros, ones), ref)
    np.testing.assert_allclose(
        project_onto_capped_simplex(np.array([0.6, 0.6, 0.6]), zeros, ones), [1 / 3] * 3
    )
    upper = np.array([0.1, 1.0, 1.0])
    np.testing.assert_allclose(project_onto_capped_simplex(ref, zeros, upper), [0.1, 0.35, 0.55])
    np.testing.assert_allclose(
        project_onto_capped_simplex(ref, np.array([0.0, 0.0, 0.9]), ones), [0.0, 0.1, 0.9]
    )
    with pytest.raises(ConfigError):
        project_onto_capped_simplex(ref, zeros, np.full(3, 0.2))
    with pytest.raises(ConfigError):
        project_onto_capped_simplex(ref, np.ones(2), ones)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    rows=st.lists(
        st.tuples(st.floats(0.01, 1), st.floats(-1, 2), st.floats(0, 1), st.floats(0, 1)),
        min_size=1,
        max_size=12,
    ),
    trials=st.lists(st.floats(0, 1), min_size=8, max_size=8),
)
def test_projection_is_the_closest_feasible_point(
    rows: list[tuple[float, float, float, float]], trials: list[float]
) -> None:
    # Bounds around a point of the simplex, so that they are always feasible.
    inside = np.array([x for x, _, _, _ in rows])
    inside /= inside.sum()
    ref = np.array([r for _, r, _, _ in rows])
    lower = inside * np.array([a for _, _, a, _ in rows])
    upper = inside + np.array([b for _, _, _, b in rows])
    w = project_onto_capped_simplex(ref, lower, upper)
    assert np.all(w >= lower) and np.all(w <= upper)
    assert w.sum() == pytest.approx(1.0, abs=1e-9)
    # Optimality: no feasible point is closer. Build some by mixing w with the
    # extreme feasible points "fill the lowest indices first".
    best = float(np.sum((w - ref) ** 2))
    for order in (np.arange(len(ref)), np.arange(len(ref))[::-1]):
        corner = lower.copy()
        room = 1.0 - corner.sum()
        for i in order:
            add = min(upper[i] - lower[i], room)
            corner[i] += add
            room -= add
        for t in trials:
            v = (1 - t) * w + t * corner
            assert float(np.sum((v - ref) ** 2)) >= best - 1e-12


# --- shares_to_boundaries -----------------------------------------------------------------


def test_boundaries_examples() -> None:
    assert shares_to_boundaries([0.5, 0.5], 3) == [0, 2, 3]  # tie: lower index first
    assert shares_to_boundaries([0.0, 1.0], 5) == [0, 0, 5]
    assert shares_to_boundaries([1 / 3] * 3, 10) == [0, 4, 7, 10]
    assert shares_to_boundaries([0.25, 0.0, 0.75], 0) == [0, 0, 0, 0]
    assert shares_to_boundaries([0.1, 0.2, 0.7], 10) == [0, 1, 3, 10]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    weights=st.lists(st.floats(0.0, 1e6), min_size=1, max_size=40).filter(lambda w: sum(w) > 0),
    num_elements=st.integers(0, 10**12),
)
def test_boundaries_properties(weights: list[float], num_elements: int) -> None:
    total = sum(weights)
    shares = [w / total for w in weights]
    boundaries = shares_to_boundaries(shares, num_elements)
    assert len(boundaries) == len(shares) + 1
    assert boundaries[0] == 0 and boundaries[-1] == num_elements
    exact_total = sum(Fraction(s) for s in shares)
    for i, share in enumerate(shares):
        size = boundaries[i + 1] - boundaries[i]
        assert size >= 0
        assert abs(size - Fraction(share) * num_elements / exact_total) < 1
        if share == 0:
            assert size == 0


# --- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"upload_bytes_per_s": 0.0},
        {"upload_bytes_per_s": -1.0},
        {"download_bytes_per_s": math.inf},
        {"download_bytes_per_s": math.nan},
        {"upload_bytes_per_s": True},
        {"upload_bytes_per_s": "fast"},
        {"samples_per_s": -1.0},
        {"samples_per_s": math.nan},
        {"client_mode": 1},
        {"computes": None},
    ],
)
def test_bad_peer_capacity(kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {"upload_bytes_per_s": MB, "download_bytes_per_s": MB, **kwargs}
    with pytest.raises(ConfigError):
        PeerCapacity(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("peers", "message"),
    [
        ([], "empty"),
        ([MB], "PeerCapacity"),
        ("peers", "sequence"),
        (sym(1.0, 2.0, client_mode=True), "client mode"),
        (sym(1.0, 2.0, computes=False), "computes"),
    ],
)
def test_bad_groups(peers: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        BALANCER.plan(peers, vector_bytes=V, target_batch_size=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=message):
        equal_shares(peers)  # type: ignore[arg-type]


@pytest.mark.parametrize("vector_bytes", [0, -5.0, math.nan, math.inf, True, "1"])
def test_bad_vector_size(vector_bytes: object) -> None:
    with pytest.raises(ConfigError, match="vector_bytes"):
        BALANCER.plan(sym(1.0, 2.0), vector_bytes=vector_bytes, target_batch_size=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("batch", [0, -1, math.nan, math.inf, None])
def test_bad_target_batch(batch: object) -> None:
    with pytest.raises(ConfigError, match="target_batch_size"):
        BALANCER.plan(sym(1.0, 2.0), vector_bytes=V, target_batch_size=batch)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "shares",
    [
        [0.5, 0.5],  # wrong length
        [0.5, 0.6, -0.1],  # negative
        [0.3, 0.3, 0.3],  # does not sum to 1
        [0.5, math.nan, 0.5],
        [0.5, 0.25, 0.25],  # positive share for a client
        "abc",
    ],
)
def test_bad_shares(shares: object) -> None:
    peers = [*sym(1.0, 2.0), PeerCapacity(MB, MB, client_mode=True)]
    with pytest.raises(ConfigError):
        evaluate_round_time(shares, peers, V)  # type: ignore[arg-type]


@pytest.mark.parametrize(("shares", "num"), [([1.0], -1), ([1.0], 2.0), ([1.0], True), ([], 3)])
def test_bad_boundaries(shares: list[float], num: object) -> None:
    with pytest.raises(ConfigError):
        shares_to_boundaries(shares, num)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"solver": "NOPE"},
        {"solver": 3},
        {"tie_tolerance": -1e-3},
        {"tie_tolerance": 0.5},
        {"tie_tolerance": math.nan},
        {"binding_margin": -0.1},
        {"binding_margin": 1.0},
        {"binding_margin": True},
        {"max_cached_sizes": 0},
        {"max_cached_sizes": 2.0},
    ],
)
def test_bad_config(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        LoadBalancerConfig(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        LoadBalancer(config=kwargs)  # type: ignore[arg-type]


# --- solver failures ----------------------------------------------------------------------


def test_solver_exception_becomes_load_balancing_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_solve(self: cp.Problem, *args: object, **kwargs: object) -> None:
        raise cp.error.SolverError("boom")

    monkeypatch.setattr(cp.Problem, "solve", broken_solve)
    with pytest.raises(LoadBalancingError) as info:
        LoadBalancer().plan(sym(1.0, 2.0, 3.0), vector_bytes=V, target_batch_size=1)
    assert isinstance(info.value, AllReduceError)
    assert info.value.status is None
    assert isinstance(info.value.__cause__, cp.error.SolverError)


def test_bad_status_becomes_load_balancing_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cp.Problem, "status", property(lambda self: cp.INFEASIBLE))
    with pytest.raises(LoadBalancingError, match="infeasible") as info:
        LoadBalancer().plan(sym(1.0, 2.0, 3.0), vector_bytes=V, target_batch_size=1)
    assert info.value.status == cp.INFEASIBLE
    assert info.value.solver == "CLARABEL"


# -- latency ---------------------------------------------------------------------------------


def test_the_latency_term_follows_its_formula() -> None:
    from p2ptrain.allreduce.partition import INITIAL_WINDOW_BYTES, latency_s

    assert latency_s(0.0, 1e9, V) == 0.0
    # 50 Mbit/s over 40 ms holds 250 kB: a round trip and the slow-start ramp, per phase.
    window = 0.04 * 6.25e6
    ramp = 0.04 * math.log2(window / INITIAL_WINDOW_BYTES) - window / 6.25e6
    assert latency_s(0.04, 6.25e6, V) == pytest.approx(2 * (0.04 + ramp))
    # A vector smaller than the path's capacity fills only its own size.
    small = 0.04 * math.log2(100_000 / INITIAL_WINDOW_BYTES) - 100_000 / 6.25e6
    assert latency_s(0.04, 6.25e6, 100_000) == pytest.approx(2 * (0.04 + small))
    assert latency_s(0.04, 6.25e6, 1000) == pytest.approx(2 * 0.04)  # below one window
    assert latency_s(0.001, 6.25e6, V) == pytest.approx(0.002)  # a LAN: the ramp costs nothing


def test_equal_round_trips_add_one_constant_and_keep_the_shares() -> None:
    from p2ptrain.allreduce.partition import latency_s

    rates = [80 * MB, 40 * MB, 20 * MB, 10 * MB]
    plain = [PeerCapacity(r, r) for r in rates]
    slow = BALANCER.plan(plain, vector_bytes=V, target_batch_size=1)
    delayed = [PeerCapacity(r, r, rtt_s=0.05) for r in rates]
    plan = BALANCER.plan(delayed, vector_bytes=V, target_batch_size=1)
    up, down = transfer_times(plan.shares, delayed, V)
    assert plan.round_time_s == pytest.approx(max(*up, *down))
    # Every peer has the same term (the group's slowest rate sets the ramp): a constant.
    assert plan.round_time_s == pytest.approx(slow.round_time_s + latency_s(0.05, 10 * MB, V))
    assert plan.shares == pytest.approx(slow.shares, abs=1e-6)


def test_a_far_away_peer_is_given_less_to_aggregate() -> None:
    near = [PeerCapacity(50 * MB, 50 * MB) for _ in range(4)]
    far = [*near[:3], PeerCapacity(50 * MB, 50 * MB, rtt_s=0.3)]
    even = BALANCER.plan(near, vector_bytes=V, target_batch_size=1)
    plan = BALANCER.plan(far, vector_bytes=V, target_batch_size=1)
    assert even.shares == pytest.approx([0.25] * 4, abs=1e-6)
    assert plan.shares[3] < 0.25 - 0.01 and all(w > 0.25 for w in plan.shares[:3])
    # Exact: the far peer binds together with the others.
    up, down = transfer_times(plan.shares, far, V)
    assert max(up[3], down[3]) == pytest.approx(plan.round_time_s, rel=1e-6)


@pytest.mark.parametrize("rtt", [-0.1, math.nan, math.inf, True])
def test_a_bad_round_trip_time_is_refused(rtt: float) -> None:
    with pytest.raises(ConfigError):
        PeerCapacity(MB, MB, rtt_s=rtt)


# --- a bound on the busiest peer's share --------------------------------------------------


def test_max_share_bounds_every_share_and_costs_round_time_only_where_it_binds() -> None:
    peers = sym(1000, 10, 10, 10, 10, 10)  # the LP gives the 1000 MB/s peer most of the vector
    free = BALANCER.plan(peers, vector_bytes=V, target_batch_size=1024)
    assert max(free.shares) > 0.5
    bounded = BALANCER.plan(peers, vector_bytes=V, target_batch_size=1024, max_share=0.3)
    shares = np.array(bounded.shares)
    assert shares.max() <= 0.3 + 1e-9
    assert shares.sum() == pytest.approx(1.0)
    assert bounded.round_time_s > free.round_time_s
    # Where the bound does not bind, the plan is the same.
    loose = BALANCER.plan(peers, vector_bytes=V, target_batch_size=1024, max_share=max(free.shares))
    assert loose.shares == pytest.approx(free.shares, abs=1e-6)


def test_max_share_below_an_equal_split_gives_the_equal_split_over_aggregators() -> None:
    peers = [*sym(1000, 10, 10), *sym(50, client_mode=True)]
    result = BALANCER.plan(peers, vector_bytes=V, target_batch_size=1024, max_share=0.01)
    assert result.shares == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0.0], abs=1e-9)


@pytest.mark.parametrize("bad", [0.0, -0.1, math.nan, math.inf, True, "0.5"])
def test_max_share_must_be_a_positive_finite_number(bad: object) -> None:
    with pytest.raises(ConfigError, match="max_share"):
        BALANCER.plan(sym(10, 10), vector_bytes=V, target_batch_size=1, max_share=bad)  # type: ignore[arg-type]
