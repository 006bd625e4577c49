"""The handshake that opens every connection: key agreement bound to identities.

Theory of operation
-------------------
A Noise-XX-like pattern (ephemeral X25519, then each side's Ed25519 identity,
sent encrypted, signing the transcript), as in SIGMA-I and TLS 1.3. Both
sides keep a transcript hash ``h`` and a chaining key ``ck``::

    h = ck = SHA-256("p2ptrain/handshake/v2/X25519-Ed25519-AESGCM-SHA256")
    MixHash(x):  h = SHA-256(h || u32(len(x)) || x)
    MixKey(x):   ck, k = HKDF-SHA256(salt=ck, ikm=x, info="", 64 bytes); n = 0
    Seal(x):     c = AES-256-GCM(k, nonce(n), x, ad=h); n += 1; MixHash(c)

``MixHash(binding)`` comes first: empty for TCP and relays; for WebRTC both
DTLS certificate fingerprints (the initiator's, then the responder's), so a
man in the middle of the signaling, who must terminate DTLS with his own
certificates, makes the two transcripts differ and the signatures fail.
Then five frames (``->`` initiator to responder)::

    1 -> HELLO  {v: 2, sw: SHA-256("p2ptrain/swarm/" || swarm), e: e_i}
                                    MixHash(u32 v), MixHash(sw), MixHash(e_i)
    2 <- HELLO  {e: e_r, c: Seal(R)}   MixHash(e_r), MixKey(X25519(e_r, e_i))
    3 -> AUTH   {c: Seal(I)}
         keys: HKDF-SHA256(salt=ck, ikm="", info="p2ptrain/records/v2" || h, 64 bytes)
               = initiator-to-responder key || responder-to-initiator key
    4 <- ACCEPT {a: proof_r}        the first sealed record (p2ptrain.wire.records)
    5 -> ACCEPT {}                  the first sealed record the other way

``R`` and ``I`` are msgpack maps ``{pk, w, f, s}`` (+ ``a`` in ``I``): the
Ed25519 public key, the stream window and frame limit the sender accepts,
and ``s = Sign(role || t)`` with ``t = SHA-256(h || pk || u64(w) || u64(f))``
taken just before the seal, ``role`` ``b"p2ptrain responder"`` or
``b"p2ptrain initiator"`` (a signature cannot be reflected). So each
signature covers everything sent so far, both ephemeral keys and the
signer's own identity; the identity travels encrypted under the ``ee`` key,
which also binds it to this key exchange. Nothing that names a peer, the
swarm, or a method is ever in the clear: only ``sw``, a hash.

Admission: with a swarm key ``K`` (256 random bits, see
:mod:`p2ptrain.secure.swarm_key`) the initiator adds ``a = HMAC-SHA256(K,
"p2ptrain admission initiator" || t)`` to ``I``, only after the responder
proved its identity in frame 2; the responder answers with ``proof_r =
HMAC-SHA256(K, "p2ptrain admission responder" || h)`` in frame 4, only after
the initiator proved its own in frame 3. Both proofs are bound to this
session. An allowlist is checked on the public keys.

The handshake completes for the initiator with frame 4 and for the
responder with frame 5, so neither believes it is connected while the other
refuses. A side that refuses sends ``REFUSE {c: code, m: message}`` and
closes: sealed, with the full reason, once records have started; in the
clear, with a generic message only (it must not name anybody), before.
Codes: ``authentication``, ``admission``, ``swarm``, ``version``, ``protocol``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import struct
from dataclasses import dataclass, field
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from p2ptrain.errors import (
    AdmissionError,
    AuthenticationError,
    ConfigError,
    HandshakeError,
    P2PTrainError,
    RemoteProtocolError,
    TransportTimeoutError,
)
from p2ptrain.secure.identity import PUBLIC_KEY_BYTES, Identity, PeerID, verify_signature
from p2ptrain.transport.base import FrameTransport
from p2ptrain.wire.frames import Frame, FrameType, pack_body, unpack_body
from p2ptrain.wire.records import KEY_BYTES, RecordKeys, nonce

__all__ = [
    "PROTOCOL_VERSION",
    "AdmissionPolicy",
    "HandshakeParams",
    "HandshakeResult",
    "Initiator",
    "Responder",
    "perform_handshake",
    "swarm_tag",
]

PROTOCOL_VERSION = 2
SWARM_KEY_BYTES = 32
_PROTOCOL_NAME = b"p2ptrain/handshake/v2/X25519-Ed25519-AESGCM-SHA256"
_RECORDS_INFO = b"p2ptrain/records/v2"
_ROLES = {True: b"p2ptrain initiator", False: b"p2ptrain responder"}
_ADMISSION = {True: b"p2ptrain admission initiator", False: b"p2ptrain admission responder"}
_MAX_PAYLOAD = 4096
_PLAINTEXT = b"insecure-plaintext"


@dataclass(frozen=True)
class AdmissionPolicy:
    """Who may join a swarm.

    Attributes:
        secret: the swarm key (32 random bytes, :mod:`p2ptrain.secure.swarm_key`)
            every member must prove it holds, or None.
        allowlist: the Ed25519 public keys admitted, or None for anybody.
    """

    secret: bytes | None = field(default=None, repr=False)
    allowlist: frozenset[bytes] | None = None

    def __post_init__(self) -> None:
        if self.secret is not None and len(self.secret) != SWARM_KEY_BYTES:
            raise ConfigError(
                f"a swarm key is {SWARM_KEY_BYTES} random bytes; make one with `p2ptrain keygen`"
            )
        if self.allowlist is not None and any(
            len(key) != PUBLIC_KEY_BYTES for key in self.allowlist
        ):
            raise ConfigError("allowlist entries must be 32-byte Ed25519 public keys")


@dataclass(frozen=True)
class HandshakeParams:
    """What one side brings to a handshake.

    Attributes:
        identity: our Ed25519 identity.
        swarm: the swarm's name (only its hash is sent, in frame 1).
        stream_window: our per-stream receive window.
        max_frame_bytes: the largest frame we accept.
        policy: who we admit.
        expected_peer: the PeerID we dialed, if we know it.
        channel_binding: (ours, theirs) fingerprints of a DTLS session, or None.
        insecure_plaintext: leave the frames after the handshake unsealed (a
            trusted cluster's opt-out; both sides must ask for it, or the
            responder refuses with ``plaintext``). Off by default.
    """

    identity: Identity
    swarm: str
    stream_window: int
    max_frame_bytes: int
    policy: AdmissionPolicy = field(default_factory=AdmissionPolicy)
    expected_peer: PeerID | None = None
    channel_binding: tuple[bytes, bytes] | None = None
    insecure_plaintext: bool = False


@dataclass(frozen=True)
class HandshakeResult:
    """What a completed handshake established about the remote peer."""

    peer_id: PeerID
    public_key: bytes
    stream_window: int
    """The remote's per-stream receive window: how much we may send unacknowledged."""
    max_frame_bytes: int
    """The largest frame the remote accepts."""
    transcript: bytes = b""
    """The final transcript hash (the same on both sides; names the session)."""


def swarm_tag(swarm: str) -> bytes:
    """The hash of a swarm name that frame 1 carries in the clear."""
    return hashlib.sha256(b"p2ptrain/swarm/" + swarm.encode("utf-8")).digest()


class _Transcript:
    """The symmetric state: transcript hash, chaining key, handshake cipher."""

    def __init__(self, binding: bytes) -> None:
        self.h = hashlib.sha256(_PROTOCOL_NAME).digest()
        self.ck = self.h
        self._aead: AESGCM | None = None
        self._n = 0
        self.mix_hash(binding)

    def mix_hash(self, data: bytes) -> None:
        self.h = hashlib.sha256(self.h + struct.pack(">I", len(data)) + data).digest()

    def mix_key(self, ikm: bytes) -> None:
        out = HKDF(hashes.SHA256(), 2 * KEY_BYTES, salt=self.ck, info=b"").derive(ikm)
        self.ck, key = out[:KEY_BYTES], out[KEY_BYTES:]
        self._aead = AESGCM(key)
        self._n = 0

    def seal(self, plaintext: bytes) -> bytes:
        if self._aead is None:  # pragma: no cover - the state machines never do this
            raise RuntimeError("no handshake key yet")
        sealed = self._aead.encrypt(nonce(self._n), plaintext, self.h)
        self._n += 1
        self.mix_hash(sealed)
        return sealed

    def open(self, sealed: bytes) -> bytes:
        if self._aead is None:  # pragma: no cover - the state machines never do this
            raise RuntimeError("no handshake key yet")
        try:
            plaintext = self._aead.decrypt(nonce(self._n), sealed, self.h)
        except InvalidTag as exc:
            raise AuthenticationError("a handshake message failed authentication") from exc
        self._n += 1
        self.mix_hash(sealed)
        return plaintext

    def record_keys(self, *, initiator: bool) -> RecordKeys:
        out = HKDF(
            hashes.SHA256(), 2 * KEY_BYTES, salt=self.ck, info=_RECORDS_INFO + self.h
        ).derive(b"")
        i2r, r2i = out[:KEY_BYTES], out[KEY_BYTES:]
        return RecordKeys(send=i2r, receive=r2i) if initiator else RecordKeys(send=r2i, receive=i2r)


def _binding(params: HandshakeParams, *, initiator: bool) -> bytes:
    if params.channel_binding is None:
        return b""
    ours, theirs = params.channel_binding
    first, second = (ours, theirs) if initiator else (theirs, ours)
    return struct.pack(">I", len(first)) + first + struct.pack(">I", len(second)) + second


def _raw_public(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _exchange(ours: X25519PrivateKey, theirs: bytes) -> bytes:
    """X25519 with the remote's ephemeral key; a low-order key is a protocol error."""
    try:
        return ours.exchange(X25519PublicKey.from_public_bytes(theirs))
    except ValueError as exc:  # cryptography refuses an all-zero shared secret
        raise RemoteProtocolError("the remote's ephemeral key is invalid") from exc


def _is_uint(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _bytes_field(frame: Frame, name: str, size: int | None = None) -> bytes:
    value = frame.field(name)
    if not isinstance(value, bytes) or (size is not None and len(value) != size):
        raise RemoteProtocolError(f"{frame.type.name}: field {name!r} is malformed")
    if len(value) > _MAX_PAYLOAD:
        raise RemoteProtocolError(f"{frame.type.name}: field {name!r} is too large")
    return value


def _expect(frame: Frame, ftype: FrameType) -> None:
    if frame.type is FrameType.REFUSE:
        raise _refusal_error(frame)
    if frame.type is not ftype:
        raise RemoteProtocolError(f"expected {ftype.name}, got {frame.type.name}")


class _Side:
    """What both roles share: the transcript, the identity payloads, the proofs."""

    def __init__(
        self, params: HandshakeParams, initiator: bool, ephemeral: X25519PrivateKey | None
    ) -> None:
        self.params = params
        self.initiator = initiator
        self.ephemeral = ephemeral or X25519PrivateKey.generate()
        self.transcript = _Transcript(_binding(params, initiator=initiator))
        self.keys: RecordKeys | None = None
        self.result: HandshakeResult | None = None

    def _signed_hash(self, pk: bytes, window: int, max_frame: int) -> bytes:
        fields = pk + struct.pack(">QQ", window, max_frame)
        return hashlib.sha256(self.transcript.h + fields).digest()

    def _identity_payload(self, *, admission: bool) -> bytes:
        p = self.params
        pk = p.identity.public_key
        t = self._signed_hash(pk, p.stream_window, p.max_frame_bytes)
        body: dict[str, Any] = {
            "pk": pk,
            "w": p.stream_window,
            "f": p.max_frame_bytes,
            "s": p.identity.sign(_ROLES[self.initiator] + t),
        }
        if admission and p.policy.secret is not None:
            body["a"] = hmac.new(p.policy.secret, _ADMISSION[True] + t, "sha256").digest()
        return pack_body(body)

    def _open_identity(self, sealed: bytes) -> tuple[Any, bytes]:
        """Decrypt the remote's identity payload; returns it and ``h`` from before it."""
        h_before = self.transcript.h
        return unpack_body(self.transcript.open(sealed), max_bytes=_MAX_PAYLOAD), h_before

    def _check_identity(self, body: Any, h_before: bytes) -> tuple[HandshakeResult, bytes]:
        """Check the remote's signature, PeerID and allowlist; returns it and its ``t``."""
        if not isinstance(body, dict):
            raise RemoteProtocolError("the identity payload must be a map")
        pk, window, max_frame, sig = body.get("pk"), body.get("w"), body.get("f"), body.get("s")
        if not isinstance(pk, bytes) or len(pk) != PUBLIC_KEY_BYTES:
            raise RemoteProtocolError("the identity payload's public key must be 32 bytes")
        if not isinstance(window, int) or not isinstance(max_frame, int):
            raise RemoteProtocolError("window and frame limit must be integers")
        if not _is_uint(window, 1024, 2**63) or not _is_uint(max_frame, 4096, 2**32):
            raise RemoteProtocolError("window (>= 1024) and frame limit (>= 4096) needed")
        t = hashlib.sha256(h_before + pk + struct.pack(">QQ", window, max_frame)).digest()
        remote_role = _ROLES[not self.initiator]
        if not isinstance(sig, bytes) or not verify_signature(pk, sig, remote_role + t):
            raise AuthenticationError("handshake signature does not verify")
        peer_id = PeerID.from_public_key(pk)
        expected = self.params.expected_peer
        if expected is not None and peer_id != expected:
            raise AuthenticationError(
                f"expected peer {expected.short}, but the remote is {peer_id.short}"
            )
        allowlist = self.params.policy.allowlist
        if allowlist is not None and pk not in allowlist:
            raise AdmissionError(f"peer {peer_id.short} is not on the swarm's allowlist")
        return HandshakeResult(peer_id, pk, window, max_frame), t

    def _check_proof(self, proof: object, *, remote_initiator: bool, data: bytes) -> None:
        secret = self.params.policy.secret
        if secret is None:
            return
        expected = hmac.new(secret, _ADMISSION[remote_initiator] + data, "sha256").digest()
        if not isinstance(proof, bytes) or not hmac.compare_digest(proof, expected):
            raise AdmissionError("the remote does not hold the swarm key")


class Initiator(_Side):
    """The dialing side's state machine (sans-IO: frames in, frames out)."""

    def __init__(
        self, params: HandshakeParams, *, ephemeral: X25519PrivateKey | None = None
    ) -> None:
        super().__init__(params, True, ephemeral)

    def hello(self) -> Frame:
        """Frame 1."""
        tag, e = swarm_tag(self.params.swarm), _raw_public(self.ephemeral)
        self.transcript.mix_hash(struct.pack(">I", PROTOCOL_VERSION))
        fields: dict[str, Any] = {"v": PROTOCOL_VERSION, "sw": tag, "e": e}
        if self.params.insecure_plaintext:
            self.transcript.mix_hash(_PLAINTEXT)
            fields["p"] = True
        self.transcript.mix_hash(tag)
        self.transcript.mix_hash(e)
        return Frame(FrameType.HELLO, fields=fields)

    def auth(self, reply: Frame) -> Frame:
        """Check frame 2 (the responder's identity); returns frame 3. Sets :attr:`keys`."""
        _expect(reply, FrameType.HELLO)
        e_r = _bytes_field(reply, "e", 32)
        sealed = _bytes_field(reply, "c")
        self.transcript.mix_hash(e_r)
        self.transcript.mix_key(_exchange(self.ephemeral, e_r))
        result, _ = self._check_identity(*self._open_identity(sealed))
        payload = self._identity_payload(admission=True)
        frame = Frame(FrameType.AUTH, fields={"c": self.transcript.seal(payload)})
        self.keys = self.transcript.record_keys(initiator=True)
        self.result = HandshakeResult(
            result.peer_id,
            result.public_key,
            result.stream_window,
            result.max_frame_bytes,
            self.transcript.h,
        )
        return frame

    def finish(self, accept: Frame) -> Frame:
        """Check frame 4 (the responder's admission proof); returns frame 5."""
        _expect(accept, FrameType.ACCEPT)
        self._check_proof(accept.field("a"), remote_initiator=False, data=self.transcript.h)
        return Frame(FrameType.ACCEPT)


class Responder(_Side):
    """The accepting side's state machine (sans-IO: frames in, frames out)."""

    def __init__(
        self, params: HandshakeParams, *, ephemeral: X25519PrivateKey | None = None
    ) -> None:
        super().__init__(params, False, ephemeral)

    def reply(self, hello: Frame) -> Frame:
        """Check frame 1; returns frame 2 (our identity, encrypted)."""
        _expect(hello, FrameType.HELLO)
        version = hello.field("v")
        if not _is_uint(version, 0, 2**32 - 1):
            raise RemoteProtocolError("HELLO: version must be an integer")
        if version != PROTOCOL_VERSION:
            raise _VersionMismatchError(f"unsupported protocol version {version}")
        tag = _bytes_field(hello, "sw", 32)
        if not hmac.compare_digest(tag, swarm_tag(self.params.swarm)):
            raise _SwarmMismatchError("the remote belongs to another swarm")
        e_i = _bytes_field(hello, "e", 32)
        plaintext = hello.field("p", False)
        if not isinstance(plaintext, bool):
            raise RemoteProtocolError("HELLO: field 'p' must be a bool")
        if plaintext != self.params.insecure_plaintext:
            raise _PlaintextMismatchError(
                "the remote asks for unencrypted frames (--insecure-plaintext) and this"
                " peer does not"
                if plaintext
                else "this peer allows only unencrypted frames (--insecure-plaintext)"
            )
        self.transcript.mix_hash(struct.pack(">I", PROTOCOL_VERSION))
        if plaintext:
            self.transcript.mix_hash(_PLAINTEXT)
        self.transcript.mix_hash(tag)
        self.transcript.mix_hash(e_i)
        e_r = _raw_public(self.ephemeral)
        self.transcript.mix_hash(e_r)
        self.transcript.mix_key(_exchange(self.ephemeral, e_i))
        sealed = self.transcript.seal(self._identity_payload(admission=False))
        return Frame(FrameType.HELLO, fields={"e": e_r, "c": sealed})

    def accept(self, auth: Frame) -> Frame:
        """Check frame 3 (the initiator's identity and proof); returns frame 4.

        :attr:`keys` is set as soon as frame 3 decrypts, even if a check then
        fails, so that the refusal can travel sealed.
        """
        _expect(auth, FrameType.AUTH)
        sealed = _bytes_field(auth, "c")
        body, h_before = self._open_identity(sealed)
        self.keys = self.transcript.record_keys(initiator=False)
        result, t = self._check_identity(body, h_before)
        self._check_proof(body.get("a"), remote_initiator=True, data=t)
        self.result = HandshakeResult(
            result.peer_id,
            result.public_key,
            result.stream_window,
            result.max_frame_bytes,
            self.transcript.h,
        )
        fields: dict[str, Any] = {}
        secret = self.params.policy.secret
        if secret is not None:
            fields["a"] = hmac.new(secret, _ADMISSION[False] + self.transcript.h, "sha256").digest()
        return Frame(FrameType.ACCEPT, fields=fields)

    def finish(self, accept: Frame) -> None:
        """Check frame 5."""
        _expect(accept, FrameType.ACCEPT)


_REFUSAL_ERRORS: dict[str, type[HandshakeError]] = {
    "authentication": AuthenticationError,
    "admission": AdmissionError,
}
_GENERIC = {
    "authentication": "authentication failed",
    "admission": "not admitted to the swarm",
    "swarm": "the swarms differ",
    "version": f"this peer speaks handshake version {PROTOCOL_VERSION}",
    "protocol": "malformed handshake",
    "plaintext": "both peers must agree on --insecure-plaintext",
}


def _refusal_error(frame: Frame) -> HandshakeError:
    code = frame.field("c")
    message = frame.field("m")
    text = message if isinstance(message, str) else "no reason given"
    cls = _REFUSAL_ERRORS.get(code if isinstance(code, str) else "", HandshakeError)
    error = cls(f"the remote refused the connection ({code}): {text}")
    error.from_remote = True
    return error


def _refusal_code(exc: P2PTrainError) -> str:
    if isinstance(exc, AdmissionError):
        return "admission"
    if isinstance(exc, AuthenticationError):
        return "authentication"
    if isinstance(exc, _SwarmMismatchError):
        return "swarm"
    if isinstance(exc, _VersionMismatchError):
        return "version"
    if isinstance(exc, _PlaintextMismatchError):
        return "plaintext"
    return "protocol"


class _SwarmMismatchError(HandshakeError):
    pass


class _VersionMismatchError(HandshakeError):
    pass


class _PlaintextMismatchError(HandshakeError):
    pass


async def perform_handshake(
    transport: FrameTransport,
    identity: Identity,
    *,
    initiator: bool,
    swarm: str,
    stream_window: int,
    max_frame_bytes: int,
    policy: AdmissionPolicy,
    expected_peer: PeerID | None = None,
    timeout: float,
    insecure_plaintext: bool = False,
) -> HandshakeResult:
    """Run the handshake over a fresh transport; on success its frames are sealed.

    With ``insecure_plaintext`` (both sides must ask for it) the frames after
    the handshake travel unencrypted and unauthenticated: for trusted
    clusters only.

    Raises:
        HandshakeError: the remote failed authentication or admission, or
            refused us (then the message carries its reason).
        RemoteProtocolError: the remote sent malformed handshake frames.
        TransportTimeoutError: the handshake did not finish within ``timeout``.
    """
    params = HandshakeParams(
        identity,
        swarm,
        stream_window,
        max_frame_bytes,
        policy,
        expected_peer,
        transport.channel_binding if transport.channel_encrypted else None,
        insecure_plaintext,
    )
    try:
        async with asyncio.timeout(timeout):
            if initiator:
                return await _run_initiator(transport, Initiator(params))
            return await _run_responder(transport, Responder(params))
    except TimeoutError as exc:
        raise TransportTimeoutError(
            f"handshake with {transport.remote_address} timed out after {timeout:g} s"
        ) from exc


async def _run_initiator(transport: FrameTransport, state: Initiator) -> HandshakeResult:
    await transport.send_frame(state.hello())
    reply = await transport.recv_frame()
    try:
        auth = state.auth(reply)
        transport.send_frame_nowait(auth)
        if state.keys is not None and not state.params.insecure_plaintext:
            transport.start_records(state.keys)  # before any byte of frame 4 is read
        else:
            transport.authenticated()
        accept = await transport.recv_frame()
        transport.send_frame_nowait(state.finish(accept))
    except (HandshakeError, RemoteProtocolError) as exc:
        _refuse(transport, exc)
        raise
    if state.result is None:  # pragma: no cover - set by auth()
        raise RuntimeError("handshake state incomplete")
    return state.result


async def _run_responder(transport: FrameTransport, state: Responder) -> HandshakeResult:
    plaintext = state.params.insecure_plaintext
    first = await transport.recv_frame()
    try:
        await transport.send_frame(state.reply(first))
        auth = await transport.recv_frame()
        try:
            accept = state.accept(auth)
        finally:
            if state.keys is not None and not transport.closed and not plaintext:
                transport.start_records(state.keys)  # a refusal, too, travels sealed
            elif not transport.closed:
                transport.authenticated()
        transport.send_frame_nowait(accept)
        state.finish(await transport.recv_frame())
    except (HandshakeError, RemoteProtocolError) as exc:
        _refuse(transport, exc)
        raise
    if state.result is None:  # pragma: no cover - set by accept()
        raise RuntimeError("handshake state incomplete")
    return state.result


def _refuse(transport: FrameTransport, exc: P2PTrainError) -> None:
    """Tell the remote why (unless it refused first), then hang up."""
    if transport.closed or getattr(exc, "from_remote", False):
        transport.close(exc)
        return
    code = _refusal_code(exc)
    private = transport.sealed or transport.channel_encrypted
    fields = {"c": code, "m": str(exc) if private else _GENERIC[code]}
    with contextlib.suppress(P2PTrainError):  # the transport may be gone already
        transport.send_frame_nowait(Frame(FrameType.REFUSE, fields=fields))
    transport.close(exc, flush=True)  # deliver the reason, then hang up
