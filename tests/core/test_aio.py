"""The background loop thread that synchronous training code calls into."""

from __future__ import annotations

import asyncio
import threading

import pytest

from p2ptrain.aio import LoopThread, has_uvloop, run
from p2ptrain.node.node import Node
from p2ptrain.rpc.handlers import CallContext, Message


@pytest.mark.parametrize(
    "use_uvloop",
    [
        False,
        pytest.param(
            True, marks=pytest.mark.skipif(not has_uvloop(), reason="uvloop not installed")
        ),
    ],
)
def test_sync_code_drives_nodes_on_the_loop_thread(use_uvloop: bool) -> None:
    async def echo(ctx: CallContext, request: Message) -> Message:
        assert threading.current_thread().name == "p2ptrain-loop"
        return Message(request.body * 2)

    with LoopThread(use_uvloop=use_uvloop) as loop_thread:
        server, client = Node(), Node()
        server.handlers.add_unary("echo", echo)
        loop_thread.run(server.start())
        loop_thread.run(client.start())
        assert loop_thread.run(client.call(server.address, "echo", 21), timeout=10).body == 42
        loop_thread.run(client.aclose())
        loop_thread.run(server.aclose())


def test_errors_and_timeouts_cross_the_thread() -> None:
    async def fails() -> None:
        raise ValueError("from the loop")

    cancelled = threading.Event()

    async def hangs() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    with LoopThread() as loop_thread:
        with pytest.raises(ValueError, match="from the loop"):
            loop_thread.run(fails())
        with pytest.raises(TimeoutError):
            loop_thread.run(hangs(), timeout=0.1)
        assert cancelled.wait(5)


def test_stop_cancels_what_still_runs() -> None:
    finished = threading.Event()

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            finished.set()

    loop_thread = LoopThread()
    loop_thread.start()
    loop_thread.submit(forever())
    loop_thread.stop()
    assert finished.is_set()


def test_run_helper_returns_the_result() -> None:
    async def answer() -> int:
        return 42

    assert run(answer()) == 42
    assert run(answer(), use_uvloop=False) == 42
