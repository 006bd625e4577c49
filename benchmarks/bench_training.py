"""Benchmark collaborative training: a 4-peer swarm on loopback against one process.

Trains the character transformer of ``p2ptrain.examples.charlm`` (432k parameters, a
1.7 MB gradient) with AdamW in three ways and reports samples per second:

* ``single``: one process, no networking, batches of ``--batch`` samples;
* ``plain``: ``--peers`` processes with a :class:`CollaborativeOptimizer`,
  batches of ``--batch``, one swarm step per ``--batches-per-step`` batches of
  every peer (``target_batch_size`` = peers × batch × batches-per-step);
* ``diloco``: the same peers with a :class:`DiLoCoOptimizer`, an outer step
  every ``--inner-steps`` local steps.

Every peer process uses one torch thread and starts training when the parent
says go; a swarm run ends when every peer reached ``--steps`` (plain) or
``--rounds`` (DiLoCo) global steps. Swarm samples/s is all peers' samples over
the longest peer's wall time. The communication fraction is, averaged over
the peers, the share of wall time the training thread spent blocked in
averaging (matchmaking not hidden by early matchmaking, and the all-reduce)
or downloading state; the wait fraction is the share spent waiting for
slower peers (a DiLoCo peer that finished its H steps waits for the others).
"MB sent/100 steps" is what a peer sends per 100 of its local batches.

The machine's cores are shared by all peers: with 4 peers on 2 cores, a swarm
cannot compute more than 2 cores' worth, whatever the protocol does.

Prints a table, then as its last line one JSON object with
``swarm_samples_per_s``, ``single_samples_per_s``, ``comm_fraction`` and
``diloco_comm_fraction`` (plus details).

Usage::

    python benchmarks/bench_training.py [--peers 4] [--batch 16] [--steps 8]
        [--batches-per-step 4] [--inner-steps 20] [--rounds 3] [--single-batches 60]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the example model lives at the repository root
    sys.path.insert(0, str(ROOT))

from benchmarks._common import DefaultsHelpFormatter, emit_json, format_table

START_TIMEOUT = 120.0


# -- the worker -----------------------------------------------------------------------------


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _corpus_and_model() -> tuple[Any, Any, Any, Any]:
    import torch

    from p2ptrain.examples.charlm.data import load_corpus
    from p2ptrain.examples.charlm.model import ModelConfig, loss, make_model, make_optimizer

    torch.set_num_threads(1)
    config = ModelConfig()
    model = make_model(config)
    sampler = load_corpus().sampler(seq_len=config.context, seed=0)
    return model, make_optimizer(model), sampler, loss


def run_single(job: dict[str, Any]) -> dict[str, Any]:
    """One process training alone."""
    model, inner, sampler, loss = _corpus_and_model()
    started = time.perf_counter()
    last = 0.0
    for step in range(job["batches"]):
        value = loss(model, sampler.batch(step, job["batch"]))
        value.backward()
        inner.step()
        inner.zero_grad()
        last = value.item()
    wall = time.perf_counter() - started
    return {"samples": job["batches"] * job["batch"], "wall": wall, "loss": last}


def run_peer(job: dict[str, Any]) -> dict[str, Any]:
    """One peer of a swarm; trains from "go" on stdin until the goal step."""
    from p2ptrain.allreduce.matchmaking import MatchmakingConfig
    from p2ptrain.dht.node_config import DHTNodeConfig
    from p2ptrain.peer import Peer, PeerConfig
    from p2ptrain.train import (
        CollaborativeOptimizer,
        DiLoCoConfig,
        DiLoCoOptimizer,
        ProgressConfig,
        TrainerConfig,
    )
    from p2ptrain.train.base import SwarmTrainer

    model, inner, sampler, loss = _corpus_and_model()
    progress = ProgressConfig(
        publish_interval=0.2,
        heartbeat_interval=1.0,
        expiration=5.0,
        min_fetch_interval=0.05,
        max_fetch_interval=1.0,
    )
    peer_config = PeerConfig(
        dht=DHTNodeConfig(initial_peers=tuple(job["initial_peers"])),
        matchmaking=MatchmakingConfig(window=2.0, poll_interval=0.05, plan_timeout=5.0),
    )
    with Peer(peer_config) as peer:
        _emit({"address": peer.address})
        if sys.stdin.readline().strip() != "go":
            return {}
        trainer: SwarmTrainer
        if job["mode"] == "diloco":
            config = DiLoCoConfig(
                run_id="bench-diloco", inner_steps=job["inner_steps"], progress=progress
            )
            trainer = DiLoCoOptimizer(inner, peer=peer, config=config)
        else:
            cfg = TrainerConfig(
                run_id="bench-plain", target_batch_size=job["target"], progress=progress
            )
            trainer = CollaborativeOptimizer(inner, peer=peer, config=cfg)
        shard, shards, batch = job["shard"], job["peers"], job["batch"]
        started = time.perf_counter()
        local, last = 0, 0.0
        with trainer:
            while trainer.global_step < job["goal"]:
                value = loss(model, sampler.batch(local, batch, shard=shard, num_shards=shards))
                value.backward()
                last = value.item()
                local += 1
                trainer.step(batch)
            wall = time.perf_counter() - started
            stats = trainer.stats
        return {
            "samples": local * batch,
            "batch": batch,
            "wall": wall,
            "communication_s": stats.communication_s,
            "averaging_s": stats.averaging_s,
            "waiting_s": stats.waiting_s,
            "sync_s": stats.sync_s,
            "matchmaking_s": stats.matchmaking_s,
            "allreduce_s": stats.allreduce_s,
            "bytes_sent": stats.bytes_sent,
            "rounds": stats.rounds,
            "local_rounds": stats.local_rounds,
            "syncs": stats.syncs,
            "loss": last,
        }


def worker_main(job: dict[str, Any]) -> None:
    """Entry point of a child process."""
    result = run_single(job) if job["mode"] == "single" else run_peer(job)
    _emit({"result": result})


# -- the parent -----------------------------------------------------------------------------


class Child:
    """A worker process whose stdout lines are read by a thread."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--worker", json.dumps(job)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        self.lines: list[dict[str, Any]] = []
        self._ready = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._ready:
                self.lines.append(json.loads(line))
                self._ready.notify_all()
        with self._ready:
            self.lines.append({})
            self._ready.notify_all()

    def wait_for(self, key: str, timeout: float) -> Any:
        with self._ready:
            found = self._ready.wait_for(
                lambda: any(key in m or not m for m in self.lines), timeout
            )
            for message in self.lines:
                if key in message:
                    return message[key]
        raise RuntimeError(f"worker exited or timed out before sending {key!r} ({found})")

    def send(self, text: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(text + "\n")
        self.process.stdin.flush()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def run_swarm(args: argparse.Namespace, mode: str) -> list[dict[str, Any]]:
    """Start the peers, say go, and collect every peer's result."""
    goal = args.steps if mode == "plain" else args.rounds
    base = {
        "mode": mode,
        "peers": args.peers,
        "batch": args.batch,
        "target": args.peers * args.batch * args.batches_per_step,
        "inner_steps": args.inner_steps,
        "goal": goal,
    }
    children: list[Child] = []
    try:
        children.append(Child({**base, "shard": 0, "initial_peers": []}))
        first = children[0].wait_for("address", START_TIMEOUT)
        for shard in range(1, args.peers):
            children.append(Child({**base, "shard": shard, "initial_peers": [first]}))
        for child in children:
            child.wait_for("address", START_TIMEOUT)
        for child in children:
            child.send("go")
        limit = START_TIMEOUT + 60.0 * goal
        return [child.wait_for("result", limit) for child in children]
    finally:
        for child in children:
            child.close()


def args_batch(results: list[dict[str, Any]]) -> int:
    """The per-peer batch size the results were computed with."""
    return int(results[0]["batch"])


def summarize(name: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    samples = sum(r["samples"] for r in results)
    wall = max(r["wall"] for r in results)
    count = len(results)
    comm = sum((r["averaging_s"] + r["sync_s"]) / r["wall"] for r in results) / count
    wait = sum(r["waiting_s"] / r["wall"] for r in results) / count
    local_steps = sum(r["samples"] for r in results) / args_batch(results)
    sent = sum(r["bytes_sent"] for r in results)
    return {
        "mode": name,
        "samples_per_s": samples / wall,
        "comm_fraction": comm,
        "wait_fraction": wait,
        "bytes_sent_per_peer": sent / count,
        "mb_per_100_local_steps": sent / local_steps * 100 / 1e6,
        "rounds": max(r["rounds"] for r in results),
        "local_rounds": sum(r["local_rounds"] for r in results),
        "wall_s": wall,
        "loss": sum(r["loss"] for r in results) / len(results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--peers", type=int, default=4, help="peers of the swarm")
    parser.add_argument("--batch", type=int, default=16, help="local batch of every peer")
    parser.add_argument("--steps", type=int, default=8, help="swarm steps of the plain run")
    parser.add_argument(
        "--batches-per-step", type=int, default=4, help="local batches per peer per swarm step"
    )
    parser.add_argument("--inner-steps", type=int, default=20, help="H of the DiLoCo run")
    parser.add_argument("--rounds", type=int, default=3, help="outer steps of the DiLoCo run")
    parser.add_argument(
        "--single-batches", type=int, default=60, help="batches of the one-process baseline"
    )
    args = parser.parse_args()
    if args.worker is not None:
        worker_main(json.loads(args.worker))
        return

    single_child = Child({"mode": "single", "batch": args.batch, "batches": args.single_batches})
    try:
        single = single_child.wait_for("result", START_TIMEOUT + 10.0 * args.single_batches)
    finally:
        single_child.close()
    single_rate = single["samples"] / single["wall"]
    plain = summarize("plain", run_swarm(args, "plain"))
    diloco = summarize("diloco", run_swarm(args, "diloco"))

    rows: list[list[object]] = [
        ["single process", single_rate, None, None, None, None, single["wall"], single["loss"]],
    ]
    for result in (plain, diloco):
        rows.append(
            [
                f"{args.peers} peers, {result['mode']}",
                result["samples_per_s"],
                result["comm_fraction"],
                result["wait_fraction"],
                result["mb_per_100_local_steps"],
                result["rounds"],
                result["wall_s"],
                result["loss"],
            ]
        )
    print(
        f"charlm, batch {args.batch} per peer, {os.cpu_count()} cores; plain: target "
        f"{args.peers * args.batch * args.batches_per_step}; DiLoCo: H = {args.inner_steps}"
    )
    print(
        format_table(
            [
                "run",
                "samples/s",
                "comm fraction",
                "wait fraction",
                "MB sent/100 steps",
                "rounds",
                "wall s",
                "loss",
            ],
            rows,
        )
    )
    emit_json(
        {
            "swarm_samples_per_s": plain["samples_per_s"],
            "single_samples_per_s": single_rate,
            "comm_fraction": plain["comm_fraction"],
            "diloco_comm_fraction": diloco["comm_fraction"],
            "diloco_samples_per_s": diloco["samples_per_s"],
            "wait_fraction": plain["wait_fraction"],
            "diloco_wait_fraction": diloco["wait_fraction"],
            "plain": plain,
            "diloco": diloco,
            "peers": args.peers,
            "cores": os.cpu_count(),
        }
    )


if __name__ == "__main__":
    main()
