"""CollaborativeOptimizer: a large batch accumulated by the whole swarm, then one step.

How a step flows::

    loss.backward()                  every peer, its own batches, its own pace
    opt.step(batch_size)             acc += grad * batch_size; samples += batch_size
      └─ progress published          {step, samples, samples/s} in <run_id>/progress
      └─ policy                      swarm samples at this step >= target_batch_size?
           no  → return (matchmake early if the step is near)
           yes → matchmaking under <run_id>/step-<step>
                 all-reduce of acc / samples, weight = samples
                 .grad = average; inner optimizer.step(); step += 1

The loss must be a mean over the batch, so that ``grad * batch_size`` is the
batch's sum of per-sample gradients and the sample-weighted average over the
swarm equals the gradient of one batch of ``target_batch_size`` samples.
With ``max_local_samples_per_step`` set, every peer contributes at most that
many samples to a step, and with ``target_batch_size`` = peers × that, the
swarm computes exactly what one process with the combined batch computes.

When no group forms or the all-reduce fails, the peer applies its own average
(and says so in the log and the stats) unless the swarm has meanwhile stepped
without it; then it downloads the swarm's state instead, so that it does not
drift from the others.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import torch

from p2ptrain.errors import ConfigError
from p2ptrain.metrics import Metrics
from p2ptrain.peer import Peer
from p2ptrain.train.base import (
    SwarmTrainer,
    check_params,
    load_optimizer_state,
)
from p2ptrain.train.collaboration import SwarmSettings
from p2ptrain.train.config import TrainerConfig
from p2ptrain.train.state import TrainingSnapshot

__all__ = ["CollaborativeOptimizer"]

logger = logging.getLogger(__name__)


class CollaborativeOptimizer(SwarmTrainer):
    """Wraps a torch optimizer so that the swarm steps it with the averaged gradient.

    Use as ``with CollaborativeOptimizer(opt, peer=peer, config=cfg) as copt:``
    and call :meth:`step` after each local ``backward()`` instead of
    ``opt.step()`` (it also clears the gradients).

    Args:
        optimizer: The inner optimizer (any ``torch.optim.Optimizer``).
        peer: The started peer to train through.
        config: The run and its step rule.
        metrics: Optional registry for samples/s, rounds, all-reduce seconds
            and bytes.
    """

    kind: ClassVar[str] = "collaborative"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        peer: Peer,
        config: TrainerConfig,
        metrics: Metrics | None = None,
    ) -> None:
        if not isinstance(config, TrainerConfig):
            raise ConfigError("config must be a TrainerConfig")
        super().__init__(optimizer, peer=peer, metrics=metrics)
        self.config = config
        numel = sum(p.numel() for p in self._params)
        self._accumulator = torch.zeros(numel, dtype=torch.float32)
        self._views: list[torch.Tensor] = []
        offset = 0
        for p in self._params:
            self._views.append(self._accumulator[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()

    @property
    def num_elements(self) -> int:
        """Elements averaged per step (all parameters)."""
        return self._accumulator.numel()

    def step(self, batch_size: int) -> bool:
        """Add the gradients of a local batch of ``batch_size`` samples; step with the swarm.

        Call it after ``backward()``; it clears the parameters' gradients. It
        returns at once unless a swarm step is due, or this peer accumulated
        ``max_local_samples_per_step`` and waits for the swarm.

        Returns:
            Whether the parameters changed (a swarm step, or a downloaded state).

        Raises:
            ConfigError: ``batch_size`` is not an int >= 0, or a gradient is sparse.
            RuntimeError: The optimizer is not started.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0:
            raise ConfigError(f"batch_size must be an int >= 0, got {batch_size!r}")
        collab = self._collaboration
        with torch.no_grad():
            for p, acc in zip(self._params, self._views, strict=True):
                grad = p.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise ConfigError("sparse gradients are not supported")
                if batch_size:
                    acc.add_(grad, alpha=batch_size)
                p.grad = None
        self._samples += batch_size
        collab.record_batch(batch_size)
        return self._advance(self.num_elements)

    def zero_grad(self) -> None:
        """Clear the parameters' gradients (not what was accumulated)."""
        for p in self._params:
            p.grad = None

    @property
    def _blocked(self) -> bool:
        limit = self.config.max_local_samples_per_step
        return limit is not None and self._samples >= limit

    def _settings(self) -> SwarmSettings:
        cfg = self.config
        lead = cfg.matchmaking_lead
        if lead is None and cfg.max_local_samples_per_step is not None:
            lead = 0.0  # bounded contributions: size each group when its step is due
        return SwarmSettings(
            run_id=cfg.run_id,
            target_batch_size=cfg.target_batch_size,
            progress=cfg.progress,
            allreduce=cfg.allreduce,
            state=cfg.state,
            matchmaking_lead=lead,
            sync_tolerance=cfg.sync_tolerance,
            grouping=cfg.grouping,
        )

    def _global_step(self) -> None:
        samples = self._samples
        vector = self._accumulator / max(samples, 1)  # all zeros when there are no samples
        averaged = self._average(vector, float(samples))
        if averaged is None:  # the swarm's state was downloaded instead
            return
        apply = averaged is not vector or samples > 0
        with self._lock, torch.no_grad():
            if apply:
                offset = 0
                for p in self._params:
                    grad = averaged[offset : offset + p.numel()].view(p.shape)
                    p.grad = grad.to(p.dtype) if grad.dtype != p.dtype else grad
                    offset += p.numel()
                self.optimizer.step()
                for p in self._params:
                    p.grad = None
            else:
                logger.warning("step %d: nothing to apply (no samples, no group)", self._step)
            self._step += 1
        self._accumulator.zero_()
        self._stepped()

    def _capture(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "params": [p.detach() for p in self._params],
            "optimizer": self.optimizer.state_dict(),
        }

    def _install(self, snapshot: TrainingSnapshot) -> None:
        state = snapshot.state
        params = check_params(state.get("params"), self._params)
        load_optimizer_state(self.optimizer, state.get("optimizer"), "optimizer")
        with torch.no_grad():
            for p, value in zip(self._params, params, strict=True):
                p.copy_(value)
        self._accumulator.zero_()
        self.zero_grad()
