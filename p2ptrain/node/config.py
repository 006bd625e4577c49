"""Configuration of a node."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from p2ptrain.errors import ConfigError
from p2ptrain.rpc.config import ConnectionConfig
from p2ptrain.secure.handshake import AdmissionPolicy
from p2ptrain.validate import check_integer, check_number

__all__ = ["NodeConfig", "reuse_port_available"]


def reuse_port_available() -> bool:
    """Whether this platform has ``SO_REUSEPORT`` (Linux, macOS, BSDs; not Windows)."""
    return hasattr(socket, "SO_REUSEPORT")


@dataclass(frozen=True)
class NodeConfig:
    """How a node listens, dials and admits peers.

    Attributes:
        host: interface to listen on.
        port: port to listen on (0 picks a free one).
        announce_host: the host others should dial (defaults to ``host``).
        swarm: name of the swarm; peers of different swarms refuse each other.
        admission: shared secret and/or public-key allowlist required of peers.
        connection: limits and timings of every connection.
        dial_timeout: seconds to open a TCP connection.
        reuse_port: listen with SO_REUSEPORT, so outgoing connections can be
            opened from the listening port (TCP hole punching needs it);
            only where the platform has it (:func:`reuse_port_available`).
        insecure_plaintext: leave frames after the handshake unencrypted and
            unauthenticated, for a trusted cluster (every peer must set it;
            others refuse). Off by default; see docs/security.md.
        max_connections: open connections above which the node closes the
            ones idle longest (no open streams for at least ``min_idle_s``);
            busy connections are never closed for this. While busy or young
            ones hold the pool above it, the node looks again as soon as the
            next could qualify.
        min_idle_s: seconds a connection must have been idle to be closed
            for ``max_connections``.
        idle_close_grace_s: such a close is graceful (the remote closes it when
            its streams are done, see :meth:`~p2ptrain.rpc.connection.Connection.go_away`);
            seconds without open streams after which this side closes it anyway.
        max_inbound: inbound connections held at once (in the handshake or
            authenticated); sockets beyond it are closed before any frame is read.
        max_inbound_per_source: inbound connections held at once from one
            source host (on loopback every local peer shares one source).
        memory_release_interval: seconds between two passes that hand memory
            nobody uses back to the system (idle pooled buffers, then the C
            allocator's free pages; see :mod:`p2ptrain.node.memory`); 0 disables.
        keep_freed_bytes: freed memory the C allocator keeps for reuse between
            two such passes (glibc; process-wide): a training loop that frees
            and allocates tens of MB per micro-batch then stops page-faulting
            them in each time. Applied when the node starts, with the passes
            on; 0 leaves the allocator as it is.
    """

    host: str = "127.0.0.1"
    port: int = 0
    announce_host: str | None = None
    swarm: str = "p2ptrain"
    admission: AdmissionPolicy = field(default_factory=AdmissionPolicy)
    connection: ConnectionConfig = field(default_factory=ConnectionConfig)
    dial_timeout: float = 10.0
    reuse_port: bool = False
    insecure_plaintext: bool = False
    max_connections: int = 256
    min_idle_s: float = 5.0
    idle_close_grace_s: float = 10.0
    max_inbound: int = 1024
    max_inbound_per_source: int = 256
    memory_release_interval: float = 10.0
    keep_freed_bytes: int = 128 << 20

    def __post_init__(self) -> None:
        check_integer("NodeConfig.port", self.port, at_least=0, at_most=65535)
        if not self.swarm or len(self.swarm.encode("utf-8")) > 256:
            raise ConfigError("swarm must be a name of 1 to 256 bytes (UTF-8)")
        check_number("NodeConfig.dial_timeout", self.dial_timeout)
        if self.reuse_port and not reuse_port_available():
            raise ConfigError("reuse_port needs SO_REUSEPORT, which this platform lacks")
        check_integer("NodeConfig.keep_freed_bytes", self.keep_freed_bytes, at_least=0)
        for name in ("max_connections", "max_inbound", "max_inbound_per_source"):
            check_integer(f"NodeConfig.{name}", getattr(self, name), at_least=1)
        for name in ("min_idle_s", "idle_close_grace_s", "memory_release_interval"):
            check_number(f"NodeConfig.{name}", getattr(self, name), at_least=0)
