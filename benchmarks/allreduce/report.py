"""Output of the all-reduce benchmark: its tables, the goals, the plot.

Everything here reads measurements (:class:`Series` of loopback rounds, a
:class:`~benchmarks.allreduce.hetero.HeteroResult`) and prints or draws them; the
functions return what goes into the JSON line.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.allreduce.hetero import HeteroResult
from benchmarks.allreduce.profile import summarize
from benchmarks.allreduce.runner import Round
from benchmarks.harness import format_table, uvloop_available
from p2ptrain.measure import TCP_PAYLOAD_FRACTION

__all__ = [
    "GLOO_GOAL",
    "HIVEMIND_GOAL",
    "LARGE_GLOO_GOAL",
    "LP_PREDICTION_GOAL",
    "SPEEDUP_GOAL",
    "SYSTEMS",
    "Series",
    "gloo_goal_for",
    "hetero_report",
    "loopback_report",
    "plot",
    "profile_report",
]

MiB = 1 << 20
GiB = 1 << 30

SYSTEMS = ("p2ptrain", "p2ptrain-plaintext", "gloo", "hivemind")
GLOO_GOAL = 1.5
"""p2ptrain's (encrypted) time may be at most this multiple of gloo's."""
LARGE_GLOO_GOAL = 1.3
"""From 64 MiB on, the encrypted rows may be at most this multiple of gloo's time."""
HIVEMIND_GOAL = 5.0
"""hivemind's time should be at least this multiple of p2ptrain's."""
LP_PREDICTION_GOAL = 0.15
"""The LP plan's achieved time within this fraction of its prediction."""
SPEEDUP_GOAL = 0.90
"""The measured LP speedup over equal shares at least this fraction of the predicted one."""


def gloo_goal_for(size_mib: int) -> float:
    """The largest p2ptrain/gloo time ratio allowed at this vector size."""
    return LARGE_GLOO_GOAL if size_mib >= 64 else GLOO_GOAL


@dataclass
class Series:
    """The timed rounds of one system at one size."""

    system: str
    peers: int
    size_bytes: int
    rounds: list[Round] = field(default_factory=list)
    retried: int = 0

    @property
    def seconds(self) -> float:
        """The median round time."""
        return statistics.median(r.seconds for r in self.rounds)

    @property
    def cpu_s_per_gb(self) -> float:
        """The median round's CPU, all peers together, per GiB of vector."""
        return statistics.median(r.cpu_s for r in self.rounds) / (self.size_bytes / GiB)

    @property
    def max_error(self) -> float:
        """The largest relative error any peer saw in any round."""
        return max(r.max_error for r in self.rounds)

    def row(self) -> dict[str, Any]:
        """The JSON row."""
        return {
            "system": self.system,
            "peers": self.peers,
            "bytes": self.size_bytes,
            "seconds": round(self.seconds, 4),
            "cpu_s_per_GB": round(self.cpu_s_per_gb, 3),
            "runs_s": [round(r.seconds, 4) for r in self.rounds],
            "cpu_s_runs": [round(r.cpu_s, 3) for r in self.rounds],
            "max_rel_error": self.max_error,
            "retried_rounds": self.retried,
        }


# -- the report -------------------------------------------------------------------------------


def _ratio(a: Series | None, b: Series | None) -> float | None:
    if a is None or b is None or not a.rounds or not b.rounds:
        return None
    return a.seconds / b.seconds


def _verdict(met: bool | None) -> str:
    return "-" if met is None else ("met" if met else "MISSED")


def loopback_report(
    args: argparse.Namespace, series: list[Series], hivemind_note: str
) -> dict[str, Any]:
    """Print the loopback table and ratios; return the ratios for the JSON line."""
    by_key = {(s.system, s.size_bytes): s for s in series}
    rows = []
    for size in args.sizes:
        gloo = by_key.get(("gloo", size * MiB))
        for system in SYSTEMS:
            s = by_key.get((system, size * MiB))
            if s is None or not s.rounds:
                continue
            runs = [r.seconds for r in s.rounds]
            vs_gloo = _ratio(s, gloo)
            rows.append(
                [
                    system,
                    s.peers,
                    size,
                    round(s.seconds, 3),
                    f"{min(runs):.3f}-{max(runs):.3f}",
                    round(s.cpu_s_per_gb, 2),
                    "-" if vs_gloo is None else f"{vs_gloo:.2f}",
                    f"{s.max_error:.1e}",
                ]
            )
    ratios: dict[str, Any] = {}
    lines = []
    for size in args.sizes:
        ours = by_key.get(("p2ptrain", size * MiB))
        vs_gloo = _ratio(ours, by_key.get(("gloo", size * MiB)))
        vs_hm = _ratio(by_key.get(("hivemind", size * MiB)), ours)
        theirs = by_key.get(("gloo", size * MiB))
        cpu_ratio = (
            None
            if ours is None or theirs is None or not ours.rounds or not theirs.rounds
            else ours.cpu_s_per_gb / theirs.cpu_s_per_gb
        )
        plain = _ratio(by_key.get(("p2ptrain-plaintext", size * MiB)), theirs)
        gloo_goal = gloo_goal_for(size)
        ratios[f"{size}MiB"] = {
            "p2ptrain_over_gloo": None if vs_gloo is None else round(vs_gloo, 3),
            "p2ptrain_plaintext_over_gloo": None if plain is None else round(plain, 3),
            "p2ptrain_over_gloo_cpu": None if cpu_ratio is None else round(cpu_ratio, 3),
            "hivemind_over_p2ptrain": None if vs_hm is None else round(vs_hm, 2),
            "gloo_goal": gloo_goal,
        }
        gloo_met = None if vs_gloo is None else vs_gloo <= gloo_goal
        hm_met = None if vs_hm is None else vs_hm >= HIVEMIND_GOAL
        gloo_text = "-" if vs_gloo is None else f"{vs_gloo:.2f}"
        hm_text = "-" if vs_hm is None else f"{vs_hm:.1f}x"
        cpu_text = "" if cpu_ratio is None else f", CPU {cpu_ratio:.2f}"
        text = (
            f"{size:>4} MiB: p2ptrain/gloo time {gloo_text} (goal <= {gloo_goal}: "
            f"{_verdict(gloo_met)}){cpu_text}; hivemind/p2ptrain time {hm_text} "
            f"(goal >= {HIVEMIND_GOAL:g}x: {_verdict(hm_met)})"
        )
        lines.append(text)
    if not args.json_only:
        loop = "uvloop" if uvloop_available() else "asyncio"
        print(
            f"Loopback all-reduce: {args.peers} peers (processes), float32, median of "
            f"{args.repeats} rounds after a warm-up; p2ptrain equal shares, codec none, "
            f"{loop}, {args.chunk_kib} KiB chunks"
        )
        print(
            format_table(
                ["system", "peers", "MiB", "seconds", "runs", "CPU s/GiB", "vs gloo", "max err"],
                rows,
            )
        )
        print("\n".join(lines))
        print(hivemind_note)
        print()
    return ratios


def hetero_report(args: argparse.Namespace, hetero: HeteroResult) -> dict[str, Any]:
    """Print the heterogeneous-bandwidth tables; return the JSON ``hetero`` object."""
    pred = hetero.prediction
    plans = {
        "lp": ("p2ptrain, LP shares", hetero.lp, pred.lp_s, pred.lp_link_rates_s),
        "equal": ("p2ptrain, equal shares", hetero.equal, pred.equal_s, pred.equal_link_rates_s),
        "gloo": (
            "gloo ring (client = a rank)",
            hetero.gloo,
            pred.gloo_ring_s,
            pred.gloo_ring_s * TCP_PAYLOAD_FRACTION,
        ),
    }
    achieved = {
        k: statistics.median(r.seconds for r in rounds) for k, (_, rounds, _, _) in plans.items()
    }
    wire = {k: statistics.median(t for t, _ in hetero.wire_limited_s(k)) for k in plans}
    busiest = {k: statistics.mode(link for _, link in hetero.wire_limited_s(k)) for k in plans}
    lp_s, equal_s, gloo_s = achieved["lp"], achieved["equal"], achieved["gloo"]
    speedup, predicted_speedup = equal_s / lp_s, pred.equal_s / pred.lp_s
    lp_met = abs(lp_s / pred.lp_s - 1) <= LP_PREDICTION_GOAL
    speedup_met = speedup >= SPEEDUP_GOAL * predicted_speedup
    meter = hetero.meter_rates()
    meter_shares, meter_real_s = hetero.meter_plan()
    if not args.json_only:
        print(
            f"Heterogeneous bandwidth: {len(hetero.scenario)} peers in network namespaces, "
            f"tc tbf links, {hetero.vector_bytes / MiB:g} MiB float32, p2ptrain chunks of "
            f"{hetero.chunk_bytes // 1024} KiB, median of {len(hetero.lp)} rounds after a warm-up"
        )
        peer_rows = [
            [
                peer.name + (" (client mode)" if peer.client else ""),
                f"{peer.link.upload_mbit:g} / {peer.link.download_mbit:g}",
                f"{pred.lp_shares[i]:.3f}",
                f"{pred.equal_shares[i]:.3f}",
                _mbit_text(meter[i][0]),
                _mbit_text(meter[i][1]),
                f"{meter_shares[i]:.3f}",
            ]
            for i, peer in enumerate(hetero.scenario)
        ]
        headers = ["peer", "up / down Mbit/s", "LP share", "equal", "meter up", "meter down"]
        print(format_table([*headers, "LP share from meter"], peer_rows))
        print()
        rows: list[list[object]] = []
        for key, (label, rounds, predicted, at_link_rates) in plans.items():
            rows.append(
                [
                    label,
                    round(predicted, 3),
                    round(at_link_rates, 3),
                    f"{wire[key]:.3f} ({busiest[key]})",
                    round(achieved[key], 3),
                    round(achieved[key] / predicted, 3),
                    _runs(rounds),
                ]
            )
        headers = ["plan", "predicted s", "at the links' rates", "busiest link on the wire s"]
        print(format_table([*headers, "achieved s", "achieved/pred.", "runs"], rows))
        fraction = speedup / predicted_speedup
        print(
            f"LP: achieved/predicted {lp_s / pred.lp_s:.3f} (goal within "
            f"{LP_PREDICTION_GOAL:.0%}: {_verdict(lp_met)}); speedup over equal shares "
            f"{speedup:.2f}x, predicted {predicted_speedup:.2f}x: {fraction:.0%} of it "
            f"(goal >= {SPEEDUP_GOAL:.0%}: {_verdict(speedup_met)}); gloo/LP {gloo_s / lp_s:.2f}x"
        )
        print(
            "Where the LP round's time goes: frames, headers and ACKs make the busiest link"
            f" carry {wire['lp'] / pred.lp_link_rates_s - 1:+.1%} over the tensor bytes; that"
            f" link then stands idle {achieved['lp'] / wire['lp'] - 1:+.1%} of its wire time"
            " (start skew, the last chunk's average travelling back, scheduling on a loaded"
            " machine)."
        )
        print(
            "The LP was fed the configured tbf rates as typed-in rates (the TCP payload they"
            " carry: 1448 of 1514 bytes). Fed p2ptrain's ThroughputMeter "
            f"instead (columns 'meter'), it would choose the last column's shares: "
            f"{meter_real_s:.3f} s on these links. The meter's upload is bytes handed to the "
            "kernel over the time it took, so socket buffers inflate it on slow links."
        )
        print()
    return {
        "scenario": {
            "peers": [
                {
                    "name": peer.name,
                    "upload_mbit": peer.link.upload_mbit,
                    "download_mbit": peer.link.download_mbit,
                    "client_mode": peer.client,
                    "lp_share": round(pred.lp_shares[i], 4),
                    "equal_share": round(pred.equal_shares[i], 4),
                    "meter_upload_mbit": _mbit(meter[i][0]),
                    "meter_download_mbit": _mbit(meter[i][1]),
                    "meter_lp_share": round(meter_shares[i], 4),
                }
                for i, peer in enumerate(hetero.scenario)
            ],
            "vector_bytes": hetero.vector_bytes,
            "chunk_bytes": hetero.chunk_bytes,
            "shaping": "tc tbf per host: upload on its veth, download on its bridge port; cubic",
            "lp_input": "configured tbf rates as typed in: their TCP payload (x 1448/1514)",
            "gloo_note": "gloo has no client mode: the client-mode peer is an ordinary ring rank",
        },
        "lp_s": round(lp_s, 4),
        "equal_s": round(equal_s, 4),
        "predicted_s": round(pred.lp_s, 4),
        "predicted_fluid_s": round(pred.lp_fluid_s, 4),
        "predicted_equal_s": round(pred.equal_s, 4),
        "gloo_s": round(gloo_s, 4),
        "gloo_ring_model_s": round(pred.gloo_ring_s, 4),
        "predicted_link_rates_s": round(pred.lp_link_rates_s, 4),
        "predicted_equal_link_rates_s": round(pred.equal_link_rates_s, 4),
        "wire_limited_s": {k: round(v, 4) for k, v in wire.items()},
        "speedup": round(speedup, 3),
        "predicted_speedup": round(predicted_speedup, 3),
        "speedup_fraction_of_predicted": round(speedup / predicted_speedup, 3),
        "lp_achieved_over_predicted": round(lp_s / pred.lp_s, 3),
        "meter_plan_real_s": round(meter_real_s, 4),
        "runs_s": {
            k: [round(r.seconds, 4) for r in rounds] for k, (_, rounds, _, _) in plans.items()
        },
        "goals": {"lp_within_15pct": lp_met, "speedup_at_least_90pct": speedup_met},
    }


def profile_report(args: argparse.Namespace, series: list[Series]) -> None:
    """Print where the profiled p2ptrain peers spent their CPU."""
    paths = sorted(Path(args.profile_dir).glob("p2ptrain-*.prof"))
    if not paths:
        print(f"no profiles in {args.profile_dir}")
        return
    ranked, benchmark_s = summarize(paths)
    # Every round (warm-ups too) of every size, summed over the peers, as in the table.
    gib = sum(s.size_bytes / GiB * (len(s.rounds) + 1) for s in series if s.system == "p2ptrain")
    print(
        f"Where p2ptrain's CPU goes (cProfile with a CPU clock, {len(paths)} peers, every "
        "round incl. warm-ups; CPU s per GiB of vector summed over the peers; the profiler "
        f"inflates Python; the benchmark's own checks took {benchmark_s / gib:.2f} s/GiB more)"
    )
    rows = [[label, round(seconds / gib, 3)] for seconds, label in ranked]
    print(format_table(["function (C functions: <- caller)", "CPU s/GiB"], rows))
    print()


def _runs(rounds: list[Round]) -> str:
    values = [r.seconds for r in rounds]
    return f"{min(values):.3f}-{max(values):.3f}"


def _mbit(rate: float | None) -> float | None:
    return None if rate is None else round(rate * 8 / 1e6, 2)


def _mbit_text(rate: float | None) -> str:
    return "-" if rate is None else f"{rate * 8 / 1e6:.1f}"


# -- the plot ---------------------------------------------------------------------------------


def plot(
    path: str, args: argparse.Namespace, series: list[Series], hetero: dict[str, Any] | None
) -> None:
    """Two panels: time vs size per system (loopback); LP vs equal vs gloo (shaped links)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    sizes = sorted({s.size_bytes // MiB for s in series})
    for index, system in enumerate(SYSTEMS):
        points = sorted(
            (s.size_bytes / MiB, s.seconds) for s in series if s.system == system and s.rounds
        )
        if points:
            xs, ys = zip(*points, strict=True)
            left.plot(xs, ys, marker="o", color=f"C{index}", label=system)
            offset = (6, -12) if system == "gloo" else (6, 4)
            for x, y in points:
                left.annotate(
                    f"{y:.3g}",
                    (x, y),
                    textcoords="offset points",
                    xytext=offset,
                    fontsize=8,
                    color=f"C{index}",  # says whose label it is where the lines cross
                )
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xticks(sizes, [str(size) for size in sizes])
    left.minorticks_off()
    left.set_xlabel("vector size, MiB (float32)")
    left.set_ylabel("all-reduce time, s (median)")
    left.set_title(f"loopback, {args.peers} peers")
    left.legend()
    left.grid(True, which="both", alpha=0.3)
    if hetero is None:
        right.text(0.5, 0.5, "heterogeneous run skipped", ha="center", va="center")
        right.set_axis_off()
    else:
        labels = ["LP shares", "equal shares", "gloo (ring)"]
        predicted = [
            hetero["predicted_s"],
            hetero["predicted_equal_s"],
            hetero["gloo_ring_model_s"],
        ]
        achieved = [hetero["lp_s"], hetero["equal_s"], hetero["gloo_s"]]
        positions = list(range(len(labels)))
        width = 0.38
        bars_p = right.bar(
            [x - width / 2 for x in positions], predicted, width, label="predicted", color="C7"
        )
        bars_a = right.bar(
            [x + width / 2 for x in positions], achieved, width, label="achieved", color="C0"
        )
        right.bar_label(bars_p, fmt="%.2f", fontsize=8)
        right.bar_label(bars_a, fmt="%.2f", fontsize=8)
        right.set_xticks(positions, labels)
        right.set_ylabel("round time, s")
        scenario = hetero["scenario"]
        right.set_title(
            f"{len(scenario['peers'])} peers, tbf links, {scenario['vector_bytes'] / MiB:g} MiB: "
            f"LP {hetero['speedup']:.2f}x faster than equal (predicted "
            f"{hetero['predicted_speedup']:.2f}x)",
            fontsize=10,
        )
        right.legend()
    fig.suptitle("p2ptrain all-reduce benchmark")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
