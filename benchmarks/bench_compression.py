"""Gradient compression: what each all-reduce codec costs in loss and saves in bytes.

    python -m benchmarks.bench_compression [--steps 150] [--png compression.png]

Two peers on loopback train the charlm example (the command line's default
task) from the same initial parameters, in one process, once per
configuration: codec ``none``, ``fp16``, ``bf16``, and ``int8`` without and
with error feedback (:mod:`p2ptrain.train.feedback`). Every global step holds
exactly two local batches (``max_local_samples_per_step``), so the runs see
the same samples in the same steps and differ only by the codec. Printed per
configuration: the held-out loss after the last step, its ratio to ``none``,
and the tensor bytes each peer sent per step, as a ratio to ``none``. The
last line is one JSON object with the rows and the configuration chosen as
the default: the fewest bytes whose loss is within ``--tolerance`` of
``none``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.harness import DefaultsHelpFormatter
from benchmarks.options import add_plot_argument
from p2ptrain.allreduce.config import AllReduceConfig
from p2ptrain.app.task import load_task, lr_schedule
from p2ptrain.dht.node_config import DHTNodeConfig
from p2ptrain.examples.charlm.data import load_corpus
from p2ptrain.examples.charlm.model import ModelConfig, loss
from p2ptrain.lab.timings import TRAINING_MATCHMAKING
from p2ptrain.peer import Peer, PeerConfig
from p2ptrain.train.config import TrainerConfig
from p2ptrain.train.optimizer import CollaborativeOptimizer
from p2ptrain.train.progress import ProgressConfig

CONFIGS = (
    ("none", "none", False),
    ("fp16", "fp16", False),
    ("bf16", "bf16", False),
    ("int8", "int8", False),
    ("int8+ef", "int8", True),
)
PROGRESS = ProgressConfig(
    publish_interval=0.05, heartbeat_interval=1.0, min_fetch_interval=0.05, max_fetch_interval=0.5
)


@dataclass(frozen=True)
class Row:
    """One configuration's outcome."""

    name: str
    held_out_loss: float
    bytes_per_step: float
    steps: int
    seconds: float


def held_out(model: torch.nn.Module, windows: torch.Tensor) -> float:
    with torch.no_grad():
        return float(loss(model, windows))


def train_one(name: str, codec: str, feedback: bool, args: argparse.Namespace) -> Row:
    first = Peer(
        PeerConfig(dht=DHTNodeConfig(), matchmaking=TRAINING_MATCHMAKING, probe_seconds=None)
    )
    first.start()
    second = Peer(
        PeerConfig(
            dht=DHTNodeConfig(initial_peers=(first.address,)),
            matchmaking=TRAINING_MATCHMAKING,
            probe_seconds=None,
        )
    )
    second.start()
    try:
        tasks = []
        for _ in range(2):
            torch.manual_seed(args.seed)  # the same initial parameters on both peers
            tasks.append(load_task(None))
        config = TrainerConfig(
            run_id=f"compression-{name}",
            target_batch_size=2 * args.batch_size,
            max_local_samples_per_step=args.batch_size,
            allreduce=AllReduceConfig(codec=codec),
            error_feedback=feedback,
            progress=PROGRESS,
        )
        trainers = [
            CollaborativeOptimizer(task.optimizer, peer=peer, config=config, model=task.model)
            for task, peer in zip(tasks, (first, second), strict=True)
        ]
        for trainer in trainers:
            trainer.start()
        started = time.perf_counter()

        def run(shard: int) -> None:
            task, trainer = tasks[shard], trainers[shard]
            schedule = lr_schedule(task)
            index = 0
            while trainer.global_step < args.steps:
                schedule(trainer.global_step)
                task.loss(task.batch(index, args.batch_size, shard=shard, num_shards=2)).backward()
                trainer.step(args.batch_size)
                index += 1

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for future in [pool.submit(run, shard) for shard in range(2)]:
                future.result(timeout=args.timeout)
        seconds = time.perf_counter() - started
        for trainer in trainers:
            trainer.close()
        windows = load_corpus().validation_windows(args.eval_windows, seq_len=ModelConfig().context)
        sent = max(trainer.stats.bytes_sent for trainer in trainers)
        return Row(
            name=name,
            held_out_loss=held_out(tasks[0].model, windows),
            bytes_per_step=sent / max(1, trainers[0].global_step),
            steps=trainers[0].global_step,
            seconds=seconds,
        )
    finally:
        second.close()
        first.close()


def choose(rows: list[Row], tolerance: float) -> str:
    """The configuration with the fewest bytes whose loss is within ``tolerance`` of none."""
    base = rows[0].held_out_loss
    fit = [r for r in rows if r.held_out_loss <= base * (1 + tolerance)]
    return min(fit, key=lambda r: r.bytes_per_step).name


def plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for row in rows:
        ax.scatter(row.bytes_per_step / 1e6, row.held_out_loss)
        ax.annotate(row.name, (row.bytes_per_step / 1e6, row.held_out_loss))
    ax.set_xlabel("MB sent per peer per step")
    ax.set_ylabel("held-out loss")
    ax.set_title("all-reduce codecs, charlm, 2 peers")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=150, help="global steps per configuration")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per local batch")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial parameters")
    parser.add_argument(
        "--eval-windows", type=int, default=256, help="held-out windows for the loss"
    )
    parser.add_argument(
        "--tolerance", type=float, default=0.01, help="loss ratio to none a default may have"
    )
    parser.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds one configuration may take"
    )
    add_plot_argument(parser, "loss against bytes")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for name, codec, feedback in CONFIGS:
        row = train_one(name, codec, feedback, args)
        print(f"  {name:8} done: {row.steps} steps in {row.seconds:.0f} s", file=sys.stderr)
        rows.append(row)
    base = rows[0]
    print(
        f"charlm, 2 peers on loopback, {args.steps} global steps of "
        f"2 x {args.batch_size} samples, the same samples in every run"
    )
    print(f"{'codec':10} {'held-out loss':>13} {'vs none':>8} {'kB/step':>9} {'vs none':>8}")
    for row in rows:
        print(
            f"{row.name:10} {row.held_out_loss:13.4f} {row.held_out_loss / base.held_out_loss:8.3f}"
            f" {row.bytes_per_step / 1e3:9.1f} {row.bytes_per_step / base.bytes_per_step:8.3f}"
        )
    chosen = choose(rows, args.tolerance)
    print(f"default by this measurement (loss within {args.tolerance:.0%}, fewest bytes): {chosen}")
    if args.png:
        plot(rows, args.png)
        print(f"PNG: {args.png}")
    result: dict[str, Any] = {
        "compression": {
            "steps": args.steps,
            "rows": [
                {
                    "codec": r.name,
                    "held_out_loss": r.held_out_loss,
                    "loss_ratio": r.held_out_loss / base.held_out_loss,
                    "bytes_per_step": r.bytes_per_step,
                    "bytes_ratio": r.bytes_per_step / base.bytes_per_step,
                }
                for r in rows
            ],
            "chosen": chosen,
        }
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
