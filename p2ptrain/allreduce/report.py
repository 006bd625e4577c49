"""What one all-reduce call did, as seen by one member."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from p2ptrain.measure.estimates import StreamTiming
from p2ptrain.secure.identity import PeerID

__all__ = ["AllReduceReport", "ShardReport"]


@dataclass(frozen=True)
class ShardReport:
    """One reducer's part of the vector, from this member's point of view.

    Attributes:
        owner: Member index of the reducer.
        start: First element of the part in the flat vector.
        stop: One past its last element.
        chunk_contributors: For every chunk, the member indices whose values
            are in the average this member received (sorted), or None when no
            average arrived and this member kept its local values.
        excluded: Senders the reducer left out of some chunk, with its reason
            (member index → reason), as far as this member learned it.
        error: Why the exchange with the reducer failed (then the chunks
            without a result kept local values), or None.
    """

    owner: int
    start: int
    stop: int
    chunk_contributors: tuple[tuple[int, ...] | None, ...]
    excluded: dict[int, str]
    error: str | None

    @property
    def averaged_chunks(self) -> int:
        """Chunks whose average arrived (with at least one contributor)."""
        return sum(1 for c in self.chunk_contributors if c)

    @property
    def complete(self) -> bool:
        """Whether every chunk was averaged."""
        return self.averaged_chunks == len(self.chunk_contributors)

    @property
    def contributors(self) -> tuple[int, ...]:
        """Members whose values are in every chunk of the part."""
        sets = [set(c) for c in self.chunk_contributors if c is not None]
        if not sets or len(sets) < len(self.chunk_contributors):
            return ()
        return tuple(sorted(set.intersection(*sets)))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form."""
        return {
            "owner": self.owner,
            "start": self.start,
            "stop": self.stop,
            "chunk_contributors": [None if c is None else list(c) for c in self.chunk_contributors],
            "excluded": {str(k): v for k, v in self.excluded.items()},
            "error": self.error,
        }


@dataclass(frozen=True)
class AllReduceReport:
    """The outcome of one all-reduce call for one member.

    Attributes:
        round_id: The round.
        members: PeerIDs of the members, in plan order.
        index: This member's index.
        weight: This member's weight.
        shards: One report per reducer (member with a non-empty part), in
            member order.
        failed: Members this member saw fail (as sender or reducer), with why.
        bytes_sent: Tensor payload bytes this member sent (parts and results).
        bytes_received: Tensor payload bytes it received.
        reduce_scatter_s: Seconds from entering the round until its own parts
            were all sent and its own part was reduced.
        all_gather_s: Seconds from then until every result was received and
            sent (the phases overlap, so this is the tail after the first).
        total_s: Seconds the call took.
        send_s: Seconds from the first to the last payload this member sent.
        receive_s: Seconds during which a payload was arriving at this member:
            from the first bytes of a payload to its reading, with overlapping
            payloads counted once (on transports that do not report the first
            bytes: from the first to the last payload read). ``bytes_received``
            over it is the download rate achieved while receiving.
        predicted_s: The plan's predicted round time, if any.
        upload_streams: This member's outgoing streams (parts to each
            reducer, results to each sender) as their receivers timed them
            and reported back: bytes and seconds in flight.
        download_streams: Its incoming streams, timed here the same way.
    """

    round_id: bytes
    members: tuple[PeerID, ...]
    index: int
    weight: float
    shards: tuple[ShardReport, ...]
    failed: dict[int, str]
    bytes_sent: int
    bytes_received: int
    reduce_scatter_s: float
    all_gather_s: float
    total_s: float
    send_s: float
    receive_s: float
    predicted_s: float | None
    upload_streams: tuple[StreamTiming, ...] = ()
    download_streams: tuple[StreamTiming, ...] = ()

    @property
    def complete(self) -> bool:
        """Whether every part of the vector was averaged."""
        return all(shard.complete for shard in self.shards)

    @property
    def slowdown(self) -> float | None:
        """Achieved over predicted time (None without a prediction)."""
        if not self.predicted_s:
            return None
        return self.total_s / self.predicted_s

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form."""
        return {
            "round_id": self.round_id.hex(),
            "members": [str(m) for m in self.members],
            "index": self.index,
            "weight": self.weight,
            "shards": [s.to_dict() for s in self.shards],
            "failed": {str(k): v for k, v in self.failed.items()},
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "reduce_scatter_s": self.reduce_scatter_s,
            "all_gather_s": self.all_gather_s,
            "total_s": self.total_s,
            "send_s": self.send_s,
            "receive_s": self.receive_s,
            "predicted_s": self.predicted_s,
            "upload_streams": [[t.nbytes, t.seconds] for t in self.upload_streams],
            "download_streams": [[t.nbytes, t.seconds] for t in self.download_streams],
        }
