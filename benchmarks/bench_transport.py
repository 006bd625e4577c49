"""Transport benchmark: p2ptrain RPC against a plain socket, and the WebRTC data channel.

Usage::

    python -m benchmarks.bench_transport [--megabytes 256] [--chunk-kib 1024]
        [--rtt-calls 10000] [--repeats 3] [--handshakes 200] [--uvloop | --no-uvloop]
        [--png PATH] [--json-only]
        [--no-webrtc] [--webrtc-seconds 4] [--webrtc-loss-seconds 20]
        [--webrtc-repeats 6] [--webrtc-loss-repeats 3]
        [--no-shaped] [--shaped-mib 24] [--shaped-repeats 3]

For every *path* a server runs in its own OS process (this script again, in a
hidden ``--role server`` mode) and the client side runs in this process, over
loopback:

* bulk: ``--megabytes`` of float32 tensor chunks of ``--chunk-kib`` each. On the
  ``rpc`` path every chunk is one message of one RPCStream (tensor header in
  the body, the raw bytes as payload); the receiver decodes each chunk into a
  tensor without copying and, when the stream ends, answers with the byte
  count and a checksum, which the sender verifies. On the ``raw`` path the
  same bytes go through a bare asyncio transport in the same chunk sizes and
  the receiver only counts them. Throughput is timed from the first send to
  the acknowledgement (on the ``rpc`` path ``encode_tensor`` runs inside the
  timing, as it would in training); CPU seconds per GiB are measured in each
  process with ``getrusage``. The paths alternate, ``--repeats`` runs each, and
  the table reports the median run.
* the ``rpc`` path is p2ptrain's default, so it is encrypted end to end
  (AES-256-GCM records after an X25519/Ed25519 handshake, see
  docs/security.md): ``secure_rpc_MBps``. The ``rpc-plaintext`` path is the
  same with ``--insecure-plaintext`` on both ends (the trusted-cluster
  opt-out): ``rpc_MBps``. The goal: encrypted RPC at least 0.60 of the raw
  socket's throughput at 1 MiB chunks.
* handshakes: ``--handshakes`` fresh handshakes with the server on new TCP
  connections (the connect itself not timed); ``handshake_ms`` is the median.
* round trips: ``--rtt-calls`` sequential tiny requests after a warm-up
  (unary RPC calls; a 16-byte echo on the raw path): median, p99, and the CPU
  each side spends per call.

Then the WebRTC data channel, in a NAT lab of network namespaces (root only;
without root these rows are skipped with a message and the TCP rows still
print): stock aiortc against p2ptrain's default ``WebRTCConfig()`` between two
homes behind easy NATs, on a clean path and on a lossy one (40 ms RTT, 0.5 %
loss through the tun shim), runs interleaved (``--webrtc-repeats`` and
``--webrtc-loss-repeats`` per variant); see
``benchmarks/bench_webrtc.py``, whose code this reuses and which also runs
the ablation.

Then send pacing on a shaped home uplink (root; skipped with a message
otherwise): two hosts of the star lab at 50 Mbit/s up, 100 down; one streams
``--shaped-mib`` MiB in 1 MiB frames to the other while making an echo call
every 50 ms, with p2ptrain's default pacing and with it off
(``pace_target_s=None``), alternating, ``--shaped-repeats`` each
(:mod:`p2ptrain.lab.bulk_echo`). The table shows the stream's rate and
the calls' median and 90th-percentile latency; JSON keys
``shaped_echo_ms_paced``, ``shaped_echo_ms_unpaced`` (medians of the runs'
medians), ``shaped_echo_p90_ms_paced``, ``shaped_echo_p90_ms_unpaced``,
``shaped_bulk_MBps_paced``, ``shaped_bulk_MBps_unpaced``.

On a shared machine wall-clock figures swing from run to run; the CPU columns
are steadier, and when both processes compete for the cores the throughput
ratio follows the ratio of total CPU per GiB.

The table goes to stdout, followed by one JSON line (always the last line)
with, besides the TCP figures, ``webrtc_MBps`` (tuned, clean),
``webrtc_stock_MBps``, ``webrtc_loss_MBps``, ``webrtc_stock_loss_MBps``, each
with a ``*_cpu_s_per_GB``, and ``webrtc_ratio`` / ``webrtc_loss_ratio``
(median of the per-repeat tuned/stock ratios). Units: 1 MB = 1 MiB = 2**20
bytes, so ``rpc_MBps`` is MiB/s.

Adding a loopback transport means writing a server coroutine and a
:class:`PathClient`, and adding one :class:`BenchPath` to :data:`PATHS`; it
then shows up as one more row.
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import contextlib
import ctypes
import math
import socket
import struct
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from benchmarks import bench_webrtc
from benchmarks.harness import (
    DefaultsHelpFormatter,
    ServerProcess,
    announce_ready,
    cpu_seconds,
    emit_json,
    format_table,
    median,
    module_argv,
    percentile,
    plot_bars,
    run,
    uvloop_available,
    wait_for_stdin_eof,
)
from p2ptrain.lab import bulk_echo
from p2ptrain.lab.natlab.netns import lab_unavailable
from p2ptrain.lab.starlab import LinkSpec, StarLab
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

MiB = 1 << 20
GiB = 1 << 30
RUN_TIMEOUT = 300.0
"""Seconds one bulk run or one round-trip series may take before the benchmark gives up."""

POOL_SIZE = 4
"""Distinct chunks the sender cycles through (so the checksum also catches reordering)."""
CHECKSUM_SAMPLES = 8
"""Elements of each chunk that enter the checksum (kept small: it runs inside the timing)."""
MAX_CHUNK_BYTES = 16 * MiB

SINK_METHOD = "bench.sink"
ECHO_METHOD = "bench.echo"
CPU_METHOD = "bench.cpu"
RTT_BODY = b"ping"

WRITE_HIGH_WATER = ConnectionConfig().write_high_water
"""The raw path uses the same send-buffer high-water mark as the RPC layer."""
RAW_READ_BYTES = 256 * 1024
"""The raw receiver's reusable read buffer; the same size as p2ptrain's TCP read buffer."""
RAW_PREAMBLE = struct.Struct(">BQ")  # mode, total bytes that follow (bulk only)
RAW_ACK = struct.Struct(">Qd")  # bytes counted, receiver CPU seconds
RAW_CPU = struct.Struct(">d")  # reply to RAW_STATS: server CPU seconds so far
RAW_BULK, RAW_ECHO, RAW_STATS = 1, 2, 3
RAW_ECHO_BYTES = 16


# -- workload ------------------------------------------------------------------------------


def chunk_checksum(index: int, tensor: torch.Tensor) -> float:
    """A cheap order-sensitive checksum term: a few sampled elements, weighted by position."""
    step = max(1, tensor.numel() // CHECKSUM_SAMPLES)
    return (index + 1) * float(tensor[::step].sum(dtype=torch.float64))


@dataclass(frozen=True)
class Workload:
    """The bytes of one bulk run: ``total_bytes`` as float32 chunks of ``chunk_bytes``."""

    total_bytes: int
    chunk_bytes: int
    pool: tuple[torch.Tensor, ...]

    @classmethod
    def make(cls, total_bytes: int, chunk_bytes: int) -> Workload:
        """Random chunks from a fixed seed, reused cyclically."""
        if chunk_bytes <= 0 or chunk_bytes % 4:
            raise ValueError("chunk_bytes must be a positive multiple of 4")
        if total_bytes <= 0 or total_bytes % 4:
            raise ValueError("total_bytes must be a positive multiple of 4")
        gen = torch.Generator().manual_seed(20240601)
        size = min(chunk_bytes, total_bytes) // 4
        pool = tuple(torch.randn(size, generator=gen) for _ in range(POOL_SIZE))
        return cls(total_bytes, chunk_bytes, pool)

    @property
    def chunks(self) -> int:
        """Number of chunks (the last one may be shorter)."""
        return -(-self.total_bytes // self.chunk_bytes)

    def chunk(self, index: int) -> torch.Tensor:
        """The tensor sent as chunk ``index``."""
        tensor = self.pool[index % len(self.pool)]
        tail = self.total_bytes - index * self.chunk_bytes
        return tensor if tail >= self.chunk_bytes else tensor[: tail // 4]

    def checksum(self) -> float:
        """The checksum the receiver must report."""
        return sum(chunk_checksum(i, self.chunk(i)) for i in range(self.chunks))


@dataclass(frozen=True)
class BulkRun:
    """One timed bulk transfer."""

    seconds: float
    nbytes: int
    sender_cpu: float
    receiver_cpu: float

    @property
    def mib_per_s(self) -> float:
        """Throughput in MiB/s."""
        return self.nbytes / MiB / self.seconds

    def cpu_per_gib(self, cpu: float) -> float:
        """``cpu`` seconds scaled to one GiB of payload."""
        return cpu / (self.nbytes / GiB)


class BenchmarkError(RuntimeError):
    """The receiver reported something other than what was sent."""


# -- the path interface --------------------------------------------------------------------


class PathClient(abc.ABC):
    """The sending/calling side of one path, run in the benchmark's main process."""

    @abc.abstractmethod
    async def connect(self, address: str) -> None:
        """Connect to the server that announced ``address`` (not timed)."""

    @abc.abstractmethod
    async def bulk(self, work: Workload) -> BulkRun:
        """Send ``work`` once, timed from the first send to the receiver's acknowledgement."""

    @abc.abstractmethod
    async def round_trips(self, calls: int) -> list[float]:
        """``calls`` sequential tiny request/response exchanges; each duration in µs."""

    @abc.abstractmethod
    async def server_cpu(self) -> float:
        """CPU seconds the server process has used so far (asked over the path itself)."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Close every connection."""


ServeFn = Callable[[Callable[[str], None]], Coroutine[Any, Any, None]]
"""A server role: start serving, call ``ready(address)``, return once told to stop."""


@dataclass(frozen=True)
class BenchPath:
    """One row of the results: a server role plus the client that talks to it."""

    key: str
    label: str
    serve: ServeFn
    client: Callable[[], PathClient]


# -- p2ptrain RPC over TCP -----------------------------------------------------------------


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


# -- raw asyncio socket baseline -----------------------------------------------------------


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


PATHS: dict[str, BenchPath] = {
    path.key: path
    for path in (
        BenchPath("rpc", "p2ptrain RPC (tcp, encrypted)", serve_rpc, RPCClient),
        BenchPath(
            "rpc-plaintext",
            "p2ptrain RPC (tcp, --insecure-plaintext)",
            serve_rpc_plaintext,
            PlaintextRPCClient,
        ),
        BenchPath("raw", "raw asyncio socket", serve_raw, RawClient),
        BenchPath(
            "rpc-inline-crypto",
            "p2ptrain RPC (tcp, encrypted, no crypto threads)",
            serve_rpc_inline_crypto,
            InlineCryptoRPCClient,
        ),
    )
}
OPTIONAL_PATHS = ("rpc-inline-crypto",)
"""Paths measured only when asked for (``--inline-crypto-row``): an ablation."""
BASELINE = "raw"
"""The path every other one is compared with."""
SECURE_GOAL = 0.60
"""Encrypted RPC throughput at 1 MiB chunks, as a fraction of the raw socket's."""


# -- measuring -----------------------------------------------------------------------------


@dataclass
class PathResult:
    """Everything measured on one path."""

    path: BenchPath
    runs: list[BulkRun] = field(default_factory=list)
    rtt_us: list[float] = field(default_factory=list)
    rtt_client_cpu_us: float = math.nan
    """Client CPU per round trip, µs."""
    rtt_server_cpu_us: float = math.nan
    """Server CPU per round trip, µs."""

    def median_run(self) -> BulkRun:
        """The run with the median throughput (the upper median for an even count)."""
        ordered = sorted(self.runs, key=lambda r: r.mib_per_s)
        return ordered[len(ordered) // 2]

    def summary(self) -> dict[str, Any]:
        """Figures for the table and the JSON line."""
        mid = self.median_run()
        speeds = [r.mib_per_s for r in self.runs]
        return {
            "MBps": round(median(speeds), 1),
            "MBps_runs": [round(s, 1) for s in speeds],
            "MBps_best": round(max(speeds), 1),
            "send_cpu_s_per_GiB": round(mid.cpu_per_gib(mid.sender_cpu), 3),
            "recv_cpu_s_per_GiB": round(mid.cpu_per_gib(mid.receiver_cpu), 3),
            "rtt_median_us": round(median(self.rtt_us), 1),
            "rtt_p99_us": round(percentile(self.rtt_us, 99), 1),
            "rtt_client_cpu_us": round(self.rtt_client_cpu_us, 1),
            "rtt_server_cpu_us": round(self.rtt_server_cpu_us, 1),
        }


def _log(quiet: bool, text: str) -> None:
    if not quiet:
        print(text, file=sys.stderr, flush=True)


async def measure(args: argparse.Namespace, addresses: dict[str, str]) -> dict[str, PathResult]:
    """Run every measurement against the servers at ``addresses``."""
    work = Workload.make(args.megabytes * MiB, args.chunk_kib * 1024)
    warm = Workload.make(min(work.total_bytes, 16 * MiB), work.chunk_bytes)
    results = {key: PathResult(PATHS[key]) for key in addresses}
    clients = {key: PATHS[key].client() for key in addresses}
    try:
        for key, client in clients.items():
            await client.connect(addresses[key])
            await client.bulk(warm)
        for attempt in range(args.repeats):
            for key, client in clients.items():
                result = await client.bulk(work)
                results[key].runs.append(result)
                _log(
                    args.json_only,
                    f"  bulk {key:>4} run {attempt + 1}/{args.repeats}: "
                    f"{result.mib_per_s:8.1f} MiB/s in {result.seconds:.3f} s",
                )
        for key, client in clients.items():
            res = results[key]
            await client.round_trips(args.rtt_warmup)
            server_start = await client.server_cpu()
            client_start = cpu_seconds()
            res.rtt_us = await client.round_trips(args.rtt_calls)
            res.rtt_client_cpu_us = (cpu_seconds() - client_start) / args.rtt_calls * 1e6
            res.rtt_server_cpu_us = (
                (await client.server_cpu() - server_start) / args.rtt_calls * 1e6
            )
            _log(args.json_only, f"  rtt  {key:>4}: median {median(res.rtt_us):.1f} µs")
        rpc = clients.get("rpc")
        if isinstance(rpc, RPCClient):
            args.zero_copy_decode = rpc.zero_copy_decode
            args.handshake_ms = await rpc.handshakes(args.handshakes)
            _log(args.json_only, f"  handshake: median {median(args.handshake_ms):.2f} ms")
    finally:
        for client in clients.values():
            await client.aclose()
    return results


# -- the WebRTC data channel ---------------------------------------------------------------

WEBRTC_PATHS = ("clean", "lossy")
WEBRTC_VARIANTS = ("stock", "tuned")


@dataclass
class WebRTCOutcome:
    """The WebRTC cells, or why they were not measured."""

    cells: dict[tuple[str, str], bench_webrtc.Cell] = field(default_factory=dict)
    skipped: str | None = None


def measure_webrtc(args: argparse.Namespace) -> WebRTCOutcome:
    """Stock aiortc and the default ``WebRTCConfig()`` in the NAT lab, clean and lossy."""
    if not args.webrtc:
        return WebRTCOutcome(skipped="--no-webrtc")
    reason = lab_unavailable()
    if reason is not None:
        print(
            f"WebRTC rows skipped: the NAT lab {reason}; TCP rows only", file=sys.stderr, flush=True
        )
        return WebRTCOutcome(skipped=reason)
    runs = 2 * (args.webrtc_repeats * args.webrtc_seconds)
    runs += 2 * (args.webrtc_loss_repeats * args.webrtc_loss_seconds)
    _log(
        args.json_only,
        f"WebRTC part (root; --no-webrtc leaves it out): about {runs:.0f} s of timed runs",
    )
    cells = bench_webrtc.measure(
        WEBRTC_PATHS,
        WEBRTC_VARIANTS,
        seconds={"clean": args.webrtc_seconds, "lossy": args.webrtc_loss_seconds},
        repeats={"clean": args.webrtc_repeats, "lossy": args.webrtc_loss_repeats},
        log=lambda text: _log(args.json_only, text),
    )
    return WebRTCOutcome(cells=cells)


SHAPED_LINK = LinkSpec(50, 100)


def measure_shaped(args: argparse.Namespace) -> dict[str, Any]:
    """Echo latency during a bulk stream on a shaped uplink, paced and unpaced (JSON fields)."""
    if not args.shaped:
        return {"shaped_skipped": "--no-shaped"}
    reason = lab_unavailable()
    if reason is not None:
        print(f"shaped rows skipped: the lab {reason}", file=sys.stderr, flush=True)
        return {"shaped_skipped": reason}
    _log(args.json_only, f"shaped part (root; --no-shaped leaves it out): {args.shaped_mib} MiB")
    runs: dict[str, list[dict[str, Any]]] = {"paced": [], "unpaced": []}
    with StarLab([SHAPED_LINK, SHAPED_LINK]) as lab:
        for _ in range(args.shaped_repeats):
            for mode, results in runs.items():
                results.append(bulk_echo.run_in_lab(lab, args.shaped_mib, paced=mode == "paced"))
    out: dict[str, Any] = {}
    rows = []
    for mode, results in runs.items():
        mbps = median([r["bytes"] / r["seconds"] / 2**20 for r in results])
        echo_ms = median([1000 * r["median"] for r in results])
        p90_ms = median([1000 * r["p90"] for r in results])
        out[f"shaped_bulk_MBps_{mode}"] = round(mbps, 3)
        out[f"shaped_echo_ms_{mode}"] = round(echo_ms, 1)
        out[f"shaped_echo_p90_ms_{mode}"] = round(p90_ms, 1)
        rows.append((mode, f"{mbps:.2f}", f"{echo_ms:.0f}", f"{p90_ms:.0f}"))
    if not args.json_only:
        print(
            f"\nsend pacing: {SHAPED_LINK.upload_mbit:g} Mbit/s uplink, a {args.shaped_mib} MiB "
            f"stream in 1 MiB frames, an echo call every 50 ms; median of "
            f"{args.shaped_repeats} runs each"
        )
        print(format_table(["pacing", "stream MiB/s", "echo median ms", "echo p90 ms"], rows))
        ratio = out["shaped_echo_ms_unpaced"] / max(out["shaped_echo_ms_paced"], 1e-9)
        print(f"echo median, unpaced/paced: {ratio:.1f}x")
    return out


def _print_all_paths(
    args: argparse.Namespace, summaries: dict[str, dict[str, Any]], webrtc: WebRTCOutcome
) -> None:
    """One table of every path: MiB/s and CPU s/GiB (sender + receiver)."""
    rows: list[list[object]] = []
    for key, summ in summaries.items():
        cpu = summ["send_cpu_s_per_GiB"] + summ["recv_cpu_s_per_GiB"]
        rows.append([f"tcp loopback: {PATHS[key].label}", summ["MBps"], None, None, cpu])
    for row in bench_webrtc.table_rows(webrtc.cells):
        rows.append([row[0], row[1], row[3], row[4], row[5]])
    print()
    print("all paths: MiB/s and CPU s/GiB of both processes")
    if webrtc.skipped is None:
        print(
            "WebRTC (NAT lab): medians of "
            f"{args.webrtc_repeats} interleaved runs of {args.webrtc_seconds:g} s (clean) and "
            f"{args.webrtc_loss_repeats} of {args.webrtc_loss_seconds:g} s (lossy: 40 ms RTT, "
            "0.5 % loss); x stock = median of the per-repeat tuned/stock ratios"
        )
    print(format_table(["path", "MiB/s", "x stock", "x stock runs", "CPU s/GiB"], rows))
    if webrtc.skipped is not None:
        print(f"(WebRTC rows skipped: {webrtc.skipped})")
        return
    figures = bench_webrtc.summary(webrtc.cells)
    for path, name in bench_webrtc.RATIO_NAMES.items():
        if name in figures:
            goal = bench_webrtc.GOALS[path]
            verdict = "meets" if figures[name] >= goal else "misses"
            print(f"webrtc {path}: tuned/stock {figures[name]:.2f} ({verdict} the {goal:g}x goal)")


def report(
    args: argparse.Namespace,
    results: dict[str, PathResult],
    webrtc: WebRTCOutcome | None = None,
) -> dict[str, Any]:
    """Print the tables (unless ``--json-only``), write the PNG, return the JSON result."""
    webrtc = webrtc if webrtc is not None else WebRTCOutcome(skipped="not measured")
    summaries = {key: res.summary() for key, res in results.items()}
    base = summaries[BASELINE]
    rpc = summaries["rpc"]
    plain = summaries.get("rpc-plaintext", rpc)
    ratio = rpc["MBps"] / base["MBps"]
    handshake_ms = median(args.handshake_ms) if args.handshake_ms else math.nan
    loop = "uvloop" if args.uvloop else "asyncio"
    if not args.json_only:
        _print_tables(args, results, summaries, loop)
        verdict = "meets" if ratio >= SECURE_GOAL else "misses"
        print(
            f"encrypted rpc/raw throughput ratio {ratio:.2f} ({verdict} the {SECURE_GOAL:.2f} goal)"
        )
        print(f"encrypted/plaintext rpc throughput {rpc['MBps'] / plain['MBps']:.2f}")
        print(f"handshake (X25519 + Ed25519, loopback): median {handshake_ms:.2f} ms")
        _print_all_paths(args, summaries, webrtc)
    if args.png:
        labels = {key: res.path.label for key, res in results.items()}
        plot_bars(
            args.png,
            [
                (f"bulk MiB/s ({args.chunk_kib} KiB chunks)", _by_label(labels, summaries, "MBps")),
                ("round trip median, µs", _by_label(labels, summaries, "rtt_median_us")),
                ("round trip p99, µs", _by_label(labels, summaries, "rtt_p99_us")),
            ],
            title=f"p2ptrain transport benchmark, {loop}, loopback",
        )
    return {
        "secure_rpc_MBps": rpc["MBps"],
        "rpc_MBps": plain["MBps"],  # with --insecure-plaintext on both ends
        "raw_MBps": base["MBps"],
        "secure_over_plaintext": round(rpc["MBps"] / plain["MBps"], 3),
        "handshake_ms": round(handshake_ms, 3),
        "handshake_ms_p90": round(percentile(args.handshake_ms, 90), 3)
        if args.handshake_ms
        else None,
        "ratio": round(ratio, 3),
        "rtt_median_us": rpc["rtt_median_us"],
        "rtt_p99_us": rpc["rtt_p99_us"],
        "raw_rtt_median_us": base["rtt_median_us"],
        "raw_rtt_p99_us": base["rtt_p99_us"],
        "uvloop": args.uvloop,
        "megabytes": args.megabytes,
        "chunk_bytes": args.chunk_kib * 1024,
        "statistic": "median",
        "repeats": args.repeats,
        "rtt_calls": args.rtt_calls,
        "zero_copy_decode": args.zero_copy_decode,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "paths": summaries,
        **bench_webrtc.summary(webrtc.cells),
        "webrtc_skipped": webrtc.skipped,
    }


def _by_label(
    labels: dict[str, str], summaries: dict[str, dict[str, Any]], metric: str
) -> dict[str, float]:
    return {labels[key]: float(summ[metric]) for key, summ in summaries.items()}


def _print_tables(
    args: argparse.Namespace,
    results: dict[str, PathResult],
    summaries: dict[str, dict[str, Any]],
    loop: str,
) -> None:
    base = summaries[BASELINE]
    bulk_rows = []
    rtt_rows = []
    for key, summ in summaries.items():
        label = results[key].path.label
        runs = summ["MBps_runs"]
        bulk_rows.append(
            [
                label,
                summ["MBps"],
                f"{min(runs):,.0f}-{max(runs):,.0f}",
                f"{summ['MBps'] / base['MBps']:.2f}",
                summ["send_cpu_s_per_GiB"],
                summ["recv_cpu_s_per_GiB"],
            ]
        )
        rtt_rows.append(
            [
                label,
                summ["rtt_median_us"],
                summ["rtt_p99_us"],
                summ["rtt_client_cpu_us"],
                summ["rtt_server_cpu_us"],
            ]
        )
    print(
        f"bulk: {args.megabytes} MiB of float32 in {args.chunk_kib} KiB chunks, {loop}, "
        f"loopback, median of {args.repeats} runs (CPU of the median run)"
    )
    print(
        format_table(
            ["path", "MiB/s", "runs", "vs raw", "send CPU s/GiB", "recv CPU s/GiB"], bulk_rows
        )
    )
    print()
    print(f"round trips: {args.rtt_calls} sequential calls after {args.rtt_warmup} warm-up")
    print(
        format_table(
            ["path", "p50 µs", "p99 µs", "client CPU µs/call", "server CPU µs/call"], rtt_rows
        )
    )


# -- entry points --------------------------------------------------------------------------


def _serve_role(key: str, use_uvloop: bool) -> None:
    run(PATHS[key].serve(announce_ready), use_uvloop=use_uvloop)


def _server_argv(key: str, use_uvloop: bool) -> list[str]:
    loop_flag = "--uvloop" if use_uvloop else "--no-uvloop"
    return module_argv("benchmarks.bench_transport", "--role", "server", "--path", key, loop_flag)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse and check the command line."""
    parser = argparse.ArgumentParser(
        description="p2ptrain RPC streaming vs a plain asyncio socket, over loopback.",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--megabytes", type=int, default=256, help="MiB per bulk run")
    parser.add_argument("--chunk-kib", type=int, default=1024, help="KiB per tensor chunk")
    parser.add_argument("--rtt-calls", type=int, default=10_000, help="timed round trips")
    parser.add_argument("--rtt-warmup", type=int, default=500, help="untimed round trips first")
    parser.add_argument("--repeats", type=int, default=3, help="bulk runs per path (median kept)")
    parser.add_argument(
        "--handshakes", type=int, default=200, help="fresh handshakes timed (median reported)"
    )
    parser.add_argument(
        "--uvloop",
        action=argparse.BooleanOptionalAction,
        default=uvloop_available(),
        help="use uvloop in every process (default: when installed)",
    )
    parser.add_argument("--png", help="also write a bar chart to this PNG file (default: none)")
    parser.add_argument(
        "--webrtc",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=(
            "also measure the WebRTC data channel in the NAT lab (default: on where the lab "
            "can run, i.e. as root with iptables; stock and tuned, clean and lossy: about "
            "3 minutes with the defaults below; --no-webrtc leaves it out)"
        ),
    )
    parser.add_argument(
        "--webrtc-seconds",
        type=float,
        default=bench_webrtc.DEFAULT_SECONDS["clean"],
        help="seconds per WebRTC run, clean path",
    )
    parser.add_argument(
        "--webrtc-loss-seconds",
        type=float,
        default=bench_webrtc.DEFAULT_SECONDS["lossy"],
        help="seconds per WebRTC run, lossy path",
    )
    parser.add_argument(
        "--webrtc-repeats",
        type=int,
        default=bench_webrtc.DEFAULT_REPEATS["clean"],
        help="WebRTC runs per variant, clean path",
    )
    parser.add_argument(
        "--webrtc-loss-repeats",
        type=int,
        default=bench_webrtc.DEFAULT_REPEATS["lossy"],
        help="WebRTC runs per variant, lossy path",
    )
    parser.add_argument(
        "--shaped",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=(
            "also measure send pacing on a shaped 50 Mbit/s uplink in the star lab "
            "(root; about 30 s with the defaults; --no-shaped leaves it out)"
        ),
    )
    parser.add_argument("--shaped-mib", type=int, default=24, help="MiB per shaped run")
    parser.add_argument("--shaped-repeats", type=int, default=3, help="shaped runs per mode")
    parser.add_argument("--json-only", action="store_true", help="print only the JSON line")
    parser.add_argument(
        "--inline-crypto-row",
        action="store_true",
        help="also measure encrypted RPC with crypto_offload_bytes=None (no worker threads)",
    )
    parser.add_argument(
        "--role", choices=["bench", "server"], default="bench", help=argparse.SUPPRESS
    )
    parser.add_argument("--path", choices=sorted(PATHS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "server" and args.path is None:
        parser.error("--role server needs --path")
    if args.megabytes <= 0:
        parser.error("--megabytes must be positive")
    if not 0 < args.chunk_kib * 1024 <= MAX_CHUNK_BYTES:
        parser.error(f"--chunk-kib must be in 1..{MAX_CHUNK_BYTES // 1024}")
    if args.rtt_calls < 1 or args.rtt_warmup < 0 or args.repeats < 1:
        parser.error("--rtt-calls and --repeats must be positive, --rtt-warmup not negative")
    if min(args.webrtc_repeats, args.webrtc_loss_repeats) < 1 or (
        min(args.webrtc_seconds, args.webrtc_loss_seconds) <= 0
    ):
        parser.error("--webrtc-repeats and the WebRTC durations must be positive")
    if args.shaped_mib < 1 or args.shaped_repeats < 1:
        parser.error("--shaped-mib and --shaped-repeats must be positive")
    if args.uvloop and not uvloop_available():
        parser.error("uvloop is not installed")
    args.zero_copy_decode = None
    args.handshake_ms = []
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (or, with the hidden ``--role server``, one server)."""
    args = parse_args(argv)
    torch.set_num_threads(1)  # tiny tensor ops only; keep OpenMP threads off the 2 cores
    if args.role == "server":
        _serve_role(args.path, args.uvloop)
        return 0
    with contextlib.ExitStack() as stack:
        addresses = {}
        for key in PATHS:
            if key in OPTIONAL_PATHS and not args.inline_crypto_row:
                continue
            server = stack.enter_context(ServerProcess(_server_argv(key, args.uvloop)))
            addresses[key] = server.address
        results = run(measure(args, addresses), use_uvloop=args.uvloop)
    webrtc = measure_webrtc(args)
    shaped = measure_shaped(args)
    emit_json({**report(args, results, webrtc), **shaped})
    return 0


if __name__ == "__main__":
    sys.exit(main())
