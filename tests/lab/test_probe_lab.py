"""The timed bandwidth probe on shaped links (network namespaces, tc tbf, root)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from p2ptrain.lab.natlab.netns import python_env
from p2ptrain.lab.starlab import LinkSpec, StarLab
from p2ptrain.testing.natlab_plugin import require_netns

_SERVER = """
import asyncio, sys
from p2ptrain.measure.probe import serve_probes
from p2ptrain.node.config import NodeConfig
from p2ptrain.node.node import Node

async def main():
    async with Node(config=NodeConfig(host=sys.argv[1])) as node:
        serve_probes(node)
        print(node.address, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

asyncio.run(main())
"""
_PROBER = """
import asyncio, json, sys
from p2ptrain.measure import LinkEstimator
from p2ptrain.measure.probe import probe_peers
from p2ptrain.node.address import PeerAddress
from p2ptrain.node.config import NodeConfig
from p2ptrain.node.node import Node

async def main():
    async with Node(config=NodeConfig(host=sys.argv[1])) as node:
        targets = [PeerAddress.parse(a) for a in sys.argv[2:]]
        results = await probe_peers(node, targets, seconds=1.0)
        links = LinkEstimator()
        links.observe_probe([r.upload for r in results], [r.download for r in results])
        print(json.dumps({"answered": len(results), "up": links.upload_bytes_per_s,
                          "down": links.download_bytes_per_s}))

asyncio.run(main())
"""


@pytest.mark.slow
def test_a_fast_peer_is_measured_as_what_its_partners_take_together() -> None:
    """A 1000 Mbit/s peer probing a 100 and a 20 Mbit/s partner at once sees ~120 each way.

    A byte-bounded probe (the same bytes to both) is timed by the 20 Mbit/s
    stream and would show about 40; the timed probe runs both for the same time.
    """
    require_netns()
    links = [LinkSpec(1000, 1000), LinkSpec(100, 100), LinkSpec(20, 20)]
    env = python_env()
    with StarLab(links) as lab:
        servers = [
            subprocess.Popen(
                lab.argv(i, [sys.executable, "-c", _SERVER, lab.host_address(i)]),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            for i in (1, 2)
        ]
        try:
            addresses = [s.stdout.readline().strip() for s in servers if s.stdout]
            done = subprocess.run(
                lab.argv(0, [sys.executable, "-c", _PROBER, lab.host_address(0), *addresses]),
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
                env=env,
            )
        finally:
            for server in servers:
                server.communicate(timeout=30)
    result = json.loads(done.stdout)
    assert result["answered"] == 2
    for direction in ("up", "down"):
        mbit = result[direction] * 8e-6
        # 120 Mbit/s on the wire is ~115 of TCP payload; the streams' ramp costs a little.
        assert 85 < mbit < 125, (direction, mbit)
