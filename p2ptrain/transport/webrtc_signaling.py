"""Signaling channels: how two peers exchange the SDP offer and answer.

:func:`~p2ptrain.transport.webrtc_connect.webrtc_connect` needs only a
:class:`SignalingChannel`: something that carries small JSON-compatible dicts
both ways, in order. In the swarm a public peer relays them over its RPC
connections; this module has two simple implementations:

* :class:`StreamSignalingChannel`: length-prefixed JSON over any asyncio
  stream (a TCP connection to a relay, one end of a ``socket.socketpair()``
  handed to a thread in another network namespace or to a child process).
* :func:`memory_signaling_pair`: two connected in-memory channels on one
  event loop.

Messages from the network are untrusted: both cap the size of one message
(:data:`MAX_SIGNAL_BYTES`) and raise :class:`~p2ptrain.errors.RemoteProtocolError`
on malformed input and :class:`~p2ptrain.errors.ConnectionClosedError` once
the other end is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
from typing import Any, Protocol

from p2ptrain.errors import ConnectionClosedError, LocalProtocolError, RemoteProtocolError

__all__ = [
    "MAX_SIGNAL_BYTES",
    "MemorySignalingChannel",
    "SignalingChannel",
    "StreamSignalingChannel",
    "memory_signaling_pair",
]

MAX_SIGNAL_BYTES = 64 * 1024
"""Largest signaling message (an SDP with a few candidates is 1-2 KB)."""

_LENGTH = struct.Struct(">I")


class SignalingChannel(Protocol):
    """An ordered, reliable exchange of small dict messages with one peer."""

    async def send(self, message: dict[str, Any]) -> None:
        """Send one message (JSON-compatible values only)."""

    async def recv(self) -> dict[str, Any]:
        """The next message from the peer."""


def _encode(message: dict[str, Any]) -> bytes:
    try:
        data = json.dumps(message, separators=(",", ":")).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise LocalProtocolError(f"signaling message is not JSON: {exc}") from exc
    if len(data) > MAX_SIGNAL_BYTES:
        raise LocalProtocolError(f"signaling message of {len(data)} bytes is too large")
    return data


def _decode(data: bytes) -> dict[str, Any]:
    try:
        message = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise RemoteProtocolError(f"signaling message is not JSON: {exc}") from exc
    if not isinstance(message, dict):
        raise RemoteProtocolError("a signaling message must be a JSON object")
    return message


class StreamSignalingChannel:
    """Length-prefixed (u32 big-endian) JSON messages over an asyncio stream.

    Args:
        reader: The stream's reader.
        writer: The stream's writer; closed by :meth:`aclose`.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def from_socket(cls, sock: socket.socket) -> StreamSignalingChannel:
        """Wrap a connected stream socket (TCP, or one end of ``socketpair()``)."""
        sock.setblocking(False)
        if sock.family == socket.AF_UNIX:
            reader, writer = await asyncio.open_unix_connection(sock=sock)
        else:
            reader, writer = await asyncio.open_connection(sock=sock)
        return cls(reader, writer)

    async def send(self, message: dict[str, Any]) -> None:
        data = _encode(message)
        if self._writer.is_closing():
            raise ConnectionClosedError("the signaling channel is closed")
        self._writer.write(_LENGTH.pack(len(data)) + data)
        try:
            await self._writer.drain()
        except OSError as exc:
            raise ConnectionClosedError(f"signaling channel lost: {exc}") from exc

    async def recv(self) -> dict[str, Any]:
        try:
            (length,) = _LENGTH.unpack(await self._reader.readexactly(_LENGTH.size))
            if length > MAX_SIGNAL_BYTES:
                raise RemoteProtocolError(f"signaling message of {length} bytes is too large")
            data = await self._reader.readexactly(length)
        except asyncio.IncompleteReadError as exc:
            raise ConnectionClosedError("the signaling channel closed") from exc
        except OSError as exc:
            raise ConnectionClosedError(f"signaling channel lost: {exc}") from exc
        return _decode(data)

    async def aclose(self) -> None:
        """Close the stream."""
        self._writer.close()
        with contextlib.suppress(OSError):  # already reset by the peer: closed either way
            await self._writer.wait_closed()


class MemorySignalingChannel:
    """One end of an in-memory signaling pair (see :func:`memory_signaling_pair`)."""

    def __init__(self) -> None:
        self._inbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.peer: MemorySignalingChannel | None = None
        self._closed = False

    async def send(self, message: dict[str, Any]) -> None:
        data = _encode(message)
        if self._closed or self.peer is None or self.peer._closed:
            raise ConnectionClosedError("the signaling channel is closed")
        self.peer._inbox.put_nowait(data)

    async def recv(self) -> dict[str, Any]:
        data = await self._inbox.get()
        if data is None:
            self._inbox.put_nowait(None)  # every later recv() fails too
            raise ConnectionClosedError("the signaling channel closed")
        return _decode(data)

    async def aclose(self) -> None:
        """Close both ends: pending and later ``recv()`` calls fail."""
        self._closed = True
        self._inbox.put_nowait(None)
        if self.peer is not None:
            self.peer._inbox.put_nowait(None)


def memory_signaling_pair() -> tuple[MemorySignalingChannel, MemorySignalingChannel]:
    """Two connected signaling channels for peers on the same event loop."""
    a, b = MemorySignalingChannel(), MemorySignalingChannel()
    a.peer, b.peer = b, a
    return a, b
