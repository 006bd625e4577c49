"""Measured throughput: moving averages of achieved rates, overrides, capacities."""

from __future__ import annotations

from typing import Any

import pytest

from p2ptrain.allreduce import AllReduceReport, ThroughputConfig, ThroughputMeter
from p2ptrain.errors import ConfigError

MB = 1 << 20


def test_the_first_sample_is_taken_as_is_then_averaged() -> None:
    meter = ThroughputMeter(ThroughputConfig(smoothing=0.5))
    assert meter.upload_bytes_per_s is None and meter.download_bytes_per_s is None
    meter.record_upload(100 * MB, 1.0)
    assert meter.upload_bytes_per_s == 100 * MB
    meter.record_upload(200 * MB, 1.0)
    assert meter.upload_bytes_per_s == 150 * MB
    meter.record_download(10 * MB, 0.5)
    assert meter.download_bytes_per_s == 20 * MB
    assert meter.samples == (2, 1)


def test_transfers_too_small_to_measure_are_ignored() -> None:
    meter = ThroughputMeter(ThroughputConfig(min_bytes=MB, min_seconds=0.01))
    meter.record_upload(MB - 1, 1.0)
    meter.record_upload(10 * MB, 0.001)
    meter.record_download(10 * MB, 0.0)
    assert meter.samples == (0, 0)
    with pytest.raises(ConfigError):
        meter.record_upload(-1, 1.0)


def test_explicit_rates_override_measurements() -> None:
    meter = ThroughputMeter(ThroughputConfig(upload_bytes_per_s=5e6))
    meter.record_upload(100 * MB, 1.0)
    meter.record_download(100 * MB, 2.0)
    assert meter.upload_bytes_per_s == 5e6
    assert meter.download_bytes_per_s == 50 * MB
    capacity = meter.capacity(default_bytes_per_s=1e6, samples_per_s=12.0, client_mode=True)
    assert capacity.upload_bytes_per_s == 5e6 and capacity.download_bytes_per_s == 50 * MB
    assert capacity.client_mode and capacity.samples_per_s == 12.0
    fresh = ThroughputMeter().capacity(default_bytes_per_s=1e6)
    assert fresh.upload_bytes_per_s == fresh.download_bytes_per_s == 1e6


def test_a_round_report_feeds_both_directions() -> None:
    fields: dict[str, Any] = {
        "round_id": b"r",
        "members": (),
        "index": 0,
        "weight": 1.0,
        "shards": (),
        "failed": {},
        "bytes_sent": 30 * MB,
        "bytes_received": 60 * MB,
        "reduce_scatter_s": 0.1,
        "all_gather_s": 0.1,
        "total_s": 0.2,
        "send_s": 0.3,
        "receive_s": 0.6,
        "predicted_s": 0.1,
    }
    report = AllReduceReport(**fields)
    assert report.slowdown == pytest.approx(2.0)
    meter = ThroughputMeter()
    meter.record_round(report)
    assert meter.upload_bytes_per_s == pytest.approx(100 * MB)
    assert meter.download_bytes_per_s == pytest.approx(100 * MB)


@pytest.mark.parametrize(
    "changes",
    [{"smoothing": 0.0}, {"smoothing": 1.5}, {"min_bytes": -1}, {"upload_bytes_per_s": 0.0}],
)
def test_config_is_validated(changes: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        ThroughputConfig(**changes)
