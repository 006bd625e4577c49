"""Training state: the tensor-tree codec, checkpoints, and the train.state stream."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import NodeFactory
from hypothesis import given
from hypothesis import strategies as st
from train_worker import backward, make_model

from p2ptrain.errors import CheckpointError, ConfigError, RemoteProtocolError, StateSyncError
from p2ptrain.peer import Peer
from p2ptrain.rpc.handlers import CallContext
from p2ptrain.rpc.stream import RPCStream
from p2ptrain.train.config import DiLoCoConfig, TrainerConfig
from p2ptrain.train.diloco import DiLoCoOptimizer
from p2ptrain.train.optimizer import CollaborativeOptimizer
from p2ptrain.train.state import (
    TrainingSnapshot,
    flatten_state,
    load_checkpoint,
    save_checkpoint,
    unflatten_state,
)
from p2ptrain.train.state_sync import (
    STATE_METHOD,
    StateServer,
    StateSyncConfig,
    download_state,
)
from p2ptrain.wire.frames import pack_body
from p2ptrain.wire.tensors import encode_tensor


def adam_state() -> dict[str, Any]:
    model = make_model(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.8, 0.9))
    backward(model, torch.ones(4, 8), torch.zeros(4, 1))
    opt.step()
    return {"kind": "test", "params": list(model.parameters()), "optimizer": opt.state_dict()}


def assert_same_tree(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same_tree(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_tree(x, y)
    else:
        assert a == b


# -- the tree codec ------------------------------------------------------------------------


def test_an_optimizer_state_survives_the_codec() -> None:
    state = adam_state()
    skeleton, tensors = flatten_state(state)
    # The skeleton is plain msgpack (optimizer states have int keys and tuples).
    pack_body(skeleton)
    rebuilt = unflatten_state(skeleton, [t.detach().clone() for t in tensors])
    assert_same_tree(state["optimizer"], rebuilt["optimizer"])
    assert isinstance(rebuilt["optimizer"]["param_groups"][0]["betas"], tuple)


leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.integers(0, 5).map(lambda n: torch.arange(n, dtype=torch.float32)),
)
keys = st.one_of(st.integers(-5, 5), st.text(max_size=4), st.booleans(), st.none())
trees = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(keys, children, max_size=4),
    ),
    max_leaves=20,
)


@given(trees)
def test_any_tree_round_trips(tree: Any) -> None:
    skeleton, tensors = flatten_state(tree)
    assert_same_tree(unflatten_state(skeleton, tensors), tree)


def nested(depth: int) -> list[Any]:
    skeleton: list[Any] = ["v", None]
    for _ in range(depth):
        skeleton = ["l", [skeleton]]
    return skeleton


@pytest.mark.parametrize(
    ("skeleton", "count"),
    [
        (None, 0),
        (["t", 0], 0),  # no such tensor
        (["l", [["t", 0], ["t", 0]]], 1),  # used twice
        (["l", []], 1),  # left unused
        (["t", True], 1),
        (["x", 1], 0),
        (["v", [1]], 0),
        (["v", 2**64], 0),
        (["d", [[1, ["v", 1]], [1, ["v", 2]]]], 0),  # duplicate key
        (["d", [[[1], ["v", 1]]]], 0),  # a list as a key
        (["d", {"a": 1}], 0),
        (["l", ["v", 1]], 0),
        (nested(100), 0),
    ],
)
def test_malformed_skeletons_are_refused(skeleton: Any, count: int) -> None:
    tensors = [torch.zeros(1) for _ in range(count)]
    with pytest.raises(RemoteProtocolError):
        unflatten_state(skeleton, tensors)


def test_unsupported_leaves_cannot_be_flattened() -> None:
    with pytest.raises(ConfigError):
        flatten_state({"x": object()})
    with pytest.raises(ConfigError):
        flatten_state({(1, 2): 3})


# -- checkpoints ---------------------------------------------------------------------------


def test_checkpoints_round_trip_and_replace_atomically(tmp_path: Path) -> None:
    path = tmp_path / "run" / "ckpt.pt"
    state = adam_state()
    save_checkpoint(path, TrainingSnapshot(3, state))
    save_checkpoint(path, TrainingSnapshot(4, state))
    loaded = load_checkpoint(path)
    assert loaded.step == 4
    assert_same_tree(loaded.state["optimizer"], state["optimizer"])
    assert [p.name for p in path.parent.iterdir()] == ["ckpt.pt"]  # no temporary left


def test_bad_checkpoints_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError):
        load_checkpoint(tmp_path / "missing.pt")
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError):
        load_checkpoint(junk)
    other = tmp_path / "other.pt"
    torch.save({"format": "something else"}, other)
    with pytest.raises(CheckpointError):
        load_checkpoint(other)


def test_a_trainer_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    peer = Peer()  # not started: checkpoints are local
    config = TrainerConfig(run_id="ckpt", target_batch_size=8)
    model = make_model(0)
    opt = CollaborativeOptimizer(torch.optim.Adam(model.parameters()), peer=peer, config=config)
    backward(model, torch.ones(2, 8), torch.zeros(2, 1))
    opt.optimizer.step()
    opt.save_checkpoint(tmp_path / "c.pt")

    fresh_model = make_model(seed=5)
    fresh = CollaborativeOptimizer(
        torch.optim.Adam(fresh_model.parameters()), peer=peer, config=config
    )
    fresh.load_checkpoint(tmp_path / "c.pt")
    for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert_same_tree(opt.optimizer.state_dict(), fresh.optimizer.state_dict())

    diloco = DiLoCoOptimizer(
        torch.optim.AdamW(make_model(0).parameters()),
        peer=peer,
        config=DiLoCoConfig(run_id="ckpt"),
    )
    with pytest.raises(CheckpointError, match="not a diloco"):
        diloco.load_checkpoint(tmp_path / "c.pt")
    other_shape = CollaborativeOptimizer(
        torch.optim.Adam(torch.nn.Linear(3, 1).parameters()), peer=peer, config=config
    )
    with pytest.raises(CheckpointError, match="parameter"):
        other_shape.load_checkpoint(tmp_path / "c.pt")


# -- the train.state stream ----------------------------------------------------------------


async def test_a_state_downloads_intact(make_node: NodeFactory) -> None:
    server_node, client_node = await make_node(), await make_node()
    state = adam_state()
    snapshot = TrainingSnapshot(7, state)
    server = StateServer(server_node, lambda: snapshot, config=StateSyncConfig(chunk_bytes=1024))
    try:
        got = await download_state(client_node, server_node.address)
    finally:
        server.close()
    assert got.step == 7
    assert_same_tree(got.state["optimizer"], state["optimizer"])
    for a, b in zip(got.state["params"], state["params"], strict=True):
        assert torch.equal(a, b.detach())


async def test_a_busy_server_refuses_more_downloads(make_node: NodeFactory) -> None:
    server_node, client_node = await make_node(), await make_node()
    entered, release = threading.Event(), threading.Event()

    def slow_provider() -> TrainingSnapshot:
        entered.set()
        release.wait(timeout=30)
        return TrainingSnapshot(1, {"w": torch.ones(3)})

    server = StateServer(server_node, slow_provider, config=StateSyncConfig(max_concurrent=1))
    try:
        first = asyncio.create_task(download_state(client_node, server_node.address))
        assert await asyncio.to_thread(entered.wait, 10)  # it holds the only slot
        with pytest.raises(StateSyncError, match="resource_exhausted"):
            await download_state(client_node, server_node.address)
        release.set()
        assert (await first).step == 1
    finally:
        release.set()
        server.close()


def fake_server(*, digest: bytes | None = None, order: list[tuple[int, int]] | None = None) -> Any:
    """A train.state handler that breaks the protocol as told."""
    tensor = torch.arange(16, dtype=torch.float32)
    header, payload = encode_tensor(tensor)
    skeleton = ["l", [["t", 0]]]

    async def handler(ctx: CallContext, stream: RPCStream) -> None:
        await stream.recv()
        await stream.send({"v": 1, "step": 1, "skeleton": skeleton, "tensors": [header]})
        good = hashlib.sha256(pack_body([1, skeleton, [header]]))
        for index, offset in order or [(0, 0), (0, 32)]:
            part = payload[offset : offset + 32]
            good.update(part)
            await stream.send({"i": index, "o": offset}, part)
        await stream.send({"sha256": digest or good.digest()}, end=True)

    return handler


@pytest.mark.parametrize(
    ("server", "message"),
    [
        (fake_server(), None),
        (fake_server(digest=b"\0" * 32), "digest"),
        (fake_server(order=[(0, 32), (0, 0)]), "chunk"),
        (fake_server(order=[(1, 0)]), "chunk"),
    ],
)
async def test_a_broken_server_is_detected(
    make_node: NodeFactory, server: Any, message: str | None
) -> None:
    server_node, client_node = await make_node(), await make_node()
    server_node.handlers.add_stream(STATE_METHOD, server)
    if message is None:
        got = await download_state(client_node, server_node.address)
        assert torch.equal(got.state[0], torch.arange(16, dtype=torch.float32))
        return
    with pytest.raises(StateSyncError, match=message):
        await download_state(client_node, server_node.address)


async def test_an_oversized_state_is_refused_before_download(make_node: NodeFactory) -> None:
    server_node, client_node = await make_node(), await make_node()
    server = StateServer(server_node, lambda: TrainingSnapshot(1, [torch.zeros(1000)]))
    try:
        with pytest.raises(StateSyncError, match="more than"):
            await download_state(
                client_node, server_node.address, config=StateSyncConfig(max_bytes=1000)
            )
    finally:
        server.close()


async def test_an_unreachable_peer_is_a_sync_error(make_node: NodeFactory) -> None:
    node = await make_node()
    with pytest.raises(StateSyncError):
        await download_state(node, "127.0.0.1:1", config=StateSyncConfig(timeout=5.0))
