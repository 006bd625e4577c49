"""Serving and downloading training state: the ``train.state`` stream.

A late joiner, or a peer that fell behind, downloads a
:class:`~p2ptrain.train.state.TrainingSnapshot` from a peer that is ahead.

Protocol (one stream, messages are msgpack bodies with optional raw payloads):

1. client → ``{"v": 1}`` and half-close;
2. server → head ``{"v": 1, "step": int, "skeleton": <skeleton>,
   "tensors": [<tensor header>, ...]}`` (see :mod:`p2ptrain.train.state`
   and :mod:`p2ptrain.wire.tensors`);
3. server → the tensors' bytes in order, in chunks of at most
   ``chunk_bytes``: body ``{"i": tensor index, "o": byte offset}``, payload
   the bytes; empty tensors have no chunk;
4. server → tail ``{"sha256": <32 bytes>}`` and half-close.

The digest is SHA-256 over ``msgpack([step, skeleton, tensors])`` followed by
every payload byte in order; the client recomputes it and refuses a state
whose digest differs. Everything from the server is untrusted: chunks must
come in order and fit their tensor, and the total size is capped
(``max_bytes``) before anything is allocated.

A server takes its snapshot in a worker thread (the trainer's lock may be
held by the training thread for an optimizer step) and serves at most
``max_concurrent`` downloads at once; more are refused with
``resource_exhausted`` so the client tries another peer.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import torch

from p2ptrain.errors import (
    ConfigError,
    InvalidArgumentError,
    P2PTrainError,
    RemoteProtocolError,
    ResourceExhaustedError,
    StateSyncError,
    StreamEndedError,
)
from p2ptrain.node.address import PeerAddress
from p2ptrain.node.node import Node
from p2ptrain.rpc.handlers import CallContext
from p2ptrain.rpc.stream import RPCStream
from p2ptrain.train.state import TrainingSnapshot, flatten_state, unflatten_state
from p2ptrain.wire.frames import pack_body
from p2ptrain.wire.tensors import decode_tensor, encode_tensor, parse_tensor_header

__all__ = ["STATE_METHOD", "StateServer", "StateSyncConfig", "download_state"]

logger = logging.getLogger(__name__)

STATE_METHOD: Final = "train.state"
"""The RPC method that serves a peer's training state."""
_VERSION = 1


@dataclass(frozen=True)
class StateSyncConfig:
    """How training state is served and downloaded.

    Attributes:
        chunk_bytes: Largest payload of one chunk message a server sends (below
            the frame limit; clients accept any chunk that fits its tensor).
        timeout: Seconds one download may take from start to end.
        max_bytes: Largest state (tensor bytes) a client accepts.
        max_concurrent: Downloads a server serves at once.
        request_timeout: Seconds a server waits for the client's request.
        retry_interval: Seconds a trainer waits before trying again after no
            peer could provide its state.
    """

    chunk_bytes: int = 1 << 20
    timeout: float = 300.0
    max_bytes: int = 1 << 36
    max_concurrent: int = 2
    request_timeout: float = 10.0
    retry_interval: float = 10.0

    def __post_init__(self) -> None:
        for name, low, high in (
            ("chunk_bytes", 1024, 1 << 26),
            ("max_bytes", 1, 1 << 50),
            ("max_concurrent", 1, 1024),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ConfigError(f"StateSyncConfig.{name} must be an int in [{low}, {high}]")
        for name in ("timeout", "request_timeout", "retry_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"StateSyncConfig.{name} must be a number")
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"StateSyncConfig.{name} must be positive and finite")


def _digest_start(step: int, skeleton: Any, headers: list[Any]) -> Any:
    digest = hashlib.sha256()
    digest.update(pack_body([step, skeleton, headers]))
    return digest


class StateServer:
    """Serves ``train.state`` on a node from a snapshot provider.

    Args:
        node: The node; the handler is registered at once.
        provider: Returns a consistent snapshot; called in a worker thread.
        config: Chunk size and concurrency.

    Raises:
        ConfigError: The node already serves ``train.state``.
    """

    def __init__(
        self,
        node: Node,
        provider: Callable[[], TrainingSnapshot],
        *,
        config: StateSyncConfig | None = None,
    ) -> None:
        self.node = node
        self.config = config or StateSyncConfig()
        self._provider = provider
        self._active = 0
        node.handlers.add_stream(STATE_METHOD, self._serve)

    def close(self) -> None:
        """Stop serving (downloads in progress finish)."""
        self.node.handlers.remove(STATE_METHOD)

    async def _serve(self, ctx: CallContext, stream: RPCStream) -> None:
        try:
            async with asyncio.timeout(self.config.request_timeout):
                request = await stream.recv()
        except (TimeoutError, StreamEndedError):
            stream.reset(InvalidArgumentError.code, "no state request")
            return
        if not isinstance(request.body, dict) or request.body.get("v") != _VERSION:
            stream.reset(InvalidArgumentError.code, f"expected a version-{_VERSION} state request")
            return
        if self._active >= self.config.max_concurrent:
            stream.reset(ResourceExhaustedError.code, "serving too many downloads")
            return
        self._active += 1
        try:
            snapshot = await asyncio.to_thread(self._provider)
            await self._send(stream, snapshot)
        finally:
            self._active -= 1
        logger.info("served state of step %d to %s", snapshot.step, ctx.peer.short)

    async def _send(self, stream: RPCStream, snapshot: TrainingSnapshot) -> None:
        skeleton, tensors = flatten_state(snapshot.state)
        encoded = [encode_tensor(t) for t in tensors]
        headers = [header for header, _ in encoded]
        digest = _digest_start(snapshot.step, skeleton, headers)
        await stream.send(
            {"v": _VERSION, "step": snapshot.step, "skeleton": skeleton, "tensors": headers}
        )
        chunk = self.config.chunk_bytes
        for index, (_, view) in enumerate(encoded):
            for offset in range(0, view.nbytes, chunk):
                part = view[offset : offset + chunk]
                digest.update(part)
                await stream.send({"i": index, "o": offset}, part)
        await stream.send({"sha256": digest.digest()}, end=True)


async def download_state(
    node: Node, source: PeerAddress | str, *, config: StateSyncConfig | None = None
) -> TrainingSnapshot:
    """Download the training state served by ``source``.

    Raises:
        StateSyncError: The peer is unreachable, refuses, breaks the protocol,
            sends a state larger than ``max_bytes`` or one whose digest differs.
    """
    config = config or StateSyncConfig()
    try:
        async with asyncio.timeout(config.timeout):
            stream = await node.open_stream(source, STATE_METHOD, timeout=config.timeout)
            async with stream:
                await stream.send({"v": _VERSION}, end=True)
                return await _receive(stream, config)
    except TimeoutError:
        raise StateSyncError(f"state download from {source} timed out") from None
    except P2PTrainError as exc:
        if isinstance(exc, StateSyncError):
            raise
        raise StateSyncError(f"state download from {source} failed: {exc}") from exc


async def _receive(stream: RPCStream, config: StateSyncConfig) -> TrainingSnapshot:
    head = (await stream.recv()).body
    if not isinstance(head, dict) or head.get("v") != _VERSION:
        raise RemoteProtocolError(f"expected a version-{_VERSION} state head")
    step, skeleton, headers = head.get("step"), head.get("skeleton"), head.get("tensors")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise RemoteProtocolError("the state's step must be an int >= 0")
    if not isinstance(headers, list):
        raise RemoteProtocolError("the state's tensor headers must be a list")
    specs = [parse_tensor_header(h) for h in headers]
    total = sum(spec.nbytes for spec in specs)
    if total > config.max_bytes:
        raise RemoteProtocolError(f"the state holds {total} bytes, more than {config.max_bytes}")
    digest = _digest_start(step, skeleton, headers)
    buffers: list[bytearray] = []
    for index, spec in enumerate(specs):
        buffer = bytearray(spec.nbytes)
        offset = 0
        while offset < spec.nbytes:
            message = await stream.recv()
            body = message.body
            if not isinstance(body, dict) or body.get("i") != index or body.get("o") != offset:
                raise RemoteProtocolError(f"expected the chunk of tensor {index} at byte {offset}")
            size = len(message.payload)
            if not 0 < size <= spec.nbytes - offset:
                raise RemoteProtocolError(f"a chunk of {size} bytes does not fit tensor {index}")
            buffer[offset : offset + size] = message.payload
            digest.update(message.payload)
            offset += size
        buffers.append(buffer)
    tail = (await stream.recv()).body
    if not isinstance(tail, dict) or not isinstance(tail.get("sha256"), bytes):
        raise RemoteProtocolError("expected the state's digest")
    if tail["sha256"] != digest.digest():
        raise StateSyncError("the state's sha256 digest does not match its bytes")
    tensors: list[torch.Tensor] = [
        decode_tensor(header, buffer) for header, buffer in zip(headers, buffers, strict=True)
    ]
    return TrainingSnapshot(step=step, state=unflatten_state(skeleton, tensors))
