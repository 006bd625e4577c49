"""Command line for the NAT lab: bring one up by hand, or clean up after a crash.

::

    python -m p2ptrain.lab.natlab.cli up \\
        --home name=a,upload=20,download=50,delay=10,loss=0.0025 \\
        --home name=b,delay=10,loss=0.0025 --home name=c,nat=symmetric
    python -m p2ptrain.lab.natlab.cli cleanup          # labs of dead processes
    python -m p2ptrain.lab.natlab.cli cleanup --all    # every lab, live or not

``up`` prints every node's namespace and address and the TURN credentials as
one JSON object, then holds the lab until Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from p2ptrain.errors import ConfigError
from p2ptrain.lab.natlab.config import DEFAULT_HOMES, HomeConfig, LabConfig
from p2ptrain.lab.natlab.lab import NatLab
from p2ptrain.lab.natlab.netns import DEFAULT_PREFIX, NatLabError, cleanup_stale_labs

__all__ = ["main", "parse_home"]

_HOME_KEYS: dict[str, tuple[str, type]] = {
    "name": ("name", str),
    "nat": ("nat", str),
    "upload": ("upload_mbit", float),
    "download": ("download_mbit", float),
    "delay": ("delay_ms", float),
    "loss": ("loss", float),
}


def parse_home(spec: str) -> HomeConfig:
    """Parse ``name=a,nat=easy,upload=20,download=50,delay=10,loss=0.01``.

    Raises:
        ConfigError: Unknown key, bad number, or an invalid home.
    """
    kwargs: dict[str, Any] = {}
    for item in spec.split(","):
        key, sep, value = item.partition("=")
        if not sep or key not in _HOME_KEYS:
            raise ConfigError(f"bad home item {item!r}; keys: {', '.join(_HOME_KEYS)}")
        field, kind = _HOME_KEYS[key]
        try:
            kwargs[field] = kind(value)
        except ValueError as exc:
            raise ConfigError(f"bad value in {item!r}") from exc
    if "name" not in kwargs:
        raise ConfigError(f"home {spec!r} has no name")
    return HomeConfig(**kwargs)


def _describe(lab: NatLab) -> dict[str, Any]:
    description: dict[str, Any] = {
        "lab_id": lab.lab_id,
        "nodes": {
            node.name: {"netns": node.netns, "address": node.address} for node in lab.nodes()
        },
    }
    if lab.config.turn:
        turn = lab.turn
        description["turn"] = {
            "stun_url": turn.stun_url,
            "turn_url": turn.turn_url,
            "username": turn.username,
            "password": turn.password,
        }
    return description


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m p2ptrain.lab.natlab.cli")
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="build a lab and hold it until Ctrl-C")
    up.add_argument("--home", action="append", default=[], help="name=a,nat=easy,upload=...")
    up.add_argument("--public", action="append", default=[], help="public host name")
    up.add_argument("--no-turn", action="store_true", help="do not start coturn")
    clean = commands.add_parser("cleanup", help="delete labs left by crashed runs")
    clean.add_argument("--all", action="store_true", help="also labs of running processes")
    clean.add_argument("--prefix", default=DEFAULT_PREFIX)
    args = parser.parse_args(argv)

    if args.command == "cleanup":
        removed = cleanup_stale_labs(args.prefix, include_live=args.all)
        print(json.dumps({"removed": removed}))
        return 0
    try:
        config = LabConfig(
            homes=tuple(parse_home(spec) for spec in args.home) or DEFAULT_HOMES,
            public_hosts=tuple(args.public) or ("boot",),
            turn=not args.no_turn,
        )
    except ConfigError as exc:
        parser.error(str(exc))
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        with NatLab(config) as lab:
            print(json.dumps(_describe(lab), indent=2), flush=True)
            stop.wait()
    except NatLabError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
