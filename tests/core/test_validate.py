"""The one config-validation helper (p2ptrain/validate.py) and its wording."""

from __future__ import annotations

import math

import pytest

from p2ptrain.errors import ConfigError
from p2ptrain.rpc.config import ConnectionConfig
from p2ptrain.validate import check_integer, check_number


@pytest.mark.parametrize("value", [1, 0.5, 1e9])
def test_a_positive_finite_number_passes(value: float) -> None:
    check_number("X.f", value)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, "X.f must be positive and finite, got 0"),
        (math.nan, "X.f must be positive and finite, got nan"),
        (math.inf, "X.f must be positive and finite, got inf"),
        (True, "X.f must be a number, got True"),
        ("1", "X.f must be a number, got '1'"),
        (None, "X.f must be a number, got None"),
    ],
)
def test_a_bad_number_names_the_field_and_the_value(value: object, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        check_number("X.f", value)
    assert str(caught.value) == message


def test_inclusive_lower_bound_and_none() -> None:
    check_number("X.f", 0, at_least=0)
    check_number("X.f", None, allow_none=True)
    with pytest.raises(ConfigError, match=r"X.f must be >= 0 and finite, got -1"):
        check_number("X.f", -1, at_least=0)


def test_integer_bounds() -> None:
    check_integer("X.n", 4, at_least=1, at_most=4)
    check_integer("X.n", None, at_least=1, allow_none=True)
    with pytest.raises(ConfigError, match=r"X.n must be an int in \[1, 4\], got 5"):
        check_integer("X.n", 5, at_least=1, at_most=4)
    with pytest.raises(ConfigError, match=r"X.n must be an int >= 1, got 0"):
        check_integer("X.n", 0, at_least=1)
    for bad in (True, 2.0, "2"):
        with pytest.raises(ConfigError, match="must be an int"):
            check_integer("X.n", bad, at_least=1)


def test_a_config_reports_through_the_helper() -> None:
    with pytest.raises(ConfigError, match=r"ConnectionConfig.stream_window must be an int in"):
        ConnectionConfig(stream_window=100)
    with pytest.raises(ConfigError, match=r"ConnectionConfig.idle_timeout must be positive"):
        ConnectionConfig(idle_timeout=math.nan)
