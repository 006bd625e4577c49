"""SWARM pipeline training with many peers in one process, on the virtual clock.

What runs as in production, over :class:`~p2ptrain.lab.simnet.SimNetwork`
(per-peer link rates and round-trip times) on a
:class:`~p2ptrain.lab.virtual_clock.VirtualClockLoop`:

* every peer's :class:`~p2ptrain.node.node.Node` (handshake, RPC) and
  :class:`~p2ptrain.dht.api.DHT`;
* the stage directory (:func:`p2ptrain.swarm.directory.announce` and
  :func:`~p2ptrain.swarm.directory.read_stage`, with its TTLs);
* the trainers: :class:`p2ptrain.swarm.trainer.PipelineTrainer` (on the
  virtual clock through its ``clock`` argument), its wiring rule, retries
  and pause, calling the pipeline protocol (:mod:`p2ptrain.swarm.protocol`)
  over the simulated links;
* rebalancing: one :class:`p2ptrain.swarm.rebalance.Rebalancer` per stage
  peer, reading the directory every period and moving its peer.

* the stage servers: the production :class:`~p2ptrain.swarm.server.StageServer`
  (its handlers, hold cap and expiry, commit ledger and receipts,
  announcements, measured rate and moves), started with
  :meth:`~p2ptrain.swarm.server.StageServer.astart` on the simulated host.

Two collaborators of the server are swapped for ones on the virtual clock,
through its ``device`` and ``stage_optimizer`` arguments:
:class:`VirtualDevice` (the compute runs at once, then the call holds the
device for the peer's emulated compute time, as ``min_compute_s`` does in real
processes) and :class:`LocalStageOptimizer` (each stage peer steps alone at
every hand-over: no stage-wise averaging, because
:class:`~p2ptrain.train.CollaborativeOptimizer` is built on a
:class:`~p2ptrain.peer.Peer`, a loop in its own thread). A peer that leaves
by churn crashes: its host is cut off and its server aborted, nothing handed
over or withdrawn; the trainers replay what it had not counted.

Throughput is what the trainers deliver (samples whose backward through
stage 0 completed) per virtual second of each rebalancing period; the ideal
is the live peers' summed speed divided by the number of stages (equal
stages), which no assignment can beat.

Example::

    async def main() -> None:
        async with SwarmSimulation(SwarmSimConfig(start=(40, 8, 8, 8))) as sim:
            for period in await sim.run(10):
                print(period.throughput, period.ideal, period.counts)

    run_virtual(main())
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar, cast

import torch
from torch import nn

from p2ptrain.dht.api import DHT
from p2ptrain.dht.config import DHTConfig
from p2ptrain.dht.node_config import DHTNodeConfig
from p2ptrain.errors import ConfigError, P2PTrainError
from p2ptrain.lab.simnet import LinkProfile, SimEndpoint, SimNetwork
from p2ptrain.lab.simulator import EPOCH, HOME_LINKS
from p2ptrain.node.config import NodeConfig
from p2ptrain.node.node import Node
from p2ptrain.secure.identity import Identity
from p2ptrain.swarm.config import PipelineTrainerConfig, StageServerConfig
from p2ptrain.swarm.rebalance import (
    PeerLoad,
    RebalanceConfig,
    Rebalancer,
    newcomer_stage,
    read_loads,
)
from p2ptrain.swarm.server import StageServer
from p2ptrain.swarm.stages import PipelineModel
from p2ptrain.swarm.trainer import PipelineTrainer
from p2ptrain.train.collaboration import StepRecord, TrainerStats

if TYPE_CHECKING:
    from p2ptrain.peer import Peer

__all__ = [
    "LocalStageOptimizer",
    "PeriodResult",
    "SimStagePeer",
    "SwarmSimConfig",
    "SwarmSimulation",
    "VirtualDevice",
    "ideal_throughput",
]

logger = logging.getLogger(__name__)

R = TypeVar("R")
T = TypeVar("T")


@dataclass(frozen=True)
class SwarmSimConfig:
    """A simulated pipeline swarm.

    Attributes:
        start: Stage peers serving each stage at the start (one entry per stage).
        speed_spread: Fastest over slowest peer speed; each peer's speed is
            drawn log-uniformly in ``[1, speed_spread]`` times the slowest.
        compute_s: Seconds the slowest peer computes one micro-batch
            (forward plus backward).
        micro_batch: Samples per micro-batch.
        width: Features of the model (one Linear block per stage).
        trainers: Trainer peers.
        in_flight: Micro-batches in flight over all trainers (0: eight times
            the number of stage peers; at 256 peers, 10 % churn and 1:8 speeds,
            four times left the bottleneck stage idle 18-20 % of the time,
            eight times 8-13 %).
        period_s: Rebalancing period (virtual seconds); throughput is
            measured per period.
        churn: Share of the stage peers that leave abruptly during each
            period; as many new peers (with fresh speeds) join, at random
            moments, on the stage :func:`~p2ptrain.swarm.rebalance.newcomer_stage` picks.
        rebalance: Run the rebalancers (off: the start assignment stays).
        min_gain: The rebalancing threshold (``RebalanceConfig.min_gain``).
        max_held_per_peer: Each stage server's cap on one trainer's held
            micro-batches (``StageServerConfig.max_held_per_peer``).
        step_interval: Seconds between a stage peer's hand-overs (its steps).
        announce_interval: Seconds between a stage peer's announcements.
        announce_ttl: Seconds an announcement lives.
        replicas: DHT replicas of each record (fewer: less traffic at scale).
        links: (download, upload) Mbit/s choices, drawn uniformly per peer.
        rtt_ms: Range of round-trip times to the core, drawn uniformly per peer.
        seed: Seeds speeds, links, churn and the wiring.
    """

    start: tuple[int, ...] = (40, 8, 8, 8)
    speed_spread: float = 1.0
    compute_s: float = 3.0
    micro_batch: int = 4
    width: int = 8
    trainers: int = 4
    in_flight: int = 0
    period_s: float = 60.0
    churn: float = 0.0
    rebalance: bool = True
    min_gain: float = 0.05
    max_held_per_peer: int = 64
    step_interval: float = 5.0
    announce_interval: float = 6.0
    announce_ttl: float = 20.0
    replicas: int = 3
    links: tuple[tuple[float, float], ...] = HOME_LINKS
    rtt_ms: tuple[float, float] = (20.0, 80.0)
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.start or any(n < 1 for n in self.start):
            raise ConfigError("start must give every stage at least one peer")
        if not (math.isfinite(self.speed_spread) and self.speed_spread >= 1):
            raise ConfigError("speed_spread must be >= 1")
        for name in ("compute_s", "period_s", "step_interval", "announce_interval", "announce_ttl"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be positive, got {value!r}")
        if self.micro_batch < 1 or self.width < 1 or self.trainers < 1 or self.in_flight < 0:
            raise ConfigError("micro_batch, width and trainers must be >= 1, in_flight >= 0")
        if not 0 <= self.churn < 1:
            raise ConfigError("churn must be in [0, 1)")
        if self.replicas < 1:
            raise ConfigError("replicas must be >= 1")
        if not self.links:
            raise ConfigError("links must not be empty")

    @property
    def stages(self) -> int:
        """Number of stages."""
        return len(self.start)


@dataclass(frozen=True)
class PeriodResult:
    """One rebalancing period of a simulation.

    Attributes:
        period: Its index (0: before the first rebalancing decision).
        throughput: Samples/s the trainers delivered during it.
        ideal: Samples/s of the best assignment of the peers live at its end
            (their summed speed over the number of stages).
        counts: Peers serving each stage at its end.
        capacity: Summed speed (samples/s) of each stage's peers at its end.
        moves: Moves the rebalancers made during it.
        killed: Stage peers that left during it.
        retries: Trainer retries during it.
        cpu_s: Wall seconds it took to simulate.
    """

    period: int
    throughput: float
    ideal: float
    counts: tuple[int, ...]
    capacity: tuple[float, ...]
    moves: int
    killed: int
    retries: int
    cpu_s: float

    @property
    def fraction(self) -> float:
        """Throughput over the ideal."""
        return self.throughput / self.ideal if self.ideal > 0 else 0.0


def ideal_throughput(speeds: Sequence[float], stages: int) -> float:
    """The best pipeline throughput of peers of these speeds over equal stages.

    No assignment beats ``sum / stages``; a peer faster than that share
    serves alone and the rest split the remaining stages, so the bound is
    computed with those peers taken out.
    """
    ordered = sorted(speeds, reverse=True)
    while stages > 0 and ordered and ordered[0] > sum(ordered) / stages:
        ordered.pop(0)
        stages -= 1
    return sum(ordered) / stages if stages and ordered else 0.0


class _Host:
    """A node and its DHT on a simulated host."""

    def __init__(
        self, net: SimNetwork, host: str, link: LinkProfile, config: SwarmSimConfig
    ) -> None:
        self.host = host
        self.endpoint: SimEndpoint = net.add_host(host, link)
        self.node = Node(
            identity=Identity.generate(),
            config=NodeConfig(
                host=host, dial_timeout=5.0, max_connections=512, memory_release_interval=0
            ),
            network=self.endpoint,
        )
        self.dht: DHT | None = None
        self._config = config

    @property
    def address(self) -> str:
        """``peerid@host:port``."""
        return str(self.node.address)

    async def start(self, initial_peers: Sequence[str]) -> DHT:
        loop = asyncio.get_running_loop()
        await self.node.start()
        self.dht = DHT(
            node=self.node,
            config=DHTNodeConfig(
                dht=DHTConfig(replicas=self._config.replicas),
                initial_peers=tuple(initial_peers),
            ),
            clock=lambda: EPOCH + loop.time(),
            rng=random.Random(self.host),
        )
        await self.dht.start()
        return self.dht

    async def aclose(self) -> None:
        if self.dht is not None:
            await self.dht.aclose()
        await self.node.aclose()


class VirtualDevice:
    """A stage server's device on the virtual clock: the compute runs at once on
    the loop, then the call holds the device until ``min_compute_s`` virtual
    seconds passed (the emulated speed; :class:`~p2ptrain.swarm.device.ThreadDevice`
    does the same in wall-clock time in real processes)."""

    def __init__(self, min_compute_s: float) -> None:
        self.min_compute_s = min_compute_s
        self._busy = asyncio.Lock()

    def now(self) -> float:
        """The loop's (virtual) time."""
        return asyncio.get_running_loop().time()

    async def run(self, compute: Callable[[], R], finish: Callable[[R], T]) -> tuple[T, float]:
        """``finish(compute())`` after ``min_compute_s`` virtual seconds of the device."""
        async with self._busy:
            loop = asyncio.get_running_loop()
            started = loop.time()
            result = compute()
            await asyncio.sleep(self.min_compute_s)
            return finish(result), loop.time() - started

    async def idle(self) -> None:
        """Wait for the running call."""
        async with self._busy:
            pass

    def shutdown(self) -> None:
        """Nothing to stop."""


class LocalStageOptimizer:
    """A stage's optimizer that steps alone at every hand-over (no averaging).

    The simulator's stand-in for :class:`~p2ptrain.train.CollaborativeOptimizer`,
    which is built on a :class:`~p2ptrain.peer.Peer` (a loop in its own thread)
    and cannot run on the virtual clock. Every hand-over is a step holding
    exactly the samples handed over, so the server's commit ledger and the
    trainers' receipts run as in production (each commit is counted by the
    next step, or lost when its server leaves).
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer
        self._lock = threading.Lock()
        self._step = 0
        self._last: StepRecord | None = None

    @property
    def state_lock(self) -> threading.Lock:
        """Held while the parameters change."""
        return self._lock

    @property
    def global_step(self) -> int:
        """Steps applied."""
        return self._step

    @property
    def local_samples(self) -> int:
        """Always 0: every hand-over steps."""
        return 0

    @property
    def last_step(self) -> StepRecord | None:
        """The latest step."""
        return self._last

    @property
    def stats(self) -> TrainerStats:
        """Its step count (it never downloads a state)."""
        return TrainerStats(global_step=self._step)

    def start(self) -> None:
        """Nothing to join."""

    def step(self, batch_size: int | None = None) -> bool:
        """Step on the handed-over gradients if they hold samples."""
        if not batch_size:
            return False
        with self._lock:
            self._optimizer.step()
            self._optimizer.zero_grad(set_to_none=True)
            self._last = StepRecord(self._step, batch_size, batch_size, None)
            self._step += 1
        return True

    def close(self) -> None:
        """Nothing to leave."""


class _ServingPeer:
    """What :class:`StageServer` and :class:`PipelineTrainer` use of a peer: node, DHT, address."""

    running = True

    def __init__(self, host: _Host) -> None:
        self.node = host.node
        self.dht = host.dht
        self.address = host.address


class SimStagePeer:
    """A simulated host serving a stage with the production
    :class:`~p2ptrain.swarm.server.StageServer` on a :class:`VirtualDevice`.

    Args:
        host: Its started host (node and DHT).
        model: The pipeline's model.
        stage: The stage it serves first.
        compute_s: Virtual seconds it computes one micro-batch (half in the
            forward, half in the backward, as ``min_compute_s`` emulates a device).
        run_id: The pipeline run.
        config: The simulation (announcement and step timing).
    """

    def __init__(
        self,
        *,
        host: _Host,
        model: PipelineModel,
        stage: int,
        compute_s: float,
        run_id: str,
        config: SwarmSimConfig,
    ) -> None:
        self.host = host
        self.compute_s = compute_s
        self._config = config
        self.server = StageServer(
            peer=cast("Peer", _ServingPeer(host)),
            model=model,
            stage=stage,
            make_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01),
            config=StageServerConfig(
                run_id=run_id,
                target_batch_size=1 << 30,
                min_compute_s=compute_s / 2,
                hold_timeout=60 * config.compute_s,  # as the trainers' call timeout
                max_held_per_peer=config.max_held_per_peer,
                step_interval=config.step_interval,
                handover_samples=1,  # hand over at every step_interval (virtual time)
                announce_interval=config.announce_interval,
                announce_ttl=config.announce_ttl,
            ),
            device=VirtualDevice(compute_s / 2),
            stage_optimizer=lambda optimizer, _module, _config: LocalStageOptimizer(optimizer),
        )
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def speed(self) -> float:
        """Its true speed in samples/s (the simulation's knowledge, not announced)."""
        return self._config.micro_batch / self.compute_s

    @property
    def stage(self) -> int:
        """The stage it serves now."""
        return self.server.stage

    @property
    def moves(self) -> int:
        """Its moves between stages."""
        return self.server.stats.moves

    @property
    def peer(self) -> str:
        """Its id as the rebalancing policy names it."""
        return str(self.host.node.peer_id)

    async def start(self) -> None:
        """Build the stage, serve and announce."""
        await self.server.astart()

    def add_task(self, task: asyncio.Task[None]) -> None:
        """Own ``task`` (cancelled on :meth:`aclose`)."""
        self._tasks.append(task)

    async def aclose(self, *, abrupt: bool = False) -> None:
        """Stop; ``abrupt``: its host is already cut off (a crash), skip the clean close."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await (self.server.abort() if abrupt else self.server.aclose())
        await self.host.aclose()

    async def read_loads(self) -> list[PeerLoad]:
        """Every stage's announced peers, as the rebalancing policy reads them."""
        dht = self.host.dht
        if dht is None:
            raise RuntimeError("the host is not started")
        return await read_loads(dht, self.server.config.run_id, self._config.stages)


class SwarmSimulation:
    """Stage peers, trainers and rebalancers on one :class:`SimNetwork`; use ``async with``."""

    RUN_ID = "sim-pipeline"

    def __init__(self, config: SwarmSimConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.net = SimNetwork(rng=random.Random(config.seed + 1))
        width = config.width
        self.model = PipelineModel.even(
            [lambda: nn.Linear(width, width)] * config.stages, config.stages, seed=config.seed
        )
        self.servers: list[SimStagePeer] = []
        self.trainers: list[PipelineTrainer] = []
        self._bootstrap: _Host | None = None
        self._trainer_hosts: list[_Host] = []
        self._workers: list[asyncio.Task[None]] = []
        self._hosts = 0
        self._periods = 0
        self._dead_moves = 0
        self._torch = torch.Generator().manual_seed(config.seed)

    async def __aenter__(self) -> SwarmSimulation:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _new_host(self) -> _Host:
        self._hosts += 1
        down, up = self.rng.choice(self.config.links)
        low, high = self.config.rtt_ms
        link = LinkProfile.mbit(down, up, self.rng.uniform(low, high))
        n = self._hosts
        return _Host(self.net, f"10.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}", link, self.config)

    def _draw_compute_s(self) -> float:
        spread = self.config.speed_spread
        speedup = math.exp(self.rng.uniform(0.0, math.log(spread))) if spread > 1 else 1.0
        return self.config.compute_s / speedup

    async def start(self) -> None:
        """Start the bootstrap, the stage peers (in waves), the trainers and their workers."""
        cfg = self.config
        self._bootstrap = self._new_host()
        await self._bootstrap.start(())
        stages = [s for s, n in enumerate(cfg.start) for _ in range(n)]
        wave = 32
        for i in range(0, len(stages), wave):
            started = await asyncio.gather(*(self._start_server(s) for s in stages[i : i + wave]))
            self.servers += started
        for _ in range(cfg.trainers):
            host = self._new_host()
            await host.start([self._bootstrap.address])
            self._trainer_hosts.append(host)
            trainer = PipelineTrainer(
                peer=cast("Peer", _ServingPeer(host)),
                config=PipelineTrainerConfig(
                    run_id=self.RUN_ID,
                    num_stages=cfg.stages,
                    call_timeout=60 * cfg.compute_s,
                    refresh_interval=cfg.announce_interval,
                ),
                loss=nn.functional.mse_loss,
                seed=self.rng.randrange(1 << 30),
                clock=asyncio.get_running_loop().time,
            )
            self.trainers.append(trainer)
        in_flight = cfg.in_flight or 8 * sum(cfg.start)
        loop = asyncio.get_running_loop()
        for i in range(in_flight):
            trainer = self.trainers[i % len(self.trainers)]
            self._workers.append(loop.create_task(self._work(trainer)))

    async def _start_server(self, stage: int) -> SimStagePeer:
        if self._bootstrap is None:
            raise RuntimeError("not started")
        host = self._new_host()
        await host.start([self._bootstrap.address])
        server = SimStagePeer(
            host=host,
            model=self.model,
            stage=stage,
            compute_s=self._draw_compute_s(),
            run_id=self.RUN_ID,
            config=self.config,
        )
        await server.start()
        if self.config.rebalance:
            rebalancer = Rebalancer(
                me=server.peer,
                config=RebalanceConfig(
                    stages=self.config.stages,
                    period_s=self.config.period_s,
                    min_gain=self.config.min_gain,
                ),
                read_loads=server.read_loads,
                move_to=server.server.move_to,
                rng=random.Random(self.rng.randrange(1 << 30)),
            )
            server.add_task(asyncio.get_running_loop().create_task(rebalancer.run()))
        return server

    async def _work(self, trainer: PipelineTrainer) -> None:
        cfg = self.config
        while True:
            x = torch.randn(cfg.micro_batch, cfg.width, generator=self._torch)
            y = torch.randn(cfg.micro_batch, cfg.width, generator=self._torch)
            try:
                await trainer.train_micro_batch(x, y)
            except P2PTrainError as exc:  # a stage paused past its wait: try again
                logger.debug("micro-batch failed: %s", exc)

    async def aclose(self) -> None:
        """Stop the workers and every peer."""
        for task in self._workers:
            task.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        hosts = [s.aclose() for s in self.servers]
        hosts += [h.aclose() for h in self._trainer_hosts]
        if self._bootstrap is not None:
            hosts.append(self._bootstrap.aclose())
        await asyncio.gather(*hosts, return_exceptions=True)

    async def _kill(self, server: SimStagePeer, delay: float) -> None:
        await asyncio.sleep(delay)
        self.net.kill(server.host.host)
        self._dead_moves += server.moves
        await server.aclose(abrupt=True)

    async def _join(self, delay: float) -> None:
        await asyncio.sleep(delay)
        if self._bootstrap is None or self._bootstrap.dht is None:
            return
        loads = await read_loads(self._bootstrap.dht, self.RUN_ID, self.config.stages)
        server = await self._start_server(newcomer_stage(loads, self.config.stages, self.rng))
        self.servers.append(server)

    async def period(self) -> PeriodResult:
        """Run one rebalancing period (with its churn) and measure it."""
        cfg = self.config
        wall = time.perf_counter()
        delivered = sum(t.stats.samples_delivered for t in self.trainers)
        retries = sum(t.stats.retries for t in self.trainers)
        moves = sum(s.moves for s in self.servers) + self._dead_moves
        victims = self.rng.sample(self.servers, round(cfg.churn * len(self.servers)))
        churn = [
            asyncio.get_running_loop().create_task(self._kill(v, self.rng.uniform(0, cfg.period_s)))
            for v in victims
        ]
        churn += [
            asyncio.get_running_loop().create_task(self._join(self.rng.uniform(0, cfg.period_s)))
            for _ in victims
        ]
        await asyncio.sleep(cfg.period_s)
        await asyncio.gather(*churn, return_exceptions=True)
        self.servers = [s for s in self.servers if s not in victims]
        counts = [0] * cfg.stages
        capacity = [0.0] * cfg.stages
        for s in self.servers:
            counts[s.stage] += 1
            capacity[s.stage] += s.speed
        result = PeriodResult(
            period=self._periods,
            throughput=(sum(t.stats.samples_delivered for t in self.trainers) - delivered)
            / cfg.period_s,
            ideal=ideal_throughput([s.speed for s in self.servers], cfg.stages),
            counts=tuple(counts),
            capacity=tuple(capacity),
            moves=sum(s.moves for s in self.servers) + self._dead_moves - moves,
            killed=len(victims),
            retries=sum(t.stats.retries for t in self.trainers) - retries,
            cpu_s=time.perf_counter() - wall,
        )
        self._periods += 1
        return result

    async def run(self, periods: int) -> list[PeriodResult]:
        """Run ``periods`` periods; each result as measured."""
        return [await self.period() for _ in range(periods)]
