"""The docs are checked: their commands name real subcommands and flags, their
Python snippets compile, import and (when complete) run; and no file of the
repository names an absolute path of a machine."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from doccheck import ROOT, check_argv, check_markdown, check_python, commands, documents, snippets


@pytest.mark.parametrize("page", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_and_snippet_of_the_docs_holds(page: Path) -> None:
    problems = check_markdown(page.read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)


def test_the_checker_finds_a_flag_that_does_not_exist() -> None:
    good = "```bash\np2ptrain train --join PEERID@203.0.113.7:4001 --seconds 60\n```\n"
    assert check_markdown(good) == []
    bad = "```bash\np2ptrain train --join PEERID@203.0.113.7:4001 --sconds 60\n```\n"
    assert check_markdown(bad) == ["line 2: p2ptrain.app.cli train: no flag --sconds"]
    inline = "Run `p2ptrain demo --peers 4 --turbo` to go faster.\n"
    assert check_markdown(inline) == ["line 1: p2ptrain.app.cli demo: no flag --turbo"]
    console = "```console\n$ p2ptrain bootstrap --relay-gbit 5\nbootstrap peer ready\n```\n"
    assert check_markdown(console) == ["line 2: p2ptrain.app.cli bootstrap: no flag --relay-gbit"]


def test_the_checker_finds_subcommands_benchmarks_and_their_flags() -> None:
    assert check_argv(["p2ptrain", "trian"]) == ["p2ptrain.app.cli: no subcommand 'trian'"]
    assert check_argv(["p2ptrain", "bench", "lp", "--resolves", "5"]) == []
    assert check_argv(["p2ptrain", "bench", "lp", "--resolvs", "5"]) == [
        "p2ptrain bench lp: no flag --resolvs"
    ]
    assert check_argv(["p2ptrain", "bench", "nope"]) == ["p2ptrain bench: no benchmark 'nope'"]
    assert check_argv(["python", "-m", "benchmarks.bench_lp", "--seed", "1"]) == []
    assert check_argv(["python", "-m", "benchmarks.bench_lp", "--sed", "1"]) == [
        "benchmarks.bench_lp: no flag --sed"
    ]
    assert check_argv(["python", "-m", "benchmarks.bench_nope"]) == [
        "python -m benchmarks.bench_nope: no such module"
    ]
    assert check_argv(["python", "benchmarks/bench_lp.py", "--seed", "1"]) == [
        "benchmarks/bench_lp.py: run benchmarks as modules: python -m benchmarks.bench_lp"
    ]
    assert check_argv(["python", "-m", "p2ptrain.lab.natlab.cli", "cleanup", "--all"]) == []
    assert check_argv(["pip", "install", "--whatever"]) == []  # not ours
    assert list(commands("$ p2ptrain demo && p2ptrain status --join X\noutput line\n")) == [
        ["p2ptrain", "demo"],
        ["p2ptrain", "status", "--join", "X"],
    ]


def test_the_checker_compiles_imports_and_runs_python() -> None:
    assert check_python("import math\nassert math.pi > 3\n") == []
    assert check_python("from p2ptrain.metrics import NoSuchThing\n") == [
        "from p2ptrain.metrics import NoSuchThing: no such name"
    ]
    assert check_python("def broken(:\n")[0].startswith("does not compile")
    assert check_python("assert 1 == 2\n")[0].startswith("fails when run")
    # free names (a fragment) or await (needs a network): imports checked, not run
    assert check_python("x = undefined_thing + 1\n") == []
    assert check_python("import asyncio\nawait asyncio.sleep(3600)\n") == []
    kinds = [s.kind for s in snippets("```python\nx = 1\n```\n```\np2ptrain demo\n```\n")]
    assert kinds == ["python", "shell"]


_MACHINE_PATH = re.compile(
    r"(?<![\w.~$/-])/(?:"
    + "|".join(["work", "home", "root", "Users", "opt", "mnt", "srv", "tmp"])
    + r")/[\w.-]"
)


def test_no_file_names_an_absolute_path_of_a_machine() -> None:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if listed.returncode != 0:
        pytest.skip("not a git checkout: no list of the repository's files")
    hits = []
    for name in listed.stdout.splitlines():
        path = ROOT / name
        if not path.is_file() or path.suffix in (".xz", ".png"):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            if _MACHINE_PATH.search(line):
                hits.append(f"{name}:{number}: {line.strip()}")
    assert not hits, "\n".join(hits)
