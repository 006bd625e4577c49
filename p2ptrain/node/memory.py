"""Giving memory back to the system after a burst (or an attack) has passed.

Theory of operation
-------------------
Freeing a Python object does not shrink the process. Two things keep the
pages: our own :data:`~p2ptrain.wire.buffers.default_pool`, which keeps freed
payload buffers for reuse, and glibc's allocator, whose arenas keep freed
chunks and whose mmap threshold grows (up to 32 MiB) each time a large
mmapped block is freed, so later large blocks come from the arenas and stay
there. An attacker who made a node allocate a few hundred MB leaves it with
that RSS for good, although nothing refers to the memory any more.

:func:`release_unused_memory` undoes both, after a full garbage collection
(payloads caught in reference cycles are otherwise freed late): it frees the
pooled buffers that have waited for reuse longer than ``idle_for`` (a workload that cycles its
buffers keeps them), then asks glibc to return free pages with
``malloc_trim(0)`` (through ctypes; a no-op where the C library is not glibc).
``benchmarks/bench_hostile.py`` measures what each step gives back. A node
runs it every ``NodeConfig.memory_release_interval`` seconds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
from collections.abc import Callable

from p2ptrain.wire.buffers import default_pool

__all__ = ["malloc_trim", "release_unused_memory"]


@functools.cache
def _trim_function() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def malloc_trim() -> bool:
    """Ask the C allocator to return its free pages to the system.

    Returns:
        Whether the call was available (glibc) and released something.
    """
    trim = _trim_function()
    return bool(trim is not None and trim(0))


def release_unused_memory(*, idle_for: float = 30.0) -> int:
    """Collect garbage cycles, free pooled buffers idle ``idle_for`` s, trim the allocator.

    The collection comes first: a cancelled handler or a refused reply can
    leave a large payload in a reference cycle (exception, traceback, frame)
    that only the cyclic collector frees, and it may not run for a long while.

    Returns:
        Bytes of pooled buffers freed (what the allocator gives back is not counted).
    """
    gc.collect()
    freed = default_pool.trim(idle_for=idle_for)
    malloc_trim()
    return freed
