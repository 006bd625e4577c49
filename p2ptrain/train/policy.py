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
4. The swarm is ready: **step**.
5. Blocked: **wait** for the swarm (matchmaking ahead when :func:`step_is_near`).
6. The estimated time to the step is below ``lead_time``: **prepare**
   (matchmake in the background while computing the last batches).
7. Otherwise **continue**.
"""

from __future__ import annotations

import enum

from p2ptrain.errors import ConfigError
from p2ptrain.train.progress import SwarmProgress

__all__ = ["Action", "decide", "step_is_near"]


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
    if swarm.ready:
        return Action.STEP
    if blocked:
        return Action.WAIT
    return Action.PREPARE if step_is_near(swarm, lead_time) else Action.CONTINUE


def step_is_near(swarm: SwarmProgress, lead_time: float) -> bool:
    """Whether the swarm's next step is due within ``lead_time`` seconds (0: never near)."""
    return lead_time > 0 and swarm.eta_s <= lead_time
