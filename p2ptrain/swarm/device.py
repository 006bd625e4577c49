"""Where a stage server computes: its device, with an optional floor per call.

A :class:`~p2ptrain.swarm.server.StageServer` hands every forward and
backward to its device as two parts: ``compute`` (the torch work) and
``finish`` (what must happen after the call's full device time, e.g. the
commit of a backward, which checks the call's deadline). The device runs
one call at a time and returns ``finish``'s result with the call's device
seconds (compute plus the floor, not the wait for the device).

Calls wait for the device in priority order (:class:`PriorityGate`): a
backward before any forward, first come first served within each. A
backward finishes a micro-batch and frees the activations the stage holds
for it; behind a FIFO queue it would wait for every forward that arrived
before it, so a saturated stage's queue would fill with forwards and every
micro-batch's latency (and the memory held for it) grow with the queue. In
the simulator a 40/8/8/8 start with 512 micro-batches in flight delivered
4 samples in its first 60 s that way. This is 1F1B's rule, applied to
whatever arrives.

* :class:`ThreadDevice` (production): one worker thread, so the event loop
  stays free; ``min_compute_s`` holds the thread, emulating a slower device.
* A simulation passes a device on its virtual clock
  (:class:`~p2ptrain.testing.swarm_sim.VirtualDevice`): the same server code,
  with the floor spent on the loop's clock.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from p2ptrain.swarm.compute import compute_pool

__all__ = ["BACKWARD", "FORWARD", "Device", "PriorityGate", "ThreadDevice"]

R = TypeVar("R")
T = TypeVar("T")

BACKWARD = 0
"""Priority of a backward (served first)."""
FORWARD = 1
"""Priority of a forward."""
_LAST = 2  # :meth:`PriorityGate.drain`: after everything waiting


class PriorityGate:
    """Lets one holder in at a time, the waiting caller of lowest priority first
    (first come first served among equals). For one event loop."""

    def __init__(self) -> None:
        self._held = False
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    async def acquire(self, priority: int) -> None:
        """Wait for this caller's turn."""
        if not self._held and not self._waiting:
            self._held = True
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (priority, next(self._order), turn))
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.release()  # granted, then cancelled before it ran: pass the turn on
            raise

    def release(self) -> None:
        """Hand the gate to the next waiter (skipping cancelled ones), or open it."""
        while self._waiting:
            _, _, turn = heapq.heappop(self._waiting)
            if not turn.done():
                turn.set_result(None)
                return
        self._held = False

    async def drain(self) -> None:
        """Return once every caller waiting now (and any of higher priority that
        arrives meanwhile) has had its turn."""
        await self.acquire(_LAST)
        self.release()


class Device(Protocol):
    """Runs a stage server's compute, one call at a time."""

    def now(self) -> float:
        """Seconds on the clock the device's floors and deadlines use."""
        ...

    async def run(
        self, compute: Callable[[], R], finish: Callable[[R], T], *, priority: int = FORWARD
    ) -> tuple[T, float]:
        """``finish(compute())`` after at least the floor; with the call's device seconds.
        Waiting calls run in ``priority`` order (:data:`BACKWARD` first)."""
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
        self._gate = PriorityGate()

    def now(self) -> float:
        """``time.monotonic()``."""
        return time.monotonic()

    async def run(
        self, compute: Callable[[], R], finish: Callable[[R], T], *, priority: int = FORWARD
    ) -> tuple[T, float]:
        """Run both parts in the worker thread, the floor between them, in turn."""
        await self._gate.acquire(priority)
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._pool, self._job, compute, finish
            )
        finally:
            self._gate.release()

    def _job(self, compute: Callable[[], R], finish: Callable[[R], T]) -> tuple[T, float]:
        started = time.perf_counter()
        result = compute()
        rest = self.min_compute_s - (time.perf_counter() - started)
        if rest > 0:
            time.sleep(rest)
        elapsed = time.perf_counter() - started
        return finish(result), elapsed

    async def idle(self) -> None:
        """Wait for the calls waiting now and the worker's queue to drain."""
        await self._gate.drain()
        await asyncio.get_running_loop().run_in_executor(self._pool, lambda: None)

    def shutdown(self) -> None:
        """Stop the worker thread (after its running job)."""
        self._pool.shutdown(wait=True)
