"""`p2ptrain train` and `p2ptrain status`, driven through the real command line."""

from __future__ import annotations

import json
import queue
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ChildLines, cli_process, run_cli, started_bootstrap
from test_task import documented_example

from p2ptrain.app.cli import main
from p2ptrain.app.status import format_status
from p2ptrain.app.train import TrainingSessionConfig, shard_of
from p2ptrain.errors import ConfigError
from p2ptrain.lab.timings import TRAINING_MATCHMAKING
from p2ptrain.measure import payload_rate
from p2ptrain.secure.identity import Identity
from p2ptrain.train.progress import PeerProgress


def _wait_for_joint_step(peer: ChildLines, deadline: float) -> dict[str, Any]:
    """The first progress event showing a step averaged with another peer."""
    while True:
        try:
            event = json.loads(peer.next_line(deadline))
        except queue.Empty:
            raise AssertionError(f"no joint step in time: {''.join(peer.stderr)[-3000:]}") from None
        if event["event"] == "progress" and event["rounds"] >= 1 and event["peers_online"] >= 2:
            return dict(event)


def test_two_peers_train_and_status_lists_them(procs: list[ChildLines]) -> None:
    deadline = time.monotonic() + 120  # a deadline, not a wait: it ends at the first joint step
    address = started_bootstrap(procs, deadline)
    train_args = ("train", "--join", address, "--run-id", "t", "--seconds", "150")
    # A step of several reads of the progress records (min_fetch_interval): a
    # step shorter than a read is cut by extrapolation alone (p2ptrain/train/cut.py).
    sizes = ("--target-batch-size", "128", "--batch-size", "4", "--log-json", "-")
    peers = [
        cli_process(*train_args, *sizes, "--upload-mbit", "50", "--download-mbit", "100"),
        cli_process(*train_args, *sizes),
    ]
    procs.extend(peers)
    events = [_wait_for_joint_step(peer, deadline) for peer in peers]
    ids = {e["peer_id"] for e in events}
    assert len(ids) == 2
    for peer, event in zip(peers, events, strict=True):  # the latest step's samples
        assert event["target_batch_size"] == 128
        # within the bound for the largest step, 1.25x the target; the
        # peer's log says why if not
        assert 0 < event["step_samples"] <= 160, "".join(peer.stderr)[-3000:]

    status = run_cli("status", "--join", address, "--run-id", "t")
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    assert "PeerID" in lines[1] and "global step" in lines[1] and "samples/s" in lines[1]
    rows = {line.split()[0]: line.split() for line in lines[3:]}
    assert ids <= set(rows), status.stdout
    for peer_id in ids:
        assert int(rows[peer_id][-1]) >= 1  # the global step column
        samples, target = rows[peer_id][-2].split("/")  # the step samples/target column
        assert target == "128" and 0 < int(samples) <= 160, status.stdout
        assert rows[peer_id][1] == "direct"
    # up/down MB/s: the rates the first peer announced, the TCP payload of the
    # 50 and 100 Mbit/s it typed in
    up, down = payload_rate(50e6 / 8) / 1e6, payload_rate(100e6 / 8) / 1e6
    assert rows[events[0]["peer_id"]][4] == f"{up:.1f}/{down:.1f}" == "6.0/12.0", status.stdout


@pytest.mark.parametrize("command", ["train", "status"])
def test_help_has_an_example(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: p2ptrain {command}" in out and "example: p2ptrain " + command in out
    assert "--join" in out


def test_train_mistakes_are_one_line() -> None:
    result = run_cli("train", "--join", "x", "--batch-size", "0")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "batch_size" in result.stderr


def test_config_is_validated() -> None:
    with pytest.raises(ConfigError):
        TrainingSessionConfig(initial_peers=("a",), seconds=-1)
    with pytest.raises(ConfigError):
        TrainingSessionConfig(initial_peers=["a"])  # type: ignore[arg-type]


def test_the_benchmarks_time_the_matchmaking_that_train_configures() -> None:
    from p2ptrain.app.train import _peer_config

    assert _peer_config(TrainingSessionConfig(initial_peers=())).matchmaking == (
        TRAINING_MATCHMAKING
    )


def test_format_status_orders_by_step() -> None:
    now = 1000.0
    a, b = Identity.generate().peer_id, Identity.generate().peer_id
    records = [
        PeerProgress(a, step=3, samples=0, samples_per_s=12.5, time=now - 1, address=None),
        PeerProgress(
            b,
            step=5,
            samples=8,
            samples_per_s=40.0,
            time=now - 2,
            address=f"{b}@127.0.0.1:4001",
            upload_bytes_per_s=2.5e6,
            download_bytes_per_s=10e6,
        ),
    ]
    table = format_status(records, run_id="r", now=now, target_batch_size=None)
    lines = table.splitlines()
    assert "2 peers online, global step 5" in lines[0]
    assert lines[3].startswith(b.short) and "direct 127.0.0.1:4001" in lines[3]
    assert "2.5/10.0" in lines[3] and "up/down MB/s" in lines[1]
    assert lines[4].startswith(a.short) and "client mode" in lines[4]
    assert "1.0s ago" in lines[4]
    assert "step samples/target" in lines[1] and lines[4].split()[-2] == "?/?"


def test_train_runs_a_users_task_module(procs: list[ChildLines], tmp_path: Path) -> None:
    task_file = tmp_path / "my_task.py"
    task_file.write_text(documented_example())
    deadline = time.monotonic() + 60
    address = started_bootstrap(procs, deadline)
    peer = cli_process(
        "train", "--join", address, "--run-id", "own", "--task", str(task_file),
        "--seconds", "6", "--target-batch-size", "32", "--batch-size", "16",
        "--log-json", "-", "--torch-threads", "1", "--save", str(tmp_path / "model.pt"),
    )  # fmt: skip
    procs.append(peer)
    events = []
    while not events or events[-1]["event"] != "end":
        events.append(json.loads(peer.next_line(deadline)))
    end = events[-1]
    assert end["global_step"] >= 2 and end["local_steps"] >= 4, end
    # The linear model learns its target (the untrained loss is about |w|^2, ~8).
    assert end["loss"] < 1e-3, end
    saved = torch.load(tmp_path / "model.pt", weights_only=True)  # --save wrote the model
    assert set(saved) == {"weight", "bias"} and saved["weight"].shape == (1, 8)


def test_two_peers_never_draw_the_same_batch() -> None:
    """Shards come from the whole PeerID digest: 10,000 draws of two peers never coincide."""
    from p2ptrain.examples.charlm.task import CharLMTask

    a, b = (shard_of(Identity.generate().peer_id) for _ in range(2))
    assert a[0] != b[0] and a[1] == b[1] >= 2**40
    namespace: dict[str, Any] = {}
    exec(documented_example(), namespace)  # the task of p2ptrain/app/task.py's docstring
    linear = namespace["make_task"]()
    draws = [
        {linear.batch(i, 4, shard=s, num_shards=n)[0].numpy().tobytes() for i in range(10_000)}
        for s, n in (a, b)
    ]
    assert len(draws[0]) == len(draws[1]) == 10_000 and not draws[0] & draws[1]
    # charlm: the sample indices of the two peers' 10,000 batches are disjoint
    firsts = [{(i * n + s) * 16 for i in range(10_000)} for s, n in (a, b)]
    assert not firsts[0] & firsts[1]
    charlm = CharLMTask()
    for i in range(20):
        assert not torch.equal(
            charlm.batch(i, 16, shard=a[0], num_shards=a[1]),
            charlm.batch(i, 16, shard=b[0], num_shards=b[1]),
        )


def _events_until_end(peer: ChildLines, deadline: float) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    while not events or events[-1]["event"] != "end":
        events.append(json.loads(peer.next_line(deadline)))
    return events


@pytest.mark.slow
def test_a_stopped_swarm_resumes_from_its_checkpoints(
    procs: list[ChildLines], tmp_path: Path
) -> None:
    """Two peers stop, restart with --checkpoint, and go on from their global step."""
    task_file = tmp_path / "my_task.py"
    task_file.write_text(documented_example())
    deadline = time.monotonic() + 150
    address = started_bootstrap(procs, deadline)

    def run(reach: list[int]) -> list[list[dict[str, Any]]]:
        """Train two peers until peer i reported global step ``reach[i]``, then
        stop them with SIGTERM (a clean end: checkpoint, end event). A condition,
        not a fixed time: on a loaded machine the second peer may join seconds
        after the first."""
        common = ["train", "--join", address, "--run-id", "resume", "--task", str(task_file)]
        common += ["--seconds", "100", "--target-batch-size", "32", "--batch-size", "8"]
        common += ["--log-json", "-", "--torch-threads", "1", "--checkpoint-every", "1"]
        peers = [
            cli_process(*common, "--checkpoint", str(tmp_path / f"peer{i}.pt")) for i in range(2)
        ]
        procs.extend(peers)
        events: list[list[dict[str, Any]]] = [[], []]
        for peer, seen, step in zip(peers, events, reach, strict=True):
            while not seen or seen[-1].get("global_step", -1) < step:
                seen.append(json.loads(peer.next_line(deadline)))
                assert seen[-1]["event"] != "end", seen[-1]
        for peer in peers:
            peer.process.terminate()
        for peer, seen in zip(peers, events, strict=True):
            while seen[-1]["event"] != "end":
                seen.append(json.loads(peer.next_line(deadline)))
        return events

    before = run([2, 2])
    steps = [events[-1]["global_step"] for events in before]
    assert min(steps) >= 2, steps
    last_loss = max(events[-1]["loss"] for events in before)
    after = run([step + 1 for step in steps])
    for events, step in zip(after, steps, strict=True):
        progress = [e for e in events if e["event"] == "progress"]
        assert progress[0]["global_step"] >= step  # resumed, not restarted from 0
        # The first loss reported after the restart (a slow machine may log no
        # progress event with a loss before the end event).
        first_loss = next(e["loss"] for e in events[1:] if e.get("loss") is not None)
        assert first_loss <= max(2 * last_loss, 1e-3), (first_loss, last_loss)
        assert events[-1]["global_step"] > step


@pytest.mark.slow
def test_one_model_per_run_through_the_command_line(
    procs: list[ChildLines], tmp_path: Path
) -> None:
    """Two peers of an unseeded task start from, and step to, the same parameters;
    a task with other parameter shapes in their run exits with a one-line error."""
    task_file = tmp_path / "linear_task.py"
    task_file.write_text(documented_example())  # torch.nn.Linear(8, 1): unseeded
    other = tmp_path / "wide_task.py"
    other.write_text(documented_example().replace("Linear(8, 1)", "Linear(8, 3)"))
    deadline = time.monotonic() + 170
    address = started_bootstrap(procs, deadline)
    # The two peers train until told to stop (SIGTERM ends a run cleanly, with
    # its summary), so the wrong peer finds them in the run however long its
    # start takes on a loaded machine.
    common = ["train", "--join", address, "--seconds", "600", "--target-batch-size", "32"]
    common += ["--batch-size", "8", "--log-json", "-", "--torch-threads", "1", "--log-digest"]
    peers = [cli_process(*common, "--task", str(task_file)) for _ in range(2)]
    procs.extend(peers)
    starts = [json.loads(peer.next_line(deadline)) for peer in peers]
    assert all(e["event"] == "start" for e in starts)
    # The task's own initial parameters (before any download): one run, one start.
    assert starts[0]["params_sha256"] == starts[1]["params_sha256"]

    # The run's id came from the task's name; another model in it is refused.
    wrong = cli_process(*common, "--task", str(other), "--run-id", "linear_task")
    procs.append(wrong)
    assert wrong.process.wait(max(1.0, deadline - time.monotonic())) == 2
    wrong_err = [line for line in wrong.stderr if "error" in line]
    assert len(wrong_err) == 1 and "trains another model" in wrong_err[0], list(wrong.stderr)

    digests: dict[int, set[str]] = {0: {starts[0]["params_sha256"]}}
    ends = []
    for peer in peers:
        events: list[dict[str, Any]] = []
        stopped = False
        while not events or events[-1]["event"] != "end":
            events.append(json.loads(peer.next_line(deadline)))
            if not stopped and events[-1].get("global_step", 0) >= 2:
                peer.process.terminate()
                stopped = True
        ends.append(events[-1])
        for event in events:
            if event["event"] == "progress":
                digests.setdefault(event["global_step"], set()).add(event["params_sha256"])
    assert min(end["global_step"] for end in ends) >= 2, ends
    assert all(len(seen) == 1 for seen in digests.values()), digests  # same step, same params
