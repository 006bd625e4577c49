"""One training peer from the command line, and a status table of a run.

:func:`run_training_peer` is what ``p2ptrain train`` runs: a
:class:`~p2ptrain.peer.Peer` joins the swarm, a
:class:`~p2ptrain.train.CollaborativeOptimizer` trains the character model of
``p2ptrain.examples.charlm`` for a bounded time, and a one-line display shows the
peer's samples/s, the swarm's global step, the loss and the peers online.
Events also go out as JSON lines (``{"event": "start" | "progress" | "end", ...}``)
for programs such as the swarm demo.

:func:`status_table` is what ``p2ptrain status`` runs: it joins the DHT as a
client, reads the run's progress records and formats one row per live peer.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TextIO

from p2ptrain.errors import ConfigError, DHTError
from p2ptrain.node.config import NodeConfig
from p2ptrain.secure.identity import PeerID
from p2ptrain.train.progress import PeerProgress, ProgressConfig, aggregate

if TYPE_CHECKING:
    import torch

    from p2ptrain.dht.api import DHT
    from p2ptrain.nat.config import NATConfig
    from p2ptrain.nat.records import PeerRecord

__all__ = [
    "StatusConfig",
    "TrainingSessionConfig",
    "TrainingSummary",
    "format_status",
    "json_lines_logger",
    "read_nat_records",
    "read_progress",
    "run_training_peer",
    "status_json",
    "status_table",
    "watch_status",
]

_NUM_SHARDS = 2**40
"""Shards of the data; a peer's is its whole PeerID digest modulo this, so two
of even a thousand peers share one with probability below 10**-6."""
_MBIT = 1e6 / 8
_OVERLAP_OUTER_LR = 0.35  # DiLoCo outer lr with overlapped rounds (docs/training.md)


def _number(owner: str, name: str, value: object, *, low: float, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{owner}.{name} must be a number, got {value!r}")
    if not (math.isfinite(value) and value > low):
        raise ConfigError(f"{owner}.{name} must be finite and > {low}, got {value!r}")


def _integer(owner: str, name: str, value: object, *, low: int, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{owner}.{name} must be an int >= {low}, got {value!r}")


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
        _integer(owner, "target_batch_size", self.target_batch_size, low=1, allow_none=False)
        _integer(owner, "batch_size", self.batch_size, low=1, allow_none=False)
        if self.step_policy not in ("carry", "wait"):
            raise ConfigError(f"{owner}.step_policy must be 'carry' or 'wait'")
        _number(owner, "seconds", self.seconds, low=0.0, allow_none=True)
        _number(owner, "upload_mbit", self.upload_mbit, low=0.0, allow_none=True)
        _number(owner, "download_mbit", self.download_mbit, low=0.0, allow_none=True)
        _integer(owner, "metrics_port", self.metrics_port, low=0, allow_none=True)
        if self.metrics_port is not None and self.metrics_port > 65535:
            raise ConfigError(f"{owner}.metrics_port must be at most 65535")
        if not isinstance(self.metrics_host, str) or not self.metrics_host:
            raise ConfigError(f"{owner}.metrics_host must be a host name or address")
        _number(owner, "log_interval", self.log_interval, low=0.0, allow_none=False)
        if not isinstance(self.node, NodeConfig):
            raise ConfigError(f"{owner}.node must be a NodeConfig")
        if self.task is not None and (not isinstance(self.task, str) or not self.task):
            raise ConfigError(f"{owner}.task must be a module name or a .py path")
        _integer(owner, "torch_threads", self.torch_threads, low=1, allow_none=True)
        _integer(owner, "diloco_inner_steps", self.diloco_inner_steps, low=1, allow_none=True)
        if not isinstance(self.diloco_overlap, bool):
            raise ConfigError(f"{owner}.diloco_overlap must be a bool")
        if self.diloco_overlap and self.diloco_inner_steps is None:
            raise ConfigError(f"{owner}.diloco_overlap needs diloco_inner_steps (--diloco H)")
        _number(owner, "checkpoint_interval", self.checkpoint_interval, low=0.0, allow_none=False)
        _number(owner, "matchmaking_window", self.matchmaking_window, low=0.0, allow_none=False)
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

    from p2ptrain.allreduce.bandwidth import ThroughputConfig  # noqa: PLC0415
    from p2ptrain.allreduce.config import AllReduceConfig  # noqa: PLC0415
    from p2ptrain.allreduce.matchmaking import MatchmakingConfig  # noqa: PLC0415
    from p2ptrain.app.collectors import dht_collector, nat_collector, node_collector  # noqa: PLC0415
    from p2ptrain.app.task import load_task, lr_schedule  # noqa: PLC0415 - imports torch
    from p2ptrain.dht.node_config import DHTNodeConfig  # noqa: PLC0415
    from p2ptrain.metrics import Metrics, MetricsServer  # noqa: PLC0415
    from p2ptrain.peer import Peer, PeerConfig  # noqa: PLC0415
    from p2ptrain.train import (  # noqa: PLC0415
        CollaborativeOptimizer,
        DiLoCoConfig,
        DiLoCoOptimizer,
        TrainerConfig,
    )
    from p2ptrain.train.base import SwarmTrainer  # noqa: PLC0415

    # Every peer of a run builds the model from the same random state, so that
    # a task that does not seed its initialisation still starts each run from
    # one set of parameters; then each peer draws its own randomness again.
    torch.manual_seed(_seed(config.run_id))
    task = load_task(config.task)
    torch.manual_seed(_seed(os.urandom(16).hex()))
    emit = log or (lambda event: None)
    if config.torch_threads is not None:
        torch.set_num_threads(config.torch_threads)
    inner = task.optimizer
    schedule = lr_schedule(task)

    throughput = ThroughputConfig(
        upload_bytes_per_s=None if config.upload_mbit is None else config.upload_mbit * _MBIT,
        download_bytes_per_s=(
            None if config.download_mbit is None else config.download_mbit * _MBIT
        ),
    )
    peer_config = PeerConfig(
        node=config.node,
        dht=DHTNodeConfig(initial_peers=config.initial_peers),
        matchmaking=MatchmakingConfig(
            window=config.matchmaking_window, poll_interval=0.05, plan_timeout=5.0
        ),
        throughput=throughput,
        identity_path=config.identity_path,
        nat=config.nat,
    )
    codec = AllReduceConfig(codec=config.compression)
    metrics = Metrics()
    screen = _Display(display)
    with Peer(peer_config) as peer:
        metrics.add_collector(node_collector(peer.node))
        metrics.add_collector(dht_collector(peer.dht.dht_node))
        if peer.nat is not None:
            metrics.add_collector(nat_collector(peer.nat))
        server: MetricsServer | None = None
        if config.metrics_port is not None:
            server = MetricsServer(metrics, host=config.metrics_host, port=config.metrics_port)
            peer.run(server.start(), timeout=10)
        started_wall = time.time()
        emit(
            {
                "event": "start",
                "time": started_wall,
                "peer_id": peer.peer_id.short,
                "address": peer.address,
                "reach": peer.reach,
                "upload_mbit": config.upload_mbit,
                "download_mbit": config.download_mbit,
                "metrics_port": None if server is None else server.port,
                **_digest(config, task.model),  # the task's initial parameters
            }
        )
        if announce is not None:
            announce(peer.address)
        shard, num_shards = shard_of(peer.peer_id)
        local, last_loss = 0, math.nan
        trainer: SwarmTrainer
        if config.diloco_inner_steps is not None:
            diloco = DiLoCoConfig(
                run_id=config.run_id,
                inner_steps=config.diloco_inner_steps,
                overlap=config.diloco_overlap,
                outer_lr=_OVERLAP_OUTER_LR if config.diloco_overlap else DiLoCoConfig.outer_lr,
                allreduce=codec,
                progress=config.progress,
            )
            trainer = DiLoCoOptimizer(
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
        try:
            with trainer:
                started = time.monotonic()
                next_save = started + config.checkpoint_interval
                deadline = math.inf if config.seconds is None else started + config.seconds
                # A step waiting for its group ends on time too (or on stop).
                trainer.stop_at(None if config.seconds is None else deadline, event=stop)
                next_log = started
                window_start, window_samples, rate = started, 0, 0.0
                while (now := time.monotonic()) < deadline and not (stop and stop.is_set()):
                    if now >= next_log:
                        if now > window_start:
                            rate = window_samples / (now - window_start)
                        window_start, window_samples = now, 0
                        view = trainer.swarm_progress()
                        step = max(trainer.global_step, view.global_step)
                        last_step = trainer.last_step
                        emit(
                            {
                                "event": "progress",
                                "time": time.time(),
                                "elapsed": now - started,
                                "peer_id": peer.peer_id.short,
                                "global_step": trainer.global_step,
                                "swarm_step": step,
                                "local_steps": local,
                                "loss": last_loss,
                                "samples_per_s": rate,
                                "swarm_samples_per_s": view.samples_per_s,
                                "peers_online": view.peers_online,
                                "rounds": trainer.stats.rounds,
                                "local_rounds": trainer.stats.local_rounds,
                                "target_batch_size": config.target_batch_size,
                                "step_samples": None if last_step is None else last_step.samples,
                                "step_own_samples": None if last_step is None else last_step.own,
                                **_digest(config, task.model),
                                "metrics": metrics.snapshot()["metrics"],
                            }
                        )
                        screen.show(
                            _progress_line(
                                samples_per_s=rate,
                                step=step,
                                loss=last_loss,
                                peers=view.peers_online,
                                elapsed=now - started,
                            )
                        )
                        next_log = now + config.log_interval
                    schedule(trainer.global_step)
                    batch = task.batch(local, config.batch_size, shard=shard, num_shards=num_shards)
                    value = task.loss(batch)
                    value.backward()  # type: ignore[no-untyped-call]  # torch stubs leave it untyped
                    last_loss = float(value.item())
                    local += 1
                    window_samples += config.batch_size
                    trainer.step(config.batch_size)
                    if checkpoint is not None and time.monotonic() >= next_save:
                        trainer.save_checkpoint(checkpoint)
                        next_save = time.monotonic() + config.checkpoint_interval
                elapsed = time.monotonic() - started
                if checkpoint is not None:
                    trainer.save_checkpoint(checkpoint)
                stats = trainer.stats
                final_step = trainer.global_step
                announced = peer.capacity()  # what matchmaking announced last
            if config.save_path is not None:
                torch.save(task.model.state_dict(), config.save_path)
        finally:
            screen.done()
            if server is not None:
                peer.run(server.aclose(), timeout=10)
        summary = TrainingSummary(
            peer_id=peer.peer_id.short,
            address=peer.address,
            global_step=final_step,
            local_steps=local,
            samples_per_s=local * config.batch_size / elapsed if elapsed > 0 else 0.0,
            loss=last_loss,
            seconds=elapsed,
            rounds=stats.rounds,
            local_rounds=stats.local_rounds,
            syncs=stats.syncs,
        )
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


# -- status ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class StatusConfig:
    """Where ``p2ptrain status`` reads a run's progress.

    Attributes:
        initial_peers: Addresses to join the DHT through.
        run_id: The run to report on.
        timeout: Seconds to join and read.
        node: How the reading peer's node is configured (swarm name, secret).
    """

    initial_peers: tuple[str, ...]
    run_id: str = "charlm"
    timeout: float = 20.0
    node: NodeConfig = field(default_factory=lambda: NodeConfig(port=0))

    def __post_init__(self) -> None:
        _addresses("StatusConfig", self.initial_peers)
        if not self.initial_peers:
            raise ConfigError("StatusConfig.initial_peers must name at least one peer")
        if not isinstance(self.run_id, str) or not self.run_id or "/" in self.run_id:
            raise ConfigError("StatusConfig.run_id must be a non-empty name without '/'")
        _number("StatusConfig", "timeout", self.timeout, low=0.0, allow_none=False)
        if not isinstance(self.node, NodeConfig):
            raise ConfigError("StatusConfig.node must be a NodeConfig")


async def read_progress(dht: DHT, run_id: str) -> list[PeerProgress]:
    """Read the live progress records of ``run_id`` from ``dht`` (a started :class:`DHT`)."""
    from p2ptrain.dht.records import key_owner, owner_bound_key  # noqa: PLC0415
    from p2ptrain.errors import IdentityError, RemoteProtocolError  # noqa: PLC0415
    from p2ptrain.train.tracker import PROGRESS_SUBKEY, progress_key  # noqa: PLC0415

    entries = await dht.get_dictionary(progress_key(run_id))
    records: list[PeerProgress] = []
    for subkey, item in entries.items():
        owner = key_owner(subkey)
        if owner is None or subkey != owner_bound_key(PROGRESS_SUBKEY, owner):
            continue
        try:
            records.append(PeerProgress.from_wire(PeerID.from_public_key(owner), item.value))
        except (RemoteProtocolError, IdentityError):
            continue
    return records


async def read_nat_records(dht: DHT, peers: Sequence[PeerID]) -> dict[PeerID, PeerRecord]:
    """The NAT records of ``peers`` that published one (lookups that fail are left out)."""
    import asyncio  # noqa: PLC0415

    from p2ptrain.errors import P2PTrainError  # noqa: PLC0415
    from p2ptrain.nat.records import find_record  # noqa: PLC0415 - p2ptrain.nat loads aiortc

    async def one(peer: PeerID) -> PeerRecord | None:
        try:
            return await find_record(dht, peer)
        except P2PTrainError:
            return None

    found = await asyncio.gather(*(one(peer) for peer in peers))
    return {peer: record for peer, record in zip(peers, found, strict=True) if record is not None}


def _reachability(record: PeerProgress, nat: PeerRecord | None = None) -> str:
    """The "reach/path" cell: how the peer is reached, from its NAT record if it has one."""
    if nat is not None:
        if nat.nat == "public":
            where = nat.addresses[0] if nat.addresses else "?"
            return f"public, tcp-direct {where}"
        paths = []
        if nat.rendezvous:
            if nat.holepunch:
                paths.append("holepunch")
            paths.append("webrtc")
            if any(point.relay for point in nat.rendezvous):
                paths.append("relay")
        via = f"via {len(nat.rendezvous)} rendezvous" if nat.rendezvous else "no rendezvous"
        return f"nat:{nat.nat}, {'/'.join(paths) or 'unreachable'} {via}"
    if record.address is None:
        return "client mode (dials out only)"
    host_port = record.address.rsplit("@", 1)[-1]
    reach = record.reach or "direct"
    return f"{reach}, tcp-direct {host_port}" if reach != "direct" else f"direct {host_port}"


def _bandwidth(record: PeerProgress) -> str:
    """The "up/down MB/s" cell (1 MB = 10**6 bytes), or "?" for a peer that did not say."""
    up, down = record.upload_bytes_per_s, record.download_bytes_per_s
    if up is None or down is None:
        return "?"
    return f"{up / 1e6:.1f}/{down / 1e6:.1f}"


def _step_samples(record: PeerProgress) -> str:
    """The "step samples/target" cell: the samples of the peer's latest step, and its target."""
    samples = "?" if record.last_step_samples is None else str(record.last_step_samples)
    target = "?" if record.target is None else str(record.target)
    return f"{samples}/{target}"


def _seed(text: str) -> int:
    """A 63-bit torch seed from ``text``."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


def _digest(config: TrainingSessionConfig, model: torch.nn.Module) -> dict[str, str]:
    """``{"params_sha256": ...}`` when ``config.log_digest``, else nothing."""
    if not config.log_digest:
        return {}
    from p2ptrain.train.fingerprint import parameters_digest  # noqa: PLC0415 - torch

    return {"params_sha256": parameters_digest(list(model.parameters()))}


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    return f"{seconds:.1f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago"


def format_status(
    records: Sequence[PeerProgress],
    *,
    run_id: str,
    now: float,
    target_batch_size: int | None,
    nat_records: Mapping[PeerID, PeerRecord] | None = None,
) -> str:
    """Format progress records as a table, one row per peer, highest step first.

    Args:
        records: The run's live records.
        run_id: The run's name, for the heading.
        now: The current time (Unix seconds), for "last seen".
        target_batch_size: The run's target, if known, for the heading.
        nat_records: The NAT records (:mod:`p2ptrain.nat.records`) of the
            peers that run NAT traversal, for the "reach/path" column.
    """
    nat_records = nat_records or {}
    view = aggregate(records, target_batch_size=target_batch_size, now=now)
    if not view.records:
        return f"run {run_id!r}: no live peers found"
    headers = (
        "PeerID",
        "reach/path",
        "samples/s",
        "up/down MB/s",
        "last seen",
        "step samples/target",
        "global step",
    )
    rows = [
        (
            r.peer_id.short,
            _reachability(r, nat_records.get(r.peer_id)),
            f"{r.samples_per_s:.1f}",
            _bandwidth(r),
            _ago(now - r.time),
            _step_samples(r),
            str(r.step),
        )
        for r in view.records
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    heading = (
        f"run {run_id!r}: {view.peers_online} peers online, global step {view.global_step}, "
        f"{view.samples_per_s:.1f} samples/s"
    )
    return "\n".join(
        [heading, line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)]
    )


def status_table(config: StatusConfig) -> str:
    """Join the DHT as a client, read the run's progress records and format them.

    Raises:
        LookupFailedError: None of the initial peers answered.
        DHTError: Joining and reading took longer than ``config.timeout``.
    """
    return watch_status(config, render=_table_of(config), count=1)[0]


def status_json(
    records: Sequence[PeerProgress],
    *,
    run_id: str,
    now: float,
    nat_records: Mapping[PeerID, PeerRecord] | None = None,
) -> dict[str, Any]:
    """The status of a run as a JSON-able dict (``p2ptrain status --json``).

    Keys: ``run_id``, ``time``, ``peers_online``, ``global_step``,
    ``samples_per_s`` and ``peers``, one dict per live peer (highest step
    first) with ``peer_id``, ``reach``, ``samples_per_s``,
    ``upload_bytes_per_s``, ``download_bytes_per_s``, ``last_seen_s`` and
    ``global_step``.
    """
    nat_records = nat_records or {}
    view = aggregate(records, target_batch_size=None, now=now)
    return {
        "run_id": run_id,
        "time": now,
        "peers_online": view.peers_online,
        "global_step": view.global_step,
        "samples_per_s": view.samples_per_s,
        "peers": [
            {
                "peer_id": str(r.peer_id),
                "reach": _reachability(r, nat_records.get(r.peer_id)),
                "samples_per_s": r.samples_per_s,
                "upload_bytes_per_s": r.upload_bytes_per_s,
                "download_bytes_per_s": r.download_bytes_per_s,
                "last_seen_s": max(0.0, now - r.time),
                "global_step": r.step,
            }
            for r in view.records
        ],
    }


_Render = Callable[[list[PeerProgress], "dict[PeerID, PeerRecord]", float], str]


def _table_of(config: StatusConfig) -> _Render:
    def render(records: list[PeerProgress], nat: dict[PeerID, PeerRecord], now: float) -> str:
        return format_status(
            records, run_id=config.run_id, now=now, target_batch_size=None, nat_records=nat
        )

    return render


def _json_of(config: StatusConfig) -> _Render:
    def render(records: list[PeerProgress], nat: dict[PeerID, PeerRecord], now: float) -> str:
        return json.dumps(status_json(records, run_id=config.run_id, now=now, nat_records=nat))

    return render


def watch_status(
    config: StatusConfig,
    *,
    render: _Render | None = None,
    as_json: bool = False,
    interval: float = 2.0,
    count: int | None = None,
    show: Callable[[str], None] | None = None,
) -> list[str]:
    """Read the run's status every ``interval`` seconds through one DHT client.

    Args:
        config: Where to read.
        render: Formats one reading (default: the table, or JSON with ``as_json``).
        as_json: Render each reading as one JSON line.
        interval: Seconds between readings.
        count: Readings to take, or ``None`` for as many as until interrupted.
        show: Called with each rendered reading as it comes.

    Returns:
        The rendered readings (only the last one when ``count`` is None).

    Raises:
        LookupFailedError: None of the initial peers answered.
        DHTError: Joining and the first reading took longer than ``config.timeout``.
    """
    import asyncio  # noqa: PLC0415

    from p2ptrain.aio import run  # noqa: PLC0415
    from p2ptrain.dht.api import DHT  # noqa: PLC0415
    from p2ptrain.dht.node_config import DHTNodeConfig  # noqa: PLC0415

    if count is not None and count < 1:
        raise ConfigError("the status needs at least one reading")
    _number("watch_status", "interval", interval, low=0.0, allow_none=False)
    draw = render or (_json_of(config) if as_json else _table_of(config))
    shown: list[str] = []

    async def reading(dht: DHT) -> str:
        records = await read_progress(dht, config.run_id)
        nat = await read_nat_records(dht, [r.peer_id for r in records])
        return draw(records, nat, time.time())

    async def loop(dht: DHT) -> None:
        taken = 0
        while count is None or taken < count:
            if taken:
                await asyncio.sleep(interval)  # the refresh period, not a wait for a condition
            try:
                async with asyncio.timeout(config.timeout):
                    text = await reading(dht)
            except TimeoutError:
                raise DHTError(f"no answer from the swarm within {config.timeout:g} s") from None
            taken += 1
            shown[:] = [*shown, text] if count is not None else [text]
            if show is not None:
                show(text)

    async def main() -> None:
        dht_config = DHTNodeConfig(initial_peers=config.initial_peers, client_mode=True)
        try:
            async with asyncio.timeout(config.timeout) as joining:
                async with DHT(node_config=config.node, config=dht_config) as dht:
                    joining.reschedule(None)  # joined: each reading has its own deadline
                    await loop(dht)
        except TimeoutError:
            raise DHTError(f"no answer from the swarm within {config.timeout:g} s") from None

    run(main())
    return shown
