"""DHT benchmark: store/get latency and success, with and without churn; get throughput.

Usage::

    python -m benchmarks.bench_dht [--nodes 64] [--keys 200] [--churn 0.1] [--replicas 5]
        [--throughput-nodes 8] [--throughput-gets 500] [--in-flight 10]
        [--hivemind-python PATH | --no-hivemind] [--uvloop | --no-uvloop] [--json-only]

The same workload runs on p2ptrain's DHT and, where it is available, on
hivemind's (``hivemind.dht.DHTNode``, the in-process node that hivemind's
``DHT`` class runs in its background process). Every node of one system runs
in one OS process on one event loop, over loopback:

1. **latency**: ``--nodes`` nodes join one by one, each through a random
   earlier node. ``--keys`` values (a small dict, ~80 bytes encoded) are stored
   one at a time from random nodes and then read once each, one at a time,
   from random nodes: latency (mean, p99) and success (the value read equals
   the value stored).
2. **churn**: the keys are read again from random live nodes while
   ``--churn`` of the nodes die abruptly (p2ptrain: connections aborted, no
   goodbye; hivemind: its p2p daemon killed) and as many new nodes join,
   spread evenly over the reads; then as many new keys are stored and read.
3. **throughput**: a separate swarm of ``--throughput-nodes`` nodes plus one
   client-mode reader (it holds no records, so every get is a network lookup),
   ``2 * --throughput-gets`` distinct keys stored; the reader gets half of them
   one at a time and the other half with ``--in-flight`` gets in flight.

Both systems store each value on ``--replicas`` nodes (hivemind's default is
5) and give up on a silent peer after ``--timeout`` seconds (hivemind's default
``wait_timeout`` is 3). Hivemind runs in a subprocess with the interpreter of
``--hivemind-python`` (by default this interpreter, where
``pip install 'p2ptrain[bench]'`` puts it). To keep hivemind's pins away from
this environment, install it in a separate one and pass its interpreter, e.g.
``python -m venv --system-site-packages ~/hivemind-venv &&
~/hivemind-venv/bin/pip install hivemind==1.1.12``.

A readable table goes to stdout, then, as the very last line, one JSON object.
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import contextlib
import json
import random
import subprocess
import sys
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.harness import (
    DefaultsHelpFormatter,
    child_env,
    emit_json,
    format_table,
    module_argv,
    percentile,
    run,
)
from benchmarks.options import (
    add_hivemind_arguments,
    add_json_only_argument,
    add_role_argument,
    add_uvloop_argument,
    hivemind_of,
)

OP_TIMEOUT = 30.0
"""Seconds one store or get may take before it counts as failed."""

HIVEMIND_TIMEOUT = 1800.0
"""Seconds the hivemind subprocess may run in all."""


# -- one system's swarm ---------------------------------------------------------------------


class Swarm(abc.ABC):
    """The operations the workload needs from one DHT implementation."""

    def __init__(self, args: argparse.Namespace) -> None:
        self._args = args
        self._nodes: list[Any] = []

    @abc.abstractmethod
    async def add_node(self, via: Any | None, *, client_mode: bool = False) -> Any:
        """Start a node that joins through node ``via`` (a new network if None)."""

    @abc.abstractmethod
    async def store(self, node: Any, key: str, value: Any, expiration: float) -> bool:
        """Store a plain value; whether it was accepted."""

    @abc.abstractmethod
    async def get(self, node: Any, key: str) -> Any:
        """The value under ``key``, or None."""

    @abc.abstractmethod
    async def crash(self, node: Any) -> None:
        """Stop ``node`` abruptly, without any goodbye."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Stop every node still running."""


class P2PTrainSwarm(Swarm):
    """p2ptrain's DHT: one :class:`p2ptrain.dht.DHT` per node."""

    def __init__(self, args: argparse.Namespace) -> None:
        from p2ptrain.dht import DHTConfig, DHTNodeConfig

        super().__init__(args)
        self._config = DHTNodeConfig(
            dht=DHTConfig(replicas=args.replicas),
            request_timeout=args.timeout,
            ping_timeout=min(args.timeout, 3.0),
        )

    async def add_node(self, via: Any | None, *, client_mode: bool = False) -> Any:
        import dataclasses

        from p2ptrain.dht import DHT

        config = dataclasses.replace(
            self._config,
            client_mode=client_mode,
            initial_peers=() if via is None else (str(via.address),),
        )
        node = DHT(config=config)
        await node.start()
        self._nodes.append(node)
        return node

    async def store(self, node: Any, key: str, value: Any, expiration: float) -> bool:
        return bool(await node.store(key, value, expiration))

    async def get(self, node: Any, key: str) -> Any:
        found = await node.get(key)
        return None if found is None else found.value

    async def crash(self, node: Any) -> None:
        for conn in node.node.connections():
            conn.transport.close()  # abort: RST, nothing queued is sent
        await node.node.aclose()
        await node.dht_node.aclose()
        self._nodes.remove(node)

    async def aclose(self) -> None:
        for node in self._nodes:
            await node.aclose()
        self._nodes.clear()


class HivemindSwarm(Swarm):
    """hivemind's DHT: one ``hivemind.dht.DHTNode`` (with its p2p daemon) per node."""

    async def add_node(self, via: Any | None, *, client_mode: bool = False) -> Any:
        from hivemind.dht.node import DHTNode

        initial = None if via is None else await via.get_visible_maddrs()
        node = await DHTNode.create(
            initial_peers=initial,
            num_replicas=self._args.replicas,
            wait_timeout=self._args.timeout,
            client_mode=client_mode,
        )
        self._nodes.append(node)
        return node

    async def store(self, node: Any, key: str, value: Any, expiration: float) -> bool:
        return bool(await node.store(key, value, expiration))

    async def get(self, node: Any, key: str) -> Any:
        found = await node.get(key)
        return None if found is None else found.value

    async def crash(self, node: Any) -> None:
        child = getattr(node.p2p, "_child", None)
        if child is not None and child.returncode is None:
            child.kill()  # the daemon dies: every connection of this node drops
        with contextlib.suppress(Exception):
            await asyncio.wait_for(node.shutdown(), 10)
        self._nodes.remove(node)

    async def aclose(self) -> None:
        for node in self._nodes:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(node.shutdown(), 10)
        self._nodes.clear()


# -- the workload ---------------------------------------------------------------------------


@dataclass
class Series:
    """Latencies (ms) and outcomes of one kind of operation."""

    ms: list[float] = field(default_factory=list)
    ok: int = 0

    @property
    def success(self) -> float | None:
        return self.ok / len(self.ms) if self.ms else None

    @property
    def mean(self) -> float | None:
        return sum(self.ms) / len(self.ms) if self.ms else None

    @property
    def p99(self) -> float | None:
        return percentile(self.ms, 99) if self.ms else None


async def timed(series: Series, operation: Awaitable[bool]) -> None:
    """Run one operation, recording its latency and whether it succeeded."""
    started = time.perf_counter()
    try:
        ok = await asyncio.wait_for(operation, OP_TIMEOUT)
    except Exception:  # any failure of the system under test counts as a failed operation
        ok = False
    series.ms.append((time.perf_counter() - started) * 1000)
    series.ok += bool(ok)


def value_for(i: int) -> dict[str, Any]:
    return {"i": i, "peer": f"peer-{i:05d}", "samples": i * 32, "pad": "x" * 40}


async def store_and_check(swarm: Swarm, node: Any, key: str, value: Any, exp: float) -> bool:
    return await swarm.store(node, key, value, exp)


async def get_and_check(swarm: Swarm, node: Any, key: str, expected: Any) -> bool:
    return bool(await swarm.get(node, key) == expected)


async def latency_and_churn(swarm: Swarm, args: argparse.Namespace) -> dict[str, Series]:
    rng = random.Random(args.seed)
    nodes = [await swarm.add_node(None)]
    for _ in range(args.nodes - 1):
        nodes.append(await swarm.add_node(rng.choice(nodes)))
    expires = time.time() + 3600
    keys = {f"bench/{i}": value_for(i) for i in range(args.keys)}
    stores, gets = Series(), Series()
    for key, value in keys.items():
        await timed(stores, store_and_check(swarm, rng.choice(nodes), key, value, expires))
    for key, value in keys.items():
        await timed(gets, get_and_check(swarm, rng.choice(nodes), key, value))

    # churn: nodes die and join while the same keys are read again
    dying = round(args.nodes * args.churn)
    churn_gets = Series()
    alive = list(nodes)
    events = set(round((j + 0.5) * len(keys) / dying) for j in range(dying)) if dying else set()
    for index, (key, value) in enumerate(keys.items()):
        if index in events:
            victim = rng.choice(alive)
            alive.remove(victim)
            await swarm.crash(victim)
            alive.append(await swarm.add_node(rng.choice(alive)))
        await timed(churn_gets, get_and_check(swarm, rng.choice(alive), key, value))
    churn_stores, churn_reads = Series(), Series()
    fresh = {f"bench/after-churn/{i}": value_for(i) for i in range(args.keys)}
    for key, value in fresh.items():
        await timed(churn_stores, store_and_check(swarm, rng.choice(alive), key, value, expires))
    for key, value in fresh.items():
        await timed(churn_reads, get_and_check(swarm, rng.choice(alive), key, value))
    return {
        "store": stores,
        "get": gets,
        "get_churn": churn_gets,
        "store_after_churn": churn_stores,
        "get_after_churn": churn_reads,
    }


async def throughput(swarm: Swarm, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed + 1)
    servers = [await swarm.add_node(None)]
    for _ in range(args.throughput_nodes - 1):
        servers.append(await swarm.add_node(rng.choice(servers)))
    reader = await swarm.add_node(servers[0], client_mode=True)
    expires = time.time() + 3600
    count = args.throughput_gets
    keys = {f"tput/{i}": value_for(i) for i in range(2 * count)}
    for key, value in keys.items():
        await swarm.store(rng.choice(servers), key, value, expires)
    items = list(keys.items())
    sequential, concurrent = Series(), Series()
    started = time.perf_counter()
    for key, value in items[:count]:
        await timed(sequential, get_and_check(swarm, reader, key, value))
    sequential_s = time.perf_counter() - started

    queue = list(items[count:])

    async def worker() -> None:
        while queue:
            key, value = queue.pop()
            await timed(concurrent, get_and_check(swarm, reader, key, value))

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.in_flight)))
    concurrent_s = time.perf_counter() - started
    return {
        "gets_per_s_sequential": count / sequential_s,
        "gets_per_s_concurrent": count / concurrent_s,
        "success_sequential": sequential.success,
        "success_concurrent": concurrent.success,
        "ms_sequential": sequential.mean,
    }


async def measure(swarm_type: type[Swarm], args: argparse.Namespace) -> dict[str, Any]:
    """Run the whole workload on fresh swarms of one system; a flat dict of results."""
    result: dict[str, Any] = {}
    swarm = swarm_type(args)
    try:
        series = await latency_and_churn(swarm, args)
    finally:
        await swarm.aclose()
    for name, s in series.items():
        result[f"{name}_success"] = s.success
        result[f"{name}_ms_mean"] = s.mean
        result[f"{name}_ms_p99"] = s.p99
    swarm = swarm_type(args)
    try:
        result.update(await throughput(swarm, args))
    finally:
        await swarm.aclose()
    return result


# -- hivemind in its own interpreter --------------------------------------------------------


def run_hivemind(python: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run the workload on hivemind in a subprocess; its result dict (or an error)."""
    argv = module_argv(
        "benchmarks.bench_dht", "--role", "hivemind", *forwarded(args), python=python
    )
    try:
        proc = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            check=False,
            timeout=HIVEMIND_TIMEOUT,
            env=child_env(),
        )
    except subprocess.TimeoutExpired:
        return {"error": f"hivemind run exceeded {HIVEMIND_TIMEOUT:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        return {"error": f"hivemind run failed (exit {proc.returncode}): {tail}"}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def forwarded(args: argparse.Namespace) -> list[str]:
    return [
        f"--nodes={args.nodes}",
        f"--keys={args.keys}",
        f"--churn={args.churn}",
        f"--replicas={args.replicas}",
        f"--timeout={args.timeout}",
        f"--throughput-nodes={args.throughput_nodes}",
        f"--throughput-gets={args.throughput_gets}",
        f"--in-flight={args.in_flight}",
        f"--seed={args.seed}",
        "--uvloop" if args.uvloop else "--no-uvloop",
    ]


# -- report ---------------------------------------------------------------------------------


def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def report(
    args: argparse.Namespace, ours: dict[str, Any], theirs: dict[str, Any] | None, status: str
) -> dict[str, Any]:
    hm = theirs if theirs is not None and "error" not in theirs else {}
    rows: list[list[str]] = []
    for label, key, fmt in [
        ("store success", "store_success", pct),
        ("store ms mean", "store_ms_mean", num),
        ("store ms p99", "store_ms_p99", num),
        ("get success", "get_success", pct),
        ("get ms mean", "get_ms_mean", num),
        ("get ms p99", "get_ms_p99", num),
        (f"get success, {args.churn:.0%} churn", "get_churn_success", pct),
        ("get ms mean, churn", "get_churn_ms_mean", num),
        ("get ms p99, churn", "get_churn_ms_p99", num),
        ("store success after churn", "store_after_churn_success", pct),
        ("get success after churn", "get_after_churn_success", pct),
        (
            f"gets/s one at a time ({args.throughput_nodes} nodes)",
            "gets_per_s_sequential",
            lambda v: num(v, 0),
        ),
        (
            f"gets/s {args.in_flight} in flight ({args.throughput_nodes} nodes)",
            "gets_per_s_concurrent",
            lambda v: num(v, 0),
        ),
        ("throughput get success", "success_concurrent", pct),
    ]:
        rows.append([label, fmt(ours.get(key)), fmt(hm.get(key))])
    if not args.json_only:
        loop = "uvloop" if args.uvloop else "asyncio"
        print(
            f"DHT benchmark: {args.nodes} nodes on loopback in one process ({loop}),"
            f" {args.keys} keys, {args.replicas} replicas, churn {args.churn:.0%}"
        )
        print(status)
        if theirs is not None and "error" in theirs:
            print(theirs["error"])
        print(format_table(["", "p2ptrain", "hivemind"], rows))
        ratio_seq = _ratio(ours.get("gets_per_s_sequential"), hm.get("gets_per_s_sequential"))
        ratio_conc = _ratio(ours.get("gets_per_s_concurrent"), hm.get("gets_per_s_concurrent"))
        if ratio_seq is not None and ratio_conc is not None:
            print(
                f"throughput ratio p2ptrain/hivemind: {ratio_seq:.1f}x one at a time,"
                f" {ratio_conc:.1f}x with {args.in_flight} in flight"
            )
    return {
        "nodes": args.nodes,
        "keys": args.keys,
        "replicas": args.replicas,
        "churn": args.churn,
        "store_success": ours.get("store_success"),
        "store_ms_mean": ours.get("store_ms_mean"),
        "store_ms_p99": ours.get("store_ms_p99"),
        "get_success": ours.get("get_success"),
        "get_ms_mean": ours.get("get_ms_mean"),
        "get_ms_p99": ours.get("get_ms_p99"),
        "get_success_churn": ours.get("get_churn_success"),
        "get_ms_mean_churn": ours.get("get_churn_ms_mean"),
        "get_ms_p99_churn": ours.get("get_churn_ms_p99"),
        "store_success_after_churn": ours.get("store_after_churn_success"),
        "get_success_after_churn": ours.get("get_after_churn_success"),
        "gets_per_s_sequential_8": ours.get("gets_per_s_sequential"),
        "gets_per_s_concurrent_8": ours.get("gets_per_s_concurrent"),
        "throughput_nodes": args.throughput_nodes,
        "hivemind": status,
        "hivemind_store_success": hm.get("store_success"),
        "hivemind_store_ms_mean": hm.get("store_ms_mean"),
        "hivemind_get_success": hm.get("get_success"),
        "hivemind_get_ms_mean": hm.get("get_ms_mean"),
        "hivemind_get_ms_p99": hm.get("get_ms_p99"),
        "hivemind_get_success_churn": hm.get("get_churn_success"),
        "hivemind_gets_per_s_sequential_8": hm.get("gets_per_s_sequential"),
        "hivemind_gets_per_s_concurrent_8": hm.get("gets_per_s_concurrent"),
        "uvloop": args.uvloop,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


# -- command line ---------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (the hidden ``--role`` is how the hivemind subprocess is run)."""
    parser = argparse.ArgumentParser(
        description="DHT store/get latency, churn and throughput, against hivemind if present.",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--nodes", type=int, default=64, help="nodes of the latency swarm")
    parser.add_argument("--keys", type=int, default=200, help="keys stored and read")
    parser.add_argument("--churn", type=float, default=0.1, help="share of nodes that die")
    parser.add_argument("--replicas", type=int, default=5, help="nodes each value is stored on")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds per request")
    parser.add_argument("--throughput-nodes", type=int, default=8, help="nodes of that swarm")
    parser.add_argument("--throughput-gets", type=int, default=500, help="gets per mode")
    parser.add_argument("--in-flight", type=int, default=10, help="concurrent gets")
    parser.add_argument("--seed", type=int, default=1, help="random seed of the workload")
    add_hivemind_arguments(parser)
    add_uvloop_argument(parser)
    add_json_only_argument(parser)
    add_role_argument(parser, "hivemind")
    args = parser.parse_args(argv)
    if args.nodes < 2 or args.keys < 1 or args.throughput_nodes < 1 or args.in_flight < 1:
        parser.error("need at least 2 nodes, 1 key, 1 throughput node and 1 get in flight")
    if not 0 <= args.churn < 1:
        parser.error("--churn is a share in [0, 1)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role == "hivemind":
        import logging

        logging.disable(logging.WARNING)  # hivemind logs every failed peer while churning
        emit_json(run(measure(HivemindSwarm, args), use_uvloop=args.uvloop))
        return 0
    python, status = hivemind_of(args)
    if not args.json_only:
        print(f"running p2ptrain ({args.nodes} nodes) ...", flush=True)
    ours = run(measure(P2PTrainSwarm, args), use_uvloop=args.uvloop)
    theirs = None
    if python is not None:
        if not args.json_only:
            print(f"running hivemind ({args.nodes} nodes) in a subprocess ...", flush=True)
        theirs = run_hivemind(python, args)
    emit_json(report(args, ours, theirs, status))
    return 0


if __name__ == "__main__":
    sys.exit(main())
