"""coturn for the NAT lab, and a minimal STUN binding client to probe it.

:class:`TurnServerInfo` is what users of the lab need (URLs, credentials);
:func:`turnserver_argv` builds the command line of Debian's ``turnserver``
(package ``coturn``); :func:`stun_binding` sends a STUN Binding request
(RFC 5389) from a socket and returns the reflexive address the server saw.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from p2ptrain.lab.natlab.netns import NatLabError

__all__ = [
    "DENIED_PEER_RANGES",
    "TurnServerInfo",
    "parse_binding_response",
    "stun_binding",
    "stun_binding_request",
    "turnserver_argv",
]

_MAGIC_COOKIE = 0x2112A442
_BINDING_REQUEST = 0x0001
_BINDING_SUCCESS = 0x0101
_ATTR_MAPPED_ADDRESS = 0x0001
_ATTR_XOR_MAPPED_ADDRESS = 0x0020
_FAMILY_IPV4 = 0x01
_HEADER = struct.Struct("!HHI12s")

DENIED_PEER_RANGES: tuple[str, ...] = (
    "0.0.0.0-0.255.255.255",
    "10.0.0.0-10.255.255.255",
    "127.0.0.0-127.255.255.255",
    "169.254.0.0-169.254.255.255",
    "172.16.0.0-172.31.255.255",
    "192.168.0.0-192.168.255.255",
)
"""Peer ranges coturn refuses to relay to: every private range the lab's
"internet" does not use. ICE tries home-LAN host candidates through the relay;
without this, a failed send could make coturn drop the whole allocation."""


@dataclass(frozen=True)
class TurnServerInfo:
    """Where the lab's coturn listens and how to log in (long-term credentials).

    Attributes:
        host: Public IPv4 address of the TURN host.
        port: UDP/TCP listening port.
        username: Long-term credential user.
        password: Its password.
        realm: The realm coturn announces.
    """

    host: str
    port: int
    username: str
    password: str
    realm: str

    @property
    def stun_url(self) -> str:
        """``stun:host:port``."""
        return f"stun:{self.host}:{self.port}"

    @property
    def turn_url(self) -> str:
        """``turn:host:port?transport=udp``."""
        return f"turn:{self.host}:{self.port}?transport=udp"

    def rtc_ice_servers(self) -> list[Any]:
        """aiortc ``RTCIceServer`` objects for this server (STUN and TURN).

        Pass them as ``RTCConfiguration(iceServers=...)``: never leave the list
        out, or aiortc contacts a public STUN server.
        """
        from aiortc import RTCIceServer  # noqa: PLC0415 - heavy, only needed here

        return [
            RTCIceServer(urls=self.stun_url),
            RTCIceServer(urls=self.turn_url, username=self.username, credential=self.password),
        ]


def turnserver_argv(info: TurnServerInfo, workdir: Path) -> list[str]:
    """The ``turnserver`` command line for ``info``, writing into ``workdir``.

    No configuration file is read (``-n``); the user database, log and pid
    file go to ``workdir``, which must be writable.
    """
    argv = [
        "turnserver",
        "-n",
        f"--listening-ip={info.host}",
        f"--relay-ip={info.host}",
        f"--listening-port={info.port}",
        "--min-port=49152",
        "--max-port=65535",
        "--lt-cred-mech",
        f"--user={info.username}:{info.password}",
        f"--realm={info.realm}",
        f"--userdb={workdir / 'turndb.sqlite'}",
        f"--log-file={workdir / 'turnserver.log'}",
        f"--pidfile={workdir / 'turnserver.pid'}",
        "--simple-log",
        "--no-stdout-log",
        "--no-cli",
        "--no-tls",
        "--no-dtls",
        "--no-multicast-peers",
        "--fingerprint",
    ]
    argv.extend(f"--denied-peer-ip={span}" for span in DENIED_PEER_RANGES)
    return argv


def stun_binding_request(transaction_id: bytes) -> bytes:
    """The 20-byte STUN Binding request with ``transaction_id`` (12 bytes)."""
    if len(transaction_id) != 12:
        raise ValueError("a STUN transaction id has 12 bytes")
    return _HEADER.pack(_BINDING_REQUEST, 0, _MAGIC_COOKIE, transaction_id)


def parse_binding_response(data: bytes, transaction_id: bytes) -> tuple[str, int] | None:
    """The reflexive (IPv4 address, port) of a Binding success response.

    Returns None when ``data`` is not a success response to ``transaction_id``
    or carries no IPv4 (XOR-)MAPPED-ADDRESS.
    """
    if len(data) < _HEADER.size:
        return None
    kind, length, cookie, txid = _HEADER.unpack_from(data)
    if kind != _BINDING_SUCCESS or cookie != _MAGIC_COOKIE or txid != transaction_id:
        return None
    body = data[_HEADER.size : _HEADER.size + length]
    mapped: tuple[str, int] | None = None
    offset = 0
    while offset + 4 <= len(body):
        attr, size = struct.unpack_from("!HH", body, offset)
        value = body[offset + 4 : offset + 4 + size]
        offset += 4 + (size + 3) // 4 * 4
        if len(value) != 8 or value[1] != _FAMILY_IPV4:
            continue
        port, raw = struct.unpack_from("!H4s", value, 2)
        if attr == _ATTR_XOR_MAPPED_ADDRESS:
            port ^= _MAGIC_COOKIE >> 16
            raw = bytes(a ^ b for a, b in zip(raw, struct.pack("!I", _MAGIC_COOKIE), strict=True))
            return socket.inet_ntoa(raw), port
        if attr == _ATTR_MAPPED_ADDRESS:
            mapped = socket.inet_ntoa(raw), port
    return mapped


def stun_binding(
    sock: socket.socket,
    server: tuple[str, int],
    *,
    timeout: float = 5.0,
    retransmit_s: float = 0.2,
) -> tuple[str, int]:
    """Ask ``server`` for this UDP socket's reflexive address.

    The request is retransmitted every ``retransmit_s`` until a matching
    response arrives or ``timeout`` passes. The socket's own timeout is
    restored afterwards.

    Returns:
        The (IPv4 address, port) the server saw.

    Raises:
        NatLabError: No answer before the deadline.
    """
    txid = os.urandom(12)
    request = stun_binding_request(txid)
    saved = sock.gettimeout()
    deadline = time.monotonic() + timeout
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.sendto(request, server)
            resend_at = time.monotonic() + min(retransmit_s, left)
            while (wait := resend_at - time.monotonic()) > 0:
                sock.settimeout(wait)
                try:
                    data = sock.recv(2048)
                except TimeoutError:
                    break
                except ConnectionRefusedError:
                    continue  # an ICMP error from an earlier try; keep waiting
                answer = parse_binding_response(data, txid)
                if answer is not None:
                    return answer
    finally:
        sock.settimeout(saved)
    raise NatLabError(f"no STUN answer from {server[0]}:{server[1]} within {timeout:.1f} s")
