"""Event loops: uvloop when installed, and a loop in a background thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread", "has_uvloop", "loop_factory", "run"]

T = TypeVar("T")


def has_uvloop() -> bool:
    """Whether uvloop can be imported."""
    try:
        import uvloop  # noqa: F401, PLC0415 - optional dependency
    except ImportError:
        return False
    return True


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
    """

    def __init__(self, *, use_uvloop: bool | None = None, name: str = "p2ptrain-loop") -> None:
        self._factory = loop_factory(use_uvloop)
        self._name = name
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
