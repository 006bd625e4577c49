"""The NAT lab and the delay/loss shim, proven with real packets.

Pure parts (config validation, the delay line, the STUN codec) run anywhere;
everything else builds network namespaces and is skipped only where that is
impossible (no CAP_NET_ADMIN / ``ip netns``).
"""

from __future__ import annotations

import asyncio
import errno
import os
import secrets
import select
import socket
import statistics
import struct
import subprocess
import threading
import time
from typing import Any

import pytest
from aioice import stun
from aioice.turn import create_turn_endpoint

from p2ptrain.errors import ConfigError
from p2ptrain.lab.lossy_link import DelayLine, LinkConfig
from p2ptrain.lab.natlab.lab import HomeConfig, LabConfig, NatLab, Node
from p2ptrain.lab.natlab.netns import cleanup_stale_labs, list_netns, run_cmd
from p2ptrain.lab.natlab.turn import (
    TurnServerInfo,
    parse_binding_response,
    stun_binding,
    stun_binding_request,
)
from p2ptrain.testing.natlab_plugin import natlab_fixture, require_netns

SHIM_DELAY_MS = 10.0
SHIM_LOSS = 0.05
UPLOAD_MBIT = 40.0
DOWNLOAD_MBIT = 80.0

natlab = natlab_fixture(
    LabConfig(
        homes=(
            HomeConfig("a", nat="easy", upload_mbit=UPLOAD_MBIT, download_mbit=DOWNLOAD_MBIT),
            HomeConfig("b", nat="easy", delay_ms=SHIM_DELAY_MS, loss=SHIM_LOSS),
            HomeConfig("c", nat="symmetric"),
        ),
        public_hosts=("boot", "echo"),
    )
)

netns = pytest.mark.netns
SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)  # Linux; ignores rmem_max (root)
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux: kernel receive time


# -- helpers ---------------------------------------------------------------------------


def udp(lab: NatLab, node: Node | str, port: int = 0) -> socket.socket:
    sock = lab.socket(node)
    sock.bind(("0.0.0.0", port))
    return sock


def addr_of(lab: NatLab, node: str, sock: socket.socket) -> tuple[str, int]:
    return lab.node(node).address, sock.getsockname()[1]


def send_until_received(
    tx: socket.socket, rx: socket.socket, dest: tuple[str, int], *, timeout: float = 5.0
) -> tuple[bytes, tuple[str, int]]:
    """Send a probe every 100 ms until ``rx`` gets it; return (data, source)."""
    deadline = time.monotonic() + timeout
    payload = os.urandom(8)
    while time.monotonic() < deadline:
        tx.sendto(payload, dest)
        ready, _, _ = select.select([rx], [], [], 0.1)
        if ready:
            data, src = rx.recvfrom(2048)
            if data == payload:
                return data, src
    raise AssertionError(f"nothing arrived at {dest} within {timeout} s")


def drain(sock: socket.socket) -> list[tuple[bytes, tuple[str, int]]]:
    got = []
    while True:
        try:
            got.append(sock.recvfrom(2048, socket.MSG_DONTWAIT))
        except BlockingIOError:
            return got


def tcp_goodput_mbit(
    lab: NatLab, client: Node, server: Node, *, upload: bool, nbytes: int
) -> float:
    """Move ``nbytes`` over one TCP connection; the receiver's goodput in Mbit/s."""
    listener = lab.socket(server, kind=socket.SOCK_STREAM)
    listener.bind(("0.0.0.0", 0))
    listener.listen(1)
    listener.settimeout(10)
    conn_holder: list[socket.socket] = []
    accepted = threading.Event()

    def accept() -> None:
        conn_holder.append(listener.accept()[0])
        accepted.set()

    acceptor = threading.Thread(target=accept)
    acceptor.start()
    out = lab.socket(client, kind=socket.SOCK_STREAM)
    out.settimeout(10)
    out.connect((server.address, listener.getsockname()[1]))
    acceptor.join()
    assert accepted.is_set()
    conn = conn_holder[0]
    conn.settimeout(30)
    sender, receiver = (out, conn) if upload else (conn, out)
    result: list[float] = []

    def receive() -> None:
        total, first = 0, 0.0
        while chunk := receiver.recv(1 << 20):
            if not total:
                first = time.perf_counter()
            total += len(chunk)
        result.append(total * 8 / (time.perf_counter() - first) / 1e6)
        assert total == nbytes

    reader = threading.Thread(target=receive)
    reader.start()
    sender.sendall(bytes(nbytes))
    sender.shutdown(socket.SHUT_WR)
    reader.join(timeout=60)
    for sock in (out, conn, listener):
        sock.close()
    assert result, "the transfer did not finish"
    return result[0]


# -- pure parts ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"name": "A"},
        {"name": "toolongname"},
        {"name": "inet"},
        {"name": "a", "nat": "full-cone"},
        {"name": "a", "loss": 1.0},
        {"name": "a", "delay_ms": -1},
        {"name": "a", "upload_mbit": 0},
    ],
)
def test_home_config_rejects_bad_values(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        HomeConfig(**kwargs)


def test_lab_config_rejects_duplicates_and_bad_prefix() -> None:
    with pytest.raises(ConfigError, match="unique"):
        LabConfig(homes=(HomeConfig("a"),), public_hosts=("a",))
    with pytest.raises(ConfigError):
        LabConfig(prefix="has-dash")
    with pytest.raises(ConfigError):
        LinkConfig(loss=-0.1)


def test_delay_line_keeps_order_and_delay() -> None:
    line = DelayLine(LinkConfig(delay_ms=10.0))
    for i in range(100):
        assert line.offer(bytes([i]), now=1.0 + i * 1e-4)
    assert line.pop_due(1.0099) == []
    due = line.pop_due(1.0105)
    assert due == [bytes([i]) for i in range(6)]
    rest = line.pop_due(2.0)
    assert due + rest == [bytes([i]) for i in range(100)]
    assert line.next_due() is None


def test_delay_line_loss_is_seeded_and_near_the_rate() -> None:
    def kept(seed: int) -> list[int]:
        line = DelayLine(LinkConfig(loss=0.1, seed=seed, queue_limit=100_000))
        return [i for i in range(20_000) if line.offer(b"x", now=0.0)]

    first = kept(7)
    assert first == kept(7)
    assert first != kept(8)
    assert 0.085 < 1 - len(first) / 20_000 < 0.115


def test_delay_line_tail_drops_past_the_queue_limit() -> None:
    line = DelayLine(LinkConfig(delay_ms=5.0, queue_limit=3))
    results = [line.offer(b"p", now=0.0) for _ in range(5)]
    assert results == [True, True, True, False, False]
    assert line.stats.overflowed == 2


def test_stun_codec_matches_aioice() -> None:
    txid = os.urandom(12)
    request = stun_binding_request(txid)
    parsed = stun.parse_message(request)
    assert len(request) == 20
    assert parsed.message_method == stun.Method.BINDING
    assert parsed.transaction_id == txid
    response = stun.Message(
        message_method=stun.Method.BINDING,
        message_class=stun.Class.RESPONSE,
        transaction_id=txid,
    )
    response.attributes["XOR-MAPPED-ADDRESS"] = ("100.64.3.2", 40123)
    assert parse_binding_response(bytes(response), txid) == ("100.64.3.2", 40123)
    assert parse_binding_response(bytes(response), os.urandom(12)) is None


# -- the lab ---------------------------------------------------------------------------


@netns
def test_addresses_and_commands(natlab: NatLab) -> None:
    addresses = natlab.addresses()
    assert addresses["inet"] == "100.64.0.1"
    assert {"boot", "echo", "turn", "a", "b", "c", "a.router"} <= set(addresses)
    for name in "abc":
        home = natlab.home(name)
        assert home.host.address.startswith("192.168.")
        assert home.public_address.startswith("100.64.")
        shown = natlab.run(home.host, ["ip", "-4", "-o", "address", "show", "dev", "eth0"])
        assert home.host.address in shown.stdout
    code = (
        "import socket, sys; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM);"
        " s.connect((sys.argv[1], 9)); print(s.getsockname()[0])"
    )
    proc = natlab.python("a", ["-c", code, addresses["boot"]], stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert out.strip() == natlab.home("a").host.address


@netns
@pytest.mark.parametrize(("home", "preserving"), [("a", True), ("c", False)])
def test_nat_port_mapping_per_destination(natlab: NatLab, home: str, preserving: bool) -> None:
    receivers = [udp(natlab, host) for host in ("boot", "boot", "echo", "echo")]
    sender = udp(natlab, natlab.home(home).host)
    local_port = sender.getsockname()[1]
    seen = []
    for rx, host in zip(receivers, ("boot", "boot", "echo", "echo"), strict=True):
        _, src = send_until_received(sender, rx, addr_of(natlab, host, rx))
        seen.append(src)
    assert {ip for ip, _ in seen} == {natlab.home(home).public_address}
    ports = [port for _, port in seen]
    if preserving:
        assert ports == [local_port] * 4
    else:
        assert len(set(ports)) >= 3, ports


@netns
def test_router_drops_unsolicited_inbound(natlab: NatLab) -> None:
    home = natlab.home("a")
    inside = udp(natlab, home.host, 41000)
    before = natlab.unsolicited_drops("a")
    knocker = udp(natlab, "boot")
    knocker.connect((home.public_address, 41000))
    for _ in range(20):
        knocker.send(b"knock")
    # Control: an unfiltered public host answers a closed port with an ICMP
    # error, which a connected UDP socket reports as ECONNREFUSED...
    control = udp(natlab, "boot")
    control.connect((natlab.node("echo").address, 9))
    deadline = time.monotonic() + 5
    error = 0
    while not error and time.monotonic() < deadline:
        control.send(b"closed?")
        select.select([control], [], [], 0.1)
        error = control.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    assert error == errno.ECONNREFUSED
    refused = natlab.socket("boot", kind=socket.SOCK_STREAM)
    refused.settimeout(5)
    with pytest.raises(ConnectionRefusedError):
        refused.connect((natlab.node("echo").address, 9))
    # ...while the NAT router stays silent: TCP times out instead of a reset.
    silent = natlab.socket("boot", kind=socket.SOCK_STREAM)
    silent.settimeout(0.5)
    with pytest.raises(TimeoutError):
        silent.connect((home.public_address, 9))
    assert knocker.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
    assert drain(inside) == []
    assert natlab.unsolicited_drops("a") - before >= 21


def punch(natlab: NatLab, x: str, y: str, *, timeout: float) -> tuple[bool, bool]:
    """Both hosts learn their mapping from STUN, then send to each other."""
    turn = (natlab.turn.host, natlab.turn.port)
    sx, sy = udp(natlab, natlab.home(x).host), udp(natlab, natlab.home(y).host)
    ext_x, ext_y = stun_binding(sx, turn), stun_binding(sy, turn)
    got_x = got_y = False
    deadline = time.monotonic() + timeout
    while not (got_x and got_y) and time.monotonic() < deadline:
        sx.sendto(b"from-x", ext_y)
        sy.sendto(b"from-y", ext_x)
        ready, _, _ = select.select([sx, sy], [], [], 0.05)
        for sock in ready:
            for data, src in drain(sock):
                if sock is sx and data == b"from-y":
                    got_x = src == ext_y or got_x
                if sock is sy and data == b"from-x":
                    got_y = src == ext_x or got_y
    return got_x, got_y


@netns
def test_hole_punching_between_easy_nats(natlab: NatLab) -> None:
    assert punch(natlab, "a", "b", timeout=5.0) == (True, True)


@netns
def test_hole_punching_fails_against_symmetric_nat(natlab: NatLab) -> None:
    assert punch(natlab, "a", "c", timeout=1.0) == (False, False)


@netns
@pytest.mark.parametrize("home", ["a", "c"])
def test_coturn_answers_stun_with_the_reflexive_address(natlab: NatLab, home: str) -> None:
    sock = udp(natlab, natlab.home(home).host)
    server = (natlab.turn.host, natlab.turn.port)
    request = stun.Message(message_method=stun.Method.BINDING, message_class=stun.Class.REQUEST)
    _, reply = None, None
    deadline = time.monotonic() + 5
    while reply is None and time.monotonic() < deadline:
        sock.sendto(bytes(request), server)
        if select.select([sock], [], [], 0.2)[0]:
            reply = stun.parse_message(sock.recv(2048))
    assert reply is not None
    assert reply.message_class == stun.Class.RESPONSE
    assert reply.transaction_id == request.transaction_id
    ip, port = reply.attributes["XOR-MAPPED-ADDRESS"]
    assert ip == natlab.home(home).public_address
    if home == "a":
        assert port == sock.getsockname()[1]
    assert stun_binding(sock, server)[0] == ip


async def relay_roundtrip(
    turn: TurnServerInfo, peer: socket.socket, peer_addr: tuple[str, int]
) -> dict[str, Any]:
    inbox: asyncio.Queue[tuple[bytes, tuple[str, int]]] = asyncio.Queue()

    class Inbox(asyncio.DatagramProtocol):
        def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
            inbox.put_nowait((data, addr))

    transport, _ = await create_turn_endpoint(
        Inbox, server_addr=(turn.host, turn.port), username=turn.username, password=turn.password
    )
    loop = asyncio.get_running_loop()
    peer.setblocking(False)
    try:
        relayed = transport.get_extra_info("sockname")
        transport.sendto(b"via relay", peer_addr)
        data, src = await asyncio.wait_for(loop.sock_recvfrom(peer, 2048), 5)
        await loop.sock_sendto(peer, b"reply", src)
        back, back_src = await asyncio.wait_for(inbox.get(), 5)
        return {"relayed": relayed, "data": data, "src": src, "back": back, "back_src": back_src}
    finally:
        transport.close()


@netns
def test_turn_relays_for_a_symmetric_nat(natlab: NatLab) -> None:
    peer = udp(natlab, "boot")
    peer_addr = addr_of(natlab, "boot", peer)
    out = natlab.call("c", asyncio.run, relay_roundtrip(natlab.turn, peer, peer_addr))
    assert out["relayed"][0] == natlab.turn.host
    assert out["data"] == b"via relay" and tuple(out["src"]) == tuple(out["relayed"])
    assert out["back"] == b"reply" and tuple(out["back_src"]) == peer_addr


@netns
@pytest.mark.parametrize(("upload", "rate"), [(True, UPLOAD_MBIT), (False, DOWNLOAD_MBIT)])
def test_tbf_shapes_the_home_link(natlab: NatLab, upload: bool, rate: float) -> None:
    nbytes = int(rate * 1e6 / 8 * 0.8)  # about 0.8 s at the shaped rate
    got = tcp_goodput_mbit(
        natlab, natlab.home("a").host, natlab.node("boot"), upload=upload, nbytes=nbytes
    )
    assert 0.6 * rate < got < 1.1 * rate, got


def kernel_stamped(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    return sock


def recv_stamped(sock: socket.socket) -> tuple[bytes, tuple[str, int], float]:
    """Receive one datagram and the kernel's arrival time (CLOCK_REALTIME, seconds)."""
    data, ancillary, _, src = sock.recvmsg(2048, 64)
    for level, kind, raw in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
            sec, nsec = struct.unpack("qq", raw[:16])
            return data, src, sec + nsec / 1e9
    raise AssertionError("no kernel timestamp on the datagram")


def echo_rtts_ms(natlab: NatLab, home: str, probes: int) -> list[float]:
    """Round trips host -> boot -> host, from kernel timestamps.

    The time the echoing side (this test process) took to answer is subtracted,
    so a busy machine delaying this process does not inflate the result.
    """
    client = kernel_stamped(udp(natlab, natlab.home(home).host))
    server = kernel_stamped(udp(natlab, "boot"))
    dest = addr_of(natlab, "boot", server)
    rtts = []
    for i in range(probes):
        payload = i.to_bytes(4, "big")
        sent = time.time()
        client.sendto(payload, dest)
        if not select.select([server], [], [], 0.5)[0]:
            continue  # lost on the way out
        data, src, arrived = recv_stamped(server)
        answered = time.time()
        server.sendto(data, src)
        if not select.select([client], [], [], 0.5)[0]:
            continue  # lost on the way back
        back, _, returned = recv_stamped(client)
        if back == payload:
            rtts.append(((returned - sent) - (answered - arrived)) * 1000)
        drain(client)
    return rtts


@netns
def test_shim_adds_the_configured_rtt(natlab: NatLab) -> None:
    impaired = echo_rtts_ms(natlab, "b", 30)
    clean = echo_rtts_ms(natlab, "a", 10)
    assert len(impaired) >= 20
    expected = 2 * SHIM_DELAY_MS
    # Never early; late only by scheduling noise (a right tail on a busy machine).
    assert min(impaired) >= expected, impaired
    assert statistics.quantiles(impaired, n=4)[0] < expected + 3, impaired
    assert statistics.median(impaired) < expected + 10, impaired
    assert statistics.median(clean) < 5, clean


def count_arrivals(tx: socket.socket, rx: socket.socket, dest: tuple[str, int], n: int) -> int:
    rx.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 8 << 20)
    seen: set[int] = set()
    for start in range(0, n, 50):
        for seq in range(start, min(start + 50, n)):
            tx.sendto(seq.to_bytes(4, "big") + bytes(60), dest)
        seen.update(int.from_bytes(data[:4], "big") for data, _ in drain(rx))
        time.sleep(0.001)  # pacing, not waiting: ~50 packets per ms
    quiet_until = time.monotonic() + 0.5
    while time.monotonic() < quiet_until and len(seen) < n:
        if select.select([rx], [], [], 0.05)[0]:
            seen.update(int.from_bytes(data[:4], "big") for data, _ in drain(rx))
            quiet_until = time.monotonic() + 0.5
    return len(seen)


@netns
@pytest.mark.parametrize("upload", [True, False])
def test_shim_drops_about_the_configured_fraction(natlab: NatLab, upload: bool) -> None:
    host = udp(natlab, natlab.home("b").host)
    public = udp(natlab, "boot")
    _, mapped = send_until_received(host, public, addr_of(natlab, "boot", public))
    drain(public)
    n = 4000
    if upload:
        arrived = count_arrivals(host, public, addr_of(natlab, "boot", public), n)
    else:
        arrived = count_arrivals(public, host, mapped, n)
    lost = 1 - arrived / n
    assert SHIM_LOSS - 0.02 < lost < SHIM_LOSS + 0.02, lost


@netns
def test_teardown_leaves_nothing_even_after_an_error() -> None:
    require_netns(turn=False)
    config = LabConfig(homes=(HomeConfig("x", delay_ms=1.0),), public_hosts=("srv",), turn=False)
    lab = NatLab(config)
    with pytest.raises(RuntimeError, match="boom"), lab:
        sleeper = lab.python("x", ["-c", "import time; time.sleep(600)"])
        names = [name for name in list_netns() if name.startswith(lab.lab_id)]
        assert len(names) == 4  # inet, srv, x.router, x
        rate = tcp_goodput_mbit(
            lab, lab.home("x").host, lab.node("srv"), upload=True, nbytes=25 << 20
        )
        assert rate > 100, rate  # the shim is not the bottleneck at 100 Mbit/s
        raise RuntimeError("boom")
    assert sleeper.poll() is not None
    assert not [name for name in list_netns() if name.startswith(lab.lab_id)]
    assert lab.lab_id not in run_cmd(["ip", "netns", "list"]).stdout
    stats = lab.shim_stats("x")
    # the compiled shim takes TCP segments of up to 64 KiB at once: count bytes
    assert stats is not None and stats["delivered_bytes"] > 25 << 20 and stats["lost"] == 0
    assert not lab.workdir.exists()


@netns
def test_cleanup_stale_labs_spares_live_runs() -> None:
    require_netns(turn=False)
    prefix = f"t{secrets.token_hex(3)}"  # private to this run
    finished = subprocess.Popen(["true"])
    finished.wait()
    dead = f"{prefix}-{finished.pid}-dead-inet"
    alive = f"{prefix}-1-beef-inet"  # pid 1 is always alive
    for name in (dead, alive):
        run_cmd(["ip", "netns", "add", name])
    try:
        removed = cleanup_stale_labs(prefix)
        assert dead in removed
        assert alive not in removed and alive in list_netns()
    finally:
        for name in (dead, alive):
            run_cmd(["ip", "netns", "delete", name], check=False)
