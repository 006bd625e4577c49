"""Collectors that read each layer's figures into a :class:`~p2ptrain.metrics.Metrics` registry.

The registry (:mod:`p2ptrain.metrics`) knows no layer; these callbacks, run at
scrape time, do: a node's connections and bytes per path, a DHT node's
requests, a peer's NAT traversals, and what a bootstrap peer serves others.
The all-reduce rounds' collector lives with the trainer's figures
(:func:`p2ptrain.train.round_stats.allreduce_collector`). See
docs/observability.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from p2ptrain.dht.node import DHTNode
from p2ptrain.dht.stats import LATENCY_BUCKETS
from p2ptrain.metrics import Sample, counter_sample, histogram_samples
from p2ptrain.nat.service import NATService
from p2ptrain.nat.stats import TRAVERSAL_BUCKETS

__all__ = ["bootstrap_collector", "dht_collector", "nat_collector", "node_collector"]


class _TrafficSource(Protocol):
    def traffic_by_path(self) -> dict[str, tuple[int, int]]: ...

    def connections(self) -> list[Any]: ...


def node_collector(node: _TrafficSource) -> Callable[[], list[Sample]]:
    """A collector of a node's open connections and their bytes per path.

    Use ``metrics.add_collector(node_collector(node))``. Bytes are
    counters since the node started (closed connections keep counting).
    """

    def collect() -> list[Sample]:
        samples = [Sample("p2ptrain_connections_open", len(node.connections()))]
        for path, (sent, received) in sorted(node.traffic_by_path().items()):
            labels = {"path": path}
            samples.append(counter_sample("p2ptrain_path_bytes_sent_total", sent, labels))
            samples.append(counter_sample("p2ptrain_path_bytes_received_total", received, labels))
        return samples

    return collect


def dht_collector(node: DHTNode) -> Callable[[], list[Sample]]:
    """A collector of a DHT node's requests by method, failures, latency and table size.

    Use ``metrics.add_collector(dht_collector(peer.dht.dht_node))``.
    """
    stats = node.stats

    def collect() -> list[Sample]:
        samples = [
            Sample("p2ptrain_dht_peers_known", len(node.routing_table)),
            Sample("p2ptrain_dht_records_held", len(node.records)),
        ]
        for method, count in sorted(dict(stats.sent).items()):
            labels = {"method": method}
            samples.append(counter_sample("p2ptrain_dht_requests_total", count, labels))
            seconds = stats.answer_seconds.get(method, 0.0)
            counts = stats.answer_buckets.get(method, [0] * (len(LATENCY_BUCKETS) + 1))
            samples += histogram_samples(
                "p2ptrain_dht_response_seconds", LATENCY_BUCKETS, counts, seconds, labels
            )
        for (method, reason), count in sorted(dict(stats.failed).items()):
            labels = {"method": method, "reason": reason}
            samples.append(counter_sample("p2ptrain_dht_request_failures_total", count, labels))
        for method, count in sorted(dict(stats.served).items()):
            labels = {"method": method}
            samples.append(counter_sample("p2ptrain_dht_requests_served_total", count, labels))
        return samples

    return collect


def nat_collector(service: NATService) -> Callable[[], list[Sample]]:
    """A collector of a peer's NAT traversals: paths taken, fallbacks, failures, durations.

    Use ``metrics.add_collector(nat_collector(peer.nat))`` on a peer running
    NAT traversal.
    """
    stats = service.stats

    def collect() -> list[Sample]:
        connected = dict(stats.connected)
        samples = [
            counter_sample("p2ptrain_nat_traversal_failures_total", stats.failed),
            counter_sample("p2ptrain_nat_crossing_dials_total", stats.crossing),
            counter_sample("p2ptrain_nat_refused_total", service.refused),
        ]
        samples += histogram_samples(
            "p2ptrain_nat_traversal_seconds", TRAVERSAL_BUCKETS, list(stats.buckets), stats.seconds
        )
        for path, count in sorted(connected.items()):
            samples.append(counter_sample("p2ptrain_nat_traversals_total", count, {"path": path}))
        for attempt, count in sorted(dict(stats.fallbacks).items()):
            samples.append(counter_sample("p2ptrain_nat_fallbacks_total", count, {"path": attempt}))
        return samples

    return collect


def bootstrap_collector(service: NATService) -> Callable[[], list[Sample]]:
    """A collector of what a public peer serves others: STUN answers and relay circuits.

    Use ``metrics.add_collector(bootstrap_collector(nat))`` on a bootstrap
    peer (``p2ptrain bootstrap`` does); relay figures appear when it relays.
    """

    def collect() -> list[Sample]:
        responders = [r for r in (service.stun, service.stun_alt) if r is not None]
        samples = [
            counter_sample("p2ptrain_stun_answers_total", sum(r.answered for r in responders)),
            counter_sample("p2ptrain_stun_ignored_total", sum(r.ignored for r in responders)),
        ]
        server = service.rendezvous_server
        relay = None if server is None else server.relay
        if relay is not None:
            samples += [
                Sample("p2ptrain_relay_circuits_open", relay.active),
                counter_sample("p2ptrain_relay_circuits_total", relay.opened),
                counter_sample("p2ptrain_relay_circuits_refused_total", relay.refused),
                counter_sample("p2ptrain_relay_bytes_total", relay.relayed_bytes),
            ]
        return samples

    return collect
