"""Send pacing: small frames never wait behind megabytes of bulk data.

Theory of operation
-------------------
A TCP connection carries everything between two peers: DHT requests,
matchmaking, flow-control credits, and the all-reduce's tensor parts. Bytes
written to a socket wait in two FIFO queues before they leave: the event
loop's write buffer and the kernel's send buffer (unsent bytes). On a home
uplink of 50 Mbit/s, a few megabytes queued there hold a 100-byte request
for most of a second (measured: 650 ms median, 1 s worst, while one stream
sent at the link's rate), which is what made groups miss their
matchmaking deadlines while the previous round's tensors were still
leaving.

So bulk frames (a payload of at least :data:`BULK_FRAME_BYTES`) wait in the
sender, one at a time in arrival order, while the bytes queued below us
(event-loop buffer plus the kernel's unsent bytes) would take more than
``target_s`` to drain at the connection's measured drain rate; small frames
are written at once. The queue below stays short, so a small frame waits for
at most about ``target_s`` plus the rest of the bulk frame being written.

:class:`SendPacer` is the pure part: it is told the bytes written so far and
the bytes still queued at a time ``now``, keeps a drain-rate estimate from
the intervals in which the queue never ran empty (when it did, the
application, not the link, set the pace), and answers how long a bulk frame
should wait. Until it has a rate it never delays, so a fast link (loopback,
a datacenter) that never builds a queue is never paced.
"""

from __future__ import annotations

import array
import contextlib
import socket
import struct
import sys
from typing import Protocol

from p2ptrain.errors import ConfigError
from p2ptrain.validate import check_integer, check_number

__all__ = [
    "BULK_FRAME_BYTES",
    "DEFAULT_PACE_TARGET_S",
    "SendPacer",
    "kernel_pacing_rate",
    "kernel_unsent_bytes",
    "set_kernel_pacing_rate",
]

BULK_FRAME_BYTES = 64 * 1024
"""Frames whose payload is at least this large are paced; smaller ones never wait."""

DEFAULT_PACE_TARGET_S = 0.02
"""Drain time of the bytes queued below a bulk frame before it is written (20 ms)."""


class _SocketLike(Protocol):
    """A socket, or asyncio's wrapper of one (what a transport hands out)."""

    def setsockopt(self, level: int, option: int, value: bytes, /) -> None: ...

    def getsockopt(self, level: int, option: int, buflen: int, /) -> bytes: ...


_SIOCOUTQNSD = 0x894B  # Linux: bytes in a TCP socket's send queue not yet sent
_SO_MAX_PACING_RATE = 47  # Linux: the most bytes/s the kernel sends this socket at
_UNLIMITED_RATE = 0xFFFF_FFFF  # the option's "no limit" (~0U)


def kernel_unsent_bytes(fileno: int) -> int | None:
    """Bytes written to a TCP socket that the kernel has not sent yet.

    Returns None where the platform cannot tell (not Linux, or the call fails).
    """
    if not sys.platform.startswith("linux"):
        return None
    import fcntl  # noqa: PLC0415 - POSIX only: importing it at the top breaks Windows

    out = array.array("i", [0])
    with contextlib.suppress(OSError, ValueError):  # ValueError: a closed socket's -1
        fcntl.ioctl(fileno, _SIOCOUTQNSD, out, True)
        return out[0]
    return None


def set_kernel_pacing_rate(sock: _SocketLike, bytes_per_s: float | None) -> bool:
    """Let the kernel pace ``sock``'s sends at most at ``bytes_per_s`` (None: no limit).

    Linux TCP paces a socket with ``SO_MAX_PACING_RATE`` set by itself, without
    the ``fq`` qdisc: segments leave spaced at the rate instead of in bursts
    of a congestion window (or of BBR's start-up at 2.89 times its estimate),
    so a shallow shaper queue downstream is not overrun. Rates are clamped to
    1 byte/s .. 4 GB/s (the 32-bit option). Returns whether the option was
    set (False where the platform has no such option, or the socket refused).
    """
    if not sys.platform.startswith("linux"):
        return False
    if bytes_per_s is None:
        value = _UNLIMITED_RATE
    else:
        check_number("bytes_per_s", bytes_per_s, above=0.0)
        value = min(max(round(bytes_per_s), 1), _UNLIMITED_RATE - 1)
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_MAX_PACING_RATE, struct.pack("I", value))
    except (OSError, ValueError):  # ValueError: a closed socket
        return False
    return True


def kernel_pacing_rate(sock: _SocketLike) -> int | None:
    """The socket's ``SO_MAX_PACING_RATE`` in bytes/s (None: unlimited or unknown)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, _SO_MAX_PACING_RATE, 8)
    except (OSError, ValueError):
        return None
    value: int = struct.unpack("Q", raw)[0] if len(raw) == 8 else struct.unpack("I", raw)[0]
    return None if value >= _UNLIMITED_RATE else value


class SendPacer:
    """Decides when a bulk frame may be written (see the module docstring).

    Args:
        target_s: The most drain time of queued bytes a bulk frame is written on.
        floor_bytes: Bulk frames are never held while fewer bytes are queued.
        min_interval_s: Shortest interval a drain-rate sample is taken over.
        smoothing: Weight of a new rate sample in the moving average.
    """

    def __init__(
        self,
        *,
        target_s: float = DEFAULT_PACE_TARGET_S,
        floor_bytes: int = 128 * 1024,
        min_interval_s: float = 0.005,
        smoothing: float = 0.25,
    ) -> None:
        check_number("SendPacer.target_s", target_s, above=0.0)
        check_integer("SendPacer.floor_bytes", floor_bytes, at_least=0)
        check_number("SendPacer.min_interval_s", min_interval_s, above=0.0)
        check_number("SendPacer.smoothing", smoothing, above=0.0)
        if smoothing > 1:
            raise ConfigError(f"SendPacer.smoothing must be at most 1, got {smoothing!r}")
        self.target_s = target_s
        self.floor_bytes = floor_bytes
        self.min_interval_s = min_interval_s
        self.smoothing = smoothing
        self.rate: float | None = None
        """Estimated drain rate in bytes/s (None until a queued interval was seen)."""
        self._mark: tuple[float, int] | None = None  # (time, bytes drained) with a queue
        self.delays = 0
        """How many times a bulk frame was told to wait."""

    def observe(self, now: float, written: int, queued: int) -> None:
        """Record that ``written`` bytes were handed down so far, ``queued`` of them unsent."""
        drained = written - queued
        if queued <= 0:
            self._mark = None  # the queue ran empty: the next interval starts afresh
            return
        if self._mark is None:
            self._mark = (now, drained)
            return
        since, drained_then = self._mark
        elapsed = now - since
        if elapsed < self.min_interval_s:
            return
        sample = (drained - drained_then) / elapsed
        self.rate = (
            sample if self.rate is None else self.rate + self.smoothing * (sample - self.rate)
        )
        self._mark = (now, drained)

    def limit_bytes(self) -> float:
        """Queued bytes below which a bulk frame is written (infinite without a rate)."""
        if self.rate is None:
            return float("inf")
        return max(float(self.floor_bytes), self.rate * self.target_s)

    def wait_s(self, queued: int) -> float:
        """How long a bulk frame should wait before asking again (0: write it now)."""
        excess = queued - self.limit_bytes()
        if excess <= 0 or self.rate is None or self.rate <= 0:
            return 0.0
        self.delays += 1
        return min(max(excess / self.rate, 0.001), self.target_s)
