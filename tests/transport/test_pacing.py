"""Send pacing: the pure drain-rate state, the kernel's unsent count, and a shaped link."""

from __future__ import annotations

import socket
import sys
import time

import pytest

from p2ptrain.errors import ConfigError
from p2ptrain.lab.bulk_echo import run_in_lab
from p2ptrain.lab.starlab import LinkSpec, StarLab
from p2ptrain.testing.natlab_plugin import require_netns
from p2ptrain.transport.pacing import (
    SendPacer,
    kernel_pacing_rate,
    kernel_unsent_bytes,
    set_kernel_pacing_rate,
)

# -- the pure state --------------------------------------------------------------------


def _drain(pacer: SendPacer, *, rate: float, queued: int, seconds: float, step: float) -> None:
    """Feed ``pacer`` a link that drains ``rate`` bytes/s while ``queued`` bytes wait."""
    written = queued
    now = 0.0
    while now <= seconds:
        pacer.observe(now, written, queued)
        now += step
        written += int(rate * step)  # the writer refills what drained


def test_without_a_rate_nothing_waits() -> None:
    pacer = SendPacer()
    assert pacer.rate is None
    assert pacer.wait_s(50 << 20) == 0.0
    assert pacer.delays == 0


def test_the_rate_is_learned_from_intervals_with_a_queue() -> None:
    pacer = SendPacer(target_s=0.02, floor_bytes=64 * 1024)
    _drain(pacer, rate=6_000_000, queued=2_000_000, seconds=0.5, step=0.01)
    assert pacer.rate == pytest.approx(6_000_000, rel=0.02)
    assert pacer.limit_bytes() == pytest.approx(max(64 * 1024, 6_000_000 * 0.02), rel=0.02)
    wait = pacer.wait_s(2_000_000)
    assert 0.001 <= wait <= 0.02  # never longer than the target: the link may speed up
    assert pacer.delays == 1
    assert pacer.wait_s(100_000) == 0.0  # below the limit: write now


def test_an_empty_queue_starts_a_new_interval() -> None:
    """When the queue runs dry the application set the pace: that interval is not a sample."""
    pacer = SendPacer(min_interval_s=0.005)
    pacer.observe(0.0, 1_000_000, 500_000)
    pacer.observe(1.0, 1_000_000, 0)  # drained, then idle for a long time
    pacer.observe(2.0, 3_000_000, 500_000)
    assert pacer.rate is None  # no queued interval yet: 0..2 s held an idle gap
    pacer.observe(2.1, 3_100_000, 100_000)
    assert pacer.rate == pytest.approx(5_000_000)  # 0.5 MB drained in 0.1 s


def test_the_floor_keeps_slow_links_full() -> None:
    pacer = SendPacer(target_s=0.02, floor_bytes=128 * 1024)
    _drain(pacer, rate=100_000, queued=1_000_000, seconds=1.0, step=0.01)
    assert pacer.limit_bytes() == 128 * 1024  # 2 kB of target would starve the link
    assert pacer.wait_s(128 * 1024) == 0.0


@pytest.mark.parametrize(
    "kwargs",
    [{"target_s": 0.0}, {"floor_bytes": -1}, {"min_interval_s": 0}, {"smoothing": 1.5}],
)
def test_bad_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        SendPacer(**kwargs)  # type: ignore[arg-type]


# -- the kernel's count ----------------------------------------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIOCOUTQNSD is Linux's")
def test_kernel_unsent_bytes_counts_what_a_stalled_peer_has_not_taken() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    try:
        assert kernel_unsent_bytes(client.fileno()) == 0
        client.setblocking(False)
        sent = 0
        try:
            while sent < 64 << 20:  # the peer never reads: fill both buffers
                sent += client.send(b"x" * 65536)
        except BlockingIOError:
            pass
        unsent = kernel_unsent_bytes(client.fileno())
        assert unsent is not None and 0 < unsent <= sent
    finally:
        for sock in (client, peer, server):
            sock.close()
    assert kernel_unsent_bytes(client.fileno()) is None  # closed: -1 is no socket


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_MAX_PACING_RATE is Linux's")
def test_the_kernel_paces_a_socket_at_its_max_pacing_rate_and_stops_when_cleared() -> None:
    # No fq qdisc needed: Linux TCP paces by itself once the option is set.
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()

    def send_seconds(nbytes: int) -> float:
        start = time.perf_counter()
        client.sendall(b"x" * nbytes)
        got = 0
        while got < nbytes:
            got += len(peer.recv(1 << 20))
        return time.perf_counter() - start

    try:
        assert kernel_pacing_rate(client) is None
        assert set_kernel_pacing_rate(client, 4e6)
        assert kernel_pacing_rate(client) == 4_000_000
        assert send_seconds(1 << 20) > 0.15  # 1 MiB at 4 MB/s: about 0.26 s
        assert set_kernel_pacing_rate(client, None)
        assert kernel_pacing_rate(client) is None
        assert send_seconds(1 << 20) < 0.1  # loopback, unpaced
    finally:
        for sock in (client, peer, server):
            sock.close()
    assert not set_kernel_pacing_rate(client, 1e6)  # closed


def test_a_pacing_rate_must_be_positive() -> None:
    with socket.socket() as sock, pytest.raises(ConfigError):
        set_kernel_pacing_rate(sock, 0.0)


# -- a shaped link ---------------------------------------------------------------------


@pytest.mark.slow
def test_small_calls_do_not_queue_behind_bulk_data_on_a_slow_uplink() -> None:
    """50 Mbit/s up: a 1 MiB-frame stream runs at the link's rate while echo calls stay fast.

    Unpaced (``pace_target_s=None``), the calls wait behind the event loop's
    and the kernel's send buffers: 0.30-0.65 s median on this link; paced,
    about 125 ms, most of it the rest of the 1 MiB frame being written.
    """
    require_netns()
    link = LinkSpec(50, 100)
    with StarLab([link, link]) as lab:
        paced = run_in_lab(lab, 24, paced=True)
        unpaced = run_in_lab(lab, 24, paced=False)
    for result in (paced, unpaced):
        assert result["bytes"] == 24 << 20
        assert result["bytes"] / result["seconds"] >= 0.85 * link.upload_bytes_per_s
        assert result["count"] >= 5  # the median of a few calls at least
    assert unpaced["delays"] == 0
    assert paced["median"] < 0.25, paced
    assert paced["median"] < 0.6 * unpaced["median"], (paced, unpaced)
    assert paced["delays"] > 0  # the pacer held bulk frames
