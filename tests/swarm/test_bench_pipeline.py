"""``p2ptrain bench pipeline --help`` runs through the command line (the run itself is long)."""

from __future__ import annotations

import subprocess
import sys


def test_the_pipeline_benchmark_answers_help_through_the_cli() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "p2ptrain", "bench", "pipeline", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "torch.distributed.pipelining" in done.stdout and "--sim256-peers" in done.stdout
