"""The layer order of docs/architecture.md, checked on the real imports.

Every ``import`` of every module under ``p2ptrain/`` is read with :mod:`ast`
(function-local and ``TYPE_CHECKING`` imports included: a type-only upward
reference is still an upward dependency). A module may import its own layer
and the layers below it, never a higher one, and never a sibling on the same
rank (``dht`` and ``measure``, ``nat`` and ``allreduce`` stand side by side).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "p2ptrain"

# Bottom to top. Each rank is a tuple of sibling layers; each layer a tuple of
# module-name prefixes. A module belongs to the layer with its longest prefix.
LAYERS: tuple[tuple[tuple[str, tuple[str, ...]], ...], ...] = (
    (
        (
            "basics",
            (
                "p2ptrain",
                "p2ptrain.errors",
                "p2ptrain.aio",
                "p2ptrain.metrics",
                "p2ptrain.validate",
            ),
        ),
    ),
    (("wire", ("p2ptrain.wire",)),),
    (("transport", ("p2ptrain.transport",)),),
    (("secure", ("p2ptrain.secure",)),),
    (("rpc", ("p2ptrain.rpc",)),),
    (("node", ("p2ptrain.node",)),),
    (("measure", ("p2ptrain.measure",)), ("dht", ("p2ptrain.dht",))),
    (("nat", ("p2ptrain.nat",)), ("allreduce", ("p2ptrain.allreduce",))),
    (("peer", ("p2ptrain.peer",)),),
    (("train", ("p2ptrain.train",)),),
    (("swarm", ("p2ptrain.swarm",)),),
    (("testing", ("p2ptrain.testing",)), ("examples", ("p2ptrain.examples",))),
    (("app", ("p2ptrain.app", "p2ptrain.__main__")),),
)

# Upward imports that exist today and are being removed; each names its way out.
KNOWN_UPWARD: frozenset[tuple[str, str]] = frozenset()


def module_name(path: Path, package_dir: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(source: str, module: str, *, is_package: bool = False) -> set[str]:
    """The ``p2ptrain`` modules one module's source imports, anywhere in it."""
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            found.add(target)
            # ``from p2ptrain import aio`` imports the module p2ptrain.aio
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return {name for name in found if name == "p2ptrain" or name.startswith("p2ptrain.")}


def layer_of(module: str) -> tuple[int, str] | None:
    best: tuple[int, int, str] | None = None
    for rank, siblings in enumerate(LAYERS):
        for layer, prefixes in siblings:
            for prefix in prefixes:
                nested = prefix != "p2ptrain" and module.startswith(prefix + ".")
                if (module == prefix or nested) and (best is None or len(prefix) > best[0]):
                    best = (len(prefix), rank, layer)
    return None if best is None else (best[1], best[2])


def violations(graph: Mapping[str, Iterable[str]], known: frozenset[tuple[str, str]]) -> list[str]:
    """Every import in ``graph`` (module -> imported modules) that breaks the order."""
    found: list[str] = []
    for module, targets in sorted(graph.items()):
        here = layer_of(module)
        if here is None:
            found.append(f"{module}: in no layer (add it to LAYERS)")
            continue
        for target in sorted(targets):
            there = layer_of(target)
            if there is None or there[1] == here[1] or (module, target) in known:
                continue
            if there[0] > here[0]:
                found.append(f"{module} ({here[1]}) imports {target} ({there[1]}), a higher layer")
            elif there[0] == here[0]:
                found.append(f"{module} ({here[1]}) imports {target} ({there[1]}), a sibling")
    return found


def import_graph(package_dir: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the modules it imports (``from m import name`` counts as ``m``
    unless ``name`` is itself a module)."""
    paths = sorted(package_dir.rglob("*.py"))
    modules = {module_name(path, package_dir) for path in paths}
    graph: dict[str, set[str]] = {}
    for path in paths:
        module = module_name(path, package_dir)
        found = imports_of(path.read_text(), module, is_package=path.stem == "__init__")
        graph[module] = {name if name in modules else name.rpartition(".")[0] for name in found}
    return graph


def test_no_module_imports_a_higher_or_sibling_layer() -> None:
    graph = import_graph()
    assert len(graph) > 100  # the walk found the package
    assert violations(graph, KNOWN_UPWARD) == []


def test_known_exceptions_still_exist() -> None:
    """An exception that was fixed is taken off the list (so it cannot come back)."""
    graph = import_graph()
    assert [pair for pair in KNOWN_UPWARD if pair[1] not in graph.get(pair[0], set())] == []


def test_the_check_catches_upward_sibling_and_unplaced_imports() -> None:
    graph = {
        "p2ptrain.wire.frames": {"p2ptrain.errors", "p2ptrain.wire.buffers"},
        "p2ptrain.rpc.stream": {"p2ptrain.train.config"},
        "p2ptrain.nat.paths": {"p2ptrain.allreduce.lp"},
        "p2ptrain.newthing": set(),
    }
    assert violations(graph, frozenset()) == [
        "p2ptrain.nat.paths (nat) imports p2ptrain.allreduce.lp (allreduce), a sibling",
        "p2ptrain.newthing: in no layer (add it to LAYERS)",
        "p2ptrain.rpc.stream (rpc) imports p2ptrain.train.config (train), a higher layer",
    ]
    assert violations(graph, frozenset({("p2ptrain.rpc.stream", "p2ptrain.train.config")}))[
        -1
    ].startswith("p2ptrain.newthing")


def test_imports_are_found_wherever_they_are_written() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "import p2ptrain.wire.frames\n"
        "from p2ptrain import aio\n"
        "if TYPE_CHECKING:\n"
        "    from p2ptrain.train.base import X\n"
        "def f():\n"
        "    from .lookup import y\n"
    )
    assert imports_of(source, "p2ptrain.dht.node") == {
        "p2ptrain",
        "p2ptrain.aio",
        "p2ptrain.wire.frames",
        "p2ptrain.train.base",
        "p2ptrain.train.base.X",
        "p2ptrain.dht.lookup",
        "p2ptrain.dht.lookup.y",
    }


def test_the_network_layers_import_without_torch() -> None:
    """torch is the training layers' concern: a DHT or bootstrap tool loads none of it."""
    code = (
        "import sys, p2ptrain.secure, p2ptrain.rpc, p2ptrain.node, p2ptrain.dht, p2ptrain.nat;"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]"


def test_the_package_root_holds_only_the_shared_basics() -> None:
    """Everything else lives in a folder named for its concern."""
    loose = sorted(path.stem for path in PACKAGE.glob("*.py"))
    assert loose == ["__init__", "__main__", "aio", "errors", "metrics", "peer", "validate"]


def test_no_function_of_the_application_layer_is_over_80_lines() -> None:
    long = []
    for path in sorted((PACKAGE / "app").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > 80:
                    long.append(f"{path.name}:{node.name} ({lines} lines)")
    assert long == []
