"""A NAT lab made of real Linux network namespaces.

:class:`NatLab` builds, inside one machine, a small internet with home networks
behind NAT routers, a TURN/STUN server and public hosts, so that NAT traversal,
relaying and bandwidth-aware code can be tested and benchmarked with real
packets. It needs root (CAP_NET_ADMIN) and the ``ip``, ``tc``, ``iptables`` and
(for TURN) ``turnserver`` tools; see docs/nat-lab.md.

Topology (addresses for the default :class:`LabConfig`; docs/nat-lab.md has more)::

              inet: internet router, 100.64.0.1, default route blackhole,
                    delay/loss shims (tun t-<home> + policy routing)
      v-boot .1.1     v-turn .2.1      v-a .3.1        v-b .4.1        v-c .5.1
         |               |                |               |               |
    boot 100.64.1.2  turn 100.64.2.2  a.router .3.2   b.router .4.2   c.router .5.2
                     coturn :3478     MASQUERADE      MASQUERADE      --random-fully
                                         | lan .1.1      | lan .2.1      | lan .3.1
                                      a 192.168.1.2   b 192.168.2.2   c 192.168.3.2

Every home router forwards, masquerades on ``wan`` and drops unsolicited
inbound (conntrack NEW/INVALID) on ``wan`` in INPUT and FORWARD, as home routers
do; tbf shapes upload on ``wan`` and download on ``lan``. Delay and loss are
added by a user-space shim (:mod:`p2ptrain.lab.lossy_link`) in the internet
router (see :mod:`p2ptrain.lab.natlab.shim`).

Example::

    with NatLab(LabConfig(homes=(HomeConfig("a", upload_mbit=20), HomeConfig("b")))) as lab:
        proc = lab.python("a", ["-m", "mypeer", "--bootstrap", lab.node("boot").address])
        sock = lab.socket("b")  # a UDP socket living in home b's host
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

from p2ptrain.lab.natlab.config import DEFAULT_HOMES, HomeConfig, LabConfig, NatKind
from p2ptrain.lab.natlab.netns import (
    DEFAULT_PREFIX,
    NatLabError,
    call_in_netns,
    cleanup_stale_labs,
    delete_netns,
    missing_tools,
    netns_argv,
    netns_socket,
    new_lab_id,
    python_env,
    run_cmd,
    unavailable_reason,
)
from p2ptrain.lab.natlab.shim import ShimLink, shim_route_commands, start_shim, stop_shim
from p2ptrain.lab.natlab.turn import TurnServerInfo, stun_binding, turnserver_argv

__all__ = [
    "DEFAULT_HOMES",
    "DEFAULT_PREFIX",
    "Home",
    "HomeConfig",
    "LabConfig",
    "NatKind",
    "NatLab",
    "NatLabError",
    "Node",
    "TurnServerInfo",
    "cleanup_stale_labs",
    "tbf_args",
    "unavailable_reason",
]

logger = logging.getLogger(__name__)
_P = ParamSpec("_P")
_T = TypeVar("_T")

INTERNET_ADDRESS = "100.64.0.1"
TURN_PORT = 3478
_TURN_NAME = "turn"
_FIRST_TABLE = 100
_PROCESS_STOP_S = 3.0


@dataclass(frozen=True)
class Node:
    """One machine of the lab: a network namespace with an address.

    Attributes:
        name: Logical name: ``"inet"``, a public host (``"boot"``, ``"turn"``),
            a home's host (``"a"``) or a home's router (``"a.router"``).
        netns: The network namespace name (for ``ip netns exec``).
        address: Its main IPv4 address: public for public hosts and routers
            (the WAN side), private (192.168.i.2) for home hosts.
    """

    name: str
    netns: str
    address: str


@dataclass(frozen=True)
class Home:
    """A home network: one host behind one NAT router.

    Attributes:
        config: What was asked for.
        host: The home's host (private address).
        router: The NAT router; ``router.address`` is the home's public address.
        gateway: The router's LAN address (the host's default gateway).
    """

    config: HomeConfig
    host: Node
    router: Node
    gateway: str

    @property
    def name(self) -> str:
        """The home's name."""
        return self.config.name

    @property
    def public_address(self) -> str:
        """The address the internet sees for this home (router WAN)."""
        return self.router.address


class NatLab:
    """A NAT lab: build it with ``with NatLab(config) as lab:`` (or start/close).

    Teardown (on ``__exit__``, :meth:`close`, or at interpreter exit if neither
    ran) stops every process the lab started, closes the sockets it opened and
    deletes its namespaces and temporary directory.

    Args:
        config: The lab's layout; the default has homes a, b (easy NAT) and c
            (symmetric), a public host ``boot`` and coturn on ``turn``.
    """

    def __init__(self, config: LabConfig | None = None) -> None:
        self.config = config or LabConfig()
        self.lab_id = ""
        self.workdir = Path()
        self._nodes: dict[str, Node] = {}
        self._homes: dict[str, Home] = {}
        self._namespaces: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._shims: dict[str, subprocess.Popen[str]] = {}
        self._shim_stats: dict[str, dict[str, int] | None] = {}
        self._sockets: weakref.WeakSet[socket.socket] = weakref.WeakSet()
        self._turn: TurnServerInfo | None = None
        self._started = False
        self._closed = False

    # -- lifecycle -----------------------------------------------------------------

    def __enter__(self) -> NatLab:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except NatLabError:
            logger.exception("NAT lab %s: teardown failed after an error", self.lab_id)

    def start(self) -> None:
        """Build the lab. On failure everything built so far is torn down.

        Raises:
            NatLabError: A command failed, a tool is missing, or coturn or a
                shim did not come up within ``ready_timeout_s``.
        """
        if self._started:
            raise NatLabError("a NatLab can only be started once")
        self._started = True
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            with contextlib.suppress(NatLabError):
                self.close()
            raise

    def close(self) -> None:
        """Tear the lab down; safe to call more than once.

        Raises:
            NatLabError: Some namespace could not be deleted (all others were).
        """
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        failures: list[str] = []
        for name, shim in self._shims.items():
            self._shim_stats[name] = stop_shim(shim)
        for proc in reversed(self._procs):
            _stop_process(proc)
        for sock in list(self._sockets):
            sock.close()
        for netns in reversed(self._namespaces):
            try:
                delete_netns(netns)
            except NatLabError as exc:
                failures.append(str(exc))
        if self.workdir != Path():
            shutil.rmtree(self.workdir, ignore_errors=True)
        if failures:
            raise NatLabError("; ".join(failures))

    # -- lookup ----------------------------------------------------------------------

    @property
    def internet(self) -> Node:
        """The internet router (address 100.64.0.1)."""
        return self._nodes["inet"]

    @property
    def homes(self) -> dict[str, Home]:
        """Homes by name."""
        return dict(self._homes)

    def home(self, name: str) -> Home:
        """The home called ``name``."""
        try:
            return self._homes[name]
        except KeyError:
            raise NatLabError(f"no home {name!r} (homes: {sorted(self._homes)})") from None

    @property
    def turn(self) -> TurnServerInfo:
        """The coturn server's address and credentials.

        Raises:
            NatLabError: The lab runs without TURN.
        """
        if self._turn is None:
            raise NatLabError("this lab runs without a TURN server (LabConfig.turn=False)")
        return self._turn

    def node(self, name: str) -> Node:
        """The node with logical name ``name`` (see :class:`Node`)."""
        try:
            return self._nodes[name]
        except KeyError:
            raise NatLabError(f"no node {name!r} (nodes: {sorted(self._nodes)})") from None

    def nodes(self) -> list[Node]:
        """Every node of the lab."""
        return list(self._nodes.values())

    def addresses(self) -> dict[str, str]:
        """The IPv4 address of every node, by logical name."""
        return {name: node.address for name, node in self._nodes.items()}

    def shim_stats(self, home: str) -> dict[str, int] | None:
        """Final counters of a home's delay/loss shim, available after close()."""
        return self._shim_stats.get(home)

    # -- running things inside ---------------------------------------------------------

    def _resolve(self, node: Node | str) -> Node:
        return node if isinstance(node, Node) else self.node(node)

    def run(
        self,
        node: Node | str,
        argv: Sequence[str],
        *,
        stdin: str | None = None,
        timeout: float = 30.0,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        """Run a command to completion inside ``node`` and capture its output.

        Raises:
            NatLabError: It failed (with ``check``) or timed out.
        """
        return run_cmd(
            netns_argv(self._resolve(node).netns, argv), stdin=stdin, timeout=timeout, check=check
        )

    def popen(self, node: Node | str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start a command inside ``node``; the lab kills it at teardown.

        ``kwargs`` go to :class:`subprocess.Popen` (``stdout``, ``text``, ``env``...).
        """
        self._check_running()
        proc: subprocess.Popen[Any] = subprocess.Popen(
            netns_argv(self._resolve(node).netns, argv), **kwargs
        )
        self._procs.append(proc)
        return proc

    def python(self, node: Node | str, args: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start this interpreter (``sys.executable``) with ``args`` inside ``node``.

        ``p2ptrain`` is importable in the child (its root is put on PYTHONPATH).
        An ``env`` keyword is merged over the current environment.
        """
        env = python_env()
        env.update(kwargs.pop("env", None) or {})
        return self.popen(node, [sys.executable, *args], env=env, **kwargs)

    def socket(
        self,
        node: Node | str,
        family: socket.AddressFamily = socket.AF_INET,
        kind: socket.SocketKind = socket.SOCK_DGRAM,
    ) -> socket.socket:
        """A socket of this process that lives in ``node``'s namespace.

        Usable from any thread or asyncio loop (pass it as ``sock=``). The lab
        closes it at teardown if the caller has not.
        """
        self._check_running()
        sock = netns_socket(self._resolve(node).netns, family, kind)
        self._sockets.add(sock)
        return sock

    def call(
        self, node: Node | str, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs
    ) -> _T:
        """Call ``fn`` in a thread of this process that entered ``node``'s namespace.

        Sockets the call creates live in that namespace; so does a whole event
        loop if ``fn`` is ``asyncio.run``. Returns what ``fn`` returns.
        """
        self._check_running()
        return call_in_netns(self._resolve(node).netns, fn, *args, **kwargs)

    def unsolicited_drops(self, home: str) -> int:
        """Packets the home's router dropped as unsolicited inbound on its WAN."""
        done = self.run(self.home(home).router, ["iptables-save", "-c", "-t", "filter"])
        total = 0
        for line in done.stdout.splitlines():
            if line.startswith("[") and "-i wan" in line and "-j DROP" in line:
                total += int(line[1 : line.index(":")])
        return total

    def _check_running(self) -> None:
        if not self._started or self._closed:
            raise NatLabError("the NAT lab is not running")

    # -- building ----------------------------------------------------------------------

    def _build(self) -> None:
        cfg = self.config
        missing = missing_tools(turn=cfg.turn)
        if missing:
            raise NatLabError(f"missing tools, apt-get install them: {', '.join(missing)}")
        self.lab_id = new_lab_id(cfg.prefix)
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{self.lab_id}-"))
        started = time.monotonic()
        inet = self._add_namespace("inet", INTERNET_ADDRESS)
        publics = list(cfg.public_hosts) + ([_TURN_NAME] if cfg.turn else [])
        inet_batch = [
            f"address add {INTERNET_ADDRESS}/32 dev lo",
        ]
        node_batches: dict[str, list[str]] = {}
        attachments: list[tuple[Node, str]] = []
        for index, name in enumerate(publics, start=1):
            node = self._add_namespace(name, f"100.64.{index}.2")
            attachments.append((node, "eth0"))
        for index, home_cfg in enumerate(cfg.homes, start=len(publics) + 1):
            router = self._add_namespace(f"{home_cfg.name}.router", f"100.64.{index}.2")
            attachments.append((router, "wan"))
        for index, (node, ifname) in enumerate(attachments, start=1):
            uplink = f"v-{node.name.split('.')[0]}"
            inet_batch += [
                f"link add {uplink} type veth peer name {ifname} netns {node.netns}",
                f"address add 100.64.{index}.1/24 dev {uplink}",
                f"link set dev {uplink} up",
            ]
            node_batches[node.netns] = [
                f"address add {node.address}/24 dev {ifname}",
                f"link set dev {ifname} up",
                f"route add default via 100.64.{index}.1",
            ]
        # The silent sink: forwarded packets to unknown destinations are dropped
        # without an ICMP error (coturn drops an allocation on "unreachable").
        inet_batch.append("route add blackhole default")
        self._ip_batch(inet.netns, inet_batch)
        for netns, batch in node_batches.items():
            self._ip_batch(netns, batch)
        self._sysctl(inet.netns, "net.ipv4.ip_forward=1")
        for index, home_cfg in enumerate(cfg.homes, start=1):
            self._build_home(index, home_cfg)
        for index, home_cfg in enumerate(cfg.homes, start=1):
            if home_cfg.impaired:
                self._start_shim(index, home_cfg)
        if cfg.turn:
            self._start_turn(self._nodes[_TURN_NAME])
        logger.info("NAT lab %s ready in %.2f s", self.lab_id, time.monotonic() - started)

    def _add_namespace(self, name: str, address: str) -> Node:
        netns = f"{self.lab_id}-{name.replace('.router', '-r')}"
        run_cmd(["ip", "netns", "add", netns])
        self._namespaces.append(netns)
        # IPv6 off (ICE then sees only the lab's IPv4 addresses); no reverse-path
        # filtering (the shim re-injects packets on a tun device).
        self._sysctl(
            netns,
            "net.ipv6.conf.all.disable_ipv6=1",
            "net.ipv6.conf.default.disable_ipv6=1",
            "net.ipv4.conf.all.rp_filter=0",
            "net.ipv4.conf.default.rp_filter=0",
        )
        run_cmd(["ip", "-n", netns, "link", "set", "dev", "lo", "up"])
        node = Node(name=name, netns=netns, address=address)
        self._nodes[name] = node
        return node

    def _build_home(self, index: int, home_cfg: HomeConfig) -> None:
        router = self._nodes[f"{home_cfg.name}.router"]
        gateway = f"192.168.{index}.1"
        host = self._add_namespace(home_cfg.name, f"192.168.{index}.2")
        self._ip_batch(
            router.netns,
            [
                f"link add lan type veth peer name eth0 netns {host.netns}",
                f"address add {gateway}/24 dev lan",
                "link set dev lan up",
            ],
        )
        self._ip_batch(
            host.netns,
            [
                f"address add {host.address}/24 dev eth0",
                "link set dev eth0 up",
                f"route add default via {gateway}",
            ],
        )
        self._sysctl(router.netns, "net.ipv4.ip_forward=1")
        random_fully = " --random-fully" if home_cfg.nat == "symmetric" else ""
        rules = "\n".join(
            [
                "*nat",
                ":PREROUTING ACCEPT [0:0]",
                ":INPUT ACCEPT [0:0]",
                ":OUTPUT ACCEPT [0:0]",
                ":POSTROUTING ACCEPT [0:0]",
                f"-A POSTROUTING -o wan -j MASQUERADE{random_fully}",
                "COMMIT",
                "*filter",
                ":INPUT ACCEPT [0:0]",
                ":FORWARD ACCEPT [0:0]",
                ":OUTPUT ACCEPT [0:0]",
                "-A INPUT -i wan -m conntrack --ctstate NEW,INVALID -j DROP",
                "-A FORWARD -i wan -m conntrack --ctstate NEW,INVALID -j DROP",
                "COMMIT",
                "",
            ]
        )
        run_cmd(netns_argv(router.netns, ["iptables-restore", "-w", "10"]), stdin=rules)
        for device, rate in (("wan", home_cfg.upload_mbit), ("lan", home_cfg.download_mbit)):
            if rate is not None:
                run_cmd(
                    [
                        "tc",
                        "-n",
                        router.netns,
                        *tbf_args(device, rate, latency_ms=home_cfg.shaper_latency_ms),
                    ]
                )
        self._homes[home_cfg.name] = Home(
            config=home_cfg, host=host, router=router, gateway=gateway
        )

    def _start_shim(self, index: int, home_cfg: HomeConfig) -> None:
        inet = self._nodes["inet"]
        link = ShimLink(
            home=home_cfg.name,
            uplink=f"v-{home_cfg.name}",
            tun=f"t-{home_cfg.name}",
            wan_address=self._homes[home_cfg.name].public_address,
            table=_FIRST_TABLE + index,
            delay_ms=home_cfg.delay_ms,
            loss=home_cfg.loss,
            seed=self.config.seed + index,
        )
        proc = start_shim(
            inet.netns, link, log_dir=self.workdir, timeout=self.config.ready_timeout_s
        )
        self._shims[home_cfg.name] = proc
        self._ip_batch(inet.netns, shim_route_commands(link))

    def _start_turn(self, node: Node) -> None:
        cfg = self.config
        info = TurnServerInfo(
            host=node.address,
            port=TURN_PORT,
            username=cfg.turn_username,
            password=cfg.turn_password,
            realm=cfg.turn_realm,
        )
        proc = self.popen(
            node,
            turnserver_argv(info, self.workdir),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        probe = self.socket("inet")
        try:
            stun_binding(probe, (info.host, info.port), timeout=cfg.ready_timeout_s)
        except NatLabError as exc:
            log = self.workdir / "turnserver.log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
            state = "exited" if proc.poll() is not None else "running"
            raise NatLabError(f"coturn did not answer STUN ({state}): {exc}\n{tail}") from exc
        finally:
            probe.close()
        self._turn = info

    def _ip_batch(self, netns: str, lines: list[str]) -> None:
        run_cmd(["ip", "-n", netns, "-batch", "-"], stdin="\n".join(lines) + "\n")

    def _sysctl(self, netns: str, *settings: str) -> None:
        run_cmd(netns_argv(netns, ["sysctl", "-q", "-w", *settings]))


def tbf_args(device: str, rate_mbit: float, *, latency_ms: float) -> list[str]:
    """``tc`` arguments of a root tbf shaping ``device`` to ``rate_mbit``.

    The burst is 4 ms worth of the rate (at least 16 KiB).
    """
    rate_bytes = rate_mbit * 1e6 / 8
    burst = max(16 * 1024, int(rate_bytes / 250))
    return [
        "qdisc",
        "add",
        "dev",
        device,
        "root",
        "tbf",
        "rate",
        f"{round(rate_mbit * 1000)}kbit",
        "burst",
        str(burst),
        "latency",
        f"{latency_ms:g}ms",
    ]


def _stop_process(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=_PROCESS_STOP_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
