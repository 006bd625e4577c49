"""The parent side of the all-reduce benchmark: peer processes and timed rounds.

:class:`PeerGroup` starts one process per peer (each in its own session, so
that whatever it spawns, e.g. hivemind's p2p daemon, can be stopped with it),
talks to them with the line protocol of ``allreduce/proto.py``, and always
stops them: on ``close`` every process gets ``quit``, then its process group
SIGTERM and SIGKILL. stderr of each peer goes to a file in a temporary
directory, whose tail is shown when a peer fails.

:func:`run_round` prepares every peer (outside the timing), sends ``go`` to
all of them back to back and turns their replies into a :class:`Round`.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from benchmarks.allreduce.proto import parse_line

__all__ = [
    "BenchmarkError",
    "NotPreparedError",
    "PeerGroup",
    "Round",
    "WrongAverageError",
    "run_round",
]

STOP_TIMEOUT = 10.0
"""Seconds a peer has to exit after ``quit`` before its process group is killed."""


class BenchmarkError(RuntimeError):
    """A peer failed, answered nonsense or timed out."""


class WrongAverageError(BenchmarkError):
    """A round ended, but some peer's result is not the exact average."""


class NotPreparedError(BenchmarkError):
    """Some peer could not get ready for the round (e.g. hivemind formed no group)."""


class _Peer:
    """One peer process and the unread part of its stdout."""

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        self.log = log
        self._log_file: IO[bytes] = log.open("wb")
        self.proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            env=env,
            start_new_session=True,
        )
        self._buffer = b""
        self.eof = False

    def send(self, message: str) -> None:
        stdin = self.proc.stdin
        if stdin is None:  # pragma: no cover - always a pipe
            raise BenchmarkError(f"{self.name}: no stdin")
        try:
            stdin.write(message.encode() + b"\n")
            stdin.flush()
        except BrokenPipeError as exc:
            raise BenchmarkError(f"{self.name} is gone: {self.tail()}") from exc

    def read_available(self) -> list[dict[str, Any]]:
        """Protocol messages in what can be read now without blocking."""
        stdout = self.proc.stdout
        if stdout is None:  # pragma: no cover - always a pipe
            return []
        data = os.read(stdout.fileno(), 1 << 16)
        if not data:
            self.eof = True
            return []
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        messages = []
        for line in lines:
            message = parse_line(line.decode(errors="replace"))
            if message is not None:
                messages.append(message)
        return messages

    def tail(self, chars: int = 1500) -> str:
        with contextlib.suppress(OSError):
            self._log_file.flush()
            text = self.log.read_text(errors="replace").strip()
            return text[-chars:] if text else "(nothing on stderr)"
        return "(no log)"

    def ask_to_quit(self) -> None:
        """Send ``quit`` and close its stdin (it also quits on the end of its input)."""
        proc = self.proc
        if proc.stdin is None:  # pragma: no cover - always a pipe
            return
        with contextlib.suppress(OSError):
            if proc.poll() is None:
                proc.stdin.write(b'{"cmd": "quit"}\n')
                proc.stdin.flush()
        with contextlib.suppress(OSError):
            proc.stdin.close()

    def finish(self, deadline: float) -> None:
        """Wait for it until ``deadline``, then end its whole process group."""
        proc = self.proc
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        # The group is this peer's own session: it holds what the peer spawned.
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            patience = time.monotonic() + 2.0
            while time.monotonic() < patience and _group_alive(proc.pid):
                proc.poll()
                time.sleep(0.02)  # poll interval while the group exits
            if not _group_alive(proc.pid):
                break
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=STOP_TIMEOUT)
        if proc.stdout is not None:
            proc.stdout.close()
        self._log_file.close()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    # Only zombies left (already dead, waiting to be reaped) count as gone.
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


class PeerGroup:
    """The processes of one system's peers; use as a context manager.

    Args:
        name: For messages and the log directory.
        env: Environment of the peer processes.
    """

    def __init__(self, name: str, *, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.env = dict(os.environ if env is None else env)
        self.peers: list[_Peer] = []
        self.hellos: list[dict[str, Any]] = []
        self._logdir = Path(tempfile.mkdtemp(prefix=f"bench-allreduce-{name}-"))
        self._selector = selectors.DefaultSelector()

    def __len__(self) -> int:
        return len(self.peers)

    def start(self, argvs: Sequence[Sequence[str]], *, timeout: float) -> list[dict[str, Any]]:
        """Start one process per command line at once; wait for every hello.

        Returns:
            Their hello messages, in order (also kept in :attr:`hellos`).
        """
        new = []
        for argv in argvs:
            index = len(self.peers)
            peer = _Peer(f"{self.name}[{index}]", argv, self.env, self._logdir / f"{index}.log")
            self.peers.append(peer)
            new.append(peer)
            stdout = peer.proc.stdout
            if stdout is not None:
                self._selector.register(stdout, selectors.EVENT_READ, peer)
        hellos = self._collect(new, timeout, "hello")
        self.hellos.extend(hellos)
        return hellos

    def request(
        self, commands: Sequence[dict[str, Any]], *, timeout: float
    ) -> list[dict[str, Any]]:
        """Send one command to each peer (in order, back to back); one reply each."""
        if len(commands) != len(self.peers):
            raise ValueError("one command per peer")
        lines = [_dumps(command) for command in commands]
        for peer, line in zip(self.peers, lines, strict=True):
            peer.send(line)
        return self._collect(self.peers, timeout, str(commands[0].get("cmd")))

    def _collect(self, peers: list[_Peer], timeout: float, what: str) -> list[dict[str, Any]]:
        replies: dict[int, dict[str, Any]] = {}
        wanted = {id(peer): i for i, peer in enumerate(peers)}
        deadline = time.monotonic() + timeout
        while len(replies) < len(peers):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                late = [p.name for p in peers if wanted[id(p)] not in replies]
                raise BenchmarkError(f"no {what} reply from {late} in {timeout:.0f} s")
            for key, _ in self._selector.select(remaining):
                peer: _Peer = key.data
                for message in peer.read_available():
                    index = wanted.get(id(peer))
                    if index is None or index in replies:
                        raise BenchmarkError(f"{peer.name}: unexpected message {message}")
                    replies[index] = message
                if peer.eof:
                    self._selector.unregister(key.fileobj)
                    if wanted.get(id(peer)) not in replies:
                        peer.proc.wait(timeout=STOP_TIMEOUT)
                        raise BenchmarkError(
                            f"{peer.name} exited ({peer.proc.returncode}) before its {what}"
                            f" reply:\n{peer.tail()}"
                        )
        return [replies[i] for i in range(len(peers))]

    def close(self, *, keep_logs: bool = False) -> None:
        """Stop every peer (their whole process groups); delete their logs unless asked not to."""
        for peer in self.peers:
            with contextlib.suppress(KeyError, ValueError):
                if peer.proc.stdout is not None:
                    self._selector.unregister(peer.proc.stdout)
        for peer in self.peers:
            peer.ask_to_quit()
        deadline = time.monotonic() + STOP_TIMEOUT
        for peer in self.peers:
            peer.finish(deadline)
        self.peers = []
        self._selector.close()
        if keep_logs:
            return
        for log in self._logdir.glob("*.log"):
            log.unlink()
        with contextlib.suppress(OSError):
            self._logdir.rmdir()

    def __enter__(self) -> PeerGroup:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(keep_logs=exc is not None)
        if exc is not None:
            print(f"{self.name}: peer logs kept in {self._logdir}", file=sys.stderr)


def _dumps(command: dict[str, Any]) -> str:
    import json

    return json.dumps(command)


@dataclass
class Round:
    """One timed round of one system.

    Attributes:
        seconds: From the first peer's start to the last peer's end.
        cpu_s: CPU seconds of all peers together.
        max_error: The largest relative error any peer found in its result.
        ok: Whether every peer's result matched the exact average.
        outcomes: Every peer's reply.
    """

    seconds: float
    cpu_s: float
    max_error: float
    ok: bool
    outcomes: list[dict[str, Any]] = field(default_factory=list)


def run_round(
    group: PeerGroup,
    prepares: Sequence[dict[str, Any]],
    *,
    prepare_timeout: float,
    round_timeout: float,
) -> Round:
    """Prepare every peer, then time one round; raise if any result is wrong."""
    replies = group.request(prepares, timeout=prepare_timeout)
    failed = [(i, reply.get("error")) for i, reply in enumerate(replies) if not reply["prepared"]]
    if failed:
        raise NotPreparedError(f"{group.name}: peers not ready (peer, why): {failed}")
    outcomes = group.request([{"cmd": "go"}] * len(group), timeout=round_timeout)
    for outcome in outcomes:
        if "end" not in outcome:
            raise BenchmarkError(f"{group.name}: unexpected reply {outcome}")
    round_ = Round(
        seconds=max(o["end"] for o in outcomes) - min(o["start"] for o in outcomes),
        cpu_s=sum(o["cpu_s"] for o in outcomes),
        max_error=max(o["max_error"] for o in outcomes),
        ok=all(o["ok"] for o in outcomes),
        outcomes=list(outcomes),
    )
    if not round_.ok:
        bad = [(i, o["max_error"], o.get("detail")) for i, o in enumerate(outcomes) if not o["ok"]]
        raise WrongAverageError(f"{group.name}: wrong average (peer, error, detail): {bad}")
    return round_
