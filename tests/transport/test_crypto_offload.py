"""The crypto offload is used only where the machine has cores to spare, and a
config refuses a threshold too small to pay for the thread handoff."""

from __future__ import annotations

import pytest

from p2ptrain.errors import ConfigError
from p2ptrain.rpc.config import ConnectionConfig
from p2ptrain.transport.crypto_offload import MIN_CPUS, effective_offload_bytes


def test_offload_needs_spare_cores() -> None:
    assert effective_offload_bytes(1 << 18, cpus=MIN_CPUS) == 1 << 18
    assert effective_offload_bytes(1 << 18, cpus=MIN_CPUS - 1) is None
    assert effective_offload_bytes(None, cpus=64) is None


def test_config_bounds() -> None:
    assert ConnectionConfig(crypto_offload_bytes=None).crypto_offload_bytes is None
    with pytest.raises(ConfigError):
        ConnectionConfig(crypto_offload_bytes=16)
