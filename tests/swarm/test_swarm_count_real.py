"""Exactly one count per micro-batch through real processes, over five kill -9 of stage peers."""

from __future__ import annotations

import collections
import json
import queue
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

WORKER = str(Path(__file__).parent.parent / "swarm_count_worker.py")
KILLS = 5


class _Worker:
    """A process of ``swarm_count_worker.py``; its JSON lines kept in order."""

    def __init__(self, stage: int | None, *args: str) -> None:
        self.stage = stage
        self.process = subprocess.Popen(
            [sys.executable, WORKER, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.events: list[dict[str, Any]] = []
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._stderr: collections.deque[str] = collections.deque(maxlen=100)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        threading.Thread(target=self._drain, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("{"):
                event = json.loads(line)
                self.events.append(event)
                self._queue.put(event)
        self._queue.put(None)

    def _drain(self) -> None:
        assert self.process.stderr is not None
        self._stderr.extend(self.process.stderr)

    def wait_for(self, key: str, deadline: float) -> dict[str, Any]:
        while True:
            try:
                event = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                tail = "".join(self._stderr)[-1500:]
                raise AssertionError(f"no {key!r} in time: {tail}") from None
            if event is None:
                raise AssertionError(f"exited before {key!r}: {''.join(self._stderr)[-1500:]}")
            if key in event:
                return event

    def skip_queued(self) -> None:
        """Drop the events read but not yet waited for, so that the next
        :meth:`wait_for` sees only what the worker prints from now on."""
        while True:
            try:
                event = self._queue.get_nowait()
            except queue.Empty:
                return
            if event is None:  # it exited: keep saying so
                self._queue.put(None)
                return

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def kill(self) -> None:
        """kill -9, then read what it printed before it died."""
        self.process.kill()
        self.process.wait()
        self._reader.join(10)

    def in_steps(self) -> int:
        """Its samples in stage steps: the last figure it printed (a closed one adds its
        hand-over, which the optimizer holds toward the next step)."""
        for event in reversed(self.events):
            if "closed" in event:
                return int(event["in_steps"]) + int(event["local"])
            if "in_steps" in event:  # stepped or announced
                return int(event["in_steps"])
        return 0

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def _in_steps(worker: _Worker, workers: list[_Worker]) -> int:
    """A worker's samples in stage steps. A victim that died right after a step
    counts that step's samples only where its stage's keeper's step holds them:
    it may die before its share of the count marker's chunk reached the others,
    which then stepped without it (and the trainer must replay them)."""
    last = next((e for e in reversed(worker.events) if "last_own" in e), None)
    if last is None:
        return worker.in_steps()
    peer = next(e["peer"] for e in worker.events if "ready" in e)
    keeper = next(w for w in workers if w.stage == worker.stage)  # the first of its stage
    # "stepped" is the step count after the step: step k is the one before k + 1.
    step = next((e for e in keeper.events if e.get("stepped") == last["last_step"] + 1), {})
    held = peer in step.get("counted", ())
    return worker.in_steps() - (0 if held else int(last["last_own"]))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_samples_in_stage_steps_equal_samples_delivered_over_five_kills() -> None:
    """Two stages, each with a keeper and victims (three and two), killed one
    after another. Victims 1, 3 and 5 die at a random moment after a stage step
    whose receipts the directory took (so each holds averaged and unaveraged
    samples); victims 2 and 4 kill themselves right after a stage step is
    applied, before any reply or announcement says what it counted (their
    stage peers vouch for it, or the step's passes would be replayed a second
    time). All start together: a restarted peer would cost a process start per
    kill."""
    rng = random.Random(7)
    started = time.monotonic()
    deadline = started + 240
    trainer = _Worker(None, "trainer")
    workers: list[_Worker] = []
    try:
        address = trainer.wait_for("address", deadline)["address"]
        stages = [0, 1] + [k % 2 for k in range(KILLS)]  # keepers, then the victims
        workers = [_Worker(s, "server", address, str(s)) for s in stages]
        for w in workers:
            w.wait_for("ready", deadline)
        trainer.send("go")
        for k, victim in enumerate(workers[2:]):
            if k % 2:
                victim.send("die-at-step")
                victim.process.wait(max(1.0, deadline - time.monotonic()))
                victim.kill()  # reaps it and reads what it printed
                continue
            # Its next announcement, not one queued since it started: a victim that
            # ran on through later steps would be killed at any moment of them.
            victim.skip_queued()
            victim.wait_for("announced", deadline)
            time.sleep(rng.uniform(0.0, 0.5))
            victim.kill()
        trainer.send("stop")
        done = trainer.wait_for("done", deadline)
        live = [w for w in workers if w.process.poll() is None]
        for w in live:
            w.send("stop")
        for w in live:
            w.wait_for("closed", deadline)
        counted = [sum(_in_steps(w, workers) for w in workers if w.stage == s) for s in (0, 1)]
        took = time.monotonic() - started
        print(
            f"{took:.0f} s: delivered {done['delivered']}, in stage steps {counted},"
            f" replayed {done['replayed']}, retries {done['retries']}"
        )
        assert len(live) == 2
        assert done["replayed"] > 0  # the kills lost unaveraged samples, replayed elsewhere
        per_worker = [(w.stage, w.process.returncode, _in_steps(w, workers)) for w in workers]
        assert counted == [done["delivered"]] * 2, per_worker
    finally:
        for w in [trainer, *workers]:
            w.stop()
