"""A user-space delay and loss shim for IPv4 packets, built on a tun device.

The kernel on the machines this project runs on has no ``netem``, so latency and
random loss cannot be configured with ``tc``. This module emulates them in user
space: the NAT lab routes chosen packets into a tun device (policy routing), this
process reads each packet, drops it with probability ``loss`` (seeded RNG, so a
run is reproducible), holds the rest for ``delay_ms`` and writes them back into
the same tun device, where the kernel routes them on normally.

Theory of operation:

* :class:`DelayLine` is the pure part: ``offer(packet, now)`` decides loss and
  queues the packet with its due time, ``pop_due(now)`` hands back what is due.
  The delay is constant, so the queue is FIFO and order is kept. The queue has a
  packet limit (a real router's buffer): past it, packets are tail-dropped.
* :func:`run_link` is the asyncio shell: a reader callback drains the
  non-blocking tun fd in batches, and one timer (re-armed for the head of the
  queue) writes due packets back. The loop uses ``select(2)``, whose timeout
  has microsecond precision: epoll and libuv (uvloop) work in milliseconds, which
  would release packets up to 1 ms late (or, with libuv, early).
* ``python -m p2ptrain.lab.lossy_link --tun NAME ...`` attaches to an
  existing tun device (or creates one), prints one JSON line ``{"ready": ...}``,
  runs until SIGTERM/SIGINT and prints one JSON line of counters on exit.

The process must run inside the network namespace that owns the tun device
(``ip netns exec``); see :mod:`p2ptrain.lab.natlab.lab`. The labs prefer
its compiled twin, ``natlab/tun_delay.c`` (:mod:`p2ptrain.lab.natlab.native_shim`):
same settings and output, a fraction of the CPU per packet.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import fcntl
import json
import os
import random
import selectors
import signal
import struct
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from p2ptrain.errors import ConfigError

__all__ = [
    "DelayLine",
    "LinkConfig",
    "LinkStats",
    "main",
    "open_tun",
    "run_link",
]

_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000
_MAX_PACKET = 65535
_READ_BATCH = 256
_IFNAMSIZ = 16


@dataclass(frozen=True)
class LinkConfig:
    """What the shim does to every packet it sees.

    Attributes:
        delay_ms: One-way delay added to every packet, in milliseconds (>= 0).
        loss: Probability in [0, 1) that a packet is dropped.
        seed: Seed of the loss RNG; the same seed and packet sequence drop the
            same packets.
        queue_limit: Packets held at most at once; more are tail-dropped. Must
            cover delay x packet rate (10 ms at 100 Mbit/s of 1500-byte packets
            is ~85 packets; the default allows about 1 Gbit/s at 100 ms).
    """

    delay_ms: float = 0.0
    loss: float = 0.0
    seed: int = 0
    queue_limit: int = 10_000

    def __post_init__(self) -> None:
        if not 0.0 <= self.delay_ms <= 60_000.0:
            raise ConfigError(f"delay_ms must be in [0, 60000], got {self.delay_ms!r}")
        if not 0.0 <= self.loss < 1.0:
            raise ConfigError(f"loss must be in [0, 1), got {self.loss!r}")
        if self.queue_limit < 1:
            raise ConfigError(f"queue_limit must be >= 1, got {self.queue_limit!r}")


@dataclass
class LinkStats:
    """Packet counters of one shim.

    Attributes:
        received: Packets read from the tun device.
        lost: Packets dropped by the random loss.
        overflowed: Packets dropped because the queue was full.
        delivered: Packets written back to the tun device.
        delivered_bytes: Their bytes.
        write_errors: Packets the kernel refused on write.
    """

    received: int = 0
    lost: int = 0
    overflowed: int = 0
    delivered: int = 0
    delivered_bytes: int = 0
    write_errors: int = 0


class DelayLine:
    """Pure delay-and-loss queue: no I/O, time is an argument.

    Args:
        config: Delay, loss, seed and queue limit.
    """

    def __init__(self, config: LinkConfig) -> None:
        self._delay = config.delay_ms / 1000.0
        self._loss = config.loss
        self._limit = config.queue_limit
        self._rng = random.Random(config.seed)
        self._queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.stats = LinkStats()

    def __len__(self) -> int:
        return len(self._queue)

    def offer(self, packet: bytes, now: float) -> bool:
        """Take one packet; return True when it was queued, False when dropped."""
        self.stats.received += 1
        if self._loss and self._rng.random() < self._loss:
            self.stats.lost += 1
            return False
        if len(self._queue) >= self._limit:
            self.stats.overflowed += 1
            return False
        self._queue.append((now + self._delay, packet))
        return True

    def next_due(self) -> float | None:
        """The time the head of the queue is due, or None when it is empty."""
        return self._queue[0][0] if self._queue else None

    def pop_due(self, now: float) -> list[bytes]:
        """Remove and return, in arrival order, every packet due at ``now``."""
        out: list[bytes] = []
        queue = self._queue
        while queue and queue[0][0] <= now:
            out.append(queue.popleft()[1])
        return out


def open_tun(name: str) -> int:
    """Open (creating if needed) the tun device ``name`` without packet info.

    Args:
        name: Interface name, at most 15 characters.

    Returns:
        A non-blocking file descriptor; closing it detaches from the device.

    Raises:
        ConfigError: The name is empty or too long.
        OSError: /dev/net/tun is missing or the ioctl failed (no CAP_NET_ADMIN).
    """
    if not name or len(name) >= _IFNAMSIZ:
        raise ConfigError(f"tun name must have 1..15 characters, got {name!r}")
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        ifr = struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI)
        fcntl.ioctl(fd, _TUNSETIFF, ifr)
    except BaseException:
        os.close(fd)
        raise
    return fd


async def run_link(fd: int, config: LinkConfig, stop: asyncio.Event) -> LinkStats:
    """Shuttle packets from the tun ``fd`` back into it until ``stop`` is set.

    Args:
        fd: Non-blocking tun file descriptor (see :func:`open_tun`).
        config: Delay and loss to apply.
        stop: Set it to end the loop; packets still queued are discarded.

    Returns:
        The counters at the time of stopping.
    """
    loop = asyncio.get_running_loop()
    line = DelayLine(config)
    stats = line.stats
    timer: asyncio.TimerHandle | None = None
    immediate = config.delay_ms == 0.0

    def write(packet: bytes) -> None:
        try:
            os.write(fd, packet)
        except OSError:
            stats.write_errors += 1
        else:
            stats.delivered += 1
            stats.delivered_bytes += len(packet)

    def flush() -> None:
        nonlocal timer
        timer = None
        for packet in line.pop_due(loop.time()):
            write(packet)
        arm()

    def arm() -> None:
        nonlocal timer
        due = line.next_due()
        if due is not None and timer is None:
            timer = loop.call_at(due, flush)

    def readable() -> None:
        for _ in range(_READ_BATCH):
            try:
                packet = os.read(fd, _MAX_PACKET)
            except BlockingIOError:
                break
            except OSError:
                stop.set()
                break
            now = loop.time()  # per packet: a stamp taken before the read could be early
            if line.offer(packet, now) and immediate:
                for ready in line.pop_due(now):
                    write(ready)
        if not immediate:
            arm()

    loop.add_reader(fd, readable)
    try:
        await stop.wait()
    finally:
        loop.remove_reader(fd)
        if timer is not None:
            timer.cancel()
    return stats


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m p2ptrain.lab.lossy_link",
        description="Delay and drop packets routed into a tun device.",
    )
    parser.add_argument("--tun", required=True, help="tun device name (created if missing)")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay")
    parser.add_argument("--loss", type=float, default=0.0, help="drop probability in [0, 1)")
    parser.add_argument("--seed", type=int, default=0, help="loss RNG seed")
    parser.add_argument("--queue-limit", type=int, default=10_000, help="packets held at most")
    parser.add_argument(
        "--nice",
        type=int,
        default=-10,
        help="niceness increment (default -10: a busy machine delays packets less)",
    )
    return parser.parse_args(argv)


async def _serve(fd: int, config: LinkConfig, tun: str) -> LinkStats:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print(json.dumps({"ready": tun, "pid": os.getpid()}), flush=True)
    return await run_link(fd, config, stop)


def _raise_priority(nice: int) -> None:
    """Apply ``nice`` so that it counts against other sessions' processes too.

    With autogroup scheduling (``kernel.sched_autogroup_enabled``) CPU is
    shared fairly between sessions and a process's nice value only weighs
    within its own session. So the shim leaves its parent's session and sets
    the niceness of its new, one-process autogroup as well.
    """
    with contextlib.suppress(OSError):  # not possible when already a group leader
        os.setsid()
    with contextlib.suppress(OSError):  # lowering niceness needs root
        os.nice(nice)
    with contextlib.suppress(OSError):  # no autogroup support, or not root
        Path("/proc/self/autogroup").write_text(f"{nice}\n")


def _precise_loop() -> asyncio.AbstractEventLoop:
    # select(2) takes a timeout in microseconds; epoll (asyncio's default) and
    # libuv (uvloop) round to milliseconds, which would add ~0.5 ms of delay
    # (or release packets early). The loop watches two fds, so select is cheap.
    return asyncio.SelectorEventLoop(selectors.SelectSelector())


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; see the module docstring."""
    args = _parse_args(argv)
    try:
        config = LinkConfig(
            delay_ms=args.delay_ms, loss=args.loss, seed=args.seed, queue_limit=args.queue_limit
        )
        fd = open_tun(args.tun)
    except (ConfigError, OSError) as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return 2
    if args.nice:
        _raise_priority(args.nice)
    try:
        with asyncio.Runner(loop_factory=_precise_loop) as runner:
            stats = runner.run(_serve(fd, config, args.tun))
    finally:
        os.close(fd)
    print(json.dumps({"stats": asdict(stats)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
