"""The package's layers, declared once: the layer test and docs/architecture.md read this.

A module may import its own layer and the layers below it, never a higher
one and never a sibling on the same rank; ``tests/project/test_layers.py``
checks every import of the package against :data:`LAYERS`, and the diagram
in docs/architecture.md is :func:`diagram` (``python -m p2ptrain.layers``
prints it; a test fails when the two differ).
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

__all__ = ["LAYERS", "Layer", "diagram", "layer_of"]


@dataclass(frozen=True)
class Layer:
    """One layer: a folder (or a few basic modules) of the package.

    Attributes:
        name: What the diagram calls it (a folder ends in ``/``).
        prefixes: The modules it holds, named inside the package (``""``
            is the package itself); a module belongs to the layer with its
            longest matching prefix.
        summary: What it does, in a line or two for the diagram.
    """

    name: str
    prefixes: tuple[str, ...]
    summary: str


# Bottom to top. Each rank is a tuple of sibling layers.
LAYERS: tuple[tuple[Layer, ...], ...] = (
    (
        Layer(
            "basics",
            ("", "errors", "aio", "metrics", "validate", "layers"),
            "errors.py aio.py metrics.py validate.py layers.py: the exception tree, the loop"
            " thread and the one owner of background tasks, the registry, config checks,"
            " this map",
        ),
    ),
    (
        Layer(
            "wire/",
            ("wire",),
            "frames (length prefix + msgpack header + raw payload), the record cipher"
            " (records.py), tensors, buffers",
        ),
    ),
    (
        Layer(
            "transport/",
            ("transport",),
            "FrameTransport: TCP (direct, hole-punched; bulk frames paced, pacing.py) and"
            " WebRTC data channels",
        ),
    ),
    (
        Layer(
            "secure/",
            ("secure",),
            "identity (Ed25519 keys, PeerID), the authenticated handshake, swarm keys",
        ),
    ),
    (
        Layer(
            "rpc/",
            ("rpc",),
            "Connection: multiplexed streams, flow control (a pure state, flow.py), deadlines",
        ),
    ),
    (Layer("node/", ("node",), "listener + connection pool, limits, memory release"),),
    (
        Layer(
            "measure/",
            ("measure",),
            "the bandwidth probe, meters and estimates, RTTs",
        ),
        Layer(
            "dht/",
            ("dht",),
            "Kademlia: routing table, lookups, signed expiring records",
        ),
    ),
    (
        Layer(
            "nat/",
            ("nat",),
            "NAT traversal (STUN, signaling, hole punching, relay, path planning)",
        ),
        Layer(
            "allreduce/",
            ("allreduce",),
            "matchmaking -> load-balancing LP -> butterfly reduce-scatter + all-gather",
        ),
    ),
    (
        Layer(
            "peer/",
            ("peer",),
            "Peer: node + DHT + NAT + all-reduce on a background loop (what train/ uses)",
        ),
    ),
    (
        Layer(
            "train/",
            ("train",),
            "CollaborativeOptimizer, DiLoCo, progress in the DHT, state for late joiners",
        ),
    ),
    (
        Layer(
            "swarm/",
            ("swarm",),
            "SWARM pipeline: stage servers, trainers, wiring, rebalancing",
        ),
    ),
    (
        Layer(
            "lab/",
            ("lab",),
            "labs users run: NAT lab, star lab, delay shim, simulated network, virtual"
            " clock, simulators",
        ),
        Layer("examples/", ("examples",), "the shipped charlm task"),
    ),
    (
        Layer(
            "app/",
            ("app", "__main__"),
            "the command line: cli.py and one module per command",
        ),
        Layer(
            "testing/",
            ("testing",),
            "test doubles (memory transport, manual clock, echo), transport conformance,"
            " the NAT lab's pytest glue",
        ),
    ),
)


def layer_of(module: str) -> tuple[int, Layer] | None:
    """The rank and layer of ``module`` (a full name, e.g. ``p2ptrain.dht.node``), or ``None``."""
    package, _, inside = module.partition(".")
    if package != __package__:
        return None
    best: tuple[int, int, Layer] | None = None
    for rank, siblings in enumerate(LAYERS):
        for layer in siblings:
            for prefix in layer.prefixes:
                matches = inside == prefix or (prefix != "" and inside.startswith(prefix + "."))
                if matches and (best is None or len(prefix) > best[0]):
                    best = (len(prefix), rank, layer)
    return None if best is None else (best[1], best[2])


_NAME_WIDTH = 22
_LINE_WIDTH = 96


def diagram() -> str:
    """The layers top to bottom as text; siblings share a row, joined by ``|``."""
    rows: list[str] = []
    for siblings in reversed(LAYERS):
        name = " | ".join(layer.name for layer in siblings)
        summary = " | ".join(layer.summary for layer in siblings)
        rows.extend(_wrap(name, summary))
    return "\n".join(rows) + "\n"


def _wrap(name: str, text: str) -> list[str]:
    indent = max(_NAME_WIDTH, len(name) + 1)
    lines = textwrap.wrap(text, width=_LINE_WIDTH - indent)
    return [(name if i == 0 else "").ljust(indent) + line for i, line in enumerate(lines)]


if __name__ == "__main__":
    print(diagram(), end="")
