"""Bounds a node puts on what strangers may hold: inbound sockets, log lines.

Theory of operation
-------------------
Anyone who knows a node's address can open sockets to it before proving
anything. :class:`InboundLimiter` counts the inbound transports a node holds
(still in the handshake or authenticated) in total and per source host, and
says whether one more may be admitted; a refused socket is closed before a
single frame is read, so it costs a file descriptor for a moment and no
buffers. On loopback every peer shares the source ``127.0.0.1``, so the
per-source cap must stay above what a local test swarm opens.

:class:`RateLimitedLog` keeps a flood of refused connections from becoming a
flood of log lines: it writes the first line of each kind, then at most one
per interval, carrying the count of those it left out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from p2ptrain.transport.base import FrameTransport

__all__ = ["InboundLimiter", "RateLimitedLog", "source_host"]


def source_host(transport: FrameTransport) -> str:
    """The host part of a transport's remote address (``?`` when unknown)."""
    address = transport.remote_address
    host, sep, _port = address.rpartition(":")
    return host if sep else address


class InboundLimiter:
    """Counts open inbound transports in total and per source host.

    Args:
        max_total: inbound transports held at most.
        max_per_source: inbound transports held at most from one source host.
    """

    def __init__(self, *, max_total: int, max_per_source: int) -> None:
        self.max_total = max_total
        self.max_per_source = max_per_source
        self._held: dict[FrameTransport, str] = {}
        self._per_source: dict[str, int] = {}
        self.refused = 0

    def __len__(self) -> int:
        return len(self._prune())

    def admit(self, transport: FrameTransport) -> str | None:
        """Hold ``transport`` if the caps allow it; else the reason it is refused."""
        held = self._prune()
        host = source_host(transport)
        if len(held) >= self.max_total:
            self.refused += 1
            return f"too many inbound connections ({self.max_total})"
        if self._per_source.get(host, 0) >= self.max_per_source:
            self.refused += 1
            return f"too many inbound connections from {host} ({self.max_per_source})"
        held[transport] = host
        self._per_source[host] = self._per_source.get(host, 0) + 1
        return None

    def _prune(self) -> dict[FrameTransport, str]:
        held = self._held
        closed = [t for t in held if t.closed]
        for transport in closed:
            host = held.pop(transport)
            left = self._per_source[host] - 1
            if left:
                self._per_source[host] = left
            else:
                del self._per_source[host]
        return held


class RateLimitedLog:
    """At most one line per ``interval`` seconds per kind, with the count left out.

    Args:
        logger: Where the lines go.
        interval: Seconds between two lines of one kind.
        clock: Monotonic seconds (injectable for tests).
    """

    def __init__(
        self,
        logger: logging.Logger,
        *,
        interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._interval = interval
        self._clock = clock
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}

    def log(self, level: int, kind: str, message: str, *args: object) -> bool:
        """Log ``message % args`` unless a line of ``kind`` went out recently.

        Returns:
            Whether the line was written.
        """
        now = self._clock()
        last = self._last.get(kind)
        if last is not None and now - last < self._interval:
            self._skipped[kind] = self._skipped.get(kind, 0) + 1
            return False
        self._last[kind] = now
        skipped = self._skipped.pop(kind, 0)
        if skipped:
            message += " (and %d more like it since the last report)"
            args = (*args, skipped)
        self._logger.log(level, message, *args)
        return True
