"""`p2ptrain demo`: a process-based swarm trains charlm, prints a summary, writes a PNG."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
from conftest import ChildLines, cli_process, run_cli

from p2ptrain.app.demo import (
    PeerRun,
    SwarmDemoConfig,
    SwarmDemoResult,
    format_summary,
    plot_loss,
)
from p2ptrain.errors import ConfigError, MissingDependencyError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_demo_with_three_peers_prints_a_summary_and_a_png(tmp_path: Path) -> None:
    png = tmp_path / "loss.png"
    result = run_cli(
        *("demo", "--peers", "3", "--seconds", "8", "--png", str(png)),
        *("--log-dir", str(tmp_path / "logs")),
        timeout=150,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "peer-2 (late)" in out and "global step" in out and "samples/s" in out
    assert "loss:" in out and "demo OK" in out
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert len(list((tmp_path / "logs").glob("peer-*.jsonl"))) == 3


def test_config_is_validated() -> None:
    with pytest.raises(ConfigError):
        SwarmDemoConfig(peers=1)
    with pytest.raises(ConfigError):
        SwarmDemoConfig(seconds=0.5)
    assert SwarmDemoConfig(peers=4, batch_size=16).target == 256


def test_summary_of_a_failed_run_says_so() -> None:
    run = PeerRun(name="peer-0", upload_mbit=10, download_mbit=20, late=False, returncode=1)
    run.stderr = ["p2ptrain train: error: boom"]
    result = SwarmDemoResult(runs=(run,), png=None, wall_s=1.0)
    text = format_summary(result, SwarmDemoConfig(peers=2))
    assert not result.ok and "demo FAILED" in text and "boom" in text


def test_without_matplotlib_the_demo_skips_its_plot_and_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = PeerRun(name="peer-0", upload_mbit=10, download_mbit=20, late=False, returncode=0)
    run.events.append({"event": "progress", "t": 1.0, "loss": 4.2})
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(MissingDependencyError, match=r"p2ptrain\[plot\]"):
        plot_loss([run], tmp_path / "loss.png")
    assert not (tmp_path / "loss.png").exists()
    result = SwarmDemoResult(runs=(run,), png=None, wall_s=1.0, png_note="skipped: no plot")
    assert "loss plot: skipped: no plot" in format_summary(result, SwarmDemoConfig(peers=2))


def test_a_peer_that_fails_before_training_shows_its_own_error_line() -> None:
    from p2ptrain.app.demo import _wait_for_start
    from p2ptrain.app.processes import ChildProcess

    runs = [PeerRun(name=f"peer-{i}", upload_mbit=1, download_mbit=1, late=False) for i in (0, 1)]
    code = "import sys; print('p2ptrain train: error: port {} in use', file=sys.stderr); exit(2)"
    processes = [
        ChildProcess([sys.executable, "-c", code.replace("{}", str(i))], run, 0.0)
        for i, run in enumerate(runs)
    ]
    with pytest.raises(ConfigError) as failure:
        _wait_for_start(processes, timeout=60)
    message = str(failure.value)
    assert "they exited" in message, message
    assert "peer-0: p2ptrain train: error: port 0 in use" in message, message
    assert "peer-1: p2ptrain train: error: port 1 in use" in message, message


def test_shaped_config_is_validated_and_the_summary_shows_configured_next_to_measured() -> None:
    with pytest.raises(ConfigError):
        SwarmDemoConfig(delay_ms=-1)
    with pytest.raises(ConfigError):
        SwarmDemoConfig(shaped=1)  # type: ignore[arg-type]
    run = PeerRun(name="peer-0", upload_mbit=50, download_mbit=200, late=False, returncode=0)
    run.events.append(
        {
            "event": "end",
            "global_step": 3,
            "samples_per_s": 10.0,
            "announced_upload_mbit": 44.2,
            "announced_download_mbit": 108.0,
        }
    )
    result = SwarmDemoResult(runs=(run,), png=None, wall_s=1.0)
    text = format_summary(result, SwarmDemoConfig(peers=2, shaped=True))
    assert "configured up/down Mbit/s" in text and "measured (announced last)" in text
    assert "50/200" in text and "44/108" in text


def test_the_shaped_demo_needs_root_and_says_so_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from p2ptrain.app import cli

    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # not root, whoever runs the tests
    assert cli.main(["demo", "--shaped"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "p2ptrain demo --shaped needs root (network namespaces and tc)"
    ]


def _read_until(child: ChildLines, marker: str, deadline: float) -> list[str]:
    lines = [child.next_line(deadline)]
    while marker not in lines[-1]:
        lines.append(child.next_line(deadline))
    return lines


def test_ctrl_c_once_training_began_stops_the_peers_and_prints_the_summary(
    tmp_path: Path,
) -> None:
    png = tmp_path / "loss.png"
    demo = cli_process("demo", "--peers", "2", "--seconds", "120", "--png", str(png))
    try:
        deadline = time.monotonic() + 120
        _read_until(demo, "training began", deadline)
        demo.process.send_signal(signal.SIGINT)
        out = "".join(_read_until(demo, "demo stopped early", deadline))
        assert demo.process.wait(60) == 0, "".join(demo.stderr)
    finally:
        demo.stop()
    assert "peer-0" in out and "global step" in out and "loss plot:" in out, out
    # the PNG is written when a loss was logged before the stop, and then the summary names it
    assert (f"loss plot: {png}" in out) == (png.is_file() and png.read_bytes()[:8] == PNG_MAGIC)
    assert "peer-1 (late)" in out and "not started" in out, out
    assert "wall" in out and float(out.split("wall ")[1].split(" s")[0]) < 120, out


def _alive_with(text: str) -> list[int]:
    """Processes (not zombies) whose command line contains ``text``."""
    alive = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue  # it exited meanwhile
        if text in cmdline and state != "Z":
            alive.append(int(proc.name))
    return alive


def test_ctrl_c_before_training_began_exits_130_and_leaves_no_process() -> None:
    demo = cli_process("demo", "--peers", "2", "--seconds", "60")
    try:
        join = _read_until(demo, "bootstrap peer", time.monotonic() + 60)[-1].split()[-1]
        # the peers are started right after this line: Ctrl-C lands while they start
        _read_until(demo, "starting 1 peers now", time.monotonic() + 60)
        demo.process.send_signal(signal.SIGINT)
        assert demo.process.wait(60) == 130, "".join(demo.stderr)
    finally:
        demo.stop()
    assert _alive_with(join) == []  # every peer got the bootstrap's address on its command line
