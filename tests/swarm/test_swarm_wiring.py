"""The wiring rule and the commit ledger, as pure logic."""

from __future__ import annotations

import collections
import random

import pytest

from p2ptrain.errors import ConfigError
from p2ptrain.swarm import Candidate, LinkStats, PipelineModel, choose_peer, even_bounds
from p2ptrain.swarm.ledger import CommitLedger, Receipts


def test_earliest_expected_completion_serves_peers_in_proportion_to_speed() -> None:
    # A discrete-time queue model: peers drain their backlog at their rate; a
    # stream of micro-batches of 8 samples arrives at 105 % of the total rate (the
    # stage is the bottleneck: below saturation the rule prefers the fastest).
    rates = {"slow": 10.0, "mid": 20.0, "fast": 40.0}
    backlog = dict.fromkeys(rates, 0.0)  # samples
    served = dict.fromkeys(rates, 0)
    rng = random.Random(0)
    dt, arrivals = 0.01, 0.0
    for _ in range(20_000):
        arrivals += 1.05 * sum(rates.values()) * dt / 8
        while arrivals >= 1:
            arrivals -= 1
            candidates = [Candidate(a, r, round(backlog[a] / 8)) for a, r in rates.items()]
            chosen = choose_peer(candidates, {}, samples=8, now=0.0, rng=rng, jitter=0.2)
            assert chosen is not None
            backlog[chosen.address] += 8
            served[chosen.address] += 8
        for address, rate in rates.items():
            backlog[address] = max(0.0, backlog[address] - rate * dt)
    total = sum(served.values())
    for address, rate in rates.items():
        share = served[address] / total
        assert share == pytest.approx(rate / sum(rates.values()), abs=0.05), served


def test_an_unmeasured_newcomer_is_costed_like_the_stage_and_not_flooded() -> None:
    """Before any reply, a peer with no rate counts at the stage's median service
    time: a trainer's burst of choices spreads over the peers instead of all going
    to the newcomer (whose backlog used to cost nothing)."""
    peers = [Candidate(f"p{i}", 8.0, 0) for i in range(3)] + [Candidate("new", 0.0, 0)]
    stats: dict[str, LinkStats] = {}
    rng = random.Random(1)
    picks: collections.Counter[str] = collections.Counter()
    for _ in range(40):  # calls in flight, none returned yet
        chosen = choose_peer(peers, stats, samples=8, now=0.0, rng=rng, jitter=0.2)
        assert chosen is not None
        picks[chosen.address] += 1
        stats.setdefault(chosen.address, LinkStats()).in_flight += 1
    assert 6 <= picks["new"] <= 14, picks  # about a quarter, not all 40
    assert all(6 <= picks[f"p{i}"] <= 14 for i in range(3)), picks
    # Alone in its stage, an unmeasured peer still gets the work.
    only = choose_peer([Candidate("new", 0.0, 5)], {}, samples=8, now=0.0, rng=rng, jitter=0.2)
    assert only is not None and only.address == "new"


def test_failed_peers_are_avoided_until_none_other_is_left() -> None:
    rng = random.Random(1)
    candidates = [Candidate("a", 10.0, 0), Candidate("b", 10.0, 0)]
    stats = {"a": LinkStats(avoid_until=5.0)}
    for _ in range(20):
        chosen = choose_peer(candidates, stats, samples=4, now=1.0, rng=rng, jitter=0.5)
        assert chosen is not None and chosen.address == "b"
    only = choose_peer(candidates[:1], stats, samples=4, now=1.0, rng=rng, jitter=0.5)
    assert only is not None and only.address == "a"
    assert choose_peer([], {}, samples=4, now=0.0, rng=rng, jitter=0.5) is None


def test_the_ledger_says_which_commits_a_step_counted_and_which_were_lost() -> None:
    ledger = CommitLedger()
    for _ in range(3):
        ledger.commit()
    ledger.handed(24)  # commits 1-3
    ledger.stepped(24)
    assert ledger.announced().fate(3) == "counted"
    for _ in range(2):
        ledger.commit()
    ledger.handed(16)  # commits 4-5, then the swarm's state replaced them
    ledger.lose_handed()
    ledger.commit()  # 6: not handed yet
    receipts = ledger.announced()
    assert [receipts.fate(s) for s in (3, 4, 5, 6)] == ["counted", "lost", "lost", "pending"]
    ledger.lose_unresolved()  # leaving the stage
    assert ledger.announced().fate(6) == "lost"
    wire = Receipts.from_wire(ledger.announced().to_wire())
    assert wire == ledger.announced()
    assert Receipts.from_wire({"inc": "x", "cs": -1, "ls": []}) is None
    assert Receipts.from_wire({"inc": "x", "cs": 1, "ls": [[1, True]]}) is None


def test_receipts_say_what_was_handed_toward_which_step_and_settle_either_way() -> None:
    ledger = CommitLedger()
    for _ in range(3):
        ledger.commit()
    ledger.handed(24)  # commits 1-3 go to the optimizer at its step 7
    ledger.commit()  # 4: not handed
    ahead = ledger.announced(7)
    assert (ahead.contributed, ahead.handed, ahead.step) == (0, 3, 7)
    assert [ahead.in_doubt(s) for s in (1, 3, 4)] == [True, True, False]
    assert Receipts.from_wire(ahead.to_wire()) == ahead
    counted, not_counted = ahead.settled(True), ahead.settled(False)
    assert [counted.fate(s) for s in (3, 4)] == ["counted", "pending"]
    assert [not_counted.fate(s) for s in (1, 3, 4)] == ["lost", "lost", "pending"]
    ledger.stepped(24)
    after = ledger.announced(8)
    assert (after.contributed, after.handed) == (3, 3)  # nothing in doubt
    assert after.settled(False) == after
    # An old server's receipts (no "hd"/"st") hold nothing in doubt; bad values are refused.
    assert Receipts.from_wire({"inc": "x", "cs": 2, "ls": []}) == Receipts("x", 2, (), 2, 0)
    assert Receipts.from_wire({"inc": "x", "cs": 2, "ls": [], "hd": -1}) is None
    assert Receipts.from_wire({"inc": "x", "cs": 2, "ls": [], "st": True}) is None


def test_blocks_are_cut_evenly_and_bad_partitions_are_refused() -> None:
    assert even_bounds(4, 4) == (0, 1, 2, 3, 4)
    assert even_bounds(5, 2) == (0, 2, 5) or even_bounds(5, 2) == (0, 3, 5)
    with pytest.raises(ConfigError):
        even_bounds(2, 3)
    with pytest.raises(ConfigError, match="bounds"):
        PipelineModel((lambda: None,) * 2, (0, 2, 2))  # type: ignore[arg-type, return-value]


def test_a_server_that_vanished_before_it_ever_answered_lost_every_commit() -> None:
    # Its passes must be replayed, not wait forever as "pending" (the trainer had
    # seen no receipts of it when it died).
    from p2ptrain.swarm.trainer import _gone

    never_seen = _gone(None)
    assert [never_seen.fate(seq) for seq in (1, 2, 10_000)] == ["lost"] * 3
    seen = Receipts("inc", 4, ((2, 2),))
    after = _gone(seen)
    assert [after.fate(seq) for seq in (1, 2, 4, 5, 99)] == [
        "counted",
        "lost",
        "counted",
        "lost",
        "lost",
    ]
