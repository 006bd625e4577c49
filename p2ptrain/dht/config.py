"""Configuration of the Kademlia DHT: one frozen dataclass, validated on creation.

Every pure DHT component (:mod:`~p2ptrain.dht.routing`,
:mod:`~p2ptrain.dht.lookup`, :mod:`~p2ptrain.dht.storage`) and the networked
node read their limits and timings from the same :class:`DHTConfig`, so one
object describes how a peer behaves. All durations are seconds and all sizes
are bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from p2ptrain.errors import ConfigError
from p2ptrain.validate import check_integer, check_number

__all__ = ["DHTConfig"]

_INT_FIELDS_MIN_ONE = (
    "k",
    "alpha",
    "max_key_bytes",
    "max_value_bytes",
    "max_subkeys",
    "max_subkeys_per_owner",
    "max_records",
    "max_store_bytes",
    "max_bytes_per_source",
    "max_failures",
    "replacement_cache_size",
)
_POSITIVE_DURATIONS = (
    "max_expiration_horizon",
    "refresh_interval",
    "republish_interval",
    "ping_timeout",
)


@dataclass(frozen=True, slots=True)
class DHTConfig:
    """Limits and timings of one DHT peer.

    Attributes:
        k: Bucket size and the number of closest nodes a lookup returns
            (Kademlia's *k*).
        alpha: How many queries an iterative lookup keeps in flight at once
            (Kademlia's *α*).
        replicas: How many of the closest nodes a value is stored on. ``None``
            means *k*; see :attr:`effective_replicas`. At most *k*, because a
            lookup only returns *k* nodes.
        max_key_bytes: Longest accepted key, and longest accepted dictionary
            sub-key.
        max_value_bytes: Longest accepted value (the msgpack-encoded bytes the
            node stores). 64 KiB by default.
        max_subkeys: Most sub-keys one dictionary value may hold at a time.
            When full, a new entry of a higher rank (signed over unsigned,
            owner-bound over signed) takes the place of the lowest-ranked
            entry that expires first; otherwise it is refused.
        max_subkeys_per_owner: Most live sub-keys of one dictionary signed
            by one owner, so one identity cannot fill a shared dictionary
            (the package's own records use one sub-key per peer).
        max_store_bytes: Most bytes of records (keys, sub-keys, values and a
            fixed overhead each) one node stores.
        max_bytes_per_source: Most of those bytes the records sent by one
            source (one host) may take; records a node stores itself are
            only counted in ``max_store_bytes``.
        max_records: Most entries (plain values plus dictionary sub-keys) one
            store holds; further new entries are refused until some expire.
        max_expiration_horizon: How far past ``now`` an expiration time may
            lie. Records announcing a later expiration are refused, so nobody
            pins data on other peers forever.
        refresh_interval: A bucket that saw no contact for this long is
            refreshed by a lookup of a random id inside it (Kademlia's
            *tRefresh*).
        republish_interval: How often a peer re-stores the records it holds
            on the current closest nodes (Kademlia's *tReplicate*).
        max_contacts_per_reply: Most contacts a lookup takes from one FIND
            reply; the rest are ignored, so a peer answering with thousands of
            bogus contacts cannot inflate the lookup's state. ``None`` means
            *k*; see :attr:`effective_max_contacts_per_reply`.
        max_failures: Consecutive failed requests after which a contact is
            dropped from the routing table (and a replacement promoted).
        replacement_cache_size: Most replacement candidates kept per bucket
            (newcomers seen while the bucket was full).
        ping_timeout: How long the routing table waits for the result of the
            PING it asked for before it asks again; the node should give up on
            that PING sooner than this.
        max_per_subnet: Most contacts of one bucket from one public /24
            (IPv4) or /64 (IPv6), so one operator's addresses cannot fill the
            buckets (an S/Kademlia-style diversity limit). Loopback, private
            and other non-global addresses are exempt (a LAN swarm). ``None``
            disables the limit.
        relaxed_split: Also split a full bucket that does not hold our own id
            when the newcomer would be among the *k* closest contacts to our
            own id (Kademlia paper, section 4.2), so a peer knows its whole
            neighbourhood even when it is unevenly populated.
    """

    k: int = 20
    alpha: int = 3
    replicas: int | None = None
    max_key_bytes: int = 512
    max_value_bytes: int = 64 * 1024
    max_subkeys: int = 256
    max_subkeys_per_owner: int = 16
    max_records: int = 100_000
    max_store_bytes: int = 256 * 1024 * 1024
    max_bytes_per_source: int = 32 * 1024 * 1024
    max_expiration_horizon: float = 24 * 3600.0
    refresh_interval: float = 3600.0
    republish_interval: float = 3600.0
    max_contacts_per_reply: int | None = None
    max_failures: int = 3
    replacement_cache_size: int = 20
    ping_timeout: float = 10.0
    relaxed_split: bool = True
    max_per_subnet: int | None = 2

    def __post_init__(self) -> None:
        for name in _INT_FIELDS_MIN_ONE:
            check_integer(f"DHTConfig.{name}", getattr(self, name), at_least=1)
        for name in _POSITIVE_DURATIONS:
            check_number(f"DHTConfig.{name}", getattr(self, name))
        for name in ("replicas", "max_contacts_per_reply", "max_per_subnet"):
            check_integer(f"DHTConfig.{name}", getattr(self, name), at_least=1, allow_none=True)
        if self.replicas is not None and self.replicas > self.k:
            raise ConfigError(
                f"DHTConfig.replicas ({self.replicas}) cannot exceed k ({self.k}):"
                " a lookup only returns k nodes"
            )
        if not isinstance(self.relaxed_split, bool):
            raise ConfigError(f"DHTConfig.relaxed_split must be a bool, got {self.relaxed_split!r}")

    @property
    def effective_replicas(self) -> int:
        """The number of nodes a value is stored on (``replicas``, or *k*)."""
        return self.k if self.replicas is None else self.replicas

    @property
    def effective_max_contacts_per_reply(self) -> int:
        """The cap on contacts taken from one reply (``max_contacts_per_reply``, or *k*)."""
        return self.k if self.max_contacts_per_reply is None else self.max_contacts_per_reply
