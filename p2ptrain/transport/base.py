"""The frame transport interface every path (TCP, WebRTC, relay) implements.

A :class:`FrameTransport` moves whole frames (:mod:`p2ptrain.wire.frames`)
between two endpoints. It knows nothing of identities or RPC: the handshake
runs over it first (reading with :meth:`FrameTransport.recv_frame`), then a
:class:`~p2ptrain.rpc.connection.Connection` takes it over by installing a
:class:`FrameReceiver`, after which frames are pushed to the receiver as they
arrive.

Between the two, the handshake calls :meth:`FrameTransport.start_records`
with the keys it agreed on: from then on every frame is sealed and opened as
a record (:mod:`p2ptrain.wire.records`). A transport whose channel is
already encrypted and authenticated end to end (WebRTC's DTLS) says so with
:attr:`FrameTransport.channel_encrypted` and exposes
:attr:`FrameTransport.channel_binding`, which the handshake signs; it is not
sealed a second time.

A transport may also open large payloads on the crypto worker threads
(:meth:`FrameTransport.set_crypto_offload`,
:mod:`p2ptrain.transport.crypto_offload`): such a frame, and every frame
decoded after it, waits in order until its payload has authenticated; one
that fails closes the connection and nothing from it or after it is
delivered.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from p2ptrain.errors import (
    ConnectionClosedError,
    IntegrityError,
    LocalProtocolError,
    P2PTrainError,
    RemoteProtocolError,
)
from p2ptrain.transport.crypto_offload import crypto_executor
from p2ptrain.wire.frames import (
    PREFIX,
    Buffer,
    Frame,
    FrameDecoder,
    PayloadAllocator,
    buffer_nbytes,
    encode_frame,
    frame_header,
)
from p2ptrain.wire.records import OpenJob, RecordKeys, RecordOpener, RecordSealer

__all__ = ["FrameReceiver", "FrameTransport", "TransportStats"]

logger = logging.getLogger(__name__)


class FrameReceiver(Protocol):
    """Who gets a transport's frames once the handshake is done."""

    def frame_received(self, frame: Frame) -> None:
        """Called for every frame, in order, on the event loop."""

    def transport_lost(self, exc: P2PTrainError | None) -> None:
        """Called once when the transport closes; ``exc`` is None for a clean close."""


@dataclass
class TransportStats:
    """Byte and frame counters of one transport."""

    bytes_sent: int = 0
    bytes_received: int = 0
    frames_sent: int = 0
    frames_received: int = 0


class FrameTransport(abc.ABC):
    """A bidirectional, ordered, reliable channel of frames.

    Subclasses call :meth:`_deliver` for each decoded frame and :meth:`_lost`
    once when the channel closes, and implement the sending side.
    """

    path: str = "unknown"
    """How this transport reached the peer, e.g. ``tcp-direct`` or ``webrtc-direct``."""

    max_send_frame: int | None = None
    """The remote's frame size limit, once known: larger frames are refused locally."""

    channel_encrypted: bool = False
    """Whether the channel itself encrypts and authenticates end to end (DTLS):
    then frames are not sealed again and :attr:`channel_binding` names the session."""

    _decoder: FrameDecoder

    def __init__(self) -> None:
        self.stats = TransportStats()
        self._receiver: FrameReceiver | None = None
        self._early: deque[Frame] = deque()
        self._early_waiter: asyncio.Future[None] | None = None
        self._close_exc: P2PTrainError | None = None
        self._closed = False
        self._closed_event = asyncio.Event()
        self.payload_allocator: PayloadAllocator | None = None
        self._sealer: RecordSealer | None = None
        self._frame_limit_after_auth: int | None = None
        self.crypto_offload_bytes: int | None = None
        """Sealed payloads at least this large go to a crypto worker thread (None: none do)."""
        # Frames decoded behind a payload that a worker is still opening, in order.
        self._opening: deque[tuple[Frame, asyncio.Future[memoryview] | None]] = deque()
        self._loss_after_opening: list[P2PTrainError | None] = []
        self._failure_after_opening: RemoteProtocolError | None = None

    # -- before authentication ---------------------------------------------------------

    def limit_frames_until_authenticated(self, max_frame_bytes: int) -> None:
        """Refuse frames larger than ``max_frame_bytes`` until :meth:`authenticated`.

        A handshake frame takes a few KiB; without this cap an unauthenticated
        peer could make us allocate a whole ``max_frame_bytes`` payload buffer
        per socket. The limit is checked on the frame's 8-byte prefix.
        """
        if self._frame_limit_after_auth is None:
            self._frame_limit_after_auth = self._decoder.max_frame_bytes
        self._decoder.max_frame_bytes = min(max_frame_bytes, self._frame_limit_after_auth)

    def authenticated(self) -> None:
        """The handshake authenticated the peer: lift the pre-authentication limits."""
        if self._frame_limit_after_auth is not None:
            self._decoder.max_frame_bytes = self._frame_limit_after_auth
            self._frame_limit_after_auth = None

    # -- sending (implemented by subclasses) -------------------------------------------

    @abc.abstractmethod
    async def send_frame(self, frame: Frame) -> int:
        """Send a frame, waiting while the send buffer is full; returns its wire size."""

    @abc.abstractmethod
    def send_frame_nowait(self, frame: Frame) -> int:
        """Queue a frame without waiting (never blocks); returns its wire size."""

    def set_pacing_rate(self, bytes_per_s: float | None) -> bool:
        """Cap the rate the channel sends at (None: no cap); returns whether it can.

        Transports that cannot pace (this default) return False and send as before.
        """
        return False

    async def drained(self) -> None:
        """Wait until the send buffer is below its high-water mark again.

        Transports without a send buffer of their own return at once.
        """
        return None

    @abc.abstractmethod
    def _abort(self, *, flush: bool) -> None:
        """Tear down the underlying channel (after sending what is queued if ``flush``)."""

    @property
    @abc.abstractmethod
    def remote_address(self) -> str:
        """A printable address of the other end."""

    @property
    def channel_binding(self) -> tuple[bytes, bytes] | None:
        """What identifies this channel's own security session, for the handshake to sign.

        None unless :attr:`channel_encrypted`; a DTLS transport gives both
        certificate fingerprints (ours, theirs), so that a man in the middle
        of the signaling, who must present his own certificates, is detected.
        """
        return None

    @property
    def sealed(self) -> bool:
        """Whether frames are sealed as records now (after the handshake, unless DTLS)."""
        return self._sealer is not None

    def start_records(self, keys: RecordKeys) -> None:
        """Seal every frame sent and open every frame received from now on.

        A transport with :attr:`channel_encrypted` ignores the call. Either
        way the pre-authentication limits are lifted (:meth:`authenticated`):
        the handshake calls this once the remote proved its identity.

        Raises:
            RemoteProtocolError: the remote sent bytes ahead of the handshake
                (nothing honest does), which could have been injected.
        """
        self.authenticated()
        if self.channel_encrypted:
            return
        if self._early:
            raise RemoteProtocolError("unexpected frames before the handshake finished")
        self._decoder.start_records(RecordOpener(keys))
        self._sealer = RecordSealer(keys)

    def _encode(self, frame: Frame) -> tuple[bytes, Buffer, int]:
        """Encode (and seal) ``frame``, refusing one the remote would reject as too large.

        Returns the bytes to send as (head, payload) and the size on the wire.
        """
        sealer = self._sealer
        if sealer is None:
            head, payload = encode_frame(frame)
            size = len(head) + buffer_nbytes(payload)
            self._check_size(size)
            return head, payload, size
        header, view = self._sealable(frame)
        head, sealed = sealer.seal(header, view)
        if sealed is None:
            return head, b"", len(head)
        return head, sealed, len(head) + len(sealed)

    def _encode_later(self, frame: Frame) -> tuple[bytes, memoryview, int, Callable[[], None]]:
        """Like :meth:`_encode` for a sealed frame with a payload, whose sealing is a job.

        Returns (head, sealed payload buffer, size on the wire, the job that
        fills the buffer); see :meth:`~p2ptrain.wire.records.RecordSealer.seal_later`.
        """
        if self._sealer is None:
            raise RuntimeError("_encode_later() needs records")
        header, view = self._sealable(frame)
        if view is None:
            raise RuntimeError("_encode_later() needs a payload")
        head, sealed, job = self._sealer.seal_later(header, view)
        return head, sealed, len(head) + len(sealed), job

    def _sealable(self, frame: Frame) -> tuple[bytes, memoryview | None]:
        """The header of ``frame`` and its payload as a flat byte view (None: no payload)."""
        header = frame_header(frame)
        nbytes = buffer_nbytes(frame.payload)
        self._check_size(PREFIX.size + len(header) + nbytes)
        view: memoryview | None = None
        if nbytes:
            view = memoryview(frame.payload)
            if not view.c_contiguous:
                raise LocalProtocolError("a frame's payload must be a contiguous buffer")
            if view.format != "B" or view.ndim != 1:
                view = view.cast("B")
        return header, view

    def _check_size(self, size: int) -> None:
        if self.max_send_frame is not None and size > self.max_send_frame:
            raise LocalProtocolError(
                f"a frame of {size} bytes exceeds the peer's limit of {self.max_send_frame}"
            )

    # -- receiving ---------------------------------------------------------------------

    async def recv_frame(self) -> Frame:
        """The next frame; for use before a receiver is installed (the handshake)."""
        if self._receiver is not None:
            raise RuntimeError("recv_frame() is not available once a receiver is set")
        while not self._early:
            if self._closed:
                raise self._close_exc or ConnectionClosedError("connection closed")
            loop = asyncio.get_running_loop()
            self._early_waiter = loop.create_future()
            try:
                await self._early_waiter
            finally:
                self._early_waiter = None
        return self._early.popleft()

    def set_receiver(self, receiver: FrameReceiver) -> None:
        """Hand every frame from now on (and any queued ones) to ``receiver``."""
        self._receiver = receiver
        while self._early:
            receiver.frame_received(self._early.popleft())
        if self._closed:
            receiver.transport_lost(self._close_exc)

    def set_payload_allocator(self, allocator: PayloadAllocator | None) -> None:
        """Let ``allocator`` choose where received payloads land (None: fresh buffers).

        Only an optimization (a receiver can skip copying a payload into its
        final place): transports that cannot honour it only remember it.
        """
        self.payload_allocator = allocator

    def set_crypto_offload(self, nbytes: int | None) -> None:
        """Seal and open payloads of at least ``nbytes`` on a worker thread (None: never).

        Only an optimization: transports that cannot honour it only remember it.
        """
        self.crypto_offload_bytes = nbytes

    def _accept(self, frame: Frame, job: OpenJob | None) -> None:
        """Deliver ``frame`` in order, once ``job`` (if any) has opened its payload."""
        if job is None and not self._opening:
            self._deliver(frame)
            return
        future = None
        if job is not None:
            future = asyncio.get_running_loop().run_in_executor(crypto_executor(), job)
            future.add_done_callback(self._opened)
        self._opening.append((frame, future))

    def _opened(self, _future: asyncio.Future[memoryview]) -> None:
        """Deliver the frames at the head of the queue whose payloads are open."""
        opening = self._opening
        while opening and not self._closed:
            frame, future = opening[0]
            if future is not None:
                if not future.done():
                    return
                exc = future.exception()
                if exc is not None:
                    opening.clear()
                    self._failure_after_opening = None  # this failure came first
                    if not isinstance(exc, IntegrityError):  # pragma: no cover - a bug
                        exc = IntegrityError(f"opening a record failed: {exc!r}")
                    self._close_failed(exc)
                    return
                frame.payload = future.result()
            opening.popleft()
            self._deliver(frame)
        if opening or self._closed:
            return
        if self._failure_after_opening is not None:
            failure, self._failure_after_opening = self._failure_after_opening, None
            self._close_failed(failure)
        elif self._loss_after_opening:
            self._lost(self._loss_after_opening.pop())

    def _close_failed(self, exc: RemoteProtocolError) -> None:
        """Close on the remote's protocol violation ``exc``, logged.

        Frames decoded before it that are still being opened come first: if
        one of them fails, its error is the one reported.
        """
        if self._opening:
            if self._failure_after_opening is None:
                self._failure_after_opening = exc
            return
        self._log_failure(exc)
        self.close(exc)

    def _log_failure(self, exc: RemoteProtocolError) -> None:
        logger.warning(
            "closing connection from %s: %s: %s", self.remote_address, type(exc).__name__, exc
        )

    def _deliver(self, frame: Frame) -> None:
        self.stats.frames_received += 1
        if self._receiver is not None:
            self._receiver.frame_received(frame)
            return
        self._early.append(frame)
        self._wake_early_waiter()

    def _wake_early_waiter(self) -> None:
        if self._early_waiter is not None and not self._early_waiter.done():
            self._early_waiter.set_result(None)

    def _lost(self, exc: P2PTrainError | None) -> None:
        if self._closed:
            return
        if self._opening:
            # The remote closed after frames still being opened: deliver them first.
            if not self._loss_after_opening:
                self._loss_after_opening.append(exc)
            return
        self._closed = True
        self._close_exc = exc
        self._closed_event.set()
        self._wake_early_waiter()
        if self._receiver is not None:
            self._receiver.transport_lost(exc)

    # -- closing -----------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether the transport has closed."""
        return self._closed

    def close(self, exc: P2PTrainError | None = None, *, flush: bool = False) -> None:
        """Close now; queued outgoing data is sent first only if ``flush``."""
        if self._closed:
            return
        self._opening.clear()  # closed here: what is still being opened is not delivered
        self._abort(flush=flush)
        self._lost(exc)

    async def wait_closed(self) -> None:
        """Wait until the transport has closed."""
        await self._closed_event.wait()

    async def aclose(self) -> None:
        """Send what is queued, close, and wait until the channel is torn down."""
        self.close(flush=True)
        await self.wait_closed()
