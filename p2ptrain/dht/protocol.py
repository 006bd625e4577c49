"""The DHT's RPC messages: their schema, encoding, and validation of what arrives.

Pure functions and frozen dataclasses, no I/O. Everything received goes
through a ``decode`` here before the node looks at it; a message that breaks
the schema raises :class:`~p2ptrain.errors.RemoteProtocolError` (the handler
turns it into :class:`~p2ptrain.errors.InvalidArgumentError` for the caller,
the client side counts the replying peer as failed). Whether a well-formed
record may be stored or trusted (sizes, expiration, owner and signature) is
decided afterwards by :func:`~p2ptrain.dht.records.validate_record` and
:func:`~p2ptrain.dht.records.validate_for_read`.

Messages (msgpack bodies of unary RPCs; values travel in the raw payload)::

    dht.ping   {"a": sender}                          -> {"c": client_mode}
    dht.find   {"a": sender, "t": target}             -> {"n": contacts}
    dht.find   {"a": sender, "k": key, "h": known}    -> {"n": contacts, "r": rows} + values
    dht.store  {"a": sender, "r": rows} + values      -> {"s": statuses}

* ``sender`` is ``"host:port"`` where the caller accepts connections, or nil
  for a client-mode caller. The callee adds a non-nil sender to its routing
  table under the caller's authenticated PeerID.
* ``target`` is a 32-byte id (FIND_NODE); ``key`` a record key (FIND_VALUE,
  whose target is SHA-256 of the key).
* ``contacts`` is ``[[peer_id (32 bytes), "host:port"], ...]``, nearest
  first; a receiver looks at no more than its cap of them.
* A store row is ``[key, subkey|nil, value_length, expiration, owner|nil,
  signature|nil]``; a find row is the same without the key (it is the one
  asked for). One row with a nil sub-key is a plain value; rows with distinct
  sub-keys are a dictionary. The payload is the values concatenated in row
  order, so their lengths must add up to its size.
* ``known`` (optional) is the concatenated :func:`entry_digest` of the
  signed dictionary entries the caller already holds under ``key``: the
  callee leaves those out of its reply (a poll of a dictionary then costs
  what changed, not the whole dictionary), but always returns at least one
  entry, so a reply still shows that it holds the key. Unsigned entries are
  always sent: the reader counts how many replicas carry them.
* ``statuses`` has one entry per stored row: 1 stored, 2 an identical record
  was already held, 0 a newer record was kept, or a string saying why the
  record was rejected.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from p2ptrain.dht.records import DictionaryRecord, Record, StoredValue
from p2ptrain.dht.routing import Contact, NodeID
from p2ptrain.errors import ConfigError, IdentityError, RemoteProtocolError
from p2ptrain.node.address import PeerAddress
from p2ptrain.secure.identity import PeerID
from p2ptrain.wire.frames import Buffer

__all__ = [
    "DIGEST_BYTES",
    "MAX_ADDRESS_CHARS",
    "MAX_KNOWN_ENTRIES",
    "METHOD_FIND",
    "METHOD_PING",
    "METHOD_STORE",
    "FindReply",
    "FindRequest",
    "PingReply",
    "PingRequest",
    "StoreOutcome",
    "StoreReply",
    "StoreRequest",
    "StoreStatus",
    "decode_contacts",
    "decode_sender",
    "encode_contacts",
    "entry_digest",
    "known_digests",
    "omit_known",
]

METHOD_PING = "dht.ping"
METHOD_FIND = "dht.find"
METHOD_STORE = "dht.store"

MAX_ADDRESS_CHARS = 300
"""Longest ``host:port`` text accepted in a contact or sender field."""

DIGEST_BYTES = 8
"""Bytes of an :func:`entry_digest`."""

MAX_KNOWN_ENTRIES = 1024
"""Most entry digests a find request may list as already known."""


_MAX_REASON_CHARS = 500


# -- shared fields -------------------------------------------------------------------------


def _fail(message: str) -> RemoteProtocolError:
    return RemoteProtocolError(f"malformed DHT message: {message}")


def _body_dict(body: object, method: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise _fail(f"a {method} body is a map, got {type(body).__name__}")
    return body


def _parse_endpoint(text: object, what: str) -> str:
    if not isinstance(text, str) or not 0 < len(text) <= MAX_ADDRESS_CHARS:
        raise _fail(f"the {what} is not an address of 1 to {MAX_ADDRESS_CHARS} characters")
    try:
        return _endpoint(text)
    except ConfigError as exc:
        raise _fail(f"bad {what} {text[:60]!r}: {exc}") from None


@functools.lru_cache(maxsize=4096)
def _endpoint(text: str) -> str:
    """The canonical ``host:port`` of ``text`` (memoized: the same peers recur in replies)."""
    address = PeerAddress.parse(text)
    if address.peer_id is not None:
        raise ConfigError("expected host:port without a peer id")
    return address.endpoint


@functools.lru_cache(maxsize=4096)
def _contact(digest: bytes, endpoint: str) -> Contact:
    """A contact (memoized: deriving its id costs more than a cache hit)."""
    return Contact(PeerID(digest), endpoint)


def decode_sender(body: dict[str, Any]) -> str | None:
    """The caller's announced ``host:port`` (``None`` for a client-mode caller)."""
    sender = body.get("a")
    return None if sender is None else _parse_endpoint(sender, "sender address")


def encode_contacts(contacts: Iterable[Contact]) -> list[list[Any]]:
    """Contacts as ``[[peer_id digest, "host:port"], ...]``."""
    return [[c.peer_id.digest, c.address] for c in contacts]


def decode_contacts(raw: object, *, cap: int) -> tuple[Contact, ...]:
    """Parse a contact list, looking at no more than its first ``cap`` entries.

    Entries past the cap are ignored unread, so a reply naming thousands of
    contacts costs no more than one naming ``cap``.

    Raises:
        RemoteProtocolError: The list or one of the entries looked at is malformed.
    """
    if not isinstance(raw, list):
        raise _fail("contacts must be a list")
    contacts: list[Contact] = []
    for item in raw[:cap]:
        if not isinstance(item, list) or len(item) != 2:
            raise _fail("a contact is [peer_id, address]")
        digest, address = item
        if not isinstance(digest, bytes):
            raise _fail("a contact's peer id must be bytes")
        endpoint = _parse_endpoint(address, "contact address")
        try:
            contacts.append(_contact(digest, endpoint))
        except IdentityError as exc:
            raise _fail(str(exc)) from None
    return tuple(contacts)


def _check_optional_bytes(value: object, what: str) -> bytes | None:
    if value is not None and not isinstance(value, bytes):
        raise _fail(f"the {what} must be bytes or nil")
    return value


def _decode_row(row: object, *, with_key: bool) -> tuple[bytes | None, Record, int]:
    """One record row: (key or None, a record with an empty value, the value's length)."""
    width = 6 if with_key else 5
    if not isinstance(row, list) or len(row) != width:
        raise _fail(f"a record row has {width} fields")
    key: bytes | None = None
    if with_key:
        key = row[0]
        if not isinstance(key, bytes):
            raise _fail("a record key must be bytes")
        row = row[1:]
    subkey, length, expiration, owner, signature = row
    _check_optional_bytes(subkey, "sub-key")
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise _fail("a value length must be a non-negative integer")
    if isinstance(expiration, bool) or not isinstance(expiration, int | float):
        raise _fail("an expiration must be a number")
    _check_optional_bytes(owner, "owner")
    _check_optional_bytes(signature, "signature")
    record = Record(key or b"", b"", float(expiration), subkey, owner, signature)
    return key, record, length


def _split_values(lengths: Sequence[int], payload: Buffer) -> list[bytes]:
    view = payload if isinstance(payload, bytes) else memoryview(payload).cast("B")
    if sum(lengths) != len(view):
        raise _fail(f"value lengths add up to {sum(lengths)}, the payload has {len(view)} bytes")
    values: list[bytes] = []
    offset = 0
    for length in lengths:
        values.append(bytes(view[offset : offset + length]))
        offset += length
    return values


def _with(record: Record, *, key: bytes, value: bytes) -> Record:
    return Record(key, value, record.expiration, record.subkey, record.owner, record.signature)


# -- dht.ping ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PingRequest:
    """``dht.ping``: are you there? (and here is where I listen)."""

    sender: str | None = None

    def encode(self) -> dict[str, Any]:
        """The msgpack body."""
        return {"a": self.sender}

    @classmethod
    def decode(cls, body: object) -> PingRequest:
        """Parse a received body (raises RemoteProtocolError)."""
        return cls(decode_sender(_body_dict(body, "ping")))


@dataclass(frozen=True, slots=True)
class PingReply:
    """The answer to ``dht.ping``: whether the callee runs in client mode."""

    client_mode: bool

    def encode(self) -> dict[str, Any]:
        """The msgpack body."""
        return {"c": self.client_mode}

    @classmethod
    def decode(cls, body: object) -> PingReply:
        """Parse a received body (raises RemoteProtocolError)."""
        client_mode = _body_dict(body, "ping reply").get("c")
        if not isinstance(client_mode, bool):
            raise _fail("a ping reply says whether the peer is in client mode")
        return cls(client_mode)


# -- dht.find ------------------------------------------------------------------------------


def entry_digest(record: Record) -> bytes:
    """A short name of one signed version of a dictionary entry (``known`` in a find).

    BLAKE2b over the sub-key, the expiration and the signature: the signature
    covers key, sub-key, value and expiration, so another version of the
    entry has another digest.
    """
    digest = hashlib.blake2b(digest_size=DIGEST_BYTES)
    digest.update(record.subkey or b"")
    digest.update(struct.pack(">d", record.expiration))
    digest.update(record.signature or b"")
    return digest.digest()


def known_digests(value: StoredValue | None) -> bytes:
    """The ``known`` field for a poll of a dictionary held as ``value``: its signed entries."""
    if not isinstance(value, DictionaryRecord):
        return b""
    signed = [r for r in value.entries.values() if r.signature is not None]
    signed.sort(key=lambda r: -r.expiration)
    return b"".join(entry_digest(r) for r in signed[:MAX_KNOWN_ENTRIES])


def omit_known(value: StoredValue, known: bytes) -> StoredValue:
    """``value`` without the signed dictionary entries whose digests are in ``known``.

    At least one entry is left (the one that expires last), so the reply
    still shows that the key is held; plain values are returned whole.
    """
    if not known or not isinstance(value, DictionaryRecord):
        return value
    names = {known[i : i + DIGEST_BYTES] for i in range(0, len(known), DIGEST_BYTES)}
    kept = {
        subkey: record
        for subkey, record in value.entries.items()
        if record.signature is None or entry_digest(record) not in names
    }
    if not kept:
        last = max(value.entries.values(), key=lambda r: r.expiration)
        kept = {last.subkey or b"": last}
    return DictionaryRecord(value.key, kept)


@dataclass(frozen=True, slots=True)
class FindRequest:
    """``dht.find``: FIND_NODE (``key is None``) or FIND_VALUE of ``key``.

    Attributes:
        target: The id looked up (SHA-256 of ``key`` for FIND_VALUE).
        key: The record key for FIND_VALUE, else ``None``.
        sender: The caller's ``host:port``, or ``None`` in client mode.
        known: FIND_VALUE of a dictionary: the :func:`entry_digest` of the
            entries the caller holds, concatenated (left out of the reply).
    """

    target: NodeID
    key: bytes | None = None
    sender: str | None = None
    known: bytes = b""

    @classmethod
    def for_key(cls, key: bytes, sender: str | None = None, known: bytes = b"") -> FindRequest:
        """A FIND_VALUE request for ``key``."""
        return cls(NodeID.from_key(key), key, sender, known)

    def encode(self) -> dict[str, Any]:
        """The msgpack body."""
        if self.key is not None:
            body: dict[str, Any] = {"a": self.sender, "k": self.key}
            if self.known:
                body["h"] = self.known
            return body
        return {"a": self.sender, "t": self.target.to_bytes32()}

    @classmethod
    def decode(cls, body: object, *, max_key_bytes: int) -> FindRequest:
        """Parse a received body (raises RemoteProtocolError)."""
        fields = _body_dict(body, "find")
        sender = decode_sender(fields)
        key = fields.get("k")
        if key is not None:
            if not isinstance(key, bytes) or len(key) > max_key_bytes:
                raise _fail(f"a key is at most {max_key_bytes} bytes")
            known = fields.get("h", b"")
            if (
                not isinstance(known, bytes)
                or len(known) % DIGEST_BYTES
                or len(known) > DIGEST_BYTES * MAX_KNOWN_ENTRIES
            ):
                raise _fail(
                    f"known entries are {DIGEST_BYTES}-byte digests, at most {MAX_KNOWN_ENTRIES}"
                )
            return cls.for_key(key, sender, known)
        target = fields.get("t")
        if not isinstance(target, bytes) or len(target) != 32:
            raise _fail("a find request needs a 32-byte target or a key")
        return cls(NodeID.from_bytes32(target), None, sender)


@dataclass(frozen=True, slots=True)
class FindReply:
    """The answer to ``dht.find``: nearby contacts and, for FIND_VALUE, the value held.

    Attributes:
        contacts: The callee's nearest contacts to the target, nearest first.
        value: The live value held under the key (FIND_VALUE only), or ``None``.
    """

    contacts: tuple[Contact, ...]
    value: StoredValue | None = None

    def encode(self, *, max_value_bytes: int) -> tuple[dict[str, Any], bytes]:
        """The msgpack body and the payload of values.

        A dictionary whose values exceed ``max_value_bytes`` in all is cut to
        the entries that expire last and fit.
        """
        body: dict[str, Any] = {"n": encode_contacts(self.contacts)}
        if self.value is None:
            return body, b""
        if isinstance(self.value, Record):
            records: list[Record] = [self.value]
        else:
            records = sorted(self.value.entries.values(), key=lambda r: -r.expiration)
        rows: list[list[Any]] = []
        values: list[bytes] = []
        total = 0
        for record in records:
            total += len(record.value)
            if total > max_value_bytes and rows:
                break
            rows.append(
                [
                    record.subkey,
                    len(record.value),
                    record.expiration,
                    record.owner,
                    record.signature,
                ]
            )
            values.append(record.value)
        body["r"] = rows
        return body, b"".join(values)

    @classmethod
    def decode(
        cls, body: object, payload: Buffer, *, key: bytes | None, max_contacts: int, max_rows: int
    ) -> FindReply:
        """Parse a received reply to a request for ``key`` (raises RemoteProtocolError).

        Args:
            body: The reply's msgpack body.
            payload: The reply's raw payload (the values).
            key: The key asked for, or ``None`` for FIND_NODE (then any value is refused).
            max_contacts: Contacts looked at; the rest are ignored.
            max_rows: Most records a value may hold (``max_subkeys``).
        """
        fields = _body_dict(body, "find reply")
        contacts = decode_contacts(fields.get("n"), cap=max_contacts)
        rows = fields.get("r")
        if rows is None:
            if len(payload):
                raise _fail("a reply without records carries no payload")
            return cls(contacts, None)
        if key is None:
            raise _fail("a FIND_NODE reply carries no value")
        if not isinstance(rows, list) or not 0 < len(rows) <= max_rows:
            raise _fail(f"a value is 1 to {max_rows} record rows")
        parsed = [_decode_row(row, with_key=False) for row in rows]
        values = _split_values([length for _, _, length in parsed], payload)
        records = [
            _with(record, key=key, value=value)
            for (_, record, _), value in zip(parsed, values, strict=True)
        ]
        if len(records) == 1 and records[0].subkey is None:
            return cls(contacts, records[0])
        entries: dict[bytes, Record] = {}
        for record in records:
            if record.subkey is None:
                raise _fail("a plain value is exactly one row, without a sub-key")
            if record.subkey in entries:
                raise _fail("a dictionary names a sub-key twice")
            entries[record.subkey] = record
        return cls(contacts, DictionaryRecord(key, entries))


# -- dht.store -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StoreRequest:
    """``dht.store``: keep these records (each checked on its own).

    Attributes:
        records: The records, of one key or several.
        sender: The caller's ``host:port``, or ``None`` in client mode.
    """

    records: tuple[Record, ...]
    sender: str | None = None

    def encode(self) -> tuple[dict[str, Any], bytes]:
        """The msgpack body and the payload of values."""
        rows = [
            [r.key, r.subkey, len(r.value), float(r.expiration), r.owner, r.signature]
            for r in self.records
        ]
        return {"a": self.sender, "r": rows}, b"".join(r.value for r in self.records)

    @classmethod
    def decode(cls, body: object, payload: Buffer, *, max_records: int) -> StoreRequest:
        """Parse a received request (raises RemoteProtocolError)."""
        fields = _body_dict(body, "store")
        sender = decode_sender(fields)
        rows = fields.get("r")
        if not isinstance(rows, list) or not 0 < len(rows) <= max_records:
            raise _fail(f"a store request carries 1 to {max_records} records")
        parsed = [_decode_row(row, with_key=True) for row in rows]
        values = _split_values([length for _, _, length in parsed], payload)
        records = tuple(
            _with(record, key=key or b"", value=value)
            for (key, record, _), value in zip(parsed, values, strict=True)
        )
        return cls(records, sender)


class StoreOutcome(enum.Enum):
    """What a peer did with one record of a STORE request."""

    STORED = 1
    """The record is now held."""
    HELD = 2
    """The very same record was already held."""
    OUTDATED = 0
    """A newer record for the same key (and sub-key) was kept instead."""
    REJECTED = -1
    """The record broke a rule (``reason`` says which)."""


@dataclass(frozen=True, slots=True)
class StoreStatus:
    """The outcome for one record, and the reason of a rejection."""

    outcome: StoreOutcome
    reason: str = ""

    @property
    def holds(self) -> bool:
        """Whether the peer holds the record after the request."""
        return self.outcome in (StoreOutcome.STORED, StoreOutcome.HELD)


@dataclass(frozen=True, slots=True)
class StoreReply:
    """The answer to ``dht.store``: one status per record, in order."""

    statuses: tuple[StoreStatus, ...]

    def encode(self) -> dict[str, Any]:
        """The msgpack body."""
        wire: list[int | str] = []
        for status in self.statuses:
            if status.outcome is StoreOutcome.REJECTED:
                wire.append(status.reason[:_MAX_REASON_CHARS] or "rejected")
            else:
                wire.append(status.outcome.value)
        return {"s": wire}

    @classmethod
    def decode(cls, body: object, *, expected: int) -> StoreReply:
        """Parse a reply to a request of ``expected`` records (raises RemoteProtocolError)."""
        raw = _body_dict(body, "store reply").get("s")
        if not isinstance(raw, list) or len(raw) != expected:
            raise _fail(f"a store reply has one status per record ({expected})")
        statuses: list[StoreStatus] = []
        for item in raw:
            if isinstance(item, str):
                statuses.append(StoreStatus(StoreOutcome.REJECTED, item[:_MAX_REASON_CHARS]))
            elif isinstance(item, int) and not isinstance(item, bool) and item in (0, 1, 2):
                statuses.append(StoreStatus(StoreOutcome(item)))
            else:
                raise _fail("a store status is 0, 1, 2 or a reason")
        return cls(tuple(statuses))
