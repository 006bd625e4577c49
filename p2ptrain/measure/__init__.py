"""Measurement of the links between peers: the probe, the meters, the estimates.

Below both the all-reduce and the NAT code (which answer probes and report
what they timed); nothing here imports them.

* :mod:`~p2ptrain.measure.probe`: a short two-way bandwidth probe, timed
  where the bytes arrive, and its server.
* :mod:`~p2ptrain.measure.meters`: :class:`ThroughputMeter`, moving averages
  of achieved rates (sender-side upload; kept for comparison).
* :mod:`~p2ptrain.measure.estimates`: receiver-side stream timing and
  :class:`LinkEstimator`, the rates a peer announces (decayed maximum of the
  probe and every round, typed-in rates as caps).
* :mod:`~p2ptrain.measure.latency`: round-trip times per peer from the RPC
  layer's pings.
"""

from p2ptrain.measure.estimates import (
    TCP_PAYLOAD_FRACTION,
    ArrivalTimer,
    EstimatorConfig,
    LinkEstimator,
    StreamTiming,
    combined_rate,
    payload_rate,
)
from p2ptrain.measure.meters import ThroughputConfig, ThroughputMeter

__all__ = [
    "TCP_PAYLOAD_FRACTION",
    "ArrivalTimer",
    "EstimatorConfig",
    "LinkEstimator",
    "StreamTiming",
    "ThroughputConfig",
    "ThroughputMeter",
    "combined_rate",
    "payload_rate",
]
