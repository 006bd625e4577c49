"""`p2ptrain demo --pipeline`: stage peers train a model none of them can hold."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_cli

from p2ptrain.app.pipeline_demo import (
    PipelineDemoConfig,
    PipelineDemoResult,
    StagePeerRun,
    format_stage_table,
    format_summary,
    model_budget,
)
from p2ptrain.errors import ConfigError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _event(t: float, committed: int, **fields: object) -> dict[str, object]:
    return {"event": "pipeline", "t": t, "committed": committed, **fields}


def test_every_peer_budget_is_below_the_model_and_fits_a_stage() -> None:
    from p2ptrain.app.pipeline import model_of, stage_bytes
    from p2ptrain.app.task import load_pipeline_task

    stages, model_mb, budget_mb = model_budget()
    task = load_pipeline_task()
    model = model_of(task)
    largest = max(stage_bytes(task, model, s) for s in range(model.num_stages)) / 1e6
    assert stages == model.num_stages >= 2
    assert largest <= budget_mb < model_mb


def test_the_stage_table_sums_each_stage_from_its_live_peers() -> None:
    a = StagePeerRun("peer-0", 0, events=[_event(0.0, 0), _event(10.0, 400, throughput=900.0)])
    b = StagePeerRun("peer-1", 0, events=[_event(0.0, 0), _event(10.0, 200, throughput=100.0)])
    c = StagePeerRun(
        "peer-2", 1, events=[_event(5.0, 0), _event(10.0, 300, queue=3, step=7, loss=2.5)]
    )
    gone = StagePeerRun("peer-3", 1, events=[_event(10.0, 999)], returncode=0)
    table = format_stage_table([a, b, c, gone])
    assert table is not None
    rows = [line.split() for line in table.splitlines()[2:]]
    assert rows[0][:4] == ["0", "2", "60.0", "1000"]  # 600 samples in 10 s; 900 + 100
    assert rows[1] == ["1", "1", "60.0", "0", "3", "7", "2.5000"]  # the exited peer left
    assert format_stage_table([StagePeerRun("peer-0", 0)]) is None


def test_the_verdict_needs_every_stage_stepping_and_the_loss_falling() -> None:
    def run(stage: int, losses: list[float], step: int = 3) -> StagePeerRun:
        events = [_event(float(i), i, loss=v, step=step) for i, v in enumerate(losses)]
        return StagePeerRun(f"peer-{stage}", stage, events=events, returncode=0)

    def result(*runs: StagePeerRun) -> PipelineDemoResult:
        return PipelineDemoResult(runs, model_mb=2.0, budget_mb=1.0, png=None, wall_s=1.0)

    assert result(run(0, [4.0, 3.0]), run(1, [4.1, 3.1])).ok
    assert not result(run(0, [3.0, 4.0]), run(1, [3.1, 4.1])).ok  # loss rose
    assert not result(run(0, [4.0, 3.0]), run(1, [4.1, 3.1], step=0)).ok  # stage 1 never stepped
    failed = run(1, [4.1, 3.1])
    failed.returncode = 1
    assert not result(run(0, [4.0, 3.0]), failed).ok
    text = format_summary(result(run(0, [4.0, 3.0]), run(1, [4.1, 3.1])))
    assert "demo OK" in text and "each peer's budget 1.00 MB" in text


@pytest.mark.parametrize(
    "kwargs", [{"peers": 1}, {"peers": 33}, {"seconds": 1.0}, {"batch_size": 0}]
)
def test_config_is_validated(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        PipelineDemoConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.slow
def test_the_pipeline_demo_trains_across_stage_peers(tmp_path: Path) -> None:
    png = tmp_path / "pipeline.png"
    done = run_cli(
        "demo", "--pipeline", "--peers", "4", "--seconds", "15", "--png", str(png), timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "so no peer can hold the whole model" in out
    assert "served samples/s" in out  # the live stage table
    assert "demo OK" in out
    assert png.read_bytes()[:8] == PNG_MAGIC
