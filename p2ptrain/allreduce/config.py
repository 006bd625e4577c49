"""Per-call settings of an all-reduce: compression, aggregation rule, robustness knobs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from p2ptrain.allreduce.compression import CODEC_NAMES, DEFAULT_BLOCK_SIZE, MAX_BLOCK_SIZE
from p2ptrain.errors import ConfigError
from p2ptrain.validate import check_integer, check_number

__all__ = ["AGGREGATION_RULES", "AllReduceConfig"]

AGGREGATION_RULES: Final = ("mean", "trimmed_mean", "centered_clip")
"""Names of the rules a reducer may aggregate its shard with."""


@dataclass(frozen=True, slots=True)
class AllReduceConfig:
    """How one peer takes part in one all-reduce call.

    Every member of a group may pass its own config: the codec applies to what
    this peer sends (its parts) and to the averaged parts it asks reducers to
    send back; the aggregation rule applies to the shard this peer reduces.

    Attributes:
        codec: Compression of what is sent, one of ``none``, ``fp16``, ``bf16``,
            ``int8`` (see :mod:`p2ptrain.allreduce.compression`).
        block_size: Elements per scale of the ``int8`` codec.
        aggregation: How this peer, as a reducer, combines the parts of its
            shard: ``mean`` (weighted mean, streamed in place),
            ``trimmed_mean`` (coordinate-wise trimmed mean) or
            ``centered_clip`` (centered clipping). The robust rules and their
            bounds are described in :mod:`p2ptrain.allreduce.aggregation`.
        trim: Senders dropped at each end of every coordinate by
            ``trimmed_mean``; it tolerates up to ``trim`` bad senders per chunk.
        clip_iterations: Iterations of ``centered_clip``.
        clip_radius: Clipping radius of ``centered_clip`` (L2 norm per chunk);
            ``None`` picks the median distance of the senders to the start
            point, a radius that bad senders in a minority cannot inflate.
        pacing_headroom: Kernel pacing of this peer's bulk streams during the
            round (Linux TCP, ``SO_MAX_PACING_RATE``; lifted when the round
            ends): each stream is capped at this factor times the peer's
            upload estimate times the stream's share of the bytes the peer
            uploads in the round (see :mod:`p2ptrain.allreduce.pacing`). It
            keeps concurrent TCP start-ups from overrunning a shallow uplink
            queue. Needs an upload capacity (the service's ``links``: its
            latest probe or typed-in rate, ``upload_capacity_bytes_per_s``);
            at least 1, e.g. 1.25. ``None`` (the default): off. Off by default
            because a typed-in rate then becomes a hard limit: the local demo,
            whose peers announce home rates on loopback, ran at 0.56x its
            samples/s with 1.25 (docs/benchmarks.md, "Kernel pacing").
    """

    codec: str = "none"
    block_size: int = DEFAULT_BLOCK_SIZE
    aggregation: str = "mean"
    trim: int = 1
    clip_iterations: int = 3
    clip_radius: float | None = None
    pacing_headroom: float | None = None

    def __post_init__(self) -> None:
        if self.codec not in CODEC_NAMES:
            raise ConfigError(f"codec must be one of {list(CODEC_NAMES)}, got {self.codec!r}")
        check_integer(
            "AllReduceConfig.block_size", self.block_size, at_least=1, at_most=MAX_BLOCK_SIZE
        )
        if self.aggregation not in AGGREGATION_RULES:
            raise ConfigError(
                f"aggregation must be one of {list(AGGREGATION_RULES)}, got {self.aggregation!r}"
            )
        check_integer("AllReduceConfig.trim", self.trim, at_least=0, at_most=1 << 16)
        check_integer(
            "AllReduceConfig.clip_iterations", self.clip_iterations, at_least=1, at_most=1000
        )
        check_number("AllReduceConfig.clip_radius", self.clip_radius, allow_none=True)
        check_number(
            "AllReduceConfig.pacing_headroom", self.pacing_headroom, at_least=1.0, allow_none=True
        )
