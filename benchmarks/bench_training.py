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

    python -m benchmarks.bench_training [--peers 4] [--batch 16] [--steps 8]
        [--batches-per-step 4] [--inner-steps 20] [--rounds 3] [--single-batches 60]

``--equivalence`` measures instead whether a step holds the batch the user set
(issue 21): ``--peers`` processes train the charlm task through the library
API (the command line's matchmaking and progress settings, the task's
warm-up schedule) for ``--steps`` global steps at ``--target``, each peer
with local batches of ``--batch``; the same swarm runs again with the step
cut off (``step_policy="unbounded"``, the old behaviour); one process trains
the same task from the same seed with batch = target for as many samples as
the swarm counted. The table shows samples per step (mean, max, first step;
summed from every peer's own share of each step), the held-out loss at 25,
50 and 100 % of the samples for both, and samples/s. ``--also 8x256,4x1024``
adds swarm runs of other sizes (``peers x target``) to the ``runs`` list::

    python -m benchmarks.bench_training --equivalence --peers 4 --target 256 \
        --batch 16 --steps 100 --also 8x256,4x1024

``--wan`` (root: network namespaces) trains a larger charlm on 4 peers behind
shaped home links (50 up / 100 down Mbit/s, 20 ms RTT) with p2ptrain's
synchronous, overlapped and DiLoCo trainers and with hivemind.Optimizer
(run by ``--hivemind-python``, default this interpreter; left out with a
printed reason where it cannot import hivemind, or with ``--no-hivemind``),
and reports per
system samples/s, communication fraction, MB sent per peer and the time to
a fixed held-out loss, with ratios against hivemind (``training/runner.py``)::

    python -m benchmarks.bench_training --wan [--steps 20] [--png wan.png] \
        [--hivemind-python PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from benchmarks.harness import DefaultsHelpFormatter, JsonChild, emit_json, format_table
from benchmarks.training.runner import add_wan_arguments, run_wan

START_TIMEOUT = 120.0


# -- the worker -----------------------------------------------------------------------------


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _corpus_and_model(job: dict[str, Any] | None = None) -> tuple[Any, Any, Any, Any]:
    """The charlm model (``job``'s shape and device, else the example's on the CPU), its
    optimizer, the corpus sampler, and a loss that moves each batch to the model's device."""
    import torch

    from p2ptrain.examples.charlm.data import load_corpus
    from p2ptrain.examples.charlm.model import ModelConfig, loss, make_model, make_optimizer

    torch.set_num_threads(1)
    job = job or {}
    shape = {k: job[n] for k, n in _SHAPE.items() if job.get(n) is not None}
    config = ModelConfig(**shape)
    device = torch.device(job.get("device", "cpu"))
    model = make_model(config).to(device)
    sampler = load_corpus().sampler(seq_len=config.context, seed=0)

    def device_loss(model: Any, batch: Any) -> Any:
        return loss(model, batch.to(device, non_blocking=True))

    return model, make_optimizer(model), sampler, device_loss


_SHAPE = {"d_model": "width", "n_layers": "layers", "n_heads": "heads"}


def run_single(job: dict[str, Any]) -> dict[str, Any]:
    """One process training alone."""
    model, inner, sampler, loss = _corpus_and_model(job)
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
    from p2ptrain.dht.node_config import DHTNodeConfig
    from p2ptrain.lab.timings import TRAINING_MATCHMAKING
    from p2ptrain.peer import Peer, PeerConfig
    from p2ptrain.train import (
        CollaborativeOptimizer,
        DiLoCoConfig,
        DiLoCoOptimizer,
        ProgressConfig,
        TrainerConfig,
    )
    from p2ptrain.train.base import SwarmTrainer

    model, inner, sampler, loss = _corpus_and_model(job)
    progress = ProgressConfig(
        publish_interval=0.2,
        heartbeat_interval=1.0,
        expiration=5.0,
        min_fetch_interval=0.05,
        max_fetch_interval=1.0,
    )
    peer_config = PeerConfig(
        dht=DHTNodeConfig(initial_peers=tuple(job["initial_peers"])),
        matchmaking=TRAINING_MATCHMAKING,
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
            trainer = DiLoCoOptimizer(inner, peer=peer, config=config, model=model)
        else:
            cfg = TrainerConfig(
                run_id="bench-plain", target_batch_size=job["target"], progress=progress
            )
            trainer = CollaborativeOptimizer(inner, peer=peer, config=cfg, model=model)
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


EVAL_WINDOWS = 256
FRACTIONS = (0.25, 0.5, 1.0)


def _eval_windows() -> Any:
    from p2ptrain.examples.charlm.data import load_corpus
    from p2ptrain.examples.charlm.model import ModelConfig

    return load_corpus().validation_windows(EVAL_WINDOWS, seq_len=ModelConfig().context)


def _cut_points(totals: list[int]) -> list[int]:
    """For each fraction, the number of steps whose cumulative samples come nearest to it."""
    whole = sum(totals)
    cumulative = [0]
    for samples in totals:
        cumulative.append(cumulative[-1] + samples)
    return [
        max(1, min(range(len(cumulative)), key=lambda k: abs(cumulative[k] - f * whole)))
        for f in FRACTIONS
    ]


def run_equivalence_single(job: dict[str, Any]) -> dict[str, Any]:
    """One process, batch = target; held-out loss at the fractions of each of ``job["samples"]``.

    ``job["samples"]`` lists the sample counts of the swarm runs compared (one
    process trains for the largest); ``losses`` maps each count, as a string,
    to the losses at its fractions."""
    import torch

    from p2ptrain.app.task import load_task, lr_schedule
    from p2ptrain.examples.charlm.model import evaluate

    torch.set_num_threads(1)
    task = load_task(None)
    schedule = lr_schedule(task)
    windows = _eval_windows()
    target, counts = job["target"], job["samples"]
    steps = max(1, round(max(counts) / target))
    points: dict[int, list[tuple[str, float]]] = {}
    for samples in counts:
        for f in FRACTIONS:
            points.setdefault(max(1, round(f * samples / target)), []).append((str(samples), f))
    losses: dict[str, dict[str, float]] = {str(samples): {} for samples in counts}
    started = time.perf_counter()
    compute = 0.0
    for step in range(steps):
        schedule(step)
        tic = time.perf_counter()
        value = task.loss(task.batch(step, target, shard=0, num_shards=1))
        value.backward()  # type: ignore[no-untyped-call]
        task.optimizer.step()
        task.optimizer.zero_grad()
        compute += time.perf_counter() - tic
        if step + 1 in points:
            value_at = evaluate(task.model, windows)
            for key, f in points[step + 1]:
                losses[key][str(f)] = value_at
    return {
        "samples": steps * target,
        "steps": steps,
        "wall": time.perf_counter() - started,
        "compute_s": compute,
        "losses": losses,
    }


def run_equivalence_peer(job: dict[str, Any]) -> dict[str, Any]:
    """One peer of an equivalence swarm; trains the charlm task until the goal step."""
    import torch

    from p2ptrain.app.task import load_task, lr_schedule
    from p2ptrain.app.train import TrainingSessionConfig
    from p2ptrain.dht.node_config import DHTNodeConfig
    from p2ptrain.examples.charlm.model import evaluate
    from p2ptrain.lab.timings import TRAINING_MATCHMAKING
    from p2ptrain.peer import Peer, PeerConfig
    from p2ptrain.train import CollaborativeOptimizer, TrainerConfig

    torch.set_num_threads(1)
    task = load_task(None)
    schedule = lr_schedule(task)
    peer_config = PeerConfig(
        dht=DHTNodeConfig(initial_peers=tuple(job["initial_peers"])),
        matchmaking=TRAINING_MATCHMAKING,
    )
    keep = job["shard"] == 0  # this peer keeps the parameters of every step for the losses
    params = list(task.model.parameters())
    kept: list[list[Any]] = [[p.detach().clone() for p in params]]
    with Peer(peer_config) as peer:
        _emit({"address": peer.address})
        if sys.stdin.readline().strip() != "go":
            return {}
        cfg = TrainerConfig(
            run_id=job["run_id"],
            target_batch_size=job["target"],
            step_policy=job["policy"],
            carry_batches=job["carry_batches"],
            progress=TrainingSessionConfig(initial_peers=()).progress,
        )
        shard, shards, batch = job["shard"], job["peers"], job["batch"]
        steps: list[list[Any]] = []
        timeline: list[list[Any]] = []  # per step: step, entered, returned, mm s, allreduce s
        local = 0
        started = time.perf_counter()
        with CollaborativeOptimizer(task.optimizer, peer=peer, config=cfg) as trainer:
            last = None
            while trainer.global_step < job["goal"]:
                schedule(trainer.global_step)
                value = task.loss(task.batch(local, batch, shard=shard, num_shards=shards))
                value.backward()  # type: ignore[no-untyped-call]
                local += 1
                entered = time.time()
                before = trainer.stats
                trainer.step(batch)
                record = trainer.last_step
                if record is not None and record is not last:
                    last = record
                    steps.append([record.step, record.own, record.samples, trainer.local_samples])
                    after = trainer.stats
                    timeline.append(
                        [
                            record.step,
                            entered,
                            time.time(),
                            after.matchmaking_s - before.matchmaking_s,
                            after.allreduce_s - before.allreduce_s,
                        ]
                    )
                    if keep:
                        kept.append([p.detach().clone() for p in params])
            wall = time.perf_counter() - started
            stats = trainer.stats
            pending = trainer.local_samples + trainer.carried_samples
        losses: dict[str, float] = {}
        if keep:
            totals = [s[2] if s[2] is not None else 0 for s in steps]
            windows = _eval_windows()
            with torch.no_grad():
                for fraction, point in zip(FRACTIONS, _cut_points(totals), strict=True):
                    for p, value in zip(params, kept[point], strict=True):
                        p.copy_(value)
                    losses[str(fraction)] = evaluate(task.model, windows)
        return {
            "samples": local * batch,
            "pending": pending,
            "wall": wall,
            "steps": steps,
            "syncs": stats.syncs,
            "local_rounds": stats.local_rounds,
            "waiting_s": stats.waiting_s,
            "averaging_s": stats.averaging_s,
            "matchmaking_s": stats.matchmaking_s,
            "allreduce_s": stats.allreduce_s,
            "timeline": timeline,
            "losses": losses,
        }


def worker_main(job: dict[str, Any]) -> None:
    """Entry point of a child process.

    ``P2PTRAIN_BENCH_DEBUG=name,name`` logs those loggers at DEBUG to stderr,
    with times, e.g. ``p2ptrain.train,p2ptrain.allreduce.matchmaking``;
    ``P2PTRAIN_BENCH_TIMELINE=path`` writes each equivalence peer's per-step
    timeline (step, entered, returned, matchmaking s, all-reduce s) there."""
    debug = os.environ.get("P2PTRAIN_BENCH_DEBUG")
    if debug:
        import logging

        logging.basicConfig(format=f"%(created).3f {job.get('shard', '-')} %(name)s %(message)s")
        for name in debug.split(","):
            logging.getLogger(name).setLevel(logging.DEBUG)
    runners = {
        "single": run_single,
        "eqsingle": run_equivalence_single,
        "eqpeer": run_equivalence_peer,
    }
    result = runners.get(job["mode"], run_peer)(job)
    _emit({"result": result})


# -- the parent -----------------------------------------------------------------------------


def model_job(args: argparse.Namespace) -> dict[str, Any]:
    """The model's shape and device, as the default mode's workers read them."""
    return {
        "device": args.device,
        "width": args.width,
        "layers": args.layers,
        "heads": args.heads,
    }


class Child(JsonChild):
    """A ``--worker`` process of this script."""

    def __init__(self, job: dict[str, Any]) -> None:
        super().__init__("benchmarks.bench_training", ["--worker", json.dumps(job)])


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
        **model_job(args),
    }
    return start_swarm(base, args.peers, START_TIMEOUT + 60.0 * goal)


def start_swarm(base: dict[str, Any], peers: int, limit: float) -> list[dict[str, Any]]:
    """Start ``peers`` workers of job ``base``, say go, and collect their results."""
    children: list[Child] = []
    try:
        children.append(Child({**base, "shard": 0, "initial_peers": []}))
        first = children[0].wait_for("address", START_TIMEOUT)
        for shard in range(1, peers):
            children.append(Child({**base, "shard": shard, "initial_peers": [first]}))
        for child in children:
            child.wait_for("address", START_TIMEOUT)
        for child in children:
            child.send("go")
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


def summarize_equivalence(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Samples per step (each step's total summed from every peer's share), rate, losses."""
    shares: dict[int, int] = {}
    marker: dict[int, int | None] = {}
    for result in results:
        for step, own, total, _carried in result["steps"]:
            shares[step] = shares.get(step, 0) + own
            marker.setdefault(step, total)
    steps = sorted(shares)
    totals = [shares[s] for s in steps]
    computed = sum(r["samples"] for r in results)
    pending = sum(r["pending"] for r in results)
    wall = max(r["wall"] for r in results)
    agree = sum(1 for s in steps if marker[s] == shares[s])
    carried = sum(c for r in results for *_, c in r["steps"])
    losses = next(r["losses"] for r in results if r["losses"])
    return {
        "steps": len(steps),
        "mean_samples_per_step": sum(totals) / max(1, len(totals)),
        "max_samples_per_step": max(totals, default=0),
        "first_step_samples": totals[0] if totals else 0,
        "samples_counted": sum(totals),
        "samples_computed": computed,
        "samples_pending": pending,
        "marker_agrees": agree,
        "samples_per_s": computed / wall,
        "syncs": sum(r["syncs"] for r in results),
        "local_rounds": sum(r["local_rounds"] for r in results),
        "wait_fraction": sum(r["waiting_s"] / r["wall"] for r in results) / len(results),
        "comm_fraction": sum(r["averaging_s"] / r["wall"] for r in results) / len(results),
        "carried_fraction": carried / max(1, sum(totals)),
        "losses": losses,
        "wall_s": wall,
    }


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The first run's figures, with samples/s pooled over every run (computed / wall)."""
    first = dict(runs[0])
    first["samples_per_s"] = sum(r["samples_computed"] for r in runs) / sum(
        r["wall_s"] for r in runs
    )
    first["samples_per_s_runs"] = [r["samples_per_s"] for r in runs]
    return first


def parse_policy(spec: str, carry_batches: int) -> tuple[str, int]:
    """``carry``, ``wait`` or ``carry:N`` (carry with ``carry_batches`` = N) → (policy, N)."""
    policy, _, limit = spec.partition(":")
    if policy not in ("carry", "wait", "unbounded") or (limit and policy != "carry"):
        raise SystemExit(f"unknown step policy {spec!r} (carry, wait or carry:N)")
    return policy, int(limit) if limit else carry_batches


def run_equivalence_swarm(
    args: argparse.Namespace, peers: int, target: int, spec: str
) -> dict[str, Any]:
    """One swarm run of the equivalence benchmark, summarized."""
    policy, carry_batches = parse_policy(spec, args.carry_batches)
    base = {
        "mode": "eqpeer",
        "peers": peers,
        "batch": args.batch,
        "target": target,
        "policy": policy,
        "carry_batches": carry_batches,
        "goal": args.steps,
        "run_id": f"eq-{peers}x{target}-{policy}-{carry_batches}",
    }
    limit = START_TIMEOUT + 10.0 * args.steps * max(1, target // 64)
    results = start_swarm(base, peers, limit)
    dump = os.environ.get("P2PTRAIN_BENCH_TIMELINE")
    if dump:  # each peer's per-step timeline, for diagnosis
        with open(dump, "w") as out:
            json.dump([r["timeline"] for r in results], out)
    return summarize_equivalence(results)


def equivalence(args: argparse.Namespace) -> None:
    """``--equivalence``: samples per step and loss per sample against one process."""
    runs: list[tuple[int, int]] = [(args.peers, args.target)]
    for spec in filter(None, (args.also or "").split(",")):
        peers, _, target = spec.partition("x")
        runs.append((int(peers), int(target)))
    if args.runs_only:
        sizes = [(p, t, run_equivalence_swarm(args, p, t, args.policy)) for p, t in runs]
        print(
            format_table(
                ["peers x target", "steps", "mean/target", "max/target", "first/target"],
                [
                    [
                        f"{p} x {t}",
                        r["steps"],
                        r["mean_samples_per_step"] / t,
                        r["max_samples_per_step"] / t,
                        r["first_step_samples"] / t,
                    ]
                    for p, t, r in sizes
                ],
            )
        )
        emit_json(
            {
                "equivalence_runs": [
                    {
                        "peers": p,
                        "target": t,
                        "steps": r["steps"],
                        "mean_samples_per_step": r["mean_samples_per_step"],
                        "max_samples_per_step": r["max_samples_per_step"],
                        "first_step_samples": r["first_step_samples"],
                        "samples_per_s": r["samples_per_s"],
                    }
                    for p, t, r in sizes
                ]
            }
        )
        return
    # Every policy compared runs in this one invocation, beside the same no-cut run.
    # With --repeats they alternate (policy, ..., no cut, policy, ...): the
    # machine's speed drifts over minutes, and alternating spreads the drift.
    specs = [args.policy, *filter(None, (args.compare or "").split(","))]
    runs_of: dict[str, list[dict[str, Any]]] = {s: [] for s in [*specs, "unbounded"]}
    for _ in range(max(1, args.repeats)):
        for spec, done in runs_of.items():
            done.append(run_equivalence_swarm(args, args.peers, args.target, spec))
    compared = [(s, pooled(runs_of[s])) for s in specs]
    main_run = compared[0][1]
    no_cut = pooled(runs_of["unbounded"])
    counts = sorted({r["samples_counted"] for _, r in compared})
    single_child = Child({"mode": "eqsingle", "target": args.target, "samples": counts})
    try:
        single = single_child.wait_for("result", START_TIMEOUT + 0.2 * max(counts))
    finally:
        single_child.close()
    extra = [(p, t, run_equivalence_swarm(args, p, t, args.policy)) for p, t in runs[1:]]

    def loss_ratios(result: dict[str, Any]) -> list[float]:
        own = single["losses"][str(result["samples_counted"])]
        return [result["losses"][str(f)] / own[str(f)] for f in FRACTIONS]

    ratios = loss_ratios(main_run)
    pairs = zip(main_run["samples_per_s_runs"], no_cut["samples_per_s_runs"], strict=True)
    by_run = (
        f"; pooled over {args.repeats} alternating runs each, run by run "
        + ", ".join(f"{a / b:.3f}" for a, b in pairs)
        if args.repeats > 1
        else ""
    )
    rows: list[list[object]] = []
    for name, result in [
        *((f"{args.peers} peers, {spec}", r) for spec, r in compared),
        (f"{args.peers} peers, no cut", no_cut),
    ]:
        rows.append(
            [
                name,
                result["steps"],
                result["mean_samples_per_step"],
                result["max_samples_per_step"],
                result["first_step_samples"],
                *(result["losses"][str(f)] for f in FRACTIONS),
                result["samples_per_s"],
                result["carried_fraction"],
            ]
        )
    main_single = single["losses"][str(main_run["samples_counted"])]
    rows.append(
        [
            "1 process, batch = target",
            single["steps"],
            args.target,
            args.target,
            args.target,
            *(main_single[str(f)] for f in FRACTIONS),
            single["samples"] / single["wall"],
            0.0,
        ]
    )
    print(
        f"charlm, target {args.target}, local batch {args.batch}, {args.steps} global steps, "
        f"{os.cpu_count()} cores; loss = held-out loss at 25/50/100 % of "
        f"{main_run['samples_counted']} samples"
    )
    print(
        format_table(
            [
                "run",
                "steps",
                "mean samples/step",
                "max",
                "first",
                "loss 25%",
                "loss 50%",
                "loss 100%",
                "samples/s",
                "carried",
            ],
            rows,
        )
    )
    print(
        format_table(
            ["policy", "loss ratio 25%", "50%", "100%", "samples/s vs no cut"],
            [
                [spec, *loss_ratios(r), r["samples_per_s"] / no_cut["samples_per_s"]]
                for spec, r in compared
            ],
        )
    )
    run_rows: list[list[object]] = [
        [
            f"{args.peers} x {args.target}",
            main_run["mean_samples_per_step"] / args.target,
            main_run["max_samples_per_step"] / args.target,
            main_run["first_step_samples"] / args.target,
        ]
    ]
    run_rows += [
        [
            f"{p} x {t}",
            r["mean_samples_per_step"] / t,
            r["max_samples_per_step"] / t,
            r["first_step_samples"] / t,
        ]
        for p, t, r in extra
    ]
    print(format_table(["peers x target", "mean/target", "max/target", "first/target"], run_rows))
    print(
        f"loss ratio swarm/single at 25/50/100 %: {', '.join(f'{r:.3f}' for r in ratios)}; "
        f"samples/s {main_run['samples_per_s']:.1f} vs {no_cut['samples_per_s']:.1f} without "
        f"the cut ({main_run['samples_per_s'] / no_cut['samples_per_s']:.3f}x{by_run}); counted "
        f"{main_run['samples_counted']} = computed {main_run['samples_computed']} - pending "
        f"{main_run['samples_pending']}"
    )

    def brief(peers: int, target: int, result: dict[str, Any]) -> dict[str, Any]:
        return {
            "peers": peers,
            "target": target,
            "mean_samples_per_step": result["mean_samples_per_step"],
            "max_samples_per_step": result["max_samples_per_step"],
            "first_step_samples": result["first_step_samples"],
            "steps": result["steps"],
        }

    emit_json(
        {
            "equivalence": {
                "peers": args.peers,
                "target": args.target,
                "policy": args.policy,
                "mean_samples_per_step": main_run["mean_samples_per_step"],
                "max_samples_per_step": main_run["max_samples_per_step"],
                "first_step_samples": main_run["first_step_samples"],
                "loss_ratio": ratios,
                "samples_per_s": main_run["samples_per_s"],
                "samples_per_s_no_cut": no_cut["samples_per_s"],
                "samples_per_s_runs": main_run["samples_per_s_runs"],
                "samples_per_s_no_cut_runs": no_cut["samples_per_s_runs"],
                "runs": [
                    brief(args.peers, args.target, main_run),
                    *(brief(p, t, r) for p, t, r in extra),
                ],
                "compared": [
                    {
                        "policy": spec,
                        "loss_ratio": loss_ratios(r),
                        "samples_per_s_vs_no_cut": r["samples_per_s"] / no_cut["samples_per_s"],
                        "carried_fraction": r["carried_fraction"],
                    }
                    for spec, r in compared
                ],
                "swarm": main_run,
                "no_cut": no_cut,
                "single": single,
            }
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--peers", type=int, default=4, help="peers of the swarm")
    parser.add_argument(
        "--batch",
        type=int,
        default=None,
        help="local batch of every peer (default 16; 8 with --wan)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="global steps of a swarm run (default 8; 20 with --wan)",
    )
    parser.add_argument(
        "--batches-per-step", type=int, default=4, help="local batches per peer per swarm step"
    )
    parser.add_argument(
        "--inner-steps",
        type=int,
        default=None,
        help="H of the DiLoCo run (default 20; 4 with --wan)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="outer steps of the DiLoCo run")
    parser.add_argument(
        "--single-batches", type=int, default=60, help="batches of the one-process baseline"
    )
    parser.add_argument(
        "--equivalence", action="store_true", help="samples per step and loss vs one process"
    )
    parser.add_argument(
        "--target", type=int, default=None, help="target batch (default 256; 128 with --wan)"
    )
    parser.add_argument(
        "--policy",
        default="wait",
        help="step policy of the main run: carry, wait or carry:N (N = carry_batches)",
    )
    parser.add_argument(
        "--compare",
        help="more policies run beside the main one against the same no-cut run, e.g. wait,carry:0",
    )
    parser.add_argument(
        "--carry-batches",
        type=int,
        default=None,
        help="carry_batches of a carry run (default 1; with --wan a step's batches per peer)",
    )
    parser.add_argument("--also", help="more swarm runs, e.g. 8x256,4x1024 (--equivalence)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of each policy and of the no-cut run, alternating; samples/s pooled over "
        "them (--equivalence; the losses are the first runs'); with --wan, pairs of the "
        "sync and overlapped runs, the loss and hiding checks their means",
    )
    parser.add_argument(
        "--runs-only",
        action="store_true",
        help="only the swarm runs' samples per step, no loss or no-cut comparison (--equivalence)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="torch device of every worker's model in the default mode (cpu, cuda, cuda:N); "
        "--width/--layers/--heads set its shape",
    )
    add_wan_arguments(parser)
    args = parser.parse_args()
    if args.worker is not None:
        worker_main(json.loads(args.worker))
        return
    if args.wan:
        for name, default in (("width", 192), ("layers", 4), ("heads", 6)):
            if getattr(args, name) is None:
                setattr(args, name, default)
        run_wan(args)
        return
    for name, default in (
        ("batch", 16),
        ("steps", 8),
        ("inner_steps", 20),
        ("target", 256),
        ("carry_batches", 1),
    ):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.equivalence:
        equivalence(args)
        return

    single_child = Child(
        {"mode": "single", "batch": args.batch, "batches": args.single_batches, **model_job(args)}
    )
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
        f"charlm, batch {args.batch} per peer, {os.cpu_count()} cores, device {args.device}"
        f"{_gpu_name(args.device)}, model {model_shape(args)}; plain: target "
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
            "device": args.device + _gpu_name(args.device),
            "model": model_shape(args),
        }
    )


def model_shape(args: argparse.Namespace) -> str:
    """The default mode's charlm shape and size, e.g. ``d_model 128, 2 layers, 0.43M params``."""
    from p2ptrain.examples.charlm.model import ModelConfig, make_model

    config = ModelConfig(**{k: getattr(args, n) for k, n in _SHAPE.items() if getattr(args, n)})
    params = sum(p.numel() for p in make_model(config).parameters())
    return f"d_model {config.d_model}, {config.n_layers} layers, {params / 1e6:.2f}M params"


def _gpu_name(device: str) -> str:
    """`` (NAME)`` of a CUDA device, else nothing."""
    import torch

    if not device.startswith("cuda"):
        return ""
    return f" ({torch.cuda.get_device_name(torch.device(device))})"


if __name__ == "__main__":
    main()
