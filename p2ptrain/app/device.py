"""Where ``p2ptrain train`` computes: the device by name, and batches moved onto it."""

from __future__ import annotations

from typing import Any

import torch

from p2ptrain.errors import ConfigError

__all__ = ["to_device", "training_device"]


def training_device(name: str) -> torch.device:
    """The torch device ``name`` names: ``auto`` is CUDA where available, else the CPU.

    Raises:
        ConfigError: ``name`` is no device, or one this machine lacks.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(
            f"--device {name!r} is not a torch device (auto, cpu, cuda, cuda:N)"
        ) from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {name}: this machine has no CUDA device")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(
                f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    elif device.type != "cpu":
        raise ConfigError(f"--device {name}: only cpu and cuda are supported by the command line")
    return device


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it (nested in tuples, lists and dicts) on ``device``.

    Tensors already there are returned as they are; anything else is left alone.
    """
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device, non_blocking=True)
    if isinstance(batch, tuple):
        moved = [to_device(item, device) for item in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else tuple(moved)
    if isinstance(batch, list):
        return [to_device(item, device) for item in batch]
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    return batch
