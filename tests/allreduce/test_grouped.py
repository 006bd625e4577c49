"""Pure pieces of grouped averaging: group count, slices, the gather plan."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from p2ptrain.allreduce.group import GroupMember, GroupPlan
from p2ptrain.allreduce.grouped import (
    GroupingConfig,
    _common_contributors,
    _gather_plan,
    _part_tag,
    _same_profiles,
    _with_tails,
    _without_tails,
    group_count,
    group_index,
    slice_bounds,
    slice_edges,
)
from p2ptrain.allreduce.report import AllReduceReport, ShardReport
from p2ptrain.errors import ConfigError
from p2ptrain.node.address import PeerAddress
from p2ptrain.secure.identity import Identity


def _plan(shares: list[float], num_elements: int = 101) -> GroupPlan:
    members = []
    for i, share in enumerate(shares):
        identity = Identity.generate()
        address = PeerAddress("10.0.0.1", 1000 + i) if share > 0 else None
        members.append(GroupMember(identity.peer_id, address))
    return GroupPlan.from_shares(members, shares, num_elements)


def test_a_swarm_up_to_the_group_size_is_one_group() -> None:
    assert group_count(1, 32) == 1
    assert group_count(32, 32) == 1
    assert group_count(33, 32) == 2
    assert group_count(1024, 32) == 32


def test_group_index_is_stable_and_spreads_peers_evenly() -> None:
    # Fixed identities: with random ones the smallest of 8 bins (binomial, mean
    # 100, sd 9.4) fell under 70 about once in 200 runs, and once in CI.
    ids = [Identity.from_seed(i.to_bytes(32, "big")).peer_id for i in range(800)]
    counts = [0] * 8
    for peer_id in ids:
        index = group_index(peer_id, 8)
        assert index == group_index(peer_id, 8)
        counts[index] += 1
    assert min(counts) > 800 / 8 * 0.7


def test_slices_cover_the_vector_and_follow_the_plan_shares() -> None:
    assert slice_bounds(10, 4) == [0, 2, 5, 7, 10]
    plan = _plan([0.5, 0.0, 0.25, 0.25])
    edges = slice_edges(plan, 8)
    assert edges == [0, 4, 4, 6, 8]  # the member without a part covers no slice


def test_the_gather_plan_gives_each_member_its_slices_under_a_new_round_id() -> None:
    plan = _plan([0.5, 0.0, 0.25, 0.25])
    bounds = slice_bounds(plan.num_elements - 1, 8)
    edges = slice_edges(plan, 8)
    gather = _gather_plan(plan, edges, bounds, 2)
    assert gather.members == plan.members
    assert gather.round_id != plan.round_id
    # every slice is followed by its flag and mask: plan.num_elements - 1 values, 8 tails of 2
    assert gather.num_elements == plan.num_elements - 1 + 16
    assert [gather.part(i) for i in range(4)] == [
        (bounds[edges[i]] + 2 * edges[i], bounds[edges[i + 1]] + 2 * edges[i + 1]) for i in range(4)
    ]
    assert gather.digest == _gather_plan(plan, edges, bounds, 2).digest  # every member agrees


def test_slice_flags_and_profiles_travel_after_their_slices_and_come_back_out() -> None:
    bounds = slice_bounds(10, 4)  # [0, 2, 5, 7, 10]
    average = torch.arange(10, dtype=torch.float32)
    flagged = _with_tails(average, bounds, {0: [5.0], 2: [6.0]}, 2)
    assert flagged.tolist() == [0, 1, 1, 5, 2, 3, 4, 0, 0, 5, 6, 1, 6, 7, 8, 9, 0, 0]
    out, tails = _without_tails(flagged, bounds, 2)
    assert torch.equal(out, average)
    assert tails == [[1.0, 5.0], [0.0, 0.0], [1.0, 6.0], [0.0, 0.0]]


def _profile(parts: list[tuple[int, float, float]], groups: int) -> list[float]:
    """A column's weight profile in float32: (group, weight, tag) per part, averaged by weight."""
    entries = torch.zeros(groups, dtype=torch.float32)
    total = 0.0
    for group, weight, tag in parts:
        entries[group] += torch.tensor(weight * tag, dtype=torch.float32)
        total += weight
    return (entries / total).tolist()


def test_profiles_tell_apart_columns_that_got_different_parts_of_a_split_group() -> None:
    """Group 1 split in two parts by matchmaking (tags b1, b2): a column that got
    only one of them holds a different average than the others, though by group
    index every column holds groups 0-2."""
    plans = [_plan([0.5, 0.5]) for _ in range(4)]
    a, b1, b2, c = (_part_tag(p) for p in plans)
    assert all(1.0 <= t < 2.0 for t in (a, b1, b2, c)) and len({a, b1, b2, c}) == 4
    assert _part_tag(plans[0]) == a  # every member of a part computes the same tag
    whole = _profile([(0, 900, a), (1, 500, b1), (1, 400, b2), (2, 1000, c)], 3)
    # the same parts added in another order: float32 rounding differs, still equal
    reordered = _profile([(2, 1000, c), (1, 400, b2), (0, 900, a), (1, 500, b1)], 3)
    assert _same_profiles([whole, reordered])
    assert not _same_profiles([whole, _profile([(0, 900, a), (1, 500, b1), (2, 1000, c)], 3)])
    # one part with its weight off by one sample
    assert not _same_profiles(
        [whole, _profile([(0, 900, a), (1, 501, b1), (1, 400, b2), (2, 1000, c)], 3)]
    )
    # the other part of the same weight in its place
    assert not _same_profiles(
        [whole, _profile([(0, 900, a), (1, 500, b2), (1, 400, b1), (2, 1000, c)], 3)]
    )
    # a group in one column and not in another (weight 0 entries stay exactly 0)
    assert not _same_profiles([whole, _profile([(0, 900, a), (1, 500, b1), (1, 400, b2)], 3)])


def test_a_group_enters_its_columns_only_if_every_chunk_averaged_the_same_members() -> None:
    """After a partial group round chunks hold averages over different members,
    or local values: the group must not join the columns with its weight. The
    contributors come with each owner's results, so every member that received
    them decides alike."""
    plan = dataclasses.replace(_plan([0.5, 0.5], num_elements=8), chunk_elements=2)

    def report(*shards: ShardReport) -> AllReduceReport:
        members = tuple(m.peer_id for m in plan.members)
        return AllReduceReport(b"r", members, 0, 1.0, shards, {}, 0, 0, 0, 0, 0, 0, 0, None)

    whole = ShardReport(0, 0, 4, ((0, 1), (0, 1)), {}, None)
    assert _common_contributors(report(whole, ShardReport(1, 4, 8, ((0, 1),) * 2, {}, None))) == (
        0,
        1,
    )
    # reducer 1 lost member 1: (0, 1) here, (0,) there
    assert _common_contributors(report(whole, ShardReport(1, 4, 8, ((0,),) * 2, {}, None))) is None
    # a chunk kept local values
    assert (
        _common_contributors(report(whole, ShardReport(1, 4, 8, ((0, 1), None), {}, None))) is None
    )


def test_grouping_config_rejects_bad_values() -> None:
    with pytest.raises(ConfigError):
        GroupingConfig(group_size=1)
    with pytest.raises(ConfigError):
        GroupingConfig(group_window=0.0)
    with pytest.raises(ConfigError):
        GroupingConfig(max_group_factor=0.5)


def test_the_swarm_averager_averages_in_groups_above_the_group_size() -> None:
    import concurrent.futures

    import torch

    from p2ptrain.allreduce.config import AllReduceConfig
    from p2ptrain.allreduce.matchmaking import MatchmakingConfig
    from p2ptrain.dht.node_config import DHTNodeConfig
    from p2ptrain.peer import Peer, PeerConfig
    from p2ptrain.train.averaging import SwarmAverager

    quick = MatchmakingConfig(window=1.0, poll_interval=0.1, ready_timeout=2.0, plan_timeout=5.0)
    grouping = GroupingConfig(group_size=2, group_window=1.5, column_window=5.0)
    peers: list[Peer] = []
    try:
        for _ in range(5):
            initial = (peers[0].address,) if peers else ()
            config = PeerConfig(
                dht=DHTNodeConfig(initial_peers=initial), matchmaking=quick, probe_seconds=None
            )
            peers.append(Peer(config).__enter__())
        averagers = [
            SwarmAverager(peer=p, run_id="grouped", allreduce=AllReduceConfig(), grouping=grouping)
            for p in peers
        ]
        vectors = [torch.full((100,), float(i)) for i in range(5)]
        weights = [1.0, 2.0, 3.0, 4.0, 5.0]
        futures = [
            p.submit(a.average(0, v, w, group_size=5))
            for p, a, v, w in zip(peers, averagers, vectors, weights, strict=True)
        ]
        results = [f.result(timeout=60) for f in concurrent.futures.as_completed(futures)]
    finally:
        for peer in peers:
            peer.__exit__(None, None, None)
    exact = sum(i * w for i, w in enumerate(weights)) / sum(weights)
    for out, outcome in results:
        assert outcome.fallback is None and outcome.complete
        assert outcome.group_size < 5  # it averaged in a group, not with everybody
        assert torch.allclose(out, torch.full((100,), exact), rtol=1e-6)
