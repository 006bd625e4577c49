"""One hivemind.Optimizer peer of ``bench_training.py --wan`` (run by hivemind's interpreter).

Usage (by ``_training_wan.py``, inside the peer's namespace)::

    /opt/hivemind-venv/bin/python benchmarks/_training_wan_hivemind.py JOB_JSON

The same model, seed, data shard, local batch, AdamW and target batch as the
p2ptrain peers, trained with ``hivemind.Optimizer`` configured as its
configuration guide (the class docstring, hivemind 1.1.12) recommends for
this case:

* ``offload_optimizer=True``, ``delay_optimizer_step=True``,
  ``delay_grad_averaging=True``: delayed parameter updates (the optimizer
  step and the gradient all-reduce of epoch t run in the background while
  the peer computes epoch t+1);
* ``grad_compression`` and ``state_averaging_compression`` =
  ``Float16Compression()`` (the p2ptrain peers send fp16 too);
* ``matchmaking_time`` from the job (the guide: 3-5 s for small runs,
  10-15 s over the internet; the benchmark's default 3 s is the most
  favourable to these short steps), ``averaging_timeout`` from the job
  ("about 2x the actual time it takes to run all-reduce");
* everything else at hivemind's defaults (``average_state_every=1``: the
  parameters are averaged in the background after every epoch).

The DHT listens on the namespace address; its p2p daemon carries every byte.
Nothing of p2ptrain but the charlm example model is imported.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

if not __package__:  # run as a script: make the benchmarks package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._training_wan_model import (
    Commands,
    Recorder,
    build,
    emit,
    param_groups,
    serve_after_training,
    train,
)


def main(job: dict[str, Any]) -> None:
    import hivemind
    from hivemind.compression import Float16Compression

    from p2ptrain.examples.charlm.model import loss

    model, sampler = build(job)
    dht = hivemind.DHT(
        start=True,
        host_maddrs=[f"/ip4/{job['host']}/tcp/0"],
        initial_peers=job["initial_peers"] or None,
    )
    emit({"address": [str(a) for a in dht.get_visible_maddrs()]})
    lr = job["lr"]
    opt = hivemind.Optimizer(
        dht=dht,
        run_id=job["run_id"],
        target_batch_size=job["target"],
        batch_size_per_step=job["batch"],
        params=param_groups(model),
        optimizer=lambda groups: torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.99)),
        offload_optimizer=True,
        delay_optimizer_step=True,
        delay_grad_averaging=True,
        grad_compression=Float16Compression(),
        state_averaging_compression=Float16Compression(),
        matchmaking_time=job["matchmaking_time"],
        averaging_timeout=job["averaging_timeout"],
        verbose=False,
    )
    recorder = Recorder(model, keep=job["keep"])
    commands = Commands()
    shard, shards, batch = job["shard"], job["peers"], job["batch"]

    def compute(index: int) -> None:
        loss(model, sampler.batch(index, batch, shard=shard, num_shards=shards)).backward()

    def step() -> None:
        opt.step()
        opt.zero_grad()

    def report() -> dict[str, Any]:
        # The last epoch's update may still run in the background: wait for it
        # (counted as blocked) so that the final parameters include it.
        tic = recorder.since_go()
        opt.state_averager.step(wait_for_delayed_updates=True, apply_delayed_updates=True)
        recorder.blocked_s += recorder.since_go() - tic
        if recorder.keep:
            with torch.no_grad():
                params = [p.detach().clone() for p in model.parameters()]
            recorder.snapshots.append((opt.local_epoch, recorder.since_go(), params))
        return {}

    try:
        emit({"ready": True})
        trained = train(
            recorder,
            job,
            commands,
            compute=compute,
            step=step,
            global_step=lambda: opt.local_epoch,
            report=report,
        )
        if trained:
            serve_after_training(recorder, job, commands)
    finally:
        opt.shutdown()
        dht.shutdown()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
