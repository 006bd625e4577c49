"""The frame codec: golden bytes, incremental decoding, limits, fuzzing."""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.errors import FrameTooLargeError, LocalProtocolError, RemoteProtocolError
from p2ptrain.wire.frames import (
    FLAG_END,
    Frame,
    FrameDecoder,
    FrameType,
    encode_frame,
    pack_body,
    unpack_body,
)

LIMIT = 1 << 20


def encode(frame: Frame) -> bytes:
    head, payload = encode_frame(frame)
    return head + bytes(payload)


def decode_all(data: bytes, *, chunk: int | None = None) -> list[Frame]:
    decoder = FrameDecoder(max_frame_bytes=LIMIT)
    frames = []
    step = chunk or max(1, len(data))
    for i in range(0, len(data), step):
        decoder.feed(data[i : i + step])
        while (frame := decoder.next_frame()) is not None:
            frames.append(frame)
    return frames


def test_golden_bytes() -> None:
    frame = Frame(FrameType.DATA, 3, FLAG_END, {"b": 7}, b"xyz")
    header = bytes([0x94, 17, 3, 1, 0x81, 0xA1, ord("b"), 7])
    expected = struct.pack(">II", 4 + len(header) + 3, len(header)) + header + b"xyz"
    assert encode(frame) == expected
    (decoded,) = decode_all(expected)
    assert (decoded.type, decoded.stream_id, decoded.flags) == (FrameType.DATA, 3, FLAG_END)
    assert decoded.fields == {"b": 7}
    assert bytes(decoded.payload) == b"xyz"
    assert decoded.wire_size == len(expected)


def test_one_byte_at_a_time_gives_the_same_frames() -> None:
    frames = [
        Frame(FrameType.OPEN, 1, 0, {"m": "echo", "d": 500}),
        Frame(FrameType.DATA, 1, 0, {"b": {"nested": [1, 2.5, "x", b"y"]}}, b"\x00" * 1000),
        Frame(FrameType.WINDOW, 1, 0, {"n": 4096}),
        Frame(FrameType.PING, 0, 0, None),
    ]
    data = b"".join(encode(f) for f in frames)
    decoded = decode_all(data, chunk=1)
    assert [(f.type, f.stream_id, dict(f.fields or {})) for f in decoded] == [
        (f.type, f.stream_id, dict(f.fields or {})) for f in frames
    ]
    assert bytes(decoded[1].payload) == b"\x00" * 1000


def test_oversized_length_is_refused_from_the_prefix_alone() -> None:
    decoder = FrameDecoder(max_frame_bytes=LIMIT)
    with pytest.raises(FrameTooLargeError, match="exceeds the limit"):
        decoder.feed(struct.pack(">II", 3_000_000_000, 10))
    # Nothing of the announced size was buffered, and the decoder stays failed.
    assert decoder.buffered_bytes <= 8
    with pytest.raises(FrameTooLargeError):
        decoder.feed(b"more")


def test_oversized_header_is_refused() -> None:
    decoder = FrameDecoder(max_frame_bytes=LIMIT, max_header_bytes=1024)
    with pytest.raises(FrameTooLargeError, match="header"):
        decoder.feed(struct.pack(">II", 5000, 4000))


def test_header_longer_than_frame_is_refused() -> None:
    with pytest.raises(RemoteProtocolError, match="header length"):
        FrameDecoder(max_frame_bytes=LIMIT).feed(struct.pack(">II", 10, 20))


def test_truncated_frame_yields_nothing() -> None:
    data = encode(Frame(FrameType.DATA, 1, 0, {"b": 1}, b"p" * 100))
    decoder = FrameDecoder(max_frame_bytes=LIMIT)
    decoder.feed(data[:-1])
    assert decoder.next_frame() is None
    decoder.feed(data[-1:])
    frame = decoder.next_frame()
    assert frame is not None
    assert bytes(frame.payload) == b"p" * 100


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ({"not": "a list"}, "array of 4"),
        ([17, 1, 0], "array of 4"),
        ([99, 1, 0, {}], "unknown frame type 99"),
        (["x", 1, 0, {}], "frame type must be an integer"),
        ([17, -1, 0, {}], "stream id"),
        ([17, 2**40, 0, {}], "out of range"),
        ([17, 1, 1 << 20, {}], "flags"),
        ([17, 1, 0, []], "fields must be a map"),
        ([17, 1, 0, {1: 2}], "map key"),
    ],
)
def test_wrong_shapes_are_protocol_errors(header: object, message: str) -> None:
    body = msgpack.packb(header, use_bin_type=True, strict_types=False)
    data = struct.pack(">II", 4 + len(body), len(body)) + body
    with pytest.raises(RemoteProtocolError, match=message):
        FrameDecoder(max_frame_bytes=LIMIT).feed(data)


def test_garbage_header_is_a_protocol_error() -> None:
    junk = b"\xc1\xc1\xc1\xc1"  # 0xc1 is never valid msgpack
    with pytest.raises(RemoteProtocolError, match="malformed msgpack"):
        FrameDecoder(max_frame_bytes=LIMIT).feed(struct.pack(">II", 8, 4) + junk)


def test_msgpack_extensions_are_refused() -> None:
    ext = msgpack.packb([17, 1, 0, {"b": msgpack.ExtType(5, b"x")}])
    with pytest.raises(RemoteProtocolError, match="extension"):
        FrameDecoder(max_frame_bytes=LIMIT).feed(struct.pack(">II", 4 + len(ext), len(ext)) + ext)


def test_unencodable_body_is_a_local_error() -> None:
    with pytest.raises(LocalProtocolError):
        encode(Frame(FrameType.DATA, 1, 0, {"b": object()}))
    with pytest.raises(LocalProtocolError):
        encode(Frame(FrameType.DATA, -1, 0, None))


def test_unpack_body_limit() -> None:
    with pytest.raises(FrameTooLargeError):
        unpack_body(pack_body("x" * 100), max_bytes=10)


frame_types = st.sampled_from(list(FrameType))
msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
frames_strategy = st.builds(
    Frame,
    frame_types,
    st.integers(0, 2**32 - 1),
    st.integers(0, 0xFFFF),
    st.dictionaries(st.text(max_size=8), msgpack_values, max_size=4),
    st.binary(max_size=300),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(frames_strategy, min_size=1, max_size=5), st.integers(1, 64))
def test_round_trip_any_split(frames: list[Frame], chunk: int) -> None:
    data = b"".join(encode(f) for f in frames)
    decoded = decode_all(data, chunk=chunk)
    assert len(decoded) == len(frames)
    for sent, got in zip(frames, decoded, strict=True):
        assert (got.type, got.stream_id, got.flags) == (sent.type, sent.stream_id, sent.flags)
        assert got.fields == sent.fields
        assert bytes(got.payload) == bytes(sent.payload)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=400), st.integers(1, 50))
def test_fuzz_arbitrary_bytes_only_raise_protocol_errors(data: bytes, chunk: int) -> None:
    decoder = FrameDecoder(max_frame_bytes=4096, max_header_bytes=1024)
    try:
        for i in range(0, len(data), chunk):
            decoder.feed(data[i : i + chunk])
            while decoder.next_frame() is not None:
                pass
    except RemoteProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(frames_strategy, st.integers(0, 200), st.binary(min_size=1, max_size=8))
def test_fuzz_corrupted_valid_frames(frame: Frame, position: int, noise: bytes) -> None:
    data = bytearray(encode(frame))
    pos = position % len(data)
    data[pos : pos + len(noise)] = noise
    decoder = FrameDecoder(max_frame_bytes=1 << 16, max_header_bytes=1 << 12)
    try:
        decoder.feed(bytes(data))
        while (got := decoder.next_frame()) is not None:
            assert isinstance(got.type, FrameType)
    except RemoteProtocolError:
        pass
