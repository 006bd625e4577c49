"""The local-swarm demo: real peer processes train the charlm example together.

:func:`run_swarm_demo` starts ``p2ptrain bootstrap`` and then ``peers``
processes of ``p2ptrain train`` on loopback, each announcing a different
upload and download rate so that the load balancer sees unequal peers. The
last peer joins late, a third into the run, and downloads the swarm's state.
Every peer writes JSON event lines on its stdout; the demo collects them and
at the end prints a summary (who joined when, global steps, samples/s, loss)
and writes a PNG of each peer's loss against time.

With ``shaped=True`` (root; ``p2ptrain demo --shaped``) the rates are real:
the bootstrap peer and every training peer run in their own network
namespace of a :class:`~p2ptrain.lab.starlab.StarLab`, with tc-tbf links
at those rates and ``delay_ms`` of delay on each host's sends, and no peer is
told a rate: the load balancer gets only what the peers measure (probe and
rounds). The summary then shows each peer's configured rate next to the
rate it announced last.

The peers run in their own process groups, so that Ctrl-C in a terminal
reaches only the demo: ``p2ptrain demo`` turns it (and SIGTERM) into
``stop``, and the demo ends its peers with SIGTERM (each writes its summary)
and prints its own.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from p2ptrain.app.processes import ChildProcess, check_stop, cli_argv
from p2ptrain.app.report import losses_of, plot_series, text_table
from p2ptrain.errors import ConfigError, MissingDependencyError

if TYPE_CHECKING:
    from p2ptrain.lab.starlab import StarLab

__all__ = [
    "PeerRun",
    "SwarmDemoConfig",
    "SwarmDemoResult",
    "format_summary",
    "plot_loss",
    "run_swarm_demo",
]

# (upload, download) Mbit/s announced by peer i (cycled): fast fibre to a slow DSL line.
BANDWIDTHS: tuple[tuple[float, float], ...] = (
    (200.0, 500.0),
    (50.0, 200.0),
    (20.0, 100.0),
    (5.0, 25.0),
)
_STARTUP_TIMEOUT = 120.0


@dataclass(frozen=True)
class SwarmDemoConfig:
    """The demo swarm.

    Attributes:
        peers: Training peers (at least 2); the last one joins late.
        seconds: Seconds the peers that start first train; the late peer
            stops at the same time.
        late_fraction: When the late peer starts, as a fraction of ``seconds``.
        batch_size: Local batch of every peer.
        target_batch_size: Samples per swarm step; ``None``: 4 local batches
            per peer.
        run_id: The run's name.
        png: Where to write the loss plot.
        log_dir: A directory to keep every peer's JSON lines in, or ``None``.
        bandwidths: (upload, download) Mbit/s per peer, cycled.
        shaped: Shape real links at those rates in network namespaces (root)
            and let the peers measure them, instead of announcing them.
        delay_ms: With ``shaped``: delay of each host's sends (a round trip
            between two peers is twice this).
    """

    peers: int = 4
    seconds: float = 90.0
    late_fraction: float = 1 / 3
    batch_size: int = 16
    target_batch_size: int | None = None
    run_id: str = "charlm-demo"
    png: str = "p2ptrain-demo-loss.png"
    log_dir: str | None = None
    bandwidths: tuple[tuple[float, float], ...] = field(default=BANDWIDTHS)
    shaped: bool = False
    delay_ms: float = 20.0

    def __post_init__(self) -> None:
        if not isinstance(self.shaped, bool):
            raise ConfigError("SwarmDemoConfig.shaped must be a bool")
        if not (isinstance(self.delay_ms, int | float) and 0 <= self.delay_ms <= 500):
            raise ConfigError("SwarmDemoConfig.delay_ms must be in [0, 500]")
        if isinstance(self.peers, bool) or not isinstance(self.peers, int) or self.peers < 2:
            raise ConfigError(f"the demo needs at least 2 peers, got {self.peers!r}")
        if self.peers > 32:
            raise ConfigError("the demo runs at most 32 peers on one machine")
        if not (isinstance(self.seconds, int | float) and math.isfinite(self.seconds)):
            raise ConfigError("SwarmDemoConfig.seconds must be a number")
        if self.seconds < 3:
            raise ConfigError(f"the demo needs at least 3 seconds, got {self.seconds!r}")
        if not 0 <= self.late_fraction < 1:
            raise ConfigError("SwarmDemoConfig.late_fraction must be in [0, 1)")
        if isinstance(self.batch_size, bool) or self.batch_size < 1:
            raise ConfigError("SwarmDemoConfig.batch_size must be a positive int")
        if self.target_batch_size is not None and self.target_batch_size < 1:
            raise ConfigError("SwarmDemoConfig.target_batch_size must be positive")
        if not self.bandwidths or any(
            len(pair) != 2 or not all(r > 0 for r in pair) for pair in self.bandwidths
        ):
            raise ConfigError("SwarmDemoConfig.bandwidths must be (upload, download) > 0 pairs")

    @property
    def target(self) -> int:
        """Samples per swarm step."""
        if self.target_batch_size is not None:
            return self.target_batch_size
        return self.peers * self.batch_size * 4

    @property
    def late_delay(self) -> float:
        """Seconds after the first peers start when the late peer starts."""
        return self.seconds * self.late_fraction


@dataclass
class PeerRun:
    """One peer process of the demo and what it logged.

    Attributes:
        name: ``peer-<i>``.
        upload_mbit: Announced upload rate.
        download_mbit: Announced download rate.
        late: Whether it joined late.
        launched: Seconds after the demo started that its process started.
        events: Its JSON events, each with ``"t"`` (seconds since the demo
            started, by the demo's clock when the line arrived).
        stderr: The tail of its stderr.
        returncode: Its exit status (``None`` if it was killed or never started).
        started: Whether its process was started.
    """

    name: str
    upload_mbit: float
    download_mbit: float
    late: bool
    launched: float = 0.0
    events: list[dict[str, Any]] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)
    returncode: int | None = None
    started: bool = False

    def first(self, kind: str) -> dict[str, Any] | None:
        """Its first event of ``kind``."""
        return next((e for e in self.events if e.get("event") == kind), None)

    @property
    def joined_at(self) -> float | None:
        """Seconds after the demo started that it joined the swarm."""
        start = self.first("start")
        return None if start is None else float(start["t"])

    @property
    def losses(self) -> list[tuple[float, float]]:
        """(seconds since the demo started, loss) of its progress events."""
        return losses_of(self.events, "progress")


@dataclass(frozen=True)
class SwarmDemoResult:
    """The outcome of a demo run.

    Attributes:
        runs: Every peer's run.
        png: The plot written, or ``None`` (then ``png_note`` says why).
        wall_s: Seconds the demo took.
        png_note: Why there is no plot, when there is none.
        stopped: Whether the run was stopped early (Ctrl-C or SIGTERM).
    """

    runs: tuple[PeerRun, ...]
    png: Path | None
    wall_s: float
    png_note: str = "nothing to plot"
    stopped: bool = False

    @property
    def ok(self) -> bool:
        """Every peer exited cleanly with a summary, and the swarm stepped."""
        ends = [r.first("end") for r in self.runs]
        return (
            all(r.returncode == 0 for r in self.runs)
            and all(e is not None for e in ends)
            and max((int(e["global_step"]) for e in ends if e is not None), default=0) > 0
        )


def _train_argv(
    config: SwarmDemoConfig, run: PeerRun, join: str, seconds: float, host: str = "127.0.0.1"
) -> list[str]:
    rates = (
        []
        if config.shaped  # measured, never told
        else ["--upload-mbit", f"{run.upload_mbit:g}", "--download-mbit", f"{run.download_mbit:g}"]
    )
    return cli_argv(
        "train",
        "--join",
        join,
        "--run-id",
        config.run_id,
        "--target-batch-size",
        str(config.target),
        "--batch-size",
        str(config.batch_size),
        "--seconds",
        f"{seconds:.1f}",
        *rates,
        "--host",
        host,
        "--log-json",
        "-",
        "--torch-threads",
        "1",  # the peers share this machine's cores
    )


_BOOTSTRAP_MBIT = 1000.0
"""The bootstrap peer's link in the shaped demo (a well-connected public host)."""


def _shaped_lab(config: SwarmDemoConfig, runs: Sequence[PeerRun]) -> StarLab:
    """Host 0: the bootstrap peer; host i + 1: peer i, linked at its rates."""
    from p2ptrain.lab.starlab import LinkSpec, StarLab  # noqa: PLC0415

    links = [LinkSpec(_BOOTSTRAP_MBIT, _BOOTSTRAP_MBIT)]
    links += [LinkSpec(run.upload_mbit, run.download_mbit) for run in runs]
    lab = StarLab(links, delay_ms=config.delay_ms)
    lab.start()
    return lab


def run_swarm_demo(
    config: SwarmDemoConfig,
    *,
    out: TextIO | None = None,
    stop: threading.Event | None = None,
    began: threading.Event | None = None,
) -> SwarmDemoResult:
    """Run the demo swarm, print a summary to ``out`` and write the loss plot.

    Args:
        config: The swarm.
        out: Where the progress lines and the summary go.
        stop: Set it (from a signal handler) to end the run early: once a
            peer trains, the peers get SIGTERM and end with their summaries,
            then the demo prints its own; before that the demo is interrupted.
        began: Set by the demo when the first peer starts training.

    Raises:
        KeyboardInterrupt: ``stop`` was set before any peer trained (the
            processes started so far are stopped).
        ConfigError: The bootstrap peer did not come up.
    """
    demo = _Demo(config, out, stop if stop is not None else threading.Event())
    demo.describe_links()
    argv = demo.wrap(0, cli_argv("bootstrap", "--port", "0", "--host", demo.host(0)))
    boot: ChildProcess[PeerRun] = ChildProcess(argv, None, demo.origin)
    try:
        demo.train(boot, began)
    finally:
        for process in demo.processes:
            process.stop()
        boot.stop()
        boot.wait(10)
        if demo.lab is not None:
            demo.lab.close()
    wall = time.monotonic() - demo.origin
    runs = demo.runs
    if config.log_dir is not None:
        _save_logs(runs, Path(config.log_dir))
    try:
        png, note = plot_loss(runs, Path(config.png)), "nothing to plot"
    except MissingDependencyError as exc:
        png, note = None, str(exc)
    stopped = demo.stop.is_set()
    result = SwarmDemoResult(runs=runs, png=png, wall_s=wall, png_note=note, stopped=stopped)
    demo.say(format_summary(result, config))
    return result


class _Demo:
    """One run of the demo: the peers' processes, their links, what it prints."""

    def __init__(self, config: SwarmDemoConfig, out: TextIO | None, stop: threading.Event) -> None:
        self.config = config
        self.out = out
        self.stop = stop
        self.origin = time.monotonic()
        self.runs = tuple(
            PeerRun(
                name=f"peer-{i}",
                upload_mbit=config.bandwidths[i % len(config.bandwidths)][0],
                download_mbit=config.bandwidths[i % len(config.bandwidths)][1],
                late=i == config.peers - 1,
            )
            for i in range(config.peers)
        )
        self.processes: list[ChildProcess[PeerRun]] = []
        self.lab = _shaped_lab(config, self.runs) if config.shaped else None

    def say(self, text: str) -> None:
        if self.out is not None:
            self.out.write(text + "\n")
            self.out.flush()

    def host(self, index: int) -> str:  # index 0: the bootstrap peer
        return "127.0.0.1" if self.lab is None else self.lab.host_address(index)

    def wrap(self, index: int, argv: list[str]) -> list[str]:
        return argv if self.lab is None else self.lab.argv(index, argv)

    def describe_links(self) -> None:
        if self.lab is None:
            self.say(
                "rates are announced (each peer is told its --upload-mbit/--download-mbit), not "
                "shaped; as root, `p2ptrain demo --shaped` shapes real links and measures them"
            )
        else:
            self.say(
                f"shaped: {len(self.runs) + 1} network namespaces, tc-tbf links at each peer's "
                f"rates, {2 * self.config.delay_ms:g} ms round trips; the load balancer is fed "
                "only by measurement"
            )

    def train(self, boot: ChildProcess[PeerRun], began: threading.Event | None) -> None:
        """Start the peers (the last one late), show their progress, and end them."""
        config, stop, runs, origin = self.config, self.stop, self.runs, self.origin
        line = boot.wait_for_line("--join", _STARTUP_TIMEOUT, stop)
        join = line.split("--join", 1)[1].strip()
        self.say(f"bootstrap peer {join}")
        early, late = runs[:-1], runs[-1]
        self.say(
            f"starting {len(early)} peers now; {late.name} joins {config.late_delay:.0f} s "
            f"after they start training; training {config.seconds:.0f} s, "
            f"target batch {config.target} samples"
        )
        for i, run in enumerate(early):
            run.launched = time.monotonic() - origin
            check_stop(stop)
            argv = self.wrap(
                i + 1, _train_argv(config, run, join, config.seconds, self.host(i + 1))
            )
            self.processes.append(ChildProcess(argv, run, origin))
        # The late peer starts a while after the first peers train, and is told
        # to stop (SIGTERM: a clean end with a summary) when they are done.
        first_start = _wait_for_start(self.processes, _STARTUP_TIMEOUT, stop)
        if began is not None:
            began.set()
        self.say(f"training began at {first_start:.1f} s; Ctrl-C stops the demo with a summary")
        live = _LiveLine(self.out, runs, origin)
        live.until(
            lambda: stop.is_set() or time.monotonic() - origin >= first_start + config.late_delay
        )
        if not stop.is_set():
            late.launched = time.monotonic() - origin
            seconds = config.seconds + _STARTUP_TIMEOUT
            argv = _train_argv(config, late, join, seconds, self.host(len(runs)))
            self.processes.append(ChildProcess(self.wrap(len(runs), argv), late, origin))
            live.say(f"{late.name} starts late at {late.launched:.0f} s")
        self._finish(live, first_start, len(early))

    def _finish(self, live: _LiveLine, first_start: float, early: int) -> None:
        """Wait for the early peers to end (or stop them all); collect the exit codes."""
        stop = self.stop
        deadline = self.origin + first_start + self.config.seconds + _STARTUP_TIMEOUT
        early_processes = self.processes[:early]
        live.until(
            lambda: (
                stop.is_set()
                or all(p.process.poll() is not None for p in early_processes)
                or time.monotonic() > deadline
            )
        )
        live.done()
        if stop.is_set():
            live.say("stopping the peers ...")
            for process in self.processes:  # SIGTERM: each peer ends with its summary
                if process.process.poll() is None:
                    process.process.terminate()
            deadline = time.monotonic() + 30.0
        for process in early_processes:
            assert process.run is not None
            process.run.returncode = process.wait(max(1.0, deadline - time.monotonic()))
        late = self.runs[-1]
        if late.started:
            self.processes[-1].process.terminate()
            late.returncode = self.processes[-1].wait(30.0)


def _wait_for_start(
    processes: Sequence[ChildProcess[PeerRun]], timeout: float, stop: threading.Event | None = None
) -> float:
    """When the first peer started training; fails with each peer's own error line.

    Raises:
        KeyboardInterrupt: ``stop`` was set first.
    """
    runs = [p.run for p in processes if p.run is not None]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        check_stop(stop)
        joined = [r.joined_at for r in runs if r.joined_at is not None]
        if joined:
            return min(joined)
        if all(p.process.poll() is not None for p in processes):
            break
        time.sleep(0.1)  # polls data gathered by the reader threads
    for process in processes:
        process.wait(5)  # the reader threads have the whole stderr
    errors = [
        f"{r.name}: {r.stderr[-1] if r.stderr else 'no error output'}"
        for r in runs
        if r.joined_at is None
    ]
    why = "exited" if time.monotonic() < deadline else f"did not start in {timeout:.0f} s"
    raise ConfigError(f"no demo peer started training (they {why}): " + "; ".join(errors))


class _LiveLine:
    """The demo's live line (peers, global step, loss, samples/s) while the peers train.

    On a terminal it is redrawn in place every second; otherwise a line is
    printed every 10 s, so that logs stay short.
    """

    def __init__(self, out: TextIO | None, runs: Sequence[PeerRun], origin: float) -> None:
        self.out = out
        self.runs = runs
        self.origin = origin
        self.tty = bool(out is not None and out.isatty())
        self.interval = 1.0 if self.tty else 10.0
        self._next = time.monotonic()
        self._drawn = False

    def text(self) -> str | None:
        """The line, from each running peer's latest progress event; None before any."""
        latest = [
            next((e for e in reversed(r.events) if e.get("event") == "progress"), None)
            for r in self.runs
            if r.first("end") is None
        ]
        events = [e for e in latest if e is not None]
        if not events:
            return None
        losses = [float(e["loss"]) for e in events if isinstance(e.get("loss"), int | float)]
        loss = f"{sum(losses) / len(losses):.4f}" if losses else "-"
        rate = sum(float(e.get("samples_per_s") or 0.0) for e in events)
        step = max(int(e.get("swarm_step") or 0) for e in events)
        online = max(int(e.get("peers_online") or 0) for e in events)
        elapsed = time.monotonic() - self.origin
        return (
            f"[{elapsed:5.0f}s] peers {len(events)} training ({online} online) | "
            f"global step {step} | loss {loss} | {rate:.1f} samples/s"
        )

    def until(self, condition: Callable[[], bool]) -> None:
        """Show the line until ``condition()`` holds (checked every 0.1 s)."""
        while not condition():
            if time.monotonic() >= self._next:
                self._next = time.monotonic() + self.interval
                self._show()
            time.sleep(0.1)  # the peers' events arrive through the reader threads

    def _show(self) -> None:
        text = self.text()
        if self.out is None or text is None:
            return
        if self.tty:
            self.out.write("\r\x1b[K" + text)
            self._drawn = True
        else:
            self.out.write(text + "\n")
        self.out.flush()

    def say(self, text: str) -> None:
        """Print an event line (below the live line on a terminal)."""
        if self.out is None:
            return
        self.out.write(("\r\x1b[K" if self._drawn else "") + text + "\n")
        self._drawn = False
        self.out.flush()

    def done(self) -> None:
        """End the live line (a newline on a terminal)."""
        if self.out is not None and self._drawn:
            self.out.write("\n")
            self.out.flush()
            self._drawn = False


def _save_logs(runs: Sequence[PeerRun], directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for run in runs:
        with (directory / f"{run.name}.jsonl").open("w", encoding="utf-8") as handle:
            for event in run.events:
                handle.write(json.dumps(event) + "\n")


def plot_loss(runs: Sequence[PeerRun], path: Path) -> Path | None:
    """Write a PNG of every peer's loss against time; ``None`` if no loss was logged.

    Raises:
        MissingDependencyError: matplotlib (the ``plot`` extra) is not installed.
    """
    series = []
    for run in runs:
        label = f"{run.name} ({run.upload_mbit:g}/{run.download_mbit:g} Mbit/s)"
        series.append((label + (", late" if run.late else ""), run.losses))
    return plot_series(
        path,
        series,
        title="p2ptrain demo: charlm trained by a local swarm",
        ylabel="training loss (last local batch)",
        marks=[run.joined_at for run in runs if run.late and run.joined_at is not None],
    )


def _fmt(value: object, spec: str) -> str:
    if isinstance(value, int | float) and math.isfinite(value):
        return format(value, spec)
    return "-"


def _exit_cell(run: PeerRun) -> str:
    if run.returncode is not None:
        return str(run.returncode)
    return "killed" if run.started else "not started"


def format_summary(result: SwarmDemoResult, config: SwarmDemoConfig) -> str:
    """The demo's summary: one row per peer, then the swarm's loss and throughput."""
    headers = (
        "peer",
        "PeerID",
        "configured up/down Mbit/s" if config.shaped else "announced up/down Mbit/s",
        "announced last" if not config.shaped else "measured (announced last)",
        "joined at",
        "global step",
        "local batches",
        "rounds",
        "syncs",
        "samples/s",
        "final loss",
        "exit",
    )
    rows: list[tuple[str, ...]] = []
    for run in result.runs:
        end = run.first("end") or {}
        start = run.first("start") or {}
        rows.append(
            (
                run.name + (" (late)" if run.late else ""),
                str(start.get("peer_id", "-")),
                f"{run.upload_mbit:g}/{run.download_mbit:g}",
                f"{_fmt(end.get('announced_upload_mbit'), '.0f')}/"
                f"{_fmt(end.get('announced_download_mbit'), '.0f')}",
                _fmt(run.joined_at, ".1f") + ("s" if run.joined_at is not None else ""),
                str(end.get("global_step", "-")),
                str(end.get("local_steps", "-")),
                str(end.get("rounds", "-")),
                str(end.get("syncs", "-")),
                _fmt(end.get("samples_per_s"), ".1f"),
                _fmt(end.get("loss"), ".4f"),
                _exit_cell(run),
            )
        )
    lines = [text_table(headers, rows)]
    points = sorted(p for run in result.runs for p in run.losses)
    ends = [run.first("end") for run in result.runs]
    total_rate = sum(float(e["samples_per_s"]) for e in ends if e is not None)
    steps = max((int(e["global_step"]) for e in ends if e is not None), default=0)
    lines.append("")
    lines.append(
        f"swarm: {steps} global steps of {config.target} samples, "
        f"{total_rate:.1f} samples/s (sum over peers), wall {result.wall_s:.0f} s"
    )
    if points:
        head = [v for _, v in points[: max(1, len(result.runs))]]
        tail = [v for _, v in points[-max(1, len(result.runs)) :]]
        lines.append(
            f"loss: {sum(head) / len(head):.4f} at the start -> "
            f"{sum(tail) / len(tail):.4f} at the end"
        )
    for run in result.runs:
        if run.returncode != 0 and run.stderr:
            lines.append(f"{run.name} stderr: {run.stderr[-1]}")
    lines.append(f"loss plot: {result.png or result.png_note}")
    if result.stopped:
        lines.append("demo stopped early (Ctrl-C or SIGTERM)")
    else:
        lines.append("demo OK" if result.ok else "demo FAILED (see above)")
    return "\n".join(lines)
