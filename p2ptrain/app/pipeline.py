"""``p2ptrain train --pipeline``: a peer that serves a pipeline stage and trains through it.

The peer joins the swarm, picks a stage (``--stage``, or one short of capacity
as the stage directory shows it), refuses it with a clear message if the stage's
parameters and optimizer state do not fit ``--memory-budget-mb``, serves it
(:class:`~p2ptrain.swarm.StageServer`) and pushes its own micro-batches
through the whole pipeline (:class:`~p2ptrain.swarm.PipelineTrainer`),
optionally rebalancing (``--rebalance-s``: every period it may move to the
bottleneck stage, :class:`~p2ptrain.swarm.rebalance.Rebalancer`), printing a
status line and, with ``--log-json``, one JSON event per second.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

import torch

from p2ptrain.app.task import PipelineTask, load_pipeline_task
from p2ptrain.app.train import shard_of
from p2ptrain.dht.node_config import DHTNodeConfig
from p2ptrain.node.config import NodeConfig
from p2ptrain.peer import Peer, PeerConfig
from p2ptrain.swarm import (
    PipelineModel,
    PipelineTrainer,
    PipelineTrainerConfig,
    StageServer,
    StageServerConfig,
    stage_memory_bytes,
)
from p2ptrain.swarm.rebalance import RebalanceConfig, Rebalancer, newcomer_stage, read_loads
from p2ptrain.train.progress import ProgressConfig
from p2ptrain.validate import check_integer, check_number

__all__ = ["PipelinePeerConfig", "PipelineSummary", "run_pipeline_peer"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PipelinePeerConfig:
    """What one ``--pipeline`` peer does.

    Attributes:
        initial_peers: Peers to join through.
        run_id: The pipeline run.
        node: How the node listens.
        task: The pipeline task module (default: charlm as blocks).
        stage: The stage to serve first; ``None``: one short of capacity
            (:func:`~p2ptrain.swarm.rebalance.newcomer_stage`).
        target_batch_size: Samples per stage step, all of the stage's peers together.
        batch_size: Samples per micro-batch.
        seconds: Stop after this long; ``None``: until stopped.
        memory_budget_mb: This peer's cap on a stage's parameters and optimizer state.
        compute_floor_s: Emulated device speed: a floor on each micro-batch's compute.
        in_flight: Micro-batches this peer's trainer keeps in the pipeline at once.
        identity_path: Key file (keeps the PeerID across restarts).
        torch_threads: ``torch.set_num_threads`` for the stage and the trainer,
            or ``None`` for torch's default (all cores).
        rebalance_s: Rebalancing period in seconds (the peer may move to the
            bottleneck stage each period); ``None``: it stays on its stage.
    """

    initial_peers: tuple[str, ...]
    run_id: str
    node: NodeConfig
    task: str | None = None
    stage: int | None = None
    target_batch_size: int = 128
    batch_size: int = 8
    seconds: float | None = None
    memory_budget_mb: float | None = None
    compute_floor_s: float = 0.0
    in_flight: int = 2
    identity_path: str | None = None
    torch_threads: int | None = None
    rebalance_s: float | None = None

    def __post_init__(self) -> None:
        owner = "PipelinePeerConfig"
        check_integer(f"{owner}.torch_threads", self.torch_threads, at_least=1, allow_none=True)
        check_integer(f"{owner}.stage", self.stage, at_least=0, allow_none=True)
        check_integer(f"{owner}.target_batch_size", self.target_batch_size, at_least=1)
        check_integer(f"{owner}.batch_size", self.batch_size, at_least=1)
        check_integer(f"{owner}.in_flight", self.in_flight, at_least=1)
        check_number(f"{owner}.seconds", self.seconds, allow_none=True)
        check_number(f"{owner}.memory_budget_mb", self.memory_budget_mb, allow_none=True)
        check_number(f"{owner}.compute_floor_s", self.compute_floor_s, above=-1e-12)
        check_number(f"{owner}.rebalance_s", self.rebalance_s, above=0, allow_none=True)


@dataclass(frozen=True)
class PipelineSummary:
    """How a ``--pipeline`` peer's run went."""

    stage: int
    stage_steps: int
    samples_delivered: int
    retries: int
    loss: float | None
    seconds: float


_PROGRESS = ProgressConfig(
    publish_interval=0.3, heartbeat_interval=1.0, expiration=6.0, max_fetch_interval=0.5
)


def model_of(task: PipelineTask) -> PipelineModel:
    """The task's blocks cut evenly into its stages."""
    return PipelineModel.even(task.blocks, task.num_stages)


def stage_bytes(task: PipelineTask, model: PipelineModel, stage: int) -> int:
    """What serving ``stage`` costs in memory (built once to measure it)."""
    module = model.build_stage(stage)
    return stage_memory_bytes(module, task.make_optimizer(module.parameters()))


async def newcomer_stage_of(peer: Peer, run_id: str, num_stages: int) -> int:
    """The stage this peer should join: drawn among the stages short of capacity as
    the directory shows them (:func:`~p2ptrain.swarm.rebalance.newcomer_stage`)."""
    loads = await read_loads(peer.dht, run_id, num_stages)
    return newcomer_stage(loads, num_stages, random.Random())


def run_pipeline_peer(
    config: PipelinePeerConfig,
    *,
    display: TextIO,
    log: Callable[[dict[str, Any]], None] | None = None,
    announce: Callable[[str], None] | None = None,
    stop: threading.Event | None = None,
) -> PipelineSummary:
    """Join, serve a stage and train through the pipeline until ``seconds`` or ``stop``.

    Raises:
        MemoryBudgetError: The chosen stage does not fit the memory budget.
        ConfigError: The task cannot be loaded or the stage does not exist.
    """
    if config.torch_threads is not None:
        torch.set_num_threads(config.torch_threads)
    task = load_pipeline_task(config.task)
    model = model_of(task)
    budget = None if config.memory_budget_mb is None else int(config.memory_budget_mb * 1e6)
    total = sum(stage_bytes(task, model, s) for s in range(model.num_stages))
    print(
        f"model: {total / 1e6:.2f} MB of parameters, accumulators and optimizer state over"
        f" {model.num_stages} stages; this peer's budget: "
        + ("none" if budget is None else f"{budget / 1e6:.2f} MB"),
        file=display,
        flush=True,
    )
    peer_config = PeerConfig(
        node=config.node,
        dht=DHTNodeConfig(initial_peers=config.initial_peers, request_timeout=2.0),
        identity_path=config.identity_path,
        nat=None,
        probe_seconds=None,
    )
    with Peer(peer_config) as peer:
        stage = config.stage
        if stage is None:
            stage = peer.run(newcomer_stage_of(peer, config.run_id, model.num_stages), 30)
        server = StageServer(
            peer=peer,
            model=model,
            stage=model.check_stage(stage),
            make_optimizer=task.make_optimizer,
            config=_server_config(config, budget),
        )
        with server:
            if announce is not None:
                announce(peer.address)
            print(f"serving stage {stage} as {peer.address}", file=display, flush=True)
            rebalancing = _start_rebalancer(config, peer, server)
            try:
                return _train(config, task, peer, server, display, log, stop or threading.Event())
            finally:
                if rebalancing is not None:
                    rebalancing.cancel()
                    concurrent.futures.wait([rebalancing], timeout=10)


def _start_rebalancer(
    config: PipelinePeerConfig, peer: Peer, server: StageServer
) -> concurrent.futures.Future[None] | None:
    """Run a :class:`Rebalancer` for ``server`` on the peer's loop (``None`` when off)."""
    if config.rebalance_s is None:
        return None
    stages = server.model.num_stages
    rebalancer = Rebalancer(
        me=str(peer.peer_id),
        config=RebalanceConfig(stages=stages, period_s=config.rebalance_s),
        read_loads=lambda: read_loads(peer.dht, config.run_id, stages),
        move_to=server.move_to,
    )
    return peer.submit(rebalancer.run())


def _server_config(config: PipelinePeerConfig, budget: int | None) -> StageServerConfig:
    return StageServerConfig(
        run_id=config.run_id,
        target_batch_size=config.target_batch_size,
        memory_budget_bytes=budget,
        min_compute_s=config.compute_floor_s,
        progress=_PROGRESS,
        announce_interval=0.5,
        announce_ttl=4.0,
        hold_timeout=30.0,
    )


def _train(  # noqa: PLR0917 - private, one call site
    config: PipelinePeerConfig,
    task: PipelineTask,
    peer: Peer,
    server: StageServer,
    display: TextIO,
    log: Callable[[dict[str, Any]], None] | None,
    stop: threading.Event,
) -> PipelineSummary:
    trainer = PipelineTrainer(
        peer=peer,
        config=PipelineTrainerConfig(
            run_id=config.run_id,
            num_stages=server.model.num_stages,
            call_timeout=5.0,
            retry_interval=0.2,
            refresh_interval=0.5,
            avoid_s=3.0,
        ),
        loss=task.loss,
    )
    shard, num_shards = shard_of(peer.peer_id)
    started = time.monotonic()
    end = None if config.seconds is None else started + config.seconds
    counter = iter(range(1 << 62))

    async def lane() -> None:
        while not stop.is_set() and (end is None or time.monotonic() < end):
            index = next(counter)
            inputs, targets = task.batch(
                index, config.batch_size, shard=shard, num_shards=num_shards
            )
            await trainer.train_micro_batch(inputs, targets)

    lanes = [peer.submit(lane()) for _ in range(config.in_flight)]
    grace = trainer.config.call_timeout  # a micro-batch in flight at the end may finish
    while not all(f.done() for f in lanes):
        if stop.wait(1.0) or (end is not None and time.monotonic() > end + grace):
            break
        _report(server, trainer, started, display, log)
    for future in lanes:
        future.cancel()  # one paused on a stage with no peer, or past the grace
    concurrent.futures.wait(lanes, timeout=10)
    trainer.close()  # stops confirming and replaying
    for future in lanes:
        if not future.cancelled() and future.exception() is not None:
            logger.warning("a training lane failed: %r", future.exception())
    return PipelineSummary(
        stage=server.stage,
        stage_steps=server.global_step,
        samples_delivered=trainer.stats.samples_delivered,
        retries=trainer.stats.retries,
        loss=trainer.stats.last_loss,
        seconds=time.monotonic() - started,
    )


def _report(
    server: StageServer,
    trainer: PipelineTrainer,
    started: float,
    display: TextIO,
    log: Callable[[dict[str, Any]], None] | None,
) -> None:
    stats = trainer.stats
    loss = "-" if stats.last_loss is None else f"{stats.last_loss:.4f}"
    print(
        f"stage {server.stage} step {server.global_step} | loss {loss} | {trainer.status()}",
        file=display,
        flush=True,
    )
    if log is not None:
        log(
            {
                "event": "pipeline",
                "t": round(time.monotonic() - started, 3),
                "stage": server.stage,
                "step": server.global_step,
                "loss": stats.last_loss,
                "delivered": stats.samples_delivered,
                "committed": server.stats.samples_committed,
                "in_steps": server.stats.samples_in_steps,
                "retries": stats.retries,
                "micro_batches": stats.micro_batches,
                "throughput": round(server.samples_per_s, 2),
                "queue": server.queue_length,
            }
        )


def json_line_writer(stream: TextIO) -> Callable[[dict[str, Any]], None]:
    """Write each event as one JSON line to ``stream`` (flushed)."""

    def write(event: dict[str, Any]) -> None:
        stream.write(json.dumps(event) + "\n")
        stream.flush()

    return write
