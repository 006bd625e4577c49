"""Measured throughput: what a peer's links achieved in real transfers.

The load balancer needs each peer's upload and download rate. Rather than
asking users to type them in, each peer records the bytes it moved and the
time that took in every round, and keeps an exponential moving average:
``rate ← rate + smoothing·(sample − rate)`` (the first sample is taken as is).
Explicit values, when configured, override the measurements.

The meter is measured at the sender for uploads, where socket buffers inflate
what it sees; :class:`~p2ptrain.measure.estimates.LinkEstimator` is what a
peer announces (every transfer timed where it arrives). The all-reduce adds
``record_round`` and ``capacity`` in :mod:`p2ptrain.allreduce.bandwidth`.

What is measured is the rate *achieved in the round*, which is also limited
by the other peers' links: it is a lower bound on the capacity, and it grows
as faster peers join. Transfers too small to measure a rate (below
``min_bytes`` or ``min_seconds``) are ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from p2ptrain.errors import ConfigError

__all__ = ["MovingAverage", "ThroughputConfig", "ThroughputMeter"]


@dataclass(frozen=True, slots=True)
class ThroughputConfig:
    """How throughput is measured.

    Attributes:
        smoothing: Weight of a new sample in the moving average, in (0, 1].
        min_bytes: Transfers smaller than this are not measured.
        min_seconds: Transfers shorter than this are not measured.
        upload_bytes_per_s: An explicit upload rate; overrides measurements.
        download_bytes_per_s: An explicit download rate; overrides measurements.
    """

    smoothing: float = 0.3
    min_bytes: int = 1 << 20
    min_seconds: float = 1e-3
    upload_bytes_per_s: float | None = None
    download_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.smoothing <= 1:
            raise ConfigError(f"smoothing must be in (0, 1], got {self.smoothing!r}")
        if self.min_bytes < 0 or not self.min_seconds >= 0:
            raise ConfigError("min_bytes and min_seconds must be >= 0")
        for name in ("upload_bytes_per_s", "download_bytes_per_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be None or positive and finite, got {value!r}")


class MovingAverage:
    """An exponentially weighted moving average; the first sample is taken as it is.

    Attributes:
        value: The average (``None`` before the first sample).
        samples: Samples seen.
    """

    def __init__(self) -> None:
        self.value: float | None = None
        self.samples = 0

    def update(self, sample: float, smoothing: float) -> None:
        """Move the average ``smoothing`` of the way towards ``sample``."""
        if self.value is None:
            self.value = sample
        else:
            self.value += smoothing * (sample - self.value)
        self.samples += 1


class ThroughputMeter:
    """Moving averages of a peer's achieved upload and download rates.

    Args:
        config: Smoothing, thresholds and explicit overrides.
    """

    def __init__(self, config: ThroughputConfig | None = None) -> None:
        self.config = config or ThroughputConfig()
        self._upload = MovingAverage()
        self._download = MovingAverage()

    def record_upload(self, nbytes: int, seconds: float) -> None:
        """Record that ``nbytes`` were sent in ``seconds``."""
        self._record(self._upload, nbytes, seconds)

    def record_download(self, nbytes: int, seconds: float) -> None:
        """Record that ``nbytes`` were received in ``seconds``."""
        self._record(self._download, nbytes, seconds)

    @property
    def upload_bytes_per_s(self) -> float | None:
        """The upload rate: explicit if configured, else measured (None before any sample)."""
        explicit = self.config.upload_bytes_per_s
        return explicit if explicit is not None else self._upload.value

    @property
    def download_bytes_per_s(self) -> float | None:
        """The download rate: explicit if configured, else measured (None before any sample)."""
        explicit = self.config.download_bytes_per_s
        return explicit if explicit is not None else self._download.value

    @property
    def samples(self) -> tuple[int, int]:
        """How many upload and download samples were averaged."""
        return self._upload.samples, self._download.samples

    def _record(self, average: MovingAverage, nbytes: int, seconds: float) -> None:
        if nbytes < 0 or not seconds >= 0:
            raise ConfigError("bytes and seconds must be >= 0")
        if nbytes < self.config.min_bytes or seconds < self.config.min_seconds or seconds == 0:
            return
        average.update(nbytes / seconds, self.config.smoothing)
