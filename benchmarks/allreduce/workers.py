"""Peer processes of the all-reduce benchmark: p2ptrain and torch.distributed (gloo).

Run by ``bench_allreduce.py``, one process per peer, speaking the line
protocol of ``allreduce/proto.py``::

    python -m benchmarks.allreduce.workers p2ptrain --host 127.0.0.1
    python -m benchmarks.allreduce.workers gloo --host 127.0.0.1 --master 127.0.0.1:PORT \
        --rank R --world N --ifname lo

p2ptrain: a :class:`~p2ptrain.node.node.Node` with its all-reduce service on
an event loop (uvloop when installed); ``prepare`` carries the group plan
(hex of its msgpack wire form) and ``go`` runs ``service.allreduce`` on the
peer's vector with weight 1, codec ``none``. The check of the result runs
in a thread, off the event loop, so that the averages this peer still has
queued for the others keep flowing (a peer's call returns once its own
averages are in, not once it has delivered everyone else's). The output
vector is dropped after the check, so that it returns to the buffer pool as
in training; the reply counts the pool's fresh allocations and the page
faults of the round, which show buffers that were not recycled.
``--pool-mib`` sets how much that pool keeps (``default_pool.max_idle_bytes``),
``--profile`` runs the peer under cProfile with a CPU clock. Every round is
recorded in the peer's :class:`~p2ptrain.measure.estimates.LinkEstimator`
(as a swarm peer's service does); ``estimates`` replies with what it would
announce, ``probe`` runs the start-up probe against a peer into it, ``rtt``
pings peers, ``forget`` starts a fresh estimator, ``cap`` one with typed-in rates.

gloo: ``init_process_group("gloo")`` through a TCP store at ``--master``
(rank 0 hosts it); ``go`` runs ``all_reduce(SUM)`` on a fresh copy of the
input (made while preparing) and divides by the world size: the average.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import resource
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
    process_cpu_seconds,
    read_command,
    write_message,
)
from p2ptrain.allreduce.butterfly import RoundObserver


class _Inputs:
    """This peer's input vector, rebuilt only when the size or rank changes."""

    def __init__(self) -> None:
        self.key: tuple[int, int] | None = None
        self.vector = torch.empty(0)

    def get(self, rank: int, numel: int) -> torch.Tensor:
        if self.key != (rank, numel):
            self.vector = torch.empty(0)  # free the old one first
            self.vector = input_vector(rank, numel)
            self.key = (rank, numel)
        return self.vector


# -- p2ptrain ---------------------------------------------------------------------------------

TRACE = bool(os.environ.get("P2PTRAIN_BENCH_TRACE"))
"""Diagnostics: each round's reply carries, per partner and event kind, when it first
and last happened and how often (seconds from the round's start)."""
PACING_HEADROOM = 1.25
"""The headroom of ``--pacing`` (docs/allreduce.md, "Kernel pacing")."""


class _Trace(RoundObserver):
    """A round observer that keeps the first and last time of each (event, partner)."""

    def __init__(self) -> None:
        self._clock = time.perf_counter
        self._start = self._clock()
        self.events: dict[str, list[float]] = {}

    def _note(self, kind: str, partner: int) -> None:
        t = self._clock() - self._start
        key = f"{kind}:{partner}"
        seen = self.events.get(key)
        if seen is None:
            self.events[key] = [t, t, 1]
        else:
            seen[1] = t
            seen[2] += 1

    def part_sent(self, reducer: int, chunk: int) -> None:
        self._note("part_sent", reducer)

    def part_received(self, sender: int, chunk: int) -> None:
        self._note("part_received", sender)

    def result_sent(self, receiver: int, chunk: int) -> None:
        self._note("result_sent", receiver)

    def result_received(self, reducer: int, chunk: int) -> None:
        self._note("result_received", reducer)

    def summary(self) -> dict[str, list[float]]:
        return {k: [round(v[0], 3), round(v[1], 3), int(v[2])] for k, v in self.events.items()}


async def _serve_p2ptrain(
    host: str,
    round_timeout: float,
    pool_bytes: int | None,
    plaintext: bool = False,
    crypto_offload: bool = True,
    *,
    pacing: bool = False,
) -> None:
    import msgpack

    from p2ptrain.allreduce import AllReduceConfig, AllReduceService, GroupPlan
    from p2ptrain.measure import EstimatorConfig, LinkEstimator
    from p2ptrain.measure.latency import measure_rtts
    from p2ptrain.measure.probe import probe_peers
    from p2ptrain.node.address import PeerAddress
    from p2ptrain.node.config import NodeConfig
    from p2ptrain.node.node import Node
    from p2ptrain.rpc.config import ConnectionConfig
    from p2ptrain.wire.buffers import default_pool

    if pool_bytes is not None:
        default_pool.max_idle_bytes = pool_bytes

    loop = asyncio.get_running_loop()
    inputs = _Inputs()
    # codec none, plain mean; kernel pacing of the round's streams if asked for
    config = AllReduceConfig(pacing_headroom=PACING_HEADROOM) if pacing else AllReduceConfig()
    node_config = NodeConfig(host=host, insecure_plaintext=plaintext)
    if not crypto_offload:
        node_config = NodeConfig(
            host=host,
            insecure_plaintext=plaintext,
            connection=ConnectionConfig(crypto_offload_bytes=None),
        )
    async with Node(config=node_config) as node:
        service = AllReduceService(node, join_timeout=round_timeout, links=LinkEstimator())
        write_message({"hello": str(node.address), "pid": os.getpid()})
        plan: GroupPlan | None = None
        rank = peers = 0
        # stdin read by the event loop itself: ``go`` starts the round at once
        # (a reader thread would add a thread hop and a loop wake-up per command).
        stdin = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
        while True:
            line = await stdin.readline()
            command = json.loads(line) if line else {"cmd": "quit"}
            if command["cmd"] == "quit":
                return
            if command["cmd"] == "forget":
                service.links = LinkEstimator()
                write_message({"forgot": True})
                continue
            if command["cmd"] == "cap":  # typed-in rates: a fresh estimator capped at them
                service.links = LinkEstimator(
                    EstimatorConfig(
                        upload_cap_bytes_per_s=command["upload"],
                        download_cap_bytes_per_s=command["download"],
                    )
                )
                write_message({"capped": True})
                continue
            if command["cmd"] == "estimates":
                links = service.links
                assert links is not None
                write_message(
                    {
                        "upload": links.upload_bytes_per_s,
                        "download": links.download_bytes_per_s,
                        "needs_probe": links.needs_probe,
                    }
                )
                continue
            if command["cmd"] == "probe":
                links = service.links
                assert links is not None
                targets = [PeerAddress.parse(a) for a in command["targets"]]
                results = await probe_peers(node, targets, seconds=command["seconds"])
                links.observe_probe([r.upload for r in results], [r.download for r in results])
                write_message({"probed": len(results)})
                continue
            if command["cmd"] == "rtt":
                targets = [PeerAddress.parse(a) for a in command["targets"]]
                rtts = await measure_rtts(node, targets, pings=5)
                write_message({"rtt": max(rtts.values(), default=0.0), "peers": len(rtts)})
                continue
            if command["cmd"] == "prepare":
                plan = GroupPlan.from_wire(msgpack.unpackb(bytes.fromhex(command["plan"])))
                rank, peers = command["rank"], command["peers"]
                if plan.index_of(node.peer_id) != rank:
                    raise SystemExit("the plan does not list this peer at its rank")
                inputs.get(rank, plan.num_elements)
                write_message({"prepared": True})
                continue
            if plan is None:
                raise SystemExit("go before prepare")
            vector = inputs.get(rank, plan.num_elements)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            allocated = default_pool.allocated
            trace = _Trace() if TRACE else None
            start, cpu = now(), process_cpu_seconds()
            result, report = await service.allreduce(
                plan, vector, 1.0, config=config, observer=trace
            )
            end, cpu = now(), process_cpu_seconds() - cpu
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            # Off the event loop (torch releases the GIL): what this peer still
            # has to send to the others (queued averages) keeps flowing meanwhile.
            error = await loop.run_in_executor(None, max_error, result, vector, rank, peers)
            del result  # back to the buffer pool before the next round
            detail = {
                "total_s": report.total_s,
                "reduce_scatter_s": report.reduce_scatter_s,
                "all_gather_s": report.all_gather_s,
                "bytes_sent": report.bytes_sent,
                "bytes_received": report.bytes_received,
                "send_s": report.send_s,
                "receive_s": report.receive_s,
                "complete": report.complete,
                "failed": {str(k): v for k, v in report.failed.items()},
                "page_faults": faults,
                "pool_allocated": default_pool.allocated - allocated,
                # every connection of the round carries AES-GCM records (the default)
                "sealed": [c.transport.sealed for c in node.connections()],
            }
            if trace is not None:
                detail["trace"] = trace.summary()
            ok = error <= TOLERANCE and report.complete and not report.failed
            write_message(RoundOutcome(start, end, cpu, error, ok, detail).to_dict())
            plan = None


# -- gloo -------------------------------------------------------------------------------------


def _serve_gloo(master: str, rank: int, world: int, timeout: float) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{master}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout),
    )
    write_message({"hello": f"rank {rank}", "pid": os.getpid()})
    inputs = _Inputs()
    work = torch.empty(0)
    try:
        while True:
            command = read_command()
            if command["cmd"] == "quit":
                return
            if command["cmd"] == "prepare":
                vector = inputs.get(rank, command["numel"])
                if work.shape != vector.shape:
                    work = torch.empty_like(vector)
                work.copy_(vector)  # all_reduce works in place
                write_message({"prepared": True})
                continue
            start, cpu = now(), process_cpu_seconds()
            dist.all_reduce(work, op=dist.ReduceOp.SUM)
            work.div_(world)
            end, cpu = now(), process_cpu_seconds() - cpu
            error = max_error(work, inputs.vector, rank, world)
            write_message(RoundOutcome(start, end, cpu, error, error <= TOLERANCE).to_dict())
    finally:
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    """Run one peer until the parent says quit (or closes stdin)."""
    parser = peer_parser(__doc__.splitlines()[0])
    parser.add_argument("system", choices=["p2ptrain", "gloo"])
    parser.add_argument("--master", help="gloo: host:port of the TCP store (rank 0 hosts it)")
    parser.add_argument("--rank", type=int, default=0, help="gloo: this peer's rank")
    parser.add_argument("--world", type=int, default=1, help="gloo: number of peers")
    parser.add_argument("--ifname", help="gloo: network interface (GLOO_SOCKET_IFNAME)")
    parser.add_argument(
        "--profile", help="p2ptrain: write cProfile stats (CPU time) to this file ({pid} expands)"
    )
    parser.add_argument(
        "--pool-mib",
        type=int,
        help="p2ptrain: idle bytes its buffer pool keeps, MiB (default: the library's)",
    )
    parser.add_argument(
        "--insecure-plaintext",
        action="store_true",
        help="p2ptrain: frames unencrypted after the handshake (the trusted-cluster opt-out)",
    )
    parser.add_argument(
        "--no-crypto-offload",
        action="store_true",
        help="p2ptrain: every AES-GCM pass on the event loop (crypto_offload_bytes=None)",
    )
    parser.add_argument(
        "--pacing",
        action="store_true",
        help=f"p2ptrain: kernel pacing of a round's streams (pacing_headroom={PACING_HEADROOM})",
    )
    args: Any = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    pool_bytes = None if args.pool_mib is None else args.pool_mib * (1 << 20)
    if args.system == "p2ptrain":
        from p2ptrain.aio import run

        serve = _serve_p2ptrain(
            args.host,
            args.timeout,
            pool_bytes,
            args.insecure_plaintext,
            not args.no_crypto_offload,
            pacing=args.pacing,
        )
        if args.profile:
            import cProfile

            # Import what the peer uses first: module imports are start-up, not rounds.
            import msgpack  # noqa: F401

            import p2ptrain.allreduce
            import p2ptrain.node.node  # noqa: F401
            from p2ptrain.aio import has_uvloop

            has_uvloop()  # imports uvloop

            with cProfile.Profile(time.process_time) as profiler:  # CPU, not waiting
                run(serve)
            profiler.dump_stats(args.profile.format(pid=os.getpid()))
        else:
            run(serve)
    else:
        if args.master is None:
            parser.error("gloo needs --master")
        if args.ifname:
            os.environ["GLOO_SOCKET_IFNAME"] = args.ifname
        _serve_gloo(args.master, args.rank, args.world, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
