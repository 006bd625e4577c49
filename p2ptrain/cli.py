"""The ``p2ptrain`` command line."""

from __future__ import annotations

import argparse
import logging
import sys

from p2ptrain import __version__
from p2ptrain.aio import run
from p2ptrain.errors import P2PTrainError

__all__ = ["main"]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="p2ptrain",
        description="Train one PyTorch model together over the internet.",
    )
    parser.add_argument("--version", action="version", version=f"p2ptrain {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True)

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
    return parser


def _run_demo(args: argparse.Namespace) -> int:
    from p2ptrain.demo import DemoConfig, format_report, run_demo  # noqa: PLC0415 - torch is slow

    config = DemoConfig(peers=args.peers, tensor_elements=max(1, int(args.megabytes * 1e6 / 4)))
    print(f"starting {config.peers} peers on 127.0.0.1 ...")
    reports = run(run_demo(config))
    print(format_report(reports))
    return 0 if all(r.verified for r in reports) else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``p2ptrain`` command."""
    args = _build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "demo":
            return _run_demo(args)
    except P2PTrainError as exc:
        print(f"p2ptrain: error: {exc}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
