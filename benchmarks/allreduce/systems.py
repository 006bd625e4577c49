"""How the all-reduce benchmark starts each system's peers and what it tells them per round.

Every system is a :class:`~benchmarks.allreduce.runner.PeerGroup` of one process per
peer; ``wrap(index, argv)`` turns a peer's command line into the one to run
(identity on loopback, ``ip netns exec <ns> ...`` in the star lab). The
``*_prepares`` functions build one ``prepare`` command per peer for one round.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from benchmarks.allreduce.runner import PeerGroup
from p2ptrain.allreduce import GroupMember, GroupPlan
from p2ptrain.node.address import PeerAddress

__all__ = [
    "Wrap",
    "free_port",
    "p2ptrain_plan",
    "p2ptrain_prepares",
    "start_gloo",
    "start_hivemind",
    "start_p2ptrain",
    "vector_prepares",
]

WORKER = "benchmarks.allreduce.workers"
HIVEMIND_WORKER = "benchmarks.allreduce.hivemind"
START_TIMEOUT = 120.0
"""Seconds a group of peers has to start (imports, DHT bootstrap, gloo rendezvous)."""

Wrap = Callable[[int, list[str]], list[str]]


def _same(_index: int, argv: list[str]) -> list[str]:
    return argv


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (for gloo's store on loopback)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


# -- p2ptrain ---------------------------------------------------------------------------------


def start_p2ptrain(
    group: PeerGroup,
    hosts: Sequence[str],
    *,
    wrap: Wrap = _same,
    timeout: float,
    pool_mib: int | None = None,
    profile: str | None = None,
    insecure_plaintext: bool = False,
    crypto_offload: bool = True,
    pacing: bool = False,
) -> list[PeerAddress]:
    """Start one p2ptrain node per host; return their addresses.

    ``pool_mib`` overrides the idle bytes of p2ptrain's buffer pool (``None``:
    the library's default); ``profile`` is a cProfile output path for every
    peer (``{pid}`` expands); ``insecure_plaintext`` runs the peers with the
    trusted-cluster opt-out (no records after the handshake);
    ``crypto_offload`` False keeps every AES-GCM pass on the peers' event loops;
    ``pacing`` turns on the kernel pacing of the rounds' streams.
    """
    base = [sys.executable, "-m", WORKER, "p2ptrain", "--timeout", str(timeout)]
    if pool_mib is not None:
        base += ["--pool-mib", str(pool_mib)]
    if profile is not None:
        base += ["--profile", profile]
    if insecure_plaintext:
        base += ["--insecure-plaintext"]
    if not crypto_offload:
        base += ["--no-crypto-offload"]
    if pacing:
        base += ["--pacing"]
    argvs = [wrap(i, [*base, "--host", host]) for i, host in enumerate(hosts)]
    hellos = group.start(argvs, timeout=START_TIMEOUT)
    return [PeerAddress.parse(hello["hello"]) for hello in hellos]


def p2ptrain_plan(
    addresses: Sequence[PeerAddress],
    shares: Sequence[float],
    numel: int,
    *,
    clients: Sequence[int] = (),
    chunk_elements: int,
    timeout: float,
    predicted_s: float | None = None,
) -> GroupPlan:
    """A plan with these shares (fresh round id); ``clients`` have no address."""
    members = [
        GroupMember(address.peer_id, None if i in clients else address)
        for i, address in enumerate(addresses)
        if address.peer_id is not None
    ]
    if len(members) != len(addresses):
        raise ValueError("every address must name its peer")
    return GroupPlan.from_shares(
        members,
        shares,
        numel,
        chunk_elements=chunk_elements,
        reduce_timeout=timeout * 0.8,
        round_timeout=timeout,
        predicted_time=predicted_s,
    )


def p2ptrain_prepares(plan: GroupPlan) -> list[dict[str, Any]]:
    """The ``prepare`` command of every member for ``plan``."""
    wire = msgpack.packb(plan.to_wire()).hex()
    return [
        {"cmd": "prepare", "rank": i, "peers": plan.size, "numel": plan.num_elements, "plan": wire}
        for i in range(plan.size)
    ]


# -- gloo -------------------------------------------------------------------------------------


def start_gloo(
    group: PeerGroup,
    master: str,
    world: int,
    *,
    ifname: str,
    wrap: Wrap = _same,
    timeout: float,
) -> None:
    """Start ``world`` gloo ranks rendezvousing at ``master`` (``host:port``, rank 0's)."""
    argvs = [
        wrap(
            rank,
            [
                sys.executable,
                "-m",
                WORKER,
                "gloo",
                "--master",
                master,
                "--rank",
                str(rank),
                "--world",
                str(world),
                "--ifname",
                ifname,
                "--timeout",
                str(timeout),
            ],
        )
        for rank in range(world)
    ]
    group.start(argvs, timeout=START_TIMEOUT)


def vector_prepares(world: int, numel: int) -> list[dict[str, Any]]:
    """The ``prepare`` command of every gloo rank or hivemind peer: just the vector."""
    return [
        {"cmd": "prepare", "rank": rank, "peers": world, "numel": numel} for rank in range(world)
    ]


# -- hivemind ---------------------------------------------------------------------------------


def start_hivemind(
    group: PeerGroup,
    python: str,
    peers: int,
    *,
    host: str = "127.0.0.1",
    matchmaking_s: float,
    timeout: float,
) -> None:
    """Start ``peers`` hivemind peers: the first, then the others bootstrapping from it."""
    base = [
        python,
        "-m",
        HIVEMIND_WORKER,
        "--host",
        host,
        "--matchmaking-time",
        str(matchmaking_s),
        "--timeout",
        str(timeout),
    ]
    (first,) = group.start([base], timeout=START_TIMEOUT)
    bootstrap = [arg for address in first["hello"] for arg in ("--initial-peer", address)]
    group.start([[*base, *bootstrap]] * (peers - 1), timeout=START_TIMEOUT)
