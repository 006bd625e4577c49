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

So a killed peer costs a replay of what it had not yet averaged, and no
sample is lost or counted twice. Lost ranges are kept for the last
:data:`MAX_LOST_RANGES` losses.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass

__all__ = ["MAX_LOST_RANGES", "CommitLedger", "Receipts"]

MAX_LOST_RANGES = 32


@dataclass(frozen=True)
class Receipts:
    """What a server announces about its commits."""

    incarnation: str
    contributed: int
    lost: tuple[tuple[int, int], ...]

    def fate(self, seq: int) -> str:
        """``counted``, ``lost`` or ``pending`` for commit ``seq``."""
        if any(lo <= seq <= hi for lo, hi in self.lost):
            return "lost"
        return "counted" if seq <= self.contributed else "pending"

    def to_wire(self) -> dict[str, object]:
        """The announcement's fields."""
        return {"inc": self.incarnation, "cs": self.contributed, "ls": [list(r) for r in self.lost]}

    @classmethod
    def from_wire(cls, value: object) -> Receipts | None:
        """Parse received receipts; ``None`` if malformed."""
        if not isinstance(value, dict):
            return None
        inc, contributed, lost = value.get("inc"), value.get("cs"), value.get("ls")
        if not isinstance(inc, str) or len(inc) > 64:
            return None
        if isinstance(contributed, bool) or not isinstance(contributed, int) or contributed < 0:
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
        return cls(inc, contributed, tuple(ranges))


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

    def announced(self) -> Receipts:
        """The receipts to announce."""
        return Receipts(self.incarnation, self.contributed, tuple(self._lost))
