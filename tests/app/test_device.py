"""``p2ptrain train --device``: the device by name, and a task's batches moved onto it."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from p2ptrain.app.device import to_device, training_device
from p2ptrain.app.train import TrainingSessionConfig
from p2ptrain.errors import ConfigError


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


def test_auto_picks_cuda_only_where_this_machine_has_it() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert training_device("auto").type == expected
    assert training_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("name", ["gpu0", "", "meta", "cuda:99"])
def test_a_device_this_machine_cannot_train_on_is_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="--device"):
        training_device(name)


def test_cuda_is_taken_where_present_and_refused_clearly_where_not() -> None:
    if torch.cuda.is_available():
        assert training_device("cuda:0") == torch.device("cuda:0")
        moved = to_device((torch.zeros(2), [torch.ones(1)]), torch.device("cuda"))
        assert moved[0].device.type == "cuda" and moved[1][0].device.type == "cuda"
    else:
        with pytest.raises(ConfigError, match="no CUDA device"):
            training_device("cuda")


def test_nested_batches_keep_their_shape_and_non_tensors() -> None:
    x, y = torch.zeros(2, 3), torch.ones(2)
    device = torch.device("cpu")
    moved = to_device({"pair": Pair(x, y), "list": [x, 7], "name": "b"}, device)
    assert isinstance(moved["pair"], Pair) and moved["pair"].x is x  # already there: no copy
    assert moved["list"][0] is x and moved["list"][1] == 7 and moved["name"] == "b"
    assert to_device((x, y), device) == (x, y)


def test_the_session_config_refuses_an_empty_device() -> None:
    with pytest.raises(ConfigError, match="device"):
        TrainingSessionConfig(initial_peers=(), device="")
