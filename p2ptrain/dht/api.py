"""The DHT as the layers above use it: Python values, dictionaries, signed records.

::

    async with DHT(node_config=NodeConfig(port=0), config=DHTNodeConfig(
            initial_peers=("peerid@host:port",))) as dht:
        await dht.store("run/step", 1200, dht.now() + 60)
        found = await dht.get("run/step")             # ValueWithExpiration | None
        # a dictionary where each peer writes only its own entry:
        await dht.store("run/progress", {"samples": 512}, dht.now() + 30,
                        subkey=dht.owned_key("peer"))
        progress = await dht.get_dictionary("run/progress")   # latest from the replicas

Keys and sub-keys are ``str`` (UTF-8 encoded) or ``bytes``. Values are any
msgpack-able Python value (``None``, bool, int, float, str, bytes, lists,
dicts); they are encoded here and stored as bytes by the DHT. Expirations are
absolute times in Unix seconds (:meth:`DHT.now` plus a lifetime); the newest
expiration wins.

Signed records: a key or sub-key made with :meth:`DHT.owned_key` (or
:func:`~p2ptrain.dht.records.owner_bound_key` with anybody's public key) can
only be written by that key's owner; :meth:`DHT.store` signs such records with
this peer's identity by itself. ``sign=True`` signs any record.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from p2ptrain.dht.node import DHTNode
from p2ptrain.dht.node_config import DHTNodeConfig
from p2ptrain.dht.records import (
    DictionaryRecord,
    Record,
    key_owner,
    owner_bound_key,
    sign_record,
)
from p2ptrain.errors import ConfigError, RecordRejectedError, RemoteProtocolError
from p2ptrain.node.address import PeerAddress
from p2ptrain.node.config import NodeConfig
from p2ptrain.node.node import Node
from p2ptrain.secure.identity import Identity, PeerID
from p2ptrain.wire.frames import pack_body, unpack_body

__all__ = ["DHT", "DictionaryValue", "ValueWithExpiration"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ValueWithExpiration:
    """A value found in the DHT.

    Attributes:
        value: The decoded Python value.
        expiration: When it expires (Unix seconds).
        owner: The raw Ed25519 public key that signed it, or ``None`` if unsigned.
    """

    value: Any
    expiration: float
    owner: bytes | None = None


@dataclass(frozen=True, eq=False)
class DictionaryValue(Mapping[bytes, ValueWithExpiration]):
    """The live entries of a dictionary value, by sub-key (bytes).

    A read-only mapping; ``len()`` is 0 when the key holds no dictionary.
    """

    entries: Mapping[bytes, ValueWithExpiration]

    def __getitem__(self, subkey: bytes) -> ValueWithExpiration:
        return self.entries[subkey]

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def expiration(self) -> float | None:
        """The latest expiration among the entries (``None`` when empty)."""
        return max((v.expiration for v in self.entries.values()), default=None)


def _as_bytes(name: str | bytes, what: str) -> bytes:
    if isinstance(name, str):
        return name.encode("utf-8")
    if isinstance(name, bytes):
        return name
    raise ConfigError(f"a {what} is str or bytes, got {type(name).__name__}")


class DHT:
    """A DHT peer with the value API. See the module docstring.

    Either give ``node`` (a started :class:`Node` the DHT shares with other
    services; it is not closed with the DHT), or let the DHT create and own
    one from ``identity`` and ``node_config``.

    Args:
        identity: The peer's key pair (a fresh one by default).
        node: An existing started node to run on.
        node_config: How the owned node listens (ignored with ``node``).
        config: DHT limits, timings, client mode and initial peers.
        clock: Current time in Unix seconds.
        rng: Source of the random ids used to refresh buckets.

    Raises:
        ConfigError: Both ``node`` and ``identity``/``node_config`` were given.
    """

    def __init__(
        self,
        *,
        identity: Identity | None = None,
        node: Node | None = None,
        node_config: NodeConfig | None = None,
        config: DHTNodeConfig | None = None,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        if node is not None and (identity is not None or node_config is not None):
            raise ConfigError("give either a node or an identity and node config, not both")
        self._owns_node = node is None
        self.node = node if node is not None else Node(identity=identity, config=node_config)
        self.dht_node = DHTNode(self.node, config=config, clock=clock, rng=rng)
        self._clock = clock

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Start the node (if owned), serve the DHT and bootstrap.

        Raises:
            LookupFailedError: Initial peers were given and none answered.
        """
        if self._owns_node:
            await self.node.start()
        try:
            await self.dht_node.start()
        except BaseException:
            if self._owns_node:
                await self.node.aclose()
            raise

    async def aclose(self) -> None:
        """Stop the DHT and close the node if it is owned."""
        await self.dht_node.aclose()
        if self._owns_node:
            await self.node.aclose()

    async def __aenter__(self) -> DHT:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- who we are --------------------------------------------------------------------

    @property
    def peer_id(self) -> PeerID:
        """This peer's PeerID."""
        return self.node.peer_id

    @property
    def public_key(self) -> bytes:
        """This peer's raw Ed25519 public key (the owner of its signed records)."""
        return self.node.identity.public_key

    @property
    def address(self) -> PeerAddress:
        """The address others pass as an initial peer (``peerid@host:port``)."""
        return self.node.address

    def now(self) -> float:
        """The current time on the DHT's clock (Unix seconds)."""
        return self._clock()

    def owned_key(self, name: str | bytes) -> bytes:
        """A key or sub-key only this peer may write (its records are signed)."""
        return owner_bound_key(_as_bytes(name, "key name"), self.public_key)

    def known_peers(self) -> list[PeerAddress]:
        """The server-mode peers in the routing table, with their PeerIDs."""
        return self.dht_node.known_peers()

    # -- values ------------------------------------------------------------------------

    async def store(
        self,
        key: str | bytes,
        value: Any,
        expiration: float,
        *,
        subkey: str | bytes | None = None,
        sign: bool | None = None,
    ) -> bool:
        """Store ``value`` under ``key`` (or under ``subkey`` of the dictionary ``key``).

        Args:
            key: The key.
            value: Any msgpack-able value.
            expiration: Absolute expiry time (Unix seconds); the newest wins.
            subkey: Store one entry of a dictionary value instead of a plain value.
            sign: Sign with this peer's key. By default records are signed
                exactly when the key or sub-key is owned by this peer.

        Returns:
            Whether at least one replica holds the record now (``False`` when
            every replica kept a newer record).

        Raises:
            RecordRejectedError: Too large, bad expiration, or the key or
                sub-key is owned by somebody else.
            LookupFailedError: No replica could be reached.
            LocalProtocolError: The value cannot be encoded with msgpack.
        """
        key_bytes = _as_bytes(key, "key")
        subkey_bytes = None if subkey is None else _as_bytes(subkey, "sub-key")
        raw = pack_body(value)
        if isinstance(expiration, bool) or not isinstance(expiration, int | float):
            raise RecordRejectedError(f"an expiration is a number, got {expiration!r}")
        try:
            when = float(expiration)
        except OverflowError:
            raise RecordRejectedError("the expiration is out of range") from None
        if sign is None:
            bound = key_owner(key_bytes)
            if bound is None and subkey_bytes is not None:
                bound = key_owner(subkey_bytes)
            sign = bound == self.public_key
        owner = signature = None
        if sign:
            owner = self.public_key
            signature = sign_record(self.node.identity, key_bytes, subkey_bytes, raw, when)
        record = Record(key_bytes, raw, when, subkey_bytes, owner, signature)
        return await self.dht_node.store_record(record) > 0

    async def get(
        self, key: str | bytes, *, latest: bool = False
    ) -> ValueWithExpiration | DictionaryValue | None:
        """The value under ``key``: plain, a dictionary, or ``None`` if there is none.

        Args:
            key: The key.
            latest: Ask several replicas and merge (newest per sub-key) instead
                of returning the local copy or the first value found.

        Raises:
            LookupFailedError: No peer could be asked.
        """
        found = await self.dht_node.find_value(_as_bytes(key, "key"), latest=latest)
        if found is None:
            return None
        if isinstance(found, DictionaryRecord):
            return _dictionary(found)
        return _decoded(found)

    async def get_dictionary(self, key: str | bytes, *, latest: bool = True) -> DictionaryValue:
        """The dictionary under ``key`` (empty if there is none or it holds a plain value).

        ``latest`` defaults to ``True`` here: entries written by different
        peers are merged from several replicas.
        """
        found = await self.dht_node.find_value(_as_bytes(key, "key"), latest=latest)
        if isinstance(found, DictionaryRecord):
            return _dictionary(found)
        return DictionaryValue({})


def _decoded(record: Record) -> ValueWithExpiration | None:
    try:
        value = unpack_body(record.value, max_bytes=len(record.value))
    except RemoteProtocolError as exc:
        logger.warning("ignoring a DHT value that is not valid msgpack: %s", exc)
        return None
    return ValueWithExpiration(value, record.expiration, record.owner)


def _dictionary(found: DictionaryRecord) -> DictionaryValue:
    entries: dict[bytes, ValueWithExpiration] = {}
    for subkey, record in found.entries.items():
        decoded = _decoded(record)
        if decoded is not None:
            entries[subkey] = decoded
    return DictionaryValue(entries)
