"""The Peer facade across real NATs: two NATed volunteers average together.

A NAT lab with one public host ``boot`` and two homes ``a`` and ``b`` behind
different easy (port-preserving) NATs. ``boot`` runs the real
``p2ptrain bootstrap`` command (DHT, STUN, rendezvous, relay); ``a`` and ``b``
are :class:`~p2ptrain.peer.Peer` objects with ``PeerConfig(nat=...)``, each
started in a thread that entered its home's namespace (the peer's loop
thread inherits it). Neither can be dialed; they find each other through the
DHT, and the all-reduce dials them by address as it always does: the node's
router (the NAT service) traverses the NATs underneath.
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import time
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
from conftest import ChildLines, join_address

from p2ptrain import aio
from p2ptrain.allreduce.group import GroupPlan
from p2ptrain.allreduce.matchmaking import MatchmakingConfig
from p2ptrain.app.collectors import nat_collector
from p2ptrain.dht.node_config import DHTNodeConfig
from p2ptrain.lab.natlab.lab import HomeConfig, LabConfig, NatLab
from p2ptrain.nat.config import NATConfig
from p2ptrain.nat.stun import stun_query
from p2ptrain.node.config import NodeConfig
from p2ptrain.peer import Peer, PeerConfig
from p2ptrain.testing.natlab_plugin import natlab_fixture

pytestmark = pytest.mark.netns
natlab = natlab_fixture(
    LabConfig(
        homes=(HomeConfig("a"), HomeConfig("b"), HomeConfig("c", nat="symmetric")),
        public_hosts=("boot",),
        turn=False,
    )
)

BOOT_PORT = 4001
ELEMENTS = 300_000


class Bootstrap:
    """``p2ptrain bootstrap`` in the lab's public host, its stdout lines in a queue."""

    def __init__(self, lab: NatLab) -> None:
        announce = lab.node("boot").address
        argv = [
            "-m",
            "p2ptrain.app.cli",
            "bootstrap",
            "--host",
            "0.0.0.0",
            "--port",
            str(BOOT_PORT),
        ]
        argv += ["--announce-host", announce, "--relay", "--relay-mbit", "100"]
        process = lab.python(
            "boot", argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.child = ChildLines(process)
        deadline = time.monotonic() + 30
        self.address = join_address(self.child, deadline)
        self.stun_port = int(self.child.next_line(deadline).split("udp/", 1)[1].split(",", 1)[0])

    def stop(self) -> None:
        self.child.stop()


def nated_peer(bootstrap: str) -> Peer:
    return Peer(
        PeerConfig(
            node=NodeConfig(host="0.0.0.0"),
            dht=DHTNodeConfig(initial_peers=(bootstrap,)),
            matchmaking=MatchmakingConfig(
                target_group_size=2, window=2.0, poll_interval=0.05, ready_timeout=5.0
            ),
            nat=NATConfig(dialback_timeout=1.5),
        )
    )


@pytest.fixture(scope="module")
def boot(natlab: NatLab) -> Iterator[Bootstrap]:
    bootstrap = Bootstrap(natlab)
    try:
        yield bootstrap
    finally:
        bootstrap.stop()


@pytest.fixture
def peers(natlab: NatLab, boot: Bootstrap) -> Iterator[dict[str, Peer]]:
    made = {name: nated_peer(boot.address) for name in "ab"}
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            # Started from a thread inside the home: the peer's loop thread lives there too.
            starts = [pool.submit(natlab.call, name, made[name].start) for name in made]
            for future in starts:
                future.result(90)
        yield made
    finally:
        for peer in made.values():
            peer.close()


def test_the_bootstraps_stun_responder_shows_a_home_its_public_address(
    natlab: NatLab, boot: Bootstrap
) -> None:
    async def ask() -> list[tuple[str, int] | None]:
        server = (natlab.node("boot").address, boot.stun_port)
        return await stun_query([server], timeout=5.0)

    [mapped] = natlab.call("a", aio.run, ask())
    assert mapped is not None and mapped[0] == natlab.home("a").public_address


def test_one_bootstrap_is_enough_to_tell_a_symmetric_nat(natlab: NatLab, boot: Bootstrap) -> None:
    peer = nated_peer(boot.address)
    try:
        natlab.call("c", peer.start)
        reachability = peer.reachability
        assert reachability is not None and not reachability.public
        assert peer.reach == "nat:symmetric", reachability.notes
        assert len(set(reachability.mapped)) == 2  # a new mapping per destination port
    finally:
        peer.close()


def test_two_nated_peers_average_through_the_router(natlab: NatLab, peers: dict[str, Peer]) -> None:
    a, b = peers["a"], peers["b"]
    for peer in (a, b):
        # The bootstrap answers STUN on two ports: one public peer tells the NAT's kind.
        assert peer.reach == "nat:easy"
        assert peer.dht.dht_node.config.client_mode  # a DHT client: nobody dials it directly
        assert not peer.client_mode  # but it takes part in the all-reduce as a reducer
        assert peer.address.split("@", 1)[1].startswith("0.0.0.0:")

    tensors = {name: torch.full((ELEMENTS,), float(i + 1)) for i, name in enumerate("ab")}

    async def round_of(peer: Peer, tensor: torch.Tensor) -> torch.Tensor:
        plan: GroupPlan = await peer.matchmaker.form_group("lab/step-1", num_elements=ELEMENTS)
        assert plan.size == 2 and all(m.address is not None for m in plan.members)
        averaged, report = await peer.allreduce.allreduce(plan, tensor)
        assert report.complete, report
        return averaged

    futures = {name: peers[name].submit(round_of(peers[name], tensors[name])) for name in "ab"}
    results = {name: future.result(90) for name, future in futures.items()}
    for name in "ab":
        assert torch.equal(results[name], torch.full((ELEMENTS,), 1.5))

    # The leader asks the other whether it is ready while the other asks the leader: both
    # dial at once, and the tie-break for crossing dials leaves one hole-punched connection.
    paths = (a.paths()[b.peer_id], b.paths()[a.peer_id])
    assert paths == ("tcp-holepunch", "tcp-holepunch"), paths
    made = [
        traversal
        for dialer, target in ((a, b), (b, a))
        if dialer.nat is not None
        and (traversal := dialer.nat.router.traversals.get(target.peer_id)) is not None
    ]
    assert made and all(t.path == "tcp-holepunch" for t in made), made
    assert all("behind NAT" in t.attempts["tcp-direct"] for t in made)  # no address published
    # The metrics count what the traversals did: the path taken, the direct dial skipped.
    samples = [s for peer in (a, b) if peer.nat is not None for s in nat_collector(peer.nat)()]
    taken = [s for s in samples if s.name == "p2ptrain_nat_traversals_total"]
    assert taken and {s.labels["path"] for s in taken} == {"tcp-holepunch"}, samples
    skipped = {s.labels["path"] for s in samples if s.name == "p2ptrain_nat_fallbacks_total"}
    assert "tcp-direct" in skipped, samples
    # ... and how long they took, as a histogram whose count is the traversals that connected
    timing: Counter[tuple[str, str | None]] = Counter()
    for s in samples:  # both peers' samples: each series summed over the two
        if s.name.startswith("p2ptrain_nat_traversal_seconds"):
            timing[(s.name, s.labels.get("le"))] += s.value
    count = sum(s.value for s in taken)
    assert timing[("p2ptrain_nat_traversal_seconds_count", None)] == count, timing
    assert timing[("p2ptrain_nat_traversal_seconds_bucket", "+Inf")] == count, timing
    assert timing[("p2ptrain_nat_traversal_seconds_sum", None)] > 0, timing
    figures = ", ".join(f"{t.attempt} in {t.seconds * 1000:.0f} ms" for t in made)
    print(f"\nFIGURE peers a<->b averaged; connected over tcp-holepunch ({figures})")
    for me, other in ((a, b), (b, a)):
        conn = me.node.connection_to(other.peer_id)
        assert conn is not None
        # Both ends of one connection: each sees the other's listening port behind its NAT.
        public = natlab.home("b" if me is a else "a").public_address
        assert conn.transport.remote_address == f"{public}:{other.node.address.port}"
