"""An in-process frame transport pair, for testing logic above the transport.

Frames are really encoded and decoded (so size limits and malformed input
behave as on a socket); bytes cross to the other side on the next loop
iteration. Use real sockets for anything that is about the network itself.
"""

from __future__ import annotations

import asyncio

from p2ptrain.errors import ConnectionClosedError, RemoteProtocolError
from p2ptrain.transport.base import FrameTransport
from p2ptrain.wire.frames import Frame, FrameDecoder

__all__ = ["MemoryTransport", "memory_transport_pair"]


class MemoryTransport(FrameTransport):
    """One end of an in-memory transport pair."""

    path = "memory"

    def __init__(self, name: str, *, max_frame_bytes: int, max_header_bytes: int) -> None:
        super().__init__()
        self._name = name
        self._decoder = FrameDecoder(
            max_frame_bytes=max_frame_bytes, max_header_bytes=max_header_bytes
        )
        self.peer: MemoryTransport | None = None
        self._loop = asyncio.get_running_loop()

    @property
    def remote_address(self) -> str:
        return self.peer._name if self.peer is not None else "?"

    async def send_frame(self, frame: Frame) -> int:
        return self.send_frame_nowait(frame)

    def send_frame_nowait(self, frame: Frame) -> int:
        head, payload, _ = self._encode(frame)
        return self.send_bytes(head + bytes(payload))

    def send_bytes(self, data: bytes) -> int:
        """Send raw bytes (tests use this to inject malformed input)."""
        if self.closed or self.peer is None:
            raise self._close_exc or ConnectionClosedError("memory transport closed")
        self.stats.bytes_sent += len(data)
        self.stats.frames_sent += 1
        self._loop.call_soon(self.peer._receive_bytes, data)
        return len(data)

    def _receive_bytes(self, data: bytes) -> None:
        if self.closed:
            return
        self.stats.bytes_received += len(data)
        try:
            self._decoder.feed(data)
        except RemoteProtocolError as exc:
            self.close(exc)
            return
        while (frame := self._decoder.next_frame()) is not None and not self.closed:
            self._deliver(frame)

    def _abort(self, *, flush: bool) -> None:
        peer = self.peer
        if peer is not None and not peer.closed:
            self._loop.call_soon(peer._lost, ConnectionClosedError(f"{self._name} closed"))


def memory_transport_pair(
    *, max_frame_bytes: int = 1 << 24, max_header_bytes: int = 1 << 20
) -> tuple[MemoryTransport, MemoryTransport]:
    """Two connected in-memory transports (call inside a running loop)."""
    a = MemoryTransport(
        "memory-a", max_frame_bytes=max_frame_bytes, max_header_bytes=max_header_bytes
    )
    b = MemoryTransport(
        "memory-b", max_frame_bytes=max_frame_bytes, max_header_bytes=max_header_bytes
    )
    a.peer, b.peer = b, a
    return a, b
