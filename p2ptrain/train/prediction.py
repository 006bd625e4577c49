"""Weight prediction for the overlapped step (``carry``): gradients on the parameters to come.

Under ``carry`` the all-reduce of step t runs while the peer computes batches
toward step t+1. Computed on the parameters before step t's update, those
gradients are one step stale when applied, and with AdamW at a usual
learning rate one-step-stale updates train measurably worse: in one process
(charlm, 20 steps of 128 samples, lr 1e-3) the held-out loss ended 1.15x that
of undelayed updates and spiked twice (3.37 -> 4.49 -> 3.14), as the swarm's
overlapped mode did (docs/training.md).

Weight prediction (as SpecTrain and PipeMare do for pipeline staleness) moves
the parameters, while step t averages, by what the inner optimizer would do
with this peer's own gradient of step t, the best estimate of the average it
has: the carried batches are computed near the parameters the update will
produce. When the average arrives, the parameters and the optimizer state
are put back exactly and the averaged update is applied to them, so every
peer still applies the same update to the same parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["WeightPrediction"]


def _clone(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


class WeightPrediction:
    """The true parameters and optimizer state while predicted ones are installed.

    Args:
        optimizer: The inner optimizer.
        params: Its parameters, in the order of its ``state_dict()``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> None:
        self.optimizer = optimizer
        self.params = list(params)
        self._values: list[torch.Tensor] | None = None
        self._state: dict[int, dict[str, Any]] = {}

    @property
    def active(self) -> bool:
        """Whether predicted parameters are installed."""
        return self._values is not None

    def install(self, gradients: Sequence[torch.Tensor]) -> None:
        """Save the true state, then step the inner optimizer on ``gradients``
        (one per parameter, on its device). Call with the parameters' lock held."""
        if self._values is not None:
            raise RuntimeError("a prediction is already installed")
        state = self.optimizer.state
        self._values = [p.detach().clone() for p in self.params]
        self._state = {i: _clone(state[p]) for i, p in enumerate(self.params) if p in state}
        with torch.no_grad():
            for p, grad in zip(self.params, gradients, strict=True):
                p.grad = grad
            self.optimizer.step()
            for p in self.params:
                p.grad = None

    def restore(self) -> None:
        """Put the true parameters and optimizer state back (no-op if none is saved).
        Call with the parameters' lock held."""
        values, self._values = self._values, None
        if values is None:
            return
        state = self.optimizer.state
        with torch.no_grad():
            for i, (p, value) in enumerate(zip(self.params, values, strict=True)):
                p.copy_(value)
                if i in self._state:
                    state[p] = self._state[i]
                else:
                    state.pop(p, None)
        self._state = {}

    def discard(self) -> None:
        """Forget the saved state (a downloaded state replaced both)."""
        self._values = None
        self._state = {}

    def true_state(self, state_dict: dict[str, Any]) -> tuple[list[torch.Tensor], dict[str, Any]]:
        """The true parameters and ``state_dict`` (the optimizer's, taken now) with the
        true per-parameter state in place of the predicted one."""
        if self._values is None:
            raise RuntimeError("no prediction is installed")
        true = dict(state_dict)
        true["state"] = dict(self._state)
        return list(self._values), true
