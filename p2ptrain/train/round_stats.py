"""Running figures of a trainer's averaging rounds, fed with each :class:`RoundOutcome`.

Plain attribute updates from the training thread; a metrics snapshot reads
them as they are (:func:`allreduce_collector`).
"""

from __future__ import annotations

from collections.abc import Callable

from p2ptrain.metrics import Sample, counter_sample
from p2ptrain.train.averaging import RoundOutcome

__all__ = ["RoundStats", "allreduce_collector"]


class RoundStats:
    """All-reduce rounds, their achieved and predicted seconds, bytes and failures.

    Attributes:
        rounds: All-reduces that returned a report.
        incomplete: Those of them where some part kept local values.
        members: Group sizes summed over those rounds.
        seconds: Achieved seconds (the report's ``total_s``) summed.
        predicted_rounds: Rounds whose plan carried a load-balancer prediction.
        predicted_seconds: Their predicted seconds summed.
        last_seconds: Achieved seconds of the latest round (``None`` before one).
        last_predicted_seconds: Its prediction, if it had one.
        last_group_size: Its group size.
        bytes_sent: Tensor bytes sent by all the rounds.
        bytes_received: Tensor bytes received.
        dropped: Members that rounds reported failed or excluded, summed.
        failures: Steps averaged locally because of an error, by stage
            (``"matchmaking"`` or ``"allreduce"``); being alone is no failure.
    """

    def __init__(self) -> None:
        self.rounds = 0
        self.incomplete = 0
        self.members = 0
        self.seconds = 0.0
        self.predicted_rounds = 0
        self.predicted_seconds = 0.0
        self.last_seconds: float | None = None
        self.last_predicted_seconds: float | None = None
        self.last_group_size = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.dropped = 0
        self.failures: dict[str, int] = {"matchmaking": 0, "allreduce": 0}

    def record(self, outcome: RoundOutcome) -> None:
        """Count one step's averaging."""
        report = outcome.report
        if report is None:
            stage = _failed_stage(outcome.fallback)
            if stage is not None:
                self.failures[stage] += 1
            return
        self.rounds += 1
        self.incomplete += int(not report.complete)
        self.members += len(report.members)
        self.seconds += report.total_s
        self.last_seconds = report.total_s
        self.last_predicted_seconds = report.predicted_s
        self.last_group_size = len(report.members)
        if report.predicted_s is not None:
            self.predicted_rounds += 1
            self.predicted_seconds += report.predicted_s
        self.bytes_sent += report.bytes_sent
        self.bytes_received += report.bytes_received
        self.dropped += len(outcome.dropped)


def _failed_stage(fallback: str | None) -> str | None:
    if fallback is None or fallback == "alone":
        return None
    return "matchmaking" if fallback.startswith("matchmaking") else "allreduce"


def allreduce_collector(stats: RoundStats) -> Callable[[], list[Sample]]:
    """A collector of a trainer's all-reduce rounds: results, predicted seconds, bytes.

    :class:`~p2ptrain.train.collaboration.Collaboration` registers one when
    given a registry (and records the achieved seconds of each round in the
    histogram ``p2ptrain_allreduce_seconds``).
    """

    def collect() -> list[Sample]:
        samples = [
            counter_sample(
                "p2ptrain_allreduce_rounds_total", stats.rounds - stats.incomplete, _DONE
            ),
            counter_sample("p2ptrain_allreduce_rounds_total", stats.incomplete, _PARTLY),
            counter_sample("p2ptrain_allreduce_predicted_seconds_count", stats.predicted_rounds),
            counter_sample("p2ptrain_allreduce_predicted_seconds_sum", stats.predicted_seconds),
            counter_sample("p2ptrain_allreduce_members_total", stats.members),
            counter_sample("p2ptrain_allreduce_bytes_sent_total", stats.bytes_sent),
            counter_sample("p2ptrain_allreduce_bytes_received_total", stats.bytes_received),
            counter_sample("p2ptrain_allreduce_peers_dropped_total", stats.dropped),
        ]
        for stage, count in sorted(dict(stats.failures).items()):
            samples.append(
                counter_sample("p2ptrain_allreduce_failures_total", count, {"stage": stage})
            )
        if stats.last_seconds is not None:
            samples.append(Sample("p2ptrain_allreduce_last_seconds", stats.last_seconds))
            samples.append(Sample("p2ptrain_allreduce_last_group_size", stats.last_group_size))
        if stats.last_predicted_seconds is not None:
            samples.append(
                Sample("p2ptrain_allreduce_last_predicted_seconds", stats.last_predicted_seconds)
            )
        return samples

    return collect


_DONE = {"result": "complete"}
_PARTLY = {"result": "incomplete"}
