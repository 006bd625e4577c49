"""Which committed micro-batches made it into a stage step: the commit ledger (pure logic).

Every backward a stage server commits gets a sequence number ``seq`` (1, 2,
...) under the server's ``incarnation`` (random per stage a server opens, so
a restarted or moved server never reuses numbers). The trainer keeps each
micro-batch's stage input and output gradient until the server's announced
receipts say what became of its ``seq``:

* ``seq <= contributed`` and in no lost range: it is in a stage step the
  server applied (its samples counted once); the trainer forgets it;
* ``seq`` in a lost range (the server downloaded the swarm's state instead of
  stepping, or left the stage before its step): the trainer replays the
  micro-batch through that stage on another peer;
* the server vanished (no record at all): the same replay.

A server that dies between a stage step and the announcement of that step's
receipts leaves receipts that do not yet count what the step counted. So
before every step it averages with other peers the server announces ahead what
it handed (``handed``) and toward which stage step (``step``): a vanished
server's commits in ``(contributed, handed]`` are *in doubt*, and the
trainer asks the stage's other peers whether that step counted the server
(each keeps who its steps counted; :class:`Vouch`). Counted: forgotten; not
counted, or no peer knows: replayed. Commits past ``handed`` never reached
the optimizer: replayed.

So a killed peer costs a replay of what it had not yet averaged, and no
sample is lost or counted twice. Lost ranges are kept for the last
:data:`MAX_LOST_RANGES` losses.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass
from typing import TypeGuard

from p2ptrain.secure.identity import PeerID

__all__ = ["MAX_LOST_RANGES", "CommitLedger", "Receipts", "Vouch"]

MAX_LOST_RANGES = 32


@dataclass(frozen=True)
class Receipts:
    """What a server announces about its commits."""

    incarnation: str
    contributed: int
    lost: tuple[tuple[int, int], ...]
    handed: int = 0
    """Every commit up to here reached the optimizer (at least ``contributed``)."""
    step: int = 0
    """The stage step the commits in ``(contributed, handed]`` are headed for."""

    def __post_init__(self) -> None:
        if self.handed < self.contributed:
            object.__setattr__(self, "handed", self.contributed)

    def fate(self, seq: int) -> str:
        """``counted``, ``lost`` or ``pending`` for commit ``seq``."""
        if any(lo <= seq <= hi for lo, hi in self.lost):
            return "lost"
        return "counted" if seq <= self.contributed else "pending"

    def in_doubt(self, seq: int) -> bool:
        """Whether commit ``seq`` was handed to the optimizer and its step's fate is
        not in these receipts (for a vanished server: ask who the step counted)."""
        return self.fate(seq) == "pending" and seq <= self.handed

    def settled(self, counted: bool) -> Receipts:
        """These receipts once the step of the commits in doubt is known to have
        ``counted`` this server, or not."""
        if self.handed == self.contributed:
            return self
        if counted:
            return Receipts(self.incarnation, self.handed, self.lost, self.handed, self.step)
        lost = (*self.lost, (self.contributed + 1, self.handed))
        return Receipts(self.incarnation, self.contributed, lost, self.handed, self.step)

    def to_wire(self) -> dict[str, object]:
        """The announcement's fields."""
        return {
            "inc": self.incarnation,
            "cs": self.contributed,
            "ls": [list(r) for r in self.lost],
            "hd": self.handed,
            "st": self.step,
        }

    @classmethod
    def from_wire(cls, value: object) -> Receipts | None:
        """Parse received receipts; ``None`` if malformed."""
        if not isinstance(value, dict):
            return None
        inc, contributed, lost = value.get("inc"), value.get("cs"), value.get("ls")
        handed, step = value.get("hd", contributed), value.get("st", 0)
        if not isinstance(inc, str) or len(inc) > 64:
            return None
        if not (_count(contributed) and _count(handed) and _count(step)):
            return None
        if not isinstance(lost, list) or len(lost) > MAX_LOST_RANGES:
            return None
        ranges = []
        for item in lost:
            if (
                not isinstance(item, list)
                or len(item) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in item)
            ):
                return None
            ranges.append((item[0], item[1]))
        return cls(inc, contributed, tuple(ranges), handed, step)


def _count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class Vouch:
    """Who one stage step this server applied was averaged with, and whose samples
    it counted (its count marker's contributors; ``None``: unknown)."""

    group: frozenset[PeerID]
    counted: frozenset[PeerID] | None

    def answer(self, peer: PeerID) -> bool | None:
        """Whether the step counted ``peer``'s samples; ``None`` if this server cannot say."""
        if peer not in self.group or self.counted is None:
            return None
        return peer in self.counted


class CommitLedger:
    """A server's commits of one stage: numbered, handed over in chunks, stepped or lost.

    Not thread-safe: the server calls it under the stage's state lock.
    """

    def __init__(self) -> None:
        self.incarnation = os.urandom(8).hex()
        self.seq = 0
        self.contributed = 0
        self._resolved = 0  # every seq up to here is contributed or lost
        self._chunks: deque[tuple[int, int]] = deque()  # (last seq, samples) handed over
        self._lost: deque[tuple[int, int]] = deque(maxlen=MAX_LOST_RANGES)

    def commit(self) -> int:
        """Number a new commit."""
        self.seq += 1
        return self.seq

    def handed(self, samples: int) -> None:
        """The commits so far (``samples`` of them not yet handed) went to the optimizer."""
        if samples:
            self._chunks.append((self.seq, samples))

    def stepped(self, own: int) -> None:
        """A step was applied holding ``own`` of this server's samples (the oldest chunks)."""
        while self._chunks and self._chunks[0][1] <= own:
            last, samples = self._chunks.popleft()
            own -= samples
            self.contributed = last
            self._resolved = last

    def lose_handed(self) -> None:
        """Everything handed over and not stepped was dropped (a downloaded state)."""
        if self._chunks:
            self._lose(self._chunks[-1][0])
            self._chunks.clear()

    def lose_unresolved(self) -> None:
        """Everything not yet in a step is dropped (the server leaves the stage)."""
        self._chunks.clear()
        if self.seq > self._resolved:
            self._lose(self.seq)

    def _lose(self, upto: int) -> None:
        self._lost.append((self._resolved + 1, upto))
        self._resolved = upto

    def announced(self, step: int = 0) -> Receipts:
        """The receipts to announce; ``step``: the stage step the optimizer is at (the
        one the commits handed and not yet stepped are headed for)."""
        handed = self._chunks[-1][0] if self._chunks else self.contributed
        return Receipts(self.incarnation, self.contributed, tuple(self._lost), handed, step)
