"""The virtual clock, the simulated network, and the swarm simulator running the real code."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import textwrap
import time

import pytest
import torch

from p2ptrain.allreduce import reducer as reducer_module
from p2ptrain.allreduce.grouped import GroupingConfig
from p2ptrain.allreduce.service import AllReduceService
from p2ptrain.errors import ConnectError, P2PTrainError
from p2ptrain.lab.simnet import LinkProfile, SimNetwork
from p2ptrain.lab.simulator import Simulation, SimulationConfig
from p2ptrain.lab.virtual_clock import VirtualClockLoop, run_virtual
from p2ptrain.node.config import NodeConfig
from p2ptrain.node.node import Node
from p2ptrain.rpc.config import ConnectionConfig
from p2ptrain.rpc.handlers import CallContext, Message
from p2ptrain.transport.base import FrameTransport
from p2ptrain.wire.frames import Frame, FrameType, encode_frame

# -- the virtual clock ---------------------------------------------------------------------


def test_virtual_clock_runs_an_hour_of_timers_in_no_time() -> None:
    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, VirtualClockLoop)
        fired: list[float] = []

        async def sleeper(delay: float) -> None:
            await asyncio.sleep(delay)
            fired.append(loop.time())

        await asyncio.gather(*(sleeper(d) for d in (3600.0, 1.5, 60.0)))
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(10.0):
                await asyncio.Event().wait()
        fired.append(loop.time())
        return fired

    wall = time.perf_counter()
    fired = run_virtual(main())
    assert time.perf_counter() - wall < 2.0
    assert fired == pytest.approx([1.5, 60.0, 3600.0, 3610.0])


# -- the simulated network -----------------------------------------------------------------


async def _echo(ctx: CallContext, request: Message) -> Message:
    return Message(len(request.payload))


async def _two_nodes(net: SimNetwork, a: LinkProfile, b: LinkProfile) -> tuple[Node, Node]:
    nodes = []
    for host, link in (("10.0.0.1", a), ("10.0.0.2", b)):
        node = Node(config=NodeConfig(host=host), network=net.add_host(host, link))
        await node.start()
        node.handlers.add_unary("echo", _echo)
        nodes.append(node)
    return nodes[0], nodes[1]


def test_a_transfer_takes_its_bytes_over_the_slower_link_plus_latency() -> None:
    async def main() -> tuple[float, float, int]:
        loop = asyncio.get_running_loop()
        net = SimNetwork()
        # 8 Mbit/s up (1 MB/s) from a, 80 Mbit/s down at b, 40 ms RTT between them.
        a, b = await _two_nodes(net, LinkProfile.mbit(50, 8, 40), LinkProfile.mbit(80, 80, 40))
        await a.call(b.address, "echo", None, b"")  # dial and handshake first
        started = loop.time()
        reply = await a.call(b.address, "echo", None, b"x" * 2_000_000)
        big = loop.time() - started
        started = loop.time()
        await a.call(b.address, "echo", None, b"")
        small = loop.time() - started
        await a.aclose()
        await b.aclose()
        return big, small, reply.body

    big, small, size = run_virtual(main())
    assert size == 2_000_000
    assert small == pytest.approx(0.04, rel=0.05)  # one round trip
    assert big == pytest.approx(2.0 + 0.04, rel=0.02)  # 2 MB at 1 MB/s, then the reply


def test_a_frame_due_just_after_another_timer_is_still_delivered() -> None:
    # asyncio runs every timer due before time() + its clock resolution, so a
    # frame's drain can run a hair before the frame is due. It must take the
    # frame then: nothing else would wake it (found at 512 simulated peers,
    # where handshakes between live hosts timed out after 10 s).
    async def main() -> int:
        loop = asyncio.get_running_loop()
        net = SimNetwork()
        link = LinkProfile.mbit(100, 100, 20)
        a, b = net.add_host("10.0.0.1", link), net.add_host("10.0.0.2", link)
        accepted: list[FrameTransport] = []
        limits = ConnectionConfig()
        await b.listen("10.0.0.2", 1, accepted.append, limits=limits, reuse_port=False)
        ours = await a.connect("10.0.0.2", 1, timeout=5.0, limits=limits)
        theirs = accepted[0]
        due = loop.time() + 1.0
        loop.call_at(due, lambda: None)  # the timer the clock jumps to
        head, payload = encode_frame(Frame(FrameType.PING, fields={"n": 7}))
        theirs._arrive(due + 5e-10, head + bytes(payload))  # type: ignore[attr-defined]
        async with asyncio.timeout(5.0):
            frame = await theirs.recv_frame()
        ours.close()
        return int(frame.field("n"))

    assert run_virtual(main()) == 7


def test_an_uplink_queues_at_most_queue_s_and_its_bulk_senders_take_turns() -> None:
    # A home modem's buffer holds a fraction of a second, not every byte the
    # host's connections have to send: a request waits behind that buffer
    # and one frame, not behind megabytes (the production transport's
    # pacing writes small frames at once).
    async def main() -> tuple[float, float, list[float], float]:
        loop = asyncio.get_running_loop()
        net = SimNetwork()
        slow = LinkProfile.mbit(100, 8, 20)  # 1 MB/s up
        fast = LinkProfile.mbit(100, 100, 20)
        a = net.add_host("10.0.0.1", slow)
        accepted: list[FrameTransport] = []
        limits = ConnectionConfig()
        outgoing = []
        for i in (2, 3, 4):
            host = f"10.0.0.{i}"
            await net.add_host(host, fast).listen(
                host, 1, accepted.append, limits=limits, reuse_port=False
            )
            outgoing.append(await a.connect(host, 1, timeout=5.0, limits=limits))
        chunk = bytes(256 * 1024)
        finished: list[float] = []

        async def bulk(transport: FrameTransport) -> None:
            for _ in range(8):
                await transport.send_frame(Frame(FrameType.DATA, stream_id=1, payload=chunk))
            finished.append(loop.time())

        started = loop.time()
        senders = [asyncio.create_task(bulk(t)) for t in outgoing[:2]]
        await asyncio.sleep(1.0)  # 4 MiB to send: 4.2 s of uplink
        backlog = a.up_free - loop.time()
        sent = loop.time()
        await outgoing[2].send_frame(Frame(FrameType.PING, fields={"n": 1}))
        async with asyncio.timeout(10.0):
            await accepted[2].recv_frame()
        waited = loop.time() - sent
        await asyncio.gather(*senders)
        for transport in outgoing:
            transport.close()
        return backlog, waited, finished, started

    backlog, waited, finished, started = run_virtual(main())
    frame_s = 256 * 1024 / 1e6
    assert backlog <= 0.25 + frame_s + 1e-6
    assert waited <= 0.25 + frame_s + 0.01 + 1e-3  # the queue, one frame, the one-way delay
    # In turns (the first sender queues two frames before the second's first):
    # both streams end within two frames of each other, the link busy throughout.
    assert abs(finished[0] - finished[1]) <= 2 * frame_s + 0.02
    assert max(finished) - started == pytest.approx(16 * frame_s, abs=0.25 + 2 * frame_s)


def test_a_killed_host_resets_its_connections_and_refuses_new_ones() -> None:
    async def main() -> None:
        net = SimNetwork()
        link = LinkProfile.mbit(100, 100, 20)
        a, b = await _two_nodes(net, link, link)
        await a.call(b.address, "echo", None, b"")
        conn = a.connection_to(b.peer_id)
        assert conn is not None
        net.kill("10.0.0.2")
        async with asyncio.timeout(1.0):
            await conn.transport.wait_closed()
        with pytest.raises(ConnectError):
            await a.call(b.address, "echo", None, b"")
        await a.aclose()

    run_virtual(main())


async def _hub_and_six_peers() -> tuple[Node, list[Node]]:
    """A hub holding at most 3 connections (closable after 1 s idle) and six echo peers."""
    net = SimNetwork()
    link = LinkProfile.mbit(100, 100, 20)
    hub = Node(
        config=NodeConfig(host="10.0.1.1", max_connections=3, min_idle_s=1.0),
        network=net.add_host("10.0.1.1", link),
    )
    await hub.start()
    others = []
    for i in range(6):
        node = Node(
            config=NodeConfig(host=f"10.0.2.{i}"), network=net.add_host(f"10.0.2.{i}", link)
        )
        await node.start()
        node.handlers.add_unary("echo", _echo)
        others.append(node)
    return hub, others


def test_a_node_closes_its_longest_idle_connections_past_max_connections() -> None:
    async def main() -> int:
        hub, others = await _hub_and_six_peers()
        for node in others:
            await hub.call(node.address, "echo", None, b"")
            await asyncio.sleep(2.0)  # virtual: the earlier connections are idle by now
        await asyncio.sleep(0.5)  # the closes take a round trip
        count = len(hub.connections())
        newest = hub.connection_to(others[-1].peer_id)
        assert newest is not None
        for node in [hub, *others]:
            await node.aclose()
        return count

    assert run_virtual(main()) <= 3


def test_a_full_pool_closes_connections_that_become_idle_later() -> None:
    """Dialled in a burst, no connection is idle enough to close when the pool
    overflows; the node closes the surplus once they have been idle ``min_idle_s``."""

    async def main() -> tuple[int, int]:
        hub, others = await _hub_and_six_peers()
        await asyncio.gather(*(hub.call(node.address, "echo", None, b"") for node in others))
        right_after = len(hub.connections())
        await asyncio.sleep(2.0)  # virtual: idle for min_idle_s, then the closes' round trip
        later = len(hub.connections())
        for node in [hub, *others]:
            await node.aclose()
        return right_after, later

    right_after, later = run_virtual(main())
    assert right_after == 6  # none was idle yet: nothing closed
    assert later <= 3


def test_a_call_racing_an_idle_close_is_served_and_the_caller_closes_after() -> None:
    """The node closing an idle connection for room must serve a stream already in flight.

    ``other`` opens a call on its pooled connection at the very moment the hub
    closes that connection (the hub's pool overflows): the OPEN is on the wire
    when the hub decides. Closing at once lost it ("closed the connection");
    the hub now announces the close and serves on, and ``other`` closes the
    connection when its call is done.
    """

    async def main() -> tuple[object, bool]:
        net = SimNetwork()
        link = LinkProfile.mbit(100, 100, 40)
        hub = Node(
            config=NodeConfig(host="10.0.1.1", max_connections=1, min_idle_s=1.0),
            network=net.add_host("10.0.1.1", link),
        )
        await hub.start()
        hub.handlers.add_unary("echo", _echo)
        other, third = (
            Node(config=NodeConfig(host=f"10.0.2.{i}"), network=net.add_host(f"10.0.2.{i}", link))
            for i in range(2)
        )
        for node in (other, third):
            await node.start()
        await other.call(hub.address, "echo", None, b"warm")
        # Virtual seconds: idle for longer than min_idle_s, and than the grace
        # after which the closer closes a connection the remote left open.
        await asyncio.sleep(2 * NodeConfig().idle_close_grace_s)
        await hub.connect(third.address)  # the hub's pool overflows: it closes the idle one
        conn = other.connection_to(hub.peer_id)
        assert conn is not None  # the close has not reached ``other`` yet
        reply = await conn.call("echo", None, b"racing")
        await asyncio.sleep(1.0)
        closed = conn.closed and hub.connection_to(other.peer_id) is None
        for node in (hub, other, third):
            await node.aclose()
        return reply.body, closed

    assert run_virtual(main()) == (len(b"racing"), True)


# -- grouped averaging in the simulator ----------------------------------------------------


def _small(peers: int, **kwargs: object) -> SimulationConfig:
    return SimulationConfig(
        peers=peers,
        vector_elements=4096,
        grouping=GroupingConfig(group_size=8, group_window=2.0, column_window=6.0),
        **kwargs,  # type: ignore[arg-type]
    )


@pytest.mark.slow
def test_grouped_averaging_reaches_the_exact_weighted_average_under_churn() -> None:
    async def main() -> list[object]:
        async with Simulation(_small(24, churn=0.1, seed=3)) as sim:
            return [await sim.step(), await sim.step()]

    for result in run_virtual(main()):
        assert result.groups == 3  # type: ignore[attr-defined]
        assert result.killed == 2  # type: ignore[attr-defined]
        assert result.incomplete == 0, result.failures  # type: ignore[attr-defined]
        assert result.counted_fraction >= 0.99  # type: ignore[attr-defined]
        assert result.max_rel_error < 1e-6  # type: ignore[attr-defined]
        # No DHT value holds more than about one group's announcements.
        assert result.max_dict_entries <= 2.5 * 8  # type: ignore[attr-defined]


@pytest.mark.slow
def test_a_member_covering_several_slices_runs_their_columns_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each column waits for its slowest member: a member covering several
    slices averages them concurrently instead of adding those waits up."""
    in_flight: dict[int, int] = {}
    most: dict[int, int] = {}
    original = AllReduceService.allreduce

    async def counted(self: AllReduceService, *args: object, **kwargs: object) -> object:
        key = id(self)
        in_flight[key] = in_flight.get(key, 0) + 1
        most[key] = max(most.get(key, 0), in_flight[key])
        try:
            return await original(self, *args, **kwargs)  # type: ignore[arg-type]
        finally:
            in_flight[key] -= 1

    monkeypatch.setattr(AllReduceService, "allreduce", counted)

    async def main() -> object:
        async with Simulation(_small(24, seed=3)) as sim:
            return await sim.step()

    result = run_virtual(main())
    assert result.groups == 3  # type: ignore[attr-defined]
    assert result.incomplete == 0, result.failures  # type: ignore[attr-defined]
    assert result.max_rel_error < 1e-6  # type: ignore[attr-defined]
    # The group's round and the gather run alone; only columns overlap.
    assert max(most.values()) >= 2


def test_below_the_group_size_the_swarm_averages_in_one_group() -> None:
    async def main() -> object:
        async with Simulation(_small(6, seed=1)) as sim:
            return await sim.step()

    result = run_virtual(main())
    assert result.groups == 1  # type: ignore[attr-defined]
    assert result.counted_fraction == 1.0  # type: ignore[attr-defined]
    assert result.max_rel_error < 1e-6  # type: ignore[attr-defined]


def _broken_add() -> object:
    """A copy of ``ShardReducer.add`` with one line changed: each part is added off by one."""
    source = textwrap.dedent(inspect.getsource(reducer_module.ShardReducer.add))
    original = "self._aggregators[chunk].add(values, sender.weight)"
    assert source.count(original) == 1
    source = source.replace(original, "self._aggregators[chunk].add(values + 1, sender.weight)")
    namespace: dict[str, object] = {}
    exec(compile(source, "<broken reducer>", "exec"), vars(reducer_module), namespace)
    return namespace["add"]


@pytest.mark.slow
def test_the_simulation_runs_the_real_butterfly_breaking_one_line_breaks_the_average(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def main() -> object:
        async with Simulation(_small(16, seed=5)) as sim:
            return await sim.step()

    healthy = run_virtual(main())
    assert healthy.max_rel_error < 1e-6  # type: ignore[attr-defined]
    monkeypatch.setattr(reducer_module.ShardReducer, "add", _broken_add())
    broken = run_virtual(main())
    assert broken.groups == 2  # type: ignore[attr-defined]
    assert broken.max_rel_error > 1e-2  # type: ignore[attr-defined]


def test_gather_only_rounds_return_each_part_as_its_owners_values() -> None:
    async def main() -> list[torch.Tensor]:
        from p2ptrain.allreduce.group import GroupMember, GroupPlan

        net = SimNetwork()
        link = LinkProfile.mbit(100, 100, 20)
        nodes = []
        for i in range(3):
            node = Node(
                config=NodeConfig(host=f"10.0.3.{i}"), network=net.add_host(f"10.0.3.{i}", link)
            )
            await node.start()
            nodes.append(node)
        services = [AllReduceService(node) for node in nodes]
        plan = GroupPlan.from_shares(
            [GroupMember(n.peer_id, n.address) for n in nodes], [0.5, 0.0, 0.5], 10
        )
        vectors = [torch.full((10,), float(i + 1)) for i in range(3)]
        results = await asyncio.gather(
            *(
                s.allreduce(plan, v, 5.0, gather_only=True)
                for s, v in zip(services, vectors, strict=True)
            )
        )
        for node in nodes:
            await node.aclose()
        return [out for out, _ in results]

    expected = torch.tensor([1.0] * 5 + [3.0] * 5)
    for out in run_virtual(main()):
        assert torch.equal(out, expected)


def test_a_simulated_round_is_timed_and_measured_on_the_virtual_clock() -> None:
    """The round's report and its stream timings read the virtual clock: a round
    that moves megabytes over 8 Mbit/s links lasts virtual seconds, while the
    simulation takes a fraction of that in wall time (perf_counter would say)."""

    async def main() -> tuple[float, list[object]]:
        from p2ptrain.allreduce.group import GroupMember, GroupPlan

        loop = asyncio.get_running_loop()
        net = SimNetwork()
        link = LinkProfile.mbit(80, 8, 20)  # 1 MB/s up
        nodes = []
        for i in range(2):
            host = f"10.0.4.{i}"
            node = Node(config=NodeConfig(host=host), network=net.add_host(host, link))
            await node.start()
            nodes.append(node)
        services = [AllReduceService(node) for node in nodes]
        plan = GroupPlan.from_shares(
            [GroupMember(n.peer_id, n.address) for n in nodes], [0.5, 0.5], 1_000_000
        )
        started = loop.time()
        results = await asyncio.gather(
            *(s.allreduce(plan, torch.ones(1_000_000), 1.0) for s in services)
        )
        elapsed = loop.time() - started
        for node in nodes:
            await node.aclose()
        return elapsed, [report for _, report in results]

    wall = time.perf_counter()
    elapsed, reports = run_virtual(main())
    wall = time.perf_counter() - wall
    # Each member sends half of 4 MB (its part) and half back (the average): 4 s at 1 MB/s.
    assert elapsed > 3.5 > wall
    for report in reports:
        assert report.total_s == pytest.approx(elapsed, rel=0.05)  # type: ignore[attr-defined]
        # Time during which bytes were arriving: virtual seconds too.
        assert 1.0 < report.receive_s <= elapsed  # type: ignore[attr-defined]


def test_simulation_config_rejects_bad_values() -> None:
    with pytest.raises(P2PTrainError):
        SimulationConfig(peers=0)
    with pytest.raises(P2PTrainError):
        SimulationConfig(churn=1.0)
    with pytest.raises(P2PTrainError):
        LinkProfile(0.0, 1.0)


def test_a_group_part_smaller_than_min_part_share_stays_out_of_the_columns() -> None:
    """With min_part_share 1, every group smaller than its expected 8 members
    is taken for a split-off part: its members' results say so, and everybody
    else's result is the exact average of the other groups."""

    async def main() -> object:
        grouping = GroupingConfig(
            group_size=8, group_window=2.0, column_window=6.0, min_part_share=1.0
        )
        config = dataclasses.replace(_small(24, seed=1), grouping=grouping)
        async with Simulation(config) as sim:
            return await sim.step()

    result = run_virtual(main())
    assert 0 < result.incomplete < result.live  # type: ignore[attr-defined]
    failures = result.failures  # type: ignore[attr-defined]
    assert failures and all("split off its group" in f for f in failures), failures
    assert result.max_rel_error < 1e-6  # type: ignore[attr-defined]
    assert 0.5 < result.counted_fraction < 1.0  # type: ignore[attr-defined]


@pytest.mark.slow
def test_members_killed_mid_round_leave_exact_results_or_honest_failures() -> None:
    # 24 peers in 3 groups of 8; 2 die 1.5-3.5 virtual seconds into the step,
    # while their groups all-reduce, matchmake their columns or gather.
    async def main() -> object:
        config = _small(24, churn=0.1, seed=3)
        config = dataclasses.replace(
            config,
            kill_window=(1.5, 3.5),
            grouping=GroupingConfig(group_size=8, group_window=1.0, column_window=6.0),
        )
        async with Simulation(config) as sim:
            return await sim.step()

    result = run_virtual(main())
    assert result.killed == 2  # type: ignore[attr-defined]
    # Nobody waits for the dead until a deadline (reduce_timeout is 30 s).
    assert result.step_s < 15.0  # type: ignore[attr-defined]
    # Every result that says it is complete is the exact weighted average of
    # the contributions it holds by the peers' own accounts.
    assert result.incomplete < result.live  # type: ignore[attr-defined]
    assert result.max_rel_error < 1e-6, result.failures  # type: ignore[attr-defined]
    assert result.counted_fraction >= 0.6  # type: ignore[attr-defined]


def _told(me: object, groups: int, represented: tuple[object, ...], groups_in: tuple[int, ...]):  # type: ignore[no-untyped-def]
    """The parts of a GroupedResult that the simulator's reference reads."""
    from types import SimpleNamespace

    return SimpleNamespace(
        groups=groups,
        group_weight=1.0,
        group=SimpleNamespace(members=[SimpleNamespace(peer_id=me)]),
        reports=[SimpleNamespace(index=0)],
        represented=represented,
        groups_in=groups_in,
        group_counted=represented,
    )


def test_a_group_split_by_matchmaking_is_measured_against_both_parts() -> None:
    """Two plans under one group key (a split) each tell their own members; a
    result holding that group holds both parts (both cover every slice), so
    the reference is their union, and unknown when the accounts overlap."""
    from p2ptrain.allreduce.grouped import group_index
    from p2ptrain.secure.identity import Identity

    ids = [Identity.generate().peer_id for _ in range(64)]
    zero = [i for i in ids if group_index(i, 2) == 0][:4]
    one = [i for i in ids if group_index(i, 2) == 1][:1]
    part_a, part_b = (zero[0], zero[1]), (zero[2], zero[3])
    results = [
        _told(zero[0], 2, part_a, (0, 1)),
        _told(zero[2], 2, part_b, (0, 1)),
        _told(one[0], 2, (one[0],), (0, 1)),
    ]
    outcomes = {r.group.members[0].peer_id: (torch.zeros(1), r) for r in results}
    reference = Simulation._reference(outcomes)  # type: ignore[arg-type]
    assert reference(results[0]) == frozenset({*part_a, *part_b, one[0]})  # type: ignore[arg-type]
    # Two accounts that name one member disagree: unknown.
    results[1] = _told(zero[2], 2, (zero[1], zero[2]), (0, 1))
    outcomes = {r.group.members[0].peer_id: (torch.zeros(1), r) for r in results}
    assert Simulation._reference(outcomes)(results[0]) is None  # type: ignore[arg-type]
