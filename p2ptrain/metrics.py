"""Counters, gauges and timing histograms of a peer, on the Prometheus client library.

Every subsystem records into one :class:`Metrics` registry (a
``prometheus_client`` :class:`~prometheus_client.CollectorRegistry`):
counters only go up (bytes sent, rounds, RPC failures), gauges are set
(samples/s, peers online), timings are histograms (all-reduce seconds,
matchmaking seconds), which Prometheus can add up across peers. Collectors are
callbacks run at scrape time for figures that live elsewhere (a transport's
byte counters), returning :class:`Sample` lists (:func:`counter_sample`,
:func:`histogram_samples`). This module knows no layer: the collectors live
with what they read, :mod:`p2ptrain.app.collectors` (connections, DHT, NAT
traversal, a bootstrap peer's services) and
:func:`p2ptrain.train.round_stats.allreduce_collector` (averaging rounds).
The registry also carries the process metrics (CPU seconds, resident memory, open files) under
``p2ptrain_process_*``.

:class:`MetricsServer` serves ``GET /metrics`` with ``prometheus_client``'s
HTTP server; :class:`JsonLinesWriter` appends :meth:`Metrics.snapshot` lines
to a file. Both read the same registry, so they always agree. Every name
starts with ``p2ptrain_``; :data:`HELP` describes each family the package
records and :data:`RENAMED` lists the names earlier versions used
(``docs/observability.md`` shows both).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from p2ptrain.errors import ConfigError, ConnectError

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

__all__ = [
    "HELP",
    "PREFIX",
    "RENAMED",
    "TIMING_BUCKETS",
    "JsonLinesWriter",
    "Metrics",
    "MetricsServer",
    "Sample",
    "counter_sample",
    "histogram_samples",
]

logger = logging.getLogger(__name__)

# The text format would carry a "<name>_created" gauge beside every counter and
# histogram (its creation time): noise on every scrape, so it is left out
# (a process-wide setting of prometheus_client).
disable_created_metrics()  # type: ignore[no-untyped-call]

PREFIX = "p2ptrain_"
"""Every metric name starts with this."""
_NAME = re.compile(r"^p2ptrain_[a-zA-Z0-9_]*[a-zA-Z0-9]$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
TIMING_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
TIMING_BUCKETS += (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""Upper bounds (seconds) of the timing histograms' buckets; ``+Inf`` is added."""
SAMPLE_BUCKETS: tuple[float, ...] = tuple(float(2**k) for k in range(4, 17))
"""Upper bounds of the samples-per-step histogram's buckets (16 to 65,536)."""
_BUCKETS: dict[str, tuple[float, ...]] = {"p2ptrain_train_step_samples": SAMPLE_BUCKETS}

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
    # bootstrap_collector
    "p2ptrain_stun_answers_total": "STUN Binding requests this peer answered.",
    "p2ptrain_stun_ignored_total": "Datagrams to the STUN port that were not Binding requests.",
    "p2ptrain_relay_circuits_open": "Relayed connections open now.",
    "p2ptrain_relay_circuits_total": "Relayed connections admitted since the start.",
    "p2ptrain_relay_circuits_refused_total": "Relayed connections refused at the circuit limit.",
    "p2ptrain_relay_bytes_total": "Bytes forwarded for relayed connections.",
    # recorded by the trainer (p2ptrain.train.collaboration)
    "p2ptrain_train_samples_total": "Samples this peer computed.",
    "p2ptrain_train_samples_per_s": "This peer's recent samples per second.",
    "p2ptrain_train_rounds_total": "Steps averaged, in a group or locally, by outcome.",
    "p2ptrain_matchmaking_seconds": "Seconds from the start of matchmaking to a group plan.",
    "p2ptrain_allreduce_seconds": "Seconds of the trainer's all-reduce rounds (in a group).",
    "p2ptrain_train_wait_seconds": "Seconds blocked waiting for the swarm.",
    "p2ptrain_state_downloads_total": "States downloaded from other peers.",
    "p2ptrain_state_download_seconds": "Seconds state downloads took.",
    "p2ptrain_train_global_step": "This peer's global step.",
    "p2ptrain_swarm_global_step": "The swarm's global step as last read.",
    "p2ptrain_swarm_samples_per_s": "The swarm's samples per second as last read.",
    "p2ptrain_peers_online": "Peers of the run online as last read.",
    "p2ptrain_train_step_samples": "Samples the swarm averaged in each step this peer applied.",
    "p2ptrain_train_last_step_samples": "Samples of the latest step this peer applied.",
    "p2ptrain_train_target_batch_size": "The target batch size of the run.",
}
"""One line of help per metric family, shown as ``# HELP`` in the Prometheus text."""

RENAMED: dict[str, str] = {
    "train_samples_total": "p2ptrain_train_samples_total",
    "train_samples_per_s": "p2ptrain_train_samples_per_s",
    "train_rounds_total": "p2ptrain_train_rounds_total",
    "train_allreduce_bytes_sent_total": "p2ptrain_allreduce_bytes_sent_total",
    "train_allreduce_bytes_received_total": "p2ptrain_allreduce_bytes_received_total",
    "train_matchmaking_seconds": "p2ptrain_matchmaking_seconds",
    "train_allreduce_seconds": "p2ptrain_allreduce_seconds",
    "train_wait_seconds": "p2ptrain_train_wait_seconds",
    "train_state_downloads_total": "p2ptrain_state_downloads_total",
    "train_state_download_seconds": "p2ptrain_state_download_seconds",
    "train_global_step": "p2ptrain_train_global_step",
    "train_swarm_global_step": "p2ptrain_swarm_global_step",
    "train_swarm_samples_per_s": "p2ptrain_swarm_samples_per_s",
    "train_peers_online": "p2ptrain_peers_online",
}
"""Earlier name -> current name. The two ``train_allreduce_bytes_*`` counters
counted the same bytes as ``p2ptrain_allreduce_bytes_*`` and were merged into
them; the timings were quantile summaries and are histograms now."""


@dataclass(frozen=True)
class Sample:
    """One value of one metric, as collectors report it.

    ``kind`` is "counter" or "gauge"; a counter pair named ``X_count`` and
    ``X_sum`` is exposed as the summary ``X`` (count and sum, no quantiles),
    or, with cumulative ``X_bucket`` counters labelled ``le`` beside them (see
    :func:`histogram_samples`), as the histogram ``X``.
    """

    name: str
    value: float
    labels: Mapping[str, str] = field(default_factory=dict)
    kind: str = "gauge"


def _check_name(name: str) -> None:
    if not _NAME.match(name):
        raise ConfigError(
            f"bad metric name {name!r}: names start with {PREFIX!r} and use [a-zA-Z0-9_]"
        )


def _label_names(labels: Mapping[str, str] | None) -> tuple[str, ...]:
    names = tuple(sorted(labels or {}))
    for label in names:
        if not _LABEL.match(label) or label.startswith("__"):
            raise ConfigError(f"bad label name {label!r}")
    return names


_Family = Counter | Gauge | Histogram


class Metrics:
    """A registry of counters, gauges and timing histograms (``prometheus_client``).

    Args:
        process: Also export this process's CPU, memory and open files
            (``p2ptrain_process_*``; Linux, from ``/proc``).
    """

    def __init__(self, *, process: bool = True) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._families: dict[str, tuple[_Family, tuple[str, ...]]] = {}
        self._lock = threading.Lock()
        self._collectors: list[Callable[[], Iterable[Sample]]] = []
        self._help: dict[str, str] = dict(HELP)
        self.registry.register(_Bridge(self))
        if process:
            ProcessCollector(namespace="p2ptrain", registry=self.registry)

    def _family(self, kind: type[_Family], name: str, labels: Mapping[str, str] | None) -> Any:
        _check_name(name)
        names = _label_names(labels)
        with self._lock:
            known = self._families.get(name)
            if known is None:
                text = self._help.get(name, name)
                if kind is Histogram:
                    family: _Family = Histogram(
                        name,
                        text,
                        names,
                        registry=self.registry,
                        buckets=_BUCKETS.get(name, TIMING_BUCKETS),
                    )
                else:
                    family = kind(name, text, names, registry=self.registry)
                known = self._families[name] = (family, names)
        family, expected = known
        if not isinstance(family, kind):
            raise ConfigError(f"metric {name!r} is a {type(family).__name__.lower()}")
        if names != expected:
            raise ConfigError(f"metric {name!r} has labels {expected}, got {names}")
        return family.labels(**labels) if names and labels else family

    def inc(self, name: str, amount: float = 1.0, labels: Mapping[str, str] | None = None) -> None:
        """Add ``amount`` (>= 0) to a counter (its name ends in ``_total``)."""
        if not (amount >= 0 and math.isfinite(amount)):
            raise ConfigError("counters only go up, by finite amounts")
        if not name.endswith("_total"):
            raise ConfigError(f"counter names end in _total, got {name!r}")
        self._family(Counter, name, labels).inc(amount)

    def set(self, name: str, value: float, labels: Mapping[str, str] | None = None) -> None:
        """Set a gauge."""
        self._family(Gauge, name, labels).set(float(value))

    def observe(self, name: str, seconds: float, labels: Mapping[str, str] | None = None) -> None:
        """Record one value in the histogram ``name`` (a timing unless :data:`SAMPLE_BUCKETS`)."""
        self._family(Histogram, name, labels).observe(seconds)

    def add_collector(self, collector: Callable[[], Iterable[Sample]]) -> None:
        """Run ``collector`` at every scrape and snapshot and include its samples.

        Collectors reporting the same series (several peers sharing one
        registry) are merged: counters add up, gauges keep the last value.
        """
        self._collectors.append(collector)

    def describe(self, family: str, text: str) -> None:
        """Set the ``# HELP`` text of a family (before its first use; see :data:`HELP`)."""
        _check_name(family)
        self._help[family] = text

    def counter(self, name: str, labels: Mapping[str, str] | None = None) -> float:
        """The current value of a counter (0 if never incremented)."""
        value = self.registry.get_sample_value(name, dict(labels or {}))
        return 0.0 if value is None else value

    def samples(self) -> list[Sample]:
        """Every current value (collectors, histograms' buckets and process metrics included).

        Safe to call from another thread than the one recording.
        """
        out: list[Sample] = []
        for metric in self.registry.collect():
            for sample in metric.samples:
                if sample.name.endswith("_created"):
                    continue  # creation times of counters and histograms
                out.append(Sample(sample.name, sample.value, dict(sample.labels), metric.type))
        return out

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
        """The Prometheus text exposition format, as ``prometheus_client`` writes it."""
        return generate_latest(self.registry).decode()

    def _collected(self) -> Iterator[Metric]:
        """The collectors' samples as metric families (what :class:`_Bridge` exports)."""
        merged: dict[tuple[str, tuple[tuple[str, str], ...]], Sample] = {}
        for collector in list(self._collectors):
            for reported in collector():
                _check_name(reported.name)
                series = (reported.name, tuple(sorted(reported.labels.items())))
                prior = merged.get(series)
                if prior is not None and reported.kind == "counter":
                    total = prior.value + reported.value
                    reported = Sample(reported.name, total, reported.labels, "counter")  # noqa: PLW2901
                merged[series] = reported
        families: dict[str, list[Sample]] = {}
        for sample in merged.values():
            families.setdefault(sample.name, []).append(sample)
        histograms = {
            name[: -len("_bucket")]
            for name in families
            if name.endswith("_bucket")
            and {name[: -len("_bucket")] + "_count", name[: -len("_bucket")] + "_sum"}
            <= set(families)
        }
        for base in sorted(histograms):
            buckets, sums = families.pop(base + "_bucket"), families.pop(base + "_sum")
            families.pop(base + "_count")
            names = sorted(n for n in buckets[0].labels if n != "le")
            histogram = HistogramMetricFamily(base, self._help.get(base, base), labels=names)
            totals = {tuple(s.labels[n] for n in names): s.value for s in sums}
            by_labels: dict[tuple[str, ...], list[tuple[str, float]]] = {}
            for sample in buckets:
                key = tuple(sample.labels[n] for n in names)
                by_labels.setdefault(key, []).append((sample.labels["le"], sample.value))
            for key, points in sorted(by_labels.items()):
                points.sort(key=lambda point: float(point[0]))
                histogram.add_metric(list(key), points, sum_value=totals.get(key, 0.0))
            yield histogram
        summaries = {
            name[: -len("_count")]
            for name in families
            if name.endswith("_count") and name[: -len("_count")] + "_sum" in families
        }
        for base in sorted(summaries):
            counts, sums = families.pop(base + "_count"), families.pop(base + "_sum")
            names = sorted(counts[0].labels)
            summary = SummaryMetricFamily(base, self._help.get(base, base), labels=names)
            totals = {tuple(s.labels[n] for n in names): s.value for s in sums}
            for sample in counts:
                key = tuple(sample.labels[n] for n in names)
                count = int(sample.value)
                summary.add_metric(list(key), count_value=count, sum_value=totals.get(key, 0.0))
            yield summary
        for name, samples in sorted(families.items()):
            names = sorted(samples[0].labels)
            text = self._help.get(name, name)
            if samples[0].kind == "counter":
                family: Metric = CounterMetricFamily(name, text, labels=names)
            else:
                family = GaugeMetricFamily(name, text, labels=names)
            for sample in samples:
                family.add_metric([sample.labels[n] for n in names], sample.value)  # type: ignore[attr-defined]
            yield family


class _Bridge(Collector):
    """Exports a :class:`Metrics`' callback collectors through ``prometheus_client``."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        return list(self._metrics._collected())

    def describe(self) -> Iterable[Metric]:
        return []  # what the callbacks report is only known when they run


def _series(name: str, labels: Mapping[str, str]) -> str:
    if not labels:
        return name
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def counter_sample(name: str, value: float, labels: Mapping[str, str] | None = None) -> Sample:
    """A counter's value read at scrape time (for collectors)."""
    return Sample(name, value, labels or {}, "counter")


def histogram_samples(
    name: str,
    bounds: Iterable[float],
    counts: Iterable[int],
    total: float,
    labels: Mapping[str, str] | None = None,
) -> list[Sample]:
    """A histogram as collector samples: cumulative ``name_bucket{le}``, ``_count``, ``_sum``.

    Args:
        name: The family.
        bounds: The buckets' upper bounds, ascending (``+Inf`` is added).
        counts: Observations per bucket, not cumulative: one per bound, then
            one for those above the largest.
        total: The sum of the observations.
        labels: The series' other labels.
    """
    base = dict(labels or {})
    out: list[Sample] = []
    running = 0
    for bound, count in zip([*bounds, math.inf], counts, strict=True):
        running += count
        le = "+Inf" if math.isinf(bound) else repr(float(bound))  # as prometheus_client writes it
        out.append(counter_sample(f"{name}_bucket", running, {**base, "le": le}))
    out.append(counter_sample(f"{name}_count", running, base))
    out.append(counter_sample(f"{name}_sum", total, base))
    return out


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
    """Serves ``GET /metrics`` (Prometheus text) with ``prometheus_client``'s HTTP server.

    Args:
        metrics: The registry to serve.
        host: The interface to listen on: 127.0.0.1 by default (this machine
            only); ``0.0.0.0`` for a Prometheus server elsewhere.
        port: The port (0 picks one; read it back from :attr:`port`).
    """

    def __init__(self, metrics: Metrics, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.metrics = metrics
        self.host = host
        self.port = port
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    async def start(self) -> None:
        """Start serving in a thread of its own.

        Raises:
            ConnectError: The address cannot be bound.
        """
        try:
            self._server, self._thread = start_http_server(
                self.port, addr=self.host, registry=self.metrics.registry
            )
        except OSError as exc:
            raise ConnectError(
                f"cannot serve metrics on {self.host}:{self.port}: {exc.strerror or exc}"
            ) from exc
        self.port = int(self._server.server_address[1])

    async def aclose(self) -> None:
        """Stop serving."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            await asyncio.to_thread(server.shutdown)
            server.server_close()
        if thread is not None:
            await asyncio.to_thread(thread.join, 5)
