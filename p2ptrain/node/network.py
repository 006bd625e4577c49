"""How a node listens and dials: TCP by default, or any :class:`Network`.

A :class:`~p2ptrain.node.node.Node` asks its network for a listener when it
starts and for a transport when it dials an address directly. Everything
after that (the handshake, the RPC connection, the pool) is the same code
whatever carries the frames. :class:`TCPNetwork` is the real thing; the
simulator in :mod:`p2ptrain.lab.simnet` implements the same protocol
with in-memory links that have rates, latency and loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from p2ptrain.rpc.config import ConnectionConfig
from p2ptrain.transport.base import FrameTransport
from p2ptrain.transport.tcp import TCPTransport, tcp_connect, tcp_listen

__all__ = ["Listener", "Network", "TCPNetwork"]


class Listener(Protocol):
    """An open listener."""

    @property
    def port(self) -> int:
        """The port it listens on."""
        ...

    async def aclose(self) -> None:
        """Stop accepting connections (existing ones stay open)."""
        ...


class Network(Protocol):
    """Opens listeners and outgoing transports for a node."""

    async def listen(
        self,
        host: str,
        port: int,
        on_transport: Callable[[FrameTransport], None],
        *,
        limits: ConnectionConfig,
        reuse_port: bool,
    ) -> Listener:
        """Listen on ``host:port`` and hand every inbound transport to ``on_transport``.

        Raises:
            ConnectError: The address cannot be listened on.
        """
        ...

    async def connect(
        self, host: str, port: int, *, timeout: float, limits: ConnectionConfig
    ) -> FrameTransport:
        """A transport connected to ``host:port``.

        Raises:
            ConnectError: Nobody accepts there.
            TransportTimeoutError: No answer within ``timeout``.
        """
        ...


class TCPNetwork:
    """The real network: TCP sockets (:mod:`p2ptrain.transport.tcp`)."""

    async def listen(
        self,
        host: str,
        port: int,
        on_transport: Callable[[FrameTransport], None],
        *,
        limits: ConnectionConfig,
        reuse_port: bool,
    ) -> Listener:
        return await tcp_listen(
            host,
            port,
            on_transport,
            max_frame_bytes=limits.max_frame_bytes,
            max_header_bytes=limits.max_header_bytes,
            write_high_water=limits.write_high_water,
            reuse_port=reuse_port,
            max_handshake_frame_bytes=limits.max_handshake_frame_bytes,
            pace_target_s=limits.pace_target_s,
        )

    async def connect(
        self, host: str, port: int, *, timeout: float, limits: ConnectionConfig
    ) -> TCPTransport:
        return await tcp_connect(
            host,
            port,
            timeout=timeout,
            max_frame_bytes=limits.max_frame_bytes,
            max_header_bytes=limits.max_header_bytes,
            write_high_water=limits.write_high_water,
            max_handshake_frame_bytes=limits.max_handshake_frame_bytes,
            pace_target_s=limits.pace_target_s,
        )
