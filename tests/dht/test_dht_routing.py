"""Tests of the pure Kademlia routing table."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.dht.config import DHTConfig
from p2ptrain.dht.routing import (
    ID_BITS,
    AddStatus,
    Contact,
    NodeID,
    RoutingTable,
)
from p2ptrain.errors import ConfigError
from p2ptrain.secure.identity import Identity, PeerID

TOP = 1 << (ID_BITS - 1)  # ids with the top bit set are in the far half from id 0


def contact(node_id: int, address: str | None = None) -> Contact:
    """A contact whose NodeID is exactly ``node_id``."""
    return Contact(PeerID(node_id.to_bytes(32, "big")), address or f"addr-{node_id:x}")


def table(own: int = 0, **overrides: object) -> RoutingTable:
    config = DHTConfig(**overrides)  # type: ignore[arg-type]
    return RoutingTable(NodeID(own), config=config, rng=random.Random(7), now=0.0)


def ids_of(contacts: object) -> list[int]:
    return [c.node_id for c in contacts]  # type: ignore[attr-defined]


def check_invariants(t: RoutingTable, k: int) -> None:
    views = t.buckets
    assert views[0].lo == 0
    assert views[-1].hi == 1 << ID_BITS
    for left, right in itertools.pairwise(views):
        assert left.hi == right.lo
    for view in views:
        size = view.hi - view.lo
        assert size & (size - 1) == 0, "bucket ranges are powers of two"
        assert view.lo % size == 0, "bucket ranges are aligned"
        assert len(view.contacts) <= k
        for c in (*view.contacts, *view.replacements):
            assert view.lo <= c.node_id < view.hi
    assert len(t) == len(list(t)) == sum(len(v.contacts) for v in views)


# NodeID


def test_node_id_from_peer_id_is_big_endian_digest() -> None:
    identity = Identity.from_seed(bytes(32))
    node_id = NodeID.from_peer_id(identity.peer_id)
    assert node_id == int.from_bytes(identity.peer_id.digest, "big")
    assert node_id.to_bytes32() == identity.peer_id.digest
    assert NodeID.from_bytes32(node_id.to_bytes32()) == node_id


def test_node_id_distance_and_bucket_index() -> None:
    a, b = NodeID(0b1010), NodeID(0b0110)
    assert a.distance(b) == 0b1100 == b.distance(a)
    assert a.bucket_index(b) == 3
    assert a.bucket_index(a) == -1
    assert NodeID(0).bucket_index(TOP) == 255


@pytest.mark.parametrize("bad", [-1, 1 << 256, True, "5"])
def test_node_id_rejects_out_of_range(bad: object) -> None:
    with pytest.raises(ConfigError):
        NodeID(bad)  # type: ignore[arg-type]


def test_node_id_from_bytes32_rejects_wrong_length() -> None:
    with pytest.raises(ConfigError):
        NodeID.from_bytes32(b"\x01" * 31)


def test_node_id_from_key_is_sha256() -> None:
    import hashlib

    assert NodeID.from_key(b"abc").to_bytes32() == hashlib.sha256(b"abc").digest()


# adding, updating, ignoring


def test_add_then_update_moves_to_tail_with_new_address_and_time() -> None:
    t = table(k=3)
    for n in (TOP + 1, TOP + 2, TOP + 3):
        assert t.add_or_update(contact(n), now=1.0).status is AddStatus.ADDED
    result = t.add_or_update(contact(TOP + 1, "new-address"), now=5.0)
    assert result.status is AddStatus.UPDATED
    assert ids_of(t.buckets[0].contacts) == [TOP + 2, TOP + 3, TOP + 1]
    updated = t.get(contact(TOP + 1).peer_id)
    assert updated is not None
    assert updated.address == "new-address"
    assert updated.last_seen == 5.0
    assert len(t) == 3


def test_client_mode_and_own_id_are_never_added() -> None:
    t = table(own=42)
    assert t.add_or_update(contact(TOP), 0.0, client_mode=True).status is AddStatus.IGNORED
    assert t.add_or_update(contact(42), 0.0).status is AddStatus.IGNORED
    assert len(t) == 0
    assert contact(TOP).peer_id not in t
    assert t.nearest(TOP, 5) == []


def test_own_bucket_splits_when_full() -> None:
    k = 4
    t = table(own=0, k=k)
    own_half = [1 + i for i in range(k)]  # very close to own id 0
    far_half = [TOP + i for i in range(k)]
    for n in far_half + own_half:
        assert t.add_or_update(contact(n), 0.0).status is AddStatus.ADDED
    assert len(t) == 2 * k
    assert len(t.buckets) >= 2
    check_invariants(t, k)
    # The far half was never split: it does not hold our id and its contacts are
    # not among our k closest.
    assert t.buckets[-1].lo == TOP and t.buckets[-1].hi == 1 << ID_BITS


def test_full_far_bucket_asks_to_ping_oldest_and_caches_newcomer() -> None:
    t = table(own=0, k=2)
    first, second, newcomer = contact(TOP + 1), contact(TOP + 2), contact(TOP + 3)
    t.add_or_update(first, 1.0)
    t.add_or_update(second, 2.0)
    result = t.add_or_update(newcomer, 3.0)
    assert result.status is AddStatus.PING_NEEDED
    assert result.ping == first
    assert newcomer.peer_id not in t
    far = t.buckets[-1]
    assert ids_of(far.replacements) == [TOP + 3]
    # A second newcomer while the ping is pending is cached without a new ping.
    assert t.add_or_update(contact(TOP + 4), 3.5).status is AddStatus.CACHED
    assert ids_of(t.buckets[-1].replacements) == [TOP + 3, TOP + 4]


def test_ping_alive_keeps_old_contact_and_moves_it_to_tail() -> None:
    t = table(own=0, k=2)
    first, second = contact(TOP + 1), contact(TOP + 2)
    t.add_or_update(first, 1.0)
    t.add_or_update(second, 2.0)
    result = t.add_or_update(contact(TOP + 3), 3.0)
    assert result.ping == first
    assert t.on_ping_result(first.peer_id, alive=True, now=4.0) is None
    far = t.buckets[-1]
    assert ids_of(far.contacts) == [TOP + 2, TOP + 1]
    assert far.contacts[-1].last_seen == 4.0
    assert ids_of(far.replacements) == [TOP + 3]  # kept for later
    # The next newcomer triggers a ping of the new oldest entry.
    again = t.add_or_update(contact(TOP + 5), 5.0)
    assert again.status is AddStatus.PING_NEEDED
    assert again.ping == second


def test_ping_dead_evicts_and_promotes_most_recent_replacement() -> None:
    t = table(own=0, k=2)
    first = contact(TOP + 1)
    t.add_or_update(first, 1.0)
    t.add_or_update(contact(TOP + 2), 2.0)
    t.add_or_update(contact(TOP + 3), 3.0)
    t.add_or_update(contact(TOP + 4), 4.0)
    promoted = t.on_ping_result(first.peer_id, alive=False, now=5.0)
    assert promoted is not None
    assert promoted.node_id == TOP + 4
    assert first.peer_id not in t
    assert ids_of(t.buckets[-1].contacts) == [TOP + 2, TOP + 4]
    assert ids_of(t.buckets[-1].replacements) == [TOP + 3]
    assert len(t) == 2


def test_ping_is_asked_again_after_ping_timeout() -> None:
    t = table(own=0, k=1, ping_timeout=10.0)
    t.add_or_update(contact(TOP + 1), 0.0)
    assert t.add_or_update(contact(TOP + 2), 1.0).status is AddStatus.PING_NEEDED
    assert t.add_or_update(contact(TOP + 3), 5.0).status is AddStatus.CACHED
    late = t.add_or_update(contact(TOP + 4), 11.5)
    assert late.status is AddStatus.PING_NEEDED
    assert late.ping is not None and late.ping.node_id == TOP + 1


def test_ping_result_for_unknown_contact_is_harmless() -> None:
    t = table(own=0, k=2)
    t.add_or_update(contact(TOP + 1), 0.0)
    assert t.on_ping_result(contact(TOP + 9).peer_id, alive=False, now=1.0) is None
    assert len(t) == 1


def test_replacement_cache_is_bounded_and_drops_oldest() -> None:
    t = table(own=0, k=1, replacement_cache_size=3)
    t.add_or_update(contact(TOP), 0.0)
    for i in range(1, 8):
        t.add_or_update(contact(TOP + i), float(i))
    assert ids_of(t.buckets[-1].replacements) == [TOP + 5, TOP + 6, TOP + 7]


def test_mark_failed_removes_after_max_failures_and_promotes() -> None:
    t = table(own=0, k=2, max_failures=3)
    victim = contact(TOP + 1)
    t.add_or_update(victim, 0.0)
    t.add_or_update(contact(TOP + 2), 0.0)
    t.add_or_update(contact(TOP + 3), 0.0)  # cached replacement
    assert t.mark_failed(victim.peer_id) is False
    assert t.mark_failed(victim.peer_id) is False
    assert victim.peer_id in t
    assert t.mark_failed(victim.peer_id) is True
    assert victim.peer_id not in t
    assert contact(TOP + 3).peer_id in t
    assert len(t) == 2


def test_success_resets_failure_count() -> None:
    t = table(own=0, k=2, max_failures=2)
    victim = contact(TOP + 1)
    t.add_or_update(victim, 0.0)
    assert t.mark_failed(victim.peer_id) is False
    t.add_or_update(victim, 1.0)  # heard from it again
    assert t.mark_failed(victim.peer_id) is False
    assert victim.peer_id in t


def test_failed_replacement_is_dropped_at_once_and_unknown_is_ignored() -> None:
    t = table(own=0, k=1)
    t.add_or_update(contact(TOP), 0.0)
    t.add_or_update(contact(TOP + 1), 0.0)
    assert t.mark_failed(contact(TOP + 1).peer_id) is True
    assert t.buckets[-1].replacements == ()
    assert t.mark_failed(contact(TOP + 2).peer_id) is False


def test_remove_contact_promotes_and_remove_unknown_is_false() -> None:
    t = table(own=0, k=1)
    t.add_or_update(contact(TOP), 0.0)
    t.add_or_update(contact(TOP + 1), 0.0)
    assert t.remove(contact(TOP).peer_id) is True
    assert ids_of(t) == [TOP + 1]
    assert t.remove(contact(TOP).peer_id) is False
    assert t.remove(contact(TOP + 1).peer_id) is True
    assert len(t) == 0


def test_relaxed_split_keeps_new_close_contact_in_far_bucket() -> None:
    # The far half holds two contacts in its upper quarter; a newcomer in its lower
    # quarter is closer to us than both, so it is among our k=2 closest.
    far_a, far_b, close = TOP + (TOP >> 1), TOP + (TOP >> 1) + 1, TOP + 1
    relaxed = table(own=0, k=2)
    strict = table(own=0, k=2, relaxed_split=False)
    for t in (relaxed, strict):
        t.add_or_update(contact(far_a), 0.0)
        t.add_or_update(contact(far_b), 0.0)
    assert relaxed.add_or_update(contact(close), 1.0).status is AddStatus.ADDED
    assert strict.add_or_update(contact(close), 1.0).status is AddStatus.PING_NEEDED
    check_invariants(relaxed, 2)
    assert len(relaxed.buckets) == 3


def test_split_promotes_replacements_into_halves_with_room() -> None:
    t = table(own=0, k=2)
    upper_a, upper_b = TOP + (TOP >> 1) + 1, TOP + (TOP >> 1) + 2
    lower_cached, lower_new = TOP + 5, TOP + 6
    for n in (1, 2, upper_a, upper_b):  # own half holds our 2 closest
        t.add_or_update(contact(n), 0.0)
    # The far bucket is full and the newcomer is not among our 2 closest: cached.
    assert t.add_or_update(contact(lower_cached), 1.0).status is AddStatus.PING_NEEDED
    t.remove(contact(1).peer_id)
    t.remove(contact(2).peer_id)
    # Now a far newcomer is among our 2 closest: the far bucket splits, and the
    # cached contact lands in the lower half, which has room: it is promoted.
    assert t.add_or_update(contact(lower_new), 2.0).status is AddStatus.ADDED
    check_invariants(t, 2)
    assert set(ids_of(t)) == {upper_a, upper_b, lower_cached, lower_new}
    assert all(not view.replacements for view in t.buckets)


def test_buckets_needing_refresh_returns_ids_inside_stale_buckets() -> None:
    t = table(own=0, k=2, refresh_interval=100.0)
    for n in (TOP + 1, TOP + 2, 1, 2, 3):
        t.add_or_update(contact(n), 0.0)
    assert t.buckets_needing_refresh(50.0) == []
    stale = t.buckets_needing_refresh(150.0)
    views = t.buckets
    assert len(stale) == len(views)
    for target, view in zip(stale, views, strict=True):
        assert view.lo <= target < view.hi
    t.add_or_update(contact(TOP + 1), 120.0)  # activity in the far bucket
    t.touch(0, 120.0)  # a lookup went to our own bucket
    remaining = t.buckets_needing_refresh(150.0)
    assert len(remaining) == len(views) - 2
    assert all(target < TOP for target in remaining)  # not in the far bucket
    own_bucket = t.buckets[0]
    assert all(not own_bucket.lo <= target < own_bucket.hi for target in remaining)


def test_refresh_ids_are_deterministic_for_a_seeded_rng() -> None:
    a, b = table(own=5), table(own=5)
    assert a.buckets_needing_refresh(1e6) == b.buckets_needing_refresh(1e6)


# nearest


def test_nearest_orders_by_xor_distance_and_excludes() -> None:
    t = table(own=0, k=20)
    ids = [TOP + 8, TOP + 1, 5, 6, 7, TOP + 2]
    for n in ids:
        t.add_or_update(contact(n), 0.0)
    target = TOP + 3
    assert ids_of(t.nearest(target, 3)) == [TOP + 2, TOP + 1, TOP + 8]
    assert ids_of(t.nearest(target, 2, exclude=[contact(TOP + 2).peer_id])) == [
        TOP + 1,
        TOP + 8,
    ]
    assert ids_of(t.nearest(target, 100)) == sorted(ids, key=lambda n: n ^ target)
    assert t.nearest(target, 0) == []


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    own=st.integers(0, (1 << 256) - 1),
    seed=st.integers(0, 2**32),
    count=st.integers(1, 40),
    k=st.integers(1, 8),
    clustered=st.booleans(),
)
def test_nearest_matches_brute_force(
    own: int, seed: int, count: int, k: int, clustered: bool
) -> None:
    rng = random.Random(seed)
    t = table(own=own, k=k)
    for _ in range(300):
        # Clustered ids share long prefixes with our own id: deep splits.
        n = own ^ rng.getrandbits(rng.randrange(1, 256)) if clustered else rng.getrandbits(256)
        if n != own:
            t.add_or_update(contact(n), 0.0)
    check_invariants(t, k)
    held = ids_of(t)
    excluded = set(rng.sample(held, min(3, len(held))))
    for target in (rng.getrandbits(256), own, held[0]):
        expected = sorted((n for n in held if n not in excluded), key=lambda n: n ^ target)
        got = t.nearest(target, count, exclude=[contact(n).peer_id for n in excluded])
        assert ids_of(got) == expected[:count]


@settings(max_examples=40, deadline=None, derandomize=True)
@given(own=st.integers(0, (1 << 256) - 1), seed=st.integers(0, 2**32), k=st.integers(1, 6))
def test_relaxed_split_keeps_the_k_closest_to_own_id(own: int, seed: int, k: int) -> None:
    rng = random.Random(seed)
    t = table(own=own, k=k)
    inserted = []
    for _ in range(200):
        n = own ^ rng.getrandbits(rng.randrange(1, 256))
        if n != own:
            inserted.append(n)
            t.add_or_update(contact(n), 0.0)
    closest = sorted(set(inserted), key=lambda n: n ^ own)[:k]
    assert set(closest) <= set(ids_of(t))
    check_invariants(t, k)


# -- one operator's addresses cannot fill a bucket ----------------------------------------------


def test_a_bucket_takes_at_most_two_contacts_of_one_public_subnet() -> None:
    t = table(k=20)
    added = [
        t.add_or_update(contact(TOP + i, f"1.2.3.{i}:4000"), now=1.0).status for i in range(10)
    ]
    # The same /24 through other spellings: another port, an IPv4-mapped IPv6 address.
    added.append(t.add_or_update(contact(TOP + 50, "1.2.3.99:5000"), now=1.0).status)
    added.append(t.add_or_update(contact(TOP + 51, "[::ffff:1.2.3.77]:4000"), now=1.0).status)
    six = [f"[2a00:1450:4001:81a::{i:x}]:4000" for i in range(1, 6)]
    added += [t.add_or_update(contact(TOP + 60 + i, a), now=1.0).status for i, a in enumerate(six)]
    others = ["1.2.4.1:4000", "5.6.7.8:4000", "[2a00:1450:4001:81b::1]:4000"]
    for i, address in enumerate(others):
        assert t.add_or_update(contact(TOP + 100 + i, address), now=1.0).status is AddStatus.ADDED
    assert len(t) == 2 + 2 + len(others)  # two of the /24, two of the /64, the others
    assert added.count(AddStatus.CROWDED) == 8 + 2 + 3
    assert t.get(contact(TOP + 2).peer_id) is None  # not cached as a replacement either
    # The first two stay; a repeat of a known contact is an update, not a newcomer.
    assert t.add_or_update(contact(TOP, "1.2.3.0:4000"), now=2.0).status is AddStatus.UPDATED


def test_local_and_private_addresses_are_not_capped() -> None:
    t = table(k=20)
    addresses = [f"127.0.0.1:{4000 + i}" for i in range(5)]
    addresses += [f"192.168.1.{i}:4000" for i in range(5)]
    addresses += [f"node-{i}.example:4000" for i in range(3)]  # host names: not parsed
    for i, address in enumerate(addresses):
        assert t.add_or_update(contact(TOP + i, address), now=1.0).status is AddStatus.ADDED
    assert len(t) == len(addresses)
    off = table(k=20, max_per_subnet=None)
    for i in range(5):
        off.add_or_update(contact(TOP + i, f"1.2.3.{i}:4000"), now=1.0)
    assert len(off) == 5
    with pytest.raises(ConfigError):
        DHTConfig(max_per_subnet=0)


def test_a_replacement_of_a_full_subnet_is_not_promoted() -> None:
    t = table(k=2, relaxed_split=False)
    assert t.add_or_update(contact(TOP + 1, "1.2.3.1:4000"), now=1.0).status is AddStatus.ADDED
    assert t.add_or_update(contact(TOP + 2, "5.6.7.8:4000"), now=1.0).status is AddStatus.ADDED
    # Full bucket: newcomers wait as replacements (one per /24 room left: 1.2.3.x has one).
    assert t.add_or_update(contact(TOP + 3, "1.2.3.3:4000"), now=2.0).status in (
        AddStatus.PING_NEEDED,
        AddStatus.CACHED,
    )
    assert t.add_or_update(contact(TOP + 4, "9.9.9.9:4000"), now=3.0).status in (
        AddStatus.PING_NEEDED,
        AddStatus.CACHED,
    )
    # 5.6.7.8 fails for good: the newest replacement (9.9.9.9) takes its place.
    for _ in range(3):
        t.mark_failed(contact(TOP + 2).peer_id)
    assert {c.address for c in t} == {"1.2.3.1:4000", "9.9.9.9:4000"}
