"""Recycled receive buffers for large payloads.

Allocating a fresh multi-megabyte buffer for every received payload costs a
page fault (and the kernel zeroing a page) for every 4 KiB, because the
allocator returns large blocks to the system as soon as they are freed. The
pool keeps freed buffers of each power-of-two size class and hands them out
again. A buffer is back in the pool only once nothing refers to it any more:
the pool hands out a view and watches that view with a finalizer, and every
memoryview or tensor made from the payload keeps the view alive.
"""

from __future__ import annotations

import threading
import time
import weakref

import numpy as np

__all__ = ["BufferPool", "default_pool"]

_MIN_CLASS = 16  # 64 KiB


class BufferPool:
    """Power-of-two size classes of reusable ``uint8`` buffers.

    Args:
        max_idle_bytes: freed buffers kept for reuse at most (the rest are freed).
    """

    def __init__(self, *, max_idle_bytes: int = 256 << 20) -> None:
        self.max_idle_bytes = max_idle_bytes
        self._idle: dict[int, list[tuple[np.ndarray, float]]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()
        self.reused = 0
        self.allocated = 0

    def get(self, nbytes: int) -> memoryview:
        """A writable buffer of exactly ``nbytes`` (contents undefined)."""
        size_class = max(_MIN_CLASS, (nbytes - 1).bit_length())
        with self._lock:
            idle = self._idle.get(size_class)
            base = idle.pop()[0] if idle else None
            if base is not None:
                self._idle_bytes -= base.nbytes
                self.reused += 1
            else:
                self.allocated += 1
        if base is None:
            base = np.empty(1 << size_class, dtype=np.uint8)
        view = base[:nbytes]
        weakref.finalize(view, self._release, size_class, base)
        return memoryview(view.data)  # a 1-D uint8 array: already format "B"

    def _release(self, size_class: int, base: np.ndarray) -> None:
        with self._lock:
            if self._idle_bytes + base.nbytes > self.max_idle_bytes:
                return
            self._idle.setdefault(size_class, []).append((base, time.monotonic()))
            self._idle_bytes += base.nbytes

    def trim(self, *, idle_for: float = 0.0) -> int:
        """Free the buffers that have waited for reuse at least ``idle_for`` seconds.

        Buffers cycled by a running workload are reused sooner and stay;
        those left over from a burst (or an attack) go back to the allocator.

        Returns:
            Bytes freed.
        """
        cutoff = time.monotonic() - idle_for
        freed = 0
        with self._lock:
            for size_class, idle in list(self._idle.items()):
                keep = [(base, since) for base, since in idle if since > cutoff]
                freed += sum(base.nbytes for base, since in idle if since <= cutoff)
                if keep:
                    self._idle[size_class] = keep
                else:
                    del self._idle[size_class]
            self._idle_bytes -= freed
        return freed

    def reserve(self, nbytes: int) -> None:
        """Keep at least ``nbytes`` of freed buffers from now on (never lowers the cap).

        A caller that cycles through buffers of ``nbytes`` in total (e.g. one
        all-reduce round of a large vector) calls this so that they are
        reused instead of freed and allocated again every time.
        """
        with self._lock:
            self.max_idle_bytes = max(self.max_idle_bytes, nbytes)

    @property
    def idle_bytes(self) -> int:
        """Bytes held for reuse right now."""
        return self._idle_bytes


default_pool = BufferPool()
"""The pool every frame decoder draws large payload buffers from."""
