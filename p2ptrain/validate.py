"""The checks config dataclasses run in ``__post_init__``, worded one way for every subsystem.

Each raises :class:`~p2ptrain.errors.ConfigError` naming the field
(``what``, e.g. ``"NATConfig.punch_timeout"``) and the value it got. ``bool``
is refused where a number is expected (``True`` is an ``int`` to Python, never
a rate or a timeout to us).
"""

from __future__ import annotations

import math

from p2ptrain.errors import ConfigError

__all__ = ["check_integer", "check_number"]


def check_number(
    what: str,
    value: object,
    *,
    above: float = 0.0,
    at_least: float | None = None,
    allow_none: bool = False,
) -> None:
    """``value`` must be a finite int or float greater than ``above`` (or None, if allowed).

    With ``at_least``, the bound is inclusive instead: ``value >= at_least``.
    """
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{what} must be a number, got {value!r}")
    if at_least is not None:
        if not (math.isfinite(value) and value >= at_least):
            raise ConfigError(f"{what} must be >= {at_least:g} and finite, got {value!r}")
    elif not (math.isfinite(value) and value > above):
        bound = "positive" if above == 0 else f"> {above:g}"
        raise ConfigError(f"{what} must be {bound} and finite, got {value!r}")


def check_integer(
    what: str,
    value: object,
    *,
    at_least: int,
    at_most: int | None = None,
    allow_none: bool = False,
) -> None:
    """``value`` must be an int (not a bool) of at least ``at_least`` and at most
    ``at_most`` (or None, if allowed)."""
    if value is None and allow_none:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < at_least
        or (at_most is not None and value > at_most)
    ):
        span = f">= {at_least}" if at_most is None else f"in [{at_least}, {at_most}]"
        raise ConfigError(f"{what} must be an int {span}, got {value!r}")
