"""What one peer needs to join a swarm: :class:`PeerConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from p2ptrain.allreduce.bandwidth import ThroughputConfig
from p2ptrain.allreduce.matchmaking import MatchmakingConfig
from p2ptrain.dht.node_config import DHTNodeConfig
from p2ptrain.errors import ConfigError
from p2ptrain.measure.probe import DEFAULT_PROBE_SECONDS, MAX_PROBE_SECONDS
from p2ptrain.node.address import is_loopback_host
from p2ptrain.node.config import NodeConfig
from p2ptrain.validate import check_number

if TYPE_CHECKING:  # p2ptrain.nat imports aiortc: loaded only when a peer traverses NATs
    from p2ptrain.nat.config import NATConfig

__all__ = ["PeerConfig"]


@dataclass(frozen=True)
class PeerConfig:
    """Everything one peer needs to join a swarm.

    Attributes:
        node: How the node listens, dials and admits peers (swarm name,
            admission secret, limits).
        dht: The DHT: initial peers to bootstrap from, client mode (a peer
            that cannot accept connections), timings.
        matchmaking: How averaging groups form (window, timeouts, sizes).
        throughput: Typed-in rates (optional caps on what is measured); its
            other fields configure the sender-side :class:`ThroughputMeter`.
        identity_path: A key file (created if absent) so that the peer keeps
            its PeerID across restarts; ``None`` uses a fresh identity.
        default_bytes_per_s: The bandwidth announced for a direction before
            any transfer was measured (and with no typed-in rate).
        join_timeout: Seconds an all-reduce stream from another member may
            wait for this peer to enter the round.
        start_timeout: Seconds :meth:`Peer.start` may take (bootstrap included).
        close_timeout: Seconds :meth:`Peer.close` waits for a clean shutdown.
        use_uvloop: Run the loop on uvloop (default: when installed).
        probe_seconds: Seconds each direction of the timed bandwidth probe of
            the initial peers lasts (at start, and after a round that ran
            late); ``None`` never probes.
        nat: NAT traversal (reachability, rendezvous, hole punching, WebRTC,
            relays): ``"auto"`` (the default, as ``p2ptrain train``) is
            ``NATConfig()`` unless the node listens on a loopback address;
            ``None`` dials plain TCP only (LAN, loopback).
    """

    node: NodeConfig = field(default_factory=NodeConfig)
    dht: DHTNodeConfig = field(default_factory=DHTNodeConfig)
    matchmaking: MatchmakingConfig = field(default_factory=MatchmakingConfig)
    throughput: ThroughputConfig = field(default_factory=ThroughputConfig)
    identity_path: str | Path | None = None
    default_bytes_per_s: float = 12.5e6
    join_timeout: float = 10.0
    start_timeout: float = 60.0
    close_timeout: float = 10.0
    use_uvloop: bool | None = None
    probe_seconds: float | None = DEFAULT_PROBE_SECONDS
    nat: NATConfig | Literal["auto"] | None = "auto"

    def __post_init__(self) -> None:
        checks = (
            ("node", NodeConfig),
            ("dht", DHTNodeConfig),
            ("matchmaking", MatchmakingConfig),
            ("throughput", ThroughputConfig),
        )
        for name, kind in checks:
            if not isinstance(getattr(self, name), kind):
                raise ConfigError(f"PeerConfig.{name} must be a {kind.__name__}")
        if self.identity_path is not None and not isinstance(self.identity_path, str | Path):
            raise ConfigError("PeerConfig.identity_path must be a path or None")
        for name in ("default_bytes_per_s", "join_timeout", "start_timeout", "close_timeout"):
            check_number(f"PeerConfig.{name}", getattr(self, name))
        if self.use_uvloop is not None and not isinstance(self.use_uvloop, bool):
            raise ConfigError("PeerConfig.use_uvloop must be a bool or None")
        probe = self.probe_seconds
        if probe is not None and (
            isinstance(probe, bool)
            or not isinstance(probe, int | float)
            or not 0 < probe <= MAX_PROBE_SECONDS
        ):
            raise ConfigError(
                f"PeerConfig.probe_seconds must be None or in (0, {MAX_PROBE_SECONDS}]"
            )
        if self.nat is not None and self.nat != "auto":
            from p2ptrain.nat.config import NATConfig  # noqa: PLC0415 - see TYPE_CHECKING

            if not isinstance(self.nat, NATConfig):
                raise ConfigError("PeerConfig.nat must be a NATConfig, 'auto' or None")

    def nat_config(self) -> NATConfig | None:
        """The NAT traversal this peer runs (``"auto"`` resolved), or ``None``."""
        if self.nat != "auto":
            return self.nat
        if is_loopback_host(self.node.host):
            return None
        from p2ptrain.nat.config import NATConfig  # noqa: PLC0415 - see TYPE_CHECKING

        return NATConfig()
