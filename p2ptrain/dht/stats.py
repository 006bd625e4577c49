"""Counters of a DHT node's requests: sent, answered (with latency), failed, served.

Plain dict increments on the node's loop, no locks: reading them from another
thread (a metrics snapshot) sees a slightly stale but consistent-enough view.
:func:`p2ptrain.app.collectors.dht_collector` exposes them.
"""

from __future__ import annotations

import bisect

from p2ptrain.errors import (
    DeadlineExceededError,
    HandshakeError,
    TransportError,
    TransportTimeoutError,
    UnavailableError,
)

__all__ = ["FAILURE_REASONS", "LATENCY_BUCKETS", "RPCStats", "failure_reason"]

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Upper bounds (seconds) of the answer-latency histogram; a last bucket holds the rest."""

FAILURE_REASONS = ("timeout", "unreachable", "error")
"""How a request can fail: no answer in time, no connection, anything else."""


def failure_reason(exc: BaseException) -> str:
    """Which of :data:`FAILURE_REASONS` ``exc`` is."""
    if isinstance(exc, TimeoutError | DeadlineExceededError | TransportTimeoutError):
        return "timeout"
    if isinstance(exc, TransportError | HandshakeError | UnavailableError):
        return "unreachable"
    return "error"


class RPCStats:
    """Per-method figures of the requests a DHT node sends and serves.

    Attributes:
        sent: Requests sent, by method (a hedged lookup's cancelled queries
            count here but neither as answered nor failed).
        answered: Requests answered with a valid reply, by method.
        answer_seconds: Sum of the answered requests' latencies, by method.
        answer_buckets: Answers per latency bucket, by method: entry i counts
            latencies in (``LATENCY_BUCKETS[i-1]``, ``LATENCY_BUCKETS[i]``],
            the last entry those above the largest bound.
        failed: Failed requests, by ``(method, reason)``.
        served: Requests received from other peers, by method.
    """

    def __init__(self) -> None:
        self.sent: dict[str, int] = {}
        self.answered: dict[str, int] = {}
        self.answer_seconds: dict[str, float] = {}
        self.answer_buckets: dict[str, list[int]] = {}
        self.failed: dict[tuple[str, str], int] = {}
        self.served: dict[str, int] = {}

    def on_sent(self, method: str) -> None:
        """A request is about to be sent."""
        self.sent[method] = self.sent.get(method, 0) + 1

    def on_answer(self, method: str, seconds: float) -> None:
        """A valid reply arrived ``seconds`` after the request was started."""
        self.answered[method] = self.answered.get(method, 0) + 1
        self.answer_seconds[method] = self.answer_seconds.get(method, 0.0) + seconds
        counts = self.answer_buckets.setdefault(method, [0] * (len(LATENCY_BUCKETS) + 1))
        counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1

    def on_failure(self, method: str, exc: BaseException) -> None:
        """The request failed with ``exc``."""
        key = (method, failure_reason(exc))
        self.failed[key] = self.failed.get(key, 0) + 1

    def on_served(self, method: str) -> None:
        """Another peer's request arrived."""
        self.served[method] = self.served.get(method, 0) + 1
