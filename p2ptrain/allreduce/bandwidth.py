"""The all-reduce's view of :class:`~p2ptrain.measure.meters.ThroughputMeter`.

The meter itself lives in :mod:`p2ptrain.measure.meters` (below both the
all-reduce and the NAT code); this subclass adds what needs all-reduce types:
recording a round's report and turning the rates into a :class:`PeerCapacity`.
"""

from __future__ import annotations

from p2ptrain.allreduce.partition import PeerCapacity
from p2ptrain.allreduce.report import AllReduceReport
from p2ptrain.measure.meters import ThroughputConfig
from p2ptrain.measure.meters import ThroughputMeter as _Meter

__all__ = ["ThroughputConfig", "ThroughputMeter"]


class ThroughputMeter(_Meter):
    """Moving averages of a peer's achieved upload and download rates (sender-side upload)."""

    def record_round(self, report: AllReduceReport) -> None:
        """Record the transfers of an all-reduce round."""
        self.record_upload(report.bytes_sent, report.send_s)
        self.record_download(report.bytes_received, report.receive_s)

    def capacity(
        self,
        *,
        default_bytes_per_s: float,
        samples_per_s: float = 0.0,
        client_mode: bool = False,
        computes: bool = True,
    ) -> PeerCapacity:
        """This peer's :class:`PeerCapacity` for the load balancer.

        Args:
            default_bytes_per_s: The rate to assume in a direction with no
                explicit value and no measurement yet.
            samples_per_s: Compute throughput.
            client_mode: Whether the peer cannot accept connections.
            computes: Whether it computes gradients.
        """
        upload = self.upload_bytes_per_s
        download = self.download_bytes_per_s
        return PeerCapacity(
            upload_bytes_per_s=default_bytes_per_s if upload is None else upload,
            download_bytes_per_s=default_bytes_per_s if download is None else download,
            samples_per_s=samples_per_s,
            client_mode=client_mode,
            computes=computes,
        )
