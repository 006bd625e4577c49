"""What a peer does after each local batch: the decision rule of the trainers (pure).

Given this peer's step, its accumulated samples, whether it is blocked (it
accumulated all it may toward this step) and the swarm's progress, it
either keeps computing, starts matchmaking ahead of the step, waits, steps,
or downloads the swarm's state. The rules, in order:

1. Behind the swarm by more than ``sync_tolerance`` steps: **sync** (the
   gradients it accumulated were computed on stale parameters).
2. Behind by at most that, with nothing accumulated: **sync** (there is
   nothing to contribute, and joining the old step's group would be late).
3. Behind by at most that, with samples: **step** now; the group for its
   step may still be forming. (If it is not, the averaging finds no group
   and the trainer syncs rather than apply its gradients alone.)
4. The swarm is ready, or this peer closed its step (the step cut): **step**.
5. Blocked: **wait** for the swarm (matchmaking ahead when :func:`step_is_near`).
6. The estimated time to the step is below ``lead_time``: **prepare**
   (matchmake in the background while computing the last batches).
7. Otherwise **continue**.
"""

from __future__ import annotations

import enum

from p2ptrain.errors import ConfigError
from p2ptrain.train.progress import SwarmProgress

__all__ = ["Action", "LeadTimer", "decide", "step_is_near"]


class Action(enum.Enum):
    """What to do next."""

    CONTINUE = "continue"
    """Compute the next batch."""
    PREPARE = "prepare"
    """Compute the next batch and matchmake for the step meanwhile."""
    WAIT = "wait"
    """Wait for the swarm (matchmaking ahead when the step is near)."""
    STEP = "step"
    """Average with the swarm and apply the step now."""
    SYNC = "sync"
    """Download the swarm's state; drop what was accumulated."""


def decide(
    *,
    local_step: int,
    local_samples: int,
    blocked: bool,
    swarm: SwarmProgress,
    lead_time: float,
    sync_tolerance: int = 1,
    closed: bool = False,
) -> Action:
    """The next action of a peer (see the module docstring for the rules).

    Args:
        local_step: This peer's global step.
        local_samples: Samples it accumulated toward its next step.
        blocked: It may not accumulate more before the step.
        swarm: The swarm's progress, this peer's latest record included.
        lead_time: Start matchmaking when the step is estimated to be this
            many seconds away or less; 0 disables it.
        sync_tolerance: Steps a peer may lag behind and still join a step;
            0 makes any lag a sync (a peer that never synced).
        closed: This peer closed its step (the step cut, :mod:`p2ptrain.train.cut`):
            it steps as when the swarm is ready.

    Raises:
        ConfigError: A negative argument.
    """
    if local_step < 0 or local_samples < 0 or sync_tolerance < 0 or not lead_time >= 0:
        raise ConfigError("decide() takes non-negative arguments")
    behind = swarm.global_step - local_step
    if behind > sync_tolerance:
        return Action.SYNC
    if behind > 0:
        return Action.STEP if local_samples > 0 else Action.SYNC
    if swarm.ready or closed:
        return Action.STEP
    if blocked:
        return Action.WAIT
    return Action.PREPARE if step_is_near(swarm, lead_time) else Action.CONTINUE


def step_is_near(swarm: SwarmProgress, lead_time: float) -> bool:
    """Whether the swarm's next step is due within ``lead_time`` seconds (0: never near)."""
    return lead_time > 0 and swarm.eta_s <= lead_time


class LeadTimer:
    """How long before a step's estimated moment matchmaking starts, from measurement.

    The lead is ``margin`` times a moving average of the durations of this
    peer's recent matchmakings (from their start, early or not, to the
    group's plan), plus the time the others need to see a new record
    (``read_interval``). Before the first measurement it is ``initial``.
    It stays within ``[low, high]``.

    Args:
        initial: The lead before any matchmaking was measured.
        read_interval: Seconds until the others read a new record.
        low: The least lead.
        high: The most lead (e.g. the matchmaking window).
        margin: Multiplies the average duration.
        smoothing: Weight of a new measurement in the average.
    """

    def __init__(
        self,
        *,
        initial: float,
        read_interval: float,
        low: float,
        high: float,
        margin: float = 1.5,
        smoothing: float = 0.3,
    ) -> None:
        if not 0 <= low <= high or not 0 < smoothing <= 1 or margin <= 0 or read_interval < 0:
            raise ConfigError("LeadTimer takes 0 <= low <= high, margin > 0, smoothing in (0, 1]")
        self.read_interval = read_interval
        self.low, self.high = low, high
        self.margin = margin
        self.smoothing = smoothing
        self._initial = min(high, max(low, initial))
        self._average: float | None = None

    def record(self, matchmaking_s: float) -> None:
        """Count one matchmaking that formed a group in ``matchmaking_s`` seconds."""
        if not matchmaking_s >= 0:
            return
        if self._average is None:
            self._average = matchmaking_s
        else:
            self._average += self.smoothing * (matchmaking_s - self._average)

    @property
    def average_s(self) -> float | None:
        """The moving average of the measured durations (``None`` before one)."""
        return self._average

    @property
    def value(self) -> float:
        """The lead in seconds."""
        if self._average is None:
            return self._initial
        lead = self.margin * self._average + self.read_interval
        return min(self.high, max(self.low, lead))
