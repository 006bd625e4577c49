"""Many peers in one process, running the production code over a simulated network.

Each :class:`SimPeer` is a real :class:`~p2ptrain.node.node.Node` (with the
real handshake and RPC connections), a real :class:`~p2ptrain.dht.api.DHT`,
:class:`~p2ptrain.allreduce.matchmaking.Matchmaker`,
:class:`~p2ptrain.allreduce.service.AllReduceService` and
:class:`~p2ptrain.allreduce.grouped.GroupedAverager`; only the network
underneath is :class:`~p2ptrain.lab.simnet.SimNetwork`. Run a
:class:`Simulation` on a :class:`~p2ptrain.lab.virtual_clock.VirtualClockLoop`
(:func:`~p2ptrain.lab.virtual_clock.run_virtual`) and its minutes of
simulated time take seconds of CPU.

Each :meth:`Simulation.step` gives every live peer a random vector and a
random weight, kills a share of the peers at random moments while they
matchmake (``churn``; as many new peers join and take part from the next
step), averages, and measures the outcome against the exact weighted average
of the contributions the averaging reports as counted.

Example::

    async def main() -> None:
        async with Simulation(SimulationConfig(peers=64)) as sim:
            result = await sim.step()
            print(result.counted_fraction, result.max_rel_error)

    run_virtual(main())
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from p2ptrain.allreduce.grouped import (
    GroupedAverager,
    GroupedResult,
    GroupingConfig,
    group_index,
)
from p2ptrain.allreduce.matchmaking import Matchmaker, MatchmakingConfig
from p2ptrain.allreduce.partition import PeerCapacity
from p2ptrain.allreduce.service import AllReduceService
from p2ptrain.dht.api import DHT
from p2ptrain.dht.node_config import DHTNodeConfig
from p2ptrain.errors import ConfigError, P2PTrainError
from p2ptrain.lab.simnet import LinkProfile, SimEndpoint, SimNetwork
from p2ptrain.node.config import NodeConfig
from p2ptrain.node.node import Node
from p2ptrain.secure.identity import Identity, PeerID

__all__ = ["HOME_LINKS", "SimPeer", "Simulation", "SimulationConfig", "StepResult"]

EPOCH = 1_800_000_000.0
"""Unix time at virtual time 0 (the DHT's record expirations are Unix seconds)."""

HOME_LINKS: tuple[tuple[float, float], ...] = ((50.0, 10.0), (100.0, 50.0), (1000.0, 100.0))
"""(download, upload) Mbit/s of the home links a simulation draws from."""


@dataclass(frozen=True)
class SimulationConfig:
    """A simulated swarm.

    Attributes:
        peers: Peers at the start (and kept: every peer that leaves is replaced).
        vector_elements: float32 elements each peer averages.
        links: (download, upload) Mbit/s choices, drawn uniformly per peer.
        rtt_ms: Range of round-trip times to the core, drawn uniformly per peer.
        loss: Packet loss rate of every link.
        churn: Share of the live peers that leave abruptly during each step
            (while matchmaking); as many new peers join for the next one.
        kill_window: When in a step (virtual seconds after its start, drawn
            uniformly) the leaving peers die; ``None``: during the group's
            matchmaking window. A later window kills members mid-round.
        max_weight: Weights (samples) are drawn uniformly from 1 to this.
        grouping: Group size and windows.
        matchmaking: Matchmaking timings (windows are set per phase by grouping).
        max_connections: Open connections per node (LRU close of idle ones).
        seed: Seeds links, weights, vectors, churn and losses.
    """

    peers: int = 64
    vector_elements: int = 1 << 16
    links: tuple[tuple[float, float], ...] = HOME_LINKS
    rtt_ms: tuple[float, float] = (20.0, 80.0)
    loss: float = 0.0
    churn: float = 0.0
    kill_window: tuple[float, float] | None = None
    max_weight: int = 64
    grouping: GroupingConfig = field(default_factory=GroupingConfig)
    matchmaking: MatchmakingConfig = field(
        default_factory=lambda: MatchmakingConfig(
            window=1.0, poll_interval=1.0, ready_timeout=2.0, plan_timeout=10.0
        )
    )
    max_connections: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.peers <= 100_000:
            raise ConfigError("peers must be in [1, 100000]")
        if self.vector_elements < 1:
            raise ConfigError("vector_elements must be positive")
        if not self.links:
            raise ConfigError("links must not be empty")
        low, high = self.rtt_ms
        if not 0 <= low <= high:
            raise ConfigError("rtt_ms must be (low, high) with 0 <= low <= high")
        if not 0 <= self.churn < 1:
            raise ConfigError("churn must be in [0, 1)")
        if self.kill_window is not None and not 0 <= self.kill_window[0] <= self.kill_window[1]:
            raise ConfigError("kill_window must be (low, high) with 0 <= low <= high")
        if self.max_weight < 1:
            raise ConfigError("max_weight must be at least 1")


class SimPeer:
    """One simulated peer: the production stack on a simulated host."""

    def __init__(
        self, net: SimNetwork, host: str, link: LinkProfile, config: SimulationConfig
    ) -> None:
        self.host = host
        self.link = link
        self.endpoint: SimEndpoint = net.add_host(host, link)
        self.node = Node(
            identity=Identity.from_seed(hashlib.sha256(f"{config.seed}/{host}".encode()).digest()),
            config=NodeConfig(host=host, dial_timeout=5.0, max_connections=config.max_connections),
            network=self.endpoint,
        )
        self.dht: DHT | None = None
        self.matchmaker: Matchmaker | None = None
        self.averager: GroupedAverager | None = None
        self.alive = True
        self._config = config

    @property
    def peer_id(self) -> PeerID:
        """The peer's PeerID."""
        return self.node.peer_id

    async def start(self, initial_peers: Sequence[str]) -> None:
        """Start the node, join the DHT through ``initial_peers``, attach the services."""
        loop = asyncio.get_running_loop()
        await self.node.start()
        self.dht = DHT(
            node=self.node,
            config=DHTNodeConfig(initial_peers=tuple(initial_peers)),
            clock=lambda: EPOCH + loop.time(),
            rng=random.Random(self.host),
        )
        await self.dht.start()
        link = self.link
        capacity = PeerCapacity(
            upload_bytes_per_s=link.upload_bytes_per_s,
            download_bytes_per_s=link.download_bytes_per_s,
            samples_per_s=1.0,
        )
        self.matchmaker = Matchmaker(
            dht=self.dht, config=self._config.matchmaking, capacity=lambda: capacity
        )
        # Streams of the gather may arrive while this member still averages
        # its columns: let them wait for the whole column phase.
        service = AllReduceService(self.node, join_timeout=120.0)
        self.averager = GroupedAverager(
            matchmaker=self.matchmaker, service=service, config=self._config.grouping
        )

    async def aclose(self) -> None:
        """Stop every service and the node."""
        if self.dht is not None:
            await self.dht.aclose()
        await self.node.aclose()


@dataclass(frozen=True)
class StepResult:
    """What one simulated step measured.

    Attributes:
        peers: Peers that started the step.
        live: Peers still alive at its end.
        killed: Peers killed during it.
        step_s: Virtual seconds from the start until the last live peer finished.
        counted_fraction: Share of the live peers' weight (samples) whose
            vectors are in the average.
        max_rel_error: Over the live peers whose averaging completed:
            max |result - exact| / max |exact|, where exact is the weighted
            average (float64) of the contributions that result holds by the
            peers' own accounts (inf where those are unknown).
        incomplete: Live peers whose averaging did not complete.
        bytes_per_peer: Mean bytes a live peer sent during the step (all
            traffic: handshakes, DHT, matchmaking, tensors).
        max_bytes_per_peer: The most any live peer sent.
        vector_bytes: Bytes of one vector (float32).
        groups: Groups the swarm was split into.
        dht_records_per_peer: Records a live peer stores for others, mean.
        dht_bytes_per_peer: Their value bytes, mean.
        max_dict_entries: The most entries any stored dictionary holds.
        max_value_bytes: The largest stored value (all entries of a key), in bytes.
        max_connections: The most open connections any live peer holds at the end.
        cpu_s: Wall seconds the step took to simulate.
        failures: A few sample failure messages.
    """

    peers: int
    live: int
    killed: int
    step_s: float
    counted_fraction: float
    max_rel_error: float
    incomplete: int
    bytes_per_peer: float
    max_bytes_per_peer: int
    vector_bytes: int
    groups: int
    dht_records_per_peer: float
    dht_bytes_per_peer: float
    max_dict_entries: int
    max_value_bytes: int
    max_connections: int
    cpu_s: float
    failures: tuple[str, ...] = ()


class Simulation:
    """A swarm of :class:`SimPeer` on one :class:`SimNetwork`; use ``async with``."""

    def __init__(self, config: SimulationConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.net = SimNetwork(rng=random.Random(config.seed + 1))
        self.peers: list[SimPeer] = []
        self._hosts = 0
        self._steps = 0
        self._torch = torch.Generator().manual_seed(config.seed)
        self._gc_thresholds: tuple[int, int, int] | None = None  # the process's, while we run

    async def __aenter__(self) -> Simulation:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Start ``config.peers`` peers; each joins the DHT through a started one."""
        if self._gc_thresholds is None:
            self._gc_thresholds = gc.get_threshold()
            gc.set_threshold(*_GC_THRESHOLDS)
        first = self._new_peer()
        await first.start(())
        started = [first]
        while len(started) < self.config.peers:
            wave = [
                self._new_peer() for _ in range(min(len(started), self.config.peers - len(started)))
            ]
            await asyncio.gather(*(self._join(p, started) for p in wave))
            started += wave
            _freeze_heap()
        self.peers = started

    async def aclose(self) -> None:
        """Stop every live peer."""
        await asyncio.gather(*(p.aclose() for p in self.peers if p.alive), return_exceptions=True)
        gc.unfreeze()
        if self._gc_thresholds is not None:
            gc.set_threshold(*self._gc_thresholds)
            self._gc_thresholds = None

    def _new_peer(self) -> SimPeer:
        self._hosts += 1
        down, up = self.rng.choice(self.config.links)
        low, high = self.config.rtt_ms
        link = LinkProfile.mbit(down, up, self.rng.uniform(low, high), self.config.loss)
        n = self._hosts
        host = f"10.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}"
        return SimPeer(self.net, host, link, self.config)

    async def _join(self, peer: SimPeer, started: Sequence[SimPeer]) -> None:
        contacts = self.rng.sample(list(started), min(3, len(started)))
        await peer.start([str(c.node.address) for c in contacts])

    async def _kill(self, peer: SimPeer, delay: float, task: asyncio.Task[object]) -> None:
        await asyncio.sleep(delay)
        peer.alive = False
        self.net.kill(peer.host)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, P2PTrainError):
            await task
        await peer.aclose()

    async def step(self) -> StepResult:
        """Run one step: average, churn, measure (see the module docstring)."""
        loop = asyncio.get_running_loop()
        cfg = self.config
        self._steps += 1
        key = f"sim/step-{self._steps}"
        peers = [p for p in self.peers if p.alive]
        n = cfg.vector_elements
        vectors = {p.peer_id: torch.randn(n, generator=self._torch) for p in peers}
        weights = {p.peer_id: float(self.rng.randint(1, cfg.max_weight)) for p in peers}
        sent_before = {p.peer_id: p.endpoint.bytes_sent for p in peers}
        victims = self.rng.sample(peers, round(cfg.churn * len(peers)))
        finished: dict[PeerID, float] = {}
        start = loop.time()
        wall = time.perf_counter()

        async def run(peer: SimPeer) -> tuple[torch.Tensor, GroupedResult] | str:
            averager = peer.averager
            if averager is None:
                raise RuntimeError("peer not started")
            try:
                out = await averager.average(
                    key, vectors[peer.peer_id], weights[peer.peer_id], swarm_size=len(peers)
                )
            except P2PTrainError as exc:
                return str(exc)
            finally:
                finished[peer.peer_id] = loop.time()
            return out

        tasks = {p.peer_id: loop.create_task(run(p)) for p in peers}
        window = cfg.grouping.group_window if len(peers) > cfg.grouping.group_size else 1.0
        low, high = cfg.kill_window or (0.0, window)
        kills = [
            loop.create_task(self._kill(v, self.rng.uniform(low, high), tasks[v.peer_id]))
            for v in victims
        ]
        joiners = [self._new_peer() for _ in victims]
        live_before = [p for p in peers if p not in victims]
        joins = [loop.create_task(self._join(j, live_before)) for j in joiners]
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        await asyncio.gather(*kills, *joins, return_exceptions=True)
        end = max((finished[p.peer_id] for p in peers if p.alive), default=start)
        self.peers = [p for p in self.peers if p.alive] + joiners
        result = self._measure(
            peers,
            tasks=tasks,
            vectors=vectors,
            weights=weights,
            sent_before=sent_before,
            step_s=end - start,
            cpu_s=time.perf_counter() - wall,
        )
        _freeze_heap()
        return result

    def _measure(
        self,
        peers: list[SimPeer],
        *,
        tasks: dict[PeerID, asyncio.Task[tuple[torch.Tensor, GroupedResult] | str]],
        vectors: dict[PeerID, torch.Tensor],
        weights: dict[PeerID, float],
        sent_before: dict[PeerID, int],
        step_s: float,
        cpu_s: float,
    ) -> StepResult:
        live = [p for p in peers if p.alive]
        outcomes: dict[PeerID, tuple[torch.Tensor, GroupedResult]] = {}
        failures: list[str] = []
        for p in live:
            task = tasks[p.peer_id]
            if task.cancelled() or task.exception() is not None:
                failures.append(repr(task.exception()) if not task.cancelled() else "cancelled")
                continue
            result = task.result()
            if isinstance(result, str):
                failures.append(result)
            else:
                outcomes[p.peer_id] = result
                failures += list(result[1].failures)
        scale_of = self._reference(outcomes)
        counted: set[PeerID] = set()
        references: list[tuple[torch.Tensor, frozenset[PeerID] | None]] = []
        for out, grouped in outcomes.values():
            if grouped.complete:
                members = scale_of(grouped)
                references.append((out, members))
                counted.update(members or ())
        live_ids = {p.peer_id for p in live}
        live_weight = sum(weights[i] for i in live_ids)
        counted_weight = sum(weights[i] for i in counted & live_ids)
        n = self.config.vector_elements
        exact: dict[frozenset[PeerID], torch.Tensor] = {}
        errors = []
        for out, members in references:
            if not members:
                errors.append(math.inf)  # complete, but whose values it holds is unknown
                continue
            if members not in exact:
                exact[members] = _weighted_average(members, vectors, weights, n)
            reference = exact[members]
            scale = float(reference.abs().max()) or 1.0
            errors.append(float((out.double() - reference).abs().max()) / scale)
        incomplete = len(live) - len(errors)
        sent = [p.endpoint.bytes_sent - sent_before[p.peer_id] for p in live]
        records, value_bytes, max_entries, max_value = self._dht_usage(live)
        groups = max((r.groups for _, r in outcomes.values()), default=0)
        return StepResult(
            peers=len(peers),
            live=len(live),
            killed=len(peers) - len(live),
            step_s=step_s,
            counted_fraction=counted_weight / live_weight if live_weight else 0.0,
            max_rel_error=max(errors) if errors else math.inf,
            incomplete=incomplete,
            bytes_per_peer=sum(sent) / max(1, len(sent)),
            max_bytes_per_peer=max(sent, default=0),
            vector_bytes=4 * self.config.vector_elements,
            groups=groups,
            dht_records_per_peer=records / max(1, len(live)),
            dht_bytes_per_peer=value_bytes / max(1, len(live)),
            max_dict_entries=max_entries,
            max_value_bytes=max_value,
            max_connections=max((len(p.node.connections()) for p in live), default=0),
            cpu_s=cpu_s,
            failures=tuple(failures[:5]),
        )

    @staticmethod
    def _reference(
        outcomes: dict[PeerID, tuple[torch.Tensor, GroupedResult]],
    ) -> Callable[[GroupedResult], frozenset[PeerID] | None]:
        """Whose values a complete result should average, from the survivors' accounts.

        A single group: the contributors its report names. Groups: the union,
        over the groups the result says it holds, of the members each group
        carried into the columns, as the group's surviving members tell it.
        A group whose matchmaking split it in two (two plans under one group
        key) has two accounts, one per part, and both parts cover every
        slice in the same columns: their union. ``None`` (unknown) when no
        survivor of such a group tells, or when accounts overlap without
        being equal (they disagree about a member).
        """
        told: dict[tuple[int, int], set[tuple[PeerID, ...]]] = {}
        for _, grouped in outcomes.values():
            if grouped.groups > 1 and grouped.group_weight > 0:
                me = grouped.group.members[grouped.reports[0].index].peer_id
                group = (grouped.groups, group_index(me, grouped.groups))
                told.setdefault(group, set()).add(grouped.represented)

        def reference(grouped: GroupedResult) -> frozenset[PeerID] | None:
            if grouped.groups == 1:
                return frozenset(grouped.group_counted)
            members: set[PeerID] = set()
            for g in grouped.groups_in:
                accounts = told.get((grouped.groups, g), set())
                if not accounts:
                    return None
                union = {peer for account in accounts for peer in account}
                if len(union) != sum(len(account) for account in accounts):
                    return None  # two accounts name one member: they disagree
                members.update(union)
            return frozenset(members)

        return reference

    def _dht_usage(self, live: list[SimPeer]) -> tuple[int, int, int, int]:
        loop = asyncio.get_running_loop()
        now = EPOCH + loop.time()
        records = value_bytes = max_entries = max_value = 0
        for p in live:
            if p.dht is None:
                continue
            per_key: dict[bytes, list[int]] = {}
            for record in p.dht.dht_node.records.records(now):
                records += 1
                value_bytes += len(record.value)
                per_key.setdefault(record.key, []).append(len(record.value))
            for sizes in per_key.values():
                max_entries = max(max_entries, len(sizes))
                max_value = max(max_value, sum(sizes))
        return records, value_bytes, max_entries, max_value


_GC_THRESHOLDS = (10_000, 20, 100)
"""The collector's thresholds while a simulation runs (Python's default: 700, 10, 10)."""


def _freeze_heap() -> None:
    """Collect garbage, then exempt every surviving object from later collections.

    Hundreds of simulated peers hold millions of long-lived objects (DHT
    tables, connections, handshake keys), and Python's collections walked
    them over and over: 13 of a 128-peer simulation's 57 CPU seconds (setup
    and one step; 28 full collections of 0.33 s each). Frozen after the
    setup's waves and after each step, a collection walks only what the last
    step made; with the rarer collections of :data:`_GC_THRESHOLDS` too, the
    collector took 4 s and the run 45. Cycles among frozen objects wait for
    :meth:`Simulation.aclose`, which unfreezes (everything, including what a
    node's first memory pass froze: :mod:`p2ptrain.node.memory`) and restores
    the thresholds.
    """
    gc.collect()
    gc.freeze()


def _weighted_average(
    members: Iterable[PeerID],
    vectors: dict[PeerID, torch.Tensor],
    weights: dict[PeerID, float],
    num_elements: int,
) -> torch.Tensor:
    """The float64 weighted average of ``members``' vectors (zeros for none)."""
    members = list(members)
    exact = torch.zeros(num_elements, dtype=torch.float64)
    total = sum(weights[i] for i in members)
    for i in members:
        exact += vectors[i].double() * (weights[i] / total)
    return exact
