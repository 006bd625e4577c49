"""A peer's NAT traversal counters (read by :func:`p2ptrain.app.collectors.nat_collector`).

Plain integers bumped on the event loop; a snapshot from another thread may
be one traversal behind, never torn.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

from p2ptrain.nat.paths import CROSSING, Traversal

__all__ = ["TRAVERSAL_BUCKETS", "TraversalStats"]

TRAVERSAL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Upper bounds (seconds) of the traversal-time histogram's buckets; ``+Inf`` is added.

From a direct dial on a LAN (milliseconds) to a relay reached after hole
punching and TURN timed out (tens of seconds)."""


@dataclass
class TraversalStats:
    """What this peer's traversals did.

    Attributes:
        connected: Traversals that made a connection, by the path it took.
        fallbacks: Cheaper attempts skipped or failed before the one that
            worked (or before all failed), by attempt.
        failed: Traversals in which every attempt failed.
        crossing: Traversals that kept the connection of a peer dialing us at once.
        seconds: Summed duration of the traversals that connected.
        buckets: Traversals that connected per duration bucket: entry i
            counts durations in (``TRAVERSAL_BUCKETS[i-1]``,
            ``TRAVERSAL_BUCKETS[i]``], the last entry those above them all.
    """

    connected: Counter[str] = field(default_factory=Counter)
    fallbacks: Counter[str] = field(default_factory=Counter)
    failed: int = 0
    crossing: int = 0
    seconds: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(TRAVERSAL_BUCKETS) + 1))

    def record(self, traversal: Traversal) -> None:
        """Count a traversal that connected (``pooled`` ones made nothing new)."""
        if traversal.attempt == "pooled":
            return
        self.connected[traversal.path] += 1
        self.fallbacks.update(a for a in traversal.attempts if a != CROSSING)
        self.crossing += traversal.crossing
        self.seconds += traversal.seconds
        self.buckets[bisect.bisect_left(TRAVERSAL_BUCKETS, traversal.seconds)] += 1

    def record_failure(self, attempts: dict[str, str]) -> None:
        """Count a traversal in which every attempt (the keys of ``attempts``) failed."""
        self.failed += 1
        self.fallbacks.update(attempts.keys())  # a mapping would add its reasons as counts
