"""Budgets shared by the connections of a node.

A node hands each of its connections the same three :class:`ByteBudget`
objects: bytes of large replies being sent, bytes of received messages not
read yet, and streams opened by peers (a count, one unit per stream). Each
connection has its own, smaller caps as well; the shared ones bound what many
connections together may pin.

Large unary replies (a DHT dictionary can be megabytes) are charged to one
:class:`ByteBudget` from the moment they are handed to the connection until
they left its send buffer. A reply that does not fit is refused at once
(``resource_exhausted``) rather than held: a peer that asks for large replies
and never reads them can then pin at most the budget, whatever the number of
its requests and connections.
"""

from __future__ import annotations

__all__ = ["ByteBudget"]


class ByteBudget:
    """Bytes (or other units, such as streams) that may be in use at once.

    Args:
        limit: the most units held at once.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("a byte budget must be positive")
        self.limit = limit
        self.used = 0
        self.refused = 0

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` could be taken now (a handler checks before building a reply)."""
        return self.used + nbytes <= self.limit

    def try_take(self, nbytes: int) -> bool:
        """Take ``nbytes`` if they fit; whether they were taken."""
        if self.used + nbytes > self.limit:
            self.refused += 1
            return False
        self.used += nbytes
        return True

    def give_back(self, nbytes: int) -> None:
        """Return ``nbytes`` taken earlier."""
        self.used = max(0, self.used - nbytes)
