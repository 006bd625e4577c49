"""A plain torch training loop on a collaborative optimizer.

Run alone (a swarm of one, to try it) or join a run::

    python examples/plain_loop.py --steps 5
    python examples/plain_loop.py --join PEERID@HOST:PORT --steps 50

The collaborative optimizer is a ``torch.optim.Optimizer``: a learning-rate
scheduler and ``torch.amp.GradScaler`` drive it exactly as they would drive
AdamW, and autocast gives mixed precision. It applies an update whenever the
swarm as a whole has accumulated ``--target-batch-size`` samples, averaged
over every peer that took part.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from p2ptrain.dht import DHTNodeConfig
from p2ptrain.peer import Peer, PeerConfig
from p2ptrain.train import CollaborativeOptimizer, TrainerConfig


def regression_batch(generator: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy samples of y = x @ w for a fixed w (every peer learns the same target)."""
    weights = torch.linspace(-1.0, 1.0, 16).unsqueeze(1)
    x = torch.randn(size, 16, generator=generator)
    return x, x @ weights + 0.01 * torch.randn(size, 1, generator=generator)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--join", action="append", default=[], help="PEERID@HOST:PORT of a peer")
    parser.add_argument("--run-id", default="plain-loop", help="the run to join")
    parser.add_argument("--steps", type=int, default=20, help="global steps to train")
    parser.add_argument("--batch-size", type=int, default=32, help="this peer's local batch")
    parser.add_argument("--target-batch-size", type=int, default=64, help="samples per step")
    args = parser.parse_args()

    torch.manual_seed(0)  # every peer starts from the same parameters
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device_type)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    config = PeerConfig(dht=DHTNodeConfig(initial_peers=tuple(args.join)))
    run = TrainerConfig(run_id=args.run_id, target_batch_size=args.target_batch_size)
    generator = torch.Generator().manual_seed(torch.seed())  # this peer's own data
    with (
        Peer(config) as peer,
        CollaborativeOptimizer(
            inner, peer=peer, config=run, model=model, batch_size=args.batch_size
        ) as opt,
    ):
        print(f"peer {peer.address}: others join with --join {peer.address}")
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
        scaler = torch.amp.GradScaler(device_type)
        opt.register_state("scheduler", scheduler)  # travels in checkpoints and downloads
        opt.register_state("scaler", scaler)
        while opt.global_step < args.steps:
            x, y = (t.to(device_type) for t in regression_batch(generator, args.batch_size))
            with torch.autocast(device_type, dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            before = opt.global_step
            scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
            scaler.step(opt)  # unscales, then opt.step(): counts the batch toward the swarm's
            scaler.update()
            opt.zero_grad()
            if opt.global_step > before:
                scheduler.step()
                lr = opt.param_groups[0]["lr"]
                print(f"global step {opt.global_step}: loss {loss.item():.4f}, lr {lr:.2e}")


if __name__ == "__main__":
    main()
