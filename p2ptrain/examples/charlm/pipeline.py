"""charlm as a pipeline task: the same transformer, declared as blocks for ``--pipeline``.

Blocks: the embedding (tokens + positions), each transformer block, the head
(final LayerNorm and output layer). No peer builds more than the blocks of
the stage it serves; the trainer holds only the loss.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from p2ptrain.examples.charlm import data
from p2ptrain.examples.charlm.model import ModelConfig, _Block

__all__ = ["CharLMPipelineTask", "make_pipeline_task"]


class _Embed(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.positions = nn.Embedding(config.context, config.d_model)
        for table in (self.tokens, self.positions):
            nn.init.normal_(table.weight, 0.0, 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.tokens(ids) + self.positions.weight[: ids.shape[1]]
        return out


class _Head(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.ln_f(x))
        return out


class CharLMPipelineTask:
    """The character transformer as blocks, for ``p2ptrain train --pipeline``.

    Attributes:
        blocks: One factory per block, in order.
        num_stages: The stages the blocks are cut into.
    """

    def __init__(self, config: ModelConfig | None = None, *, num_stages: int = 4) -> None:
        self.config = config or ModelConfig(context=32, d_model=64, n_layers=2, n_heads=4)
        cfg = self.config
        self.blocks = (
            lambda: _Embed(cfg),
            *(lambda: _Block(cfg) for _ in range(cfg.n_layers)),
            lambda: _Head(cfg),
        )
        self.num_stages = num_stages
        self._sampler = data.load_corpus().sampler(seq_len=cfg.context, seed=0)

    def make_optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        """Each stage's optimizer."""
        return torch.optim.Adam(params, lr=3e-3)

    def batch(
        self, index: int, batch_size: int, *, shard: int, num_shards: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets): token ids and the next characters."""
        rows = self._sampler.batch(index, batch_size, shard=shard, num_shards=num_shards)
        return rows[:, :-1], rows[:, 1:]

    def loss(self, output: torch.Tensor, targets: Any) -> torch.Tensor:
        """Next-character cross-entropy (nats) of the logits."""
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1))


def make_pipeline_task() -> CharLMPipelineTask:
    """What ``p2ptrain train --pipeline`` builds when no ``--task`` is given."""
    return CharLMPipelineTask()
