"""Peer identity: an Ed25519 key pair and the PeerID derived from it.

A PeerID is the SHA-256 digest of the raw 32-byte Ed25519 public key. It is
written as lowercase base32 without padding (52 characters), which is safe in
URLs, file names and DHT keys. Nobody can hold a PeerID without the matching
private key: every connection proves it in the handshake
(:mod:`p2ptrain.secure.handshake`).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from p2ptrain.errors import IdentityError

__all__ = ["PUBLIC_KEY_BYTES", "SIGNATURE_BYTES", "Identity", "PeerID", "verify_signature"]

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
_PEER_ID_BYTES = 32
_SEED_FILE_MAGIC = b"p2ptrain-ed25519-seed-v1\n"


@dataclass(frozen=True, order=True)
class PeerID:
    """The stable name of a peer: SHA-256 of its Ed25519 public key."""

    digest: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.digest, bytes) or len(self.digest) != _PEER_ID_BYTES:
            raise IdentityError(f"a PeerID is {_PEER_ID_BYTES} bytes")

    @classmethod
    def from_public_key(cls, public_key: bytes) -> PeerID:
        """Derive the PeerID of a raw 32-byte Ed25519 public key."""
        if len(public_key) != PUBLIC_KEY_BYTES:
            raise IdentityError(f"an Ed25519 public key is {PUBLIC_KEY_BYTES} bytes")
        return cls(hashlib.sha256(public_key).digest())

    @classmethod
    def from_string(cls, text: str) -> PeerID:
        """Parse the base32 form written by :meth:`__str__`."""
        cleaned = text.strip().upper()
        padded = cleaned + "=" * (-len(cleaned) % 8)
        try:
            digest = base64.b32decode(padded)
        except (ValueError, TypeError) as exc:
            raise IdentityError(f"not a PeerID: {text!r}") from exc
        if len(digest) != _PEER_ID_BYTES:
            raise IdentityError(f"not a PeerID (wrong length): {text!r}")
        peer_id = cls(digest)
        if str(peer_id) != cleaned.lower():  # unused low bits must be zero
            raise IdentityError(f"not a canonical PeerID: {text!r}")
        return peer_id

    def __str__(self) -> str:
        return _peer_text(self.digest)

    def __repr__(self) -> str:
        return f"PeerID({self.short})"

    @property
    def short(self) -> str:
        """The first 10 characters of the string form, for logs."""
        return str(self)[:10]


@functools.lru_cache(maxsize=1 << 14)
def _peer_text(digest: bytes) -> str:
    """A PeerID's string form (remembered: logs and task names ask for it often)."""
    return base64.b32encode(digest).decode("ascii").rstrip("=").lower()


def verify_signature(public_key: bytes, signature: bytes, message: bytes) -> bool:
    """Whether ``signature`` is a valid Ed25519 signature of ``message``.

    Malformed keys or signatures give ``False``; this never raises on
    untrusted input.
    """
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


@dataclass(frozen=True)
class Identity:
    """An Ed25519 key pair. Create with :meth:`generate` or :meth:`load_or_create`."""

    private_key: Ed25519PrivateKey = field(repr=False)
    public_key: bytes = field(init=False)
    peer_id: PeerID = field(init=False)

    def __post_init__(self) -> None:
        raw = self.private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        object.__setattr__(self, "public_key", raw)
        object.__setattr__(self, "peer_id", PeerID.from_public_key(raw))

    @classmethod
    def generate(cls) -> Identity:
        """A fresh random identity."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """The identity of a 32-byte private seed (deterministic; for tests and key files)."""
        if len(seed) != 32:
            raise IdentityError("an Ed25519 seed is 32 bytes")
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Identity:
        """Read a key file written by :meth:`save`."""
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise IdentityError(f"cannot read identity file {path}: {exc.strerror}") from exc
        if not data.startswith(_SEED_FILE_MAGIC):
            raise IdentityError(f"{path} is not a p2ptrain identity file")
        hex_seed = data[len(_SEED_FILE_MAGIC) :].strip()
        try:
            seed = bytes.fromhex(hex_seed.decode("ascii"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise IdentityError(f"{path}: corrupt identity file") from exc
        return cls.from_seed(seed)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the private key to ``path``, readable by the owner only."""
        seed = self.private_key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )
        target = Path(path)
        tmp = target.with_name(target.name + ".tmp")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(_SEED_FILE_MAGIC + seed.hex().encode("ascii") + b"\n")
            tmp.replace(target)
        except OSError as exc:
            raise IdentityError(f"cannot write identity file {path}: {exc.strerror}") from exc

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> Identity:
        """Load the identity at ``path``, creating and saving a new one if absent."""
        if Path(path).exists():
            return cls.load(path)
        identity = cls.generate()
        identity.save(path)
        return identity

    def sign(self, message: bytes) -> bytes:
        """Sign ``message`` with the private key (64-byte Ed25519 signature)."""
        return self.private_key.sign(message)
