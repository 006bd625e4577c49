"""Path selection: walk from the cheapest way to reach a peer to the last resort.

Theory of operation
-------------------
:func:`plan_paths` is pure: from what we know about ourselves
(:class:`LocalView`) and what the target published
(:class:`~p2ptrain.nat.records.PeerRecord`) it lists the attempts worth
making, cheapest first, and why the others are skipped:

=================  ===================================================  ==================
attempt            how                                                   connection path
=================  ===================================================  ==================
``tcp-direct``     dial an address the target published                  ``tcp-direct``
``tcp-reverse``    we are public: ask the target (through its            ``tcp-direct``
                   rendezvous point) to dial us
``tcp-holepunch``  simultaneous open between two easy NATs               ``tcp-holepunch``
                   (:mod:`p2ptrain.nat.holepunch`)
``webrtc``         ICE through the rendezvous point's signaling, with    ``webrtc-direct``,
                   TURN when configured                                  ``webrtc-turn``
``relay``          frames forwarded by a rendezvous point that relays    ``relay``
=================  ===================================================  ==================

:func:`traverse` runs them in order, each under its own deadline (ICE's is
``NATConfig.webrtc.connect_timeout``, far below aioice's own ~64 s), records
why each failed, logs it, and raises
:class:`~p2ptrain.errors.NATTraversalError` with ``attempts = {attempt:
reason}`` (skipped ones included) when none works. Attempts that cannot work
are skipped instead of timed out: hole punching and TURN-less ICE when either
side knows it is behind a symmetric NAT.

Crossing dials: when the target is dialing us at the same moment (its
circuit reached us, or it refused ours because it wins the tie-break of
:mod:`p2ptrain.nat.service`), :func:`traverse` stops walking and waits, for
what is left of the plan's deadlines, for the target's connection to land in
our pool; the :class:`Traversal` then says ``attempt == "crossing-dial"``.

The target's half of each attempt is in :mod:`p2ptrain.nat.service`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from p2ptrain.dht.api import DHT
from p2ptrain.errors import (
    ConnectError,
    HandshakeError,
    NATTraversalError,
    P2PTrainError,
    TransportTimeoutError,
)
from p2ptrain.nat.config import ATTEMPTS, NATConfig
from p2ptrain.nat.holepunch import port_pair_taken, punch_initiator
from p2ptrain.nat.records import NatKind, PeerRecord, RendezvousPoint, find_record
from p2ptrain.nat.relay import RelayTransport
from p2ptrain.nat.signaling import (
    Circuit,
    CircuitKind,
    CircuitSignaling,
    open_circuit,
    parse_endpoint,
)
from p2ptrain.node.address import PeerAddress
from p2ptrain.node.node import Node
from p2ptrain.rpc.connection import Connection
from p2ptrain.secure.identity import PeerID
from p2ptrain.transport.base import FrameTransport
from p2ptrain.transport.webrtc_config import IceServer, WebRTCConfig
from p2ptrain.transport.webrtc_connect import webrtc_connect

__all__ = [
    "ATTEMPTS",
    "CROSSING",
    "LocalState",
    "LocalView",
    "PlannedAttempt",
    "Traversal",
    "connect_peer",
    "open_webrtc",
    "plan_paths",
    "traverse",
    "webrtc_config_for",
]

logger = logging.getLogger(__name__)

_SLACK = 5.0  # seconds on top of an attempt's own deadlines (the handshake)

CROSSING = "crossing-dial"
"""``Traversal.attempt`` when the connection came from the target's own dial to us."""


@dataclass(frozen=True)
class LocalView:
    """What the dialing peer knows about itself.

    Attributes:
        public: It accepts connections.
        nat: Its NAT (see :data:`~p2ptrain.nat.records.NatKind`).
        holepunch: Its listener shares its port (simultaneous open works).
        address: ``host:port`` others dial it at (public peers), for reversal.
        reverse: It serves ``nat.reversed``, so a target can dial it back.
    """

    public: bool = False
    nat: NatKind = "unknown"
    holepunch: bool = False
    address: str | None = None
    reverse: bool = False


class LocalState(Protocol):
    """The dialing peer's side of traversal (implemented by NATService)."""

    @property
    def view(self) -> LocalView:
        """What it knows about itself."""
        ...

    async def rendezvous_connection(
        self, address: PeerAddress, *, from_listen_port: bool
    ) -> Connection:
        """A connection to a rendezvous point (from the listening port if asked)."""
        ...

    def expect_reverse(self, peer: PeerID) -> asyncio.Future[Connection]:
        """A future that the connection ``peer`` dials back to us resolves."""
        ...

    def dialing_us(self, peer: PeerID) -> bool:
        """Whether a circuit ``peer`` opened to reach us is being served now."""
        ...

    async def await_peer(self, peer: PeerID, *, timeout: float) -> Connection:
        """The connection ``peer``'s own dial to us brings (we let it dial meanwhile).

        Raises:
            TransportTimeoutError: None came within ``timeout``.
            ConnectError: We cannot wait for one (no accepting side).
        """
        ...


@dataclass(frozen=True)
class PlannedAttempt:
    """One attempt of a plan: its name and deadline in seconds."""

    name: str
    timeout: float


def plan_paths(
    local: LocalView, target: PeerRecord, config: NATConfig
) -> tuple[list[PlannedAttempt], dict[str, str]]:
    """The attempts worth making, cheapest first, and why the others are skipped.

    Pure: no I/O. See the module docstring for the order.
    """
    plan: list[PlannedAttempt] = []
    skipped: dict[str, str] = {}
    points = target.rendezvous
    symmetric = "symmetric" in (local.nat, target.nat)

    if target.addresses:
        plan.append(PlannedAttempt("tcp-direct", config.direct_timeout))
    else:
        skipped["tcp-direct"] = "skipped: the target accepts no direct connections (behind NAT)"

    if not points:
        reason = "skipped: the target has no rendezvous point"
        for name in ("tcp-reverse", "tcp-holepunch", "webrtc", "relay"):
            skipped[name] = reason
        return plan, skipped

    if not (local.public and local.reverse and local.address):
        skipped["tcp-reverse"] = "skipped: we accept no connections ourselves"
    else:
        plan.append(PlannedAttempt("tcp-reverse", config.direct_timeout + config.signal_timeout))

    if not config.holepunch:
        skipped["tcp-holepunch"] = "skipped: disabled (NATConfig.holepunch)"
    elif local.public:
        skipped["tcp-holepunch"] = "skipped: we are public (the target dials us instead)"
    elif not (local.holepunch and target.holepunch):
        who = "our" if not local.holepunch else "the target's"
        skipped["tcp-holepunch"] = f"skipped: {who} listener cannot share its port"
    elif symmetric:
        skipped["tcp-holepunch"] = "skipped: a symmetric NAT maps each destination to a new port"
    else:
        timeout = config.holepunch_timeout + config.signal_timeout
        plan.append(PlannedAttempt("tcp-holepunch", timeout))

    if symmetric and not config.has_turn:
        skipped["webrtc"] = (
            "skipped: ICE cannot cross a symmetric NAT without a TURN server (none configured)"
        )
    else:
        timeout = config.signal_timeout + config.webrtc.connect_timeout + _SLACK
        plan.append(PlannedAttempt("webrtc", timeout))

    if not config.use_relays:
        skipped["relay"] = "skipped: disabled (NATConfig.use_relays)"
    elif not any(point.relay for point in points):
        skipped["relay"] = "skipped: no rendezvous point of the target relays"
    else:
        plan.append(PlannedAttempt("relay", config.relay_timeout + config.signal_timeout))
    for step in list(plan):
        if step.name not in config.attempts:
            plan.remove(step)
            skipped[step.name] = "skipped: not in NATConfig.attempts"
    order = {name: index for index, name in enumerate(ATTEMPTS)}
    return plan, dict(sorted(skipped.items(), key=lambda item: order[item[0]]))


def webrtc_config_for(config: NATConfig, stun: tuple[str, int] | None) -> WebRTCConfig:
    """The WebRTC config of one attempt: ours, plus ``stun`` when we have no STUN server."""
    if stun is None or config.has_stun:
        return config.webrtc
    servers = (IceServer(f"stun:{stun[0]}:{stun[1]}"), *config.webrtc.ice_servers)
    return dataclasses.replace(config.webrtc, ice_servers=servers)


async def open_webrtc(
    node: Node,
    channel: CircuitSignaling,
    config: NATConfig,
    stun: tuple[str, int] | None,
    *,
    initiator: bool,
) -> FrameTransport:
    """A WebRTC data-channel transport signalled over ``channel``, framed as ``node`` frames."""
    conn_config = node.config.connection
    return await webrtc_connect(
        channel,
        config=webrtc_config_for(config, stun),
        initiator=initiator,
        max_frame_bytes=conn_config.max_frame_bytes,
        max_header_bytes=conn_config.max_header_bytes,
    )


@dataclass(frozen=True)
class Traversal:
    """How a connection to a peer was made.

    Attributes:
        connection: The authenticated connection.
        attempt: The attempt that worked (``tcp-reverse`` gives a
            ``tcp-direct`` connection; ``webrtc`` one of the two WebRTC paths),
            ``pooled``, or ``crossing-dial``: the target dialed us at the same
            time and its connection is the one both sides keep.
        attempts: Why each cheaper attempt was skipped or failed (and, under
            ``crossing-dial``, why we waited for the target's own dial).
        seconds: Time from the start of the traversal to the connection.
    """

    connection: Connection
    attempt: str
    attempts: dict[str, str]
    seconds: float

    @property
    def crossing(self) -> bool:
        """The target dialed us at the same time and its connection is the one kept."""
        return self.attempt == CROSSING

    @property
    def path(self) -> str:
        """The connection's path (``tcp-direct``, ``tcp-holepunch``, ...)."""
        return self.connection.path


class _Stateless:
    """LocalState of a peer without a NATService: no reversal, no hole punching."""

    def __init__(self, node: Node) -> None:
        self._node = node
        self.view = LocalView()

    async def rendezvous_connection(
        self, address: PeerAddress, *, from_listen_port: bool
    ) -> Connection:
        return await self._node.connect_direct(address)

    def expect_reverse(self, peer: PeerID) -> asyncio.Future[Connection]:
        raise ConnectError("this peer cannot be dialed back")

    def dialing_us(self, peer: PeerID) -> bool:
        return False  # we serve no circuits

    async def await_peer(self, peer: PeerID, *, timeout: float) -> Connection:
        raise ConnectError("this peer does not accept circuits, so it cannot wait for one")


class _RendezvousFailedError(ConnectError):
    """The rendezvous point could not be reached or would not open the circuit."""


class _CrossingDialError(ConnectError):
    """The target is dialing us too, and its dial is the one to keep."""


@contextlib.contextmanager
def _crossing(channel: CircuitSignaling) -> Iterator[None]:
    """Turn a failure caused by a crossing-dial refusal into :class:`_CrossingDialError`."""
    try:
        yield
    except P2PTrainError as exc:
        if channel.crossed:
            raise _CrossingDialError("the target dials us too and wins the tie-break") from exc
        raise


class _Walker:
    """Runs the attempts of one traversal."""

    def __init__(
        self, node: Node, target: PeerID, record: PeerRecord, config: NATConfig, local: LocalState
    ) -> None:
        self.node = node
        self.target = target
        self.record = record
        self.config = config
        self.local = local

    async def run(self, name: str) -> Connection:
        runners: dict[str, Callable[[], Awaitable[Connection]]] = {
            "tcp-direct": self.direct,
            "tcp-reverse": lambda: self.through_rendezvous(self.reverse, relay_only=False),
            "tcp-holepunch": lambda: self.through_rendezvous(self.holepunch, relay_only=False),
            "webrtc": lambda: self.through_rendezvous(self.webrtc, relay_only=False),
            "relay": lambda: self.through_rendezvous(self.relay, relay_only=True),
        }
        return await runners[name]()

    async def direct(self) -> Connection:
        errors = []
        for text in self.record.addresses:
            try:
                address = PeerAddress.parse(text).with_peer(self.target)
                async with asyncio.timeout(self.config.direct_timeout):
                    return await self.node.connect_direct(address)
            except (P2PTrainError, TimeoutError) as exc:
                errors.append(f"{text}: {_reason(exc)}")
        raise ConnectError("; ".join(errors) or "no address")

    async def through_rendezvous(
        self,
        attempt: Callable[[RendezvousPoint], Awaitable[Connection]],
        *,
        relay_only: bool,
    ) -> Connection:
        errors = []
        for point in self.record.rendezvous:
            if relay_only and not point.relay:
                continue
            try:
                return await attempt(point)
            except _RendezvousFailedError as exc:
                # Only an unusable rendezvous point is worth another one; once the
                # target was reached, the path itself failed (or the handshake did).
                errors.append(f"via {point.peer_id.short}: {exc}")
        raise ConnectError("; ".join(errors) or "no rendezvous point")

    async def _circuit(
        self, point: RendezvousPoint, kind: CircuitKind, *, from_listen_port: bool
    ) -> Circuit:
        try:
            conn = await self.local.rendezvous_connection(
                point.peer_address, from_listen_port=from_listen_port
            )
            return await open_circuit(conn, self.target, kind, timeout=self.config.signal_timeout)
        except P2PTrainError as exc:
            raise _RendezvousFailedError(_reason(exc)) from exc

    async def _signal(
        self, point: RendezvousPoint, *, from_listen_port: bool
    ) -> tuple[CircuitSignaling, Circuit]:
        circuit = await self._circuit(point, "signal", from_listen_port=from_listen_port)
        return CircuitSignaling(circuit.stream), circuit

    async def reverse(self, point: RendezvousPoint) -> Connection:
        waiter = self.local.expect_reverse(self.target)
        try:
            channel, circuit = await self._signal(point, from_listen_port=False)
            async with _closing(circuit):
                await channel.send(
                    {"type": "path", "path": "reverse", "addr": self.local.view.address}
                )
                # The target answers "done" once its call on the new connection
                # returned, so the waiter is resolved by then; an error comes instead.
                timeout = self.config.direct_timeout + self.config.signal_timeout
                done = asyncio.ensure_future(channel.expect("done", timeout=timeout))
                try:
                    pending: list[asyncio.Future[Any]] = [waiter, done]
                    await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    if not waiter.done():
                        done.result()
                    return await waiter
                finally:
                    done.cancel()
        finally:
            waiter.cancel()

    async def holepunch(self, point: RendezvousPoint) -> Connection:
        channel, circuit = await self._signal(point, from_listen_port=True)
        async with _closing(circuit):
            target = parse_endpoint(circuit.peer_observed)
            if target is None:
                raise ConnectError("the rendezvous point does not know the target's address")
            await channel.send({"type": "path", "path": "punch"})
            try:
                with _crossing(channel):
                    return await punch_initiator(
                        self.node,
                        channel,
                        peer=self.target,
                        target=target,
                        timeout=self.config.holepunch_timeout,
                    )
            except ConnectError as exc:
                if port_pair_taken(exc):  # the target's punch to us holds the 4-tuple
                    raise _CrossingDialError(f"{exc} (the target is punching to us)") from exc
                raise

    async def webrtc(self, point: RendezvousPoint) -> Connection:
        channel, circuit = await self._signal(point, from_listen_port=False)
        async with _closing(circuit):
            await channel.send({"type": "path", "path": "webrtc"})
            address = point.peer_address
            stun = None if point.stun_port is None else (address.host, point.stun_port)
            with _crossing(channel):
                transport = await open_webrtc(self.node, channel, self.config, stun, initiator=True)
            # Keep the circuit until we are authenticated too: the target's half
            # (and its handshake) stops if the circuit is reset.
            return await self.node.adopt(transport, initiator=True, expected=self.target)

    async def relay(self, point: RendezvousPoint) -> Connection:
        circuit = await self._circuit(point, "relay", from_listen_port=False)
        conn_config = self.node.config.connection
        transport = RelayTransport(
            circuit.stream,
            relay=point.peer_id,
            max_frame_bytes=conn_config.max_frame_bytes,
            max_header_bytes=conn_config.max_header_bytes,
        )
        return await self.node.adopt(transport, initiator=True, expected=self.target)


@contextlib.asynccontextmanager
async def _closing(circuit: Circuit) -> AsyncIterator[Circuit]:
    """Close ``circuit`` on the way out: gracefully on success, abort on failure."""
    try:
        yield circuit
    except BaseException:
        await circuit.aclose(abort=True)
        raise
    await circuit.aclose()


def _reason(exc: BaseException) -> str:
    if isinstance(exc, NATTraversalError) and exc.attempts:
        return "; ".join(exc.attempts.values())
    if isinstance(exc, TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if isinstance(exc, HandshakeError) else str(exc)


async def traverse(
    node: Node,
    target: PeerID,
    *,
    dht: DHT,
    config: NATConfig,
    local: LocalState | None = None,
) -> Traversal:
    """Reach ``target``: look up its record, then walk the planned attempts.

    Args:
        node: Our node.
        target: Whom to reach.
        dht: Where the target's record is.
        config: Paths, deadlines, ICE servers.
        local: Our side's state (a NATService); without it we neither punch
            holes nor get dialed back.

    Raises:
        NATTraversalError: Every attempt failed or was skipped; ``attempts``
            says why, per attempt.
        HandshakeError: A path reached somebody who is not ``target``.
    """
    loop = asyncio.get_running_loop()
    started = loop.time()
    existing = node.connection_to(target)
    if existing is not None:
        return Traversal(existing, "pooled", {}, 0.0)
    state = local or _Stateless(node)
    try:
        record = await find_record(dht, target)
    except P2PTrainError as exc:
        raise NATTraversalError(f"cannot look up {target.short}", {"lookup": str(exc)}) from exc
    if record is None:
        raise NATTraversalError(
            f"{target.short} published no record", {"lookup": "no record in the DHT"}
        )
    plan, attempts = plan_paths(state.view, record, config)
    walker = _Walker(node, target, record, config, state)
    deadline = loop.time() + sum(step.timeout for step in plan)
    crossing: str | None = None
    for step in plan:
        if state.dialing_us(target) or node.connection_to(target) is not None:
            crossing = f"{target.short} is dialing us"  # its circuit got here first
            break
        step_started = loop.time()
        try:
            async with asyncio.timeout(step.timeout):
                conn = await walker.run(step.name)
        except _CrossingDialError as exc:
            attempts[step.name] = f"crossing dial: {exc}"
            crossing = str(exc)
            break
        except (P2PTrainError, TimeoutError) as exc:
            if isinstance(exc, HandshakeError):
                raise
            reason = _reason(exc)
            if isinstance(exc, TimeoutError):
                reason = f"timed out after {step.timeout:g} s"
            attempts[step.name] = reason
            logger.info(
                "%s -> %s: %s failed after %.2f s: %s",
                node.peer_id.short,
                target.short,
                step.name,
                loop.time() - step_started,
                reason,
            )
            continue
        elapsed = loop.time() - started
        logger.info(
            "%s -> %s: connected via %s in %.2f s (%s)",
            node.peer_id.short,
            target.short,
            conn.path,
            elapsed,
            "; ".join(f"{k}: {v}" for k, v in attempts.items()) or "first choice",
        )
        return Traversal(conn, step.name, attempts, elapsed)
    if crossing is None and (state.dialing_us(target) or node.connection_to(target) is not None):
        crossing = f"{target.short} is dialing us"  # the last attempt failed meanwhile
    if crossing is not None:
        joined = await _await_crossing(
            node, target, state=state, why=crossing, attempts=attempts, deadline=deadline
        )
        if joined is not None:
            return Traversal(joined, CROSSING, attempts, loop.time() - started)
    raise NATTraversalError(f"cannot reach {target.short}", attempts)


async def _await_crossing(
    node: Node,
    target: PeerID,
    *,
    state: LocalState,
    why: str,
    attempts: dict[str, str],
    deadline: float,
) -> Connection | None:
    """Wait for the crossing dial's connection; None (reason in ``attempts``) without one."""
    attempts[CROSSING] = why
    conn = node.connection_to(target)
    if conn is None:
        timeout = max(0.0, deadline - asyncio.get_running_loop().time())
        logger.info(
            "%s -> %s: crossing dial (%s); waiting up to %.1f s for its connection",
            node.peer_id.short,
            target.short,
            why,
            timeout,
        )
        try:
            conn = await state.await_peer(target, timeout=timeout)
        except TransportTimeoutError:
            attempts[CROSSING] = f"{why}; its connection did not come within {timeout:.1f} s"
            return None
        except ConnectError as exc:
            attempts[CROSSING] = f"{why}; {exc}"
            return None
    logger.info(
        "%s -> %s: connected via %s, the crossing dial's connection (%s)",
        node.peer_id.short,
        target.short,
        conn.path,
        why,
    )
    return conn


async def connect_peer(
    node: Node,
    target: PeerID,
    *,
    dht: DHT,
    config: NATConfig,
    local: LocalState | None = None,
) -> Connection:
    """The connection to ``target``, over the cheapest path that works (see :func:`traverse`)."""
    return (await traverse(node, target, dht=dht, config=config, local=local)).connection
