"""Bandwidth probes, for a peer that has not measured its links yet.

Until a peer has taken part in an all-reduce round, nothing tells it what
its links carry and matchmaking would announce a guess. Two probes measure
both directions, each where the bytes arrive.

**Timed probe** (:func:`probe_peers`, what a peer runs at start): the prober
opens a stream to every target at once and, in step on all of them,

1. asks each to get ready (``{"d": seconds}``);
2. sends on every stream for the same ``seconds`` (then ``{"end": true}``);
   each target times what arrived (payload bytes over the span from the
   first header to the last read) and answers with it;
3. once all have answered, asks them all to send (``{"down": true}``); each
   sends for ``seconds`` and the prober times every stream the same way.

Every stream runs for the same time, so the streams together show what this
peer's link carried while all of them were busy: a byte-bounded probe (the
same bytes to every target) was timed by its slowest partner's stream, and
showed a 1000 Mbit/s link among 50–200 Mbit/s partners as 650 up and 340 down.
What the partners' own links cannot take is still not seen: a link faster
than its partners together is measured as their sum.

**Byte probe** (:func:`probe_throughput`, one target, ``u`` bytes up and
``n`` back): kept for :func:`measure_if_unknown` and small checks.

Waiting (the round trips in between, the other side's scheduling) is never
counted as transfer time. A measured round replaces or raises what a probe
found (see :class:`~p2ptrain.measure.estimates.LinkEstimator`).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Any, Final, TypeGuard

from p2ptrain.errors import ConfigError, P2PTrainError, RemoteProtocolError
from p2ptrain.measure.estimates import ArrivalTimer, StreamTiming
from p2ptrain.measure.meters import ThroughputMeter
from p2ptrain.node.address import PeerAddress
from p2ptrain.node.node import Node
from p2ptrain.rpc.handlers import CallContext
from p2ptrain.rpc.stream import RPCStream

__all__ = [
    "DEFAULT_PROBE_BYTES",
    "DEFAULT_PROBE_SECONDS",
    "MAX_PROBE_BYTES",
    "MAX_PROBE_SECONDS",
    "PROBE_METHOD",
    "ProbeResult",
    "TimedProbeResult",
    "measure_if_unknown",
    "probe_peers",
    "probe_throughput",
    "serve_probes",
]

PROBE_METHOD: Final = "allreduce/probe/v1"
DEFAULT_PROBE_BYTES: Final = 4 << 20
"""Bytes sent each way by default."""
MAX_PROBE_BYTES: Final = 16 << 20
"""Most bytes a server accepts or sends back in one byte probe."""
DEFAULT_PROBE_SECONDS: Final = 0.5
"""Seconds each direction of a timed probe sends."""
MAX_PROBE_SECONDS: Final = 5.0
"""Longest timed probe a server takes part in (each direction)."""
MAX_TIMED_BYTES: Final = 256 << 20
"""Most bytes one stream of a timed probe may carry each way (1 s at 2 Gbit/s)."""
_TIMED_CHUNK: Final = 64 << 10
"""Payload bytes per message of a timed probe."""


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """What one probe measured.

    Attributes:
        nbytes: Bytes moved each way.
        upload_s: Seconds the prober's bytes took to arrive, timed by the server.
        download_s: Seconds the server's bytes took to arrive, timed by the prober.
    """

    nbytes: int
    upload_s: float
    download_s: float

    @property
    def upload_bytes_per_s(self) -> float:
        """The prober's upload rate."""
        return self.nbytes / self.upload_s

    @property
    def download_bytes_per_s(self) -> float:
        """The prober's download rate."""
        return self.nbytes / self.download_s


@dataclass(frozen=True, slots=True)
class TimedProbeResult:
    """What one stream of a timed probe carried, each way timed where it arrived.

    Attributes:
        upload: The prober's bytes and their span at the target.
        download: The target's bytes and their span at the prober.
    """

    upload: StreamTiming
    download: StreamTiming


class _ArrivalClock:
    """Times one payload from its header's arrival to its reading."""

    def __init__(self, stream: RPCStream) -> None:
        self._loop = asyncio.get_running_loop()
        self.started: float | None = None
        stream.receive_payloads_into(self._arriving)

    def _arriving(self, body: object, nbytes: int) -> None:
        if self.started is None:
            self.started = self._loop.time()

    def seconds(self) -> float:
        """Seconds since the payload started to arrive (0 if the transport cannot tell)."""
        return 0.0 if self.started is None else self._loop.time() - self.started


def _size(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_PROBE_BYTES:
        raise RemoteProtocolError(f"{what} must be an int in (0, {MAX_PROBE_BYTES}]")
    return value


async def _serve(context: CallContext, stream: RPCStream) -> None:
    request = (await stream.recv()).body
    if not isinstance(request, dict):
        raise RemoteProtocolError("a probe request must be a map")
    if "d" in request:
        await _serve_timed(stream, _seconds(request.get("d")))
        return
    upload = _size(request.get("u"), "upload bytes")
    download = _size(request.get("n"), "download bytes")
    clock = _ArrivalClock(stream)
    await stream.send({"ready": True})
    message = await stream.recv()
    seconds = clock.seconds()
    if len(memoryview(message.payload)) != upload:
        raise RemoteProtocolError(f"expected {upload} probe bytes")
    await stream.send({"s": seconds}, bytes(download), end=True)


def _seconds(value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 < value <= MAX_PROBE_SECONDS
    ):
        raise RemoteProtocolError(f"probe seconds must be a number in (0, {MAX_PROBE_SECONDS}]")
    return float(value)


def _is_end(body: object) -> bool:
    return isinstance(body, dict) and body.get("end") is True


async def _receive_timed(stream: RPCStream) -> StreamTiming:
    """Read payload messages until ``{"end": true}``; their bytes and span where they arrived."""
    timer = ArrivalTimer()

    def arriving(body: object, nbytes: int) -> None:
        timer.arriving(time.perf_counter())

    stream.receive_payloads_into(arriving)
    try:
        while True:
            message = await stream.recv()
            nbytes = len(memoryview(message.payload))
            if nbytes:
                timer.read(nbytes, time.perf_counter())
            if timer.nbytes > MAX_TIMED_BYTES:
                raise RemoteProtocolError(f"a timed probe carries at most {MAX_TIMED_BYTES} bytes")
            if _is_end(message.body):
                return timer.timing()
    finally:
        stream.receive_payloads_into(None)


async def _send_timed(stream: RPCStream, seconds: float, *, end: bool) -> None:
    """Send payload messages for ``seconds`` (at most :data:`MAX_TIMED_BYTES`), then the end."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    chunk = bytes(_TIMED_CHUNK)
    sent = 0
    while loop.time() < deadline and sent + len(chunk) <= MAX_TIMED_BYTES:
        await stream.send(None, chunk)
        sent += len(chunk)
    await stream.send({"end": True}, end=end)


async def _serve_timed(stream: RPCStream, seconds: float) -> None:
    await stream.send({"ready": True})
    timing = await _receive_timed(stream)
    await stream.send({"b": timing.nbytes, "s": timing.seconds})
    go = await stream.recv()
    if not (isinstance(go.body, dict) and go.body.get("down") is True):
        raise RemoteProtocolError("a timed probe expects {'down': true} before it sends")
    await _send_timed(stream, seconds, end=True)


def serve_probes(node: Node) -> None:
    """Answer other peers' probes on ``node`` (once per node).

    Raises:
        ConfigError: The node already serves probes.
    """
    node.handlers.add_stream(PROBE_METHOD, _serve)


async def probe_throughput(
    node: Node,
    target: PeerAddress,
    *,
    nbytes: int = DEFAULT_PROBE_BYTES,
    timeout: float = 10.0,
) -> ProbeResult:
    """Measure this node's upload to and download from ``target`` (which serves probes).

    Raises:
        ConfigError: ``nbytes`` out of range.
        P2PTrainError: The probe failed (unreachable, refused, timed out), or
            the transport cannot time arrivals (then nothing is measured).
    """
    if not 0 < nbytes <= MAX_PROBE_BYTES:
        raise ConfigError(f"nbytes must be in (0, {MAX_PROBE_BYTES}]")
    stream = await node.open_stream(target, PROBE_METHOD, timeout=timeout)
    async with stream:
        await stream.send({"u": nbytes, "n": nbytes})
        await stream.recv()  # ready
        clock = _ArrivalClock(stream)
        await stream.send(None, bytes(nbytes), end=True)
        reply = await stream.recv()
        download_s = clock.seconds()
    body: Any = reply.body
    upload_s = body.get("s") if isinstance(body, dict) else None
    if not _is_duration(upload_s):
        raise RemoteProtocolError("a probe reply needs the upload time")
    if len(memoryview(reply.payload)) != nbytes:
        raise RemoteProtocolError(f"expected {nbytes} probe bytes back")
    if upload_s <= 0 or download_s <= 0:
        raise P2PTrainError("this transport cannot time arrivals: nothing measured")
    return ProbeResult(nbytes, float(upload_s), download_s)


def _timing_reply(body: object) -> StreamTiming:
    if not isinstance(body, dict):
        raise RemoteProtocolError("a timed probe reply must be a map")
    nbytes, seconds = body.get("b"), body.get("s")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise RemoteProtocolError("a timed probe reply needs the bytes received")
    if not _is_duration(seconds):
        raise RemoteProtocolError("a timed probe reply needs the seconds they took")
    return StreamTiming(nbytes, float(seconds))


def _is_duration(value: object) -> TypeGuard[int | float]:
    """A finite number of seconds >= 0, as a reply states one (not a bool)."""
    return (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
        and value >= 0
    )


async def probe_peers(
    node: Node,
    targets: list[PeerAddress],
    *,
    seconds: float = DEFAULT_PROBE_SECONDS,
    timeout: float = 10.0,
) -> list[TimedProbeResult]:
    """Probe every target at once, each way for ``seconds``; what those that answered gave.

    All streams send in step (every target ready first; downloads only once
    every upload was timed), so they share this peer's links for the same
    time: together (:func:`~p2ptrain.measure.estimates.combined_rate`) they
    show what its links carried towards (and from) all of them. A target
    that fails at any step is left out.

    Raises:
        ConfigError: ``seconds`` out of range.
    """
    if not 0 < seconds <= MAX_PROBE_SECONDS:
        raise ConfigError(f"seconds must be in (0, {MAX_PROBE_SECONDS}]")
    if not targets:
        return []

    async def ready(target: PeerAddress) -> RPCStream | None:
        try:
            stream = await node.open_stream(target, PROBE_METHOD, timeout=timeout)
        except P2PTrainError:
            return None
        try:
            async with asyncio.timeout(timeout):
                await stream.send({"d": seconds})
                await stream.recv()  # ready
        except (P2PTrainError, TimeoutError):
            await stream.aclose()
            return None
        return stream

    async def upload(stream: RPCStream) -> StreamTiming | None:
        try:
            async with asyncio.timeout(timeout + seconds):
                await _send_timed(stream, seconds, end=False)
                return _timing_reply((await stream.recv()).body)
        except (P2PTrainError, TimeoutError):
            return None

    async def download(stream: RPCStream) -> StreamTiming | None:
        try:
            async with asyncio.timeout(timeout + seconds):
                await stream.send({"down": True}, end=True)
                return await _receive_timed(stream)
        except (P2PTrainError, TimeoutError):
            return None

    opened = await asyncio.gather(*(ready(t) for t in targets))
    streams = [s for s in opened if s is not None]
    try:
        ups = await asyncio.gather(*(upload(s) for s in streams))
        live = [(s, up) for s, up in zip(streams, ups, strict=True) if up is not None]
        downs = await asyncio.gather(*(download(s) for s, _ in live))
    finally:
        for stream in streams:
            await stream.aclose()
    return [
        TimedProbeResult(up, down)
        for (_, up), down in zip(live, downs, strict=True)
        if down is not None and up.seconds > 0 and down.seconds > 0
    ]


async def measure_if_unknown(
    meter: ThroughputMeter,
    node: Node,
    targets: list[PeerAddress],
    *,
    nbytes: int = DEFAULT_PROBE_BYTES,
    timeout: float = 10.0,
) -> ProbeResult | None:
    """Probe the first target that answers, if ``meter`` knows neither direction yet.

    A direction with an explicit rate or a measurement is left alone; the
    probe's figures become the first samples of the others (subject to the
    meter's ``min_bytes`` / ``min_seconds``). Returns what was measured, or
    None when nothing needed measuring or no target answered.
    """
    upload_known = meter.upload_bytes_per_s is not None
    download_known = meter.download_bytes_per_s is not None
    if upload_known and download_known:
        return None
    for target in targets:
        try:
            result = await probe_throughput(node, target, nbytes=nbytes, timeout=timeout)
        except P2PTrainError:
            continue
        if not upload_known:
            meter.record_upload(nbytes, result.upload_s)
        if not download_known:
            meter.record_download(nbytes, result.download_s)
        return result
    return None
