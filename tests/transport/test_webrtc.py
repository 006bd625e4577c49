"""The WebRTC data-channel transport: framing, SCTP tuning, signaling, and real connections.

Pure parts run anywhere: the frame <-> message mapping over stand-in channels,
the SCTP tuning on real aiortc ``RTCSctpTransport`` objects fed hand-made
packets (deterministic loss), the signaling channels and the configs. The rest
connects real aiortc peers in NAT-lab homes (skipped without CAP_NET_ADMIN):
a direct path between two easy NATs, TURN from a symmetric NAT, and the
connect deadline against a symmetric NAT without TURN.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
import struct
import time
from typing import Any

import pytest
from aiortc.rtcdatachannel import RTCDataChannel, RTCDataChannelParameters
from aiortc.rtcsctptransport import (
    SCTP_DATA_FIRST_FRAG,
    SCTP_DATA_LAST_FRAG,
    USERDATA_MAX_LENGTH,
    DataChunk,
    RTCSctpTransport,
    SackChunk,
    parse_packet,
    serialize_packet,
)
from pyee.asyncio import AsyncIOEventEmitter

from p2ptrain import aio
from p2ptrain.errors import (
    ConfigError,
    ConnectError,
    ConnectionClosedError,
    NATTraversalError,
    RemoteProtocolError,
)
from p2ptrain.lab.echo import echo
from p2ptrain.lab.natlab.lab import NatLab
from p2ptrain.rpc.config import ConnectionConfig
from p2ptrain.rpc.connection import Connection
from p2ptrain.rpc.handlers import CallContext, HandlerTable
from p2ptrain.rpc.stream import RPCStream
from p2ptrain.secure.handshake import AdmissionPolicy, perform_handshake
from p2ptrain.secure.identity import Identity
from p2ptrain.testing.conformance import Check, Side, SideRunner, run_check_split, run_side
from p2ptrain.testing.natlab_plugin import natlab_fixture
from p2ptrain.transport import webrtc_connect as webrtc_connect_module
from p2ptrain.transport import webrtc_sctp
from p2ptrain.transport.base import FrameTransport
from p2ptrain.transport.webrtc import CandidatePairInfo, WebRTCTransport
from p2ptrain.transport.webrtc_config import IceServer, WebRTCConfig
from p2ptrain.transport.webrtc_connect import ice_sockets, webrtc_connect
from p2ptrain.transport.webrtc_sctp import (
    SctpTuner,
    SctpTuning,
    UnsupportedAiortcError,
    tune_association,
)
from p2ptrain.transport.webrtc_signaling import (
    MAX_SIGNAL_BYTES,
    StreamSignalingChannel,
    memory_signaling_pair,
)
from p2ptrain.wire.frames import Frame, FrameType

MiB = 1 << 20
MAX_FRAME = 16 * MiB + 64 * 1024
MAX_HEADER = 1 * MiB

netns = pytest.mark.netns
natlab = natlab_fixture()  # homes a, b (easy NAT), c (symmetric); coturn on "turn"


# -- connecting two lab homes ------------------------------------------------------------


def webrtc_runners(
    lab: NatLab,
    x: str,
    y: str,
    config: WebRTCConfig,
    *,
    timeout: float = 60.0,
    max_frame_bytes: int = MAX_FRAME,
) -> tuple[SideRunner, SideRunner]:
    """Runners for :func:`run_check_split`: end ``a`` in home ``x`` (the initiator),
    end ``b`` in home ``y``, each on its own event loop in a thread of that
    namespace, signaling over a socketpair."""
    sock_x, sock_y = socket.socketpair()

    async def serve(sock: socket.socket, initiator: bool, side: Side) -> None:
        signal = await StreamSignalingChannel.from_socket(sock)
        try:
            transport = await webrtc_connect(
                signal,
                config=config,
                initiator=initiator,
                max_frame_bytes=max_frame_bytes,
                max_header_bytes=MAX_HEADER,
            )
        finally:
            await signal.aclose()
        await run_side(transport, side, timeout=timeout)

    def runner(node: str, sock: socket.socket, initiator: bool) -> SideRunner:
        def run(side: Side) -> None:
            lab.call(node, aio.run, serve(sock, initiator, side))

        return run

    return runner(x, sock_x, True), runner(y, sock_y, False)


def stun_only(lab: NatLab, **changes: Any) -> WebRTCConfig:
    return WebRTCConfig(ice_servers=(IceServer(lab.turn.stun_url),), **changes)


# -- stand-ins for aiortc's channel and peer connection ------------------------------------


class FakeChannel(AsyncIOEventEmitter):
    """The part of RTCDataChannel the transport uses; records what is sent."""

    def __init__(self) -> None:
        super().__init__()
        self.bufferedAmount = 0
        self.bufferedAmountLowThreshold = 0
        self.readyState = "open"
        self.sent: list[bytes] = []

    def send(self, data: bytes) -> None:
        assert isinstance(data, bytes)
        self.sent.append(data)
        self.bufferedAmount += len(data)

    def drain(self) -> list[bytes]:
        out, self.sent = self.sent, []
        low = self.bufferedAmount > self.bufferedAmountLowThreshold
        self.bufferedAmount = 0
        if low:
            self.emit("bufferedamountlow")
        return out

    def close(self) -> None:
        self.readyState = "closing"


class FakePeerConnection(AsyncIOEventEmitter):
    def __init__(self) -> None:
        super().__init__()
        self.connectionState = "connected"
        self.closed = asyncio.Event()

    async def close(self) -> None:
        self.connectionState = "closed"
        self.closed.set()


def fake_transport(
    channels: int = 1, *, message_bytes: int = 64 * 1024, high_water: int = 1 * MiB
) -> tuple[WebRTCTransport, list[FakeChannel], FakePeerConnection]:
    chans = [FakeChannel() for _ in range(channels)]
    pc = FakePeerConnection()
    transport = WebRTCTransport(
        pc,
        chans,
        pair=CandidatePairInfo("host", "srflx", "192.168.1.2:1", "100.64.4.2:2"),
        message_bytes=message_bytes,
        high_water=high_water,
        low_water=high_water // 2,
        close_timeout=1.0,
        max_frame_bytes=MAX_FRAME,
        max_header_bytes=MAX_HEADER,
    )
    return transport, chans, pc


async def next_turn() -> None:
    """Let callbacks scheduled with call_soon run (the coalescing flush)."""
    await asyncio.sleep(0)


# -- framing over stand-in channels --------------------------------------------------------


async def test_small_frames_are_coalesced_into_few_messages() -> None:
    sender, (out,), _ = fake_transport()
    receiver, (inbound,), _ = fake_transport()
    for i in range(1000):
        sender.send_frame_nowait(Frame(FrameType.WINDOW, i, fields={"n": i}))
    assert out.sent == []  # nothing is sent before the loop's next turn
    await next_turn()
    assert 1 <= len(out.sent) <= 2
    for message in out.drain():
        inbound.emit("message", message)
    got = [await receiver.recv_frame() for _ in range(1000)]
    assert [frame.field("n") for frame in got] == list(range(1000))
    assert sender.stats.frames_sent == receiver.stats.frames_received == 1000
    assert sender.stats.bytes_sent == receiver.stats.bytes_received


async def test_large_payloads_are_cut_at_the_message_size() -> None:
    sender, (out,), _ = fake_transport(message_bytes=64 * 1024)
    payloads = [os.urandom(size) for size in (3 * MiB + 17, 100, 64 * 1024, 1, 70_000)]
    blob = os.urandom(150_000)  # a header larger than a message, before a payload
    for i, payload in enumerate(payloads):
        fields = {"i": i, "blob": blob} if i == 3 else {"i": i}
        sender.send_frame_nowait(Frame(FrameType.DATA, 3, 0, fields, memoryview(payload)))
    await next_turn()
    sizes = [len(message) for message in out.sent]
    assert max(sizes) == 64 * 1024 and all(size == 64 * 1024 for size in sizes[:-1])
    receiver, (inbound,), _ = fake_transport()
    for message in out.drain():
        inbound.emit("message", message)
    for i, payload in enumerate(payloads):
        frame = await receiver.recv_frame()
        assert frame.field("i") == i and bytes(frame.payload) == payload
        assert frame.field("blob", blob) == blob


async def test_several_channels_are_striped_and_reordered() -> None:
    sender, outs, _ = fake_transport(channels=3, message_bytes=1024)
    payload = os.urandom(50_000)
    sender.send_frame_nowait(Frame(FrameType.DATA, 1, 0, None, payload))
    await next_turn()
    assert all(out.sent for out in outs)  # round-robin over every channel
    receiver, ins, _ = fake_transport(channels=3, message_bytes=1024)
    # Each channel is ordered, but channels race each other: deliver channel
    # by channel, the last one first.
    for inbound, out in reversed(list(zip(ins, outs, strict=True))):
        for message in out.drain():
            inbound.emit("message", message)
    frame = await receiver.recv_frame()
    assert bytes(frame.payload) == payload


async def test_send_frame_waits_for_buffered_amount_low() -> None:
    sender, (out,), _ = fake_transport(high_water=256 * 1024)
    sender.send_frame_nowait(Frame(FrameType.DATA, 1, 0, None, bytes(512 * 1024)))
    waiting = asyncio.ensure_future(sender.send_frame(Frame(FrameType.DATA, 1)))
    await next_turn()
    assert not waiting.done()
    assert out.bufferedAmountLowThreshold == 128 * 1024
    out.drain()  # emits bufferedamountlow
    await asyncio.wait_for(waiting, 5)


@pytest.mark.parametrize("event", ["channel", "connection"])
async def test_peer_close_surfaces_as_connection_closed(event: str) -> None:
    transport, (channel,), pc = fake_transport()
    lost: list[Any] = []
    transport.set_receiver(
        type(
            "Receiver",
            (),
            {
                "frame_received": lambda self, frame: None,
                "transport_lost": lambda self, exc: lost.append(exc),
            },
        )()
    )
    if event == "channel":
        channel.readyState = "closed"
        channel.emit("close")
    else:
        pc.connectionState = "failed"
        pc.emit("connectionstatechange")
    assert transport.closed
    assert len(lost) == 1 and isinstance(lost[0], ConnectionClosedError)
    with pytest.raises(ConnectionClosedError):
        transport.send_frame_nowait(Frame(FrameType.DATA, 1))
    await asyncio.wait_for(transport.wait_closed(), 5)
    assert pc.closed.is_set()


@pytest.mark.parametrize("message", [b"\xff" * 16, "text"])
async def test_malformed_input_closes_with_a_protocol_error(message: bytes | str) -> None:
    transport, (channel,), pc = fake_transport()
    channel.emit("message", message)
    with pytest.raises(RemoteProtocolError):
        await transport.recv_frame()
    await asyncio.wait_for(pc.closed.wait(), 5)


async def test_graceful_close_flushes_then_closes_the_channels() -> None:
    transport, (channel,), pc = fake_transport()
    transport.send_frame_nowait(Frame(FrameType.DATA, 1, fields={"last": True}))
    closing = asyncio.ensure_future(transport.aclose())
    await next_turn()
    assert channel.sent and channel.readyState == "closing"
    assert not pc.closed.is_set()  # waiting for the peer to answer the reset
    channel.readyState = "closed"
    channel.emit("close")
    await asyncio.wait_for(closing, 5)
    assert pc.closed.is_set()


async def test_messages_that_arrive_before_the_transport_are_kept() -> None:
    sender, (out,), _ = fake_transport()
    sender.send_frame_nowait(Frame(FrameType.DATA, 1, fields={"early": True}))
    await next_turn()
    early = [(0, message) for message in out.drain()]
    channel, pc = FakeChannel(), FakePeerConnection()
    channel.readyState = "closed"  # and the peer already hung up
    transport = WebRTCTransport(
        pc,
        [channel],
        pair=CandidatePairInfo("relay", "srflx", "a:1", "b:2"),
        message_bytes=64 * 1024,
        high_water=MiB,
        low_water=MiB // 2,
        close_timeout=1.0,
        max_frame_bytes=MAX_FRAME,
        max_header_bytes=MAX_HEADER,
        early=early,
    )
    assert transport.path == "webrtc-turn"
    assert (await transport.recv_frame()).field("early") is True
    with pytest.raises(ConnectionClosedError):
        await transport.recv_frame()


# -- configuration --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes",
    [
        {"message_bytes": 300_000},
        {"message_bytes": 10},
        {"channels": 0},
        {"low_water": 2 * MiB},
        {"high_water": 1000},
        {"socket_buffer_bytes": 10},
        {"connect_timeout": 0},
        {"ice_policy": "relay"},
        {"ice_servers": ("stun:x",)},
    ],
)
def test_webrtc_config_rejects_bad_values(changes: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        WebRTCConfig(**changes)


def test_ice_servers_are_always_explicit() -> None:
    assert WebRTCConfig().rtc_configuration().iceServers == []
    with pytest.raises(ConfigError):
        IceServer("turn:1.2.3.4:3478")  # TURN needs credentials
    with pytest.raises(ConfigError):
        IceServer("http://example.test")
    stock = WebRTCConfig.stock((IceServer("stun:100.64.2.2:3478"),))
    assert stock.sctp is None and stock.socket_buffer_bytes is None
    assert stock.message_bytes == 64 * 1024
    servers = stock.rtc_configuration().iceServers
    assert [server.urls for server in servers] == ["stun:100.64.2.2:3478"]


@pytest.mark.parametrize(
    "changes",
    [{"rto_min": 0.001}, {"rto_initial": 100.0}, {"flows": 0}, {"max_cwnd": 1}, {"sack_every": 0}],
)
def test_sctp_tuning_rejects_bad_values(changes: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        SctpTuning(**changes)


# -- signaling ---------------------------------------------------------------------------------


async def test_stream_signaling_round_trip_and_limits() -> None:
    left, right = socket.socketpair()
    a = await StreamSignalingChannel.from_socket(left)
    b = await StreamSignalingChannel.from_socket(right)
    await a.send({"type": "offer", "sdp": "v=0"})
    assert await b.recv() == {"type": "offer", "sdp": "v=0"}
    # A peer announcing a message above the limit is refused before buffering.
    b._writer.write(struct.pack(">I", MAX_SIGNAL_BYTES + 1))
    with pytest.raises(RemoteProtocolError):
        await a.recv()
    b._writer.write(struct.pack(">I", 3) + b"[1]")
    with pytest.raises(RemoteProtocolError):
        await a.recv()  # JSON, but not an object
    await b.aclose()
    with pytest.raises(ConnectionClosedError):
        await a.recv()
    await a.aclose()


async def test_a_bad_offer_is_refused_and_the_peer_told() -> None:
    ours, theirs = memory_signaling_pair()
    await theirs.send({"type": "offer", "v": 1, "sdp": "not sdp", "channels": 1})
    with pytest.raises(RemoteProtocolError):
        await webrtc_connect(
            ours,
            config=WebRTCConfig(connect_timeout=5),
            initiator=False,
            max_frame_bytes=MAX_FRAME,
            max_header_bytes=MAX_HEADER,
        )
    assert (await theirs.recv())["type"] == "error"


async def test_the_peer_giving_up_is_a_connect_error() -> None:
    ours, theirs = memory_signaling_pair()

    async def refuse() -> None:
        offer = await theirs.recv()
        assert offer["type"] == "offer" and offer["channels"] == 1
        await theirs.send({"type": "error", "v": 1, "reason": "no thanks"})

    refusing = asyncio.ensure_future(refuse())
    with pytest.raises(ConnectError, match="no thanks"):
        await webrtc_connect(
            ours,
            config=WebRTCConfig(connect_timeout=5),
            initiator=True,
            max_frame_bytes=MAX_FRAME,
            max_header_bytes=MAX_HEADER,
        )
    await refusing


# -- SCTP tuning on real aiortc associations, packets by hand -------------------------------


class FakeDtls:
    """Stands in for RTCDtlsTransport under an RTCSctpTransport: records packets."""

    state = "connected"
    _role = "client"

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.receiver: Any = None

    def _register_data_receiver(self, receiver: Any) -> None:
        self.receiver = receiver

    def _unregister_data_receiver(self, receiver: Any) -> None:
        self.receiver = None

    async def _send_data(self, data: bytes) -> None:
        self.sent.append(data)

    def chunks(self, kind: type) -> list[Any]:
        found = [chunk for packet in self.sent for chunk in parse_packet(packet)[3]]
        return [chunk for chunk in found if isinstance(chunk, kind)]


async def send_window(sctp: RTCSctpTransport, nbytes: int) -> None:
    """Queue ``nbytes`` on stream 1 and transmit as much as cwnd allows
    (aiortc sends at most four chunks beyond the flight per call)."""
    await sctp._send(1, 53, os.urandom(nbytes))
    while True:
        flight = sctp._flight_size
        await sctp._transmit()
        if sctp._flight_size == flight:
            return


TUNERS: dict[int, SctpTuner] = {}


def established(tuning: SctpTuning | None) -> tuple[RTCSctpTransport, FakeDtls]:
    dtls = FakeDtls()
    sctp = RTCSctpTransport(dtls)  # type: ignore[arg-type]
    if tuning is not None:
        TUNERS[id(sctp)] = tune_association(sctp, tuning)
    sctp._remote_port = 5000
    sctp._remote_verification_tag = 1234
    sctp._last_received_tsn = 999
    sctp._ssthresh = 1 << 30
    sctp._set_state(RTCSctpTransport.State.ESTABLISHED)
    return sctp, dtls


def sack(cumulative: int, *gaps: tuple[int, int]) -> SackChunk:
    chunk = SackChunk()
    chunk.cumulative_tsn = cumulative
    chunk.advertised_rwnd = 1 << 20
    chunk.gaps = list(gaps)
    return chunk


async def strike_until_retransmitted(tuning: SctpTuning | None) -> list[int]:
    """Lose the first of 80 chunks, report it missing on every SACK; return how
    often it was sent after each SACK."""
    sctp, dtls = established(tuning)
    sctp._cwnd = 200 * USERDATA_MAX_LENGTH
    await send_window(sctp, 80 * USERDATA_MAX_LENGTH)
    first = dtls.chunks(DataChunk)[0].tsn
    sent_counts = []
    for highest in range(1, 40):  # SACKs for TSNs first+1 .. first+highest: the hole stays
        await sctp._receive_chunk(sack((first - 1) % (1 << 32), (2, highest + 1)))
        sent_counts.append(sum(1 for c in dtls.chunks(DataChunk) if c.tsn == first))
    await sctp.stop()
    return sent_counts


async def test_stock_aiortc_fast_retransmits_one_loss_again_and_again() -> None:
    counts = await strike_until_retransmitted(None)
    assert counts[-1] >= 10  # every third SACK sends the same chunk again


async def test_tuned_sctp_fast_retransmits_a_lost_chunk_once() -> None:
    counts = await strike_until_retransmitted(SctpTuning())
    assert counts[1] == 1 and counts[2] == 2  # the third report triggers it
    assert counts[-1] == 2  # and only once while older packets are reported


async def test_a_lost_retransmission_is_sent_again_once_proven_lost() -> None:
    sctp, dtls = established(SctpTuning())
    sctp._cwnd = 200 * USERDATA_MAX_LENGTH
    await send_window(sctp, 20 * USERDATA_MAX_LENGTH)
    first = dtls.chunks(DataChunk)[0].tsn
    before = (first - 1) % (1 << 32)
    for highest in (2, 3, 4):
        await sctp._receive_chunk(sack(before, (2, highest)))
    assert sum(1 for c in dtls.chunks(DataChunk) if c.tsn == first) == 2
    # New data goes out after the retransmission; SACKs reporting it while the
    # hole persists prove the retransmission lost too.
    await send_window(sctp, 10 * USERDATA_MAX_LENGTH)
    for highest in (21, 22, 23, 24):
        await sctp._receive_chunk(sack(before, (2, highest)))
    assert sum(1 for c in dtls.chunks(DataChunk) if c.tsn == first) == 3
    await sctp.stop()


async def full_window(tuning: SctpTuning) -> tuple[RTCSctpTransport, FakeDtls, int]:
    """An association in congestion avoidance with a full window; the first TSN."""
    sctp, dtls = established(tuning)
    sctp._cwnd = 100 * USERDATA_MAX_LENGTH
    sctp._ssthresh = 10 * USERDATA_MAX_LENGTH
    await send_window(sctp, 150 * USERDATA_MAX_LENGTH)
    assert sctp._flight_size >= sctp._cwnd
    return sctp, dtls, dtls.chunks(DataChunk)[0].tsn


async def report_a_loss(sctp: RTCSctpTransport, first: int) -> None:
    """Three SACKs reporting TSN first+1 missing: a fast-retransmit loss event."""
    for highest in (2, 3, 4):
        await sctp._receive_chunk(sack(first, (2, highest)))


async def test_growth_and_random_loss_follow_the_flows_setting() -> None:
    tuning = SctpTuning(flows=4, max_queue_delay=None)
    sctp, _, first = await full_window(tuning)
    # One window acknowledged in order: Reno adds one chunk, four flows add four.
    sctp._partial_bytes_acked = sctp._cwnd - 1
    cwnd = sctp._cwnd
    await sctp._receive_chunk(sack(first))
    assert sctp._cwnd == cwnd + 4 * USERDATA_MAX_LENGTH
    # A loss on a path without queue: cwnd shrinks by 1/8 (Reno would halve it).
    cwnd = sctp._cwnd
    await report_a_loss(sctp, first)
    assert sctp._cwnd == int(cwnd * tuning.beta)
    await sctp.stop()


async def test_a_standing_queue_holds_growth_and_makes_loss_congestion() -> None:
    sctp, _, first = await full_window(SctpTuning(flows=8, max_queue_delay=0.01))
    tuner = TUNERS[id(sctp)]
    tuner._min_rtt = 0.040
    oldest = sctp._sent_queue[0]
    assert oldest._sent_time is not None
    oldest._sent_time -= 0.080  # its SACK measures 80 ms: 40 ms of queue
    sctp._partial_bytes_acked = sctp._cwnd - 1
    cwnd = sctp._cwnd
    await sctp._receive_chunk(sack(first))
    assert sctp._cwnd == cwnd
    await report_a_loss(sctp, first)
    assert sctp._cwnd == cwnd // 2  # Reno's halving
    assert tuner.stats.congestion_losses == 1 and tuner.stats.growth_held >= 1
    await sctp.stop()


async def test_default_queue_threshold_tolerates_scheduling_delay() -> None:
    # A receiver descheduled for 40 ms inflates round trips like a queue would;
    # the default threshold (60 ms) keeps growing through it, 80 ms holds.
    for inflation, held in ((0.040, False), (0.080, True)):
        sctp, _, first = await full_window(SctpTuning())
        tuner = TUNERS[id(sctp)]
        tuner._min_rtt = 0.001
        oldest = sctp._sent_queue[0]
        assert oldest._sent_time is not None
        oldest._sent_time -= 0.001 + inflation
        sctp._partial_bytes_acked = sctp._cwnd - 1
        cwnd = sctp._cwnd
        await sctp._receive_chunk(sack(first))
        assert (sctp._cwnd == cwnd) is held
        assert (tuner.stats.growth_held == 1) is held
        await sctp.stop()


async def test_rto_bounds_and_backoff() -> None:
    stock, _ = established(None)
    tuned, _ = established(SctpTuning(rto_min=0.2, rto_initial=1.0))
    assert tuned._rto == 1.0 and stock._rto == 3.0
    for sctp in (stock, tuned):
        sctp._update_rto(0.001)
    assert stock._rto == 1.0 and tuned._rto == pytest.approx(0.2)
    tuned._t3_expired()
    assert tuned._rto == pytest.approx(0.4)  # backed off, as RFC 9260 asks
    for sctp in (stock, tuned):
        await sctp.stop()


def data_packet(sctp: RTCSctpTransport, tsn: int, flags: int, data: bytes, seq: int) -> bytes:
    chunk = DataChunk(flags=flags)
    chunk.tsn, chunk.stream_id, chunk.stream_seq, chunk.protocol = tsn, 0, seq, 53
    chunk.user_data = data
    return serialize_packet(5000, 5000, sctp._local_verification_tag, chunk)


async def test_delayed_sacks_and_fast_reassembly() -> None:
    results = {}
    cases = (("stock", None), ("every2", SctpTuning(sack_every=2)), ("every4", SctpTuning()))
    for name, tuning in cases:
        sctp, dtls = established(tuning)
        channel = RTCDataChannel(sctp, RTCDataChannelParameters(negotiated=True, id=0))
        messages: list[bytes] = []
        channel.on("message", messages.append)
        payload = os.urandom(50 * USERDATA_MAX_LENGTH)
        pieces = [payload[i : i + USERDATA_MAX_LENGTH] for i in range(0, len(payload), 1160)]
        order = list(range(len(pieces)))
        order[10], order[11] = order[11], order[10]  # one gap, filled by the next packet
        for index in order:
            flags = (SCTP_DATA_FIRST_FRAG if index == 0 else 0) | (
                SCTP_DATA_LAST_FRAG if index == len(pieces) - 1 else 0
            )
            await sctp._handle_data(data_packet(sctp, 1000 + index, flags, pieces[index], 0))
        await next_turn()
        await next_turn()
        assert messages == [payload]
        results[name] = len(dtls.chunks(SackChunk))
        await sctp.stop()
    assert results["stock"] == 50
    assert 25 <= results["every2"] <= 28  # every second packet, and at once on the gap
    # Every fourth packet until the gap, then every second one while the
    # sender recovers.
    assert 21 <= results["every4"] <= 24


async def test_reassembly_gate_delivers_messages_completed_out_of_order() -> None:
    sctp, _ = established(SctpTuning())
    channel = RTCDataChannel(sctp, RTCDataChannelParameters(negotiated=True, id=0))
    messages: list[bytes] = []
    channel.on("message", messages.append)
    first, second = os.urandom(3 * 1160), os.urandom(2 * 1160)
    chunks = [
        (1000, SCTP_DATA_FIRST_FRAG, first[:1160], 0),
        (1001, 0, first[1160:2320], 0),
        (1002, SCTP_DATA_LAST_FRAG, first[2320:], 0),
        (1003, SCTP_DATA_FIRST_FRAG, second[:1160], 1),
        (1004, SCTP_DATA_LAST_FRAG, second[1160:], 1),
    ]
    for index in (0, 2, 3, 4, 1):  # the middle of the first message comes last
        tsn, flags, data, seq = chunks[index]
        await sctp._handle_data(data_packet(sctp, tsn, flags, data, seq))
    assert messages == [first, second]
    await sctp.stop()


# -- real connections in the NAT lab -----------------------------------------------------------


async def sink(context: CallContext, stream: RPCStream) -> None:
    digest, total = hashlib.sha256(), 0
    async for message in stream:
        digest.update(message.payload)
        total += len(message.payload)
    await stream.send({"sha256": digest.hexdigest(), "bytes": total}, end=True)


def rpc_check(transfer_bytes: int, expected_path: str, results: dict[str, Any]) -> Check:
    """Handshake, then a Connection: unary calls and a streamed transfer."""
    handlers = HandlerTable()
    handlers.add_unary("echo", echo)
    handlers.add_stream("sink", sink)
    config = ConnectionConfig()
    chunk = os.urandom(MiB)

    def make_side(initiator: bool) -> Side:
        async def side(transport: FrameTransport) -> None:
            assert transport.path == expected_path
            result = await perform_handshake(
                transport,
                Identity.generate(),
                initiator=initiator,
                swarm="webrtc-test",
                stream_window=config.stream_window,
                max_frame_bytes=config.max_frame_bytes,
                policy=AdmissionPolicy(),
                timeout=20,
            )
            conn = Connection(
                transport, result, initiator=initiator, handlers=handlers, config=config
            )
            try:
                if initiator:
                    await client(conn)
                else:
                    await transport.wait_closed()  # serve until the client hangs up
            finally:
                await conn.aclose()

        return side

    async def client(conn: Connection) -> None:
        assert conn.path == expected_path
        for i in range(20):
            reply = await conn.call("echo", {"i": i}, os.urandom(i * 1000), timeout=20)
            assert (reply.body["body"], reply.body["path"]) == ({"i": i}, expected_path)
        stream = await conn.open_stream("sink", timeout=300)
        started, sent, digest = time.perf_counter(), 0, hashlib.sha256()
        while sent < transfer_bytes:
            await stream.send(payload=chunk)
            digest.update(chunk)
            sent += len(chunk)
        await stream.end()
        reply = await stream.recv()
        results["MBps"] = sent / MiB / (time.perf_counter() - started)
        assert reply.body == {"sha256": digest.hexdigest(), "bytes": transfer_bytes}

    return Check("rpc", make_side(True), make_side(False))


@netns
def test_direct_path_between_easy_nats_carries_rpc(natlab: NatLab) -> None:
    results: dict[str, Any] = {}
    run_check_split(
        rpc_check(64 * MiB, "webrtc-direct", results),
        *webrtc_runners(natlab, "a", "b", stun_only(natlab), timeout=120),
    )
    assert results["MBps"] > 1


@netns
def test_symmetric_nat_goes_through_turn(natlab: NatLab) -> None:
    results: dict[str, Any] = {}
    config = WebRTCConfig(ice_servers=IceServer.from_rtc(natlab.turn.rtc_ice_servers()))
    run_check_split(
        rpc_check(64 * MiB, "webrtc-turn", results),
        *webrtc_runners(natlab, "c", "a", config, timeout=120),
    )
    assert results["MBps"] > 1


@netns
def test_an_aiortc_without_the_patched_internals_still_connects_with_a_warning(
    natlab: NatLab, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # This aiortc "lacks" an internal the SCTP tuning patches: it must fall back.
    missing = "_internal_this_aiortc_lacks"
    monkeypatch.setattr(webrtc_sctp, "_REQUIRED", (*webrtc_sctp._REQUIRED, missing))
    monkeypatch.setattr(webrtc_connect_module, "_warned_stock", [])
    results: dict[str, Any] = {}
    with caplog.at_level(logging.WARNING, logger="p2ptrain.transport.webrtc_connect"):
        run_check_split(
            rpc_check(4 * MiB, "webrtc-direct", results),
            *webrtc_runners(natlab, "a", "b", stun_only(natlab), timeout=120),
        )
    assert results["MBps"] > 0  # connected and carried RPC (the sha256 is checked)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    stock = [m for m in warnings if "stock SCTP" in m]
    assert len(stock) == 1 and missing in stock[0], warnings  # once per process


def test_an_aiortc_version_outside_the_supported_range_is_refused_by_the_tuning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    low, high = webrtc_sctp.SUPPORTED_AIORTC
    assert low <= webrtc_sctp.aiortc_version() < high  # what this machine runs
    monkeypatch.setattr(webrtc_sctp, "aiortc_version", lambda: high)
    with pytest.raises(UnsupportedAiortcError, match="outside the versions"):
        tune_association(object(), SctpTuning())


@netns
def test_pair_details_and_socket_buffers(natlab: NatLab) -> None:
    seen: dict[str, Any] = {}

    def make_side(name: str) -> Side:
        async def side(transport: FrameTransport) -> None:
            assert isinstance(transport, WebRTCTransport)
            seen[name] = transport.pair
            buffers = [
                s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
                for s in ice_sockets(transport._pc)
            ]
            seen[f"{name}-rcvbuf"] = min(buffers)
            await transport.send_frame(Frame(FrameType.PING, 1))
            await transport.recv_frame()

        return side

    run_check_split(
        Check("pair", make_side("a"), make_side("b")),
        *webrtc_runners(natlab, "a", "b", stun_only(natlab, socket_buffer_bytes=4 * MiB)),
    )
    # Behind easy NATs the peers reach each other's server-reflexive address.
    assert seen["a"].remote_type == "srflx" and seen["b"].remote_type in ("srflx", "prflx")
    assert seen["a"].remote_address.startswith(natlab.home("b").public_address)
    assert seen["a-rcvbuf"] >= 4 * MiB and seen["b-rcvbuf"] >= 4 * MiB  # Linux doubles it


@netns
def test_the_connect_deadline_beats_ice_against_a_symmetric_nat(natlab: NatLab) -> None:
    config = stun_only(natlab, connect_timeout=2.0)

    async def never(transport: FrameTransport) -> None:
        raise AssertionError("a connection through a symmetric NAT without TURN")

    started = time.monotonic()
    with pytest.raises(NATTraversalError) as caught:
        run_check_split(Check("deadline", never, never), *webrtc_runners(natlab, "c", "a", config))
    assert time.monotonic() - started < 10
    reason = caught.value.attempts["webrtc"]
    assert "ICE" in reason and "srflx" in reason and "TURN" in reason


def test_the_stand_ins_mirror_aiortc() -> None:
    """The fakes above use only what aiortc's classes really have."""
    from aiortc import RTCPeerConnection

    for name in ("send", "close", "bufferedAmount", "bufferedAmountLowThreshold", "readyState"):
        assert hasattr(RTCDataChannel, name)
    for name in ("close", "connectionState"):
        assert hasattr(RTCPeerConnection, name)


def test_public_names_are_pinned() -> None:
    from p2ptrain.testing import conformance
    from p2ptrain.transport import (
        webrtc,
        webrtc_config,
        webrtc_connect,
        webrtc_sctp,
        webrtc_signaling,
    )

    assert webrtc.__all__ == ["CandidatePairInfo", "WebRTCTransport"]
    assert webrtc_config.__all__ == ["MAX_MESSAGE_BYTES", "IcePolicy", "IceServer", "WebRTCConfig"]
    assert webrtc_connect.__all__ == [
        "ice_sockets",
        "selected_pair",
        "set_socket_buffers",
        "webrtc_connect",
    ]
    assert webrtc_sctp.__all__ == [
        "SUPPORTED_AIORTC",
        "SctpStats",
        "SctpTuner",
        "SctpTuning",
        "UnsupportedAiortcError",
        "aiortc_version",
        "tune_association",
    ]
    assert webrtc_signaling.__all__ == [
        "MAX_SIGNAL_BYTES",
        "MemorySignalingChannel",
        "SignalingChannel",
        "StreamSignalingChannel",
        "memory_signaling_pair",
    ]
    assert sorted(conformance.__all__) == conformance.__all__
    for module in (webrtc, webrtc_config, webrtc_connect, webrtc_sctp, webrtc_signaling):
        for name in module.__all__:
            assert hasattr(module, name), (module.__name__, name)
