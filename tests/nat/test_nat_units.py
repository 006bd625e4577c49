"""NAT traversal, the pure parts: STUN codec, token buckets, planning, records, configs.

No event loop and no network: plain function calls with time as an argument.
"""

from __future__ import annotations

import struct
from typing import Any

import pytest
from aioice import stun as aioice_stun
from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.errors import ConfigError, RemoteProtocolError, ResourceExhaustedError
from p2ptrain.nat import ATTEMPTS, LocalView, NATConfig, PeerRecord, RelayLimits, plan_paths
from p2ptrain.nat.paths import webrtc_config_for
from p2ptrain.nat.reachability import DialbackOutcome, classify
from p2ptrain.nat.records import RendezvousPoint
from p2ptrain.nat.relay import RelayLimiter, TokenBucket
from p2ptrain.nat.service import wins_crossing
from p2ptrain.nat.signaling import parse_endpoint
from p2ptrain.nat.stun import (
    MAX_STUN_BYTES,
    answer_binding,
    binding_request,
    parse_binding_response,
)
from p2ptrain.secure.identity import Identity, PeerID
from p2ptrain.transport.webrtc_config import IceServer, WebRTCConfig

MiB = 1 << 20
TXID = bytes(range(12))


# -- STUN codec ----------------------------------------------------------------------------------


def test_binding_request_golden_bytes() -> None:
    txid, data = binding_request(TXID)
    assert txid == TXID
    # type 0x0001, length 8 (one FINGERPRINT attribute), magic cookie, transaction id
    assert data[:20] == bytes.fromhex("000100082112a442") + TXID
    assert data[20:24] == bytes.fromhex("80280004")  # FINGERPRINT, 4 bytes
    assert len(data) == 28


def test_a_request_is_answered_with_the_source_address() -> None:
    _, request = binding_request(TXID)
    response = answer_binding(request, ("198.51.100.7", 40123))
    assert response is not None
    assert parse_binding_response(response, TXID) == ("198.51.100.7", 40123)
    parsed = aioice_stun.parse_message(response)  # a standard client reads it too
    assert parsed.attributes["XOR-MAPPED-ADDRESS"] == ("198.51.100.7", 40123)
    assert parsed.message_class == aioice_stun.Class.RESPONSE


def test_ipv6_sources_are_answered() -> None:
    _, request = binding_request(TXID)
    response = answer_binding(request, ("2001:db8::1", 5))
    assert response is not None and parse_binding_response(response, TXID) == ("2001:db8::1", 5)


def test_only_binding_requests_are_answered() -> None:
    _, request = binding_request(TXID)
    response = answer_binding(request, ("192.0.2.1", 1))
    assert response is not None
    assert answer_binding(response, ("192.0.2.1", 1)) is None  # no reflection loops
    allocate = aioice_stun.Message(aioice_stun.Method.ALLOCATE, aioice_stun.Class.REQUEST, TXID)
    assert answer_binding(bytes(allocate), ("192.0.2.1", 1)) is None
    assert answer_binding(b"hello", ("192.0.2.1", 1)) is None
    assert answer_binding(request + bytes(MAX_STUN_BYTES), ("192.0.2.1", 1)) is None


def test_a_response_to_another_transaction_is_ignored() -> None:
    _, request = binding_request(TXID)
    response = answer_binding(request, ("192.0.2.1", 1))
    assert response is not None
    assert parse_binding_response(response, bytes(12)) is None
    corrupted = bytearray(response)
    corrupted[-1] ^= 1  # the FINGERPRINT no longer matches
    assert parse_binding_response(bytes(corrupted), TXID) is None


def test_a_bad_transaction_id_is_refused() -> None:
    with pytest.raises(ValueError, match="12 bytes"):
        binding_request(b"short")


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=600))
def test_the_codec_never_raises_on_garbage(data: bytes) -> None:
    assert answer_binding(data, ("192.0.2.1", 1)) is None or data[4:8] == b"\x21\x12\xa4\x42"
    parse_binding_response(data, TXID)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=120))
def test_the_codec_never_raises_on_stun_shaped_garbage(body: bytes) -> None:
    header = struct.pack("!HHI12s", 0x0001, len(body), aioice_stun.COOKIE, TXID)
    answer_binding(header + body, ("192.0.2.1", 1))
    response_header = struct.pack("!HHI12s", 0x0101, len(body), aioice_stun.COOKIE, TXID)
    parse_binding_response(response_header + body, TXID)


# -- token buckets and relay limits --------------------------------------------------------------


def test_token_bucket_spends_the_burst_then_paces() -> None:
    bucket = TokenBucket(rate=1000, burst=500, now=0.0)
    assert bucket.take(500, 0.0) == 0.0
    assert bucket.delay(100, 0.0) == pytest.approx(0.1)
    assert bucket.take(100, 0.0) == pytest.approx(0.1)  # reserved: the level is now -100
    assert bucket.take(100, 0.0) == pytest.approx(0.2)
    assert bucket.delay(100, 1.0) == 0.0  # refilled, capped at the burst
    assert bucket.level <= 500


def test_a_circuit_is_paced_by_the_pair_and_the_total() -> None:
    limits = RelayLimits(
        pair_bytes_per_s=1 * MiB,
        pair_burst_bytes=1 * MiB,
        total_bytes_per_s=1.5 * MiB,
        total_burst_bytes=1 * MiB,
    )
    limiter = RelayLimiter(limits, now=0.0)
    first, second = Identity.generate().peer_id, Identity.generate().peer_id
    one = limiter.open(first, second, 0.0)
    two = limiter.open(second, first, 0.0)
    assert one.charge(MiB, 0.0) == 0.0  # both buckets had a burst
    assert two.charge(MiB // 2, 0.0) == pytest.approx(1 / 3)  # the total bucket binds
    assert one.carried == MiB and limiter.relayed_bytes == MiB + MiB // 2


def test_the_relay_refuses_beyond_its_limits() -> None:
    limits = RelayLimits(circuit_bytes=1000, circuit_seconds=10, max_circuits=1, max_delay=1.0)
    limiter = RelayLimiter(limits, now=0.0)
    a, b = Identity.generate().peer_id, Identity.generate().peer_id
    budget = limiter.open(a, b, 0.0)
    with pytest.raises(ResourceExhaustedError, match="relayed connections are open"):
        limiter.open(b, a, 0.0)
    budget.charge(600, 0.0)
    with pytest.raises(ResourceExhaustedError, match="may carry 1000 bytes"):
        budget.charge(600, 0.1)
    with pytest.raises(ResourceExhaustedError, match="may last 10 s"):
        budget.charge(1, 10.0)
    budget.close()
    assert limiter.active == 0
    budget = limiter.open(a, b, 20.0)  # the slot is free again
    slow = RelayLimiter(RelayLimits(pair_bytes_per_s=1024, pair_burst_bytes=1024, max_delay=1.0), 0)
    paced = slow.open(a, b, 0.0)
    with pytest.raises(ResourceExhaustedError, match="bandwidth limit"):
        paced.charge(64 * 1024, 0.0)


# -- reachability --------------------------------------------------------------------------------


def test_one_successful_dialback_means_public() -> None:
    result = classify(
        [DialbackOutcome("x", False, reason="timed out"), DialbackOutcome("y", True, "1.2.3.4:5")],
        [],
    )
    assert result.public and result.nat == "public" and result.observed == "1.2.3.4:5"


def test_stun_mappings_tell_easy_from_symmetric() -> None:
    failed = [DialbackOutcome("x", False, reason="timed out")]
    same = [("s1", ("1.2.3.4", 5000)), ("s2", ("1.2.3.4", 5000))]
    different = [("s1", ("1.2.3.4", 5000)), ("s2", ("1.2.3.4", 6001))]
    assert classify(failed, same).nat == "easy"
    assert classify(failed, different).nat == "symmetric"
    assert classify(failed, [("s1", ("1.2.3.4", 5000)), ("s2", None)]).nat == "unknown"
    assert classify([], []).nat == "unknown"
    assert "no answer" in " ".join(classify(failed, [("s1", None)]).notes)


# -- path planning -------------------------------------------------------------------------------

POINT = RendezvousPoint(
    f"{Identity.generate().peer_id}@100.64.1.2:4000", relay=True, stun_port=4000
)
NO_RELAY = RendezvousPoint(f"{Identity.generate().peer_id}@100.64.2.2:4000")
EASY = PeerRecord(nat="easy", rendezvous=(POINT,), holepunch=True)
TURN = WebRTCConfig(ice_servers=(IceServer("turn:100.64.3.2:3478", "u", "p"),))


def names(local: LocalView, target: PeerRecord, config: NATConfig) -> list[str]:
    return [step.name for step in plan_paths(local, target, config)[0]]


def test_two_easy_nats_punch_then_ice_then_relay() -> None:
    local = LocalView(nat="easy", holepunch=True)
    assert names(local, EASY, NATConfig()) == ["tcp-holepunch", "webrtc", "relay"]
    skipped = plan_paths(local, EASY, NATConfig())[1]
    assert list(skipped) == ["tcp-direct", "tcp-reverse"]
    assert names(local, EASY, NATConfig(holepunch=False)) == ["webrtc", "relay"]


def test_a_symmetric_nat_skips_punching_and_turnless_ice() -> None:
    local = LocalView(nat="symmetric", holepunch=True)
    plan, skipped = plan_paths(local, EASY, NATConfig())
    assert [s.name for s in plan] == ["relay"]
    assert "symmetric" in skipped["tcp-holepunch"] and "TURN" in skipped["webrtc"]
    assert names(local, EASY, NATConfig(webrtc=TURN)) == ["webrtc", "relay"]
    target = PeerRecord(nat="symmetric", rendezvous=(POINT,), holepunch=True)
    assert names(LocalView(nat="easy", holepunch=True), target, NATConfig()) == ["relay"]


def test_a_public_target_is_dialed_directly_and_a_public_dialer_is_dialed_back() -> None:
    public = PeerRecord(nat="public", addresses=("100.64.1.2:4000",))
    plan, skipped = plan_paths(LocalView(nat="easy", holepunch=True), public, NATConfig())
    assert [s.name for s in plan] == ["tcp-direct"]
    assert skipped["relay"] == "skipped: the target has no rendezvous point"
    me = LocalView(public=True, nat="public", address="100.64.9.2:1", reverse=True)
    assert names(me, EASY, NATConfig()) == ["tcp-reverse", "webrtc", "relay"]


def test_relays_only_where_a_rendezvous_point_relays() -> None:
    target = PeerRecord(nat="easy", rendezvous=(NO_RELAY,), holepunch=True)
    plan, skipped = plan_paths(LocalView(nat="symmetric"), target, NATConfig())
    assert plan == [] and "relays" in skipped["relay"]
    assert "disabled" in plan_paths(LocalView(), EASY, NATConfig(use_relays=False))[1]["relay"]


def test_attempts_can_be_restricted_and_deadlines_are_bounded() -> None:
    config = NATConfig(attempts=("relay",))
    plan, skipped = plan_paths(LocalView(nat="easy", holepunch=True), EASY, config)
    assert [s.name for s in plan] == ["relay"]
    assert skipped["webrtc"] == "skipped: not in NATConfig.attempts"
    assert list(skipped) == [a for a in ATTEMPTS if a != "relay"]
    ice = plan_paths(LocalView(), EASY, NATConfig())[0][0]
    assert ice.name == "webrtc" and ice.timeout < 30  # never aioice's ~64 s


def test_a_missing_stun_server_is_taken_from_the_rendezvous_point() -> None:
    config = webrtc_config_for(NATConfig(), ("100.64.1.2", 4000))
    assert [s.url for s in config.ice_servers] == ["stun:100.64.1.2:4000"]
    own = NATConfig(webrtc=WebRTCConfig(ice_servers=(IceServer("stun:192.0.2.9:3478"),)))
    assert webrtc_config_for(own, ("100.64.1.2", 4000)) is own.webrtc
    with_turn = webrtc_config_for(NATConfig(webrtc=TURN), ("100.64.1.2", 4000))
    assert with_turn.ice_servers[0].url == "stun:100.64.1.2:4000"


@given(st.binary(min_size=32, max_size=32), st.binary(min_size=32, max_size=32))
def test_exactly_one_side_of_a_crossing_dial_wins(x: bytes, y: bytes) -> None:
    us, them = PeerID(x), PeerID(y)
    if us == them:
        assert not wins_crossing(us, them)
    else:
        assert wins_crossing(us, them) != wins_crossing(them, us)


# -- records and configs --------------------------------------------------------------------------


def test_records_round_trip() -> None:
    record = PeerRecord(
        nat="easy", addresses=("100.64.1.2:4000",), rendezvous=(POINT, NO_RELAY), holepunch=True
    )
    assert PeerRecord.from_value(record.to_value()) == record


@pytest.mark.parametrize(
    "value",
    [
        None,
        {"n": "full-cone"},
        {"n": "easy", "a": ["not an address"]},
        {"n": "easy", "r": [["100.64.1.2:4000", True, None]]},  # no PeerID
        {"n": "easy", "r": [[POINT.address, "yes", None]]},
        {"n": "easy", "r": [[POINT.address, True, 70000]]},
        {"n": "easy", "a": ["1.2.3.4:5"] * 9},
        {"n": "easy", "h": 1},
    ],
)
def test_malformed_records_are_refused(value: Any) -> None:
    with pytest.raises(RemoteProtocolError):
        PeerRecord.from_value(value)


def test_endpoints_are_parsed_strictly() -> None:
    assert parse_endpoint("100.64.1.2:80") == ("100.64.1.2", 80)
    assert parse_endpoint("[2001:db8::1]:80") == ("2001:db8::1", 80)
    for bad in ("host:80", "1.2.3.4", "1.2.3.4:0", "1.2.3.4:99999", 7, None):
        assert parse_endpoint(bad) is None


@pytest.mark.parametrize(
    "changes",
    [
        {"public": "yes"},
        {"rendezvous": "peer@1.2.3.4:5"},
        {"rendezvous": ("1.2.3.4:5",)},  # no PeerID
        {"stun_port": 70000},
        {"stun_servers": ("nope",)},
        {"rendezvous_count": 0},
        {"direct_timeout": 0},
        {"signal_timeout": float("nan")},
        {"republish_interval": 700.0, "record_ttl": 600.0},
        {"attempts": ("carrier-pigeon",)},
        {"webrtc": "default"},
    ],
)
def test_nat_config_rejects_bad_values(changes: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        NATConfig(**changes)


@pytest.mark.parametrize(
    "changes",
    [
        {"pair_bytes_per_s": 0},
        {"total_burst_bytes": 10},
        {"max_circuits": 0},
        {"circuit_bytes": 0},
        {"circuit_seconds": -1},
        {"max_delay": float("inf")},
    ],
)
def test_relay_limits_reject_bad_values(changes: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        RelayLimits(**changes)


def test_nat_config_knows_its_ice_servers() -> None:
    assert not NATConfig().has_turn and not NATConfig().has_stun
    assert NATConfig(webrtc=TURN).has_turn
    assert NATConfig().webrtc.connect_timeout == 10.0


def test_the_public_api_is_pinned() -> None:
    from p2ptrain import nat

    assert sorted(nat.__all__) == [
        "ATTEMPTS",
        "CircuitSignaling",
        "LocalView",
        "NATConfig",
        "NATRouter",
        "NATService",
        "PeerRecord",
        "Reachability",
        "RelayLimits",
        "RelayTransport",
        "RendezvousPoint",
        "Traversal",
        "check_reachability",
        "connect_peer",
        "find_record",
        "plan_paths",
        "publish_record",
        "start_node",
        "traverse",
    ]
    assert all(hasattr(nat, name) for name in nat.__all__)


def test_failed_traversals_count_their_attempts_not_their_reasons() -> None:
    from p2ptrain.nat.stats import TraversalStats

    stats = TraversalStats()
    stats.record_failure({"tcp-direct": "connection refused", "webrtc": "timed out"})
    stats.record_failure({"tcp-direct": "connection refused"})
    assert stats.failed == 2
    assert dict(stats.fallbacks) == {"tcp-direct": 2, "webrtc": 1}
