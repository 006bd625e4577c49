"""Kademlia DHT: peer discovery and signed, expiring records.

The layers above use :class:`DHT` (values, dictionaries, signed records);
:class:`DHTNode` is the protocol peer underneath, and the pure parts
(:mod:`.routing`, :mod:`.lookup`, :mod:`.records`, :mod:`.storage`) are
usable on their own. See ``docs/dht.md``.
"""

from p2ptrain.dht.api import DHT, DictionaryValue, ValueWithExpiration
from p2ptrain.dht.config import DHTConfig
from p2ptrain.dht.node import DHTNode
from p2ptrain.dht.node_config import DHTNodeConfig
from p2ptrain.dht.records import owner_bound_key
from p2ptrain.dht.standing import run_standing_dht_node

__all__ = [
    "DHT",
    "DHTConfig",
    "DHTNode",
    "DHTNodeConfig",
    "DictionaryValue",
    "ValueWithExpiration",
    "owner_bound_key",
    "run_standing_dht_node",
]
