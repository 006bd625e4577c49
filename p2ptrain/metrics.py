"""Counters, gauges and timings of a peer, as JSON lines or Prometheus text.

Every subsystem records into one :class:`Metrics` registry: counters only go
up (bytes sent, rounds, RPC failures), gauges are set (samples/s, peers
online), timings keep a count, a sum and the recent values for quantiles
(all-reduce seconds, achieved versus predicted). Collectors are callbacks run
at snapshot time, for figures that live elsewhere (a transport's byte
counters). :class:`MetricsServer` serves ``GET /metrics`` in the Prometheus
text format on a local port; :class:`JsonLinesWriter` appends snapshots to a
file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from p2ptrain.errors import ConfigError

__all__ = ["JsonLinesWriter", "Metrics", "MetricsServer", "Sample", "node_collector"]

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Sample:
    """One value of one metric, as collectors report it."""

    name: str
    value: float
    labels: Mapping[str, str] = field(default_factory=dict)
    kind: str = "gauge"


@dataclass
class _Timing:
    count: int = 0
    total: float = 0.0
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=1024))

    def quantile(self, q: float) -> float:
        if not self.recent:
            return math.nan
        ordered = sorted(self.recent)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _key(name: str, labels: Mapping[str, str] | None) -> tuple[str, Labels]:
    if not _NAME.match(name):
        raise ConfigError(f"bad metric name {name!r}")
    return name, tuple(sorted((labels or {}).items()))


class Metrics:
    """A registry of counters, gauges and timings."""

    def __init__(self) -> None:
        self._counters: dict[tuple[str, Labels], float] = {}
        self._gauges: dict[tuple[str, Labels], float] = {}
        self._timings: dict[tuple[str, Labels], _Timing] = {}
        self._collectors: list[Callable[[], Iterable[Sample]]] = []

    def inc(self, name: str, amount: float = 1.0, labels: Mapping[str, str] | None = None) -> None:
        """Add ``amount`` (>= 0) to a counter."""
        if amount < 0:
            raise ConfigError("counters only go up")
        key = _key(name, labels)
        self._counters[key] = self._counters.get(key, 0.0) + amount

    def set(self, name: str, value: float, labels: Mapping[str, str] | None = None) -> None:
        """Set a gauge."""
        self._gauges[_key(name, labels)] = float(value)

    def observe(self, name: str, seconds: float, labels: Mapping[str, str] | None = None) -> None:
        """Record one timing."""
        timing = self._timings.setdefault(_key(name, labels), _Timing())
        timing.count += 1
        timing.total += seconds
        timing.recent.append(seconds)

    def add_collector(self, collector: Callable[[], Iterable[Sample]]) -> None:
        """Run ``collector`` at every snapshot and include its samples."""
        self._collectors.append(collector)

    def counter(self, name: str, labels: Mapping[str, str] | None = None) -> float:
        """The current value of a counter (0 if never incremented)."""
        return self._counters.get(_key(name, labels), 0.0)

    def samples(self) -> list[Sample]:
        """Every current value, collectors included."""
        out = [Sample(n, v, dict(lb), "counter") for (n, lb), v in self._counters.items()]
        out += [Sample(n, v, dict(lb), "gauge") for (n, lb), v in self._gauges.items()]
        for (name, labels), timing in self._timings.items():
            base = dict(labels)
            out.append(Sample(f"{name}_count", timing.count, base, "counter"))
            out.append(Sample(f"{name}_sum", timing.total, base, "counter"))
            for q in (0.5, 0.99):
                out.append(
                    Sample(name, timing.quantile(q), {**base, "quantile": str(q)}, "summary")
                )
        for collector in self._collectors:
            out.extend(collector())
        return out

    def snapshot(self) -> dict[str, Any]:
        """A JSON-able dict: ``{"time": ..., "metrics": {"name{labels}": value}}``."""
        metrics = {_series(s.name, s.labels): s.value for s in self.samples()}
        return {"time": time.time(), "metrics": metrics}

    def prometheus_text(self) -> str:
        """The Prometheus text exposition format (version 0.0.4)."""
        lines: list[str] = []
        typed: set[str] = set()
        for sample in sorted(self.samples(), key=lambda s: s.name):
            family = sample.name
            if sample.kind == "summary" or family.endswith(("_count", "_sum")):
                family = re.sub(r"_(count|sum)$", "", family)
                kind = "summary"
            else:
                kind = sample.kind
            if family not in typed:
                lines.append(f"# TYPE {family} {kind}")
                typed.add(family)
            lines.append(f"{_series(sample.name, sample.labels)} {_number(sample.value)}")
        return "\n".join(lines) + "\n"


def _series(name: str, labels: Mapping[str, str]) -> str:
    if not labels:
        return name
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class _TrafficSource(Protocol):
    def traffic_by_path(self) -> dict[str, tuple[int, int]]: ...

    def connections(self) -> list[Any]: ...


def node_collector(node: _TrafficSource) -> Callable[[], list[Sample]]:
    """A collector of a node's open connections and their bytes per path.

    Use ``metrics.add_collector(node_collector(node))``. Bytes count the
    connections open at snapshot time (closed ones drop out).
    """

    def collect() -> list[Sample]:
        samples = [Sample("p2ptrain_connections_open", len(node.connections()))]
        for path, (sent, received) in sorted(node.traffic_by_path().items()):
            samples.append(Sample("p2ptrain_path_bytes_sent", sent, {"path": path}))
            samples.append(Sample("p2ptrain_path_bytes_received", received, {"path": path}))
        return samples

    return collect


class JsonLinesWriter:
    """Appends a snapshot of ``metrics`` to ``path`` every ``interval`` seconds."""

    def __init__(self, metrics: Metrics, path: str | Path, *, interval: float = 10.0) -> None:
        if not interval > 0:
            raise ConfigError("interval must be positive")
        self.metrics = metrics
        self.path = Path(path)
        self.interval = interval
        self._task: asyncio.Task[None] | None = None

    def write_now(self) -> None:
        """Append one snapshot line."""
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(self.metrics.snapshot()) + "\n")

    async def start(self) -> None:
        """Start writing periodically."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="metrics-jsonl")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                self.write_now()
            except OSError as exc:
                logger.warning("cannot write metrics to %s: %s", self.path, exc)

    async def aclose(self) -> None:
        """Stop, writing a last snapshot."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
            self.write_now()


class MetricsServer:
    """Serves ``GET /metrics`` (Prometheus text) on a local port; nothing else."""

    def __init__(self, metrics: Metrics, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.metrics = metrics
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        """Start listening (``port`` 0 picks one; read it back from :attr:`port`)."""
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(5):
                request = await reader.readuntil(b"\r\n\r\n")
            method, path, *_ = [*request.split(b" ", 2), b"", b""]
            if method == b"GET" and path.split(b"?")[0] == b"/metrics":
                status, body = "200 OK", self.metrics.prometheus_text().encode()
            else:
                status, body = "404 Not Found", b"only GET /metrics is served\n"
            head = (
                f"HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode() + body)
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass  # a broken or slow client: just drop it
        finally:
            writer.close()

    async def aclose(self) -> None:
        """Stop serving."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
