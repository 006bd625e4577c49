"""An owner for background tasks: each one is tracked, logged if it fails, and
cancelled and awaited when the owner closes. Nothing is fire-and-forget."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

__all__ = ["BackgroundTasks"]

logger = logging.getLogger(__name__)


class BackgroundTasks:
    """The background tasks of one component (a DHT node's pings, timers, ...).

    Args:
        owner: A name for log messages.
    """

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, None], *, name: str) -> asyncio.Task[None]:
        """Run ``coro`` in the background until it ends or :meth:`aclose` cancels it.

        An exception escaping ``coro`` is logged (this is the root of the task).

        Raises:
            RuntimeError: The owner is closed.
        """
        if self._closed:
            coro.close()
            raise RuntimeError(f"{self._owner}: cannot start {name!r} after closing")
        task = asyncio.get_running_loop().create_task(self._guard(coro, name), name=name)
        self._tasks.add(task)

        def finished(task: asyncio.Task[None]) -> None:
            self._tasks.discard(task)
            coro.close()  # never started if cancelled at once; a no-op otherwise

        task.add_done_callback(finished)
        return task

    async def aclose(self) -> None:
        """Cancel every task and wait until all have finished."""
        self._closed = True
        while self._tasks:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _guard(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        try:
            await coro
        except Exception:
            logger.exception("%s: background task %r failed", self._owner, name)
