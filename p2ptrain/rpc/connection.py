"""An authenticated connection multiplexing many RPC streams over one transport.

Theory of operation
-------------------
After the handshake a :class:`Connection` owns its
:class:`~p2ptrain.transport.base.FrameTransport` and receives every frame.
Streams opened by the dialing side (the initiator) have odd ids, the others
even; ids only grow, so a frame for an unknown id below the highest seen is a
late frame for a finished stream and is dropped, while one above it is a
protocol violation.

* ``OPEN {m: method, d: deadline ms}`` starts a stream; with ``FLAG_MESSAGE``
  it also carries the first message (``b`` and the payload), with
  ``FLAG_END`` the opener sends nothing more (a unary request is one frame).
* ``DATA {b: body}`` + payload carries one message; ``FLAG_END`` half-closes.
* ``END`` half-closes without a message; ``RESET {c: code, m: message}``
  aborts the stream on both sides (cancellation, errors, deadlines).
* ``WINDOW {n: bytes}`` returns flow-control credit (see :mod:`.stream`).
* ``PING``/``PONG {n: nonce}`` measure liveness; ``GOAWAY`` announces a close.

A node that closes an idle connection to make room (:meth:`Connection.go_away`)
must not lose a stream the remote opened just before it learnt of the close
(its OPEN may be in flight). So it only sends ``GOAWAY`` and keeps serving;
the remote opens no more streams on the connection and closes it once its own
streams are done. Should the remote not close it, the closer does after
``goaway_grace_s`` without open streams.

A protocol error confined to one stream resets that stream; a frame that
breaks the connection's framing or state closes the connection. Either way
the node keeps serving its other connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable
from typing import Any

from p2ptrain.aio import BackgroundTasks
from p2ptrain.errors import (
    ConfigError,
    ConnectionClosedError,
    DeadlineExceededError,
    DHTError,
    FlowControlError,
    LocalProtocolError,
    MethodNotFoundError,
    P2PTrainError,
    RemoteProtocolError,
    ResourceExhaustedError,
    RPCError,
    StreamEndedError,
    TransportError,
    TransportTimeoutError,
    UnavailableError,
)
from p2ptrain.rpc.budget import ByteBudget
from p2ptrain.rpc.config import ConnectionConfig
from p2ptrain.rpc.flow import StreamFlow, UnreadBytes
from p2ptrain.rpc.handlers import CallContext, HandlerTable, Message, _Entry
from p2ptrain.rpc.stream import RPCStream
from p2ptrain.secure.handshake import HandshakeResult
from p2ptrain.secure.identity import PeerID
from p2ptrain.transport.base import FrameTransport
from p2ptrain.transport.crypto_offload import effective_offload_bytes
from p2ptrain.wire.frames import (
    FLAG_END,
    FLAG_MESSAGE,
    Buffer,
    Frame,
    FrameType,
    buffer_nbytes,
)
from p2ptrain.wire.records import RECORD_OVERHEAD

__all__ = ["Connection"]

logger = logging.getLogger(__name__)

_MAX_METHOD = 128
_SMALL_REPLY = 64 * 1024
"""Replies with a smaller payload are not charged to the reply budget."""


class Connection:
    """An authenticated, multiplexed connection to one remote peer.

    Upper layers use :meth:`call` and :meth:`open_stream`; they never see
    whether the transport underneath is TCP or a WebRTC data channel.
    """

    def __init__(
        self,
        transport: FrameTransport,
        remote: HandshakeResult,
        *,
        initiator: bool,
        handlers: HandlerTable,
        config: ConnectionConfig,
        reply_budget: ByteBudget | None = None,
        unread_budget: ByteBudget | None = None,
        stream_budget: ByteBudget | None = None,
    ) -> None:
        self.transport = transport
        self.remote_peer: PeerID = remote.peer_id
        self.remote_public_key = remote.public_key
        self.initiator = initiator
        self._handlers = handlers
        self._config = config
        self._reply_budget = reply_budget or ByteBudget(config.max_reply_bytes_in_flight)
        # Shared by the node's connections (a connection made alone gets its own).
        self._unread = UnreadBytes(
            limit=config.max_buffered_bytes,
            reserve=config.connection_reserve_bytes,
            pool=unread_budget or ByteBudget(config.max_node_buffered_bytes),
        )
        self._stream_budget = stream_budget or ByteBudget(config.max_node_streams)
        self._remote_streams = 0  # open streams the remote opened
        self._send_window = remote.stream_window
        # One frame may overdraw a window: at most a whole frame, sealed (its tags).
        self._send_frame_bytes = remote.max_frame_bytes + RECORD_OVERHEAD
        self._recv_frame_bytes = config.max_frame_bytes + RECORD_OVERHEAD
        transport.max_send_frame = remote.max_frame_bytes
        self._streams: dict[int, RPCStream] = {}
        self._pacing: dict[int, float] = {}  # kernel pacing requests (bytes/s) by ticket
        self._pacing_ticket = 0
        self._next_id = 1 if initiator else 2
        self._highest_remote_id = 0
        self._remote_parity = 0 if initiator else 1
        self._tasks = BackgroundTasks(f"connection to {self.remote_peer.short}")
        """The handlers serving the remote's streams, and the maintenance task."""
        self._pings: dict[int, asyncio.Future[None]] = {}
        self._ping_ids = itertools.count(1)
        self._loop = asyncio.get_running_loop()
        self.last_received = self._loop.time()
        self.idle_since: float | None = self._loop.time()
        self.going_away = False
        """The remote announced a close: open no more streams here."""
        self.draining = False
        """This side announced a close (:meth:`go_away`) and waits for the remote's."""
        self.rtt_s: float | None = None
        """The smallest PING round-trip time seen on this connection (None before one)."""
        self._close_callbacks: list[Callable[[Connection], None]] = []
        # Before the receiver: a transport that closed meanwhile reports it
        # at once, and that cancels the maintenance task.
        self._tasks.spawn(self._maintain(), name="conn-maintenance")
        transport.set_receiver(self)
        transport.set_payload_allocator(self._payload_buffer)
        transport.set_crypto_offload(effective_offload_bytes(config.crypto_offload_bytes))

    def __repr__(self) -> str:
        return f"Connection({self.remote_peer.short} via {self.path}, {len(self._streams)} streams)"

    # -- public API --------------------------------------------------------------------

    @property
    def path(self) -> str:
        """How the transport reached the peer (``tcp-direct``, ``webrtc-direct``, ...)."""
        return self.transport.path

    @property
    def closed(self) -> bool:
        """Whether the connection is closed."""
        return self.transport.closed

    @property
    def buffered_bytes(self) -> int:
        """Bytes of received messages not yet read, over every stream."""
        return self._unread.used

    @property
    def open_streams(self) -> int:
        """Streams currently open on this connection."""
        return len(self._streams)

    def on_close(self, callback: Callable[[Connection], None]) -> None:
        """Call ``callback(self)`` once when the connection closes."""
        if self.closed:
            callback(self)
        else:
            self._close_callbacks.append(callback)

    async def open_stream(self, method: str, *, timeout: float | None = None) -> RPCStream:
        """Open a stream to ``method`` on the remote; send and receive on it."""
        stream = self._new_local_stream(method, timeout)
        try:
            await self._send_open(stream, method, timeout, flags=0, message=None)
        finally:
            if not stream.opened:
                self._discard_unopened(stream)
        return stream

    async def call(
        self,
        method: str,
        body: Any = None,
        payload: Buffer = b"",
        *,
        timeout: float | None = None,
    ) -> Message:
        """A unary call: send one request, return the one response.

        Raises:
            RPCError: typed by the remote's error code (MethodNotFoundError,
                DeadlineExceededError, RemoteInternalError, ...).
            UnavailableError: the connection dropped during the call.
        """
        stream = self._new_local_stream(method, timeout)
        try:
            await self._send_open(
                stream, method, timeout, flags=FLAG_MESSAGE | FLAG_END, message=(body, payload)
            )
            return await stream.recv()
        finally:
            if not stream.opened:
                self._discard_unopened(stream)
            elif not stream.finished:
                stream.reset("cancelled", "caller gave up")

    async def ping(self, timeout: float) -> float:
        """Round-trip time in seconds of a PING, or TransportTimeoutError."""
        nonce = next(self._ping_ids)
        waiter: asyncio.Future[None] = self._loop.create_future()
        self._pings[nonce] = waiter
        start = self._loop.time()
        try:
            self._send_control(Frame(FrameType.PING, fields={"n": nonce}))
            async with asyncio.timeout(timeout):
                await waiter
        except TimeoutError as exc:
            raise TransportTimeoutError(f"{self.remote_peer.short} did not answer a ping") from exc
        finally:
            self._pings.pop(nonce, None)
        rtt = self._loop.time() - start
        self.rtt_s = rtt if self.rtt_s is None else min(self.rtt_s, rtt)
        return rtt

    def go_away(self, grace_s: float) -> None:
        """Close gracefully: announce it, serve on, let the remote close.

        The remote stops opening streams here when the ``GOAWAY`` arrives and
        closes the connection when its streams are done; streams it opened
        before are served. Should it not close, this side does once it has
        had no open streams for ``grace_s`` seconds.
        """
        if self.closed or self.draining:
            return
        self.draining = True
        try:
            self._send_control(Frame(FrameType.GOAWAY, fields={"m": "idle"}))
        except ConnectionClosedError:
            return
        self._tasks.spawn(self._close_after_grace(grace_s), name="conn-goaway")

    async def _close_after_grace(self, grace_s: float) -> None:
        announced = self._loop.time()
        while not self.closed:
            idle_since = self.idle_since
            now = self._loop.time()
            if idle_since is None:  # a stream is open: check again after the grace
                await asyncio.sleep(grace_s)
                continue
            # Idle counts from the announcement: the remote's OPEN may be in flight.
            waited = now - max(idle_since, announced)
            if waited >= grace_s:
                await self.aclose()
                return
            await asyncio.sleep(max(grace_s - waited, 0.01))

    def pace(self, bytes_per_s: float) -> Callable[[], None]:
        """Have the transport cap its send rate while the caller's bulk transfer runs.

        Requests on one connection add up (e.g. parts to the remote and its
        averages back, or two rounds at once); once every request is released
        (call the returned function, once) the cap is lifted, so RPCs
        between rounds are not slowed. A transport that cannot pace ignores it.
        """
        self._pacing_ticket += 1
        ticket = self._pacing_ticket
        self._pacing[ticket] = bytes_per_s
        self._apply_pacing()

        def release() -> None:
            if self._pacing.pop(ticket, None) is not None:
                self._apply_pacing()

        return release

    @property
    def pacing_rate(self) -> float | None:
        """The send-rate cap requested now, bytes/s (None: none)."""
        return sum(self._pacing.values()) if self._pacing else None

    def _apply_pacing(self) -> None:
        if not self.closed:
            self.transport.set_pacing_rate(self.pacing_rate)

    async def aclose(self) -> None:
        """Close: reset open streams, stop handlers, tear the transport down."""
        if not self.closed:
            with contextlib.suppress(ConnectionClosedError):
                self._send_control(Frame(FrameType.GOAWAY, fields={"m": "closing"}))
        await self.transport.aclose()
        await self._tasks.aclose()

    # -- FrameReceiver -----------------------------------------------------------------

    def frame_received(self, frame: Frame) -> None:
        self.last_received = self._loop.time()
        try:
            self._dispatch(frame)
        except RemoteProtocolError as exc:
            logger.warning("closing connection to %s: %s", self.remote_peer.short, exc)
            self.transport.close(exc)

    def transport_lost(self, exc: P2PTrainError | None) -> None:
        for stream in list(self._streams.values()):
            stream._on_connection_lost(exc)  # a stream that fails forgets itself
            if self._streams.get(stream.stream_id) is stream:
                self._forget_stream(stream)
        for waiter in self._pings.values():
            if not waiter.done():
                waiter.set_exception(ConnectionClosedError("connection closed"))
        self._tasks.cancel()
        callbacks, self._close_callbacks = self._close_callbacks, []
        for callback in callbacks:
            callback(self)

    # -- dispatch ----------------------------------------------------------------------

    def _dispatch(self, frame: Frame) -> None:
        kind = frame.type
        if kind is FrameType.OPEN:
            self._on_open(frame)
        elif kind in (FrameType.DATA, FrameType.END, FrameType.RESET, FrameType.WINDOW):
            self._on_stream_frame(frame)
        elif kind is FrameType.PING:
            nonce = frame.field("n")
            if not isinstance(nonce, int) or isinstance(nonce, bool):
                raise RemoteProtocolError("PING needs an integer nonce")
            self._send_control(Frame(FrameType.PONG, fields={"n": nonce}))
        elif kind is FrameType.PONG:
            nonce = frame.field("n")
            valid = isinstance(nonce, int) and not isinstance(nonce, bool)
            waiter = self._pings.get(nonce) if valid else None
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        elif kind is FrameType.GOAWAY:
            self.going_away = True
            self._close_if_done()
        else:
            raise RemoteProtocolError(f"unexpected {kind.name} frame after the handshake")

    def _on_open(self, frame: Frame) -> None:
        sid = frame.stream_id
        if sid % 2 != self._remote_parity or sid <= self._highest_remote_id:
            raise RemoteProtocolError(f"OPEN with invalid stream id {sid}")
        self._highest_remote_id = sid
        method = frame.field("m")
        deadline_ms = frame.field("d")
        if not isinstance(method, str) or not 0 < len(method) <= _MAX_METHOD:
            self._send_reset(sid, "invalid_argument", "OPEN needs a method name")
            return
        if deadline_ms is not None and (
            not isinstance(deadline_ms, int) or isinstance(deadline_ms, bool) or deadline_ms <= 0
        ):
            self._send_reset(sid, "invalid_argument", "deadline must be a positive integer")
            return
        if self.going_away:
            self._send_reset(sid, UnavailableError.code, "the connection is closing")
            return
        if self._remote_streams >= self._config.max_streams:
            self._send_reset(
                sid,
                ResourceExhaustedError.code,
                f"too many open streams on this connection (limit {self._config.max_streams})",
            )
            return
        entry = self._handlers.lookup(method)
        if entry is None:
            self._send_reset(sid, MethodNotFoundError.code, f"no method {method!r}")
            return
        size = frame.wire_size
        if frame.flags & FLAG_MESSAGE and not self._unread.fits(size):
            self._send_reset(sid, ResourceExhaustedError.code, self._unread.refusal(size))
            return
        streams = self._stream_budget
        pooled = self._remote_streams >= self._config.connection_reserve_streams
        if pooled and not streams.try_take(1):
            self._send_reset(
                sid,
                ResourceExhaustedError.code,
                f"the node has {streams.used} streams open from its peers"
                f" (limit {streams.limit}); retry later",
            )
            return
        self._remote_streams += 1
        deadline = None if deadline_ms is None else self._loop.time() + deadline_ms / 1000
        stream = self._register(sid, method, deadline)
        stream.opened = True
        if not entry.unbounded:  # enforced by _expire_handlers, without a timer per call
            stream.handler_limit = self._loop.time() + self._config.handler_timeout
        if frame.flags & FLAG_MESSAGE:
            stream._on_message(Message(frame.field("b"), frame.payload), frame.wire_size)
        if frame.ends_stream:
            stream._on_remote_end()
        context = CallContext(
            self.remote_peer, method, deadline, self.path, self.transport.remote_address
        )
        stream.handler_task = self._tasks.spawn(
            self._serve(stream, entry, context), name=f"rpc:{method}"
        )

    def _on_stream_frame(self, frame: Frame) -> None:
        sid = frame.stream_id
        stream = self._streams.get(sid)
        if stream is None:
            if self._is_stale(sid):
                return  # a late frame for a finished stream
            raise RemoteProtocolError(f"{frame.type.name} for unknown stream {sid}")
        kind = frame.type
        try:
            if kind is FrameType.DATA:
                stream._on_message(Message(frame.field("b"), frame.payload), frame.wire_size)
                if frame.ends_stream:
                    stream._on_remote_end()
            elif kind is FrameType.END:
                stream._on_remote_end()
            elif kind is FrameType.RESET:
                code, message = frame.field("c"), frame.field("m")
                stream._on_reset(
                    code if isinstance(code, str) else "unknown",
                    message if isinstance(message, str) else "",
                )
            else:
                stream._on_credit(frame.field("n"))
        except RemoteProtocolError as exc:
            logger.warning(
                "resetting stream %s (%s) from %s: %s",
                sid,
                stream.method,
                self.remote_peer.short,
                exc,
            )
            code = (
                ResourceExhaustedError.code
                if isinstance(exc, FlowControlError)
                else "invalid_argument"
            )
            stream.reset(code, str(exc))

    def _payload_buffer(self, frame: Frame, nbytes: int) -> memoryview | None:
        """Where the transport receives a DATA payload: wherever its stream asks."""
        if frame.type is not FrameType.DATA:
            return None
        stream = self._streams.get(frame.stream_id)
        return None if stream is None else stream._payload_buffer(frame.field("b"), nbytes)

    def can_buffer(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more unread bytes fit under ``max_buffered_bytes``
        (this connection) and ``max_node_buffered_bytes`` (all of the node's;
        ``connection_reserve_bytes`` of each connection are outside it)."""
        return self._unread.fits(nbytes)

    def _forget_stream(self, stream: RPCStream) -> None:
        """Drop a finished stream; a remote-opened one frees its place in the caps."""
        del self._streams[stream.stream_id]
        if stream.stream_id % 2 == self._remote_parity:
            if self._remote_streams > self._config.connection_reserve_streams:
                self._stream_budget.give_back(1)
            self._remote_streams -= 1

    def _is_stale(self, sid: int) -> bool:
        if sid % 2 == self._remote_parity:
            return 0 < sid <= self._highest_remote_id
        return 0 < sid < self._next_id

    # -- serving -----------------------------------------------------------------------

    async def _serve(self, stream: RPCStream, entry: _Entry, context: CallContext) -> None:
        stream.handler_started = True
        try:
            if stream.deadline is None:
                await self._run_handler(stream, entry, context)
            else:
                async with asyncio.timeout_at(stream.deadline):
                    await self._run_handler(stream, entry, context)
        except TimeoutError:
            stream.reset(DeadlineExceededError.code, "deadline passed on the server")
        except RPCError as exc:
            stream.reset(exc.code, exc.message)
        except StreamEndedError:
            stream.reset("invalid_argument", "the stream ended before a request arrived")
        except RemoteProtocolError as exc:
            logger.warning(
                "rejected a %r request from %s: %s", context.method, self.remote_peer.short, exc
            )
            stream.reset("invalid_argument", str(exc))
        except LocalProtocolError as exc:
            logger.error("handler %r sent something invalid: %s", context.method, exc)
            stream.reset("internal", str(exc))
        except (ConfigError, DHTError) as exc:  # the request asked for something invalid
            stream.reset("invalid_argument", str(exc))
        except TransportError as exc:  # the handler could not reach what it needed
            stream.reset(UnavailableError.code, str(exc))
        except P2PTrainError as exc:
            stream.reset("internal", f"{type(exc).__name__}: {exc}")
        except Exception as exc:
            logger.exception("handler %r failed", context.method)
            stream.reset("internal", f"{type(exc).__name__}: {exc}")

    @staticmethod
    async def _run_handler(stream: RPCStream, entry: _Entry, context: CallContext) -> None:
        if entry.streaming:
            await entry.handler(context, stream)  # type: ignore[arg-type]
            if not stream.finished and not stream._local_ended:
                await stream.end()
            return
        request = await stream.recv()
        response = await entry.handler(context, request)  # type: ignore[arg-type]
        if not isinstance(response, Message):
            raise TypeError(f"unary handler {context.method!r} must return a Message")
        await stream.connection._send_reply(stream, response)

    async def _send_reply(self, stream: RPCStream, response: Message) -> None:
        """Send a unary reply; a large one under the node's reply budget and a deadline.

        A reply that does not fit the budget is refused (``resource_exhausted``)
        and dropped at once. One that has not left our send buffer within
        ``reply_send_timeout`` means a peer that does not read: it is
        disconnected, which frees what it pinned.
        """
        size = buffer_nbytes(response.payload)
        if size < _SMALL_REPLY:
            await stream.send(response.body, response.payload, end=True)
            return
        budget = self._reply_budget
        if not budget.try_take(size):
            raise ResourceExhaustedError(
                f"the node is busy sending {budget.used} bytes of replies;"
                f" a reply of {size} bytes was refused, retry later"
            )
        try:
            async with asyncio.timeout(self._config.reply_send_timeout):
                await stream.send(response.body, response.payload, end=True)
                await self.transport.drained()
        except TimeoutError:
            logger.info(
                "%s did not read a %d-byte reply within %g s; disconnecting",
                self.remote_peer.short,
                size,
                self._config.reply_send_timeout,
            )
            self.transport.close(TransportTimeoutError("the peer stopped reading"))
        finally:
            budget.give_back(size)

    async def _maintain(self) -> None:
        """Keepalive PINGs while the remote is silent; close when idle too long."""
        interval = self._config.keepalive_interval
        tick = min(interval, self._config.handler_timeout / 4)
        next_keepalive = self._loop.time() + interval
        misses = 0
        while not self.closed:
            await asyncio.sleep(tick)
            now = self._loop.time()
            self._expire_handlers(now)
            if now < next_keepalive:
                continue
            next_keepalive = now + interval
            if self._streams:
                self.idle_since = None
            elif self.idle_since is None:
                self.idle_since = now
            elif now - self.idle_since >= self._config.idle_timeout:
                logger.debug("closing idle connection to %s", self.remote_peer.short)
                await self.aclose()
                return
            if now - self.last_received < interval:
                misses = 0
                continue
            try:
                await self.ping(timeout=interval)
                misses = 0
            except TransportTimeoutError as exc:
                misses += 1
                if misses >= self._config.keepalive_misses:
                    logger.warning("%s stopped answering; closing", self.remote_peer.short)
                    self.transport.close(exc)
                    return
            except ConnectionClosedError:
                return

    def _expire_handlers(self, now: float) -> None:
        """Reset the streams whose handler ran past ``handler_timeout`` (cancelling it).

        Checked every quarter of the limit (at most every keepalive interval),
        so a handler ends within 1.25 times the limit.
        """
        for stream in list(self._streams.values()):
            limit = stream.handler_limit
            if limit is not None and now >= limit and not stream.finished:
                stream.reset(
                    DeadlineExceededError.code,
                    f"the handler of {stream.method!r} ran past the server's limit of"
                    f" {self._config.handler_timeout:g} s",
                )

    # -- sending -----------------------------------------------------------------------

    def _new_local_stream(self, method: str, timeout: float | None) -> RPCStream:
        if self.closed:
            raise UnavailableError(f"connection to {self.remote_peer.short} is closed")
        if self.draining:
            raise UnavailableError(f"closing the connection to {self.remote_peer.short}")
        if self.going_away:
            raise UnavailableError(f"{self.remote_peer.short} is closing the connection")
        sid = self._next_id
        self._next_id += 2
        deadline = None if timeout is None else self._loop.time() + timeout
        return self._register(sid, method, deadline)

    def _register(self, sid: int, method: str, deadline: float | None) -> RPCStream:
        stream = RPCStream(
            self,
            sid,
            method,
            flow=StreamFlow(
                send_window=self._send_window,
                send_frame_bytes=self._send_frame_bytes,
                recv_window=self._config.stream_window,
                recv_frame_bytes=self._recv_frame_bytes,
            ),
            unread=self._unread,
            deadline=deadline,
        )
        self._streams[sid] = stream
        self.idle_since = None
        return stream

    async def _send_open(
        self,
        stream: RPCStream,
        method: str,
        timeout: float | None,
        *,
        flags: int,
        message: tuple[Any, Buffer] | None,
    ) -> None:
        fields: dict[str, Any] = {"m": method}
        if timeout is not None:
            fields["d"] = max(1, int(timeout * 1000))
        payload: Buffer = b""
        if message is not None:
            body, payload = message
            if body is not None:
                fields["b"] = body
        frame = Frame(FrameType.OPEN, stream.stream_id, flags, fields, payload)
        size = await self._send_stream_frame(stream, frame)
        stream.opened = True
        if flags & FLAG_MESSAGE:  # only a message counts against the stream window
            stream.flow.sent(size)
        if flags & FLAG_END:
            stream._set_local_ended()

    async def _send_stream_frame(self, stream: RPCStream, frame: Frame) -> int:
        try:
            return await self.transport.send_frame(frame)
        except ConnectionClosedError as exc:
            stream._on_connection_lost(exc)
            raise UnavailableError(f"connection to {self.remote_peer.short} closed") from exc

    def _send_control(self, frame: Frame) -> None:
        self.transport.send_frame_nowait(frame)

    def _send_window_update(self, sid: int, amount: int) -> None:
        self._send_control(Frame(FrameType.WINDOW, sid, fields={"n": amount}))

    def _send_reset(self, sid: int, code: str, message: str) -> None:
        if self.closed:
            return
        self._send_control(Frame(FrameType.RESET, sid, fields={"c": code, "m": message}))

    def _discard_unopened(self, stream: RPCStream) -> None:
        """Forget a stream whose OPEN never left (the remote never heard of it)."""
        if self._streams.get(stream.stream_id) is stream:
            del self._streams[stream.stream_id]
            if not self._streams:
                self.idle_since = self._loop.time()
                self._close_if_done()

    def _maybe_forget(self, stream: RPCStream) -> None:
        if stream.finished and self._streams.get(stream.stream_id) is stream:
            self._forget_stream(stream)
            if not self._streams:
                self.idle_since = self._loop.time()
                self._close_if_done()

    def _close_if_done(self) -> None:
        """After the remote's ``GOAWAY``: close once no stream is open here."""
        if (
            self.going_away
            and not self._streams
            and not self.closed
            and not self._tasks.closed
            and not any(t.get_name() == "conn-close" for t in self._tasks)
        ):
            self._tasks.spawn(self.aclose(), name="conn-close")
