"""What the all-reduce benchmark's parent and its peer processes share.

This module needs only the standard library and torch, so that the hivemind
peer (run by another interpreter, see ``allreduce/hivemind.py``) imports it
too.

**Line protocol.** A peer process writes its messages to stdout as
``@@ab <json>`` lines (any other line, e.g. a library's chatter, is ignored)
and reads one JSON command a line from stdin:

1. on start it writes ``{"hello": ..., "pid": int}`` (``hello`` is what others
   need to reach it: a p2ptrain address, hivemind multiaddrs);
2. ``{"cmd": "prepare", "rank": r, "peers": n, "numel": k, ...}`` makes it
   build its input and get ready for a round outside any timing (system
   specific keys: the p2ptrain plan, ...); it answers ``{"prepared": true}``;
3. ``{"cmd": "go"}`` runs the round; it answers with a :class:`RoundOutcome`
   as a dict;
4. ``{"cmd": "quit"}``, or the end of stdin, stops it.

**Inputs.** Peer ``r`` of ``n`` averages ``x_r = (r + 1)·a + r`` with one
shared random vector ``a``, so the exact average is
``((n + 1)/2)·a + (n − 1)/2`` and every peer checks its *whole* result
against it from its own input alone (:func:`max_error`), outside the timing.
Every element carries a random value, and a part routed to the wrong place,
averaged twice or left out changes it.

**Time.** Peers stamp ``time.monotonic()`` (CLOCK_MONOTONIC, one clock for
every process of the machine, namespaces included) when the ``go`` line
arrives and when their result is complete; a round lasts from the first
start to the last end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "LINE_PREFIX",
    "TOLERANCE",
    "RoundOutcome",
    "descendants",
    "exact_coefficients",
    "input_vector",
    "max_error",
    "now",
    "parse_line",
    "peer_parser",
    "process_cpu_seconds",
    "read_command",
    "tree_cpu_seconds",
    "write_message",
]

LINE_PREFIX = "@@ab "
SEED = 20240607
CHECK_CHUNK = 1 << 22
"""Elements compared at a time by :func:`max_error` (keeps its temporaries small)."""
TOLERANCE = 1e-5
"""Allowed error: ``TOLERANCE · (1 + |exact|)`` per element (float32 sums of a few terms)."""


# -- the line protocol ------------------------------------------------------------------------


def write_message(message: dict[str, Any]) -> None:
    """In a peer: send one message to the parent."""
    sys.stdout.write(LINE_PREFIX + json.dumps(message) + "\n")
    sys.stdout.flush()


def read_command() -> dict[str, Any]:
    """In a peer: the next command; ``{"cmd": "quit"}`` at the end of stdin."""
    line = sys.stdin.readline()
    if not line:
        return {"cmd": "quit"}
    command: dict[str, Any] = json.loads(line)
    return command


def parse_line(line: str) -> dict[str, Any] | None:
    """In the parent: the message on a peer's stdout line, or None for other output."""
    if not line.startswith(LINE_PREFIX):
        return None
    message: dict[str, Any] = json.loads(line[len(LINE_PREFIX) :])
    return message


@dataclass
class RoundOutcome:
    """What one peer reports after one round.

    Attributes:
        start: ``time.monotonic()`` when the ``go`` command arrived.
        end: ``time.monotonic()`` when its averaged vector was complete.
        cpu_s: CPU seconds (user + system) its process(es) spent in between.
        max_error: Largest ``|result − exact| / (1 + |exact|)`` over the vector.
        ok: Whether ``max_error`` is within :data:`TOLERANCE` (and the system
            reported no failure).
        detail: System-specific figures (p2ptrain: its report's bytes and times).
    """

    start: float
    end: float
    cpu_s: float
    max_error: float
    ok: bool
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The message sent to the parent."""
        return asdict(self)


# -- inputs and the exact answer ------------------------------------------------------------


def input_vector(rank: int, numel: int) -> torch.Tensor:
    """Peer ``rank``'s input: ``(rank + 1)·a + rank`` with the shared random ``a``."""
    generator = torch.Generator().manual_seed(SEED + numel)
    vector = torch.randn(numel, generator=generator)
    return vector.mul_(rank + 1).add_(rank)


def exact_coefficients(peers: int) -> tuple[float, float]:
    """``(c1, c0)`` with the exact average ``c1·a + c0`` of ``peers`` inputs."""
    return (peers + 1) / 2, (peers - 1) / 2


def max_error(result: torch.Tensor, own_input: torch.Tensor, rank: int, peers: int) -> float:
    """Largest ``|result − exact| / (1 + |exact|)``, the exact average rebuilt from ``own_input``.

    ``a = (x_rank − rank)/(rank + 1)``, so the exact average is
    ``(x_rank − rank)·c1/(rank + 1) + c0``. It is rebuilt in float32 (relative
    error about 1e-7, far below :data:`TOLERANCE`) one slice at a time; NaN or
    infinity anywhere gives ``inf``.
    """
    if result.shape != own_input.shape:
        return math.inf
    c1, c0 = exact_coefficients(peers)
    scale = c1 / (rank + 1)
    size = min(CHECK_CHUNK, own_input.numel())
    exact_buffer, error_buffer = torch.empty(size), torch.empty(size)  # reused: no page faults
    worst = 0.0
    for lo in range(0, own_input.numel(), CHECK_CHUNK):
        hi = min(lo + CHECK_CHUNK, own_input.numel())
        exact, error = exact_buffer[: hi - lo], error_buffer[: hi - lo]
        torch.sub(own_input[lo:hi], rank, out=exact).mul_(scale).add_(c0)
        torch.sub(result[lo:hi], exact, out=error).abs_()
        chunk_worst = float(error.div_(exact.abs_().add_(1.0)).max())
        if not math.isfinite(chunk_worst):
            return math.inf
        worst = max(worst, chunk_worst)
    return worst


# -- CPU time ---------------------------------------------------------------------------------


def process_cpu_seconds() -> float:
    """User + system CPU time of this process, all threads (``getrusage``)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces; everything after its ")" splits cleanly.
    return text.rpartition(")")[2].split()


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (from ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def tree_cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU time of a process and all its descendants (from ``/proc``).

    For systems that run helper processes (hivemind: the averager and DHT
    processes, the p2p daemon). Processes that exit in between are missed.
    """
    total = 0
    for member in descendants(os.getpid() if pid is None else pid):
        fields = _stat_fields(member)
        if fields is not None:
            # After the command name: state is fields[0]; utime, stime are fields 14, 15 of stat.
            total += int(fields[11]) + int(fields[12])
    return total / _TICKS


def now() -> float:
    """The clock every peer stamps with."""
    return time.monotonic()


def peer_parser(description: str) -> argparse.ArgumentParser:
    """The command line every peer process takes: ``--host``, ``--timeout``, ``--threads``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds a round may take")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    return parser
