"""Every benchmark this machine can run, collected into one report.

Usage::

    python -m benchmarks.bench_all --out DIR [--only transport,dht] [--quick]
        [--hivemind-python PATH]
    p2ptrain bench all --out DIR

Runs each benchmark of the report (:data:`REPORT`, read from
:mod:`benchmarks.registry`) in turn as a child process, each with its
default workload, and writes into ``DIR``:

* ``report.md``: the machine (CPU model, cores, memory, kernel, Python,
  torch, aiortc and hivemind versions, uvloop on or off, root or not), what
  was skipped and why, then per benchmark its table, its plot and its JSON;
* ``NAME.txt`` (the table as printed), ``NAME.json`` (its last output line),
  ``NAME.log`` (its stderr) and ``NAME.png`` where the script draws one.

Parts that need the NAT lab (root, iproute2, iptables, coturn) are left out
where it cannot run, and the report says so: ``bench_webrtc`` entirely, the
WebRTC rows of ``bench_transport`` and the shaped-link part of
``bench_allreduce``. hivemind's columns are filled where this interpreter (or
``--hivemind-python``) can import hivemind. ``--quick`` shrinks every
workload to a smoke test (its figures mean nothing).

The last line printed is one JSON object: each benchmark's exit status and
seconds, what was skipped, and the report's path.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    DefaultsHelpFormatter,
    child_env,
    emit_json,
    module_argv,
    uvloop_available,
)
from benchmarks.options import add_hivemind_arguments, hivemind_of
from benchmarks.registry import BENCHMARKS, by_name
from p2ptrain.lab.natlab.netns import lab_unavailable

REPORT: tuple[str, ...] = tuple(bench.name for bench in BENCHMARKS if bench.in_report)
"""The benchmarks of the report, in the order they run (transport's table opens it)."""
TIMEOUT_S = 3600.0
"""Seconds one benchmark may take before it is stopped."""


@dataclass
class Outcome:
    """One benchmark's run."""

    name: str
    argv: list[str]
    seconds: float = 0.0
    returncode: int | None = None
    table: str = ""
    result: dict[str, Any] | None = None
    png: str | None = None
    notes: list[str] = field(default_factory=list)


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    except (ValueError, OSError, AttributeError):
        return None


def machine(hivemind_note: str, lab_reason: str | None) -> dict[str, Any]:
    """The facts of this machine that the figures depend on."""
    memory = _memory_gib()
    return {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": None if memory is None else round(memory, 1),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": _version("torch"),
        "aiortc": _version("aiortc"),
        "p2ptrain": _version("p2ptrain"),
        "hivemind": hivemind_note,
        "uvloop": "on" if uvloop_available() else "off (not installed)",
        "root": hasattr(os, "geteuid") and os.geteuid() == 0,
        "nat_lab": "available" if lab_reason is None else f"unavailable: {lab_reason}",
    }


def plan(
    names: list[str],
    *,
    out: Path,
    quick: bool,
    hivemind: str | None,
    lab_reason: str | None,
    hivemind_note: str = "hivemind is not importable",
) -> tuple[list[Outcome], list[str]]:
    """The runs to make, and the lines saying what is skipped and why (``hivemind_note``:
    why hivemind is left out where ``hivemind`` is None)."""
    runs: list[Outcome] = []
    skipped: list[str] = []
    for name in names:
        bench = by_name(name)
        argv = module_argv(bench.module, *(bench.quick if quick else ()))
        run = Outcome(name, argv)
        if bench.lab is not None and lab_reason is not None:
            if bench.lab.flag is None:
                skipped.append(f"{name}: needs the NAT lab: {lab_reason}")
                continue
            argv.append(bench.lab.flag)
            run.notes.append(f"{bench.lab.what} left out: NAT lab {lab_reason}")
            skipped.append(f"{name}, {bench.lab.what}: NAT lab {lab_reason}")
        if bench.plot:
            argv += ["--png", str(out / f"{name}.png")]
        if bench.hivemind:
            if hivemind is None:
                argv.append("--no-hivemind")
                skipped.append(f"{name}, hivemind columns: {hivemind_note}")
            else:
                argv += ["--hivemind-python", hivemind]
        runs.append(run)
    return runs, skipped


def execute(run: Outcome, out: Path) -> None:
    """Run one benchmark, keeping its table, JSON, log and plot in ``out``."""
    started = time.monotonic()
    with (out / f"{run.name}.log").open("w", encoding="utf-8") as log:
        try:
            done = subprocess.run(
                run.argv,
                env=child_env(),
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                timeout=TIMEOUT_S,
                check=False,
            )
            stdout, run.returncode = done.stdout, done.returncode
        except subprocess.TimeoutExpired as exc:
            raw = exc.stdout or ""
            stdout = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
            run.notes.append(f"stopped after {TIMEOUT_S:.0f} s")
    run.seconds = time.monotonic() - started
    lines = stdout.rstrip("\n").splitlines()
    if lines:
        try:
            parsed = json.loads(lines[-1])
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            run.result = parsed
            lines = lines[:-1]
    run.table = "\n".join(lines).strip("\n")
    (out / f"{run.name}.txt").write_text(run.table + "\n", encoding="utf-8")
    if run.result is not None:
        (out / f"{run.name}.json").write_text(json.dumps(run.result, indent=2) + "\n")
    png = out / f"{run.name}.png"
    run.png = png.name if png.is_file() else None
    if run.returncode != 0:
        tail = (out / f"{run.name}.log").read_text(errors="replace").strip().splitlines()[-3:]
        run.notes.append(f"exit status {run.returncode}: " + " | ".join(tail))


def report(
    runs: list[Outcome],
    skipped: list[str],
    facts: dict[str, Any],
    *,
    wall_s: float,
    argv: list[str],
    out: Path,
) -> str:
    """``report.md``: the machine, what was skipped, then each benchmark's table, plot, JSON."""
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# p2ptrain benchmark report",
        "",
        f"Run {when} with `{' '.join(argv)}`; all benchmarks took {wall_s:.0f} s.",
        "Figures vary with load; compare systems within one table (ratios), not across runs.",
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
        *(f"| {key} | {value} |" for key, value in facts.items()),
        "",
        "## Skipped",
        "",
        *([f"- {line}" for line in skipped] or ["- nothing"]),
        "",
    ]
    for run in runs:
        status = "ok" if run.returncode == 0 else "FAILED"
        lines += [
            f"## {run.name}",
            "",
            f"{status}, {run.seconds:.0f} s: `{_short(run.argv, out)}`",
            "",
        ]
        lines += [f"- {note}" for note in run.notes]
        if run.notes:
            lines.append("")
        lines += ["```text", run.table or "(no table)", "```", ""]
        if run.png is not None:
            lines += [f"![{run.name}]({run.png})", ""]
        if run.result is not None:
            lines += [
                f"<details><summary>raw JSON ({run.name}.json)</summary>",
                "",
                "```json",
                json.dumps(run.result, indent=2),
                "```",
                "",
                "</details>",
                "",
            ]
    return "\n".join(lines)


def _short(argv: list[str], out: Path) -> str:
    """A benchmark's command line as the reader would type it (files in ``out`` by name)."""
    inside = str(out.resolve()) + os.sep
    shown = ["python", *argv[1:3]]  # -m benchmarks.bench_NAME
    for arg in argv[3:]:
        resolved = str(Path(arg).resolve()) if "/" in arg else ""
        shown.append(Path(arg).name if resolved.startswith(inside) else arg)
    return " ".join(shown)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Run every benchmark this machine can run and write one report.",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--out", required=True, help="directory for report.md, tables, PNGs, JSON")
    parser.add_argument(
        "--only", default=",".join(REPORT), help="comma-separated benchmarks to run"
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny workloads: checks the report, measures nothing"
    )
    add_hivemind_arguments(parser, part=" of every benchmark")
    args = parser.parse_args(argv)
    names = [name for name in args.only.split(",") if name]
    unknown = sorted(set(names) - set(REPORT))
    if unknown or not names:
        parser.error(f"--only takes names from {', '.join(REPORT)}; got {args.only!r}")
    args.names = [name for name in REPORT if name in names]
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks, write the report, print where it is."""
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    hivemind, hivemind_note = hivemind_of(args)
    lab_reason = lab_unavailable()
    facts = machine(hivemind_note, lab_reason)
    runs, skipped = plan(
        args.names,
        out=out,
        quick=args.quick,
        hivemind=hivemind,
        lab_reason=lab_reason,
        hivemind_note=hivemind_note,
    )
    for line in skipped:
        print(f"skipped: {line}", file=sys.stderr, flush=True)
    for run in runs:
        print(f"running {run.name} ...", file=sys.stderr, flush=True)
        execute(run, out)
        status = "ok" if run.returncode == 0 else f"failed ({run.returncode})"
        print(f"  {run.name}: {status} in {run.seconds:.0f} s", file=sys.stderr, flush=True)
    wall = time.monotonic() - started
    shown = ["p2ptrain bench all", *(argv if argv is not None else sys.argv[1:])]
    text = report(runs, skipped, facts, wall_s=wall, argv=shown, out=out)
    (out / "report.md").write_text(text + "\n", encoding="utf-8")
    print(f"report: {out / 'report.md'} ({wall:.0f} s)")
    emit_json(
        {
            "report": str(out / "report.md"),
            "wall_s": round(wall, 1),
            "skipped": skipped,
            "runs": {
                r.name: {"returncode": r.returncode, "seconds": round(r.seconds, 1)} for r in runs
            },
        }
    )
    return 0 if all(run.returncode == 0 for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
