"""One member's run of one butterfly all-reduce round (the asyncio shell).

Theory of operation
-------------------
Member *i* of a :class:`~p2ptrain.allreduce.group.GroupPlan` plays two roles
at once, and both are streamed chunk by chunk so that receiving, reducing and
sending back overlap:

* **sender** — for every other member *j* that owns a non-empty part, it
  opens one stream to *j* (so members in client mode only ever dial out),
  sends a hello and then its values of *j*'s part chunk by chunk, and reads
  back the averaged chunks into the output vector;
* **reducer** — when it owns a non-empty part, every other member's stream
  lands in :meth:`ButterflyRound.serve`, which feeds the parts to a
  :class:`~p2ptrain.allreduce.reducer.ShardReducer` and sends each finalized
  chunk back on every sender's stream.

Parts are sent as zero-copy views of the flat input (codec ``none``); the
reducer accumulates in place in the output vector. Results in codec ``none``
are received straight into their place in the output vector (see
:meth:`~p2ptrain.rpc.stream.RPCStream.receive_payloads_into`; transports that
cannot do that deliver them in a buffer, copied once). Should a round end
while such a payload may still be arriving, the caller gets a copy of the
output instead, so that nothing writes into the vector it holds.

Faults: a stream that fails excludes that sender from the chunks it had not
delivered (at the reducer) or leaves the chunks of that reducer that had not
arrived at the member's local values (at the sender). At ``reduce_timeout``
the reducer finalizes every chunk with whatever arrived; at ``round_timeout``
the call returns whatever happened. Nothing waits longer.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from p2ptrain.aio import duration_clock
from p2ptrain.allreduce.aggregation import all_finite
from p2ptrain.allreduce.compression import KEY_CODEC, NoneCodec
from p2ptrain.allreduce.config import AllReduceConfig
from p2ptrain.allreduce.group import GroupPlan
from p2ptrain.allreduce.pacing import pacing_rates
from p2ptrain.allreduce.protocol import (
    METHOD,
    Hello,
    PartHeader,
    ResultHeader,
    TimingAck,
    codec_for,
    decode_values,
    parse_part,
    parse_result,
    parse_timing,
)
from p2ptrain.allreduce.reducer import ChunkResult, ShardReducer
from p2ptrain.allreduce.report import AllReduceReport, ShardReport
from p2ptrain.allreduce.vector import pooled_vector
from p2ptrain.errors import (
    ConfigError,
    ConnectError,
    DeadlineExceededError,
    InvalidArgumentError,
    P2PTrainError,
    PermissionDeniedError,
    RemoteProtocolError,
    RPCError,
    StreamEndedError,
    TransportError,
    UnavailableError,
)
from p2ptrain.measure.estimates import ArrivalTimer, StreamTiming
from p2ptrain.node.node import Node
from p2ptrain.rpc.stream import RPCStream
from p2ptrain.secure.identity import PeerID
from p2ptrain.wire.buffers import default_pool

__all__ = ["ButterflyRound", "RoundObserver"]

logger = logging.getLogger(__name__)

ABSENT_CHECK_S = 2.0
"""An owner that still waits for members that have not joined checks this
often whether they are reachable, and stops waiting for those that are not
(a member of the plan that died before its first stream reached this owner,
e.g. one whose own part is empty, so that nobody dials it)."""


REDIAL_S = 1.0
"""Seconds before a member dials a reducer again after failing to open its stream."""


class RoundObserver:
    """Callbacks at protocol events, for tracing and tests; each does nothing here.

    They run on the event loop, synchronously, right after the event.
    """

    def part_sent(self, reducer: int, chunk: int) -> None:
        """This member sent its part of ``chunk`` to member ``reducer``."""

    def part_received(self, sender: int, chunk: int) -> None:
        """This member, as reducer, accepted ``sender``'s part of ``chunk``."""

    def result_sent(self, receiver: int, chunk: int) -> None:
        """This member, as reducer, sent the average of ``chunk`` to ``receiver``."""

    def result_received(self, reducer: int, chunk: int) -> None:
        """This member received the average of ``reducer``'s ``chunk``."""


class ButterflyRound:
    """The state of one member in one round; run it once with :meth:`run`.

    Args:
        node: This member's node.
        plan: The group plan (this node must be a member).
        flat: This member's flat float32 vector of ``plan.num_elements``
            values; read, never modified. Do not modify it during the round.
        weight: This member's weight (finite, >= 0).
        config: Codec and aggregation rule.
        observer: Event callbacks.
        gather_only: Contribute to no one else's part, and make this member's
            own part its local values (weight 0 as a sender, its own weight as
            the reducer). When every member passes it, the round is an
            all-gather: each part comes back as its owner's values.

    Raises:
        ConfigError: This node is not a member, or the vector has the wrong size.
    """

    def __init__(
        self,
        node: Node,
        plan: GroupPlan,
        flat: torch.Tensor,
        weight: float,
        *,
        config: AllReduceConfig,
        observer: RoundObserver | None = None,
        gather_only: bool = False,
        upload_bytes_per_s: float | None = None,
    ) -> None:
        index = plan.index_of(node.peer_id)
        if index is None:
            raise ConfigError("this node is not a member of the group")
        if flat.dtype != torch.float32 or flat.shape != (plan.num_elements,):
            raise ConfigError(
                f"the plan averages {plan.num_elements} float32 values, got {tuple(flat.shape)}"
            )
        self.node = node
        self.plan = plan
        self.index = index
        self.flat = flat
        own_weight = weight
        self.weight = weight = 0.0 if gather_only else weight
        self.config = config
        self.observer = observer or RoundObserver()
        # The output and (flattened) input of this size come back every round:
        # let the pool keep them, not free and fault them in again.
        default_pool.reserve(8 * plan.num_elements)
        self.out = pooled_vector(plan.num_elements)
        self._out_bytes = self.out.numpy().data.cast("B")
        self._hello = Hello(plan.round_id, plan.digest, weight, config.codec, config.block_size)
        start, stop = plan.part(index)
        self.gather_only = gather_only
        self.reducer: ShardReducer | None = None
        if stop > start:
            self.reducer = ShardReducer(
                out=self.out[start:stop],
                local=flat[start:stop],
                local_index=index,
                local_weight=own_weight,
                # In an all-gather nobody sends parts: the part is done at once,
                # and a member that never shows up is not waited for.
                senders=() if gather_only else range(plan.size),
                chunk_elements=plan.chunk_elements,
                config=config,
            )
        # Receiving side: for each reducer, per chunk the contributors (() when
        # nobody contributed, None when no result arrived): local values kept for both.
        self._received: dict[int, list[tuple[int, ...] | None]] = {
            j: [None] * len(plan.chunks(j)) for j in plan.reducers() if j != index
        }
        # Per reducer: results read so far, and one past the last chunk whose
        # payload was received straight into the output.
        self._results_read = dict.fromkeys(self._received, 0)
        self._claimed_upto = dict.fromkeys(self._received, 0)
        self._excluded: dict[int, dict[int, str]] = {j: {} for j in plan.reducers()}
        self._errors: dict[int, str] = {}
        self._failed: dict[int, str] = {}
        self._serving: dict[int, RPCStream] = {}
        self._writers = 0
        self._encoded: dict[tuple[int, str, int], tuple[dict[str, Any], memoryview]] = {}
        self._changed = asyncio.Event()
        self._closed = False
        self._loop = asyncio.get_running_loop()
        self._start = self._loop.time()
        # Durations come from perf_counter (uvloop's loop.time() has millisecond
        # resolution, which made a fast round's total_s 0.0), or a virtual clock.
        self._clock = duration_clock(self._loop)
        self._started = self._clock()
        self._reduce_deadline = self._start + plan.reduce_timeout
        self._round_deadline = self._start + plan.round_timeout
        self._parts_sent_at = self._start
        self._shard_done_at = self._start
        self._send_span: list[float] = []
        self._recv_span: list[float] = []
        # Download time, measured where the bytes arrive: while any payload is
        # arriving (its header is in) or arrived and not read yet.
        self._arriving = 0
        self._arriving_since = 0.0
        self._download_s = 0.0
        # Per partner, each stream timed where it arrives (perf_counter, like
        # the durations above): results from
        # reducer j here, parts from sender i here, and what the other ends
        # timed of this member's streams (parts at j, results at i).
        self._results_in = {j: ArrivalTimer() for j in self._received}
        self._parts_in: dict[int, ArrivalTimer] = {}
        self._uploads: dict[tuple[str, int], StreamTiming] = {}
        self._acks_pending: set[int] = set()  # senders whose timing has not arrived
        self.bytes_sent = 0
        self.bytes_received = 0
        # In an all-gather the part is done at once, but its owner still
        # serves every other member: those that have not joined yet.
        self._absent: set[int] = set()
        if gather_only and self.reducer is not None:
            self._absent = set(range(plan.size)) - {index}
        if self.reducer is not None and self.reducer.done:
            self._shard_done_at = self._start
        self._pacing = (
            None
            if upload_bytes_per_s is None or config.pacing_headroom is None
            else pacing_rates(
                plan,
                index,
                sends_parts=weight > 0,
                upload_bytes_per_s=upload_bytes_per_s,
                headroom=config.pacing_headroom,
                element_bytes=_wire_element_bytes(config, plan.num_elements),
            )
        )

    # -- the call ----------------------------------------------------------------------

    async def run(self) -> tuple[torch.Tensor, AllReduceReport]:
        """Run the round to its end; return the averaged flat vector and the report."""
        try:
            async with asyncio.timeout_at(self._round_deadline), asyncio.TaskGroup() as tasks:
                for j in self._received:
                    tasks.create_task(self._exchange(j), name=f"allreduce-send:{j}")
                if self.reducer is not None:
                    tasks.create_task(self._reduce_shard(), name="allreduce-reduce")
                    if not self._part_served():
                        tasks.create_task(self._watch_absent(), name="allreduce-absent")
        except TimeoutError:
            logger.warning("round %s: round_timeout passed", self.plan.round_id.hex()[:8])
        finally:
            self._close()
        for j, received in self._received.items():
            if any(c is None for c in received):
                self._fail_reducer(j, "round_timeout passed before every average arrived")
        end = self._loop.time()
        total_s = self._clock() - self._started
        if any(self._claimed_upto[j] > self._results_read[j] for j in self._received):
            # A result may still be landing in the output: hand out a copy.
            out, self.out = self.out, pooled_vector(self.plan.num_elements)
            self.out.copy_(out)
        self._keep_local_where_missing()
        return self.out, self._report(end, total_s)

    # -- sender side -------------------------------------------------------------------

    async def _exchange(self, j: int) -> None:
        """Send our parts of reducer ``j``'s shard and read back its averages."""
        try:
            stream = await self._open_stream(j)
        except P2PTrainError as exc:
            self._fail_reducer(j, f"cannot open a stream: {exc}", exc)
            return
        release = self._pace(stream, None if self._pacing is None else self._pacing.parts.get(j))
        try:
            chunks = self.plan.chunks(j)
            sends = self.weight > 0 and bool(chunks)
            stream.receive_payloads_into(functools.partial(self._result_buffer, j))
            await stream.send(self._hello.to_body(), end=not chunks)
            async with asyncio.TaskGroup() as tasks:
                if sends:
                    tasks.create_task(self._send_parts(j, stream, chunks))
                tasks.create_task(self._receive_results(j, stream, chunks))
            if chunks and j not in self._errors:
                timing = self._results_in[j].timing()
                await stream.send(TimingAck(timing.nbytes, timing.seconds).to_body(), end=True)
        except P2PTrainError as exc:
            self._fail_reducer(j, str(exc), exc)
        finally:
            release()
            stream.receive_payloads_into(None)  # no reference cycle keeps the round alive
            await stream.aclose()

    def _pace(self, stream: RPCStream, bytes_per_s: float | None) -> Callable[[], None]:
        """Pace ``stream``'s connection at ``bytes_per_s`` more; returns the release.

        Not where the round ends within the stream's slow start (see
        :func:`~p2ptrain.allreduce.pacing.worth_pacing`).
        """
        if self._pacing is None:
            return _nothing
        rate = self._pacing.rate(bytes_per_s, stream.connection.rtt_s)
        if rate is None:
            return _nothing
        return stream.connection.pace(rate)

    async def _open_stream(self, j: int) -> RPCStream:
        """A stream to reducer ``j``; a lost one is tried again until the reduce deadline.

        Tried again: a handshake that timed out, a connection closed under the
        open. Not: a refused dial (nobody listens there).

        The reducer waits for this member's parts until then anyway (it can
        reach this member, so it does not drop it), and the whole group's
        result depends on that part: one lost handshake must not cost it.
        """
        member = self.plan.members[j]
        while True:
            remaining = max(self._round_deadline - self._loop.time(), 1e-3)
            try:
                return await self.node.open_stream(member.dial_address, METHOD, timeout=remaining)
            except ConnectError:
                raise  # nobody listens there (refused): the member is down, not slow
            except (TransportError, UnavailableError) as exc:
                retry_at = self._loop.time() + REDIAL_S
                if retry_at >= self._reduce_deadline:
                    raise
                logger.info("round %s: dialing %d again: %s", self.plan.round_id.hex()[:8], j, exc)
                await asyncio.sleep(REDIAL_S)

    async def _send_parts(self, j: int, stream: RPCStream, chunks: list[tuple[int, int]]) -> None:
        codec = codec_for(self.config.codec, self.config.block_size)
        try:
            for k, (lo, hi) in enumerate(chunks):
                header, payload = codec.encode(self.flat[lo:hi])
                self._mark(self._send_span)
                await stream.send(PartHeader(k, header).to_body(), payload)
                self.bytes_sent += payload.nbytes
                self._mark(self._send_span)
                self.observer.part_sent(j, k)
        except P2PTrainError as exc:
            self._fail_reducer(j, f"sending parts failed: {exc}", exc)
            stream.reset("cancelled", "sending failed")
        self._parts_sent_at = max(self._parts_sent_at, self._loop.time())

    async def _receive_results(
        self, j: int, stream: RPCStream, chunks: list[tuple[int, int]]
    ) -> None:
        received = self._received[j]
        try:
            for k, (lo, hi) in enumerate(chunks):
                message = await stream.recv()
                self._results_read[j] = k + 1
                self._payload_read(message.payload)
                if _nbytes(message.payload):
                    self._results_in[j].read(_nbytes(message.payload), self._clock())
                self._mark(self._recv_span)
                result = parse_result(
                    message.body, num_chunks=len(chunks), group_size=self.plan.size
                )
                if result.chunk != k:
                    raise RemoteProtocolError(
                        f"expected the result of chunk {k}, got {result.chunk}"
                    )
                for sender, reason in result.excluded:
                    self._excluded[j].setdefault(sender, reason)
                if result.timing is not None:
                    self._uploads["parts", j] = StreamTiming(*result.timing)
                header = result.codec_header
                if result.contributors and header is not None:
                    target = self.out[lo:hi]
                    values = decode_values(header, message.payload, hi - lo)
                    if values.data_ptr() != target.data_ptr():  # not received in place
                        target.copy_(values)
                    if not all_finite(target):  # checked where it is hot in cache
                        raise RemoteProtocolError(f"the average of chunk {k} is not finite")
                    self.bytes_received += _nbytes(message.payload)
                received[k] = result.contributors  # () when nobody contributed
                self.observer.result_received(j, k)
        except StreamEndedError:
            self._fail_reducer(j, "the reducer ended its stream early")
        except RemoteProtocolError as exc:
            self._fail_reducer(j, f"bad result: {exc}")
            stream.reset(InvalidArgumentError.code, str(exc))
        except P2PTrainError as exc:
            self._fail_reducer(j, str(exc), exc)

    def _result_buffer(self, j: int, body: Any, nbytes: int) -> memoryview | None:
        """Where reducer ``j``'s next result payload goes: its place in the output.

        Only for codec ``none`` and the exact size, each chunk at most once and
        never one already read (the body is not validated yet: whatever is
        wrong with it fails the chunk, and its local values are put back).
        """
        self._payload_arriving()
        if not isinstance(body, dict):
            return None
        k, header = body.get("i"), body.get("h")
        chunks = self.plan.chunks(j)
        first = max(self._claimed_upto[j], self._results_read[j])
        if (
            type(k) is not int
            or not first <= k < len(chunks)
            or not isinstance(header, dict)
            or header.get(KEY_CODEC) != NoneCodec.name
        ):
            return None
        lo, hi = chunks[k]
        if nbytes != 4 * (hi - lo):
            return None
        self._claimed_upto[j] = k + 1
        return self._out_bytes[4 * lo : 4 * hi]

    def _fail_reducer(self, j: int, reason: str, exc: P2PTrainError | None = None) -> None:
        if j not in self._errors:
            self._errors[j] = reason
            self._failed.setdefault(j, reason)
            logger.debug("round %s: reducer %d failed: %s", self.plan.round_id.hex()[:8], j, reason)
        if isinstance(exc, UnavailableError | TransportError):
            # The connection to j is gone: as a sender it is gone too. Stop
            # waiting for it unless its own stream is here (then that
            # stream's fate decides).
            self.sender_failed(j, f"connection lost: {exc}")

    def sender_failed(self, index: int, reason: str) -> None:
        """Stop waiting for member ``index``'s parts unless its stream has joined.

        Used when a member is known to be gone without a stream of its own
        telling: its connection dropped, or its stream failed before this
        member entered the round.
        """
        if index in self._absent:
            self._absent.discard(index)
            self._failed.setdefault(index, reason)
            self._notify()
            return
        reducer = self.reducer
        if reducer is None or not reducer.is_sender(index) or reducer.joined(index):
            return
        self._failed.setdefault(index, reason)
        self._publish(reducer.exclude(index, reason))

    # -- reducer side ------------------------------------------------------------------

    async def serve(self, peer: PeerID, hello: Hello, stream: RPCStream) -> None:
        """Serve one sender's stream (called by the service's RPC handler).

        Refusals reset the stream: ``permission_denied`` for a non-member,
        ``invalid_argument`` for another plan, a member that reduces nothing
        or a second stream, ``deadline_exceeded`` after the reduce-scatter
        deadline or the end of the round.

        Args:
            peer: The authenticated caller.
            hello: Its validated hello, for this round.
            stream: The stream, after the hello.
        """
        sender = self.plan.index_of(peer)
        reducer = self.reducer
        try:
            if sender is None:
                raise PermissionDeniedError("not a member of this round's group")
            if hello.plan_digest != self.plan.digest:
                raise InvalidArgumentError("the sender holds a different group plan")
            if reducer is None or sender == self.index:
                raise InvalidArgumentError("this member reduces no part of the vector")
            if self._closed or reducer.expired:
                raise DeadlineExceededError("the reduce-scatter deadline has passed")
            if sender in self._serving or reducer.joined(sender):
                raise InvalidArgumentError("a second stream from the same sender")
            if self.gather_only:
                if hello.weight != 0:
                    raise InvalidArgumentError("an all-gather takes no parts (weight must be 0)")
                self._absent.discard(sender)
            else:
                self._publish(reducer.join(sender, hello.weight))
        except (RPCError, RemoteProtocolError) as exc:
            if isinstance(exc, RPCError):
                code, message = exc.code, exc.message
            else:
                code, message = InvalidArgumentError.code, str(exc)
            logger.info("round %s: refused %s: %s", self.plan.round_id.hex()[:8], peer.short, exc)
            stream.reset(code, message)
            return
        self._serving[sender] = stream
        self._writers += 1
        self._acks_pending.add(sender)
        timer = self._parts_in[sender] = ArrivalTimer()
        stream.receive_payloads_into(functools.partial(self._part_arriving, timer))
        release = self._pace(
            stream, None if self._pacing is None else self._pacing.results.get(sender)
        )
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._read_parts(sender, stream, reducer))
                # Awaited here, not in a task of its own, so that its ``finally``
                # (which counts it out) runs even when the handler is cancelled.
                await self._write_results(sender, hello, stream, reducer)
        finally:
            release()
            stream.receive_payloads_into(None)  # no reference cycle keeps the round alive
            # A handler cancelled with its dead connection never reads the error
            # from its stream: stop waiting for the parts it still owed (a no-op
            # when every part arrived).
            if not self._closed:
                self._publish(reducer.exclude(sender, "its stream was cut off"))
            self._acks_pending.discard(sender)
            self._notify()

    async def _read_parts(self, sender: int, stream: RPCStream, reducer: ShardReducer) -> None:
        timer = self._parts_in[sender]
        while True:
            try:
                message = await stream.recv()
            except StreamEndedError:
                self._publish(reducer.exclude(sender, "ended its stream before sending every part"))
                return
            except P2PTrainError as exc:
                self._failed.setdefault(sender, f"stream failed: {exc}")
                self._publish(reducer.exclude(sender, f"stream failed: {exc}"))
                return
            self._payload_read(message.payload)
            if _nbytes(message.payload):
                timer.read(_nbytes(message.payload), self._clock())
            try:
                ack = parse_timing(message.body)
                if ack is not None:
                    if _nbytes(message.payload):
                        raise RemoteProtocolError("a timing message carries no payload")
                    self._uploads["results", sender] = StreamTiming(ack.nbytes, ack.seconds)
                    self._acks_pending.discard(sender)
                    self._notify()
                    continue
                part = parse_part(message.body, num_chunks=reducer.num_chunks)
                lo, hi = reducer.bounds[part.chunk]
                values = decode_values(part.codec_header, message.payload, hi - lo)
                finalized = reducer.add(sender, part.chunk, values)
            except RemoteProtocolError as exc:
                self._failed.setdefault(sender, f"protocol violation: {exc}")
                self._publish(reducer.exclude(sender, f"protocol violation: {exc}"))
                stream.reset(InvalidArgumentError.code, str(exc))
                return
            self.bytes_received += _nbytes(message.payload)
            self._mark(self._recv_span)
            self._publish(finalized)
            self.observer.part_received(sender, part.chunk)

    async def _write_results(
        self, sender: int, hello: Hello, stream: RPCStream, reducer: ShardReducer
    ) -> None:
        try:
            last = reducer.num_chunks - 1  # its message also ends our half of the stream
            for k in range(reducer.num_chunks):
                await self._wait(functools.partial(_finalized_past, reducer, k))
                result = reducer.results[k]
                body, payload = self._encode_result(result, hello)
                if k == last:
                    timing = self._parts_in[sender].timing()
                    body["t"] = [timing.nbytes, timing.seconds]
                self._mark(self._send_span)
                await stream.send(body, payload, end=k == last)
                self.bytes_sent += _nbytes(payload)
                self._mark(self._send_span)
                self.observer.result_sent(sender, k)
        except P2PTrainError as exc:
            self._failed.setdefault(sender, f"sending results failed: {exc}")
        finally:
            self._writers -= 1
            self._notify()

    def _encode_result(
        self, result: ChunkResult, hello: Hello
    ) -> tuple[dict[str, Any], memoryview | bytes]:
        excluded = result.excluded
        if result.values is None:
            return ResultHeader(result.index, (), excluded).to_body(), b""
        key = (result.index, hello.codec, hello.block_size)
        encoded = self._encoded.get(key)
        if encoded is None:
            codec = codec_for(hello.codec, hello.block_size)
            encoded = self._encoded[key] = codec.encode(result.values)
        header, payload = encoded
        body = ResultHeader(result.index, result.contributors, excluded, header).to_body()
        return body, payload

    async def _reduce_shard(self) -> None:
        reducer = self.reducer
        if reducer is None:  # pragma: no cover - only started with a reducer
            return
        try:
            async with asyncio.timeout_at(self._reduce_deadline):
                await self._wait(self._part_served)
        except TimeoutError:
            self._absent.clear()
            self._publish(reducer.expire())
        # Every sender that can still want results has joined by now; its
        # timing of our results ends its stream.
        # A sender left out (stalled, failed) is not waited for.
        await self._wait(lambda: self._writers == 0 and not self._awaited_acks())

    async def _watch_absent(self) -> None:
        """Every ``ABSENT_CHECK_S`` until the part is reduced: drop unreachable absentees."""
        reducer = self.reducer
        if reducer is None:  # pragma: no cover - only started with a reducer
            return
        while not self._part_served():
            try:
                async with asyncio.timeout(ABSENT_CHECK_S):
                    await self._wait(self._part_served)
                return
            except TimeoutError:
                pass
            absent = [
                i
                for i, member in enumerate(self.plan.members)
                if member.address is not None
                and (
                    i in self._absent
                    or (
                        reducer.is_sender(i)
                        and not reducer.joined(i)
                        and reducer.exclusion(i) is None
                    )
                )
            ]
            await asyncio.gather(*(self._check_reachable(i) for i in absent))

    def _part_served(self) -> bool:
        """Every chunk of this member's part is reduced, and (all-gather) every member joined."""
        return self.reducer is not None and self.reducer.done and not self._absent

    async def _check_reachable(self, index: int) -> None:
        try:
            await self.node.connect(self.plan.members[index].dial_address)
        except P2PTrainError as exc:
            self.sender_failed(index, f"unreachable: {exc}")

    def _publish(self, finalized: list[ChunkResult]) -> None:
        if not finalized:
            return
        name, block = self.config.codec, self.config.block_size
        codec = codec_for(name, block) if name != "none" else None
        for result in finalized:
            if codec is not None and result.values is not None:
                # Keep what the senders will receive, not the exact average: with
                # a lossy codec every member must end the round with equal values.
                # The encoding is kept for the senders that ask for this codec.
                encoded = self._encoded[(result.index, name, block)] = codec.encode(result.values)
                result.values.copy_(codec.decode(*encoded, numel=result.values.numel()))
            for sender, reason in result.excluded:
                self._excluded[self.index].setdefault(sender, reason)
        if self.reducer is not None and self.reducer.done:
            self._shard_done_at = self._loop.time()
        self._notify()

    def _awaited_acks(self) -> set[int]:
        left_out = self._excluded[self.index].keys() | self._failed.keys()
        return self._acks_pending - left_out

    # -- plumbing ----------------------------------------------------------------------

    async def _wait(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self._changed.wait()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _part_arriving(self, timer: ArrivalTimer, body: object, nbytes: int) -> None:
        self._payload_arriving()
        timer.arriving(self._clock())

    def _payload_arriving(self) -> None:
        if self._arriving == 0:
            self._arriving_since = self._clock()
        self._arriving += 1

    def _payload_read(self, payload: bytes | bytearray | memoryview) -> None:
        if self._arriving > 0 and _nbytes(payload) > 0:
            self._arriving -= 1
            if self._arriving == 0:
                self._download_s += self._clock() - self._arriving_since

    def _mark(self, span: list[float]) -> None:
        now = self._loop.time()
        if span:
            span[1:] = [now]
        else:
            span.extend((now, now))

    def _close(self) -> None:
        self._closed = True
        for stream in self._serving.values():
            stream.reset(DeadlineExceededError.code, "the round is over")
        self._notify()

    def _keep_local_where_missing(self) -> None:
        for j, received in self._received.items():
            for k, (lo, hi) in enumerate(self.plan.chunks(j)):
                if not received[k]:
                    self.out[lo:hi].copy_(self.flat[lo:hi])
        reducer = self.reducer
        if reducer is not None and not reducer.done:  # the round was cut short
            start = self.plan.part(self.index)[0]
            for lo, hi in reducer.bounds[reducer.finalized :]:
                self.out[start + lo : start + hi].copy_(self.flat[start + lo : start + hi])

    def _report(self, end: float, total_s: float) -> AllReduceReport:
        shards = []
        for j in self.plan.reducers():
            start, stop = self.plan.part(j)
            if j == self.index and self.reducer is not None:
                reducer = self.reducer
                contributors: list[tuple[int, ...] | None] = [
                    r.contributors or None for r in reducer.results
                ]
                contributors += [None] * (reducer.num_chunks - reducer.finalized)
            else:
                contributors = [c or None for c in self._received[j]]
            shards.append(
                ShardReport(
                    owner=j,
                    start=start,
                    stop=stop,
                    chunk_contributors=tuple(contributors),
                    excluded=dict(self._excluded[j]),
                    error=self._errors.get(j),
                )
            )
        reduce_end = max(self._parts_sent_at, self._shard_done_at)
        return AllReduceReport(
            round_id=self.plan.round_id,
            members=tuple(m.peer_id for m in self.plan.members),
            index=self.index,
            weight=self.weight,
            shards=tuple(shards),
            failed=dict(self._failed),
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            reduce_scatter_s=reduce_end - self._start,
            all_gather_s=max(end - reduce_end, 0.0),
            total_s=total_s,
            send_s=_span(self._send_span),
            receive_s=self._download_s or _span(self._recv_span),
            predicted_s=self.plan.predicted_time,
            upload_streams=tuple(self._uploads.values()),
            download_streams=tuple(
                t.timing() for t in [*self._results_in.values(), *self._parts_in.values()]
            ),
        )


def _wire_element_bytes(config: AllReduceConfig, num_elements: int) -> float:
    """Bytes one element of a part takes on the wire with the round's codec."""
    codec = codec_for(config.codec, config.block_size)
    return codec.compressed_nbytes(num_elements) / num_elements if num_elements else 4.0


def _nothing() -> None:
    """The release of a stream that is not paced."""


def _finalized_past(reducer: ShardReducer, chunk: int) -> bool:
    return reducer.finalized > chunk


def _span(span: list[float]) -> float:
    return span[-1] - span[0] if span else 0.0


def _nbytes(payload: bytes | bytearray | memoryview) -> int:
    return payload.nbytes if isinstance(payload, memoryview) else len(payload)
