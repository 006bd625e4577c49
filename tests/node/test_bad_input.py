"""Bad input over real sockets: each attack gets a clear error on its own
connection, is logged once, and a healthy client is served throughout."""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import sys
from collections.abc import Awaitable, Callable

import msgpack
import pytest
import torch
from conftest import (
    NodeFactory,
    recorded_handshake,
    shake,
    stall_server,
    while_serving_healthy,
)

from p2ptrain.errors import AuthenticationError, HandshakeError, InvalidArgumentError
from p2ptrain.lab.echo import echo
from p2ptrain.node.config import NodeConfig
from p2ptrain.node.node import Node
from p2ptrain.rpc.config import ConnectionConfig
from p2ptrain.rpc.handlers import CallContext, Message
from p2ptrain.rpc.stream import RPCStream
from p2ptrain.secure.handshake import AdmissionPolicy, HandshakeParams, Initiator
from p2ptrain.secure.identity import Identity
from p2ptrain.transport.tcp import TCPTransport, tcp_connect
from p2ptrain.wire.frames import Frame, FrameType, encode_frame, pack_body
from p2ptrain.wire.tensors import decode_tensor, encode_tensor

OPEN = AdmissionPolicy()


async def start_server(make_node: NodeFactory, **conn: float) -> Node:
    server = await make_node(config=NodeConfig(connection=ConnectionConfig(**conn)))
    server.handlers.add_unary("echo", echo)
    return server


async def while_echoing(server: Node, client: Node, attack: Callable[[], Awaitable[None]]) -> int:
    """Run ``attack`` while ``client`` keeps calling ``server``; all calls must succeed."""

    async def echo_call(n: int) -> None:
        reply = await client.call(server.address, "echo", n, b"ok", timeout=5)
        assert reply.body["body"] == n and bytes(reply.payload) == b"ok"

    return await while_serving_healthy(echo_call, attack, at_least=5)


async def raw_attack(server: Node, data: bytes, *, close: bool = False) -> bytes:
    """Send raw bytes; return what the server sent before closing on us."""
    reader, writer = await asyncio.open_connection(server.address.host, server.address.port)
    writer.write(data)
    await writer.drain()
    if close:
        writer.close()
        await writer.wait_closed()
        return b""
    try:
        received = await asyncio.wait_for(reader.read(), 5)  # until the server closes
    except ConnectionResetError:
        received = b"<reset>"
    writer.close()
    return received


def warnings_about(caplog: pytest.LogCaptureFixture, needle: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and needle in r.getMessage()
    ]


def frame_bytes(frame: Frame) -> bytes:
    head, payload = encode_frame(frame)
    return head + bytes(payload)


def raw_frame(header: object, payload: bytes = b"") -> bytes:
    body = msgpack.packb(header, use_bin_type=True)
    return struct.pack(">II", 4 + len(body) + len(payload), len(body)) + body + payload


PRE_HANDSHAKE_ATTACKS = {
    "oversized length": (struct.pack(">II", 2**31, 16), "exceeds the limit"),
    "garbage bytes": (os.urandom(8) + b"\xc1" * 64, ""),
    "wrong shape": (raw_frame({"type": "hello"}), "array of 4"),
    "unknown type": (raw_frame([77, 0, 0, {}]), "unknown frame type 77"),
}


@pytest.mark.parametrize("name", list(PRE_HANDSHAKE_ATTACKS))
async def test_malformed_bytes_before_the_handshake(
    make_node: NodeFactory, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    server, client = await start_server(make_node), await make_node()
    data, expected = PRE_HANDSHAKE_ATTACKS[name]
    caplog.set_level(logging.WARNING)
    received: list[bytes] = []

    async def attack() -> None:
        received.append(await raw_attack(server, data))

    await while_echoing(server, client, attack)
    assert received in ([b""], [b"<reset>"])  # the server closed on us, saying nothing
    refusals = warnings_about(caplog, "refused connection")
    assert len(refusals) == 1, refusals
    assert expected in refusals[0]


async def test_truncated_frame_then_close(
    make_node: NodeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    server, client = await start_server(make_node), await make_node()
    caplog.set_level(logging.WARNING)
    half = frame_bytes(Frame(FrameType.HELLO, fields={"v": 1, "pk": b"x" * 32}))[:10]
    await while_echoing(server, client, lambda: raw_attack(server, half, close=True))
    refusals = warnings_about(caplog, "refused connection")
    assert len(refusals) == 1 and ("closed" in refusals[0] or "lost" in refusals[0])


async def test_silent_client_times_out(
    make_node: NodeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    server, client = await start_server(make_node, handshake_timeout=0.3), await make_node()
    caplog.set_level(logging.WARNING)

    async def attack() -> None:
        reader, writer = await asyncio.open_connection(server.address.host, server.address.port)
        await asyncio.wait_for(reader.read(), 5)  # returns when the server gives up on us
        writer.close()

    await while_echoing(server, client, attack)
    refusals = warnings_about(caplog, "refused connection")
    assert len(refusals) == 1 and "timed out" in refusals[0]


async def test_forged_signature_is_refused_with_a_reason(
    make_node: NodeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Mallory claims alice's public key but can only sign with her own."""
    server, client = await start_server(make_node), await make_node()
    alice, mallory = Identity.generate(), Identity.generate()
    caplog.set_level(logging.WARNING)
    refusal: list[Frame] = []

    class Impostor(Initiator):
        def _identity_payload(self, *, admission: bool) -> bytes:
            t = self._signed_hash(alice.public_key, 1 << 20, 1 << 20)
            signature = mallory.sign(b"p2ptrain initiator" + t)
            return pack_body({"pk": alice.public_key, "w": 1 << 20, "f": 1 << 20, "s": signature})

    async def attack() -> None:
        transport = await _dial_raw(server)
        state = Impostor(HandshakeParams(mallory, "p2ptrain", 1 << 20, 1 << 20))
        await transport.send_frame(state.hello())
        transport.send_frame_nowait(state.auth(await transport.recv_frame()))
        assert state.keys is not None
        transport.start_records(state.keys)  # the server refuses with a sealed reason
        refusal.append(await transport.recv_frame())
        await transport.wait_closed()

    await while_echoing(server, client, attack)
    assert refusal[0].type is FrameType.REFUSE
    assert refusal[0].field("c") == "authentication"
    assert "does not verify" in refusal[0].field("m")
    refusals = warnings_about(caplog, "refused connection")
    assert len(refusals) == 1 and "does not verify" in refusals[0]


async def test_replayed_handshake_is_refused(
    make_node: NodeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Frames alice sent in an earlier session with the server are replayed over TCP."""
    server, client = await start_server(make_node), await make_node()
    alice = Identity.generate()
    # An earlier session between alice and the server's identity, recorded.
    _, recorded = await recorded_handshake(alice, server.identity, swarm="p2ptrain")
    caplog.set_level(logging.WARNING)
    replay = b"".join(frame_bytes(f) for f in recorded)
    await while_echoing(server, client, lambda: raw_attack(server, replay))
    refusals = warnings_about(caplog, "refused connection")
    assert len(refusals) == 1 and "failed authentication" in refusals[0]


async def _dial_raw(server: Node) -> TCPTransport:
    conn = server.config.connection
    return await tcp_connect(
        server.address.host,
        server.address.port,
        timeout=5,
        max_frame_bytes=conn.max_frame_bytes,
        max_header_bytes=conn.max_header_bytes,
        write_high_water=conn.write_high_water,
    )


async def _authenticated_raw(server: Node) -> TCPTransport:
    transport = await _dial_raw(server)
    await shake(transport, Identity.generate(), initiator=True, swarm="p2ptrain")
    return transport


POST_HANDSHAKE_ATTACKS: dict[str, tuple[object, str]] = {  # sealed headers, then raw bytes
    "unknown type": ([99, 1, 0, {}], "unknown frame type 99"),
    "wrong shape": ([17, 1], "array of 4"),
    "data for an unopened stream": ([17, 41, 0, {"b": 1}], "unknown stream 41"),
    "handshake frame again": ([1, 0, 0, {}], "unexpected HELLO"),
    "oversized frame": (struct.pack(">II", 2**30, 16), "exceeds the limit"),
    "a plaintext frame": (raw_frame([32, 0, 0, {"x": "y" * 40}]), "failed authentication"),
}


@pytest.mark.parametrize("name", list(POST_HANDSHAKE_ATTACKS))
async def test_malformed_frames_from_an_authenticated_peer(
    make_node: NodeFactory, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    server, client = await start_server(make_node), await make_node()
    data, expected = POST_HANDSHAKE_ATTACKS[name]
    caplog.set_level(logging.WARNING)

    async def attack() -> None:
        transport = await _authenticated_raw(server)
        assert transport._transport is not None and transport._sealer is not None
        if isinstance(data, bytes):
            transport._transport.write(data)
        else:  # a well-sealed record carrying a malformed header
            head, _ = transport._sealer.seal(msgpack.packb(data, use_bin_type=True), None)
            transport._transport.write(head)
        await asyncio.wait_for(transport.wait_closed(), 5)

    await while_echoing(server, client, attack)
    closing = [m for m in warnings_about(caplog, "closing connection") if expected in m]
    assert len(closing) == 1, caplog.text


async def still_serves(transport: TCPTransport) -> None:
    """The connection whose stream 1 was reset still answers a call (on stream 3); closed."""
    transport.send_frame_nowait(Frame(FrameType.OPEN, 3, 0x3, {"m": "echo", "b": "still here"}))
    while (reply := await asyncio.wait_for(transport.recv_frame(), 5)).stream_id != 3:
        pass
    assert reply.field("b")["body"] == "still here"
    transport.close()


async def test_window_overrun_resets_only_that_stream(
    make_node: NodeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A peer that ignores flow control loses its stream, not its connection."""
    limits = ConnectionConfig(
        stream_window=4096, max_frame_bytes=128 * 1024, max_header_bytes=16 * 1024
    )
    server = await stall_server(make_node, limits)
    client = await make_node()
    caplog.set_level(logging.WARNING)

    async def attack() -> None:
        transport = await _authenticated_raw(server)
        transport.send_frame_nowait(Frame(FrameType.OPEN, 1, 0, {"m": "stall"}))
        for _ in range(4):  # 4 x 64 KiB > 4 KiB window + one 128 KiB frame
            transport.send_frame_nowait(Frame(FrameType.DATA, 1, 0, None, b"z" * 65536))
        reset = await asyncio.wait_for(transport.recv_frame(), 5)
        assert reset.type is FrameType.RESET and reset.field("c") == "resource_exhausted"
        await still_serves(transport)

    await while_echoing(server, client, attack)
    assert len(warnings_about(caplog, "overran the stream window")) == 1


async def test_credit_never_used_resets_only_that_stream(
    make_node: NodeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A WINDOW giving back more than the server sent loses the stream, not the connection."""
    server = await stall_server(make_node, ConnectionConfig())
    client = await make_node()
    caplog.set_level(logging.WARNING)

    async def attack() -> None:
        transport = await _authenticated_raw(server)
        transport.send_frame_nowait(Frame(FrameType.OPEN, 1, 0, {"m": "stall"}))
        transport.send_frame_nowait(Frame(FrameType.WINDOW, 1, fields={"n": 1 << 40}))
        reset = await asyncio.wait_for(transport.recv_frame(), 5)
        assert reset.type is FrameType.RESET and reset.field("c") == "invalid_argument"
        assert "more than was sent" in reset.field("m")
        await still_serves(transport)

    await while_echoing(server, client, attack)
    assert len(warnings_about(caplog, "gives back more than was sent")) == 1


async def test_tensor_header_disagreeing_with_its_payload(
    make_node: NodeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    server, client = await start_server(make_node), await make_node()
    attacker = await make_node()

    async def total(ctx: CallContext, request: Message) -> Message:
        return Message(float(decode_tensor(request.body, request.payload).sum()))

    server.handlers.add_unary("total", total)
    header, payload = encode_tensor(torch.ones(100))
    assert (await client.call(server.address, "total", header, payload)).body == 100.0
    caplog.set_level(logging.WARNING)

    async def attack() -> None:
        lying = {**header, "s": [101]}  # claims 101 elements, sends 100
        with pytest.raises(InvalidArgumentError, match="payload"):
            await attacker.call(server.address, "total", lying, payload, timeout=5)

    await while_echoing(server, client, attack)
    rejected = warnings_about(caplog, "rejected a 'total' request")
    assert len(rejected) == 1


VANISHING_PEER = """
import asyncio, sys
from p2ptrain.node.node import Node
async def main():
    async with Node() as node:
        stream = await node.open_stream(sys.argv[1], "collect")
        for _ in range(8):
            await stream.send(None, b"q" * 65536)
        print("sent", flush=True)
        await asyncio.Event().wait()
asyncio.run(main())
"""


async def test_peer_vanishing_mid_stream(make_node: NodeFactory) -> None:
    """A real process is killed in the middle of a stream: the server's handler
    is stopped (cancelled with the dead connection) and nothing else suffers."""
    server, client = await start_server(make_node), await make_node()
    handler_ended = asyncio.Event()
    received = 0

    async def collect(ctx: CallContext, stream: RPCStream) -> None:
        nonlocal received
        try:
            async for message in stream:
                received += len(message.payload)
        finally:
            handler_ended.set()

    server.handlers.add_stream("collect", collect)

    async def attack() -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            VANISHING_PEER,
            str(server.address),
            stdout=asyncio.subprocess.PIPE,
        )
        assert proc.stdout is not None
        assert await asyncio.wait_for(proc.stdout.readline(), 30) == b"sent\n"
        proc.kill()
        await proc.wait()
        await asyncio.wait_for(handler_ended.wait(), 10)

    await while_echoing(server, client, attack)
    assert received == 8 * 65536
    assert all(c.remote_peer == client.peer_id for c in server.connections())


async def test_handshake_errors_are_typed_for_the_dialer(make_node: NodeFactory) -> None:
    server = await make_node(config=NodeConfig(swarm="other"))
    client = await make_node()
    with pytest.raises(HandshakeError, match="swarm"):
        await client.connect(server.address)
    impostor_address = server.address.with_peer(Identity.generate().peer_id)
    other = await make_node(config=NodeConfig(swarm="other"))
    with pytest.raises(AuthenticationError, match="expected peer"):
        await other.connect(impostor_address)
