"""The ``p2ptrain`` command line.

Each subcommand maps its flags onto the config dataclasses of the layer it
runs. User mistakes (a bad address, a port in use, an unreachable bootstrap
peer, a refused admission) end with one line on stderr and exit status 2, not
a traceback; ``-v`` shows debug logs.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import runpy
import sys
from pathlib import Path

from p2ptrain import __version__
from p2ptrain.aio import run
from p2ptrain.errors import ConfigError, P2PTrainError
from p2ptrain.handshake import AdmissionPolicy
from p2ptrain.identity import Identity
from p2ptrain.node.config import NodeConfig

__all__ = ["main"]

BENCHMARKS = ("transport", "dht", "allreduce", "lp", "training", "webrtc")
_EXAMPLES = """examples:
  p2ptrain demo                                   # a local swarm on this machine
  p2ptrain bootstrap --host 0.0.0.0 --port 4001 --announce-host 203.0.113.7
  p2ptrain bench transport --megabytes 64
"""


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
        "--secret-file", help="file holding the swarm's admission secret (>= 16 bytes)"
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

    demo = commands.add_parser(
        "demo",
        help="run a local swarm on loopback and show what happens",
        description=(
            "Start a swarm of peers on this machine; they connect, authenticate "
            "with their Ed25519 keys and pass a tensor around a ring."
        ),
        epilog="example: p2ptrain demo --peers 6 --megabytes 32",
    )
    demo.add_argument("--peers", type=int, default=4, help="number of peers (default 4)")
    demo.add_argument(
        "--megabytes", type=float, default=16.0, help="size of each tensor sent (default 16)"
    )

    bootstrap = commands.add_parser(
        "bootstrap",
        help="run a public peer others join through (a standing DHT node)",
        description=(
            "Run a standing DHT peer and print the address others pass with --join. "
            "Keep its identity in a file so the address survives restarts."
        ),
        epilog=(
            "example: p2ptrain bootstrap --host 0.0.0.0 --port 4001 "
            "--announce-host 203.0.113.7 --identity boot.key"
        ),
    )
    _add_node_flags(bootstrap, default_port=4001)
    bootstrap.add_argument(
        "--join",
        action="append",
        default=[],
        metavar="ADDR",
        help="another bootstrap peer to connect to (repeatable)",
    )

    bench = commands.add_parser(
        "bench",
        help="run a benchmark and print its table",
        description=(
            "Run one of the benchmarks in benchmarks/ (needs a source checkout). "
            "Arguments after the name go to the benchmark; try `--help` there."
        ),
        epilog="example: p2ptrain bench transport --megabytes 64 --png transport.png",
    )
    bench.add_argument("name", choices=BENCHMARKS, help="which benchmark")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    return parser


# -- helpers -----------------------------------------------------------------------------


def _read_secret(path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the secret file {path}: {exc.strerror}") from exc
    return secret


def _node_config(args: argparse.Namespace) -> NodeConfig:
    return NodeConfig(
        host=args.host,
        port=args.port,
        announce_host=args.announce_host,
        swarm=args.swarm,
        admission=AdmissionPolicy(secret=_read_secret(args.secret_file)),
    )


def _identity(args: argparse.Namespace) -> Identity | None:
    return Identity.load_or_create(args.identity) if args.identity else None


# -- subcommands -------------------------------------------------------------------------


def _run_demo(args: argparse.Namespace) -> int:
    from p2ptrain.demo import DemoConfig, format_report, run_demo  # noqa: PLC0415 - torch is slow

    config = DemoConfig(peers=args.peers, tensor_elements=max(1, int(args.megabytes * 1e6 / 4)))
    print(f"starting {config.peers} peers on 127.0.0.1 ...")
    reports = run(run_demo(config))
    print(format_report(reports))
    return 0 if all(r.verified for r in reports) else 1


def _run_bootstrap(args: argparse.Namespace) -> int:
    from p2ptrain.dht.node_config import DHTNodeConfig  # noqa: PLC0415
    from p2ptrain.dht.standing import run_standing_dht_node  # noqa: PLC0415

    dht_config = DHTNodeConfig(initial_peers=tuple(args.join))

    def announce(address: str) -> None:
        print(f"bootstrap peer ready; others join with:\n  --join {address}", flush=True)

    try:
        run(
            run_standing_dht_node(
                _node_config(args), dht_config, identity=_identity(args), announce=announce
            )
        )
    except KeyboardInterrupt:
        print("stopped")
    return 0


def _run_bench(args: argparse.Namespace) -> int:
    root = Path(__file__).resolve().parent.parent / "benchmarks"
    script = root / f"bench_{args.name}.py"
    if not script.is_file():
        raise ConfigError(
            f"benchmark {args.name!r} not found at {script} (benchmarks need a source checkout)"
        )
    sys.argv = [str(script), *args.args]
    sys.path.insert(0, str(root.parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


_COMMANDS = {"demo": _run_demo, "bootstrap": _run_bootstrap, "bench": _run_bench}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``p2ptrain`` command."""
    args = _build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return _COMMANDS[args.command](args)
    except P2PTrainError as exc:
        print(f"p2ptrain {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 130


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
