"""Rendezvous through a public peer: the protocol, and the NATed and dialing sides.

The rendezvous point's side is :mod:`p2ptrain.nat.rendezvous`.

Theory of operation
-------------------
A NATed peer cannot be dialed, but it can keep a connection open to a public
peer, its *rendezvous point*, and publish that peer in the DHT
(:mod:`p2ptrain.nat.records`). To reach it, another peer asks the rendezvous
point to open a *circuit*: two RPC streams, one on each side's connection to
the rendezvous point, whose messages the rendezvous point copies across.
:class:`~p2ptrain.rpc.connection.Connection` calls work in both directions, so
the rendezvous point calls back into the NATed peer over the connection that
peer opened. Three stream methods (bodies are msgpack maps)::

    nat.register   NATed peer T -> rendezvous R, held open as long as T stays registered
        T -> R  {"v": 1}
        R -> T  {"o": "ip:port" where R sees T's connection come from,
                 "s": R's STUN port or nil, "r": whether R relays}

    nat.connect    dialer D -> R, one per attempt
        D -> R  {"t": T's PeerID (32 bytes), "k": "signal" | "relay"}
        R opens nat.accept on T's registration connection:
        R -> T  {"f": D's PeerID, "o": "ip:port" of D's connection to R, "k": kind}
        R -> D  {"o": "ip:port" of T's registration, "y": "ip:port" of D's connection}
        then every message either side sends reaches the other (END and RESET too)

PeerIDs are the authenticated ones of R's connections, so nobody can register
or dial under another's name through an honest R. A dishonest R could lie about
``f``; that is harmless because the identity handshake then runs end to end
over whatever path the circuit sets up, with both sides expecting the PeerID
they were told, and fails (see docs/nat-traversal.md).

Circuit messages carry only a raw payload (no body). On a ``signal`` circuit
each one is a JSON object of at most
:data:`~p2ptrain.transport.webrtc_signaling.MAX_SIGNAL_BYTES` bytes, at most
``max_signal_messages`` per direction, and the circuit closes after
``signal_circuit_seconds``: :class:`CircuitSignaling` is the
:class:`~p2ptrain.transport.webrtc_signaling.SignalingChannel` over it. A
``relay`` circuit carries frame bytes for a
:class:`~p2ptrain.nat.relay.RelayTransport`, bounded by a
:class:`~p2ptrain.nat.relay.CircuitBudget`; only peers that opted in relay.

Refusals are RPC errors: ``unavailable`` (target not registered here),
``permission_denied`` (not serving, relaying off, or ``nat.accept`` from a
peer we are not registered with), ``resource_exhausted`` (full, over a limit),
``invalid_argument`` (malformed messages). Once a signal circuit is open,
either end gives up with ``{"type": "error", "reason": ...}``; a target that
is dialing the caller at the same moment and wins the tie-break adds
``"crossing": true`` (see :mod:`p2ptrain.nat.service`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
from dataclasses import dataclass
from typing import Any, Literal

from p2ptrain.errors import (
    ConnectError,
    ConnectionClosedError,
    InvalidArgumentError,
    LocalProtocolError,
    P2PTrainError,
    RemoteProtocolError,
    RPCError,
    StreamEndedError,
    TransportTimeoutError,
)
from p2ptrain.node.address import PeerAddress
from p2ptrain.rpc.connection import Connection
from p2ptrain.rpc.stream import RPCStream
from p2ptrain.secure.identity import PeerID
from p2ptrain.transport.webrtc_signaling import MAX_SIGNAL_BYTES

__all__ = [
    "ACCEPT",
    "CONNECT",
    "KINDS",
    "REGISTER",
    "VERSION",
    "AcceptHeader",
    "Circuit",
    "CircuitKind",
    "CircuitSignaling",
    "Registration",
    "connection_of",
    "first_message",
    "observed_address",
    "open_circuit",
    "parse_endpoint",
    "peer_id_field",
    "read_accept_header",
    "refuse",
    "register",
]

logger = logging.getLogger(__name__)

REGISTER = "nat.register"
CONNECT = "nat.connect"
ACCEPT = "nat.accept"
VERSION = 1

CircuitKind = Literal["signal", "relay"]
KINDS: tuple[str, ...] = ("signal", "relay")
_MAX_ADDRESS = 64


# -- helpers shared by both ends ---------------------------------------------------------------


def connection_of(stream: RPCStream) -> Connection:
    """The connection a stream belongs to (a handler learns the caller's address from it)."""
    return stream.connection


def observed_address(conn: Connection) -> str | None:
    """``ip:port`` the connection comes from, as this end sees it (TCP only)."""
    host, sep, port = conn.transport.remote_address.rpartition(":")
    if not sep or not port.isdigit():
        return None
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    return f"{host}:{port}"


def parse_endpoint(text: object) -> tuple[str, int] | None:
    """``(ip, port)`` from an ``ip:port`` string, or None when it is not one."""
    if not isinstance(text, str) or len(text) > _MAX_ADDRESS:
        return None
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    return host.strip("[]"), int(port)


def peer_id_field(value: object, what: str) -> PeerID:
    """A PeerID field of a request (32 raw bytes).

    Raises:
        InvalidArgumentError: It is not one.
    """
    if not isinstance(value, bytes) or len(value) != 32:
        raise InvalidArgumentError(f"{what} must be a 32-byte PeerID")
    return PeerID(value)


def _optional_address(value: object, what: str) -> str | None:
    if value is None:
        return None
    if parse_endpoint(value) is None:
        raise RemoteProtocolError(f"{what} is not an ip:port address: {value!r}")
    return str(value)


async def first_message(stream: RPCStream, what: str) -> dict[str, Any]:
    """The header (first message, a map) of a stream.

    Raises:
        InvalidArgumentError: It is missing or not a map.
    """
    try:
        message = await stream.recv()
    except StreamEndedError as exc:
        raise InvalidArgumentError(f"{what}: the stream ended before its header") from exc
    if not isinstance(message.body, dict):
        raise InvalidArgumentError(f"{what}: the header must be a map")
    return message.body


# -- the NATed peer's and the dialer's side ---------------------------------------------------


@dataclass
class Registration:
    """A NATed peer's standing registration at one rendezvous point.

    Attributes:
        rendezvous: The rendezvous point's address (with its PeerID).
        connection: The connection the registration lives on.
        stream: The ``nat.register`` stream (held open).
        observed: ``ip:port`` where the rendezvous point sees us.
        stun_port: Its STUN responder's port, or None.
        relay: Whether it relays.
    """

    rendezvous: PeerAddress
    connection: Connection
    stream: RPCStream
    observed: str | None
    stun_port: int | None
    relay: bool

    @property
    def peer(self) -> PeerID:
        """The rendezvous point's PeerID."""
        if self.rendezvous.peer_id is None:
            raise RuntimeError("a registration always knows its rendezvous PeerID")
        return self.rendezvous.peer_id

    @property
    def active(self) -> bool:
        """Whether the registration still stands."""
        return not self.stream.finished and not self.connection.closed

    async def wait_lost(self) -> str:
        """Wait until the rendezvous point drops us; returns why."""
        try:
            async for _ in self.stream:
                pass
        except P2PTrainError as exc:
            return str(exc)
        return "the rendezvous point ended the registration"

    async def aclose(self) -> None:
        """Unregister."""
        if not self.stream.finished:
            self.stream.reset("cancelled", "unregistering")


async def register(conn: Connection, address: PeerAddress, *, timeout: float) -> Registration:
    """Register at the rendezvous point at the other end of ``conn``.

    Raises:
        RPCError: It refused (``method not found``: it is no rendezvous point).
        TransportTimeoutError: It did not answer within ``timeout``.
        RemoteProtocolError: It answered something malformed.
    """
    stream = await conn.open_stream(REGISTER)
    try:
        async with asyncio.timeout(timeout):
            await stream.send({"v": VERSION})
            reply = (await stream.recv()).body
    except TimeoutError as exc:
        stream.reset("cancelled", "no answer")
        raise TransportTimeoutError(f"{address} did not answer the registration") from exc
    except BaseException:
        stream.reset("cancelled", "registration failed")
        raise
    if not isinstance(reply, dict):
        stream.reset("invalid_argument", "malformed reply")
        raise RemoteProtocolError("a registration reply must be a map")
    stun = reply.get("s")
    if stun is not None and (
        not isinstance(stun, int) or isinstance(stun, bool) or not 0 < stun < 65536
    ):
        stream.reset("invalid_argument", "malformed reply")
        raise RemoteProtocolError(f"bad STUN port {stun!r} in a registration reply")
    return Registration(
        rendezvous=address.with_peer(conn.remote_peer),
        connection=conn,
        stream=stream,
        observed=_optional_address(reply.get("o"), "o"),
        stun_port=stun,
        relay=reply.get("r") is True,
    )


@dataclass
class Circuit:
    """One end of a circuit through a rendezvous point.

    Attributes:
        stream: The stream; its messages reach the peer.
        relay: The rendezvous point's PeerID.
        peer: The PeerID at the other end, as the rendezvous point says (the
            identity handshake over the path verifies it).
        peer_observed: ``ip:port`` where the rendezvous point sees the peer.
        own_observed: ``ip:port`` where it sees us.
    """

    stream: RPCStream
    relay: PeerID
    peer: PeerID
    peer_observed: str | None
    own_observed: str | None

    async def aclose(self, *, abort: bool = False) -> None:
        """Close our side of the circuit.

        Gracefully (the default) our side ends and the peer may finish what it
        is doing (say, the handshake over the path the circuit set up); with
        ``abort`` the circuit is reset and the peer's half is cancelled.
        """
        if self.stream.finished:
            return
        if abort:
            self.stream.reset("cancelled", "circuit abandoned")
            return
        with contextlib.suppress(P2PTrainError):  # already ended, or gone
            await self.stream.end()


async def open_circuit(
    conn: Connection, target: PeerID, kind: CircuitKind, *, timeout: float
) -> Circuit:
    """Ask the rendezvous point at the other end of ``conn`` for a circuit to ``target``.

    Raises:
        RPCError: Refused (``unavailable``: not registered there;
            ``permission_denied``: no relaying; ``resource_exhausted``).
        TransportTimeoutError: No answer within ``timeout``.
    """
    stream = await conn.open_stream(CONNECT)
    try:
        async with asyncio.timeout(timeout):
            await stream.send({"t": target.digest, "k": kind})
            reply = (await stream.recv()).body
        if not isinstance(reply, dict):
            raise RemoteProtocolError("a circuit reply must be a map")
        return Circuit(
            stream=stream,
            relay=conn.remote_peer,
            peer=target,
            peer_observed=_optional_address(reply.get("o"), "o"),
            own_observed=_optional_address(reply.get("y"), "y"),
        )
    except TimeoutError as exc:
        stream.reset("cancelled", "no answer")
        raise TransportTimeoutError(
            f"{conn.remote_peer.short} did not open a circuit in time"
        ) from exc
    except BaseException:
        stream.reset("cancelled", "circuit refused")
        raise


@dataclass(frozen=True)
class AcceptHeader:
    """What a rendezvous point says about an incoming circuit.

    Attributes:
        peer: Who it says is calling (verified later by the handshake).
        observed: ``ip:port`` of the caller's connection to the rendezvous point.
        kind: ``signal`` or ``relay``.
        relay: The rendezvous point that opened the circuit.
    """

    peer: PeerID
    observed: str | None
    kind: CircuitKind
    relay: PeerID


async def read_accept_header(stream: RPCStream, relay: PeerID) -> AcceptHeader:
    """Read and validate the header of a ``nat.accept`` stream.

    Raises:
        InvalidArgumentError: It is malformed.
    """
    header = await first_message(stream, ACCEPT)
    kind = header.get("k")
    if kind not in KINDS:
        raise InvalidArgumentError(f"unknown circuit kind {kind!r}")
    observed = header.get("o")
    if observed is not None and parse_endpoint(observed) is None:
        raise InvalidArgumentError(f"bad observed address {observed!r}")
    return AcceptHeader(peer_id_field(header.get("f"), "f"), observed, kind, relay)


class CircuitSignaling:
    """A :class:`~p2ptrain.transport.webrtc_signaling.SignalingChannel` over a circuit.

    Messages are JSON objects in the payload of circuit messages. Errors are
    translated into what ``webrtc_connect`` expects: the circuit ending or
    being reset is a :class:`~p2ptrain.errors.ConnectionClosedError`.
    """

    def __init__(self, stream: RPCStream) -> None:
        self._stream = stream
        self.crossed = False
        """The peer refused the circuit as a crossing dial (see :func:`refuse`)."""

    async def send(self, message: dict[str, Any]) -> None:
        try:
            data = json.dumps(message, separators=(",", ":")).encode("utf-8")
        except (TypeError, ValueError) as exc:
            raise LocalProtocolError(f"signaling message is not JSON: {exc}") from exc
        if len(data) > MAX_SIGNAL_BYTES:
            raise LocalProtocolError(f"a signaling message of {len(data)} bytes is too large")
        try:
            await self._stream.send(payload=data)
        except RPCError as exc:
            raise ConnectionClosedError(f"signaling circuit closed: {exc}") from exc

    async def recv(self) -> dict[str, Any]:
        try:
            message = await self._stream.recv()
        except StreamEndedError as exc:
            raise ConnectionClosedError("the signaling circuit ended") from exc
        except RPCError as exc:
            raise ConnectionClosedError(f"signaling circuit closed: {exc}") from exc
        data = bytes(message.payload)
        if message.body is not None or len(data) > MAX_SIGNAL_BYTES:
            raise RemoteProtocolError("a malformed signaling message")
        try:
            decoded = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise RemoteProtocolError(f"a signaling message is not JSON: {exc}") from exc
        if not isinstance(decoded, dict):
            raise RemoteProtocolError("a signaling message must be a JSON object")
        if decoded.get("type") == "error" and decoded.get("crossing") is True:
            self.crossed = True  # whoever reads it next (webrtc_connect too) fails as usual
        return decoded

    async def expect(self, kind: str, *, timeout: float) -> dict[str, Any]:
        """The next message, which must have ``type == kind``.

        Raises:
            ConnectError: The peer sent ``{"type": "error"}`` (its reason is kept).
            RemoteProtocolError: It sent another type.
            TransportTimeoutError: Nothing came within ``timeout``.
        """
        try:
            async with asyncio.timeout(timeout):
                message = await self.recv()
        except TimeoutError as exc:
            raise TransportTimeoutError(f"no {kind!r} message within {timeout:g} s") from exc
        if message.get("type") == "error":
            reason = message.get("reason")
            raise ConnectError(f"the peer gave up: {str(reason)[:300]}")
        if message.get("type") != kind:
            raise RemoteProtocolError(f"expected {kind!r}, got {message.get('type')!r}")
        return message


async def refuse(channel: CircuitSignaling, reason: str, *, crossing: bool = False) -> None:
    """Tell the other side of a signaling circuit why we give up (best effort).

    With ``crossing``, the refusal says we are dialing the caller ourselves and
    win the tie-break: the caller's :attr:`CircuitSignaling.crossed` is set and
    it waits for our connection instead of trying its next path.
    """
    message: dict[str, Any] = {"type": "error", "reason": reason}
    if crossing:
        message["crossing"] = True
    try:
        async with asyncio.timeout(1.0):
            await channel.send(message)
    except (P2PTrainError, TimeoutError):
        pass
