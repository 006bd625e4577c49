"""A 30-node DHT over real loopback TCP in one process: every value is found from
every node, and still after 30 % of the nodes die without a goodbye."""

from __future__ import annotations

import hashlib
import random
import time

from p2ptrain.dht import DHT, DHTConfig, DHTNodeConfig, DictionaryValue, ValueWithExpiration
from p2ptrain.dht.routing import NodeID
from p2ptrain.secure.identity import Identity

NODES = 30
KEYS = 30
REPLICAS = 5
CONFIG = DHTConfig(replicas=REPLICAS)


def identity(i: int) -> Identity:
    """Fixed identities, so the ids (and who holds which key) are the same every run."""
    return Identity.from_seed(hashlib.sha256(f"integration-node-{i}".encode()).digest())


async def crash(peer: DHT) -> None:
    """Stop ``peer`` abruptly: abort its connections (RST, no GOAWAY), then stop listening."""
    for conn in peer.node.connections():
        conn.transport.close()  # abort: nothing queued is sent
    await peer.node.aclose()
    await peer.dht_node.aclose()


async def check_everything_found(readers: list[DHT], expected: dict[str, object]) -> None:
    for reader in readers:
        for key, value in expected.items():
            found = await reader.get(key)
            assert isinstance(found, ValueWithExpiration), (reader.peer_id, key)
            assert found.value == value
        group = await reader.get_dictionary("group")
        assert {s.decode(): v.value for s, v in group.items()} == {"a": 1, "b": 2, "c": 3}


async def test_thirty_nodes_survive_thirty_percent_dying() -> None:
    peers: list[DHT] = []
    rng = random.Random(7)
    try:
        for i in range(NODES):
            initial = (str(rng.choice(peers).address),) if peers else ()
            # 30 nodes share this process's loop: at load 12 a live node's
            # answer took over 2 s (every query of a lookup failed).
            config = DHTNodeConfig(dht=CONFIG, initial_peers=initial, request_timeout=5.0)
            peer = DHT(identity=identity(i), config=config)
            await peer.start()
            peers.append(peer)
        expires = time.time() + 600
        expected: dict[str, object] = {
            f"value/{i}": {"i": i, "blob": bytes(i)} for i in range(KEYS)
        }
        for i, (key, value) in enumerate(expected.items()):
            assert await peers[i % NODES].store(key, value, expires)
        for name, writer in zip(("a", "b", "c"), (peers[3], peers[11], peers[25]), strict=True):
            assert await writer.store("group", ord(name) - 96, expires, subkey=name)
        await check_everything_found(peers, expected)

        # Kill the nearest holder of as many keys as possible, never all holders of one.
        holders = {
            key: sorted(
                (p for p in peers if p.dht_node.records.get(key.encode(), time.time())),
                key=lambda p: p.dht_node.node_id ^ NodeID.from_key(key.encode()),
            )
            for key in [*expected, "group"]
        }
        assert all(len(h) == REPLICAS for h in holders.values())
        doomed: list[DHT] = []
        for key_holders in holders.values():
            if len(doomed) == NODES * 3 // 10:
                break
            if key_holders[0] not in doomed:
                doomed.append(key_holders[0])
        assert len(doomed) == 9
        for key_holders in holders.values():
            assert any(h not in doomed for h in key_holders)
        for peer in doomed:
            await crash(peer)
        survivors = [p for p in peers if p not in doomed]
        await check_everything_found(survivors, expected)
        # The network keeps working for new values too.
        assert await survivors[0].store("after", "crash", expires)
        found = await survivors[-1].get("after", latest=True)
        assert isinstance(found, ValueWithExpiration) and found.value == "crash"
        dictionary = await survivors[-1].get("group", latest=True)
        assert isinstance(dictionary, DictionaryValue) and len(dictionary) == 3
    finally:
        for peer in peers:
            await peer.aclose()
