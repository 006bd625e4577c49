"""Pure parts of progress tracking: records, aggregation, timing rules and the step policy."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2ptrain.errors import ConfigError, RemoteProtocolError
from p2ptrain.secure.identity import Identity, PeerID
from p2ptrain.train.policy import Action, decide, step_is_near
from p2ptrain.train.progress import (
    PeerProgress,
    ProgressConfig,
    RateMeter,
    aggregate,
    next_fetch_delay,
)
from p2ptrain.train.tracker import publish_due

IDS = sorted(Identity.from_seed(bytes([i]) * 32).peer_id for i in range(1, 6))
A, B, C, D, E = IDS
NOW = 1_000.0


def rec(
    peer: PeerID,
    step: int,
    samples: int,
    rate: float = 10.0,
    *,
    age: float = 0.0,
    blocked: bool = False,
) -> PeerProgress:
    return PeerProgress(peer, step, samples, rate, NOW - age, blocked, None)


# -- aggregation ---------------------------------------------------------------------------


def test_an_empty_swarm_has_nothing_to_do() -> None:
    swarm = aggregate([], target_batch_size=100, now=NOW)
    assert swarm.global_step == 0 and swarm.peers_online == 0
    assert not swarm.ready and swarm.eta_s == math.inf


def test_the_global_step_is_the_highest_and_only_its_samples_count() -> None:
    swarm = aggregate(
        [rec(A, 3, 40), rec(B, 4, 10), rec(C, 4, 25), rec(D, 2, 99)],
        target_batch_size=100,
        now=NOW,
    )
    assert swarm.global_step == 4
    assert swarm.samples_at_step == 35 and swarm.peers_at_step == 2
    assert swarm.peers_online == 4 and swarm.samples_per_s == 40.0
    assert not swarm.ready and not swarm.all_blocked
    assert [r.peer_id for r in swarm.records[:2]] == sorted([B, C])


def test_peers_that_left_count_as_gone_at_once() -> None:
    gone = PeerProgress(C, 9, 500, 50.0, NOW, left=True)
    swarm = aggregate([rec(A, 3, 40), rec(B, 3, 10), gone], target_batch_size=100, now=NOW)
    assert swarm.global_step == 3 and swarm.peers_online == 2
    assert swarm.samples_per_s == 20.0 and C not in {r.peer_id for r in swarm.records}
    assert PeerProgress.from_wire(C, gone.to_wire()) == gone
    described = PeerProgress(C, 9, 5, 1.0, NOW, model="0123456789abcdef")
    assert PeerProgress.from_wire(C, described.to_wire()) == described


def test_ready_when_the_target_is_reached() -> None:
    swarm = aggregate([rec(A, 1, 60), rec(B, 1, 40)], target_batch_size=100, now=NOW)
    assert swarm.ready and swarm.eta_s == 0.0


def test_ready_below_target_only_when_every_live_peer_waits() -> None:
    waiting = [rec(A, 1, 20, blocked=True), rec(B, 1, 20, blocked=True)]
    assert aggregate(waiting, target_batch_size=100, now=NOW).ready
    # One peer still at the previous step holds the step back.
    behind = [*waiting, rec(C, 0, 5, blocked=True)]
    assert not aggregate(behind, target_batch_size=100, now=NOW).ready
    # One peer still computing holds it back too.
    running = [*waiting, rec(C, 1, 5)]
    assert not aggregate(running, target_batch_size=100, now=NOW).ready
    # Without a target (DiLoCo), only "everyone waits" makes a step.
    assert aggregate(waiting, target_batch_size=None, now=NOW).ready
    assert not aggregate(running, target_batch_size=None, now=NOW).ready


def test_eta_extrapolates_running_peers_from_their_record_time() -> None:
    records = [rec(A, 1, 20, 10.0, age=1.0), rec(B, 1, 20, 30.0), rec(C, 1, 0, 50.0, blocked=True)]
    swarm = aggregate(records, target_batch_size=100, now=NOW)
    # 40 reported + 10 extrapolated for A; 50 more at 40 samples/s.
    assert swarm.eta_s == pytest.approx(50 / 40)
    stalled = aggregate([rec(A, 1, 20, 0.0)], target_batch_size=100, now=NOW)
    assert stalled.eta_s == math.inf
    overdue = aggregate([rec(A, 1, 90, 10.0, age=5.0)], target_batch_size=100, now=NOW)
    assert overdue.eta_s == 0.0 and not overdue.ready


def test_a_later_record_of_the_same_peer_replaces_the_earlier() -> None:
    swarm = aggregate([rec(A, 1, 10), rec(A, 2, 0)], target_batch_size=10, now=NOW)
    assert swarm.peers_online == 1 and swarm.global_step == 2


def test_the_group_expects_the_peers_at_its_step_and_one_behind() -> None:
    records = [
        rec(A, 3, 10),
        rec(B, 3, 0, 0.0),
        rec(C, 2, 10),  # its record may not show step 3 yet
        rec(D, 1, 10),  # too far behind: it will sync
        rec(E, 4, 0),  # already past step 3
    ]
    swarm = aggregate(records, target_batch_size=100, now=NOW)
    assert swarm.expected_in_group(3) == 3
    assert swarm.expected_in_group(3, exclude=A) == 2
    assert swarm.expected_in_group(4) == 3
    assert swarm.lagging(3) == 1 and swarm.lagging(2) == 0


def test_sources_are_peers_with_an_address_highest_step_first() -> None:
    records = [
        PeerProgress(A, 5, 0, 1.0, NOW, False, None),  # client mode: serves nothing
        PeerProgress(B, 4, 0, 1.0, NOW, False, f"{B}@127.0.0.1:1"),
        PeerProgress(C, 5, 0, 1.0, NOW, False, f"{C}@127.0.0.1:2"),
    ]
    swarm = aggregate(records, target_batch_size=10, now=NOW)
    assert [r.peer_id for r in swarm.sources()] == [C, B]
    assert [r.peer_id for r in swarm.sources(exclude=C)] == [B]


# -- the wire form -------------------------------------------------------------------------


def test_records_round_trip_through_their_wire_form() -> None:
    record = PeerProgress(A, 7, 123, 4.5, NOW, True, f"{A}@127.0.0.1:5")
    assert PeerProgress.from_wire(A, record.to_wire()) == record
    described = PeerProgress(
        A, 7, 0, 1.0, NOW, reach="nat:easy", upload_bytes_per_s=1e6, download_bytes_per_s=5e6
    )
    assert PeerProgress.from_wire(A, described.to_wire()) == described


@pytest.mark.parametrize(
    "value",
    [
        None,
        [],
        {"s": -1, "n": 0, "r": 0.0, "t": 0.0},
        {"s": True, "n": 0, "r": 0.0, "t": 0.0},
        {"s": 1, "n": 2**63, "r": 0.0, "t": 0.0},
        {"s": 1, "n": 0, "r": math.nan, "t": 0.0},
        {"s": 1, "n": 0, "r": 1.0, "t": "now"},
        {"s": 1, "n": 0, "r": 1.0, "t": 0.0, "b": 1},
        {"s": 1, "n": 0, "r": 1.0, "t": 0.0, "a": "nowhere"},
        {"s": 1, "n": 0, "r": 1.0, "t": 0.0, "a": f"{B}@127.0.0.1:5"},  # names another peer
        {"s": 1, "n": 0, "r": 1.0, "t": 0.0, "u": -5.0},
        {"s": 1, "n": 0, "r": 1.0, "t": 0.0, "d": math.inf},
        {"s": 1, "n": 0, "r": 1.0, "t": 0.0, "q": "x" * 100},
        {"s": 1, "n": 0, "r": 1.0, "t": 0.0, "x": 1},
        {"s": 1, "n": 0, "r": 1.0, "t": 0.0, "m": "x" * 65},
        {"s": 1, "n": 0, "r": 1.0, "t": 0.0, "m": 5},
    ],
)
def test_malformed_records_are_refused(value: object) -> None:
    with pytest.raises(RemoteProtocolError):
        PeerProgress.from_wire(A, value)


plain = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20), st.binary()
)


@given(st.dictionaries(st.sampled_from(["s", "n", "r", "t", "b", "a", "q", "u", "d", "x"]), plain))
def test_any_value_parses_or_is_refused_cleanly(value: dict[str, object]) -> None:
    try:
        record = PeerProgress.from_wire(A, value)
    except RemoteProtocolError:
        return
    assert record.step >= 0 and record.samples >= 0 and math.isfinite(record.time)


# -- timing rules --------------------------------------------------------------------------


def test_fetches_are_frequent_near_a_step_and_rare_far_from_it() -> None:
    config = ProgressConfig(min_fetch_interval=0.2, max_fetch_interval=5.0)
    near = aggregate([rec(A, 0, 90, 10.0)], target_batch_size=100, now=NOW)
    far = aggregate([rec(A, 0, 0, 1.0)], target_batch_size=100, now=NOW)
    assert next_fetch_delay(near, config, waiting=False) == pytest.approx(0.25)
    assert next_fetch_delay(far, config, waiting=False) == 5.0
    assert next_fetch_delay(far, config, waiting=True) == 0.2


def test_fetches_are_frequent_while_a_peer_is_a_step_behind_or_has_no_rate_yet() -> None:
    config = ProgressConfig(min_fetch_interval=0.2, max_fetch_interval=5.0)
    far = [rec(A, 1, 0, 1.0)]
    assert (
        next_fetch_delay(aggregate(far, target_batch_size=100, now=NOW), config, waiting=False)
        == 5.0
    )
    # B has not stepped in our view: it most likely did, its new record is not read yet.
    behind = aggregate([*far, rec(B, 0, 40, 1.0)], target_batch_size=100, now=NOW)
    assert next_fetch_delay(behind, config, waiting=False) == 0.2
    # The first batches of a run: samples accumulate, but C's rate is unknown.
    unknown = aggregate([rec(A, 0, 16, 1.0), rec(C, 0, 0, 0.0)], target_batch_size=1000, now=NOW)
    assert next_fetch_delay(unknown, config, waiting=False) == 0.2


def test_publication_rules() -> None:
    config = ProgressConfig(publish_interval=1.0, heartbeat_interval=5.0, expiration=20.0)
    old = rec(A, 1, 10)

    def due(new: PeerProgress, since: float, *, ready: bool = False) -> bool:
        return publish_due(new, old, since_publish=since, ready=ready, config=config)

    assert publish_due(old, None, since_publish=0.0, ready=False, config=config)
    assert not due(old, 0.1)
    assert due(old, 5.0)  # heartbeat
    assert due(rec(A, 2, 0), 0.1)  # a new step at once
    assert due(rec(A, 1, 10, blocked=True), 0.1)  # blocked at once
    assert publish_due(
        rec(A, 1, 5), rec(A, 1, 0), since_publish=0.1, ready=False, config=config
    )  # the first samples toward a step at once
    assert not due(rec(A, 1, 20), 0.5)  # more samples: rate-limited...
    assert due(rec(A, 1, 20), 1.0)
    assert due(rec(A, 1, 20), 0.5, ready=True)  # ...unless they complete the step


def test_rate_meter_is_a_moving_average() -> None:
    meter = RateMeter(0.5)
    assert meter.update(10, 0.0) == 0.0  # nothing measurable
    assert meter.update(10, 1.0) == 10.0  # the first measurement as is
    assert meter.update(15, 1.0) == 12.5  # within 2x of the average: averaged
    with pytest.raises(ConfigError):
        RateMeter(0.0)
    with pytest.raises(ConfigError):
        RateMeter(0.5, jump=1.0)


def test_rate_meter_follows_a_rate_that_jumps() -> None:
    # The first batches of a run are slow (warm-up); once the rate is more than
    # `jump` times the average, the average restarts from it instead of crawling.
    meter = RateMeter(0.2, jump=2.0)
    meter.update(2, 1.0)
    assert meter.update(30, 1.0) == 30.0
    assert meter.update(20, 1.0) == pytest.approx(28.0)  # back to averaging
    assert meter.update(10, 1.0) == 10.0  # a drop by more than 2x also replaces it


def test_a_rate_change_is_published_at_once() -> None:
    config = ProgressConfig(publish_interval=1.0)
    published = PeerProgress(IDS[0], 3, 16, 40.0, 100.0, batch=16)
    same_rate = dataclasses.replace(published, samples=32, samples_per_s=50.0)
    faster = dataclasses.replace(published, samples=32, samples_per_s=61.0)
    kwargs = {"since_publish": 0.1, "ready": False, "config": config}
    assert not publish_due(same_rate, published, **kwargs)
    assert publish_due(faster, published, **kwargs)
    assert publish_due(dataclasses.replace(faster, samples_per_s=26.0), published, **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"publish_interval": 0},
        {"expiration": 5.0, "heartbeat_interval": 5.0},
        {"min_fetch_interval": 2.0, "max_fetch_interval": 1.0},
        {"smoothing": 1.5},
        {"heartbeat_interval": math.inf},
    ],
)
def test_bad_progress_configs_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        ProgressConfig(**kwargs)


# -- the step policy -----------------------------------------------------------------------


def act(
    records: list[PeerProgress],
    *,
    step: int,
    samples: int,
    blocked: bool = False,
    lead: float = 1.0,
    tolerance: int = 1,
    target: int | None = 100,
) -> Action:
    swarm = aggregate(records, target_batch_size=target, now=NOW)
    return decide(
        local_step=step,
        local_samples=samples,
        blocked=blocked,
        swarm=swarm,
        lead_time=lead,
        sync_tolerance=tolerance,
    )


def test_policy_continues_prepares_waits_and_steps() -> None:
    me = rec(A, 2, 10, 10.0)
    assert act([me, rec(B, 2, 10, 10.0)], step=2, samples=10) is Action.CONTINUE
    near = [me, rec(B, 2, 75, 10.0)]  # 15 samples to go at 20/s
    assert act(near, step=2, samples=10) is Action.PREPARE
    assert act(near, step=2, samples=10, lead=0.0) is Action.CONTINUE
    assert step_is_near(aggregate(near, target_batch_size=100, now=NOW), 1.0)
    mine_blocked = rec(A, 2, 10, 10.0, blocked=True)
    assert act([mine_blocked, rec(B, 2, 10)], step=2, samples=10, blocked=True) is Action.WAIT
    assert act([me, rec(B, 2, 90)], step=2, samples=10) is Action.STEP


def test_policy_syncs_when_behind() -> None:
    me = rec(A, 2, 10)
    assert act([me, rec(B, 3, 0)], step=2, samples=10) is Action.STEP  # join the late group
    assert act([rec(A, 2, 0), rec(B, 3, 0)], step=2, samples=0) is Action.SYNC
    assert act([me, rec(B, 4, 0)], step=2, samples=10) is Action.SYNC  # too far behind
    assert act([me, rec(B, 3, 0)], step=2, samples=10, tolerance=0) is Action.SYNC  # fresh peer


def test_policy_rejects_negative_arguments() -> None:
    swarm = aggregate([], target_batch_size=1, now=NOW)
    with pytest.raises(ConfigError):
        decide(local_step=-1, local_samples=0, blocked=False, swarm=swarm, lead_time=0.0)
