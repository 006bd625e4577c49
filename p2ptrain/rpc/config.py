"""Limits and timings of one connection and its RPC streams."""

from __future__ import annotations

from dataclasses import dataclass

from p2ptrain.transport.crypto_offload import DEFAULT_OFFLOAD_BYTES
from p2ptrain.transport.pacing import DEFAULT_PACE_TARGET_S
from p2ptrain.validate import check_integer, check_number

__all__ = ["ConnectionConfig"]

MiB = 1 << 20


@dataclass(frozen=True)
class ConnectionConfig:
    """Limits and timings shared by every connection of a node.

    Attributes:
        max_frame_bytes: largest frame accepted (length header checked before buffering).
        max_header_bytes: largest msgpack header, which also bounds a message body.
        stream_window: bytes a peer may send on one stream before we acknowledge them.
        max_streams: streams the remote may have open at once on one connection.
        write_high_water: send-buffer size at which senders start to wait.
        pace_target_s: TCP only: a bulk frame (a payload of 64 KiB or more) is
            written once the bytes queued below it (send buffer plus the
            kernel's unsent bytes) would drain within this many seconds at
            the connection's measured rate, so that small frames never queue
            behind megabytes (:mod:`p2ptrain.transport.pacing`); None turns
            pacing off.
        crypto_offload_bytes: TCP only: encrypted payloads of at least this
            many bytes are sealed and opened on worker threads, overlapped
            with the socket I/O of the frames around them
            (:mod:`p2ptrain.transport.crypto_offload`; only on machines of
            4 cores or more); None does all the AES-GCM work on the event loop.
        handshake_timeout: seconds a new connection has to finish the handshake.
        idle_timeout: seconds without open streams after which a connection closes.
        keepalive_interval: seconds of silence from the remote after which a PING
            is sent; a peer that misses ``keepalive_misses`` in a row is dropped.
        keepalive_misses: consecutive unanswered PINGs that close the connection.
        max_handshake_frame_bytes: largest frame accepted before the peer is
            authenticated (a handshake frame needs a few KiB); a larger one is
            refused from its 8-byte prefix, before any buffer is allocated
            (capped by ``max_frame_bytes``).
        max_buffered_bytes: bytes of received messages that the application has
            not read yet, summed over the streams of one connection; a message
            that would pass it resets its stream with ``resource_exhausted``.
        max_node_buffered_bytes: bytes of received messages not read yet,
            summed over every connection of the node; a message that would
            pass it resets its stream with ``resource_exhausted`` (the
            connection stays up).
        max_node_streams: streams opened by peers that may be open at once,
            summed over every connection of the node (``max_streams`` caps
            one connection); an OPEN past it is reset with
            ``resource_exhausted``.
        connection_reserve_bytes: unread bytes each connection may hold
            outside ``max_node_buffered_bytes`` (within its own
            ``max_buffered_bytes``), so peers that fill the node's pool cannot
            starve another peer's small requests.
        connection_reserve_streams: streams each connection may hold open
            outside ``max_node_streams``, for the same reason.
        handler_timeout: seconds a stream the peer opened may stay open on
            our side (its handler running, or its end awaited); checked every
            quarter of it (at most every ``keepalive_interval``), so at most
            1.25 times this. Past it the stream is reset, its handler
            cancelled, and the caller gets ``deadline_exceeded`` saying the
            server's limit ran out. The caller's own deadline still applies.
            Stream methods registered with ``unbounded=True`` (a rendezvous
            registration, a relayed circuit) are exempt.
        max_reply_bytes_in_flight: bytes of large unary replies (payloads of at
            least 64 KiB) being sent at once, summed over every connection of
            the node; a reply that does not fit is refused with
            ``resource_exhausted`` instead of being held.
        reply_send_timeout: seconds a unary reply may take to leave our send
            buffer; a peer that does not read it by then is disconnected
            (the reply is dropped).
    """

    max_frame_bytes: int = 16 * MiB + 64 * 1024
    max_header_bytes: int = 1 * MiB
    stream_window: int = 32 * MiB
    max_streams: int = 1024
    write_high_water: int = 1 * MiB
    pace_target_s: float | None = DEFAULT_PACE_TARGET_S
    crypto_offload_bytes: int | None = DEFAULT_OFFLOAD_BYTES
    handshake_timeout: float = 10.0
    idle_timeout: float = 300.0
    keepalive_interval: float = 15.0
    keepalive_misses: int = 3
    max_handshake_frame_bytes: int = 64 * 1024
    max_buffered_bytes: int = 96 * MiB
    max_reply_bytes_in_flight: int = 64 * MiB
    reply_send_timeout: float = 30.0
    max_node_buffered_bytes: int = 160 * MiB
    max_node_streams: int = 4096
    connection_reserve_bytes: int = 256 * 1024
    connection_reserve_streams: int = 8
    handler_timeout: float = 600.0

    def __post_init__(self) -> None:
        owner = "ConnectionConfig"
        check_integer(
            f"{owner}.max_frame_bytes", self.max_frame_bytes, at_least=4096, at_most=2**32
        )
        check_integer(
            f"{owner}.max_header_bytes",
            self.max_header_bytes,
            at_least=256,
            at_most=self.max_frame_bytes,
        )
        check_integer(f"{owner}.stream_window", self.stream_window, at_least=1024, at_most=2**62)
        check_integer(
            f"{owner}.max_handshake_frame_bytes",
            self.max_handshake_frame_bytes,
            at_least=4096,
            at_most=2**32,
        )
        for name in ("max_streams", "max_node_streams", "keepalive_misses"):
            check_integer(f"{owner}.{name}", getattr(self, name), at_least=1)
        for name in (
            "write_high_water",
            "max_buffered_bytes",
            "max_reply_bytes_in_flight",
            "max_node_buffered_bytes",
        ):
            check_integer(f"{owner}.{name}", getattr(self, name), at_least=1024)
        for name in ("connection_reserve_bytes", "connection_reserve_streams"):
            check_integer(f"{owner}.{name}", getattr(self, name), at_least=0)
        check_number(f"{owner}.pace_target_s", self.pace_target_s, allow_none=True)
        check_integer(
            f"{owner}.crypto_offload_bytes",
            self.crypto_offload_bytes,
            at_least=4096,
            allow_none=True,
        )
        for name in (
            "handshake_timeout",
            "idle_timeout",
            "keepalive_interval",
            "reply_send_timeout",
            "handler_timeout",
        ):
            check_number(f"{owner}.{name}", getattr(self, name))
