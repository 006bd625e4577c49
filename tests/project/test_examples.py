"""The top-level examples run as their README says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_plain_loop_example_steps_with_a_scheduler_and_a_grad_scaler() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "plain_loop.py"), "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("global step")]
    assert [line.split(":")[0] for line in lines] == ["global step 1", "global step 2"]
    # the cosine schedule over 2 steps: half the initial rate after step 1, 0 after step 2
    assert lines[0].endswith("lr 1.50e-03") and lines[1].endswith("lr 0.00e+00"), lines
