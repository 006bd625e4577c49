"""Multiplexed RPC over real loopback TCP: call kinds, deadlines, cancellation,
typed remote errors and per-stream flow control."""

from __future__ import annotations

import asyncio

import pytest
from conftest import NodeFactory

from p2ptrain.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    LocalProtocolError,
    MethodNotFoundError,
    RemoteInternalError,
    RPCCancelledError,
    StreamEndedError,
)
from p2ptrain.lab.echo import echo
from p2ptrain.node.config import NodeConfig
from p2ptrain.rpc.config import ConnectionConfig
from p2ptrain.rpc.handlers import CallContext, Message
from p2ptrain.rpc.stream import RPCStream


async def test_unary_call_carries_body_and_payload(make_node: NodeFactory) -> None:
    server, client = await make_node(), await make_node()
    server.handlers.add_unary("echo", echo)
    payload = bytes(range(256)) * 1000
    reply = await client.call(server.address, "echo", {"k": [1, 2]}, payload, timeout=5)
    assert reply.body == {"body": {"k": [1, 2]}, "peer": str(client.peer_id), "path": "tcp-direct"}
    assert bytes(reply.payload) == payload


async def test_server_streaming_and_bidirectional(make_node: NodeFactory) -> None:
    server, client = await make_node(), await make_node()

    async def countdown(ctx: CallContext, stream: RPCStream) -> None:
        request = await stream.recv()
        for i in range(request.body, 0, -1):
            await stream.send(i)

    async def doubler(ctx: CallContext, stream: RPCStream) -> None:
        async for message in stream:
            await stream.send(message.body * 2, message.payload)

    server.handlers.add_stream("countdown", countdown)
    server.handlers.add_stream("double", doubler)

    async with await client.open_stream(server.address, "countdown", timeout=5) as stream:
        await stream.send(5, end=True)
        assert [m.body async for m in stream] == [5, 4, 3, 2, 1]

    async with await client.open_stream(server.address, "double", timeout=5) as stream:
        for i in range(20):  # interleaved send/receive: truly bidirectional
            await stream.send(i, b"x" * i)
            reply = await stream.recv()
            assert reply.body == 2 * i and bytes(reply.payload) == b"x" * i
        await stream.end()
        with pytest.raises(StreamEndedError):
            await stream.recv()
        with pytest.raises(LocalProtocolError):
            await stream.send(1)


async def test_one_connection_serves_many_concurrent_calls(make_node: NodeFactory) -> None:
    server, client = await make_node(), await make_node()

    async def slow_echo(ctx: CallContext, request: Message) -> Message:
        await asyncio.sleep(0.001 * (request.body % 7))
        return Message(request.body)

    server.handlers.add_unary("echo", slow_echo)
    replies = await asyncio.gather(
        *(client.call(server.address, "echo", i, timeout=10) for i in range(300))
    )
    assert [r.body for r in replies] == list(range(300))
    assert len(client.connections()) == 1


async def test_remote_errors_arrive_typed(make_node: NodeFactory) -> None:
    server, client = await make_node(), await make_node()

    async def rejects(ctx: CallContext, request: Message) -> Message:
        raise InvalidArgumentError("x must be positive", details={"x": request.body})

    async def crashes(ctx: CallContext, request: Message) -> Message:
        raise ZeroDivisionError("boom")

    server.handlers.add_unary("rejects", rejects)
    server.handlers.add_unary("crashes", crashes)
    with pytest.raises(InvalidArgumentError, match="x must be positive"):
        await client.call(server.address, "rejects", -1, timeout=5)
    with pytest.raises(RemoteInternalError, match="ZeroDivisionError: boom"):
        await client.call(server.address, "crashes", timeout=5)
    with pytest.raises(MethodNotFoundError, match="nope"):
        await client.call(server.address, "nope", timeout=5)
    # The connection survives all of it.
    server.handlers.add_unary("echo", echo)
    assert (await client.call(server.address, "echo", 1, timeout=5)).body["body"] == 1


async def test_deadline_reaches_the_server(make_node: NodeFactory) -> None:
    server, client = await make_node(), await make_node()
    handler_cancelled = asyncio.Event()

    async def never(ctx: CallContext, request: Message) -> Message:
        assert ctx.deadline is not None
        try:
            await asyncio.Event().wait()
        finally:
            handler_cancelled.set()
        raise AssertionError("unreachable")

    server.handlers.add_unary("never", never)
    with pytest.raises(DeadlineExceededError):
        await client.call(server.address, "never", timeout=0.2)
    await asyncio.wait_for(handler_cancelled.wait(), 5)


async def test_cancellation_reaches_the_server(make_node: NodeFactory) -> None:
    server, client = await make_node(), await make_node()
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def waits(ctx: CallContext, request: Message) -> Message:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()
        raise AssertionError("unreachable")

    server.handlers.add_unary("waits", waits)
    call = asyncio.create_task(client.call(server.address, "waits"))
    await asyncio.wait_for(started.wait(), 5)
    call.cancel()
    await asyncio.wait_for(cancelled.wait(), 5)
    with pytest.raises(asyncio.CancelledError):
        await call


async def test_server_reset_reaches_a_client_stream(make_node: NodeFactory) -> None:
    server, client = await make_node(), await make_node()

    async def gives_up(ctx: CallContext, stream: RPCStream) -> None:
        await stream.recv()
        stream.reset("cancelled", "server gave up")

    server.handlers.add_stream("gives_up", gives_up)
    stream = await client.open_stream(server.address, "gives_up", timeout=5)
    await stream.send(1)
    with pytest.raises(RPCCancelledError, match="server gave up"):
        await stream.recv()


async def test_a_stalled_bulk_stream_does_not_block_small_calls(make_node: NodeFactory) -> None:
    """Nobody reads the bulk stream: its sender stops at the window while small
    calls on the same connection keep flowing."""
    window = 256 * 1024
    config = NodeConfig(connection=ConnectionConfig(stream_window=window))
    server, client = await make_node(config=config), await make_node(config=config)
    never_read = asyncio.Event()

    async def sink(ctx: CallContext, stream: RPCStream) -> None:
        await never_read.wait()
        async for _ in stream:
            pass

    server.handlers.add_stream("sink", sink)
    server.handlers.add_unary("echo", echo)
    stream = await client.open_stream(server.address, "sink")
    chunk = b"\x01" * (64 * 1024)
    sent = 0
    target: int | None = None
    reached = asyncio.Event()

    async def pump() -> None:
        nonlocal sent
        while True:
            await stream.send(None, chunk)
            sent += len(chunk)
            if target is not None and sent >= target:
                reached.set()

    pumping = asyncio.create_task(pump())
    for i in range(50):
        reply = await client.call(server.address, "echo", i, timeout=5)
        assert reply.body["body"] == i
    assert not pumping.done()
    # The sender is held by flow control: at most one window plus one frame out.
    assert window <= sent <= window + 2 * len(chunk)
    never_read.set()  # once the reader drains, the pump proceeds
    target = sent + 4 * window
    await asyncio.wait_for(reached.wait(), 5)
    pumping.cancel()
    await asyncio.gather(pumping, return_exceptions=True)
    await stream.aclose()


async def test_large_transfer_is_intact(make_node: NodeFactory) -> None:
    server, client = await make_node(), await make_node()
    received = bytearray()

    async def collect(ctx: CallContext, stream: RPCStream) -> None:
        async for message in stream:
            received.extend(message.payload)
        await stream.send(len(received), end=True)

    server.handlers.add_stream("collect", collect)
    data = bytes(i % 251 for i in range(8 * 1024 * 1024 + 17))
    stream = await client.open_stream(server.address, "collect", timeout=30)
    view = memoryview(data)
    for start in range(0, len(data), 1 << 20):
        await stream.send(None, view[start : start + (1 << 20)])
    await stream.end()
    assert (await stream.recv()).body == len(data)
    assert received == data


async def test_a_call_refused_locally_leaves_the_connection_healthy(
    make_node: NodeFactory,
) -> None:
    """A request too large for the peer's frame limit fails on our side only."""
    limits = ConnectionConfig(max_frame_bytes=64 * 1024, max_header_bytes=16 * 1024)
    server = await make_node(config=NodeConfig(connection=limits))
    client = await make_node()
    server.handlers.add_unary("echo", echo)
    with pytest.raises(LocalProtocolError, match="exceeds the peer's limit"):
        await client.call(server.address, "echo", None, b"x" * (128 * 1024), timeout=5)
    conn = client.connection_to(server.peer_id)
    assert conn is not None and conn.open_streams == 0
    reply = await client.call(server.address, "echo", "fine", b"y" * 1000, timeout=5)
    assert reply.body["body"] == "fine"
    assert not conn.closed


async def test_library_errors_in_handlers_keep_a_meaningful_code(make_node: NodeFactory) -> None:
    from p2ptrain.errors import ConfigError, ConnectError, RecordRejectedError, UnavailableError

    server, client = await make_node(), await make_node()
    raised = {
        "config": ConfigError("bad knob"),
        "record": RecordRejectedError("bad signature"),
        "connect": ConnectError("cannot reach the next hop"),
    }

    def raiser(error: Exception):  # type: ignore[no-untyped-def]
        async def handler(ctx: CallContext, request: Message) -> Message:
            raise error

        return handler

    for name, error in raised.items():
        server.handlers.add_unary(name, raiser(error))
    with pytest.raises(InvalidArgumentError, match="bad knob"):
        await client.call(server.address, "config", timeout=5)
    with pytest.raises(InvalidArgumentError, match="bad signature"):
        await client.call(server.address, "record", timeout=5)
    with pytest.raises(UnavailableError, match="next hop"):
        await client.call(server.address, "connect", timeout=5)
