"""Stage servers and a pipeline trainer on real loopback peers."""

from __future__ import annotations

from swarm_peers import make_trainer, regression_batch, swarm


def test_micro_batches_flow_through_two_stages_and_the_loss_falls() -> None:
    with swarm([0, 1]) as (trainer_peer, _, servers):
        trainer = make_trainer(trainer_peer)
        losses = [trainer.step(*regression_batch(i % 8), timeout=30) for i in range(40)]
        assert trainer.stats.samples_delivered == 40 * 16
        assert trainer.stats.retries == 0
        assert all(s.stats.samples_committed == 40 * 16 for s in servers)
        assert sum(losses[-8:]) < 0.85 * sum(losses[:8])
        assert all(s.global_step >= 1 for s in servers)
