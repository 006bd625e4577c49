"""Flow control of the RPC layer as pure state: no I/O, no asyncio, no back-references.

Theory of operation
-------------------
Each side of a stream grants the other a window of bytes (advertised in the
handshake). :class:`StreamFlow` holds both directions of one stream:

* **Sending.** ``credit`` starts at the remote's window. The sender may send
  while it is positive (:attr:`StreamFlow.can_send`), so one frame may
  overdraw it; :meth:`~StreamFlow.sent` charges a frame, and
  :meth:`~StreamFlow.window_received` adds what the remote gives back. The
  remote can only give back what we sent: credit above the window plus one
  frame (the frame being sent while its credit comes back) is a
  :class:`~p2ptrain.errors.RemoteProtocolError`.
* **Receiving.** :meth:`~StreamFlow.received` counts a message's bytes as
  outstanding; more than ``window + one sealed frame`` outstanding is a
  :class:`~p2ptrain.errors.FlowControlError` and leaves the state as it was.
  :meth:`~StreamFlow.consumed` is called as the application reads a message;
  it returns the credit to send back in a WINDOW frame (0: none yet), in
  batches of a quarter window. This cannot stall: a blocked sender has at
  least a window outstanding, so once all of it is read, a batch is due.

A stream that nobody reads therefore holds at most ``window + max_frame``
bytes. Across the streams of one connection, :class:`UnreadBytes` counts the
bytes received and not read yet against the connection's cap and the node's
shared pool (beyond a per-connection reserve), so a peer that fills the pool
cannot starve another peer's small requests.

The shell around these (``stream.py``, ``connection.py``) turns their results
into WINDOW and RESET frames and wakes waiting tasks; the tests drive them
with plain method calls.
"""

from __future__ import annotations

from p2ptrain.errors import FlowControlError, RemoteProtocolError
from p2ptrain.rpc.budget import ByteBudget

__all__ = ["StreamFlow", "UnreadBytes"]


class StreamFlow:
    """The flow-control state of one stream, both directions.

    Args:
        send_window: the remote's window: bytes we may send before it credits any back.
        send_frame_bytes: the largest frame we may send, sealed (what one send can overdraw).
        recv_window: our window: bytes the remote may send before we credit any back.
        recv_frame_bytes: the largest frame we accept, sealed (what one receive can overdraw).
    """

    __slots__ = ("_batch", "_credit", "_credit_limit", "_outstanding", "_recv_limit", "_uncredited")

    def __init__(
        self, *, send_window: int, send_frame_bytes: int, recv_window: int, recv_frame_bytes: int
    ) -> None:
        if min(send_window, send_frame_bytes, recv_window, recv_frame_bytes) < 1:
            raise ValueError(
                "windows and frame sizes must be positive, got"
                f" {send_window}, {send_frame_bytes}, {recv_window}, {recv_frame_bytes}"
            )
        self._credit = send_window
        self._credit_limit = send_window + send_frame_bytes
        self._recv_limit = recv_window + recv_frame_bytes
        self._batch = max(1, recv_window // 4)
        self._outstanding = 0
        self._uncredited = 0

    # -- sending -----------------------------------------------------------------------

    @property
    def credit(self) -> int:
        """Bytes we may still send (negative by at most one frame: the last one overdrew it)."""
        return self._credit

    @property
    def can_send(self) -> bool:
        """Whether a frame may be sent now."""
        return self._credit > 0

    def sent(self, nbytes: int) -> None:
        """Charge a frame of ``nbytes`` (as it went on the wire) that we sent."""
        if nbytes < 0:
            raise ValueError(f"a frame cannot have {nbytes} bytes")
        self._credit -= nbytes

    def window_received(self, amount: object) -> None:
        """Add the credit of a WINDOW frame's ``n`` field (not validated yet).

        Raises:
            RemoteProtocolError: ``amount`` is not a positive integer, or more
                than we sent comes back (credit above the window plus one frame).
        """
        if not isinstance(amount, int) or isinstance(amount, bool) or amount <= 0:
            raise RemoteProtocolError("WINDOW needs a positive integer")
        if self._credit + amount > self._credit_limit:
            raise RemoteProtocolError(
                f"WINDOW of {amount} gives back more than was sent"
                f" (credit {self._credit}, window and one frame {self._credit_limit})"
            )
        self._credit += amount

    # -- receiving ---------------------------------------------------------------------

    @property
    def outstanding(self) -> int:
        """Bytes received and not yet credited back."""
        return self._outstanding

    @property
    def receive_limit(self) -> int:
        """The most bytes that may be outstanding: our window plus one sealed frame."""
        return self._recv_limit

    def received(self, nbytes: int) -> None:
        """Count a received message of ``nbytes`` (its frame's wire size).

        Raises:
            FlowControlError: the remote overran the window; nothing is counted.
        """
        if nbytes < 0:
            raise ValueError(f"a frame cannot have {nbytes} bytes")
        after = self._outstanding + nbytes
        if after > self._recv_limit:
            raise FlowControlError(
                f"remote overran the stream window ({after} > {self._recv_limit})"
            )
        self._outstanding = after

    def consumed(self, nbytes: int, *, more_expected: bool) -> int:
        """The application read a message of ``nbytes``; returns the credit to give back now.

        Args:
            nbytes: what :meth:`received` counted for the message.
            more_expected: whether the remote may still send (no credit once it ended).

        Returns:
            Bytes to credit back in a WINDOW frame, or 0 while below a batch.
        """
        if not 0 <= nbytes <= self._outstanding - self._uncredited:
            raise ValueError(f"{nbytes} bytes consumed; only received ones can be")
        self._uncredited += nbytes
        if not more_expected or self._uncredited < self._batch:
            return 0
        amount, self._uncredited = self._uncredited, 0
        self._outstanding -= amount
        return amount


class UnreadBytes:
    """Bytes received on one connection and not read yet, against its caps.

    Args:
        limit: the most unread bytes on this connection (``max_buffered_bytes``).
        reserve: unread bytes this connection holds outside ``pool``.
        pool: the node-wide budget of unread bytes, shared by its connections.
    """

    __slots__ = ("_limit", "_pool", "_reserve", "used")

    def __init__(self, *, limit: int, reserve: int, pool: ByteBudget) -> None:
        if limit < 1 or reserve < 0:
            raise ValueError(f"bad unread-byte caps: limit {limit}, reserve {reserve}")
        self._limit = limit
        self._reserve = reserve
        self._pool = pool
        self.used = 0
        """Unread bytes now, over every stream of the connection."""

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more unread bytes fit the connection's cap and the node's pool."""
        after = self.used + nbytes
        pooled = self._pooled(after) - self._pooled(self.used)
        return after <= self._limit and self._pool.fits(pooled)

    def refusal(self, nbytes: int) -> str:
        """Why :meth:`fits` refuses ``nbytes`` (for the RESET message)."""
        if self.used + nbytes > self._limit:
            return f"{self.used} bytes of this connection are unread (limit {self._limit})"
        return (
            f"{self._pool.used} bytes of the node's connections are unread"
            f" (node limit {self._pool.limit}); retry later"
        )

    def charge(self, nbytes: int) -> None:
        """Count ``nbytes`` received and not read yet.

        Raises:
            FlowControlError: they do not fit (:meth:`refusal` says why); nothing is counted.
        """
        before = self.used
        after = before + nbytes
        reserve = self._reserve
        pooled = max(0, after - reserve) - max(0, before - reserve)
        if after > self._limit or not self._pool.fits(pooled):
            raise FlowControlError(self.refusal(nbytes))
        self.used = after
        self._pool.used += pooled

    def release(self, nbytes: int) -> None:
        """``nbytes`` counted by :meth:`charge` were read or dropped."""
        before = self.used
        if not 0 <= nbytes <= before:
            raise ValueError(f"cannot release {nbytes} of {before} unread bytes")
        after = self.used = before - nbytes
        reserve = self._reserve
        pooled = max(0, before - reserve) - max(0, after - reserve)
        if pooled:
            self._pool.give_back(pooled)

    def _pooled(self, unread: int) -> int:
        """Of ``unread`` bytes, those charged to the node-wide pool."""
        return max(0, unread - self._reserve)
