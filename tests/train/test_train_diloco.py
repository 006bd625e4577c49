"""DiLoCo over two real peers on loopback: H-fold less traffic, and the loss still falls."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn
from train_worker import (
    PATIENT_MATCHMAKING,
    PATIENT_PROGRESS,
    backward,
    dataset,
    loss_of,
    make_model,
    peer_config,
    rows,
)
from training_peers import in_threads

from p2ptrain.peer import Peer
from p2ptrain.train.base import SwarmTrainer
from p2ptrain.train.config import DiLoCoConfig, TrainerConfig
from p2ptrain.train.diloco import DiLoCoOptimizer
from p2ptrain.train.optimizer import CollaborativeOptimizer

BATCH = 16
H = 20
LOCAL_STEPS = 100
PLAIN_STEPS = 10  # bytes per step are constant: 10 steps measure the rate
X, Y = dataset(2 * BATCH * LOCAL_STEPS + 1024)
HELD_OUT = slice(2 * BATCH * LOCAL_STEPS, 2 * BATCH * LOCAL_STEPS + 1024)


@pytest.fixture
def pair() -> Iterator[list[Peer]]:
    # Every round must hold both peers (the byte count and the rounds are
    # exact): the library's patience for a live but slow member, not FAST's.
    first = Peer(peer_config(matchmaking=PATIENT_MATCHMAKING))
    first.start()
    second = Peer(peer_config((first.address,), PATIENT_MATCHMAKING))
    try:
        second.start()
        yield [first, second]
    finally:
        second.close()
        first.close()


def run_local_steps(opt: SwarmTrainer, model: nn.Module, shard: int, steps: int) -> None:
    for t in range(steps):
        part = rows(t, BATCH, shard=shard, num_shards=2)
        backward(model, X[part], Y[part])
        opt.step(BATCH)


def train_together(opts: list[SwarmTrainer], models: list[nn.Module], steps: int) -> None:
    """Start every trainer (each sees the others from its first step), then train."""
    for opt in opts:
        opt.start()
    try:
        in_threads(
            [
                lambda i=i: run_local_steps(opts[i], models[i], i, steps)  # type: ignore[misc]
                for i in range(len(opts))
            ]
        )
    finally:
        for opt in opts:
            opt.close()


def held_out_loss(model: nn.Module) -> float:
    with torch.no_grad():
        return float(loss_of(model, X[HELD_OUT], Y[HELD_OUT]))


def test_diloco_sends_h_times_less_and_still_learns(pair: list[Peer]) -> None:
    plain_models = [make_model(0) for _ in pair]
    plain = [
        CollaborativeOptimizer(
            torch.optim.AdamW(m.parameters(), lr=1e-2),
            peer=p,
            config=TrainerConfig(
                run_id="plain",
                target_batch_size=2 * BATCH,
                max_local_samples_per_step=BATCH,
                progress=PATIENT_PROGRESS,
            ),
        )
        for m, p in zip(plain_models, pair, strict=True)
    ]
    train_together(list(plain), plain_models, PLAIN_STEPS)
    assert all(opt.stats.rounds == PLAIN_STEPS for opt in plain)
    plain_bytes_per_100 = max(opt.stats.bytes_sent for opt in plain) * LOCAL_STEPS / PLAIN_STEPS

    models = [make_model(0) for _ in pair]
    initial = held_out_loss(models[0])
    diloco = [
        DiLoCoOptimizer(
            torch.optim.AdamW(m.parameters(), lr=1e-2),
            peer=p,
            config=DiLoCoConfig(run_id="diloco", inner_steps=H, progress=PATIENT_PROGRESS),
        )
        for m, p in zip(models, pair, strict=True)
    ]
    train_together(list(diloco), models, LOCAL_STEPS)
    for opt in diloco:
        assert opt.global_step == LOCAL_STEPS // H
        assert opt.stats.rounds == LOCAL_STEPS // H and opt.stats.local_rounds == 0
        assert opt.stats.bytes_sent <= plain_bytes_per_100 / 15
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # the outer steps agree
    assert held_out_loss(models[0]) < 0.5 * initial


def test_overlapped_diloco_keeps_one_round_start_and_learns(pair: list[Peer]) -> None:
    """With overlap the outer step lands one round late: every peer's round start
    (what the next pseudo-gradient is measured from) is still the same."""
    models = [make_model(0) for _ in pair]
    initial = held_out_loss(models[0])
    # A one-round-late outer step with the paper's lr 0.7 and momentum 0.9
    # overshoots (measured: held-out loss 0.24 vs 0.04 synchronous here); half
    # the outer lr trains as well as synchronous DiLoCo (0.023).
    config = DiLoCoConfig(
        run_id="overlap", inner_steps=H, progress=PATIENT_PROGRESS, overlap=True, outer_lr=0.35
    )
    diloco = [
        DiLoCoOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2), peer=p, config=config)
        for m, p in zip(models, pair, strict=True)
    ]
    train_together(list(diloco), models, LOCAL_STEPS)  # close() applies the last round
    starts = [opt.snapshot().state["params"] for opt in diloco]
    for opt in diloco:
        assert opt.global_step == LOCAL_STEPS // H
        assert opt.stats.rounds == LOCAL_STEPS // H and opt.stats.local_rounds == 0
    for a, b in zip(*starts, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # one round start
    assert held_out_loss(models[0]) < 0.5 * initial
