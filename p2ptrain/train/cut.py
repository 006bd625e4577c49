"""The step cut: when a peer closes its step, and what it does after (pure).

A step holds ``target_batch_size`` samples. After each local batch a peer
estimates the swarm's work at its step: its own samples (exact) plus every
other peer's, each extrapolated from its progress record at its reported
rate, whole batches and the fractions of batches in progress
(:meth:`~p2ptrain.train.progress.SwarmProgress.estimate_samples`). A batch
always counts toward the step it was computed for: its gradient is on that
step's parameters. The peer closes the step when the swarm would pass the
target in the first half of its next batch: when its estimate of the
swarm's work, plus half of its next batch and half of what the others are
expected to compute meanwhile, reaches the target. What it does once
closed is the step policy's:

* ``wait`` (the default): it waits for the step's average, then steps.
* ``carry``: the step averages in the background while the peer computes
  up to ``carry_batches`` batches toward the *next* step (a second
  accumulator), on the parameters its own gradient of the closed step
  predicts (:mod:`p2ptrain.train.prediction`); the averaged update is
  applied at the first ``step()`` after it arrived. Only batches begun
  after the close are carried, all of them on predicted parameters. (The
  first ``carry`` also carried the batch in flight when the swarm reached
  the target, computed on the parameters before the update: with a
  quarter of each step's samples one step stale that way, the loss at the
  same samples was 3-4 % worse than ``wait``'s on the ``--wan`` benchmark,
  against -0.6 % once only predicted batches were carried.)

Why half: every peer stops by the same rule, so a step ends at about the
moment the first peer closes plus half a batch time (the others finish
the batch they are computing, evenly spread over it). A peer that closed
when its *next batch would end* past the target (the rule before)
stopped the swarm half a swarm-batch early: with ``N`` peers of batch
``b`` at one rate a step then held ``target - (N - 1) * b / 2`` on
average (measured: 0.81x at 8 peers, target 256, batch 16). Stopping at
the midpoint makes the overshoot of the peers whose batch ends past the
target equal, on average, to the shortfall of those that stopped before
it: the mean is the target. Peers that compute in lockstep (they all
began the step at the end of the same all-reduce) all stop on the batch
that ends nearest the target.

* ``unbounded``: the behaviour before the cut existed: batches are added
  until the swarm's *reported* samples reach the target; the step holds
  what every peer added meanwhile. Kept for the benchmark's comparison.

A closed peer says so in its progress record (``closed``), so the others
close the step at their next batch even when their own estimate lags.
Overshoot is then at most one batch per peer whose view was stale, as long
as a step lasts longer than a read of the records
(``ProgressConfig.min_fetch_interval``). A shorter step is cut by
extrapolation alone, only as well as the reported rates predict the
batches (each peer still stops at the target on its own, so a step never
exceeds the number of peers times the target).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from p2ptrain.errors import ConfigError

__all__ = ["STEP_POLICIES", "Placement", "StepPolicy", "place_batch"]


class StepPolicy(enum.Enum):
    """How a peer keeps a step at its target (see the module docstring)."""

    CARRY = "carry"
    WAIT = "wait"
    UNBOUNDED = "unbounded"


STEP_POLICIES = tuple(p.value for p in StepPolicy)
"""The policy names, as :class:`~p2ptrain.train.config.TrainerConfig` takes them."""


@dataclass(frozen=True)
class Placement:
    """What the peer does after a batch that counted toward its step.

    Attributes:
        close: The peer adds nothing more to the current step and steps.
    """

    close: bool


def place_batch(
    *,
    policy: StepPolicy,
    target: int,
    own: int,
    batch: int,
    others: int,
    swarm_closed: bool,
    others_per_batch: float = 0.0,
) -> Placement:
    """Whether the peer closes its step after a local batch that just ended.

    Args:
        policy: The step policy.
        target: The step's target batch size.
        own: Samples this peer holds toward the current step, before the batch.
        batch: The batch's samples.
        others: The other peers' work at the step, as estimated now
            (batches in progress by the fraction done).
        swarm_closed: A peer at the step closed it.
        others_per_batch: Samples the other peers are expected to add while
            this peer computes one more batch.

    Raises:
        ConfigError: A negative or non-finite argument, or a target below 1.
    """
    if target < 1 or min(own, batch, others) < 0 or not 0 <= others_per_batch < float("inf"):
        raise ConfigError("place_batch() takes non-negative arguments and a target >= 1")
    if policy is StepPolicy.UNBOUNDED:
        return Placement(close=False)
    before = own + others
    if swarm_closed or before >= target:
        return Placement(close=True)
    # The swarm's work halfway through this peer's next batch.
    midpoint = before + batch + (batch + others_per_batch) / 2
    return Placement(close=midpoint >= target)
