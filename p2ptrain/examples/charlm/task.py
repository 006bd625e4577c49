"""charlm as a ``p2ptrain train`` task (the default one; see :mod:`p2ptrain.app.task`)."""

from __future__ import annotations

import torch

from p2ptrain.examples.charlm import data
from p2ptrain.examples.charlm.model import ModelConfig, loss, make_model, make_optimizer

WARMUP_STEPS = 20
"""Global steps of linear learning-rate warm-up: AdamW's first steps on a fresh
model otherwise overshoot (the loss jumps back up for a few steps)."""


class CharLMTask:
    """The character-level transformer on the shipped King James Bible."""

    def __init__(self, config: ModelConfig | None = None) -> None:
        self.config = config or ModelConfig()
        self.model = make_model(self.config)
        self.optimizer: torch.optim.Optimizer = make_optimizer(self.model)
        self._sampler = data.load_corpus().sampler(seq_len=self.config.context, seed=0)

    def batch(self, index: int, batch_size: int, *, shard: int, num_shards: int) -> torch.Tensor:
        """Windows of ``context + 1`` characters from shard ``shard`` (deterministic)."""
        return self._sampler.batch(index, batch_size, shard=shard, num_shards=num_shards)

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        """Next-character cross-entropy (nats)."""
        return loss(self.model, batch)

    def lr_scale(self, global_step: int) -> float:
        """Linear warm-up over :data:`WARMUP_STEPS` global steps, then the full rate."""
        return min(1.0, (global_step + 1) / WARMUP_STEPS)


def make_task() -> CharLMTask:
    """What ``p2ptrain train`` builds when no ``--task`` is given."""
    return CharLMTask()
