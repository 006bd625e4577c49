"""Shared fixtures: nodes on loopback that are always closed."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest

from p2ptrain.node.config import NodeConfig
from p2ptrain.node.node import Node

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
