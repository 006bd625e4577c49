"""Metrics: values, JSON lines, and the Prometheus text served over real HTTP."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import io
import json
import logging
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from p2ptrain.allreduce.group import GroupMember, GroupPlan
from p2ptrain.allreduce.report import AllReduceReport, ShardReport
from p2ptrain.app.cli import _ConsoleHandler
from p2ptrain.app.collectors import dht_collector, node_collector
from p2ptrain.dht import DHT, DHTNodeConfig
from p2ptrain.errors import ConfigError, ConnectError, LookupFailedError
from p2ptrain.lab.echo import echo
from p2ptrain.metrics import (
    HELP,
    RENAMED,
    JsonLinesWriter,
    Metrics,
    MetricsServer,
    Sample,
)
from p2ptrain.node.address import PeerAddress
from p2ptrain.secure.identity import Identity
from p2ptrain.train.averaging import RoundOutcome, _log_round
from p2ptrain.train.config import TrainerConfig
from p2ptrain.train.optimizer import CollaborativeOptimizer
from p2ptrain.train.round_stats import RoundStats, allreduce_collector


def filled() -> Metrics:
    metrics = Metrics()
    metrics.inc("p2ptrain_bytes_sent_total", 1000, {"path": "tcp-direct"})
    metrics.inc("p2ptrain_bytes_sent_total", 24, {"path": "tcp-direct"})
    metrics.set("p2ptrain_samples_per_second", 12.5)
    for seconds in (0.1, 0.2, 0.3, 4.0):
        metrics.observe("p2ptrain_test_seconds", seconds)
    metrics.add_collector(lambda: [Sample("p2ptrain_peers_online", 3)])
    return metrics


def test_values_and_snapshot() -> None:
    metrics = filled()
    assert metrics.counter("p2ptrain_bytes_sent_total", {"path": "tcp-direct"}) == 1024
    values = metrics.snapshot()["metrics"]
    assert values['p2ptrain_bytes_sent_total{path="tcp-direct"}'] == 1024
    assert values["p2ptrain_samples_per_second"] == 12.5
    assert values["p2ptrain_test_seconds_count"] == 4
    assert values["p2ptrain_test_seconds_sum"] == pytest.approx(4.6)
    assert values['p2ptrain_test_seconds_bucket{le="0.25"}'] == 2
    assert values['p2ptrain_test_seconds_bucket{le="5.0"}'] == 4
    assert values['p2ptrain_test_seconds_bucket{le="+Inf"}'] == 4
    assert values["p2ptrain_peers_online"] == 3
    assert values["p2ptrain_process_resident_memory_bytes"] > 0  # process metrics
    assert not any(name.endswith("_created") for name in values)


def test_names_need_the_prefix_and_counters_only_go_up() -> None:
    metrics = Metrics()
    for bad in ("has space_total", "train_samples_total", "p2ptrain_x-y_total"):
        with pytest.raises(ConfigError, match="bad metric name"):
            metrics.inc(bad)
    with pytest.raises(ConfigError):
        metrics.inc("p2ptrain_x_total", -1)
    with pytest.raises(ConfigError, match="_total"):
        metrics.inc("p2ptrain_x")
    metrics.inc("p2ptrain_x_total", labels={"a": "1"})
    with pytest.raises(ConfigError, match="labels"):
        metrics.inc("p2ptrain_x_total", labels={"b": "1"})
    with pytest.raises(ConfigError, match="counter"):
        metrics.set("p2ptrain_x_total", 1)
    metrics.add_collector(lambda: [Sample("unprefixed", 1)])
    with pytest.raises(ConfigError, match="bad metric name"):
        metrics.prometheus_text()


def test_prometheus_text_format() -> None:
    text = filled().prometheus_text()
    lines = text.splitlines()
    assert "# TYPE p2ptrain_bytes_sent_total counter" in lines
    assert 'p2ptrain_bytes_sent_total{path="tcp-direct"} 1024.0' in lines
    assert "# TYPE p2ptrain_test_seconds histogram" in lines
    assert 'p2ptrain_test_seconds_bucket{le="0.5"} 3.0' in lines
    assert "p2ptrain_test_seconds_count 4.0" in lines
    series = parse_prometheus(text)
    assert all(name.startswith("p2ptrain_") for name, _ in series)


async def test_metrics_server_serves_over_http() -> None:
    server = MetricsServer(filled())
    await server.start()
    try:
        body = await asyncio.to_thread(_get, f"http://127.0.0.1:{server.port}/metrics")
        assert "p2ptrain_samples_per_second 12.5" in body
        assert "p2ptrain_process_cpu_seconds_total" in body
        parse_prometheus(body)
    finally:
        await server.aclose()
    with pytest.raises(OSError):
        await asyncio.to_thread(_get, f"http://127.0.0.1:{server.port}/metrics")


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        return str(response.read().decode())


async def test_a_metrics_port_in_use_is_a_clear_error() -> None:
    first = MetricsServer(Metrics())
    await first.start()
    try:
        with pytest.raises(ConnectError, match="cannot serve metrics"):
            await MetricsServer(Metrics(), port=first.port).start()
    finally:
        await first.aclose()


async def test_json_lines_writer(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    metrics = filled()
    writer = JsonLinesWriter(metrics, path, interval=3600)
    await writer.start()
    metrics.inc("p2ptrain_rounds_total")
    await writer.aclose()  # writes a final line
    (line,) = path.read_text().splitlines()
    values = json.loads(line)["metrics"]
    assert values["p2ptrain_rounds_total"] == 1
    assert values["p2ptrain_test_seconds_count"] == 4  # the same registry as the scrape


async def test_node_collector_reports_bytes_per_path() -> None:
    from p2ptrain.node.node import Node

    async with Node() as server, Node() as client:
        server.handlers.add_unary("echo", echo)
        await client.call(server.address, "echo", None, b"x" * 100_000)
        metrics = Metrics()
        metrics.add_collector(node_collector(client))
        values = metrics.snapshot()["metrics"]
        assert values["p2ptrain_connections_open"] == 1
        assert values['p2ptrain_path_bytes_sent_total{path="tcp-direct"}'] > 100_000
        assert values['p2ptrain_path_bytes_received_total{path="tcp-direct"}'] > 100_000
        sent = values['p2ptrain_path_bytes_sent_total{path="tcp-direct"}']
        conn = client.connection_to(server.peer_id)
        assert conn is not None
        await conn.aclose()
        after = metrics.snapshot()["metrics"]  # a counter: the closed connection still counts
        assert after["p2ptrain_connections_open"] == 0
        assert after['p2ptrain_path_bytes_sent_total{path="tcp-direct"}'] >= sent


# -- the Prometheus text, parsed strictly --------------------------------------------------

_SERIES = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"')
_KINDS = {"counter", "gauge", "summary", "histogram", "untyped"}
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _labels(text: str) -> tuple[tuple[str, str], ...]:
    pairs: list[tuple[str, str]] = []
    position = 0
    while position < len(text):
        match = _PAIR.match(text, position)
        assert match, f"bad label set {text!r} at {position}"
        value = re.sub(r"\\[\\\"n]", lambda m: _UNESCAPE[m.group(0)], match.group(2))
        pairs.append((match.group(1), value))
        position = match.end()
        if position < len(text):
            assert text[position] == ",", text
            position += 1
    names = [name for name, _ in pairs]
    assert len(names) == len(set(names)), f"duplicate label in {text!r}"
    return tuple(sorted(pairs))


def parse_prometheus(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every series of a text exposition, checking the format as Prometheus reads it.

    HELP and TYPE come at most once per family and before its samples, a
    family's samples are contiguous, sample names belong to their family,
    label sets parse with only the three escapes, values are numbers and no
    series repeats.
    """
    assert text.endswith("\n")
    series: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    kinds: dict[str, str] = {}
    helped: set[str] = set()
    sampled: set[str] = set()
    closed: set[str] = set()
    current: str | None = None
    for line in text.splitlines():
        if line.startswith(("# HELP ", "# TYPE ")):
            _, keyword, family, rest = line.split(" ", 3)
            if family != current:
                assert family not in closed, f"family {family} is split: {line!r}"
                if current is not None:
                    closed.add(current)
                current = family
            assert family not in sampled, f"{keyword} after the samples: {line!r}"
            if keyword == "HELP":
                assert family not in helped and family not in kinds, line
                helped.add(family)
            else:
                assert family not in kinds and rest in _KINDS, line
                kinds[family] = rest
            continue
        assert line and not line.startswith("#"), f"stray line {line!r}"
        match = _SERIES.match(line)
        assert match, f"bad sample line {line!r}"
        name, labels, value = match.group(1), match.group(2) or "", match.group(3)
        assert current is not None, line
        kind = kinds.get(current)
        family = current.removesuffix("_total") if kind == "counter" else current
        suffixes = {
            "summary": ("", "_count", "_sum", "_created"),
            "histogram": ("_bucket", "_count", "_sum", "_created"),
            "counter": ("_total", "_created"),
        }.get(kind or "", ("",))
        assert any(name == family + s for s in suffixes), f"{name} outside family {current}"
        sampled.add(current)
        key = (name, _labels(labels))
        assert key not in series, f"repeated series {line!r}"
        series[key] = float(value)
    return series


def test_prometheus_text_parses_with_help_and_escaped_labels() -> None:
    metrics = filled()
    tricky = 'a "quoted" \\ back\nslash'
    metrics.inc("p2ptrain_dht_requests_total", 2, {"method": tricky})
    metrics.describe("p2ptrain_described_total", 'bytes, with a \\ and a\nnewline "as is"')
    metrics.inc("p2ptrain_described_total")
    text = metrics.prometheus_text()
    series = parse_prometheus(text)
    assert series[("p2ptrain_dht_requests_total", (("method", tricky),))] == 2
    assert series[("p2ptrain_test_seconds_bucket", (("le", "0.25"),))] == 2
    assert "# HELP p2ptrain_dht_requests_total DHT requests sent, by method." in text
    assert '# HELP p2ptrain_described_total bytes, with a \\\\ and a\\nnewline "as is"' in text
    with pytest.raises(ConfigError):
        metrics.inc("p2ptrain_x_total", labels={"bad-label": "v"})


def test_collected_histograms_are_cumulative_and_shared_ones_add_up() -> None:
    from p2ptrain.metrics import histogram_samples

    metrics = Metrics(process=False)
    for _ in range(2):  # two peers sharing one registry
        metrics.add_collector(
            lambda: histogram_samples("p2ptrain_h_seconds", (0.1, 1.0), [2, 0, 1], 5.3, {"m": "x"})
        )
    text = metrics.prometheus_text()
    assert "# TYPE p2ptrain_h_seconds histogram" in text
    series = parse_prometheus(text)
    assert series[("p2ptrain_h_seconds_bucket", (("le", "0.1"), ("m", "x")))] == 4
    assert series[("p2ptrain_h_seconds_bucket", (("le", "1.0"), ("m", "x")))] == 4
    assert series[("p2ptrain_h_seconds_bucket", (("le", "+Inf"), ("m", "x")))] == 6
    assert series[("p2ptrain_h_seconds_count", (("m", "x"),))] == 6
    assert series[("p2ptrain_h_seconds_sum", (("m", "x"),))] == pytest.approx(10.6)


def test_shared_collectors_add_up_and_count_sum_pairs_are_summaries() -> None:
    metrics = Metrics(process=False)
    for _ in range(2):  # two peers sharing one registry
        metrics.add_collector(
            lambda: [
                Sample("p2ptrain_c_total", 3, {"k": "v"}, "counter"),
                Sample("p2ptrain_g", 5),
                Sample("p2ptrain_t_seconds_count", 2, {}, "counter"),
                Sample("p2ptrain_t_seconds_sum", 0.5, {}, "counter"),
            ]
        )
    text = metrics.prometheus_text()
    series = parse_prometheus(text)
    assert series[("p2ptrain_c_total", (("k", "v"),))] == 6
    assert series[("p2ptrain_g", ())] == 5
    assert series[("p2ptrain_t_seconds_count", ())] == 4
    assert series[("p2ptrain_t_seconds_sum", ())] == 1.0
    assert "# TYPE p2ptrain_t_seconds summary" in text
    assert "process" not in text


def test_observability_doc_lists_every_metric_and_rename() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "observability.md").read_text()
    missing = [name for name in HELP if f"`{name}" not in doc]
    assert not missing, missing
    renames = [f"`{old}` | `{new}`" for old, new in RENAMED.items()]
    assert all(rename in doc for rename in renames), [r for r in renames if r not in doc]
    assert all(name.startswith("p2ptrain_") for name in [*HELP, *RENAMED.values()])


# -- round figures, without a network ---------------------------------------------------------


def _outcome(*, failed: dict[int, str], excluded: dict[int, str]) -> RoundOutcome:
    members = tuple(Identity.generate().peer_id for _ in range(3))
    shard = ShardReport(0, 0, 4, ((0, 1),), excluded, None)
    report = AllReduceReport(
        round_id=b"r",
        members=members,
        index=0,
        weight=1.0,
        shards=(shard,),
        failed=failed,
        bytes_sent=100,
        bytes_received=80,
        reduce_scatter_s=0.1,
        all_gather_s=0.1,
        total_s=0.5,
        send_s=0.1,
        receive_s=0.1,
        predicted_s=0.25,
    )
    return RoundOutcome(7, 3, 1.0, None, True, 0.1, 0.5, 100, 80, report)


def test_round_stats_count_rounds_failures_and_dropped_peers() -> None:
    stats = RoundStats()
    outcome = _outcome(failed={2: "connection lost"}, excluded={1: "too late", 2: "gone"})
    assert outcome.dropped == {2: "connection lost", 1: "left out of member 0's shard: too late"}
    stats.record(outcome)
    stats.record(RoundOutcome(8, 1, 1.0, "alone", False, 0.0, 0.0))
    stats.record(RoundOutcome(9, 1, 1.0, "matchmaking: no group", False, 1.0, 0.0))
    stats.record(RoundOutcome(9, 3, 1.0, "allreduce: peer dropped", False, 1.0, 0.2))
    metrics = Metrics()
    metrics.add_collector(allreduce_collector(stats))
    values = metrics.snapshot()["metrics"]
    assert values['p2ptrain_allreduce_rounds_total{result="complete"}'] == 1
    assert values["p2ptrain_allreduce_predicted_seconds_sum"] == 0.25
    assert values["p2ptrain_allreduce_last_group_size"] == 3
    assert values["p2ptrain_allreduce_peers_dropped_total"] == 2
    assert values['p2ptrain_allreduce_failures_total{stage="matchmaking"}'] == 1
    assert values['p2ptrain_allreduce_failures_total{stage="allreduce"}'] == 1
    parse_prometheus(metrics.prometheus_text())


def test_console_log_lines_clear_the_progress_line_on_a_terminal() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    stream.write("\r[  1.0s] progress")
    handler = _ConsoleHandler(stream)
    handler.emit(logging.makeLogRecord({"msg": "global step advanced to 3"}))
    assert stream.getvalue() == "\r[  1.0s] progress\r\x1b[Kglobal step advanced to 3\n"


# -- a real swarm on loopback -----------------------------------------------------------------


async def test_dht_requests_to_a_dead_peer_count_as_failures() -> None:
    config = DHTNodeConfig(request_timeout=1.0, ping_timeout=1.0)
    first = DHT(config=config)
    await first.start()
    second = DHT(config=dataclasses.replace(config, initial_peers=(str(first.address),)))
    try:
        await second.start()
        metrics = Metrics()
        metrics.add_collector(dht_collector(second.dht_node))
        answered = metrics.snapshot()["metrics"]
        assert answered['p2ptrain_dht_requests_total{method="dht.ping"}'] >= 1
        pings = answered['p2ptrain_dht_response_seconds_count{method="dht.ping"}']
        assert pings >= 1
        assert (
            answered['p2ptrain_dht_response_seconds_bucket{le="+Inf",method="dht.ping"}'] == pings
        )
        assert "# TYPE p2ptrain_dht_response_seconds histogram" in metrics.prometheus_text()
        assert answered["p2ptrain_dht_peers_known"] == 1
        assert first.dht_node.stats.served.get("dht.ping", 0) >= 1
        await first.aclose()
        with pytest.raises(LookupFailedError):
            await second.dht_node.find_nodes(12345)
        failures = {
            k: v
            for k, v in metrics.snapshot()["metrics"].items()
            if k.startswith('p2ptrain_dht_request_failures_total{method="dht.find"')
        }
        assert sum(failures.values()) >= 1, failures
        assert all('reason="unreachable"' in k or 'reason="timeout"' in k for k in failures)
    finally:
        await second.aclose()
        await first.aclose()


@dataclasses.dataclass
class RealRun:
    metrics: list[Metrics]
    records: list[logging.LogRecord]
    peer_ids: list[str]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def real_run() -> Iterator[RealRun]:
    """Three trainers on loopback, two global steps, each peer with its own registry."""
    from train_worker import FAST_PROGRESS, make_model
    from training_peers import BATCH, in_threads, make_inner, start_peers, train_steps

    package = logging.getLogger("p2ptrain")
    handler, level = _Records(), package.level
    package.addHandler(handler)
    package.setLevel(logging.DEBUG)
    peers = start_peers(3)
    try:
        registries = [Metrics() for _ in peers]
        for peer, metrics in zip(peers, registries, strict=True):
            metrics.add_collector(node_collector(peer.node))
            metrics.add_collector(dht_collector(peer.dht.dht_node))
        config = TrainerConfig(
            run_id="observed",
            target_batch_size=len(peers) * BATCH,
            max_local_samples_per_step=BATCH,
            progress=FAST_PROGRESS,
        )
        models = [make_model(0) for _ in peers]
        opts = [
            CollaborativeOptimizer(make_inner(model), peer=peer, config=config, metrics=metrics)
            for model, peer, metrics in zip(models, peers, registries, strict=True)
        ]
        for opt in opts:
            opt.start()
        try:
            jobs = [
                functools.partial(train_steps, opts[i], models[i], i, len(peers), 2)
                for i in range(len(peers))
            ]
            assert in_threads(jobs) == [2, 2, 2]
        finally:
            for opt in opts:
                opt.close()
        yield RealRun(registries, handler.records, [p.peer_id.short for p in peers])
    finally:
        for peer in peers:
            peer.close()
        package.removeHandler(handler)
        package.setLevel(level)


def test_a_real_run_fills_the_metrics(real_run: RealRun) -> None:
    for metrics in real_run.metrics:
        values = metrics.snapshot()["metrics"]
        assert values['p2ptrain_dht_requests_total{method="dht.find"}'] > 0
        assert values['p2ptrain_dht_response_seconds_sum{method="dht.find"}'] > 0
        assert values['p2ptrain_allreduce_rounds_total{result="complete"}'] == 2
        assert values["p2ptrain_allreduce_seconds_count"] == 2  # a histogram
        assert values['p2ptrain_allreduce_seconds_bucket{le="+Inf"}'] == 2
        assert values["p2ptrain_allreduce_seconds_sum"] > 0
        assert values["p2ptrain_allreduce_predicted_seconds_count"] == 2
        assert values["p2ptrain_allreduce_last_predicted_seconds"] > 0
        assert values["p2ptrain_allreduce_last_seconds"] > 0
        assert values["p2ptrain_allreduce_last_group_size"] == 3
        assert values["p2ptrain_allreduce_bytes_sent_total"] > 0
        assert values["p2ptrain_train_global_step"] == 2
        assert values["p2ptrain_train_samples_per_s"] > 0
        assert values['p2ptrain_path_bytes_sent_total{path="tcp-direct"}'] > 0
        text = metrics.prometheus_text()
        series = parse_prometheus(text)
        assert series[("p2ptrain_allreduce_seconds_count", ())] == 2
        families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
        ours = {f for f in families if not f.startswith("p2ptrain_process_")}
        assert ours <= set(HELP), ours - set(HELP)
        assert all(family.startswith("p2ptrain_") for family in families), families
        json.dumps(metrics.snapshot(), allow_nan=False)  # strict JSON


def test_a_real_run_logs_its_notable_events(real_run: RealRun) -> None:
    infos = [r.getMessage() for r in real_run.records if r.levelno == logging.INFO]
    assert sum("joined the swarm at" in m and "peers known" in m for m in infos) == 2
    # Each peer says which group it found once; the same group again is DEBUG.
    groups = [m for m in infos if m.startswith("found a group of 3 for observed/step-0: ")]
    assert len(groups) == 3 and all(pid in groups[0] for pid in real_run.peer_ids), groups
    assert not any(m.startswith("found a group of 3 for observed/step-1") for m in infos)
    assert sum(m.startswith("training run 'observed' at global step 0: ") for m in infos) == 3
    # A complete round is routine: DEBUG, not one INFO line per step.
    debugs = [r.getMessage() for r in real_run.records if r.levelno == logging.DEBUG]
    averaged = [m for m in debugs if re.match(r"step \d: averaged in a group of 3 in ", m)]
    assert len(averaged) == 3 * 2, averaged
    assert all(re.search(r"\(predicted \d[\d.e-]* s\); sent \d", m) for m in averaged)
    assert not any("averaged in a group" in m for m in infos)
    assert not any(m.startswith("global step advanced") for m in infos)  # one line per step
    assert not any("dht.find" in m or "dht.ping" in m for m in infos)  # per-RPC stays DEBUG


LOOPBACK = PeerAddress.parse("127.0.0.1:1")


def test_an_averaged_round_names_its_dropped_peers(caplog: pytest.LogCaptureFixture) -> None:
    outcome = _outcome(failed={2: "connection lost"}, excluded={})
    assert outcome.report is not None
    plan = GroupPlan(
        round_id=b"r",
        members=tuple(GroupMember(m, LOOPBACK) for m in outcome.report.members),
        boundaries=(0, 4, 4, 4),
    )
    with caplog.at_level(logging.DEBUG, logger="p2ptrain"):
        _log_round(outcome, plan)
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0].startswith("step 7: averaged in a group of 3 in 0.5 s (predicted 0.25 s)")
    assert messages[1] == f"step 7: peer {outcome.report.members[2].short} dropped: connection lost"


def test_nat_traversal_seconds_is_a_histogram_of_the_traversals_that_connected() -> None:
    from types import SimpleNamespace

    from p2ptrain.app.collectors import nat_collector
    from p2ptrain.nat.paths import Traversal
    from p2ptrain.nat.stats import TRAVERSAL_BUCKETS, TraversalStats

    stats = TraversalStats()
    for path, attempt, seconds in (
        ("tcp-direct", "tcp-direct", 0.003),
        ("tcp-holepunch", "tcp-holepunch", 0.4),
        ("relay", "relay", 75.0),  # above the largest bound
        ("tcp-direct", "pooled", 0.0),  # a pooled connection is no traversal
    ):
        connection: Any = SimpleNamespace(path=path)
        stats.record(Traversal(connection, attempt, {}, seconds))
    service: Any = SimpleNamespace(stats=stats, refused=0)
    metrics = Metrics(process=False)
    metrics.add_collector(nat_collector(service))
    text = metrics.prometheus_text()
    assert "# TYPE p2ptrain_nat_traversal_seconds histogram" in text, text
    series = parse_prometheus(text)

    def bucket(le: str) -> float:
        return series[("p2ptrain_nat_traversal_seconds_bucket", (("le", le),))]

    assert TRAVERSAL_BUCKETS[0] == 0.005 and bucket("0.005") == 1
    assert bucket("0.25") == 1 and bucket("0.5") == 2 and bucket("60.0") == 2
    assert bucket("+Inf") == series[("p2ptrain_nat_traversal_seconds_count", ())] == 3
    assert series[("p2ptrain_nat_traversal_seconds_sum", ())] == pytest.approx(75.403)
    doc = (Path(__file__).parents[2] / "docs" / "observability.md").read_text()
    assert "| `p2ptrain_nat_traversal_seconds` | histogram |" in doc
