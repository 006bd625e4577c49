"""The ``p2ptrain`` command line.

Each subcommand maps its flags onto the config dataclasses of the layer it
runs. User mistakes (a bad address, a port in use, an unreachable bootstrap
peer, a refused admission) end with one line on stderr and exit status 2, not
a traceback; ``-v`` shows debug logs.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import dataclasses
import functools
import importlib.util
import logging
import math
import os
import runpy
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, NoReturn, TextIO

from p2ptrain import __version__
from p2ptrain.aio import run
from p2ptrain.errors import ConfigError, P2PTrainError
from p2ptrain.node.address import PeerAddress, is_loopback_host, is_unspecified_host
from p2ptrain.node.config import NodeConfig
from p2ptrain.secure.handshake import AdmissionPolicy
from p2ptrain.secure.identity import Identity
from p2ptrain.secure.swarm_key import generate_swarm_key, read_swarm_key, write_swarm_key

if TYPE_CHECKING:
    from p2ptrain.nat.config import NATConfig, RelayLimits

__all__ = ["main"]

_CHECKOUT = Path(__file__).resolve().parents[2]
"""The source checkout holding the package, where ``benchmarks/`` is (not in a wheel)."""
_EXAMPLES = """examples:
  p2ptrain demo                                   # a local swarm on this machine
  p2ptrain train --join PEERID@203.0.113.7:4001 --seconds 600
  p2ptrain status --join PEERID@203.0.113.7:4001
  p2ptrain bootstrap --host 0.0.0.0 --port 4001 --announce-host 203.0.113.7 --relay
  p2ptrain bench transport --megabytes 64
  p2ptrain keygen --out swarm.key                 # a private swarm's key (--secret-file)
"""


if TYPE_CHECKING:  # what add_subparsers returns; each command adds its parser to it
    _Commands = argparse._SubParsersAction[argparse.ArgumentParser]


def _add_node_flags(parser: argparse.ArgumentParser, *, default_port: int) -> None:
    group = parser.add_argument_group("network")
    group.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    group.add_argument(
        "--port", type=int, default=default_port, help="port to listen on (0 picks one)"
    )
    group.add_argument(
        "--announce-host", help="host others should dial (when listening on 0.0.0.0)"
    )
    group.add_argument("--identity", help="key file; created if missing (keeps your PeerID)")
    group.add_argument("--swarm", default="p2ptrain", help="swarm name (peers must agree)")
    group.add_argument(
        "--secret-file", help="the swarm key file (made by `p2ptrain keygen`) members must hold"
    )
    group.add_argument(
        "--insecure-plaintext",
        action="store_true",
        help="trusted clusters only: do not encrypt frames after the handshake (all peers must)",
    )


def _add_metrics_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("metrics")
    group.add_argument(
        "--metrics-port", type=int, help="serve Prometheus metrics (GET /metrics) on this port"
    )
    group.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="interface of the metrics server (default 127.0.0.1; 0.0.0.0 for a remote scraper)",
    )


def _add_join_flags(
    parser: argparse.ArgumentParser,
    *,
    run_default: str | None = "charlm",
    run_help: str = "the run (default charlm)",
) -> None:
    parser.add_argument(
        "--join",
        action="append",
        required=True,
        metavar="ADDR",
        help="a peer of the swarm (peerid@host:port) to join through (repeatable)",
    )
    _add_tofu_flag(parser)
    parser.add_argument("--run-id", default=run_default, help=run_help)


def _add_tofu_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trust-on-first-use",
        action="store_true",
        help="accept --join host:port without a PeerID: whoever answers is trusted (warned)",
    )


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="p2ptrain",
        description="Train one PyTorch model together over the internet.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"p2ptrain {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (
        _add_demo_parser,
        _add_bootstrap_parser,
        _add_train_parser,
        _add_status_parser,
        _add_keygen_parser,
        _add_bench_parser,
    ):
        add(commands)
    return parser


def _add_demo_parser(commands: _Commands) -> None:
    """``p2ptrain demo``."""
    demo = commands.add_parser(
        "demo",
        help="run a local swarm on loopback and show what happens",
        description=(
            "Start a bootstrap peer and --peers training peers on this machine, as "
            "separate processes; they train the charlm example together for --seconds "
            "(one joins late, each announces a different bandwidth). Prints a summary "
            "and writes a PNG of the loss against time. Ctrl-C once training began "
            "stops the peers and still prints the summary (exit 0)."
        ),
        epilog="example: p2ptrain demo --peers 4 --seconds 90 --png loss.png",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--peers", type=int, help="number of peers (default 4; 8 with --pipeline)")
    demo.add_argument(
        "--seconds", type=float, help="seconds of training (default 90; 60 with --pipeline)"
    )
    demo.add_argument(
        "--png",
        help="where to write the loss plot (default p2ptrain-demo-loss.png; "
        "p2ptrain-pipeline-demo-loss.png with --pipeline)",
    )
    demo.add_argument("--log-dir", help="keep every peer's JSON log lines in this directory")
    demo.add_argument(
        "--shaped",
        action="store_true",
        help="root only: run the peers in network namespaces with tc-tbf links at their "
        "rates and a delay; the load balancer is fed only by what the peers measure",
    )
    demo.add_argument(
        "--pipeline",
        action="store_true",
        help="train a model no peer can hold: the peers serve the stages of a pipeline "
        "(SWARM), each under a memory budget below the whole model; a per-stage table",
    )


def _add_bootstrap_parser(commands: _Commands) -> None:
    """``p2ptrain bootstrap``."""
    bootstrap = commands.add_parser(
        "bootstrap",
        help="run a public peer others join through (DHT, STUN, rendezvous, relay)",
        description=(
            "Run a public peer on a host others can dial: a standing DHT node, a STUN "
            "responder (UDP), the rendezvous point NATed peers register with and, with "
            "--relay, a bounded relay for peers behind symmetric NATs. Prints the address "
            "others pass with --join and the STUN port. Keep its identity in a file so "
            "the address survives restarts. See docs/nat-traversal.md."
        ),
        epilog=(
            "example: p2ptrain bootstrap --host 0.0.0.0 --port 4001 "
            "--announce-host 203.0.113.7 --identity boot.key --relay --relay-mbit 50\n"
            "(open TCP and UDP 4001 in the firewall; --stun-port moves the UDP one)"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_node_flags(bootstrap, default_port=4001)
    bootstrap.add_argument(
        "--join",
        action="append",
        default=[],
        metavar="ADDR",
        help="another bootstrap peer to connect to, peerid@host:port (repeatable)",
    )
    _add_tofu_flag(bootstrap)
    _add_metrics_flags(bootstrap)
    nat = bootstrap.add_argument_group("NAT traversal")
    nat.add_argument(
        "--stun-port", type=int, help="UDP port of the STUN responder (default: same as --port)"
    )
    nat.add_argument(
        "--no-rendezvous",
        action="store_true",
        help="do not forward signaling for NATed peers (they then need other public peers)",
    )
    nat.add_argument(
        "--relay",
        action="store_true",
        help="forward traffic for peers no other path reaches (opt-in; bounded below)",
    )
    nat.add_argument(
        "--relay-mbit",
        type=float,
        help="Mbit/s relayed in all, both directions together (default 268)",
    )
    nat.add_argument(
        "--relay-pair-mbit", type=float, help="Mbit/s one relayed pair may use (default 67)"
    )
    nat.add_argument("--relay-circuits", type=int, help="relayed pairs at once (default 64)")


def _add_train_parser(commands: _Commands) -> None:
    """``p2ptrain train``."""
    train = commands.add_parser(
        "train",
        help="train a model with a swarm (one peer; the charlm example by default)",
        description=(
            "Join a swarm through --join and train with a collaborative optimizer "
            "the character model of p2ptrain.examples.charlm, or your own model with --task, "
            "showing samples/s, the global step, the loss and the peers online on one line."
        ),
        epilog=(
            "example: p2ptrain train --join PEERID@203.0.113.7:4001 --seconds 600 "
            "--upload-mbit 20 --download-mbit 100 --log-json train.jsonl\n"
            "         p2ptrain train --join PEERID@203.0.113.7:4001 --task my_task.py"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_node_flags(train, default_port=0)
    _add_join_flags(
        train,
        run_default=None,
        run_help="the run (default: the task's name, e.g. charlm; a run trains one model)",
    )
    _add_step_flags(train)
    _add_run_flags(train)
    _add_train_nat_flags(train)
    _add_pipeline_flags(train)


def _add_pipeline_flags(train: argparse.ArgumentParser) -> None:
    """``p2ptrain train --pipeline``: SWARM pipeline training (docs/pipeline.md)."""
    group = train.add_argument_group("pipeline (a model larger than one peer)")
    group.add_argument(
        "--pipeline",
        action="store_true",
        help="serve one stage of a pipeline run and train through it (the task declares blocks)",
    )
    group.add_argument(
        "--stage", type=int, help="stage to serve first (default: one short of capacity)"
    )
    group.add_argument(
        "--rebalance-s",
        type=float,
        help="every this many seconds, move to the bottleneck stage when that raises the "
        "pipeline's throughput (default: off; 30 suits most runs)",
    )
    group.add_argument(
        "--memory-budget-mb", type=float, help="cap on a stage's parameters + optimizer state"
    )
    group.add_argument(
        "--compute-floor", type=float, default=0.0, help="emulated device: seconds per micro-batch"
    )
    group.add_argument(
        "--in-flight", type=int, default=2, help="micro-batches kept in the pipeline (2)"
    )


def _add_step_flags(train: argparse.ArgumentParser) -> None:
    """``p2ptrain train``: how the swarm steps and averages."""
    train.add_argument(
        "--target-batch-size",
        type=int,
        default=256,
        help="samples the swarm accumulates per step (default 256)",
    )
    train.add_argument(
        "--step-policy",
        choices=("carry", "wait"),
        default="wait",
        help="what a peer does once it closed a step at the target: 'wait' waits for the "
        "step's average, 'carry' computes toward the next step while it averages (default "
        "wait; docs/training.md)",
    )
    train.add_argument("--batch-size", type=int, default=16, help="local batch (default 16)")
    train.add_argument(
        "--torch-threads", type=int, help="torch threads for training (default: all cores)"
    )
    train.add_argument(
        "--device",
        default="auto",
        help="where the model trains: auto (CUDA where available, else the CPU), cpu, cuda, "
        "cuda:N (default auto)",
    )
    train.add_argument("--save", metavar="PATH", help="write the final model's state_dict here")
    train.add_argument(
        "--checkpoint",
        metavar="PATH",
        help="resume from PATH if it exists; write the training state there periodically",
    )
    train.add_argument(
        "--checkpoint-every", type=float, default=60.0, help="seconds between checkpoints (60)"
    )
    train.add_argument(
        "--diloco", type=int, metavar="H", help="train with DiLoCo, H inner steps per round"
    )
    train.add_argument(
        "--diloco-overlap",
        action="store_true",
        help="with --diloco: average each round while the next one runs, and apply it one "
        "round late with half the outer learning rate (0.35; default off)",
    )
    train.add_argument(
        "--compression",
        choices=("none", "fp16", "bf16", "int8"),
        default="fp16",
        help="codec of the all-reduce (default fp16: half the bytes of none at the same "
        "loss, measured by benchmarks/bench_compression.py; int8 halves them again)",
    )
    train.add_argument(
        "--matchmaking-window", type=float, default=2.0, help="seconds to gather a group (2)"
    )


def _add_run_flags(train: argparse.ArgumentParser) -> None:
    """``p2ptrain train``: how long, what is announced and written, the task."""
    train.add_argument("--seconds", type=float, help="stop after this many seconds of training")
    train.add_argument("--upload-mbit", type=float, help="announce this upload rate (Mbit/s)")
    train.add_argument("--download-mbit", type=float, help="announce this download rate (Mbit/s)")
    _add_metrics_flags(train)
    train.add_argument(
        "--log-json", metavar="PATH", help="append JSON event lines to PATH ('-': stdout)"
    )
    train.add_argument(
        "--log-digest",
        action="store_true",
        help="add a SHA-256 of the parameters to every JSON progress event "
        "(one pass over the model each time; default off)",
    )
    train.add_argument(
        "--task",
        metavar="MODULE",
        help="what to train: a module name or .py file defining make_task() "
        "(see p2ptrain/app/task.py; default: the charlm example)",
    )


def _add_train_nat_flags(train: argparse.ArgumentParser) -> None:
    """``p2ptrain train``: NAT traversal."""
    nat_train = train.add_argument_group("NAT traversal")
    nat_train.add_argument(
        "--nat",
        choices=("auto", "public", "private", "off"),
        help=(
            "auto: find out with dial-backs and STUN whether others can dial you; "
            "public/private: say so; off: plain TCP only. Default: off when --host is "
            "a loopback address, else auto"
        ),
    )
    nat_train.add_argument(
        "--stun",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="an extra STUN server (repeatable); the swarm's public peers answer STUN anyway",
    )
    nat_train.add_argument(
        "--turn",
        action="append",
        default=[],
        metavar="URL",
        help="a TURN server, turn:USER:PASSWORD@HOST:PORT (repeatable), for symmetric NATs",
    )


def _add_status_parser(commands: _Commands) -> None:
    """``p2ptrain status``."""
    status = commands.add_parser(
        "status",
        help="show the peers of a training run",
        description="Read a run's progress records from the DHT and print one row per peer.",
        epilog="example: p2ptrain status --join PEERID@203.0.113.7:4001 --run-id charlm",
    )
    _add_join_flags(status)
    status.add_argument("--swarm", default="p2ptrain", help="swarm name (peers must agree)")
    status.add_argument(
        "--secret-file", help="the swarm key file (made by `p2ptrain keygen`) members must hold"
    )
    status.add_argument(
        "--timeout", type=float, default=20.0, help="seconds to wait for the swarm (default 20)"
    )
    status.add_argument(
        "--json", action="store_true", help="print one JSON object per reading instead of a table"
    )
    status.add_argument(
        "--watch",
        action="store_true",
        help="keep reading and redraw the table in place until Ctrl-C (default: read once)",
    )
    status.add_argument(
        "--interval", type=float, default=2.0, help="seconds between readings (default 2)"
    )
    status.add_argument(
        "--count", type=int, help="with --watch: stop after this many readings (default: never)"
    )


def _add_keygen_parser(commands: _Commands) -> None:
    """``p2ptrain keygen``."""
    keygen = commands.add_parser(
        "keygen",
        help="make a swarm key (256 random bits) for --secret-file",
        description=(
            "Write a new swarm key to a file readable by you only. Every member of a "
            "private swarm passes the same file with --secret-file; peers without it "
            "are refused, and it cannot be guessed offline."
        ),
        epilog="example: p2ptrain keygen --out swarm.key",
    )
    keygen.add_argument("--out", default="swarm.key", help="where to write it (swarm.key)")
    keygen.add_argument("--force", action="store_true", help="replace an existing file")


def _add_bench_parser(commands: _Commands) -> None:
    """``p2ptrain bench``."""
    registry = _benchmark_registry()
    listed = (
        ""
        if registry is None
        else "\n\nbenchmarks:\n"
        + "\n".join(f"  {bench.name:12} {bench.summary}" for bench in registry.BENCHMARKS)
    )
    bench = commands.add_parser(
        "bench",
        help="run a benchmark and print its table",
        description=(
            "Run one of the benchmarks in benchmarks/ (needs a source checkout), or `all`: "
            "every one this machine can run, into one report (DIR/report.md). "
            "Arguments after the name go to the benchmark; try `--help` there." + listed
        ),
        epilog=(
            "example: p2ptrain bench transport --megabytes 64 --png transport.png\n"
            "         p2ptrain bench all --out bench-report"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    names = None
    if registry is not None:
        names = [registry.ALL, *(bench.name for bench in registry.BENCHMARKS)]
    bench.add_argument("name", choices=names, metavar="NAME", help="a benchmark above, or all")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark")


# -- helpers -----------------------------------------------------------------------------


def _read_secret(path: str | None) -> bytes | None:
    return None if path is None else read_swarm_key(path)


def _join_addresses(args: argparse.Namespace) -> tuple[str, ...]:
    """The --join addresses, each with a PeerID unless --trust-on-first-use."""
    addresses = tuple(args.join)
    for text in addresses:
        address = PeerAddress.parse(text)
        if address.peer_id is None and not args.trust_on_first_use:
            raise ConfigError(
                f"--join {text} names no PeerID, so an impostor could answer; use"
                " PEERID@HOST:PORT (the bootstrap peer prints it), or pass"
                " --trust-on-first-use to accept whoever answers"
            )
    return addresses


def _node_config(args: argparse.Namespace) -> NodeConfig:
    return NodeConfig(
        host=args.host,
        port=args.port,
        announce_host=args.announce_host,
        swarm=args.swarm,
        admission=AdmissionPolicy(secret=_read_secret(args.secret_file)),
        insecure_plaintext=args.insecure_plaintext,
    )


_MBIT = 1e6 / 8


def _relay_limits(args: argparse.Namespace) -> RelayLimits:
    from p2ptrain.nat.config import RelayLimits  # noqa: PLC0415 - aiortc is slow

    limits = RelayLimits()
    if args.relay_mbit is not None:
        rate = _positive_flag("--relay-mbit", args.relay_mbit) * _MBIT
        limits = dataclasses.replace(limits, total_bytes_per_s=rate)
    if args.relay_pair_mbit is not None:
        rate = _positive_flag("--relay-pair-mbit", args.relay_pair_mbit) * _MBIT
        limits = dataclasses.replace(limits, pair_bytes_per_s=rate)
    if args.relay_circuits is not None:
        limits = dataclasses.replace(limits, max_circuits=args.relay_circuits)
    return limits


def _positive_flag(flag: str, value: float) -> float:
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{flag} must be a positive number, got {value}")
    return value


def _train_nat_config(args: argparse.Namespace) -> NATConfig | None:
    """``--nat``, ``--stun``, ``--turn`` as a NATConfig, or None for plain TCP."""
    mode = args.nat or ("off" if is_loopback_host(args.host) else "auto")
    if mode == "off":
        if args.stun or args.turn:
            raise ConfigError("--stun and --turn need NAT traversal (--nat auto|public|private)")
        return None
    from p2ptrain.nat.config import NATConfig, ice_server_from_url  # noqa: PLC0415
    from p2ptrain.transport.webrtc_config import WebRTCConfig  # noqa: PLC0415

    if mode == "public" and is_unspecified_host(args.announce_host or args.host):
        raise ConfigError("--nat public on 0.0.0.0 needs --announce-host (your public address)")
    stun = [text.removeprefix("stun:") for text in args.stun]
    servers = [ice_server_from_url(f"stun:{text}") for text in stun]
    for url in args.turn:
        if not url.startswith(("turn:", "turns:")):
            raise ConfigError(f"--turn takes turn:USER:PASSWORD@HOST:PORT, got {url!r}")
        servers.append(ice_server_from_url(url))
    public = {"auto": None, "public": True, "private": False}[mode]
    return NATConfig(
        public=public,
        stun_servers=tuple(stun),
        webrtc=WebRTCConfig(connect_timeout=10.0, ice_servers=tuple(servers)),
    )


def _identity(args: argparse.Namespace) -> Identity | None:
    return Identity.load_or_create(args.identity) if args.identity else None


# -- subcommands -------------------------------------------------------------------------


def _run_demo(args: argparse.Namespace) -> int:
    import signal  # noqa: PLC0415
    import threading  # noqa: PLC0415

    from p2ptrain.app.demo import SwarmDemoConfig, run_swarm_demo  # noqa: PLC0415

    if args.pipeline and args.shaped:
        print("p2ptrain demo: --pipeline runs on loopback (no --shaped)", file=sys.stderr)
        return 2
    if args.shaped and os.geteuid() != 0:
        print("p2ptrain demo --shaped needs root (network namespaces and tc)", file=sys.stderr)
        return 2
    stop, began = threading.Event(), threading.Event()

    def interrupted(signum: int, frame: object) -> None:
        # Ctrl-C (or SIGTERM) once a peer trains stops the peers cleanly
        # (summaries, PNG, exit 0); before that the demo raises KeyboardInterrupt
        # where no child can be left unrecorded (exit 130); a second time, exit 130.
        if stop.is_set():
            raise KeyboardInterrupt
        if began.is_set():
            print("stopping (Ctrl-C again to interrupt) ...", file=sys.stderr, flush=True)
        stop.set()

    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    if args.pipeline:
        from p2ptrain.app.pipeline_demo import (  # noqa: PLC0415
            PipelineDemoConfig,
            run_pipeline_demo,
        )

        settings = {"peers": args.peers, "seconds": args.seconds, "png": args.png}
        pipeline = PipelineDemoConfig(**{k: v for k, v in settings.items() if v is not None})
        began.set()  # the demo stops its peers itself on a stop
        outcome = run_pipeline_demo(pipeline, out=sys.stdout, stop=stop)
        return 0 if outcome.ok or outcome.stopped else 1
    config = SwarmDemoConfig(
        peers=args.peers or 4,
        seconds=args.seconds or 90.0,
        png=args.png or "p2ptrain-demo-loss.png",
        log_dir=args.log_dir,
        shaped=args.shaped,
    )
    result = run_swarm_demo(config, out=sys.stdout, stop=stop, began=began)
    return 0 if result.ok or result.stopped else 1


def _run_train(args: argparse.Namespace) -> int:
    import contextlib  # noqa: PLC0415
    import signal  # noqa: PLC0415
    import threading  # noqa: PLC0415

    stop, began = threading.Event(), threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())  # a clean end, with a summary

    def interrupted(signum: int, frame: object) -> None:
        # Ctrl-C once training began ends it like SIGTERM (summary, exit 0);
        # before that, or a second time, it interrupts (exit 130).
        if not began.is_set() or stop.is_set():
            raise KeyboardInterrupt
        print("stopping (Ctrl-C again to interrupt) ...", file=sys.stderr, flush=True)
        stop.set()

    signal.signal(signal.SIGINT, interrupted)

    def joined(address: str) -> None:
        print(f"joined as {address}", file=sys.stderr, flush=True)
        began.set()

    from p2ptrain.app.task import default_run_id  # noqa: PLC0415 - imports torch
    from p2ptrain.app.train import (  # noqa: PLC0415 - torch is slow
        TrainingSessionConfig,
        json_lines_logger,
        run_training_peer,
    )

    config = TrainingSessionConfig(
        initial_peers=tuple(args.join),
        run_id=args.run_id or default_run_id(args.task),
        log_digest=args.log_digest,
        target_batch_size=args.target_batch_size,
        step_policy=args.step_policy,
        batch_size=args.batch_size,
        seconds=args.seconds,
        upload_mbit=args.upload_mbit,
        download_mbit=args.download_mbit,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        node=_node_config(args),
        identity_path=args.identity,
        nat=_train_nat_config(args),
        task=args.task,
        torch_threads=args.torch_threads,
        device=args.device,
        save_path=args.save,
        checkpoint_path=args.checkpoint,
        checkpoint_interval=args.checkpoint_every,
        diloco_inner_steps=args.diloco,
        diloco_overlap=args.diloco_overlap,
        compression=args.compression,
        matchmaking_window=args.matchmaking_window,
    )
    _join_addresses(args)  # after the config's own checks: those name the flag to fix first
    with contextlib.ExitStack() as stack:
        log = None
        if args.log_json == "-":
            log = json_lines_logger(sys.stdout)
        elif args.log_json:
            try:
                handle = stack.enter_context(Path(args.log_json).open("a", encoding="utf-8"))
            except OSError as exc:
                raise ConfigError(f"cannot open {args.log_json}: {exc.strerror}") from exc
            log = json_lines_logger(handle)
        summary = run_training_peer(
            config,
            display=sys.stderr,
            log=log,
            announce=joined,
            stop=stop,
        )
    print(
        f"trained {summary.seconds:.0f} s: global step {summary.global_step}, "
        f"{summary.local_steps} local batches, {summary.samples_per_s:.1f} samples/s, "
        f"loss {summary.loss:.4f}",
        file=sys.stderr,
    )
    return 0


def _run_pipeline_train(args: argparse.Namespace) -> int:
    """``p2ptrain train --pipeline`` (see :mod:`p2ptrain.app.pipeline`)."""
    import signal  # noqa: PLC0415
    import threading  # noqa: PLC0415

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())  # a clean end, with a summary
    signal.signal(signal.SIGINT, lambda signum, frame: stop.set())

    def joined(address: str) -> None:
        print(f"joined as {address}", file=sys.stderr, flush=True)

    from p2ptrain.app.pipeline import (  # noqa: PLC0415 - imports torch
        PipelinePeerConfig,
        json_line_writer,
        run_pipeline_peer,
    )

    config = PipelinePeerConfig(
        initial_peers=_join_addresses(args),
        run_id=args.run_id or "pipeline",
        node=_node_config(args),
        task=args.task,
        stage=args.stage,
        target_batch_size=args.target_batch_size,
        batch_size=args.batch_size,
        seconds=args.seconds,
        memory_budget_mb=args.memory_budget_mb,
        compute_floor_s=args.compute_floor,
        in_flight=args.in_flight,
        identity_path=args.identity,
        torch_threads=args.torch_threads,
        rebalance_s=args.rebalance_s,
    )
    log = json_line_writer(sys.stdout) if args.log_json == "-" else None
    summary = run_pipeline_peer(config, display=sys.stderr, log=log, announce=joined, stop=stop)
    print(
        f"pipeline: stage {summary.stage}, {summary.stage_steps} stage steps,"
        f" {summary.samples_delivered} samples delivered, {summary.retries} retries,"
        f" loss {summary.loss}",
        file=sys.stderr,
    )
    return 0


def _run_status(args: argparse.Namespace) -> int:
    from p2ptrain.app.status import StatusConfig, watch_status  # noqa: PLC0415

    node = NodeConfig(
        port=0, swarm=args.swarm, admission=AdmissionPolicy(secret=_read_secret(args.secret_file))
    )
    config = StatusConfig(
        initial_peers=_join_addresses(args), run_id=args.run_id, timeout=args.timeout, node=node
    )
    if not args.watch:
        if args.count is not None:
            raise ConfigError("--count needs --watch")
        (text,) = watch_status(config, as_json=args.json, count=1)
        print(text)
        return 0
    redraw = sys.stdout.isatty() and not args.json

    def show(text: str) -> None:
        # On a terminal the table is redrawn in place (cursor home, clear below).
        print(("\x1b[H\x1b[J" if redraw else "") + text + ("" if redraw or args.json else "\n"))
        sys.stdout.flush()

    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a watch ends
        watch_status(config, as_json=args.json, interval=args.interval, count=args.count, show=show)
    return 0


def _run_bootstrap(args: argparse.Namespace) -> int:
    from p2ptrain.app.bootstrap import BootstrapInfo, run_bootstrap_peer  # noqa: PLC0415
    from p2ptrain.dht.node_config import DHTNodeConfig  # noqa: PLC0415
    from p2ptrain.nat.config import NATConfig  # noqa: PLC0415

    relay_flags = (args.relay_mbit, args.relay_pair_mbit, args.relay_circuits)
    if not args.relay and any(flag is not None for flag in relay_flags):
        raise ConfigError("--relay-mbit, --relay-pair-mbit and --relay-circuits need --relay")
    nat_config = NATConfig(
        public=True,
        stun_port=args.stun_port,
        serve_rendezvous=not args.no_rendezvous,
        relay=args.relay,
        relay_limits=_relay_limits(args),
    )
    dht_config = DHTNodeConfig(initial_peers=_join_addresses(args))

    def announce(info: BootstrapInfo) -> None:
        print(f"bootstrap peer ready; others join with:\n  --join {info.address}", flush=True)
        print(
            f"  STUN udp/{info.stun_port}, rendezvous {'on' if info.rendezvous else 'off'}, "
            f"relay {'on' if info.relay else 'off'}",
            flush=True,
        )

    async def serve() -> None:
        from p2ptrain.metrics import Metrics, MetricsServer  # noqa: PLC0415

        metrics = Metrics()
        server = None
        if args.metrics_port is not None:
            server = MetricsServer(metrics, host=args.metrics_host, port=args.metrics_port)
            await server.start()
            print(f"  metrics on http://{args.metrics_host}:{server.port}/metrics", flush=True)
        try:
            await run_bootstrap_peer(
                _node_config(args),
                dht_config,
                nat_config,
                identity=_identity(args),
                announce=announce,
                metrics=metrics,
            )
        finally:
            if server is not None:
                await server.aclose()

    try:
        run(serve())
    except KeyboardInterrupt:
        print("stopped")
    return 0


def _benchmark_registry() -> ModuleType | None:
    """``benchmarks/registry.py`` of the source checkout, or None where there is none.

    Read from its file, without putting the checkout on ``sys.path`` (every
    subcommand builds the parser); it imports no benchmark.
    """
    return _load_registry(_CHECKOUT / "benchmarks" / "registry.py")


@functools.cache
def _load_registry(path: Path) -> ModuleType | None:
    name = "_p2ptrain_benchmark_registry"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None or not path.is_file():
        return None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


def _run_bench(args: argparse.Namespace) -> int:
    registry = _benchmark_registry()
    if registry is None:
        raise ConfigError(
            f"no benchmarks at {_CHECKOUT / 'benchmarks'} (benchmarks need a source checkout)"
        )
    module = registry.module_of(args.name)
    sys.argv = [module, *args.args]
    sys.path.insert(0, str(_CHECKOUT))  # the benchmarks package
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


class _ConsoleHandler(logging.StreamHandler[TextIO]):
    """Log lines on stderr; on a terminal each first clears the progress line drawn in place."""

    def emit(self, record: logging.LogRecord) -> None:
        if self.stream.isatty():
            self.stream.write("\r\x1b[K")
        super().emit(record)


def _setup_logging(command: str, *, verbose: bool) -> None:
    """Log to stderr: debug with ``-v``, else warnings, and ``train``'s notable events.

    ``p2ptrain train`` shows one INFO line per notable event (joined, found a
    group, averaged, peer dropped, state downloaded, global step); the node's
    own INFO line is left out since "joined as" says it. Nothing is changed
    when the root logger already has handlers (an embedding program, pytest).
    """
    root = logging.getLogger()
    if root.handlers:
        return
    handler = _ConsoleHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(
            "%(asctime)s %(levelname)s %(name)s: %(message)s",
            datefmt=None if verbose else "%H:%M:%S",
        )
    )
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.WARNING)
    if command == "train" and not verbose:
        logging.getLogger("p2ptrain").setLevel(logging.INFO)
        logging.getLogger("p2ptrain.node").setLevel(logging.WARNING)


def _run_keygen(args: argparse.Namespace) -> int:
    write_swarm_key(args.out, generate_swarm_key(), overwrite=args.force)
    print(
        f"wrote a new 256-bit swarm key to {args.out} (mode 0600).\n"
        "Share that file with each member over a private channel (scp, a password manager;"
        " not a public chat), and have every peer pass:\n"
        f"  --secret-file {args.out}"
    )
    return 0


_COMMANDS = {
    "keygen": _run_keygen,
    "demo": _run_demo,
    "bootstrap": _run_bootstrap,
    "train": lambda args: (_run_pipeline_train if args.pipeline else _run_train)(args),
    "status": _run_status,
    "bench": _run_bench,
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``p2ptrain`` command."""
    args = _build_parser().parse_args(argv)
    _setup_logging(args.command, verbose=args.verbose)
    try:
        return _COMMANDS[args.command](args)
    except P2PTrainError as exc:
        print(f"p2ptrain {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 130


def console_main() -> NoReturn:
    """The installed ``p2ptrain`` command: :func:`main`, then a quick exit.

    The exit runs the ``atexit`` handlers and flushes the streams but skips
    the interpreter's module teardown, which takes about a second after torch
    has trained (so that ``train --seconds N`` ends within a second of N).
    """
    code = main()
    atexit._run_exitfuncs()  # logging.shutdown and any lab's own cleanup
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    console_main()
