"""Stage servers and a pipeline trainer on real loopback peers."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import torch
from swarm_peers import make_trainer, mlp_model, regression_batch, server_config, sgd, swarm
from train_worker import FAST_MATCHMAKING, peer_config

from p2ptrain.lab.swarm_sim import LocalStageOptimizer
from p2ptrain.peer import Peer
from p2ptrain.swarm import StageServer


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


def test_close_hands_over_before_it_withdraws_so_no_commit_is_both_counted_and_lost() -> None:
    # close() withdrew first (the withdrawal announces every commit not in a step
    # as lost, and trainers replay lost commits), then handed over: the last
    # hand-over's step counted what trainers were told to replay.
    never = server_config(step_interval=30.0, handover_max_s=30.0)  # only close hands over
    with swarm([0, 1], config=never, stage_optimizer=lambda opt, *_: LocalStageOptimizer(opt)) as (
        trainer_peer,
        _,
        servers,
    ):
        trainer = make_trainer(trainer_peer)
        for i in range(2):
            trainer.step(*regression_batch(i), timeout=30)
        trainer.close()
        server = servers[1]
        assert server.stats.samples_committed == 32 and server.stats.samples_in_steps == 0
        server.close()
        assert server.stats.samples_in_steps == 32  # the last hand-over stepped them
        (receipts,) = server._past_receipts.values()
        assert receipts.lost == ()
        assert all(receipts.fate(seq) == "counted" for seq in range(1, receipts.contributed + 1))
        assert receipts.contributed >= 1


class _OneStepAtATime(LocalStageOptimizer):
    """Records step() calls that overlap; its first step in the stepper thread lasts 0.5 s."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        self.inside = threading.Lock()
        self.overlaps = 0
        self.calls = 0
        self.in_stepper = threading.Event()

    def step(self, batch_size: int | None = None) -> bool:
        self.calls += 1
        if not self.inside.acquire(blocking=False):
            self.overlaps += 1
            return super().step(batch_size)
        try:
            if threading.current_thread().name.startswith("stage-step") and not (
                self.in_stepper.is_set()
            ):
                self.in_stepper.set()
                time.sleep(0.5)
            return super().step(batch_size)
        finally:
            self.inside.release()


def test_close_hands_over_after_the_step_loops_hand_over_not_beside_it() -> None:
    # CI found a stage step applied twice and 16 samples counted twice: close()
    # cancelled the step loop, whose hand-over went on in the stepper thread,
    # and handed over again in the caller's thread at the same time.
    made: list[_OneStepAtATime] = []

    def stage_optimizer(opt: torch.optim.Optimizer, *_: object) -> _OneStepAtATime:
        made.append(_OneStepAtATime(opt))
        return made[0]

    peer = Peer(replace(peer_config((), FAST_MATCHMAKING), nat=None, probe_seconds=None))
    with peer:
        server = StageServer(
            peer=peer,
            model=mlp_model(),
            stage=0,
            make_optimizer=sgd,
            config=server_config(),
            stage_optimizer=stage_optimizer,
        )
        server.start()
        try:
            assert made[0].in_stepper.wait(10)  # the step loop's hand-over is in the optimizer
        finally:
            server.close()
        assert made[0].overlaps == 0
        assert made[0].calls >= 2  # the loop's and close's
