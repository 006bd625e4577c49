"""README.md keeps its two commands on top, and .ci/run runs the test one."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.+?)\n```", text, flags=re.S)


def test_readme_opens_with_run_and_test_commands() -> None:
    run_command, test_command = _readme_commands()[:2]
    assert run_command.endswith("p2ptrain demo")
    assert "constraints.txt" in run_command and "constraints.txt" in test_command
    assert "pytest" in test_command
    # the demo writes a loss plot: the run command installs the extra that draws it
    assert '-e ".[plot]"' in run_command


def test_ci_runs_the_readme_test_command() -> None:
    test_command = _readme_commands()[1]
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci_lines
