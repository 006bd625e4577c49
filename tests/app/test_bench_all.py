"""``p2ptrain bench all``: which parts run where, the report it writes, and every
benchmark flag described with its default in ``--help``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
from conftest import run_module
from doccheck import ROOT, program_parser

sys.path.insert(0, str(ROOT))  # the benchmarks package lives at the repository root
from benchmarks.bench_all import REPORT, plan
from benchmarks.registry import ALL, BENCHMARKS, module_of

SCRIPTS = sorted(module_of(name) for name in (ALL, *(bench.name for bench in BENCHMARKS)))
SHARED = {"__init__", "harness", "options", "registry"}
"""The modules of benchmarks/ that are no benchmark: what the benchmarks share."""


def test_every_benchmark_is_registered_and_laid_out_by_the_rule() -> None:
    folder = ROOT / "benchmarks"
    names = {bench.name for bench in BENCHMARKS}
    assert len(names) == len(BENCHMARKS)
    modules = {p.stem for p in folder.glob("*.py")}
    assert modules - SHARED == {f"bench_{name}" for name in (*names, ALL)}, "bench_NAME.py each"
    packages = {p.parent.name for p in folder.glob("*/__init__.py")}
    assert packages <= names, f"a sub-package is named after its benchmark: {packages - names}"


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


def test_the_flags_the_registry_names_are_the_benchmarks_own() -> None:
    for bench in BENCHMARKS:
        parser = program_parser(bench.module)
        assert parser is not None, bench.module
        flags = set(parser._option_string_actions)
        named = {"--png"} if bench.plot else set()
        named |= {"--no-hivemind", "--hivemind-python"} if bench.hivemind else set()
        named |= {bench.lab.flag} if bench.lab is not None and bench.lab.flag else set()
        named |= {flag for flag in bench.quick if flag.startswith("--")}
        assert named <= flags, f"{bench.name}: no {sorted(named - flags)}"


def test_without_the_lab_or_hivemind_the_plan_says_what_it_leaves_out(tmp_path: Path) -> None:
    reason = "needs CAP_NET_ADMIN (run as root) to build network namespaces"
    runs, skipped = plan(list(REPORT), out=tmp_path, quick=False, hivemind=None, lab_reason=reason)
    argv = {run.name: run.argv for run in runs}
    assert "webrtc" not in argv and set(argv) == set(REPORT) - {"webrtc"}
    assert "--no-webrtc" in argv["transport"] and "--skip-hetero" in argv["allreduce"]
    assert "--no-hivemind" in argv["dht"] and "--no-hivemind" in argv["allreduce"]
    assert any(line.startswith("webrtc: ") and reason in line for line in skipped), skipped
    assert sum("hivemind" in line for line in skipped) == 2
    runs, skipped = plan(["dht"], out=tmp_path, quick=False, hivemind="/x/python", lab_reason=None)
    assert runs[0].argv[-2:] == ["--hivemind-python", "/x/python"] and skipped == []


@pytest.mark.slow
def test_bench_all_writes_one_report(tmp_path: Path) -> None:
    out = tmp_path / "report"
    done = run_module(
        "benchmarks.bench_all", "--only", "lp", "--quick", "--out", str(out), cwd=ROOT, timeout=300
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
    assert ": `python -m benchmarks.bench_lp --sizes 8 --resolves 2`" in report  # as one types it
    assert json.loads((out / "lp.json").read_text())["build_ms_8"] > 0
