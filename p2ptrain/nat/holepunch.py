"""TCP hole punching: simultaneous open through two port-preserving NATs.

Theory of operation
-------------------
A home router keeps one external port per local socket for every
destination ("easy" NAT) and drops unsolicited inbound packets. If both
peers send a SYN from their *listening* port to the other's public mapping of
that port at about the same time, each SYN leaves a conntrack entry in its
own router that lets the other's SYN in, and the kernels complete a TCP
simultaneous open (RFC 9293 §3.5). Kernel TCP is then the path: about 50x
faster than aiortc's SCTP, and robust to loss.

1. Each peer's listener shares its port (``SO_REUSEPORT``;
   :func:`start_node` opens the node's listener that way), so an outgoing
   socket can bind the same port.
2. A NATed peer registers at its rendezvous points from its listening port
   (:func:`dial_from_listen_port`), so they see the NAT's mapping of that
   port; the dialer connects to the rendezvous point from its listening port
   too. The rendezvous point tells each side what it sees of the other
   (``o``/``y`` of the circuit, :mod:`p2ptrain.nat.signaling`).
3. Coordination over a signaling circuit, as in libp2p's DCUtR::

       dialer D                      target T
       {"type": "path", "path": "punch"} ->
       {"type": "connect"}  ->                  (D starts a clock)
                            <-  {"type": "connect"}
       {"type": "sync"}     ->                  (D measured the round trip)
       wait RTT/2, connect                      connect at once
       (both from the listening port to the other's mapping)

4. The identity handshake then runs on the new connection, D as initiator,
   each side expecting the PeerID it was told: a wrong peer fails
   authentication.

Two peers that punch towards each other at once would open the same
4-tuple twice (the second connect fails with ``EADDRNOTAVAIL``,
:func:`port_pair_taken`): the NAT service's tie-break for crossing dials
(:mod:`p2ptrain.nat.service`) lets only one of them dial.

Against a symmetric NAT the mapping the rendezvous point saw is not the one
used towards the peer, so the SYNs are dropped and the attempt times out;
path selection skips hole punching when either side knows it is symmetric.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import socket

from p2ptrain.errors import ConnectError, TransportTimeoutError
from p2ptrain.nat.signaling import CircuitSignaling
from p2ptrain.node.address import PeerAddress
from p2ptrain.node.config import reuse_port_available
from p2ptrain.node.node import Node
from p2ptrain.rpc.connection import Connection
from p2ptrain.secure.identity import PeerID
from p2ptrain.transport.tcp import TCPTransport

__all__ = [
    "HOLEPUNCH_PATH",
    "dial_from_listen_port",
    "port_pair_taken",
    "punch_initiator",
    "punch_responder",
    "reuses_port",
    "start_node",
]

logger = logging.getLogger(__name__)

HOLEPUNCH_PATH = "tcp-holepunch"


async def start_node(node: Node) -> None:
    """Start ``node`` with a listener that shares its port (``NodeConfig.reuse_port``).

    Equivalent to building the node with ``NodeConfig(reuse_port=True)`` and
    calling :meth:`Node.start`; a plain start where the platform has no
    ``SO_REUSEPORT`` (Windows: no hole punching there).

    Raises:
        RuntimeError: The node is already started.
        ConnectError: The port cannot be bound.
    """
    if node.listening:
        raise RuntimeError("start_node() replaces node.start(): the node is already started")
    if not node.config.reuse_port and reuse_port_available():
        node.config = dataclasses.replace(node.config, reuse_port=True)
    await node.start()


def reuses_port(node: Node) -> bool:
    """Whether the node's listener allows outgoing sockets on its port."""
    return node.shares_port


def port_pair_taken(exc: BaseException) -> bool:
    """Whether a connect from the listening port failed because a socket of ours
    already joins that port to the same remote address (``EADDRNOTAVAIL``): the
    peer's own punch towards us got there first."""
    cause = exc.__cause__
    return isinstance(cause, OSError) and cause.errno == errno.EADDRNOTAVAIL


def _local_addr(node: Node) -> tuple[str, int]:
    return node.config.host, node.address.port


async def _open_from_listen_port(
    node: Node, host: str, port: int, *, timeout: float, path: str
) -> TCPTransport:
    """A TCP connection to ``host:port`` from the node's listening port.

    Builds the socket itself: ``tcp_connect(local_addr=...)`` passes
    ``reuse_port`` to ``loop.create_connection``, which neither asyncio nor
    uvloop accepts.
    """
    loop = asyncio.get_running_loop()
    conn = node.config.connection
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.setblocking(False)
        sock.bind(_local_addr(node))
        async with asyncio.timeout(timeout):
            await loop.sock_connect(sock, (host, port))
            transport = TCPTransport(
                max_frame_bytes=conn.max_frame_bytes,
                max_header_bytes=conn.max_header_bytes,
                write_high_water=conn.write_high_water,
                path=path,
                pace_target_s=conn.pace_target_s,
            )
            await loop.create_connection(lambda: transport, sock=sock)
    except TimeoutError as exc:
        sock.close()
        raise TransportTimeoutError(f"connecting to {host}:{port} timed out") from exc
    except OSError as exc:
        sock.close()
        raise ConnectError(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from exc
    except BaseException:
        sock.close()
        raise
    return transport


async def dial_from_listen_port(node: Node, address: PeerAddress, *, timeout: float) -> Connection:
    """Connect to ``address`` from the node's listening port (a new connection).

    The connection joins the node's pool like any other (it becomes the pooled
    one only if none to that peer exists).

    Raises:
        ConnectError: The connection failed (or the listener does not share its port).
        TransportTimeoutError: It timed out.
        HandshakeError: The peer failed authentication.
    """
    if not reuses_port(node):
        raise ConnectError("the node's listener does not share its port (see start_node)")
    transport = await _open_from_listen_port(
        node, address.host, address.port, timeout=timeout, path="tcp-direct"
    )
    return await node.adopt(transport, initiator=True, expected=address.peer_id)


async def punch_initiator(
    node: Node,
    channel: CircuitSignaling,
    *,
    peer: PeerID,
    target: tuple[str, int],
    timeout: float,
) -> Connection:
    """The dialer's half of a hole punch (after the ``path`` message was sent).

    Args:
        node: Our node (its listener must share its port).
        channel: The signaling circuit to the peer.
        peer: Who must answer at ``target``.
        target: The peer's mapping of its listening port, as its rendezvous
            point sees it.
        timeout: Seconds for each step (the exchange, the connect).

    Raises:
        ConnectError: The peer refused, or the connection failed.
        TransportTimeoutError: A step timed out.
        HandshakeError: Whoever answered is not ``peer``.
    """
    loop = asyncio.get_running_loop()
    started = loop.time()
    await channel.send({"type": "connect"})
    await channel.expect("connect", timeout=timeout)
    rtt = loop.time() - started
    await channel.send({"type": "sync"})
    await asyncio.sleep(rtt / 2)  # the sync reaches the peer about now: both SYNs leave together
    logger.debug("punching to %s:%d (rtt %.1f ms)", target[0], target[1], rtt * 1000)
    transport = await _open_from_listen_port(
        node, target[0], target[1], timeout=timeout, path=HOLEPUNCH_PATH
    )
    return await node.adopt(transport, initiator=True, expected=peer)


async def punch_responder(
    node: Node,
    channel: CircuitSignaling,
    *,
    peer: PeerID,
    target: tuple[str, int],
    timeout: float,
) -> Connection:
    """The target's half of a hole punch (after the ``path`` message arrived).

    Arguments and errors as for :func:`punch_initiator`; ``target`` is the
    dialer's address as the rendezvous point saw it.
    """
    await channel.expect("connect", timeout=timeout)
    await channel.send({"type": "connect"})
    await channel.expect("sync", timeout=timeout)
    transport = await _open_from_listen_port(
        node, target[0], target[1], timeout=timeout, path=HOLEPUNCH_PATH
    )
    return await node.adopt(transport, initiator=False, expected=peer)
