"""Hostile peers against a real ``p2ptrain bootstrap``: does it, and a healthy client, survive?

Three real ``python -m p2ptrain bootstrap --port 0`` processes form the swarm
(the first is the victim; the other two are honest replicas, so that a get
can cross-check). A healthy client in this process keeps doing DHT gets (a
signed value, an unsigned value, a signed dictionary) and an RPC ping to the
victim, and checks every answer. Each attack runs in its own attacker
process (this script with ``--attack NAME``), in turn:

* ``reply_amplification``: store a ~12 MiB dictionary, then ask for it 40
  times on one connection and never read (the issue: +480 MB held).
* ``unread_streams``: 20 streams to a unary method, each sent ~30 MiB that
  nobody reads (the issue: +830 MB).
* ``unread_streams_spread``: the same spread over 8 connections (8
  identities), 3 streams of ~30 MiB each: every connection stays under its
  own 96 MiB cap, the node-wide cap is what holds (720 MiB sent).
* ``stream_flood``: 16 connections each open 1,000 streams to a unary method
  and never send the request, so 16,000 handlers would wait (per-connection
  cap 1,024; the node-wide cap is what holds).
* ``preauth_frames``: 64 sockets each announcing a 16 MiB first frame and
  sending 1 MiB of it (the issue: ~1 GB for the handshake timeout).
* ``socket_flood``: 2,000 sockets that connect and stay silent.
* ``dictionary_wipe``: an unsigned plain record under the healthy client's
  signed dictionary key, expiring after its entries.
* ``close_id_forgery``: a node whose id is the closest to the healthy
  client's unsigned key answers every FIND for it with a forged value.
* ``storage_fill``: 1,000 records of 60 KiB stored on the victim.
* ``sybil_flood``: 1,000 identities call the victim, each announcing a tar
  pit (a socket that accepts and never answers) as its address.
* ``dead_contacts``: a real peer that answers every FIND with 10,000
  contacts next to the target, all at one tar pit.

Per attack: the healthy client's median and p99 latency before and during,
its wrong or failed answers, the victim's RSS growth while attacked and
``--after`` seconds after the attacker left, and whether the victim and the
client survived (victim alive; client answered every request, correctly).
A last section measures, in fresh processes, what freeing ~400 MB of large
buffers gives back with and without the buffer-pool trim and ``malloc_trim``.
The last line is JSON: ``{"attacks": [{name, survived, healthy_p99_ms_before,
healthy_p99_ms_during, rss_growth_mb, rss_after_mb_delta, ...}], ...}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import socket
import struct
import subprocess
import sys
import time
from typing import Any

from benchmarks.harness import (
    DefaultsHelpFormatter,
    child_env,
    emit_json,
    format_table,
    median,
    module_argv,
    percentile,
    wait_for_stdin_eof,
)
from p2ptrain.dht import DHT, DHTNodeConfig, ValueWithExpiration
from p2ptrain.dht.protocol import (
    METHOD_FIND,
    METHOD_PING,
    FindReply,
    FindRequest,
    PingReply,
    PingRequest,
    StoreRequest,
)
from p2ptrain.dht.records import Record
from p2ptrain.dht.routing import Contact, NodeID
from p2ptrain.node.address import PeerAddress
from p2ptrain.node.node import Node
from p2ptrain.rpc.handlers import CallContext, Message
from p2ptrain.secure.identity import Identity, PeerID
from p2ptrain.transport.tcp import TCPTransport
from p2ptrain.wire.frames import pack_body

ATTACKS = (
    "reply_amplification",
    "unread_streams",
    "unread_streams_spread",
    "stream_flood",
    "preauth_frames",
    "socket_flood",
    "dictionary_wipe",
    "close_id_forgery",
    "storage_fill",
    "sybil_flood",
    "dead_contacts",
)
SIGNED_KEY = "healthy/signed"
UNSIGNED_KEY = "healthy/unsigned"
DICT_KEY = "healthy/progress"
READY = "ATTACKING"


# -- the swarm -------------------------------------------------------------------------------


class Bootstrap:
    """One ``python -m p2ptrain bootstrap --port 0`` process."""

    def __init__(self, join: str | None = None) -> None:
        command = [sys.executable, "-m", "p2ptrain", "bootstrap", "--port", "0", "--no-rendezvous"]
        if join is not None:
            command += ["--join", join]
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        assert self.process.stdout is not None
        self.address = ""
        for line in self.process.stdout:
            if line.strip().startswith("--join "):
                self.address = line.split()[-1]
                break
        if not self.address:
            raise RuntimeError("the bootstrap process did not start")

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def rss_mb(self) -> float:
        with open(f"/proc/{self.process.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        self.process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)
        if self.process.poll() is None:
            self.process.kill()


# -- the healthy client ----------------------------------------------------------------------


class Healthy:
    """Gets and pings in a loop; records latency and wrong or failed answers."""

    def __init__(self, dht: DHT, victim: str) -> None:
        self.dht = dht
        self.victim = victim
        self.latencies: list[float] = []
        self.errors: list[str] = []

    async def setup(self) -> None:
        now = self.dht.now()
        assert await self.dht.store(SIGNED_KEY, "signed-ok", now + 3600, sign=True)
        assert await self.dht.store(UNSIGNED_KEY, "unsigned-ok", now + 3600)
        sub = self.dht.owned_key("me")
        assert await self.dht.store(DICT_KEY, {"samples": 1}, now + 600, subkey=sub)

    async def one(self, i: int) -> None:
        kind = i % 4
        if kind == 0:
            found = await self.dht.get(SIGNED_KEY)
            ok = isinstance(found, ValueWithExpiration) and found.value == "signed-ok"
        elif kind == 1:
            found = await self.dht.get(UNSIGNED_KEY)
            ok = isinstance(found, ValueWithExpiration) and found.value == "unsigned-ok"
        elif kind == 2:
            entries = await self.dht.get_dictionary(DICT_KEY)
            ok = [v.value for v in entries.values()] == [{"samples": 1}]
        else:
            reply = await self.dht.node.call(
                self.victim, METHOD_PING, PingRequest(None).encode(), timeout=10
            )
            ok = not PingReply.decode(reply.body).client_mode
        if not ok:
            self.errors.append(f"wrong answer to op {kind}")

    async def run_for(self, seconds: float) -> tuple[list[float], list[str]]:
        self.latencies, self.errors = [], []
        deadline = time.perf_counter() + seconds
        i = 0
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            try:
                async with asyncio.timeout(10):
                    await self.one(i)
            except Exception as exc:  # a failed request is a result, not a crash
                self.errors.append(f"{type(exc).__name__}: {exc}"[:200])
            self.latencies.append((time.perf_counter() - started) * 1000)
            i += 1
            await asyncio.sleep(0.01)
        return self.latencies, self.errors


# -- the attacks (run in an attacker process) ------------------------------------------------


async def attacker_node() -> Node:
    node = Node()
    await node.start()
    return node


async def attack(name: str, victim: str, others: list[str]) -> None:
    """Set the attack up, print READY, hold it until stdin closes."""
    held: list[Any] = []
    node = await attacker_node()
    target = PeerAddress.parse(victim)
    if name == "reply_amplification":
        key = b"attacker/big"
        exp = time.time() + 3600
        records = tuple(Record(key, os.urandom(60_000), exp, b"s%03d" % i) for i in range(200))
        for start in range(0, 200, 50):
            body, payload = StoreRequest(records[start : start + 50]).encode()
            await node.call(target, "dht.store", body, payload, timeout=30)
        conn = await node.connect(target)
        assert isinstance(conn.transport, TCPTransport) and conn.transport._transport
        conn.transport._transport.pause_reading()  # never read a reply
        request = FindRequest(NodeID.from_key(key), key, None).encode()
        held += [asyncio.ensure_future(conn.call(METHOD_FIND, request)) for _ in range(40)]
    elif name == "unread_streams":
        conn = await node.connect(target)
        chunk = b"x" * (15 << 20)
        request = FindRequest(NodeID(1), None, None).encode()
        for _ in range(20):
            stream = await conn.open_stream(METHOD_FIND)
            held.append(stream)
            with contextlib.suppress(Exception):
                await stream.send(request)
                await stream.send(None, chunk)
                await stream.send(None, chunk)
    elif name in ("unread_streams_spread", "stream_flood"):
        spread = name == "unread_streams_spread"
        chunk = b"x" * (15 << 20)
        request = FindRequest(NodeID(1), None, None).encode()
        for _ in range(8 if spread else 16):
            extra = Node(identity=Identity.generate())  # dials only: no listener
            held.append(extra)
            conn = await extra.connect(target)
            for _ in range(3 if spread else 1000):
                stream = await conn.open_stream(METHOD_FIND)
                held.append(stream)
                if spread:
                    with contextlib.suppress(Exception):  # reset once past a cap
                        await stream.send(request)
                        await stream.send(None, chunk)
                        await stream.send(None, chunk)
    elif name == "preauth_frames":
        for _ in range(64):
            _reader, writer = await asyncio.open_connection(target.host, target.port)
            writer.write(struct.pack(">II", 16 << 20, 64) + b"\x00" * (1 << 20))
            held.append(writer)
    elif name == "socket_flood":
        _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
        for _ in range(2000):
            sock = socket.create_connection((target.host, target.port))
            held.append(sock)
    elif name == "dictionary_wipe":
        record = Record(DICT_KEY.encode(), pack_body("wiped"), time.time() + 3600)
        for address in [victim, *others]:
            body, payload = StoreRequest((record,)).encode()
            await node.call(address, "dht.store", body, payload, timeout=10)
    elif name == "close_id_forgery":
        key = UNSIGNED_KEY.encode()
        peers = [PeerAddress.parse(a).peer_id for a in [victim, *others]]
        target_id = NodeID.from_key(key)
        nearest = min(NodeID.from_peer_id(p) ^ target_id for p in peers if p is not None)
        identity = Identity.generate()
        while NodeID.from_peer_id(identity.peer_id) ^ target_id >= nearest:
            identity = Identity.generate()
        await node.aclose()
        node = Node(identity=identity)
        await node.start()

        async def ping(ctx: CallContext, request: Message) -> Message:
            return Message(PingReply(client_mode=False).encode())

        async def find(ctx: CallContext, request: Message) -> Message:
            found = FindRequest.decode(request.body, max_key_bytes=512)
            value = None
            if found.key == key:
                value = Record(key, pack_body("forged"), time.time() + 3000)
            body, payload = FindReply((), value).encode(max_value_bytes=1 << 20)
            return Message(body, payload)

        node.handlers.add_unary(METHOD_PING, ping)
        node.handlers.add_unary(METHOD_FIND, find)
        for address in [victim, *others]:
            await node.call(address, METHOD_PING, PingRequest(node.address.endpoint).encode())
    elif name == "storage_fill":
        exp = time.time() + 3600
        for batch in range(50):
            records = tuple(
                Record(b"fill/%d/%d" % (batch, i), os.urandom(60_000), exp) for i in range(20)
            )
            body, payload = StoreRequest(records).encode()
            await node.call(target, "dht.store", body, payload, timeout=30)
    elif name in ("sybil_flood", "dead_contacts"):
        held += await sybil_attack(name, node, victim, others)
    else:
        raise SystemExit(f"unknown attack {name}")
    print(READY, flush=True)
    await wait_for_stdin_eof()
    for item in held:
        if isinstance(item, asyncio.Future):
            item.cancel()
        elif isinstance(item, socket.socket | asyncio.StreamWriter | asyncio.Server):
            item.close()
        elif isinstance(item, list):
            for writer in item:
                writer.close()
        elif isinstance(item, Node):
            await item.abort()
    await node.abort()


async def tar_pit() -> tuple[asyncio.Server, str, list[asyncio.StreamWriter]]:
    """A socket that accepts connections and never answers."""
    writers: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    return server, f"127.0.0.1:{server.sockets[0].getsockname()[1]}", writers


async def sybil_attack(name: str, node: Node, victim: str, others: list[str]) -> list[Any]:
    server, pit, writers = await tar_pit()
    held: list[Any] = [server, writers]
    if name == "sybil_flood":

        async def one() -> None:
            sybil = Node(identity=Identity.generate())  # dials only: no listener
            held.append(sybil)
            with contextlib.suppress(Exception):  # refused beyond the inbound caps
                await sybil.call(victim, METHOD_PING, PingRequest(pit).encode(), timeout=10)

        for _ in range(20):
            await asyncio.gather(*(one() for _ in range(50)))
        return held

    async def ping(ctx: CallContext, request: Message) -> Message:
        return Message(PingReply(client_mode=False).encode())

    replies: dict[int, Message] = {}  # a fast attacker answers from a cache

    async def find(ctx: CallContext, request: Message) -> Message:
        found = FindRequest.decode(request.body, max_key_bytes=512)
        target = int(found.target)
        if target in replies:
            return replies[target]
        dead = sorted(
            (Contact(PeerID((target ^ (i + 1)).to_bytes(32, "big")), pit) for i in range(10_000)),
            key=lambda c: c.node_id ^ target,
        )
        body, payload = FindReply(tuple(dead), None).encode(max_value_bytes=1 << 20)
        replies[target] = Message(body, payload)
        return replies[target]

    node.handlers.add_unary(METHOD_PING, ping)
    node.handlers.add_unary(METHOD_FIND, find)
    for address in [victim, *others]:  # the rogue enters every routing table (it answers)
        await node.call(address, METHOD_PING, PingRequest(node.address.endpoint).encode())
    return held


# -- the driver ------------------------------------------------------------------------------


async def measure_attack(
    name: str, healthy: Healthy, swarm: list[Bootstrap], args: argparse.Namespace
) -> dict[str, Any]:
    victim = swarm[0]
    before, before_errors = await healthy.run_for(args.before)
    rss_base = victim.rss_mb()
    command = module_argv("benchmarks.bench_hostile", "--attack", name, *(b.address for b in swarm))
    child = subprocess.Popen(  # noqa: ASYNC220 - started once per attack, not timed
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env()
    )
    assert child.stdout is not None and child.stdin is not None
    loop = asyncio.get_running_loop()
    line = await loop.run_in_executor(None, child.stdout.readline)
    attack_ok = line.strip() == READY
    peak = [victim.rss_mb()]

    async def sample() -> None:
        while True:
            with contextlib.suppress(OSError, ValueError):
                peak.append(victim.rss_mb())
            await asyncio.sleep(0.2)

    sampler = asyncio.ensure_future(sample())
    during, during_errors = await healthy.run_for(args.during)
    sampler.cancel()
    child.stdin.close()
    await loop.run_in_executor(None, child.wait)
    await asyncio.sleep(args.after)
    alive = victim.alive
    rss_after = victim.rss_mb() if alive else float("nan")
    p99_before, p99_during = percentile(before, 99), percentile(during, 99)
    survived = alive and not during_errors and attack_ok
    return {
        "name": name,
        "survived": survived,
        "attack_set_up": attack_ok,
        "healthy_p50_ms_before": round(median(before), 2),
        "healthy_p99_ms_before": round(p99_before, 2),
        "healthy_p50_ms_during": round(median(during), 2),
        "healthy_p99_ms_during": round(p99_during, 2),
        "healthy_failures_during": len(during_errors),
        "healthy_failures_before": len(before_errors),
        "first_failure": during_errors[0] if during_errors else None,
        "p99_ratio": round(p99_during / p99_before, 2),
        "rss_base_mb": round(rss_base, 1),
        "rss_growth_mb": round(max(peak) - rss_base, 1),
        "rss_after_mb_delta": round(rss_after - rss_base, 1),
    }


MEMORY_CHILD = """
import sys, os, numpy as np
from p2ptrain.wire.buffers import default_pool
from p2ptrain.node.memory import malloc_trim
def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS:'):
            return int(line.split()[1]) / 1024
mode = sys.argv[1]
base = rss()
# what an attack leaves: pooled 16 MiB payload buffers and 12 MiB bytes replies
views = [default_pool.get(15 << 20) for _ in range(12)]
for v in views:
    v[:] = b'x' * len(v)
replies = [os.urandom(12 << 20) for _ in range(20)]
peak = rss()
del views, replies
if mode in ('pool', 'both'):
    default_pool.trim(idle_for=0)
if mode in ('trim', 'both'):
    malloc_trim()
print(round(peak - base, 1), round(rss() - base, 1))
"""


def memory_release_table() -> list[dict[str, Any]]:
    rows = []
    for mode in ("none", "pool", "trim", "both"):
        out = subprocess.run(
            [sys.executable, "-c", MEMORY_CHILD, mode], capture_output=True, text=True, check=True
        ).stdout.split()
        rows.append({"mode": mode, "peak_mb": float(out[0]), "left_mb": float(out[1])})
    return rows


async def main(args: argparse.Namespace) -> None:
    swarm = [Bootstrap()]
    swarm += [Bootstrap(join=swarm[0].address) for _ in range(2)]
    dht = DHT(config=DHTNodeConfig(initial_peers=(swarm[0].address,), client_mode=True))
    await dht.start()
    results = []
    try:
        healthy = Healthy(dht, swarm[0].address)
        await healthy.setup()
        for name in args.attacks:
            print(f"attack {name} ...", file=sys.stderr, flush=True)
            results.append(await measure_attack(name, healthy, swarm, args))
    finally:
        await dht.aclose()
        for bootstrap in swarm:
            bootstrap.stop()
    memory = memory_release_table()
    headers = [
        "attack",
        "survived",
        "p50 before ms",
        "p99 before ms",
        "p99 during ms",
        "p99 ratio",
        "failed ops",
        "RSS growth MB",
        f"RSS +{args.after:g}s MB",
    ]
    rows = [
        [
            r["name"],
            r["survived"],
            r["healthy_p50_ms_before"],
            r["healthy_p99_ms_before"],
            r["healthy_p99_ms_during"],
            r["p99_ratio"],
            r["healthy_failures_during"],
            r["rss_growth_mb"],
            r["rss_after_mb_delta"],
        ]
        for r in results
    ]
    print(format_table(headers, rows))
    for r in results:
        if r["first_failure"]:
            print(f"  {r['name']}: first failure: {r['first_failure']}")
    print("\nmemory given back after freeing ~420 MB of large buffers (fresh process each):")
    print(
        format_table(
            ["release", "peak MB", "left MB"],
            [[m["mode"], m["peak_mb"], m["left_mb"]] for m in memory],
        )
    )
    emit_json({"attacks": results, "memory_release": memory, "after_s": args.after})


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelpFormatter)
    parser.add_argument(
        "--attacks", nargs="+", default=list(ATTACKS), choices=ATTACKS, help="attacks to run"
    )
    parser.add_argument("--before", type=float, default=5.0, help="seconds measured before")
    parser.add_argument("--during", type=float, default=8.0, help="seconds measured during")
    parser.add_argument("--after", type=float, default=30.0, help="seconds until RSS 'after'")
    parser.add_argument("--attack", nargs="+", help=argparse.SUPPRESS)  # attacker process
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.attack:
        name, victim, *others = arguments.attack
        asyncio.run(attack(name, victim, others))
    else:
        asyncio.run(main(arguments))
