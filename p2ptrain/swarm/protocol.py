"""The pipeline's RPC messages: ``swarm.forward``, ``swarm.backward`` and ``swarm.release``.

All three are unary calls. Tensors travel as the tensor encoding of
:mod:`p2ptrain.wire.tensors` (header in the body, raw bytes as the payload)::

    swarm.forward   → {"v": 1, "run": str, "stage": int, "mb": bytes(16), "x": <header>} + x
                    ← {"y": <header>} + y
    swarm.backward  → {"v": 1, "run": str, "stage": int, "mb": bytes(16), "g": <header>,
                       "n": samples} + dL/dy
                    ← {"g": <header> | None, "seq": int, "inc", "cs", "ls", "hd", "st"} + dL/dx
                      (None: the stage input was not a floating tensor, e.g. token ids;
                      ``seq`` numbers the commit, the rest are the server's receipts,
                      :mod:`p2ptrain.swarm.ledger`)
    swarm.release   → {"v": 1, "run": str, "stage": int, "mb": bytes(16)}  ← {}

``mb`` names a micro-batch within the calling trainer (the server keys held
state by caller PeerID and ``mb``); ``n`` is the micro-batch's sample count,
which the server adds to its stage's count with the gradient, once.
Everything received is untrusted: a bad field, dtype, shape or payload size,
or a tensor over the receiver's size cap, is a
:class:`~p2ptrain.errors.RemoteProtocolError` (``invalid_argument`` on the wire).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import torch

from p2ptrain.errors import RemoteProtocolError, TensorFormatError
from p2ptrain.wire.tensors import decode_tensor, encode_tensor, parse_tensor_header

__all__ = [
    "BACKWARD_METHOD",
    "FORWARD_METHOD",
    "MB_ID_BYTES",
    "RECEIPTS_METHOD",
    "RELEASE_METHOD",
    "StageRequest",
    "decode_limited",
    "encode_for_wire",
    "parse_request",
]

FORWARD_METHOD: Final = "swarm.forward"
BACKWARD_METHOD: Final = "swarm.backward"
RELEASE_METHOD: Final = "swarm.release"
RECEIPTS_METHOD: Final = "swarm.receipts"
"""``{"inc": str}`` → the receipts of that incarnation (:mod:`p2ptrain.swarm.ledger`),
or ``{"unknown": true}`` when the server has no such incarnation (it restarted).
``{"inc", "peer": str, "stage": int, "step": int}`` asks instead whether this
server's stage step ``step`` counted the samples of ``peer`` (a stage peer that
vanished): ``{"counted": bool | None, "at": int}`` (``None``: it cannot say;
``at``: the steps it applied, -1 when it does not serve ``stage``)."""
VERSION: Final = 1
MB_ID_BYTES: Final = 16
_MAX_SAMPLES: Final = 1 << 40

WIRE_TORCH_DTYPES: Final = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class StageRequest:
    """A parsed forward, backward or release request."""

    run: str
    stage: int
    mb: bytes
    tensor: torch.Tensor | None
    samples: int


def encode_for_wire(tensor: torch.Tensor, wire_dtype: str) -> tuple[dict[str, Any], memoryview]:
    """Encode ``tensor``; a floating tensor is cast to ``wire_dtype`` first (16-bit on request)."""
    if tensor.is_floating_point():
        tensor = tensor.detach().to(WIRE_TORCH_DTYPES[wire_dtype])
    return encode_tensor(tensor)


def decode_limited(
    header: object, payload: bytes | bytearray | memoryview, *, max_bytes: int
) -> torch.Tensor:
    """Decode a received tensor, refusing one over ``max_bytes`` before touching its payload.

    Floating tensors come back as float32 whatever their wire dtype.

    Raises:
        TensorFormatError: Malformed header, wrong payload size, or too large.
    """
    spec = parse_tensor_header(header)
    if spec.nbytes > max_bytes:
        raise TensorFormatError(f"a tensor of {spec.nbytes} bytes is over the {max_bytes}-byte cap")
    tensor = decode_tensor(header, payload)
    if tensor.is_floating_point():
        tensor = tensor.float()
        if not bool(torch.isfinite(tensor).all()):
            raise TensorFormatError("a tensor holds NaN or infinite values")
    return tensor


def request_body(
    run: str, stage: int, mb: bytes, header: dict[str, Any] | None = None, **extra: Any
) -> dict[str, Any]:
    """The body of a request (``header`` under ``x`` or ``g`` as ``extra`` says)."""
    body: dict[str, Any] = {"v": VERSION, "run": run, "stage": stage, "mb": mb}
    body.update(extra)
    return body


def parse_request(
    body: object,
    payload: bytes | bytearray | memoryview,
    *,
    tensor_key: str | None,
    max_bytes: int,
) -> StageRequest:
    """Check a request's fields and decode its tensor (under ``tensor_key``, if any).

    Raises:
        RemoteProtocolError: A field is missing or malformed.
        TensorFormatError: The tensor is malformed or over ``max_bytes``.
    """
    if not isinstance(body, dict) or body.get("v") != VERSION:
        raise RemoteProtocolError(f"expected a version-{VERSION} pipeline request")
    run, stage, mb = body.get("run"), body.get("stage"), body.get("mb")
    if not isinstance(run, str):
        raise RemoteProtocolError("a pipeline request's run must be a string")
    if isinstance(stage, bool) or not isinstance(stage, int) or stage < 0:
        raise RemoteProtocolError("a pipeline request's stage must be an int >= 0")
    if not isinstance(mb, bytes) or len(mb) != MB_ID_BYTES:
        raise RemoteProtocolError(f"a micro-batch id is {MB_ID_BYTES} bytes")
    samples = body.get("n", 0)
    if isinstance(samples, bool) or not isinstance(samples, int) or not 0 <= samples < _MAX_SAMPLES:
        raise RemoteProtocolError("a micro-batch's sample count must be an int >= 0")
    tensor = None
    if tensor_key is not None:
        tensor = decode_limited(body.get(tensor_key), payload, max_bytes=max_bytes)
    return StageRequest(run=run, stage=stage, mb=mb, tensor=tensor, samples=samples)
