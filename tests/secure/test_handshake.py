"""The authenticated handshake, over the in-memory pair and over real TCP."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from conftest import recorded_handshake, shake
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from p2ptrain.errors import (
    AdmissionError,
    AuthenticationError,
    ConfigError,
    HandshakeError,
    RemoteProtocolError,
    TransportTimeoutError,
)
from p2ptrain.secure.handshake import (
    AdmissionPolicy,
    HandshakeParams,
    HandshakeResult,
    Initiator,
    Responder,
    swarm_tag,
)
from p2ptrain.secure.identity import Identity, PeerID
from p2ptrain.testing.memory import MemoryTransport, memory_transport_pair
from p2ptrain.wire.frames import Frame, FrameType, encode_frame, frame_header
from p2ptrain.wire.records import RecordOpener, RecordSealer

OPEN = AdmissionPolicy()
SECRET = AdmissionPolicy(secret=bytes(range(32)))


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
    wrong = AdmissionPolicy(secret=bytes(32))
    ra, rb = await run_pair(alice, bob, a_policy=wrong, b_policy=SECRET)
    assert isinstance(rb, AdmissionError) and "swarm key" in str(rb)
    assert isinstance(ra, HandshakeError) and "admission" in str(ra)
    # The responder's proof is checked too: an impostor responder without the key fails.
    ra, rb = await run_pair(alice, bob, a_policy=SECRET, b_policy=OPEN)
    assert isinstance(ra, AdmissionError) and "swarm key" in str(ra)


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
    with pytest.raises(ConfigError, match="keygen"):
        AdmissionPolicy(secret=b"short")
    with pytest.raises(ConfigError, match="keygen"):
        AdmissionPolicy(secret=b"a passphrase that is long enough to pass")
    with pytest.raises(ConfigError):
        AdmissionPolicy(allowlist=frozenset({b"abc"}))


VECTOR_SEEDS = (bytes(range(32)), bytes(range(32, 64)))  # initiator, responder identities
VECTOR_EPHEMERAL = (bytes(range(64, 96)), bytes(range(96, 128)))
VECTOR_KEY = bytes(range(128, 160))  # the swarm key
VECTOR = {
    "frame1": "00000055000000519401000083a17602a27377c420a0279f4a4e3df16692c10e1d23f80d6588"
    "4088cd321bfde3c1d0f744c6f54a38a165c42079a631eede1bf9c98f12032cdeadd0e7a079398fc786b88cc8"
    "46ec89af85a51a",
    "transcript": "dd1e79e80b55b69e3cf83aea66f5afba2b20377123a0fe52645dd7bfa3ddf5c9",
    "i2r": "dd8bc14695096b61fb33d30eb935204eec7d86e518de086a64e1685842951d0c",
    "r2i": "b8aca1728b72ff8725624aa7432d02f702f0f897e72d9cf31ac47d1e7e9f6326",
    "record4": "0000003d000000398ecdce565d86535a3efecf11804e4260fcb49958528fe7ce20f408332d46"
    "b5995086ed8621fb83da2f61bf282cfb1106edc44b1cefb8af56d8",
}


def _vector_states(
    initiator_binding: tuple[bytes, bytes] | None = None,
    responder_binding: tuple[bytes, bytes] | None = None,
) -> tuple[Initiator, Responder]:
    policy = AdmissionPolicy(secret=VECTOR_KEY)
    states = []
    for index, binding in enumerate((initiator_binding, responder_binding)):
        params = HandshakeParams(
            Identity.from_seed(VECTOR_SEEDS[index]),
            "vector-swarm",
            1 << 20,
            1 << 24,
            policy,
            channel_binding=binding,
        )
        ephemeral = X25519PrivateKey.from_private_bytes(VECTOR_EPHEMERAL[index])
        states.append((Initiator if index == 0 else Responder)(params, ephemeral=ephemeral))
    initiator, responder = states
    assert isinstance(initiator, Initiator) and isinstance(responder, Responder)
    return initiator, responder


def _wire(frame: Frame) -> bytes:
    head, payload = encode_frame(frame)
    return head + bytes(payload)


def test_fixed_test_vectors() -> None:
    """Deterministic keys give the transcript, keys and record bytes of docs/security.md."""
    initiator, responder = _vector_states()
    frame1 = initiator.hello()
    assert _wire(frame1).hex() == VECTOR["frame1"]
    frame3 = initiator.auth(responder.reply(frame1))
    frame4 = responder.accept(frame3)
    initiator.finish(frame4)
    assert initiator.result is not None and responder.result is not None
    assert initiator.result.transcript.hex() == VECTOR["transcript"]
    assert responder.result.transcript == initiator.result.transcript
    assert initiator.keys is not None and responder.keys is not None
    assert initiator.keys.send.hex() == VECTOR["i2r"] == responder.keys.receive.hex()
    assert initiator.keys.receive.hex() == VECTOR["r2i"] == responder.keys.send.hex()
    head, payload = RecordSealer(responder.keys).seal(frame_header(frame4), None)
    assert payload is None and head.hex() == VECTOR["record4"]
    opened = RecordOpener(initiator.keys).open_header(head[:8], head[8:], has_payload=False)
    assert opened == frame_header(frame4)


def test_identities_travel_only_encrypted() -> None:
    initiator, responder = _vector_states()
    frame1 = initiator.hello()
    frame2 = responder.reply(frame1)
    frame3 = initiator.auth(frame2)
    seen = _wire(frame1) + _wire(frame2) + _wire(frame3)
    for seed in VECTOR_SEEDS:
        identity = Identity.from_seed(seed)
        for secret in (identity.public_key, identity.peer_id.digest, str(identity.peer_id)):
            needle = secret.encode() if isinstance(secret, str) else secret
            assert needle not in seen
    assert b"vector-swarm" not in seen


def test_dtls_binding_mismatch_fails_the_signature() -> None:
    """A signaling MITM terminates DTLS twice: each side sees other fingerprints."""
    initiator, responder = _vector_states(
        (b"fp-initiator", b"fp-mitm-1"), (b"fp-responder", b"fp-mitm-2")
    )
    with pytest.raises(AuthenticationError):
        initiator.auth(responder.reply(initiator.hello()))
    initiator, responder = _vector_states((b"fp-i", b"fp-r"), (b"fp-r", b"fp-i"))
    responder.accept(initiator.auth(responder.reply(initiator.hello())))  # the same session


def test_admission_proof_needs_the_responders_identity_first() -> None:
    """Frame 1 carries no proof; frame 2 no proof; the initiator's comes with frame 3."""
    initiator, responder = _vector_states()
    frame1 = initiator.hello()
    frame2 = responder.reply(frame1)
    assert set(frame1.fields or {}) == {"v", "sw", "e"}
    assert set(frame2.fields or {}) == {"e", "c"}
    # Frame 2 with its ciphertext altered never yields the initiator's proof.
    forged = Frame(FrameType.HELLO, fields={"e": frame2.field("e"), "c": b"\x00" * 40})
    with pytest.raises(AuthenticationError, match="failed authentication"):
        initiator.auth(forged)


async def test_replayed_handshake_from_an_earlier_session_is_refused() -> None:
    """An attacker who recorded alice's frames cannot replay them later."""
    alice, bob = Identity.generate(), Identity.generate()
    rb, recorded = await recorded_handshake(alice, bob, swarm="s")
    assert rb.peer_id == alice.peer_id
    hello, auth = recorded[0], recorded[1]
    assert hello.type is FrameType.HELLO and auth.type is FrameType.AUTH
    attacker, victim = memory_transport_pair()
    bob_side = asyncio.ensure_future(shake(victim, bob, initiator=False))
    attacker.send_frame_nowait(hello)
    await asyncio.wait_for(attacker.recv_frame(), 5)  # bob's fresh frame 2
    attacker.send_frame_nowait(auth)
    with pytest.raises(AuthenticationError, match="failed authentication"):
        await asyncio.wait_for(bob_side, 5)


async def test_silent_peer_times_out() -> None:
    a, _b = memory_transport_pair()
    with pytest.raises(TransportTimeoutError, match="timed out"):
        await shake(a, Identity.generate(), initiator=True, timeout=0.2)


async def test_malformed_hello_is_a_protocol_error() -> None:
    attacker, victim = memory_transport_pair()
    attacker.send_frame_nowait(Frame(FrameType.HELLO, fields={"v": 2, "sw": swarm_tag("s")}))
    with pytest.raises(RemoteProtocolError, match="'e' is malformed"):
        await shake(victim, Identity.generate(), initiator=False)
    assert isinstance(attacker, MemoryTransport)


async def test_insecure_plaintext_needs_both_sides() -> None:
    """The trusted-cluster opt-out: both must ask for it; nobody can be talked into it."""
    alice, bob = Identity.generate(), Identity.generate()
    for a_plain, b_plain in ((True, False), (False, True)):
        a, b = memory_transport_pair()
        ra, rb = await asyncio.gather(
            shake(a, alice, initiator=True, insecure_plaintext=a_plain),
            shake(b, bob, initiator=False, insecure_plaintext=b_plain),
            return_exceptions=True,
        )
        assert isinstance(rb, HandshakeError) and "--insecure-plaintext" in str(rb)
        assert isinstance(ra, HandshakeError) and "plaintext" in str(ra)
    a, b = memory_transport_pair()
    ra, rb = await asyncio.gather(
        shake(a, alice, initiator=True, insecure_plaintext=True),
        shake(b, bob, initiator=False, insecure_plaintext=True),
    )
    assert ra.peer_id == bob.peer_id and rb.peer_id == alice.peer_id
    assert not a.sealed and not b.sealed
    # The choice is in the transcript: a HELLO with the flag added on the way fails.
    initiator, responder = _vector_states()
    hello = initiator.hello()
    forged = Frame(FrameType.HELLO, fields={**(hello.fields or {}), "p": True})
    plain_params = dataclasses.replace(responder.params, insecure_plaintext=True)
    plain_responder = Responder(plain_params)
    with pytest.raises(AuthenticationError):
        initiator.auth(plain_responder.reply(forged))


async def test_a_low_order_ephemeral_key_is_a_protocol_error() -> None:
    """X25519 with an all-zero key gives an all-zero secret: refused, never used."""
    attacker, victim = memory_transport_pair()
    attacker.send_frame_nowait(
        Frame(FrameType.HELLO, fields={"v": 2, "sw": swarm_tag("s"), "e": bytes(32)})
    )
    with pytest.raises(RemoteProtocolError, match="ephemeral key is invalid"):
        await shake(victim, Identity.generate(), initiator=False)
