"""A stage server moves to another stage: it leaves cleanly, downloads the new stage, serves it."""

from __future__ import annotations

import asyncio

import pytest
import torch
from swarm_peers import make_trainer, regression_batch, swarm

from p2ptrain.errors import ConfigError
from p2ptrain.swarm import PipelineTrainer


def test_a_server_moves_to_another_stage_downloads_its_state_and_serves_it() -> None:
    with swarm([0, 1, 1]) as (trainer_peer, _, servers):
        trainer = make_trainer(trainer_peer, avoid_s=0.2)  # the mover refuses while it moves
        for i in range(400):  # until stage 0 stepped (a micro-batch takes milliseconds)
            trainer.step(*regression_batch(i), timeout=30)
            if servers[0].global_step >= 1:
                break
        assert servers[0].global_step >= 1
        mover = servers[2]
        committed = mover.stats.samples_committed
        # No training during the move: stage 1 takes no step, so the mover's
        # unaveraged samples are dropped after the drain timeout, announced lost
        # and replayed by the trainer; stage 0 stands still, so the mover must
        # join it at its step with its exact parameters.
        mover.peer.run(mover.move_to(0, drain_timeout=0.5), timeout=60)
        assert mover.stage == 0
        assert mover.stats.moves == 1
        dropped = mover.stats.samples_dropped_on_move
        assert dropped == committed - mover.stats.samples_in_steps
        assert mover.global_step == servers[0].global_step >= 1
        with servers[0].optimizer.state_lock, mover.optimizer.state_lock:
            for a, b in zip(servers[0].module.parameters(), mover.module.parameters(), strict=True):
                assert torch.equal(a, b)
        trainer_peer.run(trainer.settle(), timeout=60)
        assert trainer.stats.replayed_samples >= dropped
        before = mover.stats.samples_committed
        rounds = 0
        while mover.stats.samples_committed == before and rounds < 500:
            # four micro-batches in flight at once: a backlog builds at stage 0
            trainer_peer.run(_concurrently(trainer, 4 * rounds), timeout=60)
            rounds += 1
        assert mover.stats.samples_committed > before  # the wiring sends it stage-0 work
        trainer.close()


def test_a_move_to_a_stage_that_does_not_exist_is_refused() -> None:
    with swarm([0, 1]) as (_, _, servers):
        with pytest.raises(ConfigError, match="stage 5"):
            servers[1].peer.run(servers[1].move_to(5), timeout=10)
        assert servers[1].stage == 1


async def _concurrently(trainer: PipelineTrainer, first: int) -> None:
    await asyncio.gather(
        *(trainer.train_micro_batch(*regression_batch(first + k)) for k in range(4))
    )
