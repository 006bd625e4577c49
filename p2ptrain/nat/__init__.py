"""NAT traversal: reachability, STUN, rendezvous signaling, hole punching, relays.

See docs/nat-traversal.md. The pieces, bottom up:

* :mod:`~p2ptrain.nat.config`: :class:`NATConfig`, :class:`RelayLimits`.
* :mod:`~p2ptrain.nat.stun`: a STUN Binding codec, responder and client.
* :mod:`~p2ptrain.nat.reachability`: dial-backs + STUN -> :class:`Reachability`.
* :mod:`~p2ptrain.nat.records`: the :class:`PeerRecord` a peer publishes in the DHT.
* :mod:`~p2ptrain.nat.signaling`: the rendezvous protocol, registrations, circuits.
* :mod:`~p2ptrain.nat.rendezvous`: the rendezvous point public peers run.
* :mod:`~p2ptrain.nat.relay`: bandwidth limits and :class:`RelayTransport`.
* :mod:`~p2ptrain.nat.holepunch`: TCP simultaneous open.
* :mod:`~p2ptrain.nat.paths`: path planning and :func:`connect_peer`.
* :mod:`~p2ptrain.nat.service`: :class:`NATService`, all of it for one peer.
* :mod:`~p2ptrain.nat.router`: :class:`NATRouter`, the node's dialer hook.

A bootstrap peer (``p2ptrain bootstrap``) composes all of it with a DHT node
and a probe server: :func:`p2ptrain.app.bootstrap.run_bootstrap_peer`.
"""

from p2ptrain.nat.config import ATTEMPTS, NATConfig, RelayLimits
from p2ptrain.nat.holepunch import start_node
from p2ptrain.nat.paths import LocalView, Traversal, connect_peer, plan_paths, traverse
from p2ptrain.nat.reachability import Reachability, check_reachability
from p2ptrain.nat.records import PeerRecord, RendezvousPoint, find_record, publish_record
from p2ptrain.nat.relay import RelayTransport
from p2ptrain.nat.router import NATRouter
from p2ptrain.nat.service import NATService
from p2ptrain.nat.signaling import CircuitSignaling

__all__ = [
    "ATTEMPTS",
    "CircuitSignaling",
    "LocalView",
    "NATConfig",
    "NATRouter",
    "NATService",
    "PeerRecord",
    "Reachability",
    "RelayLimits",
    "RelayTransport",
    "RendezvousPoint",
    "Traversal",
    "check_reachability",
    "connect_peer",
    "find_record",
    "plan_paths",
    "publish_record",
    "start_node",
    "traverse",
]
