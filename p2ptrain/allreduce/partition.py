"""How a butterfly all-reduce splits its vector among peers, and what each split costs.

Pure functions, no solver and no I/O. A round averages one flat vector of
``vector_bytes`` bytes. Peer *i* aggregates a share ``w_i`` of it: in the
reduce-scatter every gradient contributor sends part *i* to peer *i*, which
averages it; in the all-gather peer *i* sends the averaged part to every peer
that needs the result. The shares sum to one.

Peers come in three roles, described by :class:`PeerCapacity`:

* a normal peer computes gradients, aggregates and needs the result;
* a peer in ``client_mode`` cannot accept connections, so it never aggregates
  (its share is zero) but still sends its parts and receives the result;
* an auxiliary peer (``computes=False``) aggregates but contributes no
  gradient and needs no result.

With ``m`` computing peers and ``g_i = 1`` when peer *i* computes, peer *i*
moves in one round (in units of the vector)::

    upload_i   = g_i·(1 − w_i)  [its parts, reduce-scatter]  + w_i·(m − g_i)  [results, all-gather]
    download_i = w_i·(m − g_i)  [parts, reduce-scatter]      + g_i·(1 − w_i)  [results, all-gather]

Both equal ``g_i + (m − 2·g_i)·w_i``, affine in the share. The round lasts as
long as the slowest transfer: ``T = max_i (max(upload_i / u_i, download_i / d_i) + L_i)``,
streaming assumed (the two phases overlap). ``L_i`` is the peer's latency
term, :func:`latency_s` of its largest round-trip time to the others
(:attr:`PeerCapacity.rtt_s`), its slower direction and the vector size: a
constant per peer and plan, so every peer's time stays affine in its own
share and the LP stays exact.

The latency term. A round is two transfers one after the other on every
connection, parts out and averages back: each pays a round trip to cross,
and each starts on a connection that sat idle since the last round, so TCP
(Linux restarts slow start after an idle period longer than the
retransmission timeout) begins again from its initial window of
:data:`INITIAL_WINDOW_BYTES` and doubles it once per round trip until it
holds what the path holds, ``window = min(V, r·RTT)``. That takes
``log2(window / W0)`` round trips, during which ``W0 + 2·W0 + … + window/2
≈ window`` bytes went out, so a phase loses ``RTT·log2(window / W0) − window / r``
beyond its bandwidth time. Every connection of the round ends on the
group's slowest link (a fast peer's streams ramp up no faster than their
slow partners), so ``r`` is the group's slowest rate::

    L_i = 2·RTT_i + 2·max(0, RTT_i·log2(window_i / W0) − window_i / r_min)

On 40 ms paths with a 50 Mbit/s slowest link that is 0.33 s: more than the
bandwidth time of a 1 MiB round, a tenth of a 16 MiB one
(``bench_allreduce.py``'s RTT rows)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
from numpy.typing import NDArray

from p2ptrain.errors import ConfigError
from p2ptrain.validate import check_number

__all__ = [
    "PeerCapacity",
    "TrafficCoefficients",
    "equal_shares",
    "evaluate_round_time",
    "latency_s",
    "shares_to_boundaries",
    "slow_start_s",
    "traffic_coefficients",
    "transfer_times",
]

INITIAL_WINDOW_BYTES = 10 * 1448
"""TCP's initial congestion window (10 segments of a 1448-byte MSS)."""
ROUND_PHASES = 2
"""Transfers one after the other on a connection in a round: parts, then averages."""

SHARE_SUM_TOLERANCE = 1e-6
"""How far from one a share vector's sum may be before it is rejected."""

FloatArray = NDArray[np.float64]


def _check_positive_finite(name: str, value: object) -> float:
    check_number(name, value)
    return float(value)  # type: ignore[arg-type]  # check_number made sure


@dataclass(frozen=True, slots=True)
class PeerCapacity:
    """What one peer can do in a round, as measured or announced.

    Attributes:
        upload_bytes_per_s: Upload bandwidth in bytes per second; positive, finite.
        download_bytes_per_s: Download bandwidth in bytes per second; positive,
            finite. Links are often asymmetric, so both directions count.
        samples_per_s: Compute throughput in training samples per second;
            finite, at least zero. Ignored for auxiliary peers.
        client_mode: The peer cannot accept incoming connections, so it never
            aggregates: its share is always zero.
        computes: The peer computes gradients and needs the averaged result.
            ``False`` marks an auxiliary peer, which only aggregates. A peer
            that neither computes nor accepts connections has no role and
            moves no data.
        rtt_s: The largest round-trip time from the peer to the others, in
            seconds; finite, at least zero (0: latency ignored).
    """

    upload_bytes_per_s: float
    download_bytes_per_s: float
    samples_per_s: float = 0.0
    client_mode: bool = False
    computes: bool = True
    rtt_s: float = 0.0

    def __post_init__(self) -> None:
        _check_positive_finite("upload_bytes_per_s", self.upload_bytes_per_s)
        _check_positive_finite("download_bytes_per_s", self.download_bytes_per_s)
        speed = self.samples_per_s
        if isinstance(speed, bool) or not isinstance(speed, int | float):
            raise ConfigError(f"samples_per_s must be a number, got {speed!r}")
        if not math.isfinite(speed) or speed < 0:
            raise ConfigError(f"samples_per_s must be finite and >= 0, got {speed!r}")
        for name in ("client_mode", "computes"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        rtt = self.rtt_s
        if isinstance(rtt, bool) or not isinstance(rtt, int | float):
            raise ConfigError(f"rtt_s must be a number, got {rtt!r}")
        if not math.isfinite(rtt) or rtt < 0:
            raise ConfigError(f"rtt_s must be finite and >= 0, got {rtt!r}")

    @property
    def can_aggregate(self) -> bool:
        """Whether the peer may be given a non-zero share."""
        return not self.client_mode


@dataclass(frozen=True, slots=True)
class TrafficCoefficients:
    """Bytes each peer moves in a round, as ``vector_bytes · (fixed + per_share · w_i)``.

    All arrays have one entry per peer, in the order the peers were given.
    Upload and download coincide under the butterfly model; they are kept
    apart so that each direction is checked against its own bandwidth.

    Attributes:
        upload_fixed: Upload that does not depend on the peer's own share.
        upload_per_share: Upload added per unit of the peer's own share.
        download_fixed: Download that does not depend on the peer's own share.
        download_per_share: Download added per unit of the peer's own share.
        upload_bytes_per_s: Each peer's upload bandwidth.
        download_bytes_per_s: Each peer's download bandwidth.
        can_aggregate: Whether each peer may be given a non-zero share.
        rtt_s: Each peer's largest round-trip time.
    """

    upload_fixed: FloatArray
    upload_per_share: FloatArray
    download_fixed: FloatArray
    download_per_share: FloatArray
    upload_bytes_per_s: FloatArray
    download_bytes_per_s: FloatArray
    can_aggregate: NDArray[np.bool_]
    rtt_s: FloatArray

    def latency_s(self, vector_bytes: float) -> FloatArray:
        """Each peer's latency term for a vector of ``vector_bytes`` (see :func:`latency_s`)."""
        slowest = float(np.min(np.minimum(self.upload_bytes_per_s, self.download_bytes_per_s)))
        return np.array(
            [latency_s(float(rtt), slowest, vector_bytes) for rtt in self.rtt_s],
            dtype=np.float64,
        )


def latency_s(rtt_s: float, slowest_bytes_per_s: float, vector_bytes: float) -> float:
    """Seconds a round costs beyond its bandwidth time, for a peer ``rtt_s`` from the others.

    ``2·RTT + 2·max(0, RTT·log2(w / W0) − w / r)`` with ``w = min(vector_bytes, r·RTT)``,
    ``r`` the group's slowest rate and ``W0`` = :data:`INITIAL_WINDOW_BYTES`: a round
    trip and the slow-start ramp of each of the round's two phases (module docstring).
    """
    if rtt_s <= 0:
        return 0.0
    window = min(vector_bytes, slowest_bytes_per_s * rtt_s)
    ramp = slow_start_s(rtt_s, window) - window / slowest_bytes_per_s
    return ROUND_PHASES * (rtt_s + max(ramp, 0.0))


def slow_start_s(rtt_s: float, window_bytes: float) -> float:
    """Seconds slow start takes from :data:`INITIAL_WINDOW_BYTES` to ``window_bytes``.

    ``RTT·log2(window / W0)``: the window doubles once per round trip (0 when
    the initial window already holds it).
    """
    return rtt_s * math.log2(max(window_bytes / INITIAL_WINDOW_BYTES, 1.0))


def _check_peers(peers: Sequence[PeerCapacity]) -> None:
    if isinstance(peers, str | bytes) or not isinstance(peers, Sequence):
        raise ConfigError(f"peers must be a sequence of PeerCapacity, got {type(peers).__name__}")
    if not peers:
        raise ConfigError("peers must not be empty")
    for index, peer in enumerate(peers):
        if not isinstance(peer, PeerCapacity):
            raise ConfigError(f"peers[{index}] must be a PeerCapacity, got {peer!r}")
    if not any(peer.can_aggregate for peer in peers):
        raise ConfigError("no peer can aggregate: every peer is in client mode")
    if not any(peer.computes for peer in peers):
        raise ConfigError("no peer computes gradients: there is nothing to average")


def traffic_coefficients(peers: Sequence[PeerCapacity]) -> TrafficCoefficients:
    """Derive each peer's traffic in a round as an affine function of its share.

    Args:
        peers: The peers of the group; at least one computes and at least one
            can aggregate.

    Returns:
        The coefficients, in units of the vector size.

    Raises:
        ConfigError: If ``peers`` is empty, holds something else than
            :class:`PeerCapacity`, or no peer can aggregate or compute.
    """
    _check_peers(peers)
    computes = np.array([peer.computes for peer in peers], dtype=np.float64)
    contributors = float(computes.sum())  # m: senders of parts, receivers of results
    # Reduce-scatter: a contributor uploads every part but its own, (1 − w_i);
    # an aggregator downloads its part from every other contributor, w_i·(m − g_i).
    # All-gather: an aggregator uploads its averaged part to every other
    # receiver, w_i·(m − g_i); a receiver downloads every part but its own, (1 − w_i).
    others = contributors - computes
    return TrafficCoefficients(
        upload_fixed=computes.copy(),
        upload_per_share=others - computes,
        download_fixed=computes.copy(),
        download_per_share=others - computes,
        upload_bytes_per_s=np.array([p.upload_bytes_per_s for p in peers], dtype=np.float64),
        download_bytes_per_s=np.array([p.download_bytes_per_s for p in peers], dtype=np.float64),
        can_aggregate=np.array([peer.can_aggregate for peer in peers], dtype=np.bool_),
        rtt_s=np.array([peer.rtt_s for peer in peers], dtype=np.float64),
    )


def _check_vector_bytes(vector_bytes: float) -> float:
    return _check_positive_finite("vector_bytes", vector_bytes)


def _check_shares(shares: Sequence[float], count: int) -> FloatArray:
    if isinstance(shares, str | bytes) or not isinstance(shares, Sequence | np.ndarray):
        raise ConfigError(f"shares must be a sequence of numbers, got {type(shares).__name__}")
    if len(shares) != count:
        raise ConfigError(f"expected {count} shares, got {len(shares)}")
    try:
        values = np.array(shares, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"shares must be numbers: {exc}") from exc
    if values.ndim != 1 or not np.all(np.isfinite(values)):
        raise ConfigError("shares must be finite numbers")
    if np.any(values < 0):
        raise ConfigError(f"shares must be >= 0, got {values.min()!r}")
    total = float(values.sum())
    if abs(total - 1.0) > SHARE_SUM_TOLERANCE:
        raise ConfigError(f"shares must sum to 1, got {total!r}")
    return values


def transfer_times(
    shares: Sequence[float], peers: Sequence[PeerCapacity], vector_bytes: float
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Predict how long each peer uploads and downloads in one round (its latency included).

    Args:
        shares: One share per peer: at least zero, summing to one, zero for
            peers in client mode.
        peers: The peers, in the order of ``shares``.
        vector_bytes: Size of the averaged vector in bytes, e.g.
            ``tensor.numel() * tensor.element_size()``.

    Returns:
        ``(upload_seconds, download_seconds)``, one entry per peer each.

    Raises:
        ConfigError: On invalid peers, shares or size, or a non-zero share
            given to a peer in client mode.
    """
    coeffs = traffic_coefficients(peers)
    size = _check_vector_bytes(vector_bytes)
    w = _check_shares(shares, len(peers))
    if np.any(w[~coeffs.can_aggregate] > 0):
        raise ConfigError("peers in client mode cannot aggregate: their shares must be 0")
    upload = size * (coeffs.upload_fixed + coeffs.upload_per_share * w)
    download = size * (coeffs.download_fixed + coeffs.download_per_share * w)
    # Clamp the rounding error of 1 − w at w = 1 so that no time is negative.
    latency = coeffs.latency_s(size)
    upload_s = np.maximum(upload, 0.0) / coeffs.upload_bytes_per_s + latency
    download_s = np.maximum(download, 0.0) / coeffs.download_bytes_per_s + latency
    return tuple(float(x) for x in upload_s), tuple(float(x) for x in download_s)


def evaluate_round_time(
    shares: Sequence[float], peers: Sequence[PeerCapacity], vector_bytes: float
) -> float:
    """Predict the round time of the butterfly all-reduce for a given split.

    Args:
        shares: One share per peer (see :func:`transfer_times`).
        peers: The peers, in the order of ``shares``.
        vector_bytes: Size of the averaged vector in bytes.

    Returns:
        The time in seconds until the busiest link of the busiest peer is done.

    Raises:
        ConfigError: On invalid peers, shares or size.
    """
    upload_s, download_s = transfer_times(shares, peers, vector_bytes)
    return max(*upload_s, *download_s)


def equal_shares(peers: Sequence[PeerCapacity]) -> tuple[float, ...]:
    """Split the vector equally among the peers that may aggregate.

    Args:
        peers: The peers of the group.

    Returns:
        ``1/k`` for each of the ``k`` peers not in client mode, ``0.0`` for the others.

    Raises:
        ConfigError: On invalid peers, or if every peer is in client mode.
    """
    _check_peers(peers)
    count = sum(1 for peer in peers if peer.can_aggregate)
    return tuple(1.0 / count if peer.can_aggregate else 0.0 for peer in peers)


def shares_to_boundaries(shares: Sequence[float], num_elements: int) -> list[int]:
    """Turn fractional shares into integer element boundaries (largest remainder).

    Part *i* is ``range(boundaries[i], boundaries[i + 1])``. Each part's size
    is the floor or the ceiling of ``shares[i] · num_elements`` (the shares
    normalised to sum exactly to one); the elements left over after flooring
    go to the largest remainders, ties to the lower index. The arithmetic is
    exact, so a zero share always gets an empty part.

    Args:
        shares: One share per peer: at least zero, summing to one.
        num_elements: Length of the vector, at least zero.

    Returns:
        ``len(shares) + 1`` non-decreasing integers from ``0`` to ``num_elements``.

    Raises:
        ConfigError: If the shares are not valid or ``num_elements`` is negative
            or not an integer.
    """
    if isinstance(num_elements, bool) or not isinstance(num_elements, int | np.integer):
        raise ConfigError(f"num_elements must be an int, got {num_elements!r}")
    if num_elements < 0:
        raise ConfigError(f"num_elements must be >= 0, got {num_elements}")
    values = _check_shares(shares, len(shares))
    exact = [Fraction(float(x)) for x in values]
    total = sum(exact, Fraction(0))
    quotas = [x * int(num_elements) / total for x in exact]
    sizes = [math.floor(q) for q in quotas]
    leftover = int(num_elements) - sum(sizes)
    by_remainder = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - sizes[i]), i))
    for index in by_remainder[:leftover]:
        sizes[index] += 1
    boundaries = [0]
    for size in sizes:
        boundaries.append(boundaries[-1] + size)
    return boundaries
