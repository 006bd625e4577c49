"""Configuration of WebRTC data-channel transports.

Two frozen dataclasses, validated on construction (:class:`ConfigError`):
:class:`IceServer` names one STUN or TURN server, :class:`WebRTCConfig` holds
everything a :func:`~p2ptrain.transport.webrtc_connect.webrtc_connect` needs
besides the signaling channel. :class:`SctpTuning` (in
:mod:`p2ptrain.transport.webrtc_sctp`) tunes aiortc's SCTP stack and is part of
the config.

``WebRTCConfig()`` is the tuned default; :meth:`WebRTCConfig.stock` gives what
plain aiortc does (64 KiB messages, default socket buffers, untouched SCTP),
which the benchmark compares against.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from p2ptrain.errors import ConfigError
from p2ptrain.transport.webrtc_sctp import SctpTuning
from p2ptrain.validate import check_integer

__all__ = ["MAX_MESSAGE_BYTES", "IcePolicy", "IceServer", "WebRTCConfig"]

MAX_MESSAGE_BYTES = 262_144
"""The largest data-channel message aiortc accepts (the ``max-message-size`` it
advertises in its SDP). Every message is cut into ~1160-byte SCTP chunks anyway."""

_MIN_MESSAGE_BYTES = 1024
_MAX_CHANNELS = 16
_SCHEMES = ("stun:", "turn:", "turns:", "stuns:")

IcePolicy = Literal["all", "relay"]
"""``all``: host, server-reflexive and relayed candidates; ``relay``: only TURN."""


@dataclass(frozen=True)
class IceServer:
    """One STUN or TURN server.

    Attributes:
        url: ``stun:host:port`` or ``turn:host:port?transport=udp``.
        username: TURN long-term credential user (None for STUN).
        credential: TURN password (None for STUN).
    """

    url: str
    username: str | None = None
    credential: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.startswith(_SCHEMES):
            raise ConfigError(f"an ICE server URL starts with stun: or turn:, got {self.url!r}")
        is_turn = self.url.startswith(("turn:", "turns:"))
        if is_turn and (not self.username or self.credential is None):
            raise ConfigError(f"TURN server {self.url} needs a username and a credential")

    @classmethod
    def from_rtc(cls, servers: Iterable[Any]) -> tuple[IceServer, ...]:
        """Convert aiortc ``RTCIceServer`` objects (one URL or a list each)."""
        converted: list[IceServer] = []
        for server in servers:
            urls = server.urls if isinstance(server.urls, list) else [server.urls]
            converted.extend(cls(url, server.username, server.credential) for url in urls)
        return tuple(converted)

    def to_rtc(self) -> Any:
        """This server as an aiortc ``RTCIceServer``."""
        from aiortc import RTCIceServer  # noqa: PLC0415 - heavy import, needed only here

        return RTCIceServer(urls=self.url, username=self.username, credential=self.credential)


@dataclass(frozen=True)
class WebRTCConfig:
    """How WebRTC transports are established and tuned.

    Attributes:
        ice_servers: STUN/TURN servers. Always explicit: an empty tuple means
            host candidates only (aiortc would otherwise contact a public STUN
            server). aioice uses the first STUN and the first TURN server.
        ice_policy: ``"relay"`` forces TURN (no direct path is even tried).
        message_bytes: Largest data-channel message sent (the byte stream of
            frames is cut into messages of this size); capped at the remote's
            advertised ``max-message-size``.
        channels: Data channels the byte stream is striped over, round-robin
            (both sides use the initiator's count). They share one SCTP
            association, so more than one rarely helps; see docs/webrtc.md.
        high_water: Bytes queued in the data channels above which
            ``send_frame`` waits.
        low_water: Queued bytes at which waiting senders resume
            (``bufferedamountlow``).
        socket_buffer_bytes: SO_RCVBUF and SO_SNDBUF asked for on every ICE
            socket (SO_*BUFFORCE when allowed, so rmem_max does not cap it);
            None keeps aioice's setting.
        connect_timeout: Seconds from the first signaling message to open data
            channels; past it the attempt fails with NATTraversalError (aioice
            alone gives up only after ~64 s against a symmetric NAT).
        close_timeout: Seconds a graceful close waits for the peer to take what
            is queued before the connection is torn down anyway.
        sctp: Tuning of aiortc's SCTP stack, or None to leave it untouched.
    """

    ice_servers: tuple[IceServer, ...] = ()
    ice_policy: IcePolicy = "all"
    message_bytes: int = MAX_MESSAGE_BYTES
    channels: int = 1
    high_water: int = 1 << 20
    low_water: int = 512 * 1024
    socket_buffer_bytes: int | None = 4 << 20
    connect_timeout: float = 15.0
    close_timeout: float = 5.0
    sctp: SctpTuning | None = field(default_factory=SctpTuning)

    def __post_init__(self) -> None:
        if not isinstance(self.ice_servers, tuple) or not all(
            isinstance(server, IceServer) for server in self.ice_servers
        ):
            raise ConfigError("ice_servers must be a tuple of IceServer")
        if self.ice_policy not in ("all", "relay"):
            raise ConfigError(f"ice_policy must be 'all' or 'relay', got {self.ice_policy!r}")
        if self.ice_policy == "relay" and not any(
            server.url.startswith(("turn:", "turns:")) for server in self.ice_servers
        ):
            raise ConfigError("ice_policy 'relay' needs a TURN server in ice_servers")
        check_integer(
            "WebRTCConfig.message_bytes",
            self.message_bytes,
            at_least=_MIN_MESSAGE_BYTES,
            at_most=MAX_MESSAGE_BYTES,
        )
        check_integer("WebRTCConfig.channels", self.channels, at_least=1, at_most=_MAX_CHANNELS)
        if not 0 <= self.low_water < self.high_water:
            raise ConfigError("need 0 <= low_water < high_water")
        if self.high_water < self.message_bytes:
            raise ConfigError("high_water must be at least one message (message_bytes)")
        if self.socket_buffer_bytes is not None and not (
            64 * 1024 <= self.socket_buffer_bytes <= 256 << 20
        ):
            raise ConfigError("socket_buffer_bytes must be in [64 KiB, 256 MiB] or None")
        for name in ("connect_timeout", "close_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive")
        if self.sctp is not None and not isinstance(self.sctp, SctpTuning):
            raise ConfigError("sctp must be an SctpTuning or None")

    @classmethod
    def stock(cls, ice_servers: tuple[IceServer, ...] = (), **changes: Any) -> WebRTCConfig:
        """What an untuned aiortc application does: 64 KiB messages, one channel,
        aioice's socket buffers, aiortc's SCTP as shipped."""
        base = cls(
            ice_servers=ice_servers,
            message_bytes=64 * 1024,
            socket_buffer_bytes=None,
            sctp=None,
        )
        return dataclasses.replace(base, **changes)

    def rtc_configuration(self) -> Any:
        """The aiortc ``RTCConfiguration`` (the ICE server list is always explicit)."""
        from aiortc import RTCConfiguration, RTCIceTransportPolicy  # noqa: PLC0415

        policy = RTCIceTransportPolicy.RELAY if self.ice_policy == "relay" else None
        servers = [server.to_rtc() for server in self.ice_servers]
        if policy is None:
            return RTCConfiguration(iceServers=servers)
        return RTCConfiguration(iceServers=servers, iceTransportPolicy=policy)
