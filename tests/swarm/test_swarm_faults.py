"""Faults of stage peers cost only a retry; bad requests get typed errors; nothing crashes."""

from __future__ import annotations

import threading

import pytest
import torch
from swarm_peers import RUN, kill, make_trainer, regression_batch, server_config, swarm

from p2ptrain.errors import InvalidArgumentError, ResourceExhaustedError, StageUnavailableError
from p2ptrain.swarm import StageServer
from p2ptrain.swarm.protocol import (
    BACKWARD_METHOD,
    FORWARD_METHOD,
    RELEASE_METHOD,
    request_body,
)
from p2ptrain.wire.tensors import encode_tensor


def _watch(server: StageServer, wanted: str) -> threading.Event:
    seen = threading.Event()

    def on_event(event: str, stage: int) -> None:
        if event == wanted:
            seen.set()

    server.on_event = on_event
    return seen


@pytest.mark.parametrize("moment", ["forward_started", "forward_done"])
def test_a_stage_peer_killed_mid_micro_batch_costs_a_retry_and_counts_once(moment: str) -> None:
    slow = server_config(min_compute_s=0.3)
    with swarm([0, 1, 1], config=[server_config(), slow, slow]) as (trainer_peer, peers, servers):
        trainer = make_trainer(trainer_peer)
        trainer.step(*regression_batch(0), timeout=30)  # both stage-1 peers are announced
        events = {i: _watch(servers[i], moment) for i in (1, 2)}
        before = {i: servers[i].stats.samples_committed for i in (0, 1, 2)}
        done = trainer_peer.submit(trainer.train_micro_batch(*regression_batch(1)))
        victim = None
        for _ in range(2):  # the trainer picked one of the two stage-1 peers
            for i, event in events.items():
                if event.wait(timeout=0.1 if victim is None else 0):
                    victim = i
            if victim is not None:
                break
        if victim is None:
            victim = next(i for i, e in events.items() if e.wait(timeout=20))
        kill(peers[victim])
        done.result(timeout=30)
        survivor = 3 - victim
        assert trainer.stats.retries >= 1
        assert trainer.stats.samples_delivered == 32
        assert servers[0].stats.samples_committed - before[0] == 16
        assert servers[survivor].stats.samples_committed - before[survivor] == 16
        assert servers[victim].stats.samples_committed == before[victim]


def test_a_full_cap_is_a_typed_error_and_bad_frames_leave_the_server_serving() -> None:
    config = server_config(max_held_per_peer=2, max_tensor_bytes=4096)
    with swarm([0, 1], config=config) as (trainer_peer, _, servers):
        address = servers[0].peer.address
        node = trainer_peer.node
        header, view = encode_tensor(torch.randn(4, 4))

        def forward(mb: bytes, payload: object = view, head: object = header) -> object:
            body = request_body(RUN, 0, mb, x=head)
            return trainer_peer.run(node.call(address, FORWARD_METHOD, body, payload, timeout=5))

        forward(b"a" * 16)
        forward(b"b" * 16)
        with pytest.raises(ResourceExhaustedError, match="cap"):
            forward(b"c" * 16)
        assert servers[0].stats.refused_full == 1
        with pytest.raises(InvalidArgumentError, match="payload"):
            forward(b"d" * 16, payload=bytes(view)[:-4])
        with pytest.raises(InvalidArgumentError, match="cap"):
            big, big_view = encode_tensor(torch.zeros(64, 64))
            forward(b"e" * 16, payload=big_view, head=big)
        with pytest.raises(InvalidArgumentError):
            forward(b"short", payload=view)
        with pytest.raises(InvalidArgumentError, match="NaN"):
            nan, nan_view = encode_tensor(torch.full((4, 4), float("nan")))
            forward(b"f" * 16, payload=nan_view, head=nan)
        with pytest.raises(InvalidArgumentError, match="holds no forward"):
            body = request_body(RUN, 0, b"z" * 16, g=header, n=4)
            trainer_peer.run(node.call(address, BACKWARD_METHOD, body, view, timeout=5))
        assert servers[0].stats.bad_requests >= 4
        for mb in (b"a" * 16, b"b" * 16):  # free the cap again
            body = request_body(RUN, 0, mb)
            trainer_peer.run(node.call(address, RELEASE_METHOD, body, timeout=5))
        assert servers[0].queue_length == 0
        trainer = make_trainer(trainer_peer)
        trainer.step(*regression_batch(0), timeout=30)
        assert trainer.stats.samples_delivered == 16


def test_a_stage_with_no_live_peer_pauses_with_a_status_line_then_gives_up() -> None:
    with swarm([0]) as (trainer_peer, _, _servers):
        trainer = make_trainer(trainer_peer, stage_wait=1.0)
        with pytest.raises(StageUnavailableError, match="stage 1"):
            trainer.step(*regression_batch(0), timeout=30)
        assert trainer.stats.micro_batches == 0
