"""Frames over WebRTC data channels (aiortc).

Theory of operation
-------------------
A :class:`WebRTCTransport` carries the same byte stream as a TCP connection
(frames encoded by :func:`~p2ptrain.wire.frames.encode_frame`) over one or more
reliable, ordered data channels of one ``RTCPeerConnection``:

* **Sending.** Frames are appended to a byte stream that is cut into messages
  of ``message_bytes`` (at most the peer's ``max-message-size``, 256 KiB).
  Small frames are coalesced: bytes wait in a buffer until it holds a full
  message or until the event loop's next turn, so a burst of tiny frames
  becomes a few large messages instead of one SCTP packet each. A large
  payload is sliced straight from the caller's buffer into messages (one copy:
  aiortc wants ``bytes``). With several channels, message *i* goes to channel
  ``i % n``.
* **Receiving.** Messages are fed, in order, into a
  :class:`~p2ptrain.wire.frames.FrameDecoder`; with several channels the
  receiver takes the next message from channel ``i % n`` (each channel is
  ordered, so no sequence numbers are needed) and holds early ones.
* **Backpressure.** ``RTCDataChannel.send`` never blocks and queues without
  limit. :meth:`WebRTCTransport.send_frame` waits while the bytes queued in
  the channels (``bufferedAmount``) exceed ``high_water`` and resumes on
  ``bufferedamountlow`` once they are down to ``low_water``;
  :meth:`~WebRTCTransport.send_frame_nowait` queues regardless.
* **Closing.** A graceful close (``close(flush=True)``, ``aclose``) closes the
  channels, which resets their SCTP streams *after* everything queued before
  (RFC 8831), then closes the peer connection once the peer has answered
  the reset (or after ``close_timeout``). The peer sees its channel close after
  the last message. An abortive close tears the peer connection down at once
  (SCTP ABORT + DTLS close_notify). Either side learns of the other's close, or
  of the connection failing (ICE consent lost, DTLS closed), as a
  :class:`~p2ptrain.errors.ConnectionClosedError`.

* **Security.** DTLS already encrypts and authenticates the data channels
  end to end, so frames are not sealed a second time
  (:attr:`~p2ptrain.transport.base.FrameTransport.channel_encrypted`).
  Instead :attr:`WebRTCTransport.channel_binding` gives the SHA-256
  fingerprints of both certificates of the DTLS session, which the handshake
  signs: a man in the middle of the signaling must terminate DTLS with
  certificates of his own, and then the two handshakes cannot agree.

Connecting (signaling, ICE, the path taken) lives in
:mod:`p2ptrain.transport.webrtc_connect`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes

from p2ptrain.errors import ConnectionClosedError, HandshakeError, RemoteProtocolError
from p2ptrain.transport.base import FrameTransport
from p2ptrain.transport.webrtc_sctp import SctpTuner
from p2ptrain.wire.frames import Frame, FrameDecoder, buffer_nbytes

__all__ = ["CandidatePairInfo", "WebRTCTransport"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CandidatePairInfo:
    """The ICE candidate pair a connection uses.

    Attributes:
        local_type: ``host``, ``srflx`` (our address as a NAT shows it) or
            ``relay`` (a TURN allocation).
        remote_type: The same for the peer's candidate.
        local_address: ``ip:port`` of our candidate.
        remote_address: ``ip:port`` of the peer's candidate.
    """

    local_type: str
    remote_type: str
    local_address: str
    remote_address: str

    @property
    def relayed(self) -> bool:
        """Whether a TURN relay carries the traffic."""
        return "relay" in (self.local_type, self.remote_type)

    @property
    def path(self) -> str:
        """``webrtc-turn`` through a relay, else ``webrtc-direct``."""
        return "webrtc-turn" if self.relayed else "webrtc-direct"


class WebRTCTransport(FrameTransport):
    """Frames over the data channels of one aiortc ``RTCPeerConnection``.

    Built by :func:`~p2ptrain.transport.webrtc_connect.webrtc_connect` once
    every channel is open; it owns the peer connection from then on.

    Args:
        pc: The connected ``RTCPeerConnection``.
        channels: Its open data channels, in the agreed order.
        pair: The selected ICE candidate pair (gives :attr:`path`).
        message_bytes: Largest message to send.
        high_water: ``bufferedAmount`` (all channels) above which
            :meth:`send_frame` waits.
        low_water: Where waiting senders resume.
        close_timeout: Seconds a graceful close waits for the peer.
        max_frame_bytes: Largest incoming frame accepted.
        max_header_bytes: Largest incoming frame header accepted.
        tuner: The SCTP tuning installed on the association, if any.
        early: Messages that arrived before the transport existed, as
            (channel index, message), in arrival order.
    """

    def __init__(
        self,
        pc: Any,
        channels: Sequence[Any],
        *,
        pair: CandidatePairInfo,
        message_bytes: int,
        high_water: int,
        low_water: int,
        close_timeout: float,
        max_frame_bytes: int,
        max_header_bytes: int,
        tuner: SctpTuner | None = None,
        early: Sequence[tuple[int, bytes | str]] = (),
    ) -> None:
        super().__init__()
        if not channels:
            raise ValueError("a WebRTC transport needs at least one data channel")
        self.path = pair.path
        self.pair = pair
        self.tuner = tuner
        self._pc = pc
        self._channels = list(channels)
        self._message_bytes = message_bytes
        self._high_water = high_water
        self._low_water = low_water
        self._close_timeout = close_timeout
        self._decoder = FrameDecoder(
            max_frame_bytes=max_frame_bytes, max_header_bytes=max_header_bytes
        )
        self._loop = asyncio.get_running_loop()
        self._pending = bytearray()  # bytes not yet cut into a message
        self._flush_handle: asyncio.Handle | None = None
        self._next_tx = 0
        self._next_rx = 0
        self._held: list[deque[bytes | str]] = [deque() for _ in self._channels]
        self._writable = asyncio.Event()
        self._writable.set()
        self._teardown: asyncio.Task[None] | None = None
        per_channel_low = low_water // len(self._channels)
        handlers = [self._message_handler(index) for index in range(len(self._channels))]
        for index, message in early:
            handlers[index](message)
        for channel, handler in zip(self._channels, handlers, strict=True):
            channel.bufferedAmountLowThreshold = per_channel_low
            channel.on("message", handler)
            channel.on("bufferedamountlow", self._on_buffered_low)
            channel.on("close", self._on_channel_close)
        pc.on("connectionstatechange", self._on_connection_state)
        if any(channel.readyState != "open" for channel in self._channels):
            self._on_channel_close()  # the peer hung up while we were connecting
        else:
            self._on_connection_state()

    # -- FrameTransport ----------------------------------------------------------------

    channel_encrypted = True

    @property
    def channel_binding(self) -> tuple[bytes, bytes]:
        """SHA-256 of our DTLS certificate and of the one the peer presented."""
        return dtls_fingerprints(self._pc)

    @property
    def remote_address(self) -> str:
        return self.pair.remote_address

    @property
    def buffered_amount(self) -> int:
        """Bytes queued for sending and not yet handed to SCTP."""
        return self._queued() + len(self._pending)

    async def send_frame(self, frame: Frame) -> int:
        while self._queued() > self._high_water and not self.closed:
            self._writable.clear()
            await self._writable.wait()
        return self.send_frame_nowait(frame)

    def send_frame_nowait(self, frame: Frame) -> int:
        self._check_open()
        head, payload, size = self._encode(frame)
        pending = self._pending
        pending += head
        self._send_full_messages()
        nbytes = buffer_nbytes(payload)
        if nbytes:
            view = memoryview(payload).cast("B")
            pos = 0
            if pending:  # top up the partial message first
                pos = min(self._message_bytes - len(pending), nbytes)
                pending += view[:pos]
                self._send_full_messages()
            if not pending:  # on a message boundary: whole messages straight from the payload
                step = self._message_bytes
                while nbytes - pos >= step:
                    self._send_message(bytes(view[pos : pos + step]))
                    pos += step
            pending += view[pos:]
        if pending and self._flush_handle is None:
            self._flush_handle = self._loop.call_soon(self._flush)
        self.stats.frames_sent += 1
        self.stats.bytes_sent += size
        return size

    def _abort(self, *, flush: bool) -> None:
        if flush:
            with contextlib.suppress(ConnectionClosedError):
                self._flush()
            for channel in self._channels:
                channel.close()  # a no-op on a channel already closing
        self._start_teardown(graceful=flush)

    # -- sending -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed:
            raise self._close_exc or ConnectionClosedError("WebRTC connection closed")
        if any(channel.readyState != "open" for channel in self._channels):
            error = ConnectionClosedError(f"the data channel to {self.remote_address} closed")
            self._lost(error)
            self._start_teardown(graceful=False)
            raise error

    def _flush(self) -> None:
        self._flush_handle = None
        if not self._pending or self.closed:
            return
        try:
            self._check_open()
        except ConnectionClosedError:
            return
        self._send_pending(len(self._pending))

    def _send_full_messages(self) -> None:
        while len(self._pending) >= self._message_bytes:
            self._send_pending(self._message_bytes)

    def _send_pending(self, nbytes: int) -> None:
        self._send_message(bytes(memoryview(self._pending)[:nbytes]))
        del self._pending[:nbytes]

    def _send_message(self, message: bytes) -> None:
        channel = self._channels[self._next_tx % len(self._channels)]
        self._next_tx += 1
        channel.send(message)

    def _queued(self) -> int:
        # Bytes in the channels; the coalescing buffer (under one message, sent
        # on the loop's next turn) does not count, so that the last channel
        # crossing its share of low_water always releases waiting senders.
        return sum(int(channel.bufferedAmount) for channel in self._channels)

    def _on_buffered_low(self) -> None:
        if self._queued() <= self._low_water:
            self._writable.set()

    # -- receiving ---------------------------------------------------------------------

    def _message_handler(self, index: int) -> Any:
        if len(self._channels) == 1:
            return self._on_message

        def on_message(message: bytes | str) -> None:
            self._held[index].append(message)
            count = len(self._channels)
            while True:
                held = self._held[self._next_rx % count]
                if not held:
                    return
                self._next_rx += 1
                self._on_message(held.popleft())
                if self.closed:
                    return

        return on_message

    def _on_message(self, message: bytes | str) -> None:
        if self.closed:
            return
        if isinstance(message, str):
            self.close(RemoteProtocolError("text message on a binary data channel"))
            return
        self.stats.bytes_received += len(message)
        error: RemoteProtocolError | None = None
        try:
            self._decoder.feed(message)
        except RemoteProtocolError as exc:
            error = exc  # after the frames that were complete before it
        while (frame := self._decoder.next_frame()) is not None:
            self._deliver(frame)
            if self.closed:
                return
        if error is not None:
            logger.warning("closing WebRTC connection to %s: %s", self.remote_address, error)
            self.close(error)

    # -- closing -----------------------------------------------------------------------

    def _on_channel_close(self) -> None:
        self._remote_gone(f"{self.remote_address} closed the data channel")

    def _on_connection_state(self) -> None:
        state = self._pc.connectionState
        if state in ("failed", "closed"):
            self._remote_gone(f"the WebRTC connection to {self.remote_address} {state}")

    def _remote_gone(self, why: str) -> None:
        self._writable.set()
        if not self.closed:
            self._lost(ConnectionClosedError(why))
        self._start_teardown(graceful=False)

    def _start_teardown(self, *, graceful: bool) -> None:
        self._writable.set()
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        if self._teardown is None:
            self._teardown = self._loop.create_task(
                self._tear_down(graceful), name="webrtc-teardown"
            )

    async def _tear_down(self, graceful: bool) -> None:
        try:
            if graceful:
                # Wait for the peer to acknowledge the stream resets, which it
                # does only after receiving everything queued before them.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._close_timeout):
                        await self._channels_closed()
        finally:
            if self.tuner is not None:
                self.tuner.close()
            try:
                await self._pc.close()
            except Exception:  # the root of this task: log, the transport is closed anyway
                logger.exception("closing the WebRTC connection to %s failed", self.remote_address)

    async def _channels_closed(self) -> None:
        for channel in self._channels:
            if channel.readyState != "closed":
                await _next_event(channel, "close")

    async def wait_closed(self) -> None:
        """Wait until the transport has closed and the connection is torn down."""
        await super().wait_closed()
        if self._teardown is not None:
            await asyncio.shield(self._teardown)

    async def aclose(self) -> None:
        """Send what is queued, close the channels, and tear the connection down."""
        self.close(flush=True)
        await self.wait_closed()


async def _next_event(emitter: Any, event: str) -> None:
    """Wait for the next ``event`` of a pyee emitter."""
    fired: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def fire(*_: Any) -> None:
        if not fired.done():
            fired.set_result(None)

    emitter.once(event, fire)
    try:
        await fired
    finally:
        emitter.remove_listener(event, fire)


def dtls_fingerprints(pc: Any) -> tuple[bytes, bytes]:
    """SHA-256 fingerprints of (our, the peer's) certificate in ``pc``'s DTLS session.

    Read from the session itself (aiortc's ``RTCDtlsTransport._ssl``), not
    from the SDP, so they name the certificates really in use.

    Raises:
        HandshakeError: the DTLS session is not established.
    """
    sctp = getattr(pc, "sctp", None)
    ssl = getattr(getattr(sctp, "transport", None), "_ssl", None)
    if ssl is None:
        raise HandshakeError("the WebRTC connection has no DTLS session to bind to")
    local = ssl.get_certificate()
    remote = ssl.get_peer_certificate(as_cryptography=True)
    if local is None or remote is None:
        raise HandshakeError("the DTLS session has no certificates to bind to")
    ours = local.to_cryptography() if not isinstance(local, x509.Certificate) else local
    return ours.fingerprint(hashes.SHA256()), remote.fingerprint(hashes.SHA256())
