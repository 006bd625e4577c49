"""Sealed records against a real man in the middle: two peer processes talk
through a TCP proxy in this process that alters, drops, replays, reorders,
truncates or injects one record; a third peer calls the server meanwhile.

The proxy cuts each direction into frames by their clear length prefix (the
only thing it can read) and attacks the first large record the client sends
after the handshake: the first of four concurrent calls, each carrying a
256 KiB float32 tensor.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from conftest import ChildLines

from p2ptrain.node.address import PeerAddress
from p2ptrain.node.config import NodeConfig
from p2ptrain.node.node import Node
from p2ptrain.secure.identity import Identity

SWARM = "mitm-test-swarm-name"
METHOD = "secure_check_method"
FLOATS = 64 * 1024  # 256 KiB tensors
CALLS = 4

COMMON = f"""
import asyncio, logging, sys
import numpy as np
from p2ptrain.secure.identity import Identity
from p2ptrain.node.config import NodeConfig
from p2ptrain.node.node import Node
from p2ptrain.rpc.handlers import Message
from p2ptrain.errors import P2PTrainError

def tensor(i):
    return np.random.default_rng(i).standard_normal({FLOATS}).astype(np.float32)

class ToStdout(logging.Handler):
    def emit(self, record):
        print("LOG", record.levelname, record.name, record.getMessage(), flush=True)

logging.getLogger("p2ptrain").addHandler(ToStdout(logging.WARNING))
"""

SERVER = (
    COMMON
    + f"""
async def check(ctx, request):
    i = request.body["i"]
    got = np.frombuffer(request.payload, np.float32)
    if not np.array_equal(got, tensor(i)):
        print("ALTERED", i, flush=True)
    return Message({{"i": i, "sum": float(got.sum(dtype=np.float64))}})

async def main():
    node = Node(identity=Identity.from_seed(bytes.fromhex(sys.argv[1])),
                config=NodeConfig(host="127.0.0.1", swarm="{SWARM}"))
    async with node:
        node.handlers.add_unary("{METHOD}", check)
        print("ADDRESS", node.address, node.identity.public_key.hex(), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

asyncio.run(main())
"""
)

CLIENT = (
    COMMON
    + f"""
async def main():
    node = Node(identity=Identity.from_seed(bytes.fromhex(sys.argv[1])),
                config=NodeConfig(host="127.0.0.1", swarm="{SWARM}"))
    async with node:
        async def one(i):
            try:
                reply = await node.call(sys.argv[2], "{METHOD}", {{"i": i}},
                                        tensor(i).tobytes(), timeout=15)
                good = reply.body == {{"i": i, "sum": float(tensor(i).sum(dtype=np.float64))}}
                print("OK" if good else "WRONG", i, flush=True)
            except P2PTrainError as exc:
                print("ERROR", i, type(exc).__name__, flush=True)
        await asyncio.gather(*(one(i) for i in range(int(sys.argv[3]))))
    print("DONE", flush=True)

asyncio.run(main())
"""
)


def tensor(i: int) -> np.ndarray:
    return np.random.default_rng(i).standard_normal(FLOATS).astype(np.float32)


def spawn(script: str, *args: str) -> ChildLines:
    process = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return ChildLines(process)


async def next_line(
    child: ChildLines, prefix: str, seen: list[str] | None = None, timeout: float = 60
) -> str:
    """The next stdout line starting with ``prefix``; the lines before go to ``seen``."""
    deadline = time.monotonic() + timeout
    while True:
        line = (await asyncio.to_thread(child.next_line, deadline)).strip()
        if line.startswith(prefix):
            return line
        if seen is not None:
            seen.append(line)


Attack = Callable[[list[bytes]], list[bytes]]
"""Given the first two large records, returns what the proxy forwards instead."""


def flip(offset: int) -> Attack:
    def attack(records: list[bytes]) -> list[bytes]:
        first = bytearray(records[0])
        first[offset] ^= 0x10
        return [bytes(first), records[1]]

    return attack


ATTACKS: dict[str, Attack] = {
    "flip a payload bit": flip(-1000),
    "flip a header bit": flip(10),
    "drop": lambda r: [r[1]],
    "replay": lambda r: [r[0], r[0], r[1]],
    "reorder": lambda r: [r[1], r[0]],
    "inject": lambda r: [r[0][:8] + os.urandom(len(r[0]) - 8), r[0], r[1]],
    "truncate": lambda r: [r[0][: len(r[0]) // 2], r[1]],
}


class Proxy:
    """A TCP proxy that records every byte and may attack the client's large records."""

    def __init__(self, target: tuple[str, int], attack: Attack | None) -> None:
        self.target = target
        self.attack = attack
        self.recorded: list[bytes] = []
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        pumps = [
            asyncio.create_task(self._pump(reader, up_writer, attack=self.attack)),
            asyncio.create_task(self._pump(up_reader, writer, attack=None)),
        ]
        self.tasks.update(pumps)
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for task in pumps:
            task.cancel()
        for w in (writer, up_writer):
            w.close()

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, attack: Attack | None
    ) -> None:
        held: list[bytes] = []
        attacked = attack is None
        try:
            while True:
                prefix = await reader.readexactly(4)
                record = prefix + await reader.readexactly(int.from_bytes(prefix, "big"))
                self.recorded.append(record)
                if not attacked and len(record) > 100_000:
                    held.append(record)
                    if len(held) == 2:
                        assert attack is not None
                        for item in attack(held):
                            writer.write(item)
                        attacked = True
                    continue
                writer.write(record)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return

    async def aclose(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
        for task in self.tasks:
            task.cancel()


@pytest.fixture(scope="module")
def server_process() -> Iterator[tuple[ChildLines, PeerAddress, bytes, Identity]]:
    identity = Identity.generate()
    server = spawn(SERVER, identity_seed(identity))
    try:
        line = asyncio.run(next_line(server, "ADDRESS"))
        _, address, public_key = line.split()
        yield server, PeerAddress.parse(address), bytes.fromhex(public_key), identity
    finally:
        if server.process.stdin is not None:
            server.process.stdin.close()
        server.stop()


def identity_seed(identity: Identity) -> str:
    from cryptography.hazmat.primitives import serialization

    return identity.private_key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    ).hex()


async def third_peer_calls(server: PeerAddress, stop: asyncio.Event) -> int:
    """Call the server directly until ``stop``; every answer must be right."""
    served = 0
    async with Node(config=NodeConfig(host="127.0.0.1", swarm=SWARM)) as node:
        while not stop.is_set() or served < 3:
            i = 1000 + served
            reply = await node.call(server, METHOD, {"i": i}, tensor(i).tobytes(), timeout=15)
            assert reply.body == {"i": i, "sum": float(tensor(i).sum(dtype=np.float64))}
            served += 1
    return served


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ATTACKS))
async def test_man_in_the_middle_is_detected(
    server_process: tuple[ChildLines, PeerAddress, bytes, Identity], name: str
) -> None:
    server, address, _, _ = server_process
    proxy = Proxy((address.host, address.port), ATTACKS[name])
    port = await proxy.start()
    stop = asyncio.Event()
    third = asyncio.create_task(third_peer_calls(address, stop))
    client = spawn(CLIENT, identity_seed(Identity.generate()), str(via(address, port)), str(CALLS))
    server_lines: list[str] = []
    client_lines: list[str] = []
    try:
        # The server closes the attacked connection with a typed, logged error.
        closing = await next_line(server, "LOG WARNING p2ptrain.transport.tcp", server_lines)
        assert "closing connection" in closing and "IntegrityError" in closing, closing
        await next_line(client, "DONE", client_lines)
    finally:
        stop.set()
        client.stop()
        await proxy.aclose()
    assert await asyncio.wait_for(third, 30) >= 3  # the third peer was served throughout
    outcomes = [line.split() for line in client_lines if not line.startswith("LOG")]
    assert len(outcomes) == CALLS, client_lines
    assert all(o[0] in ("OK", "ERROR") for o in outcomes), outcomes  # never a wrong value
    assert any(o[0] == "ERROR" for o in outcomes), outcomes
    assert not [line for line in server_lines if line.startswith("ALTERED")]


def via(address: PeerAddress, port: int) -> PeerAddress:
    """``address`` (its PeerID kept) at the proxy's port."""
    return dataclasses.replace(address, host="127.0.0.1", port=port)


@pytest.mark.slow
async def test_recorded_bytes_reveal_no_names_keys_or_payload(
    server_process: tuple[ChildLines, PeerAddress, bytes, Identity],
) -> None:
    """Everything a handshake and a call put on the wire, seen by the proxy, is opaque."""
    _, address, server_key, _ = server_process
    proxy = Proxy((address.host, address.port), None)
    port = await proxy.start()
    client_identity = Identity.generate()
    client = spawn(CLIENT, identity_seed(client_identity), str(via(address, port)), "1")
    try:
        assert (await next_line(client, "OK")) == "OK 0"
        await next_line(client, "DONE")
    finally:
        client.stop()
        await proxy.aclose()
    wire = b"".join(proxy.recorded)
    assert len(wire) > 4 * FLOATS  # the tensor crossed
    payload = tensor(0).tobytes()
    secrets = {
        "server PeerID": address.peer_id.digest if address.peer_id else b"",
        "server PeerID text": str(address.peer_id).encode(),
        "client PeerID": client_identity.peer_id.digest,
        "client PeerID text": str(client_identity.peer_id).encode(),
        "server public key": server_key,
        "client public key": client_identity.public_key,
        "swarm name": SWARM.encode(),
        "method name": METHOD.encode(),
        **{f"payload bytes at {i}": payload[i : i + 16] for i in range(0, len(payload), 4096)},
    }
    for what, needle in secrets.items():
        assert len(needle) >= 16, what
        assert needle not in wire, f"the {what} is visible on the wire"
