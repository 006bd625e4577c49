"""Benchmark the load-balancing planner: first build versus cached re-solves.

For each group size, a seeded random swarm (log-uniform bandwidths of
1-100 MB/s, uploads slower than downloads, round-trip times of 0-100 ms, about
15% of peers in client mode and 5% auxiliary) is planned once on a fresh :class:`LoadBalancer` (the
"build": cvxpy problem construction, DPP compilation and the first solve),
then re-planned ``--resolves`` times with every bandwidth perturbed by up to
±20%, re-using the compiled LP. Times are wall-clock milliseconds of the whole
``plan()`` call (validation and result included).

Prints a table, then as its last line one JSON object with the figures.

Usage::

    python -m benchmarks.bench_lp [--sizes 8 64 256] [--resolves 50] [--solver CLARABEL]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Sequence

from benchmarks.harness import DefaultsHelpFormatter
from p2ptrain.allreduce.lp import LoadBalancer, LoadBalancerConfig, PeerCapacity

MB = 1e6
VECTOR_BYTES = 4 * 110_000_000  # an ALBERT-large-sized fp32 gradient, roughly
TARGET_BATCH = 4096


def random_swarm(size: int, rng: random.Random) -> list[PeerCapacity]:
    """A mixed swarm; always at least one computing peer able to aggregate."""
    peers = []
    for index in range(size):
        download = MB * 10 ** rng.uniform(0, 2)
        role = rng.random()
        peers.append(
            PeerCapacity(
                upload_bytes_per_s=download * rng.uniform(0.1, 1.0),
                download_bytes_per_s=download,
                samples_per_s=rng.uniform(5, 50),
                rtt_s=rng.uniform(0.0, 0.1),
                client_mode=index > 0 and role < 0.15,
                computes=index == 0 or role < 0.95,
            )
        )
    return peers


def perturbed(peers: Sequence[PeerCapacity], rng: random.Random) -> list[PeerCapacity]:
    """The same swarm with every bandwidth scaled by a factor in [0.8, 1.2]."""
    return [
        PeerCapacity(
            upload_bytes_per_s=p.upload_bytes_per_s * rng.uniform(0.8, 1.2),
            download_bytes_per_s=p.download_bytes_per_s * rng.uniform(0.8, 1.2),
            samples_per_s=p.samples_per_s,
            client_mode=p.client_mode,
            computes=p.computes,
            rtt_s=p.rtt_s,
        )
        for p in peers
    ]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def bench_size(size: int, resolves: int, solver: str, seed: int) -> dict[str, float]:
    """Build and re-solve timings for one group size, in milliseconds."""
    rng = random.Random(seed + size)
    base = random_swarm(size, rng)
    balancer = LoadBalancer(LoadBalancerConfig(solver=solver))
    started = time.perf_counter()
    first = balancer.plan(base, vector_bytes=VECTOR_BYTES, target_batch_size=TARGET_BATCH)
    build_ms = (time.perf_counter() - started) * 1e3
    timings = []
    gains = []
    for _ in range(resolves):
        peers = perturbed(base, rng)
        started = time.perf_counter()
        plan = balancer.plan(peers, vector_bytes=VECTOR_BYTES, target_batch_size=TARGET_BATCH)
        timings.append((time.perf_counter() - started) * 1e3)
        gains.append(plan.equal_shares_round_time_s / plan.round_time_s)
    return {
        "build_ms": build_ms,
        "resolve_median_ms": statistics.median(timings),
        "resolve_p99_ms": percentile(timings, 99),
        "round_time_s": first.round_time_s,
        "speedup_vs_equal": statistics.median(gains),
    }


def main() -> None:
    """Run the benchmark and print the table and the JSON line."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter
    )
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[8, 64, 256], help="swarm sizes (peers) to plan"
    )
    parser.add_argument(
        "--resolves", type=int, default=50, help="re-solves per size after the first build"
    )
    parser.add_argument("--solver", default="CLARABEL", help="the cvxpy solver")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the swarms")
    args = parser.parse_args()

    results = {n: bench_size(n, args.resolves, args.solver, args.seed) for n in args.sizes}
    print(f"solver {args.solver}, {args.resolves} re-solves, vector {VECTOR_BYTES / MB:.0f} MB")
    header = f"{'peers':>6} {'build ms':>9} {'re-solve median ms':>19} {'p99 ms':>8}"
    print(f"{header} {'round time s':>13} {'speed-up vs equal':>18}")
    for n, r in results.items():
        print(
            f"{n:>6} {r['build_ms']:>9.1f} {r['resolve_median_ms']:>19.2f} "
            f"{r['resolve_p99_ms']:>8.2f} {r['round_time_s']:>13.2f} "
            f"{r['speedup_vs_equal']:>17.2f}x"
        )
    summary: dict[str, float] = {}
    for n, r in results.items():
        summary[f"build_ms_{n}"] = round(r["build_ms"], 2)
        summary[f"resolve_ms_{n}"] = round(r["resolve_median_ms"], 3)
        summary[f"resolve_p99_ms_{n}"] = round(r["resolve_p99_ms"], 3)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
