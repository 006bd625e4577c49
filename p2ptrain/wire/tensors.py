"""Tensors on the wire: a small msgpack-able header plus the raw element bytes.

A tensor is sent as a header dict ``{"d": dtype, "s": shape, "o": byte order}``
and a payload holding exactly ``numel * itemsize`` bytes in row-major order.
No pickle is involved anywhere; docs/tensor-encoding.md specifies the format.

Copies are avoided where the buffers allow it:

* :func:`encode_tensor` returns a read-only memoryview over the tensor's own
  storage (contiguous CPU tensors), which keeps that storage alive. Other
  tensors are first made contiguous / moved to the CPU, one copy.
* :func:`decode_tensor` wraps a writable, suitably aligned payload (a
  ``bytearray`` or a writable memoryview) without copying; read-only
  (``bytes``), misaligned or byte-swapped payloads cost exactly one copy.

Everything in a header or payload is treated as untrusted: any violation
raises :class:`~p2ptrain.errors.TensorFormatError` and nothing else.
"""

from __future__ import annotations

import math
import reprlib
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final, Literal

import numpy as np
import torch

from p2ptrain.errors import ConfigError, LocalProtocolError, TensorFormatError

__all__ = [
    "KEY_BYTE_ORDER",
    "KEY_DTYPE",
    "KEY_SHAPE",
    "MAX_DIMS",
    "WIRE_DTYPES",
    "TensorSpec",
    "decode_tensor",
    "empty_tensor",
    "encode_tensor",
    "parse_tensor_header",
    "short_repr",
    "tensor_nbytes",
]

KEY_DTYPE: Final = "d"
"""Header key of the dtype name (a string from :data:`WIRE_DTYPES`)."""
KEY_SHAPE: Final = "s"
"""Header key of the shape (a list of non-negative ints)."""
KEY_BYTE_ORDER: Final = "o"
"""Header key of the byte order (``"<"`` little-endian or ``">"`` big-endian)."""

MAX_DIMS: Final = 32
"""Largest number of dimensions a decoded header may declare."""

_MAX_INDEX: Final = 2**63 - 1  # torch sizes, strides and numel are int64

WIRE_DTYPES: Final[Mapping[str, torch.dtype]] = MappingProxyType(
    {
        "float32": torch.float32,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "float64": torch.float64,
        "int8": torch.int8,
        "uint8": torch.uint8,
        "int16": torch.int16,
        "int32": torch.int32,
        "int64": torch.int64,
        "bool": torch.bool,
    }
)
"""The fixed table of wire dtype names. Names are stable protocol constants."""

_WIRE_NAMES: Final[dict[torch.dtype, str]] = {dtype: name for name, dtype in WIRE_DTYPES.items()}
_HEADER_KEYS: Final = frozenset({KEY_DTYPE, KEY_SHAPE, KEY_BYTE_ORDER})
_NATIVE_ORDER: Final[Literal["<", ">"]] = "<" if sys.byteorder == "little" else ">"
_FOREIGN_ORDER: Final = ">" if _NATIVE_ORDER == "<" else "<"
_WIRE_ORDER: Final = "<"  # what we send, whatever the host


class _BoundedRepr(reprlib.Repr):
    """reprlib, minus the ValueError ``repr`` raises for ints of over 4300 digits."""

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 64:
            return f"<{x.bit_length()}-bit int>"
        return super().repr_int(x, level)


_BOUNDED_REPR = _BoundedRepr()
_BOUNDED_REPR.maxstring = 40
_BOUNDED_REPR.maxother = 40
_BOUNDED_REPR.maxlist = 4
_BOUNDED_REPR.maxtuple = 4
_BOUNDED_REPR.maxdict = 4


def short_repr(value: object) -> str:
    """Return a short repr of an untrusted value, for error messages.

    The result is bounded in length and computing it cannot raise, even
    for huge ints or deeply nested containers.
    """
    return _BOUNDED_REPR.repr(value)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A validated tensor header.

    Attributes:
        dtype: The element type.
        shape: The dimensions, each non-negative.
        byte_order: ``"<"`` (little-endian) or ``">"`` (big-endian) payload bytes.
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    byte_order: Literal["<", ">"] = "<"

    @property
    def numel(self) -> int:
        """Number of elements (1 for a 0-d tensor)."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Exact payload length in bytes."""
        return self.numel * self.dtype.itemsize

    def to_header(self) -> dict[str, Any]:
        """Return the msgpack-able header dict for this spec."""
        return {
            KEY_DTYPE: _WIRE_NAMES[self.dtype],
            KEY_SHAPE: list(self.shape),
            KEY_BYTE_ORDER: self.byte_order,
        }


def parse_tensor_header(header: object, *, max_elements: int | None = None) -> TensorSpec:
    """Validate a tensor header received from the network.

    Args:
        header: The decoded header; must be a mapping with exactly the keys
            ``"d"``, ``"s"`` and ``"o"``.
        max_elements: If given, reject headers declaring more elements.

    Returns:
        The validated spec.

    Raises:
        TensorFormatError: The header is malformed (wrong type, unknown or
            missing key, unknown dtype, bad shape, too many elements).
        ConfigError: ``max_elements`` is not a non-negative int.
    """
    limit = _check_limit(max_elements)
    if not isinstance(header, Mapping):
        raise TensorFormatError(f"tensor header must be a map, got {type(header).__name__}")
    keys = set(header)
    if keys != _HEADER_KEYS:
        extra = sorted(map(short_repr, keys - _HEADER_KEYS))
        missing = sorted(_HEADER_KEYS - keys)
        raise TensorFormatError(
            f"tensor header keys must be exactly {sorted(_HEADER_KEYS)}: "
            f"missing {missing}, unexpected {extra}"
        )
    name = header[KEY_DTYPE]
    dtype = WIRE_DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise TensorFormatError(f"unknown tensor dtype {short_repr(name)}")
    order = header[KEY_BYTE_ORDER]
    if not isinstance(order, str) or order not in ("<", ">"):
        raise TensorFormatError(f"byte order must be '<' or '>', got {short_repr(order)}")
    shape = _parse_shape(header[KEY_SHAPE])
    spec = TensorSpec(dtype, shape, "<" if order == "<" else ">")
    if limit is not None and spec.numel > limit:
        raise TensorFormatError(f"tensor has {spec.numel} elements, more than the limit {limit}")
    return spec


def tensor_nbytes(header: object, *, max_elements: int | None = None) -> int:
    """Return the exact payload length a tensor header announces.

    Lets a framing layer size (or refuse) the payload before buffering it.

    Args:
        header: The header as received; validated like :func:`parse_tensor_header`.
        max_elements: If given, reject headers declaring more elements.

    Raises:
        TensorFormatError: The header is malformed.
    """
    return parse_tensor_header(header, max_elements=max_elements).nbytes


def encode_tensor(tensor: torch.Tensor) -> tuple[dict[str, Any], memoryview]:
    """Describe a tensor for the wire without copying its data where possible.

    A contiguous CPU tensor is not copied: the returned memoryview is a
    read-only view of its storage and keeps that storage alive, so later
    in-place changes to the tensor show through until the bytes are sent.
    A non-contiguous tensor is made contiguous, and a tensor on another
    device is copied to the CPU (one copy either way). Gradients are not
    tracked. The payload is little-endian (swapped, with one copy, on a
    big-endian host).

    Args:
        tensor: A strided tensor of a dtype in :data:`WIRE_DTYPES`.

    Returns:
        The header dict and a 1-D unsigned-byte memoryview of the payload.

    Raises:
        LocalProtocolError: The tensor is not a tensor, is sparse or on the
            ``meta`` device, or has a dtype with no wire name.
    """
    if not isinstance(tensor, torch.Tensor):
        raise LocalProtocolError(f"cannot encode {type(tensor).__name__} as a tensor")
    if tensor.layout != torch.strided:
        raise LocalProtocolError(f"cannot encode a tensor with layout {tensor.layout}")
    if tensor.device.type == "meta":
        raise LocalProtocolError("cannot encode a meta tensor: it has no data")
    name = _WIRE_NAMES.get(tensor.dtype)
    if name is None:
        raise LocalProtocolError(f"dtype {tensor.dtype} has no wire encoding")
    data = tensor.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    data = data.resolve_conj().resolve_neg().contiguous()  # no-ops unless needed
    raw = data.reshape(-1).view(torch.uint8)
    itemsize = data.dtype.itemsize
    if _NATIVE_ORDER != _WIRE_ORDER and itemsize > 1:
        raw = raw.view(-1, itemsize).flip(1).reshape(-1)
    header = {KEY_DTYPE: name, KEY_SHAPE: list(data.shape), KEY_BYTE_ORDER: _WIRE_ORDER}
    # The ndarray holds a reference to ``raw``, which holds the storage.
    return header, raw.numpy().data.toreadonly()


def decode_tensor(
    header: object,
    payload: bytes | bytearray | memoryview,
    *,
    max_elements: int | None = None,
) -> torch.Tensor:
    """Rebuild a tensor from a header and payload received from the network.

    A writable payload (``bytearray``, writable memoryview) whose address
    suits the dtype is shared, not copied: the tensor then aliases it and
    keeps it alive (a shared ``bytearray`` cannot be resized meanwhile).
    Read-only, misaligned or big-endian payloads are copied once. The
    result is always a native-endian CPU tensor of the declared dtype and
    shape.

    Args:
        header: The received header, see :func:`parse_tensor_header`.
        payload: Exactly ``numel * itemsize`` bytes.
        max_elements: If given, reject headers declaring more elements.

    Returns:
        The decoded tensor.

    Raises:
        TensorFormatError: The header is malformed, the payload length
            differs from what the header announces, or a ``bool`` payload
            holds a byte other than 0 or 1.
        ConfigError: ``max_elements`` is not a non-negative int.
    """
    spec = parse_tensor_header(header, max_elements=max_elements)
    view = _byte_view(payload)
    if view.nbytes != spec.nbytes:
        raise TensorFormatError(
            f"tensor payload is {view.nbytes} bytes, header announces {spec.nbytes} "
            f"({spec.numel} x {_WIRE_NAMES[spec.dtype]})"
        )
    if spec.numel == 0:
        return torch.empty(spec.shape, dtype=spec.dtype)
    itemsize = spec.dtype.itemsize
    if itemsize > 1 and spec.byte_order != _NATIVE_ORDER:
        raw = _swapped_copy(view, itemsize)
    elif view.readonly:
        raw = _plain_copy(view)
    else:
        raw = torch.frombuffer(view, dtype=torch.uint8)  # shares the payload
    if raw.data_ptr() % itemsize:
        raw = _plain_copy(view)
        if raw.data_ptr() % itemsize:  # pragma: no cover - numpy aligns to 16 bytes
            raw = raw.clone()
    if spec.dtype == torch.bool and bool((raw > 1).any()):
        raise TensorFormatError("bool tensor payload holds a byte other than 0 or 1")
    return raw.view(spec.dtype).view(spec.shape)


def empty_tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Allocate an uninitialised CPU tensor through numpy's allocator.

    For large buffers numpy asks the kernel for transparent huge pages, so
    the first write to a fresh multi-megabyte buffer costs far fewer page
    faults than with torch's allocator (about twice the throughput for a
    64 MB conversion here). Use it for big per-message buffers.

    Args:
        shape: The dimensions.
        dtype: Any dtype in :data:`WIRE_DTYPES`.
    """
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    flat = torch.from_numpy(np.empty(numel * dtype.itemsize, dtype=np.uint8))
    return flat.view(dtype).view(tuple(shape))


def _check_limit(max_elements: int | None) -> int | None:
    if max_elements is None:
        return None
    if isinstance(max_elements, bool) or not isinstance(max_elements, int) or max_elements < 0:
        raise ConfigError(
            f"max_elements must be a non-negative int, got {short_repr(max_elements)}"
        )
    return max_elements


def _parse_shape(value: object) -> tuple[int, ...]:
    if not isinstance(value, list | tuple):
        raise TensorFormatError(f"tensor shape must be a list, got {type(value).__name__}")
    if len(value) > MAX_DIMS:
        raise TensorFormatError(f"tensor has {len(value)} dimensions, more than {MAX_DIMS}")
    extent = 1  # product with zero sizes counted as one: bounds every stride
    for dim in value:
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TensorFormatError(f"tensor shape entries must be ints, got {short_repr(dim)}")
        if dim < 0:
            raise TensorFormatError(
                f"tensor shape entries must be non-negative, got {short_repr(dim)}"
            )
        extent *= max(dim, 1)
        if extent > _MAX_INDEX:
            raise TensorFormatError(f"tensor shape {short_repr(value)} is too large")
    return tuple(int(dim) for dim in value)


def _byte_view(payload: bytes | bytearray | memoryview) -> memoryview:
    """A flat unsigned-byte view of ``payload``, copying only if it is not contiguous."""
    view = memoryview(payload)
    if view.format == "B" and view.ndim == 1 and view.c_contiguous:
        return view
    if view.c_contiguous:
        try:
            return view.cast("B")
        except TypeError:  # formats cast() cannot reinterpret, e.g. structs
            pass
    return memoryview(view.tobytes())


def _plain_copy(view: memoryview) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(view, dtype=np.uint8).copy())


def _swapped_copy(view: memoryview, itemsize: int) -> torch.Tensor:
    """Copy ``view`` into a fresh tensor, reversing the bytes of every element."""
    foreign = np.frombuffer(view, dtype=np.dtype(f"{_FOREIGN_ORDER}u{itemsize}"))
    native = foreign.astype(np.dtype(f"{_NATIVE_ORDER}u{itemsize}"))
    return torch.from_numpy(native.view(np.uint8))
