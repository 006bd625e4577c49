"""The group plan: who takes part in a round, who reduces which part, and until when.

Every member of a round must hold the same :class:`GroupPlan`. A leader (the
matchmaking layer) builds it, typically from the load-balancing LP with
:meth:`GroupPlan.from_shares`, and sends :meth:`GroupPlan.to_wire` to the
others, who rebuild it with :meth:`GroupPlan.from_wire`. Peers prove they hold
the same plan by sending its :attr:`GroupPlan.digest` with their first message
to each reducer; a reducer refuses parts sent under any other plan.

Deadlines are durations measured by each member from the moment it enters the
round, so that members need no synchronised clocks; the leader should hand
the plan to everybody at about the same time.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Final

from p2ptrain.allreduce.partition import shares_to_boundaries
from p2ptrain.errors import ConfigError, IdentityError, RemoteProtocolError
from p2ptrain.node.address import PeerAddress
from p2ptrain.secure.identity import PeerID
from p2ptrain.wire.frames import pack_body
from p2ptrain.wire.tensors import short_repr

__all__ = [
    "DEFAULT_CHUNK_ELEMENTS",
    "MAX_CHUNK_ELEMENTS",
    "MAX_MEMBERS",
    "GroupMember",
    "GroupPlan",
    "new_round_id",
]

DEFAULT_CHUNK_ELEMENTS: Final = 1 << 20
"""Elements per streamed chunk unless the plan says otherwise (4 MiB of float32).

Every chunk costs a fixed amount of CPU (two messages per sender, a reduction
step), which on loopback outweighs the finer overlap of smaller chunks: 4 peers
averaging 64-256 MiB spent ~1 CPU s per GiB less with 4 MiB chunks than with
1 MiB (docs/benchmarks.md). On a slow link a chunk adds about its own
transfer time to the round (0.3 s at 100 Mbit/s)."""
MAX_CHUNK_ELEMENTS: Final = 1 << 21
"""Largest chunk a plan may ask for (8 MiB of float32: one frame, well under its limit)."""
MAX_MEMBERS: Final = 1024
"""Largest group a plan may describe."""
_MAX_ROUND_ID = 64
_MAX_ELEMENTS = 1 << 40


def new_round_id() -> bytes:
    """A fresh random round id (16 bytes)."""
    return os.urandom(16)


@dataclass(frozen=True, slots=True)
class GroupMember:
    """One member of a group.

    Attributes:
        peer_id: Who the member is; the handshake proves it.
        address: Where it accepts connections. ``None`` for a member in client
            mode, which cannot accept connections and so must own no part.
    """

    peer_id: PeerID
    address: PeerAddress | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.peer_id, PeerID):
            raise ConfigError(f"peer_id must be a PeerID, got {short_repr(self.peer_id)}")
        if self.address is not None:
            if not isinstance(self.address, PeerAddress):
                raise ConfigError(f"address must be a PeerAddress, got {self.address!r}")
            if self.address.peer_id not in (None, self.peer_id):
                raise ConfigError("the address names another peer than the member")

    @property
    def dial_address(self) -> PeerAddress:
        """The address bound to the member's PeerID (so nobody else can answer)."""
        if self.address is None:
            raise ConfigError(f"member {self.peer_id.short} has no address (client mode)")
        return self.address.with_peer(self.peer_id)


@dataclass(frozen=True)
class GroupPlan:
    """Everything the members of one round must agree on.

    Member *i* reduces elements ``[boundaries[i], boundaries[i + 1])`` of the
    flat vector; an empty range (share 0, e.g. a client-mode member) means it
    only sends its parts and receives the averages. Parts travel in chunks of
    ``chunk_elements`` elements, counted from the start of each member's range.

    Attributes:
        round_id: Names the round (1 to 64 bytes); never reuse one.
        members: The members, in the order of ``boundaries``; distinct PeerIDs.
        boundaries: ``len(members) + 1`` non-decreasing ints from 0 to the
            vector's length.
        chunk_elements: Elements per streamed chunk.
        reduce_timeout: Seconds after entering the round until which a reducer
            waits for parts; senders that have not delivered by then are left
            out of the chunks still open.
        round_timeout: Seconds after entering the round when the call returns
            whatever happened; parts whose average has not arrived keep their
            local values. Larger than ``reduce_timeout``.
        predicted_time: The round time the load balancer predicted, if any, to
            compare with the achieved time in the report.
    """

    round_id: bytes
    members: tuple[GroupMember, ...]
    boundaries: tuple[int, ...]
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS
    reduce_timeout: float = 30.0
    round_timeout: float = 60.0
    predicted_time: float | None = None
    _index: dict[PeerID, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.round_id, bytes) or not 0 < len(self.round_id) <= _MAX_ROUND_ID:
            raise ConfigError(f"round_id must be 1 to {_MAX_ROUND_ID} bytes")
        members = tuple(self.members)
        object.__setattr__(self, "members", members)
        if not 0 < len(members) <= MAX_MEMBERS:
            raise ConfigError(f"a group has 1 to {MAX_MEMBERS} members, got {len(members)}")
        if not all(isinstance(m, GroupMember) for m in members):
            raise ConfigError("members must be GroupMember instances")
        index = {m.peer_id: i for i, m in enumerate(members)}
        if len(index) != len(members):
            raise ConfigError("a PeerID appears twice among the members")
        object.__setattr__(self, "_index", index)
        bounds = tuple(self.boundaries)
        object.__setattr__(self, "boundaries", bounds)
        if len(bounds) != len(members) + 1:
            raise ConfigError(f"expected {len(members) + 1} boundaries, got {len(bounds)}")
        if any(isinstance(b, bool) or not isinstance(b, int) for b in bounds):
            raise ConfigError("boundaries must be ints")
        if bounds[0] != 0 or any(a > b for a, b in itertools.pairwise(bounds)):
            raise ConfigError("boundaries must start at 0 and never decrease")
        if bounds[-1] > _MAX_ELEMENTS:
            raise ConfigError(f"a vector may have at most {_MAX_ELEMENTS} elements")
        for i, member in enumerate(members):
            if bounds[i + 1] > bounds[i] and member.address is None:
                raise ConfigError(f"member {i} owns a part but has no address (client mode)")
        chunk = self.chunk_elements
        if isinstance(chunk, bool) or not isinstance(chunk, int):
            raise ConfigError("chunk_elements must be an int")
        if not 1 <= chunk <= MAX_CHUNK_ELEMENTS:
            raise ConfigError(f"chunk_elements must be in [1, {MAX_CHUNK_ELEMENTS}]")
        for name in ("reduce_timeout", "round_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"{name} must be a number")
            if not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name} must be positive and finite")
        if self.reduce_timeout >= self.round_timeout:
            raise ConfigError("reduce_timeout must be shorter than round_timeout")
        predicted = self.predicted_time
        if predicted is not None and (
            isinstance(predicted, bool)
            or not isinstance(predicted, int | float)
            or not math.isfinite(predicted)
            or predicted < 0
        ):
            raise ConfigError("predicted_time must be None or finite and >= 0")

    # -- construction ------------------------------------------------------------------

    @classmethod
    def from_shares(
        cls,
        members: Sequence[GroupMember],
        shares: Sequence[float],
        num_elements: int,
        *,
        round_id: bytes | None = None,
        chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
        reduce_timeout: float = 30.0,
        round_timeout: float = 60.0,
        predicted_time: float | None = None,
    ) -> GroupPlan:
        """Build a plan from fractional shares, e.g. ``LoadBalancePlan.shares``.

        Args:
            members: The members, in the order of ``shares``.
            shares: One share per member, at least 0, summing to 1; members
                without an address must have share 0.
            num_elements: Length of the flat vector.
            round_id: The round's id; a fresh random one by default.
            chunk_elements: Elements per streamed chunk.
            reduce_timeout: See the class attributes.
            round_timeout: See the class attributes.
            predicted_time: See the class attributes (``LoadBalancePlan.round_time_s``).

        Raises:
            ConfigError: On invalid arguments.
        """
        if len(shares) != len(members):
            raise ConfigError(f"expected {len(members)} shares, got {len(shares)}")
        boundaries = shares_to_boundaries(shares, num_elements)
        return cls(
            round_id=new_round_id() if round_id is None else round_id,
            members=tuple(members),
            boundaries=tuple(boundaries),
            chunk_elements=chunk_elements,
            reduce_timeout=reduce_timeout,
            round_timeout=round_timeout,
            predicted_time=predicted_time,
        )

    # -- queries -----------------------------------------------------------------------

    @property
    def size(self) -> int:
        """Number of members."""
        return len(self.members)

    @property
    def num_elements(self) -> int:
        """Length of the flat vector."""
        return self.boundaries[-1]

    def index_of(self, peer_id: PeerID) -> int | None:
        """The member index of ``peer_id``, or None if it is not a member."""
        return self._index.get(peer_id)

    def part(self, index: int) -> tuple[int, int]:
        """``(start, stop)`` of the elements member ``index`` reduces."""
        return self.boundaries[index], self.boundaries[index + 1]

    def chunks(self, index: int) -> list[tuple[int, int]]:
        """``(start, stop)`` of every chunk of member ``index``'s part, in order."""
        start, stop = self.part(index)
        step = self.chunk_elements
        return [(lo, min(lo + step, stop)) for lo in range(start, stop, step)]

    def reducers(self) -> list[int]:
        """Indices of the members that own a non-empty part."""
        return [i for i in range(self.size) if self.boundaries[i + 1] > self.boundaries[i]]

    # -- wire form ---------------------------------------------------------------------

    def to_wire(self) -> dict[str, Any]:
        """The msgpack-able form of the plan (see docs/allreduce.md)."""
        return {
            "v": 1,
            "r": self.round_id,
            "m": [
                [m.peer_id.digest, None if m.address is None else m.address.endpoint]
                for m in self.members
            ],
            "b": list(self.boundaries),
            "c": self.chunk_elements,
            "ts": float(self.reduce_timeout),
            "tr": float(self.round_timeout),
            "p": None if self.predicted_time is None else float(self.predicted_time),
        }

    @cached_property
    def digest(self) -> bytes:
        """SHA-256 of the canonical msgpack encoding of :meth:`to_wire`."""
        return hashlib.sha256(pack_body(self.to_wire())).digest()

    @classmethod
    def from_wire(cls, data: object) -> GroupPlan:
        """Rebuild a plan received from the network.

        Raises:
            RemoteProtocolError: The data is not a valid plan.
        """
        try:
            return cls._from_wire(data)
        except (ConfigError, IdentityError) as exc:
            raise RemoteProtocolError(f"invalid group plan: {exc}") from exc

    @classmethod
    def _from_wire(cls, data: object) -> GroupPlan:
        if not isinstance(data, Mapping) or data.get("v") != 1:
            raise ConfigError("expected a version-1 plan map")
        keys = {"v", "r", "m", "b", "c", "ts", "tr", "p"}
        if set(data) != keys:
            raise ConfigError(f"plan keys must be exactly {sorted(keys)}")
        raw_members = data["m"]
        if not isinstance(raw_members, list) or len(raw_members) > MAX_MEMBERS:
            raise ConfigError("members must be a list")
        members = []
        for item in raw_members:
            if not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], bytes):
                raise ConfigError(f"bad member entry {short_repr(item)}")
            peer_id = PeerID(item[0])
            endpoint = item[1]
            if endpoint is not None and not isinstance(endpoint, str):
                raise ConfigError(f"bad member address {short_repr(endpoint)}")
            address = None if endpoint is None else PeerAddress.parse(endpoint)
            members.append(GroupMember(peer_id, address))
        bounds = data["b"]
        if not isinstance(bounds, list):
            raise ConfigError("boundaries must be a list")
        predicted = data["p"]
        return cls(
            round_id=data["r"],
            members=tuple(members),
            boundaries=tuple(bounds),
            chunk_elements=data["c"],
            reduce_timeout=data["ts"],
            round_timeout=data["tr"],
            predicted_time=predicted,
        )
