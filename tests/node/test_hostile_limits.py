"""Hostile peers at the connection layer: what a stranger may make a node hold.

Real nodes on loopback; the attacker uses raw sockets or a real node whose
reading is paused (a peer that never reads).
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
import subprocess
import sys
import time

import pytest
from conftest import NodeFactory, stall_server

from p2ptrain.errors import DeadlineExceededError, ResourceExhaustedError
from p2ptrain.lab.echo import echo
from p2ptrain.lab.virtual_clock import run_virtual
from p2ptrain.node.config import NodeConfig
from p2ptrain.node.limits import RateLimitedLog
from p2ptrain.node.memory import malloc_trim, release_for_loop, release_unused_memory
from p2ptrain.node.node import Node
from p2ptrain.rpc.budget import ByteBudget
from p2ptrain.rpc.config import ConnectionConfig
from p2ptrain.rpc.connection import Connection
from p2ptrain.rpc.handlers import CallContext, Message
from p2ptrain.rpc.stream import RPCStream
from p2ptrain.transport.tcp import TCPTransport
from p2ptrain.wire.buffers import BufferPool

pytestmark = pytest.mark.timeout(60)


async def assert_healthy(server: Node, client: Node) -> None:
    reply = await client.call(server.address, "echo", {"x": 1}, timeout=5)
    assert reply.body["body"] == {"x": 1}


def warnings_about(caplog: pytest.LogCaptureFixture, needle: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if needle in r.getMessage()]


async def test_a_large_first_frame_is_refused_from_its_prefix(
    make_node: NodeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """1 MiB is a legal frame after the handshake, but not before it."""
    server = await make_node()
    server.handlers.add_unary("echo", echo)
    caplog.set_level(logging.WARNING)
    reader, writer = await asyncio.open_connection(server.address.host, server.address.port)
    writer.write(struct.pack(">II", 1 << 20, 64) + b"\x00" * 4096)
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed on us
    writer.close()
    refusals = warnings_about(caplog, "refused connection")
    assert len(refusals) == 1 and "exceeds the limit of 65536" in refusals[0], refusals
    client = await make_node()
    await assert_healthy(server, client)


@pytest.mark.parametrize(
    ("config", "admitted"),
    [({"max_inbound": 3}, 3), ({"max_inbound_per_source": 2}, 2)],
)
async def test_inbound_sockets_are_capped(
    make_node: NodeFactory,
    caplog: pytest.LogCaptureFixture,
    config: dict[str, int],
    admitted: int,
) -> None:
    """Sockets beyond the cap are closed at once; the ones held time out later."""
    server = await make_node(
        config=NodeConfig(connection=ConnectionConfig(handshake_timeout=3.0), **config)
    )
    caplog.set_level(logging.WARNING)
    socks = [
        await asyncio.open_connection(server.address.host, server.address.port) for _ in range(6)
    ]
    closed_at_once = 0
    for reader, _ in socks:
        try:
            data = await asyncio.wait_for(reader.read(), 0.5)
        except TimeoutError:
            continue  # still held: it is in the handshake
        assert data == b""
        closed_at_once += 1
    assert closed_at_once == 6 - admitted
    assert len(server.inbound) == admitted
    # One warning line, not one per refused socket.
    assert len(warnings_about(caplog, "too many inbound connections")) == 1
    for _, writer in socks:
        writer.close()


def test_rate_limited_log_counts_what_it_left_out(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    log = RateLimitedLog(logging.getLogger("t"), interval=10.0, clock=lambda: now[0])
    caplog.set_level(logging.INFO)
    assert log.log(logging.INFO, "k", "refused %s", "a")
    assert not any(log.log(logging.INFO, "k", "refused %s", "b") for _ in range(99))
    now[0] = 10.0
    assert log.log(logging.INFO, "k", "refused %s", "c")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["refused a", "refused c (and 99 more like it since the last report)"]


async def test_unread_stream_data_is_capped_per_connection(make_node: NodeFactory) -> None:
    """Streams nobody reads may not buffer more than max_buffered_bytes together."""
    limits = ConnectionConfig(
        stream_window=1 << 20, max_frame_bytes=1 << 20, max_buffered_bytes=1 << 20
    )
    server = await stall_server(make_node, limits)
    client = await make_node()
    conn = await client.connect(server.address)
    streams = [await conn.open_stream("stall", timeout=10) for _ in range(4)]
    chunk = b"x" * (300 * 1024)
    for stream in streams:  # 4 x 300 KiB: the fourth passes 1 MiB
        await stream.send(None, chunk)
    with pytest.raises(ResourceExhaustedError, match="unread"):
        await streams[3].recv()
    (server_conn,) = server.connections()
    assert server_conn.buffered_bytes <= 1 << 20
    assert not conn.closed
    await assert_healthy(server, client)


def closed(conn: Connection) -> asyncio.Event:
    """An event set once ``conn`` closed (after its streams were dropped)."""
    event = asyncio.Event()
    conn.on_close(lambda _: event.set())
    return event


async def test_unread_stream_data_is_capped_across_connections(make_node: NodeFactory) -> None:
    """Peers that each stay under their connection's cap still share one node-wide cap."""
    limits = ConnectionConfig(
        stream_window=1 << 20,
        max_frame_bytes=1 << 20,
        max_buffered_bytes=1 << 20,
        max_node_buffered_bytes=1 << 20,
        connection_reserve_bytes=64 * 1024,
    )
    server = await stall_server(make_node, limits)
    chunk = b"x" * (300 * 1024)
    attackers = [await (await make_node()).connect(server.address) for _ in range(2)]
    sent = []
    for conn in attackers:  # 2 x 2 x 300 KiB: under 1 MiB a connection, over it in all
        for _ in range(2):
            stream = await conn.open_stream("stall", timeout=30)
            await stream.send(None, chunk)
            sent.append(stream)
    with pytest.raises(ResourceExhaustedError, match="node limit"):
        await sent[3].recv()
    budget = server.unread_budget
    assert 0 < budget.used <= budget.limit
    # The pool is full, but a small request of another peer still fits its reserve.
    client = await make_node()
    await assert_healthy(server, client)
    # Once the attackers leave, everything they pinned is given back.
    server_side = [c for c in server.connections() if c.remote_peer != client.peer_id]
    gone = [closed(c) for c in server_side]
    for conn in attackers:
        await conn.aclose()
    await asyncio.wait_for(asyncio.gather(*(g.wait() for g in gone)), 10)
    assert budget.used == 0


async def test_open_streams_are_capped_across_connections(make_node: NodeFactory) -> None:
    limits = ConnectionConfig(max_streams=4, max_node_streams=5, connection_reserve_streams=1)
    server = await stall_server(make_node, limits)
    attackers = [await (await make_node()).connect(server.address) for _ in range(2)]
    held = [await attackers[0].open_stream("stall", timeout=30) for _ in range(4)]
    with pytest.raises(ResourceExhaustedError, match="on this connection"):
        extra = await attackers[0].open_stream("stall", timeout=30)
        await extra.recv()
    # The first connection took 1 reserved + 3 pooled streams; the second one
    # gets its reserved stream and the 2 pooled left, then the pool is empty.
    held += [await attackers[1].open_stream("stall", timeout=30) for _ in range(3)]
    with pytest.raises(ResourceExhaustedError, match="streams open from its peers"):
        extra = await attackers[1].open_stream("stall", timeout=30)
        await extra.recv()
    assert server.stream_budget.used == server.stream_budget.limit
    client = await make_node()
    await assert_healthy(server, client)  # its reserved stream
    server_side = [c for c in server.connections() if c.remote_peer != client.peer_id]
    gone = [closed(c) for c in server_side]
    for conn in attackers:
        await conn.aclose()
    await asyncio.wait_for(asyncio.gather(*(g.wait() for g in gone)), 10)
    assert server.stream_budget.used == 0
    assert len(held) == 7


async def test_a_handler_that_waits_forever_is_cancelled_at_the_time_limit(
    make_node: NodeFactory,
) -> None:
    server = await make_node(config=NodeConfig(connection=ConnectionConfig(handler_timeout=0.5)))
    server.handlers.add_unary("echo", echo)
    never = asyncio.Event()
    cancelled: list[str] = []

    async def hang(ctx: CallContext, request: Message) -> Message:
        try:
            await never.wait()
        except asyncio.CancelledError:
            cancelled.append(ctx.method)
            raise
        return request

    async def chat(ctx: CallContext, stream: RPCStream) -> None:
        async for message in stream:
            await stream.send(message.body)

    server.handlers.add_unary("hang", hang)
    server.handlers.add_stream("chat", chat, unbounded=True)
    client = await make_node()
    conn = await client.connect(server.address)
    long_lived = await conn.open_stream("chat")  # no deadline, and exempt from the limit
    with pytest.raises(DeadlineExceededError, match=r"server's limit of 0\.5 s"):
        await conn.call("hang", {"x": 1})  # the caller set no deadline either
    assert cancelled == ["hang"]
    await long_lived.send("still there")  # past the limit, the unbounded stream lives on
    assert (await asyncio.wait_for(long_lived.recv(), 5)).body == "still there"
    await long_lived.end()
    await assert_healthy(server, client)


async def test_large_replies_are_budgeted_and_a_non_reader_is_dropped(
    make_node: NodeFactory,
) -> None:
    """A peer that asks for big replies and never reads pins at most the budget."""
    limits = ConnectionConfig(max_reply_bytes_in_flight=12 << 20, reply_send_timeout=1.0)
    server = await make_node(config=NodeConfig(connection=limits))
    refused = asyncio.Event()

    class WatchedBudget(ByteBudget):
        def try_take(self, nbytes: int) -> bool:
            taken = super().try_take(nbytes)
            if not taken:
                refused.set()
            return taken

    server.reply_budget = WatchedBudget(limits.max_reply_bytes_in_flight)
    big = b"y" * (8 << 20)

    async def large(ctx: CallContext, request: Message) -> Message:
        return Message(None, big)

    server.handlers.add_unary("large", large)
    server.handlers.add_unary("echo", echo)
    attacker = await make_node()
    conn = await attacker.connect(server.address)
    assert isinstance(conn.transport, TCPTransport)
    raw = conn.transport._transport
    assert raw is not None
    raw.pause_reading()  # the attacker never reads again
    calls = [asyncio.ensure_future(conn.call("large", timeout=30)) for _ in range(5)]
    await asyncio.wait_for(refused.wait(), 10)
    assert server.reply_budget.used <= limits.max_reply_bytes_in_flight
    (server_conn,) = server.connections()
    await asyncio.wait_for(server_conn.transport.wait_closed(), 10)  # the send deadline
    assert server.reply_budget.used == 0
    for call in calls:
        call.cancel()
    await asyncio.gather(*calls, return_exceptions=True)
    client = await make_node()
    await assert_healthy(server, client)


def test_pool_trim_frees_only_buffers_idle_long_enough() -> None:
    pool = BufferPool()
    view = pool.get(1 << 20)
    del view  # back in the pool
    assert pool.idle_bytes == 1 << 20
    assert pool.trim(idle_for=60.0) == 0
    assert pool.trim(idle_for=0.0) == 1 << 20
    assert pool.idle_bytes == 0
    assert release_unused_memory(idle_for=0.0) >= 0
    assert isinstance(malloc_trim(), bool)


def test_nodes_sharing_a_loop_run_one_memory_release_per_interval() -> None:
    """Each node of a process used to collect every interval: a simulation of 64
    nodes spent a quarter of its CPU in gc.collect."""
    passes: list[float] = []

    async def main() -> list[bool]:
        loop = asyncio.get_running_loop()

        def release(cost: float = 0.0) -> None:
            passes.append(loop.time())
            time.sleep(cost)

        ran = [release_for_loop(loop, 10.0, release=release) for _ in range(100)]  # 100 nodes
        await asyncio.sleep(4.0)
        ran.append(release_for_loop(loop, 10.0, release=release))
        await asyncio.sleep(6.0)  # due again; this pass takes 0.2 s: the next waits 20 s
        ran += [release_for_loop(loop, 10.0, release=lambda: release(0.2)) for _ in range(100)]
        await asyncio.sleep(10.0)
        ran.append(release_for_loop(loop, 10.0, release=release))
        await asyncio.sleep(11.0)
        ran.append(release_for_loop(loop, 10.0, release=release))
        return ran

    ran = run_virtual(main())
    assert sum(ran) == 3 and passes == [0.0, 10.0, 31.0]


def test_the_first_collection_freezes_its_survivors_and_later_cycles_still_go() -> None:
    """A full collection with torch loaded walks ~230,000 objects (0.4-0.8 s of a stalled
    event loop); after the first one freezes them, later ones walk only what came after."""
    code = """
import gc, json, weakref
import torch
import p2ptrain.peer
from p2ptrain.node.memory import release_unused_memory
before = len(gc.get_objects())
release_unused_memory(idle_for=0.0)
class Box: pass
a, b = Box(), Box()
a.other, b.other = b, a
alive = weakref.ref(a)
del a, b
release_unused_memory(idle_for=0.0)
print(json.dumps({"before": before, "frozen": gc.get_freeze_count(),
                  "walked": len(gc.get_objects()), "cycle_freed": alive() is None}))
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["cycle_freed"]  # a cycle made after the freeze is still collected
    assert result["frozen"] > 0.5 * result["before"]
    assert result["walked"] < 0.1 * result["before"]  # what a later collection walks
