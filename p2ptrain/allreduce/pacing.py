"""How fast a member lets the kernel send each of its round's bulk streams.

Theory of operation
-------------------
In a round a member uploads to several partners at once: its parts to every
reducer, and (as a reducer) the averages back to every sender. Unpaced, each
of those TCP connections starts by sending bursts (slow start, or BBR's
start-up at 2.89 times its estimate) as if it had the uplink to itself; on
a home's 50 Mbit/s uplink two such starts together overran a 50 ms shaper
queue in 4 of 10 rounds of 1 MiB and cost a retransmission timeout each.

So each connection is paced (``SO_MAX_PACING_RATE``) at the member's upload
estimate times the connection's share of the bytes the member uploads in
the round, times a headroom: the streams then finish together at the
uplink's rate, as the load balancer's fluid model assumes, and their sum
never exceeds ``headroom`` times the uplink. The headroom also lets an
estimate that reads low grow: a paced stream can run ``headroom`` times
faster than the estimate, and the next round measures that.
"""

from __future__ import annotations

from dataclasses import dataclass

from p2ptrain.allreduce.group import GroupPlan
from p2ptrain.validate import check_number

__all__ = ["PacingRates", "pacing_rates"]


@dataclass(frozen=True, slots=True)
class PacingRates:
    """Per partner (plan index), the send rate cap in bytes/s of each bulk stream.

    Attributes:
        parts: For the streams carrying this member's parts to reducer ``j``.
        results: For the streams carrying this member's averages to sender ``i``.
    """

    parts: dict[int, float]
    results: dict[int, float]


def pacing_rates(
    plan: GroupPlan,
    index: int,
    *,
    sends_parts: bool,
    upload_bytes_per_s: float,
    headroom: float,
) -> PacingRates:
    """The pacing rates of member ``index``'s streams in a round of ``plan``.

    Args:
        plan: The round's plan.
        index: This member's index in it.
        sends_parts: Whether this member sends parts (weight > 0, not an all-gather).
        upload_bytes_per_s: This member's upload estimate.
        headroom: Factor over the proportional rate (at least 1).

    Returns:
        The rates; empty where this member uploads nothing.
    """
    check_number("upload_bytes_per_s", upload_bytes_per_s, above=0.0)
    check_number("headroom", headroom, at_least=1.0)
    parts: dict[int, int] = {}
    if sends_parts:
        for j in plan.reducers():
            if j != index:
                lo, hi = plan.part(j)
                parts[j] = hi - lo
    lo, hi = plan.part(index)
    own = hi - lo
    results = {i: own for i in range(plan.size) if i != index} if own else {}
    total = sum(parts.values()) + sum(results.values())
    if total == 0:
        return PacingRates({}, {})
    scale = headroom * upload_bytes_per_s / total
    return PacingRates(
        {j: n * scale for j, n in parts.items() if n},
        {i: n * scale for i, n in results.items()},
    )
