"""The networked Kademlia peer: RPC handlers, lookups over the network, timers.

Theory of operation
-------------------
A :class:`DHTNode` lives on a :class:`~p2ptrain.node.node.Node` (one identity,
one listener, one pooled connection per remote peer) and serves three unary
methods on it, ``dht.ping``, ``dht.find`` and ``dht.store``
(:mod:`~p2ptrain.dht.protocol`). All the decisions are made by the pure
components; this module only moves messages and keeps time:

* :class:`~p2ptrain.dht.routing.RoutingTable` learns a peer when it calls us
  and announces where it listens (its PeerID is the authenticated one of the
  connection), and when it answers one of our requests. A request that fails
  (timeout, refused dial, typed error, malformed reply) is counted with
  ``mark_failed``. A full bucket asks for a PING of its oldest contact; the
  PING runs as a background task of this node.
* :class:`~p2ptrain.dht.lookup.IterativeLookup` is driven by :meth:`_lookup`:
  it hands out up to *alpha* queries, each one a task owned by the lookup,
  which waits for the first to finish, feeds the reply (or the failure) back,
  and cancels whatever is still in flight when the lookup is done.
* :class:`~p2ptrain.dht.storage.RecordStore` holds the records sent to us.
  A record is validated before it is stored, and every value received in a
  reply is validated (:func:`~p2ptrain.dht.records.validate_for_read`) before
  the lookup sees it; a peer that sends an invalid one counts as failed.

Storing a record looks up the *k* nodes closest to the key and sends it to the
``replicas`` closest of them (ourselves included, unless in client mode); a
replica that fails is replaced by the next closest. Getting a value returns
the local copy when there is one, else the first valid value a FIND_VALUE
lookup finds if it is signed; an unsigned value is cross-checked: values are
collected from ``get_quorum`` replicas and an unsigned record is returned only
if more than half of the replies carry it
(:func:`~p2ptrain.dht.storage.agreed_value`), so a node whose id sits next
to the key cannot forge one. With ``latest=True`` values are collected from
up to ``replicas`` nodes and combined the same way (signed records: newest
valid signature wins, per dictionary sub-key). A key read with ``latest``
again within 30 s is not looked up again: the ``get_quorum`` closest of its
replicas found by the last lookup (or by our own store under it) are asked
directly, in one round, and a lookup runs only when none of them answers.

A plain get is *hedged*: it first asks only the closest candidate and
launches the other queries the lookup hands out when that one fails, answers
without the value, or is slower than ``hedge_delay``. The closest peer
usually holds the value, so a get usually costs one request instead of
*alpha*, and a silent peer delays it by at most ``hedge_delay``.

Timers run in one background loop every ``maintenance_interval`` seconds
(:meth:`maintain`, also callable directly with an explicit ``now``): expired
records are evicted, buckets idle for ``refresh_interval`` are refreshed by a
lookup of a random id in them, and every ``republish_interval`` the records we
hold are stored again on the current closest nodes of their keys.

All times are the injected ``clock`` (Unix seconds by default): record
expirations are absolute times that every peer compares with its own clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any, TypeVar

from p2ptrain.aio import BackgroundTasks
from p2ptrain.dht.config import DHTConfig
from p2ptrain.dht.expiring import ExpiringMap
from p2ptrain.dht.lookup import IterativeLookup, LookupMode, LookupResult
from p2ptrain.dht.node_config import DHTNodeConfig
from p2ptrain.dht.protocol import (
    METHOD_FIND,
    METHOD_PING,
    METHOD_STORE,
    FindReply,
    FindRequest,
    PingReply,
    PingRequest,
    StoreOutcome,
    StoreReply,
    StoreRequest,
    StoreStatus,
    known_digests,
    omit_known,
)
from p2ptrain.dht.records import (
    DictionaryRecord,
    Record,
    StoredValue,
    validate_for_read,
    validate_record,
)
from p2ptrain.dht.routing import AddStatus, Contact, NodeID, RoutingTable
from p2ptrain.dht.stats import RPCStats
from p2ptrain.dht.storage import RecordStore, agreed_value, merge_values
from p2ptrain.errors import (
    ConfigError,
    DeadlineExceededError,
    InvalidArgumentError,
    LookupFailedError,
    P2PTrainError,
    RecordRejectedError,
    RemoteProtocolError,
    ResourceExhaustedError,
)
from p2ptrain.node.address import PeerAddress
from p2ptrain.node.node import Node
from p2ptrain.rpc.handlers import CallContext, Message
from p2ptrain.secure.identity import PeerID

__all__ = ["DHTNode"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_FAILURES = (P2PTrainError, TimeoutError)
_LARGE_REPLY = 64 * 1024
"""Replies at least this large are charged to the node's reply budget."""
_UNRESPONSIVE_S = 30.0
"""Seconds later lookups skip an address a lookup gave up on (named in a reply)."""
_UNRESPONSIVE_MAX = 4096
_VERIFIED_S = 600.0
"""Seconds a caller that answered at its announced address is believed there."""
_VERIFIED_MAX = 4096
_HOLDERS_S = 1.0
"""Seconds a read with ``latest`` asks the replicas a lookup found, without a new lookup.

Short: the replicas one lookup finds can miss some a writer stored on (young
routing tables; a writer whose lookup gave up on a replica busy with a
tensor stores on the next one instead). In a simulated swarm of 128 a
column's announcements stayed unread for its whole 10 s window with 30 s
here; with 3 s, 256 peers' column members read their last group's
announcement about 3 s after it was stored (step 13.6 s, 10.7 s with 1 s).
A fresh lookup every second reads them."""
_HOLDERS_MAX = 1024
_READS_S = 30.0
"""Seconds the signed entries a ``latest`` read merged are kept, to poll only for changes."""
_READS_MAX = 256
_TIMER_SLACK_S = 1e-6
"""A wait that ends this close to its deadline counts as having reached it."""
_MAX_VERIFYING = 64
"""Callers whose announced address is checked at once (more wait for a later call)."""
"""What a request to another peer may fail with (typed errors and our own timeout)."""


class DHTNode:
    """One Kademlia peer on a :class:`Node`. See the module docstring.

    Use as ``async with DHTNode(node, config=...) as dht:`` on a started node,
    or call :meth:`start` and :meth:`aclose`. The node is not closed with it.

    Args:
        node: The started node whose identity and connections the DHT uses.
        config: Limits, timings, client mode and initial peers.
        clock: Current time in Unix seconds (record expirations are absolute).
        rng: Source of the random ids used to refresh buckets.

    Attributes:
        stats: Requests sent, answered, failed and served
            (:class:`~p2ptrain.dht.stats.RPCStats`).
    """

    def __init__(
        self,
        node: Node,
        *,
        config: DHTNodeConfig | None = None,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        self.node = node
        self.config = config or DHTNodeConfig()
        self._dht: DHTConfig = self.config.dht
        self._clock = clock
        self.node_id = NodeID.from_peer_id(node.peer_id)
        self._rng = rng or random.Random()
        self.routing_table = RoutingTable(
            self.node_id, config=self._dht, rng=self._rng, now=clock()
        )
        self.records = RecordStore(config=self._dht)
        self.stats = RPCStats()
        self._tasks = BackgroundTasks(f"dht {node.peer_id.short}")
        self._sender: str | None = None
        self._next_republish = clock() + self._dht.republish_interval
        self._srtt: float | None = None  # smoothed duration of answered requests
        # callers whose address is being checked, each with the event set when it ends
        self._verifying: dict[PeerID, asyncio.Event] = {}
        # Addresses a lookup gave up on lately, each until _UNRESPONSIVE_S after.
        self._unresponsive: ExpiringMap[str, bool] = ExpiringMap(_UNRESPONSIVE_MAX)
        # (caller, the address it answered at), believed for _VERIFIED_S
        self._verified: ExpiringMap[tuple[PeerID, str], bool] = ExpiringMap(_VERIFIED_MAX)
        # key -> the replicas a lookup found for it lately: see find_value
        self._holders: ExpiringMap[bytes, tuple[Contact, ...]] = ExpiringMap(_HOLDERS_MAX)
        # key -> the signed entries the last `latest` read of it merged: see _merge_read
        self._reads: ExpiringMap[bytes, DictionaryRecord] = ExpiringMap(_READS_MAX)
        self._none_verifying = asyncio.Event()
        self._none_verifying.set()
        # How long a PING waits for its caller's address check (see _serve_ping):
        # well inside the request timeout the caller (configured alike) allows.
        self._verify_wait = min(self.config.ping_timeout, self.config.request_timeout / 2)
        self._started = False
        self._closing = False

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def peer_id(self) -> PeerID:
        """This peer's PeerID."""
        return self.node.peer_id

    @property
    def client_mode(self) -> bool:
        """Whether this peer stays out of others' routing tables."""
        return self.config.client_mode

    async def start(self) -> None:
        """Serve the DHT methods, bootstrap from ``config.initial_peers``, start the timers.

        Raises:
            LookupFailedError: Initial peers were given and none of them answered.
        """
        if self._started:
            raise RuntimeError("the DHT node is already started")
        self._started = True
        self._sender = None if self.client_mode else self.node.address.endpoint
        handlers = self.node.handlers
        handlers.add_unary(METHOD_PING, self._serve_ping)
        handlers.add_unary(METHOD_FIND, self._serve_find)
        handlers.add_unary(METHOD_STORE, self._serve_store)
        try:
            if self.config.initial_peers:
                await self.bootstrap(self.config.initial_peers)
        except BaseException:
            await self.aclose()
            raise
        self._tasks.spawn(self._maintenance_loop(), name=f"dht-timers:{self.peer_id.short}")

    async def aclose(self) -> None:
        """Stop serving and cancel every background task (the node stays open)."""
        if self._closing:
            return
        self._closing = True
        for method in (METHOD_PING, METHOD_FIND, METHOD_STORE):
            self.node.handlers.remove(method)
        await self._tasks.aclose()

    async def __aenter__(self) -> DHTNode:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def known_peers(self) -> list[PeerAddress]:
        """Addresses of the peers in our routing table (server-mode peers we heard from)."""
        return [PeerAddress.parse(c.address).with_peer(c.peer_id) for c in self.routing_table]

    # -- joining -----------------------------------------------------------------------

    async def bootstrap(self, addresses: Iterable[str | PeerAddress]) -> int:
        """Join the network through ``addresses``: greet them, then look ourselves up.

        After the lookup of our own id, every bucket that does not hold our id
        is refreshed with a lookup of a random id in it, as Kademlia joins do.

        Returns:
            How many of the addresses answered.

        Raises:
            LookupFailedError: None of them answered.
        """
        targets = [PeerAddress.parse(a) if isinstance(a, str) else a for a in addresses]
        own = self.node.address
        targets = [
            t
            for t in targets
            if t.peer_id != self.peer_id and (t.peer_id is not None or t.endpoint != own.endpoint)
        ]
        if not targets:
            return 0
        failures: dict[str, str] = {}
        greeted = await asyncio.gather(*(self._greet(t, failures) for t in targets))
        answered = sum(greeted)
        if not answered:
            reasons = "; ".join(f"{addr}: {why}" for addr, why in failures.items())
            raise LookupFailedError(
                f"none of the {len(targets)} initial peers answered ({reasons})"
            )
        await self._refresh([self.node_id])
        far = [b for b in self.routing_table.buckets if not b.lo <= self.node_id < b.hi]
        await self._refresh([NodeID(self._rng.randrange(b.lo, b.hi)) for b in far])
        logger.info(
            "joined the swarm at %s through %d of %d initial peers; peers known: %d",
            self.node.address,
            answered,
            len(targets),
            len(self.routing_table),
        )
        return answered

    async def _greet(self, address: PeerAddress, failures: dict[str, str]) -> bool:
        # A verifying peer holds a greeting's reply while it checks our address
        # (see _serve_ping): budget for that wait on top of the request itself.
        timeout = self.config.request_timeout + self._verify_wait
        loop = asyncio.get_running_loop()
        started = loop.time()
        self.stats.on_sent(METHOD_PING)
        try:
            async with asyncio.timeout(timeout):
                conn = await self.node.connect(address)
                message = await conn.call(
                    METHOD_PING, PingRequest(self._sender).encode(), timeout=timeout
                )
            reply = PingReply.decode(message.body)
        except _FAILURES as exc:
            self.stats.on_failure(METHOD_PING, exc)
            failures[address.endpoint] = str(exc) or "timeout"
            logger.debug("initial peer %s did not answer: %s", address, exc or "timeout")
            return False
        self.stats.on_answer(METHOD_PING, loop.time() - started)
        if conn.remote_peer == self.peer_id:
            return False
        if not reply.client_mode:
            self._heard(Contact(conn.remote_peer, address.endpoint))
        return True

    # -- finding nodes and values ------------------------------------------------------

    async def find_nodes(self, target: int) -> list[Contact]:
        """The (up to) *k* live peers closest to ``target``, nearest first.

        Raises:
            LookupFailedError: No peer answered (or none is known).
        """
        node_id = NodeID(target)
        result = await self._lookup(node_id, LookupMode.FIND_NODE, None, values_wanted=1)
        self.routing_table.touch(node_id, self._clock())
        return list(result.closest)

    async def find_value(self, key: bytes, *, latest: bool = False) -> StoredValue | None:
        """The live value under ``key``: a plain record, a dictionary, or ``None``.

        Args:
            key: The record key.
            latest: Ask up to ``replicas`` nodes and merge what they hold,
                instead of returning the local copy or the first value found
                (the replicas a lookup found lately, when there are some).

        Raises:
            ConfigError: The key is not bytes or too long.
            LookupFailedError: Nothing is held locally and no peer answered.
        """
        if not isinstance(key, bytes) or len(key) > self._dht.max_key_bytes:
            raise ConfigError(f"a key is bytes of at most {self._dht.max_key_bytes}")
        local = self.records.get(key, self._clock())
        if local is not None and not latest:
            return local
        if not len(self.routing_table) and not self.client_mode:
            return local  # alone in the network: nobody else to ask
        # A plain get stops at the first signed value; an unsigned one is only
        # believed when most of `get_quorum` replicas carry it (agreed_value).
        quorum = min(self.config.get_quorum, self._dht.effective_replicas)
        wanted = self._dht.effective_replicas if latest else quorum
        read_before = self._reads.get(key, self._clock()) if latest else None
        known = known_digests(read_before)
        if latest:
            found = await self._ask_holders(key, known)
            if found is not None:
                if local is not None:
                    found.append(local)
                return self._merge_read(key, found, read_before)
        try:
            result = await self._lookup(
                NodeID.from_key(key),
                LookupMode.FIND_VALUE,
                key,
                values_wanted=wanted,
                hedge=not latest,
                enough=None if latest else _signed,
                known=known,
            )
        except LookupFailedError:
            if local is not None:
                return local
            raise
        values = [value for _, value in result.values]
        if local is not None:
            values.append(local)
        if latest:
            self._note_holders(key, result.closest)
            return self._merge_read(key, values, read_before)
        return agreed_value(values, now=self._clock())

    def _merge_read(
        self, key: bytes, values: list[StoredValue], read_before: DictionaryRecord | None
    ) -> StoredValue | None:
        """Merge a ``latest`` read's replies with the entries the last read held.

        The replicas leave out the entries this node said it knew, so those
        come from the last read; entries are only replaced by newer signed
        versions or expire, so the merge is what a full read would give.
        """
        now = self._clock()
        merged = agreed_value(values, now=now)
        if read_before is not None:
            merged = merge_values([v for v in (merged, read_before) if v is not None], now=now)
        if isinstance(merged, DictionaryRecord):
            signed = {s: r for s, r in merged.entries.items() if r.signature is not None}
            if signed:
                self._reads.put(key, DictionaryRecord(key, signed), now + _READS_S)
            else:
                self._reads.pop(key)
        return merged

    def _note_holders(self, key: bytes, closest: Sequence[Contact]) -> None:
        """Remember the replicas of ``key`` that a lookup found (for :meth:`_ask_holders`)."""
        replicas = tuple(c for c in closest if c.peer_id != self.peer_id)
        replicas = replicas[: min(self.config.get_quorum, self._dht.effective_replicas)]
        if not replicas:
            return
        self._holders.put(key, replicas, self._clock() + _HOLDERS_S)

    async def _ask_holders(self, key: bytes, known: bytes = b"") -> list[StoredValue] | None:
        """What the replicas of ``key`` found lately hold, asked directly in one round.

        A key read again and again (a matchmaking dictionary polled until its
        group is complete) was looked up from scratch at every read: 20
        values wanted (``replicas`` is *k* by default), 20-40 requests. Every
        writer stores on the replicas closest to the key, so the
        ``get_quorum`` closest of them, found by the first lookup or by our
        own store, answer nearly always the same: they alone are asked.
        Queries that outlive the lookup patience are given up. ``None`` (do
        a lookup) when no holders are known or none answered; they are then
        forgotten. ``known`` lists the dictionary entries the replies may
        leave out (:func:`~p2ptrain.dht.protocol.known_digests`): a poll then
        carries what changed since the last read, not the whole dictionary.
        """
        holders = self._holders.get(key, self._clock())
        if holders is None:
            return None
        request = FindRequest(NodeID.from_key(key), key, self._sender, known).encode()
        tasks = [asyncio.ensure_future(self._query(c, request, key)) for c in holders]
        try:
            done, _ = await asyncio.wait(tasks, timeout=self._query_patience())
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        replies: list[FindReply] = []
        for task in done:
            try:
                replies.append(task.result())
            except _FAILURES as exc:
                logger.debug("holder of a key failed: %s", exc)
        if not replies:
            self._holders.pop(key)
            return None
        return [reply.value for reply in replies if reply.value is not None]

    async def _lookup(
        self,
        target: NodeID,
        mode: LookupMode,
        key: bytes | None,
        *,
        values_wanted: int,
        hedge: bool = False,
        enough: Callable[[StoredValue], bool] | None = None,
        known: bytes = b"",
    ) -> LookupResult[StoredValue]:
        """Drive one lookup; ``enough(value)`` ends a FIND_VALUE at a value that suffices.

        ``known``: digests of dictionary entries the replies may leave out.
        """
        lookup: IterativeLookup[StoredValue] = IterativeLookup(
            target,
            self.routing_table.nearest(target, self._dht.k),
            config=self._dht,
            mode=mode,
            own_id=self.node_id,
            values_wanted=values_wanted,
        )
        request = FindRequest(target, key, self._sender, known).encode()
        loop = asyncio.get_running_loop()
        pending: dict[asyncio.Task[FindReply], Contact] = {}
        # Hedging: a plain get first asks only the closest candidate; the others
        # handed out by the lookup wait in `staged` until that query fails,
        # answers without the value, or takes longer than `hedge_delay`.
        hedging = mode is LookupMode.FIND_VALUE and hedge and self.config.hedge_delay > 0
        staged: deque[Contact] = deque()
        # A query that outlives `patience` is given up by the lookup (which
        # moves on) but left running as a straggler, so a slow peer is not
        # blamed; stragglers outlive the lookup (_await_straggler), and one
        # that answers clears its address from the skipped ones.
        patience = self._query_patience()
        started: dict[asyncio.Task[FindReply], float] = {}
        stragglers: set[asyncio.Task[FindReply]] = set()
        try:
            while True:
                staged.extend(lookup.next_queries())
                launch = len(staged) if not hedging else int(not pending and bool(staged))
                for _ in range(launch):
                    contact = staged.popleft()
                    task = loop.create_task(self._query(contact, request, key))
                    pending[task] = contact
                    started[task] = loop.time()
                waiting = [t for t in pending if t not in stragglers]
                if not waiting:
                    break
                now = loop.time()
                wake = min(started[t] for t in waiting) + patience - now
                if hedging and staged:
                    wake = min(wake, self.config.hedge_delay)
                done, _ = await asyncio.wait(
                    pending, timeout=max(0.0, wake), return_when=asyncio.FIRST_COMPLETED
                )
                hedging = False  # after the first reply (or the delay), alpha in flight
                for task in done:
                    contact = pending.pop(task)
                    started.pop(task, None)
                    if task in stragglers:  # the lookup gave up on it already
                        stragglers.discard(task)
                        if not task.cancelled() and task.exception() is None:
                            self._unresponsive.pop(contact.address)  # slow, not silent
                        continue
                    try:
                        reply = task.result()
                    except _FAILURES as exc:
                        logger.debug("lookup: %s failed: %s", contact.peer_id.short, exc)
                        lookup.on_failure(contact)
                        continue
                    lookup.on_response(contact, self._responsive(reply.contacts), reply.value)
                    if enough is not None and reply.value is not None and enough(reply.value):
                        return lookup.result()
                now = loop.time()
                for task in [t for t in pending if t not in stragglers]:
                    if _outlived(started[task], patience, now):
                        stragglers.add(task)
                        lookup.on_failure(pending[task])
                        self._note_unresponsive(pending[task].address, now)
                if lookup.done:
                    break
        finally:
            cancelled = []
            for task, contact in pending.items():
                if task in stragglers and not self._closing:
                    self._tasks.spawn(
                        self._await_straggler(task, contact.address),
                        name=f"dht-straggler:{contact.peer_id.short}",
                    )
                else:
                    task.cancel()
                    cancelled.append(task)
            if cancelled:
                await asyncio.gather(*cancelled, return_exceptions=True)
        return lookup.result()

    async def _await_straggler(self, task: asyncio.Task[FindReply], address: str) -> None:
        """A query its lookup gave up on still runs (``request_timeout`` at most):
        should it answer, its address was slow, not silent, and later lookups
        stop skipping it (a peer whose uplink is busy with a tensor answers late)."""
        try:
            await task
        except _FAILURES:
            return
        finally:
            task.cancel()  # a no-op once done; stops the query should we be cancelled
        self._unresponsive.pop(address)

    def _note_unresponsive(self, address: str, now: float) -> None:
        """A lookup gave up on ``address``: later lookups skip it for a while."""
        self._unresponsive.put(address, True, now + _UNRESPONSIVE_S)

    def _responsive(self, contacts: Sequence[Contact]) -> Sequence[Contact]:
        """``contacts`` of a reply without those at addresses that stalled a lookup lately."""
        if not self._unresponsive:
            return contacts
        now = asyncio.get_running_loop().time()
        return [c for c in contacts if self._unresponsive.get(c.address, now) is None]

    async def _query(
        self, contact: Contact, request: dict[str, Any], key: bytes | None
    ) -> FindReply:
        def decode(message: Message) -> FindReply:
            reply = FindReply.decode(
                message.body,
                message.payload,
                key=key,
                max_contacts=self._dht.effective_max_contacts_per_reply,
                max_rows=self._dht.max_subkeys,
            )
            if reply.value is None:
                return reply
            now = self._clock()
            # An entry may expire while the reply travels: not the sender's fault.
            value = _live_part(reply.value, now)
            if value is not None:
                validate_for_read(value, config=self._dht, now=now)
            return FindReply(reply.contacts, value)

        return await self._call(contact, METHOD_FIND, request, b"", decode)

    # -- storing -----------------------------------------------------------------------

    async def store_record(self, record: Record) -> int:
        """Store ``record`` on the ``replicas`` nodes closest to its key.

        Returns:
            How many nodes hold the record afterwards (ourselves included); 0
            when every replica kept a newer record for the key or sub-key.

        Raises:
            RecordRejectedError: The record breaks a size, expiration or
                ownership rule (checked here before anything is sent).
            LookupFailedError: No replica (not even ourselves) could be reached.
        """
        now = self._clock()
        if not isinstance(record, Record):
            raise ConfigError("store_record() takes a Record")
        record = _normalized(record)
        validate_record(record, config=self._dht, now=now)
        outcomes = await self._replicate(record.key, [record], store_locally=True)
        if not outcomes:
            raise LookupFailedError("no replica could be reached to store the record")
        return sum(1 for statuses in outcomes if statuses[0].holds)

    async def _replicate(
        self, key: bytes, records: Sequence[Record], *, store_locally: bool
    ) -> list[tuple[StoreStatus, ...]]:
        """Send ``records`` (all under ``key``) to its replica set; the statuses of each replica."""
        target = NodeID.from_key(key)
        try:
            closest = await self.find_nodes(target)
        except LookupFailedError:
            if self.client_mode:
                raise
            closest = []
        remote = [c for c in closest if c.peer_id != self.peer_id]
        self._note_holders(key, remote)
        want = self._dht.effective_replicas
        outcomes: list[tuple[StoreStatus, ...]] = []
        if not self.client_mode:
            own = self.node_id ^ target
            if sum(1 for c in remote if c.node_id ^ target < own) < want:
                want -= 1  # we are one of the replicas
                if store_locally:
                    now = self._clock()
                    outcomes.append(tuple(self._store_locally(r, now) for r in records))
        outcomes.extend(await self._store_on(remote, records, want))
        return outcomes

    async def _store_on(
        self, contacts: Sequence[Contact], records: Sequence[Record], want: int
    ) -> list[tuple[StoreStatus, ...]]:
        """Store on the first ``want`` contacts, replacing each that fails by the next."""
        queue = iter(contacts)
        loop = asyncio.get_running_loop()
        pending: dict[asyncio.Task[tuple[StoreStatus, ...]], Contact] = {}
        answers: list[tuple[StoreStatus, ...]] = []

        def launch(count: int) -> None:
            for contact in itertools.islice(queue, count):
                pending[loop.create_task(self._send_store(contact, records))] = contact

        launch(want)
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    contact = pending.pop(task)
                    try:
                        answers.append(task.result())
                    except _FAILURES as exc:
                        logger.debug("store on %s failed: %s", contact.peer_id.short, exc)
                        launch(1)
        finally:
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        return answers

    async def _send_store(
        self, contact: Contact, records: Sequence[Record]
    ) -> tuple[StoreStatus, ...]:
        statuses: list[StoreStatus] = []
        for batch in self._batches(records):
            body, payload = StoreRequest(tuple(batch), self._sender).encode()
            reply = await self._call(
                contact, METHOD_STORE, body, payload, _store_reply_decoder(len(batch))
            )
            statuses.extend(reply.statuses)
        return tuple(statuses)

    def _batches(self, records: Sequence[Record]) -> Iterable[list[Record]]:
        batch: list[Record] = []
        size = 0
        for record in records:
            if batch and (
                len(batch) >= self.config.max_records_per_request
                or size + len(record.value) > self.config.max_reply_bytes
            ):
                yield batch
                batch, size = [], 0
            batch.append(record)
            size += len(record.value)
        if batch:
            yield batch

    def _store_locally(self, record: Record, now: float, source: str | None = None) -> StoreStatus:
        try:
            stored = self.records.store_record(record, now, source=source)
        except RecordRejectedError as exc:
            return StoreStatus(StoreOutcome.REJECTED, str(exc))
        if stored:
            return StoreStatus(StoreOutcome.STORED)
        held = self.records.get(record.key, now)
        if isinstance(held, DictionaryRecord) and record.subkey is not None:
            held = held.entries.get(record.subkey)
        if held == record:
            return StoreStatus(StoreOutcome.HELD)
        return StoreStatus(StoreOutcome.OUTDATED)

    # -- timers ------------------------------------------------------------------------

    async def maintain(self, now: float | None = None) -> None:
        """Run the timers once: evict expired records, refresh idle buckets, republish.

        Args:
            now: The time to act at (default: the clock). Republishing happens
                when ``now`` reached ``republish_interval`` after the last one.
        """
        now = self._clock() if now is None else now
        self.records.evict_expired(now)
        stale = self.routing_table.buckets_needing_refresh(now)
        if stale and len(self.routing_table):
            await self._refresh(stale, now)
        if now >= self._next_republish:
            self._next_republish = now + self._dht.republish_interval
            await self._republish(now)

    async def _maintenance_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.maintenance_interval)
            try:
                await self.maintain()
            except Exception:  # the root of the timer: log and keep ticking
                logger.exception("DHT maintenance failed")

    async def _refresh(self, targets: Sequence[NodeID], now: float | None = None) -> None:
        async def refresh(target: NodeID) -> None:
            try:
                await self.find_nodes(target)
            except LookupFailedError as exc:
                logger.debug("refresh of %064x found nobody: %s", target, exc)
            self.routing_table.touch(target, self._clock() if now is None else now)

        await self._limited(refresh(t) for t in targets)

    async def _republish(self, now: float) -> None:
        by_key: dict[bytes, list[Record]] = {}
        for record in self.records.records(now):
            by_key.setdefault(record.key, []).append(record)
        if not by_key:
            return
        logger.debug("republishing %d keys", len(by_key))

        async def republish(key: bytes, records: list[Record]) -> None:
            try:
                await self._replicate(key, records, store_locally=False)
            except LookupFailedError as exc:
                logger.debug("republish of a key reached nobody: %s", exc)

        await self._limited(republish(k, r) for k, r in by_key.items())

    async def _limited(self, coros: Iterable[Coroutine[Any, Any, None]]) -> None:
        """Run ``coros`` with at most ``republish_parallelism`` at a time."""
        semaphore = asyncio.Semaphore(self.config.republish_parallelism)

        async def limited(coro: Coroutine[Any, Any, None]) -> None:
            async with semaphore:
                await coro

        async with asyncio.TaskGroup() as group:
            for coro in coros:
                group.create_task(limited(coro))

    # -- talking to one peer -----------------------------------------------------------

    async def _call(
        self,
        contact: Contact,
        method: str,
        body: Any,
        payload: bytes,
        decode: Callable[[Message], T],
        *,
        timeout: float | None = None,
    ) -> T:
        """One request to ``contact``: the routing table hears of its success or failure."""
        timeout = self.config.request_timeout if timeout is None else timeout
        # The loop's clock, like the lookup's patience it feeds (a simulation's is virtual).
        loop = asyncio.get_running_loop()
        started = loop.time()
        self.stats.on_sent(method)
        try:
            async with asyncio.timeout(timeout):
                conn = self.node.connection_to(contact.peer_id)
                if conn is None:
                    address = PeerAddress.parse(contact.address).with_peer(contact.peer_id)
                    conn = await self.node.connect(address)
                message = await conn.call(method, body, payload, timeout=timeout)
            result = decode(message)
        except TimeoutError as exc:
            self.stats.on_failure(method, exc)
            self.routing_table.mark_failed(contact.peer_id)
            raise DeadlineExceededError(
                f"{contact.peer_id.short} did not answer {method} within {timeout} s"
            ) from exc
        except P2PTrainError as exc:
            self.stats.on_failure(method, exc)
            self.routing_table.mark_failed(contact.peer_id)
            raise
        elapsed = loop.time() - started
        self.stats.on_answer(method, elapsed)
        self._srtt = elapsed if self._srtt is None else 0.8 * self._srtt + 0.2 * elapsed
        self._heard(contact)
        return result

    def _query_patience(self) -> float:
        """How long a lookup waits for one query before moving on (see the config)."""
        srtt = 0.0 if self._srtt is None else 4 * self._srtt
        return min(self.config.request_timeout, max(self.config.lookup_query_timeout, srtt))

    def _heard(self, contact: Contact) -> None:
        """We heard from ``contact`` directly: tell the routing table (and ping if asked)."""
        if contact.peer_id == self.peer_id:
            return
        result = self.routing_table.add_or_update(contact, self._clock())
        if result.status is AddStatus.PING_NEEDED and result.ping is not None:
            if self._closing:
                return
            oldest = result.ping
            self._tasks.spawn(self._ping_oldest(oldest), name=f"dht-ping:{oldest.peer_id.short}")

    async def _ping_oldest(self, contact: Contact) -> None:
        request = PingRequest(self._sender).encode()
        try:
            await self._call(
                contact,
                METHOD_PING,
                request,
                b"",
                lambda message: PingReply.decode(message.body),
                timeout=self.config.ping_timeout,
            )
            alive = True
        except _FAILURES:
            alive = False
        self.routing_table.on_ping_result(contact.peer_id, alive, self._clock())

    # -- serving -----------------------------------------------------------------------

    def _heard_from_caller(self, ctx: CallContext, sender: str | None) -> asyncio.Event | None:
        """A caller announced where it listens: believe it once it answered there.

        Returns the event set when the check of its address ends (``None``
        when none runs: believed at once, already known, or no room).
        """
        if sender is None or ctx.peer == self.peer_id:
            return None
        contact = Contact(ctx.peer, sender)
        known = self.routing_table.get(ctx.peer)
        if (
            not self.config.verify_callers
            or (known is not None and known.address == sender)
            or self._verified_lately(contact)
        ):
            self._heard(contact)
            return None
        running = self._verifying.get(ctx.peer)
        if running is not None:
            return running
        if self._closing or len(self._verifying) >= _MAX_VERIFYING:
            return None
        checked = self._verifying[ctx.peer] = asyncio.Event()
        self._none_verifying.clear()
        self._tasks.spawn(self._verify(contact), name=f"dht-verify:{ctx.peer.short}")
        return checked

    async def _verify(self, contact: Contact) -> None:
        try:
            address = PeerAddress.parse(contact.address).with_peer(contact.peer_id)
            reply = await self.node.probe(
                address,
                METHOD_PING,
                PingRequest(None).encode(),
                timeout=self.config.ping_timeout,
            )
            if not PingReply.decode(reply.body).client_mode:
                self._note_verified(contact)
                self._heard(contact)
        except (*_FAILURES, ValueError) as exc:
            logger.debug("%s did not answer at %s: %s", contact.peer_id.short, contact.address, exc)
        finally:
            checked = self._verifying.pop(contact.peer_id, None)
            if checked is not None:
                checked.set()
            if not self._verifying:
                self._none_verifying.set()

    def _note_verified(self, contact: Contact) -> None:
        self._verified.put((contact.peer_id, contact.address), True, self._clock() + _VERIFIED_S)

    def _verified_lately(self, contact: Contact) -> bool:
        """Whether ``contact`` answered at its address in the last ``_VERIFIED_S``.

        A caller that is not in the routing table (its bucket is full: most
        peers of a large swarm) would otherwise be probed again at every
        request it makes, a fresh connection and handshake each time.
        """
        return self._verified.get((contact.peer_id, contact.address), self._clock()) is not None

    async def callers_verified(self) -> None:
        """Wait until no caller's announced address is being checked (see ``verify_callers``)."""
        await self._none_verifying.wait()

    async def _serve_ping(self, ctx: CallContext, request: Message) -> Message:
        self.stats.on_served(METHOD_PING)
        ping = _decoded(lambda: PingRequest.decode(request.body))
        checked = self._heard_from_caller(ctx, ping.sender)
        if checked is not None:
            # A greeting is answered once the caller's address is checked (or
            # the wait ran out), so the caller's join lookup, which follows,
            # is answered by a table that holds every peer that greeted us
            # before it. Without the wait, two peers joining through us at
            # once both missed each other (each still being checked when the
            # other looked itself up) and learned of each other only at a
            # later lookup. The wait only delays this caller's own reply.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(checked.wait(), self._verify_wait)
        return Message(PingReply(self.client_mode).encode())

    async def _serve_find(self, ctx: CallContext, request: Message) -> Message:
        self.stats.on_served(METHOD_FIND)
        find = _decoded(
            lambda: FindRequest.decode(request.body, max_key_bytes=self._dht.max_key_bytes)
        )
        self._heard_from_caller(ctx, find.sender)
        contacts = self.routing_table.nearest(find.target, self._dht.k, exclude=(ctx.peer,))
        value = None if find.key is None else self.records.get(find.key, self._clock())
        if value is not None:
            value = omit_known(value, find.known)
            # Refuse before building a reply the node's reply budget cannot take.
            size = min(self.config.max_reply_bytes, _value_bytes(value))
            budget = self.node.reply_budget
            if size >= _LARGE_REPLY and not budget.fits(size):
                raise ResourceExhaustedError(
                    f"busy sending {budget.used} bytes of replies; retry later"
                )
        body, payload = FindReply(tuple(contacts), value).encode(
            max_value_bytes=self.config.max_reply_bytes
        )
        return Message(body, payload)

    async def _serve_store(self, ctx: CallContext, request: Message) -> Message:
        self.stats.on_served(METHOD_STORE)
        store = _decoded(
            lambda: StoreRequest.decode(
                request.body, request.payload, max_records=self.config.max_records_per_request
            )
        )
        self._heard_from_caller(ctx, store.sender)
        now = self._clock()
        source = _source_host(ctx.remote_address)
        statuses = tuple(self._store_locally(r, now, source) for r in store.records)
        for status in statuses:
            if status.outcome is StoreOutcome.REJECTED:
                logger.debug("refused a record from %s: %s", ctx.peer.short, status.reason)
        return Message(StoreReply(statuses).encode())


def _outlived(started: float, patience: float, now: float) -> bool:
    """Whether a query started at ``started`` has waited ``patience`` by ``now``.

    The lookup sleeps until ``started + patience``, a sum that rounds: woken
    there, ``now - started`` can come out an ulp short of ``patience`` (for
    about 1 start in 1,000 with 0.5 s). Checked exactly, the query was not
    given up, the next sleep was 0 s, and the lookup spun: on a virtual clock
    forever (a zero timeout never lets the clock move), which hung the swarm
    simulation; hence the slack.
    """
    return now - started >= patience - _TIMER_SLACK_S


def _source_host(remote_address: str) -> str:
    """The host a STORE came from, which its records are charged to."""
    host, sep, _port = remote_address.rpartition(":")
    return host if sep else remote_address


def _decoded(parse: Callable[[], T]) -> T:
    """Parse a request; a malformed one becomes InvalidArgumentError for the caller."""
    try:
        return parse()
    except RemoteProtocolError as exc:
        raise InvalidArgumentError(str(exc)) from exc


def _value_bytes(value: StoredValue) -> int:
    """Bytes of values a reply carrying ``value`` would hold (its payload)."""
    if isinstance(value, Record):
        return len(value.value)
    return sum(len(r.value) for r in value.entries.values())


def _signed(value: StoredValue) -> bool:
    """Whether every record of ``value`` is signed."""
    records = (value,) if isinstance(value, Record) else value.entries.values()
    return all(r.owner is not None for r in records)


def _live_part(value: StoredValue, now: float) -> StoredValue | None:
    """``value`` without the records that expired at ``now`` (None if nothing is left)."""
    if isinstance(value, Record):
        return value if _expires_after(value, now) else None
    live = {s: r for s, r in value.entries.items() if _expires_after(r, now)}
    if len(live) == len(value.entries):
        return value
    return DictionaryRecord(value.key, live) if live else None


def _expires_after(record: Record, now: float) -> bool:
    # Malformed expirations (not numbers) are kept for validate_for_read to reject.
    expiration = record.expiration
    return not isinstance(expiration, int | float) or expiration > now


def _store_reply_decoder(count: int) -> Callable[[Message], StoreReply]:
    def decode(message: Message) -> StoreReply:
        return StoreReply.decode(message.body, expected=count)

    return decode


def _normalized(record: Record) -> Record:
    """The record with a float expiration (as stored and as signed)."""
    if isinstance(record.expiration, float):
        return record
    if isinstance(record.expiration, bool) or not isinstance(record.expiration, int):
        raise RecordRejectedError("the expiration must be a number")
    return Record(
        record.key,
        record.value,
        float(record.expiration),
        record.subkey,
        record.owner,
        record.signature,
    )
