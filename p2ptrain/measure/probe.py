"""A short bandwidth probe, for a peer that has not measured its links yet.

Until a peer has taken part in an all-reduce round, its
:class:`~p2ptrain.measure.meters.ThroughputMeter` has nothing to report
and matchmaking would announce a guess. :func:`probe_throughput` measures
both directions against one other peer instead, each where the bytes arrive:

1. the prober opens a stream to :data:`PROBE_METHOD` and asks for ``n`` bytes
   back after sending ``u`` bytes;
2. the server gets ready to time the next payload and says so;
3. the prober sends ``u`` bytes; the server times them from their first bytes
   (the message's header) to their last and answers with that time and
   ``n`` bytes, which the prober times the same way.

Waiting (the round trips in between, the other side's scheduling) is never
counted as transfer time. One probe moves a few megabytes: on a fast link it
measures latency and CPU as much as bandwidth, which is why a measured round
replaces it as soon as there is one (see :func:`measure_if_unknown`).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any, Final

from p2ptrain.errors import ConfigError, P2PTrainError, RemoteProtocolError
from p2ptrain.measure.meters import ThroughputMeter
from p2ptrain.node.address import PeerAddress
from p2ptrain.node.node import Node
from p2ptrain.rpc.handlers import CallContext
from p2ptrain.rpc.stream import RPCStream

__all__ = [
    "DEFAULT_PROBE_BYTES",
    "MAX_PROBE_BYTES",
    "PROBE_METHOD",
    "ProbeResult",
    "measure_if_unknown",
    "probe_peers",
    "probe_throughput",
    "serve_probes",
]

PROBE_METHOD: Final = "allreduce/probe/v1"
DEFAULT_PROBE_BYTES: Final = 4 << 20
"""Bytes sent each way by default."""
MAX_PROBE_BYTES: Final = 16 << 20
"""Most bytes a server accepts or sends back in one probe."""


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
    upload = _size(request.get("u"), "upload bytes")
    download = _size(request.get("n"), "download bytes")
    clock = _ArrivalClock(stream)
    await stream.send({"ready": True})
    message = await stream.recv()
    seconds = clock.seconds()
    if len(memoryview(message.payload)) != upload:
        raise RemoteProtocolError(f"expected {upload} probe bytes")
    await stream.send({"s": seconds}, bytes(download), end=True)


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
    if (
        isinstance(upload_s, bool)
        or not isinstance(upload_s, int | float)
        or not math.isfinite(upload_s)
        or upload_s < 0
    ):
        raise RemoteProtocolError("a probe reply needs the upload time")
    if len(memoryview(reply.payload)) != nbytes:
        raise RemoteProtocolError(f"expected {nbytes} probe bytes back")
    if upload_s <= 0 or download_s <= 0:
        raise P2PTrainError("this transport cannot time arrivals: nothing measured")
    return ProbeResult(nbytes, float(upload_s), download_s)


async def probe_peers(
    node: Node,
    targets: list[PeerAddress],
    *,
    nbytes: int = DEFAULT_PROBE_BYTES,
    timeout: float = 10.0,
) -> list[ProbeResult]:
    """Probe every target at once, ``nbytes`` split among them; what those that answered gave.

    Run at the same time, the probes share this peer's links: together they
    show what its links carried towards (and from) all of them, which a
    single slow partner would hide. Each target gets at least 1 MiB.
    """
    if not targets:
        return []
    each = max(nbytes // len(targets), min(nbytes, 1 << 20))

    async def one(target: PeerAddress) -> ProbeResult | None:
        try:
            return await probe_throughput(node, target, nbytes=each, timeout=timeout)
        except P2PTrainError:
            return None

    results = await asyncio.gather(*(one(t) for t in targets))
    return [r for r in results if r is not None]


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
