"""A bootstrap peer: a public DHT node that also serves NAT traversal.

This is what ``p2ptrain bootstrap`` runs on a host others can dial: a DHT
server node, a STUN responder (UDP), the rendezvous point NATed peers
register with (signaling for hole punching and WebRTC), dial-backs that tell
peers whether they are reachable, and, when it opted in, a bounded relay for
peers behind symmetric NATs. See docs/nat-traversal.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

from p2ptrain.app.collectors import bootstrap_collector, dht_collector, node_collector
from p2ptrain.dht.api import DHT
from p2ptrain.dht.node_config import DHTNodeConfig
from p2ptrain.errors import ConfigError
from p2ptrain.measure.probe import serve_probes
from p2ptrain.metrics import Metrics
from p2ptrain.nat.config import NATConfig
from p2ptrain.nat.service import NATService
from p2ptrain.node.address import is_unspecified_host
from p2ptrain.node.config import NodeConfig
from p2ptrain.node.node import Node
from p2ptrain.secure.identity import Identity

__all__ = ["BootstrapInfo", "run_bootstrap_peer"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BootstrapInfo:
    """What a bootstrap peer tells its operator once it serves.

    Attributes:
        address: The address others pass with ``--join`` (``peerid@host:port``).
        stun_port: UDP port of its STUN responder.
        relay: Whether it relays for peers behind symmetric NATs.
        rendezvous: Whether NATed peers can register with it.
    """

    address: str
    stun_port: int
    relay: bool
    rendezvous: bool


def _check_dialable(node_config: NodeConfig) -> None:
    host = node_config.announce_host or node_config.host
    if is_unspecified_host(host):
        raise ConfigError(
            f"others cannot dial {host}: give the host's public address with --announce-host"
        )


async def run_bootstrap_peer(
    node_config: NodeConfig,
    dht_config: DHTNodeConfig,
    nat_config: NATConfig,
    *,
    identity: Identity | None = None,
    announce: Callable[[BootstrapInfo], None] | None = None,
    stop: asyncio.Event | None = None,
    metrics: Metrics | None = None,
) -> None:
    """Serve as a public bootstrap peer until ``stop`` is set (or the task is cancelled).

    Args:
        node_config: Where to listen and the public host to announce.
        dht_config: DHT settings (``initial_peers``: other bootstrap peers);
            the node is a DHT server whatever ``client_mode`` says.
        nat_config: Rendezvous, STUN port and relay settings; ``public`` is
            forced to True (a bootstrap peer is configured public, not measured).
        identity: The key pair (keep it in a file so the address survives restarts).
        announce: Called once with :class:`BootstrapInfo` when everything serves.
        stop: Set it to shut down cleanly.
        metrics: A registry to report into (connections and bytes, DHT
            requests, STUN answers, relay circuits and bytes), or None.

    Raises:
        ConfigError: The announced host is unspecified (``0.0.0.0``).
        ConnectError: The TCP or UDP port cannot be bound.
        LookupFailedError: Other bootstrap peers were given and none answered.
    """
    _check_dialable(node_config)
    node = Node(identity=identity, config=node_config)
    await node.start()
    serve_probes(node)  # newcomers measure their links against us
    try:
        dht = DHT(node=node, config=dataclasses.replace(dht_config, client_mode=False))
        await dht.start()
        try:
            nat = NATService(
                node=node, dht=dht, config=dataclasses.replace(nat_config, public=True)
            )
            async with nat:
                node.set_router(nat.router)
                if metrics is not None:
                    metrics.add_collector(node_collector(node))
                    metrics.add_collector(dht_collector(dht.dht_node))
                    metrics.add_collector(bootstrap_collector(nat))
                stun = nat.stun
                info = BootstrapInfo(
                    address=str(node.address),
                    stun_port=stun.address[1] if stun is not None else 0,
                    relay=nat_config.relay,
                    rendezvous=nat.rendezvous_server is not None,
                )
                logger.info(
                    "bootstrap peer %s serving at %s (STUN udp/%d)",
                    node.peer_id.short,
                    info.address,
                    info.stun_port,
                )
                if announce is not None:
                    announce(info)
                await (stop or asyncio.Event()).wait()
        finally:
            await dht.aclose()
    finally:
        await node.aclose()
