"""Who a peer is and how two peers trust each other.

* :mod:`~p2ptrain.secure.identity`: Ed25519 keys and PeerIDs.
* :mod:`~p2ptrain.secure.handshake`: the authenticated X25519 handshake and
  admission (swarm key, allowlist).
* :mod:`~p2ptrain.secure.swarm_key`: swarm key files (``p2ptrain keygen``).

The record cipher every frame goes through after the handshake is
:mod:`p2ptrain.wire.records`: the frame decoder opens records, so it sits
below the transports, which this package builds on.
"""
