"""A clock that moves only when a test says so, for code that takes ``clock=``.

Pure logic in p2ptrain takes time as an argument or a ``Callable[[], float]``
(the DHT's record store, the progress tracker); a test passes a
:class:`ManualClock` and :meth:`~ManualClock.advance`-s it instead of
sleeping. For whole asyncio programs on a virtual clock see
:mod:`p2ptrain.lab.virtual_clock`.
"""

from __future__ import annotations

__all__ = ["ManualClock"]


class ManualClock:
    """Unix time that only moves when a test says so.

    Args:
        now: The time it starts at (seconds).
    """

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock forward by ``seconds``."""
        self.now += seconds
