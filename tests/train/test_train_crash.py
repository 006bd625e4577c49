"""A peer killed mid-epoch never stalls the swarm longer than the step deadline.

Four peers train together: three in this process (a :class:`Peer` and a
training thread each) and the victim in its own process
(tests/train_worker.py), which is SIGKILLed while it accumulates toward a
step. The three survivors keep stepping, and no step of theirs takes longer
than the deadline of one averaging (matchmaking window, two ready checks and
the plan timeout, plus the all-reduce round timeout).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from train_worker import (
    FAST_MATCHMAKING,
    FAST_PROGRESS,
    WorkerProcess,
    backward,
    dataset,
    make_model,
    peer_config,
    rows,
)

from p2ptrain.peer import Peer
from p2ptrain.train.config import TrainerConfig
from p2ptrain.train.optimizer import CollaborativeOptimizer

START_TIMEOUT = 60.0  # importing torch on 2 busy cores
BATCH = 8
COUNT = 4
KILL_AFTER = 2  # the victim dies right after it reports this step
MORE_STEPS = 4  # steps every survivor takes after the kill
COMPUTE_S = 0.02  # stands for a real model's compute time per batch
MM = FAST_MATCHMAKING
DEADLINE = MM.window + 2 * MM.ready_timeout + MM.plan_timeout + MM.round_timeout
"""The longest one step may take with a dead member (see SwarmAverager.deadline)."""
CONFIG = TrainerConfig(run_id="crash", target_batch_size=COUNT * BATCH * 2, progress=FAST_PROGRESS)


class Survivor:
    """An in-process peer that trains in its own thread until told to stop."""

    def __init__(self, peer: Peer, shard: int, progress: threading.Condition) -> None:
        self.peer = peer
        self.progress = progress
        self.shard = shard
        self.model = make_model(0)
        self.opt = CollaborativeOptimizer(
            torch.optim.SGD(self.model.parameters(), lr=0.05), peer=peer, config=CONFIG
        )
        self.steps: list[tuple[float, int]] = []
        """(time, global step after it) of every step this survivor took."""
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._train, name=f"survivor-{shard}")

    def _train(self) -> None:
        x, y = dataset(4096)
        local = 0
        try:
            while not self.stop.is_set():
                part = rows(local % 100, BATCH, shard=self.shard, num_shards=COUNT)
                backward(self.model, x[part], y[part])
                time.sleep(COMPUTE_S)
                local += 1
                if self.opt.step(BATCH):
                    with self.progress:
                        self.steps.append((time.time(), self.opt.global_step))
                        self.progress.notify_all()
        except BaseException as exc:
            with self.progress:
                self.error = exc
                self.progress.notify_all()
            raise


@pytest.fixture
def survivors() -> Iterator[list[Survivor]]:
    peers: list[Peer] = []
    crew: list[Survivor] = []
    progress = threading.Condition()
    try:
        for shard in range(COUNT - 1):
            peer = Peer(peer_config((peers[0].address,) if peers else ()))
            peer.start()
            peers.append(peer)
            crew.append(Survivor(peer, shard, progress))
        yield crew
    finally:
        for member in crew:
            member.stop.set()
            if member.thread.ident is not None:
                member.thread.join(timeout=DEADLINE + 10)
            member.opt.close()
        for peer in peers:
            peer.close()


@pytest.fixture
def victim(survivors: list[Survivor]) -> Iterator[WorkerProcess]:
    job = {
        "run_id": CONFIG.run_id,
        "target": CONFIG.target_batch_size,
        "batch": BATCH,
        "steps": 1000,
        "shard": COUNT - 1,
        "num_shards": COUNT,
        "compute_s": COMPUTE_S,
        "initial_peers": [survivors[0].peer.address],
    }
    process = WorkerProcess(job)
    try:
        yield process
    finally:
        process.kill()


def test_survivors_keep_stepping_after_a_peer_is_killed(
    survivors: list[Survivor], victim: WorkerProcess
) -> None:
    victim.next(START_TIMEOUT)  # its address: it is in the swarm
    for member in survivors:
        member.opt.start()
    for member in survivors:
        member.thread.start()
    while victim.next(DEADLINE + 10).get("step", 0) < KILL_AFTER:
        pass
    victim.kill()  # it was accumulating toward its next step
    killed_at = time.time()

    # Counted by global step, not by steps after the kill's timestamp: the
    # survivors' own step KILL_AFTER can end a moment after the victim reported it.
    goal = KILL_AFTER + MORE_STEPS

    def done() -> bool:
        failed = any(m.error is not None for m in survivors)
        return failed or all(m.steps and m.steps[-1][1] >= goal for m in survivors)

    progress = survivors[0].progress
    with progress:
        assert progress.wait_for(done, timeout=(MORE_STEPS + 2) * DEADLINE), "no more steps"
    for member in survivors:
        member.stop.set()
    for member in survivors:
        member.thread.join(timeout=DEADLINE + 10)
        assert member.error is None
        after = [(t, step) for t, step in member.steps if t > killed_at]
        assert [step for _, step in after] == sorted({step for _, step in after}), after
        times = [killed_at, *(t for t, _ in after)]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert max(gaps) <= DEADLINE, f"a step took {max(gaps):.1f} s > {DEADLINE} s"
        assert member.opt.global_step >= goal
