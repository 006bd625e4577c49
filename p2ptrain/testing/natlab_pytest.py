"""pytest glue for the NAT lab.

In a test module::

    from p2ptrain.testing.natlab import HomeConfig, LabConfig
    from p2ptrain.testing.natlab_pytest import natlab_fixture

    natlab = natlab_fixture(LabConfig(homes=(HomeConfig("a"), HomeConfig("b"))))

    def test_something(natlab):
        host_a = natlab.home("a").host
        ...

The fixture skips the test (with the reason) where namespaces cannot be built,
i.e. without CAP_NET_ADMIN or a working ``ip netns``; any other failure to
build the lab (coturn missing, a command failing) is an error, not a skip.
Before building, labs left behind by crashed runs (dead owner pid) are removed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Literal

import pytest

from p2ptrain.testing.natlab import LabConfig, NatLab
from p2ptrain.testing.natlab_netns import cleanup_stale_labs, unavailable_reason

__all__ = ["natlab_fixture", "require_netns"]

_Scope = Literal["session", "package", "module", "class", "function"]


def require_netns() -> None:
    """Skip the calling test when network namespaces cannot be built here."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"NAT lab unavailable: {reason}")


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

    def natlab() -> Iterator[NatLab]:
        require_netns()
        cleanup_stale_labs(config.prefix if config else LabConfig().prefix)
        with NatLab(config) as lab:
            yield lab

    fixture: Callable[..., Any] = pytest.fixture(scope=scope, name=name or "natlab")(natlab)
    return fixture
