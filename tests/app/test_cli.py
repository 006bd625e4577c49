"""The command line, driven as a user would: real processes, real output."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ChildLines, cli_process, join_address, run_cli, stop_all
from doccheck import ROOT

from p2ptrain.aio import run
from p2ptrain.app.cli import main
from p2ptrain.nat.stun import stun_query
from p2ptrain.node.address import PeerAddress
from p2ptrain.secure.identity import Identity

COMMANDS = ("demo", "bootstrap", "bench")


@pytest.mark.parametrize("command", COMMANDS)
def test_every_subcommand_has_help_with_an_example(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: p2ptrain {command}" in out
    assert "example" in out


def test_top_level_help_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in COMMANDS:
        assert command in out


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


PINNED = f"{Identity.from_seed(bytes(32)).peer_id}@127.0.0.1:1"


def test_user_mistakes_get_one_line_errors(busy_port: int, tmp_path: Path) -> None:
    # A port bound but not listening refuses connections, and stays ours: a port
    # merely found free could be handed to the bootstrap itself, which then joined itself.
    refusing = socket.socket()
    refusing.bind(("127.0.0.1", 0))
    closed_port = refusing.getsockname()[1]
    cases = {
        ("bootstrap", "--port", str(busy_port)): "address already in use",
        ("bootstrap", "--port", "0", "--join", "not-an-address"): "bad address",
        (
            "bootstrap",
            "--port",
            "0",
            "--trust-on-first-use",
            "--join",
            f"127.0.0.1:{closed_port}",
        ): "none of the",
        ("bootstrap", "--port", "0", "--join", "127.0.0.1:1"): "--trust-on-first-use",
        ("bootstrap", "--port", "0", "--secret-file", str(tmp_path / "no")): "cannot read",
        ("bootstrap", "--port", "0", "--join", "zz@127.0.0.1:1"): "bad peer id",
    }
    with refusing:
        for args, expected in cases.items():
            result = run_cli(*args)
            assert result.returncode == 2, (args, result.stderr)
            lines = result.stderr.strip().splitlines()
            assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
            assert expected in lines[0], lines[0]


def _joinable_bootstrap(*args: str) -> tuple[ChildLines, str]:
    """Start ``p2ptrain bootstrap --port 0 ARGS``; returns it and the address it prints."""
    boot = cli_process("bootstrap", "--port", "0", *args)
    deadline = time.monotonic() + 60
    try:
        return boot, join_address(boot, deadline)
    except BaseException:
        boot.stop()
        raise


def test_refused_admission_is_one_line(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    assert main(["keygen", "--out", str(secret)]) == 0
    boot, address = _joinable_bootstrap("--secret-file", str(secret))
    try:
        result = run_cli("bootstrap", "--port", "0", "--join", address)
        assert result.returncode == 2
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
        assert "admission" in result.stderr
    finally:
        boot.stop()


def test_bootstrap_prints_a_joinable_address() -> None:
    boot, address = _joinable_bootstrap()
    second = None
    try:
        second = cli_process("bootstrap", "--port", "0", "--join", address)
        # it joined through the first
        assert "ready" in second.next_line(time.monotonic() + 60)
    finally:
        stop_all([second, boot])


def test_bootstrap_answers_stun_on_the_port_it_prints() -> None:
    boot, printed = _joinable_bootstrap("--relay")
    try:
        address = PeerAddress.parse(printed)
        assert address.peer_id is not None and address.host == "127.0.0.1"
        info = boot.next_line(time.monotonic() + 60)
        assert "rendezvous on" in info and "relay on" in info
        stun_port = int(info.split("udp/", 1)[1].split(",", 1)[0])
        answers = run(stun_query([("127.0.0.1", stun_port)], timeout=5.0))
        assert answers[0] is not None and answers[0][0] == "127.0.0.1"
    finally:
        boot.stop()


def test_nat_flags_are_checked() -> None:
    mistakes = {
        ("bootstrap", "--port", "0", "--relay-mbit", "5"): "need --relay",
        ("bootstrap", "--port", "0", "--relay", "--relay-mbit", "-1"): "positive",
        ("bootstrap", "--host", "0.0.0.0", "--port", "0"): "--announce-host",
        ("train", "--join", PINNED, "--turn", "turn:h:1"): "need NAT traversal",
        ("train", "--join", PINNED, "--nat", "auto", "--turn", "stun:h:1"): "--turn takes",
        ("train", "--join", PINNED, "--nat", "auto", "--turn", "turn:h:1"): "username",
        ("train", "--join", PINNED, "--host", "0.0.0.0", "--nat", "public"): "announce",
    }
    for args, fragment in mistakes.items():
        result = run_cli(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
        assert fragment in result.stderr, (args, result.stderr)


def test_bench_finds_the_benchmarks_through_the_registry() -> None:
    sys.path.insert(0, str(ROOT))  # the benchmarks package lives at the repository root
    from benchmarks.registry import BENCHMARKS

    listed = run_cli("bench", "--help")
    assert listed.returncode == 0, listed.stderr
    for bench in BENCHMARKS:
        assert f"  {bench.name} " in listed.stdout and bench.summary in listed.stdout
    result = run_cli("bench", "nope")
    assert result.returncode == 2 and "invalid choice" in result.stderr
    # The command finds the scripts of a source checkout (it lost them once
    # when the command line moved one folder down).
    result = run_cli("bench", "lp", "--help")
    assert result.returncode == 0 and "usage" in result.stdout, result.stderr


def test_bench_without_a_checkout_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from p2ptrain.app import cli

    monkeypatch.setattr(cli, "_CHECKOUT", tmp_path)  # an installed wheel: no benchmarks/
    assert main(["bench", "lp"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "need a source checkout" in err, err
