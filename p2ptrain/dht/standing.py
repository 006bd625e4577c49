"""A standing DHT node: joins (or starts) a network and serves until told to stop.

This is what ``p2ptrain dht`` / ``p2ptrain bootstrap`` run: a peer that others
pass as an initial peer. It announces its address once it is ready.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from p2ptrain.dht.api import DHT
from p2ptrain.dht.node_config import DHTNodeConfig
from p2ptrain.node.config import NodeConfig
from p2ptrain.secure.identity import Identity

__all__ = ["run_standing_dht_node"]

logger = logging.getLogger(__name__)


async def run_standing_dht_node(
    node_config: NodeConfig,
    dht_config: DHTNodeConfig,
    *,
    identity: Identity | None = None,
    announce: Callable[[str], None] = print,
    stop: asyncio.Event | None = None,
) -> None:
    """Run a DHT peer until ``stop`` is set (or the task is cancelled).

    Args:
        node_config: Where to listen (``port=0`` picks one) and what host to
            announce (set ``announce_host`` when listening on ``0.0.0.0``).
        dht_config: DHT settings; ``initial_peers`` empty starts a new network.
        identity: The peer's key pair (e.g. ``Identity.load_or_create(path)``,
            so the address stays the same across restarts); fresh by default.
        announce: Called once with the address others pass to join
            (``peerid@host:port``) as soon as the node serves.
        stop: Set it to shut the node down cleanly.

    Raises:
        LookupFailedError: Initial peers were given and none of them answered.
        ConnectError: The listening port cannot be bound.
    """
    async with DHT(identity=identity, node_config=node_config, config=dht_config) as dht:
        announce(str(dht.address))
        logger.info(
            "standing DHT node %s serving (%d known peers)",
            dht.peer_id.short,
            len(dht.known_peers()),
        )
        await (stop or asyncio.Event()).wait()
