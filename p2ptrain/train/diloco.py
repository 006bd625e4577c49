"""DiLoCo: many local steps, then one averaged outer step (Douillard et al., 2023).

Each round, every peer takes ``inner_steps`` (H) steps of its inner optimizer
(AdamW in the paper) on its own data, then the swarm averages the
*pseudo-gradient* ``θ_start − θ_now`` (weighted by the samples behind it) with
the same matchmaking and all-reduce as
:class:`~p2ptrain.train.optimizer.CollaborativeOptimizer`, and every peer
applies it with the outer optimizer, SGD with Nesterov momentum, to the
start-of-round parameters ``θ_start``. The vector averaged is as large as one
gradient, but it is averaged once per H local steps instead of once per
step: communication drops about H-fold.

A round ends when every live peer has finished its inner steps (peers that
finish early wait), or, with ``target_batch_size``, when the swarm processed
that many samples in the round. The state served to late joiners is the
start-of-round parameters with the inner and outer optimizer states, and the
round counter as the global step.

With ``DiLoCoConfig(overlap=True)`` a round's average runs in the background
while the next round's inner steps run from the local parameters
``θ_end`` (one outer step of delay): when the average arrives the peer
applies the outer step to ``θ_start`` as above, giving the swarm's new
start ``θ'``, and moves its parameters to ``θ' + (θ_now − θ_end)``, keeping
the progress made meanwhile. Every peer's round start is ``θ'`` again, so
the next pseudo-gradient is measured from the same point everywhere. A peer
that finishes its next inner steps before the average arrives waits for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from p2ptrain.errors import ConfigError
from p2ptrain.metrics import Metrics
from p2ptrain.peer import Peer
from p2ptrain.train.base import SwarmTrainer, check_params, load_optimizer_state
from p2ptrain.train.collaboration import PendingAverage, SwarmSettings
from p2ptrain.train.config import DiLoCoConfig
from p2ptrain.train.staging import HostStaging, parameters_device
from p2ptrain.train.state import TrainingSnapshot

__all__ = ["DiLoCoOptimizer"]

logger = logging.getLogger(__name__)


class DiLoCoOptimizer(SwarmTrainer):
    """Trains with the swarm in DiLoCo rounds (see the module docstring).

    Use like :class:`~p2ptrain.train.optimizer.CollaborativeOptimizer`: call
    :meth:`step` after each local ``backward()``. The global step it reports
    is the number of outer steps.

    Args:
        optimizer: The inner optimizer (typically ``torch.optim.AdamW``).
        peer: The started peer to train through.
        config: The run, H and the outer optimizer's settings.
        metrics: Optional registry for the trainer's figures.
    """

    kind: ClassVar[str] = "diloco"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        peer: Peer,
        config: DiLoCoConfig,
        metrics: Metrics | None = None,
        model: torch.nn.Module | None = None,
        batch_size: int | None = None,
    ) -> None:
        if not isinstance(config, DiLoCoConfig):
            raise ConfigError("config must be a DiLoCoConfig")
        super().__init__(optimizer, peer=peer, metrics=metrics, model=model, batch_size=batch_size)
        self.config = config
        self._start = [p.detach().clone() for p in self._params]
        self.outer_optimizer = torch.optim.SGD(
            self._params,
            lr=config.outer_lr,
            momentum=config.outer_momentum,
            nesterov=config.nesterov,
        )
        self._inner_done = 0
        self._numel = sum(p.numel() for p in self._params)
        self._staging = HostStaging(self._numel, parameters_device(self._params))
        self._pending: _PendingRound | None = None

    @property
    def inner_steps_done(self) -> int:
        """Inner steps taken in the current round."""
        return self._inner_done

    def step(  # type: ignore[override]
        self, batch_size: int | None = None, closure: Callable[[], Any] | None = None
    ) -> bool:
        """Take an inner step on the local gradients; end the round after H of them.

        Returns:
            Whether an outer step happened (or a downloaded state was installed).

        Raises:
            ConfigError: ``batch_size`` is not an int >= 0.
            RuntimeError: The optimizer is not started.
            ConcurrentStepError: Another ``step()`` of this optimizer is running.
        """
        with self._one_step_at_a_time():
            return self._step_batch(batch_size, closure)

    def _step_batch(self, batch_size: int | None, closure: Callable[[], Any] | None) -> bool:
        batch_size = self._batch(batch_size, closure)
        collab = self._collaboration
        with self._lock:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self._inner_done += 1
        self._samples += batch_size
        collab.record_batch(batch_size)
        if self._pending is not None:  # the last round averages in the background
            if not self._pending.average.future.done() and not self._blocked:
                return False
            changed = self._finish_round()
            if not self._blocked:
                return changed
            return self._advance(self._numel) or changed
        return self._advance(self._numel)

    def close(self) -> None:
        """Apply a round still averaging in the background, then leave the run."""
        if self._pending is not None and self._collab is not None and self._collab.started:
            self._finish_round()
        super().close()

    @property
    def _blocked(self) -> bool:
        return self._inner_done >= self.config.inner_steps

    def _settings(self) -> SwarmSettings:
        cfg = self.config
        return SwarmSettings(
            run_id=cfg.run_id,
            target_batch_size=cfg.target_batch_size,
            progress=cfg.progress,
            allreduce=cfg.allreduce,
            state=cfg.state,
            matchmaking_lead=cfg.matchmaking_lead,
            sync_tolerance=cfg.sync_tolerance,
        )

    def _pseudo_gradient(self) -> torch.Tensor:
        with torch.no_grad():
            parts = [
                (start.float() - p.detach().float()).reshape(-1)
                for start, p in zip(self._start, self._params, strict=True)
            ]
        return torch.cat(parts)

    def _global_step(self) -> bool:
        samples = self._samples
        vector = self._pseudo_gradient() if samples > 0 else torch.zeros(self._numel)
        vector = self._staging.to_host(vector)
        collab = self._collaboration
        if self.config.overlap and collab.expects_group(self._step):
            average = collab.begin_average(self._step, vector, float(samples))
            with torch.no_grad():
                round_start = [start.clone() for start in self._start]
                for start, p in zip(self._start, self._params, strict=True):
                    start.copy_(p)  # θ_end: the next round runs from here meanwhile
            self._pending = _PendingRound(average, vector, samples, round_start)
            self._inner_done = 0
            self._samples = 0
            return False
        averaged = self._average(vector, float(samples))
        if averaged is None:  # the swarm's state was downloaded instead
            return True
        with self._lock, torch.no_grad():
            self._outer_step(averaged, self._start, apply=averaged is not vector or samples > 0)
            for p, start in zip(self._params, self._start, strict=True):
                start.copy_(p)
            self._step += 1
        self._inner_done = 0
        self._stepped(own=samples)
        return True

    def _outer_step(
        self, averaged: torch.Tensor, start: list[torch.Tensor], *, apply: bool
    ) -> None:
        """Set the parameters to ``start`` and apply the averaged pseudo-gradient to them."""
        offset = 0
        for p, begin in zip(self._params, start, strict=True):
            p.copy_(begin)
            delta = averaged[offset : offset + p.numel()].view(p.shape)
            p.grad = self._staging.to_device(delta, p)
            offset += p.numel()
        if apply:
            self.outer_optimizer.step()
        else:
            logger.warning("round %d: nothing to apply (no samples, no group)", self._step)
        for p in self._params:
            p.grad = None

    def _finish_round(self) -> bool:
        """Apply the round averaged in the background (waits for it if needed)."""
        pending, self._pending = self._pending, None
        if pending is None:  # pragma: no cover - callers check
            return False
        ended = self._end_average(pending.average)
        if ended is None:
            return False
        averaged, outcome = ended
        settled = self._settle(averaged, outcome)
        if settled is None:  # the swarm's state was downloaded instead
            return True
        apply = settled is not pending.vector or pending.samples > 0
        with self._lock, torch.no_grad():
            progress = [p - end for p, end in zip(self._params, self._start, strict=True)]
            self._outer_step(settled, pending.round_start, apply=apply)
            for p, start, moved in zip(self._params, self._start, progress, strict=True):
                start.copy_(p)  # θ': the swarm's new start
                p.add_(moved)
            self._step += 1
        self._stepped(carried=self._samples, own=pending.samples)
        return True

    def _capture(self) -> dict[str, Any]:
        pending = self._pending
        return {
            "kind": self.kind,
            # the swarm's start of the current global step, not this peer's θ_end
            "params": list(self._start if pending is None else pending.round_start),
            "inner": self.optimizer.state_dict(),
            "outer": self.outer_optimizer.state_dict(),
        }

    def _install(self, snapshot: TrainingSnapshot) -> None:
        state = snapshot.state
        params = check_params(state.get("params"), self._params)
        load_optimizer_state(self.optimizer, state.get("inner"), "inner optimizer")
        load_optimizer_state(self.outer_optimizer, state.get("outer"), "outer optimizer")
        with torch.no_grad():
            for p, start, value in zip(self._params, self._start, params, strict=True):
                p.copy_(value)
                start.copy_(value)
                p.grad = None
        self._inner_done = 0


@dataclass(frozen=True)
class _PendingRound:
    """A round averaging in the background (``DiLoCoConfig.overlap``).

    Attributes:
        average: The all-reduce on the peer's loop.
        vector: The pseudo-gradient averaged (unchanged until it ends).
        samples: This peer's samples in the round.
        round_start: The round's start ``θ_start`` (the swarm's, the same on every peer).
    """

    average: PendingAverage
    vector: torch.Tensor
    samples: int
    round_start: list[torch.Tensor]
