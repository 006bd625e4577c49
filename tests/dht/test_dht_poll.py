"""Polling a dictionary costs what changed: a ``latest`` read names the signed
entries it already holds, and the replicas leave them out of their replies."""

from __future__ import annotations

import pytest
from conftest import NodeFactory
from test_dht_node import (  # noqa: F401 - make_dht is a fixture
    DHTFactory,
    make_dht,
    swarm,
    while_storing,
)

from p2ptrain.dht.node import DHTNode
from p2ptrain.dht.protocol import (
    DIGEST_BYTES,
    MAX_KNOWN_ENTRIES,
    METHOD_FIND,
    FindReply,
    FindRequest,
    entry_digest,
    known_digests,
    omit_known,
)
from p2ptrain.dht.records import DictionaryRecord, Record, owner_bound_key, sign_record
from p2ptrain.errors import InvalidArgumentError, RemoteProtocolError
from p2ptrain.rpc.handlers import CallContext, Message
from p2ptrain.secure.identity import Identity

pytestmark = pytest.mark.timeout(60)

KEY = b"mm/step-1/g0"


def signed_entry(name: str, expiration: float, value: bytes = b"v") -> Record:
    identity = Identity.generate()
    subkey = owner_bound_key(name.encode(), identity.public_key)
    signature = sign_record(identity, KEY, subkey, value, expiration)
    return Record(KEY, value, expiration, subkey, identity.public_key, signature)


def dictionary(*records: Record) -> DictionaryRecord:
    return DictionaryRecord(KEY, {r.subkey or b"": r for r in records})


def test_a_digest_names_one_version_of_an_entry() -> None:
    first = signed_entry("a", 100.0)
    assert len(entry_digest(first)) == DIGEST_BYTES
    assert entry_digest(first) == entry_digest(first)
    renewed = Record(KEY, first.value, 101.0, first.subkey, first.owner, b"\x01" * 64)
    assert entry_digest(renewed) != entry_digest(first)


def test_known_entries_are_left_out_unsigned_ones_never_and_one_always_stays() -> None:
    a, b = signed_entry("a", 100.0), signed_entry("b", 200.0)
    unsigned = Record(KEY, b"u", 150.0, b"open")
    value = dictionary(a, b, unsigned)
    only_a = omit_known(value, entry_digest(a))
    assert isinstance(only_a, DictionaryRecord)
    assert set(only_a.entries) == {b.subkey, unsigned.subkey}
    signed_only = dictionary(a, b)
    rest = omit_known(signed_only, known_digests(signed_only))
    assert isinstance(rest, DictionaryRecord)
    assert list(rest.entries.values()) == [b]  # the one that expires last
    plain = Record(KEY, b"p", 100.0)
    assert omit_known(plain, entry_digest(a)) is plain
    assert omit_known(value, b"") is value


def test_known_digests_list_signed_entries_only() -> None:
    a, b = signed_entry("a", 100.0), signed_entry("b", 200.0)
    known = known_digests(dictionary(a, b, Record(KEY, b"u", 150.0, b"open")))
    assert known == entry_digest(b) + entry_digest(a)  # newest first
    assert known_digests(None) == b""
    assert known_digests(Record(KEY, b"p", 1.0)) == b""


def test_a_request_carries_its_known_digests() -> None:
    a = signed_entry("a", 100.0)
    body = FindRequest.for_key(KEY, "127.0.0.1:1", entry_digest(a)).encode()
    decoded = FindRequest.decode(body, max_key_bytes=64)
    assert decoded.known == entry_digest(a)
    assert "h" not in FindRequest.for_key(KEY).encode()


@pytest.mark.parametrize(
    "known",
    [b"\x00" * (DIGEST_BYTES + 1), b"\x00" * (DIGEST_BYTES * (MAX_KNOWN_ENTRIES + 1)), "text", 7],
)
def test_malformed_known_digests_are_refused(known: object) -> None:
    body = {"a": None, "k": KEY, "h": known}
    with pytest.raises(RemoteProtocolError, match="known entries"):
        FindRequest.decode(body, max_key_bytes=64)


async def test_a_poll_gets_only_the_new_entries_and_reads_the_whole_dictionary(
    make_dht: DHTFactory,  # noqa: F811 - the fixture imported above
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    key = "mm/step-1/g0"
    rows: list[int] = []
    serve = DHTNode._serve_find

    async def counting(self: DHTNode, ctx: CallContext, request: Message) -> Message:
        reply = await serve(self, ctx, request)
        if isinstance(request.body, dict) and request.body.get("k") == key.encode():
            decoded = FindReply.decode(
                reply.body, reply.payload, key=key.encode(), max_contacts=64, max_rows=64
            )
            if isinstance(decoded.value, DictionaryRecord):
                rows.append(len(decoded.value.entries))
        return reply

    monkeypatch.setattr(DHTNode, "_serve_find", counting)  # before the nodes bind it
    peers = await swarm(make_dht, 4)
    writers, reader = peers[:3], peers[3]
    for i, writer in enumerate(writers):
        assert await writer.store(key, {"i": i}, writer.now() + 60, subkey=writer.owned_key("m"))
    rows.clear()

    first = await reader.get_dictionary(key)
    assert sorted(v.value["i"] for v in first.values()) == [0, 1, 2]
    assert rows and max(rows) == 3  # the first read gets every entry
    rows.clear()
    again = await reader.get_dictionary(key)
    assert sorted(v.value["i"] for v in again.values()) == [0, 1, 2]
    assert rows and max(rows) == 1  # each replica sends one entry, not three
    rows.clear()
    late = peers[0]
    assert await late.store(key, {"i": 9}, late.now() + 90, subkey=late.owned_key("n"))
    third = await reader.get_dictionary(key)
    assert sorted(v.value["i"] for v in third.values()) == [0, 1, 2, 9]
    assert rows and max(rows) == 1  # only the new entry travelled


async def test_a_raw_find_with_known_digests_leaves_them_out(
    make_dht: DHTFactory,  # noqa: F811 - the fixture imported above
    make_node: NodeFactory,
) -> None:
    (holder,) = await swarm(make_dht, 1)
    key = "mm/step-1/g1"
    for name in ("a", "b", "c"):
        assert await holder.store(key, name, holder.now() + 60, subkey=holder.owned_key(name))
    caller = await make_node()

    async def find(known: bytes) -> DictionaryRecord:
        body = FindRequest.for_key(key.encode(), None, known).encode()
        reply = await caller.call(holder.address, METHOD_FIND, body, timeout=5)
        found = FindReply.decode(
            reply.body, reply.payload, key=key.encode(), max_contacts=64, max_rows=64
        ).value
        assert isinstance(found, DictionaryRecord)
        return found

    everything = await find(b"")
    assert len(everything.entries) == 3
    some = next(iter(everything.entries.values()))
    assert len((await find(entry_digest(some))).entries) == 2
    assert len((await find(known_digests(everything))).entries) == 1


@pytest.mark.parametrize("known", [b"\x00" * (DIGEST_BYTES + 1), "text"])
async def test_a_malformed_known_field_is_refused_while_others_are_served(
    make_dht: DHTFactory,  # noqa: F811 - the fixture imported above
    make_node: NodeFactory,
    known: object,
) -> None:
    victim, writer, reader = await swarm(make_dht, 3)
    key = "mm/step-1/g2"
    assert await victim.store(key, 1, victim.now() + 60, subkey=victim.owned_key("m"))
    attacker = await make_node()

    body = {"a": None, "k": key.encode(), "h": known}

    async def attack() -> None:
        for _ in range(3):
            with pytest.raises(InvalidArgumentError, match="known entries"):
                await attacker.call(victim.address, METHOD_FIND, body, timeout=5)
        found = await reader.get_dictionary(key)  # the victim still answers well-formed reads
        assert [v.value for v in found.values()] == [1]

    assert await while_storing(writer, reader, attack) >= 3
