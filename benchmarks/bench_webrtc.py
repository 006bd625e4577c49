"""WebRTC data-channel benchmark: stock aiortc against p2ptrain's tuned transport.

``benchmarks/bench_transport.py`` runs the stock and tuned rows of this module
next to its TCP rows (that is the benchmark to quote). This script adds the
ablation: every step between the two ends, one row each.

Usage (as root: it builds a NAT lab of network namespaces)::

    python -m benchmarks.bench_webrtc [--seconds 4] [--loss-seconds 20]
        [--paths clean,lossy] [--variants stock,tuned] [--ablation] [--repeats 3]
        [--json-only]

Two homes behind easy NATs exchange frames over a
:class:`~p2ptrain.transport.webrtc.WebRTCTransport` (the lab's coturn as STUN
server, so ICE finds the direct server-reflexive path). Every peer is its own
OS process (``lab.python``), as in production; the two processes of a pair
exchange the SDP offer and answer over a ``socketpair()`` inherited by both.

Paths:

* ``clean``: two unshaped homes (the CPU is the limit).
* ``lossy``: each home adds 10 ms each way and drops 0.25 % of packets each
  way in the tun shim (:mod:`p2ptrain.lab.lossy_link`): ~40 ms RTT and
  ~0.5 % loss on the path.

Variants (``--ablation`` adds the intermediate steps between the two ends):

* ``stock``: what an untuned aiortc application gets: the default asyncio
  loop, one channel, 64 KiB messages, aioice's socket buffers, aiortc's SCTP.
* ``tuned``: ``WebRTCConfig()`` (what p2ptrain uses): uvloop, 256 KiB
  messages, 4 MiB socket buffers, the SCTP tuning of
  :mod:`p2ptrain.transport.webrtc_sctp`.

Each variant gets one connection per path (a sender and a receiver
process), kept for all its runs. A run is a burst: the sender sends 1 MiB
frames for ``--seconds`` (``--loss-seconds`` on the lossy path), then an end
marker; the receiver checks every frame's index and a sample of its bytes and
answers with the count and its CPU time. Throughput is timed from the first
send to that answer; CPU seconds per GB add both processes' ``getrusage``
over the burst. A one-second burst on every connection first is not counted
(slow start). Fixed durations give every variant the same exposure to the
machine's load.

**Interleaving.** The clean path is CPU-bound, and on a shared machine the
CPU a benchmark gets changes from second to second (with autogroup
scheduling every session gets an equal share, whatever its processes'
nice values). So the variants' bursts alternate (ABBA order across repeats)
on connections that stay up, and each variant's ratio to stock is also taken
per repeat, between two neighbouring bursts; the table shows medians and the
range of those ratios. Every peer runs in its own session, as on its own
machine.

The table goes to stdout, then one JSON line (always the last line) with
``webrtc_MBps``, ``webrtc_stock_MBps``, ``webrtc_loss_MBps``,
``webrtc_stock_loss_MBps``, CPU seconds per GB and the ratios. Units: MB =
MiB, GB = GiB.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.harness import (
    DefaultsHelpFormatter,
    cpu_seconds,
    emit_json,
    format_table,
    median,
    run,
)
from benchmarks.options import add_json_only_argument, add_role_argument
from p2ptrain.lab.natlab.lab import HomeConfig, LabConfig, NatLab
from p2ptrain.lab.natlab.netns import lab_unavailable
from p2ptrain.transport.webrtc import WebRTCTransport
from p2ptrain.transport.webrtc_config import IceServer, WebRTCConfig
from p2ptrain.transport.webrtc_connect import webrtc_connect
from p2ptrain.transport.webrtc_sctp import SctpTuning
from p2ptrain.transport.webrtc_signaling import StreamSignalingChannel
from p2ptrain.wire.frames import Frame, FrameType

MiB = 1 << 20
GiB = 1 << 30
FRAME_BYTES = 1 * MiB
RUN_TIMEOUT = 600.0
MAX_FRAME = 2 * MiB

CLEAN_HOMES = (HomeConfig("a"), HomeConfig("b"))
LOSSY_HOMES = (
    HomeConfig("la", delay_ms=10.0, loss=0.0025),
    HomeConfig("lb", delay_ms=10.0, loss=0.0025),
)
PATH_HOMES = {"clean": ("a", "b"), "lossy": ("la", "lb")}
PATH_CONFIGS = {"clean": CLEAN_HOMES, "lossy": LOSSY_HOMES}
DEFAULT_SECONDS = {"clean": 4.0, "lossy": 20.0}
"""How long each run sends, per path (the lossy path needs longer: loss is random)."""
WARMUP_SECONDS = 1.0
"""An uncounted first burst on every connection (slow start, first allocations)."""
DEFAULT_REPEATS = {"clean": 6, "lossy": 3}
"""Runs per variant and path: the clean path is CPU-bound, so the load other
jobs put on a shared machine moves it most."""


@dataclass(frozen=True)
class Variant:
    """One way of running the transport."""

    label: str
    use_uvloop: bool
    make_config: Callable[[tuple[IceServer, ...]], WebRTCConfig]


def _stock(servers: tuple[IceServer, ...]) -> WebRTCConfig:
    return WebRTCConfig.stock(servers)


def _tuned(servers: tuple[IceServer, ...]) -> WebRTCConfig:
    return WebRTCConfig(ice_servers=servers)


AIORTC_SCTP = SctpTuning(
    rto_min=1.0,
    rto_max=60.0,
    rto_initial=3.0,
    flows=1,
    max_cwnd=1 << 30,
    max_queue_delay=None,
    single_fast_retransmit=False,
    sack_every=1,
    fast_reassembly=False,
)
"""SctpTuning that reproduces aiortc's own behaviour (the ablation's starting point)."""


def _step(
    sctp: SctpTuning | None = None, *, message_kib: int = 64, socket_buffer_mib: int | None = None
) -> Callable[[tuple[IceServer, ...]], WebRTCConfig]:
    """Stock settings with some of the tuning applied (one step of the ablation)."""

    def make(servers: tuple[IceServer, ...]) -> WebRTCConfig:
        return dataclasses.replace(
            WebRTCConfig.stock(servers),
            sctp=sctp,
            message_bytes=message_kib * 1024,
            socket_buffer_bytes=None if socket_buffer_mib is None else socket_buffer_mib * MiB,
        )

    return make


_REASSEMBLY = dataclasses.replace(AIORTC_SCTP, fast_reassembly=True)
_SACK = dataclasses.replace(_REASSEMBLY, sack_every=4)
_LOSS = dataclasses.replace(SctpTuning(), flows=1)  # every fix but the loss response: Reno

VARIANTS: dict[str, Variant] = {
    "stock": Variant("stock aiortc: asyncio, 64 KiB msgs", False, _stock),
    "uvloop": Variant("+ uvloop", True, _stock),
    "buffers": Variant("+ 4 MiB socket buffers", True, _step(socket_buffer_mib=4)),
    "large": Variant(
        "+ 256 KiB messages (aiortc SCTP)",
        True,
        _step(AIORTC_SCTP, message_kib=256, socket_buffer_mib=4),
    ),
    "reassembly": Variant(
        "+ fast reassembly", True, _step(_REASSEMBLY, message_kib=256, socket_buffer_mib=4)
    ),
    "sack": Variant(
        "+ SACK every 4th packet", True, _step(_SACK, message_kib=256, socket_buffer_mib=4)
    ),
    "recovery": Variant(
        "+ 1 fast rtx, RTO.min 0.2 s, queue hold (Reno)",
        True,
        _step(_LOSS, message_kib=256, socket_buffer_mib=4),
    ),
    "tuned": Variant("tuned: WebRTCConfig() (+ 8-flow loss response)", True, _tuned),
    "channels4": Variant(
        "tuned, 4 channels striped",
        True,
        lambda servers: dataclasses.replace(_tuned(servers), channels=4),
    ),
}
ABLATION = ("stock", "uvloop", "buffers", "large", "reassembly", "sack", "recovery", "tuned")


@dataclass
class RunResult:
    """One transfer between two processes."""

    mbytes: float
    seconds: float
    cpu_sender: float
    cpu_receiver: float
    connect_ms: float
    path: str
    sender_sctp: dict[str, int]

    @property
    def mbps(self) -> float:
        """Throughput in MiB/s."""
        return self.mbytes / self.seconds

    @property
    def cpu_per_gb(self) -> float:
        """CPU seconds of both processes per GiB moved."""
        return (self.cpu_sender + self.cpu_receiver) / (self.mbytes / 1024)


# -- the peer processes ------------------------------------------------------------------


async def peer(args: argparse.Namespace) -> None:
    """One side of a pair (a child process inside a lab home).

    The sender reads commands from stdin, one JSON line each: ``{"seconds":
    s}`` sends 1 MiB frames for ``s`` seconds, then an end marker, waits for
    the receiver's count and CPU time and prints the burst's figures as one
    JSON line; ``{"quit": true}`` says goodbye to the receiver and exits. The
    connection stays up between bursts.
    """
    servers = tuple(IceServer(url) for url in args.ice)
    config = VARIANTS[args.variant].make_config(servers)
    sock = socket.socket(fileno=args.fd)
    signal = await StreamSignalingChannel.from_socket(sock)
    started = time.perf_counter()
    transport = await webrtc_connect(
        signal,
        config=config,
        initiator=args.side == "send",
        max_frame_bytes=MAX_FRAME,
        max_header_bytes=64 * 1024,
    )
    connect_ms = (time.perf_counter() - started) * 1000
    await signal.aclose()
    if args.side == "send":
        await _send_bursts(transport, connect_ms)
    else:
        await _receive_bursts(transport)
    await transport.aclose()


_PATTERN = bytes(range(256)) * (FRAME_BYTES // 256)


async def _send_bursts(transport: WebRTCTransport, connect_ms: float) -> None:
    loop = asyncio.get_running_loop()
    while True:
        command = json.loads(await loop.run_in_executor(None, sys.stdin.readline) or "{}")
        if "seconds" not in command:
            await transport.send_frame(Frame(FrameType.DATA, 1, 0, {"bye": True}))
            return
        cpu0, t0 = cpu_seconds(), time.perf_counter()
        deadline = t0 + float(command["seconds"])
        frames = 0
        while frames == 0 or time.perf_counter() < deadline:
            await transport.send_frame(Frame(FrameType.DATA, 1, 0, {"i": frames}, _PATTERN))
            frames += 1
        await transport.send_frame(Frame(FrameType.DATA, 1, 0, {"end": frames}))
        ack = await transport.recv_frame()
        if ack.field("frames") != frames:
            raise RuntimeError(f"receiver counted {ack.field('frames')} frames of {frames}")
        burst = {
            "seconds": time.perf_counter() - t0,
            "cpu": cpu_seconds() - cpu0,
            "cpu_receiver": ack.field("cpu"),
            "mbytes": frames * FRAME_BYTES / MiB,
            "path": transport.path,
            "connect_ms": connect_ms,
            "sctp": dataclasses.asdict(transport.tuner.stats) if transport.tuner else {},
        }
        sys.stdout.write(json.dumps(burst) + "\n")
        sys.stdout.flush()


async def _receive_bursts(transport: WebRTCTransport) -> None:
    cpu0 = cpu_seconds()
    index = 0
    while True:
        frame = await transport.recv_frame()
        if frame.field("bye"):
            return
        if frame.field("end") is not None:
            ack = {"cpu": cpu_seconds() - cpu0, "frames": index}
            await transport.send_frame(Frame(FrameType.DATA, 1, 0, ack))
            cpu0, index = cpu_seconds(), 0
            continue
        payload = memoryview(frame.payload)
        if frame.field("i") != index or payload[1000:1256] != _PATTERN[1000:1256]:
            raise RuntimeError(f"frame {index} arrived damaged or out of order")
        index += 1


def _peer_main(args: argparse.Namespace) -> int:
    run(peer(args), use_uvloop=VARIANTS[args.variant].use_uvloop)
    return 0


# -- the orchestrator --------------------------------------------------------------------


def lab_config(paths: Sequence[str]) -> LabConfig:
    """A NAT lab with the homes ``paths`` need (no public hosts)."""
    homes = tuple(home for path in paths for home in PATH_CONFIGS[path])
    return LabConfig(homes=homes, public_hosts=())


class PeerPair:
    """Two peer processes of one variant, connected once, sending on command."""

    def __init__(self, lab: NatLab, path: str, variant: str) -> None:
        self.variant = variant
        self._sctp_before: dict[str, int] = {}
        sender_home, receiver_home = PATH_HOMES[path]
        ice = [arg for url in [lab.turn.stun_url] for arg in ("--ice", url)]
        left, right = socket.socketpair()
        self._procs: list[subprocess.Popen[str]] = []
        try:
            for home, side, sock in ((sender_home, "send", left), (receiver_home, "recv", right)):
                argv = ["-m", "benchmarks.bench_webrtc", "--role", "peer", "--side", side]
                argv += ["--fd", str(sock.fileno())]
                # Each peer in its own session: with autogroup scheduling a
                # session shares one CPU share among its processes, so peers
                # (and shims) in one session would get a fraction of what two
                # machines would.
                proc = lab.python(
                    home,
                    [*argv, "--variant", variant, *ice],
                    stdin=subprocess.PIPE if side == "send" else subprocess.DEVNULL,
                    stdout=subprocess.PIPE if side == "send" else subprocess.DEVNULL,
                    text=True,
                    pass_fds=(sock.fileno(),),
                    start_new_session=True,
                )
                self._procs.append(proc)
        finally:
            left.close()
            right.close()

    def burst(self, seconds: float) -> RunResult:
        """Send for ``seconds``; the figures of that burst."""
        sender = self._procs[0]
        if sender.stdin is None or sender.stdout is None:  # pragma: no cover - piped above
            raise RuntimeError("sender pipes missing")
        sender.stdin.write(json.dumps({"seconds": seconds}) + "\n")
        sender.stdin.flush()
        ready, _, _ = select.select([sender.stdout], [], [], seconds + RUN_TIMEOUT)
        line = sender.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"{self.variant}: the sender failed or timed out")
        sent = json.loads(line)
        totals: dict[str, int] = sent["sctp"]  # since the connection opened
        self._sctp_before, before = totals, self._sctp_before
        return RunResult(
            mbytes=sent["mbytes"],
            seconds=sent["seconds"],
            cpu_sender=sent["cpu"],
            cpu_receiver=sent["cpu_receiver"],
            connect_ms=sent["connect_ms"],
            path=sent["path"],
            sender_sctp={k: v - before.get(k, 0) for k, v in totals.items()},
        )

    def close(self) -> None:
        """Tell the sender to quit (it says goodbye to the receiver); reap both."""
        sender = self._procs[0] if self._procs else None
        if sender is not None and sender.stdin is not None and sender.poll() is None:
            with contextlib.suppress(OSError):
                sender.stdin.write(json.dumps({"quit": True}) + "\n")
                sender.stdin.close()
        for proc in self._procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


@dataclass
class Cell:
    """Every run of one variant on one path."""

    path: str
    variant: str
    runs: list[RunResult] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    """Throughput over that of the neighbouring stock run, per repeat."""

    def median_run(self) -> RunResult:
        """The run with the median throughput (the upper median for an even count)."""
        return sorted(self.runs, key=lambda r: r.mbps)[len(self.runs) // 2]

    @property
    def mbps(self) -> float:
        """Median throughput in MiB/s."""
        return median(r.mbps for r in self.runs)

    @property
    def cpu_per_gb(self) -> float:
        """Median CPU seconds (both processes) per GiB."""
        return median(r.cpu_per_gb for r in self.runs)


def measure(
    paths: Sequence[str],
    variants: Sequence[str],
    *,
    seconds: dict[str, float],
    repeats: dict[str, int],
    log: Callable[[str], None] = lambda _: None,
) -> dict[tuple[str, str], Cell]:
    """Run ``variants`` on ``paths`` in one NAT lab, interleaved; ``repeats[path]`` runs each.

    Every variant gets one connection per path, kept for all its runs; a
    one-second warm-up burst on each is not counted. Repeat *k* runs the
    variants in order for even *k* and reversed for odd *k* (ABBA), so a
    load that drifts during the benchmark favours none of them.
    """
    cells = {(p, v): Cell(p, v) for p in paths for v in variants}
    with NatLab(lab_config(paths)) as lab:
        for path in paths:
            pairs: list[PeerPair] = []
            try:
                for variant in variants:
                    pairs.append(PeerPair(lab, path, variant))
                for pair in pairs:
                    pair.burst(WARMUP_SECONDS)
                _interleave(path, pairs, cells, seconds=seconds[path], count=repeats[path], log=log)
            finally:
                for pair in pairs:
                    pair.close()
    return cells


def _interleave(
    path: str,
    pairs: Sequence[PeerPair],
    cells: dict[tuple[str, str], Cell],
    *,
    seconds: float,
    count: int,
    log: Callable[[str], None],
) -> None:
    for attempt in range(count):
        order = list(pairs) if attempt % 2 == 0 else list(reversed(pairs))
        this_round: dict[str, RunResult] = {}
        for pair in order:
            result = pair.burst(seconds)
            this_round[pair.variant] = result
            cells[(path, pair.variant)].runs.append(result)
            log(
                f"  webrtc {path:5} {pair.variant:10} run {attempt + 1}/{count}:"
                f" {result.mbps:7.2f} MiB/s {result.cpu_per_gb:6.1f} CPU s/GiB"
                f" {result.mbytes:5.0f} MiB  {_sctp_brief(result.sender_sctp)}"
            )
        stock = this_round.get("stock")
        if stock is not None:
            for variant, result in this_round.items():
                cells[(path, variant)].ratios.append(result.mbps / stock.mbps)


def _sctp_brief(stats: dict[str, int]) -> str:
    keys = ("loss_events", "congestion_losses", "timeouts", "growth_held")
    return " ".join(f"{k}={stats[k]}" for k in keys if k in stats)


SUMMARY_NAMES = {
    ("clean", "tuned"): "webrtc",
    ("clean", "stock"): "webrtc_stock",
    ("lossy", "tuned"): "webrtc_loss",
    ("lossy", "stock"): "webrtc_stock_loss",
}
"""JSON key prefix of each (path, variant) cell."""
RATIO_NAMES = {"clean": "webrtc_ratio", "lossy": "webrtc_loss_ratio"}
GOALS = {"clean": 2.0, "lossy": 3.0}
"""Tuned over stock throughput that issue 4 asks for, per path."""


def summary(cells: dict[tuple[str, str], Cell]) -> dict[str, Any]:
    """The JSON figures: MiB/s and CPU s/GiB per cell, tuned/stock ratios per path."""
    out: dict[str, Any] = {}
    for key, name in SUMMARY_NAMES.items():
        if key in cells:
            out[f"{name}_MBps"] = round(cells[key].mbps, 2)
    for key, name in SUMMARY_NAMES.items():
        if key in cells:
            out[f"{name}_cpu_s_per_GB"] = round(cells[key].cpu_per_gb, 1)
    for path, name in RATIO_NAMES.items():
        tuned = cells.get((path, "tuned"))
        if tuned is not None and tuned.ratios:
            out[name] = round(median(tuned.ratios), 2)
            out[f"{name}_runs"] = [round(r, 2) for r in tuned.ratios]
    return out


def table_rows(cells: dict[tuple[str, str], Cell]) -> list[list[object]]:
    """Rows for :data:`TABLE_HEADERS`, one per cell."""
    rows: list[list[object]] = []
    for (path, variant), cell in cells.items():
        mid = cell.median_run()
        ratios = cell.ratios
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-"
        speeds = [r.mbps for r in cell.runs]
        rows.append(
            [
                f"webrtc {path}: {VARIANTS[variant].label}",
                cell.mbps,
                f"{min(speeds):.3g}-{max(speeds):.3g}",
                median(ratios) if ratios else None,
                spread,
                cell.cpu_per_gb,
                mid.cpu_sender / (mid.mbytes / 1024),
                mid.cpu_receiver / (mid.mbytes / 1024),
                mid.connect_ms,
                mid.path,
            ]
        )
    return rows


TABLE_HEADERS = [
    "path / variant",
    "MiB/s",
    "runs",
    "x stock",
    "x stock runs",
    "CPU s/GiB",
    "send s/GiB",
    "recv s/GiB",
    "connect ms",
    "ICE path",
]


def _log(quiet: bool, text: str) -> None:
    if not quiet:
        print(text, file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line arguments."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n", 1)[0], formatter_class=DefaultsHelpFormatter
    )
    parser.add_argument(
        "--seconds", type=float, default=DEFAULT_SECONDS["clean"], help="per run, clean path"
    )
    parser.add_argument(
        "--loss-seconds", type=float, default=DEFAULT_SECONDS["lossy"], help="per run, lossy path"
    )
    parser.add_argument("--paths", default="clean,lossy", help="clean, lossy or both")
    parser.add_argument("--variants", default="stock,tuned", help=f"from {sorted(VARIANTS)}")
    parser.add_argument("--ablation", action="store_true", help="add the steps between")
    parser.add_argument("--repeats", type=int, default=3, help="runs per cell (median kept)")
    add_json_only_argument(parser)
    add_role_argument(parser, "peer")
    parser.add_argument("--side", choices=["send", "recv"], help=argparse.SUPPRESS)
    parser.add_argument("--fd", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--ice", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.paths = [p for p in args.paths.split(",") if p]
    args.variants = list(ABLATION) if args.ablation else [v for v in args.variants.split(",") if v]
    for path in args.paths:
        if path not in PATH_HOMES:
            parser.error(f"unknown path {path!r}")
    for variant in args.variants:
        if variant not in VARIANTS:
            parser.error(f"unknown variant {variant!r}")
    if args.repeats < 1 or min(args.seconds, args.loss_seconds) <= 0:
        parser.error("--repeats and the durations must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (or, in a child, one peer)."""
    args = parse_args(argv)
    if args.role == "peer":
        return _peer_main(args)
    reason = lab_unavailable()
    if reason is not None:
        print(f"bench_webrtc needs network namespaces (root): {reason}", file=sys.stderr)
        return 2
    cells = measure(
        args.paths,
        args.variants,
        seconds={"clean": args.seconds, "lossy": args.loss_seconds},
        repeats={path: args.repeats for path in args.paths},
        log=lambda text: _log(args.json_only, text),
    )
    if not args.json_only:
        print(f"WebRTC, NAT lab, median of {args.repeats} interleaved runs")
        print(format_table(TABLE_HEADERS, table_rows(cells)))
    emit_json(summary(cells))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
