"""One pipeline process of the exactly-once count test: a stage server or the trainer.

    python tests/swarm_count_worker.py trainer
    python tests/swarm_count_worker.py server JOIN STAGE

Both print JSON lines. The trainer (the swarm's first DHT peer) prints
``{"address"}``, pushes micro-batches (four in flight) from a line ``go`` on
stdin until a line ``stop``, then settles (replays every pass known lost)
and prints ``{"done", "delivered", "replayed", "retries"}``. A server prints
``{"ready", "peer"}``, then ``{"stepped", "in_steps", "counted"}`` at once after
each stage step it applies (``in_steps``: its samples in the steps it applied
so far; ``counted``: the peers whose samples that step holds) and
``{"announced", "in_steps"}`` once the directory holds that step's receipts; on a
line ``stop`` it closes (handing its last gradients to the optimizer) and
prints ``{"closed", "in_steps", "local"}``; on a line ``die-at-step`` it kills
itself (SIGKILL) right after its next stage step is applied, before any reply
or announcement says what the step counted (first printing ``{"stepped",
"in_steps", "last_step", "last_own"}``). Each exits when its stdin closes.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch
from swarm_peers import (
    make_trainer,
    mlp_model,
    regression_batch,
    server_config,
    sgd,
)
from train_worker import FAST_MATCHMAKING, peer_config

from p2ptrain.peer import Peer
from p2ptrain.swarm import StageServer

IN_FLIGHT = 4


def _emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def _peer(join: tuple[str, ...]) -> Peer:
    peer = Peer(replace(peer_config(join, FAST_MATCHMAKING), nat=None, probe_seconds=None))
    peer.start()
    return peer


def _lines() -> tuple[threading.Event, threading.Event, threading.Event]:
    """(``go`` read, ``stop`` read or stdin closed, ``die-at-step`` read)."""
    go, stop, die = threading.Event(), threading.Event(), threading.Event()
    events = {"go": go, "die-at-step": die}

    def read() -> None:
        for line in sys.stdin:
            events.get(line.strip(), stop).set()
        stop.set()

    threading.Thread(target=read, daemon=True).start()
    return go, stop, die


def _die_at_next_step(server: StageServer, armed: threading.Event) -> None:
    """Once ``armed``: kill -9 this process right after the next stage step is applied,
    in the hand-over, before anything (a reply, the directory) says what it counted;
    first print ``{"stepped", "in_steps"}`` with that step's samples."""
    copt = server.optimizer
    step = copt.step

    def step_then_die(batch_size: int | None = None) -> bool:
        before = copt.last_step
        changed = step(batch_size)
        record = copt.last_step
        if armed.is_set() and record is not None and record is not before:
            _emit(
                stepped=copt.global_step,
                in_steps=server.stats.samples_in_steps + record.own,
                last_step=record.step,
                last_own=record.own,
            )
            os.kill(os.getpid(), signal.SIGKILL)
        return changed

    copt.step = step_then_die  # type: ignore[method-assign]


def train() -> None:
    peer = _peer(())
    trainer = make_trainer(
        peer, refresh_interval=0.2, avoid_s=0.5, gone_after=1.0, call_timeout=3.0
    )
    _emit(address=peer.address)
    go, stop, _ = _lines()
    go.wait()
    counter = iter(range(1 << 40))

    async def lane() -> None:
        while not stop.is_set():
            await trainer.train_micro_batch(*regression_batch(next(counter), rows=8))

    lanes = [peer.submit(lane()) for _ in range(IN_FLIGHT)]
    for future in lanes:
        future.result()
    peer.run(trainer.settle(), timeout=120)
    stats = trainer.stats
    _emit(
        done=True,
        delivered=stats.samples_delivered,
        replayed=stats.replayed_samples,
        retries=stats.retries,
    )
    trainer.close()
    sys.stdin.read()
    peer.close()


def serve(join: str, stage: int) -> None:
    peer = _peer((join,))
    config = server_config(
        target_batch_size=96, announce_ttl=1.5, announce_interval=0.2, min_compute_s=0.005
    )
    server = StageServer(
        peer=peer, model=mlp_model(), stage=stage, make_optimizer=sgd, config=config
    )

    def on_event(event: str, _stage: int) -> None:
        if event == "stepped":
            record = server.optimizer.last_step
            counted = [] if record is None else sorted(str(p) for p in record.counted or ())
            in_steps = server.stats.samples_in_steps
            _emit(stepped=server.global_step, in_steps=in_steps, counted=counted)
        elif event == "announced":
            _emit(announced=server.global_step, in_steps=server.stats.samples_in_steps)

    server.on_event = on_event
    _, stop, die = _lines()
    server.start()
    _die_at_next_step(server, die)
    _emit(ready=True, peer=str(peer.node.peer_id))
    stop.wait()
    server.close()
    _emit(closed=True, in_steps=server.stats.samples_in_steps, local=server.optimizer.local_samples)
    peer.close()


def main() -> None:
    torch.set_num_threads(1)
    if sys.argv[1] == "trainer":
        train()
    else:
        serve(sys.argv[2], int(sys.argv[3]))


if __name__ == "__main__":
    main()
