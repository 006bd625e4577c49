"""The heterogeneous-bandwidth part of the all-reduce benchmark.

Eight peers, each in its own network namespace of a :class:`StarLab`, with
``tc tbf`` links (Mbit/s, upload / download):

=========  ===========  =========================================================
peer       links        role
=========  ===========  =========================================================
dc         1000 / 1000  a well-connected server
lab        200 / 200    a university lab machine
home1..5   50 / 100     home connections (upload slower than download)
client     50 / 100     a home behind NAT: client mode, never aggregates
=========  ===========  =========================================================

Why these rates. Every computing peer moves at least one whole vector each
way, so the 50 Mbit/s uploads bound any plan: ``T ≥ V/(50 Mbit/s)``. Equal
shares (1/7 each; the client has 0) make each home move ``1 + 6/7`` vectors
through that upload, while the LP moves the aggregation onto ``dc`` and
``lab``, which have room for it, and leaves the homes one vector each: the
predicted speedup is the largest possible with slow peers binding,
``1 + 6/7 ≈ 1.86`` (``2(n−1)/n`` when everybody aggregates). The scenario the
brief suggested (1000, six × 100, a client with 50 Mbit/s upload) predicts no
gain at all: there the client's own upload binds both plans.

The LP is fed the configured tbf rates as peers that typed them in announce
them: the TCP payload they carry (``p2ptrain.measure.payload_rate``, 1448 of
every 1514 bytes). What p2ptrain's own
``ThroughputMeter`` records from the round reports is shown next to them, as
the input a swarm would use instead, with the plan the LP would make of it.

Size: 16 MiB, so that a round lasts a few seconds and its fixed costs (start
skew, the last chunk's average travelling back: some 50–100 ms) stay small
against the ~2.7 s the LP predicts; chunks of 256 KiB keep that tail short.
What limits the round is measured, not guessed: the shapers' counters give
each link's bytes on the wire per round, hence the least time the busiest
link needed (headers and ACKs included) and how long it stood idle.

TCP uses CUBIC in the lab (set per route, as a namespace may only take the
machine's unprivileged algorithms as its default): this machine defaults to
BBR, which with several flows into a 50 ms tbf queue dropped thousands of
packets per round and left links idle.

Rounds: p2ptrain with the LP's shares and with equal shares, interleaved
(a warm-up of each first), then torch.distributed gloo on the same
namespaces. gloo has no client mode: its ring needs every rank to accept a
connection, so the client takes part as an ordinary rank (the lab lets it);
the ring model predicts ``2(n−1)/n · V / min_i min(u_i, d_i)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from benchmarks.allreduce.runner import PeerGroup, Round, run_round
from benchmarks.allreduce.systems import (
    p2ptrain_plan,
    p2ptrain_prepares,
    start_gloo,
    start_p2ptrain,
    vector_prepares,
)
from p2ptrain.allreduce import ThroughputMeter
from p2ptrain.allreduce.fairshare import fair_share_round_time
from p2ptrain.allreduce.lp import LoadBalancer, PeerCapacity
from p2ptrain.allreduce.partition import equal_shares, evaluate_round_time
from p2ptrain.lab.natlab.netns import python_env
from p2ptrain.lab.starlab import LinkSpec, StarLab
from p2ptrain.measure import payload_rate

__all__ = ["SCENARIO", "HeteroPeer", "HeteroResult", "Prediction", "predict", "run_hetero"]

GLOO_PORT = 29500
"""Port of gloo's TCP store on rank 0's namespace (a fresh namespace: always free)."""


@dataclass(frozen=True)
class HeteroPeer:
    """One peer of the scenario."""

    name: str
    link: LinkSpec
    client: bool = False

    def capacity(self) -> PeerCapacity:
        """What the load balancer is told: the tbf rates as a peer that typed them in
        announces them, the TCP payload they carry (:func:`~p2ptrain.measure.payload_rate`)."""
        link = self.link_capacity()
        return replace(
            link,
            upload_bytes_per_s=payload_rate(link.upload_bytes_per_s),
            download_bytes_per_s=payload_rate(link.download_bytes_per_s),
        )

    def link_capacity(self) -> PeerCapacity:
        """The tbf rates themselves (frame bytes/s): what a peer types in."""
        return PeerCapacity(
            upload_bytes_per_s=self.link.upload_bytes_per_s,
            download_bytes_per_s=self.link.download_bytes_per_s,
            client_mode=self.client,
        )


SCENARIO: tuple[HeteroPeer, ...] = (
    HeteroPeer("dc", LinkSpec(1000, 1000)),
    HeteroPeer("lab", LinkSpec(200, 200)),
    *(HeteroPeer(f"home{i}", LinkSpec(50, 100)) for i in range(1, 6)),
    HeteroPeer("client", LinkSpec(50, 100), client=True),
)


@dataclass(frozen=True)
class Prediction:
    """What the models predict for one vector size."""

    lp_shares: tuple[float, ...]
    equal_shares: tuple[float, ...]
    lp_s: float
    equal_s: float
    gloo_ring_s: float
    lp_link_rates_s: float
    """The LP plan's time with the tbf rates taken as payload rates (headers ignored)."""
    equal_link_rates_s: float
    lp_fluid_s: float
    """The LP's own (fluid) time for its plan; ``lp_s`` is its fair-share time."""


def predict(scenario: Sequence[HeteroPeer], vector_bytes: int) -> Prediction:
    """Plan the scenario with the LP and evaluate equal shares and gloo's ring.

    Both plans' times are their fair-share times
    (:func:`~p2ptrain.allreduce.fairshare.fair_share_round_time`), the prediction
    p2ptrain's matchmaking gives a plan.
    """
    peers = [peer.capacity() for peer in scenario]
    plan = LoadBalancer().plan(peers, vector_bytes=vector_bytes, target_batch_size=1)
    equal = tuple(equal_shares(peers))
    link_rates = [peer.link_capacity() for peer in scenario]
    n = len(scenario)
    slowest = min(min(p.upload_bytes_per_s, p.download_bytes_per_s) for p in peers)
    return Prediction(
        lp_shares=plan.shares,
        equal_shares=equal,
        lp_s=fair_share_round_time(plan.shares, peers, vector_bytes),
        equal_s=fair_share_round_time(equal, peers, vector_bytes),
        gloo_ring_s=2 * (n - 1) / n * vector_bytes / slowest,
        lp_link_rates_s=fair_share_round_time(plan.shares, link_rates, vector_bytes),
        equal_link_rates_s=fair_share_round_time(equal, link_rates, vector_bytes),
        lp_fluid_s=plan.round_time_s,
    )


@dataclass
class HeteroResult:
    """Everything measured in the star lab."""

    scenario: tuple[HeteroPeer, ...]
    vector_bytes: int
    chunk_bytes: int
    prediction: Prediction
    lp: list[Round] = field(default_factory=list)
    equal: list[Round] = field(default_factory=list)
    gloo: list[Round] = field(default_factory=list)
    wire: dict[str, list[list[dict[str, int]]]] = field(
        default_factory=lambda: {"lp": [], "equal": [], "gloo": []}
    )
    """Per plan, per timed round, per peer: the shapers' byte and drop counts in that round."""

    def wire_limited_s(self, kind: str) -> list[tuple[float, str]]:
        """Per timed round of ``kind``: the busiest link's wire time and which link it is.

        A link's wire time is the frames tbf passed in the round over its
        rate: the least time the round could have taken given what was
        really sent. Against the prediction it shows the byte overhead
        (Ethernet/IP/TCP headers, ACKs, messages); against the achieved time,
        how long that link stood idle.
        """
        out = []
        for counts in self.wire[kind]:
            best = (0.0, "")
            for peer, count in zip(self.scenario, counts, strict=True):
                for direction, rate in (
                    ("up", peer.link.upload_bytes_per_s),
                    ("down", peer.link.download_bytes_per_s),
                ):
                    seconds = count[f"{direction}_bytes"] / rate
                    if seconds > best[0]:
                        best = (seconds, f"{peer.name} {direction}load")
            out.append(best)
        return out

    def meter_rates(self) -> list[tuple[float | None, float | None]]:
        """Per peer, the upload and download rates (bytes/s) p2ptrain's meter would report.

        Every timed p2ptrain round's report goes through a
        :class:`~p2ptrain.allreduce.ThroughputMeter` per peer (LP and equal
        rounds alternately, as they ran), exactly as a swarm would record them.
        """
        meters = [ThroughputMeter() for _ in self.scenario]
        for pair in zip(self.lp, self.equal, strict=True):
            for round_ in pair:
                for meter, outcome in zip(meters, round_.outcomes, strict=True):
                    detail = outcome["detail"]
                    meter.record_upload(detail["bytes_sent"], detail["send_s"])
                    meter.record_download(detail["bytes_received"], detail["receive_s"])
        return [(m.upload_bytes_per_s, m.download_bytes_per_s) for m in meters]

    def meter_plan(self) -> tuple[tuple[float, ...], float]:
        """The LP's shares when fed the meter's rates, and their time on the real links."""
        peers = []
        for peer, (up, down) in zip(self.scenario, self.meter_rates(), strict=True):
            configured = peer.capacity()
            peers.append(
                PeerCapacity(
                    upload_bytes_per_s=up or configured.upload_bytes_per_s,
                    download_bytes_per_s=down or configured.download_bytes_per_s,
                    client_mode=peer.client,
                )
            )
        plan = LoadBalancer().plan(peers, vector_bytes=self.vector_bytes, target_batch_size=1)
        real = [peer.capacity() for peer in self.scenario]
        return plan.shares, evaluate_round_time(plan.shares, real, self.vector_bytes)


def run_hetero(
    *,
    vector_bytes: int,
    chunk_bytes: int,
    repeats: int,
    timeout: float,
    log: Callable[[str], None],
    scenario: Sequence[HeteroPeer] = SCENARIO,
    congestion_control: str | None = "cubic",
    pacing: bool = False,
) -> HeteroResult:
    """Build the lab, run the p2ptrain rounds (LP and equal) and gloo's, tear it all down."""
    numel = vector_bytes // 4
    prediction = predict(scenario, vector_bytes)
    result = HeteroResult(tuple(scenario), vector_bytes, chunk_bytes, prediction)
    clients = [i for i, peer in enumerate(scenario) if peer.client]
    env = python_env()
    links = [peer.link for peer in scenario]
    with StarLab(links, congestion_control=congestion_control) as lab:
        log(f"  star lab {lab.lab_id}: {len(scenario)} namespaces with tbf links")
        hosts = [lab.host_address(i) for i in range(len(scenario))]
        with PeerGroup("p2ptrain-hetero", env=env) as group:
            addresses = start_p2ptrain(group, hosts, wrap=lab.argv, timeout=timeout, pacing=pacing)
            plans: dict[str, tuple[tuple[float, ...], float]] = {
                "lp": (prediction.lp_shares, prediction.lp_s),
                "equal": (prediction.equal_shares, prediction.equal_s),
            }
            for attempt in range(1 + repeats):
                for kind, (shares, predicted) in plans.items():
                    plan = p2ptrain_plan(
                        addresses,
                        shares,
                        numel,
                        clients=clients,
                        chunk_elements=chunk_bytes // 4,
                        timeout=timeout,
                        predicted_s=predicted,
                    )
                    round_, wire = _round(lab, group, p2ptrain_prepares(plan), timeout)
                    log(_describe(f"p2ptrain {kind}", attempt, round_, predicted))
                    if attempt:
                        getattr(result, kind).append(round_)
                        result.wire[kind].append(wire)
        with PeerGroup("gloo-hetero", env=env) as group:
            master = f"{hosts[0]}:{GLOO_PORT}"
            start_gloo(group, master, len(scenario), ifname="eth0", wrap=lab.argv, timeout=timeout)
            for attempt in range(1 + repeats):
                round_, wire = _round(lab, group, vector_prepares(len(scenario), numel), timeout)
                log(_describe("gloo", attempt, round_, prediction.gloo_ring_s))
                if attempt:
                    result.gloo.append(round_)
                    result.wire["gloo"].append(wire)
    return result


def _round(
    lab: StarLab, group: PeerGroup, prepares: list[dict[str, Any]], timeout: float
) -> tuple[Round, list[dict[str, int]]]:
    """One round, with what each shaper passed during it."""
    before = lab.counters()
    round_ = run_round(group, prepares, prepare_timeout=timeout, round_timeout=timeout)
    after = lab.counters()
    wire = [{key: a[key] - b[key] for key in a} for a, b in zip(after, before, strict=True)]
    return round_, wire


def _describe(label: str, attempt: int, round_: Round, predicted: float) -> str:
    kind = "warm-up" if attempt == 0 else f"run {attempt}"
    return (
        f"  hetero {label:<14} {kind:>8}: {round_.seconds:6.3f} s"
        f" (predicted {predicted:.3f} s, ×{round_.seconds / predicted:.2f})"
    )
