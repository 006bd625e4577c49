"""``p2ptrain train``: one training peer from the command line.

:func:`run_training_peer` is what ``p2ptrain train`` runs: a
:class:`~p2ptrain.peer.Peer` joins the swarm, a
:class:`~p2ptrain.train.CollaborativeOptimizer` trains the character model of
``p2ptrain.examples.charlm`` for a bounded time, and a one-line display shows the
peer's samples/s, the swarm's global step, the loss and the peers online.
Events also go out as JSON lines (``{"event": "start" | "progress" | "end", ...}``)
for programs such as the swarm demo. ``p2ptrain status`` is
:mod:`p2ptrain.app.status`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TextIO

from p2ptrain.errors import ConfigError
from p2ptrain.node.config import NodeConfig
from p2ptrain.secure.identity import PeerID
from p2ptrain.train.progress import ProgressConfig
from p2ptrain.validate import check_integer, check_number

if TYPE_CHECKING:
    import torch

    from p2ptrain.allreduce.partition import PeerCapacity
    from p2ptrain.app.task import TrainingTask
    from p2ptrain.metrics import Metrics
    from p2ptrain.nat.config import NATConfig
    from p2ptrain.peer import Peer, PeerConfig
    from p2ptrain.train.base import SwarmTrainer

__all__ = [
    "TrainingSessionConfig",
    "TrainingSummary",
    "json_lines_logger",
    "run_training_peer",
    "shard_of",
]

_NUM_SHARDS = 2**40
"""Shards of the data; a peer's is its whole PeerID digest modulo this, so two
of even a thousand peers share one with probability below 10**-6."""
_MBIT = 1e6 / 8
_OVERLAP_OUTER_LR = 0.35  # DiLoCo outer lr with overlapped rounds (docs/training.md)


def _addresses(owner: str, value: object) -> None:
    if not isinstance(value, tuple) or not all(isinstance(a, str) and a for a in value):
        raise ConfigError(f"{owner}.initial_peers must be a tuple of addresses")


@dataclass(frozen=True)
class TrainingSessionConfig:
    """One peer training charlm with the swarm.

    Attributes:
        initial_peers: Addresses (``peerid@host:port``) to join through.
        run_id: The run to train in; peers with the same run id train together.
        target_batch_size: Samples the swarm accumulates before each step.
        step_policy: How a step holds the target: ``wait`` (default) or ``carry``
            (see :mod:`p2ptrain.train.cut`).
        batch_size: Samples of each local batch.
        seconds: Seconds to train (from the moment the peer joined), or
            ``None`` to train until interrupted.
        upload_mbit: Upload rate announced to the load balancer (Mbit/s),
            or ``None`` to measure it.
        download_mbit: Download rate announced (Mbit/s), or ``None`` to measure it.
        metrics_port: Serve Prometheus metrics on this port (0 picks
            one), or ``None`` for no server.
        metrics_host: The interface the metrics server listens on
            (127.0.0.1: this machine only; 0.0.0.0 for a remote Prometheus).
        log_interval: Seconds between two progress events and display updates.
        node: Where the peer listens and how it admits others.
        identity_path: Key file of the peer (created if missing), or ``None``.
        progress: How often progress is published and read.
        nat: NAT traversal (see :class:`~p2ptrain.peer.PeerConfig`), or
            ``None`` to dial plain TCP (LAN, loopback).
        task: The task module (``None``: charlm).
        torch_threads: ``torch.set_num_threads`` for training, or ``None``
            for torch's default (all cores).
        device: Where the model trains: ``auto`` (CUDA where this machine
            has it, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``. The task
            builds its model and batches on the CPU; the session moves both.
        save_path: Write the final model's ``state_dict`` here (``torch.save``).
        checkpoint_path: Resume from this checkpoint if it exists, and write
            the whole training state to it every ``checkpoint_interval``
            seconds and at the end; ``None`` for none.
        checkpoint_interval: Seconds between two checkpoints.
        diloco_inner_steps: Train with DiLoCo, this many inner steps per
            round (H); ``None`` trains with the collaborative optimizer.
        diloco_overlap: DiLoCo rounds overlap (``DiLoCoConfig.overlap``), with
            half the default outer learning rate (measured to train as well as
            synchronous rounds, where the default overshoots).
        compression: Codec of the all-reduce: ``none``, ``fp16`` (the default:
            half the bytes at the same loss, see docs/training.md), ``bf16``,
            ``int8`` (with error feedback).
        matchmaking_window: Seconds a peer gathers a step's group.
        log_digest: Add ``params_sha256`` (the parameters' SHA-256) to the
            start event (the task's initial parameters), every progress event
            and the end event; costs one pass over the model each time.
    """

    initial_peers: tuple[str, ...]
    run_id: str = "charlm"
    target_batch_size: int = 256
    step_policy: str = "wait"
    batch_size: int = 16
    seconds: float | None = None
    upload_mbit: float | None = None
    download_mbit: float | None = None
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    log_interval: float = 1.0
    node: NodeConfig = field(default_factory=lambda: NodeConfig(port=0))
    identity_path: str | None = None
    progress: ProgressConfig = field(
        default_factory=lambda: ProgressConfig(
            publish_interval=0.5, heartbeat_interval=2.0, expiration=8.0, max_fetch_interval=2.0
        )
    )
    nat: NATConfig | None = None
    task: str | None = None
    torch_threads: int | None = None
    device: str = "auto"
    save_path: str | None = None
    checkpoint_path: str | None = None
    checkpoint_interval: float = 60.0
    diloco_inner_steps: int | None = None
    diloco_overlap: bool = False
    compression: str = "fp16"
    matchmaking_window: float = 2.0
    log_digest: bool = False

    def __post_init__(self) -> None:
        owner = "TrainingSessionConfig"
        _addresses(owner, self.initial_peers)
        if not isinstance(self.run_id, str) or not self.run_id or "/" in self.run_id:
            raise ConfigError(f"{owner}.run_id must be a non-empty name without '/'")
        check_integer(
            f"{owner}.target_batch_size", self.target_batch_size, at_least=1, allow_none=False
        )
        check_integer(f"{owner}.batch_size", self.batch_size, at_least=1)
        if self.step_policy not in ("carry", "wait"):
            raise ConfigError(f"{owner}.step_policy must be 'carry' or 'wait'")
        check_number(f"{owner}.seconds", self.seconds, above=0.0, allow_none=True)
        check_number(f"{owner}.upload_mbit", self.upload_mbit, above=0.0, allow_none=True)
        check_number(f"{owner}.download_mbit", self.download_mbit, above=0.0, allow_none=True)
        check_integer(f"{owner}.metrics_port", self.metrics_port, at_least=0, allow_none=True)
        if self.metrics_port is not None and self.metrics_port > 65535:
            raise ConfigError(f"{owner}.metrics_port must be at most 65535")
        if not isinstance(self.metrics_host, str) or not self.metrics_host:
            raise ConfigError(f"{owner}.metrics_host must be a host name or address")
        check_number(f"{owner}.log_interval", self.log_interval, above=0.0)
        if not isinstance(self.node, NodeConfig):
            raise ConfigError(f"{owner}.node must be a NodeConfig")
        if self.task is not None and (not isinstance(self.task, str) or not self.task):
            raise ConfigError(f"{owner}.task must be a module name or a .py path")
        check_integer(f"{owner}.torch_threads", self.torch_threads, at_least=1, allow_none=True)
        if not isinstance(self.device, str) or not self.device:
            raise ConfigError(f"{owner}.device must be auto, cpu, cuda or cuda:N")
        check_integer(
            f"{owner}.diloco_inner_steps", self.diloco_inner_steps, at_least=1, allow_none=True
        )
        if not isinstance(self.diloco_overlap, bool):
            raise ConfigError(f"{owner}.diloco_overlap must be a bool")
        if self.diloco_overlap and self.diloco_inner_steps is None:
            raise ConfigError(f"{owner}.diloco_overlap needs diloco_inner_steps (--diloco H)")
        check_number(
            f"{owner}.checkpoint_interval", self.checkpoint_interval, above=0.0, allow_none=False
        )
        check_number(
            f"{owner}.matchmaking_window", self.matchmaking_window, above=0.0, allow_none=False
        )
        if self.compression not in ("none", "fp16", "bf16", "int8"):
            raise ConfigError(f"{owner}.compression must be none, fp16, bf16 or int8")
        if self.checkpoint_path is not None and not (
            isinstance(self.checkpoint_path, str) and self.checkpoint_path
        ):
            raise ConfigError(f"{owner}.checkpoint_path must be a path")
        if self.save_path is not None and (
            not isinstance(self.save_path, str) or not self.save_path
        ):
            raise ConfigError(f"{owner}.save_path must be a path")
        if not isinstance(self.progress, ProgressConfig):
            raise ConfigError(f"{owner}.progress must be a ProgressConfig")
        if self.nat is not None:
            from p2ptrain.nat.config import NATConfig  # noqa: PLC0415 - aiortc is slow

            if not isinstance(self.nat, NATConfig):
                raise ConfigError(f"{owner}.nat must be a NATConfig or None")


@dataclass(frozen=True)
class TrainingSummary:
    """What one training session did.

    Attributes:
        peer_id: The peer's PeerID (short form).
        address: Where it listened.
        global_step: The swarm step it reached.
        local_steps: Local batches it computed.
        samples_per_s: Its samples over its training time.
        loss: The loss of its last batch (``nan`` if it computed none).
        seconds: Seconds it trained.
        rounds: Steps averaged in a group.
        local_rounds: Steps applied alone.
        syncs: States downloaded from others.
    """

    peer_id: str
    address: str
    global_step: int
    local_steps: int
    samples_per_s: float
    loss: float
    seconds: float
    rounds: int
    local_rounds: int
    syncs: int


def shard_of(peer_id: PeerID) -> tuple[int, int]:
    """A peer's data shard and the number of shards: from its whole PeerID digest."""
    digest = hashlib.sha256(str(peer_id).encode()).digest()
    return int.from_bytes(digest, "big") % _NUM_SHARDS, _NUM_SHARDS


class _Display:
    """A one-line progress display that redraws in place on a terminal."""

    def __init__(self, stream: TextIO | None) -> None:
        self.stream = stream
        self.tty = bool(stream is not None and stream.isatty())
        self._width = 0

    def show(self, text: str) -> None:
        if self.stream is None:
            return
        if self.tty:
            pad = max(0, self._width - len(text))
            self.stream.write("\r" + text + " " * pad)
            self._width = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.stream is not None and self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()


def _progress_line(
    *, samples_per_s: float, step: int, loss: float, peers: int, elapsed: float
) -> str:
    return (
        f"[{elapsed:6.1f}s] {samples_per_s:7.1f} samples/s | global step {step:5d} | "
        f"loss {loss:.4f} | peers online {peers}"
    )


def run_training_peer(
    config: TrainingSessionConfig,
    *,
    display: TextIO | None = None,
    log: Callable[[dict[str, Any]], None] | None = None,
    announce: Callable[[str], None] | None = None,
    stop: threading.Event | None = None,
) -> TrainingSummary:
    """Join the swarm and train charlm until ``config.seconds`` have passed.

    Args:
        config: The session.
        display: Stream for the one-line progress display (redrawn in place
            on a terminal, one line per update otherwise), or ``None``.
        log: Called with every event as a JSON-able dict: ``start`` (peer id,
            address, time), ``progress`` (every ``log_interval`` seconds, with
            a metrics snapshot) and ``end`` (the summary).
        announce: Called once with the peer's address when it joined.
        stop: Set it (from a signal handler or another thread) to end the
            session cleanly before ``config.seconds``.

    Returns:
        What the session did.

    Raises:
        ConfigError: The task cannot be loaded.
        LookupFailedError: None of the initial peers answered.
        ConnectError: The port cannot be bound.
    """
    import torch  # noqa: PLC0415 - slow import, only for training

    from p2ptrain.app.collectors import dht_collector, nat_collector, node_collector  # noqa: PLC0415
    from p2ptrain.metrics import MetricsServer  # noqa: PLC0415
    from p2ptrain.peer import Peer  # noqa: PLC0415

    task, device = _task_on_device(config)
    emit = log or (lambda event: None)
    if config.torch_threads is not None:
        torch.set_num_threads(config.torch_threads)
    run = _Run(config, task, emit=emit, screen=_Display(display), device=device)
    with Peer(_peer_config(config)) as peer:
        run.metrics.add_collector(node_collector(peer.node))
        run.metrics.add_collector(dht_collector(peer.dht.dht_node))
        if peer.nat is not None:
            run.metrics.add_collector(nat_collector(peer.nat))
        server: MetricsServer | None = None
        if config.metrics_port is not None:
            server = MetricsServer(run.metrics, host=config.metrics_host, port=config.metrics_port)
            peer.run(server.start(), timeout=10)
        run.started(peer, None if server is None else server.port)
        if announce is not None:
            announce(peer.address)
        trainer = _make_trainer(config, task, peer, run.metrics)
        try:
            summary, announced = run.train(peer, trainer, stop)
            if config.save_path is not None:
                torch.save(task.model.state_dict(), config.save_path)
        finally:
            run.screen.done()
            if server is not None:
                peer.run(server.aclose(), timeout=10)
    emit(
        {
            "event": "end",
            "time": time.time(),
            **summary.__dict__,
            "announced_upload_mbit": announced.upload_bytes_per_s / _MBIT,
            "announced_download_mbit": announced.download_bytes_per_s / _MBIT,
            **_digest(config, task.model),
        }
    )
    return summary


def _task_on_device(config: TrainingSessionConfig) -> tuple[TrainingTask, torch.device]:
    """The session's task, its model moved to the session's device."""
    import torch  # noqa: PLC0415 - slow import, only for training

    from p2ptrain.app.device import training_device  # noqa: PLC0415 - imports torch
    from p2ptrain.app.task import load_task  # noqa: PLC0415 - imports torch

    device = training_device(config.device)  # a bad name fails before the task loads
    # Every peer of a run builds the model from the same random state, so that
    # a task that does not seed its initialisation still starts each run from
    # one set of parameters; then each peer draws its own randomness again.
    torch.manual_seed(_seed(config.run_id))
    task = load_task(config.task)
    torch.manual_seed(_seed(os.urandom(16).hex()))
    task.model.to(device)  # in place: the task's optimizer keeps its parameters
    return task, device


def _peer_config(config: TrainingSessionConfig) -> PeerConfig:
    """The :class:`~p2ptrain.peer.PeerConfig` of a session's peer."""
    from p2ptrain.allreduce.bandwidth import ThroughputConfig  # noqa: PLC0415
    from p2ptrain.allreduce.matchmaking import MatchmakingConfig  # noqa: PLC0415
    from p2ptrain.dht.node_config import DHTNodeConfig  # noqa: PLC0415
    from p2ptrain.peer import PeerConfig  # noqa: PLC0415

    throughput = ThroughputConfig(
        upload_bytes_per_s=None if config.upload_mbit is None else config.upload_mbit * _MBIT,
        download_bytes_per_s=(
            None if config.download_mbit is None else config.download_mbit * _MBIT
        ),
    )
    return PeerConfig(
        node=config.node,
        dht=DHTNodeConfig(initial_peers=config.initial_peers),
        matchmaking=MatchmakingConfig(
            window=config.matchmaking_window, poll_interval=0.05, plan_timeout=5.0
        ),
        throughput=throughput,
        identity_path=config.identity_path,
        nat=config.nat,
    )


def _make_trainer(
    config: TrainingSessionConfig, task: TrainingTask, peer: Peer, metrics: Metrics
) -> SwarmTrainer:
    """The session's trainer: DiLoCo with ``diloco_inner_steps``, else the collaborative one,
    from the checkpoint when there is one."""
    from p2ptrain.allreduce.config import AllReduceConfig  # noqa: PLC0415
    from p2ptrain.train import (  # noqa: PLC0415
        CollaborativeOptimizer,
        DiLoCoConfig,
        DiLoCoOptimizer,
        TrainerConfig,
    )

    codec = AllReduceConfig(codec=config.compression)
    inner = task.optimizer
    if config.diloco_inner_steps is not None:
        diloco = DiLoCoConfig(
            run_id=config.run_id,
            inner_steps=config.diloco_inner_steps,
            overlap=config.diloco_overlap,
            outer_lr=_OVERLAP_OUTER_LR if config.diloco_overlap else DiLoCoConfig.outer_lr,
            allreduce=codec,
            progress=config.progress,
        )
        trainer: SwarmTrainer = DiLoCoOptimizer(
            inner, peer=peer, config=diloco, metrics=metrics, model=task.model
        )
    else:
        trainer_config = TrainerConfig(
            run_id=config.run_id,
            target_batch_size=config.target_batch_size,
            step_policy=config.step_policy,
            allreduce=codec,
            progress=config.progress,
        )
        trainer = CollaborativeOptimizer(
            inner, peer=peer, config=trainer_config, metrics=metrics, model=task.model
        )
    checkpoint = config.checkpoint_path
    if checkpoint is not None and Path(checkpoint).exists():
        trainer.load_checkpoint(checkpoint)  # then start() downloads if the swarm moved on
    return trainer


class _Run:
    """A session's training loop: local batches, the trainer's steps, progress events."""

    def __init__(
        self,
        config: TrainingSessionConfig,
        task: TrainingTask,
        *,
        emit: Callable[[dict[str, Any]], None],
        screen: _Display,
        device: torch.device,
    ) -> None:
        from p2ptrain.app.task import lr_schedule  # noqa: PLC0415 - imports torch
        from p2ptrain.metrics import Metrics  # noqa: PLC0415

        self.config = config
        self.task = task
        self.device = device
        self.emit = emit
        self.screen = screen
        self.metrics = Metrics()
        self.schedule = lr_schedule(task)
        self.peer_id = ""
        self.shard, self.num_shards = 0, 1
        self.local, self.last_loss = 0, math.nan
        self.window_start, self.window_samples, self.rate = 0.0, 0, 0.0

    def started(self, peer: Peer, metrics_port: int | None) -> None:
        """The peer joined: take its data shard and emit the ``start`` event."""
        config = self.config
        self.peer_id = peer.peer_id.short
        self.shard, self.num_shards = shard_of(peer.peer_id)
        self.emit(
            {
                "event": "start",
                "time": time.time(),
                "peer_id": self.peer_id,
                "address": peer.address,
                "reach": peer.reach,
                "upload_mbit": config.upload_mbit,
                "download_mbit": config.download_mbit,
                "metrics_port": metrics_port,
                "device": str(self.device),
                **_digest(config, self.task.model),  # the task's initial parameters
            }
        )

    def train(
        self, peer: Peer, trainer: SwarmTrainer, stop: threading.Event | None
    ) -> tuple[TrainingSummary, PeerCapacity]:
        """Train until the deadline or ``stop``; the summary and the capacity announced last."""
        config = self.config
        checkpoint = config.checkpoint_path
        with trainer:
            started = time.monotonic()
            next_save = started + config.checkpoint_interval
            deadline = math.inf if config.seconds is None else started + config.seconds
            # A step waiting for its group ends on time too (or on stop).
            trainer.stop_at(None if config.seconds is None else deadline, event=stop)
            next_log = started
            self.window_start, self.window_samples, self.rate = started, 0, 0.0
            while (now := time.monotonic()) < deadline and not (stop and stop.is_set()):
                if now >= next_log:
                    self._report(trainer, now - started, now)
                    next_log = now + config.log_interval
                self._step(trainer)
                if checkpoint is not None and time.monotonic() >= next_save:
                    trainer.save_checkpoint(checkpoint)
                    next_save = time.monotonic() + config.checkpoint_interval
            elapsed = time.monotonic() - started
            if checkpoint is not None:
                trainer.save_checkpoint(checkpoint)
            stats = trainer.stats
            final_step = trainer.global_step
            announced = peer.capacity()  # what matchmaking announced last
        summary = TrainingSummary(
            peer_id=self.peer_id,
            address=peer.address,
            global_step=final_step,
            local_steps=self.local,
            samples_per_s=self.local * config.batch_size / elapsed if elapsed > 0 else 0.0,
            loss=self.last_loss,
            seconds=elapsed,
            rounds=stats.rounds,
            local_rounds=stats.local_rounds,
            syncs=stats.syncs,
        )
        return summary, announced

    def _step(self, trainer: SwarmTrainer) -> None:
        """One local batch: forward, backward, and the trainer's step."""
        from p2ptrain.app.device import to_device  # noqa: PLC0415 - imports torch

        batch_size = self.config.batch_size
        self.schedule(trainer.global_step)
        batch = to_device(
            self.task.batch(self.local, batch_size, shard=self.shard, num_shards=self.num_shards),
            self.device,
        )
        value = self.task.loss(batch)
        value.backward()  # type: ignore[no-untyped-call]  # torch stubs leave it untyped
        self.last_loss = float(value.item())
        self.local += 1
        self.window_samples += batch_size
        trainer.step(batch_size)

    def _report(self, trainer: SwarmTrainer, elapsed: float, now: float) -> None:
        """Emit a ``progress`` event and redraw the display line."""
        if now > self.window_start:
            self.rate = self.window_samples / (now - self.window_start)
        self.window_start, self.window_samples = now, 0
        view = trainer.swarm_progress()
        step = max(trainer.global_step, view.global_step)
        last_step = trainer.last_step
        self.emit(
            {
                "event": "progress",
                "time": time.time(),
                "elapsed": elapsed,
                "peer_id": self.peer_id,
                "global_step": trainer.global_step,
                "swarm_step": step,
                "local_steps": self.local,
                "loss": self.last_loss,
                "samples_per_s": self.rate,
                "swarm_samples_per_s": view.samples_per_s,
                "peers_online": view.peers_online,
                "rounds": trainer.stats.rounds,
                "local_rounds": trainer.stats.local_rounds,
                "target_batch_size": self.config.target_batch_size,
                "step_samples": None if last_step is None else last_step.samples,
                "step_own_samples": None if last_step is None else last_step.own,
                **_digest(self.config, self.task.model),
                "metrics": self.metrics.snapshot()["metrics"],
            }
        )
        self.screen.show(
            _progress_line(
                samples_per_s=self.rate,
                step=step,
                loss=self.last_loss,
                peers=view.peers_online,
                elapsed=elapsed,
            )
        )


def json_lines_logger(stream: IO[str]) -> Callable[[dict[str, Any]], None]:
    """A ``log`` callback for :func:`run_training_peer` writing one JSON object per line."""

    def write(event: dict[str, Any]) -> None:
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in event.items()
        }
        stream.write(json.dumps(clean) + "\n")
        stream.flush()

    return write


def _seed(text: str) -> int:
    """A 63-bit torch seed from ``text``."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


def _digest(config: TrainingSessionConfig, model: torch.nn.Module) -> dict[str, str]:
    """``{"params_sha256": ...}`` when ``config.log_digest``, else nothing."""
    if not config.log_digest:
        return {}
    from p2ptrain.train.fingerprint import parameters_digest  # noqa: PLC0415 - torch

    return {"params_sha256": parameters_digest(list(model.parameters()))}
