"""Shared fixtures: nodes on loopback that are always closed."""

from __future__ import annotations

import asyncio
import collections
import queue
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from p2ptrain.lab.echo import echo
from p2ptrain.node.config import NodeConfig
from p2ptrain.node.node import Node
from p2ptrain.rpc.config import ConnectionConfig
from p2ptrain.rpc.handlers import CallContext
from p2ptrain.rpc.stream import RPCStream
from p2ptrain.secure.handshake import AdmissionPolicy, HandshakeResult, perform_handshake
from p2ptrain.secure.identity import Identity, PeerID
from p2ptrain.testing.memory import memory_transport_pair
from p2ptrain.testing.natlab_plugin import pytest_terminal_summary
from p2ptrain.transport.base import FrameTransport
from p2ptrain.wire.frames import Frame

# Property tests run beside process-heavy tests on 2 cores: a per-example time
# limit (hypothesis' default 200 ms) failed them for the machine's load, not
# for what they check.
settings.register_profile("p2ptrain", deadline=None)
settings.load_profile("p2ptrain")

__all__ = ["pytest_terminal_summary"]  # the NAT-lab skip line ends every run

NodeFactory = Callable[..., Coroutine[Any, Any, Node]]


@pytest.fixture
async def make_node() -> AsyncIterator[NodeFactory]:
    """Start nodes on 127.0.0.1 (port 0); all are closed when the test ends."""
    started: list[Node] = []

    async def factory(**kwargs: Any) -> Node:
        config = kwargs.pop("config", None) or NodeConfig(**kwargs.pop("config_kwargs", {}))
        node = Node(config=config, **kwargs)
        await node.start()
        started.append(node)
        return node

    yield factory
    for node in reversed(started):
        await node.aclose()


async def stall_server(make_node: NodeFactory, limits: ConnectionConfig) -> Node:
    """A node serving ``echo`` and ``stall`` (a stream handler that never returns)."""
    server = await make_node(config=NodeConfig(connection=limits))
    server.handlers.add_unary("echo", echo)
    never = asyncio.Event()

    async def stall(ctx: CallContext, stream: RPCStream) -> None:
        await never.wait()

    server.handlers.add_stream("stall", stall)
    return server


async def shake(
    transport: FrameTransport,
    identity: Identity,
    *,
    initiator: bool,
    swarm: str = "s",
    policy: AdmissionPolicy | None = None,
    stream_window: int = 1 << 20,
    expected_peer: PeerID | None = None,
    timeout: float = 5,
    insecure_plaintext: bool = False,
) -> HandshakeResult:
    """perform_handshake with the defaults the tests share (1 MiB frames)."""
    return await perform_handshake(
        transport,
        identity,
        initiator=initiator,
        swarm=swarm,
        stream_window=stream_window,
        max_frame_bytes=1 << 20,
        policy=policy or AdmissionPolicy(),
        expected_peer=expected_peer,
        timeout=timeout,
        insecure_plaintext=insecure_plaintext,
    )


async def recorded_handshake(
    initiator: Identity, responder: Identity, *, swarm: str
) -> tuple[HandshakeResult, list[Frame]]:
    """A completed in-memory handshake and the frames the responder received."""
    a, b = memory_transport_pair()
    recorded: list[Frame] = []
    deliver = b._deliver

    def record(frame: Frame) -> None:
        recorded.append(frame)
        deliver(frame)

    b._deliver = record  # type: ignore[method-assign]
    _, result = await asyncio.gather(
        shake(a, initiator, initiator=True, swarm=swarm),
        shake(b, responder, initiator=False, swarm=swarm),
    )
    return result, recorded


async def while_serving_healthy(
    request: Callable[[int], Awaitable[None]],
    attack: Callable[[], Awaitable[None]],
    *,
    at_least: int = 3,
) -> int:
    """Run ``attack`` while a healthy peer makes ``request(0)``, ``request(1)``, ...

    Every request must succeed (``request`` checks its answer) throughout
    the attack, and at least ``at_least`` of them; the number made.
    """
    done = asyncio.Event()
    served = 0

    async def healthy() -> None:
        nonlocal served
        while not done.is_set() or served < at_least:
            await request(served)
            served += 1

    task = asyncio.create_task(healthy())
    try:
        await attack()
    finally:
        done.set()
    await asyncio.wait_for(task, 10)
    return served


class ChildLines:
    """A child process whose stdout lines arrive in a queue, read with a deadline.

    Its stderr is drained as it comes (a full pipe would block the child's
    logging); the tail is shown when the child exits before a line comes.
    """

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr: collections.deque[str] = collections.deque(maxlen=200)
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        self.stderr.extend(self.process.stderr)

    def next_line(self, deadline: float) -> str:
        """The next stdout line; fails at ``deadline`` (monotonic) or when the child exits."""
        line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        if line is None:
            self.process.wait(5)
            raise AssertionError(f"process exited: {''.join(self.stderr)[-2000:]}")
        return line

    def stop(self) -> None:
        """Terminate the child (kill it if it does not exit within 15 s)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def stop_all(children: Iterable[ChildLines | None]) -> None:
    """Stop every child at once: terminate them all, then wait (kill after 15 s).

    Stopped one by one, eight training peers take their clean shutdowns in
    turn (about 20 s of a test's teardown); together, the slowest one's.
    """
    running = [c for c in children if c is not None and c.process.poll() is None]
    for child in running:
        child.process.terminate()
    deadline = time.monotonic() + 15
    for child in running:
        try:
            child.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait()


@pytest.fixture
def procs() -> Iterator[list[ChildLines]]:
    """Child processes a test starts; all are stopped when it ends."""
    started: list[ChildLines] = []
    yield started
    stop_all(started)


def started_bootstrap(procs: list[ChildLines], deadline: float) -> str:
    """``p2ptrain bootstrap --port 0``, stopped with ``procs``; the address to join."""
    boot = cli_process("bootstrap", "--port", "0")
    procs.append(boot)
    return join_address(boot, deadline)


def join_address(boot: ChildLines, deadline: float) -> str:
    """The address a starting ``p2ptrain bootstrap`` tells peers to join (after "ready")."""
    assert "ready" in boot.next_line(deadline)
    return boot.next_line(deadline).split("--join", 1)[1].strip()


def cli_process(*args: str) -> ChildLines:
    """``python -m p2ptrain.app.cli ARGS`` as a :class:`ChildLines`."""
    process = subprocess.Popen(
        [sys.executable, "-m", "p2ptrain.app.cli", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return ChildLines(process)


def run_module(
    module: str, *args: str, timeout: float = 60, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m MODULE ARGS`` run to its end in a process of its own; its output."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        check=False,
    )


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The command line run to its end in a process of its own (as a user runs it)."""
    return run_module("p2ptrain.app.cli", *args, timeout=timeout)
