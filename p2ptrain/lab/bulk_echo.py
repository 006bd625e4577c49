"""Small calls during a bulk stream: how long a request waits behind tensor data.

Two processes, for a shaped link (the star lab) or any two hosts::

    python -m p2ptrain.lab.bulk_echo serve HOST          # prints its address
    python -m p2ptrain.lab.bulk_echo measure ADDRESS MIB paced|unpaced

``measure`` streams ``MIB`` MiB to the server in 1 MiB frames and meanwhile
makes an echo call every 50 ms; it prints one JSON line: bytes delivered,
seconds, the calls' median and 90th-percentile latency, how many calls, and
how many times the pacer held a bulk frame. ``unpaced`` sets
``ConnectionConfig.pace_target_s`` to None. The server serves until its
standard input closes.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from p2ptrain import aio
from p2ptrain.lab.echo import echo
from p2ptrain.lab.starlab import StarLab
from p2ptrain.node.address import PeerAddress
from p2ptrain.node.config import NodeConfig
from p2ptrain.node.node import Node
from p2ptrain.rpc.config import ConnectionConfig
from p2ptrain.rpc.handlers import CallContext
from p2ptrain.rpc.stream import RPCStream

__all__ = ["main", "measure", "run_in_lab", "serve"]

SINK_METHOD = "bulk_echo.sink"
FRAME_BYTES = 1 << 20
PING_INTERVAL_S = 0.05


async def _sink(context: CallContext, stream: RPCStream) -> None:
    total = 0
    async for message in stream:
        total += len(memoryview(message.payload))
    await stream.send({"n": total}, end=True)


async def serve(host: str) -> None:
    """Serve echo and the sink on ``host`` until standard input closes."""
    async with Node(config=NodeConfig(host=host)) as node:
        node.handlers.add_unary("echo", echo)
        node.handlers.add_stream(SINK_METHOD, _sink)
        print(node.address, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


async def measure(address: str, mib: int, *, paced: bool) -> dict[str, Any]:
    """Stream ``mib`` MiB to ``address`` while timing echo calls (see the module docstring)."""
    target = PeerAddress.parse(address)
    pace = ConnectionConfig().pace_target_s if paced else None
    config = NodeConfig(connection=ConnectionConfig(pace_target_s=pace))
    async with Node(config=config) as node:
        await node.connect(target)
        sending = True
        latencies: list[float] = []

        async def ping() -> None:
            while sending:
                start = time.monotonic()
                await node.call(target, "echo", {"ping": 1})
                latencies.append(time.monotonic() - start)
                await asyncio.sleep(PING_INTERVAL_S)

        pinger = asyncio.create_task(ping())
        payload = memoryview(bytearray(FRAME_BYTES))
        start = time.monotonic()
        stream = await node.open_stream(target, SINK_METHOD)
        async with stream:
            for i in range(mib):
                await stream.send({"i": i}, payload, end=i == mib - 1)
            total = (await stream.recv()).body["n"]
        seconds = time.monotonic() - start
        sending = False
        await pinger
        pacer = getattr(node.connections()[0].transport, "pacer", None)
    latencies.sort()
    return {
        "bytes": total,
        "seconds": seconds,
        "median": latencies[len(latencies) // 2],
        "p90": latencies[int(0.9 * (len(latencies) - 1))],
        "count": len(latencies),
        "delays": 0 if pacer is None else pacer.delays,
    }


def run_in_lab(lab: StarLab, mib: int, *, paced: bool, timeout: float = 120.0) -> dict[str, Any]:
    """Serve on host 1 of ``lab`` and measure from host 0; returns :func:`measure`'s result.

    Raises:
        RuntimeError: a process failed or the server printed no address.
    """
    module = [sys.executable, "-m", "p2ptrain.lab.bulk_echo"]
    server = subprocess.Popen(
        lab.argv(1, [*module, "serve", lab.host_address(1)]),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        address = server.stdout.readline().strip() if server.stdout is not None else ""
        if not address:
            raise RuntimeError("the bulk-echo server printed no address")
        mode = "paced" if paced else "unpaced"
        done = subprocess.run(
            lab.argv(0, [*module, "measure", address, str(mib), mode]),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    finally:
        server.communicate(timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"bulk-echo measure failed: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Command line (see the module docstring)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) == 2 and args[0] == "serve":
        aio.run(serve(args[1]))
        return 0
    if len(args) == 4 and args[0] == "measure" and args[3] in ("paced", "unpaced"):
        result = aio.run(measure(args[1], int(args[2]), paced=args[3] == "paced"))
        print(json.dumps(result), flush=True)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
