"""p2ptrain's side of ``bench_pipeline.py``: real processes of ``peer.py`` on loopback.

:class:`Swarm` starts the trainer (the swarm's first DHT peer) and stage
servers, each a process; the functions measure samples/s without faults,
the recovery from kill -9 of one stage peer, real-process rebalancing, and
the loss curve of a lock-step run.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.harness import JsonChild
from benchmarks.pipeline.model import PipelineModel

__all__ = ["Swarm", "kill_recovery", "lockstep_losses", "rebalance_real", "samples_per_s"]

WORKER = "benchmarks.pipeline.peer"


class Swarm:
    """A trainer process and one server process per entry of ``stages``."""

    def __init__(
        self,
        model: PipelineModel,
        stages: Sequence[int],
        *,
        trainer_args: Sequence[str] = (),
        server_args: Sequence[str] = (),
        run: str = "bench-pipeline",
    ) -> None:
        self.model = model
        self._log = open(os.devnull, "wb")  # noqa: SIM115 - closed in close()
        self.trainer = JsonChild(
            WORKER,
            ["trainer", f"--run={run}", "--wait-go", *trainer_args, *model.args()],
            stderr=self._log,
        )
        self.servers: list[JsonChild] = []
        try:
            address = self.trainer.wait_for("address", 60)
            self._server_args = [f"--run={run}", f"--join={address}", *server_args, *model.args()]
            for stage in stages:
                self.add_server(stage)
        except BaseException:
            self.close()
            raise

    def add_server(self, stage: int) -> JsonChild:
        """Start one more server on ``stage`` and wait until it serves."""
        server = JsonChild(
            WORKER, ["server", f"--stage={stage}", *self._server_args], stderr=self._log
        )
        self.servers.append(server)
        server.wait_for("ready", 120)
        return server

    def go(self) -> float:
        """Let the trainer start; returns when."""
        self.trainer.send("go")
        return time.time()

    def delivered(self) -> list[dict[str, Any]]:
        """The trainer's micro-batch lines so far."""
        return [m for m in list(self.trainer.lines) if "delivered" in m and "step" in m]

    def wait_done(self, timeout: float) -> dict[str, Any]:
        """The trainer's final line (it pushed all its steps)."""
        self.trainer.wait_for("done", timeout)
        return next(m for m in self.trainer.lines if "done" in m)

    def close(self) -> None:
        """Kill every process."""
        for child in [*self.servers, self.trainer]:
            child.close()
        self._log.close()


def _rate(lines: list[dict[str, Any]], start: float, end: float) -> float:
    inside = [m for m in lines if start <= m["time"] <= end]
    if len(inside) < 2:
        return 0.0
    first, last = inside[0], inside[-1]
    return (last["delivered"] - first["delivered"]) / max(last["time"] - first["time"], 1e-9)


def samples_per_s(
    model: PipelineModel,
    *,
    per_stage: int,
    steps: int,
    warmup: int,
    in_flight: int,
    default_intervals: bool = False,
) -> float:
    """Samples/s with ``per_stage`` peers on every stage, after ``warmup`` steps' samples
    (``default_intervals``: the library's progress, announcement, step and refresh
    intervals, not the fast ones of the fault parts)."""
    stages = [s for s in range(model.stages) for _ in range(per_stage)]
    intervals = ["--default-intervals"] if default_intervals else []
    swarm = Swarm(
        model,
        stages,
        trainer_args=[f"--steps={steps + warmup}", f"--in-flight={in_flight}", *intervals],
        server_args=intervals,
    )
    try:
        swarm.go()
        swarm.wait_done(600)
        lines = sorted(swarm.delivered(), key=lambda m: m["delivered"])
        after = [m for m in lines if m["delivered"] > warmup * model.batch]
        if len(after) < 2:
            raise RuntimeError("the pipeline delivered too little to time")
        return (after[-1]["delivered"] - after[0]["delivered"]) / (
            after[-1]["time"] - after[0]["time"]
        )
    finally:
        swarm.close()


def _steps(server: JsonChild) -> list[tuple[float, int]]:
    return [(m["time"], m["step"]) for m in list(server.lines) if "step" in m and "time" in m]


def kill_recovery(
    model: PipelineModel, *, victim_stage: int, warm_s: float, bound_s: float, in_flight: int
) -> float | None:
    """Seconds from kill -9 of one of ``victim_stage``'s two peers until every stage's
    global step advances again (None: not within ``bound_s``)."""
    stages = [s for s in range(model.stages) for _ in range(2)]
    swarm = Swarm(model, stages, trainer_args=["--steps=100000", f"--in-flight={in_flight}"])
    try:
        swarm.go()
        time.sleep(warm_s)
        victim = next(s for i, s in enumerate(swarm.servers) if stages[i] == victim_stage)
        survivors = [s for s in swarm.servers if s is not victim]
        at_kill = {id(s): max((st for _, st in _steps(s)), default=0) for s in survivors}
        os.kill(victim.process.pid, signal.SIGKILL)
        killed = time.time()
        deadline = time.monotonic() + bound_s
        while time.monotonic() < deadline:
            advanced: dict[int, float] = {}
            for s in survivors:
                later = [t for t, st in _steps(s) if st > at_kill[id(s)] and t > killed]
                if later:
                    advanced[stages[swarm.servers.index(s)]] = min(
                        advanced.get(stages[swarm.servers.index(s)], later[0]), later[0]
                    )
            if len(advanced) == model.stages:
                return max(advanced.values()) - killed
            time.sleep(0.2)
        return None
    finally:
        swarm.close()


def rebalance_real(
    model: PipelineModel,
    *,
    start: Sequence[int],
    floor_s: float,
    period_s: float,
    window_s: float,
    run_s: float,
    in_flight: int,
) -> tuple[float, float, list[int]]:
    """Samples/s in the first ``window_s`` after the first delivered micro-batch and in the
    last ``window_s`` of a run from ``start`` peers per stage, each server emulating a
    device (``floor_s`` per forward and per backward) and rebalancing every ``period_s``
    (the first decisions come after ``0.8 * period_s``); and the peers per stage at the end."""
    stages = [s for s, n in enumerate(start) for _ in range(n)]
    swarm = Swarm(
        model,
        stages,
        trainer_args=["--steps=100000", f"--in-flight={in_flight}"],
        server_args=[f"--floor-s={floor_s}", f"--rebalance-s={period_s}"],
    )
    try:
        began = swarm.go()
        time.sleep(run_s)
        lines = swarm.delivered()
        flowing = min((m["time"] for m in lines), default=began)
        first = _rate(lines, flowing, flowing + window_s)
        last = _rate(lines, began + run_s - window_s, began + run_s)
        counts = [0] * model.stages
        for server in swarm.servers:
            reports = [m for m in list(server.lines) if "stage" in m]
            if reports:
                counts[reports[-1]["stage"]] += 1
        return first, last, counts
    finally:
        swarm.close()


def lockstep_losses(model: PipelineModel, steps: int) -> list[float]:
    """Mean micro-batch loss of each step of a lock-step run (one peer per stage)."""
    swarm = Swarm(
        model,
        list(range(model.stages)),
        trainer_args=[f"--steps={steps}", "--lockstep", f"--in-flight={model.microbatches}"],
    )
    try:
        swarm.go()
        swarm.wait_done(900)
        by_step: dict[int, list[float]] = {}
        for m in swarm.delivered():
            by_step.setdefault(m["step"], []).append(m["loss"])
        return [sum(v) / len(v) for _, v in sorted(by_step.items())]
    finally:
        swarm.close()
