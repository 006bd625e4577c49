"""NAT traversal through real NATs: the NAT lab (skipped without CAP_NET_ADMIN).

One lab for the module: public hosts ``boot`` and ``pub``, coturn on ``turn``,
homes ``a`` and ``b`` behind easy (port-preserving) NATs and ``c`` behind a
symmetric NAT. Each peer is a Node + DHT + NATService on its own event loop in
a thread that entered its namespace (:class:`LabPeer`). ``boot`` is a
configured public bootstrap peer that relays; the others find out what they
are with dial-backs and STUN against ``boot`` and ``pub``.

The figures (connect time and throughput of a 64 MiB tensor per path) are
printed; run with ``-s`` to see them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hashlib
import threading
import time
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import pytest
import torch

from p2ptrain import aio
from p2ptrain.dht.api import DHT, ValueWithExpiration
from p2ptrain.dht.node_config import DHTNodeConfig
from p2ptrain.errors import ConnectionClosedError, HandshakeError, StreamEndedError
from p2ptrain.lab.echo import echo
from p2ptrain.lab.natlab.lab import LabConfig, NatLab
from p2ptrain.nat import (
    LocalView,
    NATConfig,
    NATService,
    RelayLimits,
    Traversal,
    check_reachability,
    start_node,
    traverse,
)
from p2ptrain.nat.paths import LocalState
from p2ptrain.nat.signaling import CONNECT, CircuitSignaling, open_circuit
from p2ptrain.node.address import PeerAddress
from p2ptrain.node.config import NodeConfig
from p2ptrain.node.node import Node
from p2ptrain.rpc.connection import Connection
from p2ptrain.rpc.handlers import CallContext
from p2ptrain.rpc.stream import RPCStream
from p2ptrain.secure.identity import Identity, PeerID
from p2ptrain.testing.natlab_plugin import natlab_fixture
from p2ptrain.transport.webrtc import WebRTCTransport
from p2ptrain.transport.webrtc_config import IceServer, WebRTCConfig
from p2ptrain.transport.webrtc_connect import webrtc_connect
from p2ptrain.wire.tensors import decode_tensor, encode_tensor, tensor_nbytes

T = TypeVar("T")
MiB = 1 << 20
TENSOR_BYTES = 64 * MiB
CHUNK = 4 * MiB

pytestmark = pytest.mark.netns
natlab = natlab_fixture(LabConfig(public_hosts=("boot", "pub")))

BOOT_CONFIG = NATConfig(
    public=True,
    relay=True,
    relay_limits=RelayLimits(pair_bytes_per_s=1024 * MiB, total_bytes_per_s=1024 * MiB),
)
PEER_CONFIG = NATConfig(dialback_timeout=1.5)


# -- a peer in a namespace ------------------------------------------------------------------------


def seeded_tensor(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(TENSOR_BYTES // 4, generator=generator)


async def tensor_sink(context: CallContext, stream: RPCStream) -> None:
    """Receive a tensor in chunks; answer whether it is the seeded one, bit for bit."""
    header = (await stream.recv()).body
    buffer = bytearray(tensor_nbytes(header["t"]))
    filled = 0
    while True:
        try:
            chunk = (await stream.recv()).payload
        except StreamEndedError:
            break
        buffer[filled : filled + len(chunk)] = chunk
        filled += len(chunk)
    tensor = decode_tensor(header["t"], buffer)
    intact = filled == len(buffer) and torch.equal(tensor, seeded_tensor(header["seed"]))
    digest = hashlib.sha256(buffer).hexdigest()
    await stream.send({"intact": intact, "sha256": digest, "path": context.path}, end=True)


class LabPeer:
    """A peer (Node, DHT, NATService) on an event loop in a thread inside a lab node."""

    def __init__(self, lab: NatLab, where: str) -> None:
        self.where = where
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(
            target=lab.call, args=(where, aio.run, self._serve()), name=f"peer-{where}"
        )
        self._thread.start()
        self._ready.wait()
        self.node: Node
        self.dht: DHT
        self.nat: NATService

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._ready.set()
        await self._stop.wait()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        return self.submit(coro).result(timeout)

    @property
    def peer_id(self) -> PeerID:
        return self.node.peer_id

    async def start(
        self, config: NATConfig, *, announce: str | None, bootstrap: tuple[str, ...] = ()
    ) -> None:
        self.node = Node(config=NodeConfig(host="0.0.0.0", announce_host=announce))
        self.node.handlers.add_unary("echo", echo)
        self.node.handlers.add_stream("tensor.sink", tensor_sink)
        await start_node(self.node)
        reach = None
        if config.public is None:
            reach = await check_reachability(self.node, bootstrap, config=config)
        public = config.public is True or (reach is not None and reach.public)
        self.dht = DHT(
            node=self.node,
            config=DHTNodeConfig(initial_peers=bootstrap, client_mode=not public),
        )
        await self.dht.start()
        self.nat = NATService(node=self.node, dht=self.dht, config=config, reachability=reach)
        await self.nat.start()

    async def _shutdown(self) -> None:
        await self.nat.aclose()
        await self.dht.aclose()
        await self.node.aclose()

    def close(self) -> None:
        if self._loop is None:
            return
        try:
            if hasattr(self, "nat"):
                self.run(self._shutdown(), timeout=30)
        finally:
            assert self._stop is not None
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join()


@dataclasses.dataclass
class Swarm:
    lab: NatLab
    peers: dict[str, LabPeer]

    def __getitem__(self, name: str) -> LabPeer:
        return self.peers[name]


@pytest.fixture(scope="module")
def swarm(natlab: NatLab) -> Iterator[Swarm]:
    peers: dict[str, LabPeer] = {}
    try:
        boot = peers["boot"] = LabPeer(natlab, "boot")
        boot.run(boot.start(BOOT_CONFIG, announce=natlab.node("boot").address))
        first = (str(boot.node.address),)
        pub = peers["pub"] = LabPeer(natlab, "pub")
        pub.run(pub.start(PEER_CONFIG, announce=natlab.node("pub").address, bootstrap=first))
        both = (*first, str(pub.node.address))
        for name in "abc":
            peers[name] = LabPeer(natlab, name)
        starts = [
            peers[n].submit(peers[n].start(PEER_CONFIG, announce=None, bootstrap=both))
            for n in "abc"
        ]
        for future in starts:
            future.result(60)
        yield Swarm(natlab, peers)
    finally:
        for peer in reversed(list(peers.values())):
            peer.close()


# -- moving data ----------------------------------------------------------------------------------


async def exercise(conn: Connection, seed: int) -> dict[str, Any]:
    """RPCs, then a 64 MiB tensor; returns what the target said and the throughput."""
    for i in range(10):
        reply = await conn.call("echo", {"i": i}, bytes(i * 10_000), timeout=20)
        assert (reply.body["path"], reply.body["body"]) == (conn.path, {"i": i})
        assert len(reply.payload) == i * 10_000
    tensor = seeded_tensor(seed)
    header, payload = encode_tensor(tensor)
    started = time.perf_counter()
    async with await conn.open_stream("tensor.sink", timeout=120) as stream:
        await stream.send({"t": header, "seed": seed})
        view = memoryview(payload).cast("B")
        for offset in range(0, len(view), CHUNK):
            await stream.send(payload=view[offset : offset + CHUNK])
        await stream.end()
        result = (await stream.recv()).body
    seconds = time.perf_counter() - started
    assert result["sha256"] == hashlib.sha256(view).hexdigest()
    return {**result, "MBps": TENSOR_BYTES / MiB / seconds}


def connect_and_move(swarm: Swarm, source: str, target: str, config: NATConfig) -> Traversal:
    dialer, far = swarm[source], swarm[target]

    async def run() -> tuple[Traversal, dict[str, Any]]:
        traversal = await dialer.nat.traverse(far.peer_id, config=config)
        try:
            moved = await exercise(traversal.connection, seed=len(source) * 7 + ord(target))
        finally:
            await traversal.connection.aclose()
        return traversal, moved

    traversal, moved = dialer.run(run(), timeout=110)
    assert moved["intact"] and moved["path"] == traversal.path  # both ends agree on the path
    print(
        f"\nFIGURE {source}->{target} {traversal.path}: connect {traversal.seconds * 1000:.0f} ms,"
        f" 64 MiB tensor at {moved['MBps']:.1f} MiB/s"
    )
    return traversal


def turn_servers(lab: NatLab) -> WebRTCConfig:
    return WebRTCConfig(
        connect_timeout=10.0, ice_servers=IceServer.from_rtc(lab.turn.rtc_ice_servers())
    )


# -- the tests ------------------------------------------------------------------------------------


def test_peers_learn_their_reachability(swarm: Swarm) -> None:
    kinds = {name: swarm[name].nat.reachability for name in ("boot", "pub", "a", "b", "c")}
    assert all(k is not None for k in kinds.values())
    assert kinds["pub"] is not None and kinds["pub"].public  # a dial-back reached it
    assert {n: k.nat for n, k in kinds.items() if k is not None} == {
        "boot": "public",
        "pub": "public",
        "a": "easy",
        "b": "easy",
        "c": "symmetric",
    }
    lab = swarm.lab
    for name in "abc":
        registrations = swarm[name].nat.registrations
        assert {r.peer for r in registrations} == {swarm["boot"].peer_id, swarm["pub"].peer_id}
        public = lab.home(name).public_address
        assert all(r.observed is not None and r.observed.startswith(public) for r in registrations)
    for name in "ab":  # easy NAT: the listening port keeps its number outside
        port = swarm[name].node.address.port
        assert all(
            r.observed == f"{lab.home(name).public_address}:{port}"
            for r in swarm[name].nat.registrations
        )


def test_a_dht_of_public_and_nated_peers(swarm: Swarm) -> None:
    for name in "abc":
        peer = swarm[name]
        assert peer.dht.dht_node.config.client_mode

        async def store(peer: LabPeer = peer, name: str = name) -> bool:
            return await peer.dht.store(f"lab/{name}", {"from": name}, peer.dht.now() + 60)

        assert peer.run(store())
    for reader in ("a", "b", "c", "pub"):
        peer = swarm[reader]

        async def read(peer: LabPeer = peer) -> list[Any]:
            found = [await peer.dht.get(f"lab/{name}", latest=True) for name in "abc"]
            return [f.value if isinstance(f, ValueWithExpiration) else f for f in found]

        assert peer.run(read()) == [{"from": "a"}, {"from": "b"}, {"from": "c"}]


def test_easy_nats_connect_over_webrtc_direct(swarm: Swarm) -> None:
    traversal = connect_and_move(swarm, "a", "b", NATConfig(holepunch=False))
    assert traversal.path == "webrtc-direct"
    transport = traversal.connection.transport
    assert isinstance(transport, WebRTCTransport)
    # Reflexive candidates from the swarm's own STUN responders: no STUN server configured.
    assert "srflx" in (transport.pair.local_type, transport.pair.remote_type)
    assert transport.pair.remote_address.startswith(swarm.lab.home("b").public_address)
    assert "disabled" in traversal.attempts["tcp-holepunch"]


def test_easy_nats_connect_over_tcp_holepunch(swarm: Swarm) -> None:
    traversal = connect_and_move(swarm, "a", "b", NATConfig())
    assert traversal.path == "tcp-holepunch"
    public_b = swarm.lab.home("b").public_address
    assert (
        traversal.connection.transport.remote_address
        == f"{public_b}:{swarm['b'].node.address.port}"
    )


async def traverse_once_dialed(me: LabPeer, other: LabPeer) -> Traversal:
    """Traverse to ``other`` once its circuit to us is being served (its dial came first)."""
    dialed = asyncio.Event()
    serve = me.nat._serve_path

    async def spy(*args: Any) -> None:
        dialed.set()
        await serve(*args)

    me.nat._serve_path = spy  # type: ignore[method-assign]
    try:
        await dialed.wait()
    finally:
        del me.nat._serve_path
    return await me.nat.traverse(other.peer_id)


@pytest.mark.parametrize("first", ["neither", "smaller", "larger"])
def test_crossing_dials_between_easy_nats_share_one_holepunched_connection(
    swarm: Swarm, first: str
) -> None:
    """Two NATed peers traverse towards each other (as the matchmaker makes them), at
    once or one when the other's circuit reached it: one hole punch, one connection."""
    lab = swarm.lab
    bootstrap = (str(swarm["boot"].node.address), str(swarm["pub"].node.address))
    fresh = {name: LabPeer(lab, name) for name in "ab"}  # pools without each other
    try:
        starts = [
            p.submit(p.start(PEER_CONFIG, announce=None, bootstrap=bootstrap))
            for p in fresh.values()
        ]
        for future in starts:
            future.result(60)
        a, b = fresh["a"], fresh["b"]
        smaller, larger = sorted(fresh.values(), key=lambda p: p.peer_id.digest)
        if first == "neither":  # each loop starts its traversal without waiting for the other
            dials = {p: p.submit(p.nat.traverse(o.peer_id)) for p, o in ((a, b), (b, a))}
            winner, loser = smaller, larger  # the tie-break
        else:
            winner, loser = (smaller, larger) if first == "smaller" else (larger, smaller)
            later = loser.submit(traverse_once_dialed(loser, winner))
            dials = {winner: winner.submit(winner.nat.traverse(loser.peer_id)), loser: later}
        made = {peer: future.result(60) for peer, future in dials.items()}
        if first == "neither" and made[winner].crossing:
            # The larger's circuit reached the smaller before the smaller began
            # its own traversal (its loop ran late): the smaller then waits for
            # that dial (paths.py, "Crossing dials"), and the larger punches.
            winner, loser = loser, winner
        assert made[winner].attempt == "tcp-holepunch", made[winner]
        # The loser waited for the winner's dial instead of punching (or falling back).
        assert made[loser].crossing and made[loser].attempts["crossing-dial"], made[loser]
        for me, other in ((a, b), (b, a)):

            async def check(me: LabPeer = me, other: LabPeer = other) -> tuple[str, int]:
                conn = me.node.connection_to(other.peer_id)
                assert conn is not None and conn is made[me].connection
                reply = await conn.call("echo", {"from": me.where}, timeout=10)
                assert reply.body["path"] == "tcp-holepunch"
                assert reply.body["body"] == {"from": me.where}
                # Every live connection, pooled or not (the pool keeps only the first).
                mine = [c for c in me.node._all if c.remote_peer == other.peer_id and not c.closed]
                return conn.transport.remote_address, len(mine)

            remote, count = me.run(check())
            assert made[me].path == "tcp-holepunch"
            assert count == 1  # one connection, not one per dial
            # From the listening port to the other's: one 4-tuple, so one connection pair.
            assert remote == f"{lab.home(other.where).public_address}:{other.node.address.port}"
        figures = ", ".join(
            f"{p.where}: {t.attempt} in {t.seconds * 1000:.0f} ms" for p, t in made.items()
        )
        print(f"\nFIGURE crossing dials a<->b ({first} first) over tcp-holepunch; {figures}")
    finally:
        for peer in fresh.values():
            peer.close()


def test_symmetric_nat_reaches_easy_nat_through_turn(swarm: Swarm) -> None:
    traversal = connect_and_move(swarm, "c", "a", NATConfig(webrtc=turn_servers(swarm.lab)))
    assert traversal.path == "webrtc-turn"
    assert "symmetric" in traversal.attempts["tcp-holepunch"]


def test_symmetric_nat_without_turn_goes_through_a_public_peers_relay(swarm: Swarm) -> None:
    traversal = connect_and_move(swarm, "c", "a", NATConfig())
    assert traversal.path == "relay"
    assert "without a TURN server" in traversal.attempts["webrtc"]


class Unsure:
    """A LocalState that forgets it is behind a symmetric NAT (so everything is tried)."""

    def __init__(self, real: LocalState) -> None:
        self._real = real
        self.view = dataclasses.replace(real.view, nat="unknown")
        self.rendezvous_connection = real.rendezvous_connection
        self.expect_reverse = real.expect_reverse
        self.dialing_us = real.dialing_us
        self.await_peer = real.await_peer


def test_punching_and_ice_give_up_at_their_deadlines_then_the_relay_takes_over(
    swarm: Swarm,
) -> None:
    dialer, far = swarm["c"], swarm["a"]
    config = NATConfig(holepunch_timeout=2.0, webrtc=WebRTCConfig(connect_timeout=2.0))

    async def run() -> Traversal:
        local: LocalState = Unsure(dialer.nat)
        assert isinstance(local.view, LocalView)
        traversal = await traverse(
            dialer.node, far.peer_id, dht=dialer.dht, config=config, local=local
        )
        await traversal.connection.aclose()
        return traversal

    started = time.monotonic()
    traversal = dialer.run(run(), timeout=60)
    assert traversal.path == "relay"
    assert (
        "ICE" in traversal.attempts["webrtc"]
        and "no candidate pair worked" in traversal.attempts["webrtc"]
    )
    assert time.monotonic() - started < 10  # the deadlines, not aioice's ~64 s


def test_a_forged_offer_fails_authentication_over_the_data_channel(
    natlab: NatLab, swarm: Swarm
) -> None:
    """A rendezvous point that lies about who calls: the handshake over the data
    channel exposes the caller, and the target refuses it."""
    victim = swarm["a"].peer_id  # the PeerID the caller is said to have
    rogue = LabPeer(natlab, "pub")
    target = LabPeer(natlab, "b")
    mallory = LabPeer(natlab, "a")
    try:
        rogue.run(rogue.start(NATConfig(public=True), announce=natlab.node("pub").address))
        server = rogue.nat.rendezvous_server
        assert server is not None

        async def lying_connect(context: CallContext, stream: RPCStream) -> None:
            await server._on_connect(dataclasses.replace(context, peer=victim), stream)

        async def install() -> None:
            rogue.node.handlers.remove(CONNECT)
            rogue.node.handlers.add_stream(CONNECT, lying_connect)

        rogue.run(install())
        address = str(rogue.node.address)
        target.run(
            target.start(
                dataclasses.replace(PEER_CONFIG, public=False), announce=None, bootstrap=(address,)
            )
        )
        assert [r.peer for r in target.nat.registrations] == [rogue.peer_id]

        async def attack() -> str:
            node = Node(identity=Identity.generate(), config=NodeConfig(host="0.0.0.0"))
            await node.start()
            try:
                conn = await node.connect(PeerAddress.parse(address))
                circuit = await open_circuit(conn, target.peer_id, "signal", timeout=10)
                channel = CircuitSignaling(circuit.stream)
                await channel.send({"type": "path", "path": "webrtc"})
                assert rogue.nat.stun is not None
                stun_port = rogue.nat.stun.address[1]
                stun = IceServer(f"stun:{natlab.node('pub').address}:{stun_port}")
                transport = await webrtc_connect(
                    channel,
                    config=WebRTCConfig(ice_servers=(stun,)),
                    initiator=True,
                    max_frame_bytes=MiB,
                    max_header_bytes=MiB,
                )
                path = transport.path
                # The target refuses: with the reason (REFUSE) if it gets out before
                # the data channel is torn down, else as a closed connection.
                with pytest.raises((HandshakeError, ConnectionClosedError)):
                    await node.adopt(transport, initiator=True, expected=target.peer_id)
                await circuit.aclose()
                return path
            finally:
                await node.aclose()

        assert mallory.run(attack(), timeout=60) == "webrtc-direct"  # the channel itself opened
        assert target.nat.refused == 1
        assert target.node.connection_to(victim) is None
    finally:
        for peer in (mallory, target, rogue):
            peer.close()
