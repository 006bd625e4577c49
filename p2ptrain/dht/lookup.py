"""The iterative Kademlia lookup, as a sans-IO state machine.

Theory of operation
-------------------
:class:`IterativeLookup` searches for the *k* nodes closest to a target id
(FIND_NODE) or for a value stored near it (FIND_VALUE). It never sends
anything itself; the networked node drives it::

    lookup = IterativeLookup(target, table.nearest(target, k), config=config, own_id=me)
    while not lookup.done:
        for contact in lookup.next_queries():      # at most alpha in flight
            send FIND_NODE/FIND_VALUE(target) to contact
        wait for a reply or a timeout, then either
            lookup.on_response(contact, contacts_in_reply, value)
        or  lookup.on_failure(contact)
    result = lookup.result()

The lookup keeps a *shortlist* of candidates sorted by XOR distance to the
target. It only ever queries candidates among the *k* closest known ones that
have not failed, closest first, with at most ``alpha`` queries in flight
until ``alpha`` replies in a row brought no candidate closer than the closest
known: the search has converged, and the rest of the *k* closest are asked
at once (Kademlia's final round) instead of ``alpha`` at a time, a round
trip per wave (on simulated links busy with tensors, a store's lookup spent
3 s collecting its 20 answers three at a time).
Every reply may add candidates; a failure removes the candidate for good
(it is remembered, so a later reply naming it again is ignored). The lookup is
done when the *k* closest remaining candidates have all answered, when no
candidate is left, or, in FIND_VALUE mode, when ``values_wanted`` nodes have
returned a value. Replies that arrive for a contact not in flight (late, after
a failure, or unsolicited) are ignored.

Hostile replies cannot blow up the state: only the first
``config.effective_max_contacts_per_reply`` entries of a reply are looked at
(duplicates, our own id and the responder count towards the cap), and the
shortlist keeps at most ``SHORTLIST_FACTOR * k`` candidates that were never
queried, dropping the farthest. An address (``host:port``) serves one peer:
a contact naming an address that another id already claimed in this lookup
is ignored, so thousands of made-up ids next to the target that all point at
one tar pit cost one query, not thousands.

The node must validate a returned value (signatures, expiration, see
:func:`p2ptrain.dht.records.validate_for_read`) *before* passing it in; a
peer that returns an invalid value should be reported with
:meth:`IterativeLookup.on_failure` instead.

Dictionary values: with ``values_wanted > 1`` the lookup continues after the
first value until that many nodes have returned one (or the usual termination),
and :attr:`LookupResult.values` lists every value found; the caller merges
them (:func:`p2ptrain.dht.storage.merge_values` keeps the newest entry of each
sub-key).

Hops: every initial contact has depth 1, and a contact first learned from a
reply of a depth-``d`` node has depth ``d + 1``. :attr:`LookupResult.hops` is
the largest depth among nodes that answered: the length of the longest chain
of request/response round trips the lookup depended on.
"""

from __future__ import annotations

import enum
import itertools
from bisect import bisect_left, bisect_right
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from p2ptrain.dht.config import DHTConfig
from p2ptrain.dht.routing import Contact
from p2ptrain.errors import ConfigError, LookupFailedError

__all__ = ["SHORTLIST_FACTOR", "IterativeLookup", "LookupMode", "LookupResult"]

V = TypeVar("V")

SHORTLIST_FACTOR = 4
"""The shortlist keeps at most this many times *k* never-queried candidates."""


class LookupMode(enum.Enum):
    """What a lookup searches for."""

    FIND_NODE = "find_node"
    """The *k* closest nodes to the target."""
    FIND_VALUE = "find_value"
    """A value stored under the target; stops early when found."""


@dataclass(frozen=True, slots=True)
class LookupResult(Generic[V]):
    """What an :class:`IterativeLookup` found.

    Attributes:
        target: The id that was looked up.
        closest: Up to *k* nodes that answered, nearest first.
        values: In FIND_VALUE mode, each node that returned a value with that
            value, in the order the replies arrived.
        closest_without_value: In FIND_VALUE mode, nodes that answered without
            a value, nearest first (up to *k*): where to cache a found value.
        hops: Longest chain of round trips (see the module docstring).
        queries: Queries handed out by :meth:`IterativeLookup.next_queries`.
        failures: Queries reported failed.
    """

    target: int
    closest: tuple[Contact, ...]
    values: tuple[tuple[Contact, V], ...]
    closest_without_value: tuple[Contact, ...]
    hops: int
    queries: int
    failures: int


class _State(enum.Enum):
    FRESH = 0
    IN_FLIGHT = 1
    ANSWERED = 2
    FAILED = 3


class _Candidate:
    __slots__ = ("contact", "depth", "distance", "has_value", "state")

    def __init__(self, contact: Contact, distance: int, depth: int) -> None:
        self.contact = contact
        self.distance = distance
        self.depth = depth
        self.state = _State.FRESH
        self.has_value = False


class IterativeLookup(Generic[V]):
    """One FIND_NODE or FIND_VALUE lookup. See the module docstring.

    Args:
        target: The id to look up (a node's id or a key's id).
        initial_contacts: Where to start, usually our routing table's nearest
            contacts to ``target``.
        config: *k*, *alpha* and the per-reply contact cap.
        mode: FIND_NODE or FIND_VALUE.
        own_id: Our own id, never queried; ``None`` if we have none to skip.
        values_wanted: In FIND_VALUE mode, stop once this many nodes returned a
            value (use more than 1 to collect dictionary sub-keys from several
            replicas).

    Raises:
        ConfigError: ``values_wanted`` is below 1.
    """

    def __init__(
        self,
        target: int,
        initial_contacts: Iterable[Contact],
        *,
        config: DHTConfig,
        mode: LookupMode = LookupMode.FIND_NODE,
        own_id: int | None = None,
        values_wanted: int = 1,
    ) -> None:
        if isinstance(values_wanted, bool) or not isinstance(values_wanted, int):
            raise ConfigError("values_wanted must be an int")
        if values_wanted < 1:
            raise ConfigError(f"values_wanted must be >= 1, got {values_wanted}")
        self._target = int(target)
        self._config = config
        self._mode = mode
        self._own = own_id
        self._values_wanted = values_wanted
        self._k = config.k
        self._cap = config.effective_max_contacts_per_reply
        # Non-failed candidates sorted by distance, and their distances (for bisect).
        self._shortlist: list[_Candidate] = []
        self._distances: list[int] = []
        # Every candidate still tracked, failed ones included, by node id.
        self._known: dict[int, _Candidate] = {}
        # Which node id claimed each address first: an address serves one peer.
        self._addresses: dict[str, int] = {}
        self._fresh = 0
        self._in_flight = 0
        # Replies in a row that named nobody closer than the closest known.
        self._no_progress = 0
        self._queries = 0
        self._failures = 0
        self._values: list[tuple[Contact, V]] = []
        for contact in initial_contacts:
            self._consider(contact, depth=1)
        self._trim()

    @property
    def target(self) -> int:
        """The id being looked up."""
        return self._target

    @property
    def mode(self) -> LookupMode:
        """FIND_NODE or FIND_VALUE."""
        return self._mode

    @property
    def converged(self) -> bool:
        """``alpha`` replies in a row found nobody closer: the rest of the k closest go at once."""
        return self._no_progress >= self._config.alpha

    @property
    def in_flight(self) -> int:
        """Queries handed out and not yet answered or failed."""
        return self._in_flight

    @property
    def done(self) -> bool:
        """Whether the lookup has finished (see the module docstring)."""
        if self._mode is LookupMode.FIND_VALUE and len(self._values) >= self._values_wanted:
            return True
        return all(c.state is _State.ANSWERED for c in self._shortlist[: self._k])

    def next_queries(self) -> list[Contact]:
        """Contacts to query now; each is counted in flight until answered or failed.

        Returns an empty list when the lookup is done or ``alpha`` queries are
        already in flight (*k* once it :attr:`converged`).
        """
        width = self._k if self.converged else self._config.alpha
        slots = width - self._in_flight
        if slots <= 0 or self.done:
            return []
        chosen: list[Contact] = []
        for candidate in self._shortlist[: self._k]:
            if candidate.state is _State.FRESH:
                candidate.state = _State.IN_FLIGHT
                self._fresh -= 1
                chosen.append(candidate.contact)
                if len(chosen) == slots:
                    break
        self._in_flight += len(chosen)
        self._queries += len(chosen)
        return chosen

    def on_response(
        self, contact: Contact, contacts: Iterable[Contact], value: V | None = None
    ) -> None:
        """Feed the reply of a queried contact.

        Args:
            contact: The contact that answered (as returned by
                :meth:`next_queries`).
            contacts: The contacts named in its reply; only the first
                ``config.effective_max_contacts_per_reply`` are looked at.
            value: In FIND_VALUE mode, the (already validated) value it
                returned, or ``None``. Ignored in FIND_NODE mode.
        """
        candidate = self._known.get(contact.node_id)
        if candidate is None or candidate.state is not _State.IN_FLIGHT:
            return
        candidate.state = _State.ANSWERED
        self._in_flight -= 1
        if value is not None and self._mode is LookupMode.FIND_VALUE:
            candidate.has_value = True
            self._values.append((candidate.contact, value))
        depth = candidate.depth + 1
        closest = self._distances[0]
        for named in itertools.islice(contacts, self._cap):
            self._consider(named, depth)
        self._trim()
        self._no_progress = 0 if self._distances[0] < closest else self._no_progress + 1

    def on_failure(self, contact: Contact) -> None:
        """Report that a queried contact timed out, refused, or sent garbage.

        The contact is dropped from the shortlist and never queried again.
        """
        candidate = self._known.get(contact.node_id)
        if candidate is None or candidate.state is not _State.IN_FLIGHT:
            return
        candidate.state = _State.FAILED
        self._in_flight -= 1
        self._failures += 1
        index = self._index_of(candidate)
        del self._shortlist[index]
        del self._distances[index]

    def result(self) -> LookupResult[V]:
        """What was found so far (call when :attr:`done`, or to give up early).

        Raises:
            LookupFailedError: No node has answered.
        """
        answered = [c for c in self._shortlist if c.state is _State.ANSWERED]
        if not answered:
            raise LookupFailedError(
                f"no node answered the lookup of {self._target:064x}"
                f" ({self._queries} queried, {self._failures} failed)"
            )
        without_value: tuple[Contact, ...] = ()
        if self._mode is LookupMode.FIND_VALUE:
            without_value = tuple(c.contact for c in answered if not c.has_value)[: self._k]
        return LookupResult(
            target=self._target,
            closest=tuple(c.contact for c in answered[: self._k]),
            values=tuple(self._values),
            closest_without_value=without_value,
            hops=max(c.depth for c in answered),
            queries=self._queries,
            failures=self._failures,
        )

    # internals

    def _consider(self, contact: Contact, depth: int) -> None:
        node_id = contact.node_id
        if node_id in self._known or node_id == self._own:
            return
        claimed = self._addresses.setdefault(contact.address, node_id)
        if claimed != node_id:
            return  # another id at the same address: a Sybil (or a stale entry)
        candidate = _Candidate(contact, node_id ^ self._target, depth)
        self._known[node_id] = candidate
        index = bisect_right(self._distances, candidate.distance)
        self._shortlist.insert(index, candidate)
        self._distances.insert(index, candidate.distance)
        self._fresh += 1

    def _trim(self) -> None:
        """Drop the farthest never-queried candidates beyond the shortlist bound."""
        excess = self._fresh - SHORTLIST_FACTOR * self._k
        index = len(self._shortlist) - 1
        while excess > 0 and index >= self._k:
            candidate = self._shortlist[index]
            if candidate.state is _State.FRESH:
                del self._shortlist[index]
                del self._distances[index]
                del self._known[candidate.contact.node_id]
                del self._addresses[candidate.contact.address]
                self._fresh -= 1
                excess -= 1
            index -= 1

    def _index_of(self, candidate: _Candidate) -> int:
        # Distances to one target are unique (XOR with it is a bijection).
        return bisect_left(self._distances, candidate.distance)
