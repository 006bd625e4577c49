"""``p2ptrain bench all``: which parts run where, the report it writes, and every
benchmark flag described with its default in ``--help``."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from doccheck import ROOT, program_parser

sys.path.insert(0, str(ROOT))  # the benchmarks package lives at the repository root
from benchmarks.bench_all import BENCHMARKS, plan

SCRIPTS = sorted(f"benchmarks.{p.stem}" for p in (ROOT / "benchmarks").glob("bench_*.py"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_benchmark_flag_has_a_description_and_a_default(script: str) -> None:
    parser = program_parser(script)
    assert parser is not None, script
    formatter = parser.formatter_class(prog=script)
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        if isinstance(action, argparse._HelpAction):
            continue
        shown = formatter._get_help_string(action) or ""  # what --help prints for it
        assert action.help, f"{script} {action.option_strings[0]}: no description"
        assert "default" in shown, f"{script} {action.option_strings[0]}: no default shown"


def test_without_the_lab_or_hivemind_the_plan_says_what_it_leaves_out(tmp_path: Path) -> None:
    reason = "needs CAP_NET_ADMIN (run as root) to build network namespaces"
    runs, skipped = plan(
        list(BENCHMARKS), out=tmp_path, quick=False, hivemind=None, lab_reason=reason
    )
    argv = {run.name: run.argv for run in runs}
    assert "webrtc" not in argv and set(argv) == set(BENCHMARKS) - {"webrtc"}
    assert "--no-webrtc" in argv["transport"] and "--skip-hetero" in argv["allreduce"]
    assert "--no-hivemind" in argv["dht"] and "--no-hivemind" in argv["allreduce"]
    assert any(line.startswith("webrtc: ") and reason in line for line in skipped), skipped
    assert sum("hivemind" in line for line in skipped) == 2
    runs, skipped = plan(["dht"], out=tmp_path, quick=False, hivemind="/x/python", lab_reason=None)
    assert runs[0].argv[-2:] == ["--hivemind-python", "/x/python"] and skipped == []


@pytest.mark.slow
def test_bench_all_writes_one_report(tmp_path: Path) -> None:
    out = tmp_path / "report"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.bench_all",
            "--only",
            "lp",
            "--quick",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.splitlines()[-1])
    assert summary["runs"]["lp"]["returncode"] == 0
    report = (out / "report.md").read_text()
    for part in ("## Machine", "| cpu_model |", "| cores |", "| memory_gib |", "| torch |"):
        assert part in report, part
    for part in ("| aiortc |", "| uvloop |", "| os |", "## Skipped", "## lp", "```text"):
        assert part in report, part
    assert "re-solve median ms" in report  # the benchmark's own table
    assert json.loads((out / "lp.json").read_text())["build_ms_8"] > 0
