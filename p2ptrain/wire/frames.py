"""Frames: the unit every p2ptrain connection carries.

Theory of operation
-------------------
A connection is a sequence of frames. Each frame is::

    +-----------------+-----------------+------------------+-------------------+
    | length (u32 BE) | hlen (u32 BE)   | header (msgpack) | payload (raw)     |
    +-----------------+-----------------+------------------+-------------------+
                      |<------------------ length bytes ------------------->|

``length`` counts everything after itself, ``hlen`` the header bytes. The
header is a msgpack array ``[type, stream_id, flags, fields]`` and the payload
is whatever raw bytes are left (tensor data; never pickled).

:class:`FrameDecoder` is sans-IO: feed it bytes with :meth:`FrameDecoder.feed`
and take complete frames with :meth:`FrameDecoder.next_frame`. It checks
``length`` and ``hlen`` against its limits as soon as the 8-byte prefix has
arrived, before buffering anything else, so a peer announcing a 4 GB frame is
refused without allocating it. A large payload is copied once, from the bytes
given to ``feed`` straight into a buffer of its final size.

After the handshake, frames travel sealed (:mod:`p2ptrain.wire.records`):
the decoder is given a :class:`~p2ptrain.wire.records.RecordOpener` with
:meth:`FrameDecoder.start_records`, the prefix keeps its meaning, and the
header and payload are authenticated and decrypted before a frame is built.
The size limits apply to the plaintext frame (the 32 bytes of tags are not
counted against them). With :attr:`FrameDecoder.defer_open_bytes` set, a
payload at least that large is not opened by the decoder: the frame comes
out of :meth:`FrameDecoder.next_sealed` with an
:data:`~p2ptrain.wire.records.OpenJob` that its receiver runs (on a worker
thread) before it uses the frame or any frame after it.

Any violation raises a :class:`~p2ptrain.errors.RemoteProtocolError`; the
decoder is then unusable and the connection must be closed.
"""

from __future__ import annotations

import enum
import struct
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from p2ptrain.errors import (
    ConfigError,
    FrameTooLargeError,
    LocalProtocolError,
    RemoteProtocolError,
)
from p2ptrain.wire.buffers import default_pool
from p2ptrain.wire.records import RECORD_OVERHEAD, TAG_BYTES, OpenJob, RecordOpener

__all__ = [
    "FLAG_END",
    "FLAG_MESSAGE",
    "PREFIX",
    "Buffer",
    "Frame",
    "FrameDecoder",
    "FrameType",
    "PayloadAllocator",
    "buffer_nbytes",
    "encode_frame",
    "frame_header",
    "pack_body",
    "unpack_body",
]

Buffer = bytes | bytearray | memoryview
PayloadAllocator = Callable[["Frame", int], memoryview | None]
"""``(frame, nbytes)`` → where the payload of ``frame`` (fields parsed, payload not
yet received) goes: a writable byte buffer of exactly ``nbytes``, or None for a
fresh buffer. It runs while bytes are being decoded, so it must be quick and
must not raise. Lets a receiver land a payload straight in its final place."""

PREFIX = struct.Struct(">II")
_MAX_STREAM_ID = 2**32 - 1
_MAX_FLAGS = 0xFFFF

FLAG_END = 0x1
"""On OPEN or DATA: the sender sends nothing more on this stream (half-close)."""

FLAG_MESSAGE = 0x2
"""On OPEN: the frame also carries the stream's first message (``b`` and payload)."""


class FrameType(enum.IntEnum):
    """Frame types. Handshake frames come first on a connection, then the rest."""

    HELLO = 1
    AUTH = 2
    REFUSE = 3
    ACCEPT = 4
    OPEN = 16
    DATA = 17
    END = 18
    RESET = 19
    WINDOW = 20
    PING = 32
    PONG = 33
    GOAWAY = 34


_TYPES_BY_VALUE: dict[int, FrameType] = {int(t): t for t in FrameType}
_LARGE_PAYLOAD = 64 * 1024


@dataclass(slots=True)
class Frame:
    """One decoded or to-be-encoded frame."""

    type: FrameType
    stream_id: int = 0
    flags: int = 0
    fields: Mapping[str, Any] | None = None
    payload: Buffer = b""
    wire_size: int = 0
    """Bytes the frame took on the wire (set by the decoder)."""

    @property
    def ends_stream(self) -> bool:
        """Whether the sender half-closes the stream with this frame."""
        return bool(self.flags & FLAG_END)

    def field(self, name: str, default: Any = None) -> Any:
        """A header field, or ``default`` when absent."""
        if self.fields is None:
            return default
        return self.fields.get(name, default)


def buffer_nbytes(buf: Buffer) -> int:
    """Size in bytes of a bytes-like object (a memoryview may have wide items)."""
    return buf.nbytes if isinstance(buf, memoryview) else len(buf)


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not allowed")


def pack_body(obj: Any) -> bytes:
    """Encode a message body with msgpack (bin and str types kept apart)."""
    try:
        return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]
    except (TypeError, ValueError, OverflowError) as exc:
        raise LocalProtocolError(f"cannot encode message body: {exc}") from exc


def unpack_body(data: Buffer, *, max_bytes: int) -> Any:
    """Decode a msgpack body from the network, refusing extensions and huge input."""
    if len(data) > max_bytes:
        raise FrameTooLargeError(f"message body of {len(data)} bytes exceeds {max_bytes}")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            ext_hook=_reject_ext,
            timestamp=0,
        )
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as exc:
        raise RemoteProtocolError(f"malformed msgpack: {exc}") from exc


def frame_header(frame: Frame) -> bytes:
    """The msgpack header of ``frame`` (checked: stream id and flags in range)."""
    if frame.stream_id < 0 or frame.stream_id > _MAX_STREAM_ID:
        raise LocalProtocolError(f"stream id {frame.stream_id} out of range")
    if not 0 <= frame.flags <= _MAX_FLAGS:
        raise LocalProtocolError(f"flags {frame.flags:#x} do not fit in 16 bits")
    return pack_body([int(frame.type), frame.stream_id, frame.flags, dict(frame.fields or {})])


def encode_frame(frame: Frame) -> tuple[bytes, Buffer]:
    """Encode a frame as (prefix + header, payload), ready for ``writelines``.

    The payload is not copied.
    """
    header = frame_header(frame)
    payload = frame.payload
    payload_len = buffer_nbytes(payload)
    length = PREFIX.size - 4 + len(header) + payload_len
    if length > 0xFFFFFFFF:
        raise LocalProtocolError(f"frame of {length} bytes cannot be encoded")
    return PREFIX.pack(length, len(header)) + header, payload


def _parse_header(header: Any) -> tuple[FrameType, int, int, dict[str, Any]]:
    if not isinstance(header, list) or len(header) != 4:
        raise RemoteProtocolError("frame header must be an array of 4 items")
    ftype, stream_id, flags, fields = header
    if not isinstance(ftype, int) or isinstance(ftype, bool):
        raise RemoteProtocolError("frame type must be an integer")
    frame_type = _TYPES_BY_VALUE.get(ftype)
    if frame_type is None:
        raise RemoteProtocolError(f"unknown frame type {ftype}")
    if not isinstance(stream_id, int) or isinstance(stream_id, bool):
        raise RemoteProtocolError("stream id must be an integer")
    if not 0 <= stream_id <= _MAX_STREAM_ID:
        raise RemoteProtocolError(f"stream id {stream_id} out of range")
    if not isinstance(flags, int) or isinstance(flags, bool) or not 0 <= flags <= _MAX_FLAGS:
        raise RemoteProtocolError("frame flags must be a 16-bit integer")
    if not isinstance(fields, dict) or not all(isinstance(k, str) for k in fields):
        raise RemoteProtocolError("frame fields must be a map with string keys")
    return frame_type, stream_id, flags, fields


class FrameDecoder:
    """Incremental, sans-IO frame decoder.

    Args:
        max_frame_bytes: largest whole frame accepted (``length`` + 4 bytes).
        max_header_bytes: largest msgpack header accepted.
    """

    def __init__(self, *, max_frame_bytes: int, max_header_bytes: int = 1 << 20) -> None:
        if max_frame_bytes < PREFIX.size:
            raise ConfigError("max_frame_bytes is too small")
        if not 0 < max_header_bytes <= max_frame_bytes:
            raise ConfigError("max_header_bytes must be in (0, max_frame_bytes]")
        self.max_frame_bytes = max_frame_bytes
        self.max_header_bytes = max_header_bytes
        self._pending = bytearray()  # prefix and header bytes not yet parsed
        self._frames: deque[tuple[Frame, OpenJob | None]] = deque()
        self._partial: Frame | None = None  # header parsed, payload being filled
        self._payload: memoryview | None = None
        self._filled = 0
        self._failed: RemoteProtocolError | None = None
        self.bytes_received = 0
        self.payload_allocator: PayloadAllocator | None = None
        """Picks the buffer a frame's payload is received into (see :data:`PayloadAllocator`)."""
        self._opener: RecordOpener | None = None
        self._overhead = 0  # tag bytes a record adds to a frame (0 before records start)
        self._prefix = b""  # the current record's prefix (its associated data)
        self._tag: bytearray | None = None  # a payload's tag being received
        self._tag_inline = False  # the payload buffer holds ciphertext and tag
        self.defer_open_bytes: int | None = None
        """Sealed payloads at least this large are opened by the receiver (see
        :meth:`next_sealed`); None: the decoder opens every payload itself."""

    @property
    def records(self) -> bool:
        """Whether frames arrive sealed (:meth:`start_records` was called)."""
        return self._opener is not None

    def start_records(self, opener: RecordOpener) -> None:
        """Open every frame from the next byte on with ``opener``.

        Raises:
            RemoteProtocolError: bytes of a next frame are already buffered;
                the handshake never lets a peer send ahead, so they were
                injected.
        """
        if self._pending or self._payload is not None or self._frames:
            raise RemoteProtocolError("unexpected bytes before the handshake finished")
        self._opener = opener
        self._overhead = RECORD_OVERHEAD

    @property
    def buffered_bytes(self) -> int:
        """Bytes held for frames not yet complete."""
        return len(self._pending) + self._filled + (len(self._tag) if self._tag else 0)

    def feed(self, data: Buffer) -> None:
        """Add bytes from the network. Raises RemoteProtocolError on bad input."""
        if self._failed is not None:
            raise self._failed
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        self.bytes_received += len(view)
        try:
            self._consume(view)
        except RemoteProtocolError as exc:
            self._failed = exc
            raise

    def next_frame(self) -> Frame | None:
        """The next complete frame, or None if more bytes are needed.

        A payload left to open (:attr:`defer_open_bytes`) is opened here.

        Raises:
            IntegrityError: that payload failed authentication.
        """
        item = self.next_sealed()
        if item is None:
            return None
        frame, job = item
        if job is not None:
            frame.payload = job()
        return frame

    def next_sealed(self) -> tuple[Frame, OpenJob | None] | None:
        """The next complete frame and the job that opens its payload, if left to the caller.

        With a job, ``frame.payload`` is the buffer the job decrypts in place
        (its plaintext view on success). Until the job has returned, neither
        this frame nor any later one may be used: they stand behind a record
        that is not yet authenticated.
        """
        if self._frames:
            return self._frames.popleft()
        return None

    def _consume(self, view: memoryview) -> None:
        pos, end = 0, len(view)
        while pos < end:
            if self._tag is not None:
                take = min(TAG_BYTES - len(self._tag), end - pos)
                self._tag += view[pos : pos + take]
                pos += take
                self._complete_payload_if_full()
                continue
            if self._payload is not None:
                pos = self._fill_payload(view, pos)
                continue
            # Accumulate prefix + header in _pending; parse it when complete.
            need = self._header_bytes_needed()
            take = min(need - len(self._pending), end - pos)
            self._pending += view[pos : pos + take]
            pos += take
            if len(self._pending) == need:
                self._parse_pending()

    def _header_bytes_needed(self) -> int:
        if len(self._pending) < PREFIX.size:
            return PREFIX.size
        _length, hlen = PREFIX.unpack_from(self._pending)
        return PREFIX.size + hlen if hlen else PREFIX.size

    def _parse_pending(self) -> None:
        length, hlen = PREFIX.unpack_from(self._pending)
        if len(self._pending) == PREFIX.size:
            self._check_prefix(length, hlen)
            if hlen:
                return  # now wait for the header bytes
        header_bytes = bytes(self._pending[PREFIX.size :])
        prefix = bytes(self._pending[: PREFIX.size])
        self._pending.clear()
        payload_len = length - 4 - hlen
        if self._opener is not None:
            if payload_len and payload_len <= TAG_BYTES:
                raise RemoteProtocolError("a record's payload is shorter than its tag")
            header_bytes = self._opener.open_header(
                prefix, header_bytes, has_payload=payload_len > 0
            )
            payload_len = max(0, payload_len - TAG_BYTES)
            self._prefix = prefix
        ftype, stream_id, flags, fields = _parse_header(
            unpack_body(header_bytes, max_bytes=self.max_header_bytes)
        )
        frame = Frame(ftype, stream_id, flags, fields, b"", length + 4)
        if payload_len == 0:
            self._frames.append((frame, None))
            return
        self._partial = frame
        self._payload = self._payload_buffer(frame, payload_len)
        if self._opener is not None and self._payload is None:
            # No place was asked for: ciphertext and tag land in one buffer,
            # opened in place in one call.
            self._payload = _allocate(payload_len + TAG_BYTES)
            self._tag_inline = True
        elif self._payload is None:
            self._payload = _allocate(payload_len)
        self._filled = 0

    def _payload_buffer(self, frame: Frame, nbytes: int) -> memoryview | None:
        allocator = self.payload_allocator
        if allocator is not None:
            buffer = allocator(frame, nbytes)
            # Only a writable, flat byte buffer of exactly the payload's size is used.
            if (
                buffer is not None
                and not buffer.readonly
                and buffer.format == "B"
                and buffer.contiguous
                and buffer.nbytes == nbytes
            ):
                return buffer
        return None

    def _check_prefix(self, length: int, hlen: int) -> None:
        if length + 4 - self._overhead > self.max_frame_bytes:
            raise FrameTooLargeError(
                f"frame of {length + 4} bytes exceeds the limit of {self.max_frame_bytes}"
            )
        if hlen <= self._overhead // 2:
            raise RemoteProtocolError("frame has an empty header")
        if hlen - self._overhead // 2 > self.max_header_bytes:
            raise FrameTooLargeError(
                f"frame header of {hlen} bytes exceeds the limit of {self.max_header_bytes}"
            )
        if hlen > length - 4:
            raise RemoteProtocolError(f"header length {hlen} exceeds frame length {length}")

    def payload_tail(self) -> memoryview | None:
        """The unfilled part of a large payload being received, or None.

        A transport may read straight into it and then call
        :meth:`payload_written`, which saves a copy of every payload byte.
        """
        if self._payload is None or self._failed is not None:
            return None
        return self._payload[self._filled :]

    def payload_written(self, nbytes: int) -> None:
        """Account for ``nbytes`` written into :meth:`payload_tail`."""
        if self._payload is None or not 0 <= nbytes <= len(self._payload) - self._filled:
            raise ValueError("payload_written() does not match payload_tail()")
        self.bytes_received += nbytes
        self._filled += nbytes
        try:
            self._complete_payload_if_full()
        except RemoteProtocolError as exc:
            self._failed = exc
            raise

    def _fill_payload(self, view: memoryview, pos: int) -> int:
        payload = self._payload
        if payload is None:  # pragma: no cover - guarded by caller
            raise RuntimeError("decoder state corrupted")
        take = min(len(payload) - self._filled, len(view) - pos)
        payload[self._filled : self._filled + take] = view[pos : pos + take]
        self._filled += take
        self._complete_payload_if_full()
        return pos + take

    def _complete_payload_if_full(self) -> None:
        frame, payload = self._partial, self._payload
        if frame is None or payload is None or self._filled < len(payload):
            return
        job: OpenJob | None = None
        opener = self._opener
        if self._tag_inline:
            self._tag_inline = False
            if opener is None:  # pragma: no cover - inline only with records
                raise RuntimeError("decoder state corrupted")
            if self._defer(len(payload) - TAG_BYTES):
                job = opener.open_later(self._prefix, payload, None)
            else:
                payload = opener.open_payload_inline(self._prefix, payload)
        elif opener is not None:
            if self._tag is None:
                self._tag = bytearray()  # the ciphertext is in: now its tag
                return
            if len(self._tag) < TAG_BYTES:
                return
            tag, self._tag = bytes(self._tag), None
            if self._defer(len(payload)):
                job = opener.open_later(self._prefix, payload, tag)
            else:
                opener.open_payload(self._prefix, payload, tag)
        frame.payload = payload
        self._frames.append((frame, job))
        self._partial = None
        self._payload = None
        self._filled = 0

    def _defer(self, nbytes: int) -> bool:
        return self.defer_open_bytes is not None and nbytes >= self.defer_open_bytes


def _allocate(nbytes: int) -> memoryview:
    """A writable buffer for a payload; large ones come from the recycling pool."""
    if nbytes < _LARGE_PAYLOAD:
        return memoryview(bytearray(nbytes))
    return default_pool.get(nbytes)
