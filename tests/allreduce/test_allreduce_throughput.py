"""Measured inputs and the receive path over real loopback TCP.

Payloads received straight into a buffer the stream names (and never into a
result the caller already holds); download time measured where the bytes
arrive (waiting is not transfer time); the probe a peer without measurements
runs, and how it feeds the meter; the buffer pool's reserve.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from allreduce_rounds import make_members, make_plan, weighted_mean
from conftest import NodeFactory

from p2ptrain.allreduce import ThroughputConfig, ThroughputMeter, allreduce
from p2ptrain.allreduce.protocol import METHOD, ResultHeader, codec_for
from p2ptrain.errors import InvalidArgumentError
from p2ptrain.measure.probe import (
    MAX_PROBE_BYTES,
    PROBE_METHOD,
    measure_if_unknown,
    probe_throughput,
)
from p2ptrain.rpc.handlers import CallContext
from p2ptrain.rpc.stream import RPCStream
from p2ptrain.wire.buffers import BufferPool
from p2ptrain.wire.frames import Frame, FrameType, frame_header


async def test_a_payload_lands_in_the_buffer_the_stream_names(make_node: NodeFactory) -> None:
    server, client = await make_node(), await make_node()
    sizes = [300_000, 300_000, 1000]  # in place; a buffer of the wrong size; a small payload

    async def send_three(context: CallContext, stream: RPCStream) -> None:
        await stream.recv()
        for i, size in enumerate(sizes):
            await stream.send({"i": i}, bytes([i + 1]) * size)
        await stream.end()

    server.handlers.add_stream("test/payloads", send_three)
    target = bytearray(300_000)
    asked: list[tuple[object, int]] = []

    def place(body: object, nbytes: int) -> memoryview | None:
        asked.append((body, nbytes))
        return memoryview(target) if body == {"i": 0} else memoryview(bytearray(5))

    stream = await client.open_stream(server.address, "test/payloads", timeout=10)
    stream.receive_payloads_into(place)
    await stream.send("go")
    first, second, third = [await stream.recv() for _ in sizes]
    assert target == bytes([1]) * 300_000
    target[0] = 9  # the message's payload is the target itself
    assert bytes(memoryview(first.payload)[:2]) == bytes([9, 1])
    assert bytes(second.payload) == bytes([2]) * 300_000  # a buffer of the wrong size is ignored
    assert bytes(third.payload) == bytes([3]) * 1000
    assert asked == [({"i": i}, size) for i, size in enumerate(sizes)]
    await stream.aclose()


async def test_download_time_counts_arriving_bytes_not_waiting(make_node: NodeFactory) -> None:
    nodes = await make_members(make_node, 3)
    plan = make_plan(nodes, 60_000, chunk_elements=5_000)
    inputs = [torch.randn(60_000) for _ in nodes]
    delay = 0.8

    async def late() -> tuple[torch.Tensor, object]:
        await asyncio.sleep(delay)  # member 2 enters late: the others wait for its parts
        return await allreduce(nodes[2], plan, inputs[2], 1.0)

    (out0, report0), (out1, report1), _ = await asyncio.gather(
        allreduce(nodes[0], plan, inputs[0], 1.0), allreduce(nodes[1], plan, inputs[1], 1.0), late()
    )
    expected = weighted_mean(inputs, [1.0, 1.0, 1.0])
    for output, report in ((out0, report0), (out1, report1)):
        torch.testing.assert_close(output.double(), expected, rtol=1e-6, atol=1e-6)
        assert report.total_s > delay * 0.9
        # 2/3 of 240 kB arrive in well under the wait, which is not counted.
        assert 0 < report.receive_s < delay / 2
        assert report.bytes_received == 2 * 2 * 20_000 * 4  # parts and averages
    meter = ThroughputMeter(ThroughputConfig(min_bytes=0, min_seconds=0))
    meter.record_round(report0)
    rate = meter.download_bytes_per_s
    assert rate is not None and rate > 2 * report0.bytes_received / delay


async def test_a_probe_fills_only_the_directions_the_meter_lacks(make_node: NodeFactory) -> None:
    nodes = await make_members(make_node, 2)
    gone = await make_node()
    unreachable = gone.address
    await gone.aclose()
    config = ThroughputConfig(min_bytes=0, min_seconds=0)
    meter = ThroughputMeter(config)
    result = await measure_if_unknown(meter, nodes[0], [unreachable, nodes[1].address])
    assert result is not None and result.nbytes == 4 << 20
    assert meter.samples == (1, 1)
    assert meter.upload_bytes_per_s == pytest.approx(result.upload_bytes_per_s)
    assert meter.download_bytes_per_s == pytest.approx(result.download_bytes_per_s)
    assert result.upload_bytes_per_s > 1e6 and result.download_bytes_per_s > 1e6  # loopback
    assert await measure_if_unknown(meter, nodes[0], [nodes[1].address]) is None  # known now

    explicit = ThroughputMeter(ThroughputConfig(upload_bytes_per_s=5e6, min_bytes=0, min_seconds=0))
    assert await measure_if_unknown(explicit, nodes[1], [nodes[0].address]) is not None
    assert explicit.samples == (0, 1)
    capacity = explicit.capacity(default_bytes_per_s=1.0)
    assert capacity.upload_bytes_per_s == 5e6  # explicit wins
    assert capacity.download_bytes_per_s == explicit.download_bytes_per_s != 1.0
    assert await measure_if_unknown(ThroughputMeter(), nodes[0], [unreachable]) is None


async def test_a_probe_server_refuses_oversized_or_malformed_requests(
    make_node: NodeFactory,
) -> None:
    nodes = await make_members(make_node, 3)
    # A healthy peer probes the server while another sends it bad requests.
    healthy = asyncio.create_task(probe_throughput(nodes[2], nodes[1].address, nbytes=8 << 20))
    for request in ({"u": MAX_PROBE_BYTES + 1, "n": 1}, {"u": 1, "n": True}, [1, 2]):
        stream = await nodes[0].open_stream(nodes[1].address, PROBE_METHOD, timeout=10)
        await stream.send(request)
        with pytest.raises(InvalidArgumentError):
            await stream.recv()
        await stream.aclose()
    served = await healthy
    assert served.upload_s > 0 and served.download_s > 0
    result = await probe_throughput(nodes[0], nodes[1].address, nbytes=1 << 20)
    assert result.upload_s > 0 and result.download_s > 0


async def test_an_average_still_arriving_when_the_round_ends_cannot_touch_the_result(
    make_node: NodeFactory,
) -> None:
    # Member 1 is a fake reducer: it sends the header of its average and half
    # of the payload, then stalls past the end of the round; the rest arrives
    # only after member 0 holds its result.
    (node,) = await make_members(make_node, 1)
    fake = await make_node()
    plan = make_plan([node, fake], 200_000, reduce_timeout=0.5, round_timeout=1.5)
    start, stop = plan.part(1)
    stalled: asyncio.Future[tuple[Any, bytes]] = asyncio.get_running_loop().create_future()
    fake_transports: list[Any] = []

    async def reducer(context: CallContext, stream: RPCStream) -> None:
        for _ in range(1 + len(plan.chunks(1))):  # the hello and the parts
            await stream.recv()
        header, _ = codec_for("none", 1).encode(torch.zeros(stop - start))
        body = ResultHeader(0, (0, 1), (), header).to_body()
        payload = b"\xff" * ((stop - start) * 4)  # NaN everywhere
        frame = Frame(FrameType.DATA, stream.stream_id, 0, {"b": body}, payload)
        connection = fake.connection_to(node.peer_id)
        assert connection is not None and connection.transport._sealer is not None
        head, sealed = connection.transport._sealer.seal(  # a record, as the channel needs
            frame_header(frame), memoryview(payload)
        )
        assert sealed is not None
        record = head + bytes(sealed)
        raw = connection.transport._transport  # type: ignore[attr-defined]
        raw.write(record[: len(record) // 2])
        # Nothing else may be written until the rest of this frame (e.g. the
        # RESET answering member 0's at the end of its round): drop it.
        connection.transport.send_frame_nowait = lambda frame: 0  # type: ignore[method-assign]
        fake_transports.append(connection.transport)
        stalled.set_result((raw, record[len(record) // 2 :]))
        await asyncio.Event().wait()

    fake.handlers.add_stream(METHOD, reducer)
    local = torch.randn(200_000)
    output, report = await allreduce(node, plan, local, 1.0)
    assert report.shards[1].error is not None
    raw, rest = await stalled
    (fake_transport,) = fake_transports
    raw.write(rest)  # the rest of the payload, after the round
    del fake_transport.send_frame_nowait  # frames flow again
    connection = node.connection_to(fake.peer_id)
    assert connection is not None
    await connection.ping(timeout=5)  # every byte written before the pong has been read
    torch.testing.assert_close(output, local)  # nobody contributed anything but us


def test_a_reserved_pool_keeps_what_a_round_cycles_through() -> None:
    pool = BufferPool(max_idle_bytes=1 << 20)
    buffer = pool.get(3 << 20)  # larger than the cap: freed, not kept
    del buffer
    assert pool.idle_bytes == 0
    pool.reserve(8 << 20)
    pool.reserve(1)  # never lowers the cap
    assert pool.max_idle_bytes == 8 << 20
    buffer = pool.get(3 << 20)
    del buffer
    assert pool.idle_bytes == 4 << 20  # its power-of-two class, kept
    again = pool.get(3 << 20)
    assert pool.reused == 1 and pool.allocated == 2 and len(again) == 3 << 20
