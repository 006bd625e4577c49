"""The record a peer publishes in the DHT so that others can reach it.

Key ``b"nat/peer/" + PeerID digest`` holds a dictionary; the peer writes one
entry under a sub-key bound to its own public key
(:meth:`~p2ptrain.dht.api.DHT.owned_key`), so the DHT accepts that entry only
signed by the peer itself, and a reader keeps only the entry whose owner key
hashes to the PeerID it looks for. Others can add entries under their own
sub-keys, which are ignored: nobody can replace or hide a peer's record.

The value is a msgpack map with short keys::

    {"n": "public" | "easy" | "symmetric" | "unknown",   # what it found out about itself
     "a": ["host:port", ...],                             # where it accepts TCP directly
     "r": [["peerid@host:port", relays, stun_port|nil], ...],  # its rendezvous points
     "h": bool,                                           # it can take part in TCP hole punching
     "s": stun_port | nil,                                # its own STUN responder (public peers)
     "x": bool}                                           # it relays for others

Everything read back is validated (:meth:`PeerRecord.from_value`): a
malformed record raises :class:`~p2ptrain.errors.RemoteProtocolError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

from p2ptrain.dht.api import DHT
from p2ptrain.dht.records import key_owner
from p2ptrain.errors import ConfigError, IdentityError, RemoteProtocolError
from p2ptrain.node.address import PeerAddress
from p2ptrain.secure.identity import PeerID

__all__ = [
    "RECORD_PREFIX",
    "NatKind",
    "PeerRecord",
    "RendezvousPoint",
    "find_record",
    "publish_record",
    "record_key",
]

RECORD_PREFIX = b"nat/peer/"
_SUBKEY_NAME = b"nat"
_MAX_ENTRIES = 8
_MAX_TEXT = 200

NatKind = Literal["public", "easy", "symmetric", "unknown"]
"""``public``: accepts connections. ``easy``: behind an endpoint-independent
(port-preserving) NAT, hole punching works. ``symmetric``: a new mapping per
destination, needs TURN or a relay. ``unknown``: could not tell."""


def _port(value: object, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise RemoteProtocolError(f"{what} is not a port: {value!r}")
    return value


def _address(value: object, *, peer: bool) -> str:
    if not isinstance(value, str) or len(value) > _MAX_TEXT:
        raise RemoteProtocolError(f"not an address: {value!r}")
    try:
        parsed = PeerAddress.parse(value)
    except ConfigError as exc:
        raise RemoteProtocolError(f"not an address: {value!r}") from exc
    if peer and parsed.peer_id is None:
        raise RemoteProtocolError(f"a rendezvous address needs a PeerID: {value!r}")
    return value


def _entries(value: object, what: str) -> list[Any]:
    if not isinstance(value, list) or len(value) > _MAX_ENTRIES:
        raise RemoteProtocolError(f"{what} must be a list of at most {_MAX_ENTRIES}")
    return value


@dataclass(frozen=True)
class RendezvousPoint:
    """A public peer through which a NATed peer can be reached.

    Attributes:
        address: ``peerid@host:port`` of the rendezvous point.
        relay: Whether it relays frames (the last-resort path).
        stun_port: Its STUN responder's UDP port, or None.
    """

    address: str
    relay: bool = False
    stun_port: int | None = None

    @property
    def peer_address(self) -> PeerAddress:
        """The parsed address (with the PeerID)."""
        return PeerAddress.parse(self.address)

    @property
    def peer_id(self) -> PeerID:
        """The rendezvous point's PeerID."""
        peer = self.peer_address.peer_id
        if peer is None:
            raise ConfigError(f"a rendezvous address needs a PeerID: {self.address!r}")
        return peer


@dataclass(frozen=True)
class PeerRecord:
    """How to reach a peer: what it published about itself.

    Attributes:
        nat: What it found out about its NAT (see :data:`NatKind`).
        addresses: ``host:port`` where it accepts TCP connections directly.
        rendezvous: Its rendezvous points.
        holepunch: It can take part in TCP hole punching (its listener allows
            simultaneous open and its rendezvous points see its listening port).
        stun_port: Its own STUN responder's port (public peers), or None.
        relay: It relays for others (public peers).
    """

    nat: NatKind
    addresses: tuple[str, ...] = ()
    rendezvous: tuple[RendezvousPoint, ...] = ()
    holepunch: bool = False
    stun_port: int | None = None
    relay: bool = False

    def to_value(self) -> dict[str, Any]:
        """The msgpack-able value stored in the DHT."""
        return {
            "n": self.nat,
            "a": list(self.addresses),
            "r": [[r.address, r.relay, r.stun_port] for r in self.rendezvous],
            "h": self.holepunch,
            "s": self.stun_port,
            "x": self.relay,
        }

    @classmethod
    def from_value(cls, value: object) -> PeerRecord:
        """Validate and decode a value read from the DHT.

        Raises:
            RemoteProtocolError: The value is malformed.
        """
        if not isinstance(value, dict):
            raise RemoteProtocolError("a peer record must be a map")
        nat = value.get("n")
        if nat not in get_args(NatKind):
            raise RemoteProtocolError(f"unknown NAT kind {nat!r}")
        kind = cast(NatKind, nat)
        addresses = tuple(_address(a, peer=False) for a in _entries(value.get("a", []), "a"))
        points = []
        for entry in _entries(value.get("r", []), "r"):
            if not isinstance(entry, list) or len(entry) != 3 or not isinstance(entry[1], bool):
                raise RemoteProtocolError(f"a malformed rendezvous entry: {entry!r}")
            points.append(
                RendezvousPoint(
                    _address(entry[0], peer=True), entry[1], _port(entry[2], "stun port")
                )
            )
        for flag in ("h", "x"):
            if not isinstance(value.get(flag, False), bool):
                raise RemoteProtocolError(f"{flag!r} must be a bool")
        return cls(
            nat=kind,
            addresses=addresses,
            rendezvous=tuple(points),
            holepunch=value.get("h", False),
            stun_port=_port(value.get("s"), "stun port"),
            relay=value.get("x", False),
        )


def record_key(peer_id: PeerID) -> bytes:
    """The DHT key of ``peer_id``'s record."""
    return RECORD_PREFIX + peer_id.digest


async def publish_record(dht: DHT, record: PeerRecord, *, ttl: float) -> bool:
    """Store our record for ``ttl`` seconds (signed: only we can write it).

    Returns:
        Whether a replica holds it (see :meth:`~p2ptrain.dht.api.DHT.store`).

    Raises:
        LookupFailedError: No replica could be reached.
    """
    return await dht.store(
        record_key(dht.peer_id),
        record.to_value(),
        dht.now() + ttl,
        subkey=dht.owned_key(_SUBKEY_NAME),
    )


async def find_record(dht: DHT, peer_id: PeerID) -> PeerRecord | None:
    """The record ``peer_id`` published, or None if there is none (or none valid).

    Raises:
        LookupFailedError: No DHT peer could be asked.
    """
    entries = await dht.get_dictionary(record_key(peer_id))
    best: tuple[float, PeerRecord] | None = None
    for subkey, entry in entries.items():
        owner = key_owner(subkey)
        if owner is None or entry.owner != owner:
            continue
        try:
            if PeerID.from_public_key(owner) != peer_id:
                continue
            record = PeerRecord.from_value(entry.value)
        except (IdentityError, RemoteProtocolError):
            continue
        if best is None or entry.expiration > best[0]:
            best = (entry.expiration, record)
    return None if best is None else best[1]
