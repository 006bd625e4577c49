"""Sealed records, sans-IO: round trips, byte-at-a-time decoding, rekeying, and
every kind of tampering refused with IntegrityError."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.errors import ConfigError, IntegrityError, RemoteProtocolError
from p2ptrain.wire.frames import Frame, FrameDecoder, FrameType, frame_header
from p2ptrain.wire.records import RecordKeys, RecordOpener, RecordSealer, rekey

A, B = bytes(range(32)), bytes(range(100, 132))


def sealer_and_decoder(**bounds: int) -> tuple[RecordSealer, FrameDecoder]:
    decoder = FrameDecoder(max_frame_bytes=1 << 22, max_header_bytes=1 << 16)
    decoder.start_records(RecordOpener(RecordKeys(send=B, receive=A, **bounds)))
    return RecordSealer(RecordKeys(send=A, receive=B, **bounds)), decoder


def sealed(sealer: RecordSealer, frame: Frame) -> bytes:
    head, payload = sealer.seal(frame_header(frame), memoryview(bytes(frame.payload)))
    return head + (bytes(payload) if payload is not None else b"")


def frames(count: int) -> list[Frame]:
    return [
        Frame(FrameType.DATA, 1 + 2 * i, 0, {"b": i}, os.urandom(i * 7000 % 70_001))
        for i in range(count)
    ]


def decode_all(decoder: FrameDecoder, data: bytes, step: int) -> list[Frame]:
    out = []
    for pos in range(0, len(data), step):
        decoder.feed(data[pos : pos + step])
        while (frame := decoder.next_frame()) is not None:
            out.append(frame)
    return out


@pytest.mark.parametrize("step", [1, 7, 65_536, 1 << 30])
def test_round_trip_in_any_chunking_with_rekeying(step: int) -> None:
    sealer, decoder = sealer_and_decoder(rekey_operations=4, rekey_bytes=50_000)
    sent = frames(12 if step > 1 else 4)
    wire = b"".join(sealed(sealer, f) for f in sent)
    got = decode_all(decoder, wire, step)
    assert [(f.stream_id, f.field("b"), bytes(f.payload)) for f in got] == [
        (f.stream_id, f.field("b"), bytes(f.payload)) for f in sent
    ]
    assert sum(f.wire_size for f in got) == len(wire)
    if len(sent) > 4:
        assert sealer.rekeys > 2  # the keys changed along the way, in step on both ends


def test_ciphertext_hides_header_and_payload() -> None:
    sealer, _ = sealer_and_decoder()
    frame = Frame(FrameType.OPEN, 1, 2, {"m": "a-secret-method-name"}, b"payload-bytes-here" * 10)
    wire = sealed(sealer, frame)
    assert b"a-secret-method-name" not in wire and b"payload-bytes-here" not in wire


def test_every_altered_byte_is_refused() -> None:
    frame = Frame(FrameType.DATA, 3, 0, {"b": "x"}, os.urandom(300))
    wire = sealed(sealer_and_decoder()[0], frame)
    for index in range(len(wire)):
        _, decoder = sealer_and_decoder()
        bad = bytearray(wire)
        bad[index] ^= 0x01
        delivered = []
        with pytest.raises(RemoteProtocolError):
            delivered = decode_all(decoder, bytes(bad) + bytes(64), 1 << 20)
            raise AssertionError(f"byte {index} altered and nothing noticed")
        assert not delivered


def test_replayed_reordered_dropped_and_injected_records_are_refused() -> None:
    sealer, _ = sealer_and_decoder()
    one, two, three = (sealed(sealer, f) for f in frames(3))
    injected = one[:8] + os.urandom(len(one) - 8)
    for name, wire in {
        "replay": one + one,
        "reorder": two + one,
        "drop": one + three,
        "inject": injected + one,
    }.items():
        _, decoder = sealer_and_decoder()
        with pytest.raises(IntegrityError):
            decode_all(decoder, wire, 1 << 20)
            raise AssertionError(name)


def test_a_failed_opener_stays_failed() -> None:
    opener = RecordOpener(RecordKeys(send=B, receive=A))
    with pytest.raises(IntegrityError):
        opener.open_header(bytes(8), bytes(32), has_payload=False)
    sealer = RecordSealer(RecordKeys(send=A, receive=B))
    head, _ = sealer.seal(frame_header(Frame(FrameType.PING, fields={"n": 1})), None)
    with pytest.raises(IntegrityError, match="already failed"):
        opener.open_header(head[:8], head[8:], has_payload=False)


def test_records_start_only_on_a_frame_boundary() -> None:
    decoder = FrameDecoder(max_frame_bytes=1 << 20)
    decoder.feed(b"\x00\x00\x00")  # a frame has begun
    with pytest.raises(RemoteProtocolError, match="before the handshake finished"):
        decoder.start_records(RecordOpener(RecordKeys(send=B, receive=A)))


def test_key_validation_and_rekey_derivation() -> None:
    with pytest.raises(ConfigError):
        RecordKeys(send=A, receive=A)
    with pytest.raises(ConfigError):
        RecordKeys(send=A[:16], receive=B)
    assert rekey(A) != A and len(rekey(A)) == 32 and rekey(A) == rekey(A)
    assert "secret" in repr(RecordKeys(send=A, receive=B))


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=400))
def test_random_bytes_never_decode(data: bytes) -> None:
    _, decoder = sealer_and_decoder()
    try:
        got = decode_all(decoder, data, 1 << 20)
    except RemoteProtocolError:
        return
    assert got == []  # not enough bytes for a record: nothing delivered


def test_deferred_payloads_open_later_and_in_place() -> None:
    """With defer_open_bytes, large payloads come out with a job (sealed with
    seal_later); small ones are opened by the decoder; next_frame() runs the job."""
    sealer, decoder = sealer_and_decoder(rekey_operations=4)
    decoder.defer_open_bytes = 60_000
    sent = frames(6)
    data = b""
    for frame in sent:
        if len(frame.payload) >= 60_000:
            head, buffer, job = sealer.seal_later(frame_header(frame), memoryview(frame.payload))
            job()
            data += head + bytes(buffer)
        else:
            data += sealed(sealer, frame)
    decoder.feed(data)
    got = []
    while (item := decoder.next_sealed()) is not None:
        frame, job = item
        assert (job is not None) == (len(sent[len(got)].payload) >= 60_000)
        if job is not None:
            frame.payload = job()
        got.append(frame)
    assert [bytes(f.payload) for f in got] == [bytes(f.payload) for f in sent]


def test_a_deferred_payload_that_was_altered_fails_its_job() -> None:
    sealer, decoder = sealer_and_decoder()
    decoder.defer_open_bytes = 1024
    first, second = (Frame(FrameType.DATA, 1, 0, {}, os.urandom(4096)) for _ in range(2))
    data = bytearray(sealed(sealer, first))
    data[-100] ^= 1
    decoder.feed(bytes(data) + sealed(sealer, second))
    _frame, job = decoder.next_sealed() or (None, None)
    assert job is not None
    with pytest.raises(IntegrityError):
        job()
    with pytest.raises(IntegrityError):  # the opener is spent
        decoder.feed(sealed(sealer, second))
