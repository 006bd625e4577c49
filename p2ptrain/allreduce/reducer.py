"""The reducer of one shard, as a state machine without I/O.

Theory of operation
-------------------
A member that owns a non-empty part of the vector reduces it chunk by chunk.
Every other member is a potential sender. A sender first *joins* (announces
its weight; weight 0 means it sends nothing), then delivers its parts in
chunk order. Chunk ``k`` is complete when every sender has delivered it, has
weight 0, or has been *excluded*; complete chunks are finalized strictly in
order, which is also the order in which results go back to the senders.

A sender is excluded, from the first chunk it has not delivered onwards, when
its stream fails, when it breaks the protocol, when a part holds NaN or ±Inf
(that part is never averaged in), or when the reduce-scatter deadline passes
(:meth:`ShardReducer.expire`). What it delivered before stays in the average.
The reducer's own local values are its own contribution (when its weight is
positive) and follow the same rules.

A finalized chunk with no contributor at all is left at the reducer's local
values, and its result tells the receivers to keep theirs.

Each method returns the chunks it finalized, so the asyncio shell can send
them on.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from p2ptrain.allreduce.aggregation import ChunkAggregator, all_finite, make_aggregator
from p2ptrain.allreduce.config import AllReduceConfig
from p2ptrain.errors import ConfigError, RemoteProtocolError

__all__ = ["ChunkResult", "ShardReducer"]


@dataclass(frozen=True, slots=True)
class ChunkResult:
    """One finalized chunk.

    Attributes:
        index: The chunk's index within the shard.
        start: First element of the chunk, relative to the shard.
        stop: One past its last element, relative to the shard.
        contributors: Member indices whose parts are in the result, sorted.
        excluded: ``(member index, reason)`` of the senders first left out at
            this chunk.
        values: The result (a view of the output), or None when nobody
            contributed and local values are kept.
    """

    index: int
    start: int
    stop: int
    contributors: tuple[int, ...]
    excluded: tuple[tuple[int, str], ...]
    values: torch.Tensor | None


@dataclass(slots=True)
class _Sender:
    weight: float | None = None  # None until it joins
    delivered: int = 0
    excluded: str | None = None


class ShardReducer:
    """Aggregates one shard from the parts of its senders.

    Args:
        out: The shard's place in the output vector (float32, 1-D); the
            results are written there.
        local: The reducer's own values for the shard (same shape).
        local_index: The reducer's member index.
        local_weight: The reducer's own weight; 0 leaves its values out.
        senders: Member indices of the other members (potential senders).
        chunk_elements: Elements per chunk.
        config: The aggregation rule.
    """

    def __init__(
        self,
        *,
        out: torch.Tensor,
        local: torch.Tensor,
        local_index: int,
        local_weight: float,
        senders: Iterable[int],
        chunk_elements: int,
        config: AllReduceConfig,
    ) -> None:
        if out.shape != local.shape or out.dim() != 1:
            raise ConfigError("out and local must be 1-D tensors of one shape")
        if chunk_elements < 1:
            raise ConfigError("chunk_elements must be positive")
        self.out = out
        self.local = local
        self.local_index = local_index
        size = out.numel()
        self.bounds = [
            (lo, min(lo + chunk_elements, size)) for lo in range(0, size, chunk_elements)
        ]
        self._senders = {index: _Sender() for index in senders if index != local_index}
        self._aggregators: list[ChunkAggregator] = [
            make_aggregator(config, out[lo:hi]) for lo, hi in self.bounds
        ]
        self._contributors: list[list[int]] = [[] for _ in self.bounds]
        self._excluded: list[list[tuple[int, str]]] = [[] for _ in self.bounds]
        self.results: list[ChunkResult] = []
        self.expired = False
        if local_weight > 0:
            self._add_local(local_weight)
        self._advance()  # with no other sender, everything is complete already

    # -- queries -----------------------------------------------------------------------

    @property
    def num_chunks(self) -> int:
        """Chunks in the shard."""
        return len(self.bounds)

    @property
    def finalized(self) -> int:
        """Chunks finalized so far (always a prefix)."""
        return len(self.results)

    @property
    def done(self) -> bool:
        """Whether every chunk is finalized."""
        return len(self.results) == len(self.bounds)

    def is_sender(self, index: int) -> bool:
        """Whether member ``index`` may send parts to this shard."""
        return index in self._senders

    def joined(self, index: int) -> bool:
        """Whether sender ``index`` has joined."""
        sender = self._senders.get(index)
        return sender is not None and sender.weight is not None

    def exclusion(self, index: int) -> str | None:
        """Why sender ``index`` was excluded, or None."""
        sender = self._senders.get(index)
        return None if sender is None else sender.excluded

    # -- events ------------------------------------------------------------------------

    def join(self, index: int, weight: float) -> list[ChunkResult]:
        """Sender ``index`` announces its weight.

        Raises:
            RemoteProtocolError: Not a sender, joined twice, or after the deadline.
        """
        sender = self._sender(index)
        if sender.weight is not None:
            raise RemoteProtocolError(f"member {index} joined twice")
        if self.expired:
            raise RemoteProtocolError(f"member {index} joined after the reduce-scatter deadline")
        if sender.excluded is not None:
            raise RemoteProtocolError(f"member {index} was already left out: {sender.excluded}")
        sender.weight = weight
        return self._advance()

    def add(self, index: int, chunk: int, values: torch.Tensor) -> list[ChunkResult]:
        """Sender ``index`` delivers its part of ``chunk``.

        Parts of an excluded sender are ignored. Non-finite values exclude
        the sender instead of being added.

        Raises:
            RemoteProtocolError: Not a joined sender with positive weight, a
                chunk out of order (or repeated), or values of the wrong size.
        """
        sender = self._sender(index)
        if sender.excluded is not None:
            return []
        if sender.weight is None or sender.weight == 0:
            raise RemoteProtocolError(f"member {index} sent a part without a positive weight")
        if chunk != sender.delivered:
            raise RemoteProtocolError(
                f"member {index} sent chunk {chunk}, expected chunk {sender.delivered}"
            )
        lo, hi = self.bounds[chunk]
        if values.shape != (hi - lo,):
            raise RemoteProtocolError(f"chunk {chunk} needs {hi - lo} values")
        if not all_finite(values):
            return self.exclude(index, f"non-finite values in chunk {chunk}")
        self._aggregators[chunk].add(values, sender.weight)
        self._contributors[chunk].append(index)
        sender.delivered += 1
        return self._advance()

    def exclude(self, index: int, reason: str) -> list[ChunkResult]:
        """Stop waiting for sender ``index`` (its remaining chunks are left out)."""
        sender = self._senders.get(index)
        if sender is None:  # not a sender of this shard (e.g. in an all-gather)
            return []
        if sender.excluded is not None or sender.delivered == len(self.bounds):
            return []
        if sender.weight == 0:
            return []  # it was never going to send anything
        sender.excluded = reason
        at = max(sender.delivered, self.finalized)
        if at < len(self.bounds):
            self._excluded[at].append((index, reason))
        return self._advance()

    def expire(self) -> list[ChunkResult]:
        """The reduce-scatter deadline passed: finalize every chunk with what arrived."""
        self.expired = True
        finalized: list[ChunkResult] = []
        for index, sender in self._senders.items():
            if sender.weight is None:
                reason = "did not join before the reduce-scatter deadline"
            else:
                reason = "missed the reduce-scatter deadline"
            finalized += self.exclude(index, reason)
        return finalized + self._advance()

    # -- internals ---------------------------------------------------------------------

    def _sender(self, index: int) -> _Sender:
        sender = self._senders.get(index)
        if sender is None:
            raise RemoteProtocolError(f"member {index} is not a sender of this shard")
        return sender

    def _add_local(self, weight: float) -> None:
        for chunk, (lo, hi) in enumerate(self.bounds):
            values = self.local[lo:hi]
            if not all_finite(values):
                self._excluded[chunk].append(
                    (self.local_index, f"non-finite values in chunk {chunk}")
                )
                return
            self._aggregators[chunk].add(values, weight)
            self._contributors[chunk].append(self.local_index)

    def _complete(self, chunk: int) -> bool:
        for sender in self._senders.values():
            if sender.excluded is None and sender.weight != 0 and sender.delivered <= chunk:
                return False
        return True

    def _advance(self) -> list[ChunkResult]:
        finalized = []
        while not self.done and self._complete(len(self.results)):
            chunk = len(self.results)
            lo, hi = self.bounds[chunk]
            aggregator = self._aggregators[chunk]
            if aggregator.finish():
                values: torch.Tensor | None = self.out[lo:hi]
                contributors = tuple(sorted(self._contributors[chunk]))
            else:
                self.out[lo:hi].copy_(self.local[lo:hi])
                values, contributors = None, ()
            result = ChunkResult(chunk, lo, hi, contributors, tuple(self._excluded[chunk]), values)
            self.results.append(result)
            finalized.append(result)
        return finalized
