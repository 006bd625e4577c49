"""Tests of DHT records: storage with expiration, owner-bound keys, signatures."""

from __future__ import annotations

import contextlib
import random
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.dht.config import DHTConfig
from p2ptrain.dht.records import (
    OWNER_MARKER,
    SIGNATURE_DOMAIN,
    DictionaryRecord,
    Record,
    key_owner,
    owner_bound_key,
    sign_record,
    signed_bytes,
    validate_for_read,
    verify_record,
)
from p2ptrain.dht.storage import (
    RecordStore,
    agreed_value,
    merge_values,
    rank,
    record_bytes,
)
from p2ptrain.errors import RecordRejectedError
from p2ptrain.secure.identity import Identity

CONFIG = DHTConfig(max_subkeys=4, max_records=50, max_value_bytes=1024, max_key_bytes=64)
NOW = 1_000_000.0
ALICE = Identity.from_seed(b"a" * 32)
BOB = Identity.from_seed(b"b" * 32)


def new_store(config: DHTConfig = CONFIG) -> RecordStore:
    return RecordStore(config=config)


def signed(
    identity: Identity, key: bytes, value: bytes, expiration: float, subkey: bytes | None = None
) -> Record:
    signature = sign_record(identity, key, subkey, value, expiration)
    return Record(key, value, expiration, subkey, identity.public_key, signature)


# plain values and expiration


def test_newest_expiration_wins() -> None:
    store = new_store()
    assert store.store(b"k", b"old", NOW + 10, NOW) is True
    assert store.store(b"k", b"new", NOW + 20, NOW) is True
    assert store.store(b"k", b"stale", NOW + 15, NOW) is False
    got = store.get(b"k", NOW)
    assert isinstance(got, Record)
    assert (got.value, got.expiration) == (b"new", NOW + 20)
    assert len(store) == 1


def test_same_record_twice_is_not_stored_again_and_ties_break_deterministically() -> None:
    store = new_store()
    assert store.store(b"k", b"v", NOW + 10, NOW) is True
    assert store.store(b"k", b"v", NOW + 10, NOW) is False
    first, second = new_store(), new_store()
    first.store(b"k", b"aaa", NOW + 10, NOW)
    first.store(b"k", b"bbb", NOW + 10, NOW)
    second.store(b"k", b"bbb", NOW + 10, NOW)
    second.store(b"k", b"aaa", NOW + 10, NOW)
    assert first.get(b"k", NOW) == second.get(b"k", NOW)


def test_expired_records_are_never_returned_and_evicted() -> None:
    store = new_store()
    store.store(b"short", b"v", NOW + 5, NOW)
    store.store(b"long", b"v", NOW + 50, NOW)
    store.store(b"d", b"x", NOW + 5, NOW, subkey=b"s1")
    store.store(b"d", b"y", NOW + 50, NOW, subkey=b"s2")
    assert store.get(b"short", NOW + 4.9) is not None
    assert store.get(b"short", NOW + 5) is None  # expiring at `now` means expired
    assert {r.subkey for r in store.records(NOW + 6)} == {None, b"s2"}
    assert len(store) == 4
    assert store.evict_expired(NOW + 6) == 2
    assert len(store) == 2
    assert sorted(store) == [b"d", b"long"]
    assert store.evict_expired(NOW + 6) == 0
    assert store.evict_expired(NOW + 100) == 2
    assert len(store) == 0 and list(store) == []


def test_replaced_records_are_not_evicted_by_their_old_expiration() -> None:
    store = new_store()
    store.store(b"k", b"v1", NOW + 5, NOW)
    store.store(b"k", b"v2", NOW + 50, NOW)
    assert store.evict_expired(NOW + 10) == 0
    got = store.get(b"k", NOW + 10)
    assert isinstance(got, Record) and got.value == b"v2"


@pytest.mark.parametrize(
    ("expiration", "message"),
    [
        (NOW, "expired already"),
        (NOW - 1, "expired already"),
        (NOW + CONFIG.max_expiration_horizon + 1, "ahead"),
        (float("nan"), "finite"),
        (float("inf"), "finite"),
        (10**400, "out of range"),
        (True, "number"),
        ("soon", "number"),
    ],
)
def test_bad_expirations_are_rejected(expiration: object, message: str) -> None:
    with pytest.raises(RecordRejectedError, match=message):
        new_store().store(b"k", b"v", expiration, NOW)  # type: ignore[arg-type]


def test_integer_expiration_is_accepted_as_float() -> None:
    store = new_store()
    assert store.store(b"k", b"v", int(NOW) + 10, NOW)
    got = store.get(b"k", NOW)
    assert isinstance(got, Record) and got.expiration == NOW + 10.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"key": b"k" * 65}, "key is 65 bytes"),
        ({"subkey": b"s" * 65}, "sub-key is 65 bytes"),
        ({"value": b"v" * 1025}, "value is 1025 bytes"),
        ({"key": "text"}, "key must be bytes"),
        ({"value": 5}, "value must be bytes"),
        ({"subkey": ["s"]}, "sub-key must be bytes"),
    ],
)
def test_oversized_or_mistyped_fields_are_rejected(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"key": b"k", "value": b"v", "subkey": None} | kwargs
    with pytest.raises(RecordRejectedError, match=message):
        new_store().store(
            args["key"],  # type: ignore[arg-type]
            args["value"],  # type: ignore[arg-type]
            NOW + 10,
            NOW,
            subkey=args["subkey"],  # type: ignore[arg-type]
        )


def test_limits_are_inclusive() -> None:
    store = new_store()
    assert store.store(b"k" * 64, b"v" * 1024, NOW + CONFIG.max_expiration_horizon, NOW)


# dictionaries


def test_subkeys_have_independent_expirations() -> None:
    store = new_store()
    store.store(b"d", b"1", NOW + 10, NOW, subkey=b"a")
    store.store(b"d", b"2", NOW + 30, NOW, subkey=b"b")
    assert store.store(b"d", b"1-old", NOW + 5, NOW, subkey=b"a") is False
    assert store.store(b"d", b"2-new", NOW + 40, NOW, subkey=b"b") is True
    got = store.get(b"d", NOW)
    assert isinstance(got, DictionaryRecord)
    assert {s: (r.value, r.expiration) for s, r in got.entries.items()} == {
        b"a": (b"1", NOW + 10),
        b"b": (b"2-new", NOW + 40),
    }
    assert got.expiration == NOW + 40
    later = store.get(b"d", NOW + 20)
    assert isinstance(later, DictionaryRecord)
    assert list(later.entries) == [b"b"]
    assert store.get(b"d", NOW + 40) is None


def test_too_many_subkeys_rejected_until_some_expire() -> None:
    store = new_store()
    for i in range(4):
        store.store(b"d", b"v", NOW + 10 + i, NOW, subkey=bytes([i]))
    with pytest.raises(RecordRejectedError, match="4 sub-keys"):
        store.store(b"d", b"v", NOW + 50, NOW, subkey=b"extra")
    assert store.store(b"d", b"v2", NOW + 60, NOW, subkey=b"\x00")  # replacing is fine
    assert store.store(b"d", b"v", NOW + 50, NOW + 11.5, subkey=b"extra")  # two expired
    got = store.get(b"d", NOW + 11.5)
    assert isinstance(got, DictionaryRecord)
    assert sorted(got.entries) == [b"\x00", b"\x02", b"\x03", b"extra"]


def test_store_capacity_is_enforced_after_evicting_expired() -> None:
    store = new_store(DHTConfig(max_records=3))
    store.store(b"a", b"v", NOW + 10, NOW)
    store.store(b"b", b"v", NOW + 100, NOW)
    store.store(b"c", b"v", NOW + 100, NOW)
    with pytest.raises(RecordRejectedError, match="full"):
        store.store(b"d", b"v", NOW + 100, NOW)
    assert store.store(b"a", b"newer", NOW + 100, NOW)  # replacing needs no room
    assert store.store(b"d", b"v", NOW + 200, NOW + 150)  # a, b, c expired meanwhile
    assert len(store) == 1


def test_a_later_record_cannot_change_a_keys_kind_without_outranking_it() -> None:
    """Plain vs dictionary: the first kind stays unless the newcomer outranks it."""
    store = new_store()
    store.store(b"k", b"x", NOW + 5, NOW, subkey=b"s")
    with pytest.raises(RecordRejectedError, match="holds a dictionary"):
        store.store(b"k", b"plain", NOW + 10, NOW)  # unsigned vs unsigned: refused
    assert store.get(b"k", NOW) == DictionaryRecord(b"k", {b"s": Record(b"k", b"x", NOW + 5, b"s")})
    assert store.store(b"k", b"plain", NOW + 10, NOW + 6)  # the entry expired: free again
    with pytest.raises(RecordRejectedError, match="holds a plain value"):
        store.store(b"k", b"y", NOW + 20, NOW + 6, subkey=b"t")
    assert len(store) == 1


def test_signed_records_displace_unsigned_ones_of_the_other_kind() -> None:
    """Rank 0 (unsigned) < 1 (signed) < 2 (signed by the owner the key or sub-key names)."""
    store = new_store()
    assert store.store(b"k", b"squat", NOW + 100, NOW)  # unsigned plain first
    sub = owner_bound_key(b"p", ALICE.public_key)
    entry = signed(ALICE, b"k", b"alice", NOW + 10, subkey=sub)
    assert [rank(Record(b"k", b"v", NOW + 1)), rank(signed(BOB, b"k", b"v", NOW + 1))] == [0, 1]
    assert rank(entry) == 2
    assert store.store_record(entry, NOW)  # the owner-bound entry displaces it
    assert store.get(b"k", NOW) == DictionaryRecord(b"k", {sub: entry})
    with pytest.raises(RecordRejectedError, match="holds a dictionary"):
        store.store_record(signed(BOB, b"k", b"wipe", NOW + 200), NOW)  # rank 1 < 2
    assert len(store) == 1


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([None, b"a", b"b", b"c"]),
            st.sampled_from([b"1", b"2", b"3"]),
            st.integers(1, 6),
        ),
        min_size=1,
        max_size=8,
    ),
    st.randoms(use_true_random=False),
)
def test_replicas_converge_whatever_the_arrival_order(
    pieces: list[tuple[bytes | None, bytes, int]], shuffler: random.Random
) -> None:
    # One kind per key: records of the other kind and equal rank are refused
    # (test_a_later_record_cannot_change_a_keys_kind_without_outranking_it).
    plain = pieces[0][0] is None
    records = [
        Record(b"k", value, NOW + exp, subkey)
        for subkey, value, exp in pieces
        if (subkey is None) == plain
    ]
    shuffled = list(records)
    shuffler.shuffle(shuffled)
    views = []
    for order in (records, shuffled, list(reversed(records))):
        store = new_store()
        for record in order:
            store.store_record(record, NOW)
        views.append([store.get(b"k", NOW + t) for t in (0, 2, 4, 6)])
    assert views[0] == views[1] == views[2]
    assert merge_values(records, now=NOW) == views[0][0]


# signed records


def test_canonical_signed_bytes_layout() -> None:
    owner = bytes(range(32))
    got = signed_bytes(b"key", b"sub", b"value", 1234.5, owner)
    expected = (
        b"p2ptrain/dht-record/v1\x00"
        + b"\x00\x00\x00\x03key"
        + b"\x01\x00\x00\x00\x03sub"
        + b"\x00\x00\x00\x05value"
        + bytes.fromhex("40934a0000000000")  # 1234.5 as big-endian binary64
        + owner
    )
    assert got == expected
    assert got.startswith(SIGNATURE_DOMAIN)
    plain = signed_bytes(b"key", None, b"", 1234, owner)
    assert plain == (
        SIGNATURE_DOMAIN
        + b"\x00\x00\x00\x03key"
        + b"\x00"
        + b"\x00\x00\x00\x00"
        + struct.pack(">d", 1234.0)
        + owner
    )


def test_signature_is_deterministic_ed25519_over_canonical_bytes() -> None:
    from p2ptrain.secure.identity import verify_signature

    signature = sign_record(ALICE, b"key", None, b"value", NOW + 10)
    assert signature == sign_record(ALICE, b"key", None, b"value", NOW + 10)
    message = signed_bytes(b"key", None, b"value", NOW + 10, ALICE.public_key)
    assert verify_signature(ALICE.public_key, signature, message)


def test_owner_bound_keys() -> None:
    key = owner_bound_key(b"progress", ALICE.public_key)
    assert key == b"progress" + OWNER_MARKER + ALICE.public_key
    assert key_owner(key) == ALICE.public_key
    assert key_owner(b"progress") is None
    assert key_owner(OWNER_MARKER + b"short") is None
    with pytest.raises(RecordRejectedError):
        owner_bound_key(b"x", b"too short")


def test_owner_bound_key_accepts_only_its_owners_valid_signature() -> None:
    key = owner_bound_key(b"state", ALICE.public_key)
    store = new_store()
    good = signed(ALICE, key, b"v", NOW + 10)
    assert verify_record(good)
    assert store.store_record(good, NOW)
    with pytest.raises(RecordRejectedError, match="must be signed"):
        store.store(key, b"evil", NOW + 20, NOW)
    with pytest.raises(RecordRejectedError, match="signed by"):
        store.store_record(signed(BOB, key, b"evil", NOW + 20), NOW)
    forged = Record(key, b"evil", NOW + 20, None, ALICE.public_key, good.signature)
    assert not verify_record(forged)
    with pytest.raises(RecordRejectedError, match="invalid signature"):
        store.store_record(forged, NOW)
    flipped = bytes([good.signature[0] ^ 1]) + good.signature[1:]  # type: ignore[index]
    with pytest.raises(RecordRejectedError, match="invalid signature"):
        store.store_record(Record(key, b"v", NOW + 10, None, ALICE.public_key, flipped), NOW)
    with pytest.raises(RecordRejectedError, match="64 bytes"):
        store.store_record(Record(key, b"v", NOW + 10, None, ALICE.public_key, b"short"), NOW)
    # Every entry of an owner-bound dictionary needs the key owner's signature too.
    key = owner_bound_key(b"table", ALICE.public_key)
    with pytest.raises(RecordRejectedError, match="must be signed"):
        store.store(key, b"v", NOW + 10, NOW, subkey=b"s")
    assert store.store_record(signed(ALICE, key, b"v", NOW + 30, subkey=b"s"), NOW)
    assert store.get(key, NOW) == DictionaryRecord(
        key, {b"s": signed(ALICE, key, b"v", NOW + 30, subkey=b"s")}
    )


def test_replayed_old_signed_record_loses_to_the_newer_one() -> None:
    key = owner_bound_key(b"state", ALICE.public_key)
    store = new_store()
    old = signed(ALICE, key, b"old", NOW + 10)
    new = signed(ALICE, key, b"new", NOW + 20)
    store.store_record(new, NOW)
    assert store.store_record(old, NOW) is False
    # Claiming a later expiration for the old value breaks the signature.
    replay = Record(key, b"old", NOW + 30, None, ALICE.public_key, old.signature)
    with pytest.raises(RecordRejectedError, match="invalid signature"):
        store.store_record(replay, NOW)
    assert store.get(key, NOW) == new


def test_owner_bound_subkey_protects_one_entry_of_a_shared_dictionary() -> None:
    store = new_store()
    alice_slot = owner_bound_key(b"peer", ALICE.public_key)
    assert store.store_record(signed(ALICE, b"group", b"hi", NOW + 10, alice_slot), NOW)
    assert store.store(b"group", b"anyone", NOW + 10, NOW, subkey=b"open")
    with pytest.raises(RecordRejectedError, match="sub-key is bound"):
        store.store_record(signed(BOB, b"group", b"evil", NOW + 20, alice_slot), NOW)
    with pytest.raises(RecordRejectedError, match="must be signed"):
        store.store(b"group", b"evil", NOW + 20, NOW, subkey=alice_slot)
    bob_slot = owner_bound_key(b"peer", BOB.public_key)
    assert store.store_record(signed(BOB, b"group", b"me too", NOW + 10, bob_slot), NOW)
    got = store.get(b"group", NOW)
    assert isinstance(got, DictionaryRecord)
    assert sorted(got.entries) == sorted([alice_slot, b"open", bob_slot])


def test_signatures_on_unbound_keys_are_optional_but_checked() -> None:
    store = new_store()
    assert store.store_record(signed(BOB, b"free", b"v", NOW + 10), NOW)
    with pytest.raises(RecordRejectedError, match="exactly when"):
        store.store(b"free", b"v", NOW + 20, NOW, owner=BOB.public_key)
    with pytest.raises(RecordRejectedError, match="exactly when"):
        store.store(b"free", b"v", NOW + 20, NOW, signature=b"s" * 64)
    with pytest.raises(RecordRejectedError, match="invalid signature"):
        store.store(b"free", b"v", NOW + 20, NOW, owner=BOB.public_key, signature=b"s" * 64)
    with pytest.raises(RecordRejectedError, match="32-byte"):
        store.store(b"free", b"v", NOW + 20, NOW, owner=b"o" * 31, signature=b"s" * 64)


# validation on read


def test_validate_for_read_accepts_good_values() -> None:
    key = owner_bound_key(b"state", ALICE.public_key)
    validate_for_read(signed(ALICE, key, b"v", NOW + 10), config=CONFIG, now=NOW)
    entries = {b"a": Record(b"d", b"1", NOW + 5, b"a"), b"b": Record(b"d", b"2", NOW + 6, b"b")}
    validate_for_read(DictionaryRecord(b"d", entries), config=CONFIG, now=NOW)


@pytest.mark.parametrize(
    "bad",
    [
        # forged signature on an owner-bound key
        Record(
            owner_bound_key(b"s", ALICE.public_key),
            b"evil",
            NOW + 10,
            None,
            ALICE.public_key,
            b"\x00" * 64,
        ),
        # owner-bound key signed by someone else
        signed(BOB, owner_bound_key(b"s", ALICE.public_key), b"evil", NOW + 10),
        # owner-bound key without a signature
        Record(owner_bound_key(b"s", ALICE.public_key), b"evil", NOW + 10),
        # expired
        Record(b"k", b"v", NOW - 1),
        # a plain value carrying a sub-key
        Record(b"k", b"v", NOW + 10, b"sub"),
        # a dictionary with one forged entry
        DictionaryRecord(
            b"d",
            {
                b"ok": Record(b"d", b"1", NOW + 5, b"ok"),
                owner_bound_key(b"p", ALICE.public_key): signed(
                    BOB, b"d", b"evil", NOW + 5, owner_bound_key(b"p", ALICE.public_key)
                ),
            },
        ),
        # an entry filed under the wrong sub-key or key
        DictionaryRecord(b"d", {b"x": Record(b"d", b"1", NOW + 5, b"y")}),
        DictionaryRecord(b"d", {b"x": Record(b"other", b"1", NOW + 5, b"x")}),
        # an empty or oversized dictionary
        DictionaryRecord(b"d", {}),
        DictionaryRecord(
            b"d", {bytes([i]): Record(b"d", b"", NOW + 5, bytes([i])) for i in range(5)}
        ),
        # not a value at all
        "garbage",
    ],
)
def test_validate_for_read_rejects_bad_values(bad: object) -> None:
    with pytest.raises(RecordRejectedError):
        validate_for_read(bad, config=CONFIG, now=NOW)  # type: ignore[arg-type]


def test_merge_values_from_several_nodes() -> None:
    a = DictionaryRecord(b"d", {b"x": Record(b"d", b"1", NOW + 5, b"x")})
    b = DictionaryRecord(
        b"d", {b"x": Record(b"d", b"2", NOW + 9, b"x"), b"y": Record(b"d", b"3", NOW + 7, b"y")}
    )
    merged = merge_values([a, b], now=NOW)
    assert isinstance(merged, DictionaryRecord)
    assert {s: r.value for s, r in merged.entries.items()} == {b"x": b"2", b"y": b"3"}
    assert merge_values([], now=NOW) is None
    with pytest.raises(RecordRejectedError, match="different keys"):
        merge_values([Record(b"p", b"v", NOW + 1), Record(b"q", b"v", NOW + 1)], now=NOW)


def test_records_iterates_everything_live_for_republishing() -> None:
    store = new_store()
    store.store(b"p", b"v", NOW + 10, NOW)
    store.store(b"d", b"1", NOW + 10, NOW, subkey=b"a")
    store.store(b"d", b"2", NOW + 3, NOW, subkey=b"b")
    assert {(r.key, r.subkey) for r in store.records(NOW)} == {
        (b"p", None),
        (b"d", b"a"),
        (b"d", b"b"),
    }
    assert {(r.key, r.subkey) for r in store.records(NOW + 5)} == {(b"p", None), (b"d", b"a")}


def test_eviction_heap_stays_bounded_under_churn() -> None:
    store = new_store()
    for i in range(5_000):
        store.store(b"k", str(i).encode(), NOW + 10 + i * 1e-3, NOW)
    assert len(store) == 1
    assert len(store._expiry) <= 2 * len(store) + 64  # white-box: garbage is bounded


# fuzzing: untrusted input only ever raises RecordRejectedError

_maybe_bytes = st.one_of(st.none(), st.binary(max_size=80))
_weird = st.one_of(
    st.none(),
    st.binary(max_size=80),
    st.text(max_size=5),
    st.integers(),
    st.floats(),
    st.booleans(),
    st.lists(st.integers(), max_size=2),
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    fields=st.fixed_dictionaries(
        {
            "key": st.one_of(st.binary(max_size=80), _weird),
            "value": st.one_of(st.binary(max_size=1100), _weird),
            "expiration": st.one_of(
                st.floats(allow_nan=True, allow_infinity=True),
                st.floats(NOW - 10, NOW + 2 * CONFIG.max_expiration_horizon),
                st.integers(-(10**20), 10**400),
                _weird,
            ),
            "subkey": st.one_of(_maybe_bytes, _weird),
            "owner": st.one_of(_maybe_bytes, st.just(ALICE.public_key), _weird),
            "signature": st.one_of(_maybe_bytes, st.binary(min_size=64, max_size=64), _weird),
        }
    ),
    owner_bound=st.booleans(),
)
def test_fuzzed_store_only_raises_record_rejected(
    fields: dict[str, Any], owner_bound: bool
) -> None:
    if owner_bound and isinstance(fields["key"], bytes):
        fields["key"] = owner_bound_key(fields["key"][:8], ALICE.public_key)
    store = new_store()
    try:
        stored = store.store(now=NOW, **fields)
    except RecordRejectedError:
        assert len(store) == 0
        return
    assert stored is True
    assert len(store) == 1
    assert store.get(fields["key"], NOW) is not None


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    data=st.lists(
        st.tuples(
            st.binary(max_size=3),
            st.one_of(st.none(), st.binary(max_size=2)),
            st.binary(max_size=3),
            st.floats(NOW - 5, NOW + 20),
        ),
        max_size=30,
    ),
    now_steps=st.lists(st.floats(0, 3), max_size=30),
)
def test_fuzzed_sequences_keep_store_consistent(
    data: list[tuple[bytes, bytes | None, bytes, float]], now_steps: list[float]
) -> None:
    store = new_store(DHTConfig(max_subkeys=3, max_records=10))
    now = NOW
    for i, (key, subkey, value, expiration) in enumerate(data):
        now += now_steps[i] if i < len(now_steps) else 0.0
        with contextlib.suppress(RecordRejectedError):
            store.store(key, value, expiration, now, subkey=subkey)
        if i % 5 == 0:
            store.evict_expired(now)
        assert len(store) <= 10
        for record in store.records(now):
            assert record.expiration > now
        for k in store:
            got = store.get(k, now)
            if isinstance(got, DictionaryRecord):
                assert 0 < len(got) <= 3
                assert all(r.expiration > now for r in got)
            elif got is not None:
                assert got.expiration > now
    store.evict_expired(now + 1e6)
    assert len(store) == 0


def test_storage_is_capped_in_bytes_in_all_and_per_source() -> None:
    config = DHTConfig(max_value_bytes=1024, max_store_bytes=4000, max_bytes_per_source=2500)
    store = new_store(config)
    size = record_bytes(Record(b"k0", b"v" * 1000, NOW + 10))
    assert store.store(b"k0", b"v" * 1000, NOW + 10, NOW, source="10.0.0.1")
    assert store.store(b"k1", b"v" * 1000, NOW + 10, NOW, source="10.0.0.1")
    assert store.source_bytes("10.0.0.1") == 2 * size
    with pytest.raises(RecordRejectedError, match=r"records of 10\.0\.0\.1"):
        store.store(b"k2", b"v" * 1000, NOW + 10, NOW, source="10.0.0.1")
    assert store.store(b"k1", b"w" * 1000, NOW + 20, NOW, source="10.0.0.1")  # a replacement fits
    assert store.store(b"k2", b"v" * 1000, NOW + 10, NOW, source="10.0.0.2")
    with pytest.raises(RecordRejectedError, match="4000 bytes"):
        store.store(b"k3", b"v" * 1000, NOW + 10, NOW)  # the node's own record: only the total
    assert store.store(b"k3", b"v" * 1000, NOW + 30, NOW + 15)  # k0 and k2 expired
    assert store.stored_bytes == 2 * size and store.source_bytes("10.0.0.2") == 0


def test_agreed_value_drops_unsigned_records_of_a_minority() -> None:
    honest, forged = Record(b"k", b"v", NOW + 10), Record(b"k", b"forged", NOW + 50)
    assert agreed_value([forged, honest, honest], now=NOW) == honest
    assert agreed_value([forged, honest], now=NOW) is None  # no majority: nothing
    assert agreed_value([forged], now=NOW) == forged  # one reply is its own majority
    good = signed(ALICE, b"k", b"a", NOW + 20)
    newer = signed(BOB, b"k", b"b", NOW + 30)
    assert agreed_value([good, newer, forged], now=NOW) == newer  # signatures need no vote
    a = Record(b"d", b"1", NOW + 10, b"a")
    b = Record(b"d", b"2", NOW + 10, b"b")
    got = agreed_value(
        [DictionaryRecord(b"d", {b"a": a, b"b": b}), DictionaryRecord(b"d", {b"a": a})],
        now=NOW,
    )
    assert got == DictionaryRecord(b"d", {b"a": a})  # b is carried by half: not more
