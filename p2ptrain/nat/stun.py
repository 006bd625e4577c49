"""STUN Binding (RFC 8489): a codec, the responder public peers run, a client.

Public peers answer Binding requests themselves, on a UDP port with the same
number as their TCP listener (or a configured one), so a swarm needs no
third-party STUN server: a NATed peer learns its reflexive address from
them, and ICE uses them as its STUN server. Only Binding is implemented; no
authentication, no TURN (coturn or any standard server does that).

* The codec is pure: :func:`binding_request`, :func:`answer_binding` (request
  bytes and source address in, response bytes out, or None for anything that
  is not a well-formed Binding request), :func:`parse_binding_response`.
  Message encoding is aioice's (``aioice.stun``); every error it may raise on
  garbage is caught here, so a malformed datagram is simply ignored.
* :class:`StunResponder` is the asyncio shell of a responder.
* :func:`stun_query` asks several servers from one UDP socket, retransmitting
  with a doubling timeout, and returns the mapping each one saw. Comparing the
  mappings tells an endpoint-independent ("easy") NAT from a symmetric one
  (see :mod:`p2ptrain.nat.reachability`).

A Binding response is ~12 bytes larger than the request, so a responder
amplifies a spoofed request by less than 2x; it never answers anything else.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
from collections.abc import Sequence
from typing import Any, cast

from aioice import stun as _stun

from p2ptrain.errors import ConnectError

__all__ = [
    "MAX_STUN_BYTES",
    "StunResponder",
    "answer_binding",
    "binding_request",
    "parse_binding_response",
    "start_stun_responder",
    "stun_query",
]

logger = logging.getLogger(__name__)

MAX_STUN_BYTES = 548
"""Larger datagrams are ignored (a Binding request is 20-100 bytes)."""

_MAGIC = struct.pack("!I", _stun.COOKIE)
_INITIAL_RTO = 0.2
_MAX_RTO = 1.6
_SOFTWARE = "p2ptrain"

Address = tuple[str, int]


def _decode(data: bytes) -> Any | None:
    """A parsed STUN message, or None for anything that is not one."""
    if not _stun.HEADER_LENGTH <= len(data) <= MAX_STUN_BYTES:
        return None
    if data[0] & 0xC0 or data[4:8] != _MAGIC:  # RFC 8489 §6: top bits 0, magic cookie
        return None
    try:
        return _stun.parse_message(data)
    except (ValueError, IndexError, KeyError, TypeError, struct.error):
        return None


def binding_request(transaction_id: bytes | None = None) -> tuple[bytes, bytes]:
    """A Binding request: returns ``(transaction_id, datagram)``.

    Raises:
        ValueError: ``transaction_id`` is not 12 bytes.
    """
    txid = os.urandom(12) if transaction_id is None else transaction_id
    if len(txid) != 12:
        raise ValueError("a STUN transaction id has 12 bytes")
    message = _stun.Message(_stun.Method.BINDING, _stun.Class.REQUEST, transaction_id=txid)
    message.add_fingerprint()
    return txid, bytes(message)


def answer_binding(data: bytes, source: Address) -> bytes | None:
    """The Binding success response to ``data`` received from ``source``.

    Returns None when ``data`` is not a well-formed Binding request (responses,
    indications, other methods, garbage): a responder must stay silent then.
    """
    request = _decode(data)
    if request is None:
        return None
    if request.message_method != _stun.Method.BINDING:
        return None
    if request.message_class != _stun.Class.REQUEST:
        return None
    response = _stun.Message(
        _stun.Method.BINDING,
        _stun.Class.RESPONSE,
        transaction_id=request.transaction_id,
        attributes={"XOR-MAPPED-ADDRESS": (source[0], source[1]), "SOFTWARE": _SOFTWARE},
    )
    response.add_fingerprint()
    return bytes(response)


def parse_binding_response(data: bytes, transaction_id: bytes) -> Address | None:
    """The reflexive address in a Binding success response to ``transaction_id``.

    Returns None for anything else (another transaction, an error response,
    no mapped address, garbage).
    """
    message = _decode(data)
    if message is None or message.transaction_id != transaction_id:
        return None
    if message.message_method != _stun.Method.BINDING:
        return None
    if message.message_class != _stun.Class.RESPONSE:
        return None
    mapped = message.attributes.get("XOR-MAPPED-ADDRESS") or message.attributes.get(
        "MAPPED-ADDRESS"
    )
    if not isinstance(mapped, tuple) or len(mapped) != 2:
        return None
    host, port = mapped
    if not isinstance(host, str) or not isinstance(port, int):
        return None
    return host, port


# -- responder -----------------------------------------------------------------------------


class StunResponder(asyncio.DatagramProtocol):
    """Answers STUN Binding requests on one UDP socket.

    Use :func:`start_stun_responder`; close with :meth:`aclose`.

    Attributes:
        answered: Requests answered.
        ignored: Datagrams that were not Binding requests.
    """

    def __init__(self) -> None:
        self.answered = 0
        self.ignored = 0
        self._transport: asyncio.DatagramTransport | None = None
        self._closed = asyncio.Event()

    @property
    def address(self) -> Address:
        """The (host, port) the responder is bound to."""
        if self._transport is None:
            raise RuntimeError("the STUN responder is not started")
        host, port = self._transport.get_extra_info("sockname")[:2]
        return str(host), int(port)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        response = answer_binding(data, (str(addr[0]), int(addr[1])))
        if response is None or self._transport is None:
            self.ignored += 1
            return
        self.answered += 1
        self._transport.sendto(response, addr)

    def error_received(self, exc: Exception) -> None:
        logger.debug("STUN responder: %s", exc)  # ICMP errors for earlier answers

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed.set()

    async def aclose(self) -> None:
        """Close the socket."""
        if self._transport is not None:
            self._transport.close()
            await self._closed.wait()


async def start_stun_responder(host: str, port: int) -> StunResponder:
    """Answer STUN Binding requests on UDP ``host:port`` (port 0: any free port).

    Raises:
        ConnectError: The port cannot be bound.
    """
    loop = asyncio.get_running_loop()
    try:
        _, protocol = await loop.create_datagram_endpoint(
            StunResponder, local_addr=(host, port), family=socket.AF_INET
        )
    except OSError as exc:
        raise ConnectError(f"cannot bind the STUN responder to {host}:{port}: {exc}") from exc
    logger.info("STUN responder on udp %s:%d", *protocol.address)
    return protocol


# -- client ------------------------------------------------------------------------------


class _QueryProtocol(asyncio.DatagramProtocol):
    def __init__(self, waiting: dict[bytes, asyncio.Future[Address]]) -> None:
        self.waiting = waiting

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        if len(data) < _stun.HEADER_LENGTH:
            return
        future = self.waiting.get(data[8:20])
        if future is None or future.done():
            return
        mapped = parse_binding_response(data, data[8:20])
        if mapped is not None:
            future.set_result(mapped)

    def error_received(self, exc: Exception) -> None:
        logger.debug("STUN query: %s", exc)  # an unreachable server; others may answer


async def _resolve(server: Address) -> Address:
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(
            server[0], server[1], family=socket.AF_INET, type=socket.SOCK_DGRAM
        )
    except OSError as exc:
        raise ConnectError(f"cannot resolve STUN server {server[0]}: {exc}") from exc
    host, port = infos[0][4][:2]
    return str(host), int(port)


async def stun_query(
    servers: Sequence[Address],
    *,
    timeout: float,
    local_addr: Address = ("0.0.0.0", 0),
) -> list[Address | None]:
    """Ask each server for the reflexive address of one UDP socket.

    Requests are retransmitted with a doubling interval (0.2 s, 0.4 s, ...,
    at most 1.6 s) until every server answered or ``timeout`` passed.

    Returns:
        One entry per server, in order: the (host, port) it saw, or None if it
        did not answer in time.

    Raises:
        ConnectError: The socket cannot be created or a server name not resolved.
    """
    loop = asyncio.get_running_loop()
    targets = [await _resolve(server) for server in servers]
    waiting: dict[bytes, asyncio.Future[Address]] = {}
    requests: list[tuple[bytes, bytes]] = [binding_request() for _ in targets]
    for txid, _ in requests:
        waiting[txid] = loop.create_future()
    try:
        transport, _ = await loop.create_datagram_endpoint(
            lambda: _QueryProtocol(waiting), local_addr=local_addr, family=socket.AF_INET
        )
    except OSError as exc:
        raise ConnectError(f"cannot open a UDP socket for STUN: {exc}") from exc
    try:
        deadline = loop.time() + timeout
        rto = _INITIAL_RTO
        while (left := deadline - loop.time()) > 0:
            pending = []
            for (txid, data), target in zip(requests, targets, strict=True):
                if not waiting[txid].done():
                    transport.sendto(data, target)
                    pending.append(waiting[txid])
            if not pending:
                break
            await asyncio.wait(pending, timeout=min(rto, left))
            rto = min(rto * 2, _MAX_RTO)
        return [waiting[txid].result() if waiting[txid].done() else None for txid, _ in requests]
    finally:
        for future in waiting.values():
            if not future.done():
                future.cancel()
        transport.close()
