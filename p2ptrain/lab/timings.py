"""Matchmaking and progress timings for peers on one machine or on a lab's links.

The library's defaults (:class:`~p2ptrain.allreduce.matchmaking.MatchmakingConfig`,
:class:`~p2ptrain.train.progress.ProgressConfig`) are for peers across the
internet: seconds of patience for round trips of tens of milliseconds, for
joins and for slow members. Peers on loopback, in the lab's network
namespaces or on the simulated network reach each other within a
millisecond, and a test or a benchmark wants a round to end, or to fail,
within seconds. The presets here are the timings that the tests and the
benchmarks share, defined once; one that only one test needs stays with
that test (``dataclasses.replace`` adjusts a field).
"""

from __future__ import annotations

from p2ptrain.allreduce.matchmaking import MatchmakingConfig
from p2ptrain.train.progress import ProgressConfig

__all__ = ["QUICK_MATCHMAKING", "QUICK_PROGRESS", "TRAINING_MATCHMAKING"]

TRAINING_MATCHMAKING = MatchmakingConfig(window=2.0, poll_interval=0.05, plan_timeout=5.0)
"""Peers that train together: a step's group gathers for 2 s, announcements are
read every 50 ms, a member waits 5 s for the plan; the library's deadlines
otherwise. ``p2ptrain train`` gives its peers the same (with its default
``--matchmaking-window``; a test keeps the two equal), so a benchmark that
times training steps times what the command does."""

QUICK_MATCHMAKING = MatchmakingConfig(
    window=0.3,
    poll_interval=0.05,
    ready_timeout=2.0,
    plan_timeout=5.0,
    reduce_timeout=5.0,
    round_timeout=10.0,
)
"""Groups that form within a second and rounds that end, or fail, within 10 s:
matchmaking tests, and peers whose averaging runs beside other work (the
pipeline's stage optimizers)."""

QUICK_PROGRESS = ProgressConfig(
    publish_interval=0.2,
    heartbeat_interval=1.0,
    expiration=5.0,
    min_fetch_interval=0.1,
    max_fetch_interval=0.5,
)
"""Progress that the swarm sees within half a second; a peer whose records stop
for 5 s counts as gone (a killed peer is noticed quickly)."""
