"""One peer of a swarm: its configuration and the synchronous facade training code holds.

* :mod:`~p2ptrain.peer.config`: :class:`PeerConfig`.
* :mod:`~p2ptrain.peer.peer`: :class:`Peer`, a loop thread with the node, DHT,
  NAT traversal, all-reduce and matchmaking on it.
"""

from p2ptrain.peer.config import PeerConfig
from p2ptrain.peer.peer import Peer

__all__ = ["Peer", "PeerConfig"]
