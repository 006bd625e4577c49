"""Benchmark averaging at scale: a simulated swarm of 16 to 1,024 peers, and 48 real processes.

**Simulation.** For every size in ``--sizes``, a child process runs
:class:`p2ptrain.lab.simulator.Simulation` on a virtual clock: every peer
is the production Node + handshake + DHT + matchmaker + all-reduce service +
grouped averager over an in-memory network of heterogeneous home links
(download/upload 50/10, 100/50 and 1000/100 Mbit/s, RTT 20-80 ms to the core),
with ``--churn`` of the peers leaving abruptly during each step (while they
matchmake) and as many joining for the next. Each peer averages a random
vector of ``--vector-elements`` float32 with a random weight (1-64 samples).
Per size it reports, over ``--steps`` steps: the step time (virtual seconds
until the last live peer finished), bytes sent per peer per step (all
traffic: handshakes, DHT, matchmaking, tensors; mean and busiest peer) as
multiples of the vector size, the fraction of the live peers' samples that
the average holds, the largest relative error against the exact weighted
average (float64) of the counted contributions, DHT records and bytes held
per peer, and the largest dictionary any peer stores. The ratio columns
compare step time with 16 peers against log N / log 16.

**Real processes.** ``--real-peers`` processes on loopback each run a
:class:`p2ptrain.peer.Peer` and a :class:`CollaborativeOptimizer` on a tiny
MLP until ``--real-steps`` global steps; reported: steps completed by every
peer, the mean wall time of a global step, every process's peak RSS, and the
largest DHT value any of them stores (entries and bytes) against the limits.

Prints tables, then one JSON object as its last line: ``sim_rows`` (a list of
``{peers, step_s, bytes_per_peer, max_bytes_per_peer, vector_bytes,
counted_fraction, max_rel_error, ...}``), ``real_peers``, ``real_steps``,
``real_max_rss_mb``, ``real_step_s``.

Usage::

    python -m benchmarks.bench_scale [--sizes 16,64,256,1024] [--steps 2]
        [--vector-elements 262144] [--group-size 32] [--churn 0.1]
        [--real-peers 48] [--real-steps 10] [--no-real] [--no-sim] [--png out.png]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import DefaultsHelpFormatter, JsonChild, emit_json, format_table
from benchmarks.options import add_plot_argument

# -- one simulated size (child process) -------------------------------------------------------


def sim_main(job: dict[str, Any]) -> dict[str, Any]:
    """Run the simulation of one size and summarize its steps."""
    from p2ptrain.allreduce.grouped import GroupingConfig
    from p2ptrain.lab.simulator import Simulation, SimulationConfig
    from p2ptrain.lab.virtual_clock import run_virtual

    config = SimulationConfig(
        peers=job["peers"],
        vector_elements=job["vector_elements"],
        churn=job["churn"],
        grouping=GroupingConfig(
            group_size=job["group_size"], group_window=job.get("group_window", 3.0)
        ),
        seed=job["seed"],
    )

    async def main() -> tuple[list[Any], float, float, list[float]]:
        started, cpu = time.perf_counter(), time.process_time()
        async with Simulation(config) as sim:
            setup, setup_cpu = time.perf_counter() - started, time.process_time() - cpu
            steps, step_cpu = [], []
            for _ in range(job["steps"]):
                cpu = time.process_time()
                steps.append(await sim.step())
                step_cpu.append(time.process_time() - cpu)
                progress = {**steps[-1].__dict__, "process_cpu_s": step_cpu[-1]}
                print(json.dumps({"progress": progress}), file=sys.stderr, flush=True)
            return steps, setup, setup_cpu, step_cpu

    steps, setup_s, setup_cpu_s, step_cpu_s = run_virtual(main())
    vector = 4 * job["vector_elements"]
    return {
        "peers": job["peers"],
        "groups": max(s.groups for s in steps),
        "step_s": sum(s.step_s for s in steps) / len(steps),
        "max_step_s": max(s.step_s for s in steps),
        "bytes_per_peer": sum(s.bytes_per_peer for s in steps) / len(steps),
        "max_bytes_per_peer": max(s.max_bytes_per_peer for s in steps),
        "vector_bytes": vector,
        "counted_fraction": min(s.counted_fraction for s in steps),
        "max_rel_error": max(s.max_rel_error for s in steps),
        "incomplete_peers": max(s.incomplete for s in steps),
        "killed_per_step": sum(s.killed for s in steps) / len(steps),
        "dht_records_per_peer": steps[-1].dht_records_per_peer,
        "dht_bytes_per_peer": steps[-1].dht_bytes_per_peer,
        "max_dict_entries": max(s.max_dict_entries for s in steps),
        "max_value_bytes": max(s.max_value_bytes for s in steps),
        "max_connections": max(s.max_connections for s in steps),
        "cpu_s_per_step": sum(s.cpu_s for s in steps) / len(steps),
        "setup_cpu_s": setup_s,
        "process_cpu_s_per_step": sum(step_cpu_s) / len(step_cpu_s),
        "setup_process_cpu_s": setup_cpu_s,
        "failures": [f for s in steps for f in s.failures][:5],
    }


# -- one real peer (child process) ------------------------------------------------------------


def real_main(job: dict[str, Any]) -> None:
    """One real peer: train the tiny MLP until ``job['steps']`` global steps."""
    import torch
    from torch import nn

    from p2ptrain.allreduce.grouped import GroupingConfig
    from p2ptrain.allreduce.matchmaking import MatchmakingConfig
    from p2ptrain.dht.node_config import DHTNodeConfig
    from p2ptrain.peer import Peer, PeerConfig
    from p2ptrain.train.config import TrainerConfig
    from p2ptrain.train.optimizer import CollaborativeOptimizer
    from p2ptrain.train.progress import ProgressConfig

    torch.set_num_threads(1)
    grouped_steps = _count_grouped_steps()
    go = threading.Event()

    def watch_stdin() -> None:  # "go" starts training; stdin closing ends the process
        sys.stdin.readline()
        go.set()
        sys.stdin.read()
        os._exit(0)

    threading.Thread(target=watch_stdin, daemon=True).start()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    generator = torch.Generator().manual_seed(job["shard"])
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    config = PeerConfig(
        dht=DHTNodeConfig(initial_peers=tuple(job["initial_peers"]), request_timeout=5.0),
        matchmaking=MatchmakingConfig(
            window=3.0,
            poll_interval=0.5,
            ready_timeout=5.0,
            plan_timeout=15.0,
            reduce_timeout=20.0,
            round_timeout=30.0,
        ),
        start_timeout=300.0,
        join_timeout=120.0,
    )
    trainer = TrainerConfig(
        grouping=GroupingConfig(group_size=job["group_size"], column_window=20.0),
        run_id="scale",
        target_batch_size=job["target"],
        progress=ProgressConfig(
            publish_interval=1.0,
            heartbeat_interval=2.0,
            expiration=20.0,
            min_fetch_interval=0.5,
            max_fetch_interval=2.0,
        ),
    )
    with Peer(config) as peer:
        _emit({"address": peer.address})
        go.wait()
        times: list[float] = []
        with CollaborativeOptimizer(inner, peer=peer, config=trainer) as opt:
            while opt.global_step < job["steps"]:
                x = torch.randn(job["batch"], 8, generator=generator)
                y = torch.sin(x.sum(dim=1, keepdim=True))
                nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
                time.sleep(0.2)  # stands for a real model's compute time
                if opt.step(job["batch"]):
                    times.append(time.time())
            records = list(peer.dht.dht_node.records.records(peer.dht.now()))
            per_key: dict[bytes, list[int]] = {}
            for record in records:
                per_key.setdefault(record.key, []).append(len(record.value))
            limits = peer.dht.dht_node.config.dht
            _emit(
                {
                    "result": {
                        "steps": opt.global_step,
                        "averaged": opt.stats.rounds,
                        "grouped": grouped_steps[0],
                        "times": times,
                        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                        "max_entries": max((len(v) for v in per_key.values()), default=0),
                        "max_value_bytes": max((sum(v) for v in per_key.values()), default=0),
                        "max_entry_bytes": max((max(v) for v in per_key.values()), default=0),
                        "limit_subkeys": limits.max_subkeys,
                        "limit_value_bytes": limits.max_value_bytes,
                    }
                }
            )


def _count_grouped_steps() -> list[int]:
    """A counter of the steps this process averaged in groups (from the averager's log)."""
    import logging

    count = [0]

    class Counter(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "groups (mine" in record.msg:
                count[0] += 1

    log = logging.getLogger("p2ptrain.train.averaging")
    log.setLevel(logging.INFO)
    log.addHandler(Counter())
    return count


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


# -- the parent -------------------------------------------------------------------------------


class Child(JsonChild):
    """A ``--sim`` or ``--real`` worker of this script."""

    def __init__(self, flag: str, job: dict[str, Any]) -> None:
        super().__init__("benchmarks.bench_scale", [flag, json.dumps(job)])


def run_sim(args: argparse.Namespace, peers: int) -> dict[str, Any]:
    job = {
        "peers": peers,
        "steps": args.steps,
        "vector_elements": args.vector_elements,
        "group_size": args.group_size,
        "group_window": args.group_window,
        "churn": args.churn,
        "seed": args.seed,
    }
    child = Child("--sim", job)
    try:
        result: dict[str, Any] = child.wait_for("result", args.sim_timeout)
        print(f"simulated {peers} peers: {json.dumps(result)}", file=sys.stderr, flush=True)
        return result
    finally:
        child.close()


def run_real(args: argparse.Namespace) -> dict[str, Any]:
    batch = 16
    base = {
        "steps": args.real_steps,
        "batch": batch,
        "target": args.real_peers * batch,
        "group_size": args.real_group_size,
    }
    children: list[Child] = []
    try:
        children.append(Child("--real", {**base, "shard": 0, "initial_peers": []}))
        first = children[0].wait_for("address", 300.0)
        for shard in range(1, args.real_peers):
            contacts = [first] if shard < 4 else [first, *_addresses(children[1:4])]
            children.append(Child("--real", {**base, "shard": shard, "initial_peers": contacts}))
        for child in children:
            child.wait_for("address", 600.0)
        started = time.time()
        for child in children:
            child.send("go")
        results = []
        for child in children:
            try:
                results.append(child.wait_for("result", 120.0 + 60.0 * args.real_steps))
            except RuntimeError:
                results.append(None)
    finally:
        for child in children:
            child.close()
    done = [r for r in results if r is not None]
    step_times = [(r["times"][-1] - started) / max(1, len(r["times"])) for r in done if r["times"]]
    return {
        "real_peers": args.real_peers,
        "real_finished": len(done),
        "real_steps": min((r["steps"] for r in done), default=0)
        if len(done) == len(results)
        else 0,
        "real_step_s": sum(step_times) / len(step_times) if step_times else None,
        "real_max_rss_mb": max((r["rss_mb"] for r in done), default=None),
        "real_averaged_steps_min": min((r["averaged"] for r in done), default=None),
        "real_grouped_steps_min": min((r["grouped"] for r in done), default=None),
        "real_max_dict_entries": max((r["max_entries"] for r in done), default=None),
        "real_max_value_bytes": max((r["max_value_bytes"] for r in done), default=None),
        "real_max_entry_bytes": max((r["max_entry_bytes"] for r in done), default=None),
        "real_limit_subkeys": done[0]["limit_subkeys"] if done else None,
        "real_limit_value_bytes": done[0]["limit_value_bytes"] if done else None,
    }


def _addresses(children: list[Child]) -> list[str]:
    return [c.wait_for("address", 300.0) for c in children]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter
    )
    parser.add_argument("--sim", help=argparse.SUPPRESS)
    parser.add_argument("--real", help=argparse.SUPPRESS)
    parser.add_argument(
        "--sizes", default="16,64,256,1024", help="simulated swarm sizes, comma-separated"
    )
    parser.add_argument("--steps", type=int, default=2, help="simulated steps per size")
    parser.add_argument(
        "--vector-elements", type=int, default=1 << 18, help="float32 elements averaged"
    )
    parser.add_argument(
        "--group-size", type=int, default=32, help="GroupingConfig.group_size (simulated)"
    )
    parser.add_argument(
        "--group-window",
        type=float,
        default=3.0,
        help="GroupingConfig.group_window (simulated): a first step's DHT stores take up to "
        "about 2.5 virtual s on cold connections, and a group window that closes before a "
        "member's announcement is readable splits its group",
    )
    parser.add_argument(
        "--churn", type=float, default=0.1, help="fraction of peers replaced per round"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of links, churn and data")
    parser.add_argument(
        "--sim-timeout", type=float, default=7200.0, help="wall seconds one size may take"
    )
    parser.add_argument("--real-peers", type=int, default=48, help="peer processes of the real run")
    parser.add_argument("--real-steps", type=int, default=10, help="global steps of the real run")
    parser.add_argument(
        "--real-group-size", type=int, default=32, help="GroupingConfig.group_size of the real run"
    )
    parser.add_argument("--no-real", action="store_true", help="skip the real-process run")
    parser.add_argument("--no-sim", action="store_true", help="skip the simulation")
    add_plot_argument(parser, "step time and bytes against N")
    parser.add_argument(
        "--sim-rows", help="take the simulation rows from earlier runs' output files (a,b)"
    )
    args = parser.parse_args()
    if args.sim:
        _emit({"result": sim_main(json.loads(args.sim))})
        return
    if args.real:
        real_main(json.loads(args.real))
        return

    rows: list[dict[str, Any]] = []
    if args.sim_rows:  # rows measured by earlier runs of this script (their JSON lines)
        for name in args.sim_rows.split(","):
            rows += json.loads(Path(name).read_text().strip().splitlines()[-1])["sim_rows"]
            print(f"simulation rows read from {name}", flush=True)
        rows.sort(key=lambda row: row["peers"])
    elif not args.no_sim:
        sizes = [int(s) for s in args.sizes.split(",")]
        with concurrent.futures.ThreadPoolExecutor(len(sizes)) as pool:  # one child per size
            rows = list(pool.map(lambda n: run_sim(args, n), sizes))
    if rows:
        print_sim(rows)
    real: dict[str, Any] = {}
    if not args.no_real:
        real = run_real(args)
        print_real(real)
    if args.png and rows:
        draw(rows, args.png)
    emit_json({"sim_rows": rows, **real})


def print_sim(rows: list[dict[str, Any]]) -> None:
    base = rows[0]
    table = []
    for row in rows:
        v = row["vector_bytes"]
        log_ratio = math.log(row["peers"]) / math.log(base["peers"])
        table.append(
            [
                str(row["peers"]),
                str(row["groups"]),
                f"{row['step_s']:.2f}",
                f"{row['step_s'] / base['step_s']:.2f}",
                f"{log_ratio:.2f}",
                f"{row['bytes_per_peer'] / v:.2f}",
                f"{row['max_bytes_per_peer'] / v:.2f}",
                f"{row['counted_fraction']:.4f}",
                f"{row['max_rel_error']:.1e}",
                str(row["incomplete_peers"]),
                f"{row['dht_records_per_peer']:.0f}",
                f"{row['dht_bytes_per_peer'] / 1000:.1f}",
                str(row["max_dict_entries"]),
                f"{row.get('process_cpu_s_per_step', row['cpu_s_per_step']):.0f}",
            ]
        )
    print(
        format_table(
            [
                "peers",
                "groups",
                "step s",
                "÷ N=16",
                "log ratio",
                "sent/V",
                "max/V",
                "counted",
                "rel err",
                "incompl.",
                "DHT rec/peer",
                "DHT kB/peer",
                "max dict",
                "CPU s/step",
            ],
            table,
        )
    )


def print_real(real: dict[str, Any]) -> None:
    keys = sorted(real)
    print(format_table(["real processes", "value"], [[k, str(real[k])] for k in keys]))


def draw(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peers = [r["peers"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(peers, [r["step_s"] for r in rows], "o-", label="step time")
    base = rows[0]["step_s"] / math.log(peers[0])
    left.plot(peers, [base * math.log(n) for n in peers], "--", label="∝ log N")
    left.set_xscale("log")
    left.set_xlabel("peers")
    left.set_ylabel("virtual seconds")
    left.legend()
    right.plot(peers, [r["bytes_per_peer"] / r["vector_bytes"] for r in rows], "o-", label="mean")
    right.plot(
        peers, [r["max_bytes_per_peer"] / r["vector_bytes"] for r in rows], "o-", label="max"
    )
    right.set_xscale("log")
    right.set_xlabel("peers")
    right.set_ylabel("bytes sent per step / vector bytes")
    right.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
