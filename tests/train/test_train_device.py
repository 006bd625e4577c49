"""Trainers whose parameters live on an accelerator (CUDA where this machine has one).

The CUDA test is the only test of the suite skipped where the hardware is
missing; the reason is printed. The CPU checks of the staging helper run
everywhere.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn
from train_worker import FAST_PROGRESS, peer_config

from p2ptrain.errors import ConfigError
from p2ptrain.peer import Peer
from p2ptrain.train import CollaborativeOptimizer, DiLoCoConfig, DiLoCoOptimizer, TrainerConfig
from p2ptrain.train.staging import HostStaging, parameters_device

CUDA = torch.cuda.is_available()


def test_staging_on_the_cpu_copies_nothing_and_mixed_devices_are_refused() -> None:
    staging = HostStaging(4, torch.device("cpu"))
    vector = torch.arange(4.0)
    assert staging.to_host(vector) is vector
    like = torch.zeros(2, dtype=torch.float16)
    assert staging.to_device(vector[:2], like).dtype == torch.float16
    with pytest.raises(ConfigError):
        parameters_device([torch.zeros(1), torch.zeros(1, device="meta")])


@pytest.fixture
def peer() -> Iterator[Peer]:
    with Peer(peer_config()) as started:
        yield started


@pytest.mark.skipif(
    not CUDA, reason="no CUDA device on this machine (torch.cuda.is_available() is False)"
)
def test_a_cuda_model_takes_collaborative_and_diloco_steps(peer: Peer) -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = nn.Linear(5, 2).to(device)
    reference = nn.Linear(5, 2)
    reference.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
    config = TrainerConfig(run_id="cuda", target_batch_size=4, progress=FAST_PROGRESS)
    x = torch.randn(4, 5)
    with CollaborativeOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), peer=peer, config=config, model=model
    ) as opt:
        model(x.to(device)).pow(2).mean().backward()  # type: ignore[no-untyped-call]
        assert opt.step(4) is True and opt.global_step == 1
    assert all(p.device.type == "cuda" for p in model.parameters())
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference(x).pow(2).mean().backward()  # type: ignore[no-untyped-call]
    reference_opt.step()
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine.cpu(), theirs, rtol=1e-5, atol=1e-6)
    diloco = DiLoCoOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        peer=peer,
        config=DiLoCoConfig(run_id="cuda-diloco", inner_steps=2, progress=FAST_PROGRESS),
    )
    with diloco:
        for _ in range(2):
            model(x.to(device)).pow(2).mean().backward()  # type: ignore[no-untyped-call]
            diloco.step(4)
        assert diloco.global_step == 1
    assert all(p.device.type == "cuda" for p in model.parameters())
