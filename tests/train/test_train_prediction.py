"""Weight prediction under ``carry``: batches computed while a step averages see the
parameters to come; the state served and the update applied are the true ones."""

from __future__ import annotations

import time

import torch
from train_worker import peer_with_absent_partner

from p2ptrain.train.config import TrainerConfig
from p2ptrain.train.optimizer import CollaborativeOptimizer
from p2ptrain.train.prediction import WeightPrediction


def adamw_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.99))


def adam_step(model: torch.nn.Module, inner: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    inner.zero_grad()
    model(torch.randn(16, 4)).pow(2).mean().backward()
    inner.step()


def test_restore_puts_parameters_and_optimizer_state_back_exactly() -> None:
    model, inner = adamw_model()
    twin, twin_inner = adamw_model()
    for seed in range(3):  # an optimizer state with moments and a step count
        adam_step(model, inner, seed)
        adam_step(twin, twin_inner, seed)
    params = list(model.parameters())
    prediction = WeightPrediction(inner, params)
    prediction.install([torch.ones_like(p) for p in params])
    assert prediction.active
    assert not torch.equal(params[0], next(twin.parameters()))
    values, state = prediction.true_state(inner.state_dict())
    for mine, theirs in zip(values, twin.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    assert torch.equal(state["state"][0]["exp_avg"], twin_inner.state_dict()["state"][0]["exp_avg"])
    prediction.restore()
    assert not prediction.active
    # The next real step is the one the optimizer would have made without the prediction.
    adam_step(model, inner, 7)
    adam_step(twin, twin_inner, 7)
    for mine, theirs in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(mine, theirs)


def test_a_parameter_without_state_has_none_after_restore() -> None:
    model, inner = adamw_model()
    params = list(model.parameters())
    prediction = WeightPrediction(inner, params)
    prediction.install([torch.ones_like(p) for p in params])
    assert len(inner.state) == len(params)  # the predicted step created the moments
    prediction.restore()
    assert len(inner.state) == 0


def test_batches_carried_while_a_step_averages_see_the_predicted_parameters() -> None:
    """The regression: a carried batch was computed on the parameters before the
    update (one step stale); it now sees them moved by this peer's own gradient,
    while snapshots (state downloads) and the step's end keep the true ones."""
    batch, target, lr = 4, 8, 0.1  # the peer closes the step on its second batch
    with peer_with_absent_partner(window=30.0, run_id="predict", target=target) as first:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        start = [p.detach().clone() for p in model.parameters()]
        config = TrainerConfig(
            run_id="predict", target_batch_size=target, step_policy="carry", carry_batches=2
        )
        inner = torch.optim.SGD(model.parameters(), lr=lr)
        x = torch.arange(12.0).view(4, 3)
        with CollaborativeOptimizer(inner, peer=first, config=config) as trainer:
            trainer.stop_at(time.monotonic() + 3.0)
            grads = []
            for _ in range(2):  # the step's two batches: the second closes it
                model(x).pow(2).mean().backward()
                grads.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
                trainer.step(batch)
            # The partner never matchmakes: the step is averaging in the background.
            own = [(a + b) / 2 for a, b in zip(*grads, strict=True)]
            for p, p0, g in zip(model.parameters(), start, own, strict=True):
                torch.testing.assert_close(p.detach(), p0 - lr * g)
            served = trainer.snapshot().state["params"]
            for value, p0 in zip(served, start, strict=True):
                assert torch.equal(value, p0)
        # Closing gave up on the average at the stop time: nothing applied,
        # and the true parameters are back.
        assert trainer.global_step == 0
        for p, p0 in zip(model.parameters(), start, strict=True):
            assert torch.equal(p.detach(), p0)


def test_without_prediction_carried_batches_see_the_parameters_before_the_update() -> None:
    batch, target = 4, 8
    with peer_with_absent_partner(window=30.0, run_id="stale", target=target) as first:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        start = [p.detach().clone() for p in model.parameters()]
        config = TrainerConfig(
            run_id="stale",
            target_batch_size=target,
            step_policy="carry",
            carry_batches=2,
            predict_weights=False,
        )
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        with CollaborativeOptimizer(inner, peer=first, config=config) as trainer:
            trainer.stop_at(time.monotonic() + 3.0)
            for _ in range(2):
                model(torch.ones(4, 3)).sum().backward()
                trainer.step(batch)
            for p, p0 in zip(model.parameters(), start, strict=True):
                assert torch.equal(p.detach(), p0)
