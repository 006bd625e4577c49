"""Ed25519 identities and PeerIDs."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from p2ptrain.errors import IdentityError
from p2ptrain.secure.identity import Identity, PeerID, verify_signature


def test_peer_id_is_the_hash_of_the_public_key_and_round_trips() -> None:
    identity = Identity.generate()
    assert identity.peer_id == PeerID.from_public_key(identity.public_key)
    text = str(identity.peer_id)
    assert len(text) == 52 and text == text.lower()
    assert PeerID.from_string(text) == identity.peer_id
    assert PeerID.from_string(text.upper()) == identity.peer_id


def test_distinct_keys_give_distinct_ids() -> None:
    assert Identity.generate().peer_id != Identity.generate().peer_id


@pytest.mark.parametrize("bad", ["", "zzz", "a" * 52 + "!", "abc@def"])
def test_bad_peer_id_strings(bad: str) -> None:
    with pytest.raises(IdentityError):
        PeerID.from_string(bad)


def test_save_and_load(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "peer.key"
    identity = Identity.load_or_create(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    again = Identity.load_or_create(path)
    assert again.peer_id == identity.peer_id
    assert again.public_key == identity.public_key


def test_corrupt_key_files(tmp_path: Path) -> None:
    path = tmp_path / "peer.key"
    path.write_bytes(b"not a key")
    with pytest.raises(IdentityError, match="not a p2ptrain identity file"):
        Identity.load(path)
    path.write_bytes(b"p2ptrain-ed25519-seed-v1\nzz\n")
    with pytest.raises(IdentityError, match="corrupt"):
        Identity.load(path)
    with pytest.raises(IdentityError, match="cannot read"):
        Identity.load(tmp_path / "missing.key")


def test_signatures() -> None:
    identity = Identity.from_seed(bytes(range(32)))
    signature = identity.sign(b"message")
    assert verify_signature(identity.public_key, signature, b"message")
    assert not verify_signature(identity.public_key, signature, b"other")
    assert not verify_signature(Identity.generate().public_key, signature, b"message")
    assert not verify_signature(identity.public_key[:5], signature, b"message")
    assert not verify_signature(identity.public_key, signature[:10], b"message")
    assert not verify_signature(b"\x00" * 32, b"\x00" * 64, b"message")
