"""A relaying peer forwards the end-to-end sealed connection: it never holds
a plaintext byte of what it carries, and an altered byte is detected."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from test_nat_loopback import RELAY_ONLY, Peer, relay_config, start_peer, swarm

from p2ptrain.errors import P2PTrainError
from p2ptrain.nat import rendezvous
from p2ptrain.nat.paths import Traversal
from p2ptrain.rpc.handlers import Message
from p2ptrain.rpc.stream import RPCStream

MiB = 1 << 20


class Tap:
    """One spliced stream as the relay reads it: every message is kept, one may be altered."""

    def __init__(
        self, stream: RPCStream, seen: list[bytes], alter: Callable[[bytes], bytes] | None
    ) -> None:
        self._stream = stream
        self._seen = seen
        self._alter = alter

    def __aiter__(self) -> AsyncIterator[Message]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[Message]:
        async for message in self._stream:
            data = bytes(message.payload)
            self._seen.append(data)
            if self._alter is not None:
                data = self._alter(data)
            yield Message(message.body, data)

    async def send(self, **kwargs: Any) -> None:
        await self._stream.send(**kwargs)

    async def end(self) -> None:
        await self._stream.end()

    def reset(self, code: str = "cancelled", message: str = "") -> None:
        self._stream.reset(code, message)


def tap_relay(
    monkeypatch: pytest.MonkeyPatch, alter: Callable[[bytes], bytes] | None = None
) -> list[bytes]:
    """Make the relay's splice keep every message it forwards (dialer to target)."""
    seen: list[bytes] = []
    original = rendezvous.splice

    async def splice(a: RPCStream, b: RPCStream, *args: Any) -> None:
        await original(Tap(a, seen, alter), Tap(b, [], None), *args)  # type: ignore[arg-type]

    monkeypatch.setattr(rendezvous, "splice", splice)
    return seen


async def relayed(stack: contextlib.AsyncExitStack) -> tuple[Peer, Peer, Traversal]:
    """A target and a dialer that reach each other only through a relaying bootstrap
    peer, and the dialer's traversal to the target (over the relay)."""
    boot = await start_peer(stack, relay_config())
    target = await start_peer(stack, RELAY_ONLY, [boot])
    dialer = await start_peer(stack, RELAY_ONLY, [boot])
    traversal = await dialer.nat.traverse(target.peer_id)
    assert traversal.path == "relay"
    return target, dialer, traversal


async def test_the_relay_never_holds_a_plaintext_payload(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = tap_relay(monkeypatch)
    payload = os.urandom(3 * MiB)
    async with swarm() as stack:
        target, dialer, traversal = await relayed(stack)
        reply = await traversal.connection.call("echo", "known body", payload, timeout=20)
        assert bytes(reply.payload) == payload
    carried = b"".join(seen)
    assert len(carried) > len(payload)  # the relay did carry it
    for offset in range(0, len(payload), 64 * 1024):
        assert payload[offset : offset + 32] not in carried
    assert b"known body" not in carried and b"echo" not in carried
    for peer_id in (target.peer_id, dialer.peer_id):
        assert peer_id.digest not in carried and str(peer_id).encode() not in carried


async def test_a_relay_that_alters_one_byte_is_detected(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    altered = []

    def flip_one(data: bytes) -> bytes:
        if altered or len(data) < 64 * 1024:  # only the first large (payload) chunk
            return data
        altered.append(len(data))
        changed = bytearray(data)
        changed[len(data) // 2] ^= 0x01
        return bytes(changed)

    tap_relay(monkeypatch, flip_one)
    caplog.set_level(logging.WARNING)
    async with swarm() as stack:
        _, _, traversal = await relayed(stack)
        conn = traversal.connection
        with pytest.raises(P2PTrainError):
            await conn.call("echo", None, os.urandom(MiB), timeout=20)
        await conn.transport.wait_closed()
    assert altered
    closing = [
        r.getMessage() for r in caplog.records if "closing relayed connection" in r.getMessage()
    ]
    assert len(closing) == 1 and "IntegrityError" in closing[0], closing
