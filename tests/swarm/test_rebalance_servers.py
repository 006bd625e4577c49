"""The Rebalancer on real StageServers: it reads their announcements and moves one (move_to)."""

from __future__ import annotations

import asyncio
import random

import pytest
from swarm_peers import make_trainer, regression_batch, server_config, swarm

from p2ptrain.peer import Peer
from p2ptrain.swarm import PipelineTrainer, read_stage
from p2ptrain.swarm.rebalance import PeerLoad, RebalanceConfig, Rebalancer


class _AlwaysDraw(random.Random):
    def random(self) -> float:
        return 0.0


async def _loads(peer: Peer, stages: int) -> list[PeerLoad]:
    found = await asyncio.gather(*(read_stage(peer.dht, "pipe", s) for s in range(stages)))
    return [
        PeerLoad(str(a.peer_id), a.stage, a.samples_per_s, a.queue)
        for entries in found
        for a in entries
    ]


async def _burst(trainer: PipelineTrainer, first: int, count: int) -> None:
    await asyncio.gather(
        *(trainer.train_micro_batch(*regression_batch(first + k)) for k in range(count))
    )


@pytest.mark.slow
def test_three_to_one_becomes_two_to_two_through_the_servers_announcements() -> None:
    # every forward and backward takes at least 20 ms: the peers' measured speeds are alike
    config = server_config(min_compute_s=0.02, announce_interval=0.2)
    with swarm([0, 0, 0, 1], config=config) as (trainer_peer, _, servers):
        trainer = make_trainer(trainer_peer, avoid_s=0.2)
        rounds = 0
        while any(s.samples_per_s == 0 for s in servers) and rounds < 200:
            trainer_peer.run(_burst(trainer, 8 * rounds, 8), timeout=60)
            rounds += 1
        assert all(s.samples_per_s > 0 for s in servers), [s.samples_per_s for s in servers]
        for server in servers:  # announce the measured speeds now
            server.peer.run(server._announce(), timeout=10)
        moved = []
        for server in servers:
            rebalancer = Rebalancer(
                me=str(server.peer.peer_id),
                config=RebalanceConfig(stages=2, min_gain=0.05),
                read_loads=lambda peer=server.peer: _loads(peer, 2),
                move_to=server.move_to,
                rng=_AlwaysDraw(),
            )
            decision = server.peer.run(rebalancer.step(), timeout=60)
            if decision is not None and decision.target is not None:
                moved.append(server)
        assert len(moved) == 1 and moved[0].stage == 1
        assert sorted(s.stage for s in servers) == [0, 0, 1, 1]
        before = moved[0].stats.samples_committed
        rounds = 0
        while moved[0].stats.samples_committed == before and rounds < 200:
            trainer_peer.run(_burst(trainer, 1000 + 8 * rounds, 8), timeout=60)
            rounds += 1
        assert moved[0].stats.samples_committed > before  # it serves its new stage
