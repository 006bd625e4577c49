"""The RPC layer's flow-control state alone: no loop, no sockets (see p2ptrain/rpc/flow.py)."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.errors import FlowControlError, RemoteProtocolError
from p2ptrain.rpc.budget import ByteBudget
from p2ptrain.rpc.flow import StreamFlow, UnreadBytes

WINDOW = 1000
FRAME = 300


def make_flow(window: int = WINDOW, frame: int = FRAME) -> StreamFlow:
    return StreamFlow(
        send_window=window, send_frame_bytes=frame, recv_window=window, recv_frame_bytes=frame
    )


# -- sending ---------------------------------------------------------------------------


def test_a_sender_may_overdraw_its_credit_by_one_frame_then_waits() -> None:
    flow = make_flow()
    flow.sent(900)
    assert flow.can_send and flow.credit == 100
    flow.sent(FRAME)  # the credit was positive: this frame may overdraw it
    assert flow.credit == -200 and not flow.can_send
    flow.window_received(200)
    assert flow.credit == 0 and not flow.can_send
    flow.window_received(1)
    assert flow.can_send


@pytest.mark.parametrize("amount", [0, -5, 1.5, "10", None, True])
def test_a_window_frame_needs_a_positive_integer(amount: object) -> None:
    flow = make_flow()
    flow.sent(500)
    with pytest.raises(RemoteProtocolError, match="positive integer"):
        flow.window_received(amount)
    assert flow.credit == WINDOW - 500


def test_credit_for_bytes_never_sent_is_a_protocol_error() -> None:
    flow = make_flow()
    flow.sent(100)
    flow.window_received(100 + FRAME)  # a frame's credit may come back before it is charged
    with pytest.raises(RemoteProtocolError, match="more than was sent"):
        flow.window_received(1)
    assert flow.credit == WINDOW + FRAME


# -- receiving -------------------------------------------------------------------------


def test_an_overrun_of_the_window_is_a_flow_control_error_and_counts_nothing() -> None:
    flow = make_flow()
    flow.received(WINDOW)
    flow.received(FRAME)  # exactly window + one frame
    with pytest.raises(FlowControlError, match="overran the stream window"):
        flow.received(1)
    assert flow.outstanding == WINDOW + FRAME == flow.receive_limit


def test_credit_goes_back_in_quarter_windows_and_not_after_the_remote_ended() -> None:
    flow = make_flow()
    for _ in range(4):
        flow.received(100)
    assert flow.consumed(100, more_expected=True) == 0
    assert flow.consumed(100, more_expected=True) == 0
    assert flow.consumed(100, more_expected=True) == 300  # 300 >= 1000 // 4
    assert flow.outstanding == 100
    assert flow.consumed(100, more_expected=False) == 0  # the remote ended: no credit
    assert flow.outstanding == 100


def test_only_received_bytes_can_be_consumed() -> None:
    flow = make_flow()
    flow.received(10)
    with pytest.raises(ValueError):
        flow.consumed(11, more_expected=True)


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        make_flow(window=0)
    with pytest.raises(ValueError):
        make_flow().sent(-1)
    with pytest.raises(ValueError):
        make_flow().received(-1)


# -- both ends, driven by hypothesis ----------------------------------------------------

# An operation of the simulated pair: send a frame of this size, deliver the
# oldest frame in flight, read the oldest unread message, or deliver a WINDOW.
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("send"), st.integers(1, FRAME)),
        st.tuples(st.just("deliver"), st.just(0)),
        st.tuples(st.just("read"), st.just(0)),
        st.tuples(st.just("credit"), st.just(0)),
    ),
    max_size=200,
)


@settings(max_examples=300, deadline=None)
@given(ops=_ops, window=st.integers(1, 3 * FRAME))
def test_an_honest_pair_never_overruns_and_credit_stays_bounded(
    ops: list[tuple[str, int]], window: int
) -> None:
    sender, receiver = make_flow(window), make_flow(window)
    wire: deque[int] = deque()  # frames in flight
    unread: deque[int] = deque()  # received, not read
    windows: deque[int] = deque()  # WINDOW frames in flight back
    for op, size in ops:
        if op == "send" and sender.can_send:
            sender.sent(size)
            wire.append(size)
        elif op == "deliver" and wire:
            frame = wire.popleft()
            receiver.received(frame)  # never raises for a sender that honours its credit
            unread.append(frame)
        elif op == "read" and unread:
            amount = receiver.consumed(unread.popleft(), more_expected=True)
            assert amount >= 0
            if amount:
                windows.append(amount)
        elif op == "credit" and windows:
            sender.window_received(windows.popleft())  # never more than was sent
        # The invariants, after every step.
        assert 0 <= receiver.outstanding <= receiver.receive_limit
        assert sender.credit > -FRAME
        assert sender.credit <= window
        # Conservation: what the sender is charged for is on the wire, unread, or
        # read and not credited back (outstanding counts the last two) or on its way back.
        assert window - sender.credit == sum(wire) + receiver.outstanding + sum(windows)


@settings(max_examples=200, deadline=None)
@given(ops=_ops, window=st.integers(1, 3 * FRAME))
def test_a_reader_that_reads_everything_always_unblocks_the_sender(
    ops: list[tuple[str, int]], window: int
) -> None:
    sender, receiver = make_flow(window), make_flow(window)
    for op, size in ops:
        if op == "send" and sender.can_send:
            sender.sent(size)
            receiver.received(size)
            amount = receiver.consumed(size, more_expected=True)
            if amount:
                sender.window_received(amount)
    # Everything sent was read: at most a batch (a quarter window) is held back.
    assert sender.credit > window - max(1, window // 4)
    assert sender.can_send


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, FRAME), max_size=50), window=st.integers(1, 3 * FRAME))
def test_a_peer_that_ignores_its_credit_gets_a_typed_error_exactly_past_the_limit(
    sizes: list[int], window: int
) -> None:
    receiver = make_flow(window)
    total = 0
    for size in sizes:
        if total + size > receiver.receive_limit:
            with pytest.raises(FlowControlError):
                receiver.received(size)
            assert receiver.outstanding == total  # the refused frame counted nothing
        else:
            receiver.received(size)
            total += size
        assert receiver.outstanding <= receiver.receive_limit


# -- the connection's unread bytes -------------------------------------------------------


def test_unread_bytes_past_the_reserve_are_charged_to_the_node_pool() -> None:
    pool = ByteBudget(1000)
    a = UnreadBytes(limit=800, reserve=100, pool=pool)
    b = UnreadBytes(limit=800, reserve=100, pool=pool)
    a.charge(100)
    assert pool.used == 0  # within the reserve
    a.charge(700)
    assert (a.used, pool.used) == (800, 700)
    with pytest.raises(FlowControlError, match="of this connection are unread"):
        a.charge(1)
    b.charge(100)  # b's reserve is outside the pool
    b.charge(300)
    assert pool.used == 1000
    assert not b.fits(1)
    assert "node limit 1000" in b.refusal(1)
    with pytest.raises(FlowControlError, match="node's connections"):
        b.charge(1)
    a.release(800)
    assert (a.used, pool.used) == (0, 300)
    with pytest.raises(ValueError):
        a.release(1)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 3), st.integers(0, 400)), max_size=80))
def test_the_node_pool_is_the_sum_of_what_each_connection_holds_past_its_reserve(
    ops: list[tuple[bool, int, int]],
) -> None:
    pool = ByteBudget(1500)
    conns = [UnreadBytes(limit=700, reserve=150, pool=pool) for _ in range(4)]
    for charge, index, size in ops:
        conn = conns[index]
        if charge:
            fits = conn.fits(size)
            if fits:
                conn.charge(size)
            else:
                with pytest.raises(FlowControlError):
                    conn.charge(size)
        else:
            conn.release(min(size, conn.used))
        assert all(0 <= c.used <= 700 for c in conns)
        assert pool.used == sum(max(0, c.used - 150) for c in conns) <= pool.limit
