"""Configuration of a networked DHT peer: the pure limits plus timings of the shell.

:class:`~p2ptrain.dht.config.DHTConfig` describes the Kademlia parameters every
pure component shares (*k*, *alpha*, sizes, expiration horizon, refresh and
republish intervals). :class:`DHTNodeConfig` wraps it with what only the
networked peer needs: whether it accepts connections (client mode), whom it
bootstraps from, how long it waits for other peers and how often its timers
run. The CLI maps its flags onto these two dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from p2ptrain.dht.config import DHTConfig
from p2ptrain.errors import ConfigError
from p2ptrain.node.address import PeerAddress
from p2ptrain.validate import check_integer, check_number

__all__ = ["DHTNodeConfig"]

MiB = 1 << 20


@dataclass(frozen=True)
class DHTNodeConfig:
    """How one networked DHT peer behaves.

    Attributes:
        dht: The Kademlia parameters and record limits (see :class:`DHTConfig`).
        client_mode: The peer cannot accept incoming connections: it queries
            and stores but announces no address, so it never enters other
            peers' routing tables and holds no records for others.
        initial_peers: Addresses to bootstrap from, ``host:port`` or
            ``peerid@host:port`` (with a PeerID the handshake refuses anybody
            else at that address).
        request_timeout: Seconds one request to another peer (dial included)
            may take before that peer counts as failed for this request.
        ping_timeout: Seconds to wait for the PING the routing table asks for
            when a bucket is full; below ``dht.ping_timeout``.
        maintenance_interval: Seconds between two runs of the timers (bucket
            refresh, republish, eviction of expired records). Refresh and
            republish themselves follow ``dht.refresh_interval`` and
            ``dht.republish_interval``; this is how often they are checked.
        max_records_per_request: Most records one STORE request may carry (the
            republish of a large dictionary is split into several requests).
            Senders split by their own value and receivers refuse more than
            theirs, so every peer of a swarm must use the same value.
        max_reply_bytes: Byte budget of the values in one reply. A dictionary
            larger than this is answered with the entries that expire last.
            Must stay below the peers' frame limit (16 MiB by default).
        republish_parallelism: Keys republished (or buckets refreshed) at once.
        hedge_delay: Seconds a plain get (``latest=False``) waits for the one
            closest candidate before it asks *alpha* peers at once. Most gets
            are answered by the first peer asked, so this saves the other
            queries; a failure or an answer without the value ends the wait at
            once. 0 asks *alpha* peers from the start.
        lookup_query_timeout: Least seconds a lookup waits for one query
            before it moves on to other candidates: it waits
            ``max(lookup_query_timeout, 4 x`` the smoothed duration of recent
            answered requests), at most ``request_timeout``. A query given up
            this way does not count against the peer in the routing table.
        verify_callers: Add a peer that calls us and announces an address to
            the routing table only after it answered a PING over a fresh
            connection to that address (at most 64 checks at once; more
            callers wait for a later call). A greeting PING is answered once
            the check ended (at most ``min(ping_timeout, request_timeout / 2)``),
            so a joining peer's lookup finds the peers that joined before it.
            A caller that answered is believed at that address for 10
            minutes: one whose bucket is full stays out of the table, and
            was probed again at every request it made.
            Off: callers enter at once, under whatever address they announce.
        get_quorum: Replicas a plain get asks before it believes an unsigned
            value (capped by ``replicas``); the value must be carried by more
            than half of the replies. Signed values need one reply.
    """

    dht: DHTConfig = field(default_factory=DHTConfig)
    client_mode: bool = False
    initial_peers: tuple[str, ...] = ()
    request_timeout: float = 5.0
    ping_timeout: float = 3.0
    maintenance_interval: float = 60.0
    max_records_per_request: int = 1024
    max_reply_bytes: int = 12 * MiB
    republish_parallelism: int = 8
    hedge_delay: float = 0.1
    get_quorum: int = 3
    verify_callers: bool = True
    lookup_query_timeout: float = 0.5

    def __post_init__(self) -> None:
        if not isinstance(self.dht, DHTConfig):
            raise ConfigError("DHTNodeConfig.dht must be a DHTConfig")
        if not isinstance(self.client_mode, bool):
            raise ConfigError("DHTNodeConfig.client_mode must be a bool")
        if isinstance(self.initial_peers, str):
            raise ConfigError("DHTNodeConfig.initial_peers is a sequence of addresses, not one")
        peers = tuple(self.initial_peers)
        for text in peers:
            if not isinstance(text, str):
                raise ConfigError(f"an initial peer is an address string, got {text!r}")
            PeerAddress.parse(text)  # raises ConfigError with the reason
        object.__setattr__(self, "initial_peers", peers)
        for name in (
            "request_timeout",
            "ping_timeout",
            "maintenance_interval",
            "lookup_query_timeout",
        ):
            check_number(f"DHTNodeConfig.{name}", getattr(self, name))
        check_number("DHTNodeConfig.hedge_delay", self.hedge_delay, at_least=0)
        if self.ping_timeout >= self.dht.ping_timeout:
            raise ConfigError(
                f"DHTNodeConfig.ping_timeout ({self.ping_timeout}) must be below"
                f" DHTConfig.ping_timeout ({self.dht.ping_timeout})"
            )
        for name in (
            "max_records_per_request",
            "max_reply_bytes",
            "republish_parallelism",
            "get_quorum",
        ):
            check_integer(f"DHTNodeConfig.{name}", getattr(self, name), at_least=1)
        if self.max_reply_bytes < self.dht.max_value_bytes:
            raise ConfigError("DHTNodeConfig.max_reply_bytes must hold at least one value")
