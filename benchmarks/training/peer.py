"""One p2ptrain peer of ``bench_training.py --wan``, run inside its namespace of the star lab.

Usage (by ``training/runner.py``)::

    python -m benchmarks.training.peer JOB_JSON

``JOB_JSON["system"]`` picks the trainer:

* ``p2ptrain_sync``: :class:`~p2ptrain.train.CollaborativeOptimizer`, step
  policy ``wait`` (the training thread waits for every step's all-reduce);
* ``p2ptrain_overlap``: the same with step policy ``carry``: the all-reduce of
  step t runs in the background while the peer computes up to
  ``carry_batches`` batches toward step t+1; the update is applied one step
  late (delayed parameter updates);
* ``p2ptrain_diloco``: :class:`~p2ptrain.train.DiLoCoOptimizer` with
  ``inner_steps`` local AdamW steps per round, overlapped rounds unless
  ``diloco_overlap`` is false (outer lr 0.35 then, as ``p2ptrain train
  --diloco-overlap``; 0.7 for synchronous rounds).

The peer is configured as ``p2ptrain train`` configures one (matchmaking
window 2 s, its progress settings, fp16 all-reduce), listening on its
namespace address with plain TCP (no NAT in the lab). The line protocol is
in ``training/model.py``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import replace
from typing import Any

from benchmarks.training.model import (
    Commands,
    Recorder,
    adamw,
    build,
    emit,
    initial_peers,
    lr_factor,
    param_groups,
    serve_after_training,
    train,
)

START_WAIT_S = 60.0  # seconds a peer waits to see every peer of the run before "ready"


def main(job: dict[str, Any]) -> None:
    from p2ptrain.allreduce.config import AllReduceConfig
    from p2ptrain.app.train import TrainingSessionConfig
    from p2ptrain.dht.node_config import DHTNodeConfig
    from p2ptrain.examples.charlm.model import loss
    from p2ptrain.lab.timings import TRAINING_MATCHMAKING
    from p2ptrain.node.config import NodeConfig
    from p2ptrain.peer import Peer, PeerConfig
    from p2ptrain.train import (
        CollaborativeOptimizer,
        DiLoCoConfig,
        DiLoCoOptimizer,
        TrainerConfig,
    )
    from p2ptrain.train.base import SwarmTrainer

    cli = TrainingSessionConfig(initial_peers=())
    peer_config = PeerConfig(
        node=NodeConfig(host=job["host"], port=0),
        dht=DHTNodeConfig(initial_peers=tuple(initial_peers(job))),
        matchmaking=replace(TRAINING_MATCHMAKING, window=cli.matchmaking_window),
        nat=None,
    )
    codec = AllReduceConfig(codec=job["compression"])
    system = job["system"]
    with Peer(peer_config) as peer:
        emit({"address": peer.address})  # first: the others join meanwhile
        model, sampler = build(job)
        inner = adamw(param_groups(model), job["lr"])
        # The start-up bandwidth probe (4 MiB each way to the initial peer) is a
        # joining cost, not a training one: let it end before "ready".
        peer.run(peer.probed(), timeout=120.0)
        trainer: SwarmTrainer
        if system == "p2ptrain_diloco":
            overlap = bool(job["diloco_overlap"])
            trainer = DiLoCoOptimizer(
                inner,
                peer=peer,
                config=DiLoCoConfig(
                    run_id=job["run_id"],
                    inner_steps=job["inner_steps"],
                    overlap=overlap,
                    outer_lr=0.35 if overlap else DiLoCoConfig.outer_lr,
                    allreduce=codec,
                    progress=cli.progress,
                ),
                model=model,
            )
        else:
            trainer = CollaborativeOptimizer(
                inner,
                peer=peer,
                config=TrainerConfig(
                    run_id=job["run_id"],
                    target_batch_size=job["target"],
                    step_policy="carry" if system == "p2ptrain_overlap" else "wait",
                    carry_batches=job["carry_batches"],
                    allreduce=codec,
                    progress=cli.progress,
                ),
                model=model,
            )
        recorder = Recorder(model, keep=job["keep"])
        commands = Commands()
        shard, shards, batch = job["shard"], job["peers"], job["batch"]

        def compute(index: int) -> None:
            for group in inner.param_groups:
                group["lr"] = job["lr"] * lr_factor(job, trainer.global_step)
            value = loss(model, sampler.batch(index, batch, shard=shard, num_shards=shards))
            value.backward()  # type: ignore[no-untyped-call]

        def counted() -> int:
            # The swarm's samples in the steps so far, read from each step's
            # all-reduce (CollaborativeOptimizer); a DiLoCo round holds
            # peers x H x batch samples.
            stats, step = trainer.stats, trainer.global_step
            if system == "p2ptrain_diloco":
                return step * job["peers"] * job["inner_steps"] * batch
            # a step applied without a count (alone, or downloaded) counts as the target
            return stats.step_samples + max(0, step - stats.steps_counted) * job["target"]

        def report() -> dict[str, Any]:
            stats = trainer.stats
            return {
                "communication_s": stats.communication_s,
                "averaging_s": stats.averaging_s,
                "waiting_s": stats.waiting_s,
                "sync_s": stats.sync_s,
                "allreduce_s": stats.allreduce_s,
                "matchmaking_s": stats.matchmaking_s,
                "bytes_sent": stats.bytes_sent,
                "rounds": stats.rounds,
                "local_rounds": stats.local_rounds,
                "syncs": stats.syncs,
                "steps_counted": stats.steps_counted,
                "step_samples": stats.step_samples,
            }

        # Every peer leaves the run on "stop" (a DiLoCo peer still in step()
        # then stops waiting for the others' round) before peer 0 evaluates.
        with trainer:
            # A peer that does not see all the others yet sizes its first group
            # without them: on a loaded machine step 0 split into two groups of
            # 2 that trained two models until a later download joined them.
            if not trainer.wait_for_peers(job["peers"], timeout=START_WAIT_S):
                logging.getLogger(__name__).warning("not every peer online at the start")
            emit({"ready": True})
            trained = train(
                recorder,
                job,
                commands,
                compute=compute,
                step=lambda: trainer.step(batch) and None,
                global_step=lambda: trainer.global_step,
                samples=counted,
                report=report,
            )
        if trained:
            serve_after_training(recorder, job, commands)


if __name__ == "__main__":
    logging.basicConfig(
        level=os.environ.get("WAN_LOG_LEVEL", "WARNING"),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    main(json.loads(sys.argv[1]))
