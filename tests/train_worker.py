"""Shared pieces of the training tests, and one training peer in its own process.

The tests use a tiny model (a 2-layer MLP on synthetic regression data) so
that they stay fast; :func:`rows` gives peer ``shard`` of ``num_shards`` the
rows ``[t·n·b + shard·b, t·n·b + (shard + 1)·b)`` at step ``t``, so that the
shards of a step, concatenated, are the single-process batch of ``n·b``.

As a script, it runs one peer of a swarm (for the crash test). Usage::

    python tests/train_worker.py '<json job>'

The job: ``{"initial_peers": [...], "run_id": str, "target": int, "batch":
int, "steps": int, "shard": int, "num_shards": int, "compute_s": float}``
and optionally ``"policy"`` (the step policy, default the library's),
``"wait_go": true`` (train only after a line "go" on stdin) and ``"patient":
true`` (PATIENT_MATCHMAKING and PATIENT_PROGRESS instead of the fast timings,
and training starts once all ``num_shards`` peers are online). The
worker prints one JSON object a line: ``{"address": ...}`` once started,
then ``{"step": n, "t": unix time, "local_rounds": k, "own": samples,
"samples": step total or null, "digest": parameters' sha256}`` after every
global step, and ``{"done": true, "computed": samples, "pending": samples}``
when it reached ``steps`` (samples it computed, and those it holds toward
steps not taken). It exits when done or when its stdin closes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from p2ptrain.allreduce.matchmaking import MatchmakingConfig
from p2ptrain.dht.node_config import DHTNodeConfig
from p2ptrain.peer import Peer, PeerConfig
from p2ptrain.train.config import TrainerConfig
from p2ptrain.train.optimizer import CollaborativeOptimizer
from p2ptrain.train.progress import ProgressConfig
from p2ptrain.train.tracker import ProgressTracker

DIM = 8

FAST_MATCHMAKING = MatchmakingConfig(
    window=2.0,
    poll_interval=0.05,
    ready_timeout=1.0,
    plan_timeout=3.0,
    reduce_timeout=2.0,
    round_timeout=3.0,
)
"""Matchmaking and all-reduce timings for loopback tests: a peer that crashed is
left out within seconds."""

PATIENT_MATCHMAKING = dataclasses.replace(
    FAST_MATCHMAKING,
    window=10.0,
    ready_timeout=10.0,
    plan_timeout=20.0,
    reduce_timeout=30.0,
    round_timeout=60.0,
)
"""The fast timings with the library's patience for a live but slow member.

The deadlines of FAST_MATCHMAKING are for leaving a crashed peer out
quickly; each member counts them from its own entry into the round, so on a
loaded machine a live member whose process was not scheduled for 2 s has its
part left out ("averaged only partly"), and one that announced itself more
than 2 s after the others was left out of the group. A test that needs every
live member in every round (nothing lost, nothing counted twice) uses these:
they are deadlines, not waits (gathering ends once the expected members
announced), so a test is no slower when nothing stalls."""


class WorkerProcess:
    """This script run as a training peer process (the tests' side); its JSON lines
    arrive in a queue."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__)), json.dumps(job)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(json.loads(line))
        self.lines.put(None)

    def next(self, timeout: float) -> dict[str, Any]:
        """The next line the worker printed (fails if it exited first)."""
        message = self.lines.get(timeout=timeout)
        assert message is not None, "the worker exited"
        return message

    def go(self) -> None:
        """Tell a worker started with ``wait_go`` to start training."""
        assert self.process.stdin is not None
        self.process.stdin.write(b"go\n")
        self.process.stdin.flush()

    def kill(self) -> None:
        """Kill the worker if it still runs, reap it and its reader."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._reader.join()


FAST_PROGRESS = ProgressConfig(
    publish_interval=0.1,
    heartbeat_interval=0.5,
    expiration=2.0,
    min_fetch_interval=0.05,
    max_fetch_interval=0.5,
)
"""Progress timings for loopback tests."""

PATIENT_PROGRESS = dataclasses.replace(FAST_PROGRESS, expiration=20.0)
"""FAST_PROGRESS, but a peer whose records stop for a while (a loaded
machine) still counts as live (see PATIENT_MATCHMAKING)."""


def peer_config(
    initial_peers: tuple[str, ...] = (), matchmaking: MatchmakingConfig = FAST_MATCHMAKING
) -> PeerConfig:
    """A loopback peer with the fast timings."""
    return PeerConfig(
        dht=DHTNodeConfig(initial_peers=initial_peers, request_timeout=2.0),
        matchmaking=matchmaking,
    )


@contextlib.contextmanager
def peer_with_absent_partner(*, window: float, run_id: str, target: int) -> Iterator[Peer]:
    """A started peer whose step groups wait ``window`` seconds for a second peer:
    one online in ``run_id`` at step 0 that never matchmakes (nor states a batch)."""
    slow = MatchmakingConfig(window=window, poll_interval=0.05)
    with Peer(PeerConfig(matchmaking=slow, probe_seconds=None)) as first:
        joined = PeerConfig(dht=DHTNodeConfig(initial_peers=(first.address,)), probe_seconds=None)
        with Peer(joined) as absent:
            tracker = ProgressTracker(
                dht=absent.dht,
                run_id=run_id,
                config=ProgressConfig(),
                target_batch_size=target,
                address=None,
            )
            absent.run(tracker.start(step=0), timeout=10)
            tracker.report(step=0, samples=0, samples_per_s=10.0, blocked=False)
            try:
                yield first
            finally:
                absent.run(tracker.aclose(), timeout=10)


def make_model(seed: int = 0) -> nn.Module:
    """The tiny MLP, initialised from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, 1))


def dataset(num_rows: int, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic regression rows ``(x, y)``: a smooth function plus a little noise."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, DIM, generator=generator)
    w = torch.randn(DIM, 1, generator=generator)
    y = torch.sin(x @ w / DIM**0.5) + 0.05 * torch.randn(num_rows, 1, generator=generator)
    return x, y


def rows(step: int, batch: int, *, shard: int = 0, num_shards: int = 1) -> slice:
    """The rows of ``shard`` at ``step`` (see the module docstring)."""
    start = step * num_shards * batch + shard * batch
    return slice(start, start + batch)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean squared error over the batch."""
    return nn.functional.mse_loss(model(x), y)


def backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """Backpropagate the loss of a batch."""
    loss_of(model, x, y).backward()  # type: ignore[no-untyped-call]


def digest(model: nn.Module) -> str:
    """The sha256 of the model's parameters' bytes (equal digests: identical parameters)."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _watch_stdin() -> None:
    sys.stdin.read()
    os._exit(0)


def main(job: dict[str, Any]) -> None:
    """Train one peer of the swarm described by ``job`` (see the module docstring)."""
    torch.set_num_threads(1)
    x, y = dataset(200_000)
    model = make_model(0)
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    extra = {"step_policy": job["policy"]} if "policy" in job else {}
    patient = bool(job.get("patient"))
    config = TrainerConfig(
        run_id=job["run_id"],
        target_batch_size=job["target"],
        progress=PATIENT_PROGRESS if patient else FAST_PROGRESS,
        **extra,
    )
    matchmaking = PATIENT_MATCHMAKING if patient else FAST_MATCHMAKING
    batch, shard, num_shards = job["batch"], job["shard"], job["num_shards"]
    with Peer(peer_config(tuple(job["initial_peers"]), matchmaking)) as peer:
        _emit({"address": peer.address})
        if job.get("wait_go") and sys.stdin.readline().strip() != "go":
            return
        threading.Thread(target=_watch_stdin, daemon=True).start()
        with CollaborativeOptimizer(inner, peer=peer, config=config) as opt:
            # Every peer in every group from the first step: start once all are seen.
            if patient and not opt.wait_for_peers(num_shards, 60.0):
                raise RuntimeError(f"fewer than {num_shards} peers online after 60 s")
            local = 0
            while opt.global_step < job["steps"]:
                part = rows(local % 1000, batch, shard=shard, num_shards=num_shards)
                backward(model, x[part], y[part])
                time.sleep(job["compute_s"])  # stands for a real model's compute time
                local += 1
                before = opt.global_step
                opt.step(batch)
                if opt.global_step != before:
                    record = opt.last_step
                    _emit(
                        {
                            "step": opt.global_step,
                            "t": time.time(),
                            "local_rounds": opt.stats.local_rounds,
                            "syncs": opt.stats.syncs,
                            "own": None if record is None else record.own,
                            "samples": None if record is None else record.samples,
                            "digest": digest(model),
                        }
                    )
            pending = opt.local_samples + opt.carried_samples
            _emit({"done": True, "computed": local * batch, "pending": pending})


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
