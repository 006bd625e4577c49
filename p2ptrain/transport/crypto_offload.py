"""Worker threads for the AES-GCM passes over large payloads.

Sealing or opening a 1 MiB record costs about as much CPU as the kernel's
copy of it, and on the event loop the two run one after the other. The
``cryptography`` package releases the GIL while it encrypts or decrypts, so
a transport hands the pass over a large payload to these threads and keeps
reading and writing the socket meanwhile: one frame's crypto overlaps the
previous frame's I/O. The record format and its checks do not change
(:mod:`p2ptrain.wire.records`); frames still reach the wire and the
application in counter order.

A handoff costs some tens of microseconds (a thread wake-up and a loop
wake-up), so only payloads of at least
:attr:`~p2ptrain.rpc.config.ConnectionConfig.crypto_offload_bytes` go to a
thread; smaller ones are sealed and opened inline. On a machine of fewer
than :data:`MIN_CPUS` cores there is no core to spare for the workers (a
2-core machine measured about 0.2 CPU s/GiB more per side, for no gain in
throughput), so :func:`effective_offload_bytes` turns it off there.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = [
    "DEFAULT_OFFLOAD_BYTES",
    "MAX_WORKERS",
    "MIN_CPUS",
    "crypto_executor",
    "effective_offload_bytes",
]

DEFAULT_OFFLOAD_BYTES = 256 * 1024
"""Payloads at least this large are sealed and opened on a worker thread by default."""
MAX_WORKERS = 4
"""Worker threads at most (one process rarely has more large frames in flight)."""

MIN_CPUS = 4
"""Cores a machine needs for the offload to be used."""

_lock = threading.Lock()
_executors: list[ThreadPoolExecutor] = []


def crypto_executor() -> ThreadPoolExecutor:
    """The process's crypto worker threads (created on first use, shared by every connection)."""
    with _lock:
        if not _executors:
            workers = max(1, min(MAX_WORKERS, (os.cpu_count() or 2) - 1))
            _executors.append(ThreadPoolExecutor(workers, thread_name_prefix="p2ptrain-crypto"))
        return _executors[0]


def effective_offload_bytes(configured: int | None, cpus: int | None = None) -> int | None:
    """``configured`` where the machine has :data:`MIN_CPUS` cores or more, else None."""
    if configured is None or (cpus if cpus is not None else os.cpu_count() or 1) < MIN_CPUS:
        return None
    return configured
