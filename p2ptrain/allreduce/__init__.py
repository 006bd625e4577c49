"""Butterfly all-reduce: group plans, the load-balancing LP, compression, robust aggregation.

The entry point is :func:`allreduce` (or :meth:`AllReduceService.allreduce`):
every member of a :class:`GroupPlan` calls it with its own tensors and weight
and gets back the weighted average and an :class:`AllReduceReport`. See
docs/allreduce.md for the protocol and docs/load-balancing.md for the LP.
"""

from p2ptrain.allreduce.bandwidth import ThroughputConfig, ThroughputMeter
from p2ptrain.allreduce.butterfly import RoundObserver
from p2ptrain.allreduce.config import AGGREGATION_RULES, AllReduceConfig
from p2ptrain.allreduce.group import GroupMember, GroupPlan, new_round_id
from p2ptrain.allreduce.report import AllReduceReport, ShardReport
from p2ptrain.allreduce.service import AllReduceService, allreduce

__all__ = [
    "AGGREGATION_RULES",
    "AllReduceConfig",
    "AllReduceReport",
    "AllReduceService",
    "GroupMember",
    "GroupPlan",
    "RoundObserver",
    "ShardReport",
    "ThroughputConfig",
    "ThroughputMeter",
    "allreduce",
    "new_round_id",
]
