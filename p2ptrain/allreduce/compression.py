"""What the all-reduce sends: codecs for flat float32 tensors.

Each part of an all-reduce round is a 1-D float32 tensor. A :class:`Codec`
turns it into a small msgpack-able header plus a payload, and back:

======  =========================================  ==================================
name    payload                                    max abs error (m = max finite |x|)
======  =========================================  ==================================
none    float32 values                             0
fp16    float16 values, finite inputs saturated    max(2^-11·m, 2^-25, m - 65504)
bf16    bfloat16 values, finite inputs saturated   max(2^-8·m, 2^-134, m - bf16 max)
int8    float32 scale per block, then int8 values  m/254, plus float32 rounding slack
======  =========================================  ==================================

Non-finite inputs stay detectable after a round trip: fp16, bf16 and none
keep NaN and ±Inf as they are; int8 turns every block that holds a NaN or
±Inf into a block of NaN (without disturbing the other blocks). The
all-reduce checks for non-finite values before encoding and after decoding.

Decoders treat the header and payload as untrusted and raise
:class:`~p2ptrain.errors.TensorFormatError` on any violation. The byte
layout is specified in docs/tensor-encoding.md.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping
from typing import Any, ClassVar, Final

import torch

from p2ptrain.errors import ConfigError, LocalProtocolError, TensorFormatError
from p2ptrain.wire.tensors import (
    KEY_BYTE_ORDER,
    KEY_DTYPE,
    KEY_SHAPE,
    decode_tensor,
    empty_tensor,
    encode_tensor,
    short_repr,
)

__all__ = [
    "CODEC_NAMES",
    "DEFAULT_BLOCK_SIZE",
    "KEY_BLOCK_SIZE",
    "KEY_CODEC",
    "KEY_NUMEL",
    "MAX_BLOCK_SIZE",
    "BFloat16Codec",
    "Codec",
    "Float16Codec",
    "Int8BlockCodec",
    "NoneCodec",
    "get_codec",
    "register_codec",
]

KEY_CODEC: Final = "c"
"""Header key of the codec name."""
KEY_NUMEL: Final = "n"
"""Header key of the number of float32 elements encoded."""
KEY_BLOCK_SIZE: Final = "b"
"""Header key of the int8 block size (int8 only)."""

DEFAULT_BLOCK_SIZE: Final = 1024
"""Elements per int8 block (one float32 scale each) unless configured."""
MAX_BLOCK_SIZE: Final = 1 << 24
"""Largest int8 block size a header may declare or a codec may use."""

_CHUNK_ELEMENTS = 1 << 18  # int8 works in chunks of about this size: temps stay in cache
_FLOAT32_TINY: Final = float(torch.finfo(torch.float32).tiny)  # smallest normal, 2^-126


class Codec(abc.ABC):
    """Encodes a 1-D float32 tensor for the wire and decodes it back.

    Codecs are stateless apart from their configuration and safe to share.
    """

    name: ClassVar[str]
    """The codec's wire name, also its ``"c"`` header value."""

    @abc.abstractmethod
    def compressed_nbytes(self, numel: int) -> int:
        """Return the payload length for ``numel`` elements.

        Raises:
            ConfigError: ``numel`` is not a non-negative int.
        """

    @abc.abstractmethod
    def encode(self, tensor: torch.Tensor) -> tuple[dict[str, Any], memoryview]:
        """Encode a 1-D float32 tensor.

        Args:
            tensor: The values; a copy is made first if it is not a contiguous
                CPU tensor.

        Returns:
            A msgpack-able header and a read-only byte payload of
            :meth:`compressed_nbytes` bytes. The payload may alias ``tensor``
            (codec ``none``): send it before modifying the tensor.

        Raises:
            LocalProtocolError: ``tensor`` is not a 1-D float32 tensor.
        """

    @abc.abstractmethod
    def decode(
        self,
        header: object,
        payload: bytes | bytearray | memoryview,
        *,
        numel: int | None = None,
    ) -> torch.Tensor:
        """Decode a header and payload received from the network.

        Args:
            header: The received header.
            payload: The received payload bytes.
            numel: If given, the element count the caller expects; a header
                announcing any other count is rejected.

        Returns:
            A 1-D float32 CPU tensor. It may share memory with a writable
            payload (codec ``none``).

        Raises:
            TensorFormatError: The header or payload is malformed, names
                another codec, or announces an unexpected element count.
            ConfigError: ``numel`` is not a non-negative int.
        """

    @abc.abstractmethod
    def error_bound(self, tensor: torch.Tensor) -> float:
        """Return the largest absolute error a round trip may cause on ``tensor``.

        The bound holds for every finite element of ``tensor``; it is
        ``math.inf`` when the codec gives no finite promise (int8 with
        non-finite input). Non-finite elements stay non-finite.

        Raises:
            LocalProtocolError: ``tensor`` is not a 1-D float32 tensor.
        """


class NoneCodec(Codec):
    """Sends float32 values as they are, without copying them."""

    name = "none"

    def compressed_nbytes(self, numel: int) -> int:
        return 4 * _check_count(numel)

    def encode(self, tensor: torch.Tensor) -> tuple[dict[str, Any], memoryview]:
        values = _check_input(tensor)
        return _header(self.name, values.numel()), encode_tensor(values)[1]

    def decode(
        self,
        header: object,
        payload: bytes | bytearray | memoryview,
        *,
        numel: int | None = None,
    ) -> torch.Tensor:
        count, _ = _parse_header(header, self.name, numel)
        return decode_tensor(_raw_header("float32", count), payload)

    def error_bound(self, tensor: torch.Tensor) -> float:
        _check_input(tensor)
        return 0.0


class _HalfCodec(Codec):
    """Rounds to nearest in a 16-bit float type; finite values beyond its range saturate."""

    _dtype: ClassVar[torch.dtype]
    _wire_dtype: ClassVar[str]
    _unit_roundoff: ClassVar[float]  # half the distance from 1 to the next value
    _min_step: ClassVar[float]  # half the smallest subnormal: the absolute error floor

    @classmethod
    def _max(cls) -> float:
        return float(torch.finfo(cls._dtype).max)

    def compressed_nbytes(self, numel: int) -> int:
        return 2 * _check_count(numel)

    def encode(self, tensor: torch.Tensor) -> tuple[dict[str, Any], memoryview]:
        values = _check_input(tensor)
        limit = self._max()
        if values.numel():
            low, high = torch.aminmax(values)
            in_range = -limit <= float(low) and float(high) <= limit  # False on NaN
            if not in_range:  # saturate finite values only: NaN and ±Inf must survive
                clamped = values.clamp(-limit, limit)
                values = torch.where(values.isfinite(), clamped, values)
        narrow = empty_tensor(values.shape, self._dtype).copy_(values)
        return _header(self.name, values.numel()), encode_tensor(narrow)[1]

    def decode(
        self,
        header: object,
        payload: bytes | bytearray | memoryview,
        *,
        numel: int | None = None,
    ) -> torch.Tensor:
        count, _ = _parse_header(header, self.name, numel)
        narrow = decode_tensor(_raw_header(self._wire_dtype, count), payload)
        return empty_tensor((count,), torch.float32).copy_(narrow)

    def error_bound(self, tensor: torch.Tensor) -> float:
        values = _check_input(tensor)
        if values.numel() == 0:
            return 0.0
        absmax = _finite_absmax(values)
        return max(absmax * self._unit_roundoff, self._min_step, absmax - self._max())


class Float16Codec(_HalfCodec):
    """IEEE half precision: 11 significant bits, finite range ±65504."""

    name = "fp16"
    _dtype = torch.float16
    _wire_dtype = "float16"
    _unit_roundoff = 2.0**-11
    _min_step = 2.0**-25


class BFloat16Codec(_HalfCodec):
    """bfloat16: 8 significant bits, nearly the float32 range."""

    name = "bf16"
    _dtype = torch.bfloat16
    _wire_dtype = "bfloat16"
    _unit_roundoff = 2.0**-8
    _min_step = 2.0**-134


class Int8BlockCodec(Codec):
    """Per-block absmax int8 quantization.

    Every block of ``block_size`` consecutive elements (the last one may be
    shorter) gets the scale ``s = absmax / 127``, sent as float32, and each
    value ``x`` becomes ``round(x / s)`` (to nearest, ties to even) in
    [-127, 127]; decoding computes ``q * s``. A block holding a NaN or ±Inf
    gets the scale NaN and zero values, so it decodes to all NaN.

    Args:
        block_size: Elements per block, 1 to :data:`MAX_BLOCK_SIZE`.

    Raises:
        ConfigError: ``block_size`` is out of range.
    """

    name = "int8"

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int):
            raise ConfigError(f"block_size must be an int, got {short_repr(block_size)}")
        if not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise ConfigError(
                f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {short_repr(block_size)}"
            )
        self.block_size: Final = block_size

    def __repr__(self) -> str:
        return f"Int8BlockCodec(block_size={self.block_size})"

    def compressed_nbytes(self, numel: int) -> int:
        return _int8_nbytes(_check_count(numel), self.block_size)

    def encode(self, tensor: torch.Tensor) -> tuple[dict[str, Any], memoryview]:
        values = _check_input(tensor)
        count, block = values.numel(), self.block_size
        blocks = -(-count // block)
        payload = empty_tensor((_int8_nbytes(count, block),), torch.uint8)
        scales = payload[: 4 * blocks].view(torch.float32)  # offset 0: aligned
        quantized = payload[4 * blocks :].view(torch.int8)
        for rows, start, stop in _block_rows(count, block):
            first = start // block
            _quantize(
                values[start:stop].view(rows, -1),
                scales[first : first + rows],
                quantized[start:stop].view(rows, -1),
            )
        header = _header(self.name, count)
        header[KEY_BLOCK_SIZE] = block
        return header, encode_tensor(payload)[1]

    def decode(
        self,
        header: object,
        payload: bytes | bytearray | memoryview,
        *,
        numel: int | None = None,
    ) -> torch.Tensor:
        count, block = _parse_header(header, self.name, numel, with_block=True)
        blocks = -(-count // block)
        size = _int8_nbytes(count, block)
        raw = decode_tensor(_raw_header("uint8", size), payload)
        scales = raw[: 4 * blocks]
        if scales.data_ptr() % 4:
            scales = scales.clone()
        scales = scales.view(torch.float32)
        if bool((scales.isinf() | (scales < 0)).any()):
            raise TensorFormatError("int8 block scales must be NaN or finite and non-negative")
        quantized = raw[4 * blocks :].view(torch.int8)
        out = empty_tensor((count,), torch.float32)
        for rows, start, stop in _block_rows(count, block):
            first = start // block
            torch.mul(
                quantized[start:stop].view(rows, -1),
                scales[first : first + rows, None],
                out=out[start:stop].view(rows, -1),
            )
        return out

    def error_bound(self, tensor: torch.Tensor) -> float:
        values = _check_input(tensor)
        if values.numel() == 0:
            return 0.0
        if not bool(values.isfinite().all()):
            return math.inf
        # absmax/254 from rounding; the factor covers float32 rounding of the
        # scale, the division and the product; the term covers subnormal scales.
        return _finite_absmax(values) / 254 * (1 + 2.0**-14) + _FLOAT32_TINY


_CODECS: Final[dict[str, type[Codec]]] = {
    cls.name: cls for cls in (NoneCodec, Float16Codec, BFloat16Codec)
}
CODEC_NAMES: Final[list[str]] = [*_CODECS, Int8BlockCodec.name]
"""Every codec name :func:`get_codec` knows (grows with :func:`register_codec`)."""


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Make a codec class available by its ``name`` (usable as a decorator).

    The class is built without arguments. Every member of a group must have
    registered the same codec under the same name, since the receiver picks
    the decoder by the name in each part's header.

    Raises:
        ConfigError: the name is empty or already taken.
    """
    name = getattr(cls, "name", "")
    if not isinstance(name, str) or not name:
        raise ConfigError("a codec class needs a non-empty string `name`")
    if name in CODEC_NAMES:
        raise ConfigError(f"a codec named {name!r} is already registered")
    _CODECS[name] = cls
    CODEC_NAMES.append(name)
    return cls


def get_codec(name: str, *, block_size: int = DEFAULT_BLOCK_SIZE) -> Codec:
    """Return the codec called ``name``.

    Args:
        name: One of :data:`CODEC_NAMES`.
        block_size: Elements per block; used by ``int8`` only.

    Raises:
        ConfigError: Unknown name or bad block size.
    """
    if name == Int8BlockCodec.name:
        return Int8BlockCodec(block_size)
    cls = _CODECS.get(name)
    if cls is None:
        raise ConfigError(f"unknown codec {name!r}; expected one of {list(CODEC_NAMES)}")
    return cls()


def _check_count(numel: int) -> int:
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ConfigError(f"numel must be a non-negative int, got {short_repr(numel)}")
    return numel


def _check_input(tensor: torch.Tensor) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise LocalProtocolError(f"codecs encode tensors, not {type(tensor).__name__}")
    if tensor.dtype != torch.float32 or tensor.dim() != 1 or tensor.layout != torch.strided:
        raise LocalProtocolError(
            f"codecs encode 1-D float32 tensors, got {tensor.dtype} with shape {list(tensor.shape)}"
        )
    if tensor.device.type == "meta":
        raise LocalProtocolError("cannot encode a meta tensor: it has no data")
    return tensor.detach().cpu().resolve_neg().contiguous()


def _int8_nbytes(count: int, block: int) -> int:
    return 4 * -(-count // block) + count


def _header(name: str, count: int) -> dict[str, Any]:
    return {KEY_CODEC: name, KEY_NUMEL: count}


def _raw_header(dtype: str, count: int) -> dict[str, Any]:
    return {KEY_DTYPE: dtype, KEY_SHAPE: [count], KEY_BYTE_ORDER: "<"}


def _parse_header(
    header: object, name: str, expected: int | None, *, with_block: bool = False
) -> tuple[int, int]:
    """Validate a codec header; return (element count, block size or 0)."""
    if expected is not None:
        _check_count(expected)
    if not isinstance(header, Mapping):
        raise TensorFormatError(f"codec header must be a map, got {type(header).__name__}")
    keys = {KEY_CODEC, KEY_NUMEL, KEY_BLOCK_SIZE} if with_block else {KEY_CODEC, KEY_NUMEL}
    if set(header) != keys:
        raise TensorFormatError(f"{name} header keys must be exactly {sorted(keys)}")
    if not isinstance(header[KEY_CODEC], str) or header[KEY_CODEC] != name:
        raise TensorFormatError(
            f"expected codec {name!r}, header names {short_repr(header[KEY_CODEC])}"
        )
    count = header[KEY_NUMEL]
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise TensorFormatError(
            f"element count must be a non-negative int, got {short_repr(count)}"
        )
    if expected is not None and count != expected:
        raise TensorFormatError(
            f"expected {expected} elements, header announces {short_repr(count)}"
        )
    if not with_block:
        return count, 0
    block = header[KEY_BLOCK_SIZE]
    if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= MAX_BLOCK_SIZE:
        raise TensorFormatError(
            f"int8 block size must be an int in [1, {MAX_BLOCK_SIZE}], got {short_repr(block)}"
        )
    return count, block


def _block_rows(count: int, block: int) -> list[tuple[int, int, int]]:
    """Split ``count`` elements into runs of whole blocks: (blocks, start, stop) each.

    Runs hold about ``_CHUNK_ELEMENTS`` elements; the last, shorter block
    forms a run of its own.
    """
    full = count // block
    step = max(1, _CHUNK_ELEMENTS // block)
    runs = [
        (min(step, full - row), row * block, min(row + step, full) * block)
        for row in range(0, full, step)
    ]
    if count > full * block:
        runs.append((1, full * block, count))
    return runs


def _quantize(rows: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """Quantize ``rows`` (blocks x block) into ``out`` (same shape) and their ``scales``."""
    # amin and amax propagate NaN; they are ~10x faster than aminmax(dim=1) here.
    scale = torch.maximum(rows.amin(dim=1).neg_(), rows.amax(dim=1)).div_(127)
    fit = scale.isfinite()
    all_finite = bool(fit.all())
    if not all_finite:
        scale.masked_fill_(~fit, math.nan)
    # For absmax near float32 max, 127 * scale may round to inf: step the scale down.
    overflow = fit & (scale * 127).isinf()
    if bool(overflow.any()):
        scale[overflow] = torch.nextafter(scale[overflow], torch.zeros(()))
    scales.copy_(scale)
    divisor = torch.where(fit & (scale > 0), scale, 1.0)
    ratio = rows / divisor[:, None]
    ratio.round_().clamp_(-127, 127)
    if not all_finite:
        ratio.masked_fill_(~fit[:, None], 0.0)
    out.copy_(ratio)


def _finite_absmax(values: torch.Tensor) -> float:
    if values.numel() == 0:
        return 0.0
    magnitude = values.abs()
    return float(torch.where(magnitude.isfinite(), magnitude, 0.0).max())
