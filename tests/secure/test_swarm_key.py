"""Swarm keys: `p2ptrain keygen`, --secret-file, and admission with the key."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from conftest import NodeFactory, run_cli

from p2ptrain.app.cli import _build_parser, _node_config, main
from p2ptrain.errors import AdmissionError, ConfigError, HandshakeError
from p2ptrain.node.config import NodeConfig
from p2ptrain.secure.handshake import AdmissionPolicy
from p2ptrain.secure.identity import Identity
from p2ptrain.secure.swarm_key import (
    format_swarm_key,
    generate_swarm_key,
    parse_swarm_key,
    read_swarm_key,
    write_swarm_key,
)

PINNED = f"{Identity.from_seed(bytes(32)).peer_id}@127.0.0.1:1"


def cli_here(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The command line's ``main`` in this process (quicker): (status, stdout, stderr)."""
    status = main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


def test_keygen_writes_a_private_printable_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "swarm.key"
    result = run_cli("keygen", "--out", str(path))
    assert result.returncode == 0, result.stderr
    assert f"--secret-file {path}" in result.stdout and "private channel" in result.stdout
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    assert text.isprintable() or (text.endswith("\n") and text[:-1].isprintable())
    key = read_swarm_key(path)
    assert len(key) == 32
    status, _, err = cli_here(capsys, "keygen", "--out", str(path))
    assert status == 2 and "--force" in err  # never overwritten silently
    assert read_swarm_key(path) == key
    assert cli_here(capsys, "keygen", "--out", str(path), "--force")[0] == 0
    assert read_swarm_key(path) != key  # 256 fresh random bits


PASSPHRASES = {
    "passphrase": "correct horse battery staple correct horse battery staple\n",
    "short": "hunter2",
    "hex secret": os.urandom(32).hex(),
    "truncated key": format_swarm_key(bytes(range(32)))[:-3],
    "key with bad characters": format_swarm_key(bytes(range(32)))[:-1] + "1",
}


@pytest.mark.parametrize("name", list(PASSPHRASES))
def test_secret_file_refuses_anything_but_a_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    path = tmp_path / "secret"
    path.write_text(PASSPHRASES[name])
    with pytest.raises(ConfigError, match="p2ptrain keygen"):
        read_swarm_key(path)
    status, _, err = cli_here(capsys, "status", "--join", PINNED, "--secret-file", str(path))
    assert status == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "p2ptrain keygen" in lines[0]


def test_key_format_round_trips() -> None:
    key = generate_swarm_key()
    assert parse_swarm_key(format_swarm_key(key) + "\n") == key
    with pytest.raises(ConfigError):
        format_swarm_key(b"short")


async def test_keygen_round_trips_through_secret_file(
    tmp_path: Path, make_node: NodeFactory
) -> None:
    """A key from `p2ptrain keygen`, read as --secret-file reads it, admits; another refuses."""
    ours, theirs = tmp_path / "ours.key", tmp_path / "theirs.key"
    assert main(["keygen", "--out", str(ours)]) == 0
    write_swarm_key(theirs, generate_swarm_key())
    args = _build_parser().parse_args(["bootstrap", "--port", "0", "--secret-file", str(ours)])
    config = _node_config(args)
    assert config.admission.secret == read_swarm_key(ours)
    server = await make_node(config=NodeConfig(admission=config.admission))
    member = await make_node(config=NodeConfig(admission=config.admission))
    outsider = await make_node(
        config=NodeConfig(admission=AdmissionPolicy(secret=read_swarm_key(theirs)))
    )
    await member.connect(server.address)
    with pytest.raises(HandshakeError) as refused:
        await outsider.connect(server.address)
    assert isinstance(refused.value, AdmissionError) or "admission" in str(refused.value)


def test_bare_join_address_needs_trust_on_first_use(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = cli_here(capsys, "status", "--join", "127.0.0.1:1", "--timeout", "1")
    assert status == 2
    assert "names no PeerID" in err and "--trust-on-first-use" in err
    assert len(err.strip().splitlines()) == 1


async def test_trust_on_first_use_warns_with_the_learned_peer_id(
    make_node: NodeFactory, caplog: pytest.LogCaptureFixture
) -> None:
    server, client = await make_node(), await make_node()
    bare = f"{server.address.host}:{server.address.port}"
    conn = await client.connect(bare)
    assert conn.remote_peer == server.peer_id
    warnings = [r.getMessage() for r in caplog.records if "trusting on first use" in r.getMessage()]
    assert len(warnings) == 1 and str(server.peer_id) in warnings[0]
