"""A round's time when TCP shares every link fairly among its connections.

Why. The load balancer's LP (:mod:`p2ptrain.allreduce.partition`) assumes
the fluid model: each peer's streams together use its links at full rate,
each stream at the rate its share of the bytes needs. TCP does not split a
link in the plan's proportions: every connection crossing a congested link
gets about the same rate (per-flow fairness). Where one peer's upload is the
only link that binds, that changes nothing: it is full either way. Where
several links bind at once, the connection that must carry most (a fast
server's parts for the largest reducer) is held to an equal share of its
links while smaller ones finish early and leave capacity nobody can use.
Measured on the star lab with every link binding (``bench_allreduce.py``'s
throttle scenario): raw TCP flows with the plan's bytes and no p2ptrain at
all took 1.25-1.48x the fluid time, p2ptrain's rounds 1.35-1.5x.

Model. One flow per ordered pair ``i → j`` carries what the round moves
that way (``i``'s part for reducer ``j`` if ``i`` computes, plus ``i``'s
averages if ``j`` needs the result); it crosses ``i``'s upload and ``j``'s
download. Rates are max-min fair (progressive filling: every unfrozen flow
grows alike until a link fills; the flows on it freeze) and re-allocated
whenever a flow finishes. The round ends with its last flow, plus the
largest latency term (:func:`~p2ptrain.allreduce.partition.latency_s`) of
the peers that move data. The time is never below the fluid model's
bandwidth time (no allocation beats the fluid bound) and equals it when one
link binds alone.

The LP still optimizes the fluid model (linear, exact, fast); this module
only predicts what its plan will take. Cost: a few to tens of milliseconds for 8
peers, about 0.1 s for 16 (every batch of flows that ends re-allocates);
:data:`MAX_PEERS` bounds the groups it is run for.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from p2ptrain.allreduce.partition import (
    PeerCapacity,
    evaluate_round_time,
    traffic_coefficients,
)

__all__ = ["MAX_PEERS", "fair_share_round_time", "pair_bytes"]

MAX_PEERS = 16
"""Largest group :func:`fair_share_round_time` simulates; larger ones get the fluid time."""

_REL_TOL = 1e-9
BATCH = 0.01
"""Flows ending within this fraction of the round's elapsed time end together (see below)."""


def pair_bytes(
    shares: Sequence[float], peers: Sequence[PeerCapacity], vector_bytes: float
) -> np.ndarray:
    """Bytes each ordered pair moves in a round: ``out[i, j]`` from ``i`` to ``j``."""
    coeffs = traffic_coefficients(peers)  # validates the peers
    w = np.asarray(shares, dtype=np.float64)
    computes = coeffs.upload_fixed > 0  # g_i = 1: sends parts, needs the result
    parts = np.outer(computes, w)  # i's part for reducer j
    results = np.outer(w, computes)  # reducer i's average for receiver j
    out = (parts + results) * vector_bytes
    np.fill_diagonal(out, 0.0)
    return out


def _bandwidth_time(flows: np.ndarray, upload: np.ndarray, download: np.ndarray) -> float:
    """Time until every flow is done under max-min fair rates, re-allocated as flows end."""
    left = flows.copy()
    active = left > 0
    scale = float(max(upload.max(), download.max()))
    t = 0.0
    while active.any():
        rate = np.zeros_like(left)
        frozen = ~active
        cap_up, cap_down = upload.copy(), download.copy()
        while not frozen.all():
            free = ~frozen
            on_up = free.sum(axis=1)  # unfrozen flows leaving each peer
            on_down = free.sum(axis=0)  # arriving at each peer
            with np.errstate(divide="ignore", invalid="ignore"):
                grow = min(
                    np.min(np.where(on_up > 0, cap_up / on_up, np.inf)),
                    np.min(np.where(on_down > 0, cap_down / on_down, np.inf)),
                )
            rate[free] += grow
            cap_up -= grow * on_up
            cap_down -= grow * on_down
            full_up = cap_up <= _REL_TOL * scale
            full_down = cap_down <= _REL_TOL * scale
            frozen |= full_up[:, None] | full_down[None, :]
        with np.errstate(divide="ignore", invalid="ignore"):
            end = t + np.where(active, left / rate, np.inf)
        # Flows that end within BATCH of the first one end together, at the
        # last of them: one re-allocation for the lot, and the time errs high
        # by at most that fraction (capacity they free a little early is not
        # handed on).
        first = float(end.min())
        batch = end <= first * (1 + BATCH)
        step_to = float(end[batch].max())
        left = np.where(batch, 0.0, np.where(active, left - rate * (step_to - t), 0.0))
        t = step_to
        active = left > _REL_TOL * scale
    return t


def fair_share_round_time(
    shares: Sequence[float], peers: Sequence[PeerCapacity], vector_bytes: float
) -> float:
    """Predict the round time of ``shares`` when TCP shares each link fairly (see above).

    Args:
        shares: One share per peer (see :func:`~p2ptrain.allreduce.partition.transfer_times`).
        peers: The peers, in the order of ``shares``.
        vector_bytes: Size of the averaged vector in bytes.

    Returns:
        Seconds; for groups larger than :data:`MAX_PEERS`, the fluid model's
        :func:`~p2ptrain.allreduce.partition.evaluate_round_time`.

    Raises:
        ConfigError: On invalid peers, shares or size.
    """
    fluid = evaluate_round_time(shares, peers, vector_bytes)  # validates everything
    if len(peers) > MAX_PEERS:
        return fluid
    flows = pair_bytes(shares, peers, vector_bytes)
    if not flows.any():
        return fluid
    coeffs = traffic_coefficients(peers)
    moving = (flows.sum(axis=1) + flows.sum(axis=0)) > 0
    latency = float(np.max(coeffs.latency_s(float(vector_bytes))[moving]))
    bandwidth = _bandwidth_time(flows, coeffs.upload_bytes_per_s, coeffs.download_bytes_per_s)
    # Never below the fluid bound (rounding in the simulation can only err low).
    return max(bandwidth + latency, fluid)
