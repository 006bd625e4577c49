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
A step holds ``target_batch_size`` samples by the step cut
(:mod:`p2ptrain.train.cut`): a peer stops adding batches to a step when the
swarm is about to reach the target. Under the default ``wait`` policy it
then waits for the step; under ``carry`` the step's all-reduce runs in the
background while the peer computes at most ``carry_batches`` batches toward
the next step (a second accumulator; their gradients are one step stale)
on the parameters its own gradient predicts
(:mod:`p2ptrain.train.prediction`), then it waits. The vector averaged carries
one more element, ``1 / samples``, from which every peer learns the step's
total samples (:func:`~p2ptrain.train.averaging.group_weight`).

With ``max_local_samples_per_step`` set, every peer contributes at most that
many samples to a step, and with ``target_batch_size`` = peers × that, the
swarm computes exactly what one process with the combined batch computes.

When no group forms or the all-reduce fails, the peer applies its own average
(and says so in the log and the stats) unless the swarm has meanwhile stepped
without it; then it downloads the swarm's state instead, so that it does not
drift from the others.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from p2ptrain.allreduce.compression import get_codec
from p2ptrain.errors import ConfigError
from p2ptrain.metrics import Metrics
from p2ptrain.peer import Peer
from p2ptrain.train.averaging import group_weight
from p2ptrain.train.base import (
    SwarmTrainer,
    check_params,
    load_optimizer_state,
)
from p2ptrain.train.collaboration import PendingAverage, SwarmSettings
from p2ptrain.train.config import TrainerConfig
from p2ptrain.train.cut import StepPolicy
from p2ptrain.train.feedback import ErrorFeedback
from p2ptrain.train.prediction import WeightPrediction
from p2ptrain.train.staging import HostStaging, parameters_device
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
        model: The model, if its buffers belong in the state (see
            :class:`~p2ptrain.train.base.SwarmTrainer`).
        batch_size: The default local batch size of :meth:`step`.
    """

    kind: ClassVar[str] = "collaborative"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        peer: Peer,
        config: TrainerConfig,
        metrics: Metrics | None = None,
        model: torch.nn.Module | None = None,
        batch_size: int | None = None,
    ) -> None:
        if not isinstance(config, TrainerConfig):
            raise ConfigError("config must be a TrainerConfig")
        super().__init__(optimizer, peer=peer, metrics=metrics, model=model, batch_size=batch_size)
        self.config = config
        self._numel = sum(p.numel() for p in self._params)
        # One element more than the parameters: the count marker (see group_weight).
        # Accumulated on the parameters' device; staged through pinned host memory.
        self._device = parameters_device(self._params)
        self._staging = HostStaging(self._numel + 1, self._device)
        self._accumulator = torch.zeros(self._numel + 1, dtype=torch.float32, device=self._device)
        self._views = self._views_of(self._accumulator)
        self._carry: torch.Tensor | None = None  # the next step's, under the carry policy
        self._carry_views: list[torch.Tensor] = []
        # Each step's averaged-in vector, written over at the next step (a fresh one
        # per step page-faulted its whole size in: 19 ms for 33 MB on the CPU here).
        self._step_vector: torch.Tensor | None = None
        self._carried = 0
        self._carried_batches = 0
        self._pending: tuple[PendingAverage, torch.Tensor] | None = None
        self._prediction = (
            WeightPrediction(optimizer, self._params) if config.predict_weights else None
        )
        codec = config.allreduce
        self._feedback = (
            ErrorFeedback(get_codec(codec.codec, block_size=codec.block_size), self._numel)
            if config.error_feedback and codec.codec != "none"
            else None
        )
        # A per-peer bound makes each step exact by itself: no step cut on top of it.
        self._policy = (
            StepPolicy.UNBOUNDED
            if config.max_local_samples_per_step is not None
            else StepPolicy(config.step_policy)
        )

    def _views_of(self, flat: torch.Tensor) -> list[torch.Tensor]:
        views, offset = [], 0
        for p in self._params:
            views.append(flat[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        return views

    @property
    def num_elements(self) -> int:
        """Elements averaged per step (all parameters, and the count marker)."""
        return self._accumulator.numel()

    @property
    def carried_samples(self) -> int:
        """Samples computed past the step cut, counted toward the next step."""
        return self._carried

    def step(  # type: ignore[override]
        self, batch_size: int | None = None, closure: Callable[[], Any] | None = None
    ) -> bool:
        """Add the gradients of a local batch of ``batch_size`` samples; step with the swarm.

        Call it after ``backward()``; it clears the parameters' gradients. It
        returns at once unless a swarm step is due, or this peer accumulated
        ``max_local_samples_per_step`` and waits for the swarm.

        Returns:
            Whether the parameters changed (a swarm step, or a downloaded state).

        Raises:
            ConfigError: ``batch_size`` is not an int >= 0, or a gradient is sparse.
            RuntimeError: The optimizer is not started.
            ConcurrentStepError: Another ``step()`` of this optimizer is running.
        """
        with self._one_step_at_a_time():
            return self._step_batch(batch_size, closure)

    def _step_batch(self, batch_size: int | None, closure: Callable[[], Any] | None) -> bool:
        batch_size = self._batch(batch_size, closure)
        collab = self._collaboration
        collab.record_batch(batch_size)
        if self._pending is not None:  # the step is closed and averaging: carry over
            self._accumulate(batch_size, carry=True)
            # Carry over at most carry_batches batches (and no more than this peer
            # put in the step averaging), then wait for it: every carried batch
            # is one step stale, and the next step would fill with them.
            if (
                not self._pending[0].future.done()
                and self._carried_batches < self.config.carry_batches
                and self._carried < max(1, self._samples)
            ):
                collab.report(step=self._step, samples=self._samples, blocked=False)
                return False
            return self._finish_step()
        collab.place(step=self._step, own=self._samples, batch=batch_size)
        self._accumulate(batch_size, carry=False)
        return self._advance(self.num_elements)

    def close(self) -> None:
        """Apply a step still averaging in the background, then leave the run."""
        if self._pending is not None and self._collab is not None and self._collab.started:
            self._finish_step()
        super().close()

    def _accumulate(self, batch_size: int, *, carry: bool) -> None:
        views = self._views
        if carry:
            if self._carry is None:
                self._carry = torch.zeros_like(self._accumulator)
                self._carry_views = self._views_of(self._carry)
            views = self._carry_views
        grads: list[torch.Tensor] = []
        targets: list[torch.Tensor] = []
        for p, acc in zip(self._params, views, strict=True):
            grad = p.grad
            if grad is None:
                continue
            if grad.is_sparse:
                raise ConfigError("sparse gradients are not supported")
            grads.append(grad)
            targets.append(acc)
            p.grad = None
        if batch_size and grads:
            # One call for all tensors: a per-tensor loop gives the network
            # thread a chance to hold the GIL between every two adds.
            with torch.no_grad():
                torch._foreach_add_(targets, grads, alpha=batch_size)
        if carry:
            self._carried += batch_size
            self._carried_batches += int(batch_size > 0)
        else:
            self._samples += batch_size

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
            step_policy=self._policy,
            carry_batches=cfg.carry_batches,
            run_id=cfg.run_id,
            target_batch_size=cfg.target_batch_size,
            progress=cfg.progress,
            allreduce=cfg.allreduce,
            state=cfg.state,
            matchmaking_lead=lead,
            sync_tolerance=cfg.sync_tolerance,
            grouping=cfg.grouping,
        )

    def _global_step(self) -> bool:
        samples = self._samples
        self._accumulator[-1] = 1.0  # becomes 1 / samples: the count marker
        if self._step_vector is None:
            self._step_vector = torch.empty_like(self._accumulator)
        # All zeros when there are no samples. The last step's vector is done with:
        # its average was applied (or dropped) before this step closed.
        vector = torch.div(self._accumulator, max(samples, 1), out=self._step_vector)
        vector = self._staging.to_host(vector)
        feedback = self._feedback
        if self._policy is StepPolicy.CARRY and self._collaboration.expects_group(self._step):
            # Average in the background; batches computed meanwhile count toward
            # the next step, and the update is applied at the first step() after.
            filled = self._carried_batches >= self.config.carry_batches
            if not filled and self._prediction is not None and samples > 0:
                self._predict(vector)  # reads the vector before the codec's feedback changes it
            # The codec's error feedback runs in a worker thread before the
            # all-reduce, not on the training thread (measured ~0.1 s a step
            # for 1.8M elements on loaded cores).
            compensate = (
                None
                if feedback is None
                else functools.partial(
                    feedback.compensate,
                    vector[:-1],  # not the count marker
                )
            )
            average = self._collaboration.begin_average(
                self._step, vector, samples, prepare=compensate
            )
            self._pending = (average, vector)
            if filled:
                return self._finish_step()  # carry_batches=0: wait for the average now
            return False
        if feedback is not None:
            feedback.compensate(vector[:-1])  # not the count marker
        step = self._step
        averaged = self._average(vector, float(samples))
        if averaged is None:  # the swarm's state was downloaded instead
            self._keep_missed(vector, samples, step)
            return True
        self._apply(vector, averaged, samples)
        return True

    def _keep_missed(self, vector: torch.Tensor, samples: int, step: int) -> None:
        """Count the samples of a step this peer missed toward the next one.

        The swarm finished ``step`` without this peer (no group), and the
        downloaded state is the one after it. The missed gradient, one step
        stale like a carried batch, counts toward the step now due instead
        of being lost. Further behind, it is dropped.
        """
        if self._step != step + 1 or samples <= 0:
            return
        with torch.no_grad():
            self._accumulator.copy_(vector)
            self._accumulator.mul_(samples)
            self._accumulator[-1] = 0.0
        self._samples = samples
        self._collaboration.report(step=self._step, samples=samples, blocked=self._blocked)
        logger.info(
            "step %d went on without this peer; its %d samples count toward step %d",
            step,
            samples,
            self._step,
        )

    def _predict(self, vector: torch.Tensor) -> None:
        """Install the parameters this peer's own gradient predicts (see
        :mod:`p2ptrain.train.prediction`) while the step averages."""
        assert self._prediction is not None
        grads = []
        offset = 0
        for p in self._params:
            own = vector[offset : offset + p.numel()].view(p.shape)
            grads.append(self._staging.to_device(own, p))
            offset += p.numel()
        self._staging.settle()  # the copies read the vector, which the feedback changes next
        with self._lock:
            self._prediction.install(grads)

    def _finish_step(self) -> bool:
        """Apply the step averaged in the background (waits for it if needed)."""
        pending, self._pending = self._pending, None
        if pending is None:  # pragma: no cover - callers check
            return False
        if self._prediction is not None:
            with self._lock:
                self._prediction.restore()
        average, vector = pending
        ended = self._end_average(average)
        if ended is None:
            return False
        averaged, outcome = ended
        settled = self._settle(averaged, outcome)
        if settled is not None:
            self._apply(vector, settled, round(outcome.weight))
        return True

    def _apply(self, vector: torch.Tensor, averaged: torch.Tensor, samples: int) -> None:
        apply = averaged is not vector or samples > 0
        step_samples = self._step_samples(averaged)
        with self._lock, torch.no_grad():
            if apply:
                offset = 0
                for p in self._params:
                    grad = averaged[offset : offset + p.numel()].view(p.shape)
                    p.grad = self._staging.to_device(grad, p)
                    offset += p.numel()
                self.optimizer.step()
                for p in self._params:
                    p.grad = None
            else:
                logger.warning("step %d: nothing to apply (no samples, no group)", self._step)
            self._step += 1
        self._accumulator.zero_()
        carried, self._carried = self._carried, 0
        self._carried_batches = 0
        if self._carry is not None:
            self._accumulator, self._carry = self._carry, self._accumulator
            self._views, self._carry_views = self._carry_views, self._views
        self._stepped(
            carried=carried, step_samples=step_samples, own=samples, length=averaged.numel()
        )
        logger.debug("step %d applied; %d samples carried over", self._step, carried)

    def _step_samples(self, averaged: torch.Tensor) -> int | None:
        outcome = self._outcome
        codec = self.config.allreduce
        if outcome is None or codec.aggregation != "mean" or codec.codec not in ("none", "fp16"):
            return None
        return group_weight(outcome, length=averaged.numel(), marker=float(averaged[-1]))

    def _capture(self) -> dict[str, Any]:
        params = [p.detach() for p in self._params]
        optimizer = self.optimizer.state_dict()
        if self._prediction is not None and self._prediction.active:
            params, optimizer = self._prediction.true_state(optimizer)
        return {"kind": self.kind, "params": params, "optimizer": optimizer}

    def _install(self, snapshot: TrainingSnapshot) -> None:
        state = snapshot.state
        params = check_params(state.get("params"), self._params)
        if self._prediction is not None:
            self._prediction.restore()  # a refused state leaves the true one in place
        load_optimizer_state(self.optimizer, state.get("optimizer"), "optimizer")
        with torch.no_grad():
            for p, value in zip(self._params, params, strict=True):
                p.copy_(value)
        self._accumulator.zero_()
        if self._carry is not None:
            self._carry.zero_()
        self._carried = 0
        self._carried_batches = 0
        self._pending = None
        if self._feedback is not None:
            self._feedback.reset()
        self.zero_grad()
