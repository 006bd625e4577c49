"""``bench_training.py --wan``: p2ptrain's trainers against hivemind.Optimizer on shaped home links.

Each system trains in a fresh star lab (:mod:`p2ptrain.lab.starlab`):
``--peers`` hosts, each in its own network namespace, each behind a home
link of ``--up-mbit`` / ``--down-mbit`` (``tc tbf``) with ``--rtt-ms`` of
round-trip time (the kernel has no netem: every host routes its sends
through the lab's user-space delay shim, ``rtt/2`` each way). One peer
process per host (``training/peer.py`` for p2ptrain,
``training/hivemind.py`` run by hivemind's interpreter) trains the same
charlm configuration from the same seed, each peer on its own shard of the
data with local batches of ``--batch``, until its global step reaches
``--steps``:

* ``p2ptrain_sync``: CollaborativeOptimizer, step policy ``wait``, target
  ``--target``;
* ``p2ptrain_overlap``: the same with step policy ``carry``
  (``--carry-batches``, default: a whole step's batches): the all-reduce
  runs behind the next step's batches, the update lands one step late;
* ``p2ptrain_diloco``: DiLoCoOptimizer, ``--inner-steps`` local steps per
  round (``peers × batch × H`` samples a round), overlapped rounds unless
  ``--diloco-sync``;
* ``hivemind``: hivemind.Optimizer with delayed parameter updates, target
  ``--target`` (see ``training/hivemind.py`` for its settings). Its
  global step is the number of updates in the parameters: ``local_epoch - 1``
  (the step that opens epoch e first installs the update of epoch e - 1).

Every system warms the learning rate up linearly over ``--warmup`` global
steps (after k steps, ``lr · (k + 1) / warmup``; hivemind through a
``LambdaLR`` it steps once per epoch). A peer that reached the goal trains
on, unrecorded, until every peer of its system has, so that none stands
still while another finishes its last step.

All peers send fp16. The parent says ``go`` to every peer of a system at
once; a system's figures are:

* ``samples_per_s``: samples computed by all peers / the longest peer's
  time from ``go`` to its last global step;
* ``comm_fraction``: mean over the peers of the seconds the training thread
  spent inside the trainer's ``step()`` (waiting for matchmaking, the
  all-reduce, the swarm, a state download, or a background average; plus
  the accumulation and, in DiLoCo, the inner optimizer step, which take
  milliseconds) / its wall time;
* ``mb_sent_per_peer``: bytes the upload shapers passed between ``go`` and
  the end (whole frames: payload, headers, DHT, everything), mean per host;
* ``time_to_loss_s``: seconds from ``go`` until the first global step after
  which the held-out loss (``--eval-windows`` validation windows, scored
  after the run on the copies of peer 0's parameters kept at every global
  step) is at most ``--target-loss``; ``null`` if never;
* ``final_loss`` / ``final_samples``: the held-out loss after the last
  global step and the samples the swarm's steps held until then (p2ptrain
  counts them in every all-reduce; a DiLoCo round holds peers × H × batch,
  a hivemind epoch is counted as the target).

The overlapped mode's loss is compared with the synchronous mode's at the
same number of samples (the smaller of their ``final_samples``, each curve
interpolated linearly between global steps). One pair's ratio moves by about
2 % from run to run (where an AdamW spike at the end of the warm-up lands):
``--repeats R`` runs the two modes R times, alternating, and the checks take
the mean over the R pairs of each pair's ratio (each pair's is printed too).

Nothing is shared between the systems but the machine: absolute rates move
with its load, ratios within one invocation are the result.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

from benchmarks.harness import JsonChild, emit_json, format_table, plot_bars
from benchmarks.options import add_hivemind_arguments, add_plot_argument, hivemind_of

__all__ = ["SYSTEMS", "add_wan_arguments", "resolve_wan_defaults", "run_wan"]

P2PTRAIN_WORKER = "benchmarks.training.peer"
HIVEMIND_WORKER = "benchmarks.training.hivemind"
SYSTEMS = ("p2ptrain_sync", "p2ptrain_overlap", "p2ptrain_diloco", "hivemind")
START_TIMEOUT = 180.0


def add_wan_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``--wan`` (``--peers``, ``--batch``, ``--steps``, ``--target``,
    ``--inner-steps`` and ``--carry-batches`` are shared with the other modes)."""
    group = parser.add_argument_group("--wan: 4 peers on shaped home links vs hivemind")
    group.add_argument(
        "--wan", action="store_true", help="p2ptrain sync/overlap/DiLoCo vs hivemind.Optimizer"
    )
    group.add_argument("--up-mbit", type=float, default=50.0, help="upload of every home link")
    group.add_argument("--down-mbit", type=float, default=100.0, help="download of every link")
    group.add_argument("--rtt-ms", type=float, default=20.0, help="round trip between two peers")
    group.add_argument(
        "--width", type=int, help="charlm d_model (default 192 with --wan, else the example's 128)"
    )
    group.add_argument(
        "--layers", type=int, help="charlm blocks (default 4 with --wan, else the example's 2)"
    )
    group.add_argument(
        "--heads", type=int, help="attention heads (default 6 with --wan, else the example's 4)"
    )
    group.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (--wan)")
    group.add_argument(
        "--warmup", type=int, default=5, help="global steps of linear lr warm-up (--wan)"
    )
    group.add_argument(
        "--target-loss", type=float, default=3.0, help="held-out loss of time_to_loss_s"
    )
    group.add_argument(
        "--eval-windows", type=int, default=64, help="validation windows of the held-out loss"
    )
    group.add_argument(
        "--systems", default=",".join(SYSTEMS), help="comma-separated systems to run (--wan)"
    )
    add_hivemind_arguments(group, part=" of --wan")
    group.add_argument(
        "--matchmaking-time", type=float, default=3.0, help="hivemind's matchmaking_time"
    )
    group.add_argument(
        "--averaging-timeout", type=float, default=30.0, help="hivemind's averaging_timeout"
    )
    group.add_argument(
        "--diloco-sync", action="store_true", help="synchronous DiLoCo rounds (default overlapped)"
    )
    add_plot_argument(group, "a bar chart of the --wan results")


def resolve_wan_defaults(args: argparse.Namespace) -> None:
    """Fill the shared flags left unset with the ``--wan`` defaults."""
    if args.steps is None:
        args.steps = 20
    if args.batch is None:
        args.batch = 8
    if args.target is None:
        args.target = 128
    if args.inner_steps is None:
        args.inner_steps = 4
    if args.carry_batches is None:
        args.carry_batches = max(1, args.target // (args.peers * args.batch))
    for name in ("steps", "batch", "target", "inner_steps", "peers"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive")


class _Worker(JsonChild):
    """A worker process in host ``index``'s namespace; its stderr goes to a log file."""

    def __init__(  # noqa: PLR0917 - a private helper of this module
        self, lab: Any, index: int, module: str, job: dict[str, Any], python: str, log: Path
    ) -> None:
        self.log = log
        self._log_file: IO[bytes] = log.open("wb")
        super().__init__(
            module,
            [json.dumps(job)],
            python=python,
            prefix=lab.argv(index, []),
            stderr=self._log_file,
        )

    def expect(self, key: str, timeout: float) -> Any:
        """:meth:`wait_for`, with the tail of the worker's log on failure."""
        try:
            return self.wait_for(key, timeout)
        except RuntimeError as exc:
            self._log_file.flush()
            tail = self.log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{exc}; {self.log}:\n{tail}") from None

    def close(self) -> None:
        super().close()
        self._log_file.close()


def _job(args: argparse.Namespace, system: str, index: int, host: str) -> dict[str, Any]:
    return {
        "system": system,
        "run_id": f"wan-{system}",
        "host": host,
        "initial_peers": [],
        "shard": index,
        "peers": args.peers,
        "batch": args.batch,
        "target": args.target,
        "goal": args.steps,
        "lr": args.lr,
        "warmup": args.warmup,
        "width": args.width,
        "layers": args.layers,
        "heads": args.heads,
        "seed": 0,
        "threads": 1,
        "inner_steps": args.inner_steps,
        "carry_batches": args.carry_batches,
        "diloco_overlap": not args.diloco_sync,
        "compression": "fp16",
        "matchmaking_time": args.matchmaking_time,
        "averaging_timeout": args.averaging_timeout,
        "eval_windows": args.eval_windows,
        "keep": index == 0,
    }


def run_system(args: argparse.Namespace, system: str, python: str) -> dict[str, Any]:
    """Train ``system`` in a fresh star lab; the raw results of its peers and its losses."""
    from p2ptrain.lab.starlab import LinkSpec, StarLab

    script = HIVEMIND_WORKER if system == "hivemind" else P2PTRAIN_WORKER
    links = [LinkSpec(args.up_mbit, args.down_mbit)] * args.peers
    logs = Path(tempfile.mkdtemp(prefix=f"wan-{system}-"))
    limit = START_TIMEOUT + 60.0 * args.steps
    workers: list[_Worker] = []
    with StarLab(links, delay_ms=args.rtt_ms / 2) as lab:
        try:
            # All start at once; the others learn the first peer's address on stdin.
            for index in range(args.peers):
                job = _job(args, system, index, lab.host_address(index))
                job["initial_peers"] = None if index else []
                log = logs / f"peer{index}.log"
                workers.append(_Worker(lab, index, script, job, python, log))
            first = workers[0].expect("address", START_TIMEOUT)
            for worker in workers[1:]:
                worker.send(json.dumps(first if isinstance(first, list) else [first]))
            for worker in workers:
                worker.expect("ready", START_TIMEOUT)
            before = lab.counters()
            for worker in workers:
                worker.send("go")
            results = [worker.expect("result", limit) for worker in workers]
            after = lab.counters()
            for worker in workers:
                worker.send("stop")
            workers[0].send("eval")
            losses = workers[0].expect("losses", START_TIMEOUT + 10.0 * args.steps)
            for worker in workers:
                with contextlib.suppress(OSError):
                    worker.send("quit")
        finally:
            for worker in workers:
                worker.close()
    sent = [a["up_bytes"] - b["up_bytes"] for a, b in zip(after, before, strict=True)]
    drops = [a["up_drops"] - b["up_drops"] for a, b in zip(after, before, strict=True)]
    return {"results": results, "losses": losses, "sent": sent, "drops": drops}


def summarize(raw: dict[str, Any], target_loss: float) -> dict[str, Any]:
    """One system's figures from its peers' results, shaper counters and losses."""
    results = raw["results"]
    wall = max(r["wall"] for r in results)
    losses = raw["losses"]
    reached = next((at for _step, at, _samples, value in losses if value <= target_loss), None)
    out: dict[str, Any] = {
        "samples_per_s": sum(r["samples"] for r in results) / wall,
        "comm_fraction": sum(r["blocked_s"] / r["wall"] for r in results) / len(results),
        "mb_sent_per_peer": sum(raw["sent"]) / len(raw["sent"]) / 1e6,
        "time_to_loss_s": reached,
        "final_loss": losses[-1][3],
        "final_samples": losses[-1][2],
        "global_steps": min(r["global_step"] for r in results),
        "samples": sum(r["samples"] for r in results),
        "wall_s": wall,
        "upload_drops": sum(raw["drops"]),
        "losses": [[step, round(at, 3), n, round(value, 5)] for step, at, n, value in losses],
    }
    if "communication_s" in results[0]:  # p2ptrain's own account of blocked time
        out["p2ptrain_comm_fraction"] = sum(
            r["communication_s"] / r["wall"] for r in results
        ) / len(results)
        out["local_rounds"] = sum(r["local_rounds"] for r in results)
        out["syncs"] = sum(r["syncs"] for r in results)
        counted = [r for r in results if r["steps_counted"]]
        if counted:
            out["mean_step_samples"] = counted[0]["step_samples"] / counted[0]["steps_counted"]
    return out


def loss_at(losses: list[list[float]], samples: float) -> float:
    """The held-out loss after ``samples`` samples, interpolated linearly between kept copies.

    ``losses`` rows are ``[step, seconds, samples, loss]`` in step order.
    """
    points = [(row[2], row[3]) for row in losses]
    if samples <= points[0][0]:
        return points[0][1]
    for (n0, v0), (n1, v1) in itertools.pairwise(points):
        if n0 <= samples <= n1:
            return v1 if n1 == n0 else v0 + (v1 - v0) * (samples - n0) / (n1 - n0)
    return points[-1][1]


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _rounded(value: object) -> object:
    return round(value, 3) if isinstance(value, float) else value


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known and len(known) == len(values) else None


def _pair_loss_ratio(sync: dict[str, Any], overlap: dict[str, Any]) -> float | None:
    """Overlap's held-out loss over sync's, at the smaller of their sample counts."""
    same = min(sync["final_samples"], overlap["final_samples"])
    return _ratio(loss_at(overlap["losses"], same), loss_at(sync["losses"], same))


def checks(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's must-show figures, where the systems they compare ran."""
    out: dict[str, Any] = {}
    sync, overlap, hive = (runs.get(k) for k in ("p2ptrain_sync", "p2ptrain_overlap", "hivemind"))
    if sync and overlap:
        syncs = [sync, *sync.get("repeats", [])]
        pairs = list(zip(syncs, [overlap, *overlap.get("repeats", [])], strict=False))
        comms = [_ratio(o["comm_fraction"], s["comm_fraction"]) for s, o in pairs]
        losses = [_pair_loss_ratio(s, o) for s, o in pairs]
        comm = _mean(comms)
        loss = _mean(losses)
        out["overlap_comm_vs_sync"] = comm
        out["loss_compared_at_samples"] = min(sync["final_samples"], overlap["final_samples"])
        out["overlap_hides_80pct"] = comm is not None and comm <= 0.2
        out["overlap_loss_vs_sync"] = loss
        out["overlap_loss_within_2pct"] = loss is not None and abs(loss - 1) <= 0.02
        if len(pairs) > 1:  # the figures above are the pairs' means
            out["pairs"] = len(pairs)
            out["overlap_comm_vs_sync_per_pair"] = comms
            out["overlap_loss_vs_sync_per_pair"] = losses
    ours = {k: v for k, v in runs.items() if k.startswith("p2ptrain") and "samples_per_s" in v}
    if ours and hive and "samples_per_s" in hive:
        best = max(ours, key=lambda k: ours[k]["samples_per_s"])
        speed = _ratio(ours[best]["samples_per_s"], hive["samples_per_s"])
        out["best_p2ptrain"] = best
        out["best_vs_hivemind_samples_per_s"] = speed
        out["best_1_5x_hivemind"] = speed is not None and speed >= 1.5
        theirs = hive["time_to_loss_s"]
        mine = ours[best]["time_to_loss_s"]
        out["best_reaches_loss_sooner"] = mine is not None and (theirs is None or mine < theirs)
        reached = {k: v["time_to_loss_s"] for k, v in ours.items() if v["time_to_loss_s"]}
        if reached:  # the p2ptrain mode first at the target loss, whatever its samples/s
            first = min(reached, key=lambda k: reached[k])
            out["first_to_loss"] = first
            out["first_to_loss_vs_hivemind_time"] = _ratio(reached[first], theirs)
            out["first_to_loss_vs_hivemind_samples_per_s"] = _ratio(
                ours[first]["samples_per_s"], hive["samples_per_s"]
            )
    return out


def report(args: argparse.Namespace, runs: dict[str, dict[str, Any]]) -> None:
    """The table, the checks, an optional PNG, and the JSON line."""
    hive = runs.get("hivemind", {})
    rows: list[list[object]] = []
    listed = [
        (f"{name} ({i + 2})" if i >= 0 else name, one)
        for name, run in runs.items()
        for i, one in enumerate([run, *run.get("repeats", [])], start=-1)
    ]
    for name, run in listed:
        if "samples_per_s" not in run:
            rows.append([name, run.get("skipped", "skipped")])
            continue
        rows.append(
            [
                name,
                run["samples_per_s"],
                _ratio(run["samples_per_s"], hive.get("samples_per_s")),
                run["comm_fraction"],
                run["mb_sent_per_peer"],
                run["final_loss"],
                run["time_to_loss_s"],
                _ratio(run["time_to_loss_s"], hive.get("time_to_loss_s")),
                run["global_steps"],
                run["wall_s"],
            ]
        )
    print(
        f"charlm d_model {args.width}, {args.layers} layers; {args.peers} peers, links "
        f"{args.up_mbit:g}/{args.down_mbit:g} Mbit/s up/down, RTT {args.rtt_ms:g} ms; local "
        f"batch {args.batch}, target {args.target}, {args.steps} global steps "
        f"(DiLoCo: H = {args.inner_steps}); fp16; {os.cpu_count()} cores; target loss "
        f"{args.target_loss:g}"
    )
    print(
        format_table(
            [
                "system",
                "samples/s",
                "x hivemind",
                "comm fraction",
                "MB sent/peer",
                "final loss",
                "time to loss s",
                "x hivemind",
                "steps",
                "wall s",
            ],
            rows,
        )
    )
    found = checks(runs)
    for key, value in found.items():
        shown = [_rounded(v) for v in value] if isinstance(value, list) else _rounded(value)
        print(f"  {key}: {shown}")
    if args.png:
        measured = {k: v for k, v in runs.items() if "samples_per_s" in v}
        plot_bars(
            args.png,
            [
                ("samples/s", {k: v["samples_per_s"] for k, v in measured.items()}),
                ("comm fraction", {k: v["comm_fraction"] for k, v in measured.items()}),
                (
                    f"s to loss {args.target_loss:g}",
                    {
                        k: v["time_to_loss_s"]
                        for k, v in measured.items()
                        if v["time_to_loss_s"] is not None
                    },
                ),
            ],
            title="charlm on shaped home links",
        )
    emit_json(
        {
            "wan": {
                **runs,
                "target_loss": args.target_loss,
                "checks": found,
                "config": {
                    "peers": args.peers,
                    "up_mbit": args.up_mbit,
                    "down_mbit": args.down_mbit,
                    "rtt_ms": args.rtt_ms,
                    "width": args.width,
                    "layers": args.layers,
                    "batch": args.batch,
                    "target": args.target,
                    "steps": args.steps,
                    "inner_steps": args.inner_steps,
                    "carry_batches": args.carry_batches,
                    "cores": os.cpu_count(),
                },
            }
        }
    )


def run_wan(args: argparse.Namespace) -> None:
    """``--wan``: every chosen system in turn, then the report."""
    from p2ptrain.lab.starlab import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"--wan needs network namespaces: {reason}")
    resolve_wan_defaults(args)
    chosen = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SYSTEMS))
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; choose from {list(SYSTEMS)}")
    runs: dict[str, dict[str, Any]] = {}
    repeats = max(1, getattr(args, "repeats", 1))
    for system in chosen:
        python = sys.executable
        if system == "hivemind":
            found, why = hivemind_of(args)
            print(why, flush=True)
            if found is None:
                runs[system] = {"skipped": why}
                continue
            python = found
        print(f"running {system} ...", flush=True)
        runs[system] = summarize(run_system(args, system, python), args.target_loss)
    # More pairs of the two modes the loss check compares, alternating, after
    # the first of each: one pair's ratio moves by +-2 % with the run.
    pair = [s for s in ("p2ptrain_sync", "p2ptrain_overlap") if s in runs]
    for again in range(2, repeats + 1) if len(pair) == 2 else ():
        for system in pair:
            print(f"running {system} (pair {again} of {repeats}) ...", flush=True)
            extra = summarize(run_system(args, system, sys.executable), args.target_loss)
            runs[system].setdefault("repeats", []).append(extra)
    report(args, runs)
