"""What an operator sees: metrics scraped over HTTP from a training peer and a
bootstrap peer, and ``p2ptrain status --json`` / ``--watch``, on real processes."""

from __future__ import annotations

import json
import re
import signal
import time
import urllib.request
from typing import Any

import pytest
from conftest import ChildLines, cli_process, join_address, run_cli, started_bootstrap

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def scrape(port: int) -> dict[str, float]:
    """GET /metrics, as Prometheus would: every sample line as ``name{labels}`` -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        match = _SAMPLE.match(line)
        assert match, line
        values[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return values


def _first(peer: ChildLines, deadline: float, kind: str, **wanted: int) -> dict[str, Any]:
    while True:
        event = json.loads(peer.next_line(deadline))
        if event["event"] == kind and all(event.get(k, 0) >= v for k, v in wanted.items()):
            return dict(event)


@pytest.mark.slow
def test_metrics_ports_of_a_trainer_and_a_bootstrap_and_status_json(
    procs: list[ChildLines],
) -> None:
    deadline = time.monotonic() + 90
    boot = cli_process("bootstrap", "--port", "0", "--metrics-port", "0")
    procs.append(boot)
    metrics_line = boot.next_line(deadline)
    boot_port = int(re.search(r":(\d+)/metrics", metrics_line).group(1))  # type: ignore[union-attr]
    address = join_address(boot, deadline)
    train = ("train", "--join", address, "--run-id", "ops", "--seconds", "60")
    sizes = ("--target-batch-size", "16", "--batch-size", "4", "--log-json", "-")
    peers = [cli_process(*train, *sizes, "--metrics-port", "0") for _ in range(2)]
    procs.extend(peers)
    starts = [_first(peer, deadline, "start") for peer in peers]
    for peer in peers:
        _first(peer, deadline, "progress", rounds=1, peers_online=2)

    trainer = scrape(starts[0]["metrics_port"])
    assert trainer["p2ptrain_process_resident_memory_bytes"] > 0
    assert trainer["p2ptrain_process_cpu_seconds_total"] > 0
    assert trainer["p2ptrain_process_open_fds"] > 0
    rounds = trainer["p2ptrain_allreduce_seconds_count"]
    assert rounds >= 1
    assert trainer['p2ptrain_allreduce_seconds_bucket{le="+Inf"}'] == rounds
    assert trainer["p2ptrain_allreduce_seconds_sum"] > 0
    assert trainer['p2ptrain_path_bytes_sent_total{path="tcp-direct"}'] > 0
    assert all(name.startswith("p2ptrain_") for name in trainer), sorted(trainer)

    bootstrap = scrape(boot_port)
    assert bootstrap["p2ptrain_process_resident_memory_bytes"] > 0
    assert bootstrap["p2ptrain_dht_peers_known"] >= 2
    assert sum(v for k, v in bootstrap.items() if "dht_requests_served_total" in k) > 0
    assert "p2ptrain_stun_answers_total" in bootstrap
    assert all(name.startswith("p2ptrain_") for name in bootstrap), sorted(bootstrap)

    status = run_cli("status", "--join", address, "--run-id", "ops", "--json")
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report["run_id"] == "ops" and report["peers_online"] == 2
    ids = {start["peer_id"] for start in starts}
    assert {row["peer_id"][:10] for row in report["peers"]} == ids
    assert all(row["global_step"] >= 1 for row in report["peers"])

    watch = run_cli(
        "status",
        "--join",
        address,
        "--run-id",
        "ops",
        "--watch",
        "--count",
        "2",
        "--interval",
        "0.5",
    )
    assert watch.returncode == 0, watch.stderr
    assert watch.stdout.count("peers online") == 2, watch.stdout  # two readings, not a tty


@pytest.mark.slow
def test_ctrl_c_ends_training_with_the_summary_and_exit_0(procs: list[ChildLines]) -> None:
    deadline = time.monotonic() + 90
    address = started_bootstrap(procs, deadline)
    peer = cli_process(
        "train", "--join", address, "--run-id", "int", "--seconds", "120", "--log-json", "-"
    )
    procs.append(peer)
    _first(peer, deadline, "progress", local_steps=1)
    peer.process.send_signal(signal.SIGINT)
    end = _first(peer, deadline, "end")
    assert end["seconds"] < 120 and end["local_steps"] >= 1
    assert peer.process.wait(30) == 0
    # the summary line, read from the exited child's stderr by ChildLines' thread
    until = time.monotonic() + 10
    while not any("trained" in line for line in peer.stderr) and time.monotonic() < until:
        time.sleep(0.05)  # the reader thread drains what the pipe still holds
    assert any("trained" in line for line in peer.stderr), list(peer.stderr)[-5:]
