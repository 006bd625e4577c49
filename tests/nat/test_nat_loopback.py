"""NAT traversal over real loopback sockets: STUN, dial-back, rendezvous, relays.

Every peer is a real Node (TCP on 127.0.0.1) with a DHT and a NATService on
one event loop. "Behind NAT" is a configuration here (``public=False``); the
NAT lab (tests/lab/test_nat_traversal.py) has the real thing. WebRTC needs non-loopback
addresses (aioice ignores 127.0.0.1), so the paths exercised here are the
relay, the dial-back reversal and the refusals.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import os
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import pytest

from p2ptrain.dht.api import DHT
from p2ptrain.dht.node_config import DHTNodeConfig
from p2ptrain.errors import (
    HandshakeError,
    MethodNotFoundError,
    NATTraversalError,
    PermissionDeniedError,
    UnavailableError,
)
from p2ptrain.lab.echo import echo
from p2ptrain.nat import NATConfig, NATService, PeerRecord, RelayLimits, find_record
from p2ptrain.nat.reachability import DIALBACK, Reachability, request_dialback
from p2ptrain.nat.relay import RelayTransport
from p2ptrain.nat.signaling import CONNECT, CircuitSignaling, open_circuit
from p2ptrain.nat.stun import start_stun_responder, stun_query
from p2ptrain.node.config import NodeConfig
from p2ptrain.node.node import Node
from p2ptrain.rpc.handlers import CallContext
from p2ptrain.rpc.stream import RPCStream
from p2ptrain.secure.identity import PeerID
from p2ptrain.testing.conformance import SuiteConfig, run_suite
from p2ptrain.transport.base import FrameTransport

MiB = 1 << 20
FAST_RELAY = RelayLimits(
    pair_bytes_per_s=4096 * MiB,
    pair_burst_bytes=64 * MiB,
    total_bytes_per_s=4096 * MiB,
    total_burst_bytes=64 * MiB,
)
RELAY_ONLY = NATConfig(public=False, attempts=("relay",), retry_interval=0.2)


@dataclass
class Peer:
    node: Node
    dht: DHT
    nat: NATService

    @property
    def peer_id(self) -> PeerID:
        return self.node.peer_id

    async def aclose(self) -> None:
        await self.nat.aclose()
        await self.dht.aclose()
        await self.node.aclose()


async def start_peer(
    stack: contextlib.AsyncExitStack,
    config: NATConfig,
    bootstrap: Sequence[Peer] = (),
    *,
    reachability: Reachability | None = None,
) -> Peer:
    node = Node(config=NodeConfig())
    node.handlers.add_unary("echo", echo)
    await node.start()
    stack.push_async_callback(node.aclose)
    dht = DHT(
        node=node,
        config=DHTNodeConfig(
            initial_peers=tuple(str(p.node.address) for p in bootstrap),
            client_mode=config.public is not True,
        ),
    )
    await dht.start()
    stack.push_async_callback(dht.aclose)
    nat = NATService(node=node, dht=dht, config=config, reachability=reachability)
    await nat.start()
    stack.push_async_callback(nat.aclose)
    return Peer(node, dht, nat)


@contextlib.asynccontextmanager
async def swarm() -> AsyncIterator[contextlib.AsyncExitStack]:
    async with contextlib.AsyncExitStack() as stack:
        yield stack


def relay_config(limits: RelayLimits = FAST_RELAY) -> NATConfig:
    return NATConfig(public=True, relay=True, relay_limits=limits)


# -- STUN and dial-back ----------------------------------------------------------------------------


async def test_stun_responder_reports_the_mapping_of_one_socket() -> None:
    one = await start_stun_responder("127.0.0.1", 0)
    two = await start_stun_responder("127.0.0.1", 0)
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.1", 0))
    try:
        client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        client.bind(("127.0.0.1", 0))
        port = client.getsockname()[1]
        client.close()
        answers = await stun_query(
            [one.address, two.address, silent.getsockname()],
            timeout=0.5,
            local_addr=("127.0.0.1", port),
        )
        assert answers == [("127.0.0.1", port), ("127.0.0.1", port), None]
        assert one.answered >= 1 and two.answered >= 1
    finally:
        silent.close()
        await one.aclose()
        await two.aclose()


async def test_dialback_tells_a_listening_peer_from_a_closed_port() -> None:
    async with swarm() as stack:
        public = await start_peer(stack, NATConfig(public=True, dialback_timeout=2))
        other = await start_peer(stack, NATConfig(public=True))
        asker = Node(config=NodeConfig())
        await asker.start()
        stack.push_async_callback(asker.aclose)
        conn = await asker.connect(public.node.address)
        reachable = await request_dialback(conn, asker.address.port, timeout=5)
        assert reachable.reachable and reachable.observed is not None
        assert reachable.stun == ("127.0.0.1", public.node.address.port)
        assert public.nat.stun_alt is not None  # the second STUN port is told too
        assert reachable.stun_alt == ("127.0.0.1", public.nat.stun_alt.address[1])
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        closed.close()
        refused = await request_dialback(conn, port, timeout=5)
        assert not refused.reachable and "cannot connect" in refused.reason
        impostor = await request_dialback(conn, other.node.address.port, timeout=5)
        assert not impostor.reachable and "not the caller" in impostor.reason


async def test_malformed_stun_ports_in_a_dialback_answer_are_ignored() -> None:
    async def answer(ctx: CallContext, stream: RPCStream) -> None:
        await stream.recv()
        await stream.send({"ok": False, "s": True, "s2": "4002", "e": "no"}, end=True)

    async with swarm() as stack:
        liar = Node(config=NodeConfig())
        liar.handlers.add_stream(DIALBACK, answer)
        await liar.start()
        stack.push_async_callback(liar.aclose)
        asker = Node(config=NodeConfig())
        await asker.start()
        stack.push_async_callback(asker.aclose)
        outcome = await request_dialback(await asker.connect(liar.address), 1, timeout=5)
        assert not outcome.reachable and outcome.stun is None and outcome.stun_alt is None


async def test_a_peer_measures_itself_and_publishes_its_record() -> None:
    async with swarm() as stack:
        boot = await start_peer(stack, relay_config())
        measured = await start_peer(stack, NATConfig(), [boot])  # dial-back decides
        nated = await start_peer(stack, NATConfig(public=False), [boot])
        assert measured.nat.reachability is not None and measured.nat.reachability.public
        assert nated.nat.reachability is not None and not nated.nat.reachability.public
        record = await find_record(nated.dht, boot.peer_id)
        assert boot.nat.stun is not None
        assert record == PeerRecord(
            nat="public",
            addresses=(boot.node.address.endpoint,),
            stun_port=boot.nat.stun.address[1],
            relay=True,
        )
        behind = await find_record(boot.dht, nated.peer_id)
        assert behind is not None and behind.nat == "unknown" and not behind.addresses
        assert [p.peer_id for p in behind.rendezvous] == [boot.peer_id]
        assert behind.rendezvous[0].relay and behind.rendezvous[0].stun_port == record.stun_port


# -- rendezvous and circuits ----------------------------------------------------------------------


async def test_a_signal_circuit_carries_messages_both_ways() -> None:
    async with swarm() as stack:
        boot = await start_peer(stack, relay_config())
        target = await start_peer(stack, RELAY_ONLY, [boot])
        got: asyncio.Queue[dict[str, object]] = asyncio.Queue()

        async def accept(context: CallContext, stream: RPCStream) -> None:
            await stream.recv()  # the header
            channel = CircuitSignaling(stream)
            await got.put(await channel.recv())
            await channel.send({"type": "pong"})

        target.node.handlers.remove("nat.accept")
        target.node.handlers.add_stream("nat.accept", accept)
        dialer = Node(config=NodeConfig())
        await dialer.start()
        stack.push_async_callback(dialer.aclose)
        conn = await dialer.connect(boot.node.address)
        circuit = await open_circuit(conn, target.peer_id, "signal", timeout=5)
        assert circuit.peer_observed is not None and circuit.own_observed is not None
        channel = CircuitSignaling(circuit.stream)
        await channel.send({"type": "ping", "sdp": "x" * 1000})
        assert (await got.get()) == {"type": "ping", "sdp": "x" * 1000}
        assert (await channel.expect("pong", timeout=5)) == {"type": "pong"}
        await circuit.aclose()


async def test_circuits_to_unknown_peers_and_foreign_accepts_are_refused() -> None:
    async with swarm() as stack:
        boot = await start_peer(stack, NATConfig(public=True))  # no relaying
        target = await start_peer(stack, RELAY_ONLY, [boot])
        stranger = Node(config=NodeConfig())
        await stranger.start()
        stack.push_async_callback(stranger.aclose)
        conn = await stranger.connect(boot.node.address)
        with pytest.raises(UnavailableError, match="not registered"):
            await open_circuit(conn, stranger.peer_id, "signal", timeout=5)
        with pytest.raises(PermissionDeniedError, match="does not relay"):
            await open_circuit(conn, target.peer_id, "relay", timeout=5)
        direct = await stranger.connect(target.node.address)
        with pytest.raises(PermissionDeniedError, match="not registered with you"):
            await direct.call("nat.accept", {"f": stranger.peer_id.digest, "k": "relay"}, timeout=5)
        other = await start_peer(stack, NATConfig(public=True, serve_rendezvous=False))
        with pytest.raises(MethodNotFoundError):
            await open_circuit(
                await stranger.connect(other.node.address), target.peer_id, "signal", timeout=5
            )


# -- the relay ------------------------------------------------------------------------------------


async def test_relayed_transports_pass_the_conformance_suite() -> None:
    async with swarm() as stack:
        boot = await start_peer(stack, relay_config())
        far = Node(config=NodeConfig())
        await far.start()
        stack.push_async_callback(far.aclose)
        near = Node(config=NodeConfig())
        await near.start()
        stack.push_async_callback(near.aclose)
        limit = far.config.connection.max_frame_bytes
        arrived: asyncio.Queue[FrameTransport] = asyncio.Queue()

        async def accept(context: CallContext, stream: RPCStream) -> None:
            await stream.recv()
            transport = RelayTransport(
                stream, relay=context.peer, max_frame_bytes=limit, max_header_bytes=MiB
            )
            await arrived.put(transport)
            await transport.wait_done()

        far.handlers.add_stream("nat.accept", accept)
        from p2ptrain.nat.signaling import register

        registration = await register(
            await far.connect(boot.node.address), boot.node.address, timeout=5
        )
        conn = await near.connect(boot.node.address)

        async def pair() -> tuple[FrameTransport, FrameTransport]:
            circuit = await open_circuit(conn, far.peer_id, "relay", timeout=5)
            mine = RelayTransport(
                circuit.stream, relay=boot.peer_id, max_frame_bytes=limit, max_header_bytes=MiB
            )
            return mine, await arrived.get()

        ran = await run_suite(pair, config=SuiteConfig(peer_max_frame_bytes=limit, timeout=30))
        assert "oversized_frame" in ran and "backpressure" in ran
        await registration.aclose()


async def test_two_nated_peers_connect_through_a_relay_and_move_data() -> None:
    async with swarm() as stack:
        boot = await start_peer(stack, relay_config())
        target = await start_peer(stack, RELAY_ONLY, [boot])
        dialer = await start_peer(stack, RELAY_ONLY, [boot])
        traversal = await dialer.nat.traverse(target.peer_id)
        assert traversal.path == "relay" and traversal.attempt == "relay"
        assert "tcp-direct" in traversal.attempts and "relay" not in traversal.attempts
        data = os.urandom(3 * MiB)
        reply = await traversal.connection.call("echo", "hi", data, timeout=20)
        assert (reply.body["path"], reply.body["body"]) == ("relay", "hi")
        assert hashlib.sha256(reply.payload).digest() == hashlib.sha256(data).digest()
        assert boot.nat.rendezvous_server is not None
        relay = boot.nat.rendezvous_server.relay
        assert relay is not None and relay.relayed_bytes > 6 * MiB
        assert (await dialer.nat.connect(target.peer_id)) is traversal.connection  # pooled
        other = await start_peer(stack, RELAY_ONLY, [boot])
        first, second = await asyncio.gather(
            other.nat.connect(target.peer_id), other.nat.connect(target.peer_id)
        )
        assert first is second  # one traversal for concurrent callers


async def test_a_relay_refuses_traffic_beyond_its_limit() -> None:
    limits = dataclasses.replace(FAST_RELAY, circuit_bytes=2 * MiB)
    async with swarm() as stack:
        boot = await start_peer(stack, relay_config(limits))
        target = await start_peer(stack, RELAY_ONLY, [boot])
        dialer = await start_peer(stack, RELAY_ONLY, [boot])
        conn = await dialer.nat.connect(target.peer_id)
        await conn.call("echo", None, bytes(MiB // 2), timeout=10)  # within the limit
        with pytest.raises(UnavailableError, match="relay limit: a relayed connection may carry"):
            await conn.call("echo", None, bytes(3 * MiB), timeout=10)
        await conn.transport.wait_closed()
        assert boot.nat.rendezvous_server is not None
        relay = boot.nat.rendezvous_server.relay
        assert relay is not None and relay.active == 0


async def test_a_relay_paces_a_pair_to_its_rate() -> None:
    limits = RelayLimits(pair_bytes_per_s=8 * MiB, pair_burst_bytes=1 * MiB)
    async with swarm() as stack:
        boot = await start_peer(stack, relay_config(limits))
        target = await start_peer(stack, RELAY_ONLY, [boot])
        dialer = await start_peer(stack, RELAY_ONLY, [boot])
        conn = await dialer.nat.connect(target.peer_id)
        loop = asyncio.get_running_loop()
        started = loop.time()
        async with await conn.open_stream("echo", timeout=20) as stream:
            await stream.send(None, bytes(4 * MiB), end=True)
            await stream.recv()
        elapsed = loop.time() - started
        # 8 MiB there and back (the echo), 1 MiB of burst: no less than 7/8 s.
        assert elapsed >= 0.8


# -- identities -----------------------------------------------------------------------------------


async def test_a_forged_caller_fails_authentication_at_the_target() -> None:
    async with swarm() as stack:
        rogue = await start_peer(stack, relay_config())
        target = await start_peer(stack, RELAY_ONLY, [rogue])
        victim = await start_peer(stack, RELAY_ONLY, [rogue])
        mallory = Node(config=NodeConfig())
        await mallory.start()
        stack.push_async_callback(mallory.aclose)
        server = rogue.nat.rendezvous_server
        assert server is not None

        async def lying_connect(context: CallContext, stream: RPCStream) -> None:
            # Tells the target that the caller is the victim.
            await server._on_connect(dataclasses.replace(context, peer=victim.peer_id), stream)

        rogue.node.handlers.remove(CONNECT)
        rogue.node.handlers.add_stream(CONNECT, lying_connect)
        circuit = await open_circuit(
            await mallory.connect(rogue.node.address), target.peer_id, "relay", timeout=5
        )
        transport = RelayTransport(
            circuit.stream,
            relay=rogue.peer_id,
            max_frame_bytes=MiB,
            max_header_bytes=MiB,
        )
        with pytest.raises(HandshakeError):
            await mallory.adopt(transport, initiator=True, expected=target.peer_id)
        assert target.nat.refused == 1
        assert target.node.connection_to(mallory.peer_id) is None
        assert target.node.connection_to(victim.peer_id) is None


async def test_a_rendezvous_point_that_swaps_the_target_cannot_impersonate_it() -> None:
    async with swarm() as stack:
        rogue = await start_peer(stack, relay_config())
        target = await start_peer(stack, RELAY_ONLY, [rogue])
        impostor = await start_peer(stack, RELAY_ONLY, [rogue])
        dialer = await start_peer(stack, RELAY_ONLY, [rogue])
        server = rogue.nat.rendezvous_server
        assert server is not None
        server._registered[target.peer_id] = server._registered[impostor.peer_id]
        with pytest.raises(HandshakeError):
            await dialer.nat.connect(target.peer_id)
        assert dialer.node.connection_to(target.peer_id) is None
        assert dialer.node.connection_to(impostor.peer_id) is None


# -- reversal, failures, keeping registrations ----------------------------------------------------


async def test_a_public_dialer_is_dialed_back() -> None:
    async with swarm() as stack:
        boot = await start_peer(stack, relay_config())
        target = await start_peer(stack, RELAY_ONLY, [boot])
        dialer = await start_peer(stack, NATConfig(public=True, serve_rendezvous=False), [boot])
        traversal = await dialer.nat.traverse(target.peer_id)
        assert traversal.attempt == "tcp-reverse" and traversal.path == "tcp-direct"
        assert not traversal.connection.initiator  # the target dialed
        reply = await traversal.connection.call("echo", 1, timeout=5)
        assert (reply.body["path"], reply.body["body"]) == ("tcp-direct", 1)


async def test_when_every_path_fails_the_error_says_why() -> None:
    symmetric = Reachability(False, "symmetric")
    async with swarm() as stack:
        boot = await start_peer(stack, NATConfig(public=True))  # no relaying
        target = await start_peer(stack, RELAY_ONLY, [boot])
        dialer = await start_peer(stack, NATConfig(public=False), [boot], reachability=symmetric)
        with pytest.raises(NATTraversalError) as caught:
            await dialer.nat.connect(target.peer_id)
        attempts = caught.value.attempts
        assert set(attempts) == {"tcp-direct", "tcp-reverse", "tcp-holepunch", "webrtc", "relay"}
        assert attempts["tcp-holepunch"].startswith("skipped") and "TURN" in attempts["webrtc"]
        assert "relays" in attempts["relay"]
        assert "webrtc: skipped" in str(caught.value)
        nobody = Node(config=NodeConfig())
        with pytest.raises(NATTraversalError, match="no record"):
            await dialer.nat.connect(nobody.peer_id)


async def test_a_lost_rendezvous_point_is_replaced() -> None:
    async with swarm() as stack:
        first = await start_peer(stack, relay_config())
        second = await start_peer(stack, relay_config(), [first])
        config = dataclasses.replace(RELAY_ONLY, rendezvous_count=1)
        target = await start_peer(stack, config, [first, second])
        (old,) = target.nat.registrations
        replaced = asyncio.Event()

        def on_record(record: PeerRecord) -> None:
            if record.rendezvous and record.rendezvous[0].peer_id != old.peer:
                replaced.set()

        target.nat.record_listeners.append(on_record)
        lost = first if old.peer == first.peer_id else second
        kept = second if lost is first else first
        await lost.node.abort()
        async with asyncio.timeout(10):
            await replaced.wait()
        assert [r.peer for r in target.nat.registrations] == [kept.peer_id]
        dialer = await start_peer(stack, RELAY_ONLY, [kept])
        reply = await (await dialer.nat.connect(target.peer_id)).call("echo", 2, timeout=5)
        assert (reply.body["path"], reply.body["body"]) == ("relay", 2)
