"""DHT records: the data model, owner-bound keys, and the canonical signed bytes.

Keys, sub-keys and values are opaque bytes at this layer (the node
msgpack-encodes values). A record lives under a *key*; it is either a *plain*
value or one entry of a *dictionary*, named by a *sub-key*. Each record carries
an absolute ``expiration`` time (seconds since the Unix epoch, a float: all
peers compare it with their wall clocks) and may carry an ``owner`` (a raw
32-byte Ed25519 public key) with a 64-byte ``signature``.

Owner-bound keys
----------------
A key or sub-key is *owner-bound* when its last 39 bytes are the 7-byte marker
``OWNER_MARKER = b"\\x00owner="`` followed by a 32-byte Ed25519 public key::

    owner_bound_key(name, public_key) = name || b"\\x00owner=" || public_key

:func:`key_owner` extracts that public key. The rules, checked by
:func:`validate_record` (on store and on read):

1. If the **key** is owner-bound to ``P``, every record under it (the plain
   value and every sub-key) must have ``owner == P`` and a valid signature by
   ``P``. The key's owner controls the whole dictionary.
2. Otherwise, if the **sub-key** is owner-bound to ``Q``, that entry must have
   ``owner == Q`` and a valid signature by ``Q`` (each peer writes its own
   entry of a shared dictionary; nobody can overwrite another's).
3. Otherwise the record may be unsigned. If it names an owner it must carry a
   valid signature by that owner; an owner without a signature, or a signature
   without an owner, is refused.

Canonical signed bytes (version 1)
----------------------------------
The owner signs, with Ed25519 (RFC 8032, pure, no pre-hash), the message::

    "p2ptrain/dht-record/v1" || 0x00                      (23 bytes, ASCII + NUL)
    || u32(len(key)) || key
    || 0x00                                                if there is no sub-key
       or 0x01 || u32(len(subkey)) || subkey               if there is one
    || u32(len(value)) || value
    || f64(expiration)
    || owner                                               (32 bytes)

where ``u32`` is an unsigned 32-bit big-endian integer and ``f64`` the IEEE
754 binary64 big-endian encoding of the expiration (an integer expiration is
converted to binary64 first). Lengths are those of the raw bytes. The
signature is 64 bytes. Because the expiration and the owner are signed, a
replayed old record never beats the owner's newer one, and a signature cannot
be moved to another owner's key.

Limits (checked on store and on read, from :class:`~p2ptrain.dht.config.DHTConfig`):
key and sub-key at most ``max_key_bytes``, value at most ``max_value_bytes``,
expiration finite, later than ``now`` and at most ``now +
max_expiration_horizon``. Every violation raises
:class:`~p2ptrain.errors.RecordRejectedError`.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from p2ptrain.dht.config import DHTConfig
from p2ptrain.errors import RecordRejectedError
from p2ptrain.secure.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity, verify_signature

__all__ = [
    "OWNER_MARKER",
    "SIGNATURE_DOMAIN",
    "DictionaryRecord",
    "Record",
    "StoredValue",
    "key_owner",
    "owner_bound_key",
    "sign_record",
    "signed_bytes",
    "validate_for_read",
    "validate_record",
    "verify_record",
]

OWNER_MARKER = b"\x00owner="
"""Separates a key's name from the owner public key that ends it."""

SIGNATURE_DOMAIN = b"p2ptrain/dht-record/v1\x00"
"""Domain-separation prefix of the canonical signed bytes."""

_U32 = struct.Struct(">I")
_F64 = struct.Struct(">d")
_OWNER_SUFFIX = len(OWNER_MARKER) + PUBLIC_KEY_BYTES


@dataclass(frozen=True, slots=True)
class Record:
    """One stored value: a plain value (``subkey is None``) or a dictionary entry.

    Attributes:
        key: The key it is stored under.
        value: Opaque bytes.
        expiration: Absolute expiry time (Unix seconds); the newest wins.
        subkey: The dictionary entry's name, or ``None`` for a plain value.
        owner: Raw 32-byte Ed25519 public key of the signer, if signed.
        signature: 64-byte Ed25519 signature of :func:`signed_bytes`, if signed.
    """

    key: bytes
    value: bytes
    expiration: float
    subkey: bytes | None = None
    owner: bytes | None = None
    signature: bytes | None = None


@dataclass(frozen=True, slots=True)
class DictionaryRecord:
    """The live entries of a dictionary value (at least one).

    Attributes:
        key: The key the dictionary is stored under.
        entries: Sub-key to its record (value, expiration, owner, signature).
    """

    key: bytes
    entries: Mapping[bytes, Record]

    @property
    def expiration(self) -> float:
        """The latest expiration among the entries."""
        return max(r.expiration for r in self.entries.values())

    def __iter__(self) -> Iterator[Record]:
        return iter(self.entries.values())

    def __len__(self) -> int:
        return len(self.entries)


StoredValue = Record | DictionaryRecord
"""What a key holds: one plain record or a dictionary of sub-key records."""


def owner_bound_key(name: bytes, public_key: bytes) -> bytes:
    """A key (or sub-key) that only ``public_key``'s holder may write.

    Raises:
        RecordRejectedError: ``name`` is not bytes or ``public_key`` is not 32 bytes.
    """
    if not isinstance(name, bytes):
        raise RecordRejectedError(f"a key name is bytes, got {type(name).__name__}")
    if not isinstance(public_key, bytes) or len(public_key) != PUBLIC_KEY_BYTES:
        raise RecordRejectedError(f"an owner public key is {PUBLIC_KEY_BYTES} bytes")
    return name + OWNER_MARKER + public_key


def key_owner(key: bytes) -> bytes | None:
    """The owner public key a key or sub-key is bound to, or ``None`` if it is not bound."""
    if len(key) >= _OWNER_SUFFIX and key[-_OWNER_SUFFIX:-PUBLIC_KEY_BYTES] == OWNER_MARKER:
        return key[-PUBLIC_KEY_BYTES:]
    return None


def signed_bytes(
    key: bytes, subkey: bytes | None, value: bytes, expiration: float, owner: bytes
) -> bytes:
    """The canonical message an owner signs (see the module docstring)."""
    parts = [SIGNATURE_DOMAIN, _U32.pack(len(key)), key]
    if subkey is None:
        parts.append(b"\x00")
    else:
        parts += [b"\x01", _U32.pack(len(subkey)), subkey]
    parts += [_U32.pack(len(value)), value, _F64.pack(float(expiration)), owner]
    return b"".join(parts)


def sign_record(
    identity: Identity, key: bytes, subkey: bytes | None, value: bytes, expiration: float
) -> bytes:
    """Sign a record as ``identity`` (its public key is the record's owner).

    Returns:
        The 64-byte signature to store along with ``owner=identity.public_key``.
    """
    return identity.sign(signed_bytes(key, subkey, value, expiration, identity.public_key))


_VERIFIED_CACHE_SIZE = 16384
_verified: OrderedDict[bytes, None] = OrderedDict()
"""Digests of (owner, signature, signed bytes) that verified, most recent last.

Matchmaking and progress dictionaries are read again and again while their
records stay the same; a hit skips the Ed25519 verification (~0.1 ms). Only
successes are remembered, and a hit needs the very same owner, signature
and signed bytes."""


def verify_record(record: Record) -> bool:
    """Whether ``record`` carries a valid signature by its ``owner``.

    Malformed owners or signatures give ``False``; this never raises.
    Recently verified records are remembered (see ``_verified``).
    """
    if not isinstance(record.owner, bytes) or not isinstance(record.signature, bytes):
        return False
    try:
        message = signed_bytes(
            record.key, record.subkey, record.value, record.expiration, record.owner
        )
    except (TypeError, ValueError, struct.error, OverflowError):
        return False
    owner, signature = record.owner, record.signature
    framed = struct.pack(">HH", len(owner) & 0xFFFF, len(signature) & 0xFFFF)
    digest = hashlib.sha256(framed + owner + signature + message).digest()
    if digest in _verified:
        _verified.move_to_end(digest)
        return True
    if not verify_signature(owner, signature, message):
        return False
    _verified[digest] = None
    if len(_verified) > _VERIFIED_CACHE_SIZE:
        _verified.popitem(last=False)
    return True


def validate_record(record: Record, *, config: DHTConfig, now: float) -> None:
    """Check a record against the limits and ownership rules of the module docstring.

    Raises:
        RecordRejectedError: The record breaks a rule; the message says which.
    """
    _check_bytes("key", record.key, config.max_key_bytes)
    if record.subkey is not None:
        _check_bytes("sub-key", record.subkey, config.max_key_bytes)
    _check_bytes("value", record.value, config.max_value_bytes)
    _check_expiration(record.expiration, config=config, now=now)
    owner, signature = record.owner, record.signature
    if owner is not None and (not isinstance(owner, bytes) or len(owner) != PUBLIC_KEY_BYTES):
        raise RecordRejectedError(f"an owner is a {PUBLIC_KEY_BYTES}-byte Ed25519 public key")
    if signature is not None and (
        not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES
    ):
        raise RecordRejectedError(f"a signature is {SIGNATURE_BYTES} bytes")
    required = key_owner(record.key)
    bound = "key"
    if required is None and record.subkey is not None:
        required = key_owner(record.subkey)
        bound = "sub-key"
    if required is not None:
        if owner is None or signature is None:
            raise RecordRejectedError(f"the {bound} is owner-bound: the record must be signed")
        if owner != required:
            raise RecordRejectedError(
                f"the {bound} is bound to owner {required.hex()[:16]}…,"
                f" but the record is signed by {owner.hex()[:16]}…"
            )
    elif (owner is None) != (signature is None):
        raise RecordRejectedError("a record names an owner exactly when it carries a signature")
    if owner is not None and not verify_record(record):
        raise RecordRejectedError("invalid signature")


def validate_for_read(value: StoredValue, *, config: DHTConfig, now: float) -> None:
    """Check a value received from another node before trusting it.

    Applies :func:`validate_record` to the plain record or to every dictionary
    entry, and checks that the entries belong to the dictionary (matching key
    and sub-key). One bad entry rejects the whole reply: the node should treat
    its sender as faulty.

    Raises:
        RecordRejectedError: Any part of the value breaks a rule.
    """
    if isinstance(value, Record):
        if value.subkey is not None:
            raise RecordRejectedError("a plain value must not carry a sub-key")
        validate_record(value, config=config, now=now)
        return
    if not isinstance(value, DictionaryRecord):
        raise RecordRejectedError(f"not a stored value: {type(value).__name__}")
    if not value.entries:
        raise RecordRejectedError("an empty dictionary is not a value")
    if len(value.entries) > config.max_subkeys:
        raise RecordRejectedError(
            f"dictionary has {len(value.entries)} sub-keys, more than {config.max_subkeys}"
        )
    for subkey, record in value.entries.items():
        if not isinstance(record, Record) or record.key != value.key or record.subkey != subkey:
            raise RecordRejectedError("a dictionary entry does not match its key and sub-key")
        validate_record(record, config=config, now=now)


def _check_bytes(what: str, data: object, limit: int) -> None:
    if not isinstance(data, bytes):
        raise RecordRejectedError(f"the {what} must be bytes, got {type(data).__name__}")
    if len(data) > limit:
        raise RecordRejectedError(f"the {what} is {len(data)} bytes, more than {limit}")


def _check_expiration(expiration: object, *, config: DHTConfig, now: float) -> None:
    if isinstance(expiration, bool) or not isinstance(expiration, int | float):
        raise RecordRejectedError(
            f"the expiration must be a number, got {type(expiration).__name__}"
        )
    try:
        when = float(expiration)
    except OverflowError:
        raise RecordRejectedError("the expiration is out of range") from None
    if not math.isfinite(when):
        raise RecordRejectedError("the expiration must be finite")
    if when <= now:
        raise RecordRejectedError(f"the record expired already ({when} <= now {now})")
    if when > now + config.max_expiration_horizon:
        raise RecordRejectedError(
            f"the expiration is {when - now:.0f} s ahead,"
            f" more than the allowed {config.max_expiration_horizon:.0f} s"
        )
