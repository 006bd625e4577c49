"""Faults with real processes: a member SIGKILLed mid-reduce-scatter or mid-all-gather.

Each member runs tests/allreduce_worker.py in its own process. The victim
kills itself at an exact protocol event, so the fault always lands in the
phase under test. The survivors must finish long before their deadlines
(death is seen as a dropped connection), and every chunk each survivor
holds must be the weighted average over the contributors its report names,
or its own local values where it reports that no average arrived.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from allreduce_worker import check_chunks, input_vector

from p2ptrain.allreduce import GroupMember, GroupPlan
from p2ptrain.node.address import PeerAddress

WORKER = Path(__file__).parents[1] / "allreduce_worker.py"
START_TIMEOUT = 60.0  # importing torch in 4 processes on 2 busy cores
ROUND_TIMEOUT = 30.0
REDUCE_TIMEOUT = 20.0


class Swarm:
    """Worker processes; every one still running is killed on exit."""

    def __init__(self) -> None:
        self.processes: list[asyncio.subprocess.Process] = []
        self.addresses: list[PeerAddress] = []

    async def start(self, count: int) -> None:
        for _ in range(count):
            self.processes.append(
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    str(WORKER),
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                )
            )
        async with asyncio.timeout(START_TIMEOUT):
            for process in self.processes:
                assert process.stdout is not None
                line = await process.stdout.readline()
                self.addresses.append(PeerAddress.parse(json.loads(line)["address"]))

    def plan(self, num_elements: int, chunk_elements: int) -> GroupPlan:
        members = [GroupMember(a.peer_id, a) for a in self.addresses if a.peer_id is not None]
        return GroupPlan.from_shares(
            members,
            [1 / len(members)] * len(members),
            num_elements,
            chunk_elements=chunk_elements,
            reduce_timeout=REDUCE_TIMEOUT,
            round_timeout=ROUND_TIMEOUT,
        )

    async def run(self, plan: GroupPlan, jobs: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
        """Send each worker its job; return each one's reports (None if it died)."""
        wire = msgpack.packb(plan.to_wire(), use_bin_type=True).hex()
        for process, job in zip(self.processes, jobs, strict=True):
            assert process.stdin is not None
            process.stdin.write((json.dumps({"plan": wire, **job}) + "\n").encode())
            await process.stdin.drain()
        results: list[dict[str, Any] | None] = []
        async with asyncio.timeout(ROUND_TIMEOUT + 15):
            for process in self.processes:
                assert process.stdout is not None
                line = await process.stdout.readline()
                await process.wait()
                results.append(json.loads(line) if line else None)
        return results

    async def aclose(self) -> None:
        for process in self.processes:
            if process.returncode is None:
                process.kill()
            await process.wait()


@pytest.fixture
async def swarm() -> AsyncIterator[Swarm]:
    swarm = Swarm()
    try:
        yield swarm
    finally:
        await swarm.aclose()


async def run_with_victim(
    swarm: Swarm, tmp_path: Path, kill: dict[str, Any]
) -> dict[int, dict[str, Any]]:
    """Run 4 members, member 1 the victim; check the survivors; return their reports."""
    count, victim = 4, 1
    await swarm.start(count)
    plan = swarm.plan(num_elements=1_000_003, chunk_elements=16_384)  # 16 chunks a shard
    weights = [1.0, 2.0, 3.0, 4.0]
    jobs = [
        {
            "seed": i,
            "weight": weights[i],
            "kill": kill if i == victim else None,
            "output": str(tmp_path / f"out{i}.f32"),
        }
        for i in range(count)
    ]
    results = await swarm.run(plan, jobs)
    assert swarm.processes[victim].returncode == -signal.SIGKILL
    assert results[victim] is None
    inputs = [input_vector(i, plan.num_elements) for i in range(count)]
    reports: dict[int, dict[str, Any]] = {}
    for i, result in enumerate(results):
        if i == victim:
            continue
        assert swarm.processes[i].returncode == 0 and result is not None
        reports[i] = result["reports"][0]
        output = torch.from_numpy(np.fromfile(tmp_path / f"out{i}.f32", dtype=np.float32))
        check_chunks(plan, i, output, reports[i], inputs=inputs, weights=weights)
        # Death is a dropped connection: nobody waits for a deadline.
        assert reports[i]["total_s"] < REDUCE_TIMEOUT / 2, reports[i]
    # (A survivor may see no failure at all: the victim may have finished
    # everything it owed that survivor before dying.)
    assert any(str(victim) in report["failed"] for report in reports.values())
    # Survivors that received the same average agree on who is in it.
    for owner in range(count):
        seen: dict[int, list[int]] = {}
        for report in reports.values():
            for k, contributors in enumerate(report["shards"][owner]["chunk_contributors"]):
                if contributors is not None:
                    assert seen.setdefault(k, contributors) == contributors
    # The survivors' own parts are averaged everywhere among the survivors.
    for report in reports.values():
        for owner in reports:
            assert all(c is not None for c in report["shards"][owner]["chunk_contributors"])
    return reports


async def test_member_killed_mid_reduce_scatter(swarm: Swarm, tmp_path: Path) -> None:
    victim = 1
    # The victim dies right after sending part 2 to the last of the other reducers.
    reports = await run_with_victim(swarm, tmp_path, {"at": "part_sent", "chunk": 2})
    # So at least one survivor's part lacks the victim from chunk 3 on ...
    missing = [
        owner
        for owner, report in reports.items()
        if any(victim not in c for c in report["shards"][owner]["chunk_contributors"][3:])
    ]
    assert missing
    # ... and its reducer says why.
    for owner in missing:
        assert str(victim) in reports[owner]["shards"][owner]["excluded"]
    # Parts arrive in order, and once left out a sender stays out: the victim
    # is in a prefix of each part's chunks. (How long a prefix depends on
    # what was still in its buffers when it died.)
    for owner, report in reports.items():
        present = [victim in c for c in report["shards"][owner]["chunk_contributors"]]
        assert present == sorted(present, reverse=True)


async def test_member_killed_mid_all_gather(swarm: Swarm, tmp_path: Path) -> None:
    victim = 1
    # The victim dies right after sending its average of chunk 5 to one receiver.
    reports = await run_with_victim(swarm, tmp_path, {"at": "result_sent", "chunk": 5})
    victim_shards = [report["shards"][victim] for report in reports.values()]
    assert all(shard["error"] for shard in victim_shards if None in shard["chunk_contributors"])
    # The receiver of that last average never got chunk 6 on: it keeps its own
    # values there. Averages arrive in chunk order, so what arrived is a prefix.
    assert any(shard["chunk_contributors"][-1] is None for shard in victim_shards)
    for shard in victim_shards:
        arrived = [c is not None for c in shard["chunk_contributors"]]
        assert arrived == sorted(arrived, reverse=True)
