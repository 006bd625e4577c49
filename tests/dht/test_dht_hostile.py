"""Hostile DHT peers over real loopback TCP: wiping shared dictionaries, forging
values from a node whose id sits next to the key, filling a node's storage."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest
from conftest import NodeFactory
from test_dht_node import (  # noqa: F401 - make_dht is a fixture
    DHTFactory,
    make_dht,
    raw_store,
    serve_rogue,
    swarm,
)

from p2ptrain.dht import DHTConfig, ValueWithExpiration
from p2ptrain.dht.protocol import METHOD_PING, FindReply, FindRequest, PingRequest, StoreOutcome
from p2ptrain.dht.records import Record, owner_bound_key, sign_record
from p2ptrain.dht.routing import Contact, NodeID
from p2ptrain.rpc.handlers import CallContext, Message
from p2ptrain.secure.identity import Identity, PeerID
from p2ptrain.wire.frames import pack_body

pytestmark = pytest.mark.timeout(60)


async def test_an_unsigned_plain_record_cannot_wipe_a_signed_dictionary(
    make_dht: DHTFactory,  # noqa: F811 - the fixture imported above
    make_node: NodeFactory,
) -> None:
    """The "dictionary wipe": a plain record under a shared dictionary's key,
    expiring after its entries, used to evict them all and block new ones."""
    alice, bob, carol = await swarm(make_dht, 3)
    attacker = await make_node()
    key = "run/progress"
    assert await alice.store(key, {"samples": 10}, alice.now() + 60, subkey=alice.owned_key("p"))
    wipe = Record(key.encode(), pack_body("wiped"), alice.now() + 3600)
    statuses = [(await raw_store(attacker, peer, wipe))[0] for peer in (alice, bob, carol)]
    progress = await carol.get_dictionary(key)
    assert [v.value for v in progress.values()] == [{"samples": 10}]
    assert all(s.outcome is StoreOutcome.REJECTED for s in statuses), statuses
    # New entries are not blocked either.
    assert await bob.store(key, {"samples": 20}, bob.now() + 30, subkey=bob.owned_key("p"))
    progress = await carol.get_dictionary(key)
    assert sorted(v.value["samples"] for v in progress.values()) == [10, 20]


async def test_a_signed_entry_displaces_an_unsigned_plain_record_stored_first(
    make_dht: DHTFactory,  # noqa: F811 - the fixture imported above
    make_node: NodeFactory,
) -> None:
    """Storing the plain record *before* the dictionary exists does not block it."""
    alice, bob, carol = await swarm(make_dht, 3)
    attacker = await make_node()
    key = "run/matchmaking"
    squat = Record(key.encode(), pack_body("mine"), alice.now() + 3600)
    for peer in (alice, bob, carol):
        (status,) = await raw_store(attacker, peer, squat)
        assert status.outcome is StoreOutcome.STORED
    assert await alice.store(key, {"a": 1}, alice.now() + 60, subkey=alice.owned_key("m"))
    found = await carol.get_dictionary(key)
    assert [v.value for v in found.values()] == [{"a": 1}]


FILLABLE = DHTConfig(max_value_bytes=1024, max_key_bytes=64, max_subkeys=32)
"""Room for 32 sub-keys: twice what one owner may sign (max_subkeys_per_owner, 16)."""


@pytest.mark.parametrize("signer", ["one identity", "unsigned"])
async def test_an_attacker_cannot_fill_a_shared_dictionary(
    make_dht: DHTFactory,  # noqa: F811 - the fixture imported above
    make_node: NodeFactory,
    signer: str,
) -> None:
    """One identity's owner-bound entries, or unsigned ones, used to fill a shared
    dictionary up to max_subkeys, after which honest peers' entries were refused."""
    alice, bob, carol = await swarm(make_dht, 3, dht=FILLABLE)
    attacker = await make_node()
    key = b"run/progress"
    exp = alice.now() + 3600
    mallory = Identity.generate()
    records = []
    for i in range(FILLABLE.max_subkeys):
        value = pack_body({"samples": 10**6})
        if signer == "unsigned":
            records.append(Record(key, value, exp, b"fill/%d" % i))
        else:
            sub = owner_bound_key(b"p%d" % i, mallory.public_key)
            signature = sign_record(mallory, key, sub, value, exp)
            records.append(Record(key, value, exp, sub, mallory.public_key, signature))
    for peer in (alice, bob, carol):
        statuses = await raw_store(attacker, peer, *records)
        stored = sum(s.outcome is StoreOutcome.STORED for s in statuses)
        # One owner gets its share and no more; unsigned entries all fit, for now.
        assert stored == (32 if signer == "unsigned" else 16), statuses
    # The dictionary is full (unsigned) or half full (one owner): an honest
    # peer's signed entry is still stored, displacing an unsigned one if need be.
    assert await bob.store(key, {"samples": 20}, bob.now() + 30, subkey=bob.owned_key("p"))
    found = await carol.get_dictionary(key)
    assert found[bob.owned_key("p")].value == {"samples": 20}
    assert len(found) == (32 if signer == "unsigned" else 17)


async def test_a_close_id_node_cannot_forge_an_unsigned_value(
    make_dht: DHTFactory,  # noqa: F811 - the fixture imported above
    make_node: NodeFactory,
) -> None:
    """A rogue whose id is the closest to the key answers every FIND with a forgery."""
    honest = await swarm(make_dht, 5)
    rogue = await make_node()
    rogue_id = NodeID.from_peer_id(rogue.peer_id)
    ids = [NodeID.from_peer_id(p.peer_id) for p in honest]
    key = next(
        k
        for k in (f"forge/{i}".encode() for i in range(100_000))
        if all(NodeID.from_key(k) ^ rogue_id < NodeID.from_key(k) ^ i for i in ids)
    )
    forged_served = [0]

    async def forge(ctx: CallContext, request: Message) -> Message:
        find = FindRequest.decode(request.body, max_key_bytes=512)
        contacts = tuple(
            c for p in honest for c in p.dht_node.routing_table if c.peer_id != ctx.peer
        )[:8]
        value = None
        if find.key is not None:
            forged_served[0] += 1
            value = Record(find.key, pack_body("forged"), honest[0].now() + 3000)
        body, payload = FindReply(contacts, value).encode(max_value_bytes=1 << 20)
        return Message(body, payload)

    await serve_rogue(rogue, forge)
    for peer in honest:  # the rogue introduces itself: it enters every routing table
        await rogue.call(peer.address, METHOD_PING, PingRequest(rogue.address.endpoint).encode())
    reader = await make_dht(honest[0], client_mode=True)  # learns of the rogue, too
    assert await honest[1].store(key, "honest", honest[1].now() + 60)
    results = []
    for _ in range(10):
        found = await reader.get(key)
        assert isinstance(found, ValueWithExpiration)
        results.append(found.value)
    assert forged_served[0] > 0  # the rogue was asked
    assert results == ["honest"] * 10


async def test_a_get_survives_a_flood_of_dead_contacts(
    make_dht: DHTFactory,  # noqa: F811 - the fixture imported above
    make_node: NodeFactory,
) -> None:
    """A rogue answers every FIND with 10,000 contacts next to the target that
    accept TCP and never answer; a healthy get must still finish in under 2 s."""
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # accept, never answer

    tar_pit = await asyncio.start_server(hold, "127.0.0.1", 0)
    pit = f"127.0.0.1:{tar_pit.sockets[0].getsockname()[1]}"
    rogue = await make_node()

    async def flood(ctx: CallContext, request: Message) -> Message:
        find = FindRequest.decode(request.body, max_key_bytes=512)
        rng = random.Random(int(find.target))
        dead = [
            Contact(PeerID((int(find.target) ^ rng.getrandbits(40)).to_bytes(32, "big")), pit)
            for _ in range(10_000)
        ]
        dead.sort(key=lambda c: c.node_id ^ find.target)
        body, payload = FindReply(tuple(dead), None).encode(max_value_bytes=1 << 20)
        return Message(body, payload)

    await serve_rogue(rogue, flood)
    try:
        honest = await swarm(make_dht, 4, request_timeout=5.0)
        for peer in honest:
            await rogue.call(
                peer.address, METHOD_PING, PingRequest(rogue.address.endpoint).encode()
            )
        assert await honest[1].store("signed", "s", honest[1].now() + 60, sign=True)
        assert await honest[1].store("unsigned", "u", honest[1].now() + 60)
        reader = await make_dht(honest[0], rogue, client_mode=True, request_timeout=5.0)
        for key, expected in (("signed", "s"), ("unsigned", "u")):
            started = time.perf_counter()
            found = await reader.get(key)
            elapsed = time.perf_counter() - started
            assert isinstance(found, ValueWithExpiration) and found.value == expected
            assert elapsed < 2.0, (key, elapsed)
    finally:
        for writer in held:
            writer.close()
        tar_pit.close()


async def test_a_caller_enters_the_routing_table_only_if_it_answers_where_it_claims(
    make_dht: DHTFactory,  # noqa: F811 - the fixture imported above
    make_node: NodeFactory,
) -> None:
    """An identity announcing a tar pit stays out of the table; a real peer gets in."""
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    tar_pit = await asyncio.start_server(hold, "127.0.0.1", 0)
    pit = f"127.0.0.1:{tar_pit.sockets[0].getsockname()[1]}"
    try:
        victim = await make_dht(request_timeout=0.5, verify_callers=True)
        sybil = await make_node()
        await sybil.call(victim.address, METHOD_PING, PingRequest(pit).encode(), timeout=5)
        await asyncio.wait_for(victim.dht_node.callers_verified(), 5)
        assert sybil.peer_id not in victim.dht_node.routing_table
        honest = await make_dht(victim)
        await asyncio.wait_for(victim.dht_node.callers_verified(), 5)
        assert honest.peer_id in victim.dht_node.routing_table
        assert len(victim.dht_node.routing_table) == 1
    finally:
        for writer in held:
            writer.close()
        tar_pit.close()


async def test_a_caller_that_answered_is_not_probed_again_at_each_request(
    make_dht: DHTFactory,  # noqa: F811 - the fixture imported above
) -> None:
    """A caller outside the table (its bucket full) was probed, a fresh connection and
    handshake, at every request it made: a large swarm's DHT spent most of its CPU so."""
    victim = await make_dht(verify_callers=True)
    caller = await make_dht(victim)
    await asyncio.wait_for(victim.dht_node.callers_verified(), 5)
    assert caller.peer_id in victim.dht_node.routing_table
    probes: list[object] = []
    probe = victim.node.probe

    async def counted(*args: Any, **kwargs: Any) -> Message:
        probes.append(args[0])
        return await probe(*args, **kwargs)

    victim.node.probe = counted  # type: ignore[method-assign]
    for _ in range(3):
        victim.dht_node.routing_table.remove(caller.peer_id)  # as if its bucket were full
        await caller.node.call(
            victim.address, METHOD_PING, PingRequest(caller.address.endpoint).encode(), timeout=5
        )
        await asyncio.wait_for(victim.dht_node.callers_verified(), 5)
        assert caller.peer_id in victim.dht_node.routing_table
    assert probes == []
