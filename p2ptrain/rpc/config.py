"""Limits and timings of one connection and its RPC streams."""

from __future__ import annotations

from dataclasses import dataclass

from p2ptrain.errors import ConfigError

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
        handshake_timeout: seconds a new connection has to finish the handshake.
        idle_timeout: seconds without open streams after which a connection closes.
        keepalive_interval: seconds of silence from the remote after which a PING
            is sent; a peer that misses ``keepalive_misses`` in a row is dropped.
        keepalive_misses: consecutive unanswered PINGs that close the connection.
    """

    max_frame_bytes: int = 16 * MiB + 64 * 1024
    max_header_bytes: int = 1 * MiB
    stream_window: int = 32 * MiB
    max_streams: int = 1024
    write_high_water: int = 1 * MiB
    handshake_timeout: float = 10.0
    idle_timeout: float = 300.0
    keepalive_interval: float = 15.0
    keepalive_misses: int = 3

    def __post_init__(self) -> None:
        if not 4096 <= self.max_frame_bytes <= 2**32:
            raise ConfigError("max_frame_bytes must be in [4096, 2**32]")
        if not 256 <= self.max_header_bytes <= self.max_frame_bytes:
            raise ConfigError("max_header_bytes must be in [256, max_frame_bytes]")
        if not 1024 <= self.stream_window <= 2**62:
            raise ConfigError("stream_window must be in [1024, 2**62]")
        if self.max_streams < 1:
            raise ConfigError("max_streams must be positive")
        if self.write_high_water < 1024:
            raise ConfigError("write_high_water must be at least 1024")
        for name in ("handshake_timeout", "idle_timeout", "keepalive_interval"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive")
        if self.keepalive_misses < 1:
            raise ConfigError("keepalive_misses must be at least 1")
