"""NATService: one peer's NAT traversal, both as a dialer and as a target.

::

    node = Node(identity=..., config=NodeConfig(host="0.0.0.0", port=31337))
    await start_node(node)                      # listener shares its port (hole punching)
    reach = await check_reachability(node, bootstrap, config=nat_config)
    dht = DHT(node=node, config=DHTNodeConfig(initial_peers=bootstrap,
                                              client_mode=not reach.public))
    await dht.start()
    async with NATService(node=node, dht=dht, config=nat_config, reachability=reach) as nat:
        conn = await nat.connect(other_peer_id)     # conn.path says how
        node.set_router(nat.router)                 # node.connect(address) traverses too

A **public** peer answers STUN (:class:`~p2ptrain.nat.stun.StunResponder`) and
dial-backs (:class:`~p2ptrain.nat.reachability.DialbackServer`), serves as a
rendezvous point (:class:`~p2ptrain.nat.signaling.RendezvousServer`), relays
if it opted in, and publishes its addresses. A **NATed** peer keeps
registrations at ``rendezvous_count`` public peers (replacing lost ones, from
its listening port when that port is shared) and publishes them. Both serve
``nat.accept`` (the target's half of every path, for circuits opened by a
rendezvous point it is registered with) and ``nat.reversed`` (a target dialing
back), and republish their record every ``republish_interval`` and whenever a
registration changes. Background work runs in one task owned by the service.

Crossing dials: two NATed peers that dial each other at the same moment (the
all-reduce's matchmaker does) would each run a traversal, and two hole
punches on the same 4-tuple collide. The peer with the smaller PeerID wins: a
``punch`` or ``webrtc`` circuit from a peer we are dialing ourselves is
refused as a crossing dial when our PeerID is smaller, and accepted when it
is larger. The loser's :func:`~p2ptrain.nat.paths.traverse` then waits
(:meth:`NATService.await_peer`) for the winner's connection to land in its
pool; so does a traversal that finds a circuit from its target already being
served (:meth:`NATService.dialing_us`), whichever order things happened in.
While a traversal waits it refuses nothing, so the two sides never wait for
each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

from p2ptrain.aio import BackgroundTasks
from p2ptrain.dht.api import DHT
from p2ptrain.errors import (
    ConnectError,
    HandshakeError,
    InvalidArgumentError,
    NATTraversalError,
    P2PTrainError,
    PermissionDeniedError,
    TransportTimeoutError,
)
from p2ptrain.nat.config import NATConfig
from p2ptrain.nat.holepunch import (
    dial_from_listen_port,
    punch_responder,
    reuses_port,
)
from p2ptrain.nat.paths import LocalView, Traversal, open_webrtc, traverse
from p2ptrain.nat.reachability import DialbackServer, Reachability, check_reachability
from p2ptrain.nat.records import PeerRecord, RendezvousPoint, publish_record
from p2ptrain.nat.relay import RelayTransport
from p2ptrain.nat.rendezvous import RendezvousServer
from p2ptrain.nat.router import NATRouter, routing_off
from p2ptrain.nat.signaling import (
    ACCEPT,
    AcceptHeader,
    CircuitSignaling,
    Registration,
    connection_of,
    parse_endpoint,
    read_accept_header,
    refuse,
    register,
)
from p2ptrain.nat.stats import TraversalStats
from p2ptrain.nat.stun import StunResponder, start_stun_responder
from p2ptrain.node.address import PeerAddress, is_unspecified_host
from p2ptrain.node.node import Node
from p2ptrain.rpc.connection import Connection
from p2ptrain.rpc.handlers import CallContext
from p2ptrain.rpc.stream import RPCStream
from p2ptrain.secure.identity import PeerID

__all__ = ["REVERSED", "NATService", "wins_crossing"]

logger = logging.getLogger(__name__)

REVERSED = "nat.reversed"
_RECHECK = 0.25  # seconds between looks at the pool while waiting for a crossing dial
_CROSSABLE = ("punch", "webrtc")  # paths that would make a second connection


def wins_crossing(us: PeerID, them: PeerID) -> bool:
    """Whether our dial is the one kept when ``us`` and ``them`` dial each other at once."""
    return us.digest < them.digest


class NATService:
    """NAT traversal for one peer. See the module docstring.

    Args:
        node: The started node.
        dht: The DHT the peer records live in (sharing ``node``).
        config: Traversal settings.
        reachability: What :func:`check_reachability` found; measured at
            :meth:`start` when omitted (or taken from ``config.public``).
    """

    def __init__(
        self,
        *,
        node: Node,
        dht: DHT,
        config: NATConfig,
        reachability: Reachability | None = None,
    ) -> None:
        self.node = node
        self.dht = dht
        self.config = config
        self.reachability = reachability
        self.stun: StunResponder | None = None
        self.stun_alt: StunResponder | None = None
        """A second responder on another port: with it one public peer is
        enough for a NATed peer to tell an easy NAT from a symmetric one."""
        self.rendezvous_server: RendezvousServer | None = None
        self._dialback: DialbackServer | None = None
        self._registrations: dict[PeerID, Registration] = {}
        self._punch_connections: dict[PeerID, Connection] = {}
        self._reverse_waiters: dict[PeerID, asyncio.Future[Connection]] = {}
        self._traversals: dict[PeerID, asyncio.Task[Traversal]] = {}
        self._inbound: dict[PeerID, int] = {}  # circuits from a peer being served
        self._yielding: dict[PeerID, int] = {}  # our traversals waiting for a peer's dial
        self._arrivals: dict[PeerID, asyncio.Future[None]] = {}
        self._changed = asyncio.Event()
        self._publish_failed = False
        self._tasks = BackgroundTasks(f"nat {node.peer_id.short}")
        """The maintenance loop, the registrations' watchers and the traversals."""
        self.stats = TraversalStats()
        """Counters of this peer's traversals (for metrics)."""
        self.refused = 0
        """Incoming connections refused because the handshake failed."""
        self.record_listeners: list[Callable[[PeerRecord], None]] = []
        """Called with every record published (tests wait on them)."""
        self.router = NATRouter(self)
        """Install with ``node.set_router(nat.router)`` so ``Node.connect`` traverses NATs."""

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Measure reachability if needed, serve, register, publish.

        Returns once the first registrations (NATed peers) are made and the
        record is published (or failed to be: then it is retried).
        """
        handlers = self.node.handlers
        handlers.add_stream(ACCEPT, self._on_accept, unbounded=True)  # may carry a circuit
        handlers.add_stream(REVERSED, self._on_reversed)
        try:
            if self.reachability is None:
                self.reachability = await self._measure()
            if self.reachability.public:
                await self._serve_public()
            else:
                await self._fill_registrations()
            await self._publish()
        except BaseException:
            await self.aclose()
            raise
        self._tasks.spawn(routing_off(self._maintain()), name="nat-service")

    async def aclose(self) -> None:
        """Stop serving and unregister (the node stays open, dialing plain TCP again)."""
        if self.node.router is self.router:
            self.node.set_router(None)
        await self._tasks.aclose()
        self._tasks = BackgroundTasks(self._tasks.owner)  # the service may start again
        handlers = self.node.handlers
        for method in (ACCEPT, REVERSED):
            handlers.remove(method)
        if self.rendezvous_server is not None:
            self.rendezvous_server.uninstall(handlers)
            self.rendezvous_server = None
        if self._dialback is not None:
            self._dialback.uninstall(handlers)
            self._dialback = None
        for registration in list(self._registrations.values()):
            await registration.aclose()
        self._registrations.clear()
        for responder in (self.stun, self.stun_alt):
            if responder is not None:
                await responder.aclose()
        self.stun = self.stun_alt = None

    async def __aenter__(self) -> NATService:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # -- dialing -----------------------------------------------------------------------------

    async def traverse(self, peer: PeerID, *, config: NATConfig | None = None) -> Traversal:
        """Reach ``peer`` over the cheapest path that works (see :func:`traverse`).

        Concurrent calls for one peer share one traversal (the first one's config).

        Args:
            peer: Whom to reach.
            config: Settings for this attempt (default: the service's).
        """
        task = self._traversals.get(peer)
        if task is None:
            task = self._tasks.share(
                routing_off(
                    traverse(
                        self.node, peer, dht=self.dht, config=config or self.config, local=self
                    )
                ),
                name=f"nat-traverse:{peer.short}",
            )
            self._traversals[peer] = task
            task.add_done_callback(lambda _: self._traversals.pop(peer, None))
            task.add_done_callback(self._count)
        return await asyncio.shield(task)

    def _count(self, task: asyncio.Task[Traversal]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            self.stats.record(task.result())
        elif isinstance(exc, NATTraversalError):
            self.stats.record_failure(exc.attempts)

    async def connect(self, peer: PeerID, *, config: NATConfig | None = None) -> Connection:
        """The connection to ``peer`` (see :meth:`traverse`)."""
        return (await self.traverse(peer, config=config)).connection

    @property
    def registrations(self) -> list[Registration]:
        """The standing registrations at rendezvous points."""
        return [r for r in self._registrations.values() if r.active]

    # LocalState ------------------------------------------------------------------------------

    @property
    def view(self) -> LocalView:
        """What this peer knows about itself (for path planning)."""
        reach = self.reachability or Reachability(False, "unknown")
        return LocalView(
            public=reach.public,
            nat=reach.nat,
            holepunch=reuses_port(self.node),
            address=self._public_endpoint() if reach.public else None,
            reverse=reach.public,
        )

    async def rendezvous_connection(
        self, address: PeerAddress, *, from_listen_port: bool
    ) -> Connection:
        """A connection to a rendezvous point, from our listening port if asked."""
        if not from_listen_port:
            return await self.node.connect_direct(address)
        peer = address.peer_id
        registration = self._registrations.get(peer) if peer is not None else None
        if registration is not None and registration.active:
            return registration.connection
        cached = self._punch_connections.get(peer) if peer is not None else None
        if cached is not None and not cached.closed:
            return cached
        conn = await dial_from_listen_port(
            self.node, address, timeout=self.node.config.dial_timeout
        )
        self._punch_connections[conn.remote_peer] = conn
        return conn

    def expect_reverse(self, peer: PeerID) -> asyncio.Future[Connection]:
        """A future resolved with the connection ``peer`` dials back to us."""
        old = self._reverse_waiters.get(peer)
        if old is not None and not old.done():
            raise ConnectError(f"already waiting for {peer.short} to dial back")
        waiter: asyncio.Future[Connection] = asyncio.get_running_loop().create_future()
        self._reverse_waiters[peer] = waiter

        def forget(_: asyncio.Future[Connection]) -> None:
            if self._reverse_waiters.get(peer) is waiter:
                del self._reverse_waiters[peer]

        waiter.add_done_callback(forget)
        return waiter

    def dialing_us(self, peer: PeerID) -> bool:
        """Whether a circuit ``peer`` opened to reach us is being served now."""
        return self._inbound.get(peer, 0) > 0

    async def await_peer(self, peer: PeerID, *, timeout: float) -> Connection:
        """The connection ``peer``'s own dial to us brings (a crossing dial).

        Meanwhile we accept every circuit from ``peer``.

        Raises:
            TransportTimeoutError: None came within ``timeout``.
        """
        loop = asyncio.get_running_loop()
        self._yielding[peer] = self._yielding.get(peer, 0) + 1
        try:
            async with asyncio.timeout(timeout):
                while (conn := self.node.connection_to(peer)) is None:
                    arrival = self._arrivals.get(peer)
                    if arrival is None or arrival.done():
                        arrival = self._arrivals[peer] = loop.create_future()
                    # Our accept side resolves it; the recheck catches connections
                    # that come otherwise (a public peer's plain TCP dial).
                    await asyncio.wait([arrival], timeout=_RECHECK)
                return conn
        except TimeoutError as exc:
            raise TransportTimeoutError(
                f"{peer.short}'s own connection did not come within {timeout:.1f} s"
            ) from exc
        finally:
            left = self._yielding[peer] - 1
            if left:
                self._yielding[peer] = left
            else:
                del self._yielding[peer]
                self._arrivals.pop(peer, None)

    # -- internals: our own side ---------------------------------------------------------------

    def _candidates(self) -> list[PeerAddress]:
        seen: set[PeerID] = set()
        found = []
        for address in [PeerAddress.parse(a) for a in self.config.rendezvous] + list(
            self.dht.known_peers()
        ):
            if address.peer_id is not None and address.peer_id not in seen:
                seen.add(address.peer_id)
                found.append(address)
        return found

    async def _measure(self) -> Reachability:
        if self.config.public is True:
            return Reachability(True, "public", notes=("configured public",))
        return await check_reachability(
            self.node,
            self._candidates(),
            config=self.config,
            dialback=self.config.public is None,
        )

    async def _serve_public(self) -> None:
        config = self.config
        handlers = self.node.handlers
        host = self.node.config.host
        if config.stun_port is not None:
            self.stun = await start_stun_responder(host, config.stun_port)
        else:
            try:
                self.stun = await start_stun_responder(host, self.node.address.port)
            except ConnectError as exc:  # the UDP port of that number is taken
                logger.warning("%s; answering STUN on another port", exc)
                self.stun = await start_stun_responder(host, 0)
        stun_port = self.stun.address[1]
        try:  # the next port number, so that operators know which to open
            self.stun_alt = await start_stun_responder(host, stun_port % 65535 + 1)
        except ConnectError as exc:
            logger.warning("%s; second STUN responder on another port", exc)
            self.stun_alt = await start_stun_responder(host, 0)
        self._dialback = DialbackServer(
            self.node,
            timeout=config.dialback_timeout,
            stun_port=stun_port,
            stun_alt_port=self.stun_alt.address[1],
        )
        self._dialback.install(handlers)
        if config.serve_rendezvous:
            self.rendezvous_server = RendezvousServer(config=config, stun_port=stun_port)
            self.rendezvous_server.install(handlers)

    def _public_endpoint(self) -> str | None:
        """Where others dial us: the announced host, else the address a dial-back saw."""
        address = self.node.address
        if not is_unspecified_host(address.host):
            return address.endpoint
        observed = parse_endpoint(self.reachability.observed if self.reachability else None)
        if observed is None:
            return None
        return PeerAddress(observed[0], address.port).endpoint

    def _record(self) -> PeerRecord:
        reach = self.reachability or Reachability(False, "unknown")
        if reach.public:
            endpoint = self._public_endpoint()
            return PeerRecord(
                nat="public",
                addresses=() if endpoint is None else (endpoint,),
                stun_port=self.stun.address[1] if self.stun is not None else None,
                relay=self.rendezvous_server is not None and self.config.relay,
            )
        points = tuple(
            RendezvousPoint(str(r.rendezvous), r.relay, r.stun_port) for r in self.registrations
        )
        return PeerRecord(
            nat=reach.nat,
            rendezvous=points,
            holepunch=reuses_port(self.node) and reach.nat != "symmetric",
        )

    async def _publish(self) -> None:
        record = self._record()
        try:
            await publish_record(self.dht, record, ttl=self.config.record_ttl)
        except P2PTrainError as exc:
            logger.warning(
                "could not publish the NAT record of %s: %s", self.node.peer_id.short, exc
            )
            self._publish_failed = True  # tried again after retry_interval
            return
        self._publish_failed = False
        for listener in self.record_listeners:
            listener(record)

    async def _fill_registrations(self) -> None:
        for address in self._candidates():
            if len(self.registrations) >= self.config.rendezvous_count:
                return
            peer = address.peer_id
            if peer is None or (peer in self._registrations and self._registrations[peer].active):
                continue
            try:
                async with asyncio.timeout(
                    self.node.config.dial_timeout + self.config.signal_timeout
                ):
                    if reuses_port(self.node):
                        conn = await dial_from_listen_port(
                            self.node, address, timeout=self.node.config.dial_timeout
                        )
                    else:
                        conn = await self.node.connect_direct(address)
                    registration = await register(conn, address, timeout=self.config.signal_timeout)
            except (P2PTrainError, TimeoutError) as exc:
                logger.info("cannot register at %s: %s", address, exc or "timed out")
                continue
            self._registrations[peer] = registration
            self._tasks.spawn(self._watch(registration), name=f"nat-registration:{peer.short}")
            logger.info(
                "%s registered at %s, seen at %s",
                self.node.peer_id.short,
                peer.short,
                registration.observed,
            )

    async def _watch(self, registration: Registration) -> None:
        reason = await registration.wait_lost()
        logger.info("registration at %s lost: %s", registration.peer.short, reason)
        if self._registrations.get(registration.peer) is registration:
            del self._registrations[registration.peer]
        self._changed.set()

    async def _maintain(self) -> None:
        loop = asyncio.get_running_loop()
        next_publish = loop.time() + self.config.republish_interval
        try:
            while True:
                wait = next_publish - loop.time()
                if self._missing_registrations() or self._publish_failed:
                    wait = min(wait, self.config.retry_interval)
                try:
                    async with asyncio.timeout(max(0.0, wait)):
                        await self._changed.wait()
                except TimeoutError:
                    pass
                self._changed.clear()
                if self._missing_registrations():
                    await self._fill_registrations()
                await self._publish()
                next_publish = loop.time() + self.config.republish_interval
        except Exception:  # the root of this task: log, never die silently
            logger.exception("the NAT service of %s failed", self.node.peer_id.short)

    def _missing_registrations(self) -> bool:
        reach = self.reachability
        if reach is None or reach.public:
            return False
        return len(self.registrations) < self.config.rendezvous_count

    # -- internals: the target's half of every path -------------------------------------------

    async def _on_reversed(self, ctx: CallContext, stream: RPCStream) -> None:
        await stream.recv()
        waiter = self._reverse_waiters.get(ctx.peer)
        if waiter is None or waiter.done():
            raise PermissionDeniedError("nobody asked you to dial back")
        waiter.set_result(connection_of(stream))
        await stream.send({}, end=True)

    async def _on_accept(self, ctx: CallContext, stream: RPCStream) -> None:
        registration = self._registrations.get(ctx.peer)
        if registration is None or not registration.active:
            raise PermissionDeniedError("we are not registered with you")
        header = await read_accept_header(stream, ctx.peer)
        try:
            if header.kind == "relay":
                await self._accept_relay(registration, header, stream)
            else:
                await self._accept_signal(registration, header, stream)
        except HandshakeError as exc:
            self._refuse_connection(header, exc)
        except P2PTrainError as exc:
            logger.info(
                "incoming %s circuit from %s via %s failed: %s",
                header.kind,
                header.peer.short,
                ctx.peer.short,
                exc,
            )
            raise

    def _refuse_connection(self, header: AcceptHeader, exc: HandshakeError) -> None:
        self.refused += 1
        logger.warning(
            "refused a connection said to come from %s via %s: %s",
            header.peer.short,
            header.relay.short,
            exc,
        )

    def _refuses_crossing(self, peer: PeerID) -> bool:
        """Whether a circuit from ``peer`` crosses our own dial to it, which wins."""
        ours = self._traversals.get(peer)
        return (
            ours is not None
            and not ours.done()
            and peer not in self._yielding
            and wins_crossing(self.node.peer_id, peer)
        )

    @contextlib.contextmanager
    def _serving(self, peer: PeerID) -> Iterator[None]:
        """Count a circuit from ``peer`` as being served (see :meth:`dialing_us`)."""
        self._inbound[peer] = self._inbound.get(peer, 0) + 1
        try:
            yield
        finally:
            left = self._inbound[peer] - 1
            if left:
                self._inbound[peer] = left
            else:
                del self._inbound[peer]
            arrival = self._arrivals.pop(peer, None)
            if arrival is not None and not arrival.done():
                arrival.set_result(None)  # a waiter looks at the pool again

    async def _accept_relay(
        self, registration: Registration, header: AcceptHeader, stream: RPCStream
    ) -> None:
        conn_config = self.node.config.connection
        transport = RelayTransport(
            stream,
            relay=registration.peer,
            max_frame_bytes=conn_config.max_frame_bytes,
            max_header_bytes=conn_config.max_header_bytes,
        )
        try:
            with self._serving(header.peer):
                await self.node.adopt(transport, initiator=False, expected=header.peer)
        except HandshakeError as exc:
            self._refuse_connection(header, exc)
        finally:
            # The stream is the connection: serve it until both ends are done
            # (after a refusal, until the REFUSE frame has left).
            await transport.wait_done()

    async def _accept_signal(
        self, registration: Registration, header: AcceptHeader, stream: RPCStream
    ) -> None:
        channel = CircuitSignaling(stream)
        first = await channel.expect("path", timeout=self.config.signal_timeout)
        path = first.get("path")
        if path in _CROSSABLE and self._refuses_crossing(header.peer):
            logger.info(
                "%s <- %s: crossing dial (%s); we dial it ourselves and win (smaller PeerID)",
                self.node.peer_id.short,
                header.peer.short,
                path,
            )
            await refuse(channel, "crossing dial: the target dials you and wins", crossing=True)
            return
        with self._serving(header.peer):
            await self._serve_path(registration, header, channel, first)

    async def _serve_path(
        self,
        registration: Registration,
        header: AcceptHeader,
        channel: CircuitSignaling,
        first: dict[str, Any],
    ) -> None:
        path = first.get("path")
        caller = parse_endpoint(header.observed)
        if path == "webrtc":
            rendezvous = registration.rendezvous
            stun = None
            if registration.stun_port is not None:
                stun = (rendezvous.host, registration.stun_port)
            transport = await open_webrtc(self.node, channel, self.config, stun, initiator=False)
            await self.node.adopt(transport, initiator=False, expected=header.peer)
        elif path == "punch":
            if caller is None or not reuses_port(self.node):
                await refuse(channel, "the target cannot punch (no shared port or no address)")
                return
            await punch_responder(
                self.node,
                channel,
                peer=header.peer,
                target=caller,
                timeout=self.config.holepunch_timeout,
            )
        elif path == "reverse":
            await self._dial_back(channel, header, first.get("addr"), caller)
        else:
            await refuse(channel, f"unknown path {path!r}")
            raise InvalidArgumentError(f"unknown path {path!r}")

    async def _dial_back(
        self,
        channel: CircuitSignaling,
        header: AcceptHeader,
        claimed: object,
        caller: tuple[str, int] | None,
    ) -> None:
        endpoint = parse_endpoint(claimed)
        if endpoint is None or caller is None or endpoint[0] != caller[0]:
            # Dial only where the caller's own connection comes from: no third parties.
            await refuse(channel, "the address to dial back is not where the call comes from")
            return
        address = PeerAddress(endpoint[0], endpoint[1], header.peer)
        try:
            async with asyncio.timeout(self.config.direct_timeout + self.config.signal_timeout):
                conn = await self.node.connect_direct(address)
                await conn.call(REVERSED, {}, timeout=self.config.signal_timeout)
        except (P2PTrainError, TimeoutError) as exc:
            await refuse(channel, f"cannot dial back: {exc or 'timed out'}")
            return
        await channel.send({"type": "done"})
