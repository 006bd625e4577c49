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


def check_number(what: str, value: object, *, above: float = 0.0, allow_none: bool = False) -> None:
    """``value`` must be a finite int or float greater than ``above`` (or None, if allowed)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{what} must be a number, got {value!r}")
    if not (math.isfinite(value) and value > above):
        bound = "positive" if above == 0 else f"> {above:g}"
        raise ConfigError(f"{what} must be {bound} and finite, got {value!r}")


def check_integer(what: str, value: object, *, at_least: int, allow_none: bool = False) -> None:
    """``value`` must be an int (not a bool) of at least ``at_least`` (or None, if allowed)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < at_least:
        raise ConfigError(f"{what} must be an int >= {at_least}, got {value!r}")
