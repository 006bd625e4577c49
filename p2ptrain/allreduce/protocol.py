"""The messages of the butterfly all-reduce, as pure encode / parse functions.

One RPC stream, method :data:`METHOD`, runs from every sender to every reducer
(a member that owns a non-empty part). On it, in order:

* sender → reducer: a :class:`Hello`, then one part message per chunk of the
  reducer's part (none when the sender's weight is 0), then, once every
  result arrived, a :class:`TimingAck` that ends the sender's half of the
  stream (with no chunks at all, the hello ends it);
* reducer → sender: one result message per chunk, in chunk order, as soon as
  that chunk is reduced; the last one carries how the reducer timed the
  sender's parts.

The timings (payload bytes, seconds in flight, on the receiver's clock) let
each peer learn its upload rate where its bytes arrive
(:mod:`p2ptrain.measure.estimates`).

Bodies are msgpack maps with short keys; tensor data travels as the raw
payload of a message, encoded by a codec of
:mod:`p2ptrain.allreduce.compression`. Everything received is untrusted:
parsers raise :class:`~p2ptrain.errors.RemoteProtocolError` (or its subclass
:class:`~p2ptrain.errors.TensorFormatError`) and nothing else. The full
specification is in docs/allreduce.md.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import torch

from p2ptrain.allreduce.compression import (
    CODEC_NAMES,
    KEY_BLOCK_SIZE,
    KEY_CODEC,
    MAX_BLOCK_SIZE,
    Codec,
    Int8BlockCodec,
    get_codec,
)
from p2ptrain.errors import RemoteProtocolError, TensorFormatError
from p2ptrain.wire.tensors import short_repr

__all__ = [
    "MAX_REASON",
    "METHOD",
    "Hello",
    "PartHeader",
    "ResultHeader",
    "TimingAck",
    "codec_for",
    "decode_values",
    "parse_part",
    "parse_result",
    "parse_timing",
]

METHOD: Final = "allreduce/v1"
"""The RPC method of the sender → reducer stream."""
MAX_REASON: Final = 200
"""Longest exclusion reason carried in a result message (characters)."""
_MAX_ROUND_ID = 64
_DIGEST_BYTES = 32

_codecs: dict[tuple[str, int], Codec] = {}


def codec_for(name: str, block_size: int) -> Codec:
    """A shared codec instance for ``name`` (``block_size`` matters for int8 only)."""
    key = (name, block_size if name == Int8BlockCodec.name else 0)
    codec = _codecs.get(key)
    if codec is None:
        codec = _codecs[key] = get_codec(name, block_size=block_size)
    return codec


def _int(value: object, what: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise RemoteProtocolError(
            f"{what} must be an int in [{low}, {high}], got {short_repr(value)}"
        )
    return value


def _map(
    body: object, what: str, required: set[str], optional: frozenset[str]
) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise RemoteProtocolError(f"{what} must be a map, got {type(body).__name__}")
    keys = set(body)
    if not required <= keys <= required | optional:
        raise RemoteProtocolError(
            f"{what} keys must be {sorted(required)} (optionally {sorted(optional)}), "
            f"got {sorted(map(short_repr, keys))}"
        )
    return body


@dataclass(frozen=True, slots=True)
class Hello:
    """The first message of a sender: which round, under which plan, with what weight.

    Attributes:
        round_id: The round's id.
        plan_digest: :attr:`GroupPlan.digest` of the sender's plan.
        weight: The sender's averaging weight (samples it contributed); 0
            means it sends no parts but wants the averages.
        codec: The codec the sender wants its averages in.
        block_size: The int8 block size for those averages.
    """

    round_id: bytes
    plan_digest: bytes
    weight: float
    codec: str
    block_size: int

    def to_body(self) -> dict[str, Any]:
        """The message body."""
        return {
            "r": self.round_id,
            "g": self.plan_digest,
            "w": float(self.weight),
            "c": self.codec,
            "k": self.block_size,
        }

    @classmethod
    def parse(cls, body: object) -> Hello:
        """Validate a received hello body."""
        data = _map(body, "hello", {"r", "g", "w", "c", "k"}, frozenset())
        round_id, digest, weight = data["r"], data["g"], data["w"]
        if not isinstance(round_id, bytes) or not 0 < len(round_id) <= _MAX_ROUND_ID:
            raise RemoteProtocolError(f"round id must be 1 to {_MAX_ROUND_ID} bytes")
        if not isinstance(digest, bytes) or len(digest) != _DIGEST_BYTES:
            raise RemoteProtocolError(f"plan digest must be {_DIGEST_BYTES} bytes")
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise RemoteProtocolError(f"weight must be a number, got {short_repr(weight)}")
        if not math.isfinite(weight) or weight < 0:
            raise RemoteProtocolError(f"weight must be finite and >= 0, got {short_repr(weight)}")
        codec = data["c"]
        if not isinstance(codec, str) or codec not in CODEC_NAMES:
            raise RemoteProtocolError(f"unknown codec {short_repr(codec)}")
        block = _int(data["k"], "block size", 1, MAX_BLOCK_SIZE)
        return cls(round_id, digest, float(weight), codec, block)


@dataclass(frozen=True, slots=True)
class PartHeader:
    """The body of a part message: a chunk index and its codec header.

    Attributes:
        chunk: Index of the chunk within the reducer's part.
        codec_header: The codec's header for the payload.
    """

    chunk: int
    codec_header: Mapping[str, Any]

    def to_body(self) -> dict[str, Any]:
        """The message body."""
        return {"i": self.chunk, "h": self.codec_header}


def parse_part(body: object, *, num_chunks: int) -> PartHeader:
    """Validate a received part body (the payload is checked when decoded)."""
    data = _map(body, "part", {"i", "h"}, frozenset())
    chunk = _int(data["i"], "chunk index", 0, max(num_chunks - 1, 0))
    header = data["h"]
    if not isinstance(header, Mapping):
        raise RemoteProtocolError("a part's codec header must be a map")
    return PartHeader(chunk, header)


@dataclass(frozen=True, slots=True)
class ResultHeader:
    """The body of a result message: one reduced chunk and who made it.

    Attributes:
        chunk: Index of the chunk within the reducer's part.
        contributors: Member indices whose parts are in the average, sorted.
            Empty when nobody contributed: then there is no payload and the
            receiver keeps its local values for the chunk.
        excluded: ``(member index, reason)`` of each sender the reducer left
            out for the first time while reducing this chunk.
        codec_header: The codec's header for the payload; None when empty.
        timing: On the last result only: the sender's part bytes and the
            seconds they were in flight, as the reducer timed them.
    """

    chunk: int
    contributors: tuple[int, ...]
    excluded: tuple[tuple[int, str], ...] = ()
    codec_header: Mapping[str, Any] | None = None
    timing: tuple[int, float] | None = None

    def to_body(self) -> dict[str, Any]:
        """The message body."""
        body: dict[str, Any] = {"i": self.chunk, "x": list(self.contributors)}
        if self.excluded:
            body["e"] = [[index, reason[:MAX_REASON]] for index, reason in self.excluded]
        if self.codec_header is not None:
            body["h"] = self.codec_header
        if self.timing is not None:
            body["t"] = [self.timing[0], float(self.timing[1])]
        return body


def parse_result(body: object, *, num_chunks: int, group_size: int) -> ResultHeader:
    """Validate a received result body (the payload is checked when decoded)."""
    data = _map(body, "result", {"i", "x"}, frozenset({"e", "h", "t"}))
    chunk = _int(data["i"], "chunk index", 0, max(num_chunks - 1, 0))
    raw = data["x"]
    if not isinstance(raw, list) or len(raw) > group_size:
        raise RemoteProtocolError("contributors must be a list of member indices")
    contributors = tuple(_int(i, "contributor", 0, group_size - 1) for i in raw)
    if any(a >= b for a, b in itertools.pairwise(contributors)):
        raise RemoteProtocolError("contributors must be sorted and distinct")
    excluded: list[tuple[int, str]] = []
    raw_excluded = data.get("e", [])
    if not isinstance(raw_excluded, list) or len(raw_excluded) > group_size:
        raise RemoteProtocolError("exclusions must be a list")
    for item in raw_excluded:
        if not isinstance(item, list) or len(item) != 2 or not isinstance(item[1], str):
            raise RemoteProtocolError(f"bad exclusion {short_repr(item)}")
        excluded.append((_int(item[0], "excluded member", 0, group_size - 1), item[1][:MAX_REASON]))
    header = data.get("h")
    if contributors and not isinstance(header, Mapping):
        raise RemoteProtocolError("a result with contributors needs a codec header")
    if not contributors and header is not None:
        raise RemoteProtocolError("a result without contributors carries no values")
    timing = _timing(data["t"]) if "t" in data else None
    return ResultHeader(chunk, contributors, tuple(excluded), header, timing)


_MAX_TIMED_BYTES = 1 << 50
_MAX_TIMED_SECONDS = 1e6


def _timing(value: object) -> tuple[int, float]:
    if not isinstance(value, list) or len(value) != 2:
        raise RemoteProtocolError(f"a timing must be [bytes, seconds], got {short_repr(value)}")
    nbytes = _int(value[0], "timed bytes", 0, _MAX_TIMED_BYTES)
    seconds = value[1]
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise RemoteProtocolError(f"timed seconds must be a number, got {short_repr(seconds)}")
    if not (math.isfinite(seconds) and 0 <= seconds <= _MAX_TIMED_SECONDS):
        raise RemoteProtocolError(f"timed seconds out of range: {short_repr(seconds)}")
    return nbytes, float(seconds)


@dataclass(frozen=True, slots=True)
class TimingAck:
    """The sender's last message: how it timed the reducer's results (no payload).

    Attributes:
        nbytes: Result payload bytes received from the reducer.
        seconds: Seconds they were in flight, on the sender's clock.
    """

    nbytes: int
    seconds: float

    def to_body(self) -> dict[str, Any]:
        """The message body."""
        return {"t": [self.nbytes, float(self.seconds)]}


def parse_timing(body: object) -> TimingAck | None:
    """The :class:`TimingAck` in ``body``, or None when ``body`` is not one (a part, say)."""
    if not isinstance(body, Mapping) or "t" not in body:
        return None
    data = _map(body, "timing", {"t"}, frozenset())
    return TimingAck(*_timing(data["t"]))


def decode_values(
    header: Mapping[str, Any], payload: bytes | bytearray | memoryview, numel: int
) -> torch.Tensor:
    """Decode a part or result payload of exactly ``numel`` float32 values.

    The codec is the one the header names; a writable payload may be shared
    (codec ``none``).

    Raises:
        TensorFormatError: Unknown codec, bad header, wrong size.
    """
    if not isinstance(header, Mapping):
        raise TensorFormatError(f"a codec header must be a map, got {type(header).__name__}")
    name = header.get(KEY_CODEC)
    if not isinstance(name, str) or name not in CODEC_NAMES:
        raise TensorFormatError(f"unknown codec {short_repr(name)}")
    block = header.get(KEY_BLOCK_SIZE, 1) if name == Int8BlockCodec.name else 1
    if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= MAX_BLOCK_SIZE:
        raise TensorFormatError(f"bad int8 block size {short_repr(block)}")
    return codec_for(name, block).decode(header, payload, numel=numel)
