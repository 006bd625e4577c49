"""The model, data and stage split every system in ``bench_pipeline.py`` trains.

A stack of ``depth`` residual MLP blocks of ``width`` (``x + GELU(Linear(x))``;
the last block is a plain Linear), cut into ``stages`` equal runs of blocks; the task is to
regress a fixed random teacher network (mean squared error). Batches are drawn
from a generator seeded by the step number, so every system sees the same
samples in the same order, and the blocks are built from one seed, so every
system starts from the same parameters.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["PipelineModel", "Residual", "batch", "block_factory", "build_blocks", "stage_module"]


@dataclass(frozen=True)
class PipelineModel:
    """The benchmark's model and workload.

    Attributes:
        width: Features of every block.
        depth: Blocks in the model.
        stages: Stages the blocks are cut into (``depth`` divisible by it).
        batch: Samples per step.
        microbatches: Micro-batches per step (``batch`` divisible by it).
        lr: SGD learning rate.
        seed: Seed of the parameters and the teacher.
    """

    width: int = 256
    depth: int = 8
    stages: int = 4
    batch: int = 64
    microbatches: int = 8
    lr: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.depth % self.stages or self.batch % self.microbatches:
            raise ValueError("depth must divide into stages and batch into microbatches")

    def args(self) -> list[str]:
        """Command-line flags that rebuild this workload in a worker."""
        return [
            f"--{name}={getattr(self, name)}"
            for name in ("width", "depth", "stages", "batch", "microbatches", "lr", "seed")
        ]


class Residual(nn.Module):
    """``x + GELU(Linear(x))``: deep stacks of it still train."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.gelu(self.linear(x))


def block_factory(model: PipelineModel, index: int) -> nn.Module:
    """Block ``index`` (built fresh: the caller seeds it)."""
    if index < model.depth - 1:
        return Residual(model.width)
    return nn.Linear(model.width, model.width)


def build_blocks(model: PipelineModel) -> list[nn.Module]:
    """The model's blocks: residual MLP blocks, the last a plain Linear; block ``i`` is
    built under seed ``model.seed + i`` (as :class:`p2ptrain.swarm.PipelineModel` does)."""
    blocks = []
    for i in range(model.depth):
        torch.manual_seed(model.seed + i)
        blocks.append(block_factory(model, i))
    return blocks


def stage_module(model: PipelineModel, stage: int) -> nn.Sequential:
    """The blocks of ``stage`` (built from the seed: equal to the whole model's)."""
    per = model.depth // model.stages
    return nn.Sequential(*build_blocks(model)[stage * per : (stage + 1) * per])


@functools.cache
def _teacher(width: int, seed: int) -> torch.Tensor:
    """The teacher's weight, drawn once per process (at width 2048: 4M normal draws)."""
    teacher = torch.Generator().manual_seed(seed + 1)
    return torch.randn(width, width, generator=teacher) / width**0.5


def batch(model: PipelineModel, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of ``step`` (the same for every system)."""
    weight = _teacher(model.width, model.seed)
    data = torch.Generator().manual_seed(model.seed * 1_000_003 + step)
    x = torch.randn(model.batch, model.width, generator=data)
    return x, torch.tanh(x @ weight)
