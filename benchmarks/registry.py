"""Every benchmark, declared once: ``p2ptrain bench``, ``bench_all`` and the tests read this.

A benchmark ``NAME`` is the module ``benchmarks/bench_NAME.py`` (its command
line, its tables, its JSON line); the modules it alone uses live in the
sub-package ``benchmarks/NAME/``. Adding one is a module and an entry in
:data:`BENCHMARKS`; ``tests/app/test_bench_all.py`` fails when a
``bench_*.py`` or a sub-package has no entry here.

This module imports no benchmark (nor torch): the command line reads it
from the checkout's file for its choices and help without importing one.
"""

from __future__ import annotations

from dataclasses import dataclass

from p2ptrain.errors import ConfigError

__all__ = ["ALL", "BENCHMARKS", "Benchmark", "LabPart", "by_name", "module_of"]

ALL = "all"
"""The name that runs every benchmark of the report (``bench_all``), not a benchmark itself."""


@dataclass(frozen=True)
class LabPart:
    """A part of a benchmark that needs the NAT lab (root, iproute2, iptables, coturn).

    Attributes:
        what: The part, as the report names what it left out ("WebRTC rows").
        flag: The benchmark's flag that leaves the part out, or ``None``
            when the part is the whole benchmark.
    """

    what: str
    flag: str | None = None


@dataclass(frozen=True)
class Benchmark:
    """One benchmark.

    Attributes:
        name: What ``p2ptrain bench`` calls it; the module is ``bench_NAME``.
        summary: What it measures, in a line (``p2ptrain bench --help``).
        in_report: Whether ``bench all`` runs it (left out: runs of many
            minutes or of many processes that measure one issue each).
        quick: The workload of ``bench all --quick``: a smoke test of the
            report, not a measurement.
        plot: ``bench all`` asks it for its plot (``--png PATH``) and shows
            it in the report.
        hivemind: It takes ``--no-hivemind`` and ``--hivemind-python``
            (:func:`benchmarks.options.add_hivemind_arguments`).
        lab: What of it needs the NAT lab, or ``None``.
    """

    name: str
    summary: str
    in_report: bool = True
    quick: tuple[str, ...] = ()
    plot: bool = False
    hivemind: bool = False
    lab: LabPart | None = None

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or self.name == ALL:
            raise ConfigError(f"a benchmark's name is a module suffix, not {self.name!r}")

    @property
    def module(self) -> str:
        """The module that runs it: ``python -m benchmarks.bench_NAME``."""
        return f"benchmarks.bench_{self.name}"


# In the order ``bench all`` runs them: transport's table opens the report.
BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark(
        "transport",
        "RPC streaming and round trips against a raw socket; WebRTC stock vs tuned (root)",
        quick=(
            *("--megabytes", "8", "--repeats", "1", "--rtt-calls", "200"),
            *("--webrtc-seconds", "1", "--webrtc-loss-seconds", "2"),
            *("--webrtc-repeats", "1", "--webrtc-loss-repeats", "1"),
        ),
        plot=True,
        lab=LabPart("WebRTC rows", "--no-webrtc"),
    ),
    Benchmark(
        "dht",
        "DHT store/get latency and success, churn, get throughput, against hivemind",
        quick=(
            "--nodes",
            "12",
            "--keys",
            "10",
            "--throughput-nodes",
            "4",
            "--throughput-gets",
            "20",
        ),
        hivemind=True,
    ),
    Benchmark(
        "allreduce",
        "all-reduce against gloo and hivemind; the LP against equal shares on shaped links (root)",
        quick=("--sizes", "1", "--repeats", "1", "--peers", "2", "--hetero-mb", "1"),
        plot=True,
        hivemind=True,
        lab=LabPart("shaped-link part", "--skip-hetero"),
    ),
    Benchmark(
        "lp",
        "load-balancing LP: first build against cached re-solves",
        quick=("--sizes", "8", "--resolves", "2"),
    ),
    Benchmark(
        "training",
        "swarm against one process (samples/s, equivalence); --wan: against hivemind (root)",
        quick=(
            *("--peers", "2", "--steps", "2", "--rounds", "1"),
            *("--inner-steps", "2", "--single-batches", "4"),
        ),
    ),
    Benchmark(
        "compression",
        "all-reduce codecs: held-out loss and bytes per step",
        quick=("--steps", "2", "--eval-windows", "8"),
    ),
    Benchmark(
        "pipeline",
        "SWARM pipeline against torch.distributed.pipelining, kill -9, rebalancing, loss",
        quick=(
            *("--width", "128", "--steps", "2", "--warmup", "1", "--loss-steps", "4"),
            *("--sim-periods", "2", "--sim256-peers", "16", "--sim256-periods", "2"),
            *("--skip", "b,b-torch,c-real"),
        ),
    ),
    Benchmark(
        "webrtc",
        "WebRTC ablation: each tuning step on its own, clean and lossy paths (root)",
        quick=("--seconds", "1", "--loss-seconds", "2", "--repeats", "1"),
        lab=LabPart("the whole benchmark"),
    ),
    Benchmark(
        "stop",
        "how long after --seconds a `p2ptrain train` peer ends",
        in_report=False,
    ),
    Benchmark(
        "scale",
        "averaging at scale: a simulated swarm of 16 to 1,024 peers, and 48 real processes",
        in_report=False,
    ),
    Benchmark(
        "hostile",
        "hostile peers against a real bootstrap: does it, and a healthy client, survive?",
        in_report=False,
    ),
)
"""Every benchmark; those of the report first, in the order ``bench all`` runs them."""


def by_name(name: str) -> Benchmark:
    """The benchmark called ``name`` (ConfigError naming the known ones if none is)."""
    for bench in BENCHMARKS:
        if bench.name == name:
            return bench
    known = ", ".join(bench.name for bench in BENCHMARKS)
    raise ConfigError(f"no benchmark {name!r} (known: {known})")


def module_of(name: str) -> str:
    """The module that ``p2ptrain bench NAME`` runs: a benchmark's, or ``bench_all``'s."""
    return f"benchmarks.bench_{ALL}" if name == ALL else by_name(name).module
