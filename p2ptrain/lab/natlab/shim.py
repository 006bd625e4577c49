"""Wiring of the delay/loss shim into the lab.

The shim is the compiled ``tun_delay`` where a C compiler is found
(:mod:`p2ptrain.lab.natlab.native_shim`), else the Python module
:mod:`p2ptrain.lab.lossy_link`; both take the same settings and print the
same JSON lines.

A home's access link is impaired in the internet router namespace, where no
NAT happens (so the NAT's conntrack never sees a packet twice). For a home
whose router has WAN address ``W`` and hangs off the internet router's
interface ``v-<home>``, a tun device ``t-<home>`` and routing table ``T`` are
set up with these policy rules::

    prio 100  iif t-<home> to W   lookup main   # leaving the shim towards the home
    prio 200  iif v-<home>        lookup T      # from the home (upload)
    prio 300  to W                lookup T      # towards the home (download)
    table T:  default dev t-<home>

Upload rules (200) sit above download rules (300), so a packet between two
impaired homes passes the sender's shim first, then the receiver's. Packets the
shim writes back enter on ``t-<home>`` and take the main table (or rule 300 of
the other home). Reverse-path filtering must be off in that namespace.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from p2ptrain.lab.natlab.native_shim import native_shim
from p2ptrain.lab.natlab.netns import NatLabError, netns_argv, python_env

__all__ = ["ShimLink", "shim_route_commands", "start_shim", "stop_shim"]

_RULE_BACK_TO_HOME = 100
_RULE_UPLOAD = 200
_RULE_DOWNLOAD = 300
_TXQUEUELEN = 4096
_QUEUE_LIMIT = 10_000
"""Packets a shim holds at most (the Python shim's default)."""
_NICE = -10
"""Niceness increment of a shim (the Python shim's default)."""


@dataclass(frozen=True)
class ShimLink:
    """One impaired access link, as seen from the internet router.

    Attributes:
        home: Home name.
        uplink: The internet router's interface towards the home's router.
        tun: The tun device the shim serves.
        wan_address: The home router's public (WAN) address.
        table: Routing table number used for this home.
        delay_ms: One-way delay, each direction.
        loss: Drop probability, each direction.
        seed: Seed of the shim's loss RNG.
    """

    home: str
    uplink: str
    tun: str
    wan_address: str
    table: int
    delay_ms: float
    loss: float
    seed: int


def shim_route_commands(link: ShimLink) -> list[str]:
    """``ip -batch`` lines that route the home's traffic through its tun."""
    return [
        f"link set dev {link.tun} up",
        f"route add default dev {link.tun} table {link.table}",
        f"rule add priority {_RULE_BACK_TO_HOME} iif {link.tun} to {link.wan_address} lookup main",
        f"rule add priority {_RULE_UPLOAD} iif {link.uplink} lookup {link.table}",
        f"rule add priority {_RULE_DOWNLOAD} to {link.wan_address} lookup {link.table}",
    ]


def start_shim(
    netns: str, link: ShimLink, *, log_dir: Path, timeout: float
) -> subprocess.Popen[str]:
    """Create the tun device in ``netns``, start the shim on it, wait until ready.

    Routing is not touched: apply :func:`shim_route_commands` afterwards.

    Raises:
        NatLabError: The shim exited or did not report ready within ``timeout``.
    """
    for command in (
        ["ip", "-n", netns, "tuntap", "add", "dev", link.tun, "mode", "tun"],
        ["ip", "-n", netns, "link", "set", "dev", link.tun, "txqueuelen", str(_TXQUEUELEN)],
    ):
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise NatLabError(f"{' '.join(command)}: {done.stderr.strip()}")
    argv = _shim_argv(link)
    with open(log_dir / f"shim-{link.home}.log", "wb") as log:
        proc = subprocess.Popen(
            netns_argv(netns, argv),
            stdout=subprocess.PIPE,
            stderr=log,
            stdin=subprocess.DEVNULL,
            text=True,
            env=python_env(),
        )
    if proc.stdout is None:  # pragma: no cover - PIPE was asked for
        raise NatLabError("shim started without a stdout pipe")
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select([proc.stdout], [], [], left)
        if not readable:
            break
        line = proc.stdout.readline()
        if not line:
            break
        message = json.loads(line)
        if "ready" in message:
            return proc
        if "error" in message:
            stop_shim(proc)
            raise NatLabError(f"shim for home {link.home} failed: {message['error']}")
    stop_shim(proc)
    raise NatLabError(f"shim for home {link.home} not ready within {timeout:.1f} s")


def _shim_argv(link: ShimLink) -> list[str]:
    """The compiled shim where one could be built, else the Python module."""
    native = native_shim()
    if native is not None:
        return [
            str(native),
            link.tun,
            str(link.delay_ms),
            str(link.loss),
            str(link.seed),
            str(_QUEUE_LIMIT),
            str(_NICE),
        ]
    return [
        sys.executable,
        "-m",
        "p2ptrain.lab.lossy_link",
        f"--tun={link.tun}",
        f"--delay-ms={link.delay_ms}",
        f"--loss={link.loss}",
        f"--seed={link.seed}",
        f"--queue-limit={_QUEUE_LIMIT}",
        f"--nice={_NICE}",
    ]


def stop_shim(proc: subprocess.Popen[str], *, timeout: float = 3.0) -> dict[str, int] | None:
    """Stop a shim and return its final counters (None if it printed none)."""
    if proc.poll() is None:
        proc.terminate()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    for line in (out or "").splitlines():
        try:
            message = json.loads(line)
        except ValueError:
            continue
        if isinstance(message, dict) and isinstance(message.get("stats"), dict):
            return {str(k): int(v) for k, v in message["stats"].items()}
    return None
