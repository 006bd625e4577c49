"""Where a stage server computes: its device, with an optional floor per call.

A :class:`~p2ptrain.swarm.server.StageServer` hands every forward and
backward to its device as two parts: ``compute`` (the torch work) and
``finish`` (what must happen after the call's full device time, e.g. the
commit of a backward, which checks the call's deadline). The device runs
one call at a time and returns ``finish``'s result with the call's device
seconds (compute plus the floor, not the wait for the device).

* :class:`ThreadDevice` (production): one worker thread, so the event loop
  stays free; ``min_compute_s`` holds the thread, emulating a slower device.
* A simulation passes a device on its virtual clock
  (:class:`~p2ptrain.lab.swarm_sim.VirtualDevice`): the same server code,
  with the floor spent on the loop's clock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from p2ptrain.swarm.compute import compute_pool

__all__ = ["Device", "ThreadDevice"]

R = TypeVar("R")
T = TypeVar("T")


class Device(Protocol):
    """Runs a stage server's compute, one call at a time."""

    def now(self) -> float:
        """Seconds on the clock the device's floors and deadlines use."""
        ...

    async def run(self, compute: Callable[[], R], finish: Callable[[R], T]) -> tuple[T, float]:
        """``finish(compute())`` after at least the floor; with the call's device seconds."""
        ...

    async def idle(self) -> None:
        """Return once every call started before is done."""
        ...

    def shutdown(self) -> None:
        """Stop (after the running call)."""
        ...


class ThreadDevice:
    """The host's CPU or accelerator, driven from one worker thread.

    Args:
        min_compute_s: A floor on each call's seconds (0: none).
        name: The worker thread's name prefix.
    """

    def __init__(self, min_compute_s: float = 0.0, *, name: str = "stage-compute") -> None:
        self.min_compute_s = min_compute_s
        self._pool = compute_pool(name)

    def now(self) -> float:
        """``time.monotonic()``."""
        return time.monotonic()

    async def run(self, compute: Callable[[], R], finish: Callable[[R], T]) -> tuple[T, float]:
        """Run both parts in the worker thread, the floor between them."""
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, self._job, compute, finish
        )

    def _job(self, compute: Callable[[], R], finish: Callable[[R], T]) -> tuple[T, float]:
        started = time.perf_counter()
        result = compute()
        rest = self.min_compute_s - (time.perf_counter() - started)
        if rest > 0:
            time.sleep(rest)
        elapsed = time.perf_counter() - started
        return finish(result), elapsed

    async def idle(self) -> None:
        """Wait for the worker's queue to drain."""
        await asyncio.get_running_loop().run_in_executor(self._pool, lambda: None)

    def shutdown(self) -> None:
        """Stop the worker thread (after its running job)."""
        self._pool.shutdown(wait=True)
