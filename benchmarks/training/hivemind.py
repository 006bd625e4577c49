"""One hivemind.Optimizer peer of ``bench_training.py --wan`` (run by hivemind's interpreter).

Usage (by ``training/runner.py``, inside the peer's namespace)::

    HIVEMIND_PYTHON benchmarks/training/hivemind.py JOB_JSON

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
import sys
from typing import Any

import torch

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


def main(job: dict[str, Any]) -> None:
    import hivemind
    from hivemind.compression import Float16Compression

    from p2ptrain.examples.charlm.model import loss

    model, sampler = build(job)
    dht = hivemind.DHT(
        start=True,
        host_maddrs=[f"/ip4/{job['host']}/tcp/0"],
        initial_peers=initial_peers(job) or None,
    )
    emit({"address": [str(a) for a in dht.get_visible_maddrs()]})
    lr = job["lr"]
    opt = hivemind.Optimizer(
        dht=dht,
        run_id=job["run_id"],
        target_batch_size=job["target"],
        batch_size_per_step=job["batch"],
        params=param_groups(model),
        optimizer=lambda groups: adamw(groups, lr),
        scheduler=lambda inner: torch.optim.lr_scheduler.LambdaLR(
            inner, lambda epoch: lr_factor(job, epoch)
        ),
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

    def applied() -> int:
        # An epoch's update is applied in the background and installed by a
        # later step(); the step that opens epoch e first waits for the update
        # of epoch e - 1 (hivemind's _update_global_epoch). So when local_epoch
        # reads e, e - 1 updates are in the parameters: the global step
        # comparable to p2ptrain's (updates applied).
        return max(0, opt.local_epoch - 1)

    try:
        emit({"ready": True})
        trained = train(
            recorder,
            job,
            commands,
            compute=compute,
            step=step,
            global_step=applied,
            samples=lambda: applied() * job["target"],  # an epoch holds about the target
            report=dict,
        )
        if trained:
            serve_after_training(recorder, job, commands)
    finally:
        opt.shutdown()
        dht.shutdown()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
