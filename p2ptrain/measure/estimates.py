"""What a peer believes its links can carry: the rates it announces for load balancing.

Theory of operation. Every transfer is timed where it arrives
(:class:`ArrivalTimer`): a stream's bytes over its active receive time, from
its first payload's header to its last read. Receivers tell the sender what
they timed (the all-reduce carries it in a protocol field), so a peer learns
its upload from the far end, not from its own socket buffers (which made
the sender-side :class:`~p2ptrain.measure.meters.ThroughputMeter` see home
uploads faster than their links).

One round, or one probe of several peers at once, gives one observation per
direction: the bytes of the streams that moved at least ``min_bytes`` over
the longest of their spans (they run side by side and share the link).
That is exact for streams that overlap fully, as a timed probe's do by
construction; streams that were staggered (a round's averages leaving
after its parts) took longer together than the longest of them, so there
it errs high, though never above the sum of their rates. Summing the streams' own
rates instead was tried for probes: on the shaped benchmark it showed
50 Mbit/s uploads as 55–62 and 100 Mbit/s downloads as up to 277 (short
streams time the shapers' bursts), and an over-estimate is what a maximum
keeps. Staggering
aside, what a round shows is a lower bound: a peer whose partners are slower, or whose share is
small, moves less than its link can carry. So :class:`LinkEstimator` keeps a
*decayed maximum* per direction, ``estimate ← max(observation, decay ·
estimate)``, with no decay by default: a decay would let a well-connected
peer's estimate sink to what its current share makes it move, the planner
would then give it less, and so on down (a spiral measured in
``bench_allreduce.py``). A link that got slower shows up as a round that ran
late against its plan's prediction: then every observation of that round
replaces its estimate (a link the round under-used is under-estimated for
a moment) and :attr:`LinkEstimator.needs_probe` asks the owner to probe
again, which restores what the round could not show. A typed-in rate is a
cap, never the source.

Pure logic: observations and time come in as arguments; no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from p2ptrain.errors import ConfigError

__all__ = [
    "TCP_PAYLOAD_FRACTION",
    "ArrivalTimer",
    "EstimatorConfig",
    "LinkEstimator",
    "StreamTiming",
    "combined_rate",
    "payload_rate",
]

TCP_PAYLOAD_FRACTION = 1448 / 1514
"""TCP payload per byte on an Ethernet link, full-size segments with timestamps.

A segment carries 1,448 payload bytes in a 1,514-byte frame (Ethernet,
IPv4 and TCP headers with the timestamp option). A link's rate (what a user
types, what tc's shapers count) is in frame bytes; every rate measured here
is payload: a typed-in rate is converted with this before it stands beside
them. The tbf-shaped benchmark links carry payload at this fraction of
their rate."""


def payload_rate(link_bytes_per_s: float) -> float:
    """The TCP payload rate a link of ``link_bytes_per_s`` (frame bytes) carries at most."""
    return link_bytes_per_s * TCP_PAYLOAD_FRACTION


@dataclass(frozen=True, slots=True)
class StreamTiming:
    """Bytes one stream delivered and the seconds they were in flight (receiver's clock).

    Attributes:
        nbytes: Payload bytes received.
        seconds: Time during which one of the stream's messages was arriving.
    """

    nbytes: int
    seconds: float

    def __post_init__(self) -> None:
        if isinstance(self.nbytes, bool) or not isinstance(self.nbytes, int) or self.nbytes < 0:
            raise ConfigError(f"nbytes must be an int >= 0, got {self.nbytes!r}")
        if not (math.isfinite(self.seconds) and self.seconds >= 0):
            raise ConfigError(f"seconds must be finite and >= 0, got {self.seconds!r}")


class ArrivalTimer:
    """Times one stream where its bytes arrive: from its first payload's header to its last read.

    The span includes the waits between messages; on a stream that moves
    data steadily it is the stream's transfer time, and a receiver that reads
    in bursts (a busy CPU) shifts both ends alike. On transports that never
    report arriving headers (WebRTC) the span starts at the first read.
    """

    __slots__ = ("_first", "_last", "nbytes")

    def __init__(self) -> None:
        self._first: float | None = None
        self._last: float | None = None
        self.nbytes = 0

    def arriving(self, now: float) -> None:
        """A message's header arrived (its payload follows)."""
        if self._first is None:
            self._first = now

    def read(self, nbytes: int, now: float) -> None:
        """A message with ``nbytes`` of payload was read."""
        self.nbytes += nbytes
        if self._first is None:
            self._first = now
        self._last = now

    @property
    def seconds(self) -> float:
        """The span timed so far."""
        if self._first is None or self._last is None:
            return 0.0
        return max(self._last - self._first, 0.0)

    def timing(self) -> StreamTiming:
        """What was timed so far."""
        return StreamTiming(self.nbytes, self.seconds)


def combined_rate(
    timings: Iterable[StreamTiming], *, min_bytes: int, min_seconds: float = 0.0
) -> float | None:
    """The rate of streams that ran side by side: their bytes over the longest span.

    Only streams that moved at least ``min_bytes`` over at least
    ``min_seconds`` count (None if none did).
    Exact for streams that overlapped fully. Staggered streams took longer
    together than the longest of them, so for them this is an over-estimate,
    though at most the sum of their rates (which counts fully staggered
    streams twice). The spans come from different receivers' clocks, so
    their union cannot be taken here.
    """
    used = [t for t in timings if t.nbytes >= min_bytes and t.seconds > max(min_seconds, 0.0)]
    if not used:
        return None
    return sum(t.nbytes for t in used) / max(t.seconds for t in used)


def _optional_rate(name: str, value: float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"EstimatorConfig.{name} must be a number or None, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"EstimatorConfig.{name} must be positive and finite, got {value!r}")


@dataclass(frozen=True, slots=True)
class EstimatorConfig:
    """How observations become estimates.

    Attributes:
        decay: Fraction of the old estimate a lower observation keeps, per
            observation, in [0, 1]: ``estimate ← max(observation, decay ·
            estimate)``. 1 (the default) never forgets a maximum except
            through a late round; 0 believes the latest.
        min_bytes: Streams that moved fewer payload bytes are not used (their
            time is mostly latency).
        min_seconds: Streams timed over a shorter span are not used either: a
            receiver that was busy when a stream arrived finds it already in
            its kernel buffer and reads it at memory speed, so a short span
            times the copy, not the link (a 50 Mbit/s upload was announced as
            3,196 Mbit/s from such spans on the 2-core shaped demo; 88 with
            this bound). 0.1 s was tried: the shaped benchmark's 1 Gbit/s
            peer then moved no stream that long, its estimate fell to the
            loaded machine's probe (168 Mbit/s) and the measured plan ran 35 %
            slower than the configured one.
        late_tolerance: A round whose achieved time exceeded its predicted
            time by more than this fraction replaces higher estimates with
            what it observed; >= 0.
        upload_cap_bytes_per_s: A typed-in upload rate, the link's (frame
            bytes, as a user or a shaper states it): the estimate never
            exceeds the payload it carries (:func:`payload_rate`), which
            stands in until something was measured.
        download_cap_bytes_per_s: The same for download.
    """

    decay: float = 1.0
    min_bytes: int = 256 << 10
    min_seconds: float = 0.02
    late_tolerance: float = 0.25
    upload_cap_bytes_per_s: float | None = None
    download_cap_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.decay, bool) or not 0 <= self.decay <= 1:
            raise ConfigError(f"EstimatorConfig.decay must be in [0, 1], got {self.decay!r}")
        if isinstance(self.min_bytes, bool) or not isinstance(self.min_bytes, int):
            raise ConfigError("EstimatorConfig.min_bytes must be an int")
        if self.min_bytes < 0:
            raise ConfigError("EstimatorConfig.min_bytes must be >= 0")
        secs = self.min_seconds
        if isinstance(secs, bool) or not (isinstance(secs, int | float) and 0 <= secs < math.inf):
            raise ConfigError(f"EstimatorConfig.min_seconds must be >= 0, got {secs!r}")
        tol = self.late_tolerance
        if isinstance(tol, bool) or not (math.isfinite(tol) and tol >= 0):
            raise ConfigError(f"EstimatorConfig.late_tolerance must be >= 0, got {tol!r}")
        _optional_rate("upload_cap_bytes_per_s", self.upload_cap_bytes_per_s)
        _optional_rate("download_cap_bytes_per_s", self.download_cap_bytes_per_s)


class _Direction:
    __slots__ = ("observations", "value")

    def __init__(self) -> None:
        self.value: float | None = None
        self.observations = 0

    def update(self, observed: float, decay: float, late: bool) -> None:
        self.observations += 1
        if self.value is None or (late and observed < self.value):
            self.value = observed
        else:
            self.value = max(observed, decay * self.value)


class LinkEstimator:
    """A peer's upload and download estimates: probe and rounds, decayed maximum, caps.

    Args:
        config: Decay, thresholds and typed-in caps.
    """

    def __init__(self, config: EstimatorConfig | None = None) -> None:
        self.config = config or EstimatorConfig()
        self._upload = _Direction()
        self._download = _Direction()
        self._probed_upload: float | None = None  # the latest probe's upload
        self.needs_probe = False
        """Set by a late round: a probe should restore what the round could not show."""

    # -- observations ------------------------------------------------------------------

    def observe(
        self,
        *,
        uploads: Iterable[StreamTiming] = (),
        downloads: Iterable[StreamTiming] = (),
        late: bool = False,
    ) -> None:
        """Fold one round's (or one probe's) receiver-timed streams into the estimates.

        Args:
            uploads: This peer's outgoing streams, as their receivers timed them.
            downloads: Its incoming streams, as it timed them.
            late: Whether the round took longer than predicted (beyond
                ``late_tolerance``): lower observations then replace the estimates.
        """
        self._fold(self._upload, uploads, late)
        self._fold(self._download, downloads, late)

    def _fold(
        self, direction: _Direction, timings: Iterable[StreamTiming], late: bool
    ) -> float | None:
        """Fold ``timings`` into ``direction``; returns their combined rate (None: too little)."""
        rate = combined_rate(
            timings, min_bytes=self.config.min_bytes, min_seconds=self.config.min_seconds
        )
        if rate is not None:
            direction.update(rate, self.config.decay, late)
        return rate

    def observe_round(
        self,
        uploads: Iterable[StreamTiming],
        downloads: Iterable[StreamTiming],
        *,
        total_s: float,
        predicted_s: float | None,
    ) -> bool:
        """One all-reduce round: streams plus how long it took against its prediction.

        Returns:
            Whether the round ran late (its observations replaced the estimates).
        """
        late = bool(predicted_s) and total_s > (predicted_s or 0.0) * (
            1 + self.config.late_tolerance
        )
        self.observe(uploads=uploads, downloads=downloads, late=late)
        if late:
            self.needs_probe = True
        return late

    def observe_probe(
        self, uploads: Iterable[StreamTiming], downloads: Iterable[StreamTiming]
    ) -> None:
        """A probe of one or more peers at once (it clears :attr:`needs_probe`)."""
        probed = self._fold(self._upload, uploads, False)
        self._fold(self._download, downloads, False)
        if probed is not None:
            self._probed_upload = probed
        self.needs_probe = False

    def record_upload(self, nbytes: int, seconds: float) -> None:
        """One upload transfer timed by its receiver (e.g. a probe)."""
        self.observe(uploads=[StreamTiming(nbytes, seconds)])

    def record_download(self, nbytes: int, seconds: float) -> None:
        """One download transfer timed here (e.g. a probe)."""
        self.observe(downloads=[StreamTiming(nbytes, seconds)])

    # -- estimates ---------------------------------------------------------------------

    @property
    def measured_upload_bytes_per_s(self) -> float | None:
        """The upload estimate before the cap (None before any observation)."""
        return self._upload.value

    @property
    def measured_download_bytes_per_s(self) -> float | None:
        """The download estimate before the cap (None before any observation)."""
        return self._download.value

    @property
    def upload_bytes_per_s(self) -> float | None:
        """The upload rate to announce: measured, capped; the cap alone before a measurement."""
        return _capped(self._upload.value, self.config.upload_cap_bytes_per_s)

    @property
    def upload_capacity_bytes_per_s(self) -> float | None:
        """The upload rate to pace bulk sends at: the latest probe's, capped; the cap alone before.

        Only a probe (transfers sized and timed to fill the link) or a
        typed-in rate counts here, not the rounds: a round's streams are
        slowed by round trips and by the pacing itself, and pacing on the
        rounds' figures slowed 16 MiB rounds at 40 ms RTT twofold
        (docs/benchmarks.md). None: nothing to pace at.
        """
        return _capped(self._probed_upload, self.config.upload_cap_bytes_per_s)

    @property
    def download_bytes_per_s(self) -> float | None:
        """The download rate to announce: measured, capped; the cap alone before a measurement."""
        return _capped(self._download.value, self.config.download_cap_bytes_per_s)

    @property
    def observations(self) -> tuple[int, int]:
        """How many upload and download observations were folded in."""
        return self._upload.observations, self._download.observations


def _capped(value: float | None, link_cap: float | None) -> float | None:
    cap = None if link_cap is None else payload_rate(link_cap)
    if value is None:
        return cap
    return value if cap is None else min(value, cap)
