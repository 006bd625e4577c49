"""Measurement: receiver-side stream timing, the decayed-maximum estimates, RTTs, layering."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from allreduce_rounds import make_plan, run_round
from conftest import NodeFactory

from p2ptrain.allreduce import AllReduceService
from p2ptrain.allreduce.protocol import ResultHeader, TimingAck, parse_result, parse_timing
from p2ptrain.errors import ConfigError, InvalidArgumentError, RemoteProtocolError
from p2ptrain.measure import ArrivalTimer, EstimatorConfig, LinkEstimator, StreamTiming
from p2ptrain.measure.estimates import combined_rate, payload_rate
from p2ptrain.measure.latency import known_rtts, measure_rtts
from p2ptrain.measure.probe import MAX_PROBE_SECONDS, PROBE_METHOD, probe_peers, serve_probes

MB = 1 << 20


# -- pure ------------------------------------------------------------------------------------


def test_the_arrival_timer_spans_first_header_to_last_read() -> None:
    timer = ArrivalTimer()
    assert timer.timing() == StreamTiming(0, 0.0)
    timer.arriving(10.0)
    timer.read(MB, 10.5)
    timer.arriving(10.6)  # later headers do not move the start
    timer.read(MB, 11.0)
    timing = timer.timing()
    assert timing.nbytes == 2 * MB and timing.seconds == pytest.approx(1.0)


def test_without_arrival_callbacks_the_span_starts_at_the_first_read() -> None:
    timer = ArrivalTimer()  # e.g. WebRTC: headers are never reported
    timer.read(MB, 1.0)
    timer.read(MB, 1.25)
    timer.read(MB, 1.5)
    timing = timer.timing()
    assert timing.nbytes == 3 * MB and timing.seconds == pytest.approx(0.5)


def test_side_by_side_streams_combine_over_the_longest_span() -> None:
    streams = [StreamTiming(10 * MB, 1.0), StreamTiming(5 * MB, 0.5), StreamTiming(1000, 1e-6)]
    assert combined_rate(streams, min_bytes=MB) == pytest.approx(15 * MB)
    assert combined_rate(streams[2:], min_bytes=MB) is None
    with pytest.raises(ConfigError):
        StreamTiming(-1, 1.0)
    with pytest.raises(ConfigError):
        StreamTiming(1, math.nan)


def test_a_stream_read_in_one_gulp_does_not_set_the_estimate() -> None:
    # A busy receiver finds a 1 MB stream already in its kernel buffer and reads
    # it in a millisecond: that times a memory copy, not the link.
    links = LinkEstimator()
    links.record_upload(MB, 0.001)
    assert links.upload_bytes_per_s is None and links.observations == (0, 0)
    links.record_upload(MB, 0.2)  # a span the link set
    assert links.upload_bytes_per_s == pytest.approx(5 * MB)
    links.record_upload(MB, 0.001)
    assert links.upload_bytes_per_s == pytest.approx(5 * MB)
    assert combined_rate([StreamTiming(MB, 0.001)], min_bytes=0, min_seconds=0.02) is None
    with pytest.raises(ConfigError, match="min_seconds"):
        EstimatorConfig(min_seconds=-1.0)


def test_by_default_the_estimate_is_the_maximum_seen() -> None:
    links = LinkEstimator(EstimatorConfig(min_bytes=0))
    links.record_upload(100 * MB, 1.0)
    links.record_upload(20 * MB, 1.0)  # a round that under-used the link
    assert links.upload_bytes_per_s == 100 * MB
    assert not links.needs_probe


def test_the_estimate_is_a_decayed_maximum() -> None:
    links = LinkEstimator(EstimatorConfig(decay=0.5, min_bytes=0))
    assert links.upload_bytes_per_s is None and links.download_bytes_per_s is None
    links.record_upload(100 * MB, 1.0)
    assert links.upload_bytes_per_s == 100 * MB
    links.record_upload(20 * MB, 1.0)  # limited by slower partners: the maximum holds, decayed
    assert links.upload_bytes_per_s == 50 * MB
    links.record_upload(20 * MB, 1.0)
    assert links.upload_bytes_per_s == 25 * MB
    links.record_upload(20 * MB, 1.0)
    assert links.upload_bytes_per_s == 20 * MB  # a slower link is believed within a few rounds
    links.record_upload(300 * MB, 1.0)
    assert links.upload_bytes_per_s == 300 * MB  # a faster observation at once
    assert links.observations == (5, 0)


def test_a_late_round_replaces_higher_estimates_at_once() -> None:
    links = LinkEstimator(EstimatorConfig(decay=0.9, min_bytes=0, late_tolerance=0.2))
    links.observe(uploads=[StreamTiming(100 * MB, 1.0)], downloads=[StreamTiming(100 * MB, 1.0)])
    on_time = ([StreamTiming(10 * MB, 1.0)], [StreamTiming(10 * MB, 1.0)])
    assert not links.observe_round(*on_time, total_s=1.1, predicted_s=1.0)
    assert links.upload_bytes_per_s == pytest.approx(90 * MB)
    assert not links.needs_probe
    assert links.observe_round(*on_time, total_s=1.3, predicted_s=1.0)  # 30 % late
    assert links.upload_bytes_per_s == links.download_bytes_per_s == 10 * MB
    assert links.needs_probe  # the owner should probe again
    links.observe_probe([StreamTiming(40 * MB, 1.0)], [StreamTiming(30 * MB, 1.0)])
    assert not links.needs_probe
    assert (links.upload_bytes_per_s, links.download_bytes_per_s) == (40 * MB, 30 * MB)
    assert not links.observe_round(*on_time, total_s=9.0, predicted_s=None)  # no prediction
    assert links.upload_bytes_per_s == pytest.approx(0.9 * 40 * MB)  # decayed, not replaced


def test_the_upload_capacity_comes_from_probes_and_typed_in_rates_not_rounds() -> None:
    # A round's streams are slowed by round trips (and by the pacing that uses this
    # figure): they must not set it, or a paced round would pace the next one slower.
    links = LinkEstimator(EstimatorConfig(min_bytes=0))
    links.record_upload(2 * MB, 1.0)  # a round, not a probe
    assert links.upload_bytes_per_s == 2 * MB
    assert links.upload_capacity_bytes_per_s is None
    links.observe_probe([StreamTiming(30 * MB, 1.0), StreamTiming(20 * MB, 1.0)], [])
    assert links.upload_capacity_bytes_per_s == 50 * MB
    assert links.observe_round([StreamTiming(MB, 1.0)], [], total_s=9.0, predicted_s=1.0)
    assert links.upload_bytes_per_s == MB  # late: the announced estimate drops
    assert links.upload_capacity_bytes_per_s == 50 * MB  # until the next probe
    links.observe_probe([StreamTiming(10 * MB, 1.0)], [])
    assert links.upload_capacity_bytes_per_s == 10 * MB  # the latest probe, not the largest
    capped = LinkEstimator(EstimatorConfig(upload_cap_bytes_per_s=5 * MB, min_bytes=0))
    assert capped.upload_capacity_bytes_per_s == payload_rate(5 * MB)
    capped.observe_probe([StreamTiming(9 * MB, 1.0)], [])
    assert capped.upload_capacity_bytes_per_s == payload_rate(5 * MB)


def test_a_typed_in_rate_is_a_cap_and_a_stand_in() -> None:
    # Typed in: the link's rate. Announced: the TCP payload it carries.
    payload = 5 * MB * 1448 / 1514
    assert payload_rate(5 * MB) == pytest.approx(payload)
    links = LinkEstimator(EstimatorConfig(upload_cap_bytes_per_s=5 * MB, min_bytes=0))
    assert links.upload_bytes_per_s == pytest.approx(payload)  # nothing measured yet
    assert links.download_bytes_per_s is None
    links.record_upload(2 * MB, 1.0)
    assert links.upload_bytes_per_s == 2 * MB  # measured below the cap: measured
    links.record_upload(50 * MB, 1.0)
    assert links.upload_bytes_per_s == pytest.approx(payload)
    assert links.measured_upload_bytes_per_s == 50 * MB


@pytest.mark.parametrize(
    "changes",
    [
        {"decay": 1.5},
        {"decay": -0.1},
        {"min_bytes": -1},
        {"late_tolerance": math.inf},
        {"upload_cap_bytes_per_s": 0.0},
        {"download_cap_bytes_per_s": math.nan},
    ],
)
def test_bad_estimator_configs_are_refused(changes: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        EstimatorConfig(**changes)  # type: ignore[arg-type]


def test_timings_round_trip_and_bad_ones_are_protocol_errors() -> None:
    header = ResultHeader(3, (0, 1), (), {"c": "none"}, (1234, 0.5))
    parsed = parse_result(header.to_body(), num_chunks=4, group_size=2)
    assert parsed.timing == (1234, 0.5)
    assert parse_timing(TimingAck(99, 0.25).to_body()) == TimingAck(99, 0.25)
    assert parse_timing({"i": 0, "h": {}}) is None  # a part, not a timing
    for bad in ([1], [-1, 0.1], [1, math.nan], [1, -0.5], [True, 0.1], [1, "x"], "t"):
        with pytest.raises(RemoteProtocolError):
            parse_timing({"t": bad})
        with pytest.raises(RemoteProtocolError):
            parse_result({"i": 0, "x": [], "t": bad}, num_chunks=1, group_size=2)
    with pytest.raises(RemoteProtocolError):
        parse_timing({"t": [1, 0.1], "extra": 1})


def test_measurement_sits_below_the_allreduce_and_the_nat_code() -> None:
    code = (
        "import sys, p2ptrain.measure, p2ptrain.measure.probe, p2ptrain.measure.latency;"
        "import p2ptrain.nat, p2ptrain.app.bootstrap;"
        "print(sorted(m for m in sys.modules if m.startswith('p2ptrain.allreduce')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]"


# -- loopback --------------------------------------------------------------------------------


async def test_receivers_report_what_they_timed_back_to_the_sender(
    make_node: NodeFactory,
) -> None:
    nodes = [await make_node() for _ in range(3)]
    # Loopback moves these streams in a few ms: take every span (the plumbing is tested).
    estimators = [LinkEstimator(EstimatorConfig(min_bytes=0, min_seconds=0.0)) for _ in nodes]
    for node, links in zip(nodes, estimators, strict=True):
        AllReduceService(node, links=links)
    numel = 300_000
    plan = make_plan(nodes, numel, shares=[0.5, 0.5, 0.0], chunk_elements=50_000)
    inputs = [torch.randn(numel) for _ in nodes]
    results = await run_round(nodes, plan, inputs, [1.0, 1.0, 1.0])
    for index, (_, report) in enumerate(results):
        # Every byte sent was timed by the far end and reported back.
        assert sum(t.nbytes for t in report.upload_streams) == report.bytes_sent
        assert sum(t.nbytes for t in report.download_streams) == report.bytes_received
        assert all(t.seconds > 0 for t in report.upload_streams if t.nbytes)
        reducers_out = sum(1 for j in plan.reducers() if j != index)
        senders_in = 2 if index in plan.reducers() else 0
        assert len(report.upload_streams) == reducers_out + senders_in
        assert report.to_dict()["upload_streams"]
    for links in estimators:
        up, down = links.upload_bytes_per_s, links.download_bytes_per_s
        assert up is not None and down is not None and up > 0 and down > 0
        assert links.observations == (1, 1)


async def test_pings_leave_the_smallest_round_trip_on_the_connection(
    make_node: NodeFactory,
) -> None:
    a, b = await make_node(), await make_node()
    rtts = await measure_rtts(a, [b.address], pings=3)
    assert set(rtts) == {b.peer_id} and 0 < rtts[b.peer_id] < 1.0
    assert known_rtts(a) == rtts
    assert known_rtts(b) == {}  # b never pinged


async def test_a_timed_probe_runs_every_stream_for_the_same_time(make_node: NodeFactory) -> None:
    prober = await make_node()
    targets = [await make_node() for _ in range(3)]
    for node in targets:
        serve_probes(node)
    gone = await make_node()
    unreachable = gone.address
    await gone.aclose()
    seconds = 0.3
    results = await probe_peers(
        prober, [t.address for t in [*targets]] + [unreachable], seconds=seconds
    )
    assert len(results) == 3  # the unreachable one is left out
    for result in results:
        for timing in (result.upload, result.download):
            # Sent for 0.3 s and timed where it arrived: a span of about that
            # (from the first header, so a little less), many messages' bytes.
            assert timing.nbytes >= 4 * (64 << 10)
            assert seconds * 0.5 < timing.seconds < seconds * 3
    links = LinkEstimator(EstimatorConfig(min_bytes=0))
    links.observe_probe([r.upload for r in results], [r.download for r in results])
    up, down = links.upload_bytes_per_s, links.download_bytes_per_s
    assert up is not None and down is not None and up > 1e6 and down > 1e6  # loopback


async def test_a_timed_probe_server_refuses_bad_requests(make_node: NodeFactory) -> None:
    prober, server = await make_node(), await make_node()
    serve_probes(server)
    for request in ({"d": MAX_PROBE_SECONDS * 2}, {"d": True}, {"d": 0}):
        stream = await prober.open_stream(server.address, PROBE_METHOD, timeout=10)
        await stream.send(request)
        with pytest.raises(InvalidArgumentError):
            await stream.recv()
        await stream.aclose()
    # Sending before being asked: the server expects {"down": true} after the upload.
    stream = await prober.open_stream(server.address, PROBE_METHOD, timeout=10)
    await stream.send({"d": 0.1})
    await stream.recv()
    await stream.send({"end": True})
    await stream.recv()  # the upload's timing: nothing arrived
    await stream.send({"up": True})
    with pytest.raises(InvalidArgumentError):
        await stream.recv()
    await stream.aclose()
    with pytest.raises(ConfigError):
        await probe_peers(prober, [server.address], seconds=0)
    assert await probe_peers(prober, [], seconds=0.1) == []
