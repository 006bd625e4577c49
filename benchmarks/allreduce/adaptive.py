"""The adaptive part of the shaped all-reduce benchmark: the LP fed only by measurement.

Same eight peers and tbf links as ``allreduce/hetero.py``, in fresh star labs:

* **measured**: no configured rate anywhere. Each peer probes all the others
  at once (``probe_peers``, each way for ``PROBE_SECONDS``), one prober at a time, as
  newcomers joining one by one would probe their initial peers, into its own
  :class:`~p2ptrain.measure.estimates.LinkEstimator`; every round's report
  goes into it too (receiver-timed streams). Before every round the parent
  asks each peer what it would announce in matchmaking and plans with the
  LP on exactly that; the prediction is what matchmaking gives that plan
  (:func:`~p2ptrain.allreduce.fairshare.fair_share_round_time`). A peer whose round
  ran late asks to probe again (``needs_probe``), as a swarm peer would:
  the parent lets those probe, one at a time, before the next round.
* **throttle**: the same peers carry on for ``throttle_rounds`` rounds;
  after round ``throttle_after`` the ``dc`` link drops from 1000 to
  100 Mbit/s (both tbfs replaced). Adapted = the first round after the change
  within 15 % of the predicted time of the LP's plan for the new configured
  rates (its fair-share time, as matchmaking predicts; the LP's own fluid
  time is ``throttle_fluid_predicted_s``). For reference,
  the LP's plan for those configured rates then runs on the same links, and
  ``throttle_rounds_to_match_configured`` counts the rounds until one came
  within 15 % of what that plan achieved (adaptation, apart from the model).
* **rtt**: a lab whose hosts delay their sends by ``rtt_ms / 2`` (round
  trip ``rtt_ms``), LP fed the configured rates plus each peer's largest RTT
  measured by PINGs (the model turns it into a latency term,
  :func:`p2ptrain.allreduce.partition.latency_s`). Each peer is given its
  configured rates as typed-in rates (it does not probe here), which its
  rounds' kernel pacing uses. Timed rounds start ``RTT_ROUND_GAP_S`` after
  the previous one (connections idle past their retransmission timeout, as
  between training steps); then as many rounds back to back, for reference.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from benchmarks.allreduce.hetero import SCENARIO, HeteroPeer
from benchmarks.allreduce.runner import PeerGroup, run_round
from benchmarks.allreduce.systems import p2ptrain_plan, p2ptrain_prepares, start_p2ptrain
from p2ptrain.allreduce.fairshare import fair_share_round_time
from p2ptrain.allreduce.lp import LoadBalancer, PeerCapacity
from p2ptrain.lab.natlab.netns import python_env
from p2ptrain.lab.starlab import LinkSpec, StarLab

__all__ = ["run_adaptive"]

MiB = 1 << 20
PROBE_SECONDS = 0.5
"""Seconds each direction of a peer's probe of all the others lasts."""
ADAPT_TOLERANCE = 0.15
RTT_ROUND_GAP_S = 1.0
"""Idle seconds before each timed round of the RTT scenario.

More than a retransmission timeout (Linux: at least 200 ms plus the round
trip), so each round starts on connections that restart slow start from the
initial window, as training's rounds do (a step apart) and as the latency
term assumes. Rounds back to back keep their congestion windows: they are
run after, for reference, outside the goal."""


def _plan(peers: Sequence[PeerCapacity], vector_bytes: int) -> tuple[tuple[float, ...], float]:
    """The LP's shares and what matchmaking predicts for them (their fair-share time)."""
    plan = LoadBalancer().plan(peers, vector_bytes=vector_bytes, target_batch_size=1)
    return plan.shares, fair_share_round_time(plan.shares, peers, vector_bytes)


def _fluid_s(peers: Sequence[PeerCapacity], vector_bytes: int) -> float:
    """The LP's own (fluid) time for its plan."""
    return LoadBalancer().plan(peers, vector_bytes=vector_bytes, target_batch_size=1).round_time_s


def _estimates(group: PeerGroup, scenario: Sequence[HeteroPeer], timeout: float) -> list[Any]:
    replies = group.request([{"cmd": "estimates"}] * len(group), timeout=timeout)
    out = []
    for peer, reply in zip(scenario, replies, strict=True):
        if reply["upload"] is None or reply["download"] is None:
            raise RuntimeError(f"{peer.name} has measured nothing")
        out.append(
            PeerCapacity(
                upload_bytes_per_s=reply["upload"],
                download_bytes_per_s=reply["download"],
                client_mode=peer.client,
            )
        )
    return out


class _Runner:
    def __init__(  # noqa: PLR0917 - a private helper of this module
        self,
        lab: StarLab,
        group: PeerGroup,
        addresses: list[Any],
        scenario: Sequence[HeteroPeer],
        chunk_bytes: int,
        timeout: float,
        log: Callable[[str], None],
    ) -> None:
        self.lab, self.group, self.addresses, self.scenario = lab, group, addresses, scenario
        self.chunk_bytes, self.timeout, self.log = chunk_bytes, timeout, log
        self.clients = [i for i, peer in enumerate(scenario) if peer.client]
        self.drops: list[int] = []
        """Packets the shapers (uploads and downloads) dropped in each round, in order."""

    def round(self, label: str, shares: Sequence[float], predicted: float, numel: int) -> float:
        plan = p2ptrain_plan(
            self.addresses,
            shares,
            numel,
            clients=self.clients,
            chunk_elements=self.chunk_bytes // 4,
            timeout=self.timeout,
            predicted_s=predicted,
        )
        prepares = p2ptrain_prepares(plan)
        before = self.lab.counters()
        result = run_round(
            self.group, prepares, prepare_timeout=self.timeout, round_timeout=self.timeout
        )
        dropped = [
            (peer.name, "up" if key == "up_drops" else "down", a[key] - b[key])
            for peer, a, b in zip(self.scenario, self.lab.counters(), before, strict=True)
            for key in ("up_drops", "down_drops")
            if a[key] > b[key]
        ]
        self.drops.append(sum(n for _, _, n in dropped))
        drops = [f"{name} {way} {n}" for name, way, n in dropped]
        uploads = [
            reply["upload"]
            for reply in self.group.request(
                [{"cmd": "estimates"}] * len(self.group), timeout=self.timeout
            )
        ]
        self.log(
            f"  adaptive {label:<22}: {result.seconds:6.3f} s (predicted {predicted:.3f} s,"
            f" ×{result.seconds / predicted:.2f}); shares "
            + " ".join(f"{w:.2f}" for w in shares)
            + f"; shaper drops: {', '.join(drops) or 'none'}; upload estimates after (Mbit/s): "
            + " ".join("-" if u is None else f"{u * 8e-6:.0f}" for u in uploads)
        )
        return result.seconds

    def probe(self, who: Sequence[int]) -> None:
        """Let each of ``who`` probe all the other peers at once, one prober at a time."""
        for i in who:
            commands: list[dict[str, Any]] = [{"cmd": "estimates"}] * len(self.group)
            commands[i] = {
                "cmd": "probe",
                "targets": [str(a) for j, a in enumerate(self.addresses) if j != i],
                "seconds": PROBE_SECONDS,
            }
            reply = self.group.request(commands, timeout=self.timeout)[i]
            if not reply.get("probed"):
                raise RuntimeError(f"{self.scenario[i].name}: no probe answered")

    def plan(self, vector_bytes: int) -> tuple[tuple[float, ...], float]:
        """Re-probe who asks for it, then plan on what every peer would announce."""
        replies = self.group.request([{"cmd": "estimates"}] * len(self.group), timeout=self.timeout)
        stale = [i for i, reply in enumerate(replies) if reply["needs_probe"]]
        if stale:
            self.log(f"  adaptive: {len(stale)} peer(s) ran late and probe again")
            self.probe(stale)
        return _plan(_estimates(self.group, self.scenario, self.timeout), vector_bytes)


def run_adaptive(
    *,
    vector_bytes: int,
    chunk_bytes: int,
    repeats: int,
    timeout: float,
    log: Callable[[str], None],
    throttle_rounds: int = 10,
    throttle_after: int = 3,
    rtt_ms: float = 40.0,
    rtt_sizes_mib: Sequence[int] = (1, 16),
    scenario: Sequence[HeteroPeer] = SCENARIO,
    pacing: bool = False,
) -> dict[str, Any]:
    """Run the measured, throttle and RTT scenarios; return their JSON fields."""
    numel = vector_bytes // 4
    env = python_env()
    out: dict[str, Any] = {}
    links = [peer.link for peer in scenario]
    configured = [peer.capacity() for peer in scenario]
    # -- measured, then throttle, on one lab --------------------------------------------------
    with StarLab(links) as lab, PeerGroup("p2ptrain-adaptive", env=env) as group:
        hosts = [lab.host_address(i) for i in range(len(scenario))]
        addresses = start_p2ptrain(group, hosts, wrap=lab.argv, timeout=timeout, pacing=pacing)
        runner = _Runner(lab, group, addresses, scenario, chunk_bytes, timeout, log)
        runner.probe(range(len(scenario)))
        probed = _estimates(group, scenario, timeout)
        log(
            "  adaptive probe estimates (Mbit/s up/down): "
            + ", ".join(
                f"{p.name} {c.upload_bytes_per_s * 8e-6:.0f}/{c.download_bytes_per_s * 8e-6:.0f}"
                for p, c in zip(scenario, probed, strict=True)
            )
        )
        achieved, predicted = [], []
        for attempt in range(1 + repeats):
            shares, pred = runner.plan(vector_bytes)
            seconds = runner.round(
                f"measured {'warm-up' if attempt == 0 else attempt}", shares, pred, numel
            )
            if attempt:
                achieved.append(seconds)
                predicted.append(pred)
        final = _estimates(group, scenario, timeout)
        out["measured_lp_s"] = round(statistics.median(achieved), 4)
        out["measured_predicted_s"] = round(statistics.median(predicted), 4)
        out["measured_runs_s"] = [round(x, 4) for x in achieved]
        out["measured_drops"] = runner.drops[-repeats:]
        out["measured_rates_mbit"] = {
            p.name: {
                "configured_up": p.link.upload_mbit,
                "configured_down": p.link.download_mbit,
                "measured_up": round(c.upload_bytes_per_s * 8e-6, 1),
                "measured_down": round(c.download_bytes_per_s * 8e-6, 1),
            }
            for p, c in zip(scenario, final, strict=True)
        }
        # -- throttle: dc 1000 -> 100 Mbit/s after round ``throttle_after`` --------------------
        slow = LinkSpec(100, 100)
        new_rates = list(configured)
        new_rates[0] = replace(scenario[0], link=slow).capacity()
        new_shares, throttle_predicted = _plan(new_rates, vector_bytes)
        rounds: list[dict[str, float]] = []
        for r in range(1, throttle_rounds + 1):
            if r == throttle_after + 1:
                lab.set_link(0, slow)
                rate = f"{slow.upload_mbit:g}/{slow.download_mbit:g}"
                log(f"  adaptive throttle: dc now {rate} Mbit/s")
            shares, pred = runner.plan(vector_bytes)
            seconds = runner.round(f"throttle round {r}", shares, pred, numel)
            rounds.append(
                {
                    "round": r,
                    "achieved_s": round(seconds, 4),
                    "predicted_s": round(pred, 4),
                    "drops": runner.drops[-1],
                }
            )
        after = rounds[throttle_after:]
        adapted = next(
            (
                i + 1
                for i, row in enumerate(after)
                if row["achieved_s"] <= throttle_predicted * (1 + ADAPT_TOLERANCE)
            ),
            None,
        )
        out["throttle_rounds_to_adapt"] = adapted
        # Adapted: from that round on; else every round after the first re-plan.
        settled = after[adapted - 1 :] if adapted is not None else after[1:]
        out["throttle_s"] = round(statistics.median(r["achieved_s"] for r in settled), 4)
        out["throttle_predicted_s"] = round(throttle_predicted, 4)
        out["throttle_fluid_predicted_s"] = round(_fluid_s(new_rates, vector_bytes), 4)
        out["throttle_rounds"] = rounds
        # For reference, on the same throttled links: the plan of the configured new rates.
        reference = [
            runner.round(f"throttle configured {a}", new_shares, throttle_predicted, numel)
            for a in range(2)
        ]
        out["throttle_configured_plan_s"] = round(min(reference), 4)
        # Adaptation on its own: the first round after the change within 15 % of
        # what the configured new rates' plan achieved on the same links (the goal
        # above also needs the model's prediction for those rates to be right).
        out["throttle_rounds_to_match_configured"] = next(
            (
                i + 1
                for i, row in enumerate(after)
                if row["achieved_s"] <= min(reference) * (1 + ADAPT_TOLERANCE)
            ),
            None,
        )
    # -- RTT --------------------------------------------------------------------------------
    rows = []
    with (
        StarLab(links, delay_ms=rtt_ms / 2) as lab,
        PeerGroup("p2ptrain-rtt", env=env) as group,
    ):
        hosts = [lab.host_address(i) for i in range(len(scenario))]
        addresses = start_p2ptrain(group, hosts, wrap=lab.argv, timeout=timeout, pacing=pacing)
        runner = _Runner(lab, group, addresses, scenario, chunk_bytes, timeout, log)
        replies = group.request(
            [
                {"cmd": "rtt", "targets": [str(a) for j, a in enumerate(addresses) if j != i]}
                for i in range(len(addresses))
            ],
            timeout=timeout,
        )
        rtts = [reply["rtt"] for reply in replies]
        # Fed the configured rates, as the LP is: each peer's typed-in rates
        # (what its bulk streams are paced at; the plan below does not use them).
        group.request(
            [
                {"cmd": "cap", "upload": c.upload_bytes_per_s, "download": c.download_bytes_per_s}
                for c in (peer.link_capacity() for peer in scenario)
            ],
            timeout=timeout,
        )
        log("  adaptive RTTs (ms): " + ", ".join(f"{x * 1e3:.1f}" for x in rtts))
        peers = [replace(c, rtt_s=rtt) for c, rtt in zip(configured, rtts, strict=True)]
        for mib in rtt_sizes_mib:
            size = mib * MiB
            shares, pred = _plan(peers, size)
            achieved = []
            for a in range(1 + repeats):
                time.sleep(RTT_ROUND_GAP_S)
                label = f"rtt {mib} MiB {'warm-up' if a == 0 else a}"
                achieved.append(runner.round(label, shares, pred, size // 4))
            drops = runner.drops[-repeats:]
            back_to_back = [
                runner.round(f"rtt {mib} MiB back to back {a + 1}", shares, pred, size // 4)
                for a in range(repeats)
            ]
            rows.append(
                {
                    "mib": mib,
                    "achieved_s": round(statistics.median(achieved[1:]), 4),
                    "predicted_s": round(pred, 4),
                    "predicted_without_latency_s": round(_plan(configured, size)[1], 4),
                    "runs_s": [round(x, 4) for x in achieved[1:]],
                    "drops": drops,
                    "gap_s": RTT_ROUND_GAP_S,
                    "back_to_back_s": [round(x, 4) for x in back_to_back],
                    "back_to_back_drops": runner.drops[-repeats:],
                }
            )
    out["rtt_rows"] = rows
    out["rtt_ms"] = rtt_ms
    out["measured_rtt_s"] = [round(x, 4) for x in rtts]
    return out
