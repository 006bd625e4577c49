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


def test_every_committed_sample_is_counted_in_exactly_one_stage_step() -> None:
    with swarm([0, 1, 1]) as (trainer_peer, _, servers):
        trainer = make_trainer(trainer_peer)
        for i in range(30):
            trainer.step(*regression_batch(i), timeout=30)
        trainer.close()
        for server in servers:  # hand the rest over: the stages' last step may be partial
            server.close()
        delivered = trainer.stats.samples_delivered
        assert delivered == 30 * 16
        assert servers[0].stats.samples_committed == delivered
        assert servers[1].stats.samples_committed + servers[2].stats.samples_committed == delivered
        counted = [s.stats.samples_in_steps + s.optimizer.local_samples for s in servers]
        assert counted[0] == delivered
        assert counted[1] + counted[2] == delivered
