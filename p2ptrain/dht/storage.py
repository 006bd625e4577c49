"""Record storage with expiration, as pure logic (time passed in as ``now``).

Theory of operation
-------------------
:class:`RecordStore` holds, per key, at most one plain :class:`Record` and a
dictionary of sub-key records. The newest expiration wins, with a rule chosen
so that every replica converges to the same content whatever order the
records arrive in (capacity limits aside):

* A plain record replaces the plain record of its key if it is newer, and
  then drops every dictionary entry that does not expire strictly later.
* A dictionary entry replaces the entry of its sub-key if it is newer, and is
  only accepted if it expires strictly later than the key's plain record.
* "Newer" compares ``expiration`` first; equal expirations are broken by
  comparing ``(value, owner, signature)`` bytes, so ties resolve the same way
  everywhere. An identical record is not stored twice.

So a key shows its dictionary while any entry is live (a plain record that
lost to newer entries can never become visible again; it is kept only as the
floor that older entries must beat), else its plain record, else nothing.
Expired records are never returned; :meth:`RecordStore.evict_expired` frees
them (in ``O(log n)`` each, from a heap of expirations).

Every record is checked by :func:`~p2ptrain.dht.records.validate_record`
before anything else (sizes, expiration window, ownership, signature).
Capacity limits, ``DHTConfig.max_subkeys`` per dictionary and
``DHTConfig.max_records`` entries in all, are enforced after expired entries
are evicted. Every refusal raises :class:`~p2ptrain.errors.RecordRejectedError`.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator

from p2ptrain.dht.config import DHTConfig
from p2ptrain.dht.records import DictionaryRecord, Record, StoredValue, validate_record
from p2ptrain.errors import RecordRejectedError

__all__ = ["RecordStore", "merge_values"]


def _newer(candidate: Record, current: Record) -> bool:
    return (
        candidate.expiration,
        candidate.value,
        candidate.owner or b"",
        candidate.signature or b"",
    ) > (current.expiration, current.value, current.owner or b"", current.signature or b"")


class _Slot:
    """What one key holds: an optional plain record and the dictionary entries."""

    __slots__ = ("entries", "plain")

    def __init__(self) -> None:
        self.plain: Record | None = None
        self.entries: dict[bytes, Record] = {}

    def accepts(self, record: Record) -> bool:
        if record.subkey is None:
            return self.plain is None or _newer(record, self.plain)
        if self.plain is not None and record.expiration <= self.plain.expiration:
            return False
        current = self.entries.get(record.subkey)
        return current is None or _newer(record, current)

    def put(self, record: Record) -> list[Record]:
        """Store an accepted record; returns the records it displaced."""
        if record.subkey is None:
            displaced = [] if self.plain is None else [self.plain]
            self.plain = record
            for subkey, entry in list(self.entries.items()):
                if entry.expiration <= record.expiration:
                    del self.entries[subkey]
                    displaced.append(entry)
            return displaced
        previous = self.entries.get(record.subkey)
        self.entries[record.subkey] = record
        return [] if previous is None else [previous]

    def holds_place_of(self, record: Record) -> bool:
        """Whether storing ``record`` would replace an entry instead of adding one."""
        if record.subkey is None:
            return self.plain is not None
        return record.subkey in self.entries

    def remove(self, record: Record) -> bool:
        """Remove exactly this record object if the slot still holds it."""
        if record.subkey is None:
            if self.plain is record:
                self.plain = None
                return True
            return False
        if self.entries.get(record.subkey) is record:
            del self.entries[record.subkey]
            return True
        return False

    def visible(self, key: bytes, now: float) -> StoredValue | None:
        live = {s: r for s, r in self.entries.items() if r.expiration > now}
        if live:
            return DictionaryRecord(key, live)
        if self.plain is not None and self.plain.expiration > now:
            return self.plain
        return None

    def __len__(self) -> int:
        return len(self.entries) + (self.plain is not None)


class RecordStore:
    """The records one node holds for the DHT. See the module docstring.

    Args:
        config: Size, expiration and capacity limits.
    """

    def __init__(self, *, config: DHTConfig) -> None:
        self._config = config
        self._slots: dict[bytes, _Slot] = {}
        self._count = 0
        self._expiry: list[tuple[float, int, Record]] = []
        self._sequence = 0

    def __len__(self) -> int:
        """Entries held (plain records plus dictionary entries), expired or not."""
        return self._count

    def store(
        self,
        key: bytes,
        value: bytes,
        expiration: float,
        now: float,
        *,
        subkey: bytes | None = None,
        owner: bytes | None = None,
        signature: bytes | None = None,
    ) -> bool:
        """Validate and store one record (see :meth:`store_record`)."""
        return self.store_record(Record(key, value, expiration, subkey, owner, signature), now)

    def store_record(self, record: Record, now: float) -> bool:
        """Validate and store ``record``.

        Returns:
            ``True`` if it is now stored, ``False`` if a newer (or the same)
            record was kept instead.

        Raises:
            RecordRejectedError: The record breaks a limit or ownership rule,
                its dictionary already holds ``max_subkeys`` live entries, or
                the store holds ``max_records`` live entries.
        """
        validate_record(record, config=self._config, now=now)
        if not isinstance(record.expiration, float):
            record = Record(
                record.key,
                record.value,
                float(record.expiration),
                record.subkey,
                record.owner,
                record.signature,
            )
        slot = self._slots.get(record.key)
        if slot is not None and not slot.accepts(record):
            return False
        if slot is None or not slot.holds_place_of(record):
            self._check_capacity(record, now)
            slot = self._slots.get(record.key)  # eviction may have emptied it
        if slot is None:
            slot = self._slots[record.key] = _Slot()
        displaced = slot.put(record)
        self._count += 1 - len(displaced)
        heapq.heappush(self._expiry, (record.expiration, self._sequence, record))
        self._sequence += 1
        if len(self._expiry) > 2 * self._count + 64:
            self._rebuild_heap()
        return True

    def get(self, key: bytes, now: float) -> StoredValue | None:
        """The live value under ``key``: a plain record, a dictionary, or ``None``."""
        slot = self._slots.get(key)
        return None if slot is None else slot.visible(key, now)

    def evict_expired(self, now: float) -> int:
        """Free every record that expired at or before ``now``.

        Returns:
            How many entries were removed.
        """
        removed = 0
        while self._expiry and self._expiry[0][0] <= now:
            _, _, record = heapq.heappop(self._expiry)
            slot = self._slots.get(record.key)
            if slot is not None and slot.remove(record):
                removed += 1
                if not len(slot):
                    del self._slots[record.key]
        self._count -= removed
        return removed

    def records(self, now: float) -> Iterator[Record]:
        """Every live record, for republishing (plain records and dictionary entries)."""
        for slot in list(self._slots.values()):
            if slot.plain is not None and slot.plain.expiration > now:
                yield slot.plain
            for record in list(slot.entries.values()):
                if record.expiration > now:
                    yield record

    def __iter__(self) -> Iterator[bytes]:
        """The keys holding at least one entry (possibly expired, not yet evicted)."""
        return iter(list(self._slots))

    # internals

    def _check_capacity(self, record: Record, now: float) -> None:
        slot = self._slots.get(record.key)
        limit = self._config.max_subkeys
        if record.subkey is not None and slot is not None and len(slot.entries) >= limit:
            self.evict_expired(now)
            if len(slot.entries) >= limit:
                raise RecordRejectedError(f"the dictionary already holds {limit} sub-keys")
        if self._count >= self._config.max_records:
            self.evict_expired(now)
            if self._count >= self._config.max_records:
                raise RecordRejectedError(f"the store is full ({self._config.max_records} records)")

    def _rebuild_heap(self) -> None:
        self._expiry = []
        for slot in self._slots.values():
            held = list(slot.entries.values())
            if slot.plain is not None:
                held.append(slot.plain)
            for record in held:
                self._expiry.append((record.expiration, self._sequence, record))
                self._sequence += 1
        heapq.heapify(self._expiry)


def merge_values(values: Iterable[StoredValue], *, now: float) -> StoredValue | None:
    """Combine values of one key returned by several nodes, by the store's rules.

    The values must have been checked with
    :func:`~p2ptrain.dht.records.validate_for_read` first. The result is what a
    store that received every record would show at ``now`` (there is no
    sub-key limit here).

    Raises:
        RecordRejectedError: The values belong to different keys.
    """
    slot = _Slot()
    key: bytes | None = None
    for value in values:
        for record in (value,) if isinstance(value, Record) else value.entries.values():
            if key is None:
                key = record.key
            elif record.key != key:
                raise RecordRejectedError("cannot merge values of different keys")
            if slot.accepts(record):
                slot.put(record)
    if key is None:
        return None
    return slot.visible(key, now)
