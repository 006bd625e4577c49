"""A node: one identity, one listener, a pool of authenticated connections.

The pool keeps at most one connection per remote peer and reuses it for every
call; concurrent dials to the same peer share one attempt; a connection that
closes leaves the pool; idle ones close themselves (see
:class:`~p2ptrain.rpc.connection.Connection`). Inbound connections that fail
the handshake are logged once and dropped; they never disturb the others.

Dialing: :meth:`Node.connect` dials TCP (or the node's
:class:`~p2ptrain.node.network.Network`, e.g. a simulated one), unless a
:class:`~p2ptrain.node.router.Router` is installed (:meth:`Node.set_router`,
e.g. a NAT service): then every dial to a known PeerID goes through it, and
the router picks the path (a direct dial with :meth:`Node.connect_direct`, or
a traversal whose transport it hands to :meth:`Node.adopt`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from p2ptrain.aio import BackgroundTasks
from p2ptrain.errors import ConnectError, HandshakeError, RemoteProtocolError, TransportError
from p2ptrain.node.address import PeerAddress
from p2ptrain.node.config import NodeConfig
from p2ptrain.node.limits import InboundLimiter, RateLimitedLog
from p2ptrain.node.memory import keep_freed_memory, release_for_loop
from p2ptrain.node.network import Listener, Network, TCPNetwork
from p2ptrain.node.router import Router
from p2ptrain.rpc.budget import ByteBudget
from p2ptrain.rpc.connection import Connection
from p2ptrain.rpc.handlers import HandlerTable, Message
from p2ptrain.rpc.stream import RPCStream
from p2ptrain.secure.handshake import perform_handshake
from p2ptrain.secure.identity import Identity, PeerID
from p2ptrain.transport.base import FrameTransport
from p2ptrain.transport.tcp import TCPTransport
from p2ptrain.wire.frames import Buffer

__all__ = ["Node"]

logger = logging.getLogger(__name__)


class Node:
    """A peer: serves RPC handlers and calls other peers by address.

    Use as ``async with Node(identity=..., config=...) as node:``, or call
    :meth:`start` and :meth:`aclose` yourself.
    """

    def __init__(
        self,
        *,
        identity: Identity | None = None,
        config: NodeConfig | None = None,
        handlers: HandlerTable | None = None,
        network: Network | None = None,
    ) -> None:
        self.identity = identity or Identity.generate()
        self.network: Network = network or TCPNetwork()
        self.config = config or NodeConfig()
        self.handlers = handlers or HandlerTable()
        self._listener: Listener | None = None
        self._by_peer: dict[PeerID, Connection] = {}
        self._all: set[Connection] = set()
        self._dials: dict[str, asyncio.Task[Connection]] = {}
        self._tasks = BackgroundTasks(f"node {self.identity.peer_id.short}")
        """Dials, accepts, idle closes and the memory release loop."""
        self._closing = False
        self._sweep_pending = False
        """A later pass of :meth:`_close_idle` is scheduled (the pool stayed full)."""
        self._router: Router | None = None
        self._closed_traffic: dict[str, tuple[int, int]] = {}
        self.inbound = InboundLimiter(
            max_total=self.config.max_inbound,
            max_per_source=self.config.max_inbound_per_source,
        )
        limits = self.config.connection
        self.reply_budget = ByteBudget(limits.max_reply_bytes_in_flight)
        self.unread_budget = ByteBudget(limits.max_node_buffered_bytes)
        """Unread received bytes over every connection (``max_node_buffered_bytes``)."""
        self.stream_budget = ByteBudget(limits.max_node_streams)
        """Streams peers hold open over every connection (``max_node_streams``)."""
        self._log = RateLimitedLog(logger)

    @property
    def peer_id(self) -> PeerID:
        """This node's PeerID."""
        return self.identity.peer_id

    @property
    def address(self) -> PeerAddress:
        """The address other peers dial to reach this node."""
        if self._listener is None:
            raise RuntimeError("the node is not started")
        host = self.config.announce_host or self.config.host
        return PeerAddress(host, self._listener.port, self.peer_id)

    @property
    def listening(self) -> bool:
        """Whether :meth:`start` opened the listener."""
        return self._listener is not None

    @property
    def shares_port(self) -> bool:
        """Whether the listener is open with ``SO_REUSEPORT`` (``NodeConfig.reuse_port``).

        Outgoing connections can then be opened from the listening port
        (TCP hole punching needs that).
        """
        return self._listener is not None and self.config.reuse_port

    @property
    def router(self) -> Router | None:
        """The router dials go through, or None (plain TCP)."""
        return self._router

    def set_router(self, router: Router | None) -> None:
        """Send every later dial to a known PeerID through ``router`` (None: plain TCP).

        Connections already pooled stay; dials in progress finish their way.
        """
        self._router = router

    async def start(self) -> None:
        """Start listening."""
        self._listener = await self.network.listen(
            self.config.host,
            self.config.port,
            self._on_inbound,
            limits=self.config.connection,
            reuse_port=self.config.reuse_port,
        )
        logger.info("node %s listening on %s", self.peer_id.short, self.address.endpoint)
        if self.config.memory_release_interval > 0:
            if self.config.keep_freed_bytes:
                keep_freed_memory(self.config.keep_freed_bytes)  # the passes return it
            self._tasks.spawn(self._release_memory_loop(), name="node-memory")
        if self.config.insecure_plaintext:
            logger.warning(
                "insecure plaintext: frames after the handshake are neither encrypted nor"
                " authenticated; use this only inside a network you trust"
            )

    async def __aenter__(self) -> Node:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- connections -------------------------------------------------------------------

    def connections(self) -> list[Connection]:
        """The live connections of the pool."""
        return [c for c in self._by_peer.values() if not c.closed]

    def traffic_by_path(self) -> dict[str, tuple[int, int]]:
        """Bytes (sent, received) per transport path since the start, closed connections too."""
        totals = dict(self._closed_traffic)
        for conn in self._all:
            sent, received = totals.get(conn.path, (0, 0))
            stats = conn.transport.stats
            totals[conn.path] = (sent + stats.bytes_sent, received + stats.bytes_received)
        return totals

    def connection_to(self, peer_id: PeerID) -> Connection | None:
        """The live pooled connection to ``peer_id``, if any."""
        conn = self._by_peer.get(peer_id)
        return conn if conn is not None and not conn.closed and not conn.going_away else None

    async def connect(self, target: PeerAddress | str) -> Connection:
        """The pooled connection to ``target``, dialing it if needed.

        With a router installed (:meth:`set_router`) and a PeerID in the
        address, the router makes the connection (see
        :class:`~p2ptrain.node.router.Router`); otherwise this is
        :meth:`connect_direct`.
        """
        address = PeerAddress.parse(target) if isinstance(target, str) else target
        router = self._router
        if router is None or address.peer_id is None:
            return await self.connect_direct(address)
        return await self._pooled_or_dial(address, "", lambda: router.route(address))

    async def connect_direct(self, target: PeerAddress | str) -> Connection:
        """The pooled connection to ``target``, dialing its address over TCP if needed.

        Never asks the router: routers dial with this.
        """
        address = PeerAddress.parse(target) if isinstance(target, str) else target
        return await self._pooled_or_dial(address, "tcp:", lambda: self._dial(address))

    async def _pooled_or_dial(
        self,
        address: PeerAddress,
        prefix: str,
        dial: Callable[[], Coroutine[Any, Any, Connection]],
    ) -> Connection:
        if address.peer_id is not None:
            existing = self.connection_to(address.peer_id)
            if existing is not None:
                return existing
        key = prefix + (str(address.peer_id) if address.peer_id is not None else address.endpoint)
        task = self._dials.get(key)
        if task is None:
            if self._closing:
                raise ConnectError(f"node {self.peer_id.short} is closed")
            # Shared: every waiter may be cancelled, and a failed dial is then
            # not reported as "exception never retrieved".
            task = self._tasks.share(dial(), name=f"dial:{key}")
            self._dials[key] = task
            task.add_done_callback(lambda _t: self._dials.pop(key, None))
        return await asyncio.shield(task)

    async def call(
        self,
        target: PeerAddress | str,
        method: str,
        body: Any = None,
        payload: Buffer = b"",
        *,
        timeout: float | None = None,
    ) -> Message:
        """Unary call to ``method`` on ``target`` (see Connection.call)."""
        conn = await self.connect(target)
        return await conn.call(method, body, payload, timeout=timeout)

    async def open_stream(
        self, target: PeerAddress | str, method: str, *, timeout: float | None = None
    ) -> RPCStream:
        """Open a stream to ``method`` on ``target``."""
        conn = await self.connect(target)
        return await conn.open_stream(method, timeout=timeout)

    async def probe(
        self, target: PeerAddress, method: str, body: Any = None, *, timeout: float
    ) -> Message:
        """Call ``method`` over a fresh direct connection to ``target``, then close it.

        Proves that the peer named in ``target`` answers at its address (the
        handshake checks the PeerID), which a pooled connection it opened to
        us does not: the DHT checks a caller's announced address this way.
        """
        if target.peer_id is None:
            raise ValueError("probe() needs the PeerID expected at the address")
        async with asyncio.timeout(timeout):
            conn = await self._dial(target)
            try:
                return await conn.call(method, body, timeout=timeout)
            finally:
                await conn.aclose()

    async def abort(self) -> None:
        """Stop at once, as a crash would: no goodbye, queued data dropped.

        For tests and simulations of peers that vanish.
        """
        for conn in list(self._all):
            conn.transport.close()
        await self.aclose()

    async def aclose(self) -> None:
        """Stop listening and close every connection."""
        self._closing = True
        if self._listener is not None:
            await self._listener.aclose()
        await self._tasks.aclose()
        await asyncio.gather(*(conn.aclose() for conn in list(self._all)), return_exceptions=True)
        self._by_peer.clear()
        self._all.clear()

    # -- internals ---------------------------------------------------------------------

    async def _dial(self, address: PeerAddress) -> Connection:
        transport = await self.network.connect(
            address.host,
            address.port,
            timeout=self.config.dial_timeout,
            limits=self.config.connection,
        )
        conn = await self._secure(transport, initiator=True, expected=address.peer_id)
        if address.peer_id is None:
            logger.warning(
                "trusting on first use: %s is peer %s (no PeerID was given to check it"
                " against; pin it with %s@%s)",
                address.endpoint,
                conn.remote_peer,
                conn.remote_peer,
                address.endpoint,
            )
        return conn

    def _on_inbound(self, transport: FrameTransport) -> None:
        if self._closing:
            transport.close()
            return
        self._tasks.spawn(self._accept(transport), name="accept")

    async def _accept(self, transport: FrameTransport) -> None:
        if isinstance(transport, TCPTransport):
            await transport.connected.wait()
        refusal = self.inbound.admit(transport)
        if refusal is not None:
            transport.close()
            self._log.log(
                logging.WARNING,
                "inbound-cap",
                "refused connection from %s: %s",
                transport.remote_address,
                refusal,
            )
            return
        try:
            await self._secure(transport, initiator=False, expected=None)
        except (HandshakeError, RemoteProtocolError, TransportError) as exc:
            self._log.log(
                logging.WARNING,
                "handshake",
                "refused connection from %s: %s",
                transport.remote_address,
                _capped(str(exc)),
            )

    async def _release_memory_loop(self) -> None:
        interval = self.config.memory_release_interval
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval)
            release_for_loop(loop, interval)  # one pass per loop, however many nodes

    async def adopt(
        self, transport: FrameTransport, *, initiator: bool, expected: PeerID | None = None
    ) -> Connection:
        """Authenticate a transport opened by other means and add it to the pool.

        For transports this node did not dial itself: a WebRTC data channel,
        a hole-punched TCP socket, a relayed circuit. The handshake runs end to
        end over it, so whoever carries the bytes cannot impersonate the peer.

        Raises:
            HandshakeError: the peer failed authentication or admission.
            TransportTimeoutError: the handshake did not finish in time.
        """
        return await self._secure(transport, initiator=initiator, expected=expected)

    async def _secure(
        self, transport: FrameTransport, *, initiator: bool, expected: PeerID | None
    ) -> Connection:
        """Run the handshake on a fresh transport and add the connection to the pool."""
        conn_config = self.config.connection
        secured = False
        try:
            result = await perform_handshake(
                transport,
                self.identity,
                initiator=initiator,
                swarm=self.config.swarm,
                stream_window=conn_config.stream_window,
                max_frame_bytes=conn_config.max_frame_bytes,
                policy=self.config.admission,
                expected_peer=expected,
                timeout=conn_config.handshake_timeout,
                insecure_plaintext=self.config.insecure_plaintext,
            )
            secured = True
        finally:
            if not secured:
                transport.close()
        conn = Connection(
            transport,
            result,
            initiator=initiator,
            handlers=self.handlers,
            config=conn_config,
            reply_budget=self.reply_budget,
            unread_budget=self.unread_budget,
            stream_budget=self.stream_budget,
        )
        self._adopt(conn)
        return conn

    def _adopt(self, conn: Connection) -> None:
        if conn.closed:  # the transport closed right after the handshake
            return
        self._all.add(conn)
        if self.connection_to(conn.remote_peer) is None:
            self._by_peer[conn.remote_peer] = conn
        conn.on_close(self._forget)
        logger.debug("connected to %s via %s", conn.remote_peer.short, conn.path)
        self._close_idle(keep=conn)

    def _close_idle(self, *, keep: Connection | None = None) -> None:
        """Above ``max_connections``, close the connections idle longest (LRU).

        Connections with open streams, or idle for less than ``min_idle_s``,
        are not closed; while they keep the pool above the bound, another
        pass runs once the next of them could qualify.
        """
        if len(self._all) <= self.config.max_connections:  # the open ones are among them
            return
        open_ = [c for c in self._all if not c.closed and not c.draining]
        excess = len(open_) - self.config.max_connections
        if excess <= 0:
            return
        now = asyncio.get_running_loop().time()
        idle = [
            c
            for c in open_
            if c is not keep
            and c.open_streams == 0
            and c.idle_since is not None
            and now - c.idle_since >= self.config.min_idle_s
        ]
        idle.sort(key=lambda c: c.idle_since or 0.0)
        for conn in idle[:excess]:
            logger.debug("closing idle connection to %s (pool full)", conn.remote_peer.short)
            if self._by_peer.get(conn.remote_peer) is conn:
                del self._by_peer[conn.remote_peer]
            # Gracefully: the remote may be opening a stream on it right now.
            conn.go_away(self.config.idle_close_grace_s)
        if len(idle) < excess:
            self._sweep_later([c for c in open_ if not c.draining], now)

    def _sweep_later(self, open_: list[Connection], now: float) -> None:
        """Pass again when the earliest-idle connection reaches ``min_idle_s``."""
        if self._sweep_pending or self._closing:
            return
        idle_since = [c.idle_since for c in open_ if c.idle_since is not None]
        # A busy pool (every stream open) is looked at again after min_idle_s.
        due = min(idle_since) - now if idle_since else 0.0
        delay = max(due + self.config.min_idle_s, _MIN_SWEEP_S)
        self._sweep_pending = True
        self._tasks.spawn(self._sweep_after(delay), name="node-pool-sweep")

    async def _sweep_after(self, delay: float) -> None:
        try:
            await asyncio.sleep(delay)
        finally:
            self._sweep_pending = False
        self._close_idle()

    def _forget(self, conn: Connection) -> None:
        if conn in self._all:
            sent, received = self._closed_traffic.get(conn.path, (0, 0))
            stats = conn.transport.stats
            self._closed_traffic[conn.path] = (
                sent + stats.bytes_sent,
                received + stats.bytes_received,
            )
        self._all.discard(conn)
        if self._by_peer.get(conn.remote_peer) is conn:
            del self._by_peer[conn.remote_peer]


_MAX_LOGGED_REASON = 300
_MIN_SWEEP_S = 0.1
"""Seconds at least between two passes over a full connection pool."""


def _capped(text: str) -> str:
    """A remote-influenced reason, cut to a length fit for one log line."""
    if len(text) <= _MAX_LOGGED_REASON:
        return text
    return f"{text[:_MAX_LOGGED_REASON]}… ({len(text)} characters)"
