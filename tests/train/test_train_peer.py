"""The Peer facade, the trainers' configs, and averaging fallbacks."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from train_worker import peer_with_absent_partner

import p2ptrain.train
from p2ptrain.allreduce.bandwidth import ThroughputConfig
from p2ptrain.allreduce.config import AllReduceConfig
from p2ptrain.allreduce.matchmaking import MatchmakingConfig
from p2ptrain.dht.node_config import DHTNodeConfig
from p2ptrain.errors import ConfigError, LookupFailedError, RunMismatchError
from p2ptrain.measure import payload_rate
from p2ptrain.node.config import NodeConfig
from p2ptrain.peer import Peer, PeerConfig
from p2ptrain.train.averaging import SwarmAverager
from p2ptrain.train.config import DiLoCoConfig, TrainerConfig
from p2ptrain.train.optimizer import CollaborativeOptimizer
from p2ptrain.train.progress import ProgressConfig
from p2ptrain.train.tracker import ProgressTracker


def test_the_loop_thread_uses_the_creators_torch_thread_count() -> None:
    """torch's thread count is per thread: unset, the loop thread's averaging would run
    OpenMP teams as large as the machine's cores beside a training thread set to fewer."""
    before = torch.get_num_threads()
    wanted = 1 if before > 1 else 2
    torch.set_num_threads(wanted)
    try:
        with Peer(PeerConfig(nat=None, probe_seconds=None)) as peer:

            async def threads() -> int:
                return torch.get_num_threads()

            assert peer.run(threads(), timeout=10) == wanted
    finally:
        torch.set_num_threads(before)


def test_a_peer_runs_coroutines_on_its_loop_and_closes_cleanly(tmp_path: Path) -> None:
    key = tmp_path / "id.key"
    with Peer(PeerConfig(identity_path=key)) as peer:
        assert peer.running
        assert peer.address.startswith(f"{peer.peer_id}@127.0.0.1:")

        async def where() -> str:
            await asyncio.sleep(0)
            return str(peer.dht.peer_id)

        assert peer.run(where(), timeout=5) == str(peer.peer_id)
        assert peer.submit(where()).result(timeout=5) == str(peer.peer_id)
        assert peer.capacity().upload_bytes_per_s == peer.config.default_bytes_per_s
        peer.set_samples_per_s(12.5)
        assert peer.capacity().samples_per_s == 12.5
        with pytest.raises(TimeoutError):
            peer.run(asyncio.sleep(10), timeout=0.01)
        first_id = peer.peer_id
    assert not peer.running
    peer.close()  # idempotent
    with pytest.raises(RuntimeError):
        peer.run(asyncio.sleep(0))
    with Peer(PeerConfig(identity_path=key)) as again:
        assert again.peer_id == first_id  # the key file keeps the identity
    with pytest.raises(RuntimeError):
        again.start()


def test_a_new_peer_probes_its_links_against_an_initial_peer() -> None:
    with Peer(PeerConfig(probe_seconds=None)) as first:
        config = PeerConfig(
            dht=DHTNodeConfig(initial_peers=(first.address,)),
            throughput=ThroughputConfig(upload_bytes_per_s=1e6),  # explicit: never probed
            probe_seconds=0.3,
        )
        with Peer(config) as second:
            second.run(second.probed(), timeout=20)
            assert second.throughput.download_bytes_per_s is not None, "the probe measured nothing"
            # loopback moves far more than the 12.5 MB/s guessed before any measurement
            assert second.capacity().download_bytes_per_s > 50e6
            assert second.capacity().upload_bytes_per_s == payload_rate(1e6)  # the link's payload
        assert first.throughput.download_bytes_per_s is None  # probe_seconds=None: it never probed


def test_a_tracker_that_closes_tells_the_others_it_left() -> None:
    """A clean exit is seen at the next read, not when the record expires (20 s)."""
    config = ProgressConfig()
    with Peer(PeerConfig(probe_seconds=None)) as first:
        joined = PeerConfig(dht=DHTNodeConfig(initial_peers=(first.address,)), probe_seconds=None)
        with Peer(joined) as second:
            trackers = [
                ProgressTracker(
                    dht=p.dht, run_id="leave", config=config, target_batch_size=8, address=None
                )
                for p in (first, second)
            ]
            first.run(trackers[0].start(step=3), timeout=10)
            second.run(trackers[1].start(step=3), timeout=10)
            assert first.run(trackers[0].refresh(), timeout=10).peers_online == 2
            second.run(trackers[1].aclose(), timeout=10)
            view = first.run(trackers[0].refresh(), timeout=10)
            assert view.peers_online == 1 and view.records[0].peer_id == first.peer_id
            first.run(trackers[0].aclose(), timeout=10)


@pytest.mark.parametrize(
    ("policy", "by_event"),
    [("wait", False), ("carry", False), ("unbounded", False), ("wait", True)],
)
def test_a_step_waiting_for_its_group_ends_at_the_stop_time(policy: str, by_event: bool) -> None:
    """The group waits for a peer that never comes; stop_at() ends the wait on time
    (at its deadline, or when its event is set from another thread)."""
    with peer_with_absent_partner(window=8.0, run_id="stop", target=4) as first:
        model = torch.nn.Linear(3, 1)
        config = TrainerConfig(run_id="stop", target_batch_size=4, step_policy=policy)
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        with CollaborativeOptimizer(inner, peer=first, config=config) as trainer:
            stop = time.monotonic() + 1.0
            event = threading.Event()
            if by_event:
                trainer.stop_at(None, event=event)
                threading.Timer(1.0, event.set).start()
            else:
                trainer.stop_at(stop)
            while time.monotonic() < stop and not event.is_set():
                model(torch.ones(4, 3)).sum().backward()
                trainer.step(4)
            ended = time.monotonic()
        assert trainer.global_step == 0  # the step never formed a group: not applied
        # Measured about 0.5 s (the grace of a running average); bounded here
        # far below the 8 s window it would otherwise wait.
        assert ended - stop < 3.0, f"overran the stop time by {ended - stop:.2f} s"


def test_a_trainer_of_another_model_refuses_to_join_a_run() -> None:
    with Peer(PeerConfig(probe_seconds=None)) as first:
        joined = PeerConfig(dht=DHTNodeConfig(initial_peers=(first.address,)), probe_seconds=None)
        with Peer(joined) as second:
            config = TrainerConfig(run_id="one-model", target_batch_size=8)
            narrow, wide = torch.nn.Linear(4, 1), torch.nn.Linear(4, 2)
            sgd = torch.optim.SGD
            with CollaborativeOptimizer(
                sgd(narrow.parameters(), lr=0.1), peer=first, config=config
            ):
                other = CollaborativeOptimizer(
                    sgd(wide.parameters(), lr=0.1), peer=second, config=config
                )
                with pytest.raises(RunMismatchError, match="trains another model"):
                    other.start()
                # The same model joins, and the refused peer's records are gone with it.
                same = CollaborativeOptimizer(
                    sgd(torch.nn.Linear(4, 1).parameters(), lr=0.1), peer=second, config=config
                )
                with same:
                    assert same.swarm_progress().peers_online == 2


def test_the_peer_traverses_nats_by_default_like_the_command_line() -> None:
    from p2ptrain.nat.config import NATConfig

    assert PeerConfig().nat == "auto" and PeerConfig().nat_config() is None  # 127.0.0.1
    public = PeerConfig(node=NodeConfig(host="0.0.0.0"))
    assert public.nat_config() == NATConfig()
    assert PeerConfig(node=NodeConfig(host="0.0.0.0"), nat=None).nat_config() is None
    explicit = NATConfig(dialback_timeout=1.5)
    assert PeerConfig(nat=explicit).nat_config() is explicit
    with pytest.raises(ConfigError, match="NATConfig, 'auto' or None"):
        PeerConfig(nat="on")  # type: ignore[arg-type]


def test_a_peer_that_cannot_bootstrap_fails_to_start() -> None:
    config = PeerConfig(dht=DHTNodeConfig(initial_peers=("127.0.0.1:1",), request_timeout=1.0))
    peer = Peer(config)
    with pytest.raises(LookupFailedError, match="initial peers"):
        peer.start()
    assert not peer.running
    peer.close()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"default_bytes_per_s": 0},
        {"join_timeout": math.nan},
        {"node": "x"},
        {"identity_path": 3},
        {"use_uvloop": "yes"},
        {"probe_seconds": 0},
        {"probe_seconds": 60.0},
    ],
)
def test_bad_peer_configs_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        PeerConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"run_id": "", "target_batch_size": 1},
        {"run_id": "a/b", "target_batch_size": 1},
        {"run_id": "r", "target_batch_size": 0},
        {"run_id": "r", "target_batch_size": True},
        {"run_id": "r", "target_batch_size": 8, "max_local_samples_per_step": 0},
        {"run_id": "r", "target_batch_size": 8, "matchmaking_lead": -1.0},
        {"run_id": "r", "target_batch_size": 8, "sync_tolerance": -1},
        {"run_id": "r", "target_batch_size": 8, "allreduce": None},
    ],
)
def test_bad_trainer_configs_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        TrainerConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"inner_steps": 0},
        {"outer_lr": 0.0},
        {"outer_momentum": -0.1},
        {"outer_momentum": 0.0},  # Nesterov needs momentum
        {"nesterov": 1},
        {"target_batch_size": 0},
        {"progress": None},
    ],
)
def test_bad_diloco_configs_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        DiLoCoConfig(run_id="r", **kwargs)


def test_the_public_api_is_pinned() -> None:
    assert sorted(p2ptrain.train.__all__) == [
        "CheckpointError",
        "CollaborativeOptimizer",
        "DiLoCoConfig",
        "DiLoCoOptimizer",
        "PeerProgress",
        "ProgressConfig",
        "StateSyncConfig",
        "StateSyncError",
        "SwarmProgress",
        "TrainerConfig",
        "TrainerStats",
        "TrainingError",
        "TrainingSnapshot",
        "aggregate",
        "load_checkpoint",
        "save_checkpoint",
    ]


def test_without_a_group_the_averager_keeps_the_local_vector() -> None:
    quick = MatchmakingConfig(window=0.3, poll_interval=0.05, ready_timeout=0.5, plan_timeout=0.5)
    with Peer(PeerConfig(matchmaking=quick)) as peer:
        averager = SwarmAverager(peer=peer, run_id="lonely", allreduce=AllReduceConfig())
        vector = torch.arange(5, dtype=torch.float32)
        same, alone = peer.run(averager.average(0, vector, 3.0, group_size=1))
        assert same is vector and alone.fallback == "alone" and not alone.averaged
        # It believes another peer is online, but nobody comes: too few.
        peer.run(averager.prepare(1, num_elements=5, group_size=2))
        same, outcome = peer.run(averager.average(1, vector, 3.0, group_size=2), timeout=30)
        assert same is vector
        assert outcome.fallback is not None and outcome.fallback.startswith("matchmaking")
        assert outcome.matchmaking_s > 0 and outcome.report is None
        peer.run(averager.aclose())
