"""Shared fixtures: nodes on loopback that are always closed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest

from p2ptrain.handshake import AdmissionPolicy, HandshakeResult, perform_handshake
from p2ptrain.identity import Identity, PeerID
from p2ptrain.node.config import NodeConfig
from p2ptrain.node.node import Node
from p2ptrain.testing.memory import memory_transport_pair
from p2ptrain.transport.base import FrameTransport
from p2ptrain.wire.frames import Frame

NodeFactory = Callable[..., Coroutine[Any, Any, Node]]


@pytest.fixture
async def make_node() -> AsyncIterator[NodeFactory]:
    """Start nodes on 127.0.0.1 (port 0); all are closed when the test ends."""
    started: list[Node] = []

    async def factory(**kwargs: Any) -> Node:
        config = kwargs.pop("config", None) or NodeConfig(**kwargs.pop("config_kwargs", {}))
        node = Node(config=config, **kwargs)
        await node.start()
        started.append(node)
        return node

    yield factory
    for node in reversed(started):
        await node.aclose()


async def shake(
    transport: FrameTransport,
    identity: Identity,
    *,
    initiator: bool,
    swarm: str = "s",
    policy: AdmissionPolicy | None = None,
    stream_window: int = 1 << 20,
    expected_peer: PeerID | None = None,
    timeout: float = 5,
) -> HandshakeResult:
    """perform_handshake with the defaults the tests share (1 MiB frames)."""
    return await perform_handshake(
        transport,
        identity,
        initiator=initiator,
        swarm=swarm,
        stream_window=stream_window,
        max_frame_bytes=1 << 20,
        policy=policy or AdmissionPolicy(),
        expected_peer=expected_peer,
        timeout=timeout,
    )


async def recorded_handshake(
    initiator: Identity, responder: Identity, *, swarm: str
) -> tuple[HandshakeResult, list[Frame]]:
    """A completed in-memory handshake and the frames the responder received."""
    a, b = memory_transport_pair()
    recorded: list[Frame] = []
    deliver = b._deliver

    def record(frame: Frame) -> None:
        recorded.append(frame)
        deliver(frame)

    b._deliver = record  # type: ignore[method-assign]
    _, result = await asyncio.gather(
        shake(a, initiator, initiator=True, swarm=swarm),
        shake(b, responder, initiator=False, swarm=swarm),
    )
    return result, recorded
