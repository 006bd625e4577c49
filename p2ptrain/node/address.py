"""Peer addresses: ``[peerid@]host:port`` (IPv6 hosts in brackets)."""

from __future__ import annotations

import functools
import ipaddress
from dataclasses import dataclass

from p2ptrain.errors import ConfigError, IdentityError
from p2ptrain.secure.identity import PeerID

__all__ = ["PeerAddress", "is_loopback_host"]


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (``localhost`` or an IP literal) is a loopback address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_unspecified_host(host: str) -> bool:
    """Whether ``host`` is 0.0.0.0 or ``::`` (listen everywhere), which nobody can dial."""
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


@dataclass(frozen=True)
class PeerAddress:
    """Where a peer listens, and optionally who it must be.

    With a ``peer_id`` the handshake refuses anybody else at that address;
    without one (a bootstrap address typed by a user) whoever answers is
    accepted and its PeerID learned.
    """

    host: str
    port: int
    peer_id: PeerID | None = None

    def __post_init__(self) -> None:
        if not self.host:
            raise ConfigError("an address needs a host")
        if not 0 < self.port < 65536:
            raise ConfigError(f"port {self.port} is out of range")

    @classmethod
    def parse(cls, text: str) -> PeerAddress:
        """Parse ``host:port``, ``peerid@host:port`` or ``peerid@[v6]:port``."""
        return _parse_cached(text)

    @classmethod
    def _parse(cls, text: str) -> PeerAddress:
        raw = text.strip()
        peer_id = None
        if "@" in raw:
            id_text, raw = raw.rsplit("@", 1)
            try:
                peer_id = PeerID.from_string(id_text)
            except IdentityError as exc:
                raise ConfigError(f"bad peer id in address {text!r}") from exc
        if raw.startswith("["):
            host, sep, rest = raw[1:].partition("]")
            if not sep or not rest.startswith(":"):
                raise ConfigError(f"bad address {text!r}: expected [v6-host]:port")
            port_text = rest[1:]
        else:
            host, sep, port_text = raw.rpartition(":")
            if not sep or ":" in host:
                raise ConfigError(f"bad address {text!r}: expected host:port or [v6-host]:port")
        if not port_text.isascii() or not port_text.isdigit() or len(port_text) > 5:
            raise ConfigError(f"bad port in address {text!r}")
        return cls(host, int(port_text), peer_id)

    @property
    def endpoint(self) -> str:
        """``host:port`` without the peer id."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def with_peer(self, peer_id: PeerID) -> PeerAddress:
        """The same endpoint bound to ``peer_id``."""
        return PeerAddress(self.host, self.port, peer_id)

    def __str__(self) -> str:
        if self.peer_id is None:
            return self.endpoint
        return f"{self.peer_id}@{self.endpoint}"


@functools.lru_cache(maxsize=4096)
def _parse_cached(text: str) -> PeerAddress:
    return PeerAddress._parse(text)
