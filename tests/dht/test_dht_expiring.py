"""The DHT node's bounded map of entries that expire."""

from __future__ import annotations

from p2ptrain.dht.expiring import ExpiringMap


def test_an_entry_is_kept_until_its_time_then_dropped() -> None:
    kept: ExpiringMap[str, int] = ExpiringMap(4)
    kept.put("a", 1, until=10.0)
    assert kept.get("a", now=9.9) == 1
    assert kept.get("a", now=10.0) is None
    assert len(kept) == 0  # the expired entry is gone, not only hidden
    assert kept.get("never", now=0.0) is None


def test_when_full_the_entry_set_longest_ago_goes_first() -> None:
    kept: ExpiringMap[str, int] = ExpiringMap(2)
    kept.put("a", 1, until=100.0)
    kept.put("b", 2, until=100.0)
    kept.put("a", 3, until=100.0)  # setting again moves it to the end
    kept.put("c", 4, until=100.0)
    assert (kept.get("a", 0.0), kept.get("b", 0.0), kept.get("c", 0.0)) == (3, None, 4)
    kept.pop("a")
    kept.pop("missing")
    assert len(kept) == 1
