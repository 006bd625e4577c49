"""pytest glue for the NAT lab.

In a test module::

    from p2ptrain.lab.natlab.lab import HomeConfig, LabConfig
    from p2ptrain.testing.natlab_plugin import natlab_fixture

    natlab = natlab_fixture(LabConfig(homes=(HomeConfig("a"), HomeConfig("b"))))

    def test_something(natlab):
        host_a = natlab.home("a").host
        ...

The fixture skips the test (with the reason) where the lab cannot be built on
this machine: without CAP_NET_ADMIN, without a working ``ip netns``, or with a
tool missing (``iptables-restore``, ``tc``, ``turnserver``, ...). Any other
failure to build the lab (a command failing) is an error, not a skip. Before
building, labs left behind by crashed runs (dead owner pid) are removed.

Strict mode: with ``P2PTRAIN_STRICT_LAB=1`` in the environment (CI sets it),
every such skip is a failure instead, so the lab never drops out silently.

Registered as a pytest plugin (``pytest_plugins`` in ``tests/conftest.py``),
this module also ends the run with one line counting the lab tests skipped,
why, and the command that installs what is missing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any, Literal

import pytest

from p2ptrain.lab.natlab.lab import LabConfig, NatLab
from p2ptrain.lab.natlab.netns import cleanup_stale_labs, lab_unavailable

__all__ = [
    "SKIP_PREFIX",
    "STRICT_ENV",
    "lab_unavailable",
    "natlab_fixture",
    "pytest_terminal_summary",
    "require_netns",
]

_Scope = Literal["session", "package", "module", "class", "function"]

STRICT_ENV = "P2PTRAIN_STRICT_LAB"
"""Set to ``1`` to turn every NAT-lab skip into a failure."""
SKIP_PREFIX = "NAT lab unavailable: "
"""Every NAT-lab skip reason starts with this (the summary line counts them)."""


def strict() -> bool:
    """Whether :data:`STRICT_ENV` asks for failures instead of skips."""
    return os.environ.get(STRICT_ENV, "").strip() not in ("", "0")


def require_netns(*, turn: bool = False) -> None:
    """Skip the calling test when the NAT lab cannot be built here (fail in strict mode).

    Args:
        turn: Whether the test needs coturn's ``turnserver`` too.
    """
    reason = lab_unavailable(turn=turn)
    if reason is None:
        return
    if strict():
        pytest.fail(f"{SKIP_PREFIX}{reason} ({STRICT_ENV} is set: the lab must run)")
    pytest.skip(f"{SKIP_PREFIX}{reason}")


def natlab_fixture(
    config: LabConfig | None = None, *, scope: _Scope = "module", name: str | None = None
) -> Callable[..., Any]:
    """A pytest fixture that yields a running :class:`NatLab`.

    Args:
        config: The lab to build (default :class:`LabConfig`).
        scope: pytest scope; "module" builds one lab for all tests of a file.
        name: The fixture's name as tests request it (default "natlab"),
            whatever module attribute holds it.

    Returns:
        The fixture, to assign to a module-level name (or put in conftest.py).
    """
    lab_config = config or LabConfig()

    def natlab() -> Iterator[NatLab]:
        require_netns(turn=lab_config.turn)
        cleanup_stale_labs(lab_config.prefix)
        with NatLab(lab_config) as lab:
            yield lab

    fixture: Callable[..., Any] = pytest.fixture(scope=scope, name=name or "natlab")(natlab)
    return fixture


def _packages(reasons: list[str]) -> list[str]:
    """The apt packages named in ``tool (package)`` parts of the skip reasons."""
    found: list[str] = []
    for reason in reasons:
        for part in reason.split("("):
            package = part.split(")", 1)[0] if ")" in part else ""
            if package and " " not in package and package not in found:
                found.append(package)
    return found


def _why(reasons: list[str]) -> str:
    """The skip reasons merged: the union of the missing tools, then any other reason."""
    tools: list[str] = []
    others: list[str] = []
    for reason in reasons:
        if reason.startswith("missing "):
            tools += [t for t in reason.removeprefix("missing ").split(", ") if t not in tools]
        elif reason not in others:
            others.append(reason)
    return "; ".join(([f"missing {', '.join(tools)}"] if tools else []) + others)


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: Any) -> None:
    """End the run with one line about the NAT-lab tests skipped (if any were)."""
    reasons: list[str] = []
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = getattr(report, "longrepr", None)
        text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else ""
        marker = text.find(SKIP_PREFIX)
        if marker >= 0:
            reasons.append(text[marker + len(SKIP_PREFIX) :])
    if not reasons:
        return
    why = _why(reasons)
    packages = _packages(reasons)
    install = f"apt-get install {' '.join(packages)} (as root)" if packages else "run as root"
    terminalreporter.write_line(
        f"{len(reasons)} NAT-lab tests skipped ({why}); to run them: {install}; "
        f"{STRICT_ENV}=1 makes these skips failures"
    )
