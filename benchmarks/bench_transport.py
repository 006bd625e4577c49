"""Transport benchmark: p2ptrain RPC against a plain socket, and the WebRTC data channel.

Usage::

    python -m benchmarks.bench_transport [--megabytes 256] [--chunk-kib 1024]
        [--rtt-calls 10000] [--repeats 3] [--handshakes 200] [--uvloop | --no-uvloop]
        [--png PATH] [--json-only]
        [--no-webrtc] [--webrtc-seconds 4] [--webrtc-loss-seconds 20]
        [--webrtc-repeats 6] [--webrtc-loss-repeats 3]
        [--no-shaped] [--shaped-mib 24] [--shaped-repeats 3]

For every *path* a server runs in its own OS process (this script again, in a
hidden ``--role server`` mode) and the client side runs in this process, over
loopback:

* bulk: ``--megabytes`` of float32 tensor chunks of ``--chunk-kib`` each. On the
  ``rpc`` path every chunk is one message of one RPCStream (tensor header in
  the body, the raw bytes as payload); the receiver decodes each chunk into a
  tensor without copying and, when the stream ends, answers with the byte
  count and a checksum, which the sender verifies. On the ``raw`` path the
  same bytes go through a bare asyncio transport in the same chunk sizes and
  the receiver only counts them. Throughput is timed from the first send to
  the acknowledgement (on the ``rpc`` path ``encode_tensor`` runs inside the
  timing, as it would in training); CPU seconds per GiB are measured in each
  process with ``getrusage``. The paths alternate, ``--repeats`` runs each, and
  the table reports the median run.
* the ``rpc`` path is p2ptrain's default, so it is encrypted end to end
  (AES-256-GCM records after an X25519/Ed25519 handshake, see
  docs/security.md): ``secure_rpc_MBps``. The ``rpc-plaintext`` path is the
  same with ``--insecure-plaintext`` on both ends (the trusted-cluster
  opt-out): ``rpc_MBps``. The goal: encrypted RPC at least 0.60 of the raw
  socket's throughput at 1 MiB chunks.
* handshakes: ``--handshakes`` fresh handshakes with the server on new TCP
  connections (the connect itself not timed); ``handshake_ms`` is the median.
* round trips: ``--rtt-calls`` sequential tiny requests after a warm-up
  (unary RPC calls; a 16-byte echo on the raw path): median, p99, and the CPU
  each side spends per call.

Then the WebRTC data channel, in a NAT lab of network namespaces (root only;
without root these rows are skipped with a message and the TCP rows still
print): stock aiortc against p2ptrain's default ``WebRTCConfig()`` between two
homes behind easy NATs, on a clean path and on a lossy one (40 ms RTT, 0.5 %
loss through the tun shim), runs interleaved (``--webrtc-repeats`` and
``--webrtc-loss-repeats`` per variant); see
``benchmarks/bench_webrtc.py``, whose code this reuses and which also runs
the ablation.

Then send pacing on a shaped home uplink (root; skipped with a message
otherwise): two hosts of the star lab at 50 Mbit/s up, 100 down; one streams
``--shaped-mib`` MiB in 1 MiB frames to the other while making an echo call
every 50 ms, with p2ptrain's default pacing and with it off
(``pace_target_s=None``), alternating, ``--shaped-repeats`` each
(:mod:`p2ptrain.lab.bulk_echo`). The table shows the stream's rate and
the calls' median and 90th-percentile latency; JSON keys
``shaped_echo_ms_paced``, ``shaped_echo_ms_unpaced`` (medians of the runs'
medians), ``shaped_echo_p90_ms_paced``, ``shaped_echo_p90_ms_unpaced``,
``shaped_bulk_MBps_paced``, ``shaped_bulk_MBps_unpaced``.

On a shared machine wall-clock figures swing from run to run; the CPU columns
are steadier, and when both processes compete for the cores the throughput
ratio follows the ratio of total CPU per GiB.

The table goes to stdout, followed by one JSON line (always the last line)
with, besides the TCP figures, ``webrtc_MBps`` (tuned, clean),
``webrtc_stock_MBps``, ``webrtc_loss_MBps``, ``webrtc_stock_loss_MBps``, each
with a ``*_cpu_s_per_GB``, and ``webrtc_ratio`` / ``webrtc_loss_ratio``
(median of the per-repeat tuned/stock ratios). Units: 1 MB = 1 MiB = 2**20
bytes, so ``rpc_MBps`` is MiB/s.

The paths live in ``benchmarks/transport/`` (``path.py``: the workload and
the client interface; ``rpc.py``; ``raw.py``). Adding a loopback transport
means writing a server coroutine and a :class:`~benchmarks.transport.path.PathClient`
there, and adding one :class:`~benchmarks.transport.path.BenchPath` to
:data:`PATHS`; it then shows up as one more row.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks import bench_webrtc
from benchmarks.harness import (
    DefaultsHelpFormatter,
    ServerProcess,
    announce_ready,
    cpu_seconds,
    emit_json,
    format_table,
    median,
    module_argv,
    percentile,
    plot_bars,
    run,
    uvloop_available,
)
from benchmarks.options import (
    add_json_only_argument,
    add_plot_argument,
    add_role_argument,
    add_uvloop_argument,
)
from benchmarks.transport.path import MAX_CHUNK_BYTES, BenchPath, BulkRun, MiB, Workload
from benchmarks.transport.raw import RawClient, serve_raw
from benchmarks.transport.rpc import (
    InlineCryptoRPCClient,
    PlaintextRPCClient,
    RPCClient,
    serve_rpc,
    serve_rpc_inline_crypto,
    serve_rpc_plaintext,
)
from p2ptrain.lab import bulk_echo
from p2ptrain.lab.natlab.netns import lab_unavailable
from p2ptrain.lab.starlab import LinkSpec, StarLab

PATHS: dict[str, BenchPath] = {
    path.key: path
    for path in (
        BenchPath("rpc", "p2ptrain RPC (tcp, encrypted)", serve_rpc, RPCClient),
        BenchPath(
            "rpc-plaintext",
            "p2ptrain RPC (tcp, --insecure-plaintext)",
            serve_rpc_plaintext,
            PlaintextRPCClient,
        ),
        BenchPath("raw", "raw asyncio socket", serve_raw, RawClient),
        BenchPath(
            "rpc-inline-crypto",
            "p2ptrain RPC (tcp, encrypted, no crypto threads)",
            serve_rpc_inline_crypto,
            InlineCryptoRPCClient,
        ),
    )
}
OPTIONAL_PATHS = ("rpc-inline-crypto",)
"""Paths measured only when asked for (``--inline-crypto-row``): an ablation."""
BASELINE = "raw"
"""The path every other one is compared with."""
SECURE_GOAL = 0.60
"""Encrypted RPC throughput at 1 MiB chunks, as a fraction of the raw socket's."""


# -- measuring -----------------------------------------------------------------------------


@dataclass
class PathResult:
    """Everything measured on one path."""

    path: BenchPath
    runs: list[BulkRun] = field(default_factory=list)
    rtt_us: list[float] = field(default_factory=list)
    rtt_client_cpu_us: float = math.nan
    """Client CPU per round trip, µs."""
    rtt_server_cpu_us: float = math.nan
    """Server CPU per round trip, µs."""

    def median_run(self) -> BulkRun:
        """The run with the median throughput (the upper median for an even count)."""
        ordered = sorted(self.runs, key=lambda r: r.mib_per_s)
        return ordered[len(ordered) // 2]

    def summary(self) -> dict[str, Any]:
        """Figures for the table and the JSON line."""
        mid = self.median_run()
        speeds = [r.mib_per_s for r in self.runs]
        return {
            "MBps": round(median(speeds), 1),
            "MBps_runs": [round(s, 1) for s in speeds],
            "MBps_best": round(max(speeds), 1),
            "send_cpu_s_per_GiB": round(mid.cpu_per_gib(mid.sender_cpu), 3),
            "recv_cpu_s_per_GiB": round(mid.cpu_per_gib(mid.receiver_cpu), 3),
            "rtt_median_us": round(median(self.rtt_us), 1),
            "rtt_p99_us": round(percentile(self.rtt_us, 99), 1),
            "rtt_client_cpu_us": round(self.rtt_client_cpu_us, 1),
            "rtt_server_cpu_us": round(self.rtt_server_cpu_us, 1),
        }


def _log(quiet: bool, text: str) -> None:
    if not quiet:
        print(text, file=sys.stderr, flush=True)


async def measure(args: argparse.Namespace, addresses: dict[str, str]) -> dict[str, PathResult]:
    """Run every measurement against the servers at ``addresses``."""
    work = Workload.make(args.megabytes * MiB, args.chunk_kib * 1024)
    warm = Workload.make(min(work.total_bytes, 16 * MiB), work.chunk_bytes)
    results = {key: PathResult(PATHS[key]) for key in addresses}
    clients = {key: PATHS[key].client() for key in addresses}
    try:
        for key, client in clients.items():
            await client.connect(addresses[key])
            await client.bulk(warm)
        for attempt in range(args.repeats):
            for key, client in clients.items():
                result = await client.bulk(work)
                results[key].runs.append(result)
                _log(
                    args.json_only,
                    f"  bulk {key:>4} run {attempt + 1}/{args.repeats}: "
                    f"{result.mib_per_s:8.1f} MiB/s in {result.seconds:.3f} s",
                )
        for key, client in clients.items():
            res = results[key]
            await client.round_trips(args.rtt_warmup)
            server_start = await client.server_cpu()
            client_start = cpu_seconds()
            res.rtt_us = await client.round_trips(args.rtt_calls)
            res.rtt_client_cpu_us = (cpu_seconds() - client_start) / args.rtt_calls * 1e6
            res.rtt_server_cpu_us = (
                (await client.server_cpu() - server_start) / args.rtt_calls * 1e6
            )
            _log(args.json_only, f"  rtt  {key:>4}: median {median(res.rtt_us):.1f} µs")
        rpc = clients.get("rpc")
        if isinstance(rpc, RPCClient):
            args.zero_copy_decode = rpc.zero_copy_decode
            args.handshake_ms = await rpc.handshakes(args.handshakes)
            _log(args.json_only, f"  handshake: median {median(args.handshake_ms):.2f} ms")
    finally:
        for client in clients.values():
            await client.aclose()
    return results


# -- the WebRTC data channel ---------------------------------------------------------------

WEBRTC_PATHS = ("clean", "lossy")
WEBRTC_VARIANTS = ("stock", "tuned")


@dataclass
class WebRTCOutcome:
    """The WebRTC cells, or why they were not measured."""

    cells: dict[tuple[str, str], bench_webrtc.Cell] = field(default_factory=dict)
    skipped: str | None = None


def measure_webrtc(args: argparse.Namespace) -> WebRTCOutcome:
    """Stock aiortc and the default ``WebRTCConfig()`` in the NAT lab, clean and lossy."""
    if not args.webrtc:
        return WebRTCOutcome(skipped="--no-webrtc")
    reason = lab_unavailable()
    if reason is not None:
        print(
            f"WebRTC rows skipped: the NAT lab {reason}; TCP rows only", file=sys.stderr, flush=True
        )
        return WebRTCOutcome(skipped=reason)
    runs = 2 * (args.webrtc_repeats * args.webrtc_seconds)
    runs += 2 * (args.webrtc_loss_repeats * args.webrtc_loss_seconds)
    _log(
        args.json_only,
        f"WebRTC part (root; --no-webrtc leaves it out): about {runs:.0f} s of timed runs",
    )
    cells = bench_webrtc.measure(
        WEBRTC_PATHS,
        WEBRTC_VARIANTS,
        seconds={"clean": args.webrtc_seconds, "lossy": args.webrtc_loss_seconds},
        repeats={"clean": args.webrtc_repeats, "lossy": args.webrtc_loss_repeats},
        log=lambda text: _log(args.json_only, text),
    )
    return WebRTCOutcome(cells=cells)


SHAPED_LINK = LinkSpec(50, 100)


def measure_shaped(args: argparse.Namespace) -> dict[str, Any]:
    """Echo latency during a bulk stream on a shaped uplink, paced and unpaced (JSON fields)."""
    if not args.shaped:
        return {"shaped_skipped": "--no-shaped"}
    reason = lab_unavailable()
    if reason is not None:
        print(f"shaped rows skipped: the lab {reason}", file=sys.stderr, flush=True)
        return {"shaped_skipped": reason}
    _log(args.json_only, f"shaped part (root; --no-shaped leaves it out): {args.shaped_mib} MiB")
    runs: dict[str, list[dict[str, Any]]] = {"paced": [], "unpaced": []}
    with StarLab([SHAPED_LINK, SHAPED_LINK]) as lab:
        for _ in range(args.shaped_repeats):
            for mode, results in runs.items():
                results.append(bulk_echo.run_in_lab(lab, args.shaped_mib, paced=mode == "paced"))
    out: dict[str, Any] = {}
    rows = []
    for mode, results in runs.items():
        mbps = median([r["bytes"] / r["seconds"] / 2**20 for r in results])
        echo_ms = median([1000 * r["median"] for r in results])
        p90_ms = median([1000 * r["p90"] for r in results])
        out[f"shaped_bulk_MBps_{mode}"] = round(mbps, 3)
        out[f"shaped_echo_ms_{mode}"] = round(echo_ms, 1)
        out[f"shaped_echo_p90_ms_{mode}"] = round(p90_ms, 1)
        rows.append((mode, f"{mbps:.2f}", f"{echo_ms:.0f}", f"{p90_ms:.0f}"))
    if not args.json_only:
        print(
            f"\nsend pacing: {SHAPED_LINK.upload_mbit:g} Mbit/s uplink, a {args.shaped_mib} MiB "
            f"stream in 1 MiB frames, an echo call every 50 ms; median of "
            f"{args.shaped_repeats} runs each"
        )
        print(format_table(["pacing", "stream MiB/s", "echo median ms", "echo p90 ms"], rows))
        ratio = out["shaped_echo_ms_unpaced"] / max(out["shaped_echo_ms_paced"], 1e-9)
        print(f"echo median, unpaced/paced: {ratio:.1f}x")
    return out


def _print_all_paths(
    args: argparse.Namespace, summaries: dict[str, dict[str, Any]], webrtc: WebRTCOutcome
) -> None:
    """One table of every path: MiB/s and CPU s/GiB (sender + receiver)."""
    rows: list[list[object]] = []
    for key, summ in summaries.items():
        cpu = summ["send_cpu_s_per_GiB"] + summ["recv_cpu_s_per_GiB"]
        rows.append([f"tcp loopback: {PATHS[key].label}", summ["MBps"], None, None, cpu])
    for row in bench_webrtc.table_rows(webrtc.cells):
        rows.append([row[0], row[1], row[3], row[4], row[5]])
    print()
    print("all paths: MiB/s and CPU s/GiB of both processes")
    if webrtc.skipped is None:
        print(
            "WebRTC (NAT lab): medians of "
            f"{args.webrtc_repeats} interleaved runs of {args.webrtc_seconds:g} s (clean) and "
            f"{args.webrtc_loss_repeats} of {args.webrtc_loss_seconds:g} s (lossy: 40 ms RTT, "
            "0.5 % loss); x stock = median of the per-repeat tuned/stock ratios"
        )
    print(format_table(["path", "MiB/s", "x stock", "x stock runs", "CPU s/GiB"], rows))
    if webrtc.skipped is not None:
        print(f"(WebRTC rows skipped: {webrtc.skipped})")
        return
    figures = bench_webrtc.summary(webrtc.cells)
    for path, name in bench_webrtc.RATIO_NAMES.items():
        if name in figures:
            goal = bench_webrtc.GOALS[path]
            verdict = "meets" if figures[name] >= goal else "misses"
            print(f"webrtc {path}: tuned/stock {figures[name]:.2f} ({verdict} the {goal:g}x goal)")


def report(
    args: argparse.Namespace,
    results: dict[str, PathResult],
    webrtc: WebRTCOutcome | None = None,
) -> dict[str, Any]:
    """Print the tables (unless ``--json-only``), write the PNG, return the JSON result."""
    webrtc = webrtc if webrtc is not None else WebRTCOutcome(skipped="not measured")
    summaries = {key: res.summary() for key, res in results.items()}
    base = summaries[BASELINE]
    rpc = summaries["rpc"]
    plain = summaries.get("rpc-plaintext", rpc)
    ratio = rpc["MBps"] / base["MBps"]
    handshake_ms = median(args.handshake_ms) if args.handshake_ms else math.nan
    loop = "uvloop" if args.uvloop else "asyncio"
    if not args.json_only:
        _print_tables(args, results, summaries, loop)
        verdict = "meets" if ratio >= SECURE_GOAL else "misses"
        print(
            f"encrypted rpc/raw throughput ratio {ratio:.2f} ({verdict} the {SECURE_GOAL:.2f} goal)"
        )
        print(f"encrypted/plaintext rpc throughput {rpc['MBps'] / plain['MBps']:.2f}")
        print(f"handshake (X25519 + Ed25519, loopback): median {handshake_ms:.2f} ms")
        _print_all_paths(args, summaries, webrtc)
    if args.png:
        labels = {key: res.path.label for key, res in results.items()}
        plot_bars(
            args.png,
            [
                (f"bulk MiB/s ({args.chunk_kib} KiB chunks)", _by_label(labels, summaries, "MBps")),
                ("round trip median, µs", _by_label(labels, summaries, "rtt_median_us")),
                ("round trip p99, µs", _by_label(labels, summaries, "rtt_p99_us")),
            ],
            title=f"p2ptrain transport benchmark, {loop}, loopback",
        )
    return {
        "secure_rpc_MBps": rpc["MBps"],
        "rpc_MBps": plain["MBps"],  # with --insecure-plaintext on both ends
        "raw_MBps": base["MBps"],
        "secure_over_plaintext": round(rpc["MBps"] / plain["MBps"], 3),
        "handshake_ms": round(handshake_ms, 3),
        "handshake_ms_p90": round(percentile(args.handshake_ms, 90), 3)
        if args.handshake_ms
        else None,
        "ratio": round(ratio, 3),
        "rtt_median_us": rpc["rtt_median_us"],
        "rtt_p99_us": rpc["rtt_p99_us"],
        "raw_rtt_median_us": base["rtt_median_us"],
        "raw_rtt_p99_us": base["rtt_p99_us"],
        "uvloop": args.uvloop,
        "megabytes": args.megabytes,
        "chunk_bytes": args.chunk_kib * 1024,
        "statistic": "median",
        "repeats": args.repeats,
        "rtt_calls": args.rtt_calls,
        "zero_copy_decode": args.zero_copy_decode,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "paths": summaries,
        **bench_webrtc.summary(webrtc.cells),
        "webrtc_skipped": webrtc.skipped,
    }


def _by_label(
    labels: dict[str, str], summaries: dict[str, dict[str, Any]], metric: str
) -> dict[str, float]:
    return {labels[key]: float(summ[metric]) for key, summ in summaries.items()}


def _print_tables(
    args: argparse.Namespace,
    results: dict[str, PathResult],
    summaries: dict[str, dict[str, Any]],
    loop: str,
) -> None:
    base = summaries[BASELINE]
    bulk_rows = []
    rtt_rows = []
    for key, summ in summaries.items():
        label = results[key].path.label
        runs = summ["MBps_runs"]
        bulk_rows.append(
            [
                label,
                summ["MBps"],
                f"{min(runs):,.0f}-{max(runs):,.0f}",
                f"{summ['MBps'] / base['MBps']:.2f}",
                summ["send_cpu_s_per_GiB"],
                summ["recv_cpu_s_per_GiB"],
            ]
        )
        rtt_rows.append(
            [
                label,
                summ["rtt_median_us"],
                summ["rtt_p99_us"],
                summ["rtt_client_cpu_us"],
                summ["rtt_server_cpu_us"],
            ]
        )
    print(
        f"bulk: {args.megabytes} MiB of float32 in {args.chunk_kib} KiB chunks, {loop}, "
        f"loopback, median of {args.repeats} runs (CPU of the median run)"
    )
    print(
        format_table(
            ["path", "MiB/s", "runs", "vs raw", "send CPU s/GiB", "recv CPU s/GiB"], bulk_rows
        )
    )
    print()
    print(f"round trips: {args.rtt_calls} sequential calls after {args.rtt_warmup} warm-up")
    print(
        format_table(
            ["path", "p50 µs", "p99 µs", "client CPU µs/call", "server CPU µs/call"], rtt_rows
        )
    )


# -- entry points --------------------------------------------------------------------------


def _serve_role(key: str, use_uvloop: bool) -> None:
    run(PATHS[key].serve(announce_ready), use_uvloop=use_uvloop)


def _server_argv(key: str, use_uvloop: bool) -> list[str]:
    loop_flag = "--uvloop" if use_uvloop else "--no-uvloop"
    return module_argv("benchmarks.bench_transport", "--role", "server", "--path", key, loop_flag)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse and check the command line."""
    parser = argparse.ArgumentParser(
        description="p2ptrain RPC streaming vs a plain asyncio socket, over loopback.",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--megabytes", type=int, default=256, help="MiB per bulk run")
    parser.add_argument("--chunk-kib", type=int, default=1024, help="KiB per tensor chunk")
    parser.add_argument("--rtt-calls", type=int, default=10_000, help="timed round trips")
    parser.add_argument("--rtt-warmup", type=int, default=500, help="untimed round trips first")
    parser.add_argument("--repeats", type=int, default=3, help="bulk runs per path (median kept)")
    parser.add_argument(
        "--handshakes", type=int, default=200, help="fresh handshakes timed (median reported)"
    )
    add_uvloop_argument(parser)
    add_plot_argument(parser, "a bar chart")
    parser.add_argument(
        "--webrtc",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=(
            "also measure the WebRTC data channel in the NAT lab (default: on where the lab "
            "can run, i.e. as root with iptables; stock and tuned, clean and lossy: about "
            "3 minutes with the defaults below; --no-webrtc leaves it out)"
        ),
    )
    parser.add_argument(
        "--webrtc-seconds",
        type=float,
        default=bench_webrtc.DEFAULT_SECONDS["clean"],
        help="seconds per WebRTC run, clean path",
    )
    parser.add_argument(
        "--webrtc-loss-seconds",
        type=float,
        default=bench_webrtc.DEFAULT_SECONDS["lossy"],
        help="seconds per WebRTC run, lossy path",
    )
    parser.add_argument(
        "--webrtc-repeats",
        type=int,
        default=bench_webrtc.DEFAULT_REPEATS["clean"],
        help="WebRTC runs per variant, clean path",
    )
    parser.add_argument(
        "--webrtc-loss-repeats",
        type=int,
        default=bench_webrtc.DEFAULT_REPEATS["lossy"],
        help="WebRTC runs per variant, lossy path",
    )
    parser.add_argument(
        "--shaped",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=(
            "also measure send pacing on a shaped 50 Mbit/s uplink in the star lab "
            "(root; about 30 s with the defaults; --no-shaped leaves it out)"
        ),
    )
    parser.add_argument("--shaped-mib", type=int, default=24, help="MiB per shaped run")
    parser.add_argument("--shaped-repeats", type=int, default=3, help="shaped runs per mode")
    add_json_only_argument(parser)
    parser.add_argument(
        "--inline-crypto-row",
        action="store_true",
        help="also measure encrypted RPC with crypto_offload_bytes=None (no worker threads)",
    )
    add_role_argument(parser, "server")
    parser.add_argument("--path", choices=sorted(PATHS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "server" and args.path is None:
        parser.error("--role server needs --path")
    if args.megabytes <= 0:
        parser.error("--megabytes must be positive")
    if not 0 < args.chunk_kib * 1024 <= MAX_CHUNK_BYTES:
        parser.error(f"--chunk-kib must be in 1..{MAX_CHUNK_BYTES // 1024}")
    if args.rtt_calls < 1 or args.rtt_warmup < 0 or args.repeats < 1:
        parser.error("--rtt-calls and --repeats must be positive, --rtt-warmup not negative")
    if min(args.webrtc_repeats, args.webrtc_loss_repeats) < 1 or (
        min(args.webrtc_seconds, args.webrtc_loss_seconds) <= 0
    ):
        parser.error("--webrtc-repeats and the WebRTC durations must be positive")
    if args.shaped_mib < 1 or args.shaped_repeats < 1:
        parser.error("--shaped-mib and --shaped-repeats must be positive")
    if args.uvloop and not uvloop_available():
        parser.error("uvloop is not installed")
    args.zero_copy_decode = None
    args.handshake_ms = []
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (or, with the hidden ``--role server``, one server)."""
    args = parse_args(argv)
    torch.set_num_threads(1)  # tiny tensor ops only; keep OpenMP threads off the 2 cores
    if args.role == "server":
        _serve_role(args.path, args.uvloop)
        return 0
    with contextlib.ExitStack() as stack:
        addresses = {}
        for key in PATHS:
            if key in OPTIONAL_PATHS and not args.inline_crypto_row:
                continue
            server = stack.enter_context(ServerProcess(_server_argv(key, args.uvloop)))
            addresses[key] = server.address
        results = run(measure(args, addresses), use_uvloop=args.uvloop)
    webrtc = measure_webrtc(args)
    shaped = measure_shaped(args)
    emit_json({**report(args, results, webrtc), **shaped})
    return 0


if __name__ == "__main__":
    sys.exit(main())
