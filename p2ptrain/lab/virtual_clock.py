"""An asyncio event loop on a virtual clock, for simulations of many peers.

Theory of operation
-------------------
:class:`VirtualClockLoop` is a stock :class:`asyncio.SelectorEventLoop`
whose :meth:`~VirtualClockLoop.time` returns a number the loop controls.
asyncio asks its selector to wait until the next timer is due; the
:class:`_VirtualSelector` instead polls the real file descriptors without
blocking and, when none is ready, moves the clock forward by exactly that
wait. So ``asyncio.sleep``, ``asyncio.timeout``, ``loop.call_at`` and every
deadline in the code under simulation behave as on a real clock, but idle
time costs no wall time: a simulated ten-minute run takes as long as its CPU
work. CPU work itself takes no virtual time (computation is not modelled).

Only the loop's clock is virtual. Code that reads ``time.monotonic()`` or
``time.time()`` directly sees real time; production code takes its time from
``loop.time()`` or an injected clock so that it runs unchanged here.

When nothing is ready and no timer is scheduled, the selector blocks on the
real file descriptors (a thread finishing work wakes the loop through its
self-pipe), as a real loop would. While a job handed to an executor
(``run_in_executor``, ``asyncio.to_thread``) runs, the clock stands still
too: the selector blocks until the thread's result wakes the loop, so work
in threads takes no virtual time either (otherwise the clock would race
from timer to timer while the thread computes). A thread must therefore not
wait for this loop to advance its clock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import selectors
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeAlias, TypeVar, TypeVarTuple

__all__ = ["VirtualClockLoop", "run_virtual"]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")
FileDescriptorLike: TypeAlias = Any  # int or an object with fileno()


class _VirtualSelector(selectors.BaseSelector):
    """A real selector that, when idle, advances the loop's virtual clock instead of waiting."""

    def __init__(self, loop: VirtualClockLoop) -> None:
        self._real = selectors.DefaultSelector()
        self._loop = loop

    def register(
        self, fileobj: FileDescriptorLike, events: int, data: Any = None
    ) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: FileDescriptorLike) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(
        self, fileobj: FileDescriptorLike, events: int, data: Any = None
    ) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = self._real.select(0)
        if ready:
            return ready
        if timeout is None or (timeout > 0 and self._loop.threads_busy):
            return self._real.select(None)
        if timeout > 0:
            self._loop.advance(timeout)
        return []

    def close(self) -> None:
        self._real.close()

    def get_map(self) -> Mapping[FileDescriptorLike, selectors.SelectorKey]:
        return self._real.get_map()


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose clock jumps to the next timer when idle.

    Args:
        start: The clock's value at creation (seconds).
    """

    exact_time = True
    """Durations are timed on this clock (:func:`p2ptrain.aio.duration_clock`)."""

    def __init__(self, start: float = 0.0) -> None:
        self._virtual_now = float(start)
        self._threads_busy = 0
        super().__init__(selector=_VirtualSelector(self))
        self._clock_resolution = 1e-9

    @property
    def threads_busy(self) -> int:
        """Executor jobs started and not yet collected by the loop."""
        return self._threads_busy

    def run_in_executor(
        self,
        executor: concurrent.futures.Executor | None,
        func: Callable[[*Ts], T],
        *args: *Ts,
    ) -> asyncio.Future[T]:
        """As the base loop's; the clock stands still until the job's result is back."""
        future = super().run_in_executor(executor, func, *args)
        self._threads_busy += 1
        future.add_done_callback(self._thread_done)
        return future

    def _thread_done(self, _: object) -> None:
        self._threads_busy -= 1

    def time(self) -> float:
        """The virtual time in seconds."""
        return self._virtual_now

    def advance(self, seconds: float) -> None:
        """Move the clock forward (never back)."""
        if seconds > 0:
            self._virtual_now += seconds


def run_virtual(main: Coroutine[Any, Any, T], *, debug: bool | None = None) -> T:
    """Run ``main`` to completion on a fresh :class:`VirtualClockLoop`."""
    with asyncio.Runner(loop_factory=VirtualClockLoop, debug=debug) as runner:
        return runner.run(main)
