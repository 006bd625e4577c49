"""The delay shim compiled from C (``tun_delay.c``), where a C compiler is found.

The Python shim (:mod:`p2ptrain.lab.lossy_link`) costs about 20 µs of CPU
per packet; eight of them in a star lab at 40 ms RTT took over half of a
2-core machine during a 16 MiB all-reduce round, so what they measured was
partly the emulator. ``tun_delay.c`` does the same job (same arguments, same
JSON lines, same counters) at the cost of a read and a write per packet.

It is compiled once per source version into the user's cache directory
(``$XDG_CACHE_HOME/p2ptrain`` or ``~/.cache/p2ptrain``; not a shared
temporary directory, since the labs run it as root) and reused; with no
compiler, or ``P2PTRAIN_SHIM=python`` in the environment, the labs run the
Python shim instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
from functools import cache
from pathlib import Path

__all__ = ["SHIM_ENV", "native_shim"]

SHIM_ENV = "P2PTRAIN_SHIM"
"""Environment variable: ``python`` forces the Python shim."""

_SOURCE = Path(__file__).with_name("tun_delay.c")
log = logging.getLogger(__name__)


def native_shim() -> Path | None:
    """The compiled shim's path, or None to use the Python one."""
    if os.environ.get(SHIM_ENV, "").lower() == "python":
        return None
    return _build()


@cache
def _build() -> Path | None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or not _SOURCE.is_file():
        return None
    digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "p2ptrain"
    target = cache / f"tun_delay-{digest}"
    if target.is_file() and target.stat().st_uid == os.getuid():
        return target
    partial = target.with_name(f"{target.name}.{os.getpid()}")
    try:
        cache.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            [compiler, "-O2", "-std=c11", "-o", str(partial), str(_SOURCE)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode == 0:
            partial.replace(target)  # atomic: concurrent builders leave one complete binary
            return target
        reason = done.stderr.strip()
    except OSError as exc:  # no writable cache directory
        reason = str(exc)
    log.warning("tun_delay.c not built, using the Python shim: %s", reason)
    with contextlib.suppress(OSError):  # nothing was written, or no directory to hold it
        partial.unlink()
    return None
