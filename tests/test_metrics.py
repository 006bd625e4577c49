"""Metrics: values, JSON lines, and the Prometheus text served over real HTTP."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from p2ptrain.errors import ConfigError
from p2ptrain.metrics import JsonLinesWriter, Metrics, MetricsServer, Sample


def filled() -> Metrics:
    metrics = Metrics()
    metrics.inc("bytes_sent_total", 1000, {"path": "tcp-direct"})
    metrics.inc("bytes_sent_total", 24, {"path": "tcp-direct"})
    metrics.set("samples_per_second", 12.5)
    for seconds in (0.1, 0.2, 0.3, 0.4):
        metrics.observe("allreduce_seconds", seconds)
    metrics.add_collector(lambda: [Sample("peers_online", 3)])
    return metrics


def test_values_and_snapshot() -> None:
    metrics = filled()
    assert metrics.counter("bytes_sent_total", {"path": "tcp-direct"}) == 1024
    values = metrics.snapshot()["metrics"]
    assert values['bytes_sent_total{path="tcp-direct"}'] == 1024
    assert values["samples_per_second"] == 12.5
    assert values["allreduce_seconds_count"] == 4
    assert values["allreduce_seconds_sum"] == pytest.approx(1.0)
    assert values['allreduce_seconds{quantile="0.5"}'] == 0.3
    assert values["peers_online"] == 3


def test_bad_names_and_negative_counters() -> None:
    metrics = Metrics()
    with pytest.raises(ConfigError):
        metrics.inc("has space")
    with pytest.raises(ConfigError):
        metrics.inc("x", -1)


def test_prometheus_text_format() -> None:
    text = filled().prometheus_text()
    lines = text.splitlines()
    assert "# TYPE bytes_sent_total counter" in lines
    assert 'bytes_sent_total{path="tcp-direct"} 1024.0' in lines
    assert "# TYPE allreduce_seconds summary" in lines
    assert 'allreduce_seconds{quantile="0.99"} 0.4' in lines
    assert "allreduce_seconds_count 4.0" in lines
    # Every non-comment line is "series value".
    for line in lines:
        if not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            float(value)
            assert series


async def test_metrics_server_serves_over_http() -> None:
    server = MetricsServer(filled())
    await server.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        response = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        head, body = response.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 200 OK")
        assert b"samples_per_second 12.5" in body
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /other HTTP/1.1\r\n\r\n")
        assert (await asyncio.wait_for(reader.read(), 5)).startswith(b"HTTP/1.1 404")
        writer.close()
    finally:
        await server.aclose()


async def test_json_lines_writer(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    metrics = filled()
    writer = JsonLinesWriter(metrics, path, interval=3600)
    await writer.start()
    metrics.inc("rounds_total")
    await writer.aclose()  # writes a final line
    (line,) = path.read_text().splitlines()
    assert json.loads(line)["metrics"]["rounds_total"] == 1


async def test_node_collector_reports_bytes_per_path() -> None:
    from p2ptrain.metrics import node_collector
    from p2ptrain.node.node import Node
    from p2ptrain.rpc.handlers import CallContext, Message

    async def echo(ctx: CallContext, request: Message) -> Message:
        return Message(None, request.payload)

    async with Node() as server, Node() as client:
        server.handlers.add_unary("echo", echo)
        await client.call(server.address, "echo", None, b"x" * 100_000)
        metrics = Metrics()
        metrics.add_collector(node_collector(client))
        values = metrics.snapshot()["metrics"]
        assert values["p2ptrain_connections_open"] == 1
        assert values['p2ptrain_path_bytes_sent{path="tcp-direct"}'] > 100_000
        assert values['p2ptrain_path_bytes_received{path="tcp-direct"}'] > 100_000
