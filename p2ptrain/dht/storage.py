"""Record storage with expiration, as pure logic (time passed in as ``now``).

Theory of operation
-------------------
:class:`RecordStore` holds, per key, either one plain :class:`Record` or a
dictionary of sub-key records: a key has one *kind* at a time. The newest
expiration wins within a kind, with a rule chosen so that every replica
converges to the same content whatever order the records arrive in
(capacity limits aside):

* A plain record replaces the plain record of its key if it is newer; a
  dictionary entry replaces the entry of its sub-key if it is newer.
* "Newer" compares ``expiration`` first; equal expirations are broken by
  comparing ``(value, owner, signature)`` bytes, so ties resolve the same way
  everywhere. An identical record is not stored twice.

A record of the other kind than the key's live records does not change the
kind, unless it *outranks* all of them. The rank of a record is 0 when it is
unsigned, 1 when it is signed, 2 when it is signed by the owner its key or
sub-key is bound to (:func:`~p2ptrain.dht.records.key_owner`). A record that
outranks every live record of the other kind displaces them; otherwise it is
refused (:class:`~p2ptrain.errors.RecordRejectedError`). So an unsigned plain
record can never evict or block a dictionary of signed entries (the
"dictionary wipe"), a shared dictionary of owner-bound entries cannot be
squatted by any plain record of a key that is not itself owner-bound, and
between records of equal rank the first kind stays until its records expire.
Expired records are never returned and never count as a key's kind;
:meth:`RecordStore.evict_expired` frees them (in ``O(log n)`` each, from a
heap of expirations).

Every record is checked by :func:`~p2ptrain.dht.records.validate_record`
before anything else (sizes, expiration window, ownership, signature).
Capacity limits are enforced after expired entries are evicted:
``DHTConfig.max_subkeys`` per dictionary (a full dictionary takes a new
entry of higher rank by dropping its lowest-ranked entry that expires
first, so unsigned entries never block signed ones),
``max_subkeys_per_owner`` sub-keys signed by one owner per dictionary,
``max_records`` entries in all,
``max_store_bytes`` bytes in all and ``max_bytes_per_source`` bytes for the
records one source sent (the node names the source: the sender's host).
Every refusal raises :class:`~p2ptrain.errors.RecordRejectedError`.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Sequence

from p2ptrain.dht.config import DHTConfig
from p2ptrain.dht.records import (
    DictionaryRecord,
    Record,
    StoredValue,
    key_owner,
    validate_record,
)
from p2ptrain.errors import RecordRejectedError

__all__ = [
    "RECORD_OVERHEAD_BYTES",
    "RecordStore",
    "agreed_value",
    "merge_values",
    "rank",
    "record_bytes",
]

RECORD_OVERHEAD_BYTES = 160
"""What one stored record costs beyond its key, sub-key and value (signature,
owner, bookkeeping), for the byte caps."""


def _newer(candidate: Record, current: Record) -> bool:
    return (
        candidate.expiration,
        candidate.value,
        candidate.owner or b"",
        candidate.signature or b"",
    ) > (current.expiration, current.value, current.owner or b"", current.signature or b"")


def rank(record: Record) -> int:
    """0 unsigned, 1 signed, 2 signed by the owner its key or sub-key is bound to.

    The record must have been validated (a bound key's record is signed by its owner).
    """
    if record.owner is None:
        return 0
    if key_owner(record.key) is not None:
        return 2
    if record.subkey is not None and key_owner(record.subkey) is not None:
        return 2
    return 1


def record_bytes(record: Record) -> int:
    """What ``record`` counts against the byte caps."""
    return len(record.key) + len(record.subkey or b"") + len(record.value) + RECORD_OVERHEAD_BYTES


class _Slot:
    """What one key holds: a plain record or dictionary entries (never both live)."""

    __slots__ = ("entries", "plain")

    def __init__(self) -> None:
        self.plain: Record | None = None
        self.entries: dict[bytes, Record] = {}

    def accepts(self, record: Record) -> bool:
        """Whether ``record`` is newer than what it would replace in its own kind."""
        if record.subkey is None:
            return self.plain is None or _newer(record, self.plain)
        current = self.entries.get(record.subkey)
        return current is None or _newer(record, current)

    def conflict(self, record: Record, now: float) -> str | None:
        """Why ``record`` may not change the key's kind, or None if it may be stored."""
        if record.subkey is None:
            others = [r for r in self.entries.values() if r.expiration > now]
            kind = "a dictionary"
        else:
            others = [self.plain] if self.plain is not None and self.plain.expiration > now else []
            kind = "a plain value"
        if not others:
            return None
        strongest = max(rank(r) for r in others)
        if rank(record) > strongest:
            return None
        return (
            f"the key holds {kind}; a record of the other kind must outrank it"
            f" (rank {rank(record)} <= {strongest})"
        )

    def put(self, record: Record) -> list[Record]:
        """Store an accepted, non-conflicting record; returns the records it displaced."""
        if record.subkey is None:
            displaced = [] if self.plain is None else [self.plain]
            displaced += self.entries.values()
            self.entries = {}
            self.plain = record
            return displaced
        displaced = [] if self.plain is None else [self.plain]
        self.plain = None
        previous = self.entries.get(record.subkey)
        self.entries[record.subkey] = record
        if previous is not None:
            displaced.append(previous)
        return displaced

    def replaced(self, record: Record) -> Record | None:
        """The record of the same key and sub-key that storing ``record`` would replace."""
        if record.subkey is None:
            return self.plain
        return self.entries.get(record.subkey)

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


def _weakest_below(slot: _Slot, ceiling: int) -> Record | None:
    """The entry of lowest rank (below ``ceiling``) that expires first, if any."""
    candidates = [r for r in slot.entries.values() if rank(r) < ceiling]
    return min(candidates, key=lambda r: (rank(r), r.expiration), default=None)


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
        self._bytes = 0
        self._by_source: dict[str, int] = {}
        self._source_of: dict[int, str] = {}  # id(record) -> source, for stored records

    @property
    def stored_bytes(self) -> int:
        """Bytes held, as counted against ``max_store_bytes``."""
        return self._bytes

    def source_bytes(self, source: str) -> int:
        """Bytes held for records ``source`` sent."""
        return self._by_source.get(source, 0)

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
        source: str | None = None,
    ) -> bool:
        """Validate and store one record (see :meth:`store_record`)."""
        record = Record(key, value, expiration, subkey, owner, signature)
        return self.store_record(record, now, source=source)

    def store_record(self, record: Record, now: float, *, source: str | None = None) -> bool:
        """Validate and store ``record``.

        Args:
            record: The record.
            now: The current time.
            source: Who sent it (a host), for ``max_bytes_per_source``;
                None for the node's own records.

        Returns:
            ``True`` if it is now stored, ``False`` if a newer (or the same)
            record was kept instead.

        Raises:
            RecordRejectedError: The record breaks a limit or ownership rule,
                would change its key's kind without outranking it, its
                dictionary already holds ``max_subkeys`` live entries, or the
                store (or its source's share) is full.
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
        if slot is not None:
            if not slot.accepts(record):
                return False
            reason = slot.conflict(record, now)
            if reason is not None:
                raise RecordRejectedError(reason)
        self._check_capacity(record, now, source)
        slot = self._slots.get(record.key)  # eviction may have emptied it
        if slot is None:
            slot = self._slots[record.key] = _Slot()
        displaced = slot.put(record)
        for old in displaced:
            self._uncharge(old)
        self._charge(record, source)
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
                self._uncharge(record)
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

    def _check_capacity(self, record: Record, now: float, source: str | None) -> None:
        config = self._config
        slot = self._slots.get(record.key)
        replaced = None if slot is None else slot.replaced(record)
        weakest: Record | None = None  # an entry the new one displaces from a full dictionary
        if replaced is None:
            limit = config.max_subkeys
            if record.subkey is not None and slot is not None:
                if record.owner is not None:
                    self._check_owner_share(slot, record, now)
                if len(slot.entries) >= limit:
                    self.evict_expired(now)
                if len(slot.entries) >= limit:
                    weakest = _weakest_below(slot, rank(record))
                    if weakest is None:
                        raise RecordRejectedError(f"the dictionary already holds {limit} sub-keys")
            if self._count >= config.max_records:
                self.evict_expired(now)
                if self._count >= config.max_records:
                    raise RecordRejectedError(f"the store is full ({config.max_records} records)")
        size = record_bytes(record)
        freed = 0 if replaced is None else record_bytes(replaced)
        if self._bytes + size - freed > config.max_store_bytes:
            self.evict_expired(now)
            if self._bytes + size - freed > config.max_store_bytes:
                raise RecordRejectedError(f"the store is full ({config.max_store_bytes} bytes)")
        if source is not None:
            if replaced is None or self._source_of.get(id(replaced)) != source:
                freed = 0
            if self.source_bytes(source) + size - freed > config.max_bytes_per_source:
                self.evict_expired(now)
                if self.source_bytes(source) + size - freed > config.max_bytes_per_source:
                    raise RecordRejectedError(
                        f"the records of {source} already take"
                        f" {self.source_bytes(source)} bytes here"
                        f" (limit {config.max_bytes_per_source})"
                    )
        if weakest is not None and slot is not None and slot.remove(weakest):
            self._uncharge(weakest)
            self._count -= 1

    def _check_owner_share(self, slot: _Slot, record: Record, now: float) -> None:
        """Refuse a new sub-key of an owner who signed ``max_subkeys_per_owner`` already."""
        limit = self._config.max_subkeys_per_owner
        mine = sum(
            1 for r in slot.entries.values() if r.owner == record.owner and r.expiration > now
        )
        if mine >= limit:
            raise RecordRejectedError(
                f"{mine} sub-keys of this dictionary are signed by the same owner (limit {limit})"
            )

    def _charge(self, record: Record, source: str | None) -> None:
        size = record_bytes(record)
        self._bytes += size
        if source is not None:
            self._source_of[id(record)] = source
            self._by_source[source] = self._by_source.get(source, 0) + size

    def _uncharge(self, record: Record) -> None:
        size = record_bytes(record)
        self._bytes -= size
        source = self._source_of.pop(id(record), None)
        if source is not None:
            left = self._by_source[source] - size
            if left > 0:
                self._by_source[source] = left
            else:
                del self._by_source[source]

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
            if slot.accepts(record) and slot.conflict(record, now) is None:
                slot.put(record)
    if key is None:
        return None
    return slot.visible(key, now)


def agreed_value(values: Sequence[StoredValue], *, now: float) -> StoredValue | None:
    """Combine the values of one key returned by different nodes, trusting signatures only.

    Signed records (plain or dictionary entries) are merged as the store
    would (:func:`merge_values`: the newest valid signature wins). An
    unsigned record is kept only if more than half of ``values`` carry that
    very record: one returned by a minority of the replies is dropped, so a
    lone node cannot forge or roll back an unsigned value. The values must
    have been validated (:func:`~p2ptrain.dht.records.validate_for_read`).

    Raises:
        RecordRejectedError: The values belong to different keys.
    """
    votes: dict[Record, int] = {}
    signed: list[Record] = []
    for value in values:
        for record in (value,) if isinstance(value, Record) else value.entries.values():
            if record.owner is not None:
                signed.append(record)
            else:
                votes[record] = votes.get(record, 0) + 1
    agreed = [record for record, count in votes.items() if 2 * count > len(values)]
    return merge_values([*signed, *agreed], now=now)
