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

Only where a stream lasts well beyond its slow start
(:func:`worth_pacing`): a round shorter than about twice the ramp to the
stream's rate (rounds of 1 MiB at 40 ms RTT on a 50 Mbit/s uplink) ends
while the windows still grow, with no steady state to split, and a cap then
only costs: paced slow starts send evenly spaced ACK trains, which make
CUBIC's HyStart leave slow start early and lower the slow-start threshold
that the next round's restart after idle keeps. Measured in the 40 ms star
lab, eight peers, rounds 1 s apart: 1 MiB paced 0.47–0.81 s and growing
from round to round, unpaced 0.49–0.55 s (predicted 0.50–0.52 s); 16 MiB
paced 2.99–3.06 s, unpaced 3.2–6.2 s (predicted 3.02 s: the homes' two streams,
split evenly by TCP instead of 78/22, then lose packets and win back the
link slowly at that RTT).
"""

from __future__ import annotations

from dataclasses import dataclass

from p2ptrain.allreduce.group import GroupPlan
from p2ptrain.allreduce.partition import slow_start_s
from p2ptrain.validate import check_number

__all__ = ["RAMPS_TO_PACE", "PacingRates", "pacing_rates", "worth_pacing"]

RAMPS_TO_PACE = 2.0
"""A stream is paced when the member's upload lasts at least this many slow-start ramps."""


@dataclass(frozen=True, slots=True)
class PacingRates:
    """Per partner (plan index), the send rate cap in bytes/s of each bulk stream.

    Attributes:
        parts: For the streams carrying this member's parts to reducer ``j``.
        results: For the streams carrying this member's averages to sender ``i``.
        upload_s: Seconds this member's round upload lasts at its estimate.
    """

    parts: dict[int, float]
    results: dict[int, float]
    upload_s: float = 0.0

    def rate(self, bytes_per_s: float | None, rtt_s: float | None) -> float | None:
        """The pacing rate of a stream given ``bytes_per_s`` above, or None when it goes unpaced."""
        if bytes_per_s is None or not worth_pacing(self.upload_s, bytes_per_s, rtt_s):
            return None
        return bytes_per_s


def worth_pacing(upload_s: float, bytes_per_s: float, rtt_s: float | None) -> bool:
    """Whether a stream paced at ``bytes_per_s`` outlasts its slow start enough to pace it.

    The ramp is ``rtt·log2(bytes_per_s·rtt / W0)``, the time slow start takes
    from the initial window to the window the rate needs; the stream is paced
    when ``upload_s`` is at least :data:`RAMPS_TO_PACE` of them. An unknown
    round trip (no PING answered yet) paces.
    """
    if rtt_s is None or rtt_s <= 0.0:
        return True
    return upload_s >= RAMPS_TO_PACE * slow_start_s(rtt_s, bytes_per_s * rtt_s)


def pacing_rates(
    plan: GroupPlan,
    index: int,
    *,
    sends_parts: bool,
    upload_bytes_per_s: float,
    headroom: float,
    element_bytes: float,
) -> PacingRates:
    """The pacing rates of member ``index``'s streams in a round of ``plan``.

    Args:
        plan: The round's plan.
        index: This member's index in it.
        sends_parts: Whether this member sends parts (weight > 0, not an all-gather).
        upload_bytes_per_s: This member's upload estimate.
        headroom: Factor over the proportional rate (at least 1).
        element_bytes: Bytes an element takes on the wire (4 for float32
            uncompressed), for :attr:`PacingRates.upload_s`.

    Returns:
        The rates; empty where this member uploads nothing.
    """
    check_number("upload_bytes_per_s", upload_bytes_per_s, above=0.0)
    check_number("headroom", headroom, at_least=1.0)
    check_number("element_bytes", element_bytes, above=0.0)
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
        upload_s=total * element_bytes / upload_bytes_per_s,
    )
