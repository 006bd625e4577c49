"""Every frame transport keeps the same promises: the conformance suite over
TCP on loopback and over WebRTC between two NAT-lab homes (easy NATs, direct
path through STUN), one connection per check."""

from __future__ import annotations

import asyncio

import pytest
from test_webrtc import webrtc_runners

from p2ptrain.lab.natlab.lab import HomeConfig, LabConfig, NatLab
from p2ptrain.testing.conformance import Check, SuiteConfig, checks, run_check, run_check_split
from p2ptrain.testing.natlab_plugin import natlab_fixture
from p2ptrain.transport.base import FrameTransport
from p2ptrain.transport.tcp import TCPTransport, tcp_connect, tcp_listen
from p2ptrain.transport.webrtc_config import IceServer, WebRTCConfig
from p2ptrain.wire.frames import Frame, FrameType
from p2ptrain.wire.records import RecordKeys

MiB = 1 << 20
MAX_FRAME = 9 * MiB
MAX_HEADER = 64 * 1024
WRITE_HIGH_WATER = 1 * MiB

TCP_SUITE = SuiteConfig(peer_max_frame_bytes=MAX_FRAME, timeout=30)
WEBRTC_SUITE = SuiteConfig(
    large_frame_bytes=(1, 65_535, 65_536, 262_143, 262_144, 262_145, 3 * MiB, 6 * MiB),
    duplex_bytes=3 * MiB,
    backlog_bytes=4 * MiB,
    peer_max_frame_bytes=MAX_FRAME,
    timeout=60,
)

natlab = natlab_fixture(LabConfig(homes=(HomeConfig("a"), HomeConfig("b")), public_hosts=()))


async def tcp_pair() -> tuple[FrameTransport, FrameTransport]:
    """A connected pair over loopback: (dialing end, accepting end)."""
    accepted: asyncio.Future[TCPTransport] = asyncio.get_running_loop().create_future()
    listener = await tcp_listen(
        "127.0.0.1",
        0,
        accepted.set_result,
        max_frame_bytes=MAX_FRAME,
        max_header_bytes=MAX_HEADER,
        write_high_water=WRITE_HIGH_WATER,
    )
    try:
        client = await tcp_connect(
            "127.0.0.1",
            listener.port,
            timeout=5,
            max_frame_bytes=MAX_FRAME,
            max_header_bytes=MAX_HEADER,
            write_high_water=WRITE_HIGH_WATER,
        )
        server = await asyncio.wait_for(accepted, 5)
        await asyncio.wait_for(server.connected.wait(), 5)
    finally:
        await listener.aclose()
    return client, server


@pytest.mark.parametrize("check", checks(TCP_SUITE), ids=lambda check: check.name)
async def test_tcp(check: Check) -> None:
    a, b = await tcp_pair()
    await run_check(check, a, b, timeout=TCP_SUITE.timeout)


def seal(a: TCPTransport, b: TCPTransport) -> None:
    """Both ends seal their records with matching keys, rekeying every 8 frames."""
    one, two = bytes(range(32)), bytes(range(1, 33))
    a.start_records(RecordKeys(send=one, receive=two, rekey_operations=8))
    b.start_records(RecordKeys(send=two, receive=one, rekey_operations=8))


@pytest.mark.parametrize("check", checks(TCP_SUITE), ids=lambda check: check.name)
async def test_tcp_sealed(check: Check) -> None:
    """The same promises hold once records are sealed (rekeying every few frames)."""
    a, b = await tcp_pair()
    seal(a, b)
    await run_check(check, a, b, timeout=TCP_SUITE.timeout)


@pytest.mark.parametrize("check", checks(TCP_SUITE), ids=lambda check: check.name)
async def test_tcp_sealed_offloaded(check: Check) -> None:
    """And with payloads of 64 KiB or more sealed and opened on the crypto threads."""
    a, b = await tcp_pair()
    seal(a, b)
    for end in (a, b):
        end.set_crypto_offload(64 * 1024)
    await run_check(check, a, b, timeout=TCP_SUITE.timeout)


@pytest.mark.netns
@pytest.mark.parametrize("check", checks(WEBRTC_SUITE), ids=lambda check: check.name)
def test_webrtc(natlab: NatLab, check: Check) -> None:
    config = WebRTCConfig(ice_servers=(IceServer(natlab.turn.stun_url),))
    runners = webrtc_runners(
        natlab, "a", "b", config, timeout=WEBRTC_SUITE.timeout, max_frame_bytes=MAX_FRAME
    )
    run_check_split(check, *runners)


def test_the_suite_catches_a_broken_transport() -> None:
    """A transport that reorders frames fails the suite (the suite is not vacuous)."""

    async def main() -> None:
        a, b = await tcp_pair()
        original = a.send_frame_nowait
        held: list[Frame] = []

        def swap_pairs(frame: Frame) -> int:
            if frame.type is not FrameType.DATA:
                return original(frame)
            if not held:
                held.append(frame)
                return 0
            return original(frame) + original(held.pop())

        ordering = next(check for check in checks(TCP_SUITE) if check.name == "ordering")
        a.send_frame_nowait = swap_pairs  # type: ignore[method-assign]
        with pytest.raises(AssertionError, match="ordering: frame 0 arrived as"):
            await run_check(ordering, a, b, timeout=10)

    asyncio.run(main())
