"""Low-level network-namespace plumbing for the NAT lab.

Runs ``ip``/``tc``/``iptables`` commands, opens sockets inside a namespace from
this process (``setns`` in a short-lived thread), kills what runs in a namespace
and deletes it, and finds labs left behind by a crashed run.

Namespace names follow ``<prefix>-<pid>-<token>-<role>``: the pid of the process
that built the lab lets :func:`cleanup_stale_labs` tell a dead run's leftovers
from a lab that another test run is still using.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ParamSpec, TypeVar

import p2ptrain
from p2ptrain.errors import P2PTrainError

__all__ = [
    "DEFAULT_PREFIX",
    "NatLabError",
    "call_in_netns",
    "cleanup_stale_labs",
    "delete_netns",
    "kill_netns_processes",
    "lab_unavailable",
    "list_netns",
    "missing_tools",
    "netns_argv",
    "netns_socket",
    "new_lab_id",
    "python_env",
    "run_cmd",
    "unavailable_reason",
]

DEFAULT_PREFIX = "p2pnl"
"""Prefix of every namespace and temporary directory a lab creates."""

_P = ParamSpec("_P")
_T = TypeVar("_T")
_CLONE_NEWNET = 0x40000000
_CAP_NET_ADMIN = 12
_NETNS_DIR = Path("/run/netns")
_LAB_ID = re.compile(r"^(?P<prefix>[a-z0-9]+)-(?P<pid>[0-9]+)-(?P<token>[0-9a-f]{4})(?:-|$)")


class NatLabError(P2PTrainError):
    """The NAT lab could not be built or a command inside it failed."""


def run_cmd(
    argv: Sequence[str],
    *,
    stdin: str | None = None,
    timeout: float = 30.0,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run a command to completion and capture its output.

    Args:
        argv: Program and arguments.
        stdin: Text fed to the standard input.
        timeout: Seconds before the command is killed.
        check: Raise when the exit status is not 0.

    Returns:
        The finished process, with ``stdout`` and ``stderr`` as text.

    Raises:
        NatLabError: The program is missing, timed out or (with ``check``) failed.
    """
    try:
        done = subprocess.run(
            list(argv),
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NatLabError(f"{' '.join(argv)}: {exc}") from exc
    if check and done.returncode != 0:
        detail = (done.stderr or done.stdout).strip()
        raise NatLabError(f"{' '.join(argv)} exited {done.returncode}: {detail}")
    return done


def netns_argv(netns: str, argv: Sequence[str]) -> list[str]:
    """Prefix ``argv`` so that it runs inside ``netns`` (``ip netns exec``)."""
    return ["ip", "netns", "exec", netns, *argv]


def call_in_netns(netns: str, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """Call ``fn(*args, **kwargs)`` in a fresh thread that entered ``netns``.

    ``setns(2)`` moves only that thread, so the rest of this process stays where
    it is. Sockets created during the call live in ``netns`` for good (and may
    later be used from any thread); threads the call starts inherit the
    namespace. ``asyncio.run(main())`` is a fine ``fn``: the whole event loop,
    and libraries such as aiortc running on it, then live in ``netns``.

    Returns:
        What ``fn`` returned; an exception it raised is re-raised here.

    Raises:
        NatLabError: The namespace does not exist or cannot be entered.
    """
    outcome: list[_T] = []
    failure: list[BaseException] = []

    def enter_and_call() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            with open(_NETNS_DIR / netns, "rb") as handle:
                if libc.setns(handle.fileno(), _CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, os.strerror(err))
        except OSError as exc:
            failure.append(NatLabError(f"cannot enter netns {netns}: {exc}"))
            return
        try:
            outcome.append(fn(*args, **kwargs))
        except BaseException as exc:  # handed over to the calling thread
            failure.append(exc)

    worker = threading.Thread(target=enter_and_call, name=f"netns-{netns}")
    worker.start()
    worker.join()
    if failure:
        raise failure[0]
    return outcome[0]


def netns_socket(
    netns: str,
    family: socket.AddressFamily = socket.AF_INET,
    kind: socket.SocketKind = socket.SOCK_DGRAM,
    proto: int = 0,
) -> socket.socket:
    """Create a socket that lives in the network namespace ``netns``.

    The socket can be used from any thread or event loop of this process.

    Raises:
        NatLabError: The namespace does not exist or cannot be entered.
    """
    return call_in_netns(netns, socket.socket, family, kind, proto)


def python_env() -> dict[str, str]:
    """The current environment with p2ptrain's root prepended to PYTHONPATH."""
    root = str(Path(p2ptrain.__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def list_netns() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    if not _NETNS_DIR.is_dir():
        return []
    return sorted(entry.name for entry in _NETNS_DIR.iterdir())


def _netns_pids(netns: str) -> list[int]:
    done = run_cmd(["ip", "netns", "pids", netns], check=False)
    return [int(word) for word in done.stdout.split() if word.isdigit()]


def kill_netns_processes(netns: str, *, timeout: float = 3.0) -> None:
    """SIGTERM every process inside ``netns``, then SIGKILL what is left.

    The calling process itself is never signalled.
    """
    me = os.getpid()
    deadline = time.monotonic() + timeout
    sig = signal.SIGTERM
    while True:
        pids = [pid for pid in _netns_pids(netns) if pid != me]
        if not pids:
            return
        if time.monotonic() > deadline:
            sig = signal.SIGKILL
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        if sig == signal.SIGKILL and time.monotonic() > deadline + timeout:
            raise NatLabError(f"processes {pids} in netns {netns} survive SIGKILL")
        time.sleep(0.02)  # poll interval while the processes exit


def delete_netns(netns: str) -> None:
    """Kill the processes of ``netns`` and delete it; a missing one is fine."""
    if not (_NETNS_DIR / netns).exists():
        return
    kill_netns_processes(netns)
    run_cmd(["ip", "netns", "delete", netns], check=False)
    if (_NETNS_DIR / netns).exists():
        raise NatLabError(f"could not delete netns {netns}")


def new_lab_id(prefix: str = DEFAULT_PREFIX) -> str:
    """A lab id unique on this machine: ``<prefix>-<pid>-<4 hex digits>``."""
    names = list_netns()
    while True:
        lab_id = f"{prefix}-{os.getpid()}-{secrets.token_hex(2)}"
        if not any(name.startswith(f"{lab_id}-") for name in names):
            return lab_id


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (killed, not yet reaped) counts as dead
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def cleanup_stale_labs(prefix: str = DEFAULT_PREFIX, *, include_live: bool = False) -> list[str]:
    """Delete namespaces and temporary directories left by crashed labs.

    Args:
        prefix: The lab prefix (``LabConfig.prefix``).
        include_live: Also delete labs whose building process still runs
            (never those of this process). Off by default, so that a test run
            cannot destroy the lab of another run.

    Returns:
        The names of the deleted namespaces.
    """
    removed: list[str] = []
    for name in list_netns():
        match = _LAB_ID.match(name)
        if match is None or match["prefix"] != prefix:
            continue
        pid = int(match["pid"])
        if pid == os.getpid() or (_pid_alive(pid) and not include_live):
            continue
        delete_netns(name)
        removed.append(name)
    for path in Path(tempfile.gettempdir()).glob(f"{prefix}-*"):
        match = _LAB_ID.match(path.name)
        if match is None or not path.is_dir():
            continue
        pid = int(match["pid"])
        if pid != os.getpid() and (include_live or not _pid_alive(pid)):
            shutil.rmtree(path, ignore_errors=True)
    return removed


def _has_net_admin() -> bool:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> _CAP_NET_ADMIN & 1)
    return False


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be built here, or None when they can.

    Only the capability and a working ``ip netns`` count: a missing tool such
    as ``tc`` or ``turnserver`` is an installation error that
    :func:`missing_tools` reports, not a reason to skip.
    """
    if not _has_net_admin():
        return "needs CAP_NET_ADMIN (run as root) to build network namespaces"
    if shutil.which("ip") is None:
        return "'ip' not found (apt-get install iproute2)"
    probe = f"{DEFAULT_PREFIX}probe-{os.getpid()}-{secrets.token_hex(2)}"
    done = run_cmd(["ip", "netns", "add", probe], check=False)
    if done.returncode != 0:
        return f"`ip netns add` failed: {done.stderr.strip()}"
    run_cmd(["ip", "netns", "delete", probe], check=False)
    return None


_TOOL_PACKAGES = {
    "ip": "iproute2",
    "tc": "iproute2",
    "iptables-restore": "iptables",
    "iptables-save": "iptables",
    "sysctl": "procps",
    "turnserver": "coturn",
}


def lab_unavailable(*, turn: bool = True) -> str | None:
    """Why the NAT lab (with coturn when ``turn``) cannot be built here, or None.

    Unlike :func:`unavailable_reason` this counts a missing tool too: what a
    test or benchmark that can do without the lab checks before skipping it.
    """
    reason = unavailable_reason()
    if reason is not None:
        return reason
    missing = missing_tools(turn=turn)
    return "missing " + ", ".join(missing) if missing else None


def missing_tools(*, turn: bool) -> list[str]:
    """Tools the lab needs that are not installed, as ``tool (package)``."""
    tools = [tool for tool in _TOOL_PACKAGES if turn or tool != "turnserver"]
    return [f"{tool} ({_TOOL_PACKAGES[tool]})" for tool in tools if shutil.which(tool) is None]
