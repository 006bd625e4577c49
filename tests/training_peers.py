"""Training peers in this process, each on its own loop thread, for the training tests.

Shared by the training and metrics tests (``from training_peers import ...``).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn
from train_worker import FAST_MATCHMAKING, backward, dataset, peer_config, rows

from p2ptrain.allreduce.matchmaking import MatchmakingConfig
from p2ptrain.peer import Peer
from p2ptrain.train.optimizer import CollaborativeOptimizer

T = TypeVar("T")
BATCH = 16
LR = 0.1
X, Y = dataset(4096)


def make_inner(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def start_peers(
    count: int, bootstrap: Peer | None = None, matchmaking: MatchmakingConfig = FAST_MATCHMAKING
) -> list[Peer]:
    peers: list[Peer] = []
    try:
        for _ in range(count):
            first = bootstrap or (peers[0] if peers else None)
            initial = (first.address,) if first is not None else ()
            peer = Peer(peer_config(initial, matchmaking))
            peer.start()
            peers.append(peer)
    except BaseException:
        for peer in peers:
            peer.close()
        raise
    return peers


def in_threads(jobs: list[Callable[[], T]], timeout: float = 60.0) -> list[T]:
    """Run every job in its own thread; their results in order (re-raises failures)."""
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(job) for job in jobs]
        return [f.result(timeout=timeout) for f in futures]


def train_steps(
    opt: CollaborativeOptimizer, model: nn.Module, shard: int, num_shards: int, steps: int
) -> int:
    """Compute one batch per global step until ``steps`` more global steps happened."""
    goal = opt.global_step + steps
    while opt.global_step < goal:
        part = rows(opt.global_step, BATCH, shard=shard, num_shards=num_shards)
        backward(model, X[part], Y[part])
        opt.step(BATCH)
    return opt.global_step
