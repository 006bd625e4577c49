"""WebRTC data-channel benchmark: stock aiortc against p2ptrain's tuned transport.

Usage (as root: it builds a NAT lab of network namespaces)::

    python benchmarks/bench_webrtc.py [--megabytes 64] [--loss-megabytes 16]
        [--paths clean,lossy] [--variants stock,tuned] [--ablation] [--repeats 1]
        [--parallel 1] [--json-only]

Two homes behind easy NATs exchange frames over a
:class:`~p2ptrain.transport.webrtc.WebRTCTransport` (the lab's coturn as STUN
server, so ICE finds the direct server-reflexive path). Every peer is its own
OS process (``lab.python``), as in production; the two processes of a pair
exchange the SDP offer and answer over a ``socketpair()`` inherited by both.

Paths:

* ``clean``: two unshaped homes (the CPU is the limit).
* ``lossy``: each home adds 10 ms each way and drops 0.25 % of packets each
  way: ~40 ms RTT and ~0.5 % loss on the path (docs/nat-lab.md).

Variants (``--ablation`` adds the intermediate steps between the two ends):

* ``stock``: what an untuned aiortc application gets: the default asyncio
  loop, one channel, 64 KiB messages, aioice's socket buffers, aiortc's SCTP.
* ``tuned``: ``WebRTCConfig()``: uvloop, 256 KiB messages, 4 MiB socket
  buffers, the SCTP tuning of :mod:`p2ptrain.transport.webrtc_sctp`.

The sender moves ``--megabytes`` (``--loss-megabytes`` on the lossy path) as
1 MiB frames; the receiver checks every frame's index and a sample of its
bytes and, after the last, answers with its CPU time. Throughput is timed from
the first send to that answer; CPU seconds per GB add both processes'
``getrusage`` over the transfer. With ``--parallel K`` the tuned variant runs
K process pairs at once (each moving 1/K of the data) and reports the sum.

The table goes to stdout, then one JSON line (always the last line) with
``webrtc_MBps``, ``webrtc_stock_MBps``, ``webrtc_loss_MBps``,
``webrtc_stock_loss_MBps`` and ``cpu_s_per_GB`` for each. Units: MB = MiB,
GB = GiB.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from p2ptrain.testing.natlab import HomeConfig, LabConfig, NatLab, unavailable_reason
from p2ptrain.transport.webrtc_config import IceServer, WebRTCConfig
from p2ptrain.transport.webrtc_connect import webrtc_connect
from p2ptrain.transport.webrtc_sctp import SctpTuning
from p2ptrain.transport.webrtc_signaling import StreamSignalingChannel
from p2ptrain.wire.frames import Frame, FrameType

if TYPE_CHECKING or __package__:
    from benchmarks._common import cpu_seconds, emit_json, format_table, median, run
else:  # run as a script: python benchmarks/bench_webrtc.py
    from _common import cpu_seconds, emit_json, format_table, median, run

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
    "tuned": Variant("tuned: + 8-flow response to random loss", True, _tuned),
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
        return self.mbytes / self.seconds

    @property
    def cpu_per_gb(self) -> float:
        return (self.cpu_sender + self.cpu_receiver) / (self.mbytes / 1024)


# -- the peer processes ------------------------------------------------------------------


async def peer(args: argparse.Namespace) -> dict[str, Any]:
    """One side of a transfer (a child process inside a lab home)."""
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
    frames = args.megabytes
    pattern = bytes(range(256)) * (FRAME_BYTES // 256)
    result: dict[str, Any] = {"path": transport.path, "connect_ms": connect_ms}
    if args.side == "send":
        cpu0, t0 = cpu_seconds(), time.perf_counter()
        for index in range(frames):
            await transport.send_frame(Frame(FrameType.DATA, 1, 0, {"i": index}, pattern))
        ack = await transport.recv_frame()
        result["seconds"] = time.perf_counter() - t0
        result["cpu"] = cpu_seconds() - cpu0
        result["cpu_receiver"] = ack.field("cpu")
        if transport.tuner is not None:
            result["sctp"] = dataclasses.asdict(transport.tuner.stats)
    else:
        cpu0 = cpu_seconds()
        for index in range(frames):
            frame = await transport.recv_frame()
            payload = memoryview(frame.payload)
            if frame.field("i") != index or payload[1000:1256] != pattern[1000:1256]:
                raise RuntimeError(f"frame {index} arrived damaged or out of order")
        ack = Frame(FrameType.DATA, 1, 0, {"cpu": cpu_seconds() - cpu0})
        await transport.send_frame(ack)
    await transport.aclose()
    return result


def _peer_main(args: argparse.Namespace) -> int:
    result = run(peer(args), use_uvloop=VARIANTS[args.variant].use_uvloop)
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


# -- the orchestrator --------------------------------------------------------------------


def transfer(lab: NatLab, path: str, variant: str, megabytes: int, parallel: int = 1) -> RunResult:
    """Move ``megabytes`` over ``parallel`` process pairs at once; sum them up."""
    sender_home, receiver_home = PATH_HOMES[path]
    ice = [lab.turn.stun_url]
    procs: list[tuple[subprocess.Popen[str], subprocess.Popen[str]]] = []
    per_pair = max(1, megabytes // parallel)
    for _ in range(parallel):
        left, right = socket.socketpair()
        pair = []
        for home, side, sock in ((sender_home, "send", left), (receiver_home, "recv", right)):
            argv = [__file__, "--role", "peer", "--side", side, "--fd", str(sock.fileno())]
            argv += ["--variant", variant, "--megabytes", str(per_pair)]
            argv += [arg for url in ice for arg in ("--ice", url)]
            proc = lab.python(
                home, argv, stdout=subprocess.PIPE, text=True, pass_fds=(sock.fileno(),)
            )
            sock.close()
            pair.append(proc)
        procs.append((pair[0], pair[1]))
    results = []
    for sender, receiver in procs:
        out_send, _ = sender.communicate(timeout=RUN_TIMEOUT)
        out_recv, _ = receiver.communicate(timeout=RUN_TIMEOUT)
        if sender.returncode or receiver.returncode:
            raise RuntimeError(f"{variant} on {path}: a peer process failed")
        results.append(
            (json.loads(out_send.splitlines()[-1]), json.loads(out_recv.splitlines()[-1]))
        )
    seconds = max(sent["seconds"] for sent, _ in results)
    return RunResult(
        mbytes=per_pair * parallel,
        seconds=seconds,
        cpu_sender=sum(sent["cpu"] for sent, _ in results),
        cpu_receiver=sum(sent["cpu_receiver"] for sent, _ in results),
        connect_ms=median([sent["connect_ms"] for sent, _ in results]),
        path=results[0][0]["path"],
        sender_sctp=results[0][0].get("sctp", {}),
    )


def _log(quiet: bool, text: str) -> None:
    if not quiet:
        print(text, file=sys.stderr, flush=True)


def measure(args: argparse.Namespace) -> dict[tuple[str, str], RunResult]:
    """Every (path, variant) the arguments ask for; the median run of each."""
    variants = list(ABLATION) if args.ablation else args.variants
    homes = tuple(
        home for path in args.paths for home in (CLEAN_HOMES if path == "clean" else LOSSY_HOMES)
    )
    results: dict[tuple[str, str], RunResult] = {}
    with NatLab(LabConfig(homes=homes, public_hosts=())) as lab:
        for path in args.paths:
            megabytes = args.megabytes if path == "clean" else args.loss_megabytes
            for variant in variants:
                runs = []
                for _ in range(args.repeats):
                    parallel = args.parallel if variant == "tuned" else 1
                    result = transfer(lab, path, variant, megabytes, parallel)
                    _log(
                        args.json_only,
                        f"{path:5} {variant:8} {result.mbps:7.2f} MB/s"
                        f" {result.cpu_per_gb:6.1f} CPU s/GB  {result.sender_sctp}",
                    )
                    runs.append(result)
                runs.sort(key=lambda r: r.mbps)
                results[(path, variant)] = runs[len(runs) // 2]
    return results


def report(args: argparse.Namespace, results: dict[tuple[str, str], RunResult]) -> dict[str, Any]:
    """Print the table; return the JSON summary."""
    rows = []
    for (path, variant), result in results.items():
        stock = results.get((path, "stock"))
        rows.append(
            [
                f"{path}: {VARIANTS[variant].label}",
                result.mbps,
                result.mbps / stock.mbps if stock else None,
                result.cpu_per_gb,
                result.cpu_sender / (result.mbytes / 1024),
                result.cpu_receiver / (result.mbytes / 1024),
                result.connect_ms,
                result.path,
            ]
        )
    headers = [
        "path / variant",
        "MB/s",
        "x stock",
        "CPU s/GB",
        "send s/GB",
        "recv s/GB",
        "connect ms",
        "ICE path",
    ]
    if not args.json_only:
        print(format_table(headers, rows))
    summary: dict[str, Any] = {}
    names = {
        ("clean", "tuned"): "webrtc",
        ("clean", "stock"): "webrtc_stock",
        ("lossy", "tuned"): "webrtc_loss",
        ("lossy", "stock"): "webrtc_stock_loss",
    }
    for key, name in names.items():
        if key in results:
            summary[f"{name}_MBps"] = round(results[key].mbps, 2)
    cpu = {names[key]: round(results[key].cpu_per_gb, 1) for key in names if key in results}
    summary["cpu_s_per_GB"] = cpu
    return summary


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line arguments."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--megabytes", type=int, default=64, help="MiB on the clean path")
    parser.add_argument("--loss-megabytes", type=int, default=16, help="MiB on the lossy path")
    parser.add_argument("--paths", default="clean,lossy", help="clean, lossy or both")
    parser.add_argument("--variants", default="stock,tuned", help=f"from {sorted(VARIANTS)}")
    parser.add_argument("--ablation", action="store_true", help="add the steps between")
    parser.add_argument("--repeats", type=int, default=1, help="runs per cell (median kept)")
    parser.add_argument("--parallel", type=int, default=1, help="process pairs for 'tuned'")
    parser.add_argument("--json-only", action="store_true", help="print only the JSON line")
    parser.add_argument(
        "--role", choices=["bench", "peer"], default="bench", help=argparse.SUPPRESS
    )
    parser.add_argument("--side", choices=["send", "recv"], help=argparse.SUPPRESS)
    parser.add_argument("--fd", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--ice", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.paths = [p for p in args.paths.split(",") if p]
    args.variants = [v for v in args.variants.split(",") if v]
    for path in args.paths:
        if path not in PATH_HOMES:
            parser.error(f"unknown path {path!r}")
    for variant in args.variants:
        if variant not in VARIANTS:
            parser.error(f"unknown variant {variant!r}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (or, in a child, one peer)."""
    args = parse_args(argv)
    if args.role == "peer":
        return _peer_main(args)
    reason = unavailable_reason()
    if reason is not None:
        print(f"bench_webrtc needs network namespaces (root): {reason}", file=sys.stderr)
        return 2
    results = measure(args)
    summary = report(args, results)
    emit_json(summary)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
