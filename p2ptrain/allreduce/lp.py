"""The load-balancing LP of DeDLOC's adaptive averaging: who aggregates how much.

Theory of operation. Each peer's traffic in a butterfly round is affine in its
own share ``w_i`` (see :mod:`p2ptrain.allreduce.partition`). A plan takes two
stages:

1. **Round time (LP, cvxpy).** ``minimize T`` subject to
   ``upload_i(w)/u_i + L_i ≤ T``, ``download_i(w)/d_i + L_i ≤ T`` (``L_i``
   the peer's latency term, a constant: see
   :func:`~p2ptrain.allreduce.partition.latency_s`), ``Σ w = 1``,
   ``w ≥ 0`` and ``w_i = 0`` for peers in client mode. The optimum ``T*`` is
   unique; the shares often are not: when the slowest peer binds, a whole
   face of share vectors reaches ``T*`` and solvers return different points
   of it.
2. **Tie-break (exact).** Among the shares whose round time is at most
   ``T*·(1 + tie_tolerance)``, take the one closest (Euclidean) to the
   bandwidth-proportional split ``r_i ∝ min(u_i, d_i)`` over the peers that
   may aggregate. The objective is strictly convex, so the answer is unique.
   Because every peer's time depends on its own share only, the time cap is a
   box ``l_i ≤ w_i ≤ h_i`` and the problem is a projection onto
   ``box ∩ {Σ w = 1}``, computed exactly (``w_i = clip(r_i + μ, l_i, h_i)``
   with one scalar ``μ``). A QP solver here would only be accurate to its
   gap tolerance, which bounds ``‖Δw‖²``, not ``‖Δw‖``;
   ``docs/load-balancing.md`` gives the measurements and the choice of
   objective. A peer that takes within ``binding_margin`` of ``T*`` at its
   least share counts as binding (``h_i = l_i``): measured rates are not
   exact, and slack smaller than their error is not there on the real link.

The LP is built once per group size with cvxpy Parameters (it is DPP),
cached, and re-solved with new parameter values, so a re-plan costs a few
milliseconds. Times are scaled by the round time of a simple split (equal or
bandwidth-proportional shares, whichever is faster), so the solver sees
numbers near one whatever the bandwidth units; should the solver's split be
slower than that simple split, the simple split seeds the tie-break instead.

Errors: bad arguments raise :class:`~p2ptrain.errors.ConfigError`, including
a group with no peer able to aggregate or none computing; a solver failure
raises :class:`LoadBalancingError`, an
:class:`~p2ptrain.errors.AllReduceError`.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import cvxpy as cp
import numpy as np
from cvxpy.atoms.affine.binary_operators import multiply
from cvxpy.atoms.affine.sum import sum as cp_sum

from p2ptrain.allreduce.partition import (
    FloatArray,
    PeerCapacity,
    TrafficCoefficients,
    equal_shares,
    evaluate_round_time,
    shares_to_boundaries,
    traffic_coefficients,
    transfer_times,
)
from p2ptrain.errors import AllReduceError, ConfigError

__all__ = [
    "LoadBalancePlan",
    "LoadBalancer",
    "LoadBalancerConfig",
    "LoadBalancingError",
    "PeerCapacity",
    "equal_shares",
    "evaluate_round_time",
    "project_onto_capped_simplex",
    "shares_to_boundaries",
    "swarm_steps_per_s",
]

logger = logging.getLogger(__name__)

_SOLVER_OPTIONS: dict[str, dict[str, Any]] = {
    # The first-order solvers stop near 1e-4 by default; the tie-break needs
    # the optimum well within tie_tolerance.
    "SCS": {"eps_abs": 1e-9, "eps_rel": 1e-9, "max_iters": 100_000},
    "OSQP": {"eps_abs": 1e-9, "eps_rel": 1e-9, "polishing": True, "max_iter": 100_000},
}
_ACCEPTED_STATUSES = (cp.OPTIMAL, cp.OPTIMAL_INACCURATE)


class LoadBalancingError(AllReduceError):
    """The LP solver did not return a usable load-balancing plan.

    Attributes:
        solver: The solver's name.
        status: The cvxpy status (``None`` if the solver raised or returned
            no solution).
    """

    def __init__(self, message: str, *, solver: str, status: str | None) -> None:
        super().__init__(message)
        self.solver = solver
        self.status = status


@dataclass(frozen=True, slots=True)
class LoadBalancerConfig:
    """How :class:`LoadBalancer` solves for a plan.

    Attributes:
        solver: cvxpy solver of the round-time LP; must be installed.
            ``"CLARABEL"`` (interior point) and ``"HIGHS"`` (simplex) are fast
            and accurate to 1e-7 or better; ``"SCS"`` is run with tight
            tolerances and is slower; ``"OSQP"`` is not suited to LPs.
        tie_tolerance: Relative slack on the optimal round time the tie-break
            may use; in [0, 0.1). Plans come within this factor of the optimum.
        binding_margin: A peer whose transfers at its least share already
            take at least ``T*/(1 + binding_margin)`` is treated as binding by
            the tie-break: it gets no more than that least share (unless the
            others cannot take the rest within ``T*``). Its apparent slack is
            within the error of measured rates; in [0, 1). 0 turns this off.
        max_cached_sizes: How many group sizes keep their compiled LP (least
            recently used are dropped); at least 1.
    """

    solver: str = "CLARABEL"
    tie_tolerance: float = 1e-6
    binding_margin: float = 0.1
    max_cached_sizes: int = 32

    def __post_init__(self) -> None:
        installed = cp.installed_solvers()  # type: ignore[no-untyped-call]
        if not isinstance(self.solver, str) or self.solver not in installed:
            raise ConfigError(
                f"solver must name an installed cvxpy solver {sorted(installed)}, "
                f"got {self.solver!r}"
            )
        tol = self.tie_tolerance
        if isinstance(tol, bool) or not isinstance(tol, int | float) or not 0 <= tol < 0.1:
            raise ConfigError(f"tie_tolerance must be a number in [0, 0.1), got {tol!r}")
        margin = self.binding_margin
        if isinstance(margin, bool) or not isinstance(margin, int | float) or not 0 <= margin < 1:
            raise ConfigError(f"binding_margin must be a number in [0, 1), got {margin!r}")
        size = self.max_cached_sizes
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"max_cached_sizes must be an int >= 1, got {size!r}")


@dataclass(frozen=True, slots=True)
class LoadBalancePlan:
    """The split chosen for one group, and what the model predicts for it.

    Attributes:
        shares: Fraction of the vector each peer aggregates, in the order of
            the peers; at least 0, summing to 1.
        round_time_s: Predicted all-reduce time; equals
            ``evaluate_round_time(shares, peers, vector_bytes)``.
        upload_time_s: Each peer's predicted upload time.
        download_time_s: Each peer's predicted download time.
        equal_shares_round_time_s: Predicted time of :func:`equal_shares`, for
            comparison.
        compute_time_s: Time the computing peers need for one global batch,
            ``target_batch_size / Σ samples_per_s`` (``inf`` if none reported
            a throughput).
        steps_per_s_sequential: Optimizer steps per second when compute and
            communication alternate: ``1 / (compute_time_s + round_time_s)``.
        steps_per_s_overlapped: Steps per second when they overlap:
            ``min(1 / compute_time_s, 1 / round_time_s)``.
        solver: The cvxpy solver of the round-time LP (not called when a
            lone computing peer aggregates everything and nothing travels).
        solve_time_s: Wall time of both stages, parameter updates included.
    """

    shares: tuple[float, ...]
    round_time_s: float
    upload_time_s: tuple[float, ...]
    download_time_s: tuple[float, ...]
    equal_shares_round_time_s: float
    compute_time_s: float
    steps_per_s_sequential: float
    steps_per_s_overlapped: float
    solver: str
    solve_time_s: float

    def __post_init__(self) -> None:
        count = len(self.shares)
        if count == 0 or len(self.upload_time_s) != count or len(self.download_time_s) != count:
            raise ConfigError("shares, upload_time_s and download_time_s need one entry a peer")
        if any(not math.isfinite(x) or x < 0 for x in self.shares):
            raise ConfigError("shares must be finite and >= 0")
        if not math.isfinite(self.round_time_s) or self.round_time_s < 0:
            raise ConfigError(f"round_time_s must be finite and >= 0, got {self.round_time_s!r}")

    def boundaries(self, num_elements: int) -> list[int]:
        """Element boundaries of each peer's part; see :func:`shares_to_boundaries`."""
        return shares_to_boundaries(self.shares, num_elements)


def swarm_steps_per_s(compute_time_s: float, round_time_s: float) -> tuple[float, float]:
    """Optimizer steps per second of the swarm, without and with overlap.

    Args:
        compute_time_s: Time to compute one global batch (may be ``inf``).
        round_time_s: Time of one all-reduce round (at least 0).

    Returns:
        ``(sequential, overlapped)``: ``1 / (compute + round)`` and
        ``min(1 / compute, 1 / round)``.

    Raises:
        ConfigError: If a time is negative or NaN, or both are zero.
    """
    for name, value in (("compute_time_s", compute_time_s), ("round_time_s", round_time_s)):
        if math.isnan(value) or value < 0:
            raise ConfigError(f"{name} must be >= 0, got {value!r}")
    if compute_time_s == 0 and round_time_s == 0:
        raise ConfigError("compute_time_s and round_time_s cannot both be 0")
    if math.isinf(compute_time_s) or math.isinf(round_time_s):
        return 0.0, 0.0
    sequential = 1.0 / (compute_time_s + round_time_s)
    compute_rate = 1.0 / compute_time_s if compute_time_s > 0 else math.inf
    comm_rate = 1.0 / round_time_s if round_time_s > 0 else math.inf
    return sequential, min(compute_rate, comm_rate)


@dataclass(frozen=True, slots=True)
class _PeerTimes:
    """Each peer's upload and download time as ``slope · w_i + offset``, in scaled units."""

    up_slope: FloatArray
    up_offset: FloatArray
    down_slope: FloatArray
    down_offset: FloatArray

    @classmethod
    def of(cls, coeffs: TrafficCoefficients, vector_bytes: float, unit_s: float) -> _PeerTimes:
        """Times in units of ``unit_s`` seconds (latency terms included in the offsets)."""
        up = vector_bytes / unit_s / coeffs.upload_bytes_per_s
        down = vector_bytes / unit_s / coeffs.download_bytes_per_s
        latency = coeffs.latency_s(vector_bytes) / unit_s
        return cls(
            up_slope=up * coeffs.upload_per_share,
            up_offset=up * coeffs.upload_fixed + latency,
            down_slope=down * coeffs.download_per_share,
            down_offset=down * coeffs.download_fixed + latency,
        )

    def masked(self, keep: FloatArray) -> _PeerTimes:
        """The same times with the slopes of peers not in ``keep`` (0/1) set to zero."""
        return _PeerTimes(
            up_slope=self.up_slope * keep,
            up_offset=self.up_offset,
            down_slope=self.down_slope * keep,
            down_offset=self.down_offset,
        )

    def round_time(self, shares: FloatArray) -> float:
        """The round time of ``shares`` in scaled units."""
        up = self.up_slope * shares + self.up_offset
        down = self.down_slope * shares + self.down_offset
        return float(max(np.max(up), np.max(down)))

    def times_at(self, shares: FloatArray) -> FloatArray:
        """Each peer's time (the longer direction) at ``shares``, in scaled units."""
        up = self.up_slope * shares + self.up_offset
        down = self.down_slope * shares + self.down_offset
        result: FloatArray = np.maximum(up, down)
        return result

    def share_bounds(self, cap: FloatArray, limit: float) -> tuple[FloatArray, FloatArray]:
        """Bounds ``(lower, upper)`` on each share so its transfers last at most ``limit``."""
        lower = np.zeros_like(cap)
        upper = cap.copy()
        for slope, offset in ((self.up_slope, self.up_offset), (self.down_slope, self.down_offset)):
            with np.errstate(divide="ignore", invalid="ignore"):
                edge = (limit - offset) / slope
            upper = np.where(slope > 0, np.minimum(upper, edge), upper)
            lower = np.where(slope < 0, np.maximum(lower, edge), lower)
        return lower, upper


def _share_cap(max_share: float | None, aggregators: float) -> float:
    """The bound on one share: ``max_share``, at least an equal split, at most 1."""
    if max_share is None:
        return 1.0
    if isinstance(max_share, bool) or not isinstance(max_share, int | float):
        raise ConfigError(f"max_share must be a number, got {max_share!r}")
    if not (math.isfinite(max_share) and max_share > 0):
        raise ConfigError(f"max_share must be positive and finite, got {max_share!r}")
    return min(1.0, max(float(max_share), 1.0 / aggregators))


def _pin_near_binding(
    times: _PeerTimes, lower: FloatArray, upper: FloatArray, limit: float, margin: float
) -> FloatArray:
    """``upper`` with peers within ``margin`` of binding held to their least share.

    A peer whose time grows with its share and already takes at least
    ``limit / (1 + margin)`` at its least share keeps that share. Peers of
    (nearly) equal measured links would otherwise get whatever slack the
    measurement noise shows: a home measured 46 Mbit/s next to one measured
    42 aggregates, and on the real (equal) links it becomes the slowest.
    Nothing changes when the others cannot take the rest within ``limit``.
    """
    if margin <= 0:
        return upper
    grows = (times.up_slope > 0) | (times.down_slope > 0)
    near = grows & (times.times_at(lower) * (1.0 + margin) >= limit)
    pinned = np.where(near, lower, upper)
    return pinned if float(pinned.sum()) >= 1.0 else upper


class _RoundTimeLP:
    """The stage-one LP for one group size, parametrised so that it is DPP."""

    def __init__(self, size: int) -> None:
        self.up_slope = cp.Parameter(size)
        self.up_offset = cp.Parameter(size)
        self.down_slope = cp.Parameter(size)
        self.down_offset = cp.Parameter(size)
        self.cap = cp.Parameter(size, nonneg=True)  # 1, or 0 in client mode
        self.shares = cp.Variable(size, nonneg=True)
        self.time = cp.Variable()
        self.problem = cp.Problem(
            cp.Minimize(self.time),
            [
                multiply(self.up_slope, self.shares) + self.up_offset <= self.time,
                multiply(self.down_slope, self.shares) + self.down_offset <= self.time,
                cp_sum(self.shares) == 1,
                self.shares <= self.cap,
            ],
        )

    def solve(self, times: _PeerTimes, cap: FloatArray, solver: str) -> FloatArray:
        """Solve for the given peers; return the solver's shares, made valid."""
        self.up_slope.value, self.up_offset.value = times.up_slope, times.up_offset
        self.down_slope.value, self.down_offset.value = times.down_slope, times.down_offset
        self.cap.value = cap
        try:
            # No warm start: a re-used solver object keeps state (CLARABEL
            # failed on badly scaled data after other solves), and the plan
            # should depend on its inputs only.
            options = _SOLVER_OPTIONS.get(solver, {})
            self.problem.solve(  # type: ignore[no-untyped-call]
                solver=solver, warm_start=False, enforce_dpp=True, **options
            )
        except cp.error.SolverError as exc:
            raise LoadBalancingError(
                f"load-balancing LP failed in {solver}: {exc}", solver=solver, status=None
            ) from exc
        status = self.problem.status
        if status not in _ACCEPTED_STATUSES:
            raise LoadBalancingError(
                f"load-balancing LP in {solver} ended with status {status!r}",
                solver=solver,
                status=status,
            )
        if status == cp.OPTIMAL_INACCURATE:
            logger.warning("load-balancing LP in %s is only approximately optimal", solver)
        raw = self.shares.value
        shares = None if raw is None else np.clip(np.asarray(raw, dtype=np.float64), 0.0, cap)
        if shares is None or not np.all(np.isfinite(shares)) or shares.sum() <= 0:
            raise LoadBalancingError(
                f"load-balancing LP in {solver} returned no usable shares",
                solver=solver,
                status=status,
            )
        # Clipped to [0, cap] and summing to one: a valid split.
        result: FloatArray = shares / float(shares.sum())
        return result


def project_onto_capped_simplex(
    reference: FloatArray, lower: FloatArray, upper: FloatArray
) -> FloatArray:
    """The point of ``{w : lower ≤ w ≤ upper, Σ w = 1}`` closest to ``reference``.

    The answer is ``clip(reference + μ, lower, upper)`` for the ``μ`` where
    the sum is one. The sum is piecewise linear and non-decreasing in ``μ``
    with a kink wherever a coordinate meets a bound, so walking the sorted
    kinks finds ``μ`` exactly.

    Args:
        reference: The point to project.
        lower: Lower bounds, at most ``upper``.
        upper: Upper bounds.

    Returns:
        The projection.

    Raises:
        ConfigError: If the arrays disagree in shape, a lower bound exceeds
            its upper bound, or the bounds cannot sum to one.
    """
    if not (reference.shape == lower.shape == upper.shape) or reference.ndim != 1:
        raise ConfigError("reference, lower and upper must be 1-d arrays of one length")
    if not (np.all(np.isfinite(reference)) and np.all(np.isfinite(lower + upper))):
        raise ConfigError("reference, lower and upper must be finite")
    if np.any(lower > upper) or lower.sum() > 1.0 + 1e-9 or upper.sum() < 1.0 - 1e-9:
        raise ConfigError("the bounds admit no share vector summing to one")
    kinks = np.concatenate([lower - reference, upper - reference])
    steps = np.concatenate([np.ones_like(lower), -np.ones_like(upper)])
    order = np.argsort(kinks, kind="stable")
    kinks, steps = kinks[order], steps[order]
    slopes = np.cumsum(steps)  # slope of the sum between kinks[k] and kinks[k + 1]
    sums = float(lower.sum()) + np.concatenate(([0.0], np.cumsum(slopes[:-1] * np.diff(kinks))))
    k = int(np.searchsorted(sums, 1.0))  # first kink where the sum reaches one
    if k == 0:
        mu = float(kinks[0])
    elif k == len(kinks):
        mu = float(kinks[-1])
    else:
        mu = float(kinks[k - 1] + (1.0 - sums[k - 1]) / slopes[k - 1])
    result: FloatArray = np.clip(reference + mu, lower, upper)
    return result


class LoadBalancer:
    """Plans the shares of butterfly all-reduce rounds, caching compiled LPs.

    One instance serves any number of groups; the LP for each group size is
    built on first use and re-solved afterwards. Not thread-safe: give each
    thread its own instance.

    Args:
        config: Solver and tolerances; the defaults suit most uses.
    """

    def __init__(self, config: LoadBalancerConfig | None = None) -> None:
        self._config = config if config is not None else LoadBalancerConfig()
        if not isinstance(self._config, LoadBalancerConfig):
            raise ConfigError(f"config must be a LoadBalancerConfig, got {config!r}")
        self._cache: OrderedDict[int, _RoundTimeLP] = OrderedDict()

    @property
    def config(self) -> LoadBalancerConfig:
        """The configuration this balancer was made with."""
        return self._config

    @property
    def cached_sizes(self) -> tuple[int, ...]:
        """Group sizes whose LP is compiled, least recently used first."""
        return tuple(self._cache)

    def plan(
        self,
        peers: Sequence[PeerCapacity],
        *,
        vector_bytes: float,
        target_batch_size: float,
        max_share: float | None = None,
    ) -> LoadBalancePlan:
        """Choose each peer's share so that the round is as short as possible.

        Args:
            peers: The group; at least one peer computes and at least one is
                not in client mode.
            vector_bytes: Size of the averaged vector in bytes, e.g.
                ``tensor.numel() * tensor.element_size()``.
            target_batch_size: Samples the swarm processes per optimizer step;
                only the throughput figures use it.
            max_share: If given, no peer's share exceeds it (raised to an
                equal split over the peers that may aggregate where it is
                smaller): a bound on the busiest peer's upload, at the cost
                of the optimal round time when the bound binds.

        Returns:
            The plan: shares, predicted times and throughput.

        Raises:
            ConfigError: On invalid arguments, or a group without an
                aggregator or without a computing peer.
            LoadBalancingError: If the LP solver fails or reports no optimum.
        """
        coeffs = traffic_coefficients(peers)
        equal_time = evaluate_round_time(equal_shares(peers), peers, vector_bytes)
        batch = target_batch_size
        if isinstance(batch, bool) or not isinstance(batch, int | float):
            raise ConfigError(f"target_batch_size must be a number, got {batch!r}")
        if not math.isfinite(batch) or batch <= 0:
            raise ConfigError(f"target_batch_size must be positive and finite, got {batch!r}")

        started = time.perf_counter()
        bandwidth = np.minimum(coeffs.upload_bytes_per_s, coeffs.download_bytes_per_s)
        may = coeffs.can_aggregate.astype(np.float64)
        cap = may * _share_cap(max_share, float(may.sum()))
        reference = bandwidth * may / float((bandwidth * may).sum())
        if max_share is not None:
            reference = project_onto_capped_simplex(reference, np.zeros_like(cap), cap)
        evenly = may / float(may.sum())
        # The time unit is the better of two simple splits, an upper bound on
        # T* and within a small factor of it, so the LP sees T* near one even
        # when a very slow peer would make equal shares absurdly slow. (Both
        # are 0 only when a lone computing peer aggregates everything.)
        seconds = _PeerTimes.of(coeffs, vector_bytes, 1.0)
        simple = min((reference, evenly), key=seconds.round_time)
        unit = seconds.round_time(simple)
        if unit > 0:
            times = _PeerTimes.of(coeffs, vector_bytes, unit)
            # Stage one: the optimal round time, evaluated exactly on the
            # solver's shares (made valid) so that it is achievable; the
            # simple split stands in should the solver's be slower. Slopes of
            # peers that cannot aggregate are irrelevant (their share is 0)
            # and may be huge: the solver does not see them.
            solved = self._lp(len(peers)).solve(times.masked(cap), cap, self._config.solver)
            first = min((solved, simple), key=times.round_time)
        else:  # a lone computing peer aggregates everything: nothing travels
            times, first = seconds, simple
        best = times.round_time(first)

        # Stage two: the unique point of the near-optimal set closest to the
        # bandwidth-proportional split. ``first`` lies inside the bounds.
        limit = best * (1.0 + self._config.tie_tolerance)
        lower, upper = times.share_bounds(cap, limit)
        lower, upper = np.minimum(lower, first), np.maximum(upper, first)  # absorb rounding
        upper = _pin_near_binding(times, lower, upper, limit, self._config.binding_margin)
        final = project_onto_capped_simplex(reference, lower, upper)
        final = final / float(final.sum())
        elapsed = time.perf_counter() - started

        shares = tuple(float(x) for x in final)
        upload_s, download_s = transfer_times(shares, peers, vector_bytes)
        round_time = max(*upload_s, *download_s)  # as evaluate_round_time computes it
        throughput = sum(peer.samples_per_s for peer in peers if peer.computes)
        compute_time = batch / throughput if throughput > 0 else math.inf
        sequential, overlapped = swarm_steps_per_s(compute_time, round_time)
        logger.debug(
            "planned %d peers in %.2f ms: T=%.4g s (equal shares %.4g s)",
            len(peers),
            elapsed * 1e3,
            round_time,
            equal_time,
        )
        return LoadBalancePlan(
            shares=shares,
            round_time_s=round_time,
            upload_time_s=upload_s,
            download_time_s=download_s,
            equal_shares_round_time_s=equal_time,
            compute_time_s=compute_time,
            steps_per_s_sequential=sequential,
            steps_per_s_overlapped=overlapped,
            solver=self._config.solver,
            solve_time_s=elapsed,
        )

    def _lp(self, size: int) -> _RoundTimeLP:
        lp = self._cache.get(size)
        if lp is None:
            lp = _RoundTimeLP(size)
            self._cache[size] = lp
            while len(self._cache) > self._config.max_cached_sizes:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(size)
        return lp
