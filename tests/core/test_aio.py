"""The background loop thread that synchronous training code calls into."""

from __future__ import annotations

import asyncio
import gc
import inspect
import threading

import pytest

from p2ptrain.aio import BackgroundTasks, LoopThread, has_uvloop, run
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


# -- BackgroundTasks: the one owner of background tasks -------------------------------------


async def test_a_spawned_task_that_fails_is_logged_and_forgotten(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tasks = BackgroundTasks("tester")

    async def fails() -> None:
        raise ValueError("boom")

    task = tasks.spawn(fails(), name="failing")
    await asyncio.wait([task], timeout=5)
    assert len(tasks) == 0
    assert "tester: background task 'failing' failed" in caplog.text
    assert "boom" in caplog.text


async def test_a_shared_task_hands_its_outcome_to_its_callers() -> None:
    tasks = BackgroundTasks("tester")
    loop = asyncio.get_running_loop()
    gone: list[str] = []
    loop.set_exception_handler(lambda _loop, context: gone.append(context["message"]))

    async def value() -> int:
        return 7

    async def fails() -> int:
        raise ValueError("dial failed")

    assert await tasks.share(value(), name="value") == 7
    with pytest.raises(ValueError, match="dial failed"):
        await tasks.share(fails(), name="awaited")
    unawaited = tasks.share(fails(), name="nobody waits")
    await asyncio.wait([unawaited], timeout=5)
    del unawaited

    gc.collect()
    assert gone == []  # retrieved: no "Task exception was never retrieved"
    assert len(tasks) == 0


async def test_aclose_cancels_and_awaits_everything_and_refuses_new_tasks() -> None:
    tasks = BackgroundTasks("tester")
    started, cleaned = asyncio.Event(), asyncio.Event()

    async def forever() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.set()

    never = forever()
    tasks.spawn(forever(), name="forever")
    await asyncio.wait_for(started.wait(), 5)
    await asyncio.wait_for(tasks.aclose(), 5)
    assert cleaned.is_set() and len(tasks) == 0 and tasks.closed
    with pytest.raises(RuntimeError, match="after closing"):
        tasks.spawn(never, name="late")
    assert inspect.getcoroutinestate(never) == "CORO_CLOSED"  # no "never awaited" warning


async def test_a_task_closing_its_own_owner_is_not_cancelled() -> None:
    tasks = BackgroundTasks("tester")
    other_cancelled = asyncio.Event()

    async def other() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            other_cancelled.set()
            raise

    async def closer() -> None:
        await asyncio.sleep(0)
        tasks.cancel()  # from a callback-like place: cancels the others only
        await asyncio.sleep(0)
        await tasks.aclose()  # awaits the others, not itself

    tasks.spawn(other(), name="other")
    task = tasks.spawn(closer(), name="closer")
    await asyncio.wait_for(task, 5)
    assert not task.cancelled() and other_cancelled.is_set()
