"""The trainers where a ``torch.optim.Optimizer`` is expected, and the state they carry.

Learning-rate schedulers and ``torch.amp.GradScaler`` drive a
:class:`CollaborativeOptimizer`; its ``state_dict`` round-trips; registered
schedulers and scalers and the model's buffers (BatchNorm statistics) travel
in snapshots, checkpoints and state downloads. Real peers on loopback.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from train_worker import FAST_PROGRESS, peer_config

from p2ptrain.errors import ConcurrentStepError, ConfigError, StateSyncError
from p2ptrain.peer import Peer
from p2ptrain.train import CollaborativeOptimizer, TrainerConfig

BATCH = 4


@pytest.fixture
def peer() -> Iterator[Peer]:
    with Peer(peer_config()) as started:
        yield started


def alone(
    peer: Peer, model: nn.Module, lr: float = 0.1, run_id: str = "api"
) -> CollaborativeOptimizer:
    """A trainer that steps after every batch (target = one batch, nobody else)."""
    config = TrainerConfig(run_id=run_id, target_batch_size=BATCH, progress=FAST_PROGRESS)
    inner = torch.optim.SGD(model.parameters(), lr=lr)
    return CollaborativeOptimizer(inner, peer=peer, config=config, model=model, batch_size=BATCH)


def linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(3, 1, bias=False)


def batch_grad(model: nn.Module, scale: float = 1.0) -> torch.Tensor:
    x = torch.ones(BATCH, 3)
    (model(x).sum() * scale / BATCH).backward()  # type: ignore[no-untyped-call]
    return next(model.parameters()).grad.detach().clone() / scale  # type: ignore[union-attr]


def test_it_is_a_torch_optimizer_and_a_scheduler_sets_its_learning_rate(peer: Peer) -> None:
    model = linear()
    with alone(peer, model) as opt:
        assert isinstance(opt, torch.optim.Optimizer)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        weight = model.weight
        for expected_lr in (0.1, 0.05, 0.025):
            before = weight.detach().clone()
            grad = batch_grad(model)
            assert opt.step() is True  # the batch size given at construction
            torch.testing.assert_close(weight.detach(), before - expected_lr * grad)
            scheduler.step()
        assert opt.param_groups[0]["lr"] == pytest.approx(0.0125)
        assert opt.global_step == 3


def test_a_grad_scaler_drives_it_and_skips_an_overflowed_batch(peer: Peer) -> None:
    model = linear()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with alone(peer, model) as opt:
        before = model.weight.detach().clone()
        x = torch.ones(BATCH, 3)
        scaler.scale(model(x).sum() / BATCH).backward()  # type: ignore[no-untyped-call]
        scaler.step(opt)  # unscales the gradients, then calls opt.step()
        scaler.update()
        # the swarm stepped on the unscaled gradient (d/dw of sum/B = mean of x = 1)
        torch.testing.assert_close(model.weight.detach(), before - 0.1 * torch.ones(1, 3))
        assert opt.global_step == 1
        # an overflowed batch: the scaler skips step(), nothing is counted
        scaler.scale(model(x * float("inf")).sum()).backward()  # type: ignore[no-untyped-call]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        assert opt.global_step == 1 and opt.local_samples == 0
        assert scaler.get_scale() < 1024.0


def test_state_dict_carries_schedulers_scalers_and_buffers(peer: Peer, tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    with alone(peer, model, run_id="a") as opt:
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
        opt.register_state("scheduler", scheduler)
        opt.register_state("scaler", scaler)
        for _ in range(2):
            model(torch.randn(BATCH, 3)).sum().backward()  # type: ignore[no-untyped-call]
            opt.step()
            scheduler.step()
        scaler.scale(torch.tensor(1.0))  # the scaler's scale exists from its first use
        scaler.update(new_scale=64.0)
        saved = opt.state_dict()
        opt.save_checkpoint(tmp_path / "run.pt")
        mean = model[1].running_mean.clone()  # type: ignore[union-attr]
    assert mean.abs().sum() > 0  # the batches moved the statistics

    fresh = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    with alone(peer, fresh, run_id="b") as other:
        scheduler2 = torch.optim.lr_scheduler.StepLR(other, step_size=1, gamma=0.5)
        scaler2 = torch.amp.GradScaler("cpu")
        other.register_state("scheduler", scheduler2)
        other.register_state("scaler", scaler2)
        other.load_state_dict(saved)
        assert other.global_step == 2 and scheduler2.last_epoch == 2
        assert scaler2.get_scale() == 64.0
        assert other.param_groups[0]["lr"] == pytest.approx(0.025)
        torch.testing.assert_close(fresh[1].running_mean, mean)  # type: ignore[index]
        other.load_checkpoint(tmp_path / "run.pt")
        assert other.global_step == 2
        with pytest.raises(StateSyncError):
            other.load_state_dict({"global_step": 1, "state": {**saved["state"], "buffers": []}})
    with pytest.raises(ConfigError):
        other.add_param_group({"params": [torch.zeros(1)]})


def test_batchnorm_statistics_survive_a_state_download() -> None:
    first = Peer(peer_config())
    first.start()
    second = Peer(peer_config((first.address,)))
    try:
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
        with alone(first, model, run_id="bn") as opt:
            for _ in range(3):
                model(torch.randn(BATCH, 3) * 3 + 1).sum().backward()  # type: ignore[no-untyped-call]
                opt.step()
            assert opt.global_step == 3
            second.start()
            torch.manual_seed(2)
            joiner_model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
            joiner = alone(second, joiner_model, run_id="bn")
            joiner.start()  # the swarm is ahead: it downloads the state first
            try:
                assert joiner.global_step == 3 and joiner.stats.syncs == 1
                for mine, theirs in zip(joiner_model.buffers(), model.buffers(), strict=True):
                    torch.testing.assert_close(mine, theirs)
                for mine, theirs in zip(joiner_model.parameters(), model.parameters(), strict=True):
                    torch.testing.assert_close(mine, theirs)
            finally:
                joiner.close()
    finally:
        second.close()
        first.close()


def test_a_step_entered_while_another_runs_is_refused_not_counted_twice(peer: Peer) -> None:
    model = linear()
    inside, release = threading.Event(), threading.Event()

    def slow_closure() -> None:  # runs inside the first step()
        batch_grad(model)
        inside.set()
        assert release.wait(10)

    with alone(peer, model) as opt:
        first = threading.Thread(target=lambda: opt.step(closure=slow_closure))
        first.start()
        try:
            assert inside.wait(10)
            with pytest.raises(ConcurrentStepError, match="another step"):
                opt.step()
        finally:
            release.set()
            first.join(10)
        assert opt.global_step == 1  # the first step alone
        batch_grad(model)
        assert opt.step() is True and opt.global_step == 2  # the lock is free again
