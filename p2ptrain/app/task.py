"""What ``p2ptrain train`` trains: the charlm example, or a task of your own.

A *task* is a model, its optimizer, a way to draw batches and a loss. A
module (an importable name, or a path to a ``.py`` file) passed with
``p2ptrain train --task`` defines ``make_task()`` returning an object with
these members (see :class:`TrainingTask`)::

    # my_task.py
    import numpy as np
    import torch

    class LinearTask:
        def __init__(self) -> None:
            self.model = torch.nn.Linear(8, 1)
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)
            self._w = torch.randn(8, 1, generator=torch.Generator().manual_seed(0))

        def batch(self, index: int, batch_size: int, *, shard: int, num_shards: int):
            rng = np.random.default_rng([index, shard])  # a stream per (index, shard)
            x = torch.from_numpy(rng.standard_normal((batch_size, 8), dtype=np.float32))
            return x, x @ self._w

        def loss(self, batch) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.model(x), y)

    def make_task() -> LinearTask:
        return LinearTask()

Every peer builds the task the same way, so the models start equal (a late
joiner downloads the swarm's state anyway). ``batch`` gets the peer's shard
(from its whole PeerID digest, one of ``num_shards`` = 2**40) so that peers
draw different data: seed with all of it (a torch ``Generator`` keeps only
32 bits of a seed; numpy's ``default_rng([index, shard])`` keeps them all). A task may also define
``lr_scale(global_step) -> float``: the swarm-wide learning-rate schedule (a
warm-up, say), a factor on each parameter group's initial rate, read by
every peer before each local batch so that all peers step alike.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import torch

from p2ptrain.errors import ConfigError

__all__ = [
    "CHARLM",
    "CHARLM_PIPELINE",
    "PipelineTask",
    "TrainingTask",
    "default_run_id",
    "load_pipeline_task",
    "load_task",
    "lr_schedule",
]

CHARLM = "p2ptrain.examples.charlm.task"
"""The default task: the character-level transformer of :mod:`p2ptrain.examples.charlm`
(shipped inside the package with its data)."""


class TrainingTask(Protocol):
    """A model and how to train it, as ``p2ptrain train`` needs it.

    Attributes:
        model: The model; its parameters are what the swarm averages.
        optimizer: The optimizer over ``model``'s parameters (the collaborative
            optimizer wraps it).
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer

    def batch(self, index: int, batch_size: int, *, shard: int, num_shards: int) -> Any:
        """The ``index``-th local batch of ``batch_size`` samples from data shard ``shard``."""
        ...

    def loss(self, batch: Any) -> torch.Tensor:
        """The scalar loss of ``model`` on ``batch`` (the trainer calls ``backward``)."""
        ...


def load_task(spec: str | None = None) -> TrainingTask:
    """Build the task named by ``spec``: a module name, a ``.py`` path, or None for charlm.

    Raises:
        ConfigError: The module cannot be loaded, has no ``make_task``, or
            what it returns lacks a member of :class:`TrainingTask`.
    """
    module = _import(spec or CHARLM)
    make = getattr(module, "make_task", None)
    if not callable(make):
        raise ConfigError(f"task module {spec!r} defines no make_task() function")
    task = make()
    _check(task, spec or CHARLM)
    return task  # type: ignore[no-any-return]


def default_run_id(spec: str | None = None) -> str:
    """The run a task trains in unless told otherwise: its module's name (``charlm``
    for the default), so that another task never joins its run by accident."""
    if spec is None or spec == CHARLM:
        return "charlm"
    name = Path(spec).stem if spec.endswith(".py") or "/" in spec else spec.rsplit(".", 1)[-1]
    cleaned = "".join(c if c.isalnum() or c in "-_." else "-" for c in name).strip("-.")
    return cleaned or "task"


def lr_schedule(task: TrainingTask) -> Callable[[int], None]:
    """A function of the global step that applies ``task.lr_scale`` to its optimizer.

    A no-op for tasks without ``lr_scale``.

    Raises:
        ConfigError: (when called) ``lr_scale`` returned a negative or non-finite factor.
    """
    scale = getattr(task, "lr_scale", None)
    initial = [float(group["lr"]) for group in task.optimizer.param_groups]

    def apply(global_step: int) -> None:
        if scale is None:
            return
        factor = float(scale(global_step))
        if not (math.isfinite(factor) and factor >= 0):
            raise ConfigError(f"lr_scale({global_step}) must be finite and >= 0, got {factor}")
        # param_groups is read each time: loading a downloaded state replaces its dicts
        for group, lr in zip(task.optimizer.param_groups, initial, strict=True):
            group["lr"] = lr * factor

    return apply


def _import(spec: str) -> ModuleType:
    if spec.endswith(".py") or "/" in spec:
        return _import_file(Path(spec))
    try:
        return importlib.import_module(spec)
    except ImportError as exc:
        raise ConfigError(f"cannot import the task module {spec!r}: {exc}") from exc


def _import_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise ConfigError(f"task file {str(path)!r} not found")
    name = f"p2ptrain_task_{path.stem}"
    loader_spec = importlib.util.spec_from_file_location(name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise ConfigError(f"cannot load {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ConfigError(f"task file {str(path)!r} failed to load: {exc!r}") from exc
    return module


def _check(task: object, spec: str) -> None:
    owner = f"make_task() of {spec!r}"
    if not isinstance(getattr(task, "model", None), torch.nn.Module):
        raise ConfigError(f"{owner} returned no .model (a torch.nn.Module)")
    if not isinstance(getattr(task, "optimizer", None), torch.optim.Optimizer):
        raise ConfigError(f"{owner} returned no .optimizer (a torch.optim.Optimizer)")
    for method in ("batch", "loss"):
        if not callable(getattr(task, method, None)):
            raise ConfigError(f"{owner} returned no .{method}() method")


CHARLM_PIPELINE = "p2ptrain.examples.charlm.pipeline"
"""The default pipeline task: charlm declared as blocks."""


class PipelineTask(Protocol):
    """A model as blocks, for ``p2ptrain train --pipeline`` (``make_pipeline_task()``).

    No peer builds the whole model: each stage server builds only its
    stage's blocks (see :class:`~p2ptrain.swarm.PipelineModel`).

    Attributes:
        blocks: One factory per block (a callable returning a torch module), in order.
        num_stages: How many stages the blocks are cut into (evenly).
    """

    blocks: tuple[Callable[[], torch.nn.Module], ...]
    num_stages: int

    def make_optimizer(self, params: Any) -> torch.optim.Optimizer:
        """Each stage's optimizer over its parameters."""
        ...

    def batch(self, index: int, batch_size: int, *, shard: int, num_shards: int) -> Any:
        """``(inputs, targets)``: stage 0's input and what the loss compares with."""
        ...

    def loss(self, output: torch.Tensor, targets: Any) -> torch.Tensor:
        """The mean loss of the last stage's output (parameter-free)."""
        ...


def load_pipeline_task(spec: str | None = None) -> PipelineTask:
    """Build the pipeline task of ``spec`` (a module defining ``make_pipeline_task()``).

    Raises:
        ConfigError: The module cannot be loaded, or lacks a member of :class:`PipelineTask`.
    """
    name = spec or CHARLM_PIPELINE
    module = _import(name)
    make = getattr(module, "make_pipeline_task", None)
    if not callable(make):
        raise ConfigError(f"task module {name!r} defines no make_pipeline_task() function")
    task = make()
    owner = f"make_pipeline_task() of {name!r}"
    blocks = getattr(task, "blocks", None)
    if not isinstance(blocks, tuple) or not blocks or not all(callable(b) for b in blocks):
        raise ConfigError(f"{owner} returned no .blocks (a tuple of module factories)")
    stages = getattr(task, "num_stages", None)
    if isinstance(stages, bool) or not isinstance(stages, int) or not 1 <= stages <= len(blocks):
        raise ConfigError(f"{owner}: .num_stages must be an int in [1, {len(blocks)}]")
    for method in ("make_optimizer", "batch", "loss"):
        if not callable(getattr(task, method, None)):
            raise ConfigError(f"{owner} returned no .{method}() method")
    return task  # type: ignore[no-any-return]
