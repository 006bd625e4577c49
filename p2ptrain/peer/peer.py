"""One peer of a swarm, for synchronous training code.

A :class:`Peer` is what one training process owns: an event loop in a
background thread (:class:`~p2ptrain.aio.LoopThread`) and, on that loop, a
:class:`~p2ptrain.node.node.Node`, a :class:`~p2ptrain.dht.api.DHT` sharing
the node, the node's :class:`~p2ptrain.allreduce.service.AllReduceService`
and a :class:`~p2ptrain.allreduce.matchmaking.Matchmaker`. The training loop
stays ordinary torch code in the main thread and calls into the networking
with :meth:`Peer.run` (blocking) or :meth:`Peer.submit` (a future)::

    with Peer(PeerConfig(dht=DHTNodeConfig(initial_peers=("peerid@host:port",)))) as peer:
        print("others can join with", peer.address)
        value = peer.run(peer.dht.get("run/progress"), timeout=10)

The matchmaker announces the capacity of this peer: the bandwidths of
:attr:`Peer.links` (a :class:`~p2ptrain.measure.estimates.LinkEstimator`
fed by the start-up probe and by every all-reduce round, each transfer timed
where it arrived; typed-in rates in ``PeerConfig.throughput`` cap it), the
largest round-trip time seen to another peer (the planner turns it into a
latency term, :func:`~p2ptrain.allreduce.partition.latency_s`), and the
compute throughput set with :meth:`Peer.set_samples_per_s`. Each call reads
the latest estimates, so each round's plan follows the links as they change.

With ``PeerConfig(nat=NATConfig(...))`` the peer also traverses NATs: at
start it learns whether it is reachable (dial-backs and STUN against its
initial peers, or ``NATConfig.public``), joins the DHT as a server only if
it is, runs a :class:`~p2ptrain.nat.service.NATService` and installs its
router on the node, so every ``node.connect`` (DHT, all-reduce, state sync)
reaches NATed peers too. Without it (the default) the peer dials plain TCP,
as on a LAN or loopback.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import math
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from p2ptrain.aio import LoopThread
from p2ptrain.allreduce.bandwidth import ThroughputMeter
from p2ptrain.allreduce.matchmaking import Matchmaker
from p2ptrain.allreduce.partition import PeerCapacity
from p2ptrain.allreduce.service import AllReduceService
from p2ptrain.dht.api import DHT
from p2ptrain.dht.node_config import DHTNodeConfig
from p2ptrain.errors import ConfigError
from p2ptrain.measure.estimates import EstimatorConfig, LinkEstimator
from p2ptrain.measure.latency import known_rtts
from p2ptrain.measure.probe import probe_peers
from p2ptrain.node.address import PeerAddress
from p2ptrain.node.node import Node
from p2ptrain.peer.config import PeerConfig
from p2ptrain.secure.identity import Identity, PeerID

if TYPE_CHECKING:  # p2ptrain.nat imports aiortc: loaded only when a peer traverses NATs
    from p2ptrain.nat.config import NATConfig
    from p2ptrain.nat.reachability import Reachability
    from p2ptrain.nat.service import NATService

__all__ = ["Peer"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Peer:
    """The synchronous facade of one peer: loop thread, node, DHT, all-reduce, matchmaking.

    Use as a context manager, or call :meth:`start` and :meth:`close`.

    Args:
        config: The peer's configuration.
        identity: The key pair to use; overrides ``config.identity_path``.
    """

    def __init__(
        self, config: PeerConfig | None = None, *, identity: Identity | None = None
    ) -> None:
        self.config = config or PeerConfig()
        if identity is None:
            path = self.config.identity_path
            identity = Identity.load_or_create(path) if path is not None else Identity.generate()
        self.identity = identity
        self.throughput = ThroughputMeter(self.config.throughput)
        typed = self.config.throughput
        self.links = LinkEstimator(
            EstimatorConfig(
                upload_cap_bytes_per_s=typed.upload_bytes_per_s,
                download_cap_bytes_per_s=typed.download_bytes_per_s,
            )
        )
        # torch's thread count is per thread: the loop thread (averaging, compression)
        # takes its creator's, not a team as large as the machine's cores.
        self._loop_thread = LoopThread(
            use_uvloop=self.config.use_uvloop,
            name="p2ptrain-peer",
            initializer=functools.partial(torch.set_num_threads, torch.get_num_threads()),
        )
        self._samples_per_s = 0.0
        self._node: Node | None = None
        self._dht: DHT | None = None
        self._service: AllReduceService | None = None
        self._matchmaker: Matchmaker | None = None
        self._nat: NATService | None = None
        self._probe: asyncio.Task[None] | None = None
        self._probe_targets: list[PeerAddress] = []
        self._dht_client_mode = self.config.dht.client_mode
        self._state = "new"

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Start the loop thread, the node, the DHT (bootstrap) and the services.

        Raises:
            RuntimeError: The peer was already started.
            LookupFailedError: Initial peers were given and none answered.
            TimeoutError: Startup took longer than ``config.start_timeout``.
        """
        if self._state != "new":
            raise RuntimeError(f"the peer cannot start: it is {self._state}")
        self._state = "starting"
        self._loop_thread.start()
        try:
            self._loop_thread.run(self._astart(), timeout=self.config.start_timeout)
        except BaseException:
            self._shutdown()
            raise
        self._state = "running"
        logger.debug("peer %s started at %s", self.peer_id.short, self.address)

    def close(self) -> None:
        """Leave the swarm: stop the services, close the node and the loop thread.

        Idempotent; safe to call on a peer that failed to start.
        """
        if self._state in ("new", "closed"):
            self._state = "closed"
            return
        self._shutdown()

    def __enter__(self) -> Peer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _shutdown(self) -> None:
        try:
            self._loop_thread.run(self._aclose(), timeout=self.config.close_timeout)
        except (TimeoutError, RuntimeError) as exc:
            logger.warning("peer did not close cleanly: %s", exc)
        finally:
            self._loop_thread.stop()
            self._state = "closed"

    async def _astart(self) -> None:
        nat = self.config.nat_config()
        node_config = self.config.node
        if nat is not None and nat.holepunch and not node_config.reuse_port:
            node_config = dataclasses.replace(node_config, reuse_port=True)
        node = Node(identity=self.identity, config=node_config)
        await node.start()
        self._node = node
        self._service = AllReduceService(
            node, join_timeout=self.config.join_timeout, links=self.links, on_late=self._reprobe
        )
        dht_config = self.config.dht
        reachability = None
        if nat is not None:
            reachability = await _measure(node, dht_config, nat)
            dht_config = dataclasses.replace(dht_config, client_mode=not reachability.public)
            self._dht_client_mode = dht_config.client_mode
        dht = DHT(node=node, config=dht_config)
        await dht.start()
        self._dht = dht
        if nat is not None:
            from p2ptrain.nat.service import NATService  # noqa: PLC0415 - see TYPE_CHECKING

            service = NATService(node=node, dht=dht, config=nat, reachability=reachability)
            await service.start()
            self._nat = service
            node.set_router(service.router)
        self._matchmaker = Matchmaker(
            dht=dht,
            config=self.config.matchmaking,
            capacity=self.capacity,
            client_mode=self.client_mode,
        )
        self._probe_targets = [PeerAddress.parse(a) for a in dht_config.initial_peers]
        self._reprobe()

    def _reprobe(self) -> None:
        """Probe the initial peers (at start, and after a round that ran late), one at a time."""
        seconds = self.config.probe_seconds
        if seconds is None or not self._probe_targets:
            return
        if self._probe is not None and not self._probe.done():
            return
        self._probe = asyncio.get_running_loop().create_task(
            self._probe_links(self._probe_targets, seconds), name="bandwidth-probe"
        )

    async def probed(self) -> None:
        """Wait (on the peer's loop) until the start-up bandwidth probe, if any, is over."""
        if self._probe is not None:
            await asyncio.shield(self._probe)

    async def _probe_links(self, targets: list[PeerAddress], seconds: float) -> None:
        results = await probe_peers(self.node, targets, seconds=seconds)
        if not results:
            return
        first = results[0]
        self.throughput.record_upload(first.upload.nbytes, first.upload.seconds)
        self.throughput.record_download(first.download.nbytes, first.download.seconds)
        self.links.observe_probe([r.upload for r in results], [r.download for r in results])
        logger.info(
            "measured this peer's links against %d peers: up %.1f MB/s, down %.1f MB/s",
            len(results),
            (self.links.upload_bytes_per_s or 0.0) / 1e6,
            (self.links.download_bytes_per_s or 0.0) / 1e6,
        )

    async def _aclose(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)
        if self._matchmaker is not None:
            self._matchmaker.close()
        if self._service is not None:
            self._service.close()
        if self._nat is not None:
            await self._nat.aclose()
        if self._dht is not None:
            await self._dht.aclose()
        if self._node is not None:
            await self._node.aclose()

    # -- calling into the loop ---------------------------------------------------------

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the peer's loop and wait for its result.

        Raises:
            TimeoutError: It did not finish within ``timeout`` seconds (it is
                cancelled then).
            RuntimeError: Called from the loop's own thread, or the peer is not running.
        """
        if self._state != "running":
            coro.close()
            raise RuntimeError(f"the peer is {self._state}, not running")
        return self._loop_thread.run(coro, timeout)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the peer's loop; returns a thread-safe future."""
        if self._state != "running":
            coro.close()
            raise RuntimeError(f"the peer is {self._state}, not running")
        return self._loop_thread.submit(coro)

    # -- parts -------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """Whether the peer is started and not closed."""
        return self._state == "running"

    @property
    def node(self) -> Node:
        """The peer's node (after :meth:`start`)."""
        return _started(self._node)

    @property
    def dht(self) -> DHT:
        """The DHT on the peer's node (after :meth:`start`)."""
        return _started(self._dht)

    @property
    def allreduce(self) -> AllReduceService:
        """The all-reduce service of the node (after :meth:`start`)."""
        return _started(self._service)

    @property
    def matchmaker(self) -> Matchmaker:
        """The matchmaker (after :meth:`start`)."""
        return _started(self._matchmaker)

    @property
    def peer_id(self) -> PeerID:
        """This peer's PeerID."""
        return self.identity.peer_id

    @property
    def address(self) -> str:
        """The address other peers pass as an initial peer (``peerid@host:port``)."""
        return str(self.node.address)

    @property
    def client_mode(self) -> bool:
        """Whether this peer cannot accept connections.

        A NATed peer running NAT traversal accepts them through its
        rendezvous points (hole punching, WebRTC, relays), so it is not in
        client mode, although it joins the DHT as a client.
        """
        return self._dht_client_mode and self._nat is None

    @property
    def nat(self) -> NATService | None:
        """The NAT service (after :meth:`start`, with ``config.nat``), else None."""
        return self._nat

    @property
    def reachability(self) -> Reachability | None:
        """What this peer learned about its reachability, or None without ``config.nat``."""
        return None if self._nat is None else self._nat.reachability

    @property
    def reach(self) -> str:
        """``public``, ``nat:<kind>`` (easy, symmetric, unknown), or ``direct`` (plain TCP)."""
        reachability = self.reachability
        if reachability is None:
            return "direct"
        return "public" if reachability.public else f"nat:{reachability.nat}"

    def paths(self) -> dict[PeerID, str]:
        """The transport path of each pooled connection (``tcp-direct``, ``tcp-holepunch``, ...).

        Reads the node's pool from the calling thread; for a status display.
        """
        node = self._node
        if node is None:
            return {}
        return {conn.remote_peer: conn.path for conn in list(node.connections())}

    def set_samples_per_s(self, value: float) -> None:
        """Set the compute throughput that matchmaking announces (samples per second)."""
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"samples per second must be finite and >= 0, got {value!r}")
        self._samples_per_s = float(value)

    def capacity(self) -> PeerCapacity:
        """This peer's capacity as the load balancer sees it: the latest estimates."""
        default = self.config.default_bytes_per_s
        upload = self.links.upload_bytes_per_s
        download = self.links.download_bytes_per_s
        rtts = known_rtts(self._node).values() if self._node is not None else ()
        return PeerCapacity(
            upload_bytes_per_s=default if upload is None else upload,
            download_bytes_per_s=default if download is None else download,
            samples_per_s=self._samples_per_s,
            client_mode=self.client_mode,
            rtt_s=max(rtts, default=0.0),
        )


async def _measure(node: Node, dht: DHTNodeConfig, nat: NATConfig) -> Reachability:
    """Reachability from ``nat.public`` or from dial-backs and STUN against the initial peers."""
    from p2ptrain.nat.reachability import Reachability, check_reachability  # noqa: PLC0415

    if nat.public is True:
        return Reachability(True, "public", notes=("configured public",))
    servers = [*nat.rendezvous, *dht.initial_peers]
    return await check_reachability(node, servers, config=nat, dialback=nat.public is None)


def _started(part: T | None) -> T:
    if part is None:
        raise RuntimeError("the peer is not started")
    return part
