"""A node's all-reduce service: the RPC handler, the running rounds, and :func:`allreduce`.

Attach the service to a node when the node starts (``AllReduceService.attach``),
before it is put in any group: a member whose service is not attached yet
answers the others' streams with ``not_found``, and they then keep their
local values for its part. Streams that arrive before this member has entered
the round (the plan reaches members at slightly different times) wait for it,
for at most ``join_timeout`` seconds.

A matchmaking layer hands a finished :class:`~p2ptrain.allreduce.group.GroupPlan`
to :meth:`AllReduceService.allreduce` on every member; nothing else is needed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import ClassVar, overload

import torch

from p2ptrain.allreduce.butterfly import ButterflyRound, RoundObserver
from p2ptrain.allreduce.config import AllReduceConfig
from p2ptrain.allreduce.group import GroupPlan
from p2ptrain.allreduce.protocol import METHOD, Hello
from p2ptrain.allreduce.report import AllReduceReport
from p2ptrain.allreduce.vector import flatten, unflatten
from p2ptrain.errors import (
    ConfigError,
    DeadlineExceededError,
    InvalidArgumentError,
    RemoteProtocolError,
    ResourceExhaustedError,
    RPCError,
    StreamEndedError,
)
from p2ptrain.measure.estimates import LinkEstimator
from p2ptrain.measure.probe import PROBE_METHOD, serve_probes
from p2ptrain.node.node import Node
from p2ptrain.rpc.handlers import CallContext
from p2ptrain.rpc.stream import RPCStream
from p2ptrain.secure.identity import PeerID

__all__ = ["AllReduceService", "allreduce"]

logger = logging.getLogger(__name__)


class _Waiting:
    """Handlers waiting for a round this member has not entered yet."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.count = 0


class AllReduceService:
    """Serves the all-reduce RPC of one node and runs its rounds.

    It also answers bandwidth probes (:mod:`p2ptrain.measure.probe`).

    Args:
        node: The node; the service registers its handler right away.
        join_timeout: Seconds an incoming stream may take to send its hello
            and for this member to enter the named round.
        max_waiting_rounds: Distinct unknown round ids that may be waited for
            at once (more are refused with ``resource_exhausted``).
        remember_rounds: Finished round ids remembered, so that late streams
            are refused at once and round ids are never reused.
        links: Where every round's receiver-timed streams are recorded (the
            estimates this peer announces), or None. Its upload capacity
            (probe or typed-in rate) also paces the rounds' bulk streams
            (``AllReduceConfig.pacing_headroom``).
        on_late: Called after a round that ran late against its prediction
            (the owner of ``links`` may probe again).

    Raises:
        ConfigError: The node already serves the all-reduce method, or a bad
            argument.
    """

    _attached: ClassVar[weakref.WeakKeyDictionary[Node, AllReduceService]] = (
        weakref.WeakKeyDictionary()
    )

    def __init__(
        self,
        node: Node,
        *,
        join_timeout: float = 10.0,
        max_waiting_rounds: int = 64,
        remember_rounds: int = 1024,
        links: LinkEstimator | None = None,
        on_late: Callable[[], None] | None = None,
    ) -> None:
        if not (math.isfinite(join_timeout) and join_timeout > 0):
            raise ConfigError("join_timeout must be positive and finite")
        if max_waiting_rounds < 1 or remember_rounds < 1:
            raise ConfigError("max_waiting_rounds and remember_rounds must be at least 1")
        self.node = node
        self.join_timeout = join_timeout
        self.links = links
        self.on_late = on_late
        self._max_waiting = max_waiting_rounds
        self._remember = remember_rounds
        self._rounds: dict[bytes, ButterflyRound] = {}
        self._waiting: dict[bytes, _Waiting] = {}
        self._finished: OrderedDict[bytes, None] = OrderedDict()
        self._lost: OrderedDict[bytes, dict[PeerID, str]] = OrderedDict()
        node.handlers.add_stream(METHOD, self._serve)
        serve_probes(node)
        self._attached[node] = self

    @classmethod
    def attach(cls, node: Node) -> AllReduceService:
        """The service attached to ``node``, created with default settings if none is.

        To choose the settings, construct the service yourself first.
        """
        service = cls._attached.get(node)
        return cls(node) if service is None else service

    def close(self) -> None:
        """Stop serving the all-reduce method (running rounds are not interrupted)."""
        self.node.handlers.remove(METHOD)
        self.node.handlers.remove(PROBE_METHOD)
        if self._attached.get(self.node) is self:
            del self._attached[self.node]

    @property
    def active_rounds(self) -> int:
        """Rounds running right now."""
        return len(self._rounds)

    @overload
    async def allreduce(
        self,
        group: GroupPlan,
        tensors: torch.Tensor,
        weight: float = ...,
        *,
        config: AllReduceConfig | None = ...,
        observer: RoundObserver | None = ...,
        gather_only: bool = ...,
    ) -> tuple[torch.Tensor, AllReduceReport]: ...

    @overload
    async def allreduce(
        self,
        group: GroupPlan,
        tensors: Sequence[torch.Tensor],
        weight: float = ...,
        *,
        config: AllReduceConfig | None = ...,
        observer: RoundObserver | None = ...,
        gather_only: bool = ...,
    ) -> tuple[list[torch.Tensor], AllReduceReport]: ...

    async def allreduce(
        self,
        group: GroupPlan,
        tensors: torch.Tensor | Sequence[torch.Tensor],
        weight: float = 1.0,
        *,
        config: AllReduceConfig | None = None,
        observer: RoundObserver | None = None,
        gather_only: bool = False,
    ) -> tuple[torch.Tensor | list[torch.Tensor], AllReduceReport]:
        """Average ``tensors`` with the other members of ``group``, weighted.

        Every member calls this with the same plan, its own tensors (same
        shapes everywhere) and its own weight. The call returns by
        ``group.round_timeout`` whatever happens; parts whose average did not
        arrive keep this member's local values, and the report says which.

        Args:
            group: The group plan; this node must be a member.
            tensors: One floating-point tensor or a sequence of them, with
                ``group.num_elements`` elements in all. Not modified; do not
                modify them during the call.
            weight: This member's weight, e.g. the samples behind its
                gradients; finite and >= 0. A member of weight 0 receives the
                average without changing it.
            config: Codec and aggregation rule (defaults: no compression, mean).
            observer: Callbacks at protocol events.
            gather_only: All-gather instead of averaging: this member sends
                nothing to the others' parts and its own part comes back to
                everyone as its local values (every member passes it; the
                grouped averaging in :mod:`p2ptrain.allreduce.grouped` uses it).

        Returns:
            The averaged tensors (same structure, shapes and dtypes) and the
            report of the round.

        Raises:
            ConfigError: A bad argument, this node not a member, a vector of
                the wrong length, or a round id already used here.
        """
        config = config or AllReduceConfig()
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise ConfigError(f"weight must be a number, got {weight!r}")
        if not math.isfinite(weight) or weight < 0:
            raise ConfigError(f"weight must be finite and >= 0, got {weight!r}")
        flat, layout = flatten(tensors)
        round_id = group.round_id
        if round_id in self._rounds or round_id in self._finished:
            raise ConfigError(f"round id {round_id.hex()} was already used on this node")
        round_ = ButterflyRound(
            self.node,
            group,
            flat,
            float(weight),
            config=config,
            observer=observer,
            gather_only=gather_only,
            upload_bytes_per_s=None
            if self.links is None
            else self.links.upload_capacity_bytes_per_s,
        )
        self._rounds[round_id] = round_
        for peer, reason in self._lost.pop(round_id, {}).items():
            index = group.index_of(peer)
            if index is not None:
                round_.sender_failed(index, reason)
        waiting = self._waiting.get(round_id)
        if waiting is not None:
            waiting.event.set()
        try:
            out, report = await round_.run()
        finally:
            del self._rounds[round_id]
            self._finished[round_id] = None
            while len(self._finished) > self._remember:
                self._finished.popitem(last=False)
        if self.links is not None:
            late = self.links.observe_round(
                report.upload_streams,
                report.download_streams,
                total_s=report.total_s,
                predicted_s=report.predicted_s,
            )
            if late and self.on_late is not None:
                self.on_late()
        return unflatten(out, layout), report

    # -- the handler -------------------------------------------------------------------

    async def _serve(self, ctx: CallContext, stream: RPCStream) -> None:
        hello: Hello | None = None
        round_: ButterflyRound | None = None
        try:
            async with asyncio.timeout(self.join_timeout):
                message = await stream.recv()
                hello = Hello.parse(message.body)
                round_ = await self._find_round(hello.round_id)
        except TimeoutError:
            stream.reset(DeadlineExceededError.code, "no such round started in time")
        except StreamEndedError:
            stream.reset(InvalidArgumentError.code, "the stream ended before its hello")
        except RemoteProtocolError as exc:
            logger.info("bad all-reduce hello from %s: %s", ctx.peer.short, exc)
            stream.reset(InvalidArgumentError.code, str(exc))
        except RPCError as exc:
            stream.reset(exc.code, exc.message)
        finally:
            if hello is not None and round_ is None:  # also when the stream failed meanwhile
                self._sender_lost(hello.round_id, ctx.peer)
        if hello is not None and round_ is not None:
            await round_.serve(ctx.peer, hello, stream)

    def _sender_lost(self, round_id: bytes, peer: PeerID) -> None:
        """A sender's stream for ``round_id`` ended before that round started here.

        It will not send on that stream; the round, once it starts, must not
        wait for it until the reduce-scatter deadline.
        """
        reason = "its stream ended before this member entered the round"
        round_ = self._rounds.get(round_id)
        if round_ is not None:
            index = round_.plan.index_of(peer)
            if index is not None:
                round_.sender_failed(index, reason)
            return
        if round_id in self._finished:
            return
        self._lost.setdefault(round_id, {})[peer] = reason
        self._lost.move_to_end(round_id)
        while len(self._lost) > self._max_waiting:
            self._lost.popitem(last=False)

    async def _find_round(self, round_id: bytes) -> ButterflyRound:
        round_ = self._rounds.get(round_id)
        if round_ is not None:
            return round_
        if round_id in self._finished:
            raise InvalidArgumentError("that round is over")
        waiting = self._waiting.get(round_id)
        if waiting is None:
            if len(self._waiting) >= self._max_waiting:
                raise ResourceExhaustedError("too many unknown rounds waited for")
            waiting = self._waiting[round_id] = _Waiting()
        waiting.count += 1
        try:
            await waiting.event.wait()
        finally:
            waiting.count -= 1
            if waiting.count == 0 and self._waiting.get(round_id) is waiting:
                del self._waiting[round_id]
        round_ = self._rounds.get(round_id)
        if round_ is None:  # it finished before this handler ran again
            raise InvalidArgumentError("that round is over")
        return round_


@overload
async def allreduce(
    node: Node | AllReduceService,
    group: GroupPlan,
    tensors: torch.Tensor,
    weight: float = ...,
    *,
    config: AllReduceConfig | None = ...,
    observer: RoundObserver | None = ...,
) -> tuple[torch.Tensor, AllReduceReport]: ...


@overload
async def allreduce(
    node: Node | AllReduceService,
    group: GroupPlan,
    tensors: Sequence[torch.Tensor],
    weight: float = ...,
    *,
    config: AllReduceConfig | None = ...,
    observer: RoundObserver | None = ...,
) -> tuple[list[torch.Tensor], AllReduceReport]: ...


async def allreduce(
    node: Node | AllReduceService,
    group: GroupPlan,
    tensors: torch.Tensor | Sequence[torch.Tensor],
    weight: float = 1.0,
    *,
    config: AllReduceConfig | None = None,
    observer: RoundObserver | None = None,
) -> tuple[torch.Tensor | list[torch.Tensor], AllReduceReport]:
    """Average ``tensors`` over ``group``: see :meth:`AllReduceService.allreduce`.

    ``node`` may be a :class:`Node` (its attached service is used, attached
    now if needed: attach it at startup instead, see the module docstring)
    or the service itself.
    """
    service = node if isinstance(node, AllReduceService) else AllReduceService.attach(node)
    return await service.allreduce(group, tensors, weight, config=config, observer=observer)
