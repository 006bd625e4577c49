"""A hivemind peer of the all-reduce benchmark (run by hivemind's own interpreter).

Usage (by ``bench_allreduce.py``)::

    python -m benchmarks.allreduce.hivemind --host 127.0.0.1 \
        [--initial-peer MULTIADDR ...]

One ``hivemind.DHT`` (with its p2p daemon) per peer, and one
``DecentralizedAverager`` per vector size, created on the first ``prepare``
of that size. It speaks the line protocol of ``allreduce/proto.py``:

* ``prepare`` writes the peer's input into the averaged tensor and calls
  ``averager.step(wait=False, require_trigger=True)``; it answers once
  matchmaking has formed the group (stage ``AWAITING_TRIGGER``), so that
  matchmaking stays out of the timing. If no group forms within
  ``--matchmaking-timeout`` (it happens now and then: three peers await
  their trigger while the fourth keeps looking), it cancels its step and
  answers ``{"prepared": false}``; the parent then sends ``cancel`` to
  everybody and tries again;
* ``go`` calls ``allow_allreduce()`` and waits for the step's result: the
  all-reduce proper. A member that is triggered before the others simply has
  its parts wait at their handlers until they are.

CPU is counted over this process and all its descendants (the averager's and
the DHT's processes and the p2p daemon, which carries every byte), read from
``/proc`` around the round.

Nothing of p2ptrain is imported here: this runs in hivemind's virtual
environment, which only shares torch with the system.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from benchmarks.allreduce.proto import (
    TOLERANCE,
    RoundOutcome,
    input_vector,
    max_error,
    now,
    peer_parser,
    read_command,
    tree_cpu_seconds,
    write_message,
)

POLL_S = 0.005
"""How often ``prepare`` looks whether matchmaking has formed the group."""


class _Peer:
    """The DHT, the averager of the current size and the step being prepared."""

    def __init__(self, args: Any) -> None:
        import hivemind

        self.args = args
        self.dht = hivemind.DHT(
            start=True,
            host_maddrs=[f"/ip4/{args.host}/tcp/0"],
            initial_peers=args.initial_peer or None,
        )
        self.averager: Any = None
        self.key: tuple[int, int] | None = None
        self.tensor = torch.empty(0)
        self.vector = torch.empty(0)
        self.control: Any = None
        self.rank = self.peers = 0

    def hello(self) -> list[str]:
        return [str(address) for address in self.dht.get_visible_maddrs()]

    def prepare(self, rank: int, peers: int, numel: int) -> str | None:
        """Start a step and wait until matchmaking has formed its group.

        Returns:
            None when the step awaits its trigger, else why it does not (the
            step is then cancelled; the parent cancels the others' and retries).
        """
        from hivemind.averaging import DecentralizedAverager
        from hivemind.averaging.control import AveragingStage

        if self.key != (numel, peers):
            self._drop_averager()
            self.vector = torch.empty(0)
            self.vector = input_vector(rank, numel)
            self.tensor = torch.zeros(numel)
            self.averager = DecentralizedAverager(
                [self.tensor],
                self.dht,
                start=True,
                prefix=f"bench_allreduce_{numel}",
                target_group_size=peers,
                min_group_size=peers,
                min_matchmaking_time=self.args.matchmaking_time,
                request_timeout=self.args.matchmaking_time / 2,
                allreduce_timeout=self.args.timeout,
            )
            self.key = (numel, peers)
        self.rank, self.peers = rank, peers
        with self.averager.get_tensors() as tensors:
            tensors[0].copy_(self.vector)
        self.control = self.averager.step(
            wait=False, require_trigger=True, timeout=self.args.matchmaking_timeout
        )
        waiting = (AveragingStage.IDLE, AveragingStage.LOOKING_FOR_GROUP)
        deadline = time.monotonic() + self.args.matchmaking_timeout
        while self.control.stage in waiting and not self.control.done():
            if time.monotonic() > deadline:
                self.cancel()
                return "matchmaking formed no group in time"
            time.sleep(POLL_S)
        if self.control.done():  # failed before the trigger
            error = self.control.exception()
            self.control = None
            return f"the step ended before its trigger: {error!r}"
        return None

    def cancel(self) -> None:
        """Cancel the step being prepared, if any, and wait until it has ended."""
        control, self.control = self.control, None
        if control is None or control.done():
            return
        control.cancel()
        deadline = time.monotonic() + self.args.matchmaking_timeout
        while not control.done() and time.monotonic() < deadline:
            time.sleep(POLL_S)

    def go(self) -> RoundOutcome:
        if self.control is None:
            raise RuntimeError("go before prepare")
        cpu = tree_cpu_seconds()
        start = now()
        self.control.allow_allreduce()
        gathered = self.control.result(timeout=self.args.timeout)
        end = now()
        cpu = tree_cpu_seconds() - cpu
        self.control = None
        with self.averager.get_tensors() as tensors:
            error = max_error(tensors[0], self.vector, self.rank, self.peers)
        group = len(gathered) if gathered is not None else 0
        ok = error <= TOLERANCE and group == self.peers
        return RoundOutcome(start, end, cpu, error, ok, {"group_size": group})

    def _drop_averager(self) -> None:
        if self.averager is not None:
            self.averager.shutdown()
            self.averager = None

    def close(self) -> None:
        self._drop_averager()
        self.dht.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    """Run one hivemind peer until the parent says quit (or closes stdin)."""
    parser = peer_parser(__doc__.splitlines()[0])
    parser.add_argument("--initial-peer", action="append", help="multiaddr of a DHT peer")
    parser.add_argument(
        "--matchmaking-time", type=float, default=2.0, help="hivemind min_matchmaking_time"
    )
    parser.add_argument(
        "--matchmaking-timeout", type=float, default=60.0, help="seconds to form a group"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    peer = _Peer(args)
    try:
        write_message({"hello": peer.hello(), "pid": os.getpid()})
        while True:
            command = read_command()
            if command["cmd"] == "quit":
                return 0
            if command["cmd"] == "prepare":
                failure = peer.prepare(command["rank"], command["peers"], command["numel"])
                write_message({"prepared": failure is None, "error": failure})
            elif command["cmd"] == "cancel":
                peer.cancel()
                write_message({"cancelled": True})
            else:
                write_message(peer.go().to_dict())
    finally:
        peer.close()


if __name__ == "__main__":
    sys.exit(main())
