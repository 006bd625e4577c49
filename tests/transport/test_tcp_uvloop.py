"""The TCP transport's uvloop paths: a frame's head and payload in one vectored
write, a lone read of the next head after a payload read straight into its
buffer. Bulk messages and small ones, interleaved, must arrive intact and in
order, sealed and in plaintext."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from p2ptrain.node.config import NodeConfig
from p2ptrain.node.node import Node
from p2ptrain.rpc.handlers import CallContext
from p2ptrain.rpc.stream import RPCStream
from p2ptrain.transport.tcp import TCPTransport

uvloop = pytest.importorskip("uvloop")

SIZES = [1 << 20, 3, 1 << 20, (1 << 20) + 5, 70_000, 0, 1 << 20, 64 * 1024 - 1, 1 << 20]


def payload(i: int, size: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


async def exchange(plaintext: bool) -> tuple[list[bool], int]:
    config = NodeConfig(insecure_plaintext=plaintext, memory_release_interval=0)
    results: list[bool] = []

    async def sink(context: CallContext, stream: RPCStream) -> None:
        async for message in stream:
            i = message.body
            results.append(bytes(message.payload) == payload(i, SIZES[i]))
        await stream.send("done", end=True)

    async with Node(config=config) as server, Node(config=config) as client:
        server.handlers.add_stream("sink", sink)
        conn = await client.connect(server.address)
        transport = conn.transport
        assert isinstance(transport, TCPTransport) and transport._vectored
        async with await client.open_stream(server.address, "sink") as stream:
            for i, size in enumerate(SIZES):
                await stream.send(i, payload(i, size), end=i == len(SIZES) - 1)
            assert (await stream.recv()).body == "done"
        return results, transport.stats.frames_sent


@pytest.mark.parametrize("plaintext", [False, True], ids=["sealed", "plaintext"])
def test_bulk_and_small_messages_through_uvloop(plaintext: bool) -> None:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        results, frames = runner.run(asyncio.wait_for(exchange(plaintext), 30))
    assert results == [True] * len(SIZES)
    assert frames >= len(SIZES)
