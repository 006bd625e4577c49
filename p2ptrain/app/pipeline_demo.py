"""``p2ptrain demo --pipeline``: a local swarm trains a model that no peer can hold.

:func:`run_pipeline_demo` starts ``p2ptrain bootstrap`` and then ``peers``
processes of ``p2ptrain train --pipeline`` on loopback. The task's blocks
(charlm cut into stages) are served by the peers, peer ``i`` serving stage
``i mod stages``, and every peer's memory budget (parameters, gradient
accumulators and optimizer state) is set between its stage's needs and the
whole model's, so the model exists only across peers; the demo prints
both figures. While they train it shows a per-stage table (peers, their
measured throughput, micro-batches queued, the stage's step, the trainers'
loss), and at the end a summary per peer and a PNG of each trainer's loss
against time.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from p2ptrain.app.processes import ChildProcess, check_stop, cli_argv
from p2ptrain.app.report import losses_of, plot_series, text_table
from p2ptrain.errors import ConfigError, MissingDependencyError

__all__ = [
    "PipelineDemoConfig",
    "PipelineDemoResult",
    "StagePeerRun",
    "format_stage_table",
    "run_pipeline_demo",
]

_STARTUP_TIMEOUT = 120.0
_BUDGET_HEADROOM = 1.25
"""A peer's budget: the largest stage's needs times this (always below the whole model)."""


@dataclass(frozen=True)
class PipelineDemoConfig:
    """The pipeline demo swarm.

    Attributes:
        peers: Stage peers (at least the task's stages; stage ``i mod stages``).
        seconds: Seconds every peer trains.
        batch_size: Samples per micro-batch.
        target_batch_size: Samples per stage step (the stage's peers together).
        run_id: The run's name.
        png: Where to write the loss plot.
        compute_floor_s: Emulated device speed (a floor on each micro-batch's compute).
    """

    peers: int = 8
    seconds: float = 60.0
    batch_size: int = 8
    target_batch_size: int = 64
    run_id: str = "pipeline-demo"
    png: str = "p2ptrain-pipeline-demo-loss.png"
    compute_floor_s: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.peers, bool) or not isinstance(self.peers, int):
            raise ConfigError(f"PipelineDemoConfig.peers must be an int, got {self.peers!r}")
        if not 2 <= self.peers <= 32:
            raise ConfigError("the pipeline demo runs 2 to 32 peers on one machine")
        if not (isinstance(self.seconds, int | float) and math.isfinite(self.seconds)):
            raise ConfigError("PipelineDemoConfig.seconds must be a number")
        if self.seconds < 5:
            raise ConfigError(f"the pipeline demo needs at least 5 seconds, got {self.seconds!r}")
        for name in ("batch_size", "target_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"PipelineDemoConfig.{name} must be a positive int")
        if not (math.isfinite(self.compute_floor_s) and self.compute_floor_s >= 0):
            raise ConfigError("PipelineDemoConfig.compute_floor_s must be >= 0")


@dataclass
class StagePeerRun:
    """One stage peer's process and what it logged.

    Attributes:
        name: ``peer-<i>``.
        stage: The stage it serves.
        events: Its JSON events (``"t"``: seconds since the demo started).
        stderr: The tail of its stderr.
        returncode: Its exit status (``None`` if killed or never started).
        started: Whether its process was started.
    """

    name: str
    stage: int
    events: list[dict[str, Any]] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)
    returncode: int | None = None
    started: bool = False

    @property
    def latest(self) -> dict[str, Any] | None:
        """Its last pipeline event."""
        return next((e for e in reversed(self.events) if e.get("event") == "pipeline"), None)

    def committed_rate(self, window: float = 10.0) -> float:
        """Samples per second this peer's stage server committed over the last ``window`` s."""
        events = [e for e in self.events if e.get("event") == "pipeline" and "committed" in e]
        if len(events) < 2:
            return 0.0
        last = events[-1]
        first = next((e for e in events if e["t"] >= last["t"] - window), events[0])
        if first is last:
            first = events[-2]
        seconds = float(last["t"]) - float(first["t"])
        return (int(last["committed"]) - int(first["committed"])) / seconds if seconds > 0 else 0.0

    @property
    def losses(self) -> list[tuple[float, float]]:
        """(seconds since the demo started, loss) of its events."""
        return losses_of(self.events, "pipeline")


@dataclass(frozen=True)
class PipelineDemoResult:
    """The outcome of a pipeline demo run.

    Attributes:
        runs: Every stage peer's run.
        model_mb: The whole model's parameters, accumulators and optimizer state, MB.
        budget_mb: Each peer's enforced budget, MB.
        png: The plot written, or ``None`` (then ``png_note`` says why).
        wall_s: Seconds the demo took.
        png_note: Why there is no plot, when there is none.
        stopped: Whether the run was stopped early (Ctrl-C or SIGTERM).
    """

    runs: tuple[StagePeerRun, ...]
    model_mb: float
    budget_mb: float
    png: Path | None
    wall_s: float
    png_note: str = "nothing to plot"
    stopped: bool = False

    @property
    def ok(self) -> bool:
        """Every peer exited 0, every stage stepped, and the trainers' loss fell."""
        if not self.runs or any(run.returncode != 0 for run in self.runs):
            return False
        stepped = {run.stage for run in self.runs if (run.latest or {}).get("step", 0) > 0}
        if stepped != {run.stage for run in self.runs}:
            return False
        points = sorted(p for run in self.runs for p in run.losses)
        if len(points) < 2:
            return False
        head, tail = _ends(points, len(self.runs))
        return tail < head


def _ends(points: Sequence[tuple[float, float]], count: int) -> tuple[float, float]:
    """Mean of the first and of the last ``count`` losses."""
    head = [v for _, v in points[:count]]
    tail = [v for _, v in points[-count:]]
    return sum(head) / len(head), sum(tail) / len(tail)


def model_budget(task_spec: str | None = None) -> tuple[int, float, float]:
    """(stages, whole-model MB, per-peer budget MB) of the task's pipeline."""
    from p2ptrain.app.pipeline import model_of, stage_bytes  # noqa: PLC0415 - imports torch
    from p2ptrain.app.task import load_pipeline_task  # noqa: PLC0415

    task = load_pipeline_task(task_spec)
    model = model_of(task)
    sizes = [stage_bytes(task, model, s) for s in range(model.num_stages)]
    total = sum(sizes)
    budget = min(max(sizes) * _BUDGET_HEADROOM, 0.9 * total)
    if budget < max(sizes):
        raise ConfigError("the task's largest stage is most of the model: no budget fits")
    return model.num_stages, total / 1e6, budget / 1e6


def run_pipeline_demo(
    config: PipelineDemoConfig,
    *,
    out: TextIO | None = None,
    stop: threading.Event | None = None,
) -> PipelineDemoResult:
    """Run the pipeline demo swarm, print the stage table and a summary, write the plot.

    Raises:
        KeyboardInterrupt: ``stop`` was set before the peers were started.
        ConfigError: Fewer peers than stages, or the bootstrap peer did not come up.
    """
    stop = stop if stop is not None else threading.Event()
    stages, model_mb, budget_mb = model_budget()
    if config.peers < stages:
        raise ConfigError(f"the pipeline has {stages} stages: the demo needs as many peers")
    say = _printer(out)
    say(
        f"model: {model_mb:.2f} MB of parameters, gradient accumulators and Adam state over "
        f"{stages} stages; each peer's budget: {budget_mb:.2f} MB, so no peer can hold the "
        f"whole model"
    )
    origin = time.monotonic()
    runs = tuple(StagePeerRun(f"peer-{i}", i % stages) for i in range(config.peers))
    boot: ChildProcess[StagePeerRun] = ChildProcess(
        cli_argv("bootstrap", "--port", "0"), None, origin
    )
    processes: list[ChildProcess[StagePeerRun]] = []
    try:
        join = boot.wait_for_line("--join", _STARTUP_TIMEOUT, stop).split("--join", 1)[1].strip()
        say(
            f"bootstrap peer {join}; {config.peers} peers over {stages} stages, "
            f"training {config.seconds:g} s"
        )
        for run in runs:
            check_stop(stop)
            processes.append(ChildProcess(_peer_argv(config, run, join, budget_mb), run, origin))
        _show_until_done(config, runs, processes, say, stop)
    finally:
        for process in processes:
            process.stop()
        boot.stop()
    for run, process in zip(runs, processes, strict=False):
        run.returncode = process.wait(10)
    try:
        png, note = _plot(runs, Path(config.png)), "nothing to plot"
    except MissingDependencyError as exc:
        png, note = None, str(exc)
    result = PipelineDemoResult(
        runs=runs,
        model_mb=model_mb,
        budget_mb=budget_mb,
        png=png,
        wall_s=time.monotonic() - origin,
        png_note=note,
        stopped=stop.is_set(),
    )
    say(format_summary(result))
    return result


def _printer(out: TextIO | None) -> Callable[[str], None]:
    def say(text: str) -> None:
        if out is not None:
            out.write(text + "\n")
            out.flush()

    return say


def _peer_argv(
    config: PipelineDemoConfig, run: StagePeerRun, join: str, budget: float
) -> list[str]:
    return cli_argv(
        "train", "--pipeline", "--join", join, "--run-id", config.run_id,
        "--stage", str(run.stage), "--memory-budget-mb", f"{budget:.4f}",
        "--target-batch-size", str(config.target_batch_size),
        "--batch-size", str(config.batch_size), "--seconds", f"{config.seconds:g}",
        "--compute-floor", f"{config.compute_floor_s:g}",
        "--torch-threads", "1", "--log-json", "-",
    )  # fmt: skip


def _show_until_done(
    config: PipelineDemoConfig,
    runs: Sequence[StagePeerRun],
    processes: Sequence[ChildProcess[StagePeerRun]],
    say: Callable[[str], None],
    stop: threading.Event,
) -> None:
    """Print the stage table every 10 s until the peers exit (or ``stop``, then SIGTERM)."""
    deadline = time.monotonic() + config.seconds + 2 * _STARTUP_TIMEOUT
    next_table = time.monotonic() + 10.0
    while not all(p.process.poll() is not None for p in processes):
        if stop.is_set() or time.monotonic() > deadline:
            say("stopping the peers ...")
            for process in processes:
                if process.process.poll() is None:
                    process.process.terminate()  # SIGTERM: a clean end
            break
        if time.monotonic() >= next_table:
            next_table = time.monotonic() + 10.0
            table = format_stage_table(runs)
            if table:
                say(table)
        time.sleep(0.2)  # events arrive through the reader threads


def format_stage_table(runs: Sequence[StagePeerRun]) -> str | None:
    """Per stage: live peers, samples/s served, device throughput, queue, step, loss.

    "served" is what the stage's peers committed over the last 10 s; "device"
    their measured compute rate (forward plus backward), which the trainers'
    wiring weighs; "loss" the mean of those peers' own trainers' last loss.
    """
    latest = [(run, run.latest) for run in runs if run.returncode is None]
    if not any(event is not None for _, event in latest):
        return None
    rows = []
    for stage in sorted({run.stage for run in runs}):
        live = [(run, e) for run, e in latest if run.stage == stage and e is not None]
        events = [e for _, e in live]
        losses = [float(e["loss"]) for e in events if isinstance(e.get("loss"), int | float)]
        rows.append(
            (
                str(stage),
                str(len(events)),
                f"{sum(run.committed_rate() for run, _ in live):.1f}",
                f"{sum(float(e.get('throughput') or 0.0) for e in events):.0f}",
                str(sum(int(e.get("queue") or 0) for e in events)),
                str(max((int(e.get("step") or 0) for e in events), default=0)),
                f"{sum(losses) / len(losses):.4f}" if losses else "-",
            )
        )
    headers = ("stage", "peers", "served samples/s", "device samples/s", "queued", "step", "loss")
    return text_table(headers, rows)


def _exit_cell(run: StagePeerRun) -> str:
    if run.returncode is not None:
        return str(run.returncode)
    return "killed" if run.started else "not started"


def format_summary(result: PipelineDemoResult) -> str:
    """One row per peer, then the loss and the verdict."""
    rows = []
    for run in result.runs:
        last = run.latest or {}
        loss = last.get("loss")
        rows.append(
            (
                run.name,
                str(run.stage),
                str(last.get("step", "-")),
                str(last.get("delivered", "-")),
                str(last.get("in_steps", "-")),
                str(last.get("retries", "-")),
                f"{loss:.4f}" if isinstance(loss, int | float) else "-",
                _exit_cell(run),
            )
        )
    headers = ("peer", "stage", "stage step", "delivered", "in steps", "retries", "loss", "exit")
    lines = [text_table(headers, rows), ""]
    lines.append(
        f"model {result.model_mb:.2f} MB, each peer's budget {result.budget_mb:.2f} MB; "
        f"wall {result.wall_s:.0f} s"
    )
    points = sorted(p for run in result.runs for p in run.losses)
    if points:
        head, tail = _ends(points, len(result.runs))
        lines.append(f"loss: {head:.4f} at the start -> {tail:.4f} at the end")
    for run in result.runs:
        if run.returncode not in (0, None) and run.stderr:
            lines.append(f"{run.name} stderr: {run.stderr[-1]}")
    lines.append(f"loss plot: {result.png or result.png_note}")
    if result.stopped:
        lines.append("demo stopped early (Ctrl-C or SIGTERM)")
    else:
        lines.append("demo OK" if result.ok else "demo FAILED (see above)")
    return "\n".join(lines)


def _plot(runs: Sequence[StagePeerRun], path: Path) -> Path | None:
    return plot_series(
        path,
        [(f"{run.name} (stage {run.stage})", run.losses) for run in runs],
        title="p2ptrain demo --pipeline: charlm across stage peers",
        ylabel="training loss (each peer's own micro-batches)",
    )
