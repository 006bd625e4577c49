"""The node's router: every dial to a PeerID goes direct first, then traverses NAT.

:class:`NATRouter` implements :class:`~p2ptrain.node.router.Router`; install
it with ``node.set_router(nat.router)`` and ``Node.connect`` reaches NATed
peers too, so the DHT, the all-reduce and state sync work across NATs
without knowing about them.

For an address bound to a PeerID with no pooled connection:

1. dial the address over TCP (``NATConfig.direct_timeout``), unless it cannot
   work: the host is unspecified (``0.0.0.0``: a NATed peer's listen
   address) or an earlier dial to that peer had to traverse (remembered for
   ``record_ttl`` seconds);
2. otherwise, or if that fails (refused, timed out, somebody else
   answered), :meth:`NATService.traverse
   <p2ptrain.nat.service.NATService.traverse>` walks the paths of
   :mod:`p2ptrain.nat.paths`; the connection it makes is already pooled, and
   its ``path`` says how it was made.

Traversals look peers up in the DHT, whose dials come back here: while a
traversal (or the service's own upkeep) runs, dials it makes go straight to
TCP (:func:`routing_off`), so lookups never start traversals of their own.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections import OrderedDict
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from p2ptrain.errors import NATTraversalError, P2PTrainError
from p2ptrain.nat.paths import Traversal
from p2ptrain.node.address import PeerAddress, is_unspecified_host
from p2ptrain.rpc.connection import Connection
from p2ptrain.secure.identity import PeerID

if TYPE_CHECKING:
    from p2ptrain.nat.service import NATService

__all__ = ["NATRouter", "routing_off"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_ROUTING_OFF: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "p2ptrain_nat_routing_off", default=False
)
_MEMORY = 1024  # peers remembered (undialable ones, last traversals)


async def routing_off(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` (as a task's body) with its dials going straight to TCP."""
    _ROUTING_OFF.set(True)  # the task's own copy of the context
    return await coro


class NATRouter:
    """Direct TCP first, NAT traversal second (see the module docstring).

    Args:
        service: The peer's started NAT service.
    """

    def __init__(self, service: NATService) -> None:
        self._service = service
        self._undialable: OrderedDict[PeerID, float] = OrderedDict()
        self.traversals: OrderedDict[PeerID, Traversal] = OrderedDict()
        """The last traversal to each peer that needed one (path, why cheaper ones failed)."""

    async def route(self, address: PeerAddress) -> Connection:
        """A pooled connection to ``address.peer_id`` (see :class:`~p2ptrain.node.router.Router`).

        Raises:
            NATTraversalError: Neither the address nor any path worked;
                ``attempts`` has the direct dial's failure under ``address``.
            HandshakeError: A path reached somebody who is not the peer.
        """
        node = self._service.node
        peer = address.peer_id
        if peer is None or _ROUTING_OFF.get():
            return await node.connect_direct(address)
        config = self._service.config
        attempts: dict[str, str] = {}
        skip = self._skip_reason(address, peer)
        if skip is None:
            try:
                async with asyncio.timeout(config.direct_timeout):
                    return await node.connect_direct(address)
            except TimeoutError:
                attempts["address"] = f"{address.endpoint}: timed out"
            except P2PTrainError as exc:
                attempts["address"] = f"{address.endpoint}: {exc}"
        else:
            attempts["address"] = f"skipped: {skip}"
        try:
            traversal = await self._service.traverse(peer)
        except NATTraversalError as exc:
            raise NATTraversalError(
                f"cannot reach {peer.short}", {**attempts, **exc.attempts}
            ) from exc
        if traversal.attempt != "pooled":
            self._remember(self.traversals, peer, traversal)
            if traversal.path != "tcp-direct":
                self._remember(self._undialable, peer, asyncio.get_running_loop().time())
            logger.info(
                "%s -> %s: %s (%s)",
                node.peer_id.short,
                peer.short,
                traversal.path,
                attempts["address"],
            )
        return traversal.connection

    def path_to(self, peer: PeerID) -> str | None:
        """The path of the pooled connection to ``peer``, or None."""
        conn = self._service.node.connection_to(peer)
        return None if conn is None else conn.path

    def _skip_reason(self, address: PeerAddress, peer: PeerID) -> str | None:
        if is_unspecified_host(address.host):
            return f"{address.host} is not an address others can dial"
        seen = self._undialable.get(peer)
        if seen is None:
            return None
        if asyncio.get_running_loop().time() - seen > self._service.config.record_ttl:
            del self._undialable[peer]
            return None
        return "the last dial to this peer had to traverse its NAT"

    @staticmethod
    def _remember(table: OrderedDict[PeerID, Any], peer: PeerID, value: Any) -> None:
        table[peer] = value
        table.move_to_end(peer)
        while len(table) > _MEMORY:
            table.popitem(last=False)
