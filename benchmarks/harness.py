"""The harness every benchmark shares: child processes, event loops, statistics, output.

Benchmarks are modules of the ``benchmarks`` package, run from the repository
root as ``python -m benchmarks.bench_NAME`` (or ``p2ptrain bench NAME``). A
child process of a benchmark is another module of the package, started with
:func:`module_argv` and :func:`child_env` (or :class:`JsonChild` /
:class:`ServerProcess`, which use them), so no file needs to put the
repository on ``sys.path`` itself. Event loops come from :mod:`p2ptrain.aio`.

A benchmark script prints a human-readable table and then, as its very last
line, one JSON object (see :func:`emit_json`) so that tooling can parse the
result with ``output.splitlines()[-1]``.

Server roles run in separate OS processes started with :class:`ServerProcess`:
the child announces its address on stdout as ``READY <address>`` and serves
until its stdin is closed. Closing stdin (which also happens when the parent
dies) is the only stop signal, so a crashed benchmark never leaves a server
behind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import resource
import select
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, TypeVar

from p2ptrain import aio

__all__ = [
    "READY_PREFIX",
    "ROOT",
    "DefaultsHelpFormatter",
    "JsonChild",
    "ServerProcess",
    "announce_ready",
    "child_env",
    "cpu_seconds",
    "emit_json",
    "find_hivemind",
    "format_table",
    "median",
    "module_argv",
    "percentile",
    "plot_bars",
    "run",
    "uvloop_available",
    "wait_for_stdin_eof",
]

T = TypeVar("T")

READY_PREFIX = "READY "
ROOT = Path(__file__).resolve().parent.parent
"""The repository root: the folder that holds the ``benchmarks`` package."""


def module_argv(module: str, *args: str, python: str = sys.executable) -> list[str]:
    """The command line that runs a module of this package (``benchmarks.X``) in a child."""
    return [python, "-m", module, *args]


def child_env() -> dict[str, str]:
    """This environment with :data:`ROOT` first on ``PYTHONPATH``, for children that
    run modules of this package (from whatever folder they start in)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


# -- worker processes ------------------------------------------------------------------------


class JsonChild:
    """A worker process of a benchmark whose JSON stdout lines a thread collects.

    The worker is ``python -m MODULE *args`` (a module of this package) run
    from :data:`ROOT`; lines that are not JSON objects are ignored. An empty
    message marks the end of its output. ``python`` picks another interpreter,
    ``prefix`` goes before the command line (e.g. ``ip netns exec NS``), and
    ``stderr`` (an open file) receives the worker's standard error.
    """

    def __init__(
        self,
        module: str,
        args: Sequence[str],
        *,
        python: str = sys.executable,
        prefix: Sequence[str] = (),
        stderr: IO[bytes] | None = None,
    ) -> None:
        self.process = subprocess.Popen(
            [*prefix, *module_argv(module, *args, python=python)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            cwd=ROOT,
            env=child_env(),
        )
        self.lines: list[dict[str, Any]] = []
        self._ready = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("{"):
                with self._ready:
                    self.lines.append(json.loads(line))
                    self._ready.notify_all()
        with self._ready:
            self.lines.append({})
            self._ready.notify_all()

    def wait_for(self, key: str, timeout: float) -> Any:
        """The value of the first message holding ``key``; waits up to ``timeout`` s."""
        with self._ready:
            self._ready.wait_for(lambda: any(key in m or not m for m in self.lines), timeout)
            for message in self.lines:
                if key in message:
                    return message[key]
        raise RuntimeError(f"worker exited or timed out before sending {key!r}")

    def send(self, text: str) -> None:
        """Write one line to the worker's stdin."""
        assert self.process.stdin is not None
        self.process.stdin.write(text + "\n")
        self.process.stdin.flush()

    def close(self) -> None:
        """Kill the worker if it still runs, and reap it."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


# -- command lines ---------------------------------------------------------------------------


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` shows every flag's default (unless its text already names one)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if action.nargs == 0 and action.default is False:  # an on/off switch
            return text + " (default: off)"
        return text + " (default: %(default)s)"


def find_hivemind(requested: str | None) -> tuple[str | None, str]:
    """The interpreter to run hivemind with (or None), and a line saying what was found.

    By default this interpreter (where ``pip install 'p2ptrain[bench]'`` puts
    hivemind); ``requested`` (``--hivemind-python``) overrides it, e.g. a
    separate virtual environment that keeps hivemind's pins away from this one.
    """
    python = requested or sys.executable
    where = python if requested else "this interpreter"
    try:
        probe = subprocess.run(
            [python, "-c", "import hivemind; print(hivemind.__version__)"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"hivemind skipped: cannot run {python}: {exc}"
    if probe.returncode != 0:
        return None, (
            f"hivemind skipped: not installed in {where} "
            "(pip install 'p2ptrain[bench]', or pass --hivemind-python PATH)"
        )
    return python, f"hivemind {probe.stdout.strip()} ({python})"


# -- event loops ---------------------------------------------------------------------------


uvloop_available = aio.has_uvloop


def run(main: Coroutine[Any, Any, T], *, use_uvloop: bool) -> T:
    """Run ``main`` to completion on a fresh asyncio or uvloop event loop."""
    return aio.run(main, use_uvloop=use_uvloop)


# -- server processes ----------------------------------------------------------------------


def announce_ready(address: str) -> None:
    """In a server child: tell the parent where to connect (one line on stdout)."""
    sys.stdout.write(f"{READY_PREFIX}{address}\n")
    sys.stdout.flush()


async def wait_for_stdin_eof() -> None:
    """In a server child: return once the parent closes our stdin (or dies)."""
    loop = asyncio.get_running_loop()
    closed = loop.create_future()

    class _Watcher(asyncio.Protocol):
        def connection_lost(self, exc: Exception | None) -> None:
            if not closed.done():
                closed.set_result(None)

    transport, _ = await loop.connect_read_pipe(_Watcher, sys.stdin)
    try:
        await closed
    finally:
        transport.close()


class ServerProcess:
    """A server role of a benchmark script, run as a child process.

    ``argv`` is the child's command line; the child must call
    :func:`announce_ready` and stop when :func:`wait_for_stdin_eof` returns.
    Use as a context manager; :attr:`address` holds what the child announced.

    Args:
        argv: The command to run, e.g. ``module_argv("benchmarks.bench_x", "--role", "server")``.
        ready_timeout: Seconds the child has to announce its address.
        stop_timeout: Seconds the child has to exit after stdin closes before it is killed.
    """

    def __init__(
        self, argv: Sequence[str], *, ready_timeout: float = 60.0, stop_timeout: float = 10.0
    ) -> None:
        self.argv = list(argv)
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self.address = ""
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        """The child's process id."""
        if self._proc is None:
            raise RuntimeError("the server process is not running")
        return self._proc.pid

    def start(self) -> str:
        """Start the child and wait for its ``READY`` line; returns the address."""
        self._proc = subprocess.Popen(
            self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=child_env()
        )
        try:
            self.address = self._read_ready()
        except BaseException:
            self.stop()
            raise
        return self.address

    def _read_ready(self) -> str:
        proc = self._proc
        if proc is None or proc.stdout is None:  # pragma: no cover - set by start()
            raise RuntimeError("the server process is not running")
        deadline = time.monotonic() + self.ready_timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self.argv!r} did not announce an address in time")
            readable, _, _ = select.select([proc.stdout], [], [], remaining)
            if not readable:
                continue
            line = proc.stdout.readline().decode(errors="replace")
            if not line:
                code = proc.wait(timeout=self.stop_timeout)
                raise RuntimeError(f"server process exited with code {code} before it was ready")
            if line.startswith(READY_PREFIX):
                return line[len(READY_PREFIX) :].strip()

    def stop(self) -> int | None:
        """Close the child's stdin, wait for it to exit (kill it if it hangs)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            code = proc.wait(timeout=self.stop_timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        return code

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


# -- measurements --------------------------------------------------------------------------


def cpu_seconds() -> float:
    """User + system CPU time of this process so far (all threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def median(values: Iterable[float]) -> float:
    """The median of a non-empty collection."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("median of an empty collection")
    mid = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[mid]
    return (ordered[mid - 1] + ordered[mid]) / 2


def percentile(values: Iterable[float], pct: float) -> float:
    """The ``pct``-th percentile (0..100) of a non-empty collection, nearest-rank."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of an empty collection")
    if not 0 <= pct <= 100:
        raise ValueError("pct must be in [0, 100]")
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[rank - 1]


# -- output --------------------------------------------------------------------------------


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table: first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        parts = [
            row[i].ljust(widths[i]) if i == 0 else row[i].rjust(widths[i]) for i in range(len(row))
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(row) for row in cells[1:])])


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return str(value)


def emit_json(result: dict[str, Any]) -> None:
    """Print ``result`` as one JSON line; call it last so it is the last line of output."""
    sys.stdout.write(json.dumps(result, sort_keys=False) + "\n")
    sys.stdout.flush()


def plot_bars(
    path: str | os.PathLike[str],
    panels: Sequence[tuple[str, dict[str, float]]],
    *,
    title: str,
) -> None:
    """Write a PNG with one bar chart per panel: ``(y-axis label, {bar label: value})``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    for ax, (ylabel, bars) in zip(axes[0], panels, strict=True):
        labels = list(bars)
        values = [bars[k] for k in labels]
        drawn = ax.bar(labels, values, color=[f"C{i}" for i in range(len(labels))])
        ax.bar_label(drawn, fmt="%.0f")
        ax.set_ylabel(ylabel)
        ax.tick_params(axis="x", labelrotation=15)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
