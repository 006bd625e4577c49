"""Tests for p2ptrain.wire.tensors: the tensor header + raw bytes encoding."""

from __future__ import annotations

import gc
import math
import struct
import warnings
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import p2ptrain.wire.tensors as tensors_module
from p2ptrain.errors import ConfigError, LocalProtocolError, TensorFormatError
from p2ptrain.wire.tensors import (
    MAX_DIMS,
    WIRE_DTYPES,
    TensorSpec,
    decode_tensor,
    empty_tensor,
    encode_tensor,
    parse_tensor_header,
    short_repr,
    tensor_nbytes,
)

FUZZ = settings(deadline=None, max_examples=200)

ITEMSIZES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "bool": 1,
}

SHAPES = [(), (0,), (3, 0, 2), (1,), (7,), (2, 3, 4), (1, 1, 1, 5), (1 << 20,)]


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 1000).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=dtype)


def swap_bytes(payload: bytes, itemsize: int) -> bytes:
    """Reverse the bytes of every element: little-endian <-> big-endian."""
    return np.frombuffer(payload, dtype=np.uint8).reshape(-1, itemsize)[:, ::-1].tobytes()


def test_public_names_are_pinned() -> None:
    assert sorted(tensors_module.__all__) == [
        "KEY_BYTE_ORDER",
        "KEY_DTYPE",
        "KEY_SHAPE",
        "MAX_DIMS",
        "TensorSpec",
        "WIRE_DTYPES",
        "decode_tensor",
        "empty_tensor",
        "encode_tensor",
        "parse_tensor_header",
        "short_repr",
        "tensor_nbytes",
    ]


def test_dtype_table_is_the_documented_one() -> None:
    assert {name: dtype.itemsize for name, dtype in WIRE_DTYPES.items()} == ITEMSIZES


# --- golden bytes -----------------------------------------------------------


def test_golden_float32() -> None:
    header, payload = encode_tensor(torch.tensor([[1.0, -2.0]]))
    assert header == {"d": "float32", "s": [1, 2], "o": "<"}
    assert bytes(payload) == bytes.fromhex("0000803f000000c0")
    assert msgpack.packb(header) == bytes.fromhex("83a164a7666c6f61743332a173920102a16fa13c")


def test_golden_bfloat16_and_bool_and_scalar() -> None:
    header, payload = encode_tensor(torch.tensor([1.0, -2.0], dtype=torch.bfloat16))
    assert header == {"d": "bfloat16", "s": [2], "o": "<"}
    assert bytes(payload) == bytes.fromhex("803f00c0")

    header, payload = encode_tensor(torch.tensor([True, False, True]))
    assert header["d"] == "bool"
    assert bytes(payload) == b"\x01\x00\x01"

    header, payload = encode_tensor(torch.tensor(258, dtype=torch.int16))
    assert header == {"d": "int16", "s": [], "o": "<"}
    assert bytes(payload) == b"\x02\x01"


def test_golden_big_endian_decodes() -> None:
    header = {"d": "float32", "s": [3], "o": ">"}
    out = decode_tensor(header, struct.pack(">3f", 1.5, -2.0, 1e30))
    assert out.tolist() == [1.5, -2.0, pytest.approx(1e30, rel=1e-7)]
    out = decode_tensor({"d": "int64", "s": [], "o": ">"}, struct.pack(">q", -5))
    assert out.item() == -5


# --- round trips ------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(WIRE_DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kind", [bytes, bytearray])
def test_round_trip_every_dtype_and_shape(name: str, shape: tuple[int, ...], kind: type) -> None:
    dtype = WIRE_DTYPES[name]
    original = sample(dtype, shape)
    header, payload = encode_tensor(original)
    assert header == {"d": name, "s": list(shape), "o": "<"}
    assert payload.nbytes == original.numel() * ITEMSIZES[name] == tensor_nbytes(header)
    assert payload.readonly and payload.format == "B" and payload.ndim == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's non-writable buffer warning
        decoded = decode_tensor(msgpack.unpackb(msgpack.packb(header)), kind(payload))
    assert decoded.dtype == dtype and decoded.shape == original.shape
    assert torch.equal(decoded, original)
    decoded.zero_()  # writable, whatever the payload type


@pytest.mark.parametrize("name", sorted(WIRE_DTYPES))
def test_big_endian_payload_every_dtype(name: str) -> None:
    original = sample(WIRE_DTYPES[name], (3, 5), seed=1)
    header, payload = encode_tensor(original)
    swapped = swap_bytes(bytes(payload), ITEMSIZES[name])
    for kind in (bytes, bytearray):
        decoded = decode_tensor({**header, "o": ">"}, kind(swapped))
        assert torch.equal(decoded, original)
        assert decoded.is_contiguous()


def test_non_contiguous_is_copied_once() -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    transposed = base.t()
    expected = transposed.clone()
    header, payload = encode_tensor(transposed)
    assert header["s"] == [4, 3]
    assert bytes(payload) == expected.numpy().tobytes()
    base.zero_()  # the payload is a copy: unaffected
    assert torch.equal(decode_tensor(header, bytes(payload)), expected)


def test_views_with_offsets_and_grad() -> None:
    base = torch.arange(10, dtype=torch.float64, requires_grad=True)
    view = base[3:7]
    header, payload = encode_tensor(view)
    assert decode_tensor(header, payload).tolist() == [3.0, 4.0, 5.0, 6.0]


def test_expanded_and_negative_views() -> None:
    expanded = torch.tensor([1, 2], dtype=torch.int32).expand(3, 2)
    header, payload = encode_tensor(expanded)
    assert decode_tensor(header, payload).tolist() == [[1, 2]] * 3
    flipped = torch.arange(5, dtype=torch.int8).flip(0)
    header, payload = encode_tensor(flipped)
    assert decode_tensor(header, payload).tolist() == [4, 3, 2, 1, 0]


# --- zero copy ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["float32", "bfloat16", "bool", "int64"])
def test_encode_is_zero_copy(name: str) -> None:
    tensor = torch.zeros(6, dtype=WIRE_DTYPES[name])
    _, payload = encode_tensor(tensor)
    assert bytes(payload) == bytes(payload.nbytes)
    tensor[2] = 1
    itemsize = ITEMSIZES[name]
    assert (
        bytes(payload[2 * itemsize : 3 * itemsize])
        == tensor[2:3].view(torch.uint8).numpy().tobytes()
    )
    assert bytes(payload[2 * itemsize : 3 * itemsize]) != bytes(itemsize)


def test_encoded_view_keeps_storage_alive() -> None:
    tensor = torch.arange(1000, dtype=torch.float32)
    expected = tensor.numpy().tobytes()
    _, payload = encode_tensor(tensor)
    del tensor
    gc.collect()
    clobber = [torch.full((1000,), -1.0) for _ in range(50)]  # reuse freed memory, if any
    assert bytes(payload) == expected
    assert len(clobber) == 50


def test_decode_shares_writable_buffers() -> None:
    buffer = bytearray(struct.pack("<4f", 1, 2, 3, 4))
    decoded = decode_tensor({"d": "float32", "s": [2, 2], "o": "<"}, buffer)
    buffer[0:4] = struct.pack("<f", 9.0)
    assert decoded[0, 0].item() == 9.0
    decoded[1, 1] = -1.0
    assert struct.unpack_from("<f", buffer, 12) == (-1.0,)

    # a writable, aligned slice of a larger buffer is shared too
    big = bytearray(64)
    window = memoryview(big)[16:32]
    decoded = decode_tensor({"d": "int32", "s": [4], "o": "<"}, window)
    big[16] = 7
    assert decoded[0].item() == 7


def test_decoded_tensor_keeps_shared_buffer_alive() -> None:
    buffer = bytearray(struct.pack("<3i", 7, 8, 9))
    decoded = decode_tensor({"d": "int32", "s": [3], "o": "<"}, buffer)
    with pytest.raises(BufferError):
        buffer.extend(b"1234")  # exported: cannot move while the tensor lives
    del buffer
    gc.collect()
    clobber = [bytearray(b"\xff" * 12) for _ in range(50)]
    assert decoded.tolist() == [7, 8, 9]
    assert len(clobber) == 50


def test_decode_copies_read_only_buffers() -> None:
    payload = struct.pack("<2f", 1, 2)
    decoded = decode_tensor({"d": "float32", "s": [2], "o": "<"}, memoryview(payload))
    decoded.add_(1)
    assert payload == struct.pack("<2f", 1, 2)
    assert decoded.tolist() == [2.0, 3.0]


@pytest.mark.parametrize("offset", [1, 2, 3, 5])
def test_decode_misaligned_buffer_is_copied_to_aligned_memory(offset: int) -> None:
    values = [1.5, -2.25, 1e100]
    storage = bytearray(offset) + bytearray(struct.pack("<3d", *values))
    window = memoryview(storage)[offset:]
    decoded = decode_tensor({"d": "float64", "s": [3], "o": "<"}, window)
    assert decoded.data_ptr() % 8 == 0
    assert decoded.tolist() == values
    storage[offset] ^= 0xFF  # a copy: unaffected
    assert decoded.tolist() == values


def test_decode_accepts_other_buffer_formats() -> None:
    array = np.array([[1, 2], [3, 4]], dtype=np.int16)
    header = {"d": "int16", "s": [4], "o": "<"}
    assert decode_tensor(header, array.data).tolist() == [1, 2, 3, 4]
    strided = np.arange(8, dtype=np.uint8).data[::2]  # not contiguous
    assert decode_tensor({"d": "uint8", "s": [4], "o": "<"}, strided).tolist() == [0, 2, 4, 6]


def test_empty_and_scalar_results_are_valid_tensors() -> None:
    empty = decode_tensor({"d": "float16", "s": [0, 3], "o": "<"}, b"")
    assert empty.shape == (0, 3) and empty.dtype == torch.float16
    huge_empty = decode_tensor({"d": "float32", "s": [2**40, 0, 2**20], "o": "<"}, bytearray())
    assert huge_empty.numel() == 0
    scalar = decode_tensor({"d": "bool", "s": [], "o": ">"}, b"\x01")
    assert scalar.shape == () and scalar.item() is True


def test_empty_tensor_helper() -> None:
    for name, dtype in WIRE_DTYPES.items():
        tensor = empty_tensor((3, 2), dtype)
        assert tensor.shape == (3, 2) and tensor.dtype == dtype, name
        assert tensor.data_ptr() % 8 == 0
    assert empty_tensor((0,), torch.float64).numel() == 0


# --- encode errors ------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        torch.zeros(2, dtype=torch.complex64),
        torch.zeros(2, dtype=torch.uint16),
        torch.zeros(2, device="meta"),
        torch.zeros(3).to_sparse(),
        [1.0, 2.0],
    ],
    ids=["complex", "uint16", "meta", "sparse", "list"],
)
def test_encode_rejects_unsupported(value: Any) -> None:
    with pytest.raises(LocalProtocolError):
        encode_tensor(value)


# --- decode errors ------------------------------------------------------------

GOOD = {"d": "float32", "s": [2], "o": "<"}
BAD_CASES: list[tuple[object, bytes, str]] = [
    (None, b"", "must be a map"),
    ([("d", "float32")], b"", "must be a map"),
    ({"d": "float32", "s": [2]}, bytes(8), "missing"),
    ({**GOOD, "x": 1}, bytes(8), "unexpected"),
    ({**GOOD, b"d": 1}, bytes(8), "unexpected"),  # type: ignore[misc]
    ({"dtype": "float32", "shape": [2], "order": "<"}, bytes(8), "keys"),
    ({**GOOD, "d": "float8"}, bytes(8), "unknown tensor dtype"),
    ({**GOOD, "d": "Float32"}, bytes(8), "unknown tensor dtype"),
    ({**GOOD, "d": b"float32"}, bytes(8), "unknown tensor dtype"),
    ({**GOOD, "d": None}, bytes(8), "unknown tensor dtype"),
    ({**GOOD, "d": ["float32"]}, bytes(8), "unknown tensor dtype"),
    ({**GOOD, "o": "="}, bytes(8), "byte order"),
    ({**GOOD, "o": b"<"}, bytes(8), "byte order"),
    ({**GOOD, "o": 60}, bytes(8), "byte order"),
    ({**GOOD, "o": ["<"]}, bytes(8), "byte order"),
    ({**GOOD, "s": 2}, bytes(8), "shape must be a list"),
    ({**GOOD, "s": "2"}, bytes(8), "shape must be a list"),
    ({**GOOD, "s": {2: 2}}, bytes(8), "shape must be a list"),
    ({**GOOD, "s": [-2]}, bytes(8), "non-negative"),
    ({**GOOD, "s": [2.0]}, bytes(8), "must be ints"),
    ({**GOOD, "s": [True, 2]}, bytes(8), "must be ints"),
    ({**GOOD, "s": ["2"]}, bytes(8), "must be ints"),
    ({**GOOD, "s": [None]}, bytes(8), "must be ints"),
    ({**GOOD, "s": [1] * (MAX_DIMS + 1)}, bytes(4), "dimensions"),
    ({**GOOD, "s": [2**32, 2**32]}, bytes(8), "too large"),
    ({**GOOD, "s": [2**63]}, bytes(8), "too large"),
    ({**GOOD, "s": [0, 2**62, 2**62]}, b"", "too large"),
    ({**GOOD, "s": [10**400]}, bytes(8), "too large"),
    ({**GOOD, "s": [10**5000]}, bytes(8), "too large"),  # beyond int -> str limit
    ({**GOOD, "s": [-(10**5000)]}, bytes(8), "non-negative"),
    ({**GOOD, "d": 10**5000}, bytes(8), "unknown tensor dtype"),
    ({**GOOD, "o": [10**5000] * 100}, bytes(8), "byte order"),
    ({**GOOD, 10**5000: 1}, bytes(8), "unexpected"),  # type: ignore[misc]
    (GOOD, bytes(7), "payload is 7 bytes, header announces 8"),
    (GOOD, bytes(9), "payload is 9 bytes"),
    (GOOD, b"", "payload is 0 bytes"),
    ({**GOOD, "s": []}, bytes(8), "payload is 8 bytes, header announces 4"),
    ({**GOOD, "s": [0]}, bytes(1), "payload is 1 bytes"),
    ({**GOOD, "s": [2**31, 2**31]}, bytes(8), "payload is 8 bytes"),
    ({"d": "bool", "s": [3], "o": "<"}, b"\x01\x02\x00", "bool"),
    ({"d": "bool", "s": [1], "o": ">"}, b"\xff", "bool"),
]


@pytest.mark.parametrize(("header", "payload", "message"), BAD_CASES)
@pytest.mark.parametrize("kind", [bytes, bytearray])
def test_decode_rejects_bad_input(header: object, payload: bytes, message: str, kind: type) -> None:
    with pytest.raises(TensorFormatError, match=message):
        decode_tensor(header, kind(payload))


def test_max_elements() -> None:
    header = {"d": "int8", "s": [4, 4], "o": "<"}
    assert decode_tensor(header, bytes(16), max_elements=16).shape == (4, 4)
    with pytest.raises(TensorFormatError, match="limit 15"):
        decode_tensor(header, bytes(16), max_elements=15)
    with pytest.raises(TensorFormatError, match="limit"):
        tensor_nbytes({"d": "float64", "s": [2**40], "o": "<"}, max_elements=2**30)
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ConfigError):
            decode_tensor(header, bytes(16), max_elements=bad)  # type: ignore[arg-type]


def test_short_repr_is_bounded_and_safe() -> None:
    assert short_repr("abc") == "'abc'"
    assert short_repr(-(10**5000)) == "<16610-bit int>"
    assert len(short_repr(["x" * 1000] * 1000)) < 200
    nested: list[object] = []
    for _ in range(100):
        nested = [nested]
    assert len(short_repr(nested)) < 100


def test_parse_tensor_header_and_spec() -> None:
    spec = parse_tensor_header({"d": "bfloat16", "s": (2, 3), "o": ">"})
    assert spec == TensorSpec(torch.bfloat16, (2, 3), ">")
    assert (spec.numel, spec.nbytes) == (6, 12)
    assert spec.to_header() == {"d": "bfloat16", "s": [2, 3], "o": ">"}
    assert tensor_nbytes({"d": "int64", "s": [], "o": "<"}) == 8
    assert tensor_nbytes({"d": "int64", "s": [5, 0], "o": "<"}) == 0


# --- fuzzing ------------------------------------------------------------------

primitives = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=10)
    | st.binary(max_size=10)
    | st.sampled_from(["float32", "bool", "bfloat16", "<", ">"])
)
values = st.recursive(
    primitives,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=12,
)
keys = (
    st.sampled_from(["d", "s", "o"]) | st.text(max_size=3) | st.integers() | st.binary(max_size=2)
)
headers = st.dictionaries(keys, values, max_size=5) | values


PAYLOAD_KINDS: dict[str, Callable[[bytes], bytes | bytearray | memoryview]] = {
    "bytes": bytes,
    "bytearray": bytearray,
    "writable misaligned": lambda data: memoryview(bytearray(b"\0" + data))[1:],
    "read-only misaligned": lambda data: memoryview(b"\0\0\0" + data)[3:],
}


def payload_kinds(data: bytes) -> st.SearchStrategy[bytes | bytearray | memoryview]:
    return st.sampled_from(sorted(PAYLOAD_KINDS)).map(lambda kind: PAYLOAD_KINDS[kind](data))


def check_result(header: object, payload: bytes, result: torch.Tensor) -> None:
    """A decoded tensor must be exactly what the header and payload describe."""
    assert isinstance(header, dict)
    name, shape, order = header["d"], header["s"], header["o"]
    assert result.dtype == WIRE_DTYPES[name]
    assert list(result.shape) == list(shape)
    _, again = encode_tensor(result)
    expected = swap_bytes(payload, ITEMSIZES[name]) if order == ">" and payload else payload
    assert bytes(again) == expected


@FUZZ
@given(header=headers, data=st.data(), raw=st.binary(max_size=64))
def test_fuzz_arbitrary_headers(header: object, data: st.DataObject, raw: bytes) -> None:
    payload = data.draw(payload_kinds(raw))
    try:
        result = decode_tensor(header, payload)
    except TensorFormatError:
        return
    check_result(header, raw, result)


@st.composite
def near_valid(draw: st.DrawFn) -> tuple[dict[str, Any], bytes]:
    odd = draw(st.integers(0, 9)) == 9  # mostly well-formed, so that decoding goes deep
    name = draw(st.text(max_size=9) if odd else st.sampled_from(sorted(WIRE_DTYPES)))
    small_dims = st.lists(st.integers(-1, 4), max_size=5)
    odd_dims = st.lists(st.integers(-(2**70), 2**70), max_size=4)
    many_dims = st.lists(st.integers(0, 1), min_size=MAX_DIMS - 2, max_size=MAX_DIMS + 2)
    shape = draw(small_dims | odd_dims | many_dims)
    order = draw(st.sampled_from(["<", ">", "=", "|", ""] if odd else ["<", ">"]))
    expected = ITEMSIZES.get(name, 4) * math.prod(max(dim, 0) for dim in shape)
    size = max(0, min(expected, 4096) + draw(st.sampled_from([0, 0, 0, -1, 1, 3])))
    if name == "bool" and draw(st.booleans()):
        payload = bytes(draw(st.lists(st.integers(0, 1), min_size=size, max_size=size)))
    else:
        payload = draw(st.binary(min_size=size, max_size=size))
    return {"d": name, "s": shape, "o": order}, payload


@FUZZ
@given(case=near_valid(), data=st.data())
def test_fuzz_near_valid_headers(case: tuple[dict[str, Any], bytes], data: st.DataObject) -> None:
    header, raw = case
    payload = data.draw(payload_kinds(raw))
    try:
        result = decode_tensor(
            header, payload, max_elements=data.draw(st.none() | st.integers(0, 64))
        )
    except TensorFormatError:
        return
    check_result(header, raw, result)


@FUZZ
@given(
    name=st.sampled_from(sorted(WIRE_DTYPES)),
    shape=st.lists(st.integers(0, 4), max_size=4),
    data=st.data(),
)
def test_fuzz_every_valid_payload_round_trips(
    name: str, shape: list[int], data: st.DataObject
) -> None:
    size = ITEMSIZES[name] * math.prod(shape)
    if name == "bool":
        raw = bytes(data.draw(st.lists(st.integers(0, 1), min_size=size, max_size=size)))
    else:
        raw = data.draw(st.binary(min_size=size, max_size=size))  # any bits, NaNs included
    order = data.draw(st.sampled_from(["<", ">"]))
    header = {"d": name, "s": shape, "o": order}
    result = decode_tensor(header, data.draw(payload_kinds(raw)))
    check_result(header, raw, result)
