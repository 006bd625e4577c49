"""Matchmaking over a real DHT on loopback: groups form, plans agree, the
all-reduce runs on them, and peers that left are dropped."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
import torch

from p2ptrain.allreduce.config import AllReduceConfig
from p2ptrain.allreduce.fairshare import fair_share_round_time
from p2ptrain.allreduce.group import GroupPlan
from p2ptrain.allreduce.matchmaking import (
    MIN_CHUNK_ELEMENTS,
    Balancer,
    Matchmaker,
    MatchmakingConfig,
    _parse_check_reply,
    _parse_followers,
    plan_from_wire,
    plan_to_wire,
)
from p2ptrain.allreduce.partition import PeerCapacity
from p2ptrain.allreduce.service import AllReduceService
from p2ptrain.dht.api import DHT
from p2ptrain.dht.node_config import DHTNodeConfig
from p2ptrain.errors import ConfigError, InvalidArgumentError, MatchmakingError
from p2ptrain.lab.timings import QUICK_MATCHMAKING
from p2ptrain.node.node import Node
from p2ptrain.secure.identity import PeerID

FAST = replace(QUICK_MATCHMAKING, window=0.6, ready_timeout=1.0)


class Peer:
    def __init__(self, node: Node, dht: DHT, matchmaker: Matchmaker) -> None:
        self.node, self.dht, self.matchmaker = node, dht, matchmaker

    async def aclose(self) -> None:
        self.matchmaker.close()
        await self.dht.aclose()
        await self.node.aclose()


async def start_peer(initial: tuple[str, ...], upload: float = 1e8) -> Peer:
    node = Node()
    await node.start()
    AllReduceService.attach(node)
    dht = DHT(node=node, config=DHTNodeConfig(initial_peers=initial))
    await dht.start()
    capacity = PeerCapacity(
        upload_bytes_per_s=upload, download_bytes_per_s=upload, samples_per_s=10.0
    )
    return Peer(node, dht, Matchmaker(dht=dht, config=FAST, capacity=lambda: capacity))


def set_windows(monkeypatch: pytest.MonkeyPatch, windows: dict[Peer, float]) -> None:
    """Give each peer its own gathering window (the rest of FAST stays)."""
    for peer, window in windows.items():
        monkeypatch.setattr(peer.matchmaker, "config", replace(FAST, window=window))


@pytest.fixture
async def swarm() -> AsyncIterator[list[Peer]]:
    first = await start_peer(())
    peers = [first] + [await start_peer((str(first.node.address),)) for _ in range(4)]
    yield peers
    for peer in peers:
        await peer.aclose()


async def test_peers_agree_on_one_plan_and_average_with_it(swarm: list[Peer]) -> None:
    plans = await asyncio.gather(
        *(p.matchmaker.form_group("run/step-1", num_elements=1001) for p in swarm)
    )
    assert len({plan.round_id for plan in plans}) == 1
    plan = plans[0]
    assert {m.peer_id for m in plan.members} == {p.node.peer_id for p in swarm}
    assert plan.num_elements == 1001
    # Bandwidths are equal, so the LP gives (nearly) equal parts.
    sizes = [plan.part(i)[1] - plan.part(i)[0] for i in range(plan.size)]
    assert max(sizes) - min(sizes) <= 2
    vectors = [torch.full((1001,), float(i)) for i in range(len(swarm))]
    results = await asyncio.gather(
        *(
            AllReduceService.attach(p.node).allreduce(plan, v, 1.0)
            for p, v in zip(swarm, vectors, strict=True)
        )
    )
    for averaged, _report in results:
        assert torch.allclose(averaged, torch.full((1001,), 2.0))


async def test_a_peer_that_left_after_announcing_is_dropped(swarm: list[Peer]) -> None:
    leaver, *stayers = swarm

    async def announce_and_vanish() -> None:
        await leaver.matchmaker._announce("run/step-2")  # visible in the DHT...
        await leaver.node.aclose()  # ...then the peer is gone

    results = await asyncio.gather(
        announce_and_vanish(),
        *(p.matchmaker.form_group("run/step-2", num_elements=64) for p in stayers),
    )
    plans: list[GroupPlan] = list(results[1:])
    assert len({p.round_id for p in plans}) == 1
    assert {m.peer_id for m in plans[0].members} == {p.node.peer_id for p in stayers}


async def test_a_leader_whose_reads_miss_the_others_still_takes_those_that_ask_it(
    swarm: list[Peer], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A DHT read can miss announcements (a replica that has not stored them);
    # the peers that elected the leader tell it themselves through mm.ready.
    leader = min(swarm, key=lambda p: p.node.peer_id)
    set_windows(monkeypatch, {leader: 1.5})

    async def blind(key: str) -> object:
        return leader.matchmaker._with_known(key, {})  # sees only itself and its askers

    monkeypatch.setattr(leader.matchmaker, "_read", blind)
    plans = await asyncio.gather(
        *(p.matchmaker.form_group("run/blind", num_elements=64) for p in swarm)
    )
    assert len({p.round_id for p in plans}) == 1
    assert {m.peer_id for m in plans[0].members} == {p.node.peer_id for p in swarm}


async def test_a_peer_a_leader_checked_waits_for_its_plan_instead_of_leading_alone(
    swarm: list[Peer], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The loaded-machine race: the leader checks a peer, then plans slowly; the
    # peer's own reads miss the leader and its window ends before the plan.
    # Having said it was ready, the peer must wait for that plan: leading alone
    # it gave up ("too few live peers") while the leader's round waited for it.
    leader, follower = sorted(swarm[:2], key=lambda p: p.node.peer_id)
    set_windows(monkeypatch, {leader: 0.3, follower: 0.9})
    plan_slowly = leader.matchmaker._plan

    async def slow_plan(*args: object, **kwargs: object) -> GroupPlan:
        await asyncio.sleep(1.5)  # the follower's window ends meanwhile
        return await plan_slowly(*args, **kwargs)  # type: ignore[arg-type]

    async def blind(key: str) -> object:
        return follower.matchmaker._with_known(key, {})

    monkeypatch.setattr(leader.matchmaker, "_plan", slow_plan)
    monkeypatch.setattr(follower.matchmaker, "_read", blind)
    plans = await asyncio.gather(
        *(p.matchmaker.form_group("run/checked", num_elements=64) for p in (leader, follower))
    )
    assert plans[0].round_id == plans[1].round_id
    assert {m.peer_id for m in plans[0].members} == {leader.node.peer_id, follower.node.peer_id}


async def test_a_peer_whose_leader_follows_a_smaller_one_joins_that_group(
    swarm: list[Peer], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The orphan race of large swarms: M's reads miss Z and M asks X, which
    # answers "ready" because it is still gathering; X then finds Z and
    # follows it. Z's check of M is refused (M waits for X), so unless X
    # passes M on and M takes the plan of the group X joined, M gets none.
    first, middle, last = sorted(swarm[:3], key=lambda p: p.node.peer_id)
    set_windows(monkeypatch, {first: 1.6, middle: 1.0, last: 0.3})

    async def blind_to_first(key: str) -> object:
        found = await Matchmaker._read(last.matchmaker, key)
        return [c for c in found if c.peer_id != first.node.peer_id]

    monkeypatch.setattr(last.matchmaker, "_read", blind_to_first)
    asked: list[bytes] = []
    probe = Matchmaker._probe

    async def recorded_probe(self: Matchmaker, candidate: object, key: str) -> object:
        asked.append(candidate.peer_id.digest)  # type: ignore[attr-defined]
        return await probe(self, candidate, key)  # type: ignore[arg-type]

    monkeypatch.setattr(last.matchmaker, "_probe", recorded_probe.__get__(last.matchmaker))
    plans = await asyncio.gather(
        *(p.matchmaker.form_group("run/orphan", num_elements=64) for p in (first, middle, last))
    )
    # The race happened: M asked X, never Z.
    assert asked == [middle.node.peer_id.digest]
    assert len({p.round_id for p in plans}) == 1
    members = {m.peer_id for m in plans[0].members}
    assert members == {first.node.peer_id, middle.node.peer_id, last.node.peer_id}


async def test_followers_are_passed_on_through_a_chain_of_askers(
    swarm: list[Peer], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two levels: D asks C, C asks B (each still gathering when asked), B
    # then follows A. A learns of C and D only through B.
    a, b, c, d = sorted(swarm[:4], key=lambda p: p.node.peer_id)
    set_windows(monkeypatch, {a: 2.0, b: 1.4, c: 0.8, d: 0.3})
    sees = {a: {a}, b: {a, b}, c: {b, c}, d: {c, d}}
    for peer, visible in sees.items():
        ids = {p.node.peer_id for p in visible}

        async def partial(key: str, m: Matchmaker = peer.matchmaker, ids: set = ids) -> object:
            found = await Matchmaker._read(m, key)
            return [x for x in found if x.peer_id in ids or x.peer_id in m._asked.get(key, {})]

        monkeypatch.setattr(peer.matchmaker, "_read", partial)
    plans = await asyncio.gather(
        *(p.matchmaker.form_group("run/chain", num_elements=64) for p in (a, b, c, d))
    )
    assert len({p.round_id for p in plans}) == 1
    assert {m.peer_id for m in plans[0].members} == {p.node.peer_id for p in (a, b, c, d)}


async def test_a_named_follower_that_does_not_answer_stays_out(
    swarm: list[Peer], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A follower is named by another peer, not by itself: the leader checks
    # it before it enters the plan (a peer could name anyone, or a follower
    # could have left since), so an unreachable one costs nothing.
    leader, member = sorted(swarm[:2], key=lambda p: p.node.peer_id)
    set_windows(monkeypatch, {leader: 1.0, member: 0.3})
    ghost = PeerID(bytes(range(32)))
    named = [
        [
            ghost.digest,
            {"a": "127.0.0.1:1", "u": 1.0, "d": 1.0},
            member.node.peer_id.digest,
        ]
    ]
    monkeypatch.setattr(member.matchmaker, "_followers_to_wire", lambda key: named)
    plans = await asyncio.gather(
        *(p.matchmaker.form_group("run/ghost", num_elements=64) for p in (leader, member))
    )
    assert plans[0].round_id == plans[1].round_id
    assert {m.peer_id for m in plans[0].members} == {leader.node.peer_id, member.node.peer_id}


def test_malformed_followers_are_skipped() -> None:
    good, leader = PeerID(bytes(range(32))), PeerID(bytes(32))
    announcement = {"a": "127.0.0.1:9", "u": 1.0, "d": 2.0}
    raw = [
        [good.digest, announcement, leader.digest],
        [b"short", announcement, leader.digest],
        [good.digest, announcement, b"short"],
        [good.digest, {"u": "fast"}, leader.digest],
        [good.digest, announcement],
        "not a triple",
    ]
    parsed = _parse_followers(raw)
    assert [(f.peer_id, via) for f, via in parsed] == [(good, leader)]
    assert parsed[0][0].capacity.download_bytes_per_s == 2.0
    assert _parse_followers({"not": "a list"}) == []
    assert _parse_check_reply(True) == []
    assert _parse_check_reply(False) is None
    assert _parse_check_reply({"l": good.digest}) is None
    assert [f.peer_id for f, _ in _parse_check_reply({"ok": True, "f": raw}) or []] == [good]


async def test_alone_is_too_few(swarm: list[Peer]) -> None:
    with pytest.raises(MatchmakingError, match="too few"):
        await swarm[0].matchmaker.form_group("run/lonely", num_elements=8)


def test_plans_round_trip_and_malformed_plans_are_refused() -> None:
    from p2ptrain.allreduce.group import GroupMember
    from p2ptrain.node.address import PeerAddress
    from p2ptrain.secure.identity import Identity

    a, b = Identity.generate().peer_id, Identity.generate().peer_id
    plan = GroupPlan.from_shares(
        [GroupMember(a, PeerAddress("127.0.0.1", 1)), GroupMember(b, None)], [1.0, 0.0], 10
    )
    again = plan_from_wire(plan_to_wire(plan))
    assert again.members == plan.members and again.boundaries == plan.boundaries
    for bad in (
        None,
        {"m": "x"},
        {**plan_to_wire(plan), "b": [0, 11, 10]},
        {**plan_to_wire(plan), "m": [["nope", None]]},
    ):
        with pytest.raises(InvalidArgumentError):
            plan_from_wire(bad)


async def test_a_custom_balancer_and_codec_plug_in(swarm: list[Peer]) -> None:
    """The research-guide extension points, end to end: a load balancer of our
    own decides the parts, and a codec of our own carries them."""
    from dataclasses import dataclass

    from p2ptrain.allreduce import compression
    from p2ptrain.allreduce.compression import CODEC_NAMES, Codec, NoneCodec, register_codec

    @dataclass
    class Plan:
        shares: list[float]
        round_time_s: float = 1.0

    class FirstPeerAggregates:
        def plan(self, peers, *, vector_bytes, target_batch_size):  # type: ignore[no-untyped-def]
            return Plan([1.0] + [0.0] * (len(peers) - 1))

    class Counting(NoneCodec):
        name = "counting-test"
        encoded = 0

        def encode(self, tensor):  # type: ignore[no-untyped-def]
            Counting.encoded += 1
            return super().encode(tensor)

    register_codec(Counting)
    assert issubclass(Counting, Codec)
    try:
        await _run_with_custom_parts(
            swarm, FirstPeerAggregates(), AllReduceConfig(codec=Counting.name)
        )
    finally:  # leave the registry as other tests expect it
        compression._CODECS.pop(Counting.name)
        CODEC_NAMES.remove(Counting.name)
    assert Counting.encoded > 0


async def _run_with_custom_parts(
    swarm: list[Peer], balancer: Balancer, config: AllReduceConfig
) -> None:
    for peer in swarm[:3]:
        peer.matchmaker._balancer = balancer
    plans = await asyncio.gather(
        *(p.matchmaker.form_group("run/custom", num_elements=300) for p in swarm[:3])
    )
    plan = plans[0]
    assert [plan.part(i)[1] - plan.part(i)[0] for i in range(3)] == [300, 0, 0]
    # The plan's prediction is matchmaking's own (fair-share) time for those
    # shares, not the balancer's round_time_s.
    capacity = PeerCapacity(upload_bytes_per_s=1e8, download_bytes_per_s=1e8, samples_per_s=10.0)
    expected = fair_share_round_time([1.0, 0.0, 0.0], [capacity] * 3, 4 * 300)
    assert plan.predicted_time == pytest.approx(expected) and expected < 1e-3
    results = await asyncio.gather(
        *(
            AllReduceService.attach(p.node).allreduce(
                plan, torch.full((300,), float(i)), 1.0, config=config
            )
            for i, p in enumerate(swarm[:3])
        )
    )
    for averaged, _ in results:
        assert torch.allclose(averaged, torch.full((300,), 1.0))


async def test_an_expected_size_ends_gathering_but_keeps_every_announced_peer(
    swarm: list[Peer],
) -> None:
    """A peer whose view expects 2 (it had not seen the third yet) still takes
    all 3 that announced: a stale view must not cut a live peer out."""
    key = "run/step-expected"
    for peer in swarm[:3]:
        await peer.matchmaker._announce(key)
    candidates = await swarm[0].matchmaker._gather(key, expected=2)
    assert {c.peer_id for c in candidates} == {p.node.peer_id for p in swarm[:3]}


async def test_count_by_waits_for_distinct_values_not_for_announcements(
    swarm: list[Peer],
) -> None:
    """A column of grouped averaging expects one member per group: two
    announcers of one group count once, so gathering goes on to the window's
    end, and stops at once when the other group's member is in."""
    key = "run/step-count-by"
    first_group = {swarm[0].node.peer_id, swarm[1].node.peer_id}

    def group(peer: object) -> int:
        return 0 if peer in first_group else 1

    for peer in swarm[:2]:
        await peer.matchmaker._announce(key)
    loop = asyncio.get_running_loop()
    started = loop.time()
    candidates = await swarm[0].matchmaker._gather(key, expected=2, count_by=group)
    assert loop.time() - started >= FAST.window  # two announcers, one group: not enough
    assert {c.peer_id for c in candidates} == first_group
    await swarm[2].matchmaker._announce(key)
    started = loop.time()
    candidates = await swarm[0].matchmaker._gather(key, expected=2, count_by=group)
    assert loop.time() - started < FAST.window
    assert len(candidates) == 3
    # Without count_by, two announcers of one group are enough.
    for peer in swarm[:2]:
        await peer.matchmaker._announce(key + "-plain")
    started = loop.time()
    candidates = await swarm[0].matchmaker._gather(key + "-plain", expected=2)
    assert loop.time() - started < FAST.window
    assert {c.peer_id for c in candidates} == first_group


async def test_chunks_are_cut_to_the_slowest_uplink() -> None:
    """A chunk is one frame: on a 6.25 MB/s uplink it takes chunk_seconds, not 0.7 s."""
    first = await start_peer(())
    slow = await start_peer((str(first.node.address),), upload=6.25e6)
    fast = await start_peer((str(first.node.address),))
    peers = [first, slow, fast]
    try:
        plans = await asyncio.gather(
            *(p.matchmaker.form_group("run/chunks", num_elements=4 << 20) for p in peers)
        )
        fits = int(6.25e6 * FAST.chunk_seconds / 4)  # float32 elements in 50 ms
        assert {plan.chunk_elements for plan in plans} == {max(MIN_CHUNK_ELEMENTS, fits)}
        alone = [first, fast]  # without the slow peer the configured chunk stands
        plans = await asyncio.gather(
            *(p.matchmaker.form_group("run/chunks-2", num_elements=4 << 20) for p in alone)
        )
        assert {plan.chunk_elements for plan in plans} == {FAST.chunk_elements}
    finally:
        for peer in peers:
            await peer.aclose()


async def test_a_peer_alone_at_the_end_of_its_window_waits_for_expected_peers() -> None:
    """Peers reach a step moments apart: the first one's window closes before the other
    announces, and it waits ``lone_wait`` more instead of stepping alone."""
    first = await start_peer(())
    second = await start_peer((str(first.node.address),))
    config = replace(FAST, lone_wait=2.0)
    for peer in (first, second):
        peer.matchmaker.config = config
    try:

        async def late() -> GroupPlan:
            await asyncio.sleep(FAST.window * 1.5)  # arrives after the first one's window
            return await second.matchmaker.form_group("run/lone", num_elements=64, expected=2)

        plans = await asyncio.gather(
            first.matchmaker.form_group("run/lone", num_elements=64, expected=2), late()
        )
        assert plans[0].round_id == plans[1].round_id and plans[0].size == 2
        first.matchmaker.config = replace(FAST, lone_wait=0.0)  # as before: alone, it gives up

        async def late_again() -> GroupPlan:
            await asyncio.sleep(FAST.window * 1.5)
            return await second.matchmaker.form_group("run/lone-2", num_elements=64, expected=2)

        outcomes = await asyncio.gather(
            first.matchmaker.form_group("run/lone-2", num_elements=64, expected=2),
            late_again(),
            return_exceptions=True,
        )
        assert all(isinstance(o, MatchmakingError) for o in outcomes), outcomes
        assert "too few" in str(outcomes[0])
    finally:
        for peer in (first, second):
            await peer.aclose()


async def test_an_early_group_waits_for_the_last_peer_until_its_step_is_due(
    swarm: list[Peer],
) -> None:
    """Matchmaking begun ahead of a step keeps gathering past its window until
    the step is due: two peers that started early still take the third, whose
    batch ended after their window. Without ``due`` (the control) the two
    form a group alone once the window has passed."""
    early, late_peer = swarm[:2], swarm[2]

    async def late(key: str) -> GroupPlan:
        await asyncio.sleep(FAST.window * 2)  # after the early peers' window
        return await late_peer.matchmaker.form_group(key, num_elements=64, expected=3)

    due = [asyncio.Event() for _ in early]

    async def step_due() -> None:
        await asyncio.sleep(FAST.window * 1.5)
        for event in due:
            event.set()

    plans = await asyncio.gather(
        *(
            p.matchmaker.form_group("run/early", num_elements=64, expected=3, due=d)
            for p, d in zip(early, due, strict=True)
        ),
        late("run/early"),
        step_due(),
    )
    assert {plan.round_id for plan in plans[:3]} == {plans[0].round_id}
    assert plans[0].size == 3

    control = await asyncio.gather(
        *(p.matchmaker.form_group("run/early-2", num_elements=64, expected=3) for p in early),
        late("run/early-2"),
        return_exceptions=True,
    )
    first = control[0]
    assert isinstance(first, GroupPlan) and first.size == 2, control


async def test_max_share_factor_reaches_the_balancer_as_a_bound_per_member(
    swarm: list[Peer],
) -> None:
    """Grouped averaging bounds the busiest member's share: the leader passes
    ``max_share_factor / n`` to the balancer, and nothing when it is unset."""
    from dataclasses import dataclass

    seen: list[float | None] = []

    @dataclass
    class Plan:
        shares: list[float]
        round_time_s: float = 1.0

    class Recording:
        def plan(self, peers, *, vector_bytes, target_batch_size, **bound):  # type: ignore[no-untyped-def]
            seen.append(bound.get("max_share"))
            return Plan([1.0 / len(peers)] * len(peers))

    for factor, key in ((1.5, "run/bounded"), (None, "run/unbounded")):
        for peer in swarm[:3]:
            peer.matchmaker._balancer = Recording()
            peer.matchmaker.config = replace(peer.matchmaker.config, max_share_factor=factor)
        await asyncio.gather(*(p.matchmaker.form_group(key, num_elements=30) for p in swarm[:3]))
    assert seen == [pytest.approx(0.5), None]  # one leader per round plans
    with pytest.raises(ConfigError, match="max_share_factor"):
        MatchmakingConfig(max_share_factor=0.5)


async def form_one_pair(leader: Peer, member: Peer, key: str, *, leader_expects: int) -> float:
    """Both matchmake for ``key``, the member expecting a third peer that
    never comes; they must form one group of two. The seconds it took."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    plans = await asyncio.wait_for(
        asyncio.gather(
            leader.matchmaker.form_group(key, num_elements=100, expected=leader_expects),
            member.matchmaker.form_group(key, num_elements=100, expected=3),
        ),
        timeout=20.0,
    )
    assert plans[0].round_id == plans[1].round_id and plans[0].size == 2
    return loop.time() - started


async def test_a_member_stops_gathering_once_its_leader_took_it(
    swarm: list[Peer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The leader's view is complete, the member's is not (it expects a third
    peer that never comes): once the leader checked it and sent the plan, the
    member has nothing left to gather for and returns at once, not at the end
    of its long window (a column's member waited seconds for nothing)."""
    key = "run/step-taken"
    leader, member = sorted(swarm[:2], key=lambda p: p.node.peer_id)
    set_windows(monkeypatch, {leader: 0.3, member: 30.0})
    elapsed = await form_one_pair(leader, member, key, leader_expects=2)
    assert elapsed < 10.0  # the member's window alone is 30 s


async def test_a_member_taken_in_the_middle_of_a_slow_read_stops_at_once(
    swarm: list[Peer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DHT read can take seconds (a lookup behind a busy uplink): a leader's
    check ends it, rather than the member finishing the read first."""
    key = "run/step-taken-reading"
    leader, member = sorted(swarm[:2], key=lambda p: p.node.peer_id)
    set_windows(monkeypatch, {leader: 0.3, member: 30.0})
    read = member.matchmaker._read

    async def slow_read(key: str) -> list[object]:
        await asyncio.sleep(30.0)
        return await read(key)

    monkeypatch.setattr(member.matchmaker, "_read", slow_read)
    assert await form_one_pair(leader, member, key, leader_expects=2) < 10.0


async def test_a_member_taken_while_it_asks_around_stops_asking(
    swarm: list[Peer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The member's window ends first and it asks the smaller candidates to
    lead it, one after another (each may take ``ready_timeout``); the
    leader's check takes its word meanwhile. It stops asking and takes the
    plan: asking on, it kept the whole group waiting for its part."""
    key = "run/step-taken-electing"
    leader, member = sorted(swarm[:2], key=lambda p: p.node.peer_id)
    set_windows(monkeypatch, {leader: 1.0, member: 0.1})
    probe = member.matchmaker._probe
    asking = asyncio.Event()

    async def slow_probe(candidate: object, key: str) -> object:
        asking.set()
        await asyncio.sleep(30.0)
        return await probe(candidate, key)  # type: ignore[arg-type]

    monkeypatch.setattr(member.matchmaker, "_probe", slow_probe)
    elapsed = await form_one_pair(leader, member, key, leader_expects=3)
    assert asking.is_set()  # the member was asking when the leader took it
    assert elapsed < 10.0


async def test_a_gathering_leader_reads_again_as_soon_as_a_member_asks_it(
    swarm: list[Peer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member that read enough announcements asks the smallest candidate to
    lead it; that candidate, still gathering, reads again at once instead of
    at its next poll (a column's leader found its last group a whole poll
    interval after its members had)."""
    key = "run/step-asked"
    leader, member = sorted(swarm[:2], key=lambda p: p.node.peer_id)
    monkeypatch.setattr(leader.matchmaker, "config", replace(FAST, window=30.0, poll_interval=5.0))
    read = leader.matchmaker._read
    first_read = asyncio.Event()

    async def noted_read(key: str) -> list[object]:
        found = await read(key)
        first_read.set()
        return found  # type: ignore[return-value]

    monkeypatch.setattr(leader.matchmaker, "_read", noted_read)
    loop = asyncio.get_running_loop()
    leading = asyncio.ensure_future(leader.matchmaker.form_group(key, num_elements=100, expected=2))
    await asyncio.wait_for(first_read.wait(), timeout=5.0)  # it saw only itself: it pauses 5 s
    started = loop.time()
    plans = await asyncio.wait_for(
        asyncio.gather(leading, member.matchmaker.form_group(key, num_elements=100, expected=2)),
        timeout=20.0,
    )
    assert plans[0].round_id == plans[1].round_id and plans[0].size == 2
    assert loop.time() - started < 2.5  # the leader's next poll was 4.5 s away
