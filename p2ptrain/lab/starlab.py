"""A star of shaped links: the heterogeneous all-reduce benchmark and ``p2ptrain demo --shaped``.

N hosts, each in its own network namespace, hang off one Linux bridge in a
hub namespace (built with the NAT lab's plumbing, ``p2ptrain.lab.natlab.netns``)::

    host i (netns <lab>-p<i>)                hub (netns <lab>-hub)
      eth0 10.77.0.(i+1)/24  <--veth-->  h<i> --- br0 --- h<j> ...
      tbf on eth0 egress = upload            tbf on h<i> egress = download

Upload is shaped where packets leave the host (``eth0``), download where the
bridge hands them to the host (``h<i>``), both with ``tc tbf`` as the NAT lab
does (burst ``max(16 KiB, rate/250)``, queue ``latency`` 50 ms). tbf counts
whole Ethernet frames, so TCP goodput is about 1448/1514 ≈ 96 % of the rate.
No traffic leaves the namespaces. Building it needs CAP_NET_ADMIN; the lab is
always torn down (namespaces deleted, whatever runs in them killed), and
namespaces a crashed run left behind are removed on the next start.

Latency (``delay_ms``): the kernel has no netem, so each host's outgoing
packets to the lab subnet are routed through the NAT lab's user-space shim
(the compiled one where a C compiler is found, :mod:`p2ptrain.lab.natlab.native_shim`,
else :mod:`p2ptrain.lab.lossy_link`) on a tun device in the host's own
namespace, which holds them ``delay_ms`` and writes them back; they then
leave through ``eth0`` and its tbf as before::

    rule 100  iif t0 lookup main                  # back from the shim: out eth0
    rule 200  iif lo to 10.77.0.0/24 lookup 100   # locally sent: into the shim
    table 100: 10.77.0.0/24 dev t0

Every host delays its own sends, so a round trip between two hosts is
``2 · delay_ms``. :meth:`StarLab.set_link` re-shapes a host's link while the
lab runs (the throttle scenario).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from p2ptrain.lab.natlab.lab import tbf_args
from p2ptrain.lab.natlab.netns import (
    cleanup_stale_labs,
    delete_netns,
    missing_tools,
    netns_argv,
    new_lab_id,
    run_cmd,
    unavailable_reason,
)
from p2ptrain.lab.natlab.shim import ShimLink, start_shim, stop_shim

__all__ = ["LinkSpec", "StarLab", "unavailable_reason"]

PREFIX = "p2pab"
"""Namespace prefix of this benchmark's labs (distinct from the NAT lab's)."""
SUBNET = "10.77.0"
SHAPER_LATENCY_MS = 50


@dataclass(frozen=True)
class LinkSpec:
    """One host's access link.

    Attributes:
        upload_mbit: Upload rate, Mbit/s (10^6 bit/s).
        download_mbit: Download rate, Mbit/s.
    """

    upload_mbit: float
    download_mbit: float

    @property
    def upload_bytes_per_s(self) -> float:
        """The tbf rate in bytes per second (what the load balancer is told)."""
        return self.upload_mbit * 1e6 / 8

    @property
    def download_bytes_per_s(self) -> float:
        """The tbf rate in bytes per second."""
        return self.download_mbit * 1e6 / 8


class StarLab:
    """Hosts with shaped links on one bridge; use as a context manager.

    Args:
        links: One link per host.
        congestion_control: TCP congestion control of the hosts (``sysctl
            net.ipv4.tcp_congestion_control`` in their namespaces), or None
            to keep what new namespaces inherit from the machine.
    """

    def __init__(
        self,
        links: Sequence[LinkSpec],
        *,
        congestion_control: str | None = "cubic",
        delay_ms: float = 0.0,
    ) -> None:
        if not 1 <= len(links) <= 200:
            raise ValueError("a star lab has 1 to 200 hosts")
        if not 0 <= delay_ms <= 1000:
            raise ValueError("delay_ms must be in [0, 1000]")
        self.links = list(links)
        self.congestion_control = congestion_control
        self.delay_ms = delay_ms
        self.lab_id = ""
        self._namespaces: list[str] = []
        self._shims: list[subprocess.Popen[str]] = []

    def host_address(self, index: int) -> str:
        """Host ``index``'s IPv4 address."""
        return f"{SUBNET}.{index + 1}"

    def netns(self, index: int) -> str:
        """Host ``index``'s namespace."""
        return f"{self.lab_id}-p{index}"

    def argv(self, index: int, argv: Sequence[str]) -> list[str]:
        """A command line that runs ``argv`` in host ``index``'s namespace."""
        return netns_argv(self.netns(index), argv)

    def start(self) -> None:
        """Build the namespaces, the bridge and the shapers."""
        reason = unavailable_reason()
        if reason is not None:
            raise PermissionError(reason)
        missing = missing_tools(turn=False)
        if missing:
            raise RuntimeError(f"missing tools: {', '.join(missing)}")
        cleanup_stale_labs(PREFIX)
        self.lab_id = new_lab_id(PREFIX)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        hub = self._add_namespace(f"{self.lab_id}-hub")
        hub_batch = ["link add br0 type bridge", "link set dev br0 up"]
        for index in range(len(self.links)):
            netns = self._add_namespace(self.netns(index))
            hub_batch += [
                f"link add h{index} type veth peer name eth0 netns {netns}",
                f"link set dev h{index} master br0",
                f"link set dev h{index} up",
            ]
        _ip_batch(hub, hub_batch)
        for index, link in enumerate(self.links):
            netns = self.netns(index)
            _ip_batch(
                netns,
                [
                    f"address add {self.host_address(index)}/24 dev eth0",
                    "link set dev eth0 up",
                ],
            )
            if self.congestion_control is not None:
                # Per route: a namespace's sysctl default only takes the
                # algorithms the machine allows unprivileged users.
                _ip_batch(
                    netns,
                    [
                        f"route replace {SUBNET}.0/24 dev eth0 src {self.host_address(index)}"
                        f" congctl {self.congestion_control}"
                    ],
                )
            run_cmd(
                [
                    "tc",
                    "-n",
                    netns,
                    *tbf_args("eth0", link.upload_mbit, latency_ms=SHAPER_LATENCY_MS),
                ]
            )
            run_cmd(
                [
                    "tc",
                    "-n",
                    hub,
                    *tbf_args(f"h{index}", link.download_mbit, latency_ms=SHAPER_LATENCY_MS),
                ]
            )
            if self.delay_ms > 0:
                self._delay(index)

    def _delay(self, index: int) -> None:
        """Route host ``index``'s sends through a delay shim in its namespace."""
        netns = self.netns(index)
        log_dir = Path(tempfile.mkdtemp(prefix=f"{self.lab_id}-shim-"))
        link = ShimLink(
            f"p{index}", "eth0", "t0", self.host_address(index), 100, self.delay_ms, 0.0, index
        )
        self._shims.append(start_shim(netns, link, log_dir=log_dir, timeout=30.0))
        for key in (
            "ip_forward",
            "conf.all.rp_filter",
            "conf.t0.rp_filter",
            "conf.default.rp_filter",
        ):
            run_cmd(
                netns_argv(
                    netns,
                    ["sysctl", "-q", "-w", f"net.ipv4.{key}={1 if key == 'ip_forward' else 0}"],
                )
            )
        run_cmd(netns_argv(netns, ["sysctl", "-q", "-w", "net.ipv4.conf.t0.accept_local=1"]))
        congctl = f" congctl {self.congestion_control}" if self.congestion_control else ""
        _ip_batch(
            netns,
            [
                "link set dev t0 up",
                f"route add {SUBNET}.0/24 dev t0 src {self.host_address(index)} table 100{congctl}",
                "rule add priority 100 iif t0 lookup main",
                f"rule add priority 200 iif lo to {SUBNET}.0/24 lookup 100",
            ],
        )

    def set_link(self, index: int, link: LinkSpec) -> None:
        """Re-shape host ``index``'s link (both tbfs replaced) while the lab runs."""
        hub = f"{self.lab_id}-hub"
        up = tbf_args("eth0", link.upload_mbit, latency_ms=SHAPER_LATENCY_MS)
        down = tbf_args(f"h{index}", link.download_mbit, latency_ms=SHAPER_LATENCY_MS)
        up[1] = down[1] = "replace"
        run_cmd(["tc", "-n", self.netns(index), *up])
        run_cmd(["tc", "-n", hub, *down])
        self.links[index] = link

    def counters(self) -> list[dict[str, int]]:
        """Per host, what its shapers passed and dropped so far (``tc -s qdisc``).

        Keys: ``up_bytes``, ``up_drops`` (the tbf on its ``eth0``),
        ``down_bytes``, ``down_drops`` (the tbf on its bridge port). Bytes are
        whole frames as tbf counts them.
        """
        hub = f"{self.lab_id}-hub"
        result = []
        for index in range(len(self.links)):
            up = _tbf_stats(self.netns(index), "eth0")
            down = _tbf_stats(hub, f"h{index}")
            result.append(
                {
                    "up_bytes": up["bytes"],
                    "up_drops": up["drops"],
                    "down_bytes": down["bytes"],
                    "down_drops": down["drops"],
                }
            )
        return result

    def _add_namespace(self, name: str) -> str:
        run_cmd(["ip", "netns", "add", name])
        self._namespaces.append(name)
        run_cmd(
            netns_argv(
                name,
                [
                    "sysctl",
                    "-q",
                    "-w",
                    "net.ipv6.conf.all.disable_ipv6=1",
                    "net.ipv6.conf.default.disable_ipv6=1",
                ],
            )
        )
        run_cmd(["ip", "-n", name, "link", "set", "dev", "lo", "up"])
        return name

    def shim_argvs(self) -> list[list[str]]:
        """The command line of each running delay shim (compiled or Python)."""
        return [
            [str(arg) for arg in shim.args] if isinstance(shim.args, list) else [str(shim.args)]
            for shim in self._shims
        ]

    def close(self) -> None:
        """Kill what runs in the namespaces and delete them (hosts first, then the hub)."""
        for shim in self._shims:
            stop_shim(shim)
        self._shims = []
        errors = []
        for name in reversed(self._namespaces):
            try:
                delete_netns(name)
            except Exception as exc:  # keep deleting the others
                errors.append(f"{name}: {exc}")
        self._namespaces = []
        if errors:
            raise RuntimeError("could not delete: " + "; ".join(errors))

    def __enter__(self) -> StarLab:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _tbf_stats(netns: str, device: str) -> dict[str, int]:
    done = run_cmd(["tc", "-n", netns, "-s", "-j", "qdisc", "show", "dev", device])
    for qdisc in json.loads(done.stdout):
        if qdisc.get("kind") == "tbf":
            return {"bytes": int(qdisc["bytes"]), "drops": int(qdisc["drops"])}
    raise RuntimeError(f"no tbf on {device} in {netns}")


def _ip_batch(netns: str, lines: list[str]) -> None:
    run_cmd(["ip", "-n", netns, "-batch", "-"], stdin="\n".join(lines) + "\n")
