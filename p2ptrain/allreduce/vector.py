"""Tensors to one flat float32 vector and back."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from p2ptrain.errors import ConfigError
from p2ptrain.wire.buffers import default_pool

__all__ = ["FlatLayout", "flatten", "pooled_vector", "unflatten"]


@dataclass(frozen=True, slots=True)
class FlatLayout:
    """Where each tensor sits in the flat vector.

    Attributes:
        shapes: The tensors' shapes.
        dtypes: Their dtypes (results are cast back to them).
        single: Whether one tensor was given (not a sequence).
    """

    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]
    single: bool

    @property
    def numel(self) -> int:
        """Length of the flat vector."""
        return sum(shape.numel() for shape in self.shapes)


def flatten(tensors: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, FlatLayout]:
    """Concatenate floating-point tensors into one float32 vector.

    One contiguous float32 CPU tensor is not copied: the flat vector is a view
    of it. Anything else costs one copy.

    Raises:
        ConfigError: Not tensors, or a tensor is not floating point.
    """
    single = isinstance(tensors, torch.Tensor)
    items = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    for item in items:
        if not isinstance(item, torch.Tensor):
            raise ConfigError(f"expected tensors, got {type(item).__name__}")
        if not item.is_floating_point():
            raise ConfigError(f"only floating-point tensors are averaged, got {item.dtype}")
    layout = FlatLayout(
        tuple(item.shape for item in items), tuple(item.dtype for item in items), single
    )
    if (
        len(items) == 1
        and items[0].dtype == torch.float32
        and items[0].device.type == "cpu"
        and items[0].is_contiguous()
    ):
        return items[0].detach().reshape(-1), layout
    flat = pooled_vector(layout.numel)
    offset = 0
    for item in items:
        size = item.numel()
        flat[offset : offset + size].copy_(item.detach().reshape(-1))
        offset += size
    return flat, layout


def pooled_vector(numel: int) -> torch.Tensor:
    """An uninitialised float32 vector from the recycling buffer pool.

    Its memory goes back to the pool once nothing refers to the tensor, and
    the next vector of that size class reuses pages already touched: writing
    a reused multi-megabyte buffer is several times faster than writing a
    fresh allocation (see :mod:`p2ptrain.wire.buffers`).
    """
    if numel == 0:
        return torch.empty(0)
    return torch.frombuffer(default_pool.get(4 * numel), dtype=torch.float32)


def unflatten(flat: torch.Tensor, layout: FlatLayout) -> torch.Tensor | list[torch.Tensor]:
    """Split ``flat`` back into tensors of the layout's shapes and dtypes.

    float32 results are views of ``flat``; others are converted copies.
    """
    results = []
    offset = 0
    for shape, dtype in zip(layout.shapes, layout.dtypes, strict=True):
        size = shape.numel()
        piece = flat[offset : offset + size].view(shape)
        results.append(piece if dtype == torch.float32 else piece.to(dtype))
        offset += size
    return results[0] if layout.single else results
