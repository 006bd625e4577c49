"""Stochastic wiring: which peer of a stage gets the next micro-batch (pure logic).

The rule: **earliest expected completion, with jitter.** For each live peer
``i`` of the stage the trainer estimates when a micro-batch sent now would be
done::

    T_i = (q_i + f_i) * s_i + l_i

where ``q_i`` is the queue the peer announced (micro-batches it holds),
``f_i`` the trainer's own calls to it still in flight, ``s_i = b / r_i`` the
service time of a ``b``-sample micro-batch at the peer's announced rate
``r_i`` (samples/s), and ``l_i`` the trainer's moving average of its measured
call latency to that peer (compute plus network; ``s_i`` before any call).
Each ``T_i`` is multiplied by a factor drawn from ``[1, 1 + jitter]`` and the
smallest wins; with a small probability (``explore``) a uniformly drawn peer
is taken instead, so that no peer's figures go stale (a peer whose first
measurement was unlucky would otherwise never be asked again). Peers that
just failed a call are left out for a while.

Why it serves peers in proportion to speed when the stage is the bottleneck:
a peer receives work while its ``T_i`` is the smallest, and each micro-batch
it receives raises its ``T_i`` by ``s_i = b / r_i``. When work arrives at
least as fast as the stage can serve it, every peer keeps a backlog, the
backlogs settle where the ``T_i`` are equal (``(q_i + f_i) / r_i`` the same
for every peer), and each peer, never idle, serves at its own rate ``r_i``: a
peer twice as fast serves twice the samples (a queue simulation in
``tests/swarm/test_swarm_wiring.py`` checks the shares at 105 % load). Below
saturation the rule sends more to the fast peers than their share of speed
(it minimizes each micro-batch's completion time; a slow peer gets work only
when the fast ones have a backlog). The jitter spreads ties; exploration
re-measures the peers.

An unmeasured peer (no announced rate, no call returned yet) is costed at
the stage's typical service time (the median over its measured peers), so
an idle newcomer gets work at once and gets measured, but its backlog counts
like anyone's. Costed at zero, as it was, its backlog cost nothing and every
micro-batch a trainer sent before the first reply went to it: in the
simulator at 256 peers and 10 % churn, 26 newcomers a period each drew up to
the hold cap (64 micro-batches per trainer), and a slow newcomer held them
for minutes.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["Candidate", "LinkStats", "choose_peer", "expected_completion", "service_time"]


@dataclass(frozen=True)
class Candidate:
    """A live peer of a stage, as its announcement describes it.

    Attributes:
        address: ``peerid@host:port``.
        samples_per_s: Its measured throughput (0: not measured yet).
        queue: Micro-batches it holds (forward done, backward pending).
    """

    address: str
    samples_per_s: float
    queue: int


@dataclass
class LinkStats:
    """What one trainer measured of one stage peer."""

    latency_s: float | None = None
    in_flight: int = 0
    avoid_until: float = 0.0
    calls: int = 0
    failures: int = 0
    history: list[float] = field(default_factory=list)

    def observe(self, seconds: float, smoothing: float) -> None:
        """Fold a completed call's latency into the moving average."""
        self.calls += 1
        if self.latency_s is None:
            self.latency_s = seconds
        else:
            self.latency_s += smoothing * (seconds - self.latency_s)


def service_time(candidate: Candidate, stats: LinkStats | None, samples: int) -> float | None:
    """Seconds ``candidate`` takes for one ``samples``-sample micro-batch: from its
    announced rate, else from the trainer's measured latency; ``None`` if unmeasured."""
    if candidate.samples_per_s > 0:
        return max(samples, 1) / candidate.samples_per_s
    return None if stats is None else stats.latency_s


def expected_completion(
    candidate: Candidate, stats: LinkStats | None, samples: int, *, typical: float = 0.0
) -> float:
    """``T_i`` of the module docstring, in seconds (``typical``: the service time
    assumed for an unmeasured peer)."""
    stats = stats or LinkStats()
    latency = stats.latency_s
    service = service_time(candidate, stats, samples)
    if service is None:
        service = typical  # unmeasured: as fast as the stage's typical peer
    backlog = max(candidate.queue, 0) + stats.in_flight
    return backlog * service + (latency if latency is not None else service)


def choose_peer(
    candidates: Sequence[Candidate],
    stats: dict[str, LinkStats],
    *,
    samples: int,
    now: float,
    rng: random.Random,
    jitter: float,
    explore: float = 0.0,
    exclude: frozenset[str] = frozenset(),
) -> Candidate | None:
    """The candidate with the earliest jittered expected completion, or None if none is usable.

    Candidates in ``exclude`` or avoided until after ``now`` are skipped; if
    that leaves none, avoided peers (never excluded ones) are used again.
    With probability ``explore`` a uniformly drawn usable candidate is taken
    instead, so that every peer's figures keep being measured.
    """
    usable = [c for c in candidates if c.address not in exclude]
    fresh = [c for c in usable if stats.get(c.address, LinkStats()).avoid_until <= now]
    pool = fresh or usable
    if not pool:
        return None
    if explore > 0 and len(pool) > 1 and rng.random() < explore:
        return pool[rng.randrange(len(pool))]
    measured = sorted(
        t for c in pool if (t := service_time(c, stats.get(c.address), samples)) is not None
    )
    typical = measured[len(measured) // 2] if measured else 0.0
    best: Candidate | None = None
    best_time = 0.0
    for candidate in pool:
        when = expected_completion(
            candidate, stats.get(candidate.address), samples, typical=typical
        )
        when = (when + 1e-6) * (1.0 + jitter * rng.random())
        if best is None or when < best_time:
            best, best_time = candidate, when
    return best
