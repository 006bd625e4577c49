"""The authenticated handshake that opens every connection.

Theory of operation
-------------------
Both sides send HELLO at once, without waiting::

    HELLO {v: 1, pk: <32-byte Ed25519 public key>, n: <32 random bytes>,
           sw: <swarm name>, w: <stream receive window>, f: <max frame bytes>}

When a side holds both HELLOs it computes the transcript::

    T = SHA-256("p2ptrain/handshake/v1" || u32(len(swarm)) || swarm
                || for the initiator, then the responder:
                   pk || n || u32(v) || u64(w) || u64(f))

(``swarm`` as UTF-8 bytes; integers big-endian), so every HELLO field is
authenticated. Then it sends AUTH ``{s: Sign(role || T), a: admission proof}`` where ``role`` is
``b"initiator"`` or ``b"responder"`` (so a signature cannot be reflected back
to its author). Because T contains both fresh nonces, an AUTH recorded from an
earlier session never verifies again. The admission proof, when the swarm has
a shared secret, is ``HMAC-SHA256(secret, b"admission" || role || T)``: it
proves knowledge of the secret without revealing it and is bound to this
session as well.

Each side that accepts the other's AUTH then sends ``ACCEPT {}``, and the
handshake completes only when both ACCEPTs have crossed, so neither side
believes it is connected while the other refuses. A side that refuses sends
``REFUSE {c: code, m: message}`` instead and closes, so the refused peer learns
why. Codes: ``authentication``, ``admission``, ``swarm``, ``version``,
``protocol``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import struct
from dataclasses import dataclass, field
from typing import Any

from p2ptrain.errors import (
    AdmissionError,
    AuthenticationError,
    ConfigError,
    HandshakeError,
    P2PTrainError,
    RemoteProtocolError,
    TransportTimeoutError,
)
from p2ptrain.identity import PUBLIC_KEY_BYTES, Identity, PeerID, verify_signature
from p2ptrain.transport.base import FrameTransport
from p2ptrain.wire.frames import Frame, FrameType

__all__ = [
    "PROTOCOL_VERSION",
    "AdmissionPolicy",
    "HandshakeResult",
    "Hello",
    "admission_proof",
    "perform_handshake",
    "transcript_hash",
]

PROTOCOL_VERSION = 1
NONCE_BYTES = 32
_DOMAIN = b"p2ptrain/handshake/v1"
_MAX_SWARM_NAME = 256


@dataclass(frozen=True)
class AdmissionPolicy:
    """Who may join a swarm.

    Attributes:
        secret: a shared secret every member must prove it knows, or None.
        allowlist: the Ed25519 public keys admitted, or None for anybody.
    """

    secret: bytes | None = field(default=None, repr=False)
    allowlist: frozenset[bytes] | None = None

    def __post_init__(self) -> None:
        if self.secret is not None and len(self.secret) < 16:
            raise ConfigError("an admission secret must be at least 16 bytes")
        if self.allowlist is not None and any(
            len(key) != PUBLIC_KEY_BYTES for key in self.allowlist
        ):
            raise ConfigError("allowlist entries must be 32-byte Ed25519 public keys")


@dataclass(frozen=True)
class Hello:
    """The first frame each side sends."""

    public_key: bytes
    nonce: bytes
    swarm: str
    stream_window: int
    max_frame_bytes: int
    version: int = PROTOCOL_VERSION

    def to_frame(self) -> Frame:
        """This HELLO as a frame."""
        fields = {
            "v": self.version,
            "pk": self.public_key,
            "n": self.nonce,
            "sw": self.swarm,
            "w": self.stream_window,
            "f": self.max_frame_bytes,
        }
        return Frame(FrameType.HELLO, fields=fields)

    @classmethod
    def from_frame(cls, frame: Frame) -> Hello:
        """Parse and validate a HELLO received from the network."""
        if frame.type is FrameType.REFUSE:
            raise _refusal_error(frame)
        if frame.type is not FrameType.HELLO:
            raise RemoteProtocolError(f"expected HELLO, got {frame.type.name}")
        version, pk, nonce = frame.field("v"), frame.field("pk"), frame.field("n")
        swarm, window, max_frame = frame.field("sw"), frame.field("w"), frame.field("f")
        if not isinstance(version, int) or isinstance(version, bool):
            raise RemoteProtocolError("HELLO: version must be an integer")
        if not isinstance(pk, bytes) or len(pk) != PUBLIC_KEY_BYTES:
            raise RemoteProtocolError("HELLO: public key must be 32 bytes")
        if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
            raise RemoteProtocolError("HELLO: nonce must be 32 bytes")
        if not isinstance(swarm, str) or len(swarm) > _MAX_SWARM_NAME:
            raise RemoteProtocolError("HELLO: swarm must be a short string")
        if not _is_uint(window, 1024, 2**63) or not _is_uint(max_frame, 4096, 2**32):
            raise RemoteProtocolError("HELLO: window (>= 1024) and frame limit (>= 4096) needed")
        if len(swarm.encode("utf-8")) > _MAX_SWARM_NAME:
            raise RemoteProtocolError("HELLO: swarm name too long")
        return cls(pk, nonce, swarm, window, max_frame, version)


def _is_uint(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


@dataclass(frozen=True)
class HandshakeResult:
    """What a completed handshake established about the remote peer."""

    peer_id: PeerID
    public_key: bytes
    stream_window: int
    """The remote's per-stream receive window: how much we may send unacknowledged."""
    max_frame_bytes: int
    """The largest frame the remote accepts."""


def transcript_hash(initiator: Hello, responder: Hello) -> bytes:
    """The transcript both signatures cover; binds both keys and both nonces."""
    swarm = initiator.swarm.encode("utf-8")
    digest = hashlib.sha256()
    digest.update(_DOMAIN)
    digest.update(struct.pack(">I", len(swarm)))
    digest.update(swarm)
    for hello in (initiator, responder):
        digest.update(hello.public_key + hello.nonce)
        digest.update(
            struct.pack(">IQQ", hello.version, hello.stream_window, hello.max_frame_bytes)
        )
    return digest.digest()


def _role(initiator: bool) -> bytes:
    return b"initiator" if initiator else b"responder"


def admission_proof(secret: bytes, transcript: bytes, *, initiator: bool) -> bytes:
    """HMAC proving knowledge of the swarm secret, bound to this session and role."""
    return hmac.new(secret, b"admission" + _role(initiator) + transcript, "sha256").digest()


def make_auth(
    identity: Identity, transcript: bytes, *, initiator: bool, policy: AdmissionPolicy
) -> Frame:
    """The AUTH frame proving we hold our key (and the swarm secret, if any)."""
    fields: dict[str, Any] = {"s": identity.sign(_role(initiator) + transcript)}
    if policy.secret is not None:
        fields["a"] = admission_proof(policy.secret, transcript, initiator=initiator)
    return Frame(FrameType.AUTH, fields=fields)


def verify_auth(
    frame: Frame,
    remote: Hello,
    transcript: bytes,
    *,
    remote_is_initiator: bool,
    policy: AdmissionPolicy,
    expected_peer: PeerID | None,
) -> PeerID:
    """Check the remote's AUTH; return its PeerID or raise HandshakeError."""
    if frame.type is FrameType.REFUSE:
        raise _refusal_error(frame)
    if frame.type is not FrameType.AUTH:
        raise RemoteProtocolError(f"expected AUTH, got {frame.type.name}")
    signature = frame.field("s")
    if not isinstance(signature, bytes) or not verify_signature(
        remote.public_key, signature, _role(remote_is_initiator) + transcript
    ):
        raise AuthenticationError("handshake signature does not verify")
    peer_id = PeerID.from_public_key(remote.public_key)
    if expected_peer is not None and peer_id != expected_peer:
        raise AuthenticationError(
            f"expected peer {expected_peer.short}, but the remote is {peer_id.short}"
        )
    if policy.secret is not None:
        proof = frame.field("a")
        expected = admission_proof(policy.secret, transcript, initiator=remote_is_initiator)
        if not isinstance(proof, bytes) or not hmac.compare_digest(proof, expected):
            raise AdmissionError("the remote does not know the swarm's admission secret")
    if policy.allowlist is not None and remote.public_key not in policy.allowlist:
        raise AdmissionError(f"peer {peer_id.short} is not on the swarm's allowlist")
    return peer_id


_REFUSAL_ERRORS: dict[str, type[HandshakeError]] = {
    "authentication": AuthenticationError,
    "admission": AdmissionError,
}


def _refusal_error(frame: Frame) -> HandshakeError:
    code = frame.field("c")
    message = frame.field("m")
    text = message if isinstance(message, str) else "no reason given"
    cls = _REFUSAL_ERRORS.get(code if isinstance(code, str) else "", HandshakeError)
    return cls(f"the remote refused the connection ({code}): {text}")


def _refusal_code(exc: P2PTrainError) -> str:
    if isinstance(exc, AdmissionError):
        return "admission"
    if isinstance(exc, AuthenticationError):
        return "authentication"
    if isinstance(exc, _SwarmMismatchError):
        return "swarm"
    if isinstance(exc, _VersionMismatchError):
        return "version"
    return "protocol"


class _SwarmMismatchError(HandshakeError):
    pass


class _VersionMismatchError(HandshakeError):
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
) -> HandshakeResult:
    """Run the handshake over a fresh transport.

    Raises:
        HandshakeError: the remote failed authentication or admission, or
            refused us (then the message carries its reason).
        RemoteProtocolError: the remote sent malformed handshake frames.
        TransportTimeoutError: the handshake did not finish within ``timeout``.
    """
    ours = Hello(
        identity.public_key, os.urandom(NONCE_BYTES), swarm, stream_window, max_frame_bytes
    )
    try:
        async with asyncio.timeout(timeout):
            await transport.send_frame(ours.to_frame())
            first = await transport.recv_frame()
            try:
                theirs = Hello.from_frame(first)
                if theirs.version != PROTOCOL_VERSION:
                    raise _VersionMismatchError(f"unsupported protocol version {theirs.version}")
                if theirs.swarm != swarm:
                    raise _SwarmMismatchError(f"swarm {theirs.swarm!r} is not {swarm!r}")
            except (HandshakeError, RemoteProtocolError) as exc:
                if first.type is not FrameType.REFUSE:
                    _refuse(transport, exc)
                raise
            init_hello, resp_hello = (ours, theirs) if initiator else (theirs, ours)
            transcript = transcript_hash(init_hello, resp_hello)
            await transport.send_frame(
                make_auth(identity, transcript, initiator=initiator, policy=policy)
            )
            auth = await transport.recv_frame()
            try:
                peer_id = verify_auth(
                    auth,
                    theirs,
                    transcript,
                    remote_is_initiator=not initiator,
                    policy=policy,
                    expected_peer=expected_peer,
                )
            except (HandshakeError, RemoteProtocolError) as exc:
                if auth.type is not FrameType.REFUSE:
                    _refuse(transport, exc)
                raise
            await transport.send_frame(Frame(FrameType.ACCEPT))
            verdict = await transport.recv_frame()
            if verdict.type is FrameType.REFUSE:
                raise _refusal_error(verdict)
            if verdict.type is not FrameType.ACCEPT:
                error = RemoteProtocolError(f"expected ACCEPT, got {verdict.type.name}")
                _refuse(transport, error)
                raise error
    except TimeoutError as exc:
        raise TransportTimeoutError(
            f"handshake with {transport.remote_address} timed out after {timeout:g} s"
        ) from exc
    return HandshakeResult(peer_id, theirs.public_key, theirs.stream_window, theirs.max_frame_bytes)


def _refuse(transport: FrameTransport, exc: P2PTrainError) -> None:
    if transport.closed:
        return
    fields = {"c": _refusal_code(exc), "m": str(exc)}
    transport.send_frame_nowait(Frame(FrameType.REFUSE, fields=fields))
    transport.close(exc, flush=True)  # deliver the reason, then hang up
