"""Child processes of the demos: ``p2ptrain`` commands whose JSON lines are collected.

A :class:`ChildProcess` runs a command in its own process group (so that
Ctrl-C in a terminal reaches only the demo, which then stops its children),
reads its stdout and stderr with threads, and appends every JSON object line
of its stdout, stamped with ``"t"`` (seconds since ``origin`` when the line
arrived), to an :class:`EventLog`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, Generic, Protocol, TypeVar

from p2ptrain.errors import ConfigError

__all__ = ["ChildProcess", "EventLog", "check_stop", "cli_argv"]


class EventLog(Protocol):
    """Where a child's events and stderr tail go (a demo's per-peer record)."""

    started: bool
    events: list[dict[str, Any]]
    stderr: list[str]


Log = TypeVar("Log", bound=EventLog)


class ChildProcess(Generic[Log]):
    """A child process whose stdout (JSON lines) and stderr are read by threads."""

    def __init__(self, argv: Sequence[str], run: Log | None, origin: float) -> None:
        self.run = run
        if run is not None:
            run.started = True
        self.origin = origin
        self.lines: list[str] = []
        self.eof = False
        self._changed = threading.Condition()
        self.process = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            process_group=0,  # Ctrl-C in a terminal reaches the demo, which stops its peers
        )
        self._threads = [
            threading.Thread(target=self._read_stdout, daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _read_stdout(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            arrived = time.monotonic() - self.origin
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                if self.run is not None:
                    try:
                        event = json.loads(line)
                    except json.JSONDecodeError:
                        event = None
                    if isinstance(event, dict):
                        event["t"] = arrived
                        self.run.events.append(event)
                self._changed.notify_all()
        with self._changed:
            self.eof = True
            self._changed.notify_all()

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            if self.run is not None:
                self.run.stderr = [*self.run.stderr[-40:], line.rstrip("\n")]

    def wait_for_line(
        self, marker: str, timeout: float, stop: threading.Event | None = None
    ) -> str:
        """The first stdout line containing ``marker``.

        Raises:
            KeyboardInterrupt: ``stop`` was set first.
        """
        deadline = time.monotonic() + timeout
        found = False
        with self._changed:
            while not found and time.monotonic() < deadline:
                check_stop(stop)
                found = self._changed.wait_for(
                    lambda: (
                        any(marker in line for line in self.lines)
                        or self.process.poll() is not None
                    ),
                    min(0.1, max(0.0, deadline - time.monotonic())),  # to look at stop
                )
            for line in self.lines:
                if marker in line:
                    return line
        why = "timed out" if not found else f"exited ({self.process.poll()})"
        raise ConfigError(f"a demo process {why} before printing {marker!r}")

    def wait(self, timeout: float) -> int | None:
        """Wait for the process to exit; kill it after ``timeout`` seconds."""
        try:
            code: int | None = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            code = None
        for thread in self._threads:
            thread.join(5)
        return code

    def stop(self) -> None:
        """Terminate (then kill) the process if it still runs."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def check_stop(stop: threading.Event | None) -> None:
    """Before any peer trains, a stop interrupts the demo (the caller stops the processes).

    It is raised here, at a known point, rather than by the signal handler, so
    that no process can be started and not yet recorded when it comes.
    """
    if stop is not None and stop.is_set():
        raise KeyboardInterrupt


def cli_argv(*args: str) -> list[str]:
    """The command line of ``p2ptrain ARGS...`` with this interpreter."""
    return [sys.executable, "-m", "p2ptrain.app.cli", *args]
