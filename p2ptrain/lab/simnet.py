"""A simulated network of many hosts in one process, with rates, latency and loss.

Theory of operation
-------------------
Each host has a :class:`LinkProfile`: upload and download rates, a
round-trip time to the network core and a packet loss rate. A
:class:`SimNetwork` hands every node a :class:`SimEndpoint` (a
:class:`~p2ptrain.node.network.Network`), so the node listens, dials and
carries frames over the simulation with its ordinary code: the same
handshake, RPC connections, DHT, matchmaking and all-reduce as over TCP.

Bytes move on the loop's clock (meant to be a
:class:`~p2ptrain.lab.virtual_clock.VirtualClockLoop`):

* a frame of ``n`` bytes occupies the sender's uplink for ``n / upload``
  seconds after whatever it queued before (one FIFO per host, shared by all
  its connections), then travels the one-way delay ``(rtt_a + rtt_b) / 4``,
  then occupies the receiver's downlink for ``n / download`` seconds, again
  FIFO per host; it is delivered when its last byte is through both;
* a lost packet (each of the frame's ~1448-byte packets independently with
  the sender's loss rate) delays the frame by one round trip, as a
  retransmission would; frames stay in order per connection;
* a link queues at most its ``queue_s`` seconds of bytes: a bulk frame (a
  payload of :data:`~p2ptrain.transport.pacing.BULK_FRAME_BYTES` or more)
  waits until the sender's uplink and the receiver's downlink both queue
  less, the bulk senders of a host (and to a host) taking turns frame by
  frame, as TCP keeps a home modem's buffer about that full and shares the
  link among its connections; a smaller frame (a request, a credit) is
  queued at once, as the transport's pacing writes it
  (``ConnectionConfig.pace_target_s``), so it waits about ``queue_s`` plus
  one frame on each link at most;
* ``send_frame`` also waits while the sender's uplink holds more than
  ``write_high_water`` bytes, which is the backpressure a socket gives;
* dialing takes one round trip; a host with nobody listening refuses after
  one round trip (:class:`~p2ptrain.errors.ConnectError`); a killed host
  (:meth:`SimNetwork.kill`) closes its connections, and the other side learns
  it one one-way delay later, as from a reset.

This is a flow model, not a packet model: bulk senders share a link frame
by frame within its bounded queue, small frames join the queue in FIFO
order, and congestion control is not modelled beyond that bound.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from p2ptrain.errors import ConfigError, ConnectError, ConnectionClosedError, RemoteProtocolError
from p2ptrain.rpc.config import ConnectionConfig
from p2ptrain.transport.base import FrameTransport
from p2ptrain.transport.pacing import BULK_FRAME_BYTES
from p2ptrain.wire.frames import Frame, FrameDecoder, buffer_nbytes

__all__ = ["LinkProfile", "SimEndpoint", "SimNetwork", "SimTransport"]

_PACKET_BYTES = 1448
_EARLY_S = 1e-6
"""How early a frame may be taken in (more than any loop's clock resolution)."""


@dataclass(frozen=True, slots=True)
class LinkProfile:
    """One host's access link.

    Attributes:
        upload_bytes_per_s: Upload rate (bytes/s), positive.
        download_bytes_per_s: Download rate (bytes/s), positive.
        rtt_s: Round-trip time to the network core; two hosts see
            ``(rtt_a + rtt_b) / 2`` between them.
        loss: Probability that one packet is lost (and retransmitted), in [0, 1).
        queue_s: The most seconds of bytes each direction of the link queues
            before a bulk frame waits (a home modem's buffer, which TCP keeps
            about full: typically 0.1 to 0.5 s).
    """

    upload_bytes_per_s: float
    download_bytes_per_s: float
    rtt_s: float = 0.04
    loss: float = 0.0
    queue_s: float = 0.25

    def __post_init__(self) -> None:
        for name in ("upload_bytes_per_s", "download_bytes_per_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be positive and finite, got {value!r}")
        if not (math.isfinite(self.rtt_s) and self.rtt_s >= 0):
            raise ConfigError(f"rtt_s must be finite and >= 0, got {self.rtt_s!r}")
        if not 0 <= self.loss < 1:
            raise ConfigError(f"loss must be in [0, 1), got {self.loss!r}")
        if not (math.isfinite(self.queue_s) and self.queue_s >= 0):
            raise ConfigError(f"queue_s must be finite and >= 0, got {self.queue_s!r}")

    @classmethod
    def mbit(cls, down: float, up: float, rtt_ms: float, loss: float = 0.0) -> LinkProfile:
        """A profile from Mbit/s rates (download first, as ISPs quote them) and an RTT in ms."""
        return cls(up * 125_000, down * 125_000, rtt_ms / 1000, loss)


class SimEndpoint:
    """One host of a :class:`SimNetwork`; pass it to a node as its ``network``."""

    def __init__(self, net: SimNetwork, host: str, link: LinkProfile) -> None:
        self.net = net
        self.host = host
        self.link = link
        self.up_free = 0.0
        self.down_free = 0.0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.alive = True
        self.transports: set[SimTransport] = set()
        self.bulk_turn = asyncio.Lock()  # the host's bulk frames queue in turn
        self.bulk_in_turn = asyncio.Lock()  # and so do the bulk frames sent to it
        self._listeners: dict[int, Callable[[FrameTransport], None]] = {}
        self._next_port = 1

    # -- the Network protocol ----------------------------------------------------------

    async def listen(
        self,
        host: str,
        port: int,
        on_transport: Callable[[FrameTransport], None],
        *,
        limits: ConnectionConfig,
        reuse_port: bool,
    ) -> _SimListener:
        if not self.alive:
            raise ConnectError(f"host {self.host} is down")
        if port == 0:
            port = self._next_port
            self._next_port += 1
        if port in self._listeners:
            raise ConnectError(f"{self.host}:{port} is in use")
        self._listeners[port] = on_transport
        return _SimListener(self, port)

    async def connect(
        self, host: str, port: int, *, timeout: float, limits: ConnectionConfig
    ) -> SimTransport:
        if not self.alive:
            raise ConnectError(f"host {self.host} is down")
        remote = self.net.endpoints.get(host)
        rtt = self.net.rtt(self, remote) if remote is not None else self.link.rtt_s
        if rtt > timeout:
            await asyncio.sleep(timeout)
            raise ConnectError(f"connecting to {host}:{port} timed out")
        await asyncio.sleep(rtt)
        accept = None if remote is None or not remote.alive else remote._listeners.get(port)
        if remote is None or accept is None or not self.alive:
            raise ConnectError(f"cannot connect to {host}:{port}: connection refused")
        ours = SimTransport(self, remote, limits, f"{host}:{port}")
        theirs = SimTransport(remote, self, limits, f"{self.host}:?")
        ours.peer, theirs.peer = theirs, ours
        accept(theirs)
        return ours

    def _close_listener(self, port: int) -> None:
        self._listeners.pop(port, None)


class _SimListener:
    def __init__(self, endpoint: SimEndpoint, port: int) -> None:
        self._endpoint = endpoint
        self._port = port

    @property
    def port(self) -> int:
        return self._port

    async def aclose(self) -> None:
        self._endpoint._close_listener(self._port)


class SimTransport(FrameTransport):
    """One end of a simulated connection."""

    path = "sim"

    def __init__(
        self, local: SimEndpoint, remote: SimEndpoint, limits: ConnectionConfig, name: str
    ) -> None:
        super().__init__()
        self.local = local
        self.remote = remote
        self.peer: SimTransport | None = None
        self._name = name
        self._high_water = limits.write_high_water
        self._decoder = FrameDecoder(
            max_frame_bytes=limits.max_frame_bytes, max_header_bytes=limits.max_header_bytes
        )
        self._inbound: deque[tuple[float, bytes]] = deque()
        self._last_arrival = 0.0
        self._loop = asyncio.get_running_loop()
        local.transports.add(self)

    @property
    def remote_address(self) -> str:
        return self._name

    async def send_frame(self, frame: Frame) -> int:
        local = self.local
        if buffer_nbytes(frame.payload) >= BULK_FRAME_BYTES:
            remote = self.remote
            async with remote.bulk_in_turn, local.bulk_turn:
                # Holding both turns, only small frames can queue meanwhile: one wait.
                wait = self._room_at() - self._loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                size = self.send_frame_nowait(frame)
        else:
            size = self.send_frame_nowait(frame)
        drained_at = local.up_free - self._high_water / local.link.upload_bytes_per_s
        wait = drained_at - self._loop.time()
        if wait > 0:
            await asyncio.sleep(wait)
        if self.closed:
            raise self._close_exc or ConnectionClosedError("connection closed")
        return size

    def _room_at(self) -> float:
        """When this host's uplink and the remote's downlink queue at most their ``queue_s``."""
        local, remote = self.local, self.remote
        return max(local.up_free - local.link.queue_s, remote.down_free - remote.link.queue_s)

    def send_frame_nowait(self, frame: Frame) -> int:
        head, payload, size = self._encode(frame)
        peer = self.peer
        if self.closed or peer is None:
            raise self._close_exc or ConnectionClosedError("connection closed")
        data = head + bytes(payload) if buffer_nbytes(payload) else head
        self.stats.bytes_sent += size
        self.stats.frames_sent += 1
        self.local.bytes_sent += size
        arrival = self.local.net.transfer(self.local, self.remote, size)
        peer._arrive(max(arrival, peer._last_arrival), data)
        return size

    def _arrive(self, when: float, data: bytes) -> None:
        self._last_arrival = when
        self._inbound.append((when, data))
        self._loop.call_at(when, self._drain)

    def _drain(self) -> None:
        # A loop runs a timer up to its clock resolution early (asyncio takes
        # every handle due before ``time() + resolution``): a frame due within
        # that much of another timer would otherwise be found not yet due by
        # its own drain and then wait for the connection's next frame, which
        # in a handshake never comes.
        now = self._loop.time() + _EARLY_S
        inbound = self._inbound
        while inbound and inbound[0][0] <= now and not self.closed:
            _, data = inbound.popleft()
            self.stats.bytes_received += len(data)
            self.local.bytes_received += len(data)
            try:
                self._decoder.feed(data)
            except RemoteProtocolError as exc:
                self.close(exc)
                return
            while (frame := self._decoder.next_frame()) is not None and not self.closed:
                self._deliver(frame)

    def _abort(self, *, flush: bool) -> None:
        self.local.transports.discard(self)
        self._inbound.clear()
        peer = self.peer
        if peer is not None and not peer.closed:
            delay = self.local.net.rtt(self.local, self.remote) / 2
            when = max(self._loop.time() + delay, peer._last_arrival)
            self._loop.call_at(when, peer._reset, f"{self.local.host} closed the connection")

    def _reset(self, reason: str) -> None:
        self._drain()
        self._lost(ConnectionClosedError(reason))
        self.local.transports.discard(self)


class SimNetwork:
    """Hosts and the links between them.

    Args:
        rng: Source of packet losses (seeded for reproducible runs).
    """

    def __init__(self, *, rng: random.Random | None = None) -> None:
        self.endpoints: dict[str, SimEndpoint] = {}
        self._rng = rng or random.Random(0)

    def add_host(self, host: str, link: LinkProfile) -> SimEndpoint:
        """A new host (its name is the address nodes announce)."""
        if host in self.endpoints and self.endpoints[host].alive:
            raise ConfigError(f"host {host} exists")
        endpoint = SimEndpoint(self, host, link)
        self.endpoints[host] = endpoint
        return endpoint

    def kill(self, host: str) -> None:
        """The host vanishes: its listeners stop, its connections reset."""
        endpoint = self.endpoints[host]
        endpoint.alive = False
        endpoint._listeners.clear()
        for transport in list(endpoint.transports):
            transport.close(ConnectionClosedError("this host was killed"))

    @staticmethod
    def rtt(a: SimEndpoint, b: SimEndpoint | None) -> float:
        """The round-trip time between two hosts."""
        return a.link.rtt_s if b is None else (a.link.rtt_s + b.link.rtt_s) / 2

    def transfer(self, src: SimEndpoint, dst: SimEndpoint, size: int) -> float:
        """Book ``size`` bytes on both links; return when the last byte arrives."""
        now = asyncio.get_running_loop().time()
        one_way = self.rtt(src, dst) / 2
        up_time = size / src.link.upload_bytes_per_s
        start = max(now, src.up_free)
        src.up_free = start + up_time
        down_start = max(start + one_way, dst.down_free)
        done = max(down_start + size / dst.link.download_bytes_per_s, src.up_free + one_way)
        dst.down_free = done
        loss = src.link.loss
        if loss > 0:
            packets = max(1, -(-size // _PACKET_BYTES))
            if self._rng.random() < 1 - (1 - loss) ** packets:
                done += 2 * one_way
        return done
