"""All-reduce rounds among nodes of one process: members, plans, a round, the exact mean.

Shared by the all-reduce and measurement tests (``from allreduce_rounds import ...``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import torch
from conftest import NodeFactory

from p2ptrain.allreduce import (
    AllReduceConfig,
    AllReduceReport,
    AllReduceService,
    GroupMember,
    GroupPlan,
    allreduce,
)
from p2ptrain.node.node import Node


async def make_members(
    make_node: NodeFactory, count: int, *, join_timeout: float = 10.0
) -> list[Node]:
    nodes = [await make_node() for _ in range(count)]
    for node in nodes:
        AllReduceService(node, join_timeout=join_timeout)
    return nodes


def make_plan(
    nodes: Sequence[Node],
    num_elements: int,
    *,
    shares: Sequence[float] | None = None,
    clients: Sequence[int] = (),
    **kwargs: Any,
) -> GroupPlan:
    members = [
        GroupMember(node.peer_id, None if i in clients else node.address)
        for i, node in enumerate(nodes)
    ]
    if shares is None:
        owners = len(nodes) - len(clients)
        shares = [0.0 if i in clients else 1 / owners for i in range(len(nodes))]
    kwargs.setdefault("reduce_timeout", 10.0)
    kwargs.setdefault("round_timeout", 20.0)
    return GroupPlan.from_shares(members, shares, num_elements, **kwargs)


async def run_round(
    nodes: Sequence[Node],
    plan: GroupPlan,
    inputs: Sequence[torch.Tensor],
    weights: Sequence[float],
    config: AllReduceConfig | None = None,
) -> list[tuple[torch.Tensor, AllReduceReport]]:
    return await asyncio.gather(
        *(
            allreduce(node, plan, x, w, config=config)
            for node, x, w in zip(nodes, inputs, weights, strict=True)
        )
    )


def weighted_mean(inputs: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    stacked = torch.stack([x.double() for x in inputs])
    scaled = torch.tensor(weights, dtype=torch.float64) / sum(weights)
    return scaled @ stacked
