"""Error feedback for lossy gradient codecs (pure, no I/O).

A lossy codec (``int8``, ``fp16``, ``bf16``) loses a little of every
gradient it sends. With error feedback (Seide et al., 2014; Karimireddy et
al., 2019) a peer adds what it lost last time to this step's gradient before
sending it, so that what is lost is only delayed, never dropped:

    v = g + e;   q = decode(encode(v));   send q;   e = v − q

The peer applies the codec itself, so the all-reduce's own encoding of ``q``
loses (almost) nothing more; the averages the reducers send back are
encoded once more, without feedback.
"""

from __future__ import annotations

import torch

from p2ptrain.allreduce.compression import Codec

__all__ = ["ErrorFeedback"]


class ErrorFeedback:
    """Carries one codec's rounding error from step to step.

    Args:
        codec: The all-reduce's codec.
        numel: Elements of the vectors compensated.
    """

    def __init__(self, codec: Codec, numel: int) -> None:
        self.codec = codec
        self.residual = torch.zeros(numel, dtype=torch.float32)

    def compensate(self, values: torch.Tensor) -> None:
        """Replace ``values`` (flat float32, CPU) by what the codec keeps of
        ``values + residual``, and remember the difference."""
        values.add_(self.residual)
        header, payload = self.codec.encode(values)
        kept = self.codec.decode(header, payload, numel=values.numel())
        torch.sub(values, kept, out=self.residual)
        values.copy_(kept)

    def reset(self) -> None:
        """Forget the carried error (e.g. after installing a downloaded state)."""
        self.residual.zero_()
