"""Matchmaking: peers that want to average under one key gather into a group.

Theory of operation
-------------------
1. **Announce.** Each peer stores an entry in the DHT dictionary
   ``matchmaking/<key>`` under a sub-key bound to its own public key (so the
   entry is signed and nobody can announce in its name): its address (none in
   client mode) and its capacity (upload and download bytes/s, samples/s,
   whether it computes).
2. **Gather.** It re-reads the dictionary every ``poll_interval`` until the
   group is full (``target_group_size``) or ``window`` seconds have passed.
   A candidate asking it to lead (step 3) has read enough to elect: it
   reads again at once rather than at its next poll.
3. **Elect.** The leader is the live candidate with the smallest PeerID among
   those that accept connections. A candidate asks each smaller candidate, in
   order, whether it is still matchmaking for this key (``mm.ready``); the
   first that answers leads. If none answers, the candidate leads itself.
   Client-mode peers never lead; they only wait for a plan. The question
   carries the asker's announcement, and the peer asked takes the asker as a
   candidate: DHT reads can miss an announcement (a replica that did not
   store it yet), and a candidate that found its leader must not be left out
   of the leader's group because the leader did not read it.
   A candidate that was told "ready" follows the peer it asked. If that peer
   then finds a smaller leader itself, it passes its followers on, each with
   the peer it follows: in its own ``mm.ready`` question to that leader and
   in its answer to the leader's check. The leader checks them too, naming
   the peer each follows (a follower answers a check only through the peer
   it follows), and a follower takes a plan that lists the peer it follows
   as well as one from that peer itself.
4. **Plan.** The leader asks every announced peer ``mm.ready`` in parallel,
   then the followers those name; those that answer in time form the group
   (peers that left are dropped here). If at least ``min_group_size``
   remain, it solves the load-balancing LP over their capacities and sends
   every member the plan (``mm.plan``); otherwise it tells them the round
   is off (``mm.plan`` with no plan).
   A peer that a leader took while it gathered or asked around (the
   leader's check has its word, or the plan came) stops at once, in the
   middle of a DHT read or a question if need be: what it would learn no
   longer matters, and the group's all-reduce waits for its part.
5. Every member returns the plan; the caller runs the all-reduce with it.
   A member that gets no plan within ``plan_timeout`` raises
   :class:`~p2ptrain.errors.MatchmakingError` and carries on alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from p2ptrain.allreduce.fairshare import fair_share_round_time
from p2ptrain.allreduce.group import DEFAULT_CHUNK_ELEMENTS, GroupMember, GroupPlan
from p2ptrain.allreduce.lp import LoadBalancer
from p2ptrain.allreduce.partition import PeerCapacity
from p2ptrain.dht.api import DHT, DictionaryValue
from p2ptrain.dht.records import key_owner
from p2ptrain.errors import (
    ConfigError,
    InvalidArgumentError,
    MatchmakingError,
    P2PTrainError,
    PermissionDeniedError,
    RemoteProtocolError,
)
from p2ptrain.node.address import PeerAddress
from p2ptrain.rpc.handlers import CallContext, Message
from p2ptrain.secure.identity import PeerID

__all__ = [
    "MIN_CHUNK_ELEMENTS",
    "BalancedPlan",
    "Balancer",
    "Matchmaker",
    "MatchmakingConfig",
    "plan_from_wire",
    "plan_to_wire",
]

MIN_CHUNK_ELEMENTS = 1 << 16
"""The smallest chunk a plan is cut into (256 KiB of float32), however slow the links."""

logger = logging.getLogger(__name__)

T = TypeVar("T")

READY_METHOD = "mm.ready"
PLAN_METHOD = "mm.plan"
_KEY_PREFIX = "matchmaking/"
_MEMBER_SUBKEY = b"member"
_MAX_ASKED = 1024
"""Candidates taken from ``mm.ready`` questions per key, at most."""
_MAX_REDIRECTS = 3
"""Hops an election follows from a candidate to the leader it names."""


@dataclass(frozen=True)
class MatchmakingConfig:
    """How groups are formed.

    Attributes:
        target_group_size: stop gathering as soon as this many peers announced.
        min_group_size: fewer live peers than this and the round is off.
        window: seconds to gather announcements.
        lone_wait: seconds a peer that is still alone when its window closes
            keeps gathering, if more peers were expected (``form_group``'s
            ``expected``): peers of a swarm reach a step moments apart, and
            one that gives up alone steps on its local average and must
            then download the swarm's state.
        poll_interval: seconds between reads of the announcements.
        ready_timeout: seconds the leader waits for each peer's ``mm.ready``.
        plan_timeout: seconds after the window a member waits for a plan.
        reduce_timeout: the plan's reduce timeout (see GroupPlan).
        round_timeout: the plan's round timeout (see GroupPlan).
        chunk_elements: the plan's largest chunk, in elements.
        chunk_seconds: a chunk is cut smaller, down to :data:`MIN_CHUNK_ELEMENTS`,
            so that it takes at most about this long on the slowest member's
            announced upload: a chunk is one frame, and a small message on the
            same connection (a request, a flow-control credit, the next
            round's matchmaking) waits behind the frame being sent.
        max_share_factor: if set, the leader's plan gives no member more
            than this many times an equal share (``1/n`` of the vector in a
            group of ``n``), passed to the balancer as ``max_share``: a bound
            on the busiest member's upload, which grows with its share
            (grouped averaging sets it; ``None``: the LP alone decides).
    """

    target_group_size: int = 64
    min_group_size: int = 2
    window: float = 3.0
    lone_wait: float = 3.0
    poll_interval: float = 0.2
    ready_timeout: float = 2.0
    plan_timeout: float = 10.0
    reduce_timeout: float = 30.0
    round_timeout: float = 60.0
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS
    chunk_seconds: float = 0.05
    max_share_factor: float | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.min_group_size <= self.target_group_size:
            raise ConfigError("need 1 <= min_group_size <= target_group_size")
        for name in ("window", "poll_interval", "ready_timeout", "plan_timeout", "chunk_seconds"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive")
        if not (isinstance(self.lone_wait, int | float) and 0 <= self.lone_wait < math.inf):
            raise ConfigError("lone_wait must be >= 0 and finite")
        if not 0 < self.reduce_timeout < self.round_timeout:
            raise ConfigError("need 0 < reduce_timeout < round_timeout")
        factor = self.max_share_factor
        number = isinstance(factor, int | float) and not isinstance(factor, bool)
        if factor is not None and not (number and 1 <= factor < math.inf):
            raise ConfigError(f"max_share_factor must be None or a number >= 1, got {factor!r}")


class BalancedPlan(Protocol):
    """What a load balancer returns: a share per peer and the predicted time."""

    @property
    def shares(self) -> Sequence[float]: ...

    @property
    def round_time_s(self) -> float: ...


class Balancer(Protocol):
    """Anything that splits the vector among peers (LoadBalancer is one).

    Shares are one per peer, >= 0, summing to 1, and 0 for client-mode peers.
    With :attr:`MatchmakingConfig.max_share_factor` set, ``plan`` is also
    given a ``max_share`` keyword (see :meth:`LoadBalancer.plan`).
    """

    def plan(
        self, peers: Sequence[PeerCapacity], *, vector_bytes: int, target_batch_size: int
    ) -> BalancedPlan: ...


@dataclass(frozen=True)
class _Candidate:
    peer_id: PeerID
    address: PeerAddress | None
    capacity: PeerCapacity


def plan_to_wire(plan: GroupPlan) -> dict[str, Any]:
    """A GroupPlan as a msgpack-able dict (:meth:`GroupPlan.to_wire`)."""
    return plan.to_wire()


def plan_from_wire(body: Any) -> GroupPlan:
    """Parse a plan received from the network (InvalidArgumentError if malformed)."""
    try:
        return GroupPlan.from_wire(body)
    except RemoteProtocolError as exc:
        raise InvalidArgumentError(str(exc)) from exc


def _capacity_to_wire(capacity: PeerCapacity) -> dict[str, Any]:
    return {
        "u": capacity.upload_bytes_per_s,
        "d": capacity.download_bytes_per_s,
        "s": capacity.samples_per_s,
        "x": capacity.computes,
        "r": capacity.rtt_s,
    }


def _parse_candidate(subkey: bytes, value: Any) -> _Candidate | None:
    owner = key_owner(subkey)
    if owner is None:
        return None
    try:
        peer_id = PeerID.from_public_key(owner)
    except (TypeError, ValueError, P2PTrainError):
        return None
    return _parse_announcement(peer_id, value)


def _parse_announcement(peer_id: PeerID, value: Any) -> _Candidate | None:
    """The candidate ``peer_id`` announces with ``value`` (None if malformed)."""
    if not isinstance(value, dict):
        return None
    try:
        raw_address = value.get("a")
        address = PeerAddress.parse(raw_address) if isinstance(raw_address, str) else None
        capacity = PeerCapacity(
            upload_bytes_per_s=float(value["u"]),
            download_bytes_per_s=float(value["d"]),
            samples_per_s=float(value.get("s", 0.0)),
            client_mode=address is None,
            computes=bool(value.get("x", True)),
            rtt_s=float(value.get("r", 0.0)),
        )
    except (KeyError, TypeError, ValueError, P2PTrainError):
        return None
    return _Candidate(peer_id, address, capacity)


def _announcement_to_wire(candidate: _Candidate) -> dict[str, Any]:
    value = _capacity_to_wire(candidate.capacity)
    value["a"] = None if candidate.address is None else str(candidate.address)
    return value


def _parse_followers(raw: Any) -> list[tuple[_Candidate, PeerID]]:
    """Followers named in a message, each with the peer it follows.

    On the wire: ``[digest, announcement, followed digest]`` triples;
    malformed ones are skipped.
    """
    if not isinstance(raw, list):
        return []
    followers = []
    for item in raw[:_MAX_ASKED]:
        if not (isinstance(item, list | tuple) and len(item) == 3):
            continue
        digest, announcement, followed = item
        try:
            peer_id, via = PeerID(digest), PeerID(followed)
        except (TypeError, ValueError, P2PTrainError):
            continue
        follower = _parse_announcement(peer_id, announcement)
        if follower is not None:
            followers.append((follower, via))
    return followers


def _parse_check_reply(body: Any) -> list[tuple[_Candidate, PeerID]] | None:
    """A check's answer: the followers the peer names if it is ready, else None."""
    if body is True:
        return []
    if isinstance(body, dict) and body.get("ok") is True:
        return _parse_followers(body.get("f"))
    return None


class Matchmaker:
    """Forms groups over the DHT; one per node.

    Args:
        dht: the DHT, sharing the node the all-reduce runs on.
        config: timings and group sizes.
        capacity: called for this peer's current capacity when announcing.
        client_mode: this peer cannot accept connections (never leads, owns no part).
        balancer: the load balancer: :class:`LoadBalancer` (the LP) by default, or
            any :class:`Balancer`, e.g. equal shares for a baseline.
    """

    def __init__(
        self,
        *,
        dht: DHT,
        config: MatchmakingConfig | None = None,
        capacity: Callable[[], PeerCapacity],
        client_mode: bool = False,
        balancer: Balancer | None = None,
    ) -> None:
        self.dht = dht
        self.config = config or MatchmakingConfig()
        self._capacity = capacity
        self.client_mode = client_mode
        self._balancer: Balancer = balancer or LoadBalancer()
        self._waiting: dict[str, asyncio.Future[GroupPlan | None]] = {}
        # Candidates that asked us mm.ready with their announcement, per key.
        self._asked: dict[str, dict[PeerID, _Candidate]] = {}
        # Followers of those askers, named in their questions, with the peer
        # each follows, per key.
        self._forwarded: dict[str, dict[PeerID, tuple[_Candidate, PeerID]]] = {}
        # Leaders that checked us through the peer we follow, per key: we take their plans.
        self._joined: dict[str, set[PeerID]] = {}
        # Keys whose group this peer leads and has closed: it is ready for no one else.
        self._sealed: set[str] = set()
        # The leader this peer elected per key: it answers and takes plans from it only.
        self._leader: dict[str, _Candidate] = {}
        # Keys whose group this peer has begun to lead.
        self._leading: set[str] = set()
        # Set per key once a leader took us (its plan arrived, or we promised it).
        self._taken: dict[str, asyncio.Event] = {}
        # Set per key when a candidate asks us to lead it while we gather: it
        # read enough announcements to elect, so we read again at once.
        self._asked_news: dict[str, asyncio.Event] = {}
        handlers = dht.node.handlers
        handlers.add_unary(READY_METHOD, self._on_ready)
        handlers.add_unary(PLAN_METHOD, self._on_plan)

    def close(self) -> None:
        """Stop serving matchmaking RPCs."""
        self.dht.node.handlers.remove(READY_METHOD)
        self.dht.node.handlers.remove(PLAN_METHOD)

    async def form_group(
        self,
        key: str,
        *,
        num_elements: int,
        bytes_per_element: int = 4,
        target_batch_size: int = 1,
        expected: int | None = None,
        due: asyncio.Event | None = None,
        count_by: Callable[[PeerID], object] | None = None,
    ) -> GroupPlan:
        """Join the group for ``key`` and return its plan.

        Args:
            expected: Stop gathering once this many peers announced (default
                ``target_group_size``). The group still takes every peer that
                announced by then, up to ``target_group_size``: an expectation
                from a stale view must not leave out a live peer that already
                announced.
            due: For matchmaking started ahead of a step: set when this
                peer's step is due. Until then gathering waits for the
                expected peers without a deadline; the window counts from
                the moment it is set. (Counted from an early start, the
                window could close before the last peer finished its batch,
                and the group formed without it.)
            count_by: Count toward ``expected`` the distinct values of this
                function of the announcers' PeerIDs instead of the announcers
                (a column of grouped averaging waits for one member of every
                group, however many members of one group announced).

        Raises:
            MatchmakingError: no group formed (too few live peers, or no plan arrived).
        """
        if key in self._waiting:
            raise ConfigError(f"already matchmaking for {key!r}")
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[GroupPlan | None] = loop.create_future()
        self._waiting[key] = waiter
        self._taken[key] = asyncio.Event()
        self._asked_news[key] = asyncio.Event()
        self._asked[key] = {}
        self._forwarded[key] = {}
        try:
            await self._announce(key)
            candidates = await self._gather(key, expected, due, count_by)
            # A leader that checked us while we gathered has our word: we wait for its plan.
            if not self.client_mode and not waiter.done() and key not in self._leader:
                leader = await self._elect(key, candidates)
                if leader is not None:
                    # A check during the election may have taken our word first: keep it.
                    self._leader.setdefault(key, leader)
                elif not waiter.done() and key not in self._leader:
                    await self._lead(
                        key,
                        candidates,
                        num_elements * bytes_per_element,
                        num_elements,
                        target_batch_size,
                    )
            try:
                async with asyncio.timeout(self.config.plan_timeout):
                    plan = await waiter
            except TimeoutError:
                raise MatchmakingError(f"no group plan for {key!r} arrived in time") from None
            if plan is None:
                raise MatchmakingError(f"too few live peers for {key!r}")
            return plan
        finally:
            self._waiting.pop(key, None)
            self._asked.pop(key, None)
            self._forwarded.pop(key, None)
            self._joined.pop(key, None)
            self._sealed.discard(key)
            self._leader.pop(key, None)
            self._taken.pop(key, None)
            self._asked_news.pop(key, None)
            self._leading.discard(key)

    # -- steps ---------------------------------------------------------------------------

    async def _announce(self, key: str) -> None:
        value = _announcement_to_wire(self._me())
        expiration = self.dht.now() + self.config.window + self.config.plan_timeout + 30
        await self.dht.store(
            _KEY_PREFIX + key, value, expiration, subkey=self.dht.owned_key(_MEMBER_SUBKEY)
        )

    async def _read(self, key: str) -> list[_Candidate]:
        entries: DictionaryValue = await self.dht.get_dictionary(_KEY_PREFIX + key)
        found = (_parse_candidate(sub, item.value) for sub, item in entries.items())
        unique = {c.peer_id: c for c in found if c is not None}
        return self._with_known(key, unique)

    def _with_known(self, key: str, found: dict[PeerID, _Candidate]) -> list[_Candidate]:
        """``found`` with this peer and the candidates that asked it ``mm.ready``, sorted."""
        merged = {**self._asked.get(key, {}), **found}
        me = self.dht.peer_id
        if me not in merged:  # our own announcement may not be readable yet
            merged[me] = self._me()
        return sorted(merged.values(), key=lambda c: c.peer_id)

    def _me(self) -> _Candidate:
        address = None if self.client_mode else self.dht.address
        return _Candidate(self.dht.peer_id, address, self._capacity())

    @staticmethod
    def _truncate(candidates: list[_Candidate], size: int, me: PeerID) -> list[_Candidate]:
        """The first ``size`` candidates, this peer always among them."""
        kept = candidates[:size]
        if all(c.peer_id != me for c in kept):
            kept = [*kept[: size - 1], *(c for c in candidates if c.peer_id == me)]
        return kept

    async def _gather(
        self,
        key: str,
        expected: int | None = None,
        due: asyncio.Event | None = None,
        count_by: Callable[[PeerID], object] | None = None,
    ) -> list[_Candidate]:
        loop = asyncio.get_running_loop()
        enough = self.config.target_group_size
        if expected is not None:
            enough = max(1, min(expected, enough))

        def count(candidates: list[_Candidate]) -> int:
            if count_by is None:
                return len(candidates)
            return len({count_by(c.peer_id) for c in candidates})

        # Set once a leader's plan arrived or a leader's check has our word:
        # what we would gather no longer matters (we neither elect nor lead),
        # so it ends a read in flight and a pause between reads.
        taken = self._taken.get(key) or asyncio.Event()
        # Set when a candidate asks us to lead it: it has read enough to
        # elect, so its announcements (and likely the others') are readable
        # now. It ends the pause; the next poll would come up to a whole
        # ``poll_interval`` later.
        asked = self._asked_news.get(key) or asyncio.Event()

        async def read() -> list[_Candidate]:
            asked.clear()
            found = await self._unless_taken(key, self._read(key))
            return self._with_known(key, {}) if found is None else found

        async def pause(seconds: float) -> None:
            waits = [asyncio.ensure_future(e.wait()) for e in (taken, asked)]
            try:
                await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()

        while due is not None and not due.is_set():
            candidates = await read()
            if taken.is_set() or count(candidates) >= enough:
                return self._truncate(candidates, self.config.target_group_size, self.dht.peer_id)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(due.wait(), self.config.poll_interval)
        deadline = loop.time() + self.config.window
        others_expected = expected is not None and enough > 1
        lone_deadline = deadline + (self.config.lone_wait if others_expected else 0.0)
        while True:
            candidates = await read()
            now = loop.time()
            alone = len(candidates) < self.config.min_group_size
            if (
                taken.is_set()
                or count(candidates) >= enough
                or now >= lone_deadline
                or (now >= deadline and not alone)
            ):
                return self._truncate(candidates, self.config.target_group_size, self.dht.peer_id)
            until = deadline if now < deadline else lone_deadline
            await pause(min(self.config.poll_interval, max(0.0, until - now)))

    async def _elect(self, key: str, candidates: list[_Candidate]) -> _Candidate | None:
        """The live leader smaller than us, or None if we lead.

        A candidate that already elected its leader names it instead of
        answering: we follow (a few hops), so that a peer whose DHT reads
        missed the leader still joins its group.
        """
        me = self.dht.peer_id
        for candidate in candidates:
            if candidate.peer_id >= me:
                break
            asked: _Candidate | None = candidate
            for _ in range(_MAX_REDIRECTS):
                if asked is None or asked.address is None or asked.peer_id == me:
                    break
                # A leader's check may take our word while we ask around: we
                # then wait for its plan (asking on, one candidate after
                # another, kept a whole group waiting for our part).
                answer = await self._unless_taken(key, self._probe(asked, key))
                if answer is None:
                    return None
                if answer is True:
                    return asked
                asked = answer if isinstance(answer, _Candidate) else None
        return None

    async def _unless_taken(self, key: str, work: Coroutine[Any, Any, T]) -> T | None:
        """``work``'s result, or ``None`` (``work`` cancelled) once a leader took us for ``key``."""
        taken = self._taken.get(key)
        if taken is None:
            return await work
        working = asyncio.ensure_future(work)
        waking = asyncio.ensure_future(taken.wait())
        try:
            await asyncio.wait({working, waking}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waking.cancel()
            if not working.done():
                working.cancel()
            await asyncio.gather(working, waking, return_exceptions=True)
        return None if working.cancelled() else working.result()

    async def _probe(self, candidate: _Candidate, key: str) -> bool | _Candidate:
        """Ask ``candidate`` to lead us: True, False, or the leader it elected."""
        if candidate.address is None:
            return False
        request: dict[str, Any] = {"k": key, "c": _announcement_to_wire(self._me())}
        followers = self._followers_to_wire(key)
        if followers:
            request["f"] = followers
        try:
            reply = await self.dht.node.call(
                candidate.address.with_peer(candidate.peer_id),
                READY_METHOD,
                request,
                timeout=self.config.ready_timeout,
            )
        except P2PTrainError as exc:
            logger.debug("%s is not ready for %s: %s", candidate.peer_id.short, key, exc)
            return False
        body = reply.body
        if body is True:
            return True
        if isinstance(body, dict) and isinstance(body.get("l"), bytes):
            try:
                leader = PeerID(body["l"])
            except P2PTrainError:
                return False
            return _parse_announcement(leader, {"a": body.get("a"), "u": 1.0, "d": 1.0}) or False
        return False

    async def _lead(
        self,
        key: str,
        candidates: list[_Candidate],
        vector_bytes: int,
        num_elements: int,
        target_batch_size: int,
    ) -> None:
        me = self.dht.peer_id
        self._leading.add(key)
        # Candidates that asked us while we gathered join those we read.
        known = {c.peer_id: c for c in candidates}
        for peer, asker in self._asked.get(key, {}).items():
            if len(known) >= self.config.target_group_size:
                break
            known.setdefault(peer, asker)
        candidates = sorted(known.values(), key=lambda c: c.peer_id)
        others = [c for c in candidates if c.peer_id != me]
        answers = await asyncio.gather(*(self._is_ready(c, key) for c in others))
        members = [c for c in candidates if c.peer_id == me] or [self._me()]
        members += [c for c, named in zip(others, answers, strict=True) if named is not None]
        # The followers our members named (or their questions did), checked
        # through the peer each follows: it waits for that peer's plan.
        taken = {c.peer_id for c in members}
        named = dict(self._forwarded.get(key, {}))
        for followers in answers:
            named.update((f.peer_id, (f, via)) for f, via in followers or ())
        unchecked = [(f, via) for peer, (f, via) in named.items() if peer not in taken]
        if unchecked:
            second = await asyncio.gather(*(self._is_ready(f, key, via) for f, via in unchecked))
            for (follower, _), answer in zip(unchecked, second, strict=True):
                if answer is not None:  # each named once: ``named`` is keyed by peer
                    taken.add(follower.peer_id)
                    members.append(follower)
        # Those that asked us while we checked were told we lead: they are live.
        for peer, asker in self._asked.get(key, {}).items():
            if peer not in known and peer not in taken:
                taken.add(peer)
                members.append(asker)
        members = members[: self.config.target_group_size]
        self._sealed.add(key)
        members.sort(key=lambda c: c.peer_id)
        plan: GroupPlan | None = None
        if len(members) >= self.config.min_group_size:
            plan = await self._plan(members, vector_bytes, num_elements, target_batch_size)
            logger.debug("leading a group of %d for %s", len(members), key)
        else:
            logger.debug("too few live peers for %s (%d)", key, len(members))
        body = None if plan is None else plan_to_wire(plan)
        await asyncio.gather(
            *(self._send_plan(c, key, body) for c in members if c.peer_id != me),
        )
        waiter = self._waiting.get(key)
        if waiter is not None and not waiter.done():
            waiter.set_result(plan)

    async def _plan(
        self,
        members: list[_Candidate],
        vector_bytes: int,
        num_elements: int,
        target_batch_size: int,
    ) -> GroupPlan:
        capacities = [c.capacity for c in members]
        factor = self.config.max_share_factor
        bound = {} if factor is None else {"max_share": factor / len(members)}
        balanced = self._balancer.plan(
            capacities,
            vector_bytes=max(1, vector_bytes),
            target_batch_size=max(1, target_batch_size),
            **bound,
        )
        # What the plan will take when TCP shares the links fairly (the LP's own
        # time assumes the plan's proportions): a round is late only against this.
        # A simulation of up to tens of milliseconds: off the event loop.
        predicted = await asyncio.to_thread(
            fair_share_round_time, balanced.shares, capacities, max(1, vector_bytes)
        )
        cfg = self.config
        return GroupPlan.from_shares(
            [GroupMember(c.peer_id, c.address) for c in members],
            balanced.shares,
            num_elements,
            chunk_elements=self._chunk_elements(members, vector_bytes / max(1, num_elements)),
            reduce_timeout=cfg.reduce_timeout,
            round_timeout=cfg.round_timeout,
            predicted_time=predicted if math.isfinite(predicted) else None,
        )

    def _chunk_elements(self, members: list[_Candidate], bytes_per_element: float) -> int:
        """The plan's chunk: ``chunk_seconds`` of the slowest announced upload, within bounds."""
        cfg = self.config
        slowest = min(c.capacity.upload_bytes_per_s for c in members)
        fits = int(slowest * cfg.chunk_seconds / max(bytes_per_element, 1.0))
        return min(cfg.chunk_elements, max(MIN_CHUNK_ELEMENTS, fits))

    def _check_request(self, key: str, via: PeerID | None) -> dict[str, Any]:
        """A leader's ``mm.ready`` check: the key, where to find this leader,
        and for a named follower, the peer it follows."""
        request: dict[str, Any] = {
            "k": key,
            "lead": None if self.client_mode else str(self.dht.address),
        }
        if via is not None:
            request["via"] = via.digest
        return request

    async def _is_ready(
        self, candidate: _Candidate, key: str, via: PeerID | None = None
    ) -> list[tuple[_Candidate, PeerID]] | None:
        """Check ``candidate`` for our group: the followers it names, or None if not ready.

        ``via``: the peer that ``candidate`` follows, for a follower it named.
        """
        if candidate.address is None:
            return await self._client_is_ready(candidate, key, via)
        try:
            reply = await self.dht.node.call(
                candidate.address.with_peer(candidate.peer_id),
                READY_METHOD,
                self._check_request(key, via),
                timeout=self.config.ready_timeout,
            )
        except P2PTrainError as exc:
            logger.debug("%s is not ready for %s: %s", candidate.peer_id.short, key, exc)
            return None
        return _parse_check_reply(reply.body)

    async def _client_is_ready(
        self, candidate: _Candidate, key: str, via: PeerID | None
    ) -> list[tuple[_Candidate, PeerID]] | None:
        """A client-mode peer can only be asked over a connection it opened to us."""
        conn = self.dht.node.connection_to(candidate.peer_id)
        if conn is None:
            return None
        try:
            reply = await conn.call(
                READY_METHOD, self._check_request(key, via), timeout=self.config.ready_timeout
            )
        except P2PTrainError:
            return None
        return _parse_check_reply(reply.body)

    def _followers_to_wire(self, key: str) -> list[list[Any]]:
        """Those that follow us for ``key`` (asked us, or were named by those
        who did), as ``[digest, announcement, followed digest]``: at most a
        group's worth."""
        me = self.dht.peer_id
        followers = dict(self._forwarded.get(key, {}))
        followers.update((peer, (c, me)) for peer, c in self._asked.get(key, {}).items())
        followers.pop(me, None)
        chosen = sorted(followers.values(), key=lambda item: item[0].peer_id)
        return [
            [c.peer_id.digest, _announcement_to_wire(c), via.digest]
            for c, via in chosen[: self.config.target_group_size]
        ]

    async def _send_plan(self, member: _Candidate, key: str, body: Any) -> None:
        request = {"k": key, "plan": body}
        try:
            if member.address is not None:
                await self.dht.node.call(
                    member.address.with_peer(member.peer_id),
                    PLAN_METHOD,
                    request,
                    timeout=self.config.ready_timeout,
                )
                return
            conn = self.dht.node.connection_to(member.peer_id)
            if conn is not None:
                await conn.call(PLAN_METHOD, request, timeout=self.config.ready_timeout)
        except P2PTrainError as exc:
            logger.info("could not send the plan to %s: %s", member.peer_id.short, exc)

    # -- handlers ------------------------------------------------------------------------

    async def _on_ready(self, ctx: CallContext, request: Message) -> Message:
        body = request.body
        key = body.get("k") if isinstance(body, dict) else body
        waiter = self._waiting.get(key) if isinstance(key, str) else None
        ready = waiter is not None and not waiter.done() and key not in self._sealed
        leader = self._leader.get(key) if isinstance(key, str) else None
        via = body.get("via") if isinstance(body, dict) else None
        if ready and leader is not None and leader.peer_id != ctx.peer and isinstance(key, str):
            if via == leader.peer_id.digest:
                # The leader of the group the peer we follow joined checks us:
                # we take its plan too.
                self._joined.setdefault(key, set()).add(ctx.peer)
                return Message(True)
            # Promised to the leader we elected: name it to an asker that wants a leader.
            if isinstance(body, dict):
                address = None if leader.address is None else str(leader.address)
                return Message({"l": leader.peer_id.digest, "a": address})
            return Message(False)
        checking = not isinstance(body, dict) or "lead" in body
        if ready and checking and isinstance(key, str):
            # A leader checks that we are live for its group. Saying yes is a
            # promise: we must not then lead a group of our own (a lone one
            # would give up while the leader's round waits for our part).
            if key in self._leading:
                return Message(False)
            if leader is None:
                lead = body.get("lead") if isinstance(body, dict) else None
                self._leader[key] = _parse_announcement(
                    ctx.peer, {"a": lead, "u": 1.0, "d": 1.0}
                ) or _Candidate(ctx.peer, None, PeerCapacity(1.0, 1.0))
            self._mark_taken(key)
            followers = self._followers_to_wire(key)
            if followers:
                return Message({"ok": True, "f": followers})
        elif ready and isinstance(body, dict) and isinstance(key, str):
            asker = _parse_announcement(ctx.peer, body.get("c"))
            asked = self._asked.get(key)
            if asker is not None and asked is not None and len(asked) < _MAX_ASKED:
                asked[asker.peer_id] = asker
                news = self._asked_news.get(key)
                if news is not None:
                    news.set()
            forwarded = self._forwarded.get(key)
            if asker is not None and forwarded is not None:
                for follower, followed in _parse_followers(body.get("f")):
                    if len(forwarded) >= _MAX_ASKED:
                        break
                    forwarded.setdefault(follower.peer_id, (follower, followed))
        return Message(ready)

    async def _on_plan(self, ctx: CallContext, request: Message) -> Message:
        body = request.body
        if not isinstance(body, dict) or not isinstance(body.get("k"), str):
            raise InvalidArgumentError("mm.plan needs {k: key, plan: ...}")
        waiter = self._waiting.get(body["k"])
        if waiter is None or waiter.done():
            return Message(False)
        plan = None if body.get("plan") is None else plan_from_wire(body["plan"])
        if plan is not None and (
            plan.index_of(self.dht.peer_id) is None or plan.index_of(ctx.peer) is None
        ):
            raise PermissionDeniedError("a plan must come from a member and include us")
        # We wait for the plan of the leader we elected, or of the group it joined.
        key = body["k"]
        leader = self._leader.get(key)
        joined = ctx.peer in self._joined.get(key, ()) or (
            plan is not None and leader is not None and plan.index_of(leader.peer_id) is not None
        )
        if leader is not None and leader.peer_id != ctx.peer and not joined:
            return Message(False)
        waiter.set_result(plan)
        self._mark_taken(key)
        return Message(True)

    def _mark_taken(self, key: str) -> None:
        """A leader took us for ``key``: stop gathering (see :meth:`_gather`)."""
        event = self._taken.get(key)
        if event is not None:
            event.set()
