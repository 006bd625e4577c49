"""Reachability: can this peer accept connections, and what NAT is it behind?

Two measurements, combined by the pure :func:`classify`:

* **Dial-back** (TCP). A peer calls ``nat.dialback {"p": port}`` on a public
  peer; the public peer dials the *address it sees the call coming from*
  with the given port (never an address the caller names, so it cannot be
  used to scan third parties), runs the identity handshake expecting the
  caller's PeerID, hangs up, and answers ``{"ok": bool, "o": "ip:port" it
  sees, "e": why not, "s": its STUN port}``. One success means the peer is
  public.
* **STUN** (UDP). From one socket, Binding requests to two or more servers
  (public peers' responders, see :mod:`p2ptrain.nat.stun`, or configured
  ones). The same mapping from every server means an endpoint-independent
  ("easy") NAT, where hole punching works; different mappings mean a
  symmetric NAT, which needs TURN or a relay.

Exception-free shell functions turn failures into ``reason`` strings, so that
reachability is always decided (``unknown`` at worst) and logged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from p2ptrain.errors import (
    HandshakeError,
    InvalidArgumentError,
    P2PTrainError,
    RemoteProtocolError,
    TransportTimeoutError,
)
from p2ptrain.nat.config import NATConfig
from p2ptrain.nat.records import NatKind
from p2ptrain.nat.signaling import connection_of, observed_address, parse_endpoint
from p2ptrain.nat.stun import stun_query
from p2ptrain.node.address import PeerAddress
from p2ptrain.node.node import Node
from p2ptrain.rpc.connection import Connection
from p2ptrain.rpc.handlers import CallContext, HandlerTable
from p2ptrain.rpc.stream import RPCStream
from p2ptrain.secure.handshake import perform_handshake
from p2ptrain.transport.tcp import tcp_connect

__all__ = [
    "DIALBACK",
    "DialbackOutcome",
    "DialbackServer",
    "Reachability",
    "check_reachability",
    "classify",
    "request_dialback",
]

logger = logging.getLogger(__name__)

DIALBACK = "nat.dialback"
_MAX_DIALBACKS = 8  # probes one public peer runs at once
_MAX_SERVERS = 3


@dataclass(frozen=True)
class DialbackOutcome:
    """What one public peer found when it dialed us back.

    Attributes:
        server: Who answered (its address).
        reachable: The dial-back connected and authenticated us.
        observed: ``ip:port`` the server saw our call come from.
        stun: The server's STUN responder (host, port), if it runs one.
        reason: Why not, when not reachable.
        stun_alt: Its second STUN responder (same host, another port), if it
            runs one: two answers from one server tell an easy NAT from a
            symmetric one, so a single public peer is enough to know.
    """

    server: str
    reachable: bool
    observed: str | None = None
    stun: tuple[str, int] | None = None
    reason: str = ""
    stun_alt: tuple[str, int] | None = None


@dataclass(frozen=True)
class Reachability:
    """What a peer knows about its own reachability.

    Attributes:
        public: Others can dial it.
        nat: See :data:`~p2ptrain.nat.records.NatKind`.
        observed: ``ip:port`` public peers see it at (TCP), if any answered.
        mapped: UDP mappings (``ip:port``) the STUN servers saw, in order.
        notes: What was measured and what failed, for logs.
    """

    public: bool
    nat: NatKind
    observed: str | None = None
    mapped: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


def classify(
    dialbacks: Sequence[DialbackOutcome],
    mappings: Sequence[tuple[str, tuple[str, int] | None]],
) -> Reachability:
    """Decide reachability from dial-back outcomes and STUN mappings.

    Args:
        dialbacks: One outcome per public peer asked.
        mappings: ``(server, mapping or None)`` for one UDP socket.

    Returns:
        ``public`` if any dial-back succeeded; else ``easy`` when at least two
        servers saw the same mapping, ``symmetric`` when they saw different
        ones, ``unknown`` with fewer than two answers.
    """
    notes = [
        f"dial-back by {d.server}: " + ("reachable" if d.reachable else d.reason) for d in dialbacks
    ]
    notes += [
        f"STUN {server}: " + (f"{m[0]}:{m[1]}" if m else "no answer") for server, m in mappings
    ]
    observed = next((d.observed for d in dialbacks if d.observed), None)
    answers = [m for _, m in mappings if m is not None]
    mapped = tuple(f"{host}:{port}" for host, port in answers)
    if any(d.reachable for d in dialbacks):
        return Reachability(True, "public", observed, mapped, tuple(notes))
    nat: NatKind = "unknown"
    if len(answers) >= 2:
        nat = "easy" if len(set(answers)) == 1 else "symmetric"
    return Reachability(False, nat, observed, mapped, tuple(notes))


# -- the public peer's side ---------------------------------------------------------------------


class DialbackServer:
    """Serves ``nat.dialback`` on a public peer.

    Args:
        node: The node whose identity the dial-back proves itself with.
        timeout: Seconds to connect and authenticate.
        stun_port: This peer's STUN responder port, told to callers.
        stun_alt_port: Its second STUN responder's port, told to callers too.
    """

    def __init__(
        self,
        node: Node,
        *,
        timeout: float,
        stun_port: int | None,
        stun_alt_port: int | None = None,
    ) -> None:
        self._node = node
        self._timeout = timeout
        self._stun_port = stun_port
        self._stun_alt_port = stun_alt_port
        self._slots = asyncio.Semaphore(_MAX_DIALBACKS)

    def install(self, handlers: HandlerTable) -> None:
        """Serve ``nat.dialback``."""
        handlers.add_stream(DIALBACK, self._on_dialback)

    def uninstall(self, handlers: HandlerTable) -> None:
        """Stop serving."""
        handlers.remove(DIALBACK)

    async def _on_dialback(self, ctx: CallContext, stream: RPCStream) -> None:
        request = (await stream.recv()).body
        port = request.get("p") if isinstance(request, dict) else None
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise InvalidArgumentError("nat.dialback needs {'p': port}")
        observed = observed_address(connection_of(stream))
        endpoint = parse_endpoint(observed)
        reply: dict[str, object] = {
            "ok": False,
            "o": observed,
            "s": self._stun_port,
            "s2": self._stun_alt_port,
        }
        if endpoint is None:
            reply["e"] = "the call did not come over TCP; nothing to dial back"
        else:
            async with self._slots:
                reason = await self._probe(endpoint[0], port, ctx)
            reply["ok"] = reason is None
            if reason is not None:
                reply["e"] = reason
        await stream.send(reply, end=True)

    async def _probe(self, host: str, port: int, ctx: CallContext) -> str | None:
        conn_config = self._node.config.connection
        try:
            transport = await tcp_connect(
                host,
                port,
                timeout=self._timeout,
                max_frame_bytes=conn_config.max_frame_bytes,
                max_header_bytes=conn_config.max_header_bytes,
                write_high_water=conn_config.write_high_water,
            )
        except P2PTrainError as exc:
            return str(exc)
        try:
            await perform_handshake(
                transport,
                self._node.identity,
                initiator=True,
                swarm=self._node.config.swarm,
                stream_window=conn_config.stream_window,
                max_frame_bytes=conn_config.max_frame_bytes,
                policy=self._node.config.admission,
                expected_peer=ctx.peer,
                timeout=self._timeout,
                insecure_plaintext=self._node.config.insecure_plaintext,
            )
        except (HandshakeError, RemoteProtocolError, TransportTimeoutError) as exc:
            return f"{host}:{port} answered but is not the caller: {exc}"
        except P2PTrainError as exc:
            return str(exc)
        finally:
            transport.close()
        return None


# -- the asking peer's side -------------------------------------------------------------------


async def request_dialback(conn: Connection, port: int, *, timeout: float) -> DialbackOutcome:
    """Ask the public peer at the other end of ``conn`` to dial us back at ``port``.

    Never raises for a network failure: the outcome says what happened.
    """
    server = str(conn.remote_peer.short)
    try:
        async with asyncio.timeout(timeout):
            async with await conn.open_stream(DIALBACK) as stream:
                await stream.send({"p": port}, end=True)
                reply = (await stream.recv()).body
    except TimeoutError:
        return DialbackOutcome(server, False, reason="no answer in time")
    except P2PTrainError as exc:
        return DialbackOutcome(server, False, reason=str(exc))
    if not isinstance(reply, dict):
        return DialbackOutcome(server, False, reason="a malformed answer")
    observed = reply.get("o") if parse_endpoint(reply.get("o")) else None
    endpoint = parse_endpoint(conn.transport.remote_address)

    def stun_at(port: object) -> tuple[str, int] | None:
        if endpoint is None or isinstance(port, bool) or not isinstance(port, int):
            return None
        return (endpoint[0], port) if 0 < port < 65536 else None

    reason = reply.get("e")
    return DialbackOutcome(
        server,
        reply.get("ok") is True,
        observed if isinstance(observed, str) else None,
        stun_at(reply.get("s")),
        reason if isinstance(reason, str) else "",
        stun_at(reply.get("s2")),
    )


async def check_reachability(
    node: Node,
    servers: Sequence[PeerAddress | str],
    *,
    config: NATConfig,
    dialback: bool = True,
) -> Reachability:
    """Find out whether ``node`` is reachable and what NAT it is behind.

    Asks up to three of ``servers`` (public peers) to dial back, then queries
    their STUN responders and ``config.stun_servers`` from one UDP socket.
    Servers that cannot be reached are noted, not raised.

    Args:
        node: The started node.
        servers: Public peers to ask.
        config: Timeouts and extra STUN servers.
        dialback: Ask for dial-backs. Without, the peer counts as behind NAT
            and the servers' STUN responders are assumed on their TCP port
            number (the default).
    """
    port = node.address.port
    wait = config.dialback_timeout + config.signal_timeout
    chosen = [PeerAddress.parse(s) if isinstance(s, str) else s for s in servers][:_MAX_SERVERS]

    async def ask(server: PeerAddress) -> DialbackOutcome:
        try:
            async with asyncio.timeout(node.config.dial_timeout):
                conn = await node.connect_direct(server)
        except (P2PTrainError, TimeoutError) as exc:
            return DialbackOutcome(str(server), False, reason=f"cannot connect: {exc}")
        return await request_dialback(conn, port, timeout=wait)

    if dialback:
        outcomes = list(await asyncio.gather(*(ask(s) for s in chosen)))
        stun_servers = [
            server for o in outcomes for server in (o.stun, o.stun_alt) if server is not None
        ]
    else:
        outcomes = []
        stun_servers = [(s.host, s.port) for s in chosen]
    for text in config.stun_servers:
        parsed = PeerAddress.parse(text)
        stun_servers.append((parsed.host, parsed.port))
    mappings: list[tuple[str, tuple[str, int] | None]] = []
    if stun_servers:
        try:
            answers = await stun_query(stun_servers, timeout=config.stun_timeout)
        except P2PTrainError as exc:
            logger.warning("STUN queries failed: %s", exc)
            answers = [None] * len(stun_servers)
        mappings = [(f"{h}:{p}", a) for (h, p), a in zip(stun_servers, answers, strict=True)]
    result = classify(outcomes, mappings)
    logger.info(
        "reachability of %s: %s (%s)",
        node.peer_id.short,
        "public" if result.public else f"behind NAT ({result.nat})",
        "; ".join(result.notes),
    )
    return result
