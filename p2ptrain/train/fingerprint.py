"""Digests that tell whether two peers train the same model (pure, no I/O).

* :func:`model_digest` covers the parameters' shapes and dtypes, in order:
  every peer of a run must have the same one, or their all-reduces would
  mix vectors of different layouts. Progress records carry it, and a peer
  whose digest differs from its run's refuses to start
  (:class:`~p2ptrain.errors.RunMismatchError`).
* :func:`parameters_digest` covers the values too: two peers that applied
  the same steps from the same start have the same one (tests and the
  command line's ``--log-digest`` compare them).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

__all__ = ["model_digest", "parameters_digest"]

_DIGEST_CHARS = 16  # 64 bits of SHA-256, in hex: enough to tell models apart


def model_digest(params: Sequence[torch.Tensor]) -> str:
    """A short hex digest of the parameters' shapes and dtypes, in order."""
    layout = ";".join(f"{tuple(p.shape)}:{p.dtype}" for p in params)
    return hashlib.sha256(layout.encode()).hexdigest()[:_DIGEST_CHARS]


def parameters_digest(params: Sequence[torch.Tensor]) -> str:
    """SHA-256 (hex) of the parameters' layout and values (one pass over the model)."""
    digest = hashlib.sha256(model_digest(params).encode())
    with torch.no_grad():
        for p in params:
            host = p.detach().to("cpu").contiguous().reshape(-1)
            digest.update(host.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
