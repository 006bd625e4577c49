"""Error feedback: what a lossy codec drops is carried to the next step, not lost."""

from __future__ import annotations

import torch

from p2ptrain.allreduce.compression import get_codec
from p2ptrain.train.feedback import ErrorFeedback


def test_the_sum_of_what_is_sent_tracks_the_sum_of_the_gradients() -> None:
    codec = get_codec("int8", block_size=64)
    feedback = ErrorFeedback(codec, 1000)
    generator = torch.Generator().manual_seed(3)
    total_true = torch.zeros(1000)
    total_sent = torch.zeros(1000)
    total_plain = torch.zeros(1000)
    for _ in range(50):
        # a small signal under a large one: int8 blocks round the small one away
        grad = torch.randn(1000, generator=generator) * 1e-3 + 0.01
        grad[::64] = 5.0
        total_true += grad
        header, payload = codec.encode(grad.clone())
        total_plain += codec.decode(header, payload, numel=1000)
        sent = grad.clone()
        feedback.compensate(sent)
        total_sent += sent
    plain_error = (total_plain - total_true).abs().max().item()
    sent_error = (total_sent - total_true).abs().max().item()
    # With feedback the accumulated error stays one step's rounding error.
    assert sent_error <= 5.0 / 254 + 1e-4
    assert sent_error < plain_error / 10
    torch.testing.assert_close(total_true - total_sent, feedback.residual, atol=1e-4, rtol=0)
    feedback.reset()
    assert not feedback.residual.any()
