"""The Kademlia routing table, as pure logic: no I/O, time passed in as ``now``.

Theory of operation
-------------------
Every peer and every key has a position in a 256-bit id space
(:class:`NodeID`: a PeerID's SHA-256 digest read as a big-endian integer, or
the SHA-256 of a record key). The distance between two positions is their XOR,
read as an integer.

:class:`RoutingTable` covers the whole id space with *k-buckets*: disjoint,
power-of-two aligned ranges ``[lo, hi)``, each holding at most *k* contacts
ordered from least to most recently seen. The table starts with one bucket.
When a contact arrives for a full bucket, the bucket is split in two halves if
it holds our own id, or (``DHTConfig.relaxed_split``, the relaxation of the
Kademlia paper's section 4.2) if the newcomer would be among the *k* contacts
closest to our own id. So the table is fine-grained near us and coarse far
away, and we know our whole neighbourhood.

When a full bucket cannot be split, Kademlia prefers old contacts (long-lived
peers tend to stay): :meth:`RoutingTable.add_or_update` keeps the newcomer in
the bucket's *replacement cache* and returns :attr:`AddStatus.PING_NEEDED`
naming the least-recently-seen contact. The node pings it and reports with
:meth:`RoutingTable.on_ping_result`: alive, it moves to the tail; dead, it is
evicted and the most recently seen replacement takes its place. One ping per
bucket is outstanding at a time; it is asked for again after
``DHTConfig.ping_timeout`` if no result came. Failed requests are counted with
:meth:`RoutingTable.mark_failed`; after ``DHTConfig.max_failures`` in a row the
contact is dropped and a replacement promoted.

Because buckets are aligned ranges, their XOR distances to any target form
disjoint intervals, so :meth:`RoutingTable.nearest` sorts the buckets by their
smallest distance and then only sorts the contacts of the few buckets it takes
from: ``O(B log B + count log k)`` for ``B`` buckets, exact, no full scan.

Peers that cannot accept connections (client mode) are never added: the caller
says so with ``client_mode=True`` and the table ignores the contact. Call
:meth:`RoutingTable.add_or_update` only for peers heard from directly over an
authenticated connection, never for contacts merely named in someone's reply.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import ipaddress
import random
from bisect import bisect_right
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from p2ptrain.dht.config import DHTConfig
from p2ptrain.errors import ConfigError
from p2ptrain.secure.identity import PeerID

__all__ = [
    "ID_BITS",
    "AddResult",
    "AddStatus",
    "BucketView",
    "Contact",
    "NodeID",
    "RoutingTable",
    "subnet_of",
]

ID_BITS = 256
"""Width of the id space in bits."""

_ID_SPACE = 1 << ID_BITS


class NodeID(int):
    """A position in the 256-bit id space; an ``int`` in ``[0, 2**256)``.

    It is an ``int`` subclass, so arithmetic and XOR stay fast; ``a ^ b`` is
    the Kademlia distance as a plain ``int``.
    """

    __slots__ = ()

    def __new__(cls, value: int) -> NodeID:
        """Wrap ``value``, which must be an int in ``[0, 2**256)``.

        Raises:
            ConfigError: ``value`` is not an int or out of range.
        """
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"a NodeID is an int, got {type(value).__name__}")
        if not 0 <= value < _ID_SPACE:
            raise ConfigError("a NodeID lies in [0, 2**256)")
        return super().__new__(cls, value)

    @classmethod
    def from_peer_id(cls, peer_id: PeerID) -> NodeID:
        """The position of a peer: its PeerID digest as a big-endian integer."""
        return cls(int.from_bytes(peer_id.digest, "big"))

    @classmethod
    def from_key(cls, key: bytes) -> NodeID:
        """The position of a record key: SHA-256 of the key bytes, big-endian."""
        return cls(int.from_bytes(hashlib.sha256(key).digest(), "big"))

    def to_bytes32(self) -> bytes:
        """The 32-byte big-endian encoding (the inverse of :meth:`from_bytes32`)."""
        return int(self).to_bytes(32, "big")

    @classmethod
    def from_bytes32(cls, data: bytes) -> NodeID:
        """Decode a 32-byte big-endian id.

        Raises:
            ConfigError: ``data`` is not exactly 32 bytes.
        """
        if not isinstance(data, bytes) or len(data) != 32:
            raise ConfigError("a NodeID is encoded in exactly 32 bytes")
        return cls(int.from_bytes(data, "big"))

    def distance(self, other: int) -> int:
        """The XOR distance to ``other``."""
        return int(self) ^ int(other)

    def bucket_index(self, other: int) -> int:
        """The classic Kademlia bucket index of ``other`` relative to this id.

        That is ``floor(log2(distance))``: 255 for ids differing in the top bit,
        0 for ids differing only in the last bit, -1 for the id itself.
        """
        return (int(self) ^ int(other)).bit_length() - 1

    def __repr__(self) -> str:
        return f"NodeID({int(self):064x})"


@dataclass(frozen=True, slots=True)
class Contact:
    """How to reach a peer: its PeerID and a transport address.

    Attributes:
        peer_id: The peer's identity; its :class:`NodeID` is derived from it.
        address: Transport address, opaque to the DHT (the node interprets it).
        last_seen: When we last heard from the peer (the caller's clock); not
            part of equality.
        node_id: The peer's position in the id space (derived).
    """

    peer_id: PeerID
    address: str
    last_seen: float = field(default=0.0, compare=False)
    node_id: NodeID = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "node_id", NodeID.from_peer_id(self.peer_id))


class AddStatus(enum.Enum):
    """What :meth:`RoutingTable.add_or_update` did with a contact."""

    ADDED = "added"
    """The contact is new and now in its bucket."""
    UPDATED = "updated"
    """The contact was known; it moved to the tail with a fresh ``last_seen``."""
    PING_NEEDED = "ping_needed"
    """The bucket is full: the newcomer waits in the replacement cache, and the
    caller must ping :attr:`AddResult.ping` and report with
    :meth:`RoutingTable.on_ping_result`."""
    CACHED = "cached"
    """The bucket is full and a ping is already outstanding: the newcomer waits
    in the replacement cache."""
    IGNORED = "ignored"
    """Client-mode peer or our own id: never added."""
    CROWDED = "crowded"
    """The bucket already holds ``DHTConfig.max_per_subnet`` contacts of the
    newcomer's public /24 (IPv4) or /64 (IPv6): it is not added or cached."""


@dataclass(frozen=True, slots=True)
class AddResult:
    """The outcome of :meth:`RoutingTable.add_or_update`.

    Attributes:
        status: What happened.
        ping: With :attr:`AddStatus.PING_NEEDED`, the least-recently-seen
            contact of the full bucket, to be pinged; otherwise ``None``.
    """

    status: AddStatus
    ping: Contact | None = None


_ADDED = AddResult(AddStatus.ADDED)
_UPDATED = AddResult(AddStatus.UPDATED)
_CACHED = AddResult(AddStatus.CACHED)
_IGNORED = AddResult(AddStatus.IGNORED)
_CROWDED = AddResult(AddStatus.CROWDED)


@functools.lru_cache(maxsize=8192)
def subnet_of(address: str) -> str | None:
    """The /24 (IPv4) or /64 (IPv6) of a public ``host:port`` address, else ``None``.

    Loopback, private, link-local and other non-global addresses (a LAN or a
    test swarm) and host names have none: the per-subnet cap leaves them alone.
    Cached: a crowded-bucket check parses every contact of the bucket, and a
    node hears the same addresses over and over.
    """
    host = address.rpartition(":")[0].strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if not ip.is_global:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    prefix = 24 if ip.version == 4 else 64
    return str(ipaddress.ip_network(f"{ip}/{prefix}", strict=False))


@dataclass(frozen=True, slots=True)
class BucketView:
    """A read-only snapshot of one bucket, for inspection and tests.

    Attributes:
        lo: Lowest id in the bucket's range (inclusive).
        hi: End of the range (exclusive).
        contacts: Contacts, least recently seen first.
        replacements: Replacement candidates, oldest first.
        last_updated: When a contact of this bucket was last added, updated or
            the bucket refreshed.
    """

    lo: int
    hi: int
    contacts: tuple[Contact, ...]
    replacements: tuple[Contact, ...]
    last_updated: float

    @property
    def depth(self) -> int:
        """How many leading bits all ids in the range share."""
        return ID_BITS + 1 - (self.hi - self.lo).bit_length()


class _Bucket:
    __slots__ = (
        "contacts",
        "hi",
        "last_updated",
        "lo",
        "ping_since",
        "ping_target",
        "replacements",
    )

    def __init__(self, lo: int, hi: int, last_updated: float) -> None:
        self.lo = lo
        self.hi = hi
        self.last_updated = last_updated
        # Both dicts are ordered oldest (least recently seen) first.
        self.contacts: dict[int, Contact] = {}
        self.replacements: dict[int, Contact] = {}
        self.ping_target: int | None = None
        self.ping_since = 0.0

    def min_distance(self, target: int) -> int:
        """The smallest XOR distance from ``target`` to any id in the range."""
        return (self.lo ^ target) & -(self.hi - self.lo)


class RoutingTable:
    """The k-buckets of one peer. See the module docstring for how it works.

    Args:
        own_id: Our own position; never stored, buckets split around it.
        config: Bucket size *k*, split rule, failure and ping limits.
        rng: Source of the random ids returned by :meth:`buckets_needing_refresh`.
        now: Current time; buckets count as refreshed at creation.
    """

    def __init__(
        self, own_id: NodeID, *, config: DHTConfig, rng: random.Random, now: float
    ) -> None:
        self._own = NodeID(own_id)
        self._config = config
        self._rng = rng
        self._buckets: list[_Bucket] = [_Bucket(0, _ID_SPACE, now)]
        self._los: list[int] = [0]
        self._failures: dict[int, int] = {}
        self._size = 0

    @property
    def own_id(self) -> NodeID:
        """Our own position in the id space."""
        return self._own

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Contact]:
        for bucket in self._buckets:
            yield from bucket.contacts.values()

    def __contains__(self, peer_id: object) -> bool:
        if not isinstance(peer_id, PeerID):
            return False
        node_id = NodeID.from_peer_id(peer_id)
        return node_id in self._bucket_for(node_id).contacts

    def get(self, peer_id: PeerID) -> Contact | None:
        """The stored contact of ``peer_id``, or ``None`` if it is not in a bucket."""
        node_id = NodeID.from_peer_id(peer_id)
        return self._bucket_for(node_id).contacts.get(node_id)

    @property
    def buckets(self) -> list[BucketView]:
        """Snapshots of all buckets, in id order."""
        return [
            BucketView(
                b.lo,
                b.hi,
                tuple(b.contacts.values()),
                tuple(b.replacements.values()),
                b.last_updated,
            )
            for b in self._buckets
        ]

    def add_or_update(
        self, contact: Contact, now: float, *, client_mode: bool = False
    ) -> AddResult:
        """Record that we heard from ``contact`` directly at time ``now``.

        Args:
            contact: The peer and the address it was reached at.
            now: Current time; becomes the contact's ``last_seen``.
            client_mode: The peer cannot accept connections; it is ignored.

        Returns:
            What happened. With :attr:`AddStatus.PING_NEEDED` the caller must
            ping ``result.ping`` and call :meth:`on_ping_result`.
        """
        node_id = contact.node_id
        if client_mode or node_id == self._own:
            return _IGNORED
        seen = contact
        if contact.last_seen != now:
            seen = Contact(contact.peer_id, contact.address, now)
        bucket = self._bucket_for(node_id)
        if node_id in bucket.contacts:
            del bucket.contacts[node_id]
            bucket.contacts[node_id] = seen
            self._failures.pop(node_id, None)
            bucket.last_updated = now
            return _UPDATED
        k = self._config.k
        while len(bucket.contacts) >= k and self._should_split(bucket, node_id):
            self._split(bucket)
            bucket = self._bucket_for(node_id)
        if self._crowded(bucket, seen):
            return _CROWDED
        if len(bucket.contacts) < k:
            bucket.replacements.pop(node_id, None)
            bucket.contacts[node_id] = seen
            self._failures.pop(node_id, None)
            self._size += 1
            bucket.last_updated = now
            return _ADDED
        self._cache_replacement(bucket, seen)
        pending = bucket.ping_target
        if (
            pending is not None
            and pending in bucket.contacts
            and now - bucket.ping_since < self._config.ping_timeout
        ):
            return _CACHED
        oldest = next(iter(bucket.contacts.values()))
        bucket.ping_target = oldest.node_id
        bucket.ping_since = now
        return AddResult(AddStatus.PING_NEEDED, oldest)

    def on_ping_result(self, peer_id: PeerID, alive: bool, now: float) -> Contact | None:
        """Report the PING asked for by :attr:`AddStatus.PING_NEEDED`.

        Args:
            peer_id: The contact that was pinged.
            alive: Whether it answered.
            now: Current time.

        Returns:
            The replacement promoted into the bucket if the contact was evicted,
            else ``None``.
        """
        node_id = NodeID.from_peer_id(peer_id)
        bucket = self._bucket_for(node_id)
        if bucket.ping_target == node_id:
            bucket.ping_target = None
        contact = bucket.contacts.get(node_id)
        if contact is None:
            return None
        if alive:
            del bucket.contacts[node_id]
            bucket.contacts[node_id] = Contact(contact.peer_id, contact.address, now)
            self._failures.pop(node_id, None)
            bucket.last_updated = now
            return None
        return self._evict(bucket, node_id)

    def mark_failed(self, peer_id: PeerID) -> bool:
        """Count a failed request to ``peer_id``.

        A replacement candidate is dropped at once; a bucket contact after
        ``config.max_failures`` failures in a row (any success through
        :meth:`add_or_update` resets the count), its place going to the most
        recently seen replacement.

        Returns:
            Whether the peer was removed from the table or its caches.
        """
        node_id = NodeID.from_peer_id(peer_id)
        bucket = self._bucket_for(node_id)
        if bucket.replacements.pop(node_id, None) is not None:
            return True
        if node_id not in bucket.contacts:
            return False
        failures = self._failures.get(node_id, 0) + 1
        if failures < self._config.max_failures:
            self._failures[node_id] = failures
            return False
        self._evict(bucket, node_id)
        return True

    def remove(self, peer_id: PeerID) -> bool:
        """Forget ``peer_id`` (bucket or replacement cache), promoting a replacement.

        Returns:
            Whether the peer was known.
        """
        node_id = NodeID.from_peer_id(peer_id)
        bucket = self._bucket_for(node_id)
        if bucket.replacements.pop(node_id, None) is not None:
            return True
        if node_id not in bucket.contacts:
            return False
        self._evict(bucket, node_id)
        return True

    def nearest(self, target: int, count: int, *, exclude: Iterable[PeerID] = ()) -> list[Contact]:
        """The ``count`` contacts closest to ``target``, nearest first.

        Args:
            target: A position in the id space.
            count: How many contacts to return at most.
            exclude: Peers to leave out (e.g. the requester itself).
        """
        if count <= 0:
            return []
        excluded = {NodeID.from_peer_id(p) for p in exclude}
        ordered = sorted(self._buckets, key=lambda b: b.min_distance(target))
        result: list[Contact] = []
        for bucket in ordered:
            if not bucket.contacts:
                continue
            members = [c for n, c in bucket.contacts.items() if n not in excluded]
            members.sort(key=lambda c: c.node_id ^ target)
            result.extend(members[: count - len(result)])
            if len(result) >= count:
                break
        return result

    def buckets_needing_refresh(self, now: float) -> list[NodeID]:
        """A random id inside every bucket not updated for ``config.refresh_interval``.

        The node looks each id up and then calls :meth:`touch` (the lookup may
        find nobody to add in an empty range).
        """
        stale = now - self._config.refresh_interval
        return [
            NodeID(self._rng.randrange(b.lo, b.hi))
            for b in self._buckets
            if b.last_updated <= stale
        ]

    def touch(self, target: int, now: float) -> None:
        """Mark the bucket covering ``target`` as refreshed (a lookup went there)."""
        self._bucket_for(target).last_updated = now

    # internals

    def _bucket_for(self, node_id: int) -> _Bucket:
        return self._buckets[bisect_right(self._los, node_id) - 1]

    def _should_split(self, bucket: _Bucket, node_id: int) -> bool:
        if bucket.hi - bucket.lo < 2:
            return False
        if bucket.lo <= self._own < bucket.hi:
            return True
        if not self._config.relaxed_split:
            return False
        # Would the newcomer be among the k contacts closest to our own id?
        # Buckets are aligned, so each bucket is wholly closer or wholly farther.
        k = self._config.k
        own = self._own
        floor = bucket.min_distance(own)
        closer = sum(len(b.contacts) for b in self._buckets if b.min_distance(own) < floor)
        if closer >= k:
            return False
        distance = node_id ^ own
        closer += sum(1 for n in bucket.contacts if n ^ own < distance)
        return closer < k

    def _split(self, bucket: _Bucket) -> None:
        mid = (bucket.lo + bucket.hi) // 2
        left = _Bucket(bucket.lo, mid, bucket.last_updated)
        right = _Bucket(mid, bucket.hi, bucket.last_updated)
        for node_id, contact in bucket.contacts.items():
            (left if node_id < mid else right).contacts[node_id] = contact
        for node_id, contact in bucket.replacements.items():
            (left if node_id < mid else right).replacements[node_id] = contact
        if bucket.ping_target is not None:
            half = left if bucket.ping_target < mid else right
            half.ping_target = bucket.ping_target
            half.ping_since = bucket.ping_since
        for half in (left, right):
            while len(half.contacts) < self._config.k and half.replacements:
                self._promote(half)
        index = bisect_right(self._los, bucket.lo) - 1
        self._buckets[index : index + 1] = [left, right]
        self._los[index : index + 1] = [left.lo, right.lo]

    def _cache_replacement(self, bucket: _Bucket, contact: Contact) -> None:
        bucket.replacements.pop(contact.node_id, None)
        bucket.replacements[contact.node_id] = contact
        while len(bucket.replacements) > self._config.replacement_cache_size:
            del bucket.replacements[next(iter(bucket.replacements))]

    def _evict(self, bucket: _Bucket, node_id: int) -> Contact | None:
        del bucket.contacts[node_id]
        self._failures.pop(node_id, None)
        self._size -= 1
        if bucket.ping_target == node_id:
            bucket.ping_target = None
        return self._promote(bucket) if bucket.replacements else None

    def _crowded(self, bucket: _Bucket, contact: Contact) -> bool:
        """Whether ``bucket`` holds ``max_per_subnet`` contacts of ``contact``'s subnet."""
        limit = self._config.max_per_subnet
        subnet = None if limit is None else subnet_of(contact.address)
        if subnet is None:
            return False
        same = sum(1 for c in bucket.contacts.values() if subnet_of(c.address) == subnet)
        return same >= (limit or 0)

    def _promote(self, bucket: _Bucket) -> Contact | None:
        """Move the most recently seen replacement that fits into the bucket.

        Replacements whose subnet filled up meanwhile are dropped.
        """
        while bucket.replacements:
            node_id, contact = bucket.replacements.popitem()  # the most recently seen
            if self._crowded(bucket, contact):
                continue
            bucket.contacts[node_id] = contact
            self._size += 1
            return contact
        return None
