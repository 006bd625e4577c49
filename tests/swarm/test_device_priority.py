"""A stage's device serves backwards before forwards, first come first served within each."""

from __future__ import annotations

import asyncio
import threading

from p2ptrain.swarm.device import BACKWARD, FORWARD, PriorityGate, ThreadDevice


async def test_the_gate_lets_backwards_in_before_forwards_in_arrival_order() -> None:
    gate = PriorityGate()
    await gate.acquire(FORWARD)  # the call running now
    order: list[str] = []

    async def call(name: str, priority: int) -> None:
        await gate.acquire(priority)
        order.append(name)
        await asyncio.sleep(0)
        gate.release()

    tasks = []
    for name, priority in [("f1", FORWARD), ("b1", BACKWARD), ("f2", FORWARD), ("b2", BACKWARD)]:
        tasks.append(asyncio.ensure_future(call(name, priority)))
        await asyncio.sleep(0)  # each is waiting before the next arrives
    gate.release()
    await asyncio.gather(*tasks)
    assert order == ["b1", "b2", "f1", "f2"]


async def test_a_cancelled_waiter_never_holds_the_gate() -> None:
    gate = PriorityGate()
    await gate.acquire(FORWARD)
    waiting = asyncio.ensure_future(gate.acquire(BACKWARD))
    later = asyncio.ensure_future(gate.acquire(FORWARD))
    await asyncio.sleep(0)
    waiting.cancel()  # gives up while waiting
    gate.release()
    await asyncio.wait_for(later, 1)  # the turn went past the cancelled one
    granted = asyncio.ensure_future(gate.acquire(BACKWARD))
    after = asyncio.ensure_future(gate.acquire(FORWARD))
    await asyncio.sleep(0)
    gate.release()  # granted's turn ...
    granted.cancel()  # ... but it is cancelled before it runs: the turn passes on
    await asyncio.wait_for(after, 1)
    gate.release()
    await asyncio.wait_for(gate.drain(), 1)  # open again


async def test_a_busy_thread_device_runs_the_waiting_backward_first() -> None:
    device = ThreadDevice()
    started = threading.Event()
    go = threading.Event()
    ran: list[str] = []

    def blocking() -> str:
        started.set()
        go.wait(5)
        return "first"

    def job(name: str) -> str:
        ran.append(name)
        return name

    try:
        first = asyncio.ensure_future(device.run(blocking, lambda r: r))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 5)
        forward = asyncio.ensure_future(device.run(lambda: job("forward"), lambda r: r))
        await asyncio.sleep(0.01)
        backward = asyncio.ensure_future(
            device.run(lambda: job("backward"), lambda r: r, priority=BACKWARD)
        )
        await asyncio.sleep(0.01)
        go.set()
        results = await asyncio.gather(first, forward, backward)
        assert [name for name, _seconds in results] == ["first", "forward", "backward"]
        assert ran == ["backward", "forward"]  # the later backward ran first
        await device.idle()
    finally:
        go.set()
        device.shutdown()
