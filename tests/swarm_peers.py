"""Stage servers and trainers on real loopback peers in this process, for the pipeline tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from train_worker import FAST_MATCHMAKING, peer_config

from p2ptrain.lab.timings import QUICK_PROGRESS
from p2ptrain.peer import Peer
from p2ptrain.swarm import (
    PipelineModel,
    PipelineTrainer,
    PipelineTrainerConfig,
    StageServer,
    StageServerConfig,
)

RUN = "pipe"


def mlp_model(num_stages: int = 2, width: int = 16) -> PipelineModel:
    """A small MLP regression model: 4 blocks."""
    blocks = [
        lambda: nn.Sequential(nn.Linear(4, width), nn.Tanh()),
        lambda: nn.Sequential(nn.Linear(width, width), nn.Tanh()),
        lambda: nn.Sequential(nn.Linear(width, width), nn.Tanh()),
        lambda: nn.Linear(width, 1),
    ]
    return PipelineModel.even(blocks, num_stages, seed=3)


def server_config(**changes: Any) -> StageServerConfig:
    base = StageServerConfig(
        run_id=RUN,
        target_batch_size=32,
        progress=QUICK_PROGRESS,
        announce_interval=0.3,
        announce_ttl=3.0,
        step_interval=0.1,
        commit_margin=0.2,
    )
    return replace(base, **changes)


def trainer_config(num_stages: int = 2, **changes: Any) -> PipelineTrainerConfig:
    base = PipelineTrainerConfig(
        run_id=RUN,
        num_stages=num_stages,
        call_timeout=3.0,
        retry_interval=0.1,
        refresh_interval=0.3,
    )
    return replace(base, **changes)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.2)


@contextlib.contextmanager
def swarm(
    stages: list[int],
    *,
    config: StageServerConfig | list[StageServerConfig] | None = None,
    model: PipelineModel | None = None,
    stage_optimizer: Any = None,
) -> Iterator[tuple[Peer, list[Peer], list[StageServer]]]:
    """A trainer peer plus one serving peer per entry of ``stages`` (its stage index)."""
    model = model or mlp_model()
    config = config or server_config()
    configs = config if isinstance(config, list) else [config] * len(stages)
    first = Peer(replace(peer_config((), FAST_MATCHMAKING), nat=None, probe_seconds=None))
    first.start()
    peers: list[Peer] = []
    servers: list[StageServer] = []
    try:
        for _ in stages:
            peer = Peer(
                replace(
                    peer_config((first.address,), FAST_MATCHMAKING), nat=None, probe_seconds=None
                )
            )
            peer.start()
            peers.append(peer)
        for peer, stage, cfg in zip(peers, stages, configs, strict=True):
            server = StageServer(
                peer=peer,
                model=model,
                stage=stage,
                make_optimizer=sgd,
                config=cfg,
                stage_optimizer=stage_optimizer,
            )
            server.start()
            servers.append(server)
        yield first, peers, servers
    finally:
        for server in servers:
            server.close()
        for peer in peers:
            peer.close()
        first.close()


def regression_batch(index: int, rows: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(index)
    x = torch.randn(rows, 4, generator=g)
    y = (x.sum(dim=1, keepdim=True) / 2).tanh()
    return x, y


def make_trainer(peer: Peer, num_stages: int = 2, **changes: Any) -> PipelineTrainer:
    return PipelineTrainer(
        peer=peer, config=trainer_config(num_stages, **changes), loss=nn.functional.mse_loss, seed=0
    )


def kill(peer: Peer) -> None:
    """Stop ``peer`` at once, as a crash would (no goodbye); close it later as usual."""
    peer.run(peer.node.abort(), timeout=10)
