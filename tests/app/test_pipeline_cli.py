"""``p2ptrain train --pipeline`` through real processes on loopback: a model no peer can hold."""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ChildLines, cli_process, join_address, run_cli, stop_all

from p2ptrain.app.pipeline import model_of, stage_bytes
from p2ptrain.app.task import load_pipeline_task

BUDGET_MB = 1.2
STAGES = 4


class Swarm:
    """Pipeline peer processes whose JSON events arrive in one queue."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.procs: dict[int, ChildLines] = {}
        self.events: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue()
        self.latest: dict[int, dict[str, Any]] = {}
        self.first_loss: dict[int, float] = {}

    def start(self, index: int, stage: int, *extra: str) -> None:
        proc = cli_process(
            "train", "--pipeline", "--join", self.address, "--run-id", "pp",
            "--stage", str(stage), "--memory-budget-mb", str(BUDGET_MB),
            "--target-batch-size", "64", "--batch-size", "8", "--seconds", "300",
            "--log-json", "-", *extra,
        )  # fmt: skip
        self.procs[index] = proc
        threading.Thread(target=self._forward, args=(index, proc), daemon=True).start()

    def _forward(self, index: int, proc: ChildLines) -> None:
        while True:
            line = proc.lines.get()
            if line is None:
                return
            if line.startswith("{"):
                self.events.put((index, json.loads(line)))

    def until(self, deadline: float, done: Any) -> dict[str, Any]:
        """Read events until ``done(index, event)`` holds; fail at ``deadline``."""
        while True:
            try:
                index, event = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                tails = {i: "".join(p.stderr)[-600:] for i, p in self.procs.items()}
                raise AssertionError(
                    f"no such event in time; latest {self.latest}; {tails}"
                ) from None
            self.latest[index] = event
            if event.get("loss") is not None:
                self.first_loss.setdefault(index, event["loss"])
            if done(index, event):
                return event


@pytest.fixture
def swarm() -> Iterator[Swarm]:
    boot = cli_process("bootstrap", "--port", "0")
    found = Swarm("")
    try:
        deadline = time.monotonic() + 60
        found.address = join_address(boot, deadline)
        yield found
    finally:
        stop_all([*found.procs.values(), boot])


def test_the_model_exceeds_every_peers_budget_but_each_stage_fits() -> None:
    task = load_pipeline_task()
    model = model_of(task)
    sizes = [stage_bytes(task, model, s) for s in range(model.num_stages)]
    assert model.num_stages == STAGES
    assert sum(sizes) > BUDGET_MB * 1e6  # no peer could hold the whole model
    assert max(sizes) <= BUDGET_MB * 1e6  # every stage fits one peer


@pytest.mark.slow
@pytest.mark.timeout(600)  # eight torch processes start in ~15 s alone, minutes on a loaded machine
def test_eight_pipeline_peers_train_and_survive_kill_9_of_a_stage_peer(swarm: Swarm) -> None:
    for index in range(8):
        swarm.start(index, index % STAGES)
    deadline = time.monotonic() + 300  # deadlines, not waits: each ends at its event
    swarm.until(
        deadline, lambda i, e: all(swarm.latest.get(j, {}).get("step", 0) >= 3 for j in range(8))
    )
    victim, survivor = 1, 5  # both serve stage 1
    swarm.procs[victim].process.kill()
    killed_at = time.monotonic()
    step_then = swarm.latest[survivor]["step"]
    # Two more steps: the one in progress at the kill may have needed nothing new;
    # the next holds only micro-batches pushed after it (retries included).
    swarm.until(killed_at + 60, lambda i, e: i == survivor and e["step"] >= step_then + 2)
    recovered_s = time.monotonic() - killed_at
    # Recovery time is a figure of the benchmark (bench_pipeline part b: issue 22's 10 s
    # goal); measured here it ranged 4.8-11.2 s on 2 cores, so the test checks that stage 1
    # recovers, within a bound the goal does not set.
    assert recovered_s < 30, f"stage 1 stepped again only {recovered_s:.1f} s after the kill"
    swarm.start(victim, 1)  # the killed peer comes back, downloads stage 1 and serves
    swarm.until(
        time.monotonic() + 200,
        lambda i, e: i == victim and e["committed"] > 0 and e["step"] >= step_then,
    )
    later = time.monotonic() + 60
    swarm.until(later, lambda i, e: i == 0 and e["loss"] is not None and e["step"] >= 8)
    firsts = [swarm.first_loss[i] for i in range(8) if i in swarm.first_loss]
    lasts = [swarm.latest[i]["loss"] for i in range(8) if swarm.latest[i].get("loss") is not None]
    assert sum(lasts) / len(lasts) < 0.95 * sum(firsts) / len(firsts)
    print(f"kill -9 of a stage-1 peer: stage 1 stepped again after {recovered_s:.1f} s")


@pytest.mark.slow
def test_a_stage_over_the_memory_budget_is_refused_with_both_figures(swarm: Swarm) -> None:
    result = run_cli(
        *("train", "--pipeline", "--join", swarm.address, "--run-id", "pp"),
        *("--stage", "1", "--memory-budget-mb", "0.5"),
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "stage 1 needs 1.0" in result.stderr
    assert "budget is 0.50 MB: refusing to serve it" in result.stderr


TWO_STAGES = """
from p2ptrain.examples.charlm.pipeline import CharLMPipelineTask


def make_pipeline_task():
    return CharLMPipelineTask(num_stages=2)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_peers_started_three_to_one_rebalance_to_two_and_two_and_stay(
    swarm: Swarm, tmp_path: Path
) -> None:
    # Four equal (emulated) devices on two stages, three on stage 0: moving one
    # doubles the pipeline's throughput, and once at 2/2 no move gains anything.
    task = tmp_path / "two_stages.py"
    task.write_text(TWO_STAGES)
    period = 3.0
    for index, stage in enumerate([0, 0, 0, 1]):
        swarm.start(
            index, stage, "--task", str(task), "--memory-budget-mb", "100",
            "--compute-floor", "0.1", "--rebalance-s", str(period),
        )  # fmt: skip

    def counts() -> list[int]:
        stages = [swarm.latest.get(i, {}).get("stage") for i in range(4)]
        return [stages.count(0), stages.count(1)]

    swarm.until(time.monotonic() + 150, lambda i, e: counts() == [2, 2])
    moved = [i for i in range(3) if swarm.latest[i]["stage"] == 1]
    assert len(moved) == 1
    settled = time.monotonic()
    swarm.until(settled + 60, lambda i, e: time.monotonic() > settled + 4 * period)
    assert counts() == [2, 2], "a peer moved again after the split was even"
    step = swarm.latest[moved[0]]["step"]
    swarm.until(time.monotonic() + 60, lambda i, e: i == moved[0] and e["step"] > step)
