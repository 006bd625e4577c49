"""How a reducer combines the parts of one chunk: the weighted mean or a robust rule.

A reducer aggregates every chunk of its shard separately, from the parts of
the senders that delivered that chunk, each with its weight ``w_i > 0``.

``mean`` computes ``Σ w_i·x_i / Σ w_i`` in place in the output buffer as the
parts arrive, as a running mean (float32, so it stays at the scale of the
values and needs no final division). One bad sender moves it arbitrarily far.

The robust rules keep the chunk's parts until it is complete, then combine
them. Write ``H`` for the honest senders of a chunk, ``x̄_H`` for their
weighted mean, ``lo_H`` / ``hi_H`` for their coordinate-wise minimum and
maximum, ``D_H = ‖hi_H − lo_H‖₂`` and ``R_H = max_{i∈H} ‖x_i − x̄_H‖₂``.

``trimmed_mean`` (coordinate-wise, ``b = trim``): in every coordinate, drop
the ``b`` smallest and ``b`` largest values, then take the weighted mean of
the rest. **Bound:** if at most ``b`` of the ``n ≥ 2b + 1`` senders are bad,
every coordinate of the result lies in ``[lo_H, hi_H]``, whatever the bad
values and weights: a kept value has the ``b`` dropped values above it, so
``b + 1`` values are at least as large; at most ``b`` of them are bad, so an
honest value is at least as large (likewise below), and a weighted mean of
kept values stays between them. With fewer than ``2b + 1`` senders, ``b`` drops
to ``⌊(n − 1)/2⌋`` (a median for two or three senders; the plain mean for
one or two).

``centered_clip`` (Karimireddy, He and Jaggi, 2021), with ``L`` iterations and
radius ``τ``: start from the coordinate-wise median ``v_0``, then repeat
``v ← v + Σ a_i·clip(x_i − v, τ)`` with ``a_i = w_i / Σ w`` and
``clip(z, τ) = z·min(1, τ/‖z‖₂)``. **Bounds**, when fewer than half the
senders are bad (so ``v_0`` lies in ``[lo_H, hi_H]``, as ``x̄_H`` does, and
``‖v_0 − x̄_H‖ ≤ D_H``):

* always: every step moves ``v`` by at most ``τ``, so
  ``‖result − x̄_H‖ ≤ D_H + L·τ``. With the default radius (the median
  distance of the senders to ``v_0``, which a bad minority cannot inflate),
  ``τ ≤ R_H + D_H``; :func:`centered_clip_bound` evaluates the bound;
* if also ``τ ≥ R_H``: bad senders of total weight fraction ``α`` move the
  result at most ``2·α·τ`` per step (the step map is non-expansive and fixes
  ``x̄_H`` when the bad parts are replaced by ``x̄_H``), so
  ``‖result − x̄_H‖ ≤ D_H + 2·L·α·τ``.

Neither bound depends on the size of the bad values. A sender may lie about
its weight; the bounds above do not use the weights of bad senders except
through ``α``.
"""

from __future__ import annotations

import abc
import math

import torch

from p2ptrain.allreduce.config import AllReduceConfig
from p2ptrain.errors import ConfigError

__all__ = [
    "ChunkAggregator",
    "MeanAggregator",
    "RobustAggregator",
    "all_finite",
    "centered_clip",
    "centered_clip_bound",
    "make_aggregator",
    "trimmed_mean",
]


class ChunkAggregator(abc.ABC):
    """Combines the parts of one chunk into ``out``.

    Args:
        out: Where the result goes (a view into the output vector); it may be
            used as scratch space before :meth:`finish`.
    """

    def __init__(self, out: torch.Tensor) -> None:
        self.out = out
        self.total_weight = 0.0
        self.count = 0

    @abc.abstractmethod
    def add(self, values: torch.Tensor, weight: float) -> None:
        """Add one sender's finite values with weight > 0.

        ``values`` must stay unchanged until :meth:`finish` (robust rules keep
        a reference).
        """

    @abc.abstractmethod
    def finish(self) -> bool:
        """Write the result into ``out``; return False (``out`` untouched) if nothing was added."""


class MeanAggregator(ChunkAggregator):
    """The weighted mean, kept as a running mean in place as parts arrive.

    Each part moves the mean towards itself by its share of the weight so far
    (``lerp``), so the result needs no final division: one pass over the chunk
    per part. The first part is only remembered; the second is combined with
    it straight into ``out`` (no copy).
    """

    def __init__(self, out: torch.Tensor) -> None:
        super().__init__(out)
        self._first: torch.Tensor | None = None

    def add(self, values: torch.Tensor, weight: float) -> None:
        self.total_weight += weight
        self.count += 1
        share = weight / self.total_weight
        if self.count == 1:
            self._first = values
        elif self._first is not None:
            torch.lerp(self._first, values, share, out=self.out)
            self._first = None
        else:
            self.out.lerp_(values, share)

    def finish(self) -> bool:
        if self.count == 0:
            return False
        if self._first is not None:  # a single part: the mean is the part itself
            self.out.copy_(self._first)
            self._first = None
        return True


class RobustAggregator(ChunkAggregator):
    """Keeps the parts of a chunk, then applies a robust rule to them all."""

    def __init__(self, out: torch.Tensor, config: AllReduceConfig) -> None:
        super().__init__(out)
        self._config = config
        self._values: list[torch.Tensor] = []
        self._weights: list[float] = []

    def add(self, values: torch.Tensor, weight: float) -> None:
        self._values.append(values)
        self._weights.append(weight)
        self.total_weight += weight
        self.count += 1

    def finish(self) -> bool:
        if self.count == 0:
            return False
        stacked = torch.stack(self._values)
        weights = torch.tensor(self._weights, dtype=torch.float64)
        if self._config.aggregation == "trimmed_mean":
            result = trimmed_mean(stacked, weights, self._config.trim)
        else:
            result = centered_clip(
                stacked,
                weights,
                iterations=self._config.clip_iterations,
                radius=self._config.clip_radius,
            )
        self.out.copy_(result)
        self._values.clear()
        return True


def all_finite(values: torch.Tensor) -> bool:
    """Whether every element of ``values`` is finite.

    A sum is some 50 times faster than ``isfinite().all()`` and is finite
    only if every element is; only when it is not (a NaN or ±Inf, or an
    overflow of large finite values) are the elements checked one by one.
    """
    if math.isfinite(float(values.sum())):
        return True
    return bool(values.isfinite().all())


def make_aggregator(config: AllReduceConfig, out: torch.Tensor) -> ChunkAggregator:
    """The aggregator ``config.aggregation`` names, writing into ``out``."""
    if config.aggregation == "mean":
        return MeanAggregator(out)
    return RobustAggregator(out, config)


def _check_stack(values: torch.Tensor, weights: torch.Tensor) -> None:
    if values.dim() != 2 or values.shape[0] == 0:
        raise ConfigError("values must be a non-empty (senders, elements) tensor")
    if weights.shape != (values.shape[0],):
        raise ConfigError("weights need one entry per sender")
    if not bool((weights > 0).all()) or not bool(weights.isfinite().all()):
        raise ConfigError("weights must be positive and finite")


def trimmed_mean(values: torch.Tensor, weights: torch.Tensor, trim: int) -> torch.Tensor:
    """The coordinate-wise weighted trimmed mean.

    Args:
        values: ``(senders, elements)`` finite values.
        weights: One positive weight per sender.
        trim: Values dropped at each end of every coordinate; reduced to
            ``⌊(senders − 1)/2⌋`` when there are too few senders.

    Returns:
        The ``elements`` results, float32.
    """
    _check_stack(values, weights)
    count = values.shape[0]
    trim = min(trim, (count - 1) // 2)
    if trim == 0:
        return ((weights / weights.sum()) @ values.double()).to(torch.float32)
    ordered, order = values.sort(dim=0)
    kept = ordered[trim : count - trim].double()
    kept_weights = weights[order[trim : count - trim]]
    result = (kept * kept_weights).sum(dim=0) / kept_weights.sum(dim=0)
    return result.to(torch.float32)


def centered_clip(
    values: torch.Tensor,
    weights: torch.Tensor,
    *,
    iterations: int,
    radius: float | None = None,
) -> torch.Tensor:
    """Centered clipping from the coordinate-wise median.

    Args:
        values: ``(senders, elements)`` finite values.
        weights: One positive weight per sender.
        iterations: Number of clipping steps ``L``.
        radius: Clipping radius ``τ``; None uses the (lower) median distance
            of the senders to the coordinate-wise median.

    Returns:
        The ``elements`` results, float32.
    """
    _check_stack(values, weights)
    data = values.double()
    share = weights / weights.sum()
    center = data.median(dim=0).values
    if radius is None:
        radius = float((data - center).norm(dim=1).median())
    for _ in range(iterations):
        offsets = data - center
        norms = offsets.norm(dim=1)
        scale = torch.where(norms > radius, radius / norms.clamp_min(1e-300), 1.0)
        center = center + (share * scale) @ offsets
    return center.to(torch.float32)


def centered_clip_bound(
    honest: torch.Tensor, honest_weights: torch.Tensor, *, iterations: int, radius: float | None
) -> float:
    """The distance from the honest mean that :func:`centered_clip` cannot exceed.

    Valid while fewer than half the senders are bad: ``D_H + L·τ`` with
    ``τ`` the given radius, or ``R_H + D_H`` for the default radius (see the
    module docstring).

    Args:
        honest: ``(honest senders, elements)`` values of the honest senders.
        honest_weights: Their weights.
        iterations: ``L``.
        radius: The radius given to :func:`centered_clip` (None: the default).
    """
    _check_stack(honest, honest_weights)
    data = honest.double()
    mean = (honest_weights / honest_weights.sum()) @ data
    spread = float((data.max(dim=0).values - data.min(dim=0).values).norm())
    reach = float((data - mean).norm(dim=1).max())
    tau = reach + spread if radius is None else radius
    bound = spread + iterations * tau
    return bound * (1 + 1e-5) + 1e-6 * math.sqrt(honest.shape[1])  # float32 rounding slack
