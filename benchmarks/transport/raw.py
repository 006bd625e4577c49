"""The baseline path of ``bench_transport``: a bare asyncio socket.

The same bytes as the RPC paths in the same chunk sizes; the receiver only
counts them. A one-byte mode and the byte count open each connection
(:data:`RAW_PREAMBLE`): bulk, echo, or a question for the server's CPU time.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import Callable
from typing import cast

from benchmarks.harness import (
    cpu_seconds,
    wait_for_stdin_eof,
)
from benchmarks.transport.path import (
    POOL_SIZE,
    RUN_TIMEOUT,
    BenchmarkError,
    BulkRun,
    PathClient,
    Workload,
)
from p2ptrain.rpc.config import ConnectionConfig

WRITE_HIGH_WATER = ConnectionConfig().write_high_water
"""The raw path uses the same send-buffer high-water mark as the RPC layer."""
RAW_READ_BYTES = 256 * 1024
"""The raw receiver's reusable read buffer; the same size as p2ptrain's TCP read buffer."""
RAW_PREAMBLE = struct.Struct(">BQ")  # mode, total bytes that follow (bulk only)
RAW_ACK = struct.Struct(">Qd")  # bytes counted, receiver CPU seconds
RAW_CPU = struct.Struct(">d")  # reply to RAW_STATS: server CPU seconds so far
RAW_BULK, RAW_ECHO, RAW_STATS = 1, 2, 3
RAW_ECHO_BYTES = 16


def _set_nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _RawServerProtocol(asyncio.BufferedProtocol):
    """Reads a preamble, then counts ``total`` bytes and acks, echoes, or reports its CPU."""

    def __init__(self) -> None:
        self._view = memoryview(bytearray(RAW_READ_BYTES))
        self._preamble = bytearray()
        self._mode = 0
        self._total = 0
        self._remaining = 0
        self._cpu_start = 0.0
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not inherit from asyncio.Transport: no isinstance check.
        self._transport = cast(asyncio.Transport, transport)
        _set_nodelay(transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._view

    def buffer_updated(self, nbytes: int) -> None:
        transport = self._transport
        if transport is None:  # pragma: no cover - set before any data
            return
        data = self._view[:nbytes]
        if not self._mode:
            need = RAW_PREAMBLE.size - len(self._preamble)
            self._preamble += data[:need]
            data = data[need:]
            if len(self._preamble) < RAW_PREAMBLE.size:
                return
            self._mode, self._total = RAW_PREAMBLE.unpack(self._preamble)
            self._remaining = self._total
            self._cpu_start = cpu_seconds()
            if self._mode == RAW_STATS:
                transport.write(RAW_CPU.pack(self._cpu_start))
        if self._mode == RAW_STATS:
            return
        if self._mode == RAW_ECHO:
            if len(data):
                transport.write(bytes(data))
            return
        self._remaining -= len(data)
        if self._remaining < 0:
            transport.abort()
        elif self._remaining == 0 and len(data):
            transport.write(RAW_ACK.pack(self._total, cpu_seconds() - self._cpu_start))


async def serve_raw(ready: Callable[[str], None]) -> None:
    """Server role of the ``raw`` path: a bare asyncio listener."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_RawServerProtocol, "127.0.0.1", 0)
    async with server:
        host, port = server.sockets[0].getsockname()[:2]
        ready(f"{host}:{port}")
        await wait_for_stdin_eof()


class _RawClientProtocol(asyncio.Protocol):
    """Flow-controlled writes plus ``read_exactly`` for acks and echoes."""

    def __init__(self) -> None:
        self.can_write = asyncio.Event()
        self.can_write.set()
        self._received = bytearray()
        self._want = 0
        self._waiter: asyncio.Future[bytes] | None = None
        self._lost: Exception | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        _set_nodelay(transport)
        cast(asyncio.Transport, transport).set_write_buffer_limits(high=WRITE_HIGH_WATER)

    def pause_writing(self) -> None:
        self.can_write.clear()

    def resume_writing(self) -> None:
        self.can_write.set()

    def data_received(self, data: bytes) -> None:
        self._received += data
        self._maybe_wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = exc or ConnectionError("connection closed")
        self.can_write.set()
        self._maybe_wake()

    def _maybe_wake(self) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        if len(self._received) >= self._want:
            data = bytes(self._received[: self._want])
            del self._received[: self._want]
            waiter.set_result(data)
        elif self._lost is not None:
            waiter.set_exception(self._lost)

    async def read_exactly(self, nbytes: int) -> bytes:
        self._want = nbytes
        self._waiter = asyncio.get_running_loop().create_future()
        self._maybe_wake()
        try:
            return await self._waiter
        finally:
            self._waiter = None


class RawClient(PathClient):
    """Client of the ``raw`` path: a fresh connection per bulk run, one for the echoes."""

    def __init__(self) -> None:
        self._host = ""
        self._port = 0

    async def connect(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        self._host, self._port = host, int(port)

    async def _open(self) -> tuple[asyncio.Transport, _RawClientProtocol]:
        loop = asyncio.get_running_loop()
        return await loop.create_connection(_RawClientProtocol, self._host, self._port)

    async def bulk(self, work: Workload) -> BulkRun:
        views = [t.numpy().data.cast("B") for t in work.pool]
        tail = work.total_bytes - (work.chunks - 1) * work.chunk_bytes
        count = work.chunks
        async with asyncio.timeout(RUN_TIMEOUT):
            transport, proto = await self._open()
            try:
                transport.write(RAW_PREAMBLE.pack(RAW_BULK, work.total_bytes))
                cpu_start = cpu_seconds()
                start = time.perf_counter()
                for i in range(count):
                    if not proto.can_write.is_set():
                        await proto.can_write.wait()
                    view = views[i % POOL_SIZE]
                    transport.write(view if i < count - 1 else view[:tail])
                ack = await proto.read_exactly(RAW_ACK.size)
                seconds = time.perf_counter() - start
                cpu = cpu_seconds() - cpu_start
            finally:
                transport.close()
        counted, receiver_cpu = RAW_ACK.unpack(ack)
        if counted != work.total_bytes:
            raise BenchmarkError(f"receiver counted {counted} bytes of {work.total_bytes}")
        return BulkRun(seconds, work.total_bytes, cpu, receiver_cpu)

    async def round_trips(self, calls: int) -> list[float]:
        request = bytes(range(RAW_ECHO_BYTES))
        durations = []
        clock = time.perf_counter_ns
        async with asyncio.timeout(RUN_TIMEOUT):
            transport, proto = await self._open()
            try:
                transport.write(RAW_PREAMBLE.pack(RAW_ECHO, 0))
                for _ in range(calls):
                    start = clock()
                    transport.write(request)
                    reply = await proto.read_exactly(RAW_ECHO_BYTES)
                    durations.append((clock() - start) / 1000)
                    if reply != request:
                        raise BenchmarkError("echo returned different bytes")
            finally:
                transport.close()
        return durations

    async def server_cpu(self) -> float:
        async with asyncio.timeout(RUN_TIMEOUT):
            transport, proto = await self._open()
            try:
                transport.write(RAW_PREAMBLE.pack(RAW_STATS, 0))
                (seconds,) = RAW_CPU.unpack(await proto.read_exactly(RAW_CPU.size))
            finally:
                transport.close()
        return float(seconds)

    async def aclose(self) -> None:
        return None
