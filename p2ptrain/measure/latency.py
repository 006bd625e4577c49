"""Round-trip times to other peers, from the RPC layer's PINGs.

Every :class:`~p2ptrain.rpc.connection.Connection` keeps the smallest PING
round trip it saw (``Connection.rtt_s``): the propagation delay of the path,
without the queueing a busy link adds. :func:`measure_rtts` pings the peers
it is asked about (over pooled connections, dialling where needed);
:func:`known_rtts` reads what the pool already knows. The all-reduce's
round-time model adds a peer's largest RTT to its transfer times (see
:mod:`p2ptrain.allreduce.partition`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from p2ptrain.errors import P2PTrainError
from p2ptrain.node.address import PeerAddress
from p2ptrain.node.node import Node
from p2ptrain.secure.identity import PeerID

__all__ = ["known_rtts", "measure_rtts"]


def known_rtts(node: Node) -> dict[PeerID, float]:
    """The smallest RTT each pooled connection has seen (peers never pinged are left out)."""
    return {c.remote_peer: c.rtt_s for c in node.connections() if c.rtt_s is not None}


async def measure_rtts(
    node: Node, targets: Sequence[PeerAddress], *, pings: int = 3, timeout: float = 5.0
) -> dict[PeerID, float]:
    """Ping each target ``pings`` times (concurrently across targets); the smallest RTT each.

    Targets that cannot be reached or do not answer are left out.
    """

    async def one(target: PeerAddress) -> tuple[PeerID, float] | None:
        try:
            conn = await node.connect(target)
            for _ in range(pings):
                await conn.ping(timeout)
        except P2PTrainError:
            return None
        return (conn.remote_peer, conn.rtt_s) if conn.rtt_s is not None else None

    results = await asyncio.gather(*(one(t) for t in targets))
    return dict(r for r in results if r is not None)
