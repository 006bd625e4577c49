"""The node's connection pool over real loopback TCP: reuse, deduplicated
dials, idle close, keepalive against a frozen process, addresses."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest
from conftest import NodeFactory

from p2ptrain.errors import ConfigError, ConnectError, UnavailableError
from p2ptrain.lab.echo import echo
from p2ptrain.node.address import PeerAddress
from p2ptrain.node.config import NodeConfig
from p2ptrain.node.node import Node
from p2ptrain.rpc.config import ConnectionConfig
from p2ptrain.rpc.connection import Connection
from p2ptrain.rpc.handlers import CallContext, Message
from p2ptrain.secure.identity import Identity


async def test_calls_reuse_one_connection_and_both_sides_share_it(
    make_node: NodeFactory,
) -> None:
    a, b = await make_node(), await make_node()
    a.handlers.add_unary("echo", echo)
    b.handlers.add_unary("echo", echo)
    for i in range(5):
        assert (await a.call(b.address, "echo", i)).body["body"] == i
    # b calls back over the connection a opened (b knows a by PeerID).
    conn = b.connection_to(a.peer_id)
    assert conn is not None and not conn.initiator
    assert (await conn.call("echo", "back")).body["body"] == "back"
    assert len(a.connections()) == 1 and len(b.connections()) == 1


async def test_concurrent_dials_are_deduplicated(make_node: NodeFactory) -> None:
    a, b = await make_node(), await make_node()
    conns = await asyncio.gather(*(a.connect(b.address) for _ in range(20)))
    assert len({id(c) for c in conns}) == 1
    assert len(b.connections()) == 1


async def test_dial_without_peer_id_learns_it(make_node: NodeFactory) -> None:
    a, b = await make_node(), await make_node()
    conn = await a.connect(b.address.endpoint)
    assert conn.remote_peer == b.peer_id
    assert a.connection_to(b.peer_id) is conn


async def called_once(a: Node, b: Node) -> tuple[Connection, asyncio.Event]:
    """``a``'s connection to ``b`` after one ``echo`` call, and an event set when it closes."""
    b.handlers.add_unary("echo", echo)
    await a.call(b.address, "echo", 1)
    conn = a.connection_to(b.peer_id)
    assert conn is not None
    closed = asyncio.Event()
    conn.on_close(lambda _c: closed.set())
    return conn, closed


async def test_idle_connections_close_themselves(make_node: NodeFactory) -> None:
    timings = ConnectionConfig(idle_timeout=0.2, keepalive_interval=0.05)
    a = await make_node(config=NodeConfig(connection=timings))
    b = await make_node(config=NodeConfig(connection=timings))
    _, closed = await called_once(a, b)
    await asyncio.wait_for(closed.wait(), 5)
    assert a.connection_to(b.peer_id) is None
    # The next call simply dials again.
    assert (await a.call(b.address, "echo", 2)).body["body"] == 2


FROZEN_PEER = """
import asyncio, sys
from p2ptrain.node.node import Node
async def main():
    async with Node() as node:
        print(node.address, flush=True)
        await asyncio.Event().wait()
asyncio.run(main())
"""


async def test_keepalive_drops_a_frozen_peer(make_node: NodeFactory) -> None:
    """A peer whose process is stopped (SIGSTOP) never closes its socket; the
    keepalive notices and fails the calls waiting on it."""
    timings = ConnectionConfig(keepalive_interval=0.1, keepalive_misses=2)
    a = await make_node(config=NodeConfig(connection=timings))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", FROZEN_PEER, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        address = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().strip()
        conn = await a.connect(address)
        closed = asyncio.Event()
        conn.on_close(lambda _c: closed.set())
        os.kill(proc.pid, signal.SIGSTOP)
        pending = asyncio.create_task(conn.call("anything"))
        await asyncio.wait_for(closed.wait(), 10)
        with pytest.raises(UnavailableError):
            await pending
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        await proc.wait()


async def test_connect_errors_are_typed(make_node: NodeFactory) -> None:
    a, b = await make_node(), await make_node()
    port = b.address.port
    await b.aclose()
    with pytest.raises(ConnectError, match="cannot connect"):
        await a.connect(f"127.0.0.1:{port}")


async def test_node_close_fails_calls_in_flight(make_node: NodeFactory) -> None:
    a, b = await make_node(), await make_node()
    started = asyncio.Event()

    async def hang(ctx: CallContext, request: Message) -> Message:
        started.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    b.handlers.add_unary("hang", hang)
    call = asyncio.create_task(a.call(b.address, "hang"))
    await asyncio.wait_for(started.wait(), 5)
    await b.aclose()
    with pytest.raises(UnavailableError):
        await asyncio.wait_for(call, 5)


def test_addresses_parse_and_print() -> None:
    peer = Identity.generate().peer_id
    for text in ("127.0.0.1:4001", f"{peer}@10.0.0.1:80", f"{peer}@[::1]:9000", "host.example:1"):
        assert str(PeerAddress.parse(text)) == text
    parsed = PeerAddress.parse(f"{peer}@[::1]:9000")
    assert parsed.host == "::1" and parsed.peer_id == peer and parsed.endpoint == "[::1]:9000"
    for bad in ("nohost", "h:0", "h:70000", "h:+1", "h: 1", "::1:80", "x@h:1", "[::1]80", "h:4_0"):
        with pytest.raises(ConfigError):
            PeerAddress.parse(bad)


async def test_abort_drops_connections_without_goodbye(make_node: NodeFactory) -> None:
    a, b = await make_node(), await make_node()
    conn, closed = await called_once(a, b)
    await b.abort()
    await asyncio.wait_for(closed.wait(), 5)
    assert not conn.going_away  # no GOAWAY was sent: the peer just vanished


async def test_dialing_from_the_listening_port(make_node: NodeFactory) -> None:
    """With reuse_port, a node can open connections from its own listening port
    (what TCP hole punching needs), and handlers see where callers come from."""
    from p2ptrain.transport.tcp import tcp_connect

    a = await make_node(config=NodeConfig(reuse_port=True))
    b = await make_node()
    seen: list[str] = []

    async def where(ctx: CallContext, request: Message) -> Message:
        seen.append(ctx.remote_address)
        return Message(ctx.remote_address)

    b.handlers.add_unary("where", where)
    limits = a.config.connection
    transport = await tcp_connect(
        b.address.host,
        b.address.port,
        timeout=5,
        local_addr=("127.0.0.1", a.address.port),
        max_frame_bytes=limits.max_frame_bytes,
        max_header_bytes=limits.max_header_bytes,
        write_high_water=limits.write_high_water,
    )
    conn = await a.adopt(transport, initiator=True, expected=b.peer_id)
    reply = await conn.call("where", timeout=5)
    assert reply.body == f"127.0.0.1:{a.address.port}"
    assert a.connection_to(b.peer_id) is conn


def test_reuse_port_only_where_the_platform_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from p2ptrain.nat.config import NATConfig
    from p2ptrain.node.config import NodeConfig

    assert NATConfig().holepunch is hasattr(socket, "SO_REUSEPORT")
    monkeypatch.delattr(socket, "SO_REUSEPORT", raising=False)  # a platform without it
    assert NATConfig().holepunch is False  # the default follows the platform
    with pytest.raises(ConfigError, match="SO_REUSEPORT"):
        NATConfig(holepunch=True)
    with pytest.raises(ConfigError, match="SO_REUSEPORT"):
        NodeConfig(reuse_port=True)
