"""SWARM pipeline training against ``torch.distributed.pipelining``, all in one run.

    python -m benchmarks.bench_pipeline [--width 2048] [--steps 10] [--skip a-p2p2,b,...]
        [--default-intervals] [--png F]

Parts (each in real processes on loopback unless it says simulated):

(a) samples/s without faults: the torch pipeline (``Schedule1F1B`` over gloo,
    one process per stage) against p2ptrain's pipeline with one peer per stage
    and with two peers per stage (plus a trainer process, which holds no
    blocks), the same model, stages, batch and micro-batches;
(b) kill -9 of one stage peer whose stage has two peers: seconds until every
    stage's global step advances again; the same kill in the torch pipeline,
    and what happened there (one word);
(c) rebalancing from 5/1/1/1 peers over four equal stages (real processes;
    every server emulates a device with a floor on each forward and backward,
    because on two cores the machine, not a stage, limits real processes);
    and, simulated (the production trainer, directory and rebalancer over the
    simulated network on the virtual clock, see ``p2ptrain/lab/swarm_sim.py``),
    40/8/8/8 peers against the ideal, and 256 peers over 8 stages with a 1:8
    compute spread and 10 % churn per period;
(d) loss at 25/50/100 % of the samples, pipeline (lock-step: each step's
    micro-batches, then every stage's global step) over single-process training
    of the same model, seed and batches.

The table puts ours beside the baseline with ratios; the last line is one
JSON object (a part that could not be measured is null, and the reason is
printed above it).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from benchmarks.harness import DefaultsHelpFormatter, emit_json, format_table
from benchmarks.pipeline.baseline import single_process, torch_kill, torch_pipeline
from benchmarks.pipeline.model import PipelineModel
from benchmarks.pipeline.swarm import kill_recovery, lockstep_losses, rebalance_real, samples_per_s


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    parser.add_argument("--width", type=int, default=2048, help="features of every block")
    parser.add_argument("--depth", type=int, default=8, help="blocks (4 stages of depth/4)")
    parser.add_argument("--batch", type=int, default=64, help="samples per step")
    parser.add_argument("--microbatches", type=int, default=8, help="micro-batches per step")
    parser.add_argument("--steps", type=int, default=10, help="timed steps of part (a)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps of part (a)")
    parser.add_argument("--loss-steps", type=int, default=40, help="steps of part (d)")
    parser.add_argument("--kill-bound-s", type=float, default=30.0, help="how long (b) waits")
    parser.add_argument("--floor-s", type=float, default=0.1, help="(c) device floor per call")
    parser.add_argument("--rebalance-s", type=float, default=20.0, help="(c) rebalancing period")
    parser.add_argument("--rebalance-run-s", type=float, default=90.0, help="(c) run length")
    parser.add_argument("--sim-periods", type=int, default=10, help="simulated periods")
    parser.add_argument(
        "--sim256-peers",
        type=int,
        default=64,
        help="peers of the big sim (256: about 15 min for 4 periods on one core here)",
    )
    parser.add_argument("--sim256-periods", type=int, default=4, help="periods of the big sim")
    parser.add_argument(
        "--default-intervals",
        action="store_true",
        help="(a) with the library's default progress, announcement, step and refresh"
        " intervals instead of the fast ones parts (b) and (c) need",
    )
    parser.add_argument("--skip", default="", help="parts to leave out, e.g. b,sim256")
    parser.add_argument("--png", default=None, help="write the loss and rebalancing plot here")
    return parser


def _part(name: str, skip: set[str], notes: list[str], fn: Any, *args: Any, **kw: Any) -> Any:
    if name in skip:
        notes.append(f"{name}: skipped (--skip)")
        return None
    started = time.monotonic()
    try:
        result = fn(*args, **kw)
    except Exception as exc:  # a part that fails is reported, the others still run
        notes.append(f"{name}: not measured: {type(exc).__name__}: {exc}")
        return None
    took = time.monotonic() - started
    print(f"[{name} took {took:.0f} s: {result!r}]", file=sys.stderr, flush=True)
    return result


def _sim(start: tuple[int, ...], periods: int, **config: Any) -> list[Any]:
    from p2ptrain.lab.swarm_sim import SwarmSimConfig, SwarmSimulation
    from p2ptrain.lab.virtual_clock import run_virtual

    async def main() -> list[Any]:
        async with SwarmSimulation(SwarmSimConfig(start=start, **config)) as sim:
            return await sim.run(periods)

    return run_virtual(main())


def _loss_ratio(model: PipelineModel, steps: int) -> tuple[list[float], list[float], list[float]]:
    pipeline = lockstep_losses(model, steps)
    single = single_process(model, steps)
    if len(pipeline) != steps:
        raise RuntimeError(f"the lock-step run finished {len(pipeline)} of {steps} steps")
    points = [max(0, round(steps * f) - 1) for f in (0.25, 0.5, 1.0)]
    return [pipeline[i] / single[i] for i in points], pipeline, single


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    skip = {s for s in args.skip.split(",") if s}
    model = PipelineModel(
        width=args.width, depth=args.depth, batch=args.batch, microbatches=args.microbatches
    )
    notes: list[str] = []
    torch_run = _part(
        "a-torch", skip, notes, torch_pipeline, model,
        steps=args.steps, warmup=args.warmup, schedule="1f1b",
    )  # fmt: skip
    in_flight = 2 * model.microbatches
    p2p1 = _part(
        "a-p2p", skip, notes, samples_per_s, model,
        per_stage=1, steps=args.steps, warmup=args.warmup, in_flight=in_flight,
        default_intervals=args.default_intervals,
    )  # fmt: skip
    p2p2 = _part(
        "a-p2p2", skip, notes, samples_per_s, model,
        per_stage=2, steps=args.steps, warmup=args.warmup, in_flight=2 * in_flight,
        default_intervals=args.default_intervals,
    )  # fmt: skip
    kill_s = _part(
        "b", skip, notes, kill_recovery, model,
        victim_stage=1, warm_s=15.0, bound_s=args.kill_bound_s, in_flight=2 * in_flight,
    )  # fmt: skip
    if "b" not in skip and kill_s is None and not any(n.startswith("b:") for n in notes):
        notes.append(f"b: no recovery within {args.kill_bound_s:g} s")
    torch_after = _part(
        "b-torch", skip, notes, torch_kill, model, victim=1, after_steps=3,
        bound_s=args.kill_bound_s,
    )  # fmt: skip
    small = PipelineModel(width=256, depth=8, batch=model.batch, microbatches=model.microbatches)
    rebalanced = _part(
        "c-real", skip, notes, rebalance_real, small, start=(5, 1, 1, 1),
        floor_s=args.floor_s, period_s=args.rebalance_s, window_s=0.5 * args.rebalance_s,
        run_s=args.rebalance_run_s, in_flight=4 * model.microbatches,
    )  # fmt: skip
    sim40 = _part("c-sim", skip, notes, _sim, (40, 8, 8, 8), args.sim_periods)
    n = args.sim256_peers
    sim256 = _part(
        "sim256", skip, notes, _sim, tuple([n // 8] * 8), args.sim256_periods,
        speed_spread=8.0, churn=0.1,
    )  # fmt: skip
    losses = _part("d", skip, notes, _loss_ratio, model, args.loss_steps)
    results = {
        "torch_run": torch_run,
        "p2p1": p2p1,
        "p2p2": p2p2,
        "kill_s": kill_s,
        "torch_after": torch_after,
        "rebalanced": rebalanced,
        "sim40": sim40,
        "sim256": sim256,
        "losses": losses,
    }
    return _report(args, model, notes, results)


def _report(
    args: argparse.Namespace, model: PipelineModel, notes: list[str], r: dict[str, Any]
) -> int:
    torch_run, p2p1, p2p2 = r["torch_run"], r["p2p1"], r["p2p2"]
    torch_sps = torch_run.samples_per_s if torch_run else None

    def ratio(x: float | None) -> str:
        return f"{x / torch_sps:.2f}x" if x and torch_sps else "-"

    rows: list[list[object]] = [
        ["torch.distributed.pipelining 1F1B", torch_sps or "-", "1.00x" if torch_sps else "-"],
        ["p2ptrain, 1 peer per stage", p2p1 or "-", ratio(p2p1)],
        ["p2ptrain, 2 peers per stage", p2p2 or "-", ratio(p2p2)],
    ]
    print(
        f"(a) {model.depth} blocks of width {model.width}, 4 stages, batch {model.batch}"
        f" in {model.microbatches} micro-batches, one process per stage (+1 trainer for p2ptrain);"
        " p2ptrain's control plane at "
        + ("the library's default intervals" if args.default_intervals else "the fast intervals")
    )
    print(format_table(["system", "samples/s", "vs torch"], rows))
    print(
        f"(b) kill -9 of a stage-1 peer (2 per stage): every stage stepped again after"
        f" {r['kill_s']:.1f} s"
        if r["kill_s"] is not None
        else "(b) p2ptrain: not measured",
    )
    print(f"    torch pipeline after kill -9 of stage 1: {r['torch_after']}")
    rebalance_json = None
    if r["rebalanced"]:
        first, last, counts = r["rebalanced"]
        rebalance_json = {"start": first, "end": last, "counts": counts}
        print(
            f"(c) real processes, 5/1/1/1 start, emulated devices ({args.floor_s:g} s floor per"
            f" forward and backward; on 2 cores the machine would limit otherwise):"
            f" {first:.1f} -> {last:.1f} samples/s ({last / max(first, 1e-9):.2f}x), end {counts}"
        )
    sim_json = None
    if r["sim40"]:
        periods = r["sim40"]
        reached = next((p.period for p in periods if p.fraction >= 0.9), None)
        best = max(periods, key=lambda p: p.fraction)
        sim_json = {
            "ideal": periods[-1].ideal,
            "reached": periods[-1].throughput,
            "periods": reached,
            "best_fraction": best.fraction,
        }
        print("(c) simulated 40/8/8/8, equal peers and stages: period, samples/s, of ideal, peers")
        for p in periods:
            print(f"    {p.period:3d} {p.throughput:8.2f} {p.fraction:6.1%}  {p.counts}")
    sim256 = None
    if r["sim256"]:
        periods = r["sim256"]
        tail = periods[1:] or periods
        sim256 = sum(p.throughput for p in tail) / sum(p.ideal for p in tail)
        print(
            f"(sim) {args.sim256_peers} peers, 8 stages, 1:8 speeds, 10 % churn per period:"
            f" {sim256:.1%} of ideal over periods 1..{len(periods) - 1}"
        )
        for p in periods:
            print(
                f"    {p.period:3d} {p.throughput:8.2f} {p.fraction:6.1%} killed {p.killed}"
                f" cpu {p.cpu_s:.0f} s {p.counts}"
            )
    loss_ratio = None
    if r["losses"]:
        loss_ratio, pipeline, single = r["losses"]
        print(f"(d) loss pipeline / single process at 25/50/100 %: {loss_ratio}")
        if args.png:
            _plot(args.png, pipeline, single)
    for note in notes:
        print(note)
    emit_json(
        {
            "torch_pp_samples_per_s": torch_sps,
            "p2p_pp_samples_per_s": p2p1,
            "p2p_pp2_samples_per_s": p2p2,
            "kill_recover_s": r["kill_s"],
            "torch_pp_after_kill": r["torch_after"],
            "rebalance_real": rebalance_json,
            "rebalance_sim": sim_json,
            "sim256_fraction_of_ideal": sim256,
            "loss_ratio": loss_ratio,
        }
    )
    return 0


def _plot(path: str, pipeline: list[float], single: list[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(pipeline, label="p2ptrain pipeline (4 stages)")
    ax.plot(single, "--", label="single process")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
