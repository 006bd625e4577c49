"""One logical stream of an RPC connection, with credit-based flow control.

The stream is the asyncio shell around its :class:`~p2ptrain.rpc.flow.StreamFlow`
(the pure window accounting, see :mod:`.flow`): a sender waits while the state
says it may not send, the reader's consumption turns into WINDOW frames. A
stream that nobody reads holds at most ``window + max_frame`` bytes and never
stalls the other streams of the connection; its unread messages count against
the connection's :class:`~p2ptrain.rpc.flow.UnreadBytes`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from p2ptrain.errors import (
    ConnectionClosedError,
    DeadlineExceededError,
    LocalProtocolError,
    P2PTrainError,
    RemoteProtocolError,
    StreamEndedError,
    UnavailableError,
    rpc_error_from_code,
)
from p2ptrain.rpc.flow import StreamFlow, UnreadBytes
from p2ptrain.rpc.handlers import Message
from p2ptrain.wire.frames import FLAG_END, Buffer, Frame, FrameType

if TYPE_CHECKING:
    from p2ptrain.rpc.connection import Connection

__all__ = ["PayloadTarget", "RPCStream"]

PayloadTarget = Callable[[Any, int], memoryview | None]
"""``(body, nbytes)`` → the buffer a message's payload goes to, or None (see
:meth:`RPCStream.receive_payloads_into`)."""


class RPCStream:
    """A bidirectional stream of messages; obtained from a Connection or a handler.

    ``send`` and ``recv`` honour the stream's deadline; ``async for message in
    stream`` reads until the remote half-closes. Use ``async with`` (or call
    :meth:`aclose`) so an abandoned stream is reset on the remote too.
    """

    def __init__(
        self,
        connection: Connection,
        stream_id: int,
        method: str,
        *,
        flow: StreamFlow,
        unread: UnreadBytes,
        deadline: float | None,
    ) -> None:
        self._conn = connection
        self.stream_id = stream_id
        self.method = method
        self.deadline = deadline
        self.flow = flow
        """The stream's window accounting (the connection charges the OPEN's message to it)."""
        self._unread = unread
        self._queue: deque[tuple[Message, int]] = deque()
        self._queued_bytes = 0  # charged to the connection's buffered_bytes
        self._recv_waiter: asyncio.Future[None] | None = None
        self._credit_waiter: asyncio.Future[None] | None = None
        self._send_lock: asyncio.Lock | None = None  # created on first send
        self._remote_ended = False
        self._local_ended = False
        self._error: P2PTrainError | None = None
        self._payload_target: PayloadTarget | None = None
        self.handler_task: asyncio.Task[None] | None = None
        self.handler_started = False
        self.handler_limit: float | None = None
        """Loop time past which the node resets a stream it serves (handler_timeout)."""
        self.opened = False
        """Whether the remote knows of this stream (its OPEN was sent or received)."""

    # -- public API --------------------------------------------------------------------

    @property
    def connection(self) -> Connection:
        """The connection this stream runs on (e.g. to call the caller back over it)."""
        return self._conn

    @property
    def finished(self) -> bool:
        """Both sides are done (or the stream was reset)."""
        return self._error is not None or (self._local_ended and self._remote_ended)

    @property
    def remote_ended(self) -> bool:
        """The remote will send no more messages."""
        return self._remote_ended

    async def send(self, body: Any = None, payload: Buffer = b"", *, end: bool = False) -> None:
        """Send one message; with ``end=True`` also half-close our side."""
        async with self._lock():
            self._check_can_send()
            while not self.flow.can_send:
                await self._wait("_credit_waiter")
                self._check_can_send()
            fields = {"b": body} if body is not None else None
            frame = Frame(FrameType.DATA, self.stream_id, FLAG_END if end else 0, fields, payload)
            self.flow.sent(await self._conn._send_stream_frame(self, frame))
            if end:
                self._set_local_ended()

    async def end(self) -> None:
        """Half-close: tell the remote we send nothing more."""
        async with self._lock():
            self._check_can_send()
            await self._conn._send_stream_frame(self, Frame(FrameType.END, self.stream_id))
            self._set_local_ended()

    async def recv(self) -> Message:
        """The next message.

        Raises:
            StreamEndedError: the remote half-closed and every message was read.
            RPCError: the remote reset the stream (typed by its code), or the
                deadline passed (DeadlineExceededError).
            UnavailableError: the connection dropped.
        """
        while not self._queue:
            if self._error is not None:
                raise self._error
            if self._remote_ended:
                raise StreamEndedError(f"stream {self.method!r} ended")
            await self._wait("_recv_waiter")
        message, size = self._queue.popleft()
        self._release_queued(size)
        amount = self.flow.consumed(size, more_expected=not self._remote_ended)
        if amount:
            with contextlib.suppress(ConnectionClosedError):  # then transport_lost fails us
                self._conn._send_window_update(self.stream_id, amount)
        return message

    def receive_payloads_into(self, target: PayloadTarget | None) -> None:
        """Let ``target`` pick where the payloads of later messages are received.

        ``target(body, nbytes)`` runs when a message's body has arrived and
        its payload of ``nbytes`` has not. A writable byte buffer of exactly
        ``nbytes`` that it returns receives the payload straight from the
        socket, and the message's payload is then that buffer; None (or
        anything else) leaves the payload to a fresh buffer. The body is
        untrusted and not yet validated; ``target`` must be quick and must
        not raise. Transports that cannot do this (e.g. WebRTC) never call it.

        A buffer handed out may be written to until its message is received
        or the stream finishes; None stops further calls.
        """
        self._payload_target = target

    def __aiter__(self) -> AsyncIterator[Message]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Message]:
        while True:
            try:
                yield await self.recv()
            except StreamEndedError:
                return

    def reset(self, code: str = "cancelled", message: str = "") -> None:
        """Abort the stream on both sides (never blocks)."""
        if self.finished:
            return
        self._fail(rpc_error_from_code(code, message or "reset locally"))
        self._conn._send_reset(self.stream_id, code, message)

    async def aclose(self) -> None:
        """Reset the stream unless both sides already finished cleanly."""
        if not self.finished:
            self.reset("cancelled", "stream closed by its owner")

    async def __aenter__(self) -> RPCStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- called by the connection ------------------------------------------------------

    def _payload_buffer(self, body: Any, nbytes: int) -> memoryview | None:
        target = self._payload_target
        if target is None or self._error is not None or self._remote_ended:
            return None
        return target(body, nbytes)

    def _on_message(self, message: Message, size: int) -> None:
        if self._remote_ended:
            raise RemoteProtocolError("DATA after the remote ended the stream")
        self.flow.received(size)  # FlowControlError: the remote overran the window
        self._unread.charge(size)  # FlowControlError: the connection's buffer is full
        self._queued_bytes += size
        self._queue.append((message, size))
        _wake(self._recv_waiter)

    def _on_remote_end(self) -> None:
        self._remote_ended = True
        _wake(self._recv_waiter)
        self._conn._maybe_forget(self)

    def _on_reset(self, code: str, message: str) -> None:
        if self._error is None:
            self._fail(rpc_error_from_code(code, message))

    def _on_credit(self, amount: object) -> None:
        self.flow.window_received(amount)
        _wake(self._credit_waiter)

    def _on_connection_lost(self, exc: P2PTrainError | None) -> None:
        if self._error is None:
            error = UnavailableError(f"connection lost: {exc}" if exc else "connection closed")
            error.__cause__ = exc
            self._fail(error)

    # -- internals ---------------------------------------------------------------------

    def _lock(self) -> asyncio.Lock:
        if self._send_lock is None:
            self._send_lock = asyncio.Lock()
        return self._send_lock

    def _release_queued(self, size: int) -> None:
        size = min(size, self._queued_bytes)  # 0 once _fail released them all
        self._queued_bytes -= size
        self._unread.release(size)

    def _fail(self, error: P2PTrainError) -> None:
        self._error = error
        # A failed stream's unread messages no longer count against the
        # connection (they are freed with the stream).
        self._release_queued(self._queued_bytes)
        self._payload_target = None
        _wake(self._recv_waiter)
        _wake(self._credit_waiter)
        self._conn._maybe_forget(self)
        # A handler that already runs is cancelled; one that has not started yet
        # runs and meets the error on its first recv/send, so it learns of the stream.
        task = self.handler_task
        if task is not None and self.handler_started and task is not asyncio.current_task():
            task.cancel()

    def _check_can_send(self) -> None:
        if self._error is not None:
            raise self._error
        if self._local_ended:
            raise LocalProtocolError("cannot send after ending the stream")

    def _set_local_ended(self) -> None:
        self._local_ended = True
        self._conn._maybe_forget(self)

    async def _wait(self, slot: str) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        setattr(self, slot, waiter)
        try:
            if self.deadline is None:
                await waiter
            else:
                async with asyncio.timeout_at(self.deadline):
                    await waiter
        except TimeoutError:
            self.reset("deadline_exceeded", "deadline passed")
            raise DeadlineExceededError(f"stream {self.method!r}: deadline passed") from None
        finally:
            setattr(self, slot, None)


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)
