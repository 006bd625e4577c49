"""Butterfly all-reduce over real loopback TCP, all members in one process.

Correctness (exact weighted averages for 2, 3, 5 and 8 members and odd
sizes, client-mode members, weight 0, compression within its bound), the
report, deadlines for members that stall or never show up, and the API.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from allreduce_rounds import make_members, make_plan, run_round, weighted_mean
from allreduce_worker import check_chunks
from conftest import NodeFactory

from p2ptrain.allreduce import (
    AllReduceConfig,
    AllReduceService,
    ThroughputMeter,
    allreduce,
)
from p2ptrain.allreduce.compression import get_codec
from p2ptrain.allreduce.lp import LoadBalancer, PeerCapacity
from p2ptrain.allreduce.protocol import METHOD, Hello
from p2ptrain.errors import ConfigError


@pytest.mark.parametrize(
    ("count", "num_elements"), [(2, 1), (2, 4099), (3, 10_007), (5, 3_333), (8, 20_011)]
)
async def test_every_member_gets_the_exact_weighted_average(
    make_node: NodeFactory, count: int, num_elements: int
) -> None:
    nodes = await make_members(make_node, count)
    plan = make_plan(nodes, num_elements, chunk_elements=257)
    generator = torch.Generator().manual_seed(count)
    inputs = [torch.randn(num_elements, generator=generator) * (i + 1) for i in range(count)]
    weights = [float(3 * i + 1) for i in range(count)]
    expected = weighted_mean(inputs, weights)
    for output, report in await run_round(nodes, plan, inputs, weights):
        torch.testing.assert_close(output.double(), expected, rtol=1e-6, atol=1e-6)
        assert report.complete and not report.failed
        assert report.total_s < plan.reduce_timeout


async def test_client_mode_members_send_and_receive_but_reduce_nothing(
    make_node: NodeFactory,
) -> None:
    nodes = await make_members(make_node, 5)
    clients = (1, 4)
    capacities = [PeerCapacity(1e8, 1e8, client_mode=i in clients) for i in range(5)]
    balance = LoadBalancer().plan(capacities, vector_bytes=4 * 9_999, target_batch_size=64)
    assert [balance.shares[i] for i in clients] == [0.0, 0.0]
    plan = make_plan(
        nodes,
        9_999,
        shares=balance.shares,
        clients=clients,
        chunk_elements=1000,
        predicted_time=balance.round_time_s,
    )
    assert plan.reducers() == [0, 2, 3]
    inputs = [torch.randn(9_999) for _ in nodes]
    weights = [1.0, 5.0, 2.0, 0.5, 3.0]
    expected = weighted_mean(inputs, weights)
    for i, (output, report) in enumerate(await run_round(nodes, plan, inputs, weights)):
        torch.testing.assert_close(output.double(), expected, rtol=1e-6, atol=1e-6)
        assert [shard.owner for shard in report.shards] == [0, 2, 3]
        assert all(shard.contributors == (0, 1, 2, 3, 4) for shard in report.shards)
        assert report.predicted_s == balance.round_time_s and report.slowdown is not None
        if i in clients:  # its own parts out, every average in; it served nothing
            assert report.bytes_sent == 4 * 9_999
            assert report.bytes_received == 4 * 9_999


async def test_a_weight_zero_member_receives_the_average_without_changing_it(
    make_node: NodeFactory,
) -> None:
    nodes = await make_members(make_node, 4)
    plan = make_plan(nodes, 5_001, chunk_elements=500)
    inputs = [torch.randn(5_001) for _ in nodes]
    inputs[2] = torch.full((5_001,), 1e30)  # would dominate if it counted
    weights = [1.0, 2.0, 0.0, 3.0]
    expected = weighted_mean(inputs, weights)
    for output, report in await run_round(nodes, plan, inputs, weights):
        torch.testing.assert_close(output.double(), expected, rtol=1e-6, atol=1e-6)
        assert all(shard.contributors == (0, 1, 3) for shard in report.shards)


async def test_with_all_weights_zero_everyone_keeps_local_values(make_node: NodeFactory) -> None:
    nodes = await make_members(make_node, 3)
    plan = make_plan(nodes, 1000, chunk_elements=100)
    inputs = [torch.randn(1000) for _ in nodes]
    for (output, report), x in zip(
        await run_round(nodes, plan, inputs, [0, 0, 0]), inputs, strict=True
    ):
        assert torch.equal(output, x)
        assert not report.complete
        assert all(c is None for shard in report.shards for c in shard.chunk_contributors)
        assert not report.failed


@pytest.mark.parametrize("codec", ["fp16", "bf16", "int8"])
async def test_compression_error_stays_within_the_codec_bound(
    make_node: NodeFactory, codec: str
) -> None:
    nodes = await make_members(make_node, 4)
    plan = make_plan(nodes, 12_345, chunk_elements=1_000)
    inputs = [torch.randn(12_345) * 10 ** (i - 1) for i in range(4)]
    weights = [1.0, 2.0, 3.0, 4.0]
    config = AllReduceConfig(codec=codec, block_size=128)
    expected = weighted_mean(inputs, weights)
    scheme = get_codec(codec, block_size=128)
    total = sum(weights)
    outputs = [output for output, _ in await run_round(nodes, plan, inputs, weights, config)]
    for output in outputs[1:]:
        assert torch.equal(output, outputs[0])  # every member ends with the same values
    for output in outputs:
        error = (output.double() - expected).abs()
        assert error.max() > 0  # compression did happen
        for owner in plan.reducers():
            for lo, hi in plan.chunks(owner):
                # Parts are compressed by their senders (not the owner's own),
                # the average once more on its way back (the owner keeps that too).
                bound = (
                    sum(
                        w * scheme.error_bound(x[lo:hi])
                        for i, (x, w) in enumerate(zip(inputs, weights, strict=True))
                        if i != owner
                    )
                    / total
                )
                bound += scheme.error_bound(expected[lo:hi].float()) * (1 + 1e-3)
                assert float(error[lo:hi].max()) <= bound * (1 + 1e-4) + 1e-6


async def test_several_tensors_of_mixed_dtypes(make_node: NodeFactory) -> None:
    nodes = await make_members(make_node, 3)
    shapes = [(3, 5), (7,), (), (2, 2, 2)]
    dtypes = [torch.float32, torch.float64, torch.float32, torch.float16]
    numel = sum(torch.Size(s).numel() for s in shapes)
    plan = make_plan(nodes, numel, chunk_elements=4)
    inputs = [[torch.randn(s).to(d) for s, d in zip(shapes, dtypes, strict=True)] for _ in nodes]
    results = await asyncio.gather(
        *(allreduce(node, plan, x, 1.0) for node, x in zip(nodes, inputs, strict=True))
    )
    for tensors, _ in results:
        assert [t.shape for t in tensors] == [torch.Size(s) for s in shapes]
        assert [t.dtype for t in tensors] == dtypes
        for k, tensor in enumerate(tensors):
            expected = sum(x[k].double() for x in inputs) / 3
            torch.testing.assert_close(tensor.double(), expected, rtol=2e-3, atol=2e-3)


async def test_a_group_of_one_returns_its_own_values(make_node: NodeFactory) -> None:
    (node,) = await make_members(make_node, 1)
    plan = make_plan([node], 100)
    x = torch.randn(100)
    output, report = await allreduce(node, plan, x, 2.0)
    assert torch.equal(output, x) and report.complete and report.bytes_sent == 0


async def test_the_report_counts_bytes_and_times(make_node: NodeFactory) -> None:
    nodes = await make_members(make_node, 3)
    plan = make_plan(nodes, 3_000, shares=[0.5, 0.3, 0.2], chunk_elements=128)
    results = await run_round(nodes, plan, [torch.randn(3_000) for _ in nodes], [1, 1, 1])
    meter = ThroughputMeter()
    for index, (_, report) in enumerate(results):
        start, stop = plan.part(index)
        own = stop - start
        # Parts of the others' shards out, averages of its own shard to the 2 others.
        assert report.bytes_sent == 4 * (3_000 - own) + 4 * own * 2
        assert report.bytes_received == report.bytes_sent
        assert 0 < report.reduce_scatter_s <= report.total_s
        assert report.all_gather_s >= 0 and report.send_s > 0 and report.receive_s > 0
        assert report.members == tuple(node.peer_id for node in nodes)
        assert report.index == index and report.round_id == plan.round_id
        assert report.to_dict()["shards"][index]["owner"] == index
        meter.record_upload(report.bytes_sent, report.send_s)
    assert meter.samples == (0, 0)  # below min_bytes: too small to measure a rate


async def test_a_stalled_member_is_left_out_at_the_reduce_deadline(
    make_node: NodeFactory,
) -> None:
    nodes = await make_members(make_node, 4)
    staller, absent = 2, 3  # 2 sends a hello and then nothing; 3 never shows up
    plan = make_plan(
        nodes,
        4_000,
        shares=[0.5, 0.5, 0.0, 0.0],
        clients=(staller, absent),
        chunk_elements=500,
        reduce_timeout=0.5,
        round_timeout=5.0,
    )
    inputs = [torch.randn(4_000) for _ in nodes]
    streams = []
    for reducer in plan.reducers():
        stream = await nodes[staller].open_stream(nodes[reducer].address, METHOD, timeout=10)
        await stream.send(Hello(plan.round_id, plan.digest, 1.0, "none", 1024).to_body())
        streams.append(stream)
    results = await run_round(nodes[:2], plan, inputs[:2], [1.0, 3.0])
    expected = weighted_mean(inputs[:2], [1.0, 3.0])
    for output, report in results:
        torch.testing.assert_close(output.double(), expected, rtol=1e-6, atol=1e-6)
        assert plan.reduce_timeout <= report.total_s < plan.round_timeout
        for shard in report.shards:
            assert shard.contributors == (0, 1)
            assert shard.excluded == {
                staller: "missed the reduce-scatter deadline",
                absent: "did not join before the reduce-scatter deadline",
            }
    # The staller still gets the averages it did not help make.
    for stream in streams:
        replies = [(await stream.recv()).body for _ in range(4)]
        assert all(reply["x"] == [0, 1] for reply in replies)


async def test_a_reducer_that_never_enters_the_round_leaves_its_part_local(
    make_node: NodeFactory,
) -> None:
    nodes = await make_members(make_node, 3, join_timeout=0.3)
    plan = make_plan(nodes, 3_000, chunk_elements=300, reduce_timeout=1.0, round_timeout=5.0)
    inputs = [torch.randn(3_000) for _ in nodes]
    results = await run_round(nodes[:2], plan, inputs[:2], [1.0, 1.0])
    for index, (output, report) in enumerate(results):
        absent = report.shards[2]
        assert absent.error is not None and "no such round" in absent.error
        assert all(c is None for c in absent.chunk_contributors)
        check_chunks(plan, index, output, report.to_dict(), inputs=inputs, weights=[1, 1, 1])
        assert report.shards[index].contributors == (0, 1)
        assert report.total_s < plan.round_timeout


async def test_bad_arguments_are_refused(make_node: NodeFactory) -> None:
    nodes = await make_members(make_node, 2)
    plan = make_plan(nodes, 10)
    stranger = await make_node()
    with pytest.raises(ConfigError, match="not a member"):
        await allreduce(stranger, plan, torch.zeros(10))
    with pytest.raises(ConfigError, match="10 float32 values"):
        await allreduce(nodes[0], plan, torch.zeros(11))
    with pytest.raises(ConfigError, match="weight"):
        await allreduce(nodes[0], plan, torch.zeros(10), -1.0)
    with pytest.raises(ConfigError, match="floating-point"):
        await allreduce(nodes[0], plan, torch.zeros(10, dtype=torch.int64))
    solo = make_plan(nodes[:1], 10)
    await allreduce(nodes[0], solo, torch.zeros(10))
    with pytest.raises(ConfigError, match="already used"):
        await allreduce(nodes[0], solo, torch.zeros(10))
    with pytest.raises(ConfigError, match="already has a handler"):
        AllReduceService(nodes[0])
    assert AllReduceService.attach(nodes[0]) is AllReduceService.attach(nodes[0])


async def test_a_member_that_is_down_is_not_waited_for(make_node: NodeFactory) -> None:
    nodes = await make_members(make_node, 3)
    plan = make_plan(nodes, 3_000, chunk_elements=300, reduce_timeout=10.0, round_timeout=20.0)
    await nodes[2].aclose()  # it owns a part and would send parts: neither happens
    inputs = [torch.randn(3_000) for _ in nodes]
    results = await run_round(nodes[:2], plan, inputs[:2], [1.0, 1.0])
    for index, (output, report) in enumerate(results):
        # Dialing it fails at once, so it is given up as a sender too.
        assert report.total_s < 5.0 < plan.reduce_timeout
        assert report.shards[2].error is not None and 2 in report.failed
        assert report.shards[index].contributors == (0, 1)
        check_chunks(plan, index, output, report.to_dict(), inputs=inputs, weights=[1, 1, 1])


async def test_a_stream_lost_before_the_round_starts_is_not_waited_for(
    make_node: NodeFactory,
) -> None:
    nodes = await make_members(make_node, 3)
    early = 2  # client mode: nobody opens a stream to it
    plan = make_plan(nodes, 2_000, clients=(early,), reduce_timeout=10.0, round_timeout=20.0)
    for reducer in plan.reducers():
        stream = await nodes[early].open_stream(nodes[reducer].address, METHOD, timeout=10)
        connection = nodes[early].connection_to(nodes[reducer].peer_id)
        assert connection is not None
        # Its hello arrives before the round starts there (frames are handled in
        # order, so after a ping round trip the handler holds the hello) ...
        await stream.send(Hello(plan.round_id, plan.digest, 1.0, "none", 1024).to_body())
        await connection.ping(timeout=5)
        stream.reset("cancelled", "gone")  # ... and its stream dies while it waits.
        await connection.ping(timeout=5)
    inputs = [torch.randn(2_000) for _ in nodes]
    for output, report in await run_round(nodes[:2], plan, inputs[:2], [1.0, 2.0]):
        assert report.total_s < 5.0 < plan.reduce_timeout
        torch.testing.assert_close(
            output.double(), weighted_mean(inputs[:2], [1.0, 2.0]), rtol=1e-6, atol=1e-6
        )
        for shard in report.shards:
            assert shard.excluded[early] == "its stream ended before this member entered the round"
