"""One all-reduce member in its own process, for multi-process tests and timing.

Also home of :func:`check_chunks`, the per-chunk correctness check every
all-reduce test file uses.

Protocol (one JSON object a line):

1. the worker starts a node and prints ``{"address": "<peerid>@host:port"}``;
2. the parent writes one job: ``{"plan": <hex of the msgpack plan>,
   "seed": int, "weight": float, "codec": str, "rounds": int,
   "kill": null | {"at": "part_sent" | "result_sent", "chunk": int},
   "output": path | null}``;
3. the worker averages ``randn(numel)`` drawn from ``seed`` (``rounds``
   times, round ids derived from the plan's), writes the last result as raw
   float32 to ``output``, prints ``{"reports": [...], "cpu_s": [...]}`` (the
   CPU seconds of each call) and exits.

``kill`` makes the worker SIGKILL itself at a protocol event: after it sent
part ``chunk`` to every other reducer (``part_sent``: mid-reduce-scatter), or
right after it sent the average of ``chunk`` to some receiver
(``result_sent``: mid-all-gather). Environment: ``ALLREDUCE_WORKER_PROFILE``
names a file for cProfile stats in CPU seconds (``{pid}`` is replaced by the
process id); ``ALLREDUCE_WORKER_THREADS`` sets torch's
thread count (default 1: several workers share the machine).
"""

from __future__ import annotations

import asyncio
import cProfile
import dataclasses
import hashlib
import json
import os
import signal
import sys
import time
from typing import Any

import msgpack
import torch

from p2ptrain.aio import run
from p2ptrain.allreduce import AllReduceConfig, AllReduceService, GroupPlan, RoundObserver
from p2ptrain.node.node import Node


def input_vector(seed: int, numel: int) -> torch.Tensor:
    """The vector a worker with ``seed`` averages (the parent recomputes it)."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def round_plan(plan: GroupPlan, repetition: int) -> GroupPlan:
    """The plan of repetition ``repetition`` (a derived round id)."""
    if repetition == 0:
        return plan
    round_id = hashlib.sha256(plan.round_id + repetition.to_bytes(4, "big")).digest()[:16]
    return dataclasses.replace(plan, round_id=round_id)


def check_chunks(
    plan: GroupPlan,
    member: int,
    output: torch.Tensor,
    report: dict[str, Any],
    *,
    inputs: list[torch.Tensor],
    weights: list[float],
) -> None:
    """Every chunk: the weighted average of its reported contributors, else local values."""
    for shard in report["shards"]:
        chunks = plan.chunks(shard["owner"])
        assert len(chunks) == len(shard["chunk_contributors"])
        for (lo, hi), contributors in zip(chunks, shard["chunk_contributors"], strict=True):
            if contributors is None:
                expected = inputs[member][lo:hi].double()
            else:
                total = sum(weights[i] for i in contributors)
                expected = sum(weights[i] * inputs[i][lo:hi].double() for i in contributors) / total
            torch.testing.assert_close(output[lo:hi].double(), expected, rtol=1e-5, atol=1e-5)


class Killer(RoundObserver):
    """SIGKILLs this process at the configured protocol event."""

    def __init__(self, plan: GroupPlan, index: int, at: str, chunk: int) -> None:
        self.at = at
        self.chunk = chunk
        self.waiting = {j for j in plan.reducers() if j != index}

    def part_sent(self, reducer: int, chunk: int) -> None:
        if self.at == "part_sent" and chunk == self.chunk:
            self.waiting.discard(reducer)
            if not self.waiting:
                os.kill(os.getpid(), signal.SIGKILL)

    def result_sent(self, receiver: int, chunk: int) -> None:
        if self.at == "result_sent" and chunk == self.chunk:
            os.kill(os.getpid(), signal.SIGKILL)


async def serve() -> None:
    loop = asyncio.get_running_loop()
    async with Node() as node:
        service = AllReduceService(node)
        print(json.dumps({"address": str(node.address)}), flush=True)
        line = await loop.run_in_executor(None, sys.stdin.readline)
        job: dict[str, Any] = json.loads(line)
        plan = GroupPlan.from_wire(msgpack.unpackb(bytes.fromhex(job["plan"])))
        index = plan.index_of(node.peer_id)
        if index is None:
            raise SystemExit("not a member of the plan")
        vector = input_vector(job["seed"], plan.num_elements)
        config = AllReduceConfig(codec=job.get("codec", "none"))
        kill = job.get("kill")
        observer = Killer(plan, index, kill["at"], kill["chunk"]) if kill else None
        reports = []
        result = vector
        cpu = []
        for repetition in range(job.get("rounds", 1)):
            started = time.process_time()
            result, report = await service.allreduce(
                round_plan(plan, repetition),
                vector,
                job["weight"],
                config=config,
                observer=observer,
            )
            cpu.append(time.process_time() - started)
            reports.append(report.to_dict())
        if job.get("output"):
            result.numpy().tofile(job["output"])
        print(json.dumps({"reports": reports, "cpu_s": cpu}), flush=True)


def main() -> None:
    torch.set_num_threads(int(os.environ.get("ALLREDUCE_WORKER_THREADS", "1")))
    profile = os.environ.get("ALLREDUCE_WORKER_PROFILE")
    if profile:
        with cProfile.Profile(time.process_time) as profiler:  # CPU time, not waits
            run(serve())
        profiler.dump_stats(profile.format(pid=os.getpid()))
    else:
        run(serve())


if __name__ == "__main__":
    main()
