"""Tests for p2ptrain.allreduce.compression: the all-reduce codecs."""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import p2ptrain.allreduce.compression as compression_module
from p2ptrain.allreduce.compression import (
    CODEC_NAMES,
    DEFAULT_BLOCK_SIZE,
    MAX_BLOCK_SIZE,
    BFloat16Codec,
    Codec,
    Float16Codec,
    Int8BlockCodec,
    NoneCodec,
    get_codec,
)
from p2ptrain.errors import ConfigError, LocalProtocolError, TensorFormatError

FUZZ = settings(deadline=None, max_examples=150)
FLOAT32_MAX = float(np.finfo(np.float32).max)
FP16_MAX = 65504.0
BF16_MAX = float(torch.finfo(torch.bfloat16).max)
NAN, INF = math.nan, math.inf

CODECS: list[Codec] = [
    NoneCodec(),
    Float16Codec(),
    BFloat16Codec(),
    Int8BlockCodec(),
    Int8BlockCodec(block_size=1),
    Int8BlockCodec(block_size=3),
    Int8BlockCodec(block_size=64),
]
CODEC_IDS = [f"{codec.name}-{getattr(codec, 'block_size', '')}" for codec in CODECS]


def round_trip(codec: Codec, values: torch.Tensor, kind: type = bytes) -> torch.Tensor:
    header, payload = codec.encode(values)
    assert payload.nbytes == codec.compressed_nbytes(values.numel())
    return codec.decode(header, kind(payload), numel=values.numel())


def max_error(decoded: torch.Tensor, original: torch.Tensor) -> float:
    if original.numel() == 0:
        return 0.0
    return float((decoded.double() - original.double()).abs().max())


def check_within_bound(codec: Codec, values: torch.Tensor) -> None:
    decoded = round_trip(codec, values)
    assert decoded.dtype == torch.float32 and decoded.shape == values.shape
    assert bool(decoded.isfinite().all())
    assert max_error(decoded, values) <= codec.error_bound(values)


def test_public_names_are_pinned() -> None:
    assert sorted(compression_module.__all__) == [
        "BFloat16Codec",
        "CODEC_NAMES",
        "Codec",
        "DEFAULT_BLOCK_SIZE",
        "Float16Codec",
        "Int8BlockCodec",
        "KEY_BLOCK_SIZE",
        "KEY_CODEC",
        "KEY_NUMEL",
        "MAX_BLOCK_SIZE",
        "NoneCodec",
        "get_codec",
        "register_codec",
    ]


def test_get_codec() -> None:
    assert CODEC_NAMES[:4] == ["none", "fp16", "bf16", "int8"]
    for name in CODEC_NAMES:
        assert get_codec(name).name == name
    codec = get_codec("int8")
    assert isinstance(codec, Int8BlockCodec) and codec.block_size == DEFAULT_BLOCK_SIZE == 1024
    assert get_codec("int8", block_size=7).block_size == 7  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="unknown codec"):
        get_codec("zstd")
    for bad in (0, -1, MAX_BLOCK_SIZE + 1, 2.0, True):
        with pytest.raises(ConfigError):
            Int8BlockCodec(bad)  # type: ignore[arg-type]


def test_compressed_nbytes() -> None:
    assert [get_codec(name).compressed_nbytes(1000) for name in CODEC_NAMES] == [
        4000,
        2000,
        2000,
        1004,
    ]
    int8 = Int8BlockCodec(block_size=4)
    assert [int8.compressed_nbytes(n) for n in (0, 1, 4, 5, 8)] == [0, 5, 8, 13, 16]
    for codec in CODECS:
        with pytest.raises(ConfigError):
            codec.compressed_nbytes(-1)


# --- golden payloads ------------------------------------------------------------


def test_golden_payloads() -> None:
    values = torch.tensor([1.0, -2.0, 0.5])
    header, payload = NoneCodec().encode(values)
    assert header == {"c": "none", "n": 3}
    assert bytes(payload) == struct.pack("<3f", 1.0, -2.0, 0.5)

    header, payload = Float16Codec().encode(values)
    assert header == {"c": "fp16", "n": 3}
    assert bytes(payload) == struct.pack("<3e", 1.0, -2.0, 0.5)

    header, payload = BFloat16Codec().encode(values)
    assert header == {"c": "bf16", "n": 3}
    assert bytes(payload) == bytes.fromhex("803f00c0003f")

    header, payload = Int8BlockCodec(block_size=2).encode(
        torch.tensor([127.0, -63.4, 0.0, 2.54, 5.0])
    )
    assert header == {"c": "int8", "n": 5, "b": 2}
    scales = struct.pack("<3f", 1.0, *(np.array([2.54, 5.0], dtype=np.float32) / np.float32(127)))
    assert bytes(payload) == scales + struct.pack("<5b", 127, -63, 0, 127, 127)


def test_int8_rounds_to_nearest_even() -> None:
    codec = Int8BlockCodec(block_size=8)
    values = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 126.5, -127.0])
    header, payload = codec.encode(values)
    assert struct.unpack("<f8b", bytes(payload)) == (1.0, 127, 0, 2, 2, 0, -2, 126, -127)
    assert codec.decode(header, payload).tolist() == [127, 0, 2, 2, 0, -2, 126, -127]


# --- error bounds -----------------------------------------------------------------


def test_error_bound_formulas() -> None:
    values = torch.tensor([3.0, -1000.0, 0.25])
    assert NoneCodec().error_bound(values) == 0.0
    assert Float16Codec().error_bound(values) == 1000.0 * 2**-11
    assert BFloat16Codec().error_bound(values) == 1000.0 * 2**-8
    assert Int8BlockCodec().error_bound(values) == pytest.approx(1000.0 / 254, rel=1e-4)
    tiny = torch.tensor([1e-30])
    assert Float16Codec().error_bound(tiny) == 2**-25
    assert Float16Codec().error_bound(torch.tensor([1e6, 1.0])) == 1e6 - FP16_MAX
    for codec in CODECS:
        assert codec.error_bound(torch.zeros(0)) == 0.0


@pytest.mark.parametrize("codec", CODECS, ids=CODEC_IDS)
@pytest.mark.parametrize(
    "values",
    [
        [],
        [0.0],
        [-3.25],
        [0.0] * 10,
        [5.0] * 10,
        [-1e-3] * 7,
        [1.0, -1.0] * 600,
        [FLOAT32_MAX, -FLOAT32_MAX, 1.0, 0.0, 1e-45],
        [1e-45, -1e-40, 1e-38, 3e-39],
        [1e30, 1e-30, -1e20, 7.0],
        [65519.0, 65520.0, -70000.0, 1.0],
    ],
    ids=lambda values: f"{len(values)} values",
)
def test_round_trip_special_inputs(codec: Codec, values: list[float]) -> None:
    check_within_bound(codec, torch.tensor(values, dtype=torch.float32))


@pytest.mark.parametrize("codec", CODECS, ids=CODEC_IDS)
@pytest.mark.parametrize("scale", [1e-35, 1e-3, 1.0, 1e4, 1e35])
def test_round_trip_large_random(codec: Codec, scale: float) -> None:
    gen = torch.Generator().manual_seed(7)
    values = torch.randn(20_011, generator=gen) * scale
    values[5000:7000] = 0.0  # whole zero blocks
    values[9000:11000] = scale  # constant blocks
    check_within_bound(codec, values)
    if isinstance(codec, Int8BlockCodec) and codec.block_size >= 64 and scale == 1.0:
        # the bound is tight, not vacuous: rounding error reaches most of it
        assert max_error(round_trip(codec, values), values) > 0.5 * codec.error_bound(values)


@pytest.mark.parametrize("block_size", [1, 5, 1024])
def test_chunking_does_not_change_the_result(
    block_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    codec = Int8BlockCodec(block_size)
    values = torch.randn(2 * 1024 + 17, generator=torch.Generator().manual_seed(3))
    values[2000] = NAN
    header, payload = codec.encode(values)
    expected_payload, expected = bytes(payload), codec.decode(header, payload)
    monkeypatch.setattr(compression_module, "_CHUNK_ELEMENTS", 100)
    header, payload = codec.encode(values)
    assert bytes(payload) == expected_payload
    torch.testing.assert_close(codec.decode(header, payload), expected, equal_nan=True)


def test_multi_megabyte_round_trip() -> None:
    values = torch.randn((1 << 20) + 7, generator=torch.Generator().manual_seed(5))
    for name in CODEC_NAMES:
        check_within_bound(get_codec(name), values)


float32s = st.floats(width=32, allow_nan=False, allow_infinity=False)


@FUZZ
@given(
    values=st.lists(float32s, max_size=300),
    codec=st.sampled_from(CODECS),
    block_size=st.sampled_from([1, 2, 5, 16, 1024]),
)
def test_fuzz_round_trip_within_bound(values: list[float], codec: Codec, block_size: int) -> None:
    tensor = torch.tensor(values, dtype=torch.float32)
    check_within_bound(codec, tensor)
    check_within_bound(Int8BlockCodec(block_size), tensor)


@FUZZ
@given(
    size=st.integers(0, 5000),
    seed=st.integers(0, 2**32 - 1),
    exponent=st.integers(-40, 37),  # randn * 1e38 may overflow to inf
    codec=st.sampled_from(CODECS),
)
def test_fuzz_random_tensors_within_bound(
    size: int, seed: int, exponent: int, codec: Codec
) -> None:
    values = torch.randn(size, generator=torch.Generator().manual_seed(seed)) * 10.0**exponent
    check_within_bound(codec, values)


# --- non-finite values ----------------------------------------------------------------


@pytest.mark.parametrize("codec", [NoneCodec(), Float16Codec(), BFloat16Codec()], ids=str)
def test_float_codecs_keep_nan_and_inf(codec: Codec) -> None:
    values = torch.tensor([1.0, NAN, -INF, 2.0, INF, 3.0e38, -1e6])
    decoded = round_trip(codec, values)
    assert torch.isnan(decoded[1]) and decoded[2] == -INF and decoded[4] == INF
    finite = values.isfinite()
    assert bool(decoded[finite].isfinite().all())
    assert max_error(decoded[finite], values[finite]) <= codec.error_bound(values)


def test_half_codecs_saturate_finite_values() -> None:
    values = torch.tensor([1e6, -1e6, 65520.0, FLOAT32_MAX, 1.0])
    assert round_trip(Float16Codec(), values).tolist() == [
        FP16_MAX,
        -FP16_MAX,
        FP16_MAX,
        FP16_MAX,
        1,
    ]
    decoded = round_trip(BFloat16Codec(), values)
    assert decoded[3].item() == BF16_MAX
    assert bool(decoded.isfinite().all())


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_int8_poisons_only_non_finite_blocks(bad: float) -> None:
    codec = Int8BlockCodec(block_size=4)
    values = torch.arange(14, dtype=torch.float32) - 3.3
    clean = round_trip(codec, values)
    values[6] = bad
    values[13] = bad  # in the short last block
    header, payload = codec.encode(values)
    raw = bytes(payload)
    scales = struct.unpack_from("<4f", raw)
    assert math.isnan(scales[1]) and math.isnan(scales[3])
    assert raw[16 + 4 : 16 + 8] == bytes(4) and raw[16 + 12 :] == bytes(2)  # zeros, not garbage
    decoded = codec.decode(header, payload)
    assert bool(decoded[4:8].isnan().all()) and bool(decoded[12:].isnan().all())
    for keep in (slice(0, 4), slice(8, 12)):
        assert torch.equal(decoded[keep], clean[keep])
    assert codec.error_bound(values) == INF


def test_int8_huge_values_do_not_overflow() -> None:
    codec = Int8BlockCodec(block_size=3)
    values = torch.tensor([FLOAT32_MAX, -FLOAT32_MAX, 1e38, 3.0])
    decoded = round_trip(codec, values)
    assert bool(decoded.isfinite().all())
    assert max_error(decoded, values) <= codec.error_bound(values)


# --- copies ------------------------------------------------------------------------


def test_none_codec_is_zero_copy_both_ways() -> None:
    codec = NoneCodec()
    values = torch.zeros(4)
    header, payload = codec.encode(values)
    values[1] = 2.5
    assert struct.unpack("<4f", payload) == (0.0, 2.5, 0.0, 0.0)
    buffer = bytearray(payload)
    decoded = codec.decode(header, buffer)
    buffer[0:4] = struct.pack("<f", -1.0)
    assert decoded[0].item() == -1.0


@pytest.mark.parametrize("codec", CODECS, ids=CODEC_IDS)
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_decode_from_any_buffer(codec: Codec, offset: int) -> None:
    values = torch.linspace(-5, 5, 301)
    header, payload = codec.encode(values)
    expected = codec.decode(header, bytes(payload))
    writable = memoryview(bytearray(offset) + bytearray(payload))[offset:]
    read_only = memoryview(bytes(offset) + bytes(payload))[offset:]
    assert torch.equal(codec.decode(header, writable), expected)
    assert torch.equal(codec.decode(header, read_only), expected)


def test_encode_accepts_views_and_grad() -> None:
    base = torch.arange(20, dtype=torch.float32, requires_grad=True)
    for codec in CODECS:
        strided = base[::2]
        decoded = round_trip(codec, strided)
        assert max_error(decoded, strided.detach()) <= codec.error_bound(strided)


def test_decoder_accepts_the_senders_block_size() -> None:
    values = torch.randn(100)
    header, payload = Int8BlockCodec(block_size=7).encode(values)
    decoded = Int8BlockCodec(block_size=1024).decode(header, payload, numel=100)
    assert max_error(decoded, values) <= Int8BlockCodec(block_size=7).error_bound(values)


# --- bad input -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        torch.zeros(3, dtype=torch.float64),
        torch.zeros(3, dtype=torch.float16),
        torch.zeros(3, dtype=torch.int32),
        torch.zeros(2, 2),
        torch.tensor(1.0),
        torch.zeros(3, device="meta"),
        [1.0],
    ],
    ids=["float64", "float16", "int32", "2-D", "0-D", "meta", "list"],
)
@pytest.mark.parametrize("codec", CODECS[:4], ids=CODEC_IDS[:4])
def test_encode_rejects_unsupported(codec: Codec, value: Any) -> None:
    with pytest.raises(LocalProtocolError):
        codec.encode(value)
    with pytest.raises(LocalProtocolError):
        codec.error_bound(value)


def bad_headers(name: str, numel: int, extra: dict[str, Any]) -> list[tuple[object, str]]:
    good = {"c": name, "n": numel, **extra}
    cases: list[tuple[object, str]] = [
        (None, "must be a map"),
        ([name, numel], "must be a map"),
        ({"c": name}, "keys"),
        ({**good, "x": 0}, "keys"),
        ({**good, "c": "int4"}, "expected codec"),
        ({**good, "c": None}, "expected codec"),
        ({**good, "c": b"none"}, "expected codec"),
        ({**good, "n": -1}, "element count"),
        ({**good, "n": 2.0}, "element count"),
        ({**good, "n": True}, "element count"),
        ({**good, "n": "2"}, "element count"),
        ({**good, "n": numel + 1}, "expected 2 elements"),
        ({**good, "n": -(10**5000)}, "element count"),  # beyond int -> str limit
        ({**good, "n": 10**5000}, "expected 2 elements"),
        ({**good, "c": 10**5000}, "expected codec"),
    ]
    if extra:
        cases += [
            ({**good, "b": 0}, "block size"),
            ({**good, "b": MAX_BLOCK_SIZE + 1}, "block size"),
            ({**good, "b": True}, "block size"),
            ({**good, "b": 2.0}, "block size"),
            ({**good, "b": None}, "block size"),
            ({**good, "b": 10**5000}, "block size"),
            ({**good, "b": 1}, "payload is"),  # 2 blocks: 10 bytes, not 6
        ]
    else:
        cases.append(({**good, "b": 1}, "keys"))
    return cases


@pytest.mark.parametrize("codec", CODECS[:4], ids=CODEC_IDS[:4])
def test_decode_rejects_bad_headers(codec: Codec) -> None:
    header, payload = codec.encode(torch.tensor([1.0, 2.0]))
    extra = {"b": header["b"]} if "b" in header else {}
    assert codec.decode(header, payload, numel=2).shape == (2,)
    for bad, message in bad_headers(codec.name, 2, extra):
        with pytest.raises(TensorFormatError, match=message):
            codec.decode(bad, payload, numel=2)
    for size in (0, payload.nbytes - 1, payload.nbytes + 1):
        with pytest.raises(TensorFormatError, match="payload is"):
            codec.decode(header, bytes(size))
    with pytest.raises(ConfigError):
        codec.decode(header, payload, numel=-2)


@pytest.mark.parametrize("scale", [-1.0, -1e-30, INF, -INF])
def test_int8_rejects_impossible_scales(scale: float) -> None:
    header = {"c": "int8", "n": 3, "b": 2}
    payload = struct.pack("<2f3b", 1.0, scale, 1, 2, 3)
    with pytest.raises(TensorFormatError, match="scales"):
        Int8BlockCodec().decode(header, payload)


def test_int8_accepts_nan_scale_and_minus_128() -> None:
    header = {"c": "int8", "n": 3, "b": 2}
    payload = struct.pack("<2f3b", NAN, 0.5, 1, 2, -128)
    decoded = Int8BlockCodec().decode(header, payload).tolist()
    assert math.isnan(decoded[0]) and math.isnan(decoded[1]) and decoded[2] == -64.0


# --- decoder fuzzing -------------------------------------------------------------------

primitives = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=6)
    | st.binary(max_size=6)
    | st.sampled_from(list(CODEC_NAMES))
)
values_st = st.recursive(primitives, lambda inner: st.lists(inner, max_size=4), max_leaves=8)
headers = (
    st.dictionaries(st.sampled_from(["c", "n", "b"]) | st.text(max_size=2), values_st, max_size=4)
    | values_st
)


@FUZZ
@given(codec=st.sampled_from(CODECS), header=headers, payload=st.binary(max_size=64))
def test_fuzz_arbitrary_headers(codec: Codec, header: object, payload: bytes) -> None:
    try:
        decoded = codec.decode(header, payload)
    except TensorFormatError:
        return
    assert isinstance(header, dict)
    assert decoded.dtype == torch.float32 and decoded.shape == (header["n"],)


@st.composite
def near_valid(draw: st.DrawFn) -> tuple[Codec, dict[str, Any], bytes]:
    codec = draw(st.sampled_from(CODECS))
    numel = draw(st.integers(0, 40))
    header: dict[str, Any] = {"c": codec.name, "n": numel}
    if isinstance(codec, Int8BlockCodec):
        header["b"] = draw(st.integers(1, 50) | st.integers(-3, 0))
        size = numel + 4 * -(-numel // max(header["b"], 1))
    else:
        size = codec.compressed_nbytes(numel)
    size = max(0, size + draw(st.sampled_from([0, 0, 0, -1, 1])))
    return codec, header, draw(st.binary(min_size=size, max_size=size))


@FUZZ
@given(case=near_valid(), as_bytearray=st.booleans())
def test_fuzz_near_valid_payloads(
    case: tuple[Codec, dict[str, Any], bytes], as_bytearray: bool
) -> None:
    codec, header, raw = case
    try:
        decoded = codec.decode(header, bytearray(raw) if as_bytearray else raw)
    except TensorFormatError:
        return
    assert decoded.dtype == torch.float32 and decoded.shape == (header["n"],)
    if codec.name != "int8":  # any bits are valid values, and re-encoding them is lossless
        again = codec.decode(*codec.encode(decoded))
        torch.testing.assert_close(again, decoded, rtol=0, atol=0, equal_nan=True)
