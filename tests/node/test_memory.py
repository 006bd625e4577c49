"""The C allocator keeps freed memory for reuse between the node's release passes."""

from __future__ import annotations

import ctypes.util
import json
import subprocess
import sys

import pytest

from p2ptrain.errors import ConfigError
from p2ptrain.node.config import NodeConfig

# Two 16 MiB blocks freed together, allocated again: a backward's weight gradients.
_LOOP = """
import json, resource, sys
from p2ptrain.node.memory import keep_freed_memory
kept = keep_freed_memory(128 << 20) if sys.argv[1] == "keep" else False
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
blocks = [bytearray(16 << 20), bytearray(16 << 20)]
del blocks
before = faults()
for _ in range(20):
    blocks = [bytearray(16 << 20), bytearray(16 << 20)]
    del blocks
print(json.dumps({"kept": kept, "faults_per_round": (faults() - before) / 20}))
"""


def _faults(mode: str) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", _LOOP, mode], capture_output=True, text=True, check=True
    )
    return dict(json.loads(out.stdout))


@pytest.mark.skipif(
    not (ctypes.util.find_library("c") or "").startswith("libc.so"), reason="glibc only"
)
def test_kept_memory_is_reused_without_page_faults() -> None:
    stock, kept = _faults("stock"), _faults("keep")
    assert not stock["kept"] and kept["kept"]
    # glibc's defaults hand the 32 MiB back each round and fault it in again
    # (8,192 pages of 4 KiB); kept, the blocks come back from the heap.
    assert stock["faults_per_round"] > 4000, stock
    assert kept["faults_per_round"] < 100, kept


def test_keep_freed_bytes_is_checked() -> None:
    with pytest.raises(ConfigError):
        NodeConfig(keep_freed_bytes=-1)
    assert NodeConfig(keep_freed_bytes=0).keep_freed_bytes == 0
