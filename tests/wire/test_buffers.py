"""The receive-buffer pool never hands out memory that is still referenced."""

from __future__ import annotations

import gc

import torch

from p2ptrain.wire.buffers import BufferPool


def test_a_buffer_returns_only_when_every_reference_is_gone() -> None:
    pool = BufferPool()
    first = pool.get(1 << 20)
    tensor = torch.frombuffer(first, dtype=torch.float32)
    tensor.fill_(7.0)
    del first
    gc.collect()
    assert pool.idle_bytes == 0  # the tensor still uses it
    second = pool.get(1 << 20)  # so this must be fresh memory
    torch.frombuffer(second, dtype=torch.float32).fill_(-1.0)
    assert bool((tensor == 7.0).all())
    del tensor
    gc.collect()
    assert pool.idle_bytes == 1 << 20
    third = pool.get(1000 * 1000)  # same size class: reused
    assert pool.reused == 1 and third.nbytes == 1000 * 1000 and not third.readonly


def test_idle_memory_is_bounded() -> None:
    pool = BufferPool(max_idle_bytes=2 << 20)
    buffers = [pool.get(1 << 20) for _ in range(5)]
    del buffers
    gc.collect()
    assert pool.idle_bytes == 2 << 20
