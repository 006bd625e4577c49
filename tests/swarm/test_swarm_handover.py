"""A stage server's hand-overs and its commit ledger, against scripted stage optimizers."""

from __future__ import annotations

import math
from typing import Any

import torch
from swarm_peers import mlp_model, server_config, sgd

from p2ptrain.lab.swarm_sim import LocalStageOptimizer
from p2ptrain.swarm import StageServer
from p2ptrain.swarm.server import _Stage
from p2ptrain.train.collaboration import StepRecord, TrainerStats


class _MissesOneStep(LocalStageOptimizer):
    """Its first hand-over with samples finds the swarm past the step: it downloads the
    state and keeps the samples toward the next step (as ``CollaborativeOptimizer``
    does for a step that went on without it); the next one steps with them."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        self.kept = 0
        self.syncs = 0

    @property
    def local_samples(self) -> int:
        return self.kept

    @property
    def stats(self) -> TrainerStats:
        return TrainerStats(global_step=self._step, syncs=self.syncs)

    def step(self, batch_size: int | None = None) -> bool:
        if not batch_size:
            return False
        if self.syncs == 0:
            self.syncs, self.kept, self._step = 1, batch_size, self._step + 1
            return True
        own, self.kept = self.kept + batch_size, 0
        self._last = StepRecord(self._step, own, own, None)
        self._step += 1
        return True


def _server(**changes: Any) -> tuple[StageServer, _Stage]:
    server = StageServer(
        peer=None,  # type: ignore[arg-type] # no hand-over here needs the network
        model=mlp_model(),
        stage=0,
        make_optimizer=sgd,
        config=server_config(),
        stage_optimizer=lambda opt, *_: _MissesOneStep(opt),
    )
    return server, server._open(0)


def _commit(server: StageServer, state: _Stage, samples: int) -> int:
    grads = tuple(torch.ones_like(p) for p in state.params)
    _, seq, _ = server._commit(state, (None, grads), samples, math.inf)
    return seq


def test_samples_kept_toward_the_next_step_after_a_download_are_not_announced_lost() -> None:
    # Announced lost, the trainer replays them on another peer; counted by this
    # peer's next step as well, they were counted twice.
    server, state = _server()
    try:
        first = [_commit(server, state, 8) for _ in range(2)]
        server._hand_over(state)  # the download: kept, not stepped
        receipts = state.ledger.announced()
        assert receipts.lost == ()
        assert [receipts.fate(s) for s in first] == ["pending", "pending"]
        later = _commit(server, state, 8)
        server._hand_over(state)  # the step: the kept 16 samples and the new 8
        receipts = state.ledger.announced()
        assert [receipts.fate(s) for s in [*first, later]] == ["counted"] * 3
        assert server.stats.samples_in_steps == 24
    finally:
        server._device.shutdown()
