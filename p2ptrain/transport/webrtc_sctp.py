"""Tuning of aiortc's pure-Python SCTP stack, applied to one association.

Why
---
aiortc (1.16) implements SCTP (RFC 9260) itself, in ``aiortc.rtcsctptransport``.
Read against the RFC and measured in the NAT lab (docs/webrtc.md has the
numbers), these behaviours cost throughput or CPU:

1. **Repeated fast retransmits.** Every SACK that reports a TSN missing strikes
   it, and every third strike marks it for retransmission *again*, also after
   it was fast-retransmitted and before that copy could be acknowledged. With
   one SACK per packet and W packets in flight, a lost packet is resent about
   W/3 times in the round trip that follows. Classic SCTP fast-retransmits a
   TSN once; here another fast retransmit is allowed only when the peer
   reports a TSN sent *after* the copy (so the copy is known to be lost).
2. **Reno against random loss.** cwnd halves on every loss event and grows by
   one chunk (1160 bytes) per round trip: about ``1.2 * MSS / (RTT * sqrt(p))``,
   ~0.4 MB/s at 40 ms and 0.5 % loss. With ``flows = N`` the association
   responds like N Reno flows together (as MulTCP does): +N chunks per round
   trip, ``cwnd *= 1 - 1/(2N)`` on loss, what an application opening N
   connections would get; but only while the path shows no standing queue.
   A loss with a queue (round trips ``max_queue_delay`` above their minimum) is
   congestion and gets Reno's halving, and cwnd does not grow at all while
   the queue stands (the idea of TCP Veno: tell random loss from congestion
   by the backlog).
3. **RTO.Min of 1 s, no back-off, RTO.Initial 3 s.** Whenever fast retransmit
   cannot recover (a lost retransmission, a loss at the end of a burst), the
   sender waits a second and restarts from one chunk. ``rto_min`` (default
   200 ms, as Linux TCP) bounds the timer instead; timeouts double it
   (RFC 9260 6.3.3 E2, which aiortc skips).
4. **cwnd without bound.** The sender ignores the peer's receive window, so on
   a fast path cwnd grows until the receiver's socket buffer overflows; every
   SACK then makes aiortc walk the whole sent queue. cwnd stops growing when
   the round trip rises ``max_queue_delay`` above its minimum (a standing
   queue), and never exceeds ``max_cwnd``.
5. **A SACK per packet.** With ``sack_every = 4`` the receiver acknowledges
   every fourth packet, or the last of the packets read together, at once on
   gaps or duplicates (as the RFC asks) and every second packet for a while
   after a gap (the sender recovers faster with more SACKs: aiortc lets each
   release at most four chunks beyond the flight). A quarter of the SACKs to
   encrypt, send, decrypt and process on a clean path.
6. **Quadratic reassembly.** ``InboundStream.pop_messages`` rescans the partial
   message on every arriving chunk: a 256 KiB message (226 chunks) costs ~25k
   steps. ``fast_reassembly`` skips the scan when the new chunk can complete
   no message (:class:`_ReassemblyGate`).

How
---
:func:`tune_association` replaces bound methods of one ``RTCSctpTransport``
*instance* (``_receive_sack_chunk``, ``_update_rto``, ``_t3_expired``,
``_send_sack``, ``_get_inbound_stream``) with wrappers that call aiortc's
originals and adjust the instance's state (``_cwnd``, ``_ssthresh``, ``_rto``,
a chunk's ``_misses``) before or after. No aiortc code is copied and no module
constant is changed, so other associations in the process are untouched. The
aiortc version (:data:`SUPPORTED_AIORTC`) and the internals relied upon are
checked when tuning starts (:class:`UnsupportedAiortcError` if they differ;
the connection then runs stock aiortc, with a warning); ``tests/transport/test_webrtc.py``
runs the wrappers on real aiortc associations with deterministic packet loss.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from p2ptrain.aio import BackgroundTasks
from p2ptrain.errors import ConfigError, P2PTrainError

__all__ = [
    "SUPPORTED_AIORTC",
    "SctpStats",
    "SctpTuner",
    "SctpTuning",
    "UnsupportedAiortcError",
    "aiortc_version",
    "tune_association",
]

logger = logging.getLogger(__name__)

_TSN_MODULO = 1 << 32
_MAX_HOLES = 64
"""Missing TSNs per SACK examined for the single-fast-retransmit rule; holes
beyond (a burst drop) keep aiortc's behaviour."""
_NEVER = -(1 << 30)
_QUICK_SACK_PACKETS = 256
"""Packets after a gap during which SACKs go out at least every second packet."""
_RECENT_RTT_SAMPLES = 8
"""Round-trip samples (about one per SACK) whose minimum tells a queue from jitter."""
"""A strike count that cannot reach aiortc's threshold of 3."""
_REQUIRED = (
    "_receive_sack_chunk",
    "_update_rto",
    "_send_sack",
    "_t3_expired",
    "_cwnd",
    "_rto",
    "_sent_queue",
    "_fast_recovery_exit",
    "_sack_misordered",
    "_sack_duplicates",
    "_sack_needed",
    "_get_inbound_stream",
)


SUPPORTED_AIORTC = ((1, 9), (1, 17))
"""aiortc versions (from, below) whose internals the tuning was written and
tested against; pyproject.toml bounds the dependency to the same range. Outside
it the tuning is not installed and connections run aiortc's stock SCTP."""


def aiortc_version() -> tuple[int, ...]:
    """The installed aiortc's version as integers (``(1, 16, 0)``); ``()`` if unreadable."""
    from importlib import metadata  # noqa: PLC0415

    try:
        text = metadata.version("aiortc")
    except metadata.PackageNotFoundError:
        return ()
    parts: list[int] = []
    for part in text.split("."):
        digits = "".join(c for c in part if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


class UnsupportedAiortcError(P2PTrainError):
    """The installed aiortc lacks an internal the SCTP tuning relies upon."""


@dataclass(frozen=True)
class SctpTuning:
    """How one SCTP association deviates from aiortc's defaults.

    Attributes:
        rto_min: Lower bound of the retransmission timeout in seconds (aiortc
            1.0 s, RFC 9260's RTO.Min).
        rto_max: Upper bound in seconds (aiortc 60 s).
        rto_initial: RTO before the first round-trip sample (aiortc 3 s); also
            the INIT retransmission timer while the association forms.
        flows: Congestion response of this many Reno flows: +``flows`` chunks
            per round trip, ``cwnd *= 1 - 1/(2*flows)`` on a loss while the
            path shows no standing queue (a loss with one halves cwnd, as
            Reno does). 1 is plain Reno (aiortc's).
        max_cwnd: Largest congestion window in bytes.
        max_queue_delay: A round trip this many seconds above the smallest
            seen means a standing queue: cwnd stops growing (more window would
            only add delay, and aiortc's per-SACK work grows with it), and a
            loss then counts as congestion. None: grow until loss, and treat
            every loss as noise. It must exceed the delays CPU scheduling adds
            on a busy host (a receiver descheduled for tens of ms looks like a
            queue): at 20 ms, the clean lab path on a loaded 2-core machine
            held cwnd too small to bridge those gaps and lost half its
            throughput.
        single_fast_retransmit: Fast-retransmit a TSN again only after a TSN
            sent later was reported (off: aiortc's repeated retransmits).
        sack_every: Data packets per SACK at most (1: aiortc's, every packet);
            at most 2 for 256 packets after a gap, at once on a gap.
        fast_reassembly: Look for complete messages only when a chunk could
            complete one (it ends a message or fills a gap) instead of
            rescanning the partial message on every chunk (quadratic in the
            message size).
    """

    rto_min: float = 0.2
    rto_max: float = 10.0
    rto_initial: float = 1.0
    flows: int = 8
    max_cwnd: int = 4 << 20
    max_queue_delay: float | None = 0.06
    single_fast_retransmit: bool = True
    sack_every: int = 4
    fast_reassembly: bool = True

    def __post_init__(self) -> None:
        if not 0.01 <= self.rto_min <= self.rto_max <= 120.0:
            raise ConfigError("need 0.01 <= rto_min <= rto_max <= 120 (seconds)")
        if not self.rto_min <= self.rto_initial <= self.rto_max:
            raise ConfigError("rto_initial must be within [rto_min, rto_max]")
        if not 1 <= self.flows <= 64:
            raise ConfigError(f"flows must be in [1, 64], got {self.flows}")
        if not 64 * 1024 <= self.max_cwnd <= 1 << 30:
            raise ConfigError("max_cwnd must be in [64 KiB, 1 GiB]")
        if self.max_queue_delay is not None and not 0.0 <= self.max_queue_delay <= 10.0:
            raise ConfigError("max_queue_delay must be in [0, 10] seconds or None")
        if not 1 <= self.sack_every <= 16:
            raise ConfigError(f"sack_every must be in [1, 16], got {self.sack_every}")

    @property
    def beta(self) -> float:
        """The factor cwnd is multiplied by on a loss event."""
        return 1.0 - 1.0 / (2 * self.flows)


@dataclass
class SctpStats:
    """What the tuner saw on one association (for tests, logs and benchmarks)."""

    loss_events: int = 0
    """Fast-recovery entries (cwnd reductions on gap reports)."""
    congestion_losses: int = 0
    """Loss events with a standing queue, answered with Reno's halving."""
    timeouts: int = 0
    """T3-rtx expirations."""
    repeat_retransmits_suppressed: int = 0
    """Strikes ignored on TSNs already fast-retransmitted."""
    growth_held: int = 0
    """SACKs whose cwnd increase was withheld because of queueing delay."""
    sacks_sent: int = 0
    sacks_delayed: int = 0


def _tsn_gt(a: int, b: int) -> bool:
    """Serial-number comparison a > b (RFC 1982 on 32 bits)."""
    return a != b and (a - b) % _TSN_MODULO < (1 << 31)


class SctpTuner:
    """The wrappers installed on one ``RTCSctpTransport``; see the module docstring.

    Create with :func:`tune_association`; :meth:`close` cancels the tuner's own
    pending work (a delayed SACK) and is called when the transport closes.
    """

    def __init__(
        self, sctp: Any, tuning: SctpTuning, *, chunk_bytes: int, last_fragment_flag: int
    ) -> None:
        self.tuning = tuning
        self.stats = SctpStats()
        self._sctp = sctp
        self._chunk = chunk_bytes
        self._loop = asyncio.get_running_loop()
        self._tasks = BackgroundTasks("sctp tuner")  # delayed SACKs
        self._sack_flush: asyncio.Handle | None = None
        self._unacked_packets = 0
        self._quick_packets = 0
        self._closed = False
        self._min_rtt = float("inf")
        self._recent_rtts: deque[float] = deque(maxlen=_RECENT_RTT_SAMPLES)
        self._orig_receive_sack: Callable[[Any], Awaitable[None]] = sctp._receive_sack_chunk
        self._orig_update_rto: Callable[[float], None] = sctp._update_rto
        self._orig_send_sack: Callable[[], Awaitable[None]] = sctp._send_sack
        self._orig_t3_expired: Callable[[], None] = sctp._t3_expired
        sctp._receive_sack_chunk = self._receive_sack_chunk
        sctp._update_rto = self._update_rto
        sctp._t3_expired = self._t3_expired
        if tuning.sack_every > 1:
            sctp._send_sack = self._send_sack
        if tuning.fast_reassembly:
            self._orig_get_inbound_stream: Callable[[int], Any] = sctp._get_inbound_stream
            self._last_fragment = last_fragment_flag
            self._gated: dict[int, Any] = {}
            sctp._get_inbound_stream = self._get_inbound_stream
        sctp._rto = tuning.rto_initial

    def close(self) -> None:
        """Stop: cancel a pending delayed SACK (the association is going away)."""
        self._closed = True
        if self._sack_flush is not None:
            self._sack_flush.cancel()
            self._sack_flush = None
        self._tasks.cancel()

    # -- sender: SACK processing and congestion control --------------------------------

    async def _receive_sack_chunk(self, chunk: Any) -> None:
        sctp = self._sctp
        cwnd_before = sctp._cwnd
        in_recovery = sctp._fast_recovery_exit is not None
        holes = self._hold_strikes(chunk) if self.tuning.single_fast_retransmit else []
        await self._orig_receive_sack(chunk)
        for schunk in holes:
            self._note_retransmission(schunk)
        self._adjust_cwnd(cwnd_before, in_recovery)

    def _note_retransmission(self, schunk: Any) -> None:
        """Remember when a chunk was sent again, and the highest TSN in flight then.

        Only a SACK reporting a TSN beyond that one can prove the new copy lost.
        """
        if schunk._retransmit or schunk._sent_count <= getattr(schunk, "_p2p_sent", 1):
            return
        queue = self._sctp._sent_queue
        schunk._p2p_sent = schunk._sent_count
        schunk._p2p_recover = queue[-1].tsn if queue else schunk.tsn

    def _hold_strikes(self, chunk: Any) -> list[Any]:
        """Pin the strike count of retransmitted holes until their copy is proven lost.

        Returns the hole chunks examined, so that those aiortc retransmits
        while handling this SACK are noted afterwards.
        """
        queue = self._sctp._sent_queue
        if not chunk.gaps or not queue:
            return []
        first = queue[0].tsn
        cumulative = chunk.cumulative_tsn
        highest = (cumulative + chunk.gaps[-1][1]) % _TSN_MODULO
        holes: list[Any] = []
        expected = 1
        for start, end in chunk.gaps:
            for offset in range(expected, start):
                if len(holes) >= _MAX_HOLES:
                    return holes
                index = (cumulative + offset - first) % _TSN_MODULO
                if index >= len(queue):
                    continue
                schunk = queue[index]
                holes.append(schunk)
                self._note_retransmission(schunk)
                recover = getattr(schunk, "_p2p_recover", None)
                if recover is None:
                    continue
                if _tsn_gt(highest, recover):
                    # A TSN sent after the copy arrived first: the copy is lost too.
                    schunk._p2p_recover = None
                    schunk._misses = 0
                else:
                    schunk._misses = _NEVER
                    self.stats.repeat_retransmits_suppressed += 1
            expected = end + 1
        return holes

    def _adjust_cwnd(self, cwnd_before: int, in_recovery: bool) -> None:
        sctp = self._sctp
        tuning = self.tuning
        if sctp._cwnd > cwnd_before and self._queueing():
            # A standing queue: the path is full, hold the window. Slow start
            # is not left (HyStart would): on a busy host a receiver's
            # scheduling gap looks like a queue, and leaving slow start on one
            # early in a transfer kept cwnd growing one chunk per round trip
            # (clean lab path: 1.53-2.19x stock per burst, 1.93-2.06x without).
            sctp._cwnd = cwnd_before
            self.stats.growth_held += 1
        elif not in_recovery and sctp._fast_recovery_exit is not None:
            # aiortc just halved cwnd. A loss while a queue stands is congestion:
            # keep Reno's halving. A loss on an empty path is noise: respond
            # like `flows` Reno flows would (the idea of TCP Veno).
            self.stats.loss_events += 1
            if self._queueing():
                self.stats.congestion_losses += 1
                return
            reduced = max(int(cwnd_before * tuning.beta), 4 * self._chunk)
            sctp._ssthresh = reduced
            sctp._cwnd = reduced
        elif (
            not in_recovery
            and sctp._fast_recovery_exit is None
            and sctp._cwnd > cwnd_before > sctp._ssthresh
        ):
            # A congestion-avoidance step (+1 chunk per window acknowledged).
            sctp._cwnd += (tuning.flows - 1) * (sctp._cwnd - cwnd_before)
        sctp._cwnd = min(sctp._cwnd, tuning.max_cwnd)

    def _queueing(self) -> bool:
        """Whether the recent round trips show a standing queue on the path.

        The smallest of the last few samples is used: a queue raises all of
        them, a scheduling hiccup only some.
        """
        delay = self.tuning.max_queue_delay
        recent = self._recent_rtts
        return delay is not None and bool(recent) and min(recent) > self._min_rtt + delay

    def _update_rto(self, rtt: float) -> None:
        self._recent_rtts.append(rtt)
        self._min_rtt = min(self._min_rtt, rtt)
        self._orig_update_rto(rtt)
        sctp = self._sctp
        estimate = sctp._srtt + 4 * sctp._rttvar
        sctp._rto = min(max(estimate, self.tuning.rto_min), self.tuning.rto_max)

    def _t3_expired(self) -> None:
        self.stats.timeouts += 1
        self._orig_t3_expired()
        # RFC 9260 6.3.3 E2, which aiortc skips: back the timer off.
        sctp = self._sctp
        sctp._rto = min(sctp._rto * 2, self.tuning.rto_max)

    # -- receiver: reassembly ---------------------------------------------------------

    def _get_inbound_stream(self, stream_id: int) -> Any:
        stream = self._orig_get_inbound_stream(stream_id)
        if self._gated.get(stream_id) is not stream:  # a new stream (or a reset one)
            _ReassemblyGate(stream, self._last_fragment)
            self._gated[stream_id] = stream
        return stream

    # -- receiver: delayed SACKs -------------------------------------------------------

    async def _send_sack(self) -> None:
        sctp = self._sctp
        self._unacked_packets += 1
        every = self.tuning.sack_every
        if sctp._sack_misordered or sctp._sack_duplicates:
            # A gap or a duplicate: report it at once (RFC 9260 6.2), then
            # acknowledge more often for a while: the sender is recovering,
            # and aiortc lets each SACK release at most four chunks beyond
            # the flight, so rarer SACKs would keep its window from refilling.
            self._quick_packets = _QUICK_SACK_PACKETS
            await self._sack_now()
            return
        if self._quick_packets > 0:
            self._quick_packets -= 1
            every = min(every, 2)
        if self._unacked_packets >= every:
            await self._sack_now()
            return
        # Wait for the next packet, but no longer than the packets that arrived
        # together take to process (the loop's next turn).
        self.stats.sacks_delayed += 1
        if self._sack_flush is None and not self._closed:
            self._sack_flush = self._loop.call_soon(self._flush_delayed_sack)

    async def _sack_now(self) -> None:
        self._unacked_packets = 0
        if self._sack_flush is not None:
            self._sack_flush.cancel()
            self._sack_flush = None
        self.stats.sacks_sent += 1
        await self._orig_send_sack()

    def _flush_delayed_sack(self) -> None:
        self._sack_flush = None
        if self._closed or not self._sctp._sack_needed:
            return
        self._tasks.spawn(self._delayed_sack(), name="sctp-delayed-sack")

    async def _delayed_sack(self) -> None:
        """A SACK sent on the next loop turn; any other failure is logged by the owner."""
        with contextlib.suppress(ConnectionError):  # the DTLS transport closed under us
            await self._sack_now()


class _ReassemblyGate:
    """Skips aiortc's reassembly scan when the chunk just added cannot complete a message.

    aiortc's ``InboundStream.pop_messages`` walks the partial message from its
    first fragment on every chunk, so a message of k chunks costs O(k^2). A
    message can only become complete when the chunk just added is a last
    fragment or lands before the end of the (TSN-sorted) reassembly list,
    filling a gap; otherwise the scan is skipped. Calls not preceded by
    ``add_chunk`` (FORWARD TSN handling) always scan.
    """

    def __init__(self, stream: Any, last_fragment_flag: int) -> None:
        self._stream = stream
        self._last_fragment = last_fragment_flag
        self._orig_add = stream.add_chunk
        self._orig_pop = stream.pop_messages
        self._may_complete = True
        self.skipped = 0
        stream.add_chunk = self.add_chunk
        stream.pop_messages = self.pop_messages

    def add_chunk(self, chunk: Any) -> None:
        self._orig_add(chunk)
        reassembly = self._stream.reassembly
        self._may_complete = bool(chunk.flags & self._last_fragment) or (
            not reassembly or reassembly[-1] is not chunk
        )

    def pop_messages(self) -> Iterator[tuple[int, int, bytes]]:
        if self._may_complete:
            return self._orig_pop()  # type: ignore[no-any-return]
        self._may_complete = True
        self.skipped += 1
        return iter(())


def tune_association(sctp: Any, tuning: SctpTuning) -> SctpTuner:
    """Install ``tuning`` on one aiortc ``RTCSctpTransport`` before it starts.

    Raises:
        UnsupportedAiortcError: aiortc is outside :data:`SUPPORTED_AIORTC` or
            lacks an internal the tuning needs.
    """
    version = aiortc_version()
    low, high = SUPPORTED_AIORTC
    if not low <= version < high:
        shown = ".".join(map(str, version)) or "unknown"
        raise UnsupportedAiortcError(
            f"aiortc {shown} is outside the versions the SCTP tuning supports "
            f"(>= {'.'.join(map(str, low))}, < {'.'.join(map(str, high))})"
        )
    missing = [name for name in _REQUIRED if not hasattr(sctp, name)]
    if missing:
        raise UnsupportedAiortcError(f"this aiortc's SCTP transport lacks {', '.join(missing)}")
    from aiortc import rtcsctptransport  # noqa: PLC0415 - aiortc is heavy to import

    chunk_bytes = getattr(rtcsctptransport, "USERDATA_MAX_LENGTH", 1160)
    last_fragment = getattr(rtcsctptransport, "SCTP_DATA_LAST_FRAG", 0x01)
    with contextlib.suppress(AttributeError):
        if sctp._srtt is not None:
            raise ConfigError("tune the SCTP association before it carries data")
    return SctpTuner(sctp, tuning, chunk_bytes=chunk_bytes, last_fragment_flag=last_fragment)
