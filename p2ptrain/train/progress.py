"""Training progress of a swarm: per-peer records and their aggregate (pure, no I/O).

Every peer publishes a :class:`PeerProgress` in the DHT dictionary
``<run_id>/progress``, under a sub-key bound to its own key (so the record is
signed and nobody can publish in its name), and refreshes it before it
expires. Anyone can :func:`aggregate` the records it reads into a
:class:`SwarmProgress`:

* the swarm's *global step* is the highest step any live peer reports;
* the samples accumulated toward it are those of the peers at that step
  (peers still at an older step have not started on it);
* the swarm is *ready* to step when those samples reach the target batch
  size, or when every live peer is at the global step and blocked (it has
  accumulated all it may, so waiting longer can only stall);
* the estimated time to the target extrapolates every unblocked peer at the
  global step at its reported rate from the time of its record.

:class:`RateMeter` turns a peer's batches into the samples/s it reports.
Time is an argument everywhere: the functions here never read a clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from p2ptrain.errors import ConfigError, RemoteProtocolError
from p2ptrain.node.address import PeerAddress
from p2ptrain.secure.identity import PeerID

__all__ = [
    "PeerProgress",
    "ProgressConfig",
    "RateMeter",
    "SwarmProgress",
    "aggregate",
    "next_fetch_delay",
]

_MAX_STEP = 2**62
_MAX_SAMPLES = 2**62


def _check_number(owner: str, name: str, value: object, *, low: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{owner}.{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= low:
        raise ConfigError(f"{owner}.{name} must be finite and > {low}, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class ProgressConfig:
    """How often progress is published and read.

    Attributes:
        publish_interval: Least seconds between two publications that only
            change the sample count. A new step, a change of the blocked flag,
            or a sample count that makes the swarm ready is published at once.
        heartbeat_interval: A record is republished at least this often, so
            that it outlives long batches.
        expiration: Lifetime of a record in seconds. A peer that dies stops
            counting after at most this long; longer than ``heartbeat_interval``.
        min_fetch_interval: Least seconds between two reads of the swarm's
            records (used while a step is near or this peer waits).
        max_fetch_interval: Most seconds between two reads.
        smoothing: Weight of a new measurement in the samples/s moving average.
    """

    publish_interval: float = 1.0
    heartbeat_interval: float = 5.0
    expiration: float = 20.0
    min_fetch_interval: float = 0.2
    max_fetch_interval: float = 5.0
    smoothing: float = 0.2

    def __post_init__(self) -> None:
        for name in (
            "publish_interval",
            "heartbeat_interval",
            "expiration",
            "min_fetch_interval",
            "max_fetch_interval",
        ):
            _check_number("ProgressConfig", name, getattr(self, name), low=0.0)
        if self.expiration <= self.heartbeat_interval:
            raise ConfigError("ProgressConfig.expiration must exceed heartbeat_interval")
        if self.max_fetch_interval < self.min_fetch_interval:
            raise ConfigError("ProgressConfig.max_fetch_interval must be >= min_fetch_interval")
        smoothing = _check_number("ProgressConfig", "smoothing", self.smoothing, low=0.0)
        if smoothing > 1:
            raise ConfigError("ProgressConfig.smoothing must be in (0, 1]")


@dataclass(frozen=True)
class PeerProgress:
    """What one peer says about its training.

    Attributes:
        peer_id: Who reports (the owner of the record's sub-key).
        step: The peer's global step: the number of swarm steps it has applied.
        samples: Samples it accumulated toward its next step.
        samples_per_s: Its recent compute throughput.
        time: When it wrote the record (its clock, Unix seconds).
        blocked: It accumulated all it may for this step and waits for the swarm.
        address: Where it serves its state (``peerid@host:port``), or ``None``
            in client mode.
        reach: How others reach it: ``public``, ``nat:<kind>`` (with NAT
            traversal), ``direct`` (plain TCP), or ``None`` if it did not say.
        upload_bytes_per_s: Its upload bandwidth as the load balancer sees it
            (measured, or announced), or ``None`` if it did not say.
        download_bytes_per_s: The same for download.
        batch: Samples of its latest local batch (0 if it did not say); the
            step cut extrapolates its progress in whole batches of this size.
        closed: It adds no more samples to ``step`` (the step cut reached
            the target, as it estimates); what it computes next counts toward
            the following step.
        last_step_samples: Samples the swarm averaged in the peer's latest
            step (the all-reduce's total weight), or ``None`` if unknown.
        target: The target batch size it trains with, or ``None``.
        left: It left the run (its last record, published as it closed): it
            counts as gone at once instead of when the record expires.
        model: A digest of its model's parameter names, shapes and dtypes
            (:func:`~p2ptrain.train.state.model_digest`), or ``None`` if it did
            not say; peers of one run must agree on it.
    """

    peer_id: PeerID
    step: int
    samples: int
    samples_per_s: float
    time: float
    blocked: bool = False
    address: str | None = None
    reach: str | None = None
    upload_bytes_per_s: float | None = None
    download_bytes_per_s: float | None = None
    batch: int = 0
    closed: bool = False
    last_step_samples: int | None = None
    target: int | None = None
    left: bool = False
    model: str | None = None

    def to_wire(self) -> dict[str, Any]:
        """The msgpack-able value stored in the DHT (the PeerID is the sub-key's owner)."""
        return {
            "s": self.step,
            "n": self.samples,
            "r": self.samples_per_s,
            "t": self.time,
            "b": self.blocked,
            "a": self.address,
            "q": self.reach,
            "u": self.upload_bytes_per_s,
            "d": self.download_bytes_per_s,
            "k": self.batch,
            "c": self.closed,
            "l": self.last_step_samples,
            "g": self.target,
            "x": self.left,
            "m": self.model,
        }

    @classmethod
    def from_wire(cls, peer_id: PeerID, value: object) -> PeerProgress:
        """Parse a value read from the DHT.

        Raises:
            RemoteProtocolError: The value is not a valid progress record.
        """
        if not isinstance(value, Mapping):
            raise RemoteProtocolError("a progress record is a map")
        blocked, address = value.get("b", False), value.get("a")
        if not isinstance(blocked, bool):
            raise RemoteProtocolError("progress blocked flag must be a bool")
        if address is not None:
            if not isinstance(address, str) or len(address) > 512:
                raise RemoteProtocolError("progress address must be a short string")
            try:
                parsed = PeerAddress.parse(address)
            except ConfigError as exc:
                raise RemoteProtocolError(f"bad progress address: {exc}") from exc
            if parsed.peer_id not in (None, peer_id):
                raise RemoteProtocolError("the progress address names another peer")
        reach = value.get("q")
        if reach is not None and not (isinstance(reach, str) and len(reach) <= 32):
            raise RemoteProtocolError("progress reach must be a short string")
        upload, download = value.get("u"), value.get("d")
        closed, left = value.get("c", False), value.get("x", False)
        if not isinstance(closed, bool) or not isinstance(left, bool):
            raise RemoteProtocolError("progress closed and left flags must be bools")
        last, target = value.get("l"), value.get("g")
        model = value.get("m")
        if model is not None and not (isinstance(model, str) and len(model) <= 64):
            raise RemoteProtocolError("progress model digest must be a short string")
        return cls(
            peer_id=peer_id,
            step=_wire_int(value.get("s"), "step"),
            samples=_wire_int(value.get("n"), "samples"),
            samples_per_s=_wire_float(value.get("r"), "samples_per_s"),
            time=_wire_float(value.get("t"), "time"),
            blocked=blocked,
            address=address,
            reach=reach,
            upload_bytes_per_s=None if upload is None else _wire_float(upload, "upload"),
            download_bytes_per_s=None if download is None else _wire_float(download, "download"),
            batch=_wire_int(value.get("k", 0), "batch"),
            closed=closed,
            last_step_samples=None if last is None else _wire_int(last, "last step samples"),
            target=None if target is None else _wire_int(target, "target"),
            left=left,
            model=model,
        )


def _wire_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_STEP:
        raise RemoteProtocolError(f"progress {name} must be an int in [0, 2**62]")
    return value


def _wire_float(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RemoteProtocolError(f"progress {name} must be a number")
    if not math.isfinite(value) or value < 0:
        raise RemoteProtocolError(f"progress {name} must be finite and >= 0")
    return float(value)


@dataclass(frozen=True)
class SwarmProgress:
    """The swarm's progress as one peer sees it.

    Attributes:
        global_step: The highest step of any live peer (0 when none is known).
        samples_at_step: Samples the peers at ``global_step`` accumulated.
        peers_at_step: Live peers at ``global_step``.
        peers_online: Live peers, whatever their step.
        samples_per_s: The sum of the live peers' throughputs.
        all_blocked: Every live peer is at ``global_step`` and blocked.
        target_batch_size: The samples a step needs, or ``None`` when a step
            waits for every live peer to block.
        eta_s: Estimated seconds until the step is ready (0 when it is,
            ``inf`` when nothing progresses).
        time: When the view was computed.
        records: The live records it was computed from, highest step first.
    """

    global_step: int
    samples_at_step: int
    peers_at_step: int
    peers_online: int
    samples_per_s: float
    all_blocked: bool
    target_batch_size: int | None
    eta_s: float
    time: float
    records: tuple[PeerProgress, ...]

    @property
    def ready(self) -> bool:
        """Whether the swarm should step now: the target is reached, every
        live peer is blocked, or a peer at the global step closed it."""
        target = self.target_batch_size
        reached = target is not None and self.samples_at_step >= target
        return self.peers_online > 0 and (reached or self.all_blocked or self.closed)

    @property
    def closed(self) -> bool:
        """Whether a peer at the global step closed it (the step cut reached the target)."""
        return any(r.closed for r in self.records if r.step == self.global_step)

    def estimate_samples(
        self,
        step: int,
        *,
        exclude: PeerID | None,
        now: float,
        stepped_at: float | None = None,
        partial: bool = False,
        carry_batches: int = 0,
        closed_at: float | None = None,
    ) -> int:
        """Samples the live peers at ``step`` (but ``exclude``) hold now, as estimated.

        Each record's samples, plus what its peer computed since it wrote the
        record at its reported rate (a record is written at the end of a
        batch): the whole batches it finished, or with ``partial`` its
        progress into the batch it is computing too (the swarm's *work*, the
        unbiased measure the ``wait`` cut compares with the target; see
        :mod:`p2ptrain.train.cut`). A closed or blocked peer adds nothing
        more. A peer at ``step`` that did not say its batch size or rate yet
        (before its first batch) counts as computing one batch at the
        peers' typical rate and batch (:meth:`typical`) from its record's
        time, at most that one batch: its first record with a rate comes
        only after that batch, and counting such peers as idle made the
        others add a batch each to the first step of a run (8 peers, target
        256: 288-336 samples). A peer still loading its model is thus
        counted early by at most one batch.

        A record one step behind (``step - 1``) counts what its peer added
        toward ``step`` since it most likely began it:

        * a record that closed the step: at most ``carry_batches`` batches
          computed from its time while its step averaged (0 under ``wait``:
          a closed peer waits), then everything from ``stepped_at`` (the
          moment the reader itself began ``step``, in the same group);
        * any other record older than ``stepped_at``: from ``stepped_at``
          (its peer was in the same step and most likely stepped in the same
          group, its new record not read yet); under ``carry`` also what it
          most likely carried: at most ``carry_batches`` batches from when
          it most likely closed (``closed_at``, when the reader closed the
          step: peers close a step within about a batch of each other) until
          ``stepped_at``. Without this, a peer that read a record from
          before its partner's close counted none of the 2-3 batches the
          partner carried, and steps ended 1-2 batches over the target
          (``--wan``: 131-139 samples at target 128);
        * any other record written after ``stepped_at``: a lagging peer,
          nothing.

        Args:
            step: The step whose samples are estimated.
            exclude: A peer left out (the reader).
            now: The current time (Unix seconds).
            stepped_at: When the reader began ``step`` (Unix seconds), if it
                did so by a step of its own.
            partial: Count the batches in progress by the fraction done.
            carry_batches: Batches a peer that closed a step computes toward
                the next one before it applies the step (the ``carry`` policy).
            closed_at: When the reader closed ``step - 1`` (Unix seconds), if
                it did.
        """
        total = 0.0
        typical = self.typical()
        for r in self.records:
            if r.peer_id == exclude:
                continue
            if r.batch <= 0 or r.samples_per_s <= 0:
                if r.step == step:
                    total += r.samples
                    if typical is not None and not (r.closed or r.blocked):
                        total += _first_batch(r, typical, now - r.time, partial=partial)
                continue
            if r.step == step:
                total += r.samples
                if not (r.closed or r.blocked):
                    total += _computed(r, now - r.time, partial=partial)
            elif r.step != step - 1:
                continue
            elif r.closed:
                began = stepped_at if stepped_at is not None and stepped_at > r.time else None
                total += _carried(
                    r, r.time, now if began is None else began, carry_batches, partial=partial
                )
                if began is not None:
                    total += _computed(r, now - began, partial=partial)
            elif stepped_at is not None and r.time <= stepped_at:
                if closed_at is not None:
                    since = max(r.time, closed_at)
                    total += _carried(r, since, stepped_at, carry_batches, partial=partial)
                total += _computed(r, now - stepped_at, partial=partial)
            if total >= _MAX_SAMPLES:
                return _MAX_SAMPLES
        return min(math.floor(total), _MAX_SAMPLES)

    def typical(self) -> tuple[float, float] | None:
        """The mean samples/s and batch size of the live peers that stated both
        (``None`` if none did): how a peer that has not stated them yet is
        expected to compute."""
        stated = [r for r in self.records if r.batch > 0 and r.samples_per_s > 0]
        if not stated:
            return None
        count = len(stated)
        return (
            sum(r.samples_per_s for r in stated) / count,
            sum(r.batch for r in stated) / count,
        )

    def unstated_rate(self, step: int, *, exclude: PeerID | None = None) -> float:
        """The samples/s expected of the running peers at ``step`` that have not
        stated a rate yet (each at the typical rate; 0 if no peer stated one)."""
        typical = self.typical()
        if typical is None:
            return 0.0
        count = sum(
            1
            for r in self.records
            if r.step == step
            and r.peer_id != exclude
            and (r.batch <= 0 or r.samples_per_s <= 0)
            and not (r.closed or r.blocked)
        )
        return count * typical[0]

    def expected_in_group(self, step: int, *, exclude: PeerID | None = None) -> int:
        """Live peers expected to join the group of ``step``.

        Those at ``step`` and those one step behind, whose records may just
        not show their last step yet. Peers already past ``step`` finished it.
        """
        return sum(1 for r in self.records if step - 1 <= r.step <= step and r.peer_id != exclude)

    def lagging(self, step: int) -> int:
        """Live peers more than one step behind ``step`` (they will sync, or their
        record is stale, e.g. a peer that just downloaded the state)."""
        return sum(1 for r in self.records if r.step < step - 1)

    def sources(self, exclude: PeerID | None = None) -> list[PeerProgress]:
        """Peers that serve their state, highest step first (then most recent)."""
        return [r for r in self.records if r.address is not None and r.peer_id != exclude]


def _computed(record: PeerProgress, seconds: float, *, partial: bool) -> float:
    """Samples ``record``'s peer computed in ``seconds`` at its rate: whole batches, or
    with ``partial`` the fraction of the batch in progress too."""
    work = min(float(_MAX_SAMPLES), record.samples_per_s * max(0.0, seconds))
    if partial:
        return work
    return float(record.batch * math.floor(work / record.batch))


def _carried(
    record: PeerProgress, closed: float, until: float, carry_batches: int, *, partial: bool
) -> float:
    """What ``record``'s peer carried toward the next step from closing its step at
    ``closed`` until ``until``: at most ``carry_batches`` batches (none under ``wait``)."""
    computed = _computed(record, until - closed, partial=partial)
    return min(computed, float(carry_batches * record.batch))


def _first_batch(
    record: PeerProgress, typical: tuple[float, float], seconds: float, *, partial: bool
) -> float:
    """Samples of its first batch that ``record``'s peer (no rate stated) computed in
    ``seconds`` at the ``typical`` (rate, batch): the fraction done with ``partial``,
    else the whole batch once it is due; never more than one batch."""
    rate, batch = typical
    work = min(batch, rate * max(0.0, seconds))
    if partial:
        return work
    return batch if work >= batch else 0.0


def aggregate(
    records: Iterable[PeerProgress], *, target_batch_size: int | None, now: float
) -> SwarmProgress:
    """Combine the live records into the swarm's progress (see the module docstring).

    Args:
        records: One record per peer (a later duplicate of a PeerID replaces
            the earlier one); records of peers that left are ignored.
        target_batch_size: Samples a step needs; ``None`` when a step waits
            for every live peer to block.
        now: The current time (Unix seconds), for the extrapolation.
    """
    by_peer = {r.peer_id: r for r in records}
    live = (r for r in by_peer.values() if not r.left)
    ordered = tuple(sorted(live, key=lambda r: (-r.step, -r.time, r.peer_id)))
    if not ordered:
        return SwarmProgress(0, 0, 0, 0, 0.0, False, target_batch_size, math.inf, now, ())
    global_step = ordered[0].step
    current = [r for r in ordered if r.step == global_step]
    samples = min(_MAX_SAMPLES, sum(r.samples for r in current))
    all_blocked = len(current) == len(ordered) and all(r.blocked for r in current)
    progress = SwarmProgress(
        global_step=global_step,
        samples_at_step=samples,
        peers_at_step=len(current),
        peers_online=len(ordered),
        samples_per_s=sum(r.samples_per_s for r in ordered),
        all_blocked=all_blocked,
        target_batch_size=target_batch_size,
        eta_s=math.inf,
        time=now,
        records=ordered,
    )
    return _with_eta(progress, current, now)


def _with_eta(progress: SwarmProgress, current: list[PeerProgress], now: float) -> SwarmProgress:
    target = progress.target_batch_size
    if progress.ready:
        eta = 0.0
    elif target is None:
        eta = math.inf
    else:
        running = [r for r in current if not (r.blocked or r.closed)]
        expected = progress.samples_at_step + sum(
            r.samples_per_s * max(0.0, now - r.time) for r in running
        )
        rate = sum(r.samples_per_s for r in running)
        if expected >= target:
            eta = 0.0
        elif rate > 0:
            eta = (target - expected) / rate
        else:
            eta = math.inf
    return SwarmProgress(
        progress.global_step,
        progress.samples_at_step,
        progress.peers_at_step,
        progress.peers_online,
        progress.samples_per_s,
        progress.all_blocked,
        target,
        eta,
        progress.time,
        progress.records,
    )


def next_fetch_delay(progress: SwarmProgress, config: ProgressConfig, *, waiting: bool) -> float:
    """Seconds until the swarm's records should be read again.

    Often when a step is near (about four reads before the estimated time),
    when this peer waits, or when samples accumulate while a peer at the
    step has not said its rate yet (the first batches of a run: the
    estimated time counts only the rates known, and the step cut cannot
    extrapolate a peer before its first record with a rate), or while a peer
    is one step behind (after a step, until its new record is read); rarely
    when the step is far away.
    """
    if waiting or progress.ready:
        return config.min_fetch_interval
    if progress.samples_at_step > 0 and (
        not math.isfinite(progress.eta_s)
        or any(
            r.samples_per_s <= 0 and not r.blocked
            for r in progress.records
            if r.step == progress.global_step
        )
    ):
        return config.min_fetch_interval
    if any(r.step == progress.global_step - 1 for r in progress.records):
        # Peers one step behind most likely stepped in the same group: their new
        # records (and the samples they add toward this step) are not read yet.
        return config.min_fetch_interval
    delay = progress.eta_s / 4 if math.isfinite(progress.eta_s) else config.max_fetch_interval
    return min(config.max_fetch_interval, max(config.min_fetch_interval, delay))


class RateMeter:
    """Samples per second of local compute, as an exponential moving average.

    A measurement more than ``jump`` times above or below the average
    replaces it: the rate changed regime (the first batches of a run are
    slow while memory is allocated and other processes start; a competing
    process ends), and an average still weighted by the old regime would
    mislead every peer that extrapolates this one's samples from it.

    Args:
        smoothing: Weight of a new measurement, in (0, 1].
    """

    def __init__(self, smoothing: float = 0.2, *, jump: float = 2.0) -> None:
        if not 0 < smoothing <= 1:
            raise ConfigError(f"smoothing must be in (0, 1], got {smoothing!r}")
        if not 1 < jump < float("inf"):
            raise ConfigError(f"jump must be a finite number > 1, got {jump!r}")
        self.smoothing = smoothing
        self.jump = jump
        self.value = 0.0
        self._measured = False

    def update(self, samples: int, seconds: float) -> float:
        """Record ``samples`` computed in ``seconds``; returns the new average."""
        if samples < 0 or not seconds >= 0:
            raise ConfigError("samples and seconds must be >= 0")
        if seconds == 0 or samples == 0:
            return self.value
        rate = samples / seconds
        if not self._measured or not self.value / self.jump <= rate <= self.value * self.jump:
            self.value, self._measured = rate, True
        else:
            self.value += self.smoothing * (rate - self.value)
        return self.value
