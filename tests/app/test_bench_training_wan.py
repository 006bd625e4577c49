"""``bench_training.py --wan`` end to end: two real peers in the shaped star lab (root)."""

from __future__ import annotations

import json

import pytest
from conftest import run_module
from doccheck import ROOT

from p2ptrain.examples.charlm.model import ModelConfig, make_model
from p2ptrain.testing.natlab_plugin import require_netns


@pytest.mark.netns
@pytest.mark.slow
def test_two_overlapped_peers_train_through_shaped_links() -> None:
    require_netns()
    width, steps = 32, 2
    done = run_module(
        *("benchmarks.bench_training", "--wan", "--systems", "p2ptrain_overlap"),
        *("--peers", "2", "--steps", str(steps), "--batch", "4", "--target", "8"),
        *("--width", str(width), "--layers", "1", "--heads", "2", "--lr", "0.01"),
        *("--warmup", "1", "--eval-windows", "4"),
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    wan = json.loads(done.stdout.splitlines()[-1])["wan"]
    run = wan["p2ptrain_overlap"]
    assert run["global_steps"] >= steps
    assert run["samples"] >= steps * 8
    # Every step's fp16 all-reduce moved at least the whole vector out of each
    # peer (half in the reduce-scatter, half in the all-gather), through the
    # upload shaper whose counters give mb_sent_per_peer.
    model = make_model(ModelConfig(d_model=width, n_layers=1, n_heads=2))
    params = sum(p.numel() for p in model.parameters())
    assert run["mb_sent_per_peer"] >= steps * 2 * params / 1e6
    assert 0 < run["comm_fraction"] < 1
    losses = run["losses"]  # [step, seconds since go, samples, held-out loss]
    assert losses[0][:1] == [0] and losses[0][2] == 0
    assert [row[0] for row in losses] == sorted(row[0] for row in losses)
    assert losses[-1][0] >= steps and losses[-1][2] >= steps * 8
    assert run["final_loss"] < losses[0][3]  # two steps at lr 0.01 lower the loss


def _system(comm: float, losses: list[list[float]]) -> dict[str, object]:
    return {"comm_fraction": comm, "final_samples": losses[-1][2], "losses": losses}


def test_repeated_pairs_are_checked_on_their_mean_and_listed_one_by_one() -> None:
    from benchmarks.training.runner import checks

    sync = _system(0.5, [[0, 0, 0, 4.0], [1, 1, 100, 2.0]])
    sync["repeats"] = [_system(0.4, [[0, 0, 0, 4.0], [1, 1, 100, 2.0]])]
    # Pair 1: overlap 1.01x at 100 samples; pair 2: 1.04x, interpolated at 100
    # of its 200 samples (3.0 + (1.16 - 3.0) / 2 = 2.08).
    overlap = _system(0.05, [[0, 0, 0, 4.0], [1, 1, 100, 2.02]])
    overlap["repeats"] = [_system(0.06, [[0, 0, 0, 3.0], [1, 1, 200, 1.16]])]
    found = checks({"p2ptrain_sync": sync, "p2ptrain_overlap": overlap})
    assert found["pairs"] == 2
    assert found["overlap_loss_vs_sync_per_pair"] == pytest.approx([1.01, 1.04])
    assert found["overlap_loss_vs_sync"] == pytest.approx(1.025)
    assert found["overlap_loss_within_2pct"] is False
    assert found["overlap_comm_vs_sync_per_pair"] == pytest.approx([0.1, 0.15])
    assert found["overlap_hides_80pct"] is True
