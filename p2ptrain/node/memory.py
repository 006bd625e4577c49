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
runs it every ``NodeConfig.memory_release_interval`` seconds; the pass is
the process's, not the node's, so when several nodes share an event loop
(a peer with helpers, a test, the swarm simulator's hundreds of nodes) only
one of them runs it per interval (:func:`release_for_loop`): a thousand nodes
each collecting every ten seconds spent a quarter of a 64-peer simulation's
CPU in ``gc.collect``.

Between two passes, freed memory is kept for reuse (:func:`keep_freed_memory`,
``NodeConfig.keep_freed_bytes``). glibc returns the free top of its heap as
soon as it exceeds twice its mmap threshold (32 MiB at most), and a stage
server's backward frees two 16 MiB weight gradients at once, so every
micro-batch page-faulted 32 MiB back in: 8,200 minor faults and 13 of its
32 ms (two width-2048 blocks, 8 samples; ``tests/node/test_memory.py``
shows the faults). With a trim threshold of 128 MiB and the mmap
threshold fixed at 32 MiB (where glibc's own adjustment ends), the same loop
takes 19 ms without a fault; the periodic pass still returns what stays free.

A full collection walks every tracked object, and with torch and the
package imported that is some 230,000 of them: 0.4–0.8 s on this machine,
during which the event loop (where the collection runs) answers nobody.
So the first collection of the process ends with :func:`gc.freeze`: what
survived it (modules, the model, long-lived state) is exempt from later
collections, which then take milliseconds. Cycles made afterwards (a
cancelled handler holding a payload) are collected as before; only garbage
cycles among objects that were alive at that first collection are never
freed.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import gc
import time
import weakref
from collections.abc import Callable

from p2ptrain.wire.buffers import default_pool

__all__ = ["keep_freed_memory", "malloc_trim", "release_for_loop", "release_unused_memory"]

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
"""Blocks from this size on are mapped on their own (glibc's dynamic maximum)."""


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


@functools.cache
def _trim_function() -> Callable[[int], int] | None:
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    function: Callable[[int], int] = trim
    return function


_kept = 0  # the trim threshold this process set, 0 before any


def keep_freed_memory(nbytes: int) -> bool:
    """Let the C allocator keep up to ``nbytes`` of freed heap for reuse (glibc's
    ``M_TRIM_THRESHOLD``, with ``M_MMAP_THRESHOLD`` fixed at :data:`MMAP_THRESHOLD`).

    Process-wide, like the allocator; a later call only ever raises the amount.

    Returns:
        Whether the allocator took the setting (``False`` off glibc).
    """
    global _kept  # noqa: PLW0603 - one allocator per process
    if nbytes <= _kept:
        return _kept > 0
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    nbytes = min(nbytes, 2**31 - 1)
    if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, nbytes)):
        return False
    _kept = nbytes
    return True


def malloc_trim() -> bool:
    """Ask the C allocator to return its free pages to the system.

    Returns:
        Whether the call was available (glibc) and released something.
    """
    trim = _trim_function()
    return bool(trim is not None and trim(0))


_next_release: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, float] = (
    weakref.WeakKeyDictionary()
)
"""The loop time before which no node on that loop runs the release pass again."""

_MAX_SHARE = 0.01
"""The pass is spaced so that it takes at most this share of the loop's time."""


def release_for_loop(
    loop: asyncio.AbstractEventLoop,
    interval: float,
    *,
    release: Callable[[], object] | None = None,
) -> bool:
    """Run the release pass for every node on ``loop``, if it is due; whether it ran.

    Due when no node on the same loop ran it in the last half ``interval``
    (nodes wake at different moments of the interval; half of it keeps the
    pass about once per interval without missing one to rounding), nor in
    the last ``100 x`` the seconds the last pass took: a collection walks
    every object made since the first one, which in a process holding
    hundreds of simulated nodes takes seconds.

    Args:
        release: The pass (default :func:`release_unused_memory`, ``idle_for=interval``).
    """
    now = loop.time()
    if now < _next_release.get(loop, now):
        return False
    started = time.perf_counter()
    if release is None:
        release_unused_memory(idle_for=interval)
    else:
        release()
    cost = time.perf_counter() - started
    _next_release[loop] = now + max(interval / 2, cost / _MAX_SHARE)
    return True


_frozen = False  # whether this process froze what survived its first full collection


def _collect_garbage() -> None:
    """A full collection; the first one freezes its survivors (see the module docstring)."""
    global _frozen  # noqa: PLW0603 - one per process, as the collector itself
    gc.collect()
    if not _frozen:
        gc.freeze()
        _frozen = True


def release_unused_memory(*, idle_for: float = 30.0) -> int:
    """Collect garbage cycles, free pooled buffers idle ``idle_for`` s, trim the allocator.

    The collection comes first: a cancelled handler or a refused reply can
    leave a large payload in a reference cycle (exception, traceback, frame)
    that only the cyclic collector frees, and it may not run for a long while.

    Returns:
        Bytes of pooled buffers freed (what the allocator gives back is not counted).
    """
    _collect_garbage()
    freed = default_pool.trim(idle_for=idle_for)
    malloc_trim()
    return freed
