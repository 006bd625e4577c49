"""Event-loop selection: uvloop when installed, asyncio's loop otherwise."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["has_uvloop", "loop_factory", "run"]

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
