"""WebRTC: the handshake is bound to the DTLS session, so a man in the middle
of the signaling (who terminates DTLS towards each side with his own
certificate and relays the frames between them) is detected. Real aiortc in
the NAT lab: the victim and the attacker in home a, the other victim in home b."""

from __future__ import annotations

import asyncio
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from test_webrtc import MAX_FRAME, MAX_HEADER, natlab, netns, stun_only

from p2ptrain import aio
from p2ptrain.errors import AuthenticationError, HandshakeError, P2PTrainError
from p2ptrain.lab.natlab.lab import NatLab
from p2ptrain.secure.handshake import AdmissionPolicy, perform_handshake
from p2ptrain.secure.identity import Identity
from p2ptrain.transport.base import FrameTransport
from p2ptrain.transport.webrtc import WebRTCTransport
from p2ptrain.transport.webrtc_config import WebRTCConfig
from p2ptrain.transport.webrtc_connect import webrtc_connect
from p2ptrain.transport.webrtc_signaling import StreamSignalingChannel

__all__ = ["natlab"]  # the lab fixture, imported for the tests below


async def connect(sock: socket.socket, config: WebRTCConfig, initiator: bool) -> FrameTransport:
    signal = await StreamSignalingChannel.from_socket(sock)
    try:
        return await webrtc_connect(
            signal,
            config=config,
            initiator=initiator,
            max_frame_bytes=MAX_FRAME,
            max_header_bytes=MAX_HEADER,
        )
    finally:
        await signal.aclose()


async def victim(
    sock: socket.socket, config: WebRTCConfig, initiator: bool, results: dict[str, Any]
) -> None:
    transport = await connect(sock, config, initiator)
    name = "initiator" if initiator else "responder"
    try:
        assert transport.channel_encrypted
        await perform_handshake(
            transport,
            Identity.generate(),
            initiator=initiator,
            swarm="webrtc-mitm",
            stream_window=1 << 20,
            max_frame_bytes=MAX_FRAME,
            policy=AdmissionPolicy(),
            timeout=30,
        )
        results[name] = "connected"
    except P2PTrainError as exc:
        results[name] = exc
    finally:
        await transport.aclose()


async def attacker(
    to_initiator: socket.socket, to_responder: socket.socket, config: WebRTCConfig
) -> None:
    """Answer the initiator's offer and make an offer of our own to the responder
    (two DTLS sessions, our certificates), then relay frames both ways."""
    left, right = await asyncio.gather(
        connect(to_initiator, config, False), connect(to_responder, config, True)
    )

    async def pump(src: FrameTransport, dst: FrameTransport) -> None:
        try:
            while True:
                dst.send_frame_nowait(await src.recv_frame())
        except P2PTrainError:
            dst.close()

    try:
        async with asyncio.timeout(40):
            await asyncio.gather(pump(left, right), pump(right, left))
    finally:
        await asyncio.gather(left.aclose(), right.aclose())


def run_through_attacker(lab: NatLab, config: WebRTCConfig) -> dict[str, Any]:
    a_sock, m1_sock = socket.socketpair()
    m2_sock, b_sock = socket.socketpair()
    results: dict[str, Any] = {}
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = [
            pool.submit(lab.call, "a", aio.run, victim(a_sock, config, True, results)),
            pool.submit(lab.call, "a", aio.run, attacker(m1_sock, m2_sock, config)),
            pool.submit(lab.call, "b", aio.run, victim(b_sock, config, False, results)),
        ]
        for future in futures:
            future.result()
    return results


@netns
@pytest.mark.slow
def test_a_signaling_man_in_the_middle_is_detected(
    natlab: NatLab, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = stun_only(natlab)
    results = run_through_attacker(natlab, config)
    # The transcripts differ (each side's view of DTLS is in it), so frame 2,
    # sealed with the transcript as associated data, fails at the initiator.
    assert isinstance(results["initiator"], AuthenticationError), results
    assert "failed authentication" in str(results["initiator"])
    assert isinstance(results["responder"], (HandshakeError, P2PTrainError)), results

    # The test has teeth: without the binding the same attacker goes unnoticed
    # (and would read every frame, since DTLS ends at him).
    monkeypatch.setattr(WebRTCTransport, "channel_binding", property(lambda self: None))
    results = run_through_attacker(natlab, config)
    assert results == {"initiator": "connected", "responder": "connected"}, results
