"""The networked DHT over real loopback TCP: the value API, signed records, client
mode, bootstrap, timers, and every kind of bad input (a healthy peer is served
while each attack runs; the bad record is never stored)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import msgpack
import pytest
from conftest import NodeFactory, while_serving_healthy
from hypothesis import given, settings
from hypothesis import strategies as st

import p2ptrain.dht
from p2ptrain.dht import DHT, DHTConfig, DHTNodeConfig, DictionaryValue, ValueWithExpiration
from p2ptrain.dht.node import _outlived
from p2ptrain.dht.protocol import (
    METHOD_FIND,
    METHOD_PING,
    METHOD_STORE,
    FindReply,
    FindRequest,
    PingReply,
    PingRequest,
    StoreOutcome,
    StoreReply,
    StoreRequest,
    StoreStatus,
    decode_contacts,
)
from p2ptrain.dht.records import DictionaryRecord, Record, owner_bound_key, sign_record
from p2ptrain.dht.routing import Contact, NodeID
from p2ptrain.dht.standing import run_standing_dht_node
from p2ptrain.errors import (
    ConfigError,
    InvalidArgumentError,
    LookupFailedError,
    RecordRejectedError,
    RemoteProtocolError,
)
from p2ptrain.node.config import NodeConfig
from p2ptrain.node.node import Node
from p2ptrain.rpc.handlers import CallContext, Message
from p2ptrain.secure.identity import Identity, PeerID
from p2ptrain.testing.clock import ManualClock

START = 1_700_000_000.0
SMALL = DHTConfig(max_value_bytes=1024, max_key_bytes=64, max_subkeys=8)


DHTFactory = Callable[..., Coroutine[Any, Any, DHT]]


@pytest.fixture
async def make_dht() -> AsyncIterator[DHTFactory]:
    """Start DHT peers on loopback; all are closed when the test ends."""
    started: list[DHT] = []

    async def factory(
        *join: DHT | Node | str,
        client_mode: bool = False,
        dht: DHTConfig = SMALL,
        clock: Callable[[], float] = time.time,
        request_timeout: float = 2.0,
        ping_timeout: float = 1.0,
        maintenance_interval: float = 3600.0,
        identity: Identity | None = None,
        **node_config: Any,
    ) -> DHT:
        peers = tuple(p if isinstance(p, str) else str(p.address) for p in join)
        config = DHTNodeConfig(
            dht=dht,
            client_mode=client_mode,
            initial_peers=peers,
            request_timeout=request_timeout,
            ping_timeout=min(ping_timeout, request_timeout),
            maintenance_interval=maintenance_interval,
            **node_config,
        )
        peer = DHT(identity=identity, config=config, clock=clock)
        await peer.start()
        started.append(peer)
        return peer

    yield factory
    for peer in reversed(started):
        await peer.aclose()


async def swarm(make_dht: DHTFactory, count: int, **kwargs: Any) -> list[DHT]:
    first = await make_dht(**kwargs)
    peers = [first]
    for _ in range(count - 1):
        peers.append(await make_dht(first, **kwargs))
    return peers


async def while_storing(writer: DHT, reader: DHT, attack: Callable[[], Awaitable[None]]) -> int:
    """Run ``attack`` while ``writer`` stores and ``reader`` gets; every operation must succeed."""

    async def store_and_get(n: int) -> None:
        key = f"healthy/{n}"
        assert await writer.store(key, n, writer.now() + 60)
        found = await reader.get(key)
        assert isinstance(found, ValueWithExpiration) and found.value == n

    return await while_serving_healthy(store_and_get, attack, at_least=3)


def signed(
    identity: Identity, key: bytes, value: bytes, exp: float, subkey: bytes | None = None
) -> Record:
    signature = sign_record(identity, key, subkey, value, exp)
    return Record(key, value, exp, subkey, identity.public_key, signature)


async def raw_store(attacker: Node, victim: DHT, *records: Record) -> tuple[StoreStatus, ...]:
    body, payload = StoreRequest(records).encode()
    reply = await attacker.call(victim.address, METHOD_STORE, body, payload, timeout=5)
    return StoreReply.decode(reply.body, expected=len(records)).statuses


async def serve_rogue(
    node: Node, find: Callable[[CallContext, Message], Awaitable[Message]]
) -> None:
    """Make ``node`` look like a server-mode DHT peer whose FIND is ``find``."""

    async def ping(ctx: CallContext, request: Message) -> Message:
        return Message(PingReply(client_mode=False).encode())

    node.handlers.add_unary(METHOD_PING, ping)
    node.handlers.add_unary(METHOD_FIND, find)


# -- the public API --------------------------------------------------------------------------


def test_public_api_is_pinned() -> None:
    assert sorted(p2ptrain.dht.__all__) == [
        "DHT",
        "DHTConfig",
        "DHTNode",
        "DHTNodeConfig",
        "DictionaryValue",
        "ValueWithExpiration",
        "owner_bound_key",
        "run_standing_dht_node",
    ]


def test_node_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="ping_timeout"):
        DHTNodeConfig(ping_timeout=20.0)
    with pytest.raises(ConfigError, match="bad address"):
        DHTNodeConfig(initial_peers=("nonsense",))
    with pytest.raises(ConfigError, match="sequence"):
        DHTNodeConfig(initial_peers="127.0.0.1:1")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="request_timeout"):
        DHTNodeConfig(request_timeout=0)
    assert DHTNodeConfig(initial_peers=["127.0.0.1:5"]).initial_peers == ("127.0.0.1:5",)  # type: ignore[arg-type]


async def test_store_and_get_plain_values_across_peers(make_dht: DHTFactory) -> None:
    peers = await swarm(make_dht, 6, dht=DHTConfig(replicas=2, max_value_bytes=4096))
    values: list[Any] = [1, "text", b"\x00bytes", [1, 2.5, None], {"nested": {"a": [True]}}]
    for i, value in enumerate(values):
        assert await peers[i].store(f"key/{i}", value, peers[i].now() + 60) is True
    for peer in peers:
        for i, value in enumerate(values):
            found = await peer.get(f"key/{i}")
            assert isinstance(found, ValueWithExpiration)
            assert found.value == value and found.owner is None
    assert await peers[0].get("never/stored") is None
    assert await peers[0].get("never/stored", latest=True) is None
    # exactly `replicas` peers hold each value
    holders = sum(p.dht_node.records.get(b"key/0", p.now()) is not None for p in peers)
    assert holders == 2


async def test_newest_expiration_wins_and_expired_is_never_returned(make_dht: DHTFactory) -> None:
    clock = ManualClock(START)
    a, b, c = await swarm(make_dht, 3, clock=clock)
    assert await a.store("k", "old", START + 10)
    assert await b.store("k", "new", START + 20)
    assert await c.store("k", "stale", START + 15) is False  # every replica kept "new"
    for peer in (a, b, c):
        found = await peer.get("k", latest=True)
        assert isinstance(found, ValueWithExpiration)
        assert (found.value, found.expiration) == ("new", START + 20)
    clock.advance(20)  # now == expiration: expired
    for peer in (a, b, c):
        assert await peer.get("k") is None
        assert await peer.get("k", latest=True) is None
    await a.dht_node.maintain()
    assert len(a.dht_node.records) == 0


async def test_dictionary_entries_expire_on_their_own(make_dht: DHTFactory) -> None:
    clock = ManualClock(START)
    a, b, c = await swarm(make_dht, 3, clock=clock)
    assert await a.store("group", {"rank": 0}, START + 10, subkey="alice")
    assert await b.store("group", {"rank": 1}, START + 30, subkey="bob")
    found = await c.get_dictionary("group")
    assert isinstance(found, DictionaryValue)
    assert dict(found) == {
        b"alice": ValueWithExpiration({"rank": 0}, START + 10),
        b"bob": ValueWithExpiration({"rank": 1}, START + 30),
    }
    assert found.expiration == START + 30
    plain_view = await c.get("group")
    assert isinstance(plain_view, DictionaryValue) and len(plain_view) == 2
    clock.advance(15)
    assert set(await c.get_dictionary("group")) == {b"bob"}
    clock.advance(20)
    assert await c.get("group") is None
    assert len(await c.get_dictionary("group")) == 0


async def test_owned_keys_are_signed_and_only_their_owner_writes(make_dht: DHTFactory) -> None:
    alice, bob, carol = await swarm(make_dht, 3)
    key = alice.owned_key("alice/state")
    assert await alice.store(key, {"step": 7}, alice.now() + 60)
    found = await carol.get(key, latest=True)
    assert isinstance(found, ValueWithExpiration)
    assert found.value == {"step": 7} and found.owner == alice.public_key
    with pytest.raises(RecordRejectedError, match="owner-bound"):
        await bob.store(key, {"step": 999}, bob.now() + 120)
    # A shared dictionary where every peer writes only its own entry.
    for peer, samples in ((alice, 10), (bob, 20)):
        sub = peer.owned_key("progress")
        assert await peer.store("run/progress", {"samples": samples}, peer.now() + 60, subkey=sub)
    with pytest.raises(RecordRejectedError, match="owner-bound"):
        await bob.store(
            "run/progress", {"samples": 0}, bob.now() + 90, subkey=alice.owned_key("progress")
        )
    progress = await carol.get_dictionary("run/progress")
    assert {v.owner: v.value["samples"] for v in progress.values()} == {
        alice.public_key: 10,
        bob.public_key: 20,
    }
    # sign=True signs an ordinary key too
    assert await bob.store("plain", 1, bob.now() + 60, sign=True)
    found = await carol.get("plain")
    assert isinstance(found, ValueWithExpiration) and found.owner == bob.public_key


async def test_local_checks_reject_bad_records_before_sending(make_dht: DHTFactory) -> None:
    a, _ = await swarm(make_dht, 2)
    now = a.now()
    with pytest.raises(RecordRejectedError, match="value is"):
        await a.store("big", b"x" * 2000, now + 60)
    with pytest.raises(RecordRejectedError, match="key is"):
        await a.store("k" * 100, 1, now + 60)
    with pytest.raises(RecordRejectedError, match="expired"):
        await a.store("late", 1, now - 1)
    with pytest.raises(RecordRejectedError, match="ahead"):
        await a.store("far", 1, now + 10 * 24 * 3600)
    with pytest.raises(RecordRejectedError, match="finite"):
        await a.store("nan", 1, float("nan"))
    with pytest.raises(RecordRejectedError, match="number"):
        await a.store("when", 1, "tomorrow")  # type: ignore[arg-type]
    with pytest.raises(RecordRejectedError, match="range"):
        await a.store("when", 1, 10**400)
    with pytest.raises(ConfigError):
        await a.get(b"k" * 100)
    assert all(len(p.dht_node.records) == 0 for p in (a,))


# -- bad records sent straight to a peer ---------------------------------------------------


async def test_bad_records_are_refused_one_by_one(
    make_dht: DHTFactory, make_node: NodeFactory
) -> None:
    writer, reader, victim = await swarm(make_dht, 3)
    attacker = await make_node()
    alice, mallory = Identity.generate(), Identity.generate()
    now = victim.now()
    owned = owner_bound_key(b"alice", alice.public_key)
    good = signed(alice, owned, b"\xa2ok", now + 60)
    forged = Record(good.key, b"\xa4evil", good.expiration, None, good.owner, good.signature)
    impostor = signed(mallory, owned, b"\xa4evil", now + 60)  # alice's key, mallory's signature
    unsigned = Record(owned, b"\xa4evil", now + 60)
    no_owner = Record(b"plain", b"\x01", now + 60, None, None, good.signature)
    oversized = Record(b"big", b"x" * 5000, now + 60)
    past = Record(b"past", b"\x01", now - 5)
    far = Record(b"far", b"\x01", now + 30 * 24 * 3600)
    bad_sub = signed(
        mallory, b"dict", b"\x01", now + 60, subkey=owner_bound_key(b"s", alice.public_key)
    )

    async def attack() -> None:
        statuses = await raw_store(
            attacker,
            victim,
            forged,
            impostor,
            unsigned,
            no_owner,
            oversized,
            past,
            far,
            bad_sub,
            good,
        )
        outcomes = [s.outcome for s in statuses]
        assert outcomes == [StoreOutcome.REJECTED] * 8 + [StoreOutcome.STORED]
        reasons = [s.reason for s in statuses[:8]]
        assert "invalid signature" in reasons[0]
        assert "signed by" in reasons[1]
        assert "must be signed" in reasons[2]
        assert "owner exactly when" in reasons[3]
        assert "value is 5000 bytes" in reasons[4]
        assert "expired" in reasons[5]
        assert "ahead" in reasons[6]
        assert "sub-key is bound" in reasons[7]
        again = await raw_store(attacker, victim, good)
        assert again[0].outcome is StoreOutcome.HELD

    assert await while_storing(writer, reader, attack) >= 3
    store = victim.dht_node.records
    for key in (b"big", b"past", b"far", b"plain", b"dict"):
        assert store.get(key, victim.now()) is None
    assert store.get(owned, victim.now()) == good


MALFORMED: list[tuple[str, Any, bytes]] = [
    (METHOD_PING, "hello", b""),
    (METHOD_PING, {"a": b"127.0.0.1:1"}, b""),
    (METHOD_PING, {"a": "peer@127.0.0.1:1"}, b""),
    (METHOD_PING, {"a": "x" * 1000}, b""),
    (METHOD_FIND, None, b""),
    (METHOD_FIND, {"t": b"short"}, b""),
    (METHOD_FIND, {"k": 5}, b""),
    (METHOD_FIND, {"k": b"k" * 1000}, b""),
    (METHOD_FIND, {"a": "no-port", "t": b"\x00" * 32}, b""),
    (METHOD_STORE, [], b""),
    (METHOD_STORE, {"r": "rows"}, b""),
    (METHOD_STORE, {"r": []}, b""),
    (METHOD_STORE, {"r": [[b"k"]]}, b""),
    (METHOD_STORE, {"r": [[b"k", None, 5, 1.0, None, None]]}, b"abc"),  # lengths != payload
    (METHOD_STORE, {"r": [[b"k", None, -1, 1.0, None, None]]}, b""),
    (METHOD_STORE, {"r": [[b"k", None, 1, "soon", None, None]]}, b"x"),
    (METHOD_STORE, {"r": [["k", None, 1, 1.0, None, None]]}, b"x"),
    (METHOD_STORE, {"r": [[b"k", 7, 1, 1.0, None, None]]}, b"x"),
    (METHOD_STORE, {"r": [[b"k", None, 1, True, None, None]]}, b"x"),
    (METHOD_STORE, {"r": [[b"k", None, 1, 1.0, "owner", None]]}, b"x"),
    (METHOD_STORE, {"r": [[b"k", None, 1, 1.0, None, None]] * 5000}, b"x" * 5000),
]


async def test_malformed_requests_get_typed_errors(
    make_dht: DHTFactory, make_node: NodeFactory
) -> None:
    writer, reader, victim = await swarm(make_dht, 3)
    attacker = await make_node()

    async def attack() -> None:
        for method, body, payload in MALFORMED:
            with pytest.raises(InvalidArgumentError, match="malformed DHT message"):
                await attacker.call(victim.address, method, body, payload, timeout=5)

    assert await while_storing(writer, reader, attack) >= 3
    assert attacker.peer_id not in victim.dht_node.routing_table
    assert victim.dht_node.records.get(b"k", victim.now()) is None


async def test_forged_or_garbage_replies_are_not_believed(
    make_dht: DHTFactory, make_node: NodeFactory
) -> None:
    honest = await make_dht()
    alice = Identity.generate()
    owned = owner_bound_key(b"alice", alice.public_key)
    exp = honest.now() + 60
    real = signed(alice, owned, msgpack.packb("real"), exp)
    assert honest.dht_node.records.store_record(real, honest.now())
    forged_value = Record(
        owned, msgpack.packb("forged"), exp + 10, None, alice.public_key, real.signature
    )
    replies: list[tuple[Any, bytes]] = [
        FindReply((), forged_value).encode(max_value_bytes=1 << 20),
        FindReply((), signed(Identity.generate(), owned, b"\xa1x", exp + 10)).encode(
            max_value_bytes=1 << 20
        ),
        ({"n": "garbage"}, b""),
        ({"n": [], "r": [[None, 10, exp, None, None]]}, b"short"),
    ]
    for body, payload in replies:
        rogue = await make_node()

        async def find(
            ctx: CallContext, request: Message, body: Any = body, payload: bytes = payload
        ) -> Message:
            return Message(body, payload)

        await serve_rogue(rogue, find)
        reader = await make_dht(rogue, honest, client_mode=True)
        found = await reader.get(owned, latest=True)
        assert isinstance(found, ValueWithExpiration) and found.value == "real"
        assert reader.peer_id not in honest.dht_node.routing_table  # client mode


async def test_thousands_of_bogus_contacts_are_capped(
    make_dht: DHTFactory, make_node: NodeFactory
) -> None:
    k = 8
    config = DHTConfig(k=k, max_value_bytes=1024)
    writer, reader = await swarm(make_dht, 2, dht=config)
    assert await writer.store("wanted", "value", writer.now() + 60)
    # A TCP server that counts how often anybody dials a bogus contact.
    dials = 0

    async def count(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal dials
        dials += 1
        w.close()

    sink = await asyncio.start_server(count, "127.0.0.1", 0)
    sink_port = sink.sockets[0].getsockname()[1]
    bogus = [[Identity.generate().peer_id.digest, f"127.0.0.1:{sink_port}"] for _ in range(5000)]
    rogue = await make_node()
    answered = asyncio.Event()

    async def flood(ctx: CallContext, request: Message) -> Message:
        answered.set()
        return Message({"n": bogus})

    await serve_rogue(rogue, flood)
    victim = await make_dht(rogue, writer, client_mode=True, dht=config, request_timeout=1.0)

    async def attack() -> None:
        found = await victim.get("wanted", latest=True)
        assert isinstance(found, ValueWithExpiration) and found.value == "value"
        await victim.store("from-victim", 1, victim.now() + 60)

    try:
        assert await while_storing(writer, reader, attack) >= 3
    finally:
        sink.close()
        await sink.wait_closed()
    assert answered.is_set()
    # Each lookup takes at most k contacts from one reply: the rogue answered a
    # handful of lookups (bootstrap, get, store), never 5000 dials.
    assert 0 < dials <= 6 * k
    assert len(victim.dht_node.routing_table) <= 2 + k


async def test_a_peer_that_stops_answering_mid_lookup(
    make_dht: DHTFactory, make_node: NodeFactory
) -> None:
    writer, reader = await swarm(make_dht, 2)
    assert await writer.store("k", "v", writer.now() + 60)
    # `silent` answers its first FIND, then never again; `dying` drops every
    # connection (RST) while a FIND to it is in flight.
    silent, dying = await make_node(), await make_node()
    hung, died = asyncio.Event(), asyncio.Event()

    async def goes_silent(ctx: CallContext, request: Message) -> Message:
        if not hung.is_set():
            hung.set()
            return Message({"n": []})
        await asyncio.Event().wait()  # answers nothing, ever
        raise AssertionError("unreachable")

    async def dies(ctx: CallContext, request: Message) -> Message:
        died.set()
        for conn in dying.connections():
            conn.transport.close()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    await serve_rogue(silent, goes_silent)
    await serve_rogue(dying, dies)
    timeout = 0.3
    victim = await make_dht(silent, dying, writer, client_mode=True, request_timeout=timeout)

    async def attack() -> None:
        for latest in (True, False, True):
            started = time.perf_counter()
            found = await victim.get("k", latest=latest)
            assert isinstance(found, ValueWithExpiration) and found.value == "v"
            assert time.perf_counter() - started < 5 * timeout

    assert await while_storing(writer, reader, attack) >= 3
    assert hung.is_set() and died.is_set()


def count_finds(peer: DHT) -> list[int]:
    """Count the FIND requests ``peer`` serves from now on (in the returned one-item list)."""
    served = [0]
    serve = peer.dht_node._serve_find

    async def counting(ctx: CallContext, request: Message) -> Message:
        served[0] += 1
        return await serve(ctx, request)

    peer.node.handlers.remove(METHOD_FIND)
    peer.node.handlers.add_unary(METHOD_FIND, counting)
    return served


def key_closer_to(near: PeerID, far: PeerID, prefix: str = "key") -> bytes:
    a, b = NodeID.from_peer_id(near), NodeID.from_peer_id(far)
    return next(
        key
        for key in (f"{prefix}/{i}".encode() for i in range(100_000))
        if NodeID.from_key(key) ^ a < NodeID.from_key(key) ^ b
    )


async def test_a_plain_get_asks_one_peer_first(make_dht: DHTFactory) -> None:
    servers = await swarm(make_dht, 3)
    reader = await make_dht(servers[0], client_mode=True)
    # A signed value needs one reply; all three servers hold it.
    assert await servers[1].store("k", "v", servers[1].now() + 60, sign=True)
    counters = [count_finds(s) for s in servers]
    found = await reader.get("k")
    assert isinstance(found, ValueWithExpiration) and found.value == "v"
    assert sum(c[0] for c in counters) == 1  # the closest answered with the value
    assert await reader.get("k", latest=True) == found
    assert sum(c[0] for c in counters) == 1 + 3  # latest asks every replica
    # An unsigned value is only believed when a quorum (3) of replicas agree.
    assert await servers[1].store("u", "v", servers[1].now() + 60)
    before = sum(c[0] for c in counters)
    found = await reader.get("u")
    assert isinstance(found, ValueWithExpiration) and found.value == "v"
    assert sum(c[0] for c in counters) - before == 3


async def test_a_plain_get_does_not_wait_for_a_silent_closest_peer(
    make_dht: DHTFactory, make_node: NodeFactory
) -> None:
    silent = await make_node()

    async def black_hole(ctx: CallContext, request: Message) -> Message:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    await serve_rogue(silent, black_hole)
    writer = await make_dht()
    key = key_closer_to(silent.peer_id, writer.peer_id)
    assert await writer.store(key, "v", writer.now() + 60, sign=True)  # one reply suffices
    timeout, hedge = 0.5, 0.05
    reader = await make_dht(
        silent, writer, client_mode=True, request_timeout=timeout, hedge_delay=hedge
    )
    assert silent.peer_id in reader.dht_node.routing_table
    started = time.perf_counter()
    found = await reader.get(key)
    elapsed = time.perf_counter() - started
    assert isinstance(found, ValueWithExpiration) and found.value == "v"
    assert hedge <= elapsed < timeout  # the hedge fired, not the request timeout


async def test_entries_expiring_in_transit_are_dropped_not_blamed(make_dht: DHTFactory) -> None:
    server = await make_dht(clock=ManualClock(START))
    assert await server.store("group", "soon gone", START + 3, subkey="old")
    assert await server.store("group", "fresh", START + 60, subkey="new")
    assert await server.store("plain", "soon gone", START + 3)
    reader = await make_dht(server, client_mode=True, clock=ManualClock(START + 5))
    group = await reader.get_dictionary("group")
    assert dict(group) == {b"new": ValueWithExpiration("fresh", START + 60)}
    assert await reader.get("plain") is None
    assert server.peer_id in reader.dht_node.routing_table


async def test_a_full_bucket_pings_its_oldest_contact_and_evicts_the_dead(
    make_dht: DHTFactory,
) -> None:
    config = DHTConfig(k=2, relaxed_split=False, max_value_bytes=1024)
    a = await make_dht(dht=config)
    own_half = a.dht_node.node_id >> 255

    def far_identity() -> Identity:
        while True:
            identity = Identity.generate()
            if NodeID.from_peer_id(identity.peer_id) >> 255 != own_half:
                return identity

    table = a.dht_node.routing_table
    dead = [far_identity() for _ in range(2)]
    for identity in dead:  # nobody listens on port 1
        table.add_or_update(Contact(identity.peer_id, "127.0.0.1:1"), a.now())
    pinged = asyncio.Event()
    ping = a.dht_node._ping_oldest

    async def observed(contact: Contact) -> None:
        await ping(contact)
        pinged.set()

    a.dht_node._ping_oldest = observed  # type: ignore[method-assign]
    live = await make_dht(a, dht=config, identity=far_identity())
    await asyncio.wait_for(pinged.wait(), 5)
    assert live.peer_id in table  # promoted from the replacement cache
    assert dead[0].peer_id not in table  # the oldest did not answer its ping
    assert dead[1].peer_id in table


# -- client mode and bootstrap ---------------------------------------------------------------


async def test_client_mode_peers_never_enter_routing_tables(make_dht: DHTFactory) -> None:
    servers = await swarm(make_dht, 4)
    client = await make_dht(servers[0], client_mode=True)
    exp = client.now() + 60
    assert await client.store("from-client", [1, 2], exp)
    assert await servers[3].get("from-client") == ValueWithExpiration([1, 2], exp)
    found = await client.get("from-client")
    assert isinstance(found, ValueWithExpiration) and found.value == [1, 2]
    assert await servers[2].store("from-server", "s", servers[2].now() + 60)
    assert (await client.get("from-server")) is not None
    for server in servers:
        assert client.peer_id not in server.dht_node.routing_table
        assert client.peer_id not in {p.peer_id for p in server.known_peers()}
    assert len(client.dht_node.records) == 0
    assert {p.peer_id for p in client.known_peers()} == {s.peer_id for s in servers}


async def test_peers_joining_at_once_through_one_peer_learn_of_each_other(
    make_dht: DHTFactory,
) -> None:
    """A greeting is answered once the greeted peer checked the caller's address
    (verify_callers), so each join lookup finds the peers that joined before it."""
    # The library's timeouts (the factory's are short): the check, a dial back
    # and a handshake, took over the factory's 1 s wait on a loaded machine.
    patient = {"request_timeout": 5.0, "ping_timeout": 3.0}
    first = await make_dht(**patient)
    assert first.dht_node.config.verify_callers  # the default
    joiners = await asyncio.gather(*(make_dht(first, **patient) for _ in range(4)))
    peers = [first, *joiners]
    for peer in peers:
        await asyncio.wait_for(peer.dht_node.callers_verified(), 5)
    for peer in peers:
        assert {c.peer_id for c in peer.dht_node.routing_table} == {
            p.peer_id for p in peers if p is not peer
        }, peer.peer_id.short


async def test_bootstrap_from_plain_address_and_failures(
    make_dht: DHTFactory, make_node: NodeFactory
) -> None:
    first = await make_dht()
    second = await make_dht(first.address.endpoint)  # no peer id: learned in the handshake
    assert [p.peer_id for p in second.known_peers()] == [first.peer_id]
    await asyncio.wait_for(first.dht_node.callers_verified(), 5)  # first dialled second back
    assert second.peer_id in first.dht_node.routing_table
    lonely = await make_dht()  # no initial peers: a new network of one
    exp = lonely.now() + 60
    assert await lonely.store("k", 1, exp)
    assert await lonely.get("k") == ValueWithExpiration(1, exp)
    assert await lonely.get("k", latest=True) == ValueWithExpiration(1, exp)
    dead = await make_node()
    dead_address = str(dead.address)
    await dead.aclose()
    with pytest.raises(LookupFailedError, match="initial peers"):
        await make_dht(dead_address, request_timeout=1.0)
    client = DHT(config=DHTNodeConfig(client_mode=True))
    async with client:
        with pytest.raises(LookupFailedError):
            await client.get("anything")
        with pytest.raises(LookupFailedError):
            await client.store("anything", 1, client.now() + 60)


async def test_run_standing_dht_node(make_dht: DHTFactory) -> None:
    announced: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    identity = Identity.generate()
    task = asyncio.create_task(
        run_standing_dht_node(
            NodeConfig(port=0),
            DHTNodeConfig(),
            identity=identity,
            announce=announced.set_result,
            stop=stop,
        )
    )
    address = await asyncio.wait_for(announced, 10)
    assert address.startswith(f"{identity.peer_id}@127.0.0.1:")
    a = await make_dht(address)
    b = await make_dht(address)
    assert await a.store("hello", "world", a.now() + 60)
    assert (await b.get("hello")) is not None
    stop.set()
    await asyncio.wait_for(task, 10)


# -- timers ----------------------------------------------------------------------------------


async def test_republish_moves_records_to_new_closest_peers(make_dht: DHTFactory) -> None:
    clock = ManualClock(START)
    config = DHTConfig(replicas=1, republish_interval=600, refresh_interval=10_000)
    a = await make_dht(dht=config, clock=clock, max_records_per_request=2)
    newcomer_identity = Identity.generate()
    key = key_closer_to(newcomer_identity.peer_id, a.peer_id)
    dict_key = key_closer_to(newcomer_identity.peer_id, a.peer_id, prefix="dict")
    assert await a.store(key, "v", START + 3000)
    for i in range(5):  # republished in three STORE requests of at most 2 records
        assert await a.store(dict_key, i, START + 3000, subkey=f"s{i}")
    newcomer = await make_dht(
        a, dht=config, clock=clock, identity=newcomer_identity, max_records_per_request=2
    )
    assert newcomer.dht_node.records.get(key, clock()) is None
    await asyncio.wait_for(a.dht_node.callers_verified(), 5)  # a learns of the newcomer
    await a.dht_node.maintain()  # not yet time to republish
    assert newcomer.dht_node.records.get(key, clock()) is None
    clock.advance(601)
    await a.dht_node.maintain()
    held = newcomer.dht_node.records.get(key, clock())
    assert isinstance(held, Record) and held.expiration == START + 3000
    dictionary = newcomer.dht_node.records.get(dict_key, clock())
    assert isinstance(dictionary, DictionaryRecord) and len(dictionary) == 5


async def test_idle_buckets_are_refreshed(make_dht: DHTFactory) -> None:
    clock = ManualClock(START)
    config = DHTConfig(refresh_interval=100, k=4)
    peers = await swarm(make_dht, 6, dht=config, clock=clock)
    table = peers[0].dht_node.routing_table
    assert not table.buckets_needing_refresh(clock())
    clock.advance(150)
    assert table.buckets_needing_refresh(clock())
    await peers[0].dht_node.maintain()
    assert not table.buckets_needing_refresh(clock())
    assert all(b.last_updated == clock() for b in table.buckets)


async def test_the_timer_loop_runs_maintenance(make_dht: DHTFactory) -> None:
    peer = await make_dht(maintenance_interval=0.01)
    ran = asyncio.Event()
    original = peer.dht_node.maintain

    async def observed(now: float | None = None) -> None:
        await original(now)
        ran.set()

    peer.dht_node.maintain = observed  # type: ignore[method-assign]
    await asyncio.wait_for(ran.wait(), 5)


# -- the wire schema (pure) ------------------------------------------------------------------


def test_messages_round_trip() -> None:
    peer = Contact(Identity.generate().peer_id, "127.0.0.1:4000")
    ping = PingRequest("127.0.0.1:1")
    assert PingRequest.decode(ping.encode()) == ping
    assert PingReply.decode(PingReply(True).encode()) == PingReply(True)
    find = FindRequest.for_key(b"key", None)
    assert FindRequest.decode(find.encode(), max_key_bytes=64) == find
    node_find = FindRequest(NodeID(12345), None, "[::1]:5")
    assert FindRequest.decode(node_find.encode(), max_key_bytes=64) == node_find
    plain = Record(b"key", b"value", 123.5)
    body, payload = FindReply((peer,), plain).encode(max_value_bytes=100)
    got = FindReply.decode(body, payload, key=b"key", max_contacts=20, max_rows=8)
    assert got == FindReply((peer,), plain)
    entries = {s: Record(b"key", s * 3, 100.0 + len(s), s) for s in (b"a", b"bb", b"ccc")}
    body, payload = FindReply((), DictionaryRecord(b"key", entries)).encode(max_value_bytes=100)
    got = FindReply.decode(body, memoryview(payload), key=b"key", max_contacts=20, max_rows=8)
    assert isinstance(got.value, DictionaryRecord) and dict(got.value.entries) == entries
    # a budget keeps the entries that expire last
    body, payload = FindReply((), DictionaryRecord(b"key", entries)).encode(max_value_bytes=15)
    got = FindReply.decode(body, payload, key=b"key", max_contacts=20, max_rows=8)
    assert isinstance(got.value, DictionaryRecord) and set(got.value.entries) == {b"ccc", b"bb"}
    records = (plain, Record(b"other", b"", 5.0, b"sub", b"o" * 32, b"s" * 64))
    body, payload = StoreRequest(records, "127.0.0.1:9").encode()
    assert StoreRequest.decode(body, payload, max_records=10) == StoreRequest(
        records, "127.0.0.1:9"
    )
    statuses = (StoreStatus(StoreOutcome.STORED), StoreStatus(StoreOutcome.REJECTED, "why"))
    assert StoreReply.decode(StoreReply(statuses).encode(), expected=2).statuses == statuses
    with pytest.raises(RemoteProtocolError):
        StoreReply.decode(StoreReply(statuses).encode(), expected=3)
    with pytest.raises(RemoteProtocolError):  # a value in a FIND_NODE reply
        FindReply.decode(
            *FindReply((), plain).encode(max_value_bytes=100), key=None, max_contacts=20, max_rows=8
        )


def test_contact_lists_are_read_only_up_to_the_cap() -> None:
    good = [[Identity.generate().peer_id.digest, f"127.0.0.1:{1000 + i}"] for i in range(30)]
    flood: list[Any] = good + ["not even a contact"] * 100_000
    contacts = decode_contacts(flood, cap=20)
    assert len(contacts) == 20 and contacts[0].address == "127.0.0.1:1000"
    for bad in ([[b"short", "127.0.0.1:1"]], [[b"\x00" * 32, "nohost"]], [[b"\x00" * 32]], "x"):
        with pytest.raises(RemoteProtocolError):
            decode_contacts(bad, cap=20)
    assert (
        decode_contacts([[PeerID(b"\x01" * 32).digest, "[::1]:80"]], cap=1)[0].address == "[::1]:80"
    )


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.binary(max_size=40)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=7)
        | st.dictionaries(st.sampled_from(["a", "r", "n", "k", "t", "s", "c"]), inner, max_size=5)
    ),
    max_leaves=30,
)


@settings(max_examples=200, deadline=None)
@given(body=msgpack_values, payload=st.binary(max_size=64))
def test_decoders_reject_garbage_with_protocol_errors_only(body: Any, payload: bytes) -> None:
    decoders: list[Callable[[], object]] = [
        lambda: PingRequest.decode(body),
        lambda: PingReply.decode(body),
        lambda: FindRequest.decode(body, max_key_bytes=64),
        lambda: FindReply.decode(body, payload, key=b"k", max_contacts=20, max_rows=8),
        lambda: FindReply.decode(body, payload, key=None, max_contacts=20, max_rows=8),
        lambda: StoreRequest.decode(body, payload, max_records=16),
        lambda: StoreReply.decode(body, expected=2),
        lambda: decode_contacts(body, cap=20),
    ]
    for decode in decoders:
        with contextlib.suppress(RemoteProtocolError):  # anything else fails the test
            decode()


def test_a_query_woken_at_its_patience_end_counts_as_outlived_despite_rounding() -> None:
    # 511.749... + 0.5 rounds down: exactly compared, the woken lookup found
    # 0.5 s not yet over, slept 0 s, and spun (forever on the virtual clock).
    started, patience = 511.74921327834824, 0.5
    woken = started + patience
    assert woken - started < patience
    assert _outlived(started, patience, woken)
    assert not _outlived(started, patience, started + 0.499)


async def test_a_dictionary_read_again_asks_only_its_closest_replicas(make_dht: DHTFactory) -> None:
    """A matchmaking dictionary is polled until its group is complete; every poll
    was a lookup from scratch that wanted 20 values."""
    peers = await swarm(make_dht, 8)
    writer, reader, late = peers[1], peers[2], peers[3]
    assert await writer.store("group", 1, writer.now() + 60, subkey="a")
    assert set(await reader.get_dictionary("group")) == {b"a"}
    before = reader.dht_node.stats.sent.get(METHOD_FIND, 0)
    assert await late.store("group", 2, late.now() + 60, subkey="b")
    assert set(await reader.get_dictionary("group")) == {b"a", b"b"}
    assert reader.dht_node.stats.sent.get(METHOD_FIND, 0) - before <= 3  # get_quorum
    for peer in peers:  # the holders gone, a read looks the key up again
        if peer not in (writer, reader):
            await peer.aclose()
    assert set(await reader.get_dictionary("group")) == {b"a", b"b"}  # writer's and our copy


async def test_a_slow_peer_a_lookup_gave_up_on_is_skipped_only_until_it_answers(
    make_dht: DHTFactory,
) -> None:
    """A lookup moves on from a query after its patience (0.5 s here) and
    later lookups skip that address; a peer that answers late (its uplink
    busy with a tensor) is slow, not silent, and is skipped no longer."""
    servers = await swarm(make_dht, 3, request_timeout=3.0)
    slow = servers[2]
    serve = slow.dht_node._serve_find

    async def late(ctx: CallContext, request: Message) -> Message:
        await asyncio.sleep(0.9)
        return await serve(ctx, request)

    reader = await make_dht(*servers, client_mode=True, request_timeout=3.0)
    slow.node.handlers.remove(METHOD_FIND)
    slow.node.handlers.add_unary(METHOD_FIND, late)
    node = reader.dht_node
    loop = asyncio.get_running_loop()
    started = loop.time()
    await node.find_nodes(NodeID.from_peer_id(slow.peer_id))
    assert loop.time() - started < 0.9  # the lookup did not wait for the slow peer
    address = slow.address.endpoint  # as contacts name it
    assert node._unresponsive.get(address, loop.time()) is True
    # The query it gave up on runs on in the background until it answers.
    stragglers = [t for t in node._tasks if t.get_name().startswith("dht-straggler")]
    assert stragglers
    await asyncio.wait_for(asyncio.gather(*stragglers), timeout=5.0)
    assert node._unresponsive.get(address, loop.time()) is None
