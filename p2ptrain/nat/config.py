"""Configuration of NAT traversal: reachability, rendezvous, paths, relaying.

Two frozen dataclasses, validated on construction (:class:`ConfigError`):
:class:`RelayLimits` bounds what a public peer forwards for others, and
:class:`NATConfig` holds everything else. The WebRTC part (ICE servers, the ICE
deadline, data-channel tuning) is a
:class:`~p2ptrain.transport.webrtc_config.WebRTCConfig` inside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from p2ptrain.errors import ConfigError
from p2ptrain.node.address import PeerAddress
from p2ptrain.node.config import reuse_port_available
from p2ptrain.transport.webrtc_config import IceServer, WebRTCConfig
from p2ptrain.validate import check_integer, check_number

__all__ = ["ATTEMPTS", "NATConfig", "RelayLimits", "ice_server_from_url"]

MiB = 1 << 20

ATTEMPTS = ("tcp-direct", "tcp-reverse", "tcp-holepunch", "webrtc", "relay")
"""Every way of reaching a peer, cheapest first (see :mod:`p2ptrain.nat.paths`)."""


def _check_count(owner: str, name: str, value: object, low: int, high: int) -> None:
    check_integer(f"{owner}.{name}", value, at_least=low, at_most=high)


@dataclass(frozen=True)
class RelayLimits:
    """What a relaying peer forwards for others (see :mod:`p2ptrain.nat.relay`).

    Bytes are counted in both directions of a relayed pair together. A chunk
    waits for tokens in the pair's bucket and in the total bucket (that is
    the bandwidth bound); a circuit that would make a chunk wait longer than
    ``max_delay``, or that goes past ``circuit_bytes`` or ``circuit_seconds``,
    is closed with :class:`~p2ptrain.errors.ResourceExhaustedError` at both
    ends, and circuits beyond ``max_circuits`` are refused.

    Attributes:
        pair_bytes_per_s: Sustained rate of one relayed pair.
        pair_burst_bytes: Token-bucket depth of one pair.
        total_bytes_per_s: Sustained rate of everything this peer relays.
        total_burst_bytes: Token-bucket depth of the total.
        max_circuits: Relayed pairs at once.
        circuit_bytes: Bytes one circuit may carry in all, or None for no cap.
        circuit_seconds: How long one circuit may live, or None for no cap.
        max_delay: Longest a chunk may wait for tokens before the circuit is
            refused as over the limit.
    """

    pair_bytes_per_s: float = 8 * MiB
    pair_burst_bytes: int = 2 * MiB
    total_bytes_per_s: float = 32 * MiB
    total_burst_bytes: int = 8 * MiB
    max_circuits: int = 64
    circuit_bytes: int | None = None
    circuit_seconds: float | None = None
    max_delay: float = 10.0

    def __post_init__(self) -> None:
        owner = "RelayLimits"
        for name in ("pair_bytes_per_s", "total_bytes_per_s", "max_delay"):
            check_number(f"{owner}.{name}", getattr(self, name))
        check_number(f"{owner}.circuit_seconds", self.circuit_seconds, allow_none=True)
        for name in ("pair_burst_bytes", "total_burst_bytes"):
            _check_count(owner, name, getattr(self, name), 1024, 1 << 40)
        _check_count(owner, "max_circuits", self.max_circuits, 1, 100_000)
        if self.circuit_bytes is not None:
            _check_count(owner, "circuit_bytes", self.circuit_bytes, 1, 1 << 62)


def _default_webrtc() -> WebRTCConfig:
    return WebRTCConfig(connect_timeout=10.0)


@dataclass(frozen=True)
class NATConfig:
    """How a peer finds out whether it is reachable and how it reaches others.

    Attributes:
        public: True on a host others can dial (a bootstrap peer on a public
            address), False behind a NAT, None to find out with dial-backs.
        rendezvous: Addresses (``peerid@host:port``) of public peers to keep a
            connection to when behind NAT; more are taken from the DHT.
        rendezvous_count: Rendezvous points a NATed peer keeps at once.
        serve_rendezvous: A public peer forwards signaling for NATed peers
            registered with it.
        max_registrations: NATed peers one rendezvous point serves at once.
        stun_port: UDP port of the STUN responder of a public peer: None for
            the same number as its TCP listener, 0 for any free port.
        stun_servers: Extra STUN servers (``host:port``) for NAT type
            detection, besides the public peers.
        stun_timeout: Seconds one STUN query may take (with retransmissions).
        dialback_timeout: Seconds a public peer tries to dial a caller back.
        holepunch: Try TCP hole punching (simultaneous open) between NATs.
            It needs ``SO_REUSEPORT``: on by default where the platform has
            it (Linux, macOS), off elsewhere (Windows).
        webrtc: ICE servers (STUN, TURN), the ICE deadline
            (``connect_timeout``) and data-channel tuning. Without a STUN
            server of its own, a peer uses its rendezvous point's responder.
        relay: Opt in to forwarding frames for other peers (public peers only).
        relay_limits: Bounds of that forwarding.
        use_relays: Fall back to a public peer's forwarding when every other
            path failed.
        attempts: The attempts path selection may make, a subset of
            :data:`ATTEMPTS` (always made in that order).
        direct_timeout: Seconds to open a direct TCP connection.
        holepunch_timeout: Seconds for a hole punch, from the first message
            through the rendezvous to the authenticated connection.
        relay_timeout: Seconds to open a relayed connection.
        signal_timeout: Seconds one step of a signaling exchange through a
            rendezvous point may take (opening the circuit, each answer).
        signal_circuit_seconds: How long a rendezvous point keeps a signaling
            circuit open (it carries the WebRTC offer and answer and stays
            open while ICE runs, so that a failure reaches the other side).
        max_signal_messages: Messages one signaling circuit may carry.
        record_ttl: Lifetime of the peer record published in the DHT.
        republish_interval: Seconds between two publications of the record.
        retry_interval: Seconds before a lost rendezvous registration is
            replaced, and before a failed one is tried again.
    """

    public: bool | None = None
    rendezvous: tuple[str, ...] = ()
    rendezvous_count: int = 2
    serve_rendezvous: bool = True
    max_registrations: int = 1024
    stun_port: int | None = None
    stun_servers: tuple[str, ...] = ()
    stun_timeout: float = 2.0
    dialback_timeout: float = 3.0
    holepunch: bool = field(default_factory=reuse_port_available)
    webrtc: WebRTCConfig = field(default_factory=_default_webrtc)
    relay: bool = False
    relay_limits: RelayLimits = field(default_factory=RelayLimits)
    use_relays: bool = True
    attempts: tuple[str, ...] = ATTEMPTS
    direct_timeout: float = 3.0
    holepunch_timeout: float = 5.0
    relay_timeout: float = 10.0
    signal_timeout: float = 10.0
    signal_circuit_seconds: float = 60.0
    max_signal_messages: int = 16
    record_ttl: float = 600.0
    republish_interval: float = 240.0
    retry_interval: float = 5.0

    def __post_init__(self) -> None:
        owner = "NATConfig"
        if self.public is not None and not isinstance(self.public, bool):
            raise ConfigError(f"NATConfig.public must be True, False or None, got {self.public!r}")
        for name in ("serve_rendezvous", "holepunch", "relay", "use_relays"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"NATConfig.{name} must be a bool")
        if self.holepunch and not reuse_port_available():
            raise ConfigError("NATConfig.holepunch needs SO_REUSEPORT, which this platform lacks")
        if isinstance(self.rendezvous, str) or isinstance(self.stun_servers, str):
            raise ConfigError("NATConfig.rendezvous and stun_servers are sequences, not strings")
        object.__setattr__(self, "rendezvous", tuple(self.rendezvous))
        object.__setattr__(self, "stun_servers", tuple(self.stun_servers))
        if isinstance(self.attempts, str):
            raise ConfigError("NATConfig.attempts is a sequence of attempt names")
        object.__setattr__(self, "attempts", tuple(self.attempts))
        unknown = [name for name in self.attempts if name not in ATTEMPTS]
        if unknown:
            raise ConfigError(f"unknown attempts {unknown} (known: {', '.join(ATTEMPTS)})")
        for text in self.rendezvous:
            if not isinstance(text, str) or PeerAddress.parse(text).peer_id is None:
                raise ConfigError(f"a rendezvous address needs a PeerID: {text!r}")
        for text in self.stun_servers:
            if not isinstance(text, str):
                raise ConfigError(f"a STUN server is a 'host:port' string, got {text!r}")
            PeerAddress.parse(text)
        _check_count(owner, "rendezvous_count", self.rendezvous_count, 1, 16)
        _check_count(owner, "max_registrations", self.max_registrations, 1, 1_000_000)
        _check_count(owner, "max_signal_messages", self.max_signal_messages, 4, 1024)
        if self.stun_port is not None:
            _check_count(owner, "stun_port", self.stun_port, 0, 65535)
        for name in (
            "stun_timeout",
            "dialback_timeout",
            "direct_timeout",
            "holepunch_timeout",
            "relay_timeout",
            "signal_timeout",
            "signal_circuit_seconds",
            "record_ttl",
            "republish_interval",
            "retry_interval",
        ):
            check_number(f"{owner}.{name}", getattr(self, name))
        if self.republish_interval >= self.record_ttl:
            raise ConfigError("NATConfig.republish_interval must be below record_ttl")
        if not isinstance(self.webrtc, WebRTCConfig):
            raise ConfigError("NATConfig.webrtc must be a WebRTCConfig")
        if not isinstance(self.relay_limits, RelayLimits):
            raise ConfigError("NATConfig.relay_limits must be a RelayLimits")

    @property
    def has_turn(self) -> bool:
        """Whether a TURN server is configured for WebRTC."""
        return any(s.url.startswith(("turn:", "turns:")) for s in self.webrtc.ice_servers)

    @property
    def has_stun(self) -> bool:
        """Whether a STUN server is configured for WebRTC."""
        return any(s.url.startswith(("stun:", "stuns:")) for s in self.webrtc.ice_servers)


def ice_server_from_url(text: str) -> IceServer:
    """An ICE server from one URL, credentials inline for TURN.

    ``stun:host:port``, or ``turn:user:password@host:port[?transport=udp]``
    (also ``turns:``); the password may not contain ``@``.

    Raises:
        ConfigError: Not such a URL, or TURN without credentials.
    """
    scheme, sep, rest = text.partition(":")
    if not sep or scheme not in ("stun", "stuns", "turn", "turns") or not rest:
        raise ConfigError(f"an ICE server URL looks like stun:host:port, got {text!r}")
    username = credential = None
    if "@" in rest:
        userinfo, rest = rest.rsplit("@", 1)
        username, sep, credential = userinfo.partition(":")
        if not sep or not username:
            raise ConfigError(f"credentials in {scheme}:... URLs are user:password@, got {text!r}")
    endpoint = rest.split("?", 1)[0]
    PeerAddress.parse(endpoint)  # host:port, or a ConfigError naming the mistake
    return IceServer(f"{scheme}:{rest}", username, credential)
