"""Swarm keys: the 256-bit secret a private swarm's members share.

A swarm key is 32 random bytes, never typed by a person, so it cannot be
guessed offline from a recorded handshake (a passphrase can). It is written
to a file readable by its owner only, as one printable line::

    p2ptrain-swarm-key-v1:<the 32 bytes in lowercase base32, no padding>

``p2ptrain keygen`` makes one; ``--secret-file`` reads one and refuses
anything else (a passphrase, a short secret, a truncated key) with a
one-line :class:`~p2ptrain.errors.ConfigError` that says how to make a key.
"""

from __future__ import annotations

import base64
import os
import secrets
from pathlib import Path

from p2ptrain.errors import ConfigError

__all__ = [
    "KEY_BYTES",
    "format_swarm_key",
    "generate_swarm_key",
    "parse_swarm_key",
    "read_swarm_key",
    "write_swarm_key",
]

KEY_BYTES = 32
_PREFIX = "p2ptrain-swarm-key-v1:"
_HOW = "make a key with `p2ptrain keygen --out swarm.key` and share that file"


def generate_swarm_key() -> bytes:
    """32 bytes from the operating system's CSPRNG."""
    return secrets.token_bytes(KEY_BYTES)


def format_swarm_key(key: bytes) -> str:
    """The printable one-line form of ``key`` (no newline)."""
    if len(key) != KEY_BYTES:
        raise ConfigError(f"a swarm key is {KEY_BYTES} bytes")
    return _PREFIX + base64.b32encode(key).decode("ascii").rstrip("=").lower()


def parse_swarm_key(text: str, *, source: str = "the secret") -> bytes:
    """The key in ``text`` (as written by :func:`format_swarm_key`).

    Raises:
        ConfigError: ``text`` is not a swarm key (one line, saying how to make one).
    """
    line = text.strip()
    if not line.startswith(_PREFIX):
        raise ConfigError(
            f"{source} is not a p2ptrain swarm key (a passphrase or short secret can be"
            f" guessed offline); {_HOW}"
        )
    body = line[len(_PREFIX) :].upper()
    try:
        key = base64.b32decode(body + "=" * (-len(body) % 8))
    except ValueError as exc:
        raise ConfigError(f"{source} holds a corrupt swarm key; {_HOW}") from exc
    if len(key) != KEY_BYTES or format_swarm_key(key) != line:
        raise ConfigError(f"{source} holds a truncated or corrupt swarm key; {_HOW}")
    return key


def read_swarm_key(path: str | os.PathLike[str]) -> bytes:
    """Read and check the swarm key file at ``path``."""
    try:
        text = Path(path).read_text(encoding="ascii")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not a p2ptrain swarm key; {_HOW}") from exc
    except OSError as exc:
        raise ConfigError(f"cannot read the swarm key file {path}: {exc.strerror}") from exc
    return parse_swarm_key(text, source=str(path))


def write_swarm_key(path: str | os.PathLike[str], key: bytes, *, overwrite: bool = False) -> None:
    """Write ``key`` to ``path`` with mode 0600 (refusing to replace a file unless asked)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if overwrite else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError as exc:
        raise ConfigError(f"{path} exists already (pass --force to replace it)") from exc
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror}") from exc
    with os.fdopen(fd, "w", encoding="ascii") as handle:
        os.fchmod(handle.fileno(), 0o600)  # also when an existing file is overwritten
        handle.write(format_swarm_key(key) + "\n")
