"""Establishing a WebRTC transport: signaling, ICE with a deadline, the path taken.

Theory of operation
-------------------
Both peers call :func:`webrtc_connect` with the two ends of a
:class:`~p2ptrain.transport.webrtc_signaling.SignalingChannel`; exactly one of
them is the ``initiator``. ICE is not trickled: aiortc gathers every candidate
while setting the local description, so one message each way suffices::

    initiator                                    responder
      create pc + negotiated channels 0..n-1
      offer = gather(host, srflx, relay)
      {"type": "offer", "v": 1, "sdp": ..., "channels": n}  ------>
                                                 create pc + the same n channels
                                                 answer = gather(...)
      <------  {"type": "answer", "v": 1, "sdp": ...}
      ICE checks, DTLS handshake, SCTP association: both sides
      channels open  ->  WebRTCTransport on both sides

The channels are pre-negotiated (``negotiated=True``, ids 0..n-1), so no
in-band DCEP round trip is needed. A side that fails sends
``{"type": "error", "reason": ...}`` (best effort) so that the other fails at
once instead of at its deadline.

The whole exchange runs under ``config.connect_timeout``: aioice by itself
reports an ICE failure against a symmetric NAT only after about 64 s. On the
deadline, or when ICE fails earlier, :class:`~p2ptrain.errors.NATTraversalError`
says what was reached (signaling, ICE checks, DTLS, SCTP) and which candidate
types each side offered.

Reaching into aiortc
--------------------
aiortc has no public API for the selected candidate pair or for its sockets.
Both are read from ``pc.sctp.transport`` (``RTCDtlsTransport``)
``.transport`` (``RTCIceTransport``) ``._connection`` (``aioice.Connection``):
``_nominated[1]`` is the selected ``CandidatePair`` (its ``local_candidate``
and ``remote_candidate`` have a ``type``: host, srflx, prflx or relay), and
``_protocols`` are the datagram protocols of every local candidate. A host
candidate's protocol has an asyncio datagram transport (``get_extra_info
("socket")``); a relay candidate's has an ``aioice.turn.TurnTransport`` whose
inner ``TurnClientUdpProtocol`` (name-mangled ``_TurnTransport__inner_protocol``)
owns the UDP socket to the TURN server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
from collections.abc import Iterator
from typing import Any

from aiortc import RTCPeerConnection, RTCSessionDescription

from p2ptrain.errors import (
    ConnectError,
    NATTraversalError,
    RemoteProtocolError,
    TransportError,
)
from p2ptrain.transport.webrtc import CandidatePairInfo, WebRTCTransport
from p2ptrain.transport.webrtc_config import MAX_MESSAGE_BYTES, WebRTCConfig
from p2ptrain.transport.webrtc_sctp import SctpTuner, UnsupportedAiortcError, tune_association
from p2ptrain.transport.webrtc_signaling import MAX_SIGNAL_BYTES, SignalingChannel

__all__ = ["ice_sockets", "selected_pair", "set_socket_buffers", "webrtc_connect"]

logger = logging.getLogger(__name__)
_warned_stock: list[str] = []
"""The reason already warned about: the fallback is logged once per process."""


def _warn_stock_sctp(reason: UnsupportedAiortcError) -> None:
    """Say (once) that WebRTC runs aiortc's stock SCTP, slower under loss, and why."""
    if str(reason) in _warned_stock:
        logger.debug("stock SCTP: %s", reason)
        return
    _warned_stock.append(str(reason))
    logger.warning(
        "WebRTC runs aiortc's stock SCTP (slower under packet loss; see docs/webrtc.md): %s",
        reason,
    )


SIGNAL_VERSION = 1
_SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)  # Linux, needs CAP_NET_ADMIN
_SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)
_MAX_MESSAGE = re.compile(r"^a=max-message-size:(\d+)\s*$", re.MULTILINE)
_DATA_SECTION = re.compile(r"^m=application [1-9][0-9]* ", re.MULTILINE)
_DEFAULT_REMOTE_MESSAGE = 65_536  # RFC 8841 section 6, when the SDP says nothing
_ERROR_SEND_TIMEOUT = 1.0


async def webrtc_connect(
    signal: SignalingChannel,
    *,
    config: WebRTCConfig,
    initiator: bool,
    max_frame_bytes: int,
    max_header_bytes: int,
) -> WebRTCTransport:
    """Open a WebRTC transport to the peer at the other end of ``signal``.

    Args:
        signal: Carries the offer and answer (and nothing else afterwards).
        config: ICE servers, tuning, deadlines.
        initiator: True on exactly one side: it sends the offer.
        max_frame_bytes: Largest incoming frame accepted.
        max_header_bytes: Largest incoming frame header accepted.

    Returns:
        The open transport; its ``path`` is ``webrtc-direct`` or ``webrtc-turn``.

    Raises:
        NATTraversalError: No path was found within ``config.connect_timeout``
            or ICE failed; ``attempts["webrtc"]`` says how far it got.
        ConnectError: The signaling channel failed or the peer reported an error.
        RemoteProtocolError: The peer sent a malformed signaling message.
    """
    attempt = _Attempt(RTCPeerConnection(configuration=config.rtc_configuration()), config)
    established = False
    try:
        try:
            async with asyncio.timeout(config.connect_timeout):
                if initiator:
                    await attempt.offer(signal)
                else:
                    await attempt.answer(signal)
                await attempt.wait_open()
        except TimeoutError as exc:
            reason = attempt.diagnose(timed_out=True)
            error = NATTraversalError(
                f"no WebRTC connection within {config.connect_timeout:g} s", {"webrtc": reason}
            )
            await attempt.tell_peer(signal, error)
            raise error from exc
        except _IceFailedError as exc:
            error = NATTraversalError(
                "WebRTC connection failed", {"webrtc": attempt.diagnose(timed_out=False)}
            )
            await attempt.tell_peer(signal, error)
            raise error from exc
        except (TransportError, RemoteProtocolError) as exc:
            await attempt.tell_peer(signal, exc)
            raise
        transport = attempt.transport(
            max_frame_bytes=max_frame_bytes, max_header_bytes=max_header_bytes
        )
        established = True
        return transport
    finally:
        if not established:
            await attempt.discard()


class _IceFailedError(Exception):
    """The peer connection reported ``failed`` before the channels opened."""


class _Attempt:
    """The state of one connection attempt (one side)."""

    def __init__(self, pc: Any, config: WebRTCConfig) -> None:
        self.pc = pc
        self.config = config
        self.stage = "signaling"
        self.channels: list[Any] = []
        self.tuner: SctpTuner | None = None
        self.remote_message_bytes = _DEFAULT_REMOTE_MESSAGE
        self.opened: set[int] = set()
        self.early: list[tuple[int, bytes | str]] = []
        self._changed: asyncio.Future[None] | None = None

    async def offer(self, signal: SignalingChannel) -> None:
        self._create_channels(self.config.channels)
        self.stage = "gathering candidates"
        await self.pc.setLocalDescription(await self.pc.createOffer())
        self._tune_sockets()
        await _send(
            signal,
            {
                "type": "offer",
                "v": SIGNAL_VERSION,
                "sdp": self.pc.localDescription.sdp,
                "channels": len(self.channels),
            },
        )
        self.stage = "waiting for the answer"
        answer = _check_description(await _recv(signal), "answer")
        await self._set_remote(RTCSessionDescription(sdp=answer["sdp"], type="answer"))

    async def answer(self, signal: SignalingChannel) -> None:
        self.stage = "waiting for the offer"
        offer = _check_description(await _recv(signal), "offer")
        count = offer.get("channels")
        if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= 16:
            raise RemoteProtocolError(f"the offer asks for {count!r} channels (1..16)")
        await self._set_remote(RTCSessionDescription(sdp=offer["sdp"], type="offer"))
        self._create_channels(count)
        self.stage = "gathering candidates"
        await self.pc.setLocalDescription(await self.pc.createAnswer())
        self._tune_sockets()
        await _send(
            signal, {"type": "answer", "v": SIGNAL_VERSION, "sdp": self.pc.localDescription.sdp}
        )

    def _create_channels(self, count: int) -> None:
        for index in range(count):
            channel = self.pc.createDataChannel(f"p2ptrain-{index}", negotiated=True, id=index)
            # Listen from the start: the peer may send (and even close) as soon
            # as its side is open, before our transport exists.
            channel.on("open", self._opened_handler(index))
            channel.on("message", self._early_handler(index))
            self.channels.append(channel)
        self.pc.on("connectionstatechange", self._wake)
        if self.config.sctp is not None:
            try:
                self.tuner = tune_association(self.pc.sctp, self.config.sctp)
            except UnsupportedAiortcError as exc:
                _warn_stock_sctp(exc)

    def _opened_handler(self, index: int) -> Any:
        def opened() -> None:
            self.opened.add(index)
            self._wake()

        return opened

    def _early_handler(self, index: int) -> Any:
        def early(message: bytes | str) -> None:
            self.early.append((index, message))

        return early

    def _wake(self) -> None:
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)

    def detach(self) -> None:
        """Remove this attempt's listeners (the transport installs its own)."""
        self.pc.remove_all_listeners("connectionstatechange")
        for channel in self.channels:
            channel.remove_all_listeners("open")
            channel.remove_all_listeners("message")

    async def _set_remote(self, description: Any) -> None:
        try:
            await self.pc.setRemoteDescription(description)
        except ValueError as exc:  # aiortc's SDP parser and validation
            raise RemoteProtocolError(f"unusable SDP {description.type}: {exc}") from exc
        found = _MAX_MESSAGE.search(description.sdp)
        self.remote_message_bytes = int(found.group(1)) if found else _DEFAULT_REMOTE_MESSAGE

    def _tune_sockets(self) -> None:
        size = self.config.socket_buffer_bytes
        if size is None:
            return
        for sock in ice_sockets(self.pc):
            set_socket_buffers(sock, size)

    async def wait_open(self) -> None:
        self.stage = "ICE checks"
        loop = asyncio.get_running_loop()
        for index, channel in enumerate(self.channels):
            if channel.readyState == "open":
                self.opened.add(index)
        while len(self.opened) < len(self.channels):
            state = self.pc.connectionState
            if state == "closed":
                raise ConnectError("the peer closed the WebRTC connection while it was set up")
            if state == "failed":
                raise _IceFailedError(state)
            self.stage = self._progress()
            self._changed = loop.create_future()
            await self._changed

    def _progress(self) -> str:
        sctp = self.pc.sctp
        if self.pc.iceConnectionState != "completed":
            return "ICE checks"
        if sctp is None or sctp.transport.state != "connected":
            return "DTLS handshake"
        return "SCTP association"

    def diagnose(self, *, timed_out: bool) -> str:
        """Why the attempt failed, for NATTraversalError.attempts."""
        if self.stage in ("waiting for the answer", "waiting for the offer"):
            return f"{self.stage}: nothing came over the signaling channel"
        if self.stage in ("signaling", "gathering candidates"):
            return f"{self.stage}: a STUN or TURN server did not answer in time"
        local, remote = _candidate_types(self.pc)
        where = self._progress() if self.pc.connectionState != "closed" else self.stage
        if where != "ICE checks":
            return f"stuck in the {where} after ICE connected"
        why = "no candidate pair worked" + (" before the deadline" if timed_out else "")
        hint = ""
        if "relay" not in local and "relay" not in remote:
            hint = "; no relay candidate: a TURN server would relay around symmetric NATs"
        return (
            f"ICE: {why} (local candidates: {', '.join(local) or 'none'};"
            f" remote: {', '.join(remote) or 'none'}){hint}"
        )

    async def tell_peer(self, signal: SignalingChannel, error: Exception) -> None:
        """Send the peer our reason for giving up (best effort, briefly)."""
        with contextlib.suppress(TransportError, TimeoutError, RemoteProtocolError):
            async with asyncio.timeout(_ERROR_SEND_TIMEOUT):
                await signal.send({"type": "error", "v": SIGNAL_VERSION, "reason": str(error)})

    async def discard(self) -> None:
        """Close the peer connection of a failed attempt."""
        self.detach()
        if self.tuner is not None:
            self.tuner.close()
        await self.pc.close()

    def transport(self, *, max_frame_bytes: int, max_header_bytes: int) -> WebRTCTransport:
        self.detach()
        message_bytes = self.config.message_bytes
        if self.remote_message_bytes > 0:
            message_bytes = min(message_bytes, self.remote_message_bytes, MAX_MESSAGE_BYTES)
        return WebRTCTransport(
            self.pc,
            self.channels,
            pair=selected_pair(self.pc),
            message_bytes=message_bytes,
            high_water=self.config.high_water,
            low_water=self.config.low_water,
            close_timeout=self.config.close_timeout,
            max_frame_bytes=max_frame_bytes,
            max_header_bytes=max_header_bytes,
            tuner=self.tuner,
            early=self.early,
        )


# -- signaling messages ----------------------------------------------------------------


async def _send(signal: SignalingChannel, message: dict[str, Any]) -> None:
    try:
        await signal.send(message)
    except TransportError as exc:
        raise ConnectError(f"signaling failed: {exc}") from exc


async def _recv(signal: SignalingChannel) -> dict[str, Any]:
    try:
        return await signal.recv()
    except TransportError as exc:
        raise ConnectError(f"signaling failed: {exc}") from exc


def _check_description(message: dict[str, Any], kind: str) -> dict[str, Any]:
    """Validate an offer or answer received from the peer."""
    if message.get("type") == "error":
        reason = message.get("reason")
        text = reason[:500] if isinstance(reason, str) else "no reason given"
        raise ConnectError(f"the peer gave up: {text}")
    if message.get("type") != kind:
        raise RemoteProtocolError(f"expected a signaling {kind}, got {message.get('type')!r}")
    if message.get("v") != SIGNAL_VERSION:
        raise RemoteProtocolError(f"unsupported signaling version {message.get('v')!r}")
    sdp = message.get("sdp")
    if not isinstance(sdp, str) or not sdp or len(sdp) > MAX_SIGNAL_BYTES:
        raise RemoteProtocolError(f"the {kind} carries no usable SDP")
    if not _DATA_SECTION.search(sdp):
        raise RemoteProtocolError(f"the SDP {kind} has no data-channel (m=application) section")
    return message


# -- aiortc internals (see the module docstring) -----------------------------------------


def _ice_connection(pc: Any) -> Any:
    sctp = pc.sctp
    if sctp is None:
        return None
    return getattr(sctp.transport.transport, "_connection", None)


def _candidate_types(pc: Any) -> tuple[list[str], list[str]]:
    connection = _ice_connection(pc)
    if connection is None:
        return [], []
    local = sorted({candidate.type for candidate in connection.local_candidates})
    remote = sorted({candidate.type for candidate in connection.remote_candidates})
    return local, remote


def selected_pair(pc: Any) -> CandidatePairInfo:
    """The ICE candidate pair an open ``RTCPeerConnection`` sends on.

    Raises:
        ConnectError: aiortc has not selected a pair (not connected).
    """
    connection = _ice_connection(pc)
    nominated = getattr(connection, "_nominated", None) or {}
    pair = nominated.get(1)
    if pair is None:
        raise ConnectError("the WebRTC connection has no selected candidate pair")
    local, remote = pair.local_candidate, pair.remote_candidate
    return CandidatePairInfo(
        local_type=local.type,
        remote_type=remote.type,
        local_address=f"{local.host}:{local.port}",
        remote_address=f"{remote.host}:{remote.port}",
    )


def ice_sockets(pc: Any) -> Iterator[Any]:
    """The UDP sockets of every local ICE candidate (host, and TURN client)."""
    connection = _ice_connection(pc)
    for protocol in getattr(connection, "_protocols", ()):
        transport = getattr(protocol, "transport", None)
        inner = getattr(transport, "_TurnTransport__inner_protocol", None)
        if inner is not None:
            transport = getattr(inner, "transport", None)
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is not None:
            yield sock


def set_socket_buffers(sock: Any, nbytes: int) -> tuple[int, int]:
    """Ask for ``nbytes`` of receive and send buffer on ``sock``.

    Uses SO_RCVBUFFORCE/SO_SNDBUFFORCE where allowed (CAP_NET_ADMIN), which
    ignore ``net.core.rmem_max``/``wmem_max``; else SO_RCVBUF/SO_SNDBUF (capped
    by those sysctls). Returns what the kernel granted (Linux reports twice the
    requested size, for its bookkeeping).
    """
    for forced, plain in ((_SO_RCVBUFFORCE, socket.SO_RCVBUF), (_SO_SNDBUFFORCE, socket.SO_SNDBUF)):
        try:
            sock.setsockopt(socket.SOL_SOCKET, forced, nbytes)
        except OSError:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, plain, nbytes)
    received = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    sent = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    logger.debug("ICE socket buffers: receive %d, send %d bytes", received, sent)
    return int(received), int(sent)
