"""The step cut: a step holds the target batch, and no sample is lost or counted twice.

Pure parts (where a batch goes, the swarm's estimate, the matchmaking lead,
the step's total weight read from the all-reduce) are tested with plain
calls; the accounting is tested with real peer processes
(tests/train_worker.py) training with the default step policy.
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest
import torch
from train_worker import WorkerProcess, peer_with_absent_partner

from p2ptrain.allreduce.report import AllReduceReport, ShardReport
from p2ptrain.errors import ConfigError
from p2ptrain.secure.identity import Identity
from p2ptrain.train.averaging import RoundOutcome, group_weight
from p2ptrain.train.config import TrainerConfig
from p2ptrain.train.cut import Placement, StepPolicy, place_batch
from p2ptrain.train.optimizer import CollaborativeOptimizer
from p2ptrain.train.policy import Action, LeadTimer, decide
from p2ptrain.train.progress import PeerProgress, aggregate

START_TIMEOUT = 60.0  # importing torch on 2 busy cores

IDS = [Identity.generate().peer_id for _ in range(4)]


# -- where a batch goes ---------------------------------------------------------------------


def place(policy: StepPolicy, **kw: Any) -> Placement:
    args: dict[str, Any] = {
        "target": 256,
        "own": 0,
        "batch": 16,
        "others": 0,
        "swarm_closed": False,
        "others_per_batch": 0.0,
    }
    args.update(kw)
    return place_batch(policy=policy, **args)


def test_carry_closes_a_step_where_wait_does() -> None:
    """The policies differ only after the close (the batch that just ended always
    counts toward its step: carrying it made it one step stale on unpredicted
    parameters, and cost 3-4 % of loss on the --wan benchmark)."""
    cases = [
        {"own": 32, "others": 200},
        {"own": 32, "others": 200, "others_per_batch": 40.0},
        {"own": 224},
        {"own": 240},
        {"own": 64, "others": 192},
        {"own": 16, "swarm_closed": True},
    ]
    for case in cases:
        assert place(StepPolicy.CARRY, **case) == place(StepPolicy.WAIT, **case), case
    assert place(StepPolicy.CARRY, own=64, others=192) == Placement(close=True)
    assert place(StepPolicy.CARRY, own=16, swarm_closed=True) == Placement(close=True)
    assert place(StepPolicy.CARRY, own=16, others=200) == Placement(close=False)  # 240 halfway


def test_wait_closes_when_the_swarm_passes_the_target_in_the_first_half_of_the_next_batch() -> None:
    # 116 now; the others add 150 while this peer computes one more batch of 16:
    # halfway through it the swarm holds 116 + (16 + 150) / 2 = 199 < 256: compute it.
    assert place(StepPolicy.WAIT, own=50, others=50, others_per_batch=150.0) == Placement(
        close=False
    )
    # ... with others adding 300: 116 + 158 = 274 >= 256 halfway: close now, at 116.
    assert place(StepPolicy.WAIT, own=50, others=50, others_per_batch=300.0) == Placement(
        close=True
    )
    # A lone peer stops on the batch that ends nearest the target: exactly 256 here.
    assert place(StepPolicy.WAIT, own=224) == Placement(close=False)  # 240 + 8
    assert place(StepPolicy.WAIT, own=240) == Placement(close=True)  # 256 + 8
    # Halfway counts: 100 samples short with 200 expected in the next batch time.
    assert place(StepPolicy.WAIT, own=0, others=140, others_per_batch=184.0).close  # 156 + 100
    assert not place(StepPolicy.WAIT, own=0, others=139, others_per_batch=184.0).close
    # A batch past the cut is never thrown away: under "wait" it is added.
    assert place(StepPolicy.WAIT, own=64, others=300) == Placement(close=True)


def _simulate_steps(
    rates: list[float],
    *,
    target: int,
    batch: int,
    lockstep: bool,
    seed: int,
    steps: int = 200,
    delay: float = 0.0,
) -> list[int]:
    """Steps of peers that follow place_batch with exact estimates of each other's work.

    Peer ``i`` computes batches of ``batch`` samples at ``rates[i]`` samples/s
    (each batch's time varies by +-20 %); after a step every peer starts at
    once (``lockstep``) or at a random phase. A closed peer's flag reaches
    the others ``delay`` seconds later. Returns the samples of every step.
    """
    rng = random.Random(seed)
    totals = []
    n = len(rates)
    for _ in range(steps):
        duration = [batch / r * rng.uniform(0.8, 1.2) for r in rates]
        start = [0.0 if lockstep else -rng.uniform(0, d) for d in duration]
        end = [s + d for s, d in zip(start, duration, strict=True)]
        done = [0] * n
        closed_at: list[float | None] = [None] * n
        while not all(c is not None for c in closed_at):
            i = min((k for k in range(n) if closed_at[k] is None), key=lambda k: end[k])
            now = end[i]
            own = done[i]
            # The others' work now: their batches, and the fraction of the one in progress.
            others = 0.0
            for j in range(n):
                if j == i:
                    continue
                others += done[j]
                if closed_at[j] is None:
                    others += batch * max(0.0, now - start[j]) / duration[j]
            swarm_closed = any(c is not None and c + delay <= now for c in closed_at)
            opb = sum(rates[j] for j in range(n) if j != i and closed_at[j] is None)
            placement = place_batch(
                policy=StepPolicy.WAIT,
                target=target,
                own=own,
                batch=batch,
                others=int(others),
                swarm_closed=swarm_closed,
                others_per_batch=opb * batch / rates[i],
            )
            done[i] += batch
            if placement.close:
                closed_at[i] = now
            else:
                duration[i] = batch / rates[i] * rng.uniform(0.8, 1.2)
                start[i], end[i] = now, now + duration[i]
        totals.append(sum(done))
    return totals


@pytest.mark.parametrize("lockstep", [True, False])
@pytest.mark.parametrize(("peers", "target"), [(4, 256), (8, 256), (4, 1024), (16, 256)])
def test_wait_steps_hold_the_target_on_average(peers: int, target: int, lockstep: bool) -> None:
    """The mean is the target (the rule before held target - (N - 1) * b / 2: 0.81x at 8x256)."""
    rng = random.Random(peers * target)
    rates = [rng.uniform(20.0, 40.0) for _ in range(peers)]
    totals = _simulate_steps(rates, target=target, batch=16, lockstep=lockstep, seed=target)
    mean = sum(totals) / len(totals)
    assert 0.95 * target <= mean <= 1.05 * target, mean
    assert max(totals) <= 1.25 * target, max(totals)


def test_a_slow_closed_flag_adds_at_most_a_batch_per_peer() -> None:
    rates = [30.0] * 8
    totals = _simulate_steps(rates, target=256, batch=16, lockstep=False, seed=1, delay=0.3)
    assert max(totals) <= 256 + 8 * 16
    assert 0.95 * 256 <= sum(totals) / len(totals) <= 1.10 * 256


def test_unbounded_never_closes() -> None:
    assert place(StepPolicy.UNBOUNDED, own=10_000, others=10_000) == Placement(close=False)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ConfigError):
        place(StepPolicy.CARRY, target=0)
    with pytest.raises(ConfigError):
        place(StepPolicy.CARRY, own=-1)
    with pytest.raises(ConfigError):
        TrainerConfig(run_id="r", target_batch_size=8, step_policy="sometimes")
    with pytest.raises(ConfigError, match="carry_batches"):
        TrainerConfig(run_id="r", target_batch_size=8, carry_batches=-1)


def test_a_closed_peer_steps_and_its_record_makes_the_swarm_ready() -> None:
    records = [
        PeerProgress(IDS[0], 3, 100, 50.0, 10.0, batch=16),
        PeerProgress(IDS[1], 3, 64, 50.0, 10.0, batch=16, closed=True),
    ]
    view = aggregate(records, target_batch_size=256, now=10.0)
    assert view.closed and view.ready
    open_view = aggregate(records[:1], target_batch_size=256, now=10.0)
    assert not open_view.ready
    action = decide(
        local_step=3, local_samples=100, blocked=False, swarm=open_view, lead_time=0.0, closed=True
    )
    assert action is Action.STEP


@pytest.mark.parametrize("carry_batches", [0, 2])
def test_carry_counts_at_most_carry_batches_toward_the_next_step_then_waits(
    carry_batches: int,
) -> None:
    """A peer whose step is averaging computes carry_batches batches more, then waits."""
    # The peer closes the step on its second batch: the partner, which states
    # no batch size, counts as one batch at the peer's own rate once that is known.
    batch, target = 4, 12
    # The partner is online at the same step (so the step averages in the
    # background) but never matchmakes: the group never forms.
    with peer_with_absent_partner(window=30.0, run_id="carry", target=target) as first:
        model = torch.nn.Linear(3, 1)
        config = TrainerConfig(
            run_id="carry",
            target_batch_size=target,
            step_policy="carry",
            carry_batches=carry_batches,
        )
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        with CollaborativeOptimizer(inner, peer=first, config=config) as trainer:
            calls, stop = 0, time.monotonic() + 3.0
            trainer.stop_at(stop)
            while time.monotonic() < stop:
                model(torch.ones(batch, 3)).sum().backward()
                trainer.step(batch)
                calls += 1
            carried = trainer.carried_samples
    assert trainer.global_step == 0  # the average never came
    # Two batches closed the step; then carry_batches batches were computed
    # while it averaged, and the next step() call waited until the stop time.
    assert (calls, carried) == (2 + carry_batches, batch * carry_batches)


# -- the swarm's estimate -------------------------------------------------------------------


def test_the_estimate_extrapolates_whole_batches_and_stops_at_closed_peers() -> None:
    records = [
        PeerProgress(IDS[0], 5, 32, 40.0, 100.0, batch=16),  # 0.75 s: 30 samples -> 1 batch
        PeerProgress(IDS[1], 5, 48, 40.0, 100.0, batch=16, closed=True),  # adds nothing more
        PeerProgress(IDS[2], 4, 80, 40.0, 100.0, batch=16),  # another step
        PeerProgress(IDS[3], 5, 16, 40.0, 100.0),  # no batch size said: one typical batch
    ]
    view = aggregate(records, target_batch_size=256, now=100.75)
    assert view.estimate_samples(5, exclude=None, now=100.75) == 32 + 16 + 48 + 16 + 16
    assert view.estimate_samples(5, exclude=IDS[0], now=100.75) == 48 + 16 + 16
    assert view.estimate_samples(4, exclude=None, now=100.75) == 80 + 16
    assert (
        view.estimate_samples(4, exclude=None, now=101.25) == 80 + 16 * 3
    )  # 50 samples: 3 whole batches
    # IDS[1] closed step 5 at t=100. Under "wait" it waits: nothing toward step 6 yet.
    assert view.estimate_samples(6, exclude=None, now=101.25) == 0
    # Under "carry" it computes up to carry_batches batches while step 5 averages:
    # 50 samples since it closed, 3 whole batches, as many as carry_batches allows.
    assert view.estimate_samples(6, exclude=None, now=101.25, carry_batches=5) == 48
    assert view.estimate_samples(6, exclude=None, now=101.25, carry_batches=2) == 32


def test_a_peer_without_a_rate_counts_one_batch_at_the_typical_rate() -> None:
    # The first step of a run: a peer whose first batch has not ended says no
    # rate. Counted as idle, it made the others add a batch each (8 x 256: 288-336).
    late = PeerProgress(IDS[3], 0, 0, 0.0, 100.0)  # started at t=100, no batch yet
    records = [
        PeerProgress(IDS[0], 0, 16, 30.0, 100.5, batch=16),
        PeerProgress(IDS[1], 0, 16, 34.0, 100.5, batch=16),
        late,
    ]
    view = aggregate(records, target_batch_size=256, now=100.25)
    assert view.typical() == (32.0, 16.0)
    assert view.unstated_rate(0) == 32.0
    assert view.unstated_rate(0, exclude=IDS[3]) == 0.0
    # 0.25 s at 32 samples/s: 8 samples of its first batch (whole batches: none yet).
    assert view.estimate_samples(0, exclude=IDS[0], now=100.25, partial=True) == 16 + 8
    assert view.estimate_samples(0, exclude=IDS[0], now=100.25) == 16
    # Never more than that one batch, however long it takes (it may be loading).
    pair = aggregate([records[0], late], target_batch_size=256, now=110.0)
    assert pair.estimate_samples(0, exclude=IDS[0], now=100.25, partial=True) == 7  # 30/s
    assert pair.estimate_samples(0, exclude=IDS[0], now=110.0, partial=True) == 16
    assert pair.estimate_samples(0, exclude=IDS[0], now=110.0) == 16
    # Nobody stated a rate: nothing to extrapolate from.
    alone = aggregate([late], target_batch_size=256, now=101.0)
    assert alone.typical() is None and alone.unstated_rate(0) == 0.0
    assert alone.estimate_samples(0, exclude=None, now=101.0, partial=True) == 0


def test_a_closed_peer_counts_toward_the_next_step_from_when_it_stepped() -> None:
    # Measured: counting a closed "wait" peer from the time it closed (2-4 s of
    # averaging before) made the others close the next step after one batch.
    records = [PeerProgress(IDS[0], 5, 48, 40.0, 100.0, batch=16, closed=True)]
    view = aggregate(records, target_batch_size=256, now=103.5)
    # The reader stepped to 6 at t=103: 0.5 s at 40 samples/s since, one whole batch.
    assert view.estimate_samples(6, exclude=None, now=103.5, stepped_at=103.0) == 16
    # ... 20 samples of work, batch in progress included.
    assert view.estimate_samples(6, exclude=None, now=103.5, stepped_at=103.0, partial=True) == 20
    # Under "carry" one batch computed while averaging, then the same from the step.
    assert (
        view.estimate_samples(6, exclude=None, now=103.5, stepped_at=103.0, carry_batches=1)
        == 16 + 16
    )


def test_under_carry_a_record_from_before_the_close_counts_what_its_peer_carried() -> None:
    # The partner's latest record (t=100, step 5, not closed) predates its close.
    # The reader closed step 5 at t=100.5 and stepped at t=102; the partner most
    # likely closed about then too and carried batches while step 5 averaged.
    records = [PeerProgress(IDS[0], 5, 48, 16.0, 100.0, batch=8)]
    view = aggregate(records, target_batch_size=128, now=102.5)
    kw: dict[str, Any] = {"exclude": None, "now": 102.5, "stepped_at": 102.0, "partial": True}
    # Without the carry: only the 0.5 s since the step, 8 samples of work.
    assert view.estimate_samples(6, **kw) == 8
    assert view.estimate_samples(6, **kw, closed_at=100.5) == 8  # "wait": nothing carried
    # With it: 1.5 s from the close to the step at 16/s (24 samples, up to 4
    # batches of 8), plus the 8 since the step.
    assert view.estimate_samples(6, **kw, carry_batches=4, closed_at=100.5) == 24 + 8
    assert view.estimate_samples(6, **kw, carry_batches=2, closed_at=100.5) == 16 + 8
    # Not known when the reader closed: as before.
    assert view.estimate_samples(6, **kw, carry_batches=4) == 8


def test_the_work_estimate_counts_the_batches_in_progress() -> None:
    records = [
        PeerProgress(IDS[0], 5, 32, 40.0, 100.0, batch=16),  # 0.5 s: 20 samples of work
        PeerProgress(IDS[1], 5, 16, 0.0, 100.0, batch=16),  # no rate: one batch at 40/s
        PeerProgress(IDS[2], 5, 64, 40.0, 99.0, batch=16, closed=True),  # adds nothing more
    ]
    view = aggregate(records, target_batch_size=256, now=100.5)
    assert view.estimate_samples(5, exclude=None, now=100.5) == 32 + 16 + 16 + 16 + 64
    assert view.estimate_samples(5, exclude=None, now=100.5, partial=True) == 32 + 20 + 32 + 64


def test_new_record_fields_survive_the_wire() -> None:
    record = PeerProgress(
        IDS[0], 7, 96, 12.5, 3.0, batch=16, closed=True, last_step_samples=260, target=256
    )
    assert PeerProgress.from_wire(IDS[0], record.to_wire()) == record
    old = {"s": 1, "n": 2, "r": 3.0, "t": 4.0}  # a record of a peer without these fields
    parsed = PeerProgress.from_wire(IDS[0], old)
    assert (parsed.batch, parsed.closed, parsed.last_step_samples, parsed.target) == (
        0,
        False,
        None,
        None,
    )


# -- the matchmaking lead -------------------------------------------------------------------


def test_the_lead_follows_measured_matchmaking_durations() -> None:
    lead = LeadTimer(initial=1.0, read_interval=0.2, low=0.2, high=2.0, smoothing=0.5)
    assert lead.value == 1.0 and lead.average_s is None
    lead.record(0.2)
    assert lead.value == pytest.approx(1.5 * 0.2 + 0.2)
    lead.record(0.4)
    assert lead.average_s == pytest.approx(0.3)
    assert lead.value == pytest.approx(1.5 * 0.3 + 0.2)
    for _ in range(20):
        lead.record(5.0)
    assert lead.value == 2.0  # never above the window


# -- the step's samples, read from the all-reduce ------------------------------------------


def report(contributors: tuple[int, ...] | None, *, length: int) -> AllReduceReport:
    shards = (
        ShardReport(0, 0, length // 2, ((0, 1, 2),), {}, None),
        ShardReport(1, length // 2, length, ((0, 1), contributors), {}, None),
    )
    return AllReduceReport(b"r", tuple(IDS[:3]), 0, 64.0, shards, {}, 0, 0, 0, 0, 0, 0, 0, None)


def test_the_group_weight_is_read_from_the_marker() -> None:
    length = 10
    # Weights 64, 96 and 100 sent 1/64, 1/96 and 1/100: the weighted mean is 3 / 260.
    outcome = RoundOutcome(
        3, 3, 64.0, None, True, 0.1, 0.1, report=report((0, 1, 2), length=length)
    )
    assert group_weight(outcome, length=length, marker=3 / 260) == 260
    missing = RoundOutcome(3, 3, 64.0, None, False, 0.1, 0.1, report=report(None, length=length))
    assert group_weight(missing, length=length, marker=1 / 64) is None
    alone = RoundOutcome(3, 1, 48.0, "alone", False, 0.0, 0.0)
    assert group_weight(alone, length=length, marker=1 / 48) == 48


# -- the accounting, through real processes -------------------------------------------------


@pytest.mark.slow
def test_real_peers_hold_identical_parameters_and_count_every_sample_once() -> None:
    count, batch, steps = 3, 8, 8
    target = count * batch * 4
    job: dict[str, Any] = {
        "run_id": "cut",
        "target": target,
        "batch": batch,
        "steps": steps,
        "num_shards": count,
        # The one-batch bound holds while a peer reads the others' records
        # within a batch's time. With 0.05 s batches, on the CI's 2 cores
        # shared with the rest of the suite, a peer read the closing record
        # more than a batch late once and the step held 128 of 96 samples;
        # 0.1 s batches leave its loop thread twice the time.
        "compute_s": 0.1,
        "wait_go": True,
        # Every live member in every round: with the crash tests' 2 s reduce
        # deadline, a member not scheduled for 2 s on a loaded machine had its
        # part left out, and the step's total missed its share (a flake).
        "patient": True,
    }
    workers: list[WorkerProcess] = []
    try:
        workers.append(WorkerProcess({**job, "shard": 0, "initial_peers": []}))
        first = workers[0].next(START_TIMEOUT)["address"]
        for shard in range(1, count):
            workers.append(WorkerProcess({**job, "shard": shard, "initial_peers": [first]}))
        for worker in workers[1:]:
            worker.next(START_TIMEOUT)  # its address: it joined
        for worker in workers:
            worker.go()
        logs: list[list[dict[str, Any]]] = [[] for _ in workers]
        done: list[dict[str, Any]] = []
        for index, worker in enumerate(workers):
            while True:
                message = worker.next(START_TIMEOUT + 30.0 * steps)
                if "address" in message:
                    continue
                if message.get("done"):
                    done.append(message)
                    break
                logs[index].append(message)
    finally:
        for worker in workers:
            worker.kill()
    for log in logs:
        assert [m["step"] for m in log] == list(range(1, steps + 1))
        assert all(m["syncs"] == 0 and m["local_rounds"] == 0 for m in log)
    for step in range(steps):
        # identical parameters after every step
        assert len({log[step]["digest"] for log in logs}) == 1, f"step {step + 1}"
        # the total each peer read from the all-reduce is the sum of the peers' shares
        shares = sum(log[step]["own"] for log in logs)
        assert {log[step]["samples"] for log in logs} == {shares}
        assert shares <= target + count * batch  # at most one batch per peer past the target
    counted = sum(log[step]["own"] for log in logs for step in range(steps))
    computed = sum(d["computed"] for d in done)
    pending = sum(d["pending"] for d in done)
    # nothing lost, nothing counted twice: what was not counted is what the
    # peers still hold toward the unfinished step (it is less than a step).
    assert counted == computed - pending
    assert 0 <= pending < target + count * batch


def test_a_peer_one_step_behind_counts_from_when_the_reader_stepped() -> None:
    # The reader stepped to 6 at t=100.5; its view still holds the others' records
    # of step 5 (not yet re-read). IDS[0]'s record is older than the reader's step:
    # it most likely stepped in the same group and computes toward 6 since t=100.5.
    # IDS[1] wrote its step-5 record after the reader stepped: it lags, adds nothing.
    records = [
        PeerProgress(IDS[0], 5, 32, 40.0, 100.0, batch=16),
        PeerProgress(IDS[1], 5, 32, 40.0, 100.6, batch=16),
    ]
    view = aggregate(records, target_batch_size=256, now=101.5)
    # 1 s since t=100.5 at 40 samples/s: 40 samples, two whole batches of 16
    assert view.estimate_samples(6, exclude=None, now=101.5, stepped_at=100.5) == 32
    # Without the reader's step time, a record one step behind that did not close counts nothing.
    assert view.estimate_samples(6, exclude=None, now=101.5) == 0
