"""A bounded map whose entries expire (pure, no clock of its own).

The DHT node remembers several things for a while: replicas that held a key,
the entries a read merged, addresses that stalled a lookup, callers that
answered at their address. Each is kept until a time given when it is set,
and the map holds at most ``max_entries``: setting a key moves it to the
end, and the entries set longest ago go first when it is full.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

__all__ = ["ExpiringMap"]

K = TypeVar("K")
V = TypeVar("V")


class ExpiringMap(Generic[K, V]):
    """Keys to values, each until its own time; at most ``max_entries`` of them."""

    def __init__(self, max_entries: int) -> None:
        self._entries: OrderedDict[K, tuple[float, V]] = OrderedDict()
        self._max_entries = max_entries

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: K, value: V, until: float) -> None:
        """Keep ``value`` under ``key`` until ``until`` (replacing what was there)."""
        self._entries.pop(key, None)
        self._entries[key] = (until, value)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)

    def get(self, key: K, now: float) -> V | None:
        """The value under ``key`` if it is still kept at ``now`` (an expired one is dropped)."""
        kept = self._entries.get(key)
        if kept is None:
            return None
        until, value = kept
        if until <= now:
            del self._entries[key]
            return None
        return value

    def pop(self, key: K) -> None:
        """Forget ``key``."""
        self._entries.pop(key, None)
