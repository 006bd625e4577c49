"""A model as an ordered list of blocks cut into stages, and what a stage costs in memory.

Every block is built by its own factory under its own seed (``seed + index``),
so a peer that builds only stage 2 gets exactly the weights that a peer
building the whole model gets for those blocks: no peer ever needs to hold
more than its stage, and every peer of a stage starts equal.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from p2ptrain.errors import ConfigError, MemoryBudgetError

__all__ = [
    "OPTIMIZER_SLOTS",
    "PipelineModel",
    "check_budget",
    "even_bounds",
    "stage_memory_bytes",
]

BlockFactory = Callable[[], nn.Module]

OPTIMIZER_SLOTS: dict[str, int] = {"SGD": 1, "Adam": 2, "AdamW": 2, "RMSprop": 2, "Adagrad": 1}
"""Tensors the size of the parameters an optimizer keeps (SGD: momentum; Adam: two moments).
Unknown optimizers count 2."""


def even_bounds(num_blocks: int, num_stages: int) -> tuple[int, ...]:
    """Cut ``num_blocks`` blocks into ``num_stages`` stages as evenly as possible.

    Returns:
        ``num_stages + 1`` indices: stage ``s`` holds blocks ``[b[s], b[s + 1])``.
    """
    if not 1 <= num_stages <= num_blocks:
        raise ConfigError(f"cannot cut {num_blocks} blocks into {num_stages} stages")
    return tuple(round(s * num_blocks / num_stages) for s in range(num_stages + 1))


@dataclass(frozen=True)
class PipelineModel:
    """The blocks of a model in order and their partition into stages.

    Attributes:
        blocks: One factory per block, in the order data flows.
        bounds: ``num_stages + 1`` increasing indices from 0 to ``len(blocks)``;
            stage ``s`` holds ``blocks[bounds[s]:bounds[s + 1]]``.
        seed: Block ``i`` is built under ``torch.manual_seed(seed + i)``.
    """

    blocks: tuple[BlockFactory, ...]
    bounds: tuple[int, ...]
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.blocks or not all(callable(b) for b in self.blocks):
            raise ConfigError("PipelineModel.blocks must be a non-empty tuple of factories")
        bounds = self.bounds
        if (
            len(bounds) < 2
            or bounds[0] != 0
            or bounds[-1] != len(self.blocks)
            or any(b >= c for b, c in itertools.pairwise(bounds))
        ):
            raise ConfigError(
                f"PipelineModel.bounds must rise strictly from 0 to {len(self.blocks)},"
                f" got {bounds}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError("PipelineModel.seed must be an int >= 0")

    @classmethod
    def even(
        cls, blocks: Sequence[BlockFactory], num_stages: int, *, seed: int = 0
    ) -> PipelineModel:
        """``blocks`` cut into ``num_stages`` stages of (nearly) equal block counts."""
        return cls(tuple(blocks), even_bounds(len(blocks), num_stages), seed)

    @property
    def num_stages(self) -> int:
        """How many stages the model is cut into."""
        return len(self.bounds) - 1

    def check_stage(self, stage: object) -> int:
        """``stage`` as a valid stage index, or ConfigError."""
        if isinstance(stage, bool) or not isinstance(stage, int):
            raise ConfigError(f"a stage is an int, got {stage!r}")
        if not 0 <= stage < self.num_stages:
            raise ConfigError(f"stage {stage} is not in [0, {self.num_stages})")
        return stage

    def build_block(self, index: int) -> nn.Module:
        """Block ``index``, built under its own seed (the global RNG is left as it was)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + index)
            block = self.blocks[index]()
        if not isinstance(block, nn.Module):
            raise ConfigError(
                f"block factory {index} returned {type(block).__name__}, not a Module"
            )
        return block

    def build_stage(self, stage: int) -> nn.Sequential:
        """The blocks of ``stage`` as one module."""
        stage = self.check_stage(stage)
        start, end = self.bounds[stage], self.bounds[stage + 1]
        return nn.Sequential(*(self.build_block(i) for i in range(start, end)))

    def build_all(self) -> nn.Sequential:
        """The whole model (for a single-process reference run)."""
        return nn.Sequential(*(self.build_block(i) for i in range(len(self.blocks))))


def stage_memory_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes a stage server holds for ``module``: parameters, the gradient
    accumulators (the server's and the stage optimizer's) and the optimizer's per-parameter state
    (:data:`OPTIMIZER_SLOTS` copies), plus buffers."""
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    buffers = sum(b.numel() * b.element_size() for b in module.buffers())
    slots = OPTIMIZER_SLOTS.get(type(optimizer).__name__, 2)
    if isinstance(optimizer, torch.optim.SGD) and not any(
        group.get("momentum", 0) for group in optimizer.param_groups
    ):
        slots = 0
    return params * (3 + slots) + buffers


def check_budget(stage: int, needed: int, budget: int | None) -> None:
    """Refuse a stage whose memory ``needed`` exceeds ``budget`` (``None``: no cap).

    Raises:
        MemoryBudgetError: It does not fit; the message gives both figures.
    """
    if budget is not None and needed > budget:
        raise MemoryBudgetError(
            f"stage {stage} needs {needed / 1e6:.2f} MB for parameters, gradient accumulator"
            f" and optimizer state; this peer's budget is {budget / 1e6:.2f} MB:"
            " refusing to serve it"
        )
