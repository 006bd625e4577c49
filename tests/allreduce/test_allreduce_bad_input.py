"""Bad input to the all-reduce over real sockets; the honest members always finish.

A rogue member (client mode, so it owns no part) speaks the all-reduce
messages by hand: NaN parts, parts of the wrong size or dtype, duplicated
parts and streams, another plan. A stranger outside the group tries to join
the round and other rounds. An honest runner with a 1e6-scaled vector meets
the robust aggregation rules. Each time the honest members complete the
round quickly with the averages their reports describe.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from allreduce_worker import check_chunks
from conftest import NodeFactory

from p2ptrain.allreduce import AllReduceConfig, AllReduceService, GroupMember, GroupPlan
from p2ptrain.allreduce.aggregation import centered_clip_bound
from p2ptrain.allreduce.compression import get_codec
from p2ptrain.allreduce.protocol import METHOD, Hello, PartHeader
from p2ptrain.allreduce.service import allreduce
from p2ptrain.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    PermissionDeniedError,
    RPCError,
)
from p2ptrain.node.node import Node
from p2ptrain.rpc.stream import RPCStream

HONEST = 3
ROGUE = 3  # member index of the rogue: after the honest ones
NUM_ELEMENTS = 6_001
CHUNK = 500


async def setup(
    make_node: NodeFactory, *, join_timeout: float = 10.0
) -> tuple[list[Node], GroupPlan]:
    """Three honest members that reduce, and a rogue in client mode."""
    nodes = [await make_node() for _ in range(HONEST + 1)]
    for node in nodes:
        AllReduceService(node, join_timeout=join_timeout)
    members = [
        GroupMember(n.peer_id, n.address if i < HONEST else None) for i, n in enumerate(nodes)
    ]
    plan = GroupPlan.from_shares(
        members,
        [1 / HONEST] * HONEST + [0.0],
        NUM_ELEMENTS,
        chunk_elements=CHUNK,
        reduce_timeout=10.0,
        round_timeout=20.0,
    )
    return nodes, plan


async def hello(
    node: Node, plan: GroupPlan, reducer: int, *, weight: float = 1.0, **changes: Any
) -> RPCStream:
    """Open a stream to ``reducer`` and send a hello (fields overridable)."""
    stream = await node.open_stream(plan.members[reducer].dial_address, METHOD, timeout=10)
    body = Hello(plan.round_id, plan.digest, weight, "none", 1024).to_body()
    body.update(changes)
    await stream.send(body)
    return stream


async def send_part(stream: RPCStream, chunk: int, values: torch.Tensor) -> None:
    header, payload = get_codec("none").encode(values)
    await stream.send(PartHeader(chunk, header).to_body(), payload)


async def expect_reset(stream: RPCStream, error: type[RPCError], match: str) -> None:
    """The stream ends in ``error`` (results before it are skipped)."""
    with pytest.raises(error, match=match):
        while True:
            await stream.recv()


async def honest_round(
    nodes: Sequence[Node],
    plan: GroupPlan,
    inputs: Sequence[torch.Tensor],
    config: AllReduceConfig | None = None,
) -> list[dict[str, Any]]:
    """Run the honest members; check they finish and that each chunk matches its report."""
    results = await asyncio.gather(
        *(allreduce(nodes[i], plan, inputs[i], 1.0, config=config) for i in range(HONEST))
    )
    reports = []
    for index, (output, report) in enumerate(results):
        assert report.total_s < plan.reduce_timeout  # nobody waited for a deadline
        assert all(shard.error is None for shard in report.shards)
        check_chunks(plan, index, output, report.to_dict(), inputs=list(inputs), weights=[1.0] * 4)
        reports.append(report.to_dict())
    return reports


def rogue_chunks(reports: list[dict[str, Any]], owner: int) -> list[bool]:
    """For each chunk of ``owner``'s part: whether the rogue is in its average."""
    return [ROGUE in c for c in reports[owner]["shards"][owner]["chunk_contributors"]]


async def test_a_part_with_nan_or_inf_is_never_averaged_in(make_node: NodeFactory) -> None:
    nodes, plan = await setup(make_node)
    inputs = [torch.randn(NUM_ELEMENTS) for _ in nodes]
    inputs[ROGUE][plan.chunks(0)[1][0] + 7] = float("nan")
    inputs[ROGUE][plan.chunks(1)[0][0]] = float("inf")

    async def rogue() -> list[RPCStream]:
        streams = [await hello(nodes[ROGUE], plan, j) for j in range(HONEST)]
        for j, stream in enumerate(streams):
            for k, (lo, hi) in enumerate(plan.chunks(j)):
                await send_part(stream, k, inputs[ROGUE][lo:hi])
            await stream.end()
        return streams

    reports, streams = await asyncio.gather(honest_round(nodes, plan, inputs), rogue())
    sizes = [len(plan.chunks(owner)) for owner in range(HONEST)]
    assert rogue_chunks(reports, 0) == [True] + [False] * (sizes[0] - 1)  # chunk 0 was clean
    assert rogue_chunks(reports, 1) == [False] * sizes[1]
    assert rogue_chunks(reports, 2) == [True] * sizes[2]
    for report in reports:  # every member learns why
        assert report["shards"][0]["excluded"] == {str(ROGUE): "non-finite values in chunk 1"}
        assert report["shards"][1]["excluded"] == {str(ROGUE): "non-finite values in chunk 0"}
    # Excluded, not cut off: the rogue still receives every (finite) average.
    for j, stream in enumerate(streams):
        for k in range(len(plan.chunks(j))):
            message = await stream.recv()
            assert message.body["i"] == k
            assert (ROGUE in message.body["x"]) == rogue_chunks(reports, j)[k]


async def test_an_honest_runner_with_non_finite_values_is_excluded(make_node: NodeFactory) -> None:
    nodes, plan = await setup(make_node)
    nodes, plan = (
        nodes[:HONEST],
        GroupPlan.from_shares(
            [GroupMember(n.peer_id, n.address) for n in nodes[:HONEST]],
            [1 / HONEST] * HONEST,
            NUM_ELEMENTS,
            chunk_elements=CHUNK,
        ),
    )
    inputs = [torch.randn(NUM_ELEMENTS) for _ in nodes]
    inputs[2][-1] = float("nan")  # in the last chunk of member 2's own part
    results = await asyncio.gather(
        *(allreduce(n, plan, x, 1.0) for n, x in zip(nodes, inputs, strict=True))
    )
    for index, (output, report) in enumerate(results):
        assert bool(output.isfinite().all())
        check_chunks(plan, index, output, report.to_dict(), inputs=inputs, weights=[1.0] * 3)
        last = len(plan.chunks(2)) - 1
        assert report.shards[2].excluded == {2: f"non-finite values in chunk {last}"}
        assert report.shards[2].chunk_contributors[-1] == (0, 1)


@pytest.mark.parametrize(
    ("header", "payload_bytes", "match"),
    [
        ({"c": "none", "n": CHUNK - 1}, 4 * (CHUNK - 1), "expected 500 elements"),  # wrong size
        ({"c": "none", "n": CHUNK}, 4 * CHUNK - 2, "payload is 1998 bytes"),  # truncated
        ({"c": "fp16", "n": CHUNK}, 4 * CHUNK, "payload is 2000 bytes"),  # float32 sent as fp16
        ({"c": "float64", "n": CHUNK}, 8 * CHUNK, "unknown codec"),  # no such codec
    ],
)
async def test_a_part_of_the_wrong_size_or_dtype_excludes_the_sender(
    make_node: NodeFactory, header: dict[str, Any], payload_bytes: int, match: str
) -> None:
    nodes, plan = await setup(make_node)
    inputs = [torch.randn(NUM_ELEMENTS) for _ in nodes]

    async def rogue() -> None:
        streams = [await hello(nodes[ROGUE], plan, j) for j in range(HONEST)]
        for j, stream in enumerate(streams):
            lo, hi = plan.chunks(j)[0]
            await send_part(stream, 0, inputs[ROGUE][lo:hi])  # a good first part
            await stream.send(PartHeader(1, header).to_body(), bytes(payload_bytes))
            await expect_reset(stream, InvalidArgumentError, match)

    reports, _ = await asyncio.gather(honest_round(nodes, plan, inputs), rogue())
    for owner in range(HONEST):
        assert rogue_chunks(reports, owner) == [True] + [False] * (len(plan.chunks(owner)) - 1)
        reason = reports[owner]["shards"][owner]["excluded"][str(ROGUE)]
        assert reason.startswith("protocol violation") and match in reason
        assert "protocol violation" in reports[owner]["failed"][str(ROGUE)]


async def test_a_duplicated_part_or_stream_is_refused(make_node: NodeFactory) -> None:
    nodes, plan = await setup(make_node)
    inputs = [torch.randn(NUM_ELEMENTS) for _ in nodes]

    async def rogue() -> None:
        for j in range(HONEST):
            stream = await hello(nodes[ROGUE], plan, j)
            second = await hello(nodes[ROGUE], plan, j)
            await expect_reset(second, InvalidArgumentError, "second stream")
            lo, hi = plan.chunks(j)[0]
            await send_part(stream, 0, inputs[ROGUE][lo:hi])
            await send_part(stream, 0, inputs[ROGUE][lo:hi])  # the same part again
            await expect_reset(stream, InvalidArgumentError, "sent chunk 0, expected chunk 1")

    reports, _ = await asyncio.gather(honest_round(nodes, plan, inputs), rogue())
    for owner in range(HONEST):
        assert rogue_chunks(reports, owner) == [True] + [False] * (len(plan.chunks(owner)) - 1)


async def test_strangers_other_rounds_and_other_plans_are_refused(make_node: NodeFactory) -> None:
    nodes, plan = await setup(make_node, join_timeout=0.3)
    stranger = await make_node()
    inputs = [torch.randn(NUM_ELEMENTS) for _ in nodes]

    async def intruders() -> None:
        # Not in the group: refused by identity, whatever it claims.
        stream = await hello(stranger, plan, 0)
        await expect_reset(stream, PermissionDeniedError, "not a member")
        # A round nobody here enters: refused after join_timeout.
        stream = await hello(stranger, plan, 1, r=b"another round id")
        await expect_reset(stream, DeadlineExceededError, "no such round")
        # A member holding another plan: refused; then it joins properly, weight 0.
        stream = await hello(nodes[ROGUE], plan, 2, g=bytes(32))
        await expect_reset(stream, InvalidArgumentError, "different group plan")
        for j in range(HONEST):
            stream = await hello(nodes[ROGUE], plan, j, weight=0.0)
            await stream.end()
        # Garbage instead of a hello.
        stream = await nodes[ROGUE].open_stream(plan.members[0].dial_address, METHOD, timeout=5)
        await stream.send({"r": 1})
        await expect_reset(stream, InvalidArgumentError, "hello keys")

    reports, _ = await asyncio.gather(honest_round(nodes, plan, inputs), intruders())
    for owner in range(HONEST):
        assert not any(rogue_chunks(reports, owner))
    # A late stream for a finished round is refused at once.
    stream = await hello(stranger, plan, 0)
    await expect_reset(stream, InvalidArgumentError, "round is over")


@pytest.mark.parametrize("rule", ["trimmed_mean", "centered_clip"])
async def test_robust_rules_bound_a_member_sending_a_1e6_scaled_vector(
    make_node: NodeFactory, rule: str
) -> None:
    count, bad = 5, 3
    nodes = [await make_node() for _ in range(count)]
    for node in nodes:
        AllReduceService(node)
    plan = GroupPlan.from_shares(
        [GroupMember(n.peer_id, n.address) for n in nodes],
        [1 / count] * count,
        NUM_ELEMENTS,
        chunk_elements=CHUNK,
    )
    honest_inputs = [torch.randn(NUM_ELEMENTS) + 1 for _ in range(count)]
    inputs = list(honest_inputs)
    inputs[bad] = honest_inputs[bad] * 1e6
    weights = [1.0, 2.0, 1.0, 5.0, 1.0]
    config = AllReduceConfig(aggregation=rule, trim=1, clip_iterations=3)
    results = await asyncio.gather(
        *(
            allreduce(n, plan, x, w, config=config)
            for n, x, w in zip(nodes, inputs, weights, strict=True)
        )
    )
    honest = torch.stack([x for i, x in enumerate(inputs) if i != bad])
    honest_weights = torch.tensor(
        [w for i, w in enumerate(weights) if i != bad], dtype=torch.float64
    )
    honest_mean = (honest_weights / honest_weights.sum()) @ honest.double()
    plain_mean = sum(w * x.double() for w, x in zip(weights, inputs, strict=True)) / sum(weights)
    for output, report in results:
        assert report.complete and report.total_s < plan.reduce_timeout
        if rule == "trimmed_mean":  # every coordinate within the honest range
            assert bool((output >= honest.min(dim=0).values).all())
            assert bool((output <= honest.max(dim=0).values).all())
        else:  # every chunk within D_H + L·τ of the honest mean
            for owner in range(count):
                for lo, hi in plan.chunks(owner):
                    bound = centered_clip_bound(
                        honest[:, lo:hi], honest_weights, iterations=3, radius=None
                    )
                    distance = float((output[lo:hi].double() - honest_mean[lo:hi]).norm())
                    assert distance <= bound
        # The plain mean would have been dragged ~1e6 times away.
        assert float((output.double() - honest_mean).norm()) < 1e-3 * float(
            (plain_mean - honest_mean).norm()
        )
