"""The pipeline computes what one process computes: same blocks, seed, batches, optimizer."""

from __future__ import annotations

import threading

import torch
from swarm_peers import make_trainer, mlp_model, regression_batch, server_config, swarm
from torch import nn

STEPS = 24
MICRO = 2  # micro-batches of 16 per step: target_batch_size 32


def _single_process_losses() -> list[float]:
    model = mlp_model().build_all()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    losses = []
    for step in range(STEPS):
        parts = [regression_batch(MICRO * step + k) for k in range(MICRO)]
        x = torch.cat([p[0] for p in parts])
        y = torch.cat([p[1] for p in parts])
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def test_pipeline_loss_matches_single_process_training_at_25_50_and_100_percent() -> None:
    # Each stage step holds exactly one step's samples (the swarm's step cut,
    # which extrapolates the others' progress, is not what is compared here).
    config = server_config(target_batch_size=16 * MICRO, max_local_samples_per_step=16 * MICRO)
    with swarm([0, 1], config=config) as (trainer_peer, _, servers):
        stepped = {s.stage: threading.Semaphore(0) for s in servers}

        def on_event(event: str, stage: int) -> None:
            if event == "stepped":
                stepped[stage].release()

        for server in servers:
            server.on_event = on_event
        trainer = make_trainer(trainer_peer)
        losses = []
        for step in range(STEPS):
            parts = [
                trainer.step(*regression_batch(MICRO * step + k), timeout=30) for k in range(MICRO)
            ]
            losses.append(sum(parts) / MICRO)
            for stage in stepped.values():  # one global step of every stage, then the next
                assert stage.acquire(timeout=30)
        assert [s.global_step for s in servers] == [STEPS, STEPS]
    reference = _single_process_losses()
    ratios = [losses[i] / reference[i] for i in (STEPS // 4 - 1, STEPS // 2 - 1, STEPS - 1)]
    print(f"pipeline / single-process loss at 25/50/100 % of samples: {ratios}")
    assert all(abs(r - 1) < 0.02 for r in ratios), ratios
    assert reference[-1] < 0.5 * reference[0]  # it learned something to compare
