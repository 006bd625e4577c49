"""Tests of the sans-IO iterative lookup, against an in-memory network of routing tables."""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Iterator

import pytest

from p2ptrain.dht.config import DHTConfig
from p2ptrain.dht.lookup import IterativeLookup, LookupMode
from p2ptrain.dht.routing import Contact, NodeID, RoutingTable
from p2ptrain.errors import ConfigError, LookupFailedError
from p2ptrain.secure.identity import PeerID

CONFIG = DHTConfig(k=8, alpha=3)
K = CONFIG.k


def contact_of(node_id: int) -> Contact:
    return Contact(PeerID(node_id.to_bytes(32, "big")), f"mem://{node_id:x}")


class MemoryNetwork:
    """Nodes with full knowledge of each other, filtered through real k-buckets."""

    def __init__(self, size: int, seed: int) -> None:
        rng = random.Random(seed)
        self.contacts = [contact_of(rng.getrandbits(256)) for _ in range(size)]
        self.by_id = {c.node_id: c for c in self.contacts}
        self.tables: dict[int, RoutingTable] = {}
        for me in self.contacts:
            t = RoutingTable(me.node_id, config=CONFIG, rng=random.Random(me.node_id), now=0.0)
            others = list(self.contacts)
            rng.shuffle(others)
            for other in others:
                t.add_or_update(other, 0.0)
            self.tables[me.node_id] = t
        self.dead: set[int] = set()
        self.values: dict[int, bytes] = {}

    def true_closest(self, target: int, *, exclude: int) -> list[int]:
        alive = (n for n in self.by_id if n != exclude and n not in self.dead)
        return heapq.nsmallest(K, alive, key=lambda n: n ^ target)

    def start(
        self, source: Contact, target: int, mode: LookupMode = LookupMode.FIND_NODE, **kw: int
    ) -> IterativeLookup[bytes]:
        initial = self.tables[source.node_id].nearest(target, K)
        return IterativeLookup(
            target, initial, config=CONFIG, mode=mode, own_id=source.node_id, **kw
        )

    def answer(self, lookup: IterativeLookup[bytes], queried: Contact) -> None:
        if queried.node_id in self.dead:
            lookup.on_failure(queried)
            return
        value = self.values.get(queried.node_id)
        if lookup.mode is LookupMode.FIND_VALUE and value is not None:
            lookup.on_response(queried, [], value)
            return
        lookup.on_response(queried, self.tables[queried.node_id].nearest(lookup.target, K))

    def run(
        self,
        lookup: IterativeLookup[bytes],
        rng: random.Random,
        answer: Callable[[IterativeLookup[bytes], Contact], None] | None = None,
    ) -> int:
        """Deliver replies one at a time in random order; returns queries made."""
        answer = answer or self.answer
        pending: list[Contact] = []
        queries = 0
        while not lookup.done:
            fresh = lookup.next_queries()
            queries += len(fresh)
            pending += fresh
            assert lookup.in_flight <= (CONFIG.k if lookup.converged else CONFIG.alpha)
            assert pending, "a lookup that is not done always has something in flight"
            answer(lookup, pending.pop(rng.randrange(len(pending))))
        return queries


@pytest.fixture(scope="module")
def network() -> MemoryNetwork:
    return MemoryNetwork(250, seed=1)


def test_find_node_returns_true_k_closest(network: MemoryNetwork) -> None:
    rng = random.Random(2)
    for _ in range(40):
        source = rng.choice(network.contacts)
        target = rng.getrandbits(256)
        lookup = network.start(source, target)
        network.run(lookup, rng)
        result = lookup.result()
        assert [c.node_id for c in result.closest] == network.true_closest(
            target, exclude=source.node_id
        )
        assert result.values == ()
        assert result.closest_without_value == ()
        assert 1 <= result.hops <= result.queries
        assert lookup.next_queries() == []


def test_looking_up_an_existing_node_finds_it_first(network: MemoryNetwork) -> None:
    rng = random.Random(3)
    source, wanted = network.contacts[0], network.contacts[1]
    lookup = network.start(source, wanted.node_id)
    network.run(lookup, rng)
    assert lookup.result().closest[0] == wanted


def test_failed_nodes_are_skipped_and_never_requeried() -> None:
    """30% of the nodes are down but still named in everyone's routing table.

    Each reply holds only k contacts, some of them dead, so a live node that no
    responder names cannot be found: the lookup's contract is the k closest
    live nodes among those it learned of. When responders name 2k contacts
    (and the cap allows it), that is the true k closest live nodes.
    """
    net = MemoryNetwork(200, seed=4)
    rng = random.Random(5)
    net.dead = {c.node_id for c in rng.sample(net.contacts, 60)}
    alive = [c for c in net.contacts if c.node_id not in net.dead]
    wide = DHTConfig(k=K, alpha=3, max_contacts_per_reply=2 * K)
    for reply_size, config in ((K, CONFIG), (2 * K, wide)):
        for _ in range(20):
            source = rng.choice(alive)
            target = rng.getrandbits(256)
            initial = net.tables[source.node_id].nearest(target, K)
            lookup: IterativeLookup[bytes] = IterativeLookup(
                target, initial, config=config, own_id=source.node_id
            )
            learned = {c.node_id for c in initial}
            asked: list[int] = []
            pending: list[Contact] = []
            while not lookup.done:
                pending += lookup.next_queries()
                queried = pending.pop(rng.randrange(len(pending)))
                asked.append(queried.node_id)
                if queried.node_id in net.dead:
                    lookup.on_failure(queried)
                    continue
                reply = net.tables[queried.node_id].nearest(target, reply_size)
                learned.update(c.node_id for c in reply)
                lookup.on_response(queried, reply)
            result = lookup.result()
            got = [c.node_id for c in result.closest]
            assert len(asked) == len(set(asked)), "nobody is queried twice"
            assert result.failures == sum(1 for n in asked if n in net.dead)
            assert not set(got) & net.dead
            live_learned = [n for n in learned if n not in net.dead and n != source.node_id]
            assert got == heapq.nsmallest(K, live_learned, key=lambda n: n ^ target)
            if reply_size == 2 * K:
                assert got == net.true_closest(target, exclude=source.node_id)


def test_late_response_after_failure_and_unsolicited_responses_are_ignored() -> None:
    a, b, c = contact_of(1), contact_of(2), contact_of(3)
    lookup: IterativeLookup[bytes] = IterativeLookup(0, [a, b], config=CONFIG)
    assert set(lookup.next_queries()) == {a, b}
    lookup.on_failure(a)
    lookup.on_response(a, [c])  # late: ignored, c not learned
    lookup.on_response(c, [])  # never queried: ignored
    lookup.on_failure(c)  # never queried: ignored
    lookup.on_response(b, [a])  # a failed before: not queried again
    assert lookup.done
    result = lookup.result()
    assert result.closest == (b,)
    assert result.failures == 1
    assert result.queries == 2


def test_reply_is_capped_and_duplicates_and_own_id_ignored() -> None:
    config = DHTConfig(k=8, alpha=1, max_contacts_per_reply=10)
    own, first = contact_of(1 << 200), contact_of(1 << 250)
    lookup: IterativeLookup[bytes] = IterativeLookup(0, [first], config=config, own_id=own.node_id)
    assert lookup.next_queries() == [first]
    pulled = 0
    rng = random.Random(6)

    def flood() -> Iterator[Contact]:
        nonlocal pulled
        yield own
        yield first
        yield first
        for _ in range(10_000):
            pulled += 1
            yield contact_of(rng.getrandbits(100))  # bogus, much closer to the target
        raise AssertionError("the lookup read past its cap")

    lookup.on_response(first, flood())
    assert pulled == 7  # 10 entries looked at: own id, two duplicates, 7 new
    queried: set[int] = set()
    while not lookup.done:
        batch = lookup.next_queries()
        assert len(batch) == 1
        for bogus in batch:
            assert bogus.node_id != own.node_id
            queried.add(bogus.node_id)
            lookup.on_failure(bogus)
    assert len(queried) == 7
    assert lookup.result().closest == (first,)


def test_a_flood_of_bogus_contacts_does_not_derail_a_lookup(network: MemoryNetwork) -> None:
    rng = random.Random(7)
    liar, source = network.contacts[5], network.contacts[6]
    target = liar.node_id ^ rng.getrandbits(100)  # the liar is the closest real node
    initial = [liar, *network.tables[source.node_id].nearest(target, K)]
    lookup: IterativeLookup[bytes] = IterativeLookup(
        target, initial, config=CONFIG, own_id=source.node_id
    )
    bogus_queried = 0

    def answer(lk: IterativeLookup[bytes], queried: Contact) -> None:
        nonlocal bogus_queried
        if queried.node_id not in network.by_id:  # a made-up contact: nobody there
            bogus_queried += 1
            lk.on_failure(queried)
        elif queried.node_id == liar.node_id:  # 10,000 fake contacts near the target
            lk.on_response(
                queried, [contact_of(target ^ rng.getrandbits(60)) for _ in range(10_000)]
            )
        else:
            network.answer(lk, queried)

    network.run(lookup, rng, answer)
    assert 0 < bogus_queried <= CONFIG.effective_max_contacts_per_reply
    expected = network.true_closest(target, exclude=source.node_id)
    assert [c.node_id for c in lookup.result().closest] == expected


def test_find_value_stops_at_first_value_and_reports_where_to_cache() -> None:
    net = MemoryNetwork(200, seed=8)
    rng = random.Random(9)
    key_id = rng.getrandbits(256)
    holders = net.true_closest(key_id, exclude=-1)[:3]
    for n in holders:
        net.values[n] = b"the value"
    # A source that does not know any holder, so the value is a few hops away.
    source = next(
        c
        for c in net.contacts
        if not {x.node_id for x in net.tables[c.node_id].nearest(key_id, K)} & {*holders, c.node_id}
    )
    lookup = net.start(source, key_id, LookupMode.FIND_VALUE)
    net.run(lookup, rng)
    result = lookup.result()
    assert len(result.values) == 1
    holder, value = result.values[0]
    assert value == b"the value" and holder.node_id in holders
    assert result.closest_without_value
    assert all(c.node_id not in holders for c in result.closest_without_value)
    distances = [c.node_id ^ key_id for c in result.closest_without_value]
    assert distances == sorted(distances)


def test_find_value_can_collect_from_several_nodes() -> None:
    net = MemoryNetwork(200, seed=10)
    rng = random.Random(11)
    key_id = rng.getrandbits(256)
    holders = net.true_closest(key_id, exclude=-1)[:5]
    for i, n in enumerate(holders):
        net.values[n] = f"part {i}".encode()
    source = next(c for c in net.contacts if c.node_id not in holders)
    lookup = net.start(source, key_id, LookupMode.FIND_VALUE, values_wanted=4)
    net.run(lookup, rng)
    result = lookup.result()
    assert len(result.values) == 4
    assert len({c.node_id for c, _ in result.values}) == 4
    assert {c.node_id for c, _ in result.values} <= set(holders)


def test_find_value_without_any_value_behaves_like_find_node() -> None:
    net = MemoryNetwork(150, seed=12)
    rng = random.Random(13)
    source, target = net.contacts[0], rng.getrandbits(256)
    lookup = net.start(source, target, LookupMode.FIND_VALUE)
    net.run(lookup, rng)
    result = lookup.result()
    assert result.values == ()
    assert [c.node_id for c in result.closest] == net.true_closest(target, exclude=source.node_id)
    assert result.closest_without_value == result.closest


def test_find_node_ignores_values() -> None:
    a = contact_of(5)
    lookup: IterativeLookup[bytes] = IterativeLookup(0, [a], config=CONFIG)
    lookup.next_queries()
    lookup.on_response(a, [], b"stray value")
    assert lookup.result().values == ()


def test_no_contacts_or_all_failed_raises_lookup_failed() -> None:
    empty: IterativeLookup[bytes] = IterativeLookup(0, [], config=CONFIG)
    assert empty.done
    assert empty.next_queries() == []
    with pytest.raises(LookupFailedError):
        empty.result()
    lookup: IterativeLookup[bytes] = IterativeLookup(
        0, [contact_of(1), contact_of(2)], config=CONFIG
    )
    for c in lookup.next_queries():
        lookup.on_failure(c)
    assert lookup.done
    with pytest.raises(LookupFailedError, match="2 failed"):
        lookup.result()


def test_alpha_bounds_queries_in_flight() -> None:
    contacts = [contact_of(n) for n in range(1, 30)]
    lookup: IterativeLookup[bytes] = IterativeLookup(0, contacts, config=CONFIG)
    first = lookup.next_queries()
    assert [c.node_id for c in first] == [1, 2, 3]  # closest first
    assert lookup.next_queries() == []
    lookup.on_response(first[0], [])
    assert [c.node_id for c in lookup.next_queries()] == [4]


def test_once_alpha_replies_bring_nobody_closer_the_rest_of_the_k_closest_go_at_once() -> None:
    contacts = [contact_of(n) for n in range(1, 30)]
    lookup: IterativeLookup[bytes] = IterativeLookup(0, contacts, config=CONFIG)
    first = lookup.next_queries()
    assert [c.node_id for c in first] == [1, 2, 3]
    lookup.on_response(first[0], [contact_of(40)])  # farther than the closest known
    lookup.on_response(first[1], [])
    assert not lookup.converged
    assert [c.node_id for c in lookup.next_queries()] == [4, 5]  # still alpha in flight
    lookup.on_response(first[2], [contact_of(41)])
    assert lookup.converged
    # k = 8: 1-3 answered, 4 and 5 in flight, 6-8 fresh among the 8 closest.
    assert [c.node_id for c in lookup.next_queries()] == [6, 7, 8]


def test_a_reply_naming_someone_closer_keeps_alpha_in_flight() -> None:
    contacts = [contact_of(n) for n in range(4, 30)]
    lookup: IterativeLookup[bytes] = IterativeLookup(0, contacts, config=CONFIG)
    first = lookup.next_queries()
    lookup.on_response(first[0], [])
    lookup.on_response(first[1], [])
    lookup.on_response(first[2], [contact_of(1)])  # closer than 4: progress
    assert not lookup.converged
    assert [c.node_id for c in lookup.next_queries()] == [1, 7, 8]


def test_hops_count_the_longest_chain_of_referrals() -> None:
    # A chain: node i only knows node i+1, which is closer to the target 0.
    chain = [contact_of((1 << 200) >> (8 * i)) for i in range(6)]
    lookup: IterativeLookup[bytes] = IterativeLookup(0, chain[:1], config=CONFIG)
    while not lookup.done:
        for queried in lookup.next_queries():
            index = chain.index(queried)
            lookup.on_response(queried, chain[index + 1 : index + 2])
    result = lookup.result()
    assert result.hops == 6
    assert [c.node_id for c in result.closest] == [c.node_id for c in reversed(chain)]


def test_values_wanted_must_be_positive() -> None:
    with pytest.raises(ConfigError):
        IterativeLookup(0, [], config=CONFIG, values_wanted=0)


def test_node_id_target_is_accepted() -> None:
    lookup: IterativeLookup[bytes] = IterativeLookup(NodeID(9), [contact_of(1)], config=CONFIG)
    assert lookup.target == 9


def test_an_address_serves_one_id_per_lookup() -> None:
    """Thousands of made-up ids at one address (a tar pit) cost one query, not thousands."""
    target = 0
    honest = contact_of(1 << 200)
    lookup: IterativeLookup[bytes] = IterativeLookup(target, [honest], config=CONFIG)
    assert lookup.next_queries() == [honest]
    pit = [Contact(PeerID((i + 1).to_bytes(32, "big")), "10.0.0.9:4001") for i in range(1000)]
    lookup.on_response(honest, pit)
    queried = lookup.next_queries()
    assert queried == [pit[0]]  # the others name an address already claimed
    lookup.on_failure(pit[0])
    assert lookup.next_queries() == []
    assert lookup.done
