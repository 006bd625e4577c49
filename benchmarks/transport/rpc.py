"""The RPC paths of ``bench_transport``: p2ptrain RPC over TCP, encrypted or not.

The server serves a stream sink (decodes every chunk into a tensor without
copying and answers with the byte count and a checksum), a unary echo and
its CPU seconds; the client streams the workload, makes round trips and
times fresh handshakes.
"""

from __future__ import annotations

import asyncio
import ctypes
import math
import time
from collections.abc import Callable
from typing import Any

from benchmarks.harness import (
    cpu_seconds,
    wait_for_stdin_eof,
)
from benchmarks.transport.path import (
    RUN_TIMEOUT,
    BenchmarkError,
    BulkRun,
    PathClient,
    Workload,
    chunk_checksum,
)
from p2ptrain.node.address import PeerAddress
from p2ptrain.node.config import NodeConfig
from p2ptrain.node.memory import release_unused_memory
from p2ptrain.node.node import Node
from p2ptrain.rpc.config import ConnectionConfig
from p2ptrain.rpc.handlers import CallContext, Message
from p2ptrain.rpc.stream import RPCStream
from p2ptrain.secure.handshake import perform_handshake
from p2ptrain.transport.tcp import tcp_connect
from p2ptrain.wire.tensors import decode_tensor, encode_tensor

SINK_METHOD = "bench.sink"
ECHO_METHOD = "bench.echo"
CPU_METHOD = "bench.cpu"
RTT_BODY = b"ping"


def _buffer_address(buf: Any) -> int | None:
    """Address of a writable buffer's first byte (None for read-only or empty ones)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(buf))
    except (TypeError, ValueError):
        return None


async def _rpc_sink(context: CallContext, stream: RPCStream) -> None:
    cpu_start = cpu_seconds()
    total = 0
    checksum = 0.0
    zero_copy: bool | None = None
    index = 0
    async for message in stream:
        body = message.body
        if not isinstance(body, dict) or body.get("i") != index:
            raise BenchmarkError(f"chunk {index} arrived out of order: {body!r:.80}")
        tensor = decode_tensor(body["t"], message.payload)
        if zero_copy is None:
            zero_copy = tensor.data_ptr() == _buffer_address(message.payload)
        total += tensor.numel() * tensor.element_size()
        checksum += chunk_checksum(index, tensor)
        index += 1
    ack = {"n": total, "c": checksum, "z": bool(zero_copy), "cpu": cpu_seconds() - cpu_start}
    await stream.send(ack, end=True)


async def _rpc_echo(context: CallContext, request: Message) -> Message:
    return Message(request.body)


async def _rpc_cpu(context: CallContext, request: Message) -> Message:
    return Message(cpu_seconds())


def _node_config(*, plaintext: bool, inline_crypto: bool = False) -> NodeConfig:
    if not inline_crypto:
        return NodeConfig(insecure_plaintext=plaintext)
    return NodeConfig(
        insecure_plaintext=plaintext, connection=ConnectionConfig(crypto_offload_bytes=None)
    )


async def serve_rpc(
    ready: Callable[[str], None], *, plaintext: bool = False, inline_crypto: bool = False
) -> None:
    """Server role of the ``rpc`` path: a Node serving the sink and the echo."""
    async with Node(config=_node_config(plaintext=plaintext, inline_crypto=inline_crypto)) as node:
        node.handlers.add_stream(SINK_METHOD, _rpc_sink)
        node.handlers.add_unary(ECHO_METHOD, _rpc_echo)
        node.handlers.add_unary(CPU_METHOD, _rpc_cpu)
        release_unused_memory()  # see RPCClient.connect
        ready(str(node.address))
        await wait_for_stdin_eof()


class RPCClient(PathClient):
    """Client of the ``rpc`` path: one Node, one pooled connection to the server."""

    plaintext = False
    """Whether the connection runs with ``insecure_plaintext`` (no records)."""
    inline_crypto = False
    """Whether all AES-GCM work stays on the event loop (``crypto_offload_bytes=None``)."""

    def __init__(self) -> None:
        self._node: Node | None = None
        self._address: PeerAddress | None = None
        self.zero_copy_decode: bool | None = None

    async def connect(self, address: str) -> None:
        # Parsed once, as a caller holding a PeerAddress would: Node.call(str) re-parses the
        # text (base32 PeerID included) on every call.
        self._address = PeerAddress.parse(address)
        self._node = Node(
            config=_node_config(plaintext=self.plaintext, inline_crypto=self.inline_crypto)
        )
        await self._node.start()
        # The node's first memory pass (10 s after its start) is a full garbage
        # collection of everything torch and the package allocated, 0.4-0.8 s
        # with the event loop blocked, once per process: run it now, untimed,
        # instead of in the middle of one of the timed runs.
        release_unused_memory()
        await self._node.connect(self._address)

    def _started(self) -> tuple[Node, PeerAddress]:
        if self._node is None or self._address is None:
            raise RuntimeError("connect() first")
        return self._node, self._address

    async def bulk(self, work: Workload) -> BulkRun:
        node, address = self._started()
        expected = work.checksum()
        count = work.chunks
        async with asyncio.timeout(RUN_TIMEOUT):
            stream = await node.open_stream(address, SINK_METHOD)
            async with stream:
                cpu_start = cpu_seconds()
                start = time.perf_counter()
                for i in range(count):
                    header, payload = encode_tensor(work.chunk(i))
                    await stream.send({"i": i, "t": header}, payload, end=i == count - 1)
                ack = (await stream.recv()).body
                seconds = time.perf_counter() - start
                cpu = cpu_seconds() - cpu_start
        if ack["n"] != work.total_bytes or not math.isclose(
            ack["c"], expected, rel_tol=1e-9, abs_tol=1e-9
        ):
            raise BenchmarkError(
                f"receiver got {ack['n']} bytes with checksum {ack['c']!r}, "
                f"sent {work.total_bytes} with checksum {expected!r}"
            )
        self.zero_copy_decode = bool(ack["z"])
        return BulkRun(seconds, work.total_bytes, cpu, float(ack["cpu"]))

    async def round_trips(self, calls: int) -> list[float]:
        node, address = self._started()
        durations = []
        clock = time.perf_counter_ns
        async with asyncio.timeout(RUN_TIMEOUT):
            for _ in range(calls):
                start = clock()
                reply = await node.call(address, ECHO_METHOD, RTT_BODY)
                durations.append((clock() - start) / 1000)
                if reply.body != RTT_BODY:
                    raise BenchmarkError(f"echo returned {reply.body!r}")
        return durations

    async def server_cpu(self) -> float:
        node, address = self._started()
        reply = await node.call(address, CPU_METHOD, timeout=RUN_TIMEOUT)
        return float(reply.body)

    async def handshakes(self, count: int) -> list[float]:
        """Milliseconds of ``count`` fresh handshakes with the server (TCP connect excluded)."""
        node, address = self._started()
        conn = node.config.connection
        durations = []
        async with asyncio.timeout(RUN_TIMEOUT):
            for _ in range(count):
                transport = await tcp_connect(
                    address.host,
                    address.port,
                    timeout=node.config.dial_timeout,
                    max_frame_bytes=conn.max_frame_bytes,
                    max_header_bytes=conn.max_header_bytes,
                    write_high_water=conn.write_high_water,
                )
                start = time.perf_counter()
                await perform_handshake(
                    transport,
                    node.identity,
                    initiator=True,
                    swarm=node.config.swarm,
                    stream_window=conn.stream_window,
                    max_frame_bytes=conn.max_frame_bytes,
                    policy=node.config.admission,
                    expected_peer=address.peer_id,
                    timeout=conn.handshake_timeout,
                )
                durations.append((time.perf_counter() - start) * 1000)
                await transport.aclose()
        return durations

    async def aclose(self) -> None:
        if self._node is not None:
            await self._node.aclose()
            self._node = None


async def serve_rpc_plaintext(ready: Callable[[str], None]) -> None:
    """Server role of the ``rpc-plaintext`` path (``--insecure-plaintext``)."""
    await serve_rpc(ready, plaintext=True)


class PlaintextRPCClient(RPCClient):
    """Client of the ``rpc-plaintext`` path: frames after the handshake unsealed."""

    plaintext = True


async def serve_rpc_inline_crypto(ready: Callable[[str], None]) -> None:
    """Server role of the ``rpc-inline-crypto`` path (no crypto worker threads)."""
    await serve_rpc(ready, inline_crypto=True)


class InlineCryptoRPCClient(RPCClient):
    """Client of the ``rpc-inline-crypto`` path: encrypted, every AES-GCM pass on the loop."""

    inline_crypto = True
