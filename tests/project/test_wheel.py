"""A wheel installed into a fresh virtual environment runs the demo from any directory.

The wheel is built from this checkout and installed without ``-e`` into a
new venv. That venv reuses torch, aiortc, ... of the environment the tests run
in (a ``.pth`` file naming its site-packages), never the base interpreter's:
``--system-site-packages`` would borrow the base interpreter's packages, which
a fresh machine does not have. p2ptrain itself comes only from the wheel (the
running environment's editable-install hook is a ``.pth`` file in its
site-packages, and ``.pth`` files of a directory named by another ``.pth``
file are not processed). The demo then runs from an empty directory, where
the repository is not on ``sys.path``: the default task and its data must
ship inside the package.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Imported by the demo; each must resolve inside the running environment.
_DEPENDENCIES = ("torch", "msgpack", "aiortc", "cvxpy", "numpy", "cryptography", "matplotlib")
_PRINT_DEPENDENCY_ORIGINS = (
    "import importlib, sys\nfor name in sys.argv[1:]: print(importlib.import_module(name).__file__)"
)
_NOT_SOURCE = (".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "runs")


def _run(argv: list[str], *, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def _builder() -> list[str]:
    """pip of an interpreter that can build a wheel offline (``--no-build-isolation``).

    A fresh venv's setuptools (65 with Python 3.11) has no ``bdist_wheel``
    without the ``wheel`` package; the base interpreter's may. Without any,
    pip builds in isolation (which needs the package index).
    """
    probe = (
        "import importlib.util as u, sys; sys.exit(0 if u.find_spec('wheel') "
        "or u.find_spec('setuptools.command.bdist_wheel') else 1)"
    )
    for python in dict.fromkeys([sys.executable, getattr(sys, "_base_executable", "")]):
        if python and subprocess.run([python, "-c", probe], check=False).returncode == 0:
            return [python, "-m", "pip", "wheel", "--no-build-isolation"]
    return [sys.executable, "-m", "pip", "wheel"]


def _borrow_running_environment(venv: Path) -> list[str]:
    """Let ``venv`` import the running environment's packages (not the base interpreter's).

    Returns the directories it now borrows.
    """
    paths = sysconfig.get_paths()
    borrowed = list(dict.fromkeys([paths["purelib"], paths["platlib"]]))
    (site_packages,) = venv.glob("lib/python*/site-packages")
    (site_packages / "_running_environment.pth").write_text("\n".join(borrowed) + "\n")
    return borrowed


def _ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
@pytest.mark.timeout(480)  # a build, a venv and a 20 s demo: about 40 s on an idle machine
def test_the_wheel_runs_the_demo_from_an_empty_directory(tmp_path: Path) -> None:
    dist, venv, work = tmp_path / "dist", tmp_path / "venv", tmp_path / "work"
    work.mkdir()
    # A clean copy: a build/ left in the checkout could put stale modules in the wheel.
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*_NOT_SOURCE))
    _ok(
        _run(
            [
                *_builder(),
                "--no-deps",
                "-q",
                "-w",
                str(dist),
                str(source),
            ],
            cwd=tmp_path,
            timeout=180,
        )
    )
    (wheel,) = dist.glob("p2ptrain-*.whl")
    base = getattr(sys, "_base_executable", sys.executable)
    _ok(_run([base, "-m", "venv", str(venv)], cwd=work, timeout=120))
    borrowed = _borrow_running_environment(venv)
    python = venv / "bin" / "python"
    _ok(
        _run(
            [str(python), "-m", "pip", "install", "--no-deps", "-q", str(wheel)],
            cwd=work,
            timeout=180,
        )
    )
    where = _ok(
        _run(
            [
                str(python),
                "-c",
                "import p2ptrain, sys; print(p2ptrain.__file__); print(*sys.path, sep='\\n')",
            ],
            cwd=work,
            timeout=60,
        )
    )
    installed, *path = where.splitlines()
    assert installed.startswith(str(venv)), installed  # from the wheel, not the checkout
    # The checkout is not on the path (a running environment kept inside it may be).
    assert not [p for p in path if p not in borrowed and p.startswith(str(ROOT))], path
    # The dependencies come from the environment the tests run in, whatever the
    # base interpreter has installed (on a fresh machine: nothing).
    origins = _ok(
        _run(
            [str(python), "-c", _PRINT_DEPENDENCY_ORIGINS, *_DEPENDENCIES],
            cwd=work,
            timeout=120,
        )
    ).splitlines()
    assert len(origins) == len(_DEPENDENCIES), origins
    for name, origin in zip(_DEPENDENCIES, origins, strict=True):
        assert any(origin.startswith(d) for d in borrowed), (name, origin, borrowed)
    png = work / "loss.png"
    demo = _run(
        [
            str(venv / "bin" / "p2ptrain"),
            "demo",
            "--peers",
            "2",
            "--seconds",
            "20",
            "--png",
            "loss.png",
        ],
        cwd=work,
        timeout=300,
    )
    out = _ok(demo)
    assert "demo OK" in out, out
    assert png.read_bytes()[:8] == PNG_MAGIC
