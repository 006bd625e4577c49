"""A conformance suite for :class:`~p2ptrain.transport.base.FrameTransport` implementations.

Every transport (TCP, WebRTC, a relay) must behave the same way to the layers
above it. This suite states how, as checks that run over a connected pair.

Theory of operation
-------------------
A :class:`Check` is two coroutine functions, one per end of the pair (``a``
and ``b``). The two sides coordinate only through the frames they exchange,
so a check runs unchanged whether both ends share one event loop
(:func:`run_check`, :func:`run_suite`) or live in two threads, two network
namespaces or two processes (:func:`run_check_split`). Each side starts by
greeting the other (both ends are then fully open) and ends by waiting for the
peer's acknowledgement, so nobody closes while the other still expects data.

What the checks require (see :func:`checks`):

* ``identity``: ``path`` and ``remote_address`` are non-empty strings.
* ``ordering``: frames of every size arrive in order with their stream id,
  flags, fields and payload intact; the sizes ``send_frame`` returns add up to
  ``stats.bytes_sent`` and to the ``wire_size`` of the received frames.
* ``large_frames``: frames of several MB (and around 64 KiB / 256 KiB message
  boundaries) arrive intact, from ``bytes``, ``bytearray`` and ``memoryview``.
* ``many_small_frames``: a burst of tiny frames queued without awaiting.
* ``both_directions``: both ends send several MB at once while receiving.
* ``backpressure``: ``send_frame_nowait`` queues without waiting; with a large
  backlog queued, ``send_frame`` does not complete until the backlog drained
  (it waits while the send buffer is above its high mark), then everything
  arrives in order.
* ``receiver_handoff``: frames read with ``recv_frame``, then a
  :class:`~p2ptrain.transport.base.FrameReceiver` installed mid-stream gets
  every later frame in order and ``transport_lost`` exactly once.
* ``close_by_a`` / ``close_by_b``: a graceful close (``aclose``) delivers what
  was queued before it; the other end then gets
  :class:`~p2ptrain.errors.ConnectionClosedError` from ``recv_frame`` and is
  ``closed``; the closed end refuses to send with ConnectionClosedError.
* ``abort``: ``close()`` without flushing reaches the other end as
  ConnectionClosedError too.
* ``oversized_frame``: a frame above the receiver's ``max_frame_bytes``
  makes the receiver fail with FrameTooLargeError and close; one above
  ``max_send_frame`` is refused locally with LocalProtocolError.

Usage with a same-loop pair factory::

    async def tcp_pair() -> tuple[FrameTransport, FrameTransport]: ...
    await run_suite(tcp_pair, config=SuiteConfig(peer_max_frame_bytes=LIMIT))

With two ends in two threads (e.g. two NAT-lab namespaces), give
:func:`run_check_split` one *runner* per end: a blocking function that opens
its end, runs the given side on it with :func:`run_side`, and closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from p2ptrain.errors import (
    ConnectionClosedError,
    FrameTooLargeError,
    LocalProtocolError,
    P2PTrainError,
    TransportError,
)
from p2ptrain.transport.base import FrameTransport
from p2ptrain.wire.frames import FLAG_END, Buffer, Frame, FrameType

__all__ = [
    "Check",
    "ConformanceError",
    "PairFactory",
    "Side",
    "SideRunner",
    "SuiteConfig",
    "checks",
    "run_check",
    "run_check_split",
    "run_side",
    "run_suite",
]

MiB = 1 << 20

Side = Callable[[FrameTransport], Coroutine[Any, Any, None]]
"""One end's part of a check: runs on that end's transport (and event loop)."""

PairFactory = Callable[[], Awaitable[tuple[FrameTransport, FrameTransport]]]
"""Opens a connected pair (``a``, ``b``) on the running loop."""

SideRunner = Callable[[Side], None]
"""Opens one end somewhere (a thread, a namespace), runs the side on it, closes it."""

_HELLO = 0xFFF0
_ACK = 0xFFF1
_DATA = 7


class ConformanceError(AssertionError):
    """A transport broke a promise of the FrameTransport interface."""


@dataclass(frozen=True)
class SuiteConfig:
    """Sizes and limits of the checks.

    Attributes:
        large_frame_bytes: Payload sizes of the ``large_frames`` check.
        small_frames: Frames in the ``many_small_frames`` burst.
        ordered_frames: Frames in the ``ordering`` check.
        duplex_bytes: Bytes each end sends in ``both_directions``.
        backlog_bytes: Bytes queued at once in ``backpressure``; must exceed
            the transport's high-water mark by far.
        peer_max_frame_bytes: The receiving end's ``max_frame_bytes``; None
            skips ``oversized_frame``.
        timeout: Seconds one side of one check may take.
    """

    large_frame_bytes: tuple[int, ...] = (
        1,
        65_535,
        65_536,
        262_143,
        262_144,
        262_145,
        3 * MiB,
        8 * MiB,
    )
    small_frames: int = 5_000
    ordered_frames: int = 1_000
    duplex_bytes: int = 8 * MiB
    backlog_bytes: int = 16 * MiB
    peer_max_frame_bytes: int | None = None
    timeout: float = 60.0


@dataclass(frozen=True)
class Check:
    """One conformance check: what end ``a`` and end ``b`` each do."""

    name: str
    a: Side
    b: Side
    expects_close: bool = field(default=False)
    """True when the check itself closes the pair (no acknowledgement at the end)."""


# -- helpers -------------------------------------------------------------------------------


def _fail(check: str, what: str) -> ConformanceError:
    return ConformanceError(f"{check}: {what}")


def _pattern(seed: int, nbytes: int) -> bytes:
    return random.Random(seed).randbytes(nbytes)


async def _greet(t: FrameTransport, check: str) -> None:
    """Exchange a first frame: both ends are open before the check proper starts."""
    await t.send_frame(Frame(FrameType.PING, _HELLO, fields={"check": check}))
    frame = await t.recv_frame()
    if frame.stream_id != _HELLO or frame.field("check") != check:
        raise _fail(check, f"expected the peer's greeting, got {frame!r}")


async def _ack(t: FrameTransport, **fields: Any) -> None:
    await t.send_frame(Frame(FrameType.PONG, _ACK, fields=fields))


async def _await_ack(t: FrameTransport, check: str) -> Frame:
    frame = await t.recv_frame()
    if frame.stream_id != _ACK:
        raise _fail(check, f"expected the peer's acknowledgement, got {frame!r}")
    return frame


async def _expect_closed(t: FrameTransport, check: str) -> None:
    try:
        frame = await t.recv_frame()
    except ConnectionClosedError:
        pass
    else:
        raise _fail(check, f"expected ConnectionClosedError, got a frame {frame!r}")
    await t.wait_closed()
    if not t.closed:
        raise _fail(check, "the transport does not report closed after the peer closed")


def _refuses_to_send(t: FrameTransport, check: str) -> None:
    try:
        t.send_frame_nowait(Frame(FrameType.DATA, _DATA))
    except ConnectionClosedError:
        return
    raise _fail(check, "send_frame_nowait on a closed transport did not raise")


# -- the checks ------------------------------------------------------------------------


def _identity() -> Check:
    async def side(t: FrameTransport) -> None:
        if not isinstance(t.path, str) or not t.path:
            raise _fail("identity", f"path must be a non-empty string, got {t.path!r}")
        if not isinstance(t.remote_address, str) or not t.remote_address:
            raise _fail("identity", "remote_address must be a non-empty string")
        await _greet(t, "identity")

    return Check("identity", side, side)


def _ordering(count: int) -> Check:
    name = "ordering"

    def frame(i: int) -> Frame:
        payload = _pattern(i, (i * 397) % 5000)
        return Frame(FrameType.DATA, 1 + i % 9, FLAG_END if i % 5 == 0 else 0, {"i": i}, payload)

    async def send(t: FrameTransport) -> None:
        await _greet(t, name)
        before = t.stats.bytes_sent
        sizes = 0
        for i in range(count):
            if i % 2:
                sizes += t.send_frame_nowait(frame(i))
            else:
                sizes += await t.send_frame(frame(i))
        if t.stats.bytes_sent - before != sizes:
            raise _fail(name, "stats.bytes_sent disagrees with the sizes send_frame returned")
        ack = await _await_ack(t, name)
        if ack.field("wire") != sizes:
            raise _fail(name, f"sent {sizes} bytes of frames, the peer decoded {ack.field('wire')}")

    async def receive(t: FrameTransport) -> None:
        await _greet(t, name)
        wire = 0
        for i in range(count):
            got, want = await t.recv_frame(), frame(i)
            same = (
                got.type is want.type
                and got.stream_id == want.stream_id
                and got.flags == want.flags
                and got.field("i") == i
                and bytes(got.payload) == want.payload
            )
            if not same:
                raise _fail(name, f"frame {i} arrived as {got!r}")
            wire += got.wire_size
        # The peer sent its greeting and these frames, and waits for our ack.
        if t.stats.frames_received != count + 1:
            raise _fail(name, "stats.frames_received does not count the frames delivered")
        await _ack(t, wire=wire)

    return Check(name, send, receive)


def _large_frames(sizes: Sequence[int]) -> Check:
    name = "large_frames"
    kinds: tuple[Callable[[bytes], Buffer], ...] = (bytes, bytearray, memoryview)

    async def send(t: FrameTransport) -> None:
        await _greet(t, name)
        for index, size in enumerate(sizes):
            payload = kinds[index % len(kinds)](_pattern(size, size))
            await t.send_frame(Frame(FrameType.DATA, _DATA, 0, {"n": size}, payload))
        await _await_ack(t, name)

    async def receive(t: FrameTransport) -> None:
        await _greet(t, name)
        for size in sizes:
            got = await t.recv_frame()
            digest = hashlib.sha256(got.payload).digest()
            if got.field("n") != size or digest != hashlib.sha256(_pattern(size, size)).digest():
                raise _fail(name, f"a frame of {size} bytes arrived damaged")
        await _ack(t)

    return Check(name, send, receive)


def _many_small_frames(count: int) -> Check:
    name = "many_small_frames"

    async def send(t: FrameTransport) -> None:
        await _greet(t, name)
        for i in range(count):
            t.send_frame_nowait(Frame(FrameType.WINDOW, i % 1000, fields={"n": i}))
        await _await_ack(t, name)

    async def receive(t: FrameTransport) -> None:
        await _greet(t, name)
        for i in range(count):
            got = await t.recv_frame()
            if got.field("n") != i or got.stream_id != i % 1000:
                raise _fail(name, f"small frame {i} arrived as {got!r}")
        await _ack(t)

    return Check(name, send, receive)


def _both_directions(nbytes: int) -> Check:
    name = "both_directions"
    chunk = 256 * 1024
    count = max(1, nbytes // chunk)

    def make_side(seed: int, peer_seed: int) -> Side:
        async def side(t: FrameTransport) -> None:
            await _greet(t, name)

            async def send() -> None:
                for i in range(count):
                    payload = _pattern(seed * 100_000 + i, chunk)
                    await t.send_frame(Frame(FrameType.DATA, _DATA, 0, {"i": i}, payload))
                await _ack(t)

            async def receive() -> None:
                for i in range(count):
                    got = await t.recv_frame()
                    want = _pattern(peer_seed * 100_000 + i, chunk)
                    if got.field("i") != i or bytes(got.payload) != want:
                        raise _fail(name, f"frame {i} from the peer arrived damaged")
                await _await_ack(t, name)

            async with asyncio.TaskGroup() as group:
                group.create_task(send())
                group.create_task(receive())

        return side

    return Check(name, make_side(1, 2), make_side(2, 1))


def _backpressure(nbytes: int) -> Check:
    name = "backpressure"
    chunk = 256 * 1024
    count = max(1, nbytes // chunk)

    async def send(t: FrameTransport) -> None:
        await _greet(t, name)
        payload = _pattern(7, chunk)
        for i in range(count):
            t.send_frame_nowait(Frame(FrameType.DATA, _DATA, 0, {"i": i}, payload))
        # The backlog is far above any high-water mark: send_frame must wait.
        marker = asyncio.ensure_future(t.send_frame(Frame(FrameType.DATA, _DATA, 0, {"i": count})))
        await asyncio.sleep(0)
        if marker.done():
            marker.result()
            raise _fail(name, f"send_frame did not wait with {nbytes} bytes queued")
        await marker
        await _await_ack(t, name)

    async def receive(t: FrameTransport) -> None:
        await _greet(t, name)
        payload = _pattern(7, chunk)
        for i in range(count + 1):
            got = await t.recv_frame()
            if got.field("i") != i or (i < count and bytes(got.payload) != payload):
                raise _fail(name, f"frame {i} of the backlog arrived as {got!r}")
        await _ack(t)

    return Check(name, send, receive)


class _Collector:
    """A FrameReceiver that records what it gets."""

    def __init__(self) -> None:
        self.frames: list[Frame] = []
        self.lost: list[P2PTrainError | None] = []
        self.changed = asyncio.Event()

    def frame_received(self, frame: Frame) -> None:
        self.frames.append(frame)
        self.changed.set()

    def transport_lost(self, exc: P2PTrainError | None) -> None:
        self.lost.append(exc)
        self.changed.set()


def _receiver_handoff() -> Check:
    name = "receiver_handoff"
    first, second = 10, 10

    async def send(t: FrameTransport) -> None:
        await _greet(t, name)
        for i in range(first):
            await t.send_frame(Frame(FrameType.DATA, _DATA, 0, {"i": i}, _pattern(i, 100)))
        await _await_ack(t, name)  # the peer installed its receiver
        for i in range(first, first + second):
            await t.send_frame(Frame(FrameType.DATA, _DATA, 0, {"i": i}, _pattern(i, 100)))
        await t.aclose()

    async def receive(t: FrameTransport) -> None:
        await _greet(t, name)
        for i in range(3):
            got = await t.recv_frame()
            if got.field("i") != i:
                raise _fail(name, f"recv_frame returned frame {got.field('i')}, expected {i}")
        collector = _Collector()
        t.set_receiver(collector)
        try:
            await t.recv_frame()
        except RuntimeError:
            pass
        else:
            raise _fail(name, "recv_frame still works after set_receiver")
        await _ack(t)
        while not collector.lost:
            collector.changed.clear()
            await collector.changed.wait()
        indices = [frame.field("i") for frame in collector.frames]
        if indices != list(range(3, first + second)):
            raise _fail(name, f"the receiver got frames {indices}")
        if len(collector.lost) != 1 or not isinstance(collector.lost[0], ConnectionClosedError):
            raise _fail(name, f"transport_lost was called with {collector.lost}")

    return Check(name, send, receive, expects_close=True)


def _close(closer: str) -> Check:
    name = f"close_by_{closer}"
    count = 50

    async def close(t: FrameTransport) -> None:
        await _greet(t, name)
        for i in range(count):
            t.send_frame_nowait(Frame(FrameType.DATA, _DATA, 0, {"i": i}, _pattern(i, 20_000)))
        await t.aclose()
        if not t.closed:
            raise _fail(name, "aclose() returned but the transport is not closed")
        _refuses_to_send(t, name)
        try:
            await t.recv_frame()
        except ConnectionClosedError:
            pass
        else:
            raise _fail(name, "recv_frame on a closed transport returned a frame")

    async def observe(t: FrameTransport) -> None:
        await _greet(t, name)
        for i in range(count):
            got = await t.recv_frame()
            if got.field("i") != i or bytes(got.payload) != _pattern(i, 20_000):
                raise _fail(name, f"frame {i} sent before the close arrived as {got!r}")
        await _expect_closed(t, name)
        _refuses_to_send(t, name)

    if closer == "a":
        return Check(name, close, observe, expects_close=True)
    return Check(name, observe, close, expects_close=True)


def _abort() -> Check:
    name = "abort"

    async def abort(t: FrameTransport) -> None:
        await _greet(t, name)
        # An abort may drop what is still queued, our greeting included: wait
        # until the peer has it.
        await _await_ack(t, name)
        t.close()
        await t.wait_closed()
        _refuses_to_send(t, name)

    async def observe(t: FrameTransport) -> None:
        await _greet(t, name)
        await _ack(t)
        await _expect_closed(t, name)

    return Check(name, abort, observe, expects_close=True)


def _oversized_frame(limit: int) -> Check:
    name = "oversized_frame"

    async def send(t: FrameTransport) -> None:
        await _greet(t, name)
        saved = t.max_send_frame
        t.max_send_frame = 4096
        try:
            t.send_frame_nowait(Frame(FrameType.DATA, _DATA, 0, None, bytes(5000)))
        except LocalProtocolError:
            pass
        else:
            raise _fail(name, "a frame above max_send_frame was not refused locally")
        finally:
            t.max_send_frame = saved
        await _await_ack(t, name)  # the peer read everything before the bad frame
        with contextlib.suppress(ConnectionClosedError):  # the peer may have hung up already
            await t.send_frame(Frame(FrameType.DATA, _DATA, 0, None, bytes(limit)))
        await _expect_closed(t, name)

    async def receive(t: FrameTransport) -> None:
        await _greet(t, name)
        await _ack(t)
        try:
            got = await t.recv_frame()
        except FrameTooLargeError:
            pass
        else:
            raise _fail(name, f"a frame above max_frame_bytes was delivered: {got!r}")
        if not t.closed:
            raise _fail(name, "the receiver did not close after an oversized frame")

    return Check(name, send, receive, expects_close=True)


def checks(config: SuiteConfig | None = None) -> list[Check]:
    """Every check of the suite, configured by ``config``."""
    config = config or SuiteConfig()
    suite = [
        _identity(),
        _ordering(config.ordered_frames),
        _large_frames(config.large_frame_bytes),
        _many_small_frames(config.small_frames),
        _both_directions(config.duplex_bytes),
        _backpressure(config.backlog_bytes),
        _receiver_handoff(),
        _close("a"),
        _close("b"),
        _abort(),
    ]
    if config.peer_max_frame_bytes is not None:
        suite.append(_oversized_frame(config.peer_max_frame_bytes))
    return suite


# -- runners -------------------------------------------------------------------------------


async def run_side(transport: FrameTransport, side: Side, *, timeout: float) -> None:
    """Run one side of a check on ``transport`` with a deadline, then close it."""
    try:
        async with asyncio.timeout(timeout):
            await side(transport)
    finally:
        await transport.aclose()


async def run_check(check: Check, a: FrameTransport, b: FrameTransport, *, timeout: float) -> None:
    """Run both sides of ``check`` on a same-loop pair; both ends are closed after."""
    try:
        async with asyncio.timeout(timeout), asyncio.TaskGroup() as group:
            group.create_task(check.a(a))
            group.create_task(check.b(b))
    except ExceptionGroup as group_error:
        raise _first_cause([*group_error.exceptions]) from group_error
    finally:
        await a.aclose()
        await b.aclose()


async def run_suite(
    make_pair: PairFactory,
    *,
    config: SuiteConfig | None = None,
    only: Sequence[str] | None = None,
) -> list[str]:
    """Run every check (or those named in ``only``), each on a fresh pair.

    Returns:
        The names of the checks that ran.

    Raises:
        ConformanceError: a check failed (or another error a side raised).
    """
    config = config or SuiteConfig()
    ran = []
    for check in checks(config):
        if only is not None and check.name not in only:
            continue
        a, b = await make_pair()
        await run_check(check, a, b, timeout=config.timeout)
        ran.append(check.name)
    return ran


def run_check_split(check: Check, run_a: SideRunner, run_b: SideRunner) -> None:
    """Run the two sides of ``check`` at once in two threads (each its own loop).

    ``run_a(side)`` must open end ``a`` (e.g. in a network namespace), run
    ``side`` on it with :func:`run_side`, and return when it is closed; the
    same for ``run_b``. The most telling failure is raised: a broken promise
    before the ConnectionClosedError it caused at the other end.
    """
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"check-{check.name}") as pool:
        futures = [pool.submit(run_a, check.a), pool.submit(run_b, check.b)]
        errors = [exc for future in futures if (exc := future.exception()) is not None]
    if errors:
        raise _first_cause(errors)


def _first_cause(errors: list[BaseException]) -> BaseException:
    """The error to report: not a mere consequence (the other end closing)."""
    for error in errors:
        if not isinstance(error, TransportError | TimeoutError):
            return error
    for error in errors:
        if not isinstance(error, ConnectionClosedError):
            return error
    return errors[0]
