"""Where p2ptrain's peers spend their CPU: a summary of their cProfile files.

``bench_allreduce.py --profile-dir DIR`` runs every loopback p2ptrain peer
under cProfile with a CPU clock (``time.process_time``), so waiting costs
nothing and what uvloop does in C (socket reads, the poll itself) shows up
as the time of ``asyncio.Runner.run``. :func:`summarize` merges the files and
splits the time of C functions (``copy_``, ``sum``, ...) by their Python
caller, so that a tensor copy in the runner and one in the benchmark's own
correctness check are told apart. The profiler slows Python code down, so
the shares matter more than the absolute figures.
"""

from __future__ import annotations

import pstats
from collections.abc import Sequence
from pathlib import Path

__all__ = ["summarize"]

BENCHMARK_FILES = tuple(str(Path(__file__).with_name(name)) for name in ("proto.py", "workers.py"))
"""Code of the benchmark itself (inputs, checks), not of p2ptrain."""


def _label(function: tuple[str, int, str]) -> str:
    filename, line, name = function
    if filename == "~":
        return name
    return f"{name} ({Path(filename).name}:{line})"


def summarize(paths: Sequence[Path], *, top: int = 15) -> tuple[list[tuple[float, str]], float]:
    """The costliest entries, as (CPU seconds, label), and the benchmark's own share.

    Returns:
        The ``top`` entries of p2ptrain (and the libraries it calls), costliest
        first, and the CPU seconds spent in the benchmark's checks and inputs.
    """
    stats = pstats.Stats(*(str(path) for path in paths))
    table: dict[str, float] = {}
    ours = 0.0
    for function, row in stats.stats.items():  # type: ignore[attr-defined]
        own_time, callers = row[2], row[4]
        if function[0] == "~" and callers:  # a C function: charge its callers
            for caller, caller_row in callers.items():
                seconds = caller_row[2]
                if Path(caller[0]).name in BENCHMARK_FILES:
                    ours += seconds
                    continue
                key = f"{_label(function)} <- {_label(caller)}"
                table[key] = table.get(key, 0.0) + seconds
        elif str(Path(function[0]).resolve()) in BENCHMARK_FILES:
            ours += own_time
        else:
            key = _label(function)
            table[key] = table.get(key, 0.0) + own_time
    ranked = sorted(((seconds, label) for label, seconds in table.items()), reverse=True)
    return ranked[:top], ours
