"""Sealed records: the AEAD protection of every frame after the handshake.

Theory of operation
-------------------
Once the handshake (:mod:`p2ptrain.secure.handshake`) has agreed on two 32-byte
keys, one per direction, every frame travels as a *record*. A frame with
msgpack header ``H`` and payload ``P`` (``n`` bytes, possibly none) becomes::

    +-----------------+-----------------+---------------------+------------------------+
    | length (u32 BE) | hlen (u32 BE)   | seal(c, H)          | seal(c + 1, P)         |
    +-----------------+-----------------+---------------------+------------------------+
    |<-- prefix: associated data -->|    hlen = len(H) + 16    n + 16 bytes, only if n > 0

``seal(c, X)`` is AES-256-GCM of ``X`` under the direction's key with the
96-bit nonce ``0x00000000 || u64(c)`` and the 8-byte prefix as associated
data; its 16-byte tag follows the ciphertext. ``c`` counts the AEAD
operations of the direction since its key was set: the header takes one
value, a payload the next. So the prefix (lengths), the header (type,
stream, method, message body) and the payload are all authenticated, and a
record accepted once can never be accepted again, nor in another place:
a replayed, reordered, dropped or injected record meets a counter it was
not sealed with, and fails.

The prefix is the same as a plaintext frame's, so the
:class:`~p2ptrain.wire.frames.FrameDecoder` still checks sizes before
buffering anything; it calls :meth:`RecordOpener.open_header` when the
sealed header is complete and :meth:`RecordOpener.open_payload` when the
payload and its tag are in. A payload is received (its ciphertext) straight
into its final buffer and decrypted there, in place: no copy beyond the
kernel's. On the sending side :meth:`RecordSealer.seal` encrypts a payload
once, from the caller's buffer into a pooled buffer the transport writes.

Large payloads may be sealed and opened off the event loop
(:mod:`p2ptrain.transport.crypto_offload`): :meth:`RecordSealer.seal_later`
and :meth:`RecordOpener.open_later` take the payload's counter at once, in
frame order, and return the AEAD work as a job that any thread may run (the
``cryptography`` package releases the GIL while it encrypts). The job uses
its own AESGCM instance of the key captured when the counter was taken, so
a rekey or another thread's operation never meets it. The format and the
checks are the same; only the thread that runs the AES-GCM pass changes.

Rekeying: after :data:`REKEY_OPERATIONS` AEAD operations or
:data:`REKEY_BYTES` bytes sealed under one key, whichever comes first, both
ends replace the key with ``HKDF-Expand(key, "p2ptrain/rekey", 32)`` and
restart the counter at 0, at the same frame boundary (the decision is taken
between frames, from counts both ends share). Those bounds sit far below
AES-GCM's limits (2^32 messages with these nonces is not the concern: the
counter is 64 bits; the data bound is about 2^36 bytes per key for a
distinguishing advantage near 2^-57).

Any failure raises :class:`~p2ptrain.errors.IntegrityError`; the opener is
then spent and the connection must close.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand

from p2ptrain.errors import ConfigError, IntegrityError
from p2ptrain.wire.buffers import default_pool

__all__ = [
    "KEY_BYTES",
    "RECORD_OVERHEAD",
    "REKEY_BYTES",
    "REKEY_OPERATIONS",
    "TAG_BYTES",
    "OpenJob",
    "RecordKeys",
    "RecordOpener",
    "RecordSealer",
    "nonce",
    "rekey",
]

KEY_BYTES = 32
TAG_BYTES = 16
RECORD_OVERHEAD = 2 * TAG_BYTES
"""The most a record adds to a frame's size on the wire (a header tag and a payload tag)."""
REKEY_OPERATIONS = 1 << 28
"""AEAD operations under one key before it is replaced."""
REKEY_BYTES = 1 << 34
"""Bytes (16 GiB) sealed under one key before it is replaced."""

OpenJob = Callable[[], memoryview]
"""Authenticates and decrypts one payload in place when called (from any thread);
returns the plaintext view or raises :class:`~p2ptrain.errors.IntegrityError`."""

_NONCE = struct.Struct(">4xQ")
_REKEY_INFO = b"p2ptrain/rekey"


def nonce(counter: int) -> bytes:
    """The 96-bit AES-GCM nonce of an operation counter."""
    return _NONCE.pack(counter)


def rekey(key: bytes) -> bytes:
    """The key that follows ``key`` (both ends compute it; nothing is sent)."""
    return HKDFExpand(hashes.SHA256(), KEY_BYTES, _REKEY_INFO).derive(key)


@dataclass(frozen=True)
class RecordKeys:
    """The two keys of a connection, as one end sees them.

    Attributes:
        send: The key of the records this end seals.
        receive: The key of the records this end opens.
        rekey_operations: AEAD operations per key before rekeying (tests lower it).
        rekey_bytes: Bytes per key before rekeying.
    """

    send: bytes
    receive: bytes
    rekey_operations: int = REKEY_OPERATIONS
    rekey_bytes: int = REKEY_BYTES

    def __post_init__(self) -> None:
        if len(self.send) != KEY_BYTES or len(self.receive) != KEY_BYTES:
            raise ConfigError(f"record keys are {KEY_BYTES} bytes")
        if self.send == self.receive:
            raise ConfigError("the two directions must have different keys")
        if not 2 <= self.rekey_operations <= 1 << 32 or self.rekey_bytes < 1:
            raise ConfigError("rekey bounds must be positive (and at most 2^32 operations)")

    def __repr__(self) -> str:  # never print key material
        return "RecordKeys(<secret>)"


class _Direction:
    """One direction's key, counter and rekey accounting."""

    def __init__(self, key: bytes, max_operations: int, max_bytes: int) -> None:
        self.key = key
        self.aead = AESGCM(key)
        self.counter = 0
        self.sealed_bytes = 0
        self._max_operations = max_operations
        self._max_bytes = max_bytes
        self.rekeys = 0

    def take(self, nbytes: int) -> int:
        counter = self.counter
        self.counter += 1
        self.sealed_bytes += nbytes
        return counter

    def frame_done(self) -> None:
        """Between frames: replace the key if this one has done enough."""
        if self.counter + 2 > self._max_operations or self.sealed_bytes >= self._max_bytes:
            self.key = rekey(self.key)
            self.aead = AESGCM(self.key)
            self.counter = 0
            self.sealed_bytes = 0
            self.rekeys += 1


class RecordSealer:
    """Seals the frames one end sends (see the module docstring)."""

    def __init__(self, keys: RecordKeys) -> None:
        self._dir = _Direction(keys.send, keys.rekey_operations, keys.rekey_bytes)

    @property
    def rekeys(self) -> int:
        """How many times the sending key was replaced."""
        return self._dir.rekeys

    def seal(self, header: bytes, payload: memoryview | None) -> tuple[bytes, memoryview | None]:
        """Seal one frame: returns (prefix + sealed header, sealed payload or None).

        ``payload`` must be a flat byte view (format ``B``); it is read, never
        modified, and may be reused by the caller once this returns.
        """
        head, sealed, _ = self._seal(header, payload, later=False)
        return head, sealed

    def seal_later(
        self, header: bytes, payload: memoryview
    ) -> tuple[bytes, memoryview, Callable[[], None]]:
        """Seal a frame's header now and return its payload's sealing as a job.

        Returns (prefix + sealed header, the buffer the sealed payload goes
        to, the job that fills it). The counters are taken now, so the frame
        must go on the wire before any frame sealed after this call, and only
        once the job has returned; ``payload`` must stay unchanged until then.
        """
        head, sealed, job = self._seal(header, payload, later=True)
        if sealed is None or job is None:
            raise ConfigError("seal_later() needs a non-empty payload")
        return head, sealed, job

    def _seal(
        self, header: bytes, payload: memoryview | None, *, later: bool
    ) -> tuple[bytes, memoryview | None, Callable[[], None] | None]:
        direction = self._dir
        hlen = len(header) + TAG_BYTES
        nbytes = 0 if payload is None else len(payload)
        body = hlen + (nbytes + TAG_BYTES if nbytes else 0)
        length = 4 + body
        if length > 0xFFFFFFFF:
            raise ConfigError(f"a record of {length} bytes cannot be encoded")
        prefix = struct.pack(">II", length, hlen)
        sealed_header = direction.aead.encrypt(nonce(direction.take(len(header))), header, prefix)
        sealed: memoryview | None = None
        job: Callable[[], None] | None = None
        if payload is not None and nbytes:
            sealed = default_pool.get(nbytes + TAG_BYTES)
            payload_nonce = nonce(direction.take(nbytes))
            if later:
                job = _seal_job(direction.key, payload_nonce, payload, prefix, sealed)
            else:
                direction.aead.encrypt_into(payload_nonce, payload, prefix, sealed)
        direction.frame_done()
        return prefix + sealed_header, sealed, job


def _seal_job(
    key: bytes, payload_nonce: bytes, payload: memoryview, prefix: bytes, sealed: memoryview
) -> Callable[[], None]:
    def job() -> None:
        AESGCM(key).encrypt_into(payload_nonce, payload, prefix, sealed)

    return job


class RecordOpener:
    """Opens the records one end receives, in order (see the module docstring)."""

    def __init__(self, keys: RecordKeys) -> None:
        self._dir = _Direction(keys.receive, keys.rekey_operations, keys.rekey_bytes)
        self._failed = False

    @property
    def rekeys(self) -> int:
        """How many times the receiving key was replaced."""
        return self._dir.rekeys

    def open_header(self, prefix: bytes, sealed: bytes, *, has_payload: bool) -> bytes:
        """Authenticate and decrypt a record's header; returns the msgpack bytes."""
        self._check()
        direction = self._dir
        try:
            header = direction.aead.decrypt(
                nonce(direction.take(len(sealed) - TAG_BYTES)), sealed, prefix
            )
        except InvalidTag as exc:
            self._failed = True
            raise IntegrityError(
                "a record's header failed authentication (altered, replayed, reordered,"
                " dropped or injected on the way)"
            ) from exc
        if not has_payload:
            direction.frame_done()
        return header

    def open_payload(self, prefix: bytes, payload: memoryview, tag: bytes) -> None:
        """Authenticate and decrypt a payload in place (``payload`` holds its ciphertext).

        On failure the buffer holds garbage, and :class:`IntegrityError` is raised.
        """
        self._check()
        direction = self._dir
        counter = direction.take(len(payload))
        decryptor = Cipher(
            algorithms.AES(direction.key), modes.GCM(nonce(counter), tag)
        ).decryptor()
        decryptor.authenticate_additional_data(prefix)
        try:
            decryptor.update_into(payload, payload)
            decryptor.finalize()
        except InvalidTag as exc:
            self._failed = True
            raise IntegrityError(
                "a record's payload failed authentication (altered on the way)"
            ) from exc
        direction.frame_done()

    def open_payload_inline(self, prefix: bytes, sealed: memoryview) -> memoryview:
        """Authenticate and decrypt ciphertext + tag in place; returns the plaintext view."""
        self._check()
        direction = self._dir
        plaintext = sealed[: len(sealed) - TAG_BYTES]
        counter = direction.take(len(plaintext))
        try:
            direction.aead.decrypt_into(nonce(counter), sealed, prefix, plaintext)
        except InvalidTag as exc:
            self._failed = True
            raise IntegrityError(
                "a record's payload failed authentication (altered on the way)"
            ) from exc
        direction.frame_done()
        return plaintext

    def open_later(self, prefix: bytes, payload: memoryview, tag: bytes | None) -> OpenJob:
        """Take a payload's counter now and return its opening as a job.

        ``tag`` None: ``payload`` holds ciphertext and tag (as for
        :meth:`open_payload_inline`); else ``payload`` holds the ciphertext
        (as for :meth:`open_payload`). The caller must not use the plaintext,
        nor anything that follows it on the connection, before the job has
        returned; a job that raises spends the opener.
        """
        self._check()
        direction = self._dir
        nbytes = len(payload) - (TAG_BYTES if tag is None else 0)
        payload_nonce = nonce(direction.take(nbytes))
        key = direction.key
        direction.frame_done()

        def job() -> memoryview:
            try:
                if tag is None:
                    plaintext = payload[:nbytes]
                    AESGCM(key).decrypt_into(payload_nonce, payload, prefix, plaintext)
                    return plaintext
                decryptor = Cipher(algorithms.AES(key), modes.GCM(payload_nonce, tag)).decryptor()
                decryptor.authenticate_additional_data(prefix)
                decryptor.update_into(payload, payload)
                decryptor.finalize()
                return payload
            except InvalidTag as exc:
                self._failed = True
                raise IntegrityError(
                    "a record's payload failed authentication (altered on the way)"
                ) from exc

        return job

    def _check(self) -> None:
        if self._failed:
            raise IntegrityError("the record stream already failed authentication")
