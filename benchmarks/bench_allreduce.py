"""All-reduce benchmark: p2ptrain's butterfly against torch.distributed gloo and hivemind.

Usage::

    python -m benchmarks.bench_allreduce [--sizes 4,64,256] [--repeats 5] [--peers 4]
        [--chunk-kib 4096] [--p2ptrain-pool-mib N] [--profile-dir DIR] [--peer-detail]
        [--hivemind-python PATH | --no-hivemind] [--no-plaintext] [--skip-hetero] [--hetero-mb 16]
        [--hetero-chunk-kib 256] [--hetero-repeats N] [--shaped-only] [--skip-adaptive]
        [--png allreduce.png] [--json-only]

**Loopback.** ``--peers`` processes per system average a float32 vector of
each ``--sizes`` MiB:

* ``p2ptrain``: the butterfly all-reduce with equal shares, codec ``none``,
  every connection encrypted (AES-256-GCM records, the library's default;
  the log line counts the sealed connections, JSON ``p2ptrain_encrypted``),
  uvloop, ``--chunk-kib`` chunks (the library's default: 4 MiB) and the
  library's buffer pool (``--p2ptrain-pool-mib`` changes how much it keeps;
  ``--profile-dir`` profiles the peers and prints where their CPU goes);
* ``p2ptrain-plaintext``: the same peers with ``--insecure-plaintext`` (the
  trusted-cluster opt-out: no records after the handshake), to show what
  encryption costs in the same run (``--no-plaintext`` leaves them out);
* ``gloo``: ``torch.distributed.all_reduce(SUM)`` over gloo (TCP store on
  loopback), then a division by the world size;
* ``hivemind``: hivemind's ``DecentralizedAverager`` run by this interpreter
  when it can import hivemind (the ``bench`` extra), or by
  ``--hivemind-python PATH``, its own DHT on loopback; matchmaking happens before the
  timed region (``step(require_trigger=True)``), the trigger starts it.

For each size a warm-up round, then ``--repeats`` timed rounds (p2ptrain and
gloo alternate; hivemind runs afterwards). A round lasts from the first peer
receiving ``go`` to the last peer holding its result; the table gives the
median. CPU is ``getrusage`` of every peer process around its part of the
round (hivemind: its whole process tree, daemon included, from /proc), summed
over the peers, per GiB of vector. Every peer checks its whole result against
the exact average after every round (outside the timing); a wrong average
stops the benchmark (hivemind's rounds that keep local values, which its
fault tolerance allows, or whose matchmaking forms no group are retried and
counted in ``retried_rounds``).

**Heterogeneous bandwidth** (root only; ``--skip-hetero`` to leave it out):
eight peers in network namespaces with ``tc tbf`` links, the LP's shares
against equal shares and gloo, each against its model's prediction; see
``allreduce/hetero.py`` for the scenario and why it was chosen. Then, in
the same run, the adaptive scenarios of ``allreduce/adaptive.py``
(``--skip-adaptive`` leaves them out): the LP fed only by measurement, the
throttle (the fastest link 1000 → 100 Mbit/s after round 3 of 10), and the
same peers with 40 ms RTT at 1 and 16 MiB. ``--shaped-only`` runs just the
shaped part (no loopback rows, no hivemind).

Output: the tables, ratios against the goals, a PNG (``--png``), and as the
very last line one JSON object. Units: 1 MiB = 2**20 bytes; ``cpu_s_per_GB``
is CPU seconds per GiB (2**30 bytes) of vector; rates are Mbit/s = 10**6 bit/s.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from benchmarks.allreduce.adaptive import ADAPT_TOLERANCE, run_adaptive
from benchmarks.allreduce.hetero import HeteroResult, run_hetero
from benchmarks.allreduce.report import (
    Series,
    hetero_report,
    loopback_report,
    plot,
    profile_report,
)
from benchmarks.allreduce.runner import (
    BenchmarkError,
    NotPreparedError,
    PeerGroup,
    WrongAverageError,
    run_round,
)
from benchmarks.allreduce.systems import (
    free_port,
    p2ptrain_plan,
    p2ptrain_prepares,
    start_gloo,
    start_hivemind,
    start_p2ptrain,
    vector_prepares,
)
from benchmarks.harness import DefaultsHelpFormatter, emit_json, uvloop_available
from benchmarks.options import (
    add_hivemind_arguments,
    add_json_only_argument,
    add_plot_argument,
    hivemind_of,
)
from p2ptrain.allreduce import GroupPlan
from p2ptrain.allreduce.group import DEFAULT_CHUNK_ELEMENTS
from p2ptrain.lab.natlab.netns import lab_unavailable, python_env
from p2ptrain.node.address import PeerAddress
from p2ptrain.rpc.config import ConnectionConfig
from p2ptrain.transport.crypto_offload import effective_offload_bytes

MiB = 1 << 20
HIVEMIND_RETRIES = 3
"""Extra attempts for a hivemind round that formed no group or whose result kept local values."""


def _log(args: argparse.Namespace, text: str) -> None:
    if not args.json_only:
        print(text, file=sys.stderr, flush=True)


# -- loopback ---------------------------------------------------------------------------------


def _timed(
    args: argparse.Namespace,
    series: Series,
    attempt: int,
    group: PeerGroup,
    prepares: Sequence[dict[str, Any]],
    *,
    retries: int = 0,
) -> None:
    """Run one round; keep it unless it is the warm-up."""
    for tries in range(retries + 1):
        try:
            round_ = run_round(
                group, prepares, prepare_timeout=args.timeout, round_timeout=args.timeout
            )
            break
        except (WrongAverageError, NotPreparedError) as exc:
            if tries == retries:
                raise
            series.retried += 1
            _log(args, f"  {series.system}: retrying the round ({exc})")
            if isinstance(exc, NotPreparedError):
                group.request([{"cmd": "cancel"}] * len(group), timeout=args.timeout)
    kind = "warm-up" if attempt == 0 else f"run {attempt}"
    starts = [o["start"] for o in round_.outcomes]
    text = (
        f"  {series.system:<8} {series.size_bytes // MiB:>4} MiB {kind:>8}: "
        f"{round_.seconds:7.3f} s, CPU {round_.cpu_s:6.3f} s, max error {round_.max_error:.1e}, "
        f"start skew {(max(starts) - min(starts)) * 1e3:.0f} ms"
    )
    details = [o["detail"] for o in round_.outcomes if "pool_allocated" in o.get("detail", {})]
    if details:  # p2ptrain: signs of buffers not recycled
        faults = sum(d["page_faults"] for d in details)
        fresh = sum(d["pool_allocated"] for d in details)
        text += f", page faults {faults}, fresh pool buffers {fresh}"
        sealed = [flag for d in details for flag in d.get("sealed", [])]
        text += f", sealed connections {sum(sealed)}/{len(sealed)}"
        if series.system == "p2ptrain":  # the default rows: every connection sealed?
            args.p2ptrain_sealed = (
                bool(sealed) and all(sealed) and getattr(args, "p2ptrain_sealed", True)
            )
    if args.peer_detail:
        for o in round_.outcomes:
            d = o.get("detail", {})
            if "reduce_scatter_s" in d:
                text += (
                    f"\n      peer: start +{(o['start'] - min(starts)) * 1e3:.0f} ms, "
                    f"reduce-scatter {d['reduce_scatter_s']:.3f} s, "
                    f"all-gather {d['all_gather_s']:.3f} s, CPU {o['cpu_s']:.3f} s"
                )
    _log(args, text)
    if attempt:
        series.rounds.append(round_)


def _plan(args: argparse.Namespace, addresses: Sequence[PeerAddress], numel: int) -> GroupPlan:
    n = len(addresses)
    return p2ptrain_plan(
        addresses, [1 / n] * n, numel, chunk_elements=args.chunk_kib * 256, timeout=args.timeout
    )


def measure_p2ptrain_and_gloo(args: argparse.Namespace) -> list[Series]:
    """Both systems' peers run side by side; their rounds alternate."""
    n, env = args.peers, python_env()
    results = []
    with (
        PeerGroup("p2ptrain", env=env) as ours,
        PeerGroup("gloo", env=env) as gloo,
        PeerGroup("p2ptrain-plaintext", env=env) as plain,
    ):
        profile = None
        if args.profile_dir:
            profile = os.path.join(os.path.abspath(args.profile_dir), "p2ptrain-{pid}.prof")
        addresses = start_p2ptrain(
            ours,
            ["127.0.0.1"] * n,
            timeout=args.timeout,
            pool_mib=args.p2ptrain_pool_mib,
            profile=profile,
            crypto_offload=not args.no_crypto_offload,
        )
        start_gloo(gloo, f"127.0.0.1:{free_port()}", n, ifname="lo", timeout=args.timeout)
        plain_addresses = []
        if args.plaintext_rows:
            plain_addresses = start_p2ptrain(
                plain,
                ["127.0.0.1"] * n,
                timeout=args.timeout,
                pool_mib=args.p2ptrain_pool_mib,
                insecure_plaintext=True,
            )
        for size in args.sizes:
            numel = size * MiB // 4
            mine = Series("p2ptrain", n, numel * 4)
            theirs = Series("gloo", n, numel * 4)
            unsealed = Series("p2ptrain-plaintext", n, numel * 4)
            for attempt in range(1 + args.repeats):
                runs = [
                    (mine, ours, p2ptrain_prepares(_plan(args, addresses, numel))),
                    (theirs, gloo, vector_prepares(n, numel)),
                ]
                if plain_addresses:
                    plan = _plan(args, plain_addresses, numel)
                    runs.append((unsealed, plain, p2ptrain_prepares(plan)))
                for series, group, prepares in runs if attempt % 2 == 0 else runs[::-1]:
                    _timed(args, series, attempt, group, prepares)
            results += [mine, theirs] + ([unsealed] if plain_addresses else [])
    return results


def measure_hivemind(args: argparse.Namespace, python: str) -> list[Series]:
    """hivemind's peers, one averager per size (its first round is the warm-up)."""
    n = args.peers
    results = []
    with PeerGroup("hivemind", env=python_env()) as group:
        start_hivemind(
            group, python, n, matchmaking_s=args.hivemind_matchmaking_s, timeout=args.timeout
        )
        for size in args.sizes:
            numel = size * MiB // 4
            series = Series("hivemind", n, numel * 4)
            for attempt in range(1 + args.repeats):
                prepares = vector_prepares(n, numel)
                _timed(args, series, attempt, group, prepares, retries=HIVEMIND_RETRIES)
            results.append(series)
    return results


# -- entry point ------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse and check the command line."""
    parser = argparse.ArgumentParser(
        description="p2ptrain's butterfly all-reduce vs gloo and hivemind; the LP on shaped links.",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--sizes", default="4,64,256", help="vector sizes in MiB, comma-separated")
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed rounds per size (median kept)"
    )
    parser.add_argument("--peers", type=int, default=4, help="peers on loopback")
    parser.add_argument(
        "--chunk-kib",
        type=int,
        default=DEFAULT_CHUNK_ELEMENTS // 256,
        help="p2ptrain chunk size on loopback (KiB; default: the library's)",
    )
    parser.add_argument(
        "--no-crypto-offload",
        action="store_true",
        help="encrypted p2ptrain rows with every AES-GCM pass on the event loop "
        "(ConnectionConfig.crypto_offload_bytes=None; offload is used only on 4+ cores)",
    )
    parser.add_argument(
        "--p2ptrain-pool-mib",
        type=int,
        help="idle bytes p2ptrain's buffer pool may keep, MiB (default: the library's: "
        "256, raised to twice the vector by each round)",
    )
    parser.add_argument(
        "--profile-dir",
        help="run the loopback p2ptrain peers under cProfile, write the stats here, summarize",
    )
    parser.add_argument(
        "--peer-detail",
        action="store_true",
        help="log each p2ptrain peer's start offset, phases and CPU in every loopback round",
    )
    add_hivemind_arguments(parser)
    parser.add_argument(
        "--no-plaintext",
        dest="plaintext_rows",
        action="store_false",
        help="leave out the p2ptrain-plaintext rows (--insecure-plaintext peers)",
    )
    parser.add_argument(
        "--hivemind-matchmaking-s", type=float, default=2.0, help="hivemind min_matchmaking_time"
    )
    parser.add_argument("--skip-hetero", action="store_true", help="leave out the shaped-link part")
    parser.add_argument("--hetero-mb", type=float, default=16, help="vector MiB on shaped links")
    parser.add_argument(
        "--hetero-chunk-kib", type=int, default=256, help="p2ptrain chunk size on shaped links"
    )
    parser.add_argument(
        "--hetero-repeats",
        type=int,
        help="timed rounds per plan on shaped links (default --repeats)",
    )
    parser.add_argument(
        "--shaped-only", action="store_true", help="run only the shaped-link part (root)"
    )
    parser.add_argument(
        "--pacing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="shaped part: kernel pacing of p2ptrain's round streams (pacing_headroom 1.25;"
        " AllReduceConfig's default is off: docs/allreduce.md, 'Kernel pacing')",
    )
    parser.add_argument(
        "--skip-adaptive", action="store_true", help="leave out the measured/throttle/RTT scenarios"
    )
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds one round may take")
    add_plot_argument(parser, "the plot", default="allreduce.png")
    add_json_only_argument(parser)
    args = parser.parse_args(argv)
    try:
        args.sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    except ValueError:
        parser.error("--sizes must be integers (MiB) separated by commas")
    if not args.sizes or any(size <= 0 for size in args.sizes):
        parser.error("--sizes must be positive")
    if args.repeats < 1 or args.peers < 2:
        parser.error("--repeats must be >= 1 and --peers >= 2")
    if not 1 <= args.chunk_kib <= 8192 or not 1 <= args.hetero_chunk_kib <= 8192:
        parser.error("chunk sizes must be 1..8192 KiB")
    if args.hetero_repeats is None:
        args.hetero_repeats = args.repeats
    return args


def _adaptive_report(h: dict[str, Any]) -> None:
    """Print the adaptive scenarios against their goals."""
    lp, measured = h["lp_s"], h["measured_lp_s"]
    print("Adaptive (LP fed only by measurement; throttle; RTT)")
    print(
        f"  measured-fed LP {measured:.3f} s vs configured-rate LP {lp:.3f} s:"
        f" {measured / lp - 1:+.1%} (goal within 5 %)"
    )
    print(
        f"  achieved/predicted: configured {lp / h['predicted_s']:.3f},"
        f" measured {measured / h['measured_predicted_s']:.3f} (goal within 10 %)"
    )
    print(
        f"  throttle: adapted after {h['throttle_rounds_to_adapt']} round(s) (goal <= 3);"
        f" {h['throttle_s']:.3f} s vs {h['throttle_predicted_s']:.3f} s predicted for the new"
        f" rates (fair-share time; fluid {h['throttle_fluid_predicted_s']:.3f} s;"
        f" goal within {ADAPT_TOLERANCE:.0%})"
    )
    print(
        f"  throttle: the configured new rates' plan achieved"
        f" {h['throttle_configured_plan_s']:.3f} s on the same links;"
        f" within {ADAPT_TOLERANCE:.0%} of it after"
        f" {h['throttle_rounds_to_match_configured']} round(s)"
    )
    for row in h["rtt_rows"]:
        print(
            f"  {h['rtt_ms']:g} ms RTT, {row['mib']} MiB: {row['achieved_s']:.3f} s vs"
            f" {row['predicted_s']:.3f} s predicted ({row['achieved_s'] / row['predicted_s']:.2f}x;"
            f" without the latency term {row['predicted_without_latency_s']:.3f} s;"
            f" goal within 20 %; rounds {row['gap_s']:g} s apart);"
            " back to back (warm connections, outside the latency term):"
            f" {', '.join(f'{x:.3f}' for x in row['back_to_back_s'])} s"
        )
    print()


def _terminate(signum: int, frame: object) -> None:
    """SIGTERM: unwind like Ctrl-C, so that peers and namespaces are torn down."""
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark."""
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    torch.set_num_threads(1)
    started = time.monotonic()
    series = [] if args.shaped_only else measure_p2ptrain_and_gloo(args)
    python, hivemind_note = (
        (None, "hivemind skipped (--shaped-only)") if args.shaped_only else hivemind_of(args)
    )
    hivemind_error = None
    if python is not None:
        try:
            series += measure_hivemind(args, python)
        except BenchmarkError as exc:
            hivemind_error = str(exc)
            hivemind_note = f"hivemind failed: {exc}"
    _log(args, hivemind_note)

    shaped: dict[str, Any] = {  # the workload of both shaped-link parts
        "vector_bytes": int(args.hetero_mb * MiB) // 4 * 4,
        "chunk_bytes": args.hetero_chunk_kib * 1024,
        "repeats": args.hetero_repeats,
        "timeout": args.timeout,
        "log": lambda text: _log(args, text),
        "pacing": args.pacing,
    }
    hetero_result: HeteroResult | None = None
    hetero_note = None
    if args.skip_hetero:
        hetero_note = "skipped (--skip-hetero)"
    elif (reason := lab_unavailable(turn=False)) is not None:
        hetero_note = f"skipped: {reason}"
    else:
        hetero_result = run_hetero(**shaped)
    adaptive = None
    if hetero_result is not None and not args.skip_adaptive:
        adaptive = run_adaptive(**shaped)
    ratios = loopback_report(args, series, hivemind_note) if series else {}
    if args.profile_dir and not args.json_only:
        profile_report(args, series)
    hetero = None if hetero_result is None else hetero_report(args, hetero_result)
    if hetero is not None and adaptive is not None:
        hetero.update(adaptive)
        if not args.json_only:
            _adaptive_report(hetero)
    if hetero_note is not None and not args.json_only:
        print(f"Heterogeneous bandwidth: {hetero_note}")
    if args.png:
        plot(args.png, args, series, hetero)
    elapsed = time.monotonic() - started
    if not args.json_only:
        print(f"PNG: {os.path.abspath(args.png) if args.png else '-'}; total {elapsed:.0f} s")
    emit_json(
        {
            "rows": [s.row() for s in series if s.rounds],
            "ratios": ratios,
            "hetero": hetero if hetero is not None else {"skipped": hetero_note},
            "hivemind": hivemind_note if hivemind_error is None else {"error": hivemind_error},
            "peers": args.peers,
            "repeats": args.repeats,
            "chunk_bytes": args.chunk_kib * 1024,
            "p2ptrain_encrypted": getattr(args, "p2ptrain_sealed", None),
            "p2ptrain_crypto_offload": effective_offload_bytes(
                None if args.no_crypto_offload else ConnectionConfig().crypto_offload_bytes
            ),
            "p2ptrain_pool_mib": args.p2ptrain_pool_mib,
            "statistic": "median",
            "uvloop": uvloop_available(),
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "cores": os.cpu_count(),
            "load_avg_1min": round(os.getloadavg()[0], 2),
            "elapsed_s": round(elapsed, 1),
            "png": os.path.abspath(args.png) if args.png else None,
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
