"""The baselines of ``bench_pipeline.py``: ``torch.distributed.pipelining`` and one process.

:func:`torch_pipeline` runs one process per stage (``torch_stage.py``,
gloo on loopback) and measures samples/s over the steps after the warm-up;
:func:`torch_kill` kills one stage process with SIGKILL mid-run and reports
what the others do within a bound; :func:`single_process` trains the whole
model in this process on the same batches (the loss reference).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from dataclasses import dataclass

import torch

from benchmarks.harness import JsonChild
from benchmarks.pipeline.model import PipelineModel, batch, build_blocks

__all__ = ["TorchRun", "single_process", "torch_kill", "torch_pipeline"]

WORKER = "benchmarks.pipeline.torch_stage"


@dataclass(frozen=True)
class TorchRun:
    """What one torch pipeline run measured."""

    samples_per_s: float
    losses: list[float]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _start(model: PipelineModel, steps: int, schedule: str) -> list[JsonChild]:
    port = _free_port()
    return [
        JsonChild(
            WORKER,
            [
                f"--rank={rank}",
                f"--port={port}",
                f"--steps={steps}",
                f"--schedule={schedule}",
                *model.args(),
            ],
            stderr=open(os.devnull, "wb"),
        )
        for rank in range(model.stages)
    ]


def torch_pipeline(
    model: PipelineModel, *, steps: int, warmup: int, schedule: str, timeout: float = 600.0
) -> TorchRun:
    """Samples/s of the torch pipeline over ``steps`` timed steps after ``warmup``."""
    workers = _start(model, steps + warmup, schedule)
    try:
        deadline = time.monotonic() + timeout
        for w in workers:
            w.process.wait(max(1.0, deadline - time.monotonic()))
        last = [m for m in workers[-1].lines if "loss" in m]
        if len(last) != steps + warmup:
            raise RuntimeError(f"torch pipeline ended after {len(last)} of {steps + warmup} steps")
        elapsed = last[-1]["time"] - last[warmup - 1]["time"]
        return TorchRun(steps * model.batch / elapsed, [m["loss"] for m in last])
    finally:
        for w in workers:
            w.close()


def torch_kill(model: PipelineModel, *, victim: int, after_steps: int, bound_s: float) -> str:
    """Kill stage ``victim``'s process after ``after_steps`` steps; what then happens.

    Returns one word: ``continued`` (steps still completed after the kill),
    ``crashed`` (every other process exited, with an error, without another
    step) or ``hung`` (no step and at least one process still running when
    the bound passed; they are then killed).
    """
    workers = _start(model, 1_000_000, "1f1b")
    try:
        last = workers[-1]
        deadline = time.monotonic() + 300
        while sum("loss" in m for m in last.lines) < after_steps:
            if time.monotonic() > deadline or last.process.poll() is not None:
                raise RuntimeError("the torch pipeline did not start")
            time.sleep(0.05)
        os.kill(workers[victim].process.pid, signal.SIGKILL)
        killed_at = time.time()
        others = [w for i, w in enumerate(workers) if i != victim]
        end = time.monotonic() + bound_s
        while time.monotonic() < end and any(w.process.poll() is None for w in others):
            time.sleep(0.1)
        steps_after = [
            m for w in (workers[0], last) for m in w.lines if m.get("time", 0) > killed_at + 1.0
        ]
        if steps_after:
            return "continued"
        if all(w.process.poll() is not None for w in others):
            return "crashed"
        return "hung"
    finally:
        for w in workers:
            w.close()


def single_process(model: PipelineModel, steps: int) -> list[float]:
    """Losses of the whole model trained in one process on the same batches."""
    torch.set_num_threads(1)
    net = torch.nn.Sequential(*build_blocks(model))
    optimizer = torch.optim.SGD(net.parameters(), lr=model.lr)
    losses = []
    for step in range(steps):
        x, y = batch(model, step)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses
