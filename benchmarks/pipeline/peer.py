"""One p2ptrain pipeline process of ``bench_pipeline.py``: a stage server or the trainer.

    python benchmarks/pipeline/peer.py trainer --run R [--join ADDR] [model flags] ...
    python benchmarks/pipeline/peer.py server --run R --join ADDR --stage S [--floor-s F]
        [--rebalance-s P] [model flags]

Both print JSON lines on stdout. The trainer (also the swarm's first DHT
peer) prints ``{"address"}`` once, then one ``{"delivered", "time", "loss",
"retries"}`` per completed micro-batch; in ``--lockstep`` mode it pushes one
step's micro-batches at a time and waits until every stage announces the
next global step (the loss comparison), else it keeps ``--in-flight``
micro-batches going (throughput). A server prints ``{"ready"}`` and then,
every second, ``{"stage", "samples_per_s", "step", "moves"}``; with
``--rebalance-s`` it runs a :class:`p2ptrain.swarm.rebalance.Rebalancer`.
A process ends when its stdin closes (or it is killed).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import os
import random
import sys
import threading
import time

import torch

from benchmarks.pipeline.model import PipelineModel, batch, block_factory
from benchmarks.pipeline.torch_stage import model_flags, model_from
from p2ptrain.allreduce.matchmaking import MatchmakingConfig
from p2ptrain.dht.node_config import DHTNodeConfig
from p2ptrain.lab.timings import QUICK_MATCHMAKING, QUICK_PROGRESS
from p2ptrain.peer import Peer, PeerConfig
from p2ptrain.swarm import (
    PipelineModel as SwarmModel,
)
from p2ptrain.swarm import (
    PipelineTrainer,
    PipelineTrainerConfig,
    StageServer,
    StageServerConfig,
    even_bounds,
    read_stage,
)
from p2ptrain.swarm.rebalance import RebalanceConfig, Rebalancer, read_loads


def swarm_model(model: PipelineModel) -> SwarmModel:
    """The benchmark's model as the pipeline library takes it (same blocks, same seeds)."""
    factories = tuple((lambda i=i: block_factory(model, i)) for i in range(model.depth))
    return SwarmModel(factories, even_bounds(model.depth, model.stages), seed=model.seed)


def _emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def _watch_stdin() -> tuple[threading.Event, threading.Event]:
    """(a line arrived, stdin closed)."""
    line, closed = threading.Event(), threading.Event()

    def read() -> None:
        for _ in sys.stdin:
            line.set()
        line.set()
        closed.set()

    threading.Thread(target=read, daemon=True).start()
    return line, closed


def _freeze_startup_objects() -> None:
    """Leave what startup built (torch's ~350k objects, the model) out of later collections.

    The node's memory release runs a full collection on its loop every
    ``memory_release_interval`` (10 s): 0.4 to 0.6 s here with everything
    tracked, a stall of every call and reply of the process; a few ms once
    frozen. ``torch.distributed.pipelining``'s processes run no such pass.
    """
    gc.collect()
    gc.freeze()


def _peer(join: str | None, *, fast: bool = True) -> Peer:
    initial = (join,) if join else ()
    peer = Peer(
        PeerConfig(
            nat=None,
            probe_seconds=None,
            matchmaking=QUICK_MATCHMAKING if fast else MatchmakingConfig(),
            dht=DHTNodeConfig(initial_peers=initial, request_timeout=2.0),
        )
    )
    peer.start()
    return peer


def serve(args: argparse.Namespace, model: PipelineModel) -> None:
    fast = not args.default_intervals
    peer = _peer(args.join, fast=fast)
    config = StageServerConfig(
        run_id=args.run, target_batch_size=model.batch, min_compute_s=args.floor_s
    )
    if fast:
        config = dataclasses.replace(
            config,
            progress=QUICK_PROGRESS,
            announce_interval=0.5,
            announce_ttl=3.0,
            step_interval=0.1,
        )
    server = StageServer(
        peer=peer,
        model=swarm_model(model),
        stage=args.stage,
        make_optimizer=lambda ps: torch.optim.SGD(ps, lr=model.lr),
        config=config,
    )
    _, closed = _watch_stdin()
    server.start()
    _freeze_startup_objects()
    _emit(ready=peer.address, pid=os.getpid())
    rebalancing = None
    if args.rebalance_s > 0:
        rebalancer = Rebalancer(
            me=str(peer.peer_id),
            config=RebalanceConfig(stages=model.stages, period_s=args.rebalance_s),
            read_loads=lambda: read_loads(peer.dht, args.run, model.stages),
            move_to=server.move_to,
            rng=random.Random(os.getpid()),
        )
        rebalancing = peer.submit(rebalancer.run())
    while not closed.wait(1.0):
        _emit(
            stage=server.stage,
            samples_per_s=server.samples_per_s,
            step=server.global_step,
            moves=server.stats.moves,
            time=time.time(),
        )
    if rebalancing is not None:
        rebalancing.cancel()
    server.close()
    peer.close()


async def _steps_reached(peer: Peer, run: str, stages: int, step: int, timeout: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        found = await asyncio.gather(*(read_stage(peer.dht, run, s) for s in range(stages)))
        if all(entries and min(a.step for a in entries) >= step for entries in found):
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"the stages did not all reach step {step}")


async def _train(
    args: argparse.Namespace, model: PipelineModel, trainer: PipelineTrainer, peer: Peer
) -> None:
    per = model.batch // model.microbatches
    batches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    async def micro(step: int, index: int) -> None:
        # Each step's batch is drawn once, as each torch stage does (not once per
        # micro-batch: on the loop that serves the trainer's calls).
        if step not in batches:
            batches[step] = batch(model, step)
            batches.pop(step - 4, None)
        x, y = batches[step]
        part = slice(index * per, (index + 1) * per)
        loss = await trainer.train_micro_batch(x[part], y[part])
        _emit(
            step=step,
            delivered=trainer.stats.samples_delivered,
            time=time.time(),
            loss=loss,
            retries=trainer.stats.retries,
        )

    if args.lockstep:
        for step in range(args.steps):
            await asyncio.gather(*(micro(step, i) for i in range(model.microbatches)))
            await _steps_reached(peer, args.run, model.stages, step + 1, timeout=60)
        return
    queue: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
    for step in range(args.steps):
        for i in range(model.microbatches):
            queue.put_nowait((step, i))

    async def worker() -> None:
        while not queue.empty():
            await micro(*queue.get_nowait())

    await asyncio.gather(*(worker() for _ in range(args.in_flight)))


def train(args: argparse.Namespace, model: PipelineModel) -> None:
    peer = _peer(args.join, fast=not args.default_intervals)
    _emit(address=peer.address)
    trainer = PipelineTrainer(
        peer=peer,
        config=PipelineTrainerConfig(
            run_id=args.run,
            num_stages=model.stages,
            call_timeout=5.0,
            retry_interval=0.1,
            refresh_interval=1.0 if args.default_intervals else 0.5,
        ),
        loss=torch.nn.functional.mse_loss,
        seed=0,
    )
    go, closed = _watch_stdin()
    _freeze_startup_objects()
    if args.wait_go:
        go.wait()
    future = peer.submit(_train(args, model, trainer, peer))
    while not future.done() and not closed.is_set():
        time.sleep(0.1)
    if future.done():
        future.result()
    _emit(done=True, delivered=trainer.stats.samples_delivered, retries=trainer.stats.retries)
    peer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("role", choices=("trainer", "server"), help="what this process runs")
    parser.add_argument("--run", default="bench-pipeline", help="pipeline run id")
    parser.add_argument("--join", default=None, help="a peer's address to join through")
    parser.add_argument("--stage", type=int, default=0, help="server: the stage served first")
    parser.add_argument("--floor-s", type=float, default=0.0, help="server: compute floor")
    parser.add_argument("--rebalance-s", type=float, default=0.0, help="server: rebalance period")
    parser.add_argument("--steps", type=int, default=20, help="trainer: steps to push")
    parser.add_argument(
        "--in-flight", type=int, default=8, help="trainer: concurrent micro-batches"
    )
    parser.add_argument("--lockstep", action="store_true", help="trainer: one step at a time")
    parser.add_argument(
        "--default-intervals",
        action="store_true",
        help="the library's default progress, announcement, step and refresh intervals"
        " (not the fast ones that let a kill be noticed within seconds)",
    )
    parser.add_argument("--wait-go", action="store_true", help="trainer: start on a stdin line")
    model_flags(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = model_from(args)
    if args.role == "server":
        serve(args, model)
    else:
        train(args, model)


if __name__ == "__main__":
    main()
