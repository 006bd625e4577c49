"""What every ``bench_training.py --wan`` worker shares: model, data, timing, held-out loss.

Imported by the p2ptrain workers (``training/peer.py``) and by the
hivemind workers (``training/hivemind.py``, run by hivemind's own
interpreter), so it needs only torch and the charlm example (which imports
nothing else of p2ptrain).

A worker speaks JSON lines on stdout and reads plain commands on stdin:

1. it announces its address (``{"address": ...}``; a worker started without
   initial peers first reads them from stdin as a JSON list), then, once its
   trainer is built, ``{"ready": true}``;
2. on ``go`` it trains until its global step reaches ``goal``, recording on
   the way the seconds its training thread spent inside the trainer's
   ``step()`` and, on the peer with ``keep`` set, a copy of the parameters at
   every global step with the time since ``go``; it then sends
   ``{"result": {...}}`` and trains on, unrecorded, until ``stop`` (so that
   no peer stands still while another still finishes its last step);
3. after ``stop`` it leaves the run; on ``eval`` it scores every kept copy on
   the held-out windows and sends ``{"losses": [...]}``; on ``quit`` or the
   end of its input it exits.
"""

from __future__ import annotations

import functools
import json
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from p2ptrain.examples.charlm.data import BatchSampler, Corpus, load_corpus
from p2ptrain.examples.charlm.model import ModelConfig, evaluate, make_model

__all__ = [
    "Commands",
    "Recorder",
    "build",
    "emit",
    "initial_peers",
    "lr_factor",
    "param_groups",
    "serve_after_training",
    "train",
]


def emit(obj: dict[str, Any]) -> None:
    """One JSON line on stdout."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


@functools.cache
def _corpus() -> Corpus:
    return load_corpus()


def initial_peers(job: dict[str, Any]) -> list[str]:
    """The job's initial peers; ``None`` there: read them as a JSON list from stdin's first line.

    (The parent starts every worker at once and tells the others the first
    peer's address when it has it.)
    """
    if job["initial_peers"] is not None:
        return list(job["initial_peers"])
    line = sys.stdin.readline()
    return list(json.loads(line)) if line else []


def build(job: dict[str, Any]) -> tuple[torch.nn.Module, BatchSampler]:
    """The job's model (seeded: every peer of every system starts equal) and data."""
    torch.set_num_threads(job["threads"])
    config = ModelConfig(
        d_model=job["width"], n_layers=job["layers"], n_heads=job["heads"], seed=job["seed"]
    )
    model = make_model(config)
    sampler = _corpus().sampler(seq_len=config.context, seed=job["seed"])
    return model, sampler


def lr_factor(job: dict[str, Any], global_step: int) -> float:
    """Linear warm-up over ``job["warmup"]`` global steps (after k steps: (k + 1) / warmup)."""
    return min(1.0, (global_step + 1) / max(1, job["warmup"]))


def adamw(groups: list[dict[str, Any]], lr: float) -> torch.optim.AdamW:
    """The AdamW of every system: fused (one kernel per step) where torch has it."""
    try:
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.99), fused=True)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.99))


def param_groups(model: torch.nn.Module, weight_decay: float = 0.01) -> list[dict[str, Any]]:
    """charlm's AdamW groups: decay on matrices and embeddings only."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


class Recorder:
    """Time inside ``step()``, samples, and (if ``keep``) the parameters at each global step."""

    def __init__(self, model: torch.nn.Module, *, keep: bool) -> None:
        self.model = model
        self.keep = keep
        self.started = 0.0
        self.blocked_s = 0.0
        self.batches = 0
        self.samples = 0
        self.snapshots: list[tuple[int, float, int, list[torch.Tensor]]] = []
        self._last_step = -1

    def go(self) -> None:
        """Start the clock (the parent said ``go``) and keep the initial parameters."""
        self.started = time.perf_counter()
        self.mark(0, 0)

    def since_go(self) -> float:
        return time.perf_counter() - self.started

    def mark(self, global_step: int, samples: int) -> None:
        """Note the global step after a ``step()``; keeps a copy when it changed.

        ``samples`` is what the swarm's steps so far held, all peers together."""
        if global_step == self._last_step:
            return
        self._last_step = global_step
        if self.keep:
            with torch.no_grad():
                params = [p.detach().clone() for p in self.model.parameters()]
            self.snapshots.append((global_step, self.since_go(), samples, params))

    def result(self, **extra: Any) -> dict[str, Any]:
        """What the worker reports after training."""
        return {
            "wall": self.since_go(),
            "blocked_s": self.blocked_s,
            "batches": self.batches,
            "samples": self.samples,
            **extra,
        }

    def losses(self, windows: torch.Tensor) -> list[list[float]]:
        """``[global step, seconds since go, samples, held-out loss]`` of every kept copy."""
        out = []
        params = list(self.model.parameters())
        with torch.no_grad():
            for step, at, samples, values in self.snapshots:
                for p, v in zip(params, values, strict=True):
                    p.copy_(v)
                out.append([step, at, samples, evaluate(self.model, windows)])
        return out


class Commands:
    """The parent's commands, read from stdin by a thread (the training loop polls them)."""

    def __init__(self) -> None:
        self._queue: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in sys.stdin:
            self._queue.put(line.strip())
        self._queue.put("quit")

    def get(self) -> str:
        """The next command (waits for it)."""
        return self._queue.get()

    def poll(self) -> str | None:
        """The next command if one came, else None."""
        try:
            return self._queue.get_nowait()
        except queue.Empty:
            return None


def train(
    recorder: Recorder,
    job: dict[str, Any],
    commands: Commands,
    *,
    compute: Callable[[int], None],
    step: Callable[[], None],
    global_step: Callable[[], int],
    samples: Callable[[], int],
    report: Callable[[], dict[str, Any]],
) -> bool:
    """Train from ``go``; report at the goal step; keep training until ``stop``.

    A peer that reached the goal keeps computing and stepping until the
    parent, holding every peer's result, says ``stop``: a peer that stood
    still would hold the others' last step (a DiLoCo round waits for every
    live peer). ``compute(i)`` runs the forward and backward of local batch
    ``i``; ``step()`` is timed as blocked; ``samples()`` is what the swarm's
    steps held so far. Returns False if told to quit
    before ``go``.
    """
    if commands.get() != "go":
        return False
    recorder.go()
    batch = job["batch"]
    reported = False
    while True:
        if reported and commands.poll() in ("stop", "quit"):
            break
        compute(recorder.batches)
        tic = recorder.since_go()
        step()
        if reported:
            continue
        recorder.blocked_s += recorder.since_go() - tic
        recorder.batches += 1
        recorder.samples += batch
        recorder.mark(global_step(), samples())
        if global_step() >= job["goal"]:
            emit({"result": recorder.result(global_step=global_step(), **report())})
            reported = True
    return True


def serve_after_training(recorder: Recorder, job: dict[str, Any], commands: Commands) -> None:
    """Answer ``eval`` until ``quit``."""
    while True:
        command = commands.get()
        if command == "eval":
            context = recorder.model.config.context  # type: ignore[union-attr]
            windows = _corpus().validation_windows(job["eval_windows"], seq_len=context)
            emit({"losses": recorder.losses(windows)})
        elif command == "quit":
            return
