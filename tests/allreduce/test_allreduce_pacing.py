"""Kernel pacing of a round's bulk streams: the rates, and the socket option set and lifted."""

from __future__ import annotations

import asyncio
import sys

import pytest
import torch
from allreduce_rounds import make_plan, weighted_mean
from conftest import NodeFactory

from p2ptrain.allreduce import (
    AllReduceConfig,
    AllReduceReport,
    AllReduceService,
    GroupMember,
    GroupPlan,
    RoundObserver,
)
from p2ptrain.allreduce.pacing import pacing_rates, worth_pacing
from p2ptrain.errors import ConfigError
from p2ptrain.measure import EstimatorConfig, LinkEstimator, payload_rate
from p2ptrain.node.address import PeerAddress
from p2ptrain.node.node import Node
from p2ptrain.secure.identity import Identity
from p2ptrain.transport.tcp import TCPTransport

UPLOAD = 4e8  # bytes/s: fast enough not to slow the test


def test_streams_share_the_upload_in_proportion_to_their_bytes() -> None:
    plan = _plan_for(1000, shares=(0.75, 0.25, 0.0))
    home = pacing_rates(
        plan, 2, sends_parts=True, upload_bytes_per_s=100.0, headroom=1.2, element_bytes=4.0
    )
    assert home.parts == pytest.approx({0: 90.0, 1: 30.0})
    assert home.results == {}
    # A reducer: parts to the other reducer, and its averages to both others.
    dc = pacing_rates(
        plan, 0, sends_parts=True, upload_bytes_per_s=100.0, headroom=1.0, element_bytes=4.0
    )
    total = 250 + 2 * 750
    assert dc.parts == pytest.approx({1: 100.0 * 250 / total})
    assert dc.results == pytest.approx({1: 100.0 * 750 / total, 2: 100.0 * 750 / total})
    assert sum(dc.parts.values()) + sum(dc.results.values()) == pytest.approx(100.0)
    # Weight 0 (no parts) and nothing to reduce: nothing is paced.
    idle = pacing_rates(
        plan, 2, sends_parts=False, upload_bytes_per_s=100.0, headroom=1.2, element_bytes=4.0
    )
    assert idle.parts == {} and idle.results == {}
    with pytest.raises(ConfigError):
        pacing_rates(
            plan, 2, sends_parts=True, upload_bytes_per_s=100.0, headroom=0.5, element_bytes=4.0
        )
    with pytest.raises(ConfigError):
        AllReduceConfig(pacing_headroom=0.9)


MBIT = 1e6 / 8  # bytes/s


def test_a_round_that_ends_within_its_slow_start_goes_unpaced() -> None:
    # A home's 50 Mbit/s uplink at 40 ms RTT: slow start takes about four round
    # trips (0.17 s) to the window that rate needs; 1 MiB leaves in 0.17 s.
    assert not worth_pacing((1 << 20) / (50 * MBIT), 50 * MBIT, 0.04)
    assert worth_pacing((16 << 20) / (50 * MBIT), 50 * MBIT, 0.04)
    # Without a measured round trip, or on a LAN, the stream is paced.
    assert worth_pacing(0.01, 50 * MBIT, None)
    assert worth_pacing(0.01, 50 * MBIT, 0.0002)


def test_the_rates_know_how_long_the_members_upload_lasts() -> None:
    plan = _plan_for(1000, shares=(0.75, 0.25, 0.0))
    home = pacing_rates(
        plan, 2, sends_parts=True, upload_bytes_per_s=100.0, headroom=1.2, element_bytes=4.0
    )
    assert home.upload_s == pytest.approx(1000 * 4.0 / 100.0)
    assert home.rate(90.0, None) == 90.0
    assert home.rate(None, 0.04) is None
    # 40 s of upload against a ramp to 90 bytes/s at a 10 s round trip: paced;
    # at a 1,000 s round trip the upload ends within the ramp: not.
    assert home.rate(90.0, 10.0) == 90.0
    assert home.rate(90.0, 1000.0) is None


class _Watch(RoundObserver):
    """Reads the kernel's pacing rate of the sender's connection to each reducer."""

    def __init__(self, node: Node, reducers: dict[int, Node]) -> None:
        self.node, self.reducers = node, reducers
        self.seen: dict[int, set[int | None]] = {j: set() for j in reducers}

    def part_sent(self, reducer: int, chunk: int) -> None:
        self.seen[reducer].add(_rate_to(self.node, self.reducers[reducer]))


def _rate_to(node: Node, peer: Node) -> int | None:
    (conn,) = [c for c in node.connections() if c.remote_peer == peer.peer_id]
    assert isinstance(conn.transport, TCPTransport)
    return conn.transport.kernel_pacing_rate


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_MAX_PACING_RATE is Linux's")
@pytest.mark.parametrize("headroom", [1.25, None])
async def test_a_round_paces_its_connections_and_lifts_the_cap_after(
    make_node: NodeFactory, headroom: float | None
) -> None:
    nodes = [await make_node() for _ in range(3)]
    for node in nodes:
        cap = EstimatorConfig(upload_cap_bytes_per_s=UPLOAD)  # the rate before any measurement
        AllReduceService(node, links=LinkEstimator(cap))
    plan = make_plan(nodes, 200_000, shares=(0.75, 0.25, 0.0), chunk_elements=10_000)
    inputs = [torch.randn(200_000) for _ in nodes]
    config = AllReduceConfig(pacing_headroom=headroom)
    watch = _Watch(nodes[2], {0: nodes[0], 1: nodes[1]})
    results = await _run(nodes, plan, inputs, config, watch)
    expected = weighted_mean(inputs, [1.0] * 3)
    for output, report in results:
        torch.testing.assert_close(output.double(), expected, rtol=1e-6, atol=1e-6)
        assert report.complete
    if headroom is None:
        assert watch.seen == {0: {None}, 1: {None}}
    else:  # member 2 reduces nothing: its two connections carry its parts only
        capacity = payload_rate(UPLOAD)  # the typed-in link rate's payload
        assert watch.seen == {
            0: {round(headroom * capacity * 0.75)},
            1: {round(headroom * capacity * 0.25)},
        }
    for node in nodes:  # after the round nothing is paced
        for conn in node.connections():
            assert isinstance(conn.transport, TCPTransport)
            assert conn.transport.kernel_pacing_rate is None
            assert conn.pacing_rate is None


async def _run(
    nodes: list[Node],
    plan: GroupPlan,
    inputs: list[torch.Tensor],
    config: AllReduceConfig,
    watch: _Watch,
) -> list[tuple[torch.Tensor, AllReduceReport]]:
    calls = [
        AllReduceService.attach(node).allreduce(
            plan, x, 1.0, config=config, observer=watch if i == 2 else None
        )
        for i, (node, x) in enumerate(zip(nodes, inputs, strict=True))
    ]
    return list(await asyncio.gather(*calls))


def _plan_for(num_elements: int, *, shares: tuple[float, ...]) -> GroupPlan:
    ids = [Identity.generate().peer_id for _ in shares]
    members = [
        GroupMember(i, PeerAddress.parse(f"{i}@127.0.0.1:{9000 + n}")) for n, i in enumerate(ids)
    ]
    return GroupPlan.from_shares(members, shares, num_elements, chunk_elements=100)
