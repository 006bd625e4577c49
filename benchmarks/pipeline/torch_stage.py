"""One stage process of the ``torch.distributed.pipelining`` baseline (gloo, CPU).

    python benchmarks/pipeline/torch_stage.py --rank R --port P --steps N [model flags]

Rank ``r`` holds stage ``r`` of :mod:`benchmarks.pipeline.model`; the world
size is the number of stages. Every step runs the chosen schedule over the
step's micro-batches and an SGD step on the stage. The first and the last rank
print one JSON line per step: ``{"rank", "step", "time", "loss"}`` (the loss
only on the last rank, the mean over the micro-batches).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from benchmarks.pipeline.model import PipelineModel, batch, stage_module


def model_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of :class:`PipelineModel` (shared by the workers)."""
    defaults = PipelineModel()
    for name in ("width", "depth", "stages", "batch", "microbatches", "seed"):
        parser.add_argument(f"--{name}", type=int, default=getattr(defaults, name), help=name)
    parser.add_argument("--lr", type=float, default=defaults.lr, help="SGD learning rate")


def model_from(args: argparse.Namespace) -> PipelineModel:
    """The workload the flags describe."""
    return PipelineModel(
        width=args.width,
        depth=args.depth,
        stages=args.stages,
        batch=args.batch,
        microbatches=args.microbatches,
        lr=args.lr,
        seed=args.seed,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rank", type=int, required=True, help="this process's stage")
    parser.add_argument("--port", type=int, required=True, help="rendezvous port on 127.0.0.1")
    parser.add_argument("--steps", type=int, default=20, help="steps to run")
    parser.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b", help="schedule")
    model_flags(parser)
    args = parser.parse_args()
    model = model_from(args)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=args.rank,
        world_size=model.stages,
    )
    module = stage_module(model, args.rank)
    stage = PipelineStage(module, args.rank, model.stages, torch.device("cpu"))
    kind = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
    schedule = kind(stage, model.microbatches, loss_fn=torch.nn.functional.mse_loss)
    optimizer = torch.optim.SGD(module.parameters(), lr=model.lr)
    last = args.rank == model.stages - 1
    for step in range(args.steps):
        x, y = batch(model, step)
        optimizer.zero_grad()
        losses: list[torch.Tensor] = []
        if args.rank == 0:
            schedule.step(x)
        elif last:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        optimizer.step()
        if args.rank == 0 or last:
            line: dict[str, object] = {"rank": args.rank, "step": step, "time": time.time()}
            if last:
                line["loss"] = float(torch.stack(losses).mean())
            print(json.dumps(line), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
