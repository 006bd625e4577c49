"""Configuration of the NAT lab: which homes, which public hosts, which links.

Two frozen dataclasses, validated on construction (:class:`ConfigError`):
:class:`HomeConfig` for one home network (its NAT type, its access link) and
:class:`LabConfig` for the whole lab.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, get_args

from p2ptrain.errors import ConfigError

__all__ = ["DEFAULT_HOMES", "HomeConfig", "LabConfig", "NatKind"]

NatKind = Literal["easy", "symmetric"]
"""``easy``: MASQUERADE, one external port per socket for every destination
(port-preserving, hole punching works). ``symmetric``: MASQUERADE
``--random-fully``, a new random external port per destination (needs a relay)."""

_NAME = re.compile(r"^[a-z][a-z0-9]{0,7}$")
_PREFIX = re.compile(r"^[a-z][a-z0-9]{0,9}$")
_TURN_WORD = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_RESERVED = frozenset({"inet", "turn"})
_MAX_ATTACHMENTS = 250


@dataclass(frozen=True)
class HomeConfig:
    """One home network: a host behind its own NAT router.

    Attributes:
        name: Short name (lowercase letter then up to 7 letters or digits); the
            home's host is the node of that name.
        nat: ``"easy"`` or ``"symmetric"`` (see :data:`NatKind`).
        upload_mbit: Upload rate of the access link in Mbit/s (tc tbf on the
            router's WAN side), or None for unshaped.
        download_mbit: Download rate in Mbit/s (tbf on the router's LAN side),
            or None for unshaped.
        delay_ms: One-way delay added to each direction of the access link by
            the user-space shim. The RTT from this home to a public host grows
            by ``2 * delay_ms``; between two homes by ``2 * (d1 + d2)``.
        loss: Probability that the shim drops a packet, in each direction
            independently (a round trip survives with ``(1 - loss) ** 2``).
        shaper_latency_ms: Longest time a packet may wait in a tbf queue
            (the queue size of the shaped link).
    """

    name: str
    nat: NatKind = "easy"
    upload_mbit: float | None = None
    download_mbit: float | None = None
    delay_ms: float = 0.0
    loss: float = 0.0
    shaper_latency_ms: float = 50.0

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ConfigError(f"home name must match {_NAME.pattern}, got {self.name!r}")
        if self.name in _RESERVED:
            raise ConfigError(f"home name {self.name!r} is reserved")
        if self.nat not in get_args(NatKind):
            raise ConfigError(f"nat must be one of {get_args(NatKind)}, got {self.nat!r}")
        for label, rate in (
            ("upload_mbit", self.upload_mbit),
            ("download_mbit", self.download_mbit),
        ):
            if rate is not None and not 0.01 <= rate <= 100_000:
                raise ConfigError(f"{label} must be in [0.01, 100000] or None, got {rate!r}")
        if not 0.0 <= self.delay_ms <= 10_000.0:
            raise ConfigError(f"delay_ms must be in [0, 10000], got {self.delay_ms!r}")
        if not 0.0 <= self.loss < 1.0:
            raise ConfigError(f"loss must be in [0, 1), got {self.loss!r}")
        if not 1.0 <= self.shaper_latency_ms <= 10_000.0:
            raise ConfigError(
                f"shaper_latency_ms must be in [1, 10000], got {self.shaper_latency_ms!r}"
            )

    @property
    def impaired(self) -> bool:
        """True when the home's link needs the delay/loss shim."""
        return self.delay_ms > 0.0 or self.loss > 0.0


DEFAULT_HOMES: tuple[HomeConfig, ...] = (
    HomeConfig("a", nat="easy"),
    HomeConfig("b", nat="easy"),
    HomeConfig("c", nat="symmetric"),
)
"""Two port-preserving homes and one symmetric home, all unshaped."""


@dataclass(frozen=True)
class LabConfig:
    """The whole NAT lab.

    Attributes:
        homes: The home networks, each a host behind its own NAT router.
        public_hosts: Names of hosts with a public address (e.g. a bootstrap
            peer); same naming rule as homes.
        turn: Run coturn on a public host named ``turn``.
        turn_username: Long-term credential user of the TURN server.
        turn_password: Its password.
        turn_realm: The TURN realm.
        prefix: Prefix of namespace names; see
            :func:`~p2ptrain.lab.natlab.netns.cleanup_stale_labs`.
        seed: Seed of the loss shims (home ``i`` uses ``seed + i``).
        ready_timeout_s: How long to wait for coturn and the shims to answer.
    """

    homes: tuple[HomeConfig, ...] = DEFAULT_HOMES
    public_hosts: tuple[str, ...] = ("boot",)
    turn: bool = True
    turn_username: str = "p2ptrain"
    turn_password: str = "natlab-secret"
    turn_realm: str = "natlab.p2ptrain.test"
    prefix: str = "p2pnl"
    seed: int = 0
    ready_timeout_s: float = 15.0

    def __post_init__(self) -> None:
        if not isinstance(self.homes, tuple) or not all(
            isinstance(home, HomeConfig) for home in self.homes
        ):
            raise ConfigError("homes must be a tuple of HomeConfig")
        for name in self.public_hosts:
            if not _NAME.match(name) or name in _RESERVED:
                raise ConfigError(f"bad public host name {name!r} (rule {_NAME.pattern})")
        names = [home.name for home in self.homes] + list(self.public_hosts)
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ConfigError(f"node names must be unique, repeated: {duplicates}")
        if len(names) + 1 > _MAX_ATTACHMENTS:
            raise ConfigError(f"at most {_MAX_ATTACHMENTS - 1} homes and public hosts")
        if not _PREFIX.match(self.prefix):
            raise ConfigError(f"prefix must match {_PREFIX.pattern}, got {self.prefix!r}")
        for label, word in (
            ("turn_username", self.turn_username),
            ("turn_password", self.turn_password),
            ("turn_realm", self.turn_realm),
        ):
            if not _TURN_WORD.match(word):
                raise ConfigError(f"{label} must match {_TURN_WORD.pattern}, got {word!r}")
        if not 0.5 <= self.ready_timeout_s <= 600.0:
            raise ConfigError(
                f"ready_timeout_s must be in [0.5, 600], got {self.ready_timeout_s!r}"
            )
