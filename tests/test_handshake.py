"""The authenticated handshake, over the in-memory pair and over real TCP."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from conftest import recorded_handshake, shake

from p2ptrain.errors import (
    AdmissionError,
    AuthenticationError,
    ConfigError,
    HandshakeError,
    TransportTimeoutError,
)
from p2ptrain.handshake import (
    AdmissionPolicy,
    HandshakeResult,
    Hello,
    make_auth,
    transcript_hash,
    verify_auth,
)
from p2ptrain.identity import Identity, PeerID
from p2ptrain.testing.memory import MemoryTransport, memory_transport_pair
from p2ptrain.wire.frames import Frame, FrameType

OPEN = AdmissionPolicy()
SECRET = AdmissionPolicy(secret=b"0123456789abcdef-swarm")


async def run_pair(
    a_identity: Identity,
    b_identity: Identity,
    *,
    a_policy: AdmissionPolicy = OPEN,
    b_policy: AdmissionPolicy = OPEN,
    a_swarm: str = "s",
    b_swarm: str = "s",
    expected: PeerID | None = None,
) -> tuple[HandshakeResult | BaseException, HandshakeResult | BaseException]:
    a, b = memory_transport_pair()
    results = await asyncio.gather(
        shake(
            a, a_identity, initiator=True, swarm=a_swarm, policy=a_policy, expected_peer=expected
        ),
        shake(
            b, b_identity, initiator=False, swarm=b_swarm, stream_window=1 << 16, policy=b_policy
        ),
        return_exceptions=True,
    )
    return results[0], results[1]


async def test_both_sides_learn_each_others_peer_id() -> None:
    alice, bob = Identity.generate(), Identity.generate()
    ra, rb = await run_pair(alice, bob, expected=bob.peer_id)
    assert isinstance(ra, HandshakeResult) and isinstance(rb, HandshakeResult)
    assert ra.peer_id == bob.peer_id and rb.peer_id == alice.peer_id
    assert ra.stream_window == 1 << 16 and rb.stream_window == 1 << 20


async def test_dialing_the_wrong_peer_is_refused() -> None:
    alice, bob, carol = Identity.generate(), Identity.generate(), Identity.generate()
    ra, rb = await run_pair(alice, bob, expected=carol.peer_id)
    assert isinstance(ra, AuthenticationError)
    assert "expected peer" in str(ra)
    assert isinstance(rb, AuthenticationError)  # told why by the REFUSE frame
    assert "refused" in str(rb)


async def test_admission_secret() -> None:
    alice, bob = Identity.generate(), Identity.generate()
    ra, rb = await run_pair(alice, bob, a_policy=SECRET, b_policy=SECRET)
    assert isinstance(ra, HandshakeResult) and isinstance(rb, HandshakeResult)
    wrong = AdmissionPolicy(secret=b"another-secret-of-16")
    ra, rb = await run_pair(alice, bob, a_policy=wrong, b_policy=SECRET)
    assert isinstance(rb, AdmissionError) and "admission secret" in str(rb)
    assert isinstance(ra, HandshakeError) and "admission" in str(ra)


async def test_allowlist() -> None:
    alice, bob, mallory = Identity.generate(), Identity.generate(), Identity.generate()
    policy = AdmissionPolicy(allowlist=frozenset({alice.public_key, bob.public_key}))
    _ra, rb = await run_pair(alice, bob, b_policy=policy)
    assert isinstance(rb, HandshakeResult)
    rm, rb = await run_pair(mallory, bob, b_policy=policy)
    assert isinstance(rb, AdmissionError) and "allowlist" in str(rb)
    assert isinstance(rm, AdmissionError) and "allowlist" in str(rm)


async def test_swarm_mismatch_gives_a_reason_to_both() -> None:
    ra, rb = await run_pair(Identity.generate(), Identity.generate(), a_swarm="x", b_swarm="y")
    assert isinstance(ra, HandshakeError) and isinstance(rb, HandshakeError)
    assert "swarm" in str(ra) and "swarm" in str(rb)


def test_policy_validation() -> None:
    with pytest.raises(ConfigError):
        AdmissionPolicy(secret=b"short")
    with pytest.raises(ConfigError):
        AdmissionPolicy(allowlist=frozenset({b"abc"}))


def _hello(identity: Identity, nonce: bytes) -> Hello:
    return Hello(identity.public_key, nonce, "s", 1 << 20, 1 << 20)


def test_transcript_binds_both_nonces_and_keys() -> None:
    a, b = Identity.generate(), Identity.generate()
    base = transcript_hash(_hello(a, b"\x01" * 32), _hello(b, b"\x02" * 32))
    assert base != transcript_hash(_hello(a, b"\x03" * 32), _hello(b, b"\x02" * 32))
    assert base != transcript_hash(_hello(a, b"\x01" * 32), _hello(b, b"\x03" * 32))
    assert base != transcript_hash(_hello(b, b"\x01" * 32), _hello(a, b"\x02" * 32))


def test_wrong_signature_and_reflection_are_refused() -> None:
    a, b, mallory = Identity.generate(), Identity.generate(), Identity.generate()
    ha, hb = _hello(a, b"\x01" * 32), _hello(b, b"\x02" * 32)
    transcript = transcript_hash(ha, hb)
    # Mallory claims a's key but signs with her own.
    forged = make_auth(mallory, transcript, initiator=True, policy=OPEN)
    with pytest.raises(AuthenticationError, match="does not verify"):
        verify_auth(
            forged, ha, transcript, remote_is_initiator=True, policy=OPEN, expected_peer=None
        )
    # b's own responder signature reflected back as if it came from the initiator.
    reflected = make_auth(b, transcript, initiator=False, policy=OPEN)
    hb_as_a = dataclasses.replace(ha, public_key=b.public_key)
    with pytest.raises(AuthenticationError):
        verify_auth(
            reflected,
            hb_as_a,
            transcript,
            remote_is_initiator=True,
            policy=OPEN,
            expected_peer=None,
        )
    bad_type = Frame(FrameType.AUTH, fields={"s": "not bytes"})
    with pytest.raises(AuthenticationError):
        verify_auth(
            bad_type, ha, transcript, remote_is_initiator=True, policy=OPEN, expected_peer=None
        )


async def test_replayed_auth_from_an_earlier_session_is_refused() -> None:
    """An attacker who recorded alice's HELLO and AUTH cannot replay them later."""
    alice, bob = Identity.generate(), Identity.generate()
    rb, recorded = await recorded_handshake(alice, bob, swarm="s")
    assert rb.peer_id == alice.peer_id
    hello, auth, accept = recorded
    assert accept.type is FrameType.ACCEPT
    # Replay both frames against a fresh session with bob.
    attacker, victim = memory_transport_pair()
    attacker.send_frame_nowait(hello)
    attacker.send_frame_nowait(auth)
    attacker.send_frame_nowait(accept)
    with pytest.raises(AuthenticationError, match="does not verify"):
        await shake(victim, bob, initiator=False)


async def test_silent_peer_times_out() -> None:
    a, _b = memory_transport_pair()
    with pytest.raises(TransportTimeoutError, match="timed out"):
        await shake(a, Identity.generate(), initiator=True, timeout=0.2)


async def test_malformed_hello_is_a_protocol_error() -> None:
    from p2ptrain.errors import RemoteProtocolError

    attacker, victim = memory_transport_pair()
    attacker.send_frame_nowait(Frame(FrameType.HELLO, fields={"v": 1, "pk": b"short"}))
    with pytest.raises(RemoteProtocolError, match="public key"):
        await shake(victim, Identity.generate(), initiator=False)
    assert isinstance(attacker, MemoryTransport)
