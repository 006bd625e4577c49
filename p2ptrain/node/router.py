"""The hook a node asks when a plain TCP dial cannot reach a peer.

A :class:`~p2ptrain.node.node.Node` dials peers by address. Behind NAT that
fails: a NATed peer's address is private and nothing listens for it outside.
A :class:`Router` installed with :meth:`Node.set_router
<p2ptrain.node.node.Node.set_router>` takes over every dial to a known PeerID
that has no pooled connection: it decides whether to dial directly
(:meth:`Node.connect_direct <p2ptrain.node.node.Node.connect_direct>`) or to
reach the peer another way (a hole-punched socket, a WebRTC data channel, a
relay), authenticates the result with :meth:`Node.adopt
<p2ptrain.node.node.Node.adopt>` so that it joins the pool, and returns it.
Everything above the node (DHT, all-reduce, state sync) keeps calling
:meth:`Node.connect <p2ptrain.node.node.Node.connect>` unchanged.

The node knows nothing of NATs: :class:`~p2ptrain.nat.service.NATService`
implements this protocol, and the dependency points from ``nat`` to ``node``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from p2ptrain.node.address import PeerAddress
    from p2ptrain.rpc.connection import Connection

__all__ = ["Router"]


class Router(Protocol):
    """Reaches a peer by its PeerID when dialing its address may not work."""

    async def route(self, address: PeerAddress) -> Connection:
        """An authenticated, pooled connection to ``address.peer_id`` (never None).

        Called by :meth:`Node.connect <p2ptrain.node.node.Node.connect>` only
        for addresses bound to a PeerID and only when no connection to that
        peer is pooled; concurrent connects to one peer share one call. Must
        not call ``Node.connect`` for the same peer (that call would wait for
        itself): dial with ``Node.connect_direct``.

        Raises:
            TransportError: The peer cannot be reached (``NATTraversalError``
                says why, per path).
            HandshakeError: Whoever answered is not the peer.
        """
        ...
