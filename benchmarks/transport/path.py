"""What a path of ``bench_transport`` is: the bulk workload, the client interface, a row.

A path is a server role (run in a child process of its own) and a client
that talks to it from the benchmark's process; :data:`benchmarks.bench_transport.PATHS`
lists them. Units: 1 MB = 1 MiB = 2**20 bytes.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import torch

MiB = 1 << 20
GiB = 1 << 30
RUN_TIMEOUT = 300.0
"""Seconds one bulk run or one round-trip series may take before the benchmark gives up."""

POOL_SIZE = 4
"""Distinct chunks the sender cycles through (so the checksum also catches reordering)."""
CHECKSUM_SAMPLES = 8
"""Elements of each chunk that enter the checksum (kept small: it runs inside the timing)."""
MAX_CHUNK_BYTES = 16 * MiB

# -- workload ------------------------------------------------------------------------------


def chunk_checksum(index: int, tensor: torch.Tensor) -> float:
    """A cheap order-sensitive checksum term: a few sampled elements, weighted by position."""
    step = max(1, tensor.numel() // CHECKSUM_SAMPLES)
    return (index + 1) * float(tensor[::step].sum(dtype=torch.float64))


@dataclass(frozen=True)
class Workload:
    """The bytes of one bulk run: ``total_bytes`` as float32 chunks of ``chunk_bytes``."""

    total_bytes: int
    chunk_bytes: int
    pool: tuple[torch.Tensor, ...]

    @classmethod
    def make(cls, total_bytes: int, chunk_bytes: int) -> Workload:
        """Random chunks from a fixed seed, reused cyclically."""
        if chunk_bytes <= 0 or chunk_bytes % 4:
            raise ValueError("chunk_bytes must be a positive multiple of 4")
        if total_bytes <= 0 or total_bytes % 4:
            raise ValueError("total_bytes must be a positive multiple of 4")
        gen = torch.Generator().manual_seed(20240601)
        size = min(chunk_bytes, total_bytes) // 4
        pool = tuple(torch.randn(size, generator=gen) for _ in range(POOL_SIZE))
        return cls(total_bytes, chunk_bytes, pool)

    @property
    def chunks(self) -> int:
        """Number of chunks (the last one may be shorter)."""
        return -(-self.total_bytes // self.chunk_bytes)

    def chunk(self, index: int) -> torch.Tensor:
        """The tensor sent as chunk ``index``."""
        tensor = self.pool[index % len(self.pool)]
        tail = self.total_bytes - index * self.chunk_bytes
        return tensor if tail >= self.chunk_bytes else tensor[: tail // 4]

    def checksum(self) -> float:
        """The checksum the receiver must report."""
        return sum(chunk_checksum(i, self.chunk(i)) for i in range(self.chunks))


@dataclass(frozen=True)
class BulkRun:
    """One timed bulk transfer."""

    seconds: float
    nbytes: int
    sender_cpu: float
    receiver_cpu: float

    @property
    def mib_per_s(self) -> float:
        """Throughput in MiB/s."""
        return self.nbytes / MiB / self.seconds

    def cpu_per_gib(self, cpu: float) -> float:
        """``cpu`` seconds scaled to one GiB of payload."""
        return cpu / (self.nbytes / GiB)


class BenchmarkError(RuntimeError):
    """The receiver reported something other than what was sent."""


# -- the path interface --------------------------------------------------------------------


class PathClient(abc.ABC):
    """The sending/calling side of one path, run in the benchmark's main process."""

    @abc.abstractmethod
    async def connect(self, address: str) -> None:
        """Connect to the server that announced ``address`` (not timed)."""

    @abc.abstractmethod
    async def bulk(self, work: Workload) -> BulkRun:
        """Send ``work`` once, timed from the first send to the receiver's acknowledgement."""

    @abc.abstractmethod
    async def round_trips(self, calls: int) -> list[float]:
        """``calls`` sequential tiny request/response exchanges; each duration in µs."""

    @abc.abstractmethod
    async def server_cpu(self) -> float:
        """CPU seconds the server process has used so far (asked over the path itself)."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Close every connection."""


ServeFn = Callable[[Callable[[str], None]], Coroutine[Any, Any, None]]
"""A server role: start serving, call ``ready(address)``, return once told to stop."""


@dataclass(frozen=True)
class BenchPath:
    """One row of the results: a server role plus the client that talks to it."""

    key: str
    label: str
    serve: ServeFn
    client: Callable[[], PathClient]
