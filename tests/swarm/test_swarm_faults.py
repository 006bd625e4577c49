"""Faults of stage peers cost only a retry; bad requests get typed errors; nothing crashes."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
from swarm_peers import (
    RUN,
    kill,
    make_trainer,
    regression_batch,
    server_config,
    swarm,
    trainer_config,
)
from torch import nn
from train_worker import FAST_MATCHMAKING, peer_config

from p2ptrain.errors import (
    InvalidArgumentError,
    LookupFailedError,
    ResourceExhaustedError,
    StageUnavailableError,
    UnavailableError,
)
from p2ptrain.peer import Peer
from p2ptrain.secure.identity import Identity
from p2ptrain.swarm import StageServer
from p2ptrain.swarm import trainer as trainer_module
from p2ptrain.swarm.directory import StageAnnouncement, announce
from p2ptrain.swarm.ledger import Receipts
from p2ptrain.swarm.protocol import (
    BACKWARD_METHOD,
    FORWARD_METHOD,
    RECEIPTS_METHOD,
    RELEASE_METHOD,
    request_body,
)
from p2ptrain.swarm.trainer import PipelineTrainer, _Unconfirmed
from p2ptrain.wire.tensors import encode_tensor


@pytest.mark.parametrize("moment", ["forward_started", "forward_done"])
def test_a_stage_peer_killed_mid_micro_batch_costs_a_retry_and_counts_once(moment: str) -> None:
    slow = server_config(min_compute_s=0.3)
    with swarm([0, 1, 1], config=[server_config(), slow, slow]) as (trainer_peer, peers, servers):
        trainer = make_trainer(trainer_peer)
        trainer.step(*regression_batch(0), timeout=30)  # both stage-1 peers are announced
        before = {i: servers[i].stats.samples_committed for i in (0, 1, 2)}
        killed: list[int] = []

        def killer(index: int) -> Callable[[str, int], None]:
            def on_event(event: str, stage: int) -> None:
                if event == moment and not killed:  # the kill lands at once, on its loop
                    killed.append(index)
                    asyncio.get_running_loop().create_task(peers[index].node.abort())

            return on_event

        for index in (1, 2):
            servers[index].on_event = killer(index)
        trainer.step(*regression_batch(1), timeout=60)
        assert killed
        victim = killed[0]
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
        for vouch in (
            {"inc": "x", "peer": "not a peer id", "stage": 0, "step": 0},
            {"inc": "x", "peer": str(node.peer_id), "stage": 0, "step": "0"},
        ):
            with pytest.raises(InvalidArgumentError, match="vouch request"):
                trainer_peer.run(node.call(address, RECEIPTS_METHOD, vouch, timeout=5))
        assert servers[0].stats.bad_requests >= 6
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


def test_samples_a_killed_peer_had_not_yet_averaged_are_replayed_and_counted_once() -> None:
    # Stage steps of 20 micro-batches: the victim holds committed, unaveraged samples
    # (the first micro-batch), and the kill comes before stage 1's first step, so no
    # step is in flight at the kill (a peer killed after a step and before its
    # receipts reached the directory is the window docs/pipeline.md leaves open).
    # A floor on compute keeps stage steps ~1 s apart: the two stage-1 peers then
    # average together (far faster steps outrun their matchmaking and one of them
    # keeps downloading the other's state, losing and replaying its samples).
    config = server_config(
        target_batch_size=320, announce_ttl=1.5, announce_interval=0.2, min_compute_s=0.01
    )
    with swarm([0, 1, 1], config=config) as (trainer_peer, peers, servers):
        trainer = make_trainer(trainer_peer, refresh_interval=0.2, avoid_s=0.5, gone_after=1.0)
        trainer.step(*regression_batch(0), timeout=30)
        i = 1
        committed = [servers[k].stats.samples_committed for k in (1, 2)]
        v = 1 if committed[0] >= committed[1] else 2  # the one holding unaveraged samples
        victim, survivor = servers[v], servers[3 - v]
        assert victim.global_step == 0
        assert victim.stats.samples_in_steps == 0
        kill(peers[v])
        lost = victim.stats.samples_committed - victim.stats.samples_in_steps
        assert lost > 0
        delivered, stage0 = _train_past_the_kill(trainer, servers[0], victim, survivor, i, 1000)
        assert trainer.stats.replayed_samples >= lost
        stage1 = (
            victim.stats.samples_in_steps
            + survivor.stats.samples_in_steps
            + survivor.optimizer.local_samples
        )
        print(
            f"delivered {delivered}, counted stage 0 {stage0}, stage 1 {stage1}; replayed "
            f"{trainer.stats.replayed_samples} ({lost} lost with the victim)"
        )
        assert stage0 == delivered
        assert stage1 == delivered


def test_a_peer_killed_between_a_step_and_its_receipts_is_vouched_for_by_its_stage() -> None:
    """The victim dies right after its first stage step, before any reply or
    announcement says what that step counted. Its directory entry holds what it
    had handed toward that step (announced before the step); the stage's other
    peer, which averaged with it, says the step counted it; so the trainer replays
    only the commits after the step, and every sample counts once (the old
    trainer replayed the whole step's share of the victim a second time)."""
    config = server_config(
        target_batch_size=320, announce_ttl=5.0, announce_interval=0.2, min_compute_s=0.01
    )
    with swarm([0, 1, 1], config=config) as (trainer_peer, peers, servers):
        trainer = make_trainer(trainer_peer, refresh_interval=0.2, avoid_s=0.5, gone_after=1.0)
        victim, survivor = servers[1], servers[2]
        dead = _die_after_first_step(victim)
        i = 0
        while not dead.is_set():
            trainer.step(*regression_batch(i), timeout=30)
            i += 1
            assert i < 2000
        peers[1].run(victim.abort(), timeout=10)  # its server's loops die with the process
        record = victim.optimizer.last_step
        assert record is not None and len(record.group) == 2  # averaged with the survivor
        delivered, stage0 = _train_past_the_kill(trainer, servers[0], victim, survivor, i, 3000)
        # The victim's step holds its samples as the survivor saw it: the victim may
        # die before its share of the count marker's chunk reached the survivor,
        # which then stepped without it (and the trainer must replay them).
        in_survivor = peers[1].node.peer_id in (survivor._state.vouches[record.step].counted or ())
        stage1 = (
            (record.own if in_survivor else 0)
            + survivor.stats.samples_in_steps
            + survivor.optimizer.local_samples
        )
        print(
            f"delivered {delivered}, counted stage 0 {stage0}, stage 1 {stage1}; the victim's"
            f" step held {record.own} of its samples (in the survivor's: {in_survivor});"
            f" replayed {trainer.stats.replayed_samples}"
        )
        assert victim.stats.samples_in_steps == record.own  # its only step
        assert trainer.stats.vouched == int(in_survivor)
        assert stage0 == delivered
        assert stage1 == delivered


def _train_past_the_kill(  # noqa: PLR0917 - the two kill tests' shared tail
    trainer: PipelineTrainer,
    stage0: StageServer,
    victim: StageServer,
    survivor: StageServer,
    i: int,
    limit: int,
) -> tuple[int, int]:
    """Train until no pass waits on the victim and the survivor stepped twice more,
    settle, and close the trainer, stage 0's server and the survivor (each hands
    its last partial step's samples to its optimizer). Returns the samples
    delivered and those in stage 0's steps."""
    step_at_kill = survivor.global_step
    while trainer.awaiting(victim._address) or survivor.global_step < step_at_kill + 2:
        trainer.step(*regression_batch(i), timeout=30)
        i += 1
        assert i < limit
    trainer.peer.run(trainer.settle(), timeout=60)
    trainer.close()
    for server in (stage0, survivor):
        server.close()
    return trainer.stats.samples_delivered, (
        stage0.stats.samples_in_steps + stage0.optimizer.local_samples
    )


def _die_after_first_step(server: StageServer) -> threading.Event:
    """``server``'s peer is killed right after its first stage step is applied (in the
    hand-over, before the step's receipts exist); the event is set then."""
    dead = threading.Event()
    copt = server.optimizer
    step, commit_now, announce_now = copt.step, server._commit, server._announce

    def step_then_die(batch_size: int | None = None) -> bool:
        before = copt.global_step
        changed = step(batch_size)
        if copt.global_step != before:
            dead.set()
            kill(server.peer)
        return changed

    def commit(*args: Any) -> Any:
        if dead.is_set():
            raise UnavailableError("dead")
        return commit_now(*args)

    async def announce() -> bool:
        return False if dead.is_set() else await announce_now()

    copt.step = step_then_die  # type: ignore[method-assign]
    server._commit = commit  # type: ignore[method-assign]
    server._announce = announce  # type: ignore[method-assign]
    return dead


def test_a_server_gone_right_after_a_step_is_settled_by_its_last_directory_receipts() -> None:
    """A server killed before any reply carried its last step's receipts: the
    directory entry it announced says what that step counted. The trainer reads
    it at the first failed ask and keeps it (the entry may expire before the
    server counts as gone), so it replays only the rest, and once however many
    confirming rounds run at a time."""
    with swarm([]) as (trainer_peer, _, _):
        config = peer_config((trainer_peer.address,), FAST_MATCHMAKING)
        dead = Peer(replace(config, nat=None, probe_seconds=None))
        dead.start()
        address = dead.address
        receipts = Receipts("a1b2", contributed=5, lost=())
        stored = announce(
            dead.dht, RUN, 1, address=address, samples_per_s=1.0, queue=0, step=1, ttl=60.0,
            receipts=receipts,
        )  # fmt: skip
        assert dead.run(stored)
        kill(dead)
        dead.close()
        now = [0.0]  # the trainer's clock: gone_after passes when the test says so
        trainer = PipelineTrainer(
            peer=trainer_peer,
            config=trainer_config(gone_after=3.0),
            loss=nn.functional.mse_loss,
            seed=0,
            clock=lambda: now[0],
        )
        x, grad = torch.zeros(4, 8), torch.zeros(4, 8)
        counted = _Unconfirmed(1, address, ("a1b2", 3), x, grad, samples=4)
        pending = _Unconfirmed(1, address, ("a1b2", 7), x, grad, samples=4)
        trainer._unconfirmed = [counted, pending]
        trainer_peer.run(trainer.confirm())  # unreachable: reads the directory once
        assert trainer._unconfirmed == [counted, pending]  # not gone yet
        assert trainer._receipts_seen[(address, "a1b2")] == receipts  # kept from the entry
        now[0] += 3.0  # unreachable for gone_after: the server counts as gone

        async def twice() -> None:  # settle() beside the confirming loop
            await asyncio.gather(trainer.confirm(), trainer.confirm())

        trainer_peer.run(twice())
        assert trainer._unconfirmed == []
        # Seq 7 once: seq 3 was in the step, and the second round found nothing left.
        assert trainer.stats.replayed_samples == 4
        trainer.close()


async def test_micro_batches_share_one_directory_read_and_a_failed_read_keeps_the_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A trainer keeps hundreds of micro-batches in flight; when the stage list needs
    # a refresh they must not each read the DHT (a herd that makes lookups fail),
    # and a failed lookup must not read as "this stage has no peer" (a pause).
    peer_id = Identity.generate().peer_id
    entry = StageAnnouncement(peer_id, 0, f"{peer_id}@127.0.0.1:1", 8.0, 0, 0, 1e12, None, False)
    reads: list[int] = []
    outcome: list[object] = [[entry]]
    release = asyncio.Event()

    async def read_stage(_dht: object, _run: str, stage: int) -> list[StageAnnouncement]:
        reads.append(stage)
        await release.wait()
        if isinstance(outcome[0], Exception):
            raise outcome[0]
        return outcome[0]  # type: ignore[return-value]

    class _Peer:
        dht = None

    monkeypatch.setattr(trainer_module, "read_stage", read_stage)
    now = [0.0]
    trainer = PipelineTrainer(
        peer=_Peer(),  # type: ignore[arg-type]
        config=trainer_config(),
        loss=nn.functional.mse_loss,
        seed=0,
        clock=lambda: now[0],
    )
    waiters = [asyncio.ensure_future(trainer._stage_candidates(0, force=True)) for _ in range(200)]
    await asyncio.sleep(0)
    release.set()
    lists = await asyncio.gather(*waiters)
    assert reads == [0]  # one read for all 200
    assert all([c.address for c in found] == [entry.address] for found in lists)
    now[0] += 100.0  # stale: the next call reads again, and that lookup fails
    outcome[0] = LookupFailedError("no DHT peer answered")
    kept = await trainer._stage_candidates(0, force=False)
    assert reads == [0, 0]
    assert [c.address for c in kept] == [entry.address]  # not an empty stage
    assert await trainer._stage_candidates(1, force=True) == []  # never read: nothing to keep
