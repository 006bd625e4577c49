"""Frames over TCP (asyncio protocol; uvloop when the loop is uvloop).

Incoming bytes go through a :class:`~p2ptrain.wire.frames.FrameDecoder` fed by
a buffered protocol: while a large payload is being filled, ``get_buffer``
hands the kernel the payload's own unfilled tail, so payload bytes are copied
once, from the socket into their final buffer. Outgoing frames are written as
header and payload (the payload is not joined to the header first);
:meth:`TCPTransport.send_frame` waits while the write buffer is above its
high-water mark, which is the backpressure the RPC layer builds on. Under
uvloop both go to the kernel in one vectored write.

With records and :meth:`~p2ptrain.transport.base.FrameTransport.set_crypto_offload`,
a large payload is sealed on a crypto worker thread
(:mod:`p2ptrain.transport.crypto_offload`) while the loop keeps the socket
busy with the frames before it; frames sent meanwhile wait behind it, so the
wire keeps the records' counter order. Large received payloads are opened
there too, while the next frame is read.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import socket
from collections.abc import Callable
from typing import Any, cast

from p2ptrain.errors import (
    ConnectError,
    ConnectionClosedError,
    LocalProtocolError,
    RemoteProtocolError,
    TransportTimeoutError,
)
from p2ptrain.transport.base import FrameTransport
from p2ptrain.transport.crypto_offload import crypto_executor
from p2ptrain.transport.pacing import (
    BULK_FRAME_BYTES,
    DEFAULT_PACE_TARGET_S,
    SendPacer,
    kernel_pacing_rate,
    kernel_unsent_bytes,
    set_kernel_pacing_rate,
)
from p2ptrain.wire.frames import Buffer, Frame, FrameDecoder, PayloadAllocator, buffer_nbytes

__all__ = ["TCPListener", "TCPTransport", "tcp_connect", "tcp_listen"]

logger = logging.getLogger(__name__)

_READ_CHUNK = 256 * 1024
_FIRST_READ_CHUNK = 16 * 1024  # grown to _READ_CHUNK once a read fills it (authenticated)
_DIRECT_READ_MIN = 64 * 1024  # read straight into payloads at least this large
_HEAD_READ = 4 * 1024  # after a payload read straight in, the next frame's head is read alone
_SMALL_FRAME_HEADROOM = 4  # small frames wait only past this many high-water marks


class TCPTransport(FrameTransport, asyncio.BufferedProtocol):
    """One TCP connection carrying frames."""

    def __init__(
        self,
        *,
        max_frame_bytes: int,
        max_header_bytes: int,
        write_high_water: int,
        path: str = "tcp-direct",
        max_handshake_frame_bytes: int | None = None,
        pace_target_s: float | None = DEFAULT_PACE_TARGET_S,
    ) -> None:
        FrameTransport.__init__(self)
        self.path = path
        self._decoder = FrameDecoder(
            max_frame_bytes=max_frame_bytes, max_header_bytes=max_header_bytes
        )
        self._write_high_water = write_high_water
        self._transport: asyncio.Transport | None = None
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._read_buffer = bytearray(_FIRST_READ_CHUNK)
        self._may_grow = False  # set once the peer is authenticated
        self._reading_direct = False
        self._after_direct = False  # the last read went straight into a payload
        self._peername = "?"
        self._fileno: int | None = None  # for the kernel's unsent-bytes count
        self._sock: Any = None  # the socket (asyncio's or uvloop's wrapper), for its options
        self._vectored = False  # writelines() sends its buffers without joining them
        self.pacer = None if pace_target_s is None else SendPacer(target_s=pace_target_s)
        """Paces bulk frames (None: pacing is off)."""
        self._bulk_turn = asyncio.Lock()  # bulk frames are written one at a time, in order
        # While a worker seals a bulk frame: the frames sent meanwhile, written after it.
        self._held: list[tuple[bytes, Buffer]] | None = None
        self._close_after_seal = False
        self.connected = asyncio.Event()
        if max_handshake_frame_bytes is not None:
            self.limit_frames_until_authenticated(max_handshake_frame_bytes)

    # -- asyncio.BufferedProtocol --------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport; both are stream transports.
        self._transport = cast(asyncio.Transport, transport)
        self._transport.set_write_buffer_limits(high=self._write_high_water)
        # uvloop's writelines() hands all buffers to one writev; asyncio's (before
        # Python 3.12) joins them into one bytes object first, a copy of the payload.
        self._vectored = type(transport).__module__.partition(".")[0] == "uvloop"
        peer = transport.get_extra_info("peername")
        self._peername = f"{peer[0]}:{peer[1]}" if peer else "?"
        sock = self._sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):  # not every socket supports it
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with contextlib.suppress(OSError, ValueError):
                fileno = sock.fileno()
                if kernel_unsent_bytes(fileno) is not None:
                    self._fileno = fileno
        self.connected.set()

    def get_buffer(self, sizehint: int) -> memoryview:
        tail = self._decoder.payload_tail()
        self._reading_direct = tail is not None and len(tail) >= _DIRECT_READ_MIN
        if tail is not None and self._reading_direct:
            return tail
        if self._after_direct and (tail is None or not len(tail)):
            # Bulk frames come in a row: a full-size read here would also take
            # the start of the next payload, to be copied out of the read buffer
            # (a quarter of each 1 MiB payload); read its head alone instead.
            return memoryview(self._read_buffer)[:_HEAD_READ]
        return memoryview(self._read_buffer)

    def buffer_updated(self, nbytes: int) -> None:
        self.stats.bytes_received += nbytes
        self._after_direct = self._reading_direct
        failure: RemoteProtocolError | None = None
        try:
            if self._reading_direct:
                self._decoder.payload_written(nbytes)
            else:
                self._decoder.feed(memoryview(self._read_buffer)[:nbytes])
                if nbytes == len(self._read_buffer) and self._may_grow:
                    self._read_buffer = bytearray(_READ_CHUNK)  # busy: read more at once
                    self._may_grow = False
        except RemoteProtocolError as exc:
            failure = exc
        # The frames decoded before a failure go first: one still being opened
        # may turn out to be where the stream went wrong.
        while (item := self._decoder.next_sealed()) is not None:
            self._accept(*item)
            if self.closed:
                return
        if failure is not None:
            self._close_failed(failure)

    def _log_failure(self, exc: RemoteProtocolError) -> None:
        logger.warning(
            "closing connection from %s: %s: %s", self._peername, type(exc).__name__, exc
        )

    def eof_received(self) -> bool | None:
        self._lost(ConnectionClosedError(f"{self._peername} closed the connection"))
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._can_write.set()
        if exc is None:
            self._lost(ConnectionClosedError(f"connection to {self._peername} closed"))
        else:
            self._lost(ConnectionClosedError(f"connection to {self._peername} lost: {exc}"))

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    # -- FrameTransport ----------------------------------------------------------------

    def authenticated(self) -> None:
        super().authenticated()
        # An authenticated peer's read buffer grows on demand (most connections
        # are idle or carry small messages and never need 256 KiB).
        self._may_grow = len(self._read_buffer) < _READ_CHUNK

    def set_payload_allocator(self, allocator: PayloadAllocator | None) -> None:
        super().set_payload_allocator(allocator)
        self._decoder.payload_allocator = allocator

    def set_crypto_offload(self, nbytes: int | None) -> None:
        super().set_crypto_offload(nbytes)
        self._decoder.defer_open_bytes = nbytes

    @property
    def remote_address(self) -> str:
        return self._peername

    async def send_frame(self, frame: Frame) -> int:
        if buffer_nbytes(frame.payload) < BULK_FRAME_BYTES:
            # A small frame skips the bulk frames' wait; it waits only when the buffer
            # is far over its mark (a flood of small frames), which bounds memory.
            transport = self._transport
            if (
                not self._can_write.is_set()
                and transport is not None
                and transport.get_write_buffer_size()
                > _SMALL_FRAME_HEADROOM * self._write_high_water
            ):
                await self._can_write.wait()
            return self.send_frame_nowait(frame)
        async with self._bulk_turn:
            if not self._can_write.is_set():
                await self._can_write.wait()
            # The kernel signals no event when its unsent bytes fall below a level
            # (the event loop owns the socket's writability): poll, at the drain time.
            while (delay := self._pace()) > 0:  # noqa: ASYNC110
                await asyncio.sleep(delay)
            offload = self.crypto_offload_bytes
            if self.sealed and offload is not None and buffer_nbytes(frame.payload) >= offload:
                return await self._send_sealed_later(frame)
            return self.send_frame_nowait(frame)

    async def _send_sealed_later(self, frame: Frame) -> int:
        """Seal ``frame``'s payload on a worker thread, then write it (see the module doc).

        Once its counters are taken the frame is written even if the caller
        is cancelled meanwhile: the frames after it need it on the wire.
        """
        transport = self._open_transport()
        head, sealed, size, job = self._encode_later(frame)
        loop = asyncio.get_running_loop()
        written: asyncio.Future[bool] = loop.create_future()
        self._held = []

        def sealed_by_worker(done: concurrent.futures.Future[None]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to write
                loop.call_soon_threadsafe(
                    self._write_sealed, transport, done, head, sealed, written
                )

        crypto_executor().submit(job).add_done_callback(sealed_by_worker)
        self.stats.frames_sent += 1
        self.stats.bytes_sent += size
        if not await asyncio.shield(written):
            raise self._close_exc or ConnectionClosedError("connection closed")
        return size

    def _write_sealed(
        self,
        transport: asyncio.Transport,
        done: concurrent.futures.Future[None],
        head: bytes,
        sealed: memoryview,
        written: asyncio.Future[bool],
    ) -> None:
        held, self._held = self._held or [], None
        ok = False
        exc = done.exception()
        if exc is not None:  # pragma: no cover - encrypting into our own buffer does not fail
            self.close(LocalProtocolError(f"sealing a frame failed: {exc!r}"))
        elif not transport.is_closing() and (self._close_after_seal or not self.closed):
            self._write(transport, head, sealed)
            for held_head, payload in held:
                self._write(transport, held_head, payload)
            ok = True
        if self._close_after_seal:
            transport.close()  # the close(flush=True) that waited for this frame
        if not written.done():
            written.set_result(ok)

    def _open_transport(self) -> asyncio.Transport:
        transport = self._transport
        if self.closed or transport is None or transport.is_closing():
            raise self._close_exc or ConnectionClosedError("connection closed")
        return transport

    def _pace(self) -> float:
        """Seconds a bulk frame should wait for the queue below to drain (0: write now)."""
        transport = self._transport
        if self.pacer is None or self._fileno is None or transport is None or self.closed:
            return 0.0
        unsent = kernel_unsent_bytes(self._fileno)
        if unsent is None:
            return 0.0
        queued = transport.get_write_buffer_size() + unsent
        self.pacer.observe(asyncio.get_running_loop().time(), self.stats.bytes_sent, queued)
        return self.pacer.wait_s(queued)

    def set_pacing_rate(self, bytes_per_s: float | None) -> bool:
        """Cap the socket's send rate in the kernel (``SO_MAX_PACING_RATE``; None: no cap)."""
        if self._sock is None or self.closed:
            return False
        return set_kernel_pacing_rate(self._sock, bytes_per_s)

    @property
    def kernel_pacing_rate(self) -> int | None:
        """The socket's pacing cap as the kernel holds it, bytes/s (None: none, or unknown)."""
        return None if self._sock is None or self.closed else kernel_pacing_rate(self._sock)

    async def drained(self) -> None:
        if not self._can_write.is_set():
            await self._can_write.wait()

    def send_frame_nowait(self, frame: Frame) -> int:
        transport = self._open_transport()
        head, payload, size = self._encode(frame)
        if self._held is not None:
            self._held.append((head, payload))  # behind the frame a worker is sealing
        else:
            self._write(transport, head, payload)
        self.stats.frames_sent += 1
        self.stats.bytes_sent += size
        return size

    def _write(self, transport: asyncio.Transport, head: bytes, payload: Buffer) -> None:
        if not buffer_nbytes(payload):
            transport.write(head)
        elif self._vectored:
            # One system call for the frame: no separate tiny segment for its head.
            transport.writelines((head, payload))
        else:
            transport.write(head)
            transport.write(payload)

    def _abort(self, *, flush: bool) -> None:
        if self._transport is None:
            return
        if flush and self._held is not None:
            self._close_after_seal = True  # closed once the frame being sealed is written
        elif flush:
            self._transport.close()  # sends the write buffer first
        else:
            self._transport.abort()


def _make_transport_factory(
    *,
    max_frame_bytes: int,
    max_header_bytes: int,
    write_high_water: int,
    path: str,
    max_handshake_frame_bytes: int | None = None,
    pace_target_s: float | None = DEFAULT_PACE_TARGET_S,
) -> Callable[[], TCPTransport]:
    def factory() -> TCPTransport:
        return TCPTransport(
            max_frame_bytes=max_frame_bytes,
            max_header_bytes=max_header_bytes,
            write_high_water=write_high_water,
            path=path,
            max_handshake_frame_bytes=max_handshake_frame_bytes,
            pace_target_s=pace_target_s,
        )

    return factory


async def tcp_connect(
    host: str,
    port: int,
    *,
    timeout: float,
    max_frame_bytes: int,
    max_header_bytes: int,
    write_high_water: int,
    local_addr: tuple[str, int] | None = None,
    path: str = "tcp-direct",
    max_handshake_frame_bytes: int | None = None,
    pace_target_s: float | None = DEFAULT_PACE_TARGET_S,
) -> TCPTransport:
    """Open a TCP connection and return its frame transport.

    With ``local_addr`` the socket is bound there first with SO_REUSEADDR and
    SO_REUSEPORT, so it can share a listening port (TCP hole punching). With
    ``max_handshake_frame_bytes``, larger frames are refused until the
    handshake authenticates the peer.
    """
    loop = asyncio.get_running_loop()
    factory = _make_transport_factory(
        max_frame_bytes=max_frame_bytes,
        max_header_bytes=max_header_bytes,
        write_high_water=write_high_water,
        path=path,
        max_handshake_frame_bytes=max_handshake_frame_bytes,
        pace_target_s=pace_target_s,
    )
    sock: socket.socket | None = None
    try:
        async with asyncio.timeout(timeout):
            if local_addr is None:
                _, protocol = await loop.create_connection(factory, host, port)
            else:
                sock = _bound_socket(local_addr)
                await loop.sock_connect(sock, (host, port))
                _, protocol = await loop.create_connection(factory, sock=sock)
    except TimeoutError as exc:
        if sock is not None:
            sock.close()
        raise TransportTimeoutError(f"connecting to {host}:{port} timed out") from exc
    except OSError as exc:
        if sock is not None:
            sock.close()
        raise ConnectError(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from exc
    return protocol


def _bound_socket(local_addr: tuple[str, int]) -> socket.socket:
    family = socket.AF_INET6 if ":" in local_addr[0] else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.setblocking(False)
        sock.bind(local_addr)
    except OSError:
        sock.close()
        raise
    return sock


class TCPListener:
    """A listening socket that hands each accepted transport to a callback."""

    def __init__(self, server: asyncio.Server) -> None:
        self._server = server

    @property
    def addresses(self) -> list[tuple[str, int]]:
        """The (host, port) pairs the listener is bound to."""
        return [sock.getsockname()[:2] for sock in self._server.sockets]

    @property
    def port(self) -> int:
        """The bound port (the first socket's).

        Raises:
            ConnectionClosedError: The listener is closed (it has no socket).
        """
        addresses = self.addresses
        if not addresses:
            raise ConnectionClosedError("the listener is closed")
        return addresses[0][1]

    async def aclose(self) -> None:
        """Stop accepting connections (existing ones stay open)."""
        self._server.close()
        await self._server.wait_closed()


async def tcp_listen(
    host: str,
    port: int,
    on_transport: Callable[[TCPTransport], None],
    *,
    max_frame_bytes: int,
    max_header_bytes: int,
    write_high_water: int,
    reuse_port: bool = False,
    max_handshake_frame_bytes: int | None = None,
    pace_target_s: float | None = DEFAULT_PACE_TARGET_S,
) -> TCPListener:
    """Listen on ``host:port`` (port 0 picks one) and report each new transport."""
    loop = asyncio.get_running_loop()
    base = _make_transport_factory(
        max_frame_bytes=max_frame_bytes,
        max_header_bytes=max_header_bytes,
        write_high_water=write_high_water,
        path="tcp-direct",
        max_handshake_frame_bytes=max_handshake_frame_bytes,
        pace_target_s=pace_target_s,
    )

    def factory() -> TCPTransport:
        transport = base()
        loop.call_soon(on_transport, transport)
        return transport

    try:
        server = await loop.create_server(factory, host, port, reuse_port=reuse_port or None)
    except OSError as exc:
        raise ConnectError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    return TCPListener(server)
