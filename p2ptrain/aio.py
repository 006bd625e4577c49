"""Event loops (uvloop when installed, a loop in a background thread) and the
one owner of background tasks every component uses."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

__all__ = [
    "BackgroundTasks",
    "LoopThread",
    "duration_clock",
    "has_uvloop",
    "loop_factory",
    "run",
]

T = TypeVar("T")

logger = logging.getLogger(__name__)


def has_uvloop() -> bool:
    """Whether uvloop can be imported."""
    try:
        import uvloop  # noqa: F401, PLC0415 - optional dependency
    except ImportError:
        return False
    return True


def duration_clock(loop: asyncio.AbstractEventLoop) -> Callable[[], float]:
    """The clock to time durations with on ``loop``.

    ``time.perf_counter`` on a real loop (uvloop's ``loop.time()`` has
    millisecond resolution, which made fast transfers last 0 s); the loop's
    own clock where it says it is exact (``exact_time``: the simulator's
    virtual clock, where wall time means nothing).
    """
    return loop.time if getattr(loop, "exact_time", False) else time.perf_counter


def loop_factory(use_uvloop: bool | None = None) -> Callable[[], asyncio.AbstractEventLoop]:
    """A factory for new event loops: uvloop's if wanted (default: when installed)."""
    if use_uvloop is None:
        use_uvloop = has_uvloop()
    if use_uvloop:
        import uvloop  # noqa: PLC0415 - optional dependency

        return uvloop.new_event_loop
    return asyncio.new_event_loop


def run(main: Coroutine[Any, Any, T], *, use_uvloop: bool | None = None) -> T:
    """Run ``main`` to completion on a fresh loop (uvloop when installed)."""
    with asyncio.Runner(loop_factory=loop_factory(use_uvloop)) as runner:
        return runner.run(main)


class LoopThread:
    """An event loop running in a background thread.

    The training loop is ordinary synchronous code; it calls into the
    networking, which lives on this loop, through :meth:`run` (blocking) or
    :meth:`submit` (a concurrent future).

    Args:
        use_uvloop: use uvloop (default: when installed).
        name: the thread's name.
        initializer: called first in the new thread (e.g. to give it the creating
            thread's ``torch.set_num_threads``, which is per thread).
    """

    def __init__(
        self,
        *,
        use_uvloop: bool | None = None,
        name: str = "p2ptrain-loop",
        initializer: Callable[[], object] | None = None,
    ) -> None:
        self._factory = loop_factory(use_uvloop)
        self._name = name
        self._initializer = initializer
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop (after :meth:`start`)."""
        if self._loop is None:
            raise RuntimeError("the loop thread is not started")
        return self._loop

    def start(self) -> None:
        """Start the thread and wait until its loop runs."""
        if self._thread is not None:
            raise RuntimeError("the loop thread is already started")
        self._thread = threading.Thread(target=self._main, name=self._name, daemon=True)
        self._thread.start()
        self._started.wait()

    def _main(self) -> None:
        if self._initializer is not None:
            self._initializer()
        loop = self._factory()
        asyncio.set_event_loop(loop)
        self._loop = loop
        loop.call_soon(self._started.set)
        try:
            loop.run_forever()
        finally:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; returns a thread-safe future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (from another thread).

        On ``timeout`` the coroutine is cancelled and TimeoutError raised.
        """
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("LoopThread.run() called from the loop's own thread")
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"operation did not finish within {timeout} s") from None

    def stop(self) -> None:
        """Cancel what still runs on the loop, stop it and join the thread."""
        thread, loop = self._thread, self._loop
        if thread is None or loop is None:
            return
        if not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)
        thread.join()
        self._thread = None

    def __enter__(self) -> LoopThread:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class BackgroundTasks:
    """The background tasks of one component (a node's accepts, a connection's handlers, ...).

    Nothing is fire-and-forget: each task is tracked until it ends, its
    failure is logged (:meth:`spawn`) or left to the callers that await it
    (:meth:`share`), and :meth:`aclose` (or :meth:`cancel` from a callback)
    cancels what still runs.

    Args:
        owner: A name for log messages.
    """

    __slots__ = ("_closed", "_owner", "_tasks")

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(list(self._tasks))

    @property
    def owner(self) -> str:
        """The name in log messages."""
        return self._owner

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called (no task may start any more)."""
        return self._closed

    def spawn(self, coro: Coroutine[Any, Any, None], *, name: str) -> asyncio.Task[None]:
        """Run ``coro`` in the background until it ends or :meth:`aclose` cancels it.

        Nobody awaits the result: an exception escaping ``coro`` is logged
        (this is the root of the task).

        Raises:
            RuntimeError: The owner is closed.
        """
        return self._start(coro, name, self._spawned_done)

    def share(self, coro: Coroutine[Any, Any, T], *, name: str) -> asyncio.Task[T]:
        """Run ``coro`` as a task whose outcome its callers await (one dial shared by many).

        Its exception is the callers' to handle; if every caller gave up, it
        is retrieved here, so it is never reported as "never retrieved".

        Raises:
            RuntimeError: The owner is closed.
        """
        return self._start(coro, name, self._shared_done)

    def cancel(self) -> None:
        """Cancel every task without waiting (e.g. from a connection-lost callback).

        The task calling this, if it is one of ours, is left to finish (it is
        ending what it owns).
        """
        current = asyncio.current_task()
        for task in list(self._tasks):
            if task is not current:
                task.cancel()

    async def aclose(self) -> None:
        """Cancel every task and wait until all have finished.

        A task that closes its own owner is neither cancelled nor awaited (it
        is the one running this).
        """
        self._closed = True
        current = asyncio.current_task()
        while tasks := [t for t in self._tasks if t is not current]:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _start(
        self,
        coro: Coroutine[Any, Any, T],
        name: str,
        done: Callable[[asyncio.Task[Any]], None],
    ) -> asyncio.Task[T]:
        if self._closed:
            coro.close()
            raise RuntimeError(f"{self._owner}: cannot start {name!r} after closing")
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(done)
        return task

    def _spawned_done(self, task: asyncio.Task[Any]) -> None:
        """The root of a spawned task: its exception is logged (and so retrieved)."""
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            logger.error(
                "%s: background task %r failed", self._owner, task.get_name(), exc_info=exc
            )

    def _shared_done(self, task: asyncio.Task[Any]) -> None:
        """A shared task's exception is its callers'; retrieved here in case none awaited."""
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()
