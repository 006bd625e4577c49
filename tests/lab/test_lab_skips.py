"""The test command passes on a machine without the NAT-lab tools, and says so in one line.

A PATH is built with every tool of this machine except ``iptables*`` and
``turnserver`` (a directory of symlinks), and the README's test command runs
two NAT-lab tests in a child pytest: it exits 0 with one line naming what is
missing and how to install it; with ``P2PTRAIN_STRICT_LAB=1`` (what CI sets)
the same run fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from p2ptrain.testing.natlab_plugin import STRICT_ENV, _packages

ROOT = Path(__file__).resolve().parents[2]
HIDDEN = ("iptables", "turnserver")
LAB_TESTS = [
    "tests/lab/test_natlab.py::test_addresses_and_commands",
    "tests/lab/test_natlab.py::test_teardown_leaves_nothing_even_after_an_error",
]


def _path_without(hidden: tuple[str, ...], directory: Path) -> str:
    """A directory of symlinks to every program on PATH except those starting with ``hidden``."""
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        if not folder or not Path(folder).is_dir():
            continue
        for program in Path(folder).iterdir():
            target = directory / program.name
            if program.name.startswith(hidden) or target.exists():
                continue
            if program.is_file() and os.access(program, os.X_OK):
                target.symlink_to(program)
    return str(directory)


def _pytest(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *LAB_TESTS],
        cwd=ROOT,
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_missing_lab_tools_skip_with_one_line_and_fail_in_strict_mode(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    env = {**os.environ, "PATH": _path_without(HIDDEN, bin_dir)}
    env.pop(STRICT_ENV, None)
    relaxed = _pytest(env)
    assert relaxed.returncode == 0, relaxed.stdout[-3000:] + relaxed.stderr[-2000:]
    lines = [line for line in relaxed.stdout.splitlines() if "NAT-lab tests skipped" in line]
    assert len(lines) == 1, relaxed.stdout[-3000:]
    line = lines[0]
    assert line.startswith("2 NAT-lab tests skipped"), line
    if os.geteuid() == 0:  # as root the missing tools are the reason; else the capability
        assert "iptables-restore (iptables)" in line and "turnserver (coturn)" in line, line
        assert "apt-get install iptables coturn" in line, line
    assert f"{STRICT_ENV}=1" in line
    strict = _pytest({**env, STRICT_ENV: "1"})
    assert strict.returncode != 0, strict.stdout[-3000:]
    assert "NAT lab unavailable" in strict.stdout, strict.stdout[-3000:]


def test_the_install_hint_names_each_package_once() -> None:
    reasons = [
        "missing iptables-restore (iptables), iptables-save (iptables), turnserver (coturn)",
        "missing tc (iproute2)",
        "needs CAP_NET_ADMIN (run as root) to build network namespaces",
    ]
    assert _packages(reasons) == ["iptables", "coturn", "iproute2"]
