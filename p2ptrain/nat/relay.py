"""Relaying through a public peer: bandwidth limits and the relayed frame transport.

Theory of operation
-------------------
When no direct path exists (a symmetric NAT and no TURN server), two peers
talk through a public peer that opted in to relaying (``NATConfig.relay``).
Each side holds one RPC stream to the relay (the dialer opens
``nat.connect``, the relay opens ``nat.accept`` on the connection the target
keeps to it; see :mod:`p2ptrain.nat.signaling`), and the relay copies
messages from one stream to the other. :class:`RelayTransport` turns such a
stream into a :class:`~p2ptrain.transport.base.FrameTransport`: the encoded
frames form a byte stream that is cut into messages of at most
``chunk_bytes``, and the receiver feeds them to a
:class:`~p2ptrain.wire.frames.FrameDecoder`. The identity handshake then runs
end to end over this transport and every frame after it is a sealed record
(:mod:`p2ptrain.wire.records`), so the relay forwards ciphertext it can
neither read nor alter undetected, and cannot impersonate either end: it
holds none of their keys.

Flow control is the RPC streams' own: each hop has a window, so a slow
receiver slows the relay, which slows the sender. The relay charges every
chunk to two token buckets (:class:`TokenBucket`), one for the pair and one
for all its circuits, and holds the chunk until both have the tokens; that is
the bandwidth bound. :class:`RelayLimiter` refuses circuits beyond
``max_circuits``, and a :class:`CircuitBudget` closes a circuit that carried
``circuit_bytes``, lived ``circuit_seconds``, or would have to hold a chunk
longer than ``max_delay``, with a
:class:`~p2ptrain.errors.ResourceExhaustedError` that reaches both ends.

The limiter is pure (time is an argument); only the transport does I/O.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from p2ptrain.errors import (
    ConnectionClosedError,
    P2PTrainError,
    RemoteProtocolError,
    ResourceExhaustedError,
)
from p2ptrain.nat.config import RelayLimits
from p2ptrain.rpc.stream import RPCStream
from p2ptrain.secure.identity import PeerID
from p2ptrain.transport.base import FrameTransport
from p2ptrain.wire.frames import Buffer, Frame, FrameDecoder, buffer_nbytes

__all__ = ["CircuitBudget", "RelayLimiter", "RelayTransport", "TokenBucket"]

logger = logging.getLogger(__name__)

MiB = 1 << 20
CHUNK_BYTES = 256 * 1024
"""Largest message a relayed transport sends (one hop's frame holds it easily)."""
_ABORT_FLUSH_BYTES = 64 * 1024
_ABORTED = "the relayed connection was aborted"


# -- limits (pure) ---------------------------------------------------------------------------


class TokenBucket:
    """A token bucket of bytes: ``rate`` per second, at most ``burst`` saved up.

    :meth:`take` reserves tokens at once (the level may go negative) and says
    how long the caller must wait until the reservation is covered, so
    concurrent users are served in order without a lock.
    """

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.level = burst
        self.updated = now

    def _refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.burst, self.level + (now - self.updated) * self.rate)
            self.updated = now

    def delay(self, nbytes: int, now: float) -> float:
        """Seconds until ``nbytes`` could be taken (0 when available now)."""
        self._refill(now)
        missing = nbytes - self.level
        return 0.0 if missing <= 0 else missing / self.rate

    def take(self, nbytes: int, now: float) -> float:
        """Reserve ``nbytes``; returns the seconds to wait before sending them."""
        self._refill(now)
        self.level -= nbytes
        return 0.0 if self.level >= 0 else -self.level / self.rate


def _rate(limits: RelayLimits) -> str:
    return (
        f"{limits.pair_bytes_per_s / MiB:g} MiB/s per pair,"
        f" {limits.total_bytes_per_s / MiB:g} MiB/s in all"
    )


class CircuitBudget:
    """What one relayed pair may still send. Made by :meth:`RelayLimiter.open`."""

    def __init__(self, limiter: RelayLimiter, pair: tuple[PeerID, PeerID], now: float) -> None:
        self._limiter = limiter
        self.pair = pair
        limits = limiter.limits
        self._bucket = TokenBucket(limits.pair_bytes_per_s, limits.pair_burst_bytes, now)
        self.opened = now
        self.carried = 0
        self.closed = False

    @property
    def expires(self) -> float | None:
        """When the circuit must close (``circuit_seconds``), or None."""
        seconds = self._limiter.limits.circuit_seconds
        return None if seconds is None else self.opened + seconds

    def charge(self, nbytes: int, now: float) -> float:
        """Account for a chunk of ``nbytes``; returns the seconds to hold it.

        Raises:
            ResourceExhaustedError: The chunk goes beyond the circuit's data
                cap or lifetime, or would wait longer than ``max_delay``.
        """
        limits = self._limiter.limits
        if self.closed:
            raise ResourceExhaustedError("relay limit: the circuit is closed")
        if limits.circuit_bytes is not None and self.carried + nbytes > limits.circuit_bytes:
            raise ResourceExhaustedError(
                f"relay limit: a relayed connection may carry {limits.circuit_bytes} bytes"
                f" and this one carried {self.carried}"
            )
        expires = self.expires
        if expires is not None and now >= expires:
            raise ResourceExhaustedError(
                f"relay limit: a relayed connection may last {limits.circuit_seconds:g} s"
            )
        total = self._limiter.total
        wait = max(self._bucket.delay(nbytes, now), total.delay(nbytes, now))
        if wait > limits.max_delay:
            raise ResourceExhaustedError(
                f"relay over its bandwidth limit ({_rate(limits)}): a chunk would wait"
                f" {wait:.1f} s, more than {limits.max_delay:g} s"
            )
        self.carried += nbytes
        self._limiter.relayed_bytes += nbytes
        return max(self._bucket.take(nbytes, now), total.take(nbytes, now))

    def close(self) -> None:
        """Release the circuit's slot (idempotent)."""
        if not self.closed:
            self.closed = True
            self._limiter._release(self)


class RelayLimiter:
    """Admission and bandwidth accounting of every circuit a relay forwards.

    Args:
        limits: The bounds.
        now: The current time (seconds, any monotonic origin).
    """

    def __init__(self, limits: RelayLimits, now: float) -> None:
        self.limits = limits
        self.total = TokenBucket(limits.total_bytes_per_s, limits.total_burst_bytes, now)
        self.relayed_bytes = 0
        self.refused = 0
        self.opened = 0
        self._circuits: set[CircuitBudget] = set()

    @property
    def active(self) -> int:
        """Circuits open now."""
        return len(self._circuits)

    def open(self, source: PeerID, target: PeerID, now: float) -> CircuitBudget:
        """Admit a circuit from ``source`` to ``target``.

        Raises:
            ResourceExhaustedError: ``max_circuits`` are open already.
        """
        if len(self._circuits) >= self.limits.max_circuits:
            self.refused += 1
            raise ResourceExhaustedError(
                f"relay limit: {self.limits.max_circuits} relayed connections are open already"
            )
        budget = CircuitBudget(self, (source, target), now)
        self._circuits.add(budget)
        self.opened += 1
        return budget

    def _release(self, budget: CircuitBudget) -> None:
        self._circuits.discard(budget)


# -- the relayed transport ---------------------------------------------------------------------


class RelayTransport(FrameTransport):
    """Frames over an RPC stream whose other end is spliced to the peer by a relay.

    Args:
        stream: The circuit's stream (after the circuit header was exchanged).
        relay: The relaying peer (for ``remote_address`` and logs).
        max_frame_bytes: Largest incoming frame accepted.
        max_header_bytes: Largest incoming frame header accepted.
        chunk_bytes: Largest message sent on the stream.
        high_water: Queued bytes above which :meth:`send_frame` waits.
        close_timeout: Seconds a graceful close waits for the queue to drain.
    """

    path = "relay"

    def __init__(
        self,
        stream: RPCStream,
        *,
        relay: PeerID,
        max_frame_bytes: int,
        max_header_bytes: int,
        chunk_bytes: int = CHUNK_BYTES,
        high_water: int = 1 * MiB,
        close_timeout: float = 5.0,
    ) -> None:
        super().__init__()
        self._stream = stream
        self._relay = relay
        self._chunk = chunk_bytes
        self._high_water = high_water
        self._close_timeout = close_timeout
        self._decoder = FrameDecoder(
            max_frame_bytes=max_frame_bytes, max_header_bytes=max_header_bytes
        )
        self._queue: deque[Buffer] = deque()
        self._offset = 0  # bytes of _queue[0] already sent
        self._queued = 0
        self._finishing = False  # send what is queued, then end the stream
        self._aborting = False  # send what is queued, then reset the stream
        self._wake = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()
        loop = asyncio.get_running_loop()
        self._pump_task = loop.create_task(self._pump(), name="relay-pump")
        self._read_task = loop.create_task(self._read(), name="relay-read")

    # -- FrameTransport ----------------------------------------------------------------

    @property
    def remote_address(self) -> str:
        return f"relay:{self._relay}"

    async def send_frame(self, frame: Frame) -> int:
        while self._queued > self._high_water and not self.closed:
            self._writable.clear()
            await self._writable.wait()
        return self.send_frame_nowait(frame)

    def send_frame_nowait(self, frame: Frame) -> int:
        if self.closed or self._finishing:
            raise self._close_exc or ConnectionClosedError("connection closed")
        head, payload, size = self._encode(frame)
        self._queue.append(head)
        if buffer_nbytes(payload):
            # The caller may reuse its buffer once we return: keep our own copy
            # (a sealed payload is ours already: the record layer encrypted it into it).
            keep = isinstance(payload, bytes) or self.sealed
            self._queue.append(payload if keep else bytes(payload))
        self._queued += size
        self.stats.frames_sent += 1
        self.stats.bytes_sent += size
        self._wake.set()
        return size

    def _abort(self, *, flush: bool) -> None:
        self._finishing = True
        self._wake.set()
        if flush:
            return
        if self._queued <= _ABORT_FLUSH_BYTES:
            # Like a kernel socket that already took the bytes: a little that was
            # queued (a REFUSE, a GOAWAY) still leaves, then the stream is reset.
            self._aborting = True
            return
        self._pump_task.cancel()
        self._stream.reset("cancelled", _ABORTED)

    def _lost(self, exc: P2PTrainError | None) -> None:
        self._finishing = True
        self._wake.set()
        self._writable.set()
        super()._lost(exc)

    async def aclose(self) -> None:
        """Send what is queued, end the stream, and wait for the peer to end its side.

        Past ``close_timeout`` the stream is reset instead.
        """
        self.close(flush=True)
        tasks = [self._pump_task, self._read_task]
        _, pending = await asyncio.wait(tasks, timeout=self._close_timeout)
        if pending:
            for task in pending:
                task.cancel()
            self._stream.reset("cancelled", "the relayed connection did not drain in time")
            await asyncio.wait(pending)
        await self.wait_closed()

    async def wait_done(self) -> None:
        """Wait until both directions of the stream are finished."""
        await asyncio.wait([self._pump_task, self._read_task])

    # -- internals ---------------------------------------------------------------------

    def _next_chunk(self) -> Buffer:
        first = self._queue[0]
        if len(first) - self._offset >= self._chunk:  # a large payload: slice, no copy
            view = memoryview(first)[self._offset : self._offset + self._chunk]
            self._advance(len(view))
            return view
        out = bytearray()
        while self._queue and len(out) < self._chunk:
            item = self._queue[0]
            take = min(len(item) - self._offset, self._chunk - len(out))
            out += memoryview(item)[self._offset : self._offset + take]
            self._advance(take)
        return out

    def _advance(self, nbytes: int) -> None:
        self._offset += nbytes
        self._queued -= nbytes
        if self._offset == len(self._queue[0]):
            self._queue.popleft()
            self._offset = 0

    async def _pump(self) -> None:
        try:
            while True:
                if not self._queue:
                    if self._aborting:
                        self._stream.reset("cancelled", _ABORTED)
                        return
                    if self._finishing:
                        if not self._stream.finished:
                            await self._stream.end()
                        return
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                await self._stream.send(payload=self._next_chunk())
                if self._queued <= self._high_water // 2:
                    self._writable.set()
        except P2PTrainError as exc:
            self._lost(ConnectionClosedError(f"the relayed connection was closed: {exc}"))
        except Exception:  # the root of this task: log, never lose it silently
            logger.exception("relay transport: sending failed")
            self._lost(ConnectionClosedError("the relayed connection failed"))

    async def _read(self) -> None:
        try:
            async for message in self._stream:
                if self.closed:
                    continue  # closed locally: drain until the peer ends, so it is not stuck
                nbytes = buffer_nbytes(message.payload)
                if message.body is not None or nbytes == 0:
                    raise RemoteProtocolError("a relayed message carries frame bytes only")
                self.stats.bytes_received += nbytes
                self._decoder.feed(message.payload)
                while not self.closed and (frame := self._decoder.next_frame()) is not None:
                    self._deliver(frame)
        except RemoteProtocolError as exc:
            logger.warning(
                "closing relayed connection via %s: %s: %s",
                self._relay.short,
                type(exc).__name__,
                exc,
            )
            self.close(exc)
            return
        except P2PTrainError as exc:
            self._lost(ConnectionClosedError(f"the relayed connection was closed: {exc}"))
            return
        except Exception:  # the root of this task: log, never lose it silently
            logger.exception("relay transport: receiving failed")
            self.close(ConnectionClosedError("the relayed connection failed"))
            return
        self._lost(
            ConnectionClosedError(f"the peer closed the connection relayed by {self._relay.short}")
        )
