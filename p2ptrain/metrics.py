"""Counters, gauges and timings of a peer, as JSON lines or Prometheus text.

Every subsystem records into one :class:`Metrics` registry: counters only go
up (bytes sent, rounds, RPC failures), gauges are set (samples/s, peers
online), timings keep a count, a sum and the recent values for quantiles
(all-reduce seconds, achieved versus predicted). Collectors are callbacks run
at snapshot time, for figures that live elsewhere (a transport's byte
counters): :func:`node_collector` (connections and bytes per path),
:func:`dht_collector` (DHT requests) and :func:`allreduce_collector`
(averaging rounds). :class:`MetricsServer` serves ``GET /metrics`` in the
Prometheus text format on a local port; :class:`JsonLinesWriter` appends
snapshots to a file. Both read :meth:`Metrics.samples`, so they always agree.
:data:`HELP` describes every metric the package records (``docs/observability.md``
lists them too).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from p2ptrain.errors import ConfigError

if TYPE_CHECKING:
    from p2ptrain.dht.node import DHTNode
    from p2ptrain.nat.service import NATService
    from p2ptrain.train.round_stats import RoundStats

__all__ = [
    "HELP",
    "JsonLinesWriter",
    "Metrics",
    "MetricsServer",
    "Sample",
    "allreduce_collector",
    "dht_collector",
    "nat_collector",
    "node_collector",
]

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
Labels = tuple[tuple[str, str], ...]

HELP: dict[str, str] = {
    # node_collector
    "p2ptrain_connections_open": "Connections open now.",
    "p2ptrain_path_bytes_sent_total": "Bytes sent since the node started, by transport path.",
    "p2ptrain_path_bytes_received_total": "Bytes received since the node started, by path.",
    # dht_collector
    "p2ptrain_dht_requests_total": "DHT requests sent, by method.",
    "p2ptrain_dht_request_failures_total": "DHT requests that failed, by method and reason.",
    "p2ptrain_dht_response_seconds": "Latency of the DHT requests answered, by method.",
    "p2ptrain_dht_requests_served_total": "DHT requests received from other peers, by method.",
    "p2ptrain_dht_peers_known": "Peers in the DHT routing table.",
    "p2ptrain_dht_records_held": "DHT records this peer stores for the swarm.",
    # allreduce_collector
    "p2ptrain_allreduce_rounds_total": "All-reduce rounds run, by result.",
    "p2ptrain_allreduce_failures_total": "Steps averaged locally after an error, by stage.",
    "p2ptrain_allreduce_seconds": "Achieved all-reduce seconds.",
    "p2ptrain_allreduce_predicted_seconds": "Load-balancer predicted seconds of the rounds.",
    "p2ptrain_allreduce_last_seconds": "Achieved seconds of the latest round.",
    "p2ptrain_allreduce_last_predicted_seconds": "Predicted seconds of the latest round.",
    "p2ptrain_allreduce_last_group_size": "Group size of the latest round.",
    "p2ptrain_allreduce_members_total": "Group sizes summed over the rounds.",
    "p2ptrain_allreduce_bytes_sent_total": "Tensor bytes sent by all-reduce rounds.",
    "p2ptrain_allreduce_bytes_received_total": "Tensor bytes received by all-reduce rounds.",
    "p2ptrain_allreduce_peers_dropped_total": "Group members reported failed or excluded.",
    # nat_collector
    "p2ptrain_nat_traversals_total": "NAT traversals that connected, by the path they took.",
    "p2ptrain_nat_traversal_failures_total": "NAT traversals in which every path failed.",
    "p2ptrain_nat_fallbacks_total": "Cheaper paths skipped or failed during traversals, by path.",
    "p2ptrain_nat_crossing_dials_total": "Traversals that kept a simultaneous dial's connection.",
    "p2ptrain_nat_traversal_seconds": "Seconds the traversals that connected took.",
    "p2ptrain_nat_refused_total": "Traversed connections refused at the handshake.",
    # recorded by the trainer (p2ptrain.train.collaboration)
    "train_samples_total": "Samples this peer computed.",
    "train_samples_per_s": "This peer's recent samples per second.",
    "train_rounds_total": "Steps averaged, in a group or locally.",
    "train_allreduce_bytes_sent_total": "Tensor bytes the trainer's averaging sent.",
    "train_allreduce_bytes_received_total": "Tensor bytes the trainer's averaging received.",
    "train_matchmaking_seconds": "Seconds from the start of matchmaking to a group plan.",
    "train_allreduce_seconds": "Seconds of the trainer's all-reduce calls.",
    "train_wait_seconds": "Seconds blocked waiting for the swarm.",
    "train_state_downloads_total": "States downloaded from other peers.",
    "train_state_download_seconds": "Seconds state downloads took.",
    "train_global_step": "This peer's global step.",
    "train_swarm_global_step": "The swarm's global step as last read.",
    "train_swarm_samples_per_s": "The swarm's samples per second as last read.",
    "train_peers_online": "Peers of the run online as last read.",
    "train_step_samples": "Samples the swarm averaged in each step this peer applied.",
    "train_last_step_samples": "Samples of the latest step this peer applied.",
    "train_target_batch_size": "The target batch size of the run.",
}
"""One line of help per metric family, shown as ``# HELP`` in the Prometheus text."""


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
    if not labels:
        return name, ()
    for label in labels:
        if not _LABEL.match(label) or label.startswith("__"):
            raise ConfigError(f"bad label name {label!r}")
    return name, tuple(sorted(labels.items()))


class Metrics:
    """A registry of counters, gauges and timings."""

    def __init__(self) -> None:
        self._counters: dict[tuple[str, Labels], float] = {}
        self._gauges: dict[tuple[str, Labels], float] = {}
        self._timings: dict[tuple[str, Labels], _Timing] = {}
        self._collectors: list[Callable[[], Iterable[Sample]]] = []
        self._help: dict[str, str] = dict(HELP)

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
        """Run ``collector`` at every snapshot and include its samples.

        Collectors reporting the same series (several peers sharing one
        registry) are merged: counters add up, gauges keep the last value.
        """
        self._collectors.append(collector)

    def describe(self, family: str, text: str) -> None:
        """Set the ``# HELP`` text of a metric family (see :data:`HELP`)."""
        _key(family, None)
        self._help[family] = text

    def counter(self, name: str, labels: Mapping[str, str] | None = None) -> float:
        """The current value of a counter (0 if never incremented)."""
        return self._counters.get(_key(name, labels), 0.0)

    def samples(self) -> list[Sample]:
        """Every current value, collectors included.

        Safe to call from another thread than the one recording: each dict is
        copied in one step (under the GIL) before it is read.
        """
        out = [Sample(n, v, dict(lb), "counter") for (n, lb), v in list(self._counters.items())]
        out += [Sample(n, v, dict(lb), "gauge") for (n, lb), v in list(self._gauges.items())]
        for (name, labels), timing in list(self._timings.items()):
            base = dict(labels)
            out.append(Sample(f"{name}_count", timing.count, base, "counter"))
            out.append(Sample(f"{name}_sum", timing.total, base, "counter"))
            for q in (0.5, 0.99):
                out.append(
                    Sample(name, timing.quantile(q), {**base, "quantile": str(q)}, "summary")
                )
        if not self._collectors:
            return out
        merged: dict[tuple[str, Labels], Sample] = {}
        for collector in self._collectors:
            for sample in collector():
                series = (sample.name, tuple(sorted(sample.labels.items())))
                prior = merged.get(series)
                if prior is not None and sample.kind == "counter":
                    merged[series] = dataclasses.replace(sample, value=prior.value + sample.value)
                else:
                    merged[series] = sample
        return out + list(merged.values())

    def snapshot(self) -> dict[str, Any]:
        """A JSON-able dict: ``{"time": ..., "metrics": {"name{labels}": value}}``.

        NaN and infinite values become ``None`` (JSON has no such numbers).
        """
        metrics = {
            _series(s.name, s.labels): s.value if math.isfinite(s.value) else None
            for s in self.samples()
        }
        return {"time": time.time(), "metrics": metrics}

    def prometheus_text(self) -> str:
        """The Prometheus text exposition format (version 0.0.4).

        Each family's samples come together, after its ``# HELP`` (when
        known) and ``# TYPE`` lines. A ``_count``/``_sum`` pair makes a
        summary (with quantiles for timings, without for collectors' sums).
        """
        families: dict[str, tuple[str, list[Sample]]] = {}
        for sample in self.samples():
            family, kind = sample.name, sample.kind
            if kind == "summary" or family.endswith(("_count", "_sum")):
                family, kind = re.sub(r"_(count|sum)$", "", family), "summary"
            families.setdefault(family, (kind, []))[1].append(sample)
        lines: list[str] = []
        for family in sorted(families):
            kind, samples = families[family]
            if family in self._help:
                lines.append(f"# HELP {family} {_escape_help(self._help[family])}")
            lines.append(f"# TYPE {family} {kind}")
            samples.sort(key=lambda s: (s.name, sorted(s.labels.items())))
            lines += [f"{_series(s.name, s.labels)} {_number(s.value)}" for s in samples]
        return "\n".join(lines) + "\n"


def _series(name: str, labels: Mapping[str, str]) -> str:
    if not labels:
        return name
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class _TrafficSource(Protocol):
    def traffic_by_path(self) -> dict[str, tuple[int, int]]: ...

    def connections(self) -> list[Any]: ...


def _counter(name: str, value: float, labels: Mapping[str, str] | None = None) -> Sample:
    return Sample(name, value, labels or {}, "counter")


def node_collector(node: _TrafficSource) -> Callable[[], list[Sample]]:
    """A collector of a node's open connections and their bytes per path.

    Use ``metrics.add_collector(node_collector(node))``. Bytes are
    counters since the node started (closed connections keep counting).
    """

    def collect() -> list[Sample]:
        samples = [Sample("p2ptrain_connections_open", len(node.connections()))]
        for path, (sent, received) in sorted(node.traffic_by_path().items()):
            labels = {"path": path}
            samples.append(_counter("p2ptrain_path_bytes_sent_total", sent, labels))
            samples.append(_counter("p2ptrain_path_bytes_received_total", received, labels))
        return samples

    return collect


def dht_collector(node: DHTNode) -> Callable[[], list[Sample]]:
    """A collector of a DHT node's requests by method, failures, latency and table size.

    Use ``metrics.add_collector(dht_collector(peer.dht.dht_node))``.
    """
    stats = node.stats

    def collect() -> list[Sample]:
        samples = [
            Sample("p2ptrain_dht_peers_known", len(node.routing_table)),
            Sample("p2ptrain_dht_records_held", len(node.records)),
        ]
        for method, count in sorted(dict(stats.sent).items()):
            labels = {"method": method}
            samples.append(_counter("p2ptrain_dht_requests_total", count, labels))
            answered = stats.answered.get(method, 0)
            seconds = stats.answer_seconds.get(method, 0.0)
            samples.append(_counter("p2ptrain_dht_response_seconds_count", answered, labels))
            samples.append(_counter("p2ptrain_dht_response_seconds_sum", seconds, labels))
        for (method, reason), count in sorted(dict(stats.failed).items()):
            labels = {"method": method, "reason": reason}
            samples.append(_counter("p2ptrain_dht_request_failures_total", count, labels))
        for method, count in sorted(dict(stats.served).items()):
            labels = {"method": method}
            samples.append(_counter("p2ptrain_dht_requests_served_total", count, labels))
        return samples

    return collect


def nat_collector(service: NATService) -> Callable[[], list[Sample]]:
    """A collector of a peer's NAT traversals: paths taken, fallbacks, failures.

    Use ``metrics.add_collector(nat_collector(peer.nat))`` on a peer running
    NAT traversal.
    """
    stats = service.stats

    def collect() -> list[Sample]:
        connected = dict(stats.connected)
        samples = [
            _counter("p2ptrain_nat_traversal_failures_total", stats.failed),
            _counter("p2ptrain_nat_crossing_dials_total", stats.crossing),
            _counter("p2ptrain_nat_traversal_seconds_count", sum(connected.values())),
            _counter("p2ptrain_nat_traversal_seconds_sum", stats.seconds),
            _counter("p2ptrain_nat_refused_total", service.refused),
        ]
        for path, count in sorted(connected.items()):
            samples.append(_counter("p2ptrain_nat_traversals_total", count, {"path": path}))
        for attempt, count in sorted(dict(stats.fallbacks).items()):
            samples.append(_counter("p2ptrain_nat_fallbacks_total", count, {"path": attempt}))
        return samples

    return collect


def allreduce_collector(stats: RoundStats) -> Callable[[], list[Sample]]:
    """A collector of a trainer's all-reduce rounds: achieved vs predicted seconds, bytes.

    :class:`~p2ptrain.train.collaboration.Collaboration` registers one when
    given a registry.
    """

    def collect() -> list[Sample]:
        samples = [
            _counter("p2ptrain_allreduce_rounds_total", stats.rounds - stats.incomplete, _DONE),
            _counter("p2ptrain_allreduce_rounds_total", stats.incomplete, _PARTLY),
            _counter("p2ptrain_allreduce_seconds_count", stats.rounds),
            _counter("p2ptrain_allreduce_seconds_sum", stats.seconds),
            _counter("p2ptrain_allreduce_predicted_seconds_count", stats.predicted_rounds),
            _counter("p2ptrain_allreduce_predicted_seconds_sum", stats.predicted_seconds),
            _counter("p2ptrain_allreduce_members_total", stats.members),
            _counter("p2ptrain_allreduce_bytes_sent_total", stats.bytes_sent),
            _counter("p2ptrain_allreduce_bytes_received_total", stats.bytes_received),
            _counter("p2ptrain_allreduce_peers_dropped_total", stats.dropped),
        ]
        for stage, count in sorted(dict(stats.failures).items()):
            samples.append(_counter("p2ptrain_allreduce_failures_total", count, {"stage": stage}))
        if stats.last_seconds is not None:
            samples.append(Sample("p2ptrain_allreduce_last_seconds", stats.last_seconds))
            samples.append(Sample("p2ptrain_allreduce_last_group_size", stats.last_group_size))
        if stats.last_predicted_seconds is not None:
            samples.append(
                Sample("p2ptrain_allreduce_last_predicted_seconds", stats.last_predicted_seconds)
            )
        return samples

    return collect


_DONE = {"result": "complete"}
_PARTLY = {"result": "incomplete"}


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
