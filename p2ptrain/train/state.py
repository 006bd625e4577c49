"""Training state as data: snapshots, a tensor-tree codec, and checkpoints on disk.

A :class:`TrainingSnapshot` is a global step plus a *state tree*: nested
dicts, lists and tuples whose leaves are tensors or plain values (``None``,
bool, int, float, str, bytes), such as ``{"params": [...], "optimizer":
optimizer.state_dict()}``. Two forms exist:

* for the network, :func:`flatten_state` splits a tree into a msgpack-able
  *skeleton* and the list of its tensors, which travel as raw bytes (see
  :mod:`p2ptrain.train.state_sync`); :func:`unflatten_state`
  rebuilds the tree and treats the skeleton as untrusted input;
* for the disk, :func:`save_checkpoint` writes the snapshot with
  ``torch.save`` atomically (a temporary file, fsync, rename) and
  :func:`load_checkpoint` reads it back with ``weights_only=True``.

Skeleton nodes are two-element lists ``[tag, content]``: ``["t", index]`` a
tensor, ``["v", value]`` a plain value, ``["l", [nodes]]`` a list, ``["u",
[nodes]]`` a tuple, ``["d", [[key, node], ...]]`` a dict whose keys are plain
values (msgpack maps would only allow string keys; optimizer states use ints).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

from p2ptrain.errors import CheckpointError, ConfigError, RemoteProtocolError

__all__ = [
    "CHECKPOINT_FORMAT",
    "MAX_DEPTH",
    "MAX_NODES",
    "TrainingSnapshot",
    "clone_state",
    "flatten_state",
    "load_checkpoint",
    "save_checkpoint",
    "unflatten_state",
]

CHECKPOINT_FORMAT: Final = "p2ptrain.train/1"
"""The ``format`` field of a checkpoint file."""
MAX_DEPTH: Final = 32
"""Deepest nesting a skeleton may have."""
MAX_NODES: Final = 1 << 20
"""Most nodes a skeleton may have."""

_PLAIN = (type(None), bool, int, float, str, bytes)
_INT_RANGE = (-(2**63), 2**64 - 1)


@dataclass(frozen=True)
class TrainingSnapshot:
    """A consistent copy of a trainer's state.

    Attributes:
        step: The global step the state belongs to.
        state: The state tree (see the module docstring).
    """

    step: int
    state: Any

    def __post_init__(self) -> None:
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise ConfigError(f"a snapshot's step is an int >= 0, got {self.step!r}")


def clone_state(tree: Any) -> Any:
    """A deep copy of a state tree whose tensors are detached clones in host memory
    (a state is served and saved from the CPU, whatever device it trains on)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, Mapping):
        return {key: clone_state(value) for key, value in tree.items()}
    if isinstance(tree, tuple):
        return tuple(clone_state(item) for item in tree)
    if isinstance(tree, list):
        return [clone_state(item) for item in tree]
    return tree


# -- the network form -------------------------------------------------------------------


def flatten_state(tree: Any) -> tuple[Any, list[torch.Tensor]]:
    """Split a state tree into its skeleton and its tensors (in skeleton order).

    Raises:
        ConfigError: A leaf is neither a tensor nor a plain value, a dict key
            is not a plain value, or the tree is too deep or too large.
    """
    tensors: list[torch.Tensor] = []
    count = [0]

    def visit(node: Any, depth: int) -> list[Any]:
        count[0] += 1
        if depth > MAX_DEPTH or count[0] > MAX_NODES:
            raise ConfigError("the state tree is too deep or too large")
        if isinstance(node, torch.Tensor):
            tensors.append(node)
            return ["t", len(tensors) - 1]
        if isinstance(node, _PLAIN):
            _check_plain(node, ConfigError)
            return ["v", node]
        if isinstance(node, Mapping):
            items = []
            for key, value in node.items():
                if not isinstance(key, _PLAIN):
                    raise ConfigError(f"a state dict key must be a plain value, got {key!r}")
                _check_plain(key, ConfigError)
                items.append([key, visit(value, depth + 1)])
            return ["d", items]
        if isinstance(node, tuple):
            return ["u", [visit(item, depth + 1) for item in node]]
        if isinstance(node, list):
            return ["l", [visit(item, depth + 1) for item in node]]
        raise ConfigError(f"cannot put a {type(node).__name__} in a training state")

    skeleton = visit(tree, 0)
    return skeleton, tensors


def unflatten_state(skeleton: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """Rebuild a state tree from a skeleton received from the network.

    Every tensor must be referenced exactly once.

    Raises:
        RemoteProtocolError: The skeleton is malformed.
    """
    used = [False] * len(tensors)
    count = [0]

    def build(node: Any, depth: int) -> Any:
        count[0] += 1
        if depth > MAX_DEPTH or count[0] > MAX_NODES:
            raise RemoteProtocolError("the state skeleton is too deep or too large")
        if not isinstance(node, list) or len(node) != 2 or not isinstance(node[0], str):
            raise RemoteProtocolError("a skeleton node is [tag, content]")
        tag, content = node
        if tag == "t":
            if isinstance(content, bool) or not isinstance(content, int):
                raise RemoteProtocolError("a tensor reference is an int")
            if not 0 <= content < len(tensors) or used[content]:
                raise RemoteProtocolError(f"bad or repeated tensor reference {content}")
            used[content] = True
            return tensors[content]
        if tag == "v":
            _check_plain(content, RemoteProtocolError)
            return content
        if tag in ("l", "u"):
            if not isinstance(content, list):
                raise RemoteProtocolError("a list node holds a list")
            items = [build(item, depth + 1) for item in content]
            return items if tag == "l" else tuple(items)
        if tag == "d":
            if not isinstance(content, list):
                raise RemoteProtocolError("a dict node holds a list of pairs")
            result: dict[Any, Any] = {}
            for pair in content:
                if not isinstance(pair, list) or len(pair) != 2:
                    raise RemoteProtocolError("a dict entry is [key, node]")
                key = pair[0]
                _check_plain(key, RemoteProtocolError)
                if key in result:
                    raise RemoteProtocolError(f"duplicate state dict key {key!r}")
                result[key] = build(pair[1], depth + 1)
            return result
        raise RemoteProtocolError(f"unknown skeleton tag {tag!r}")

    tree = build(skeleton, 0)
    if not all(used):
        raise RemoteProtocolError("the skeleton leaves tensors unreferenced")
    return tree


def _check_plain(value: object, error: type[Exception]) -> None:
    if not isinstance(value, _PLAIN):
        raise error(f"not a plain value: {type(value).__name__}")
    if isinstance(value, int) and not _INT_RANGE[0] <= value <= _INT_RANGE[1]:
        raise error("an int in a training state must fit 64 bits")


# -- the disk form ----------------------------------------------------------------------


def save_checkpoint(path: str | os.PathLike[str], snapshot: TrainingSnapshot) -> None:
    """Write ``snapshot`` to ``path`` atomically: readers see the old file or the new one.

    Raises:
        CheckpointError: The file cannot be written.
    """
    target = Path(path)
    payload = {"format": CHECKPOINT_FORMAT, "step": snapshot.step, "state": snapshot.state}
    tmp_name: str | None = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        with os.fdopen(fd, "wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, target)
        tmp_name = None
        _fsync_directory(target.parent)
    except (OSError, RuntimeError, pickle.PicklingError) as exc:
        raise CheckpointError(f"cannot write checkpoint {target}: {exc}") from exc
    finally:
        if tmp_name is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp_name)


def load_checkpoint(path: str | os.PathLike[str]) -> TrainingSnapshot:
    """Read a checkpoint written by :func:`save_checkpoint`.

    Raises:
        CheckpointError: The file is missing, unreadable, or not a checkpoint.
    """
    try:
        payload = torch.load(Path(path), map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} is not a {CHECKPOINT_FORMAT} checkpoint")
    step = payload.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{path}: the step must be an int >= 0")
    return TrainingSnapshot(step=step, state=payload.get("state"))


def _fsync_directory(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be opened
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
