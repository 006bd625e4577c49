"""``p2ptrain status``: a table (or JSON lines) of a run's live peers.

:func:`status_table` joins the DHT as a client, reads the run's progress
records (and the NAT records of peers that publish one) and formats one row
per live peer; :func:`watch_status` keeps reading through one DHT client.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from p2ptrain.app.train import _addresses
from p2ptrain.errors import ConfigError, DHTError
from p2ptrain.node.config import NodeConfig
from p2ptrain.secure.identity import PeerID
from p2ptrain.train.progress import PeerProgress, aggregate
from p2ptrain.validate import check_number

if TYPE_CHECKING:
    from p2ptrain.dht.api import DHT
    from p2ptrain.nat.records import PeerRecord

__all__ = [
    "StatusConfig",
    "format_status",
    "read_nat_records",
    "read_progress",
    "status_json",
    "status_table",
    "watch_status",
]


@dataclass(frozen=True)
class StatusConfig:
    """Where ``p2ptrain status`` reads a run's progress.

    Attributes:
        initial_peers: Addresses to join the DHT through.
        run_id: The run to report on.
        timeout: Seconds to join and read.
        node: How the reading peer's node is configured (swarm name, secret).
    """

    initial_peers: tuple[str, ...]
    run_id: str = "charlm"
    timeout: float = 20.0
    node: NodeConfig = field(default_factory=lambda: NodeConfig(port=0))

    def __post_init__(self) -> None:
        _addresses("StatusConfig", self.initial_peers)
        if not self.initial_peers:
            raise ConfigError("StatusConfig.initial_peers must name at least one peer")
        if not isinstance(self.run_id, str) or not self.run_id or "/" in self.run_id:
            raise ConfigError("StatusConfig.run_id must be a non-empty name without '/'")
        check_number("StatusConfig.timeout", self.timeout, above=0.0)
        if not isinstance(self.node, NodeConfig):
            raise ConfigError("StatusConfig.node must be a NodeConfig")


async def read_progress(dht: DHT, run_id: str) -> list[PeerProgress]:
    """Read the live progress records of ``run_id`` from ``dht`` (a started :class:`DHT`)."""
    from p2ptrain.dht.records import key_owner, owner_bound_key  # noqa: PLC0415
    from p2ptrain.errors import IdentityError, RemoteProtocolError  # noqa: PLC0415
    from p2ptrain.train.tracker import PROGRESS_SUBKEY, progress_key  # noqa: PLC0415

    entries = await dht.get_dictionary(progress_key(run_id))
    records: list[PeerProgress] = []
    for subkey, item in entries.items():
        owner = key_owner(subkey)
        if owner is None or subkey != owner_bound_key(PROGRESS_SUBKEY, owner):
            continue
        try:
            records.append(PeerProgress.from_wire(PeerID.from_public_key(owner), item.value))
        except (RemoteProtocolError, IdentityError):
            continue
    return records


async def read_nat_records(dht: DHT, peers: Sequence[PeerID]) -> dict[PeerID, PeerRecord]:
    """The NAT records of ``peers`` that published one (lookups that fail are left out)."""
    import asyncio  # noqa: PLC0415

    from p2ptrain.errors import P2PTrainError  # noqa: PLC0415
    from p2ptrain.nat.records import find_record  # noqa: PLC0415 - p2ptrain.nat loads aiortc

    async def one(peer: PeerID) -> PeerRecord | None:
        try:
            return await find_record(dht, peer)
        except P2PTrainError:
            return None

    found = await asyncio.gather(*(one(peer) for peer in peers))
    return {peer: record for peer, record in zip(peers, found, strict=True) if record is not None}


def _reachability(record: PeerProgress, nat: PeerRecord | None = None) -> str:
    """The "reach/path" cell: how the peer is reached, from its NAT record if it has one."""
    if nat is not None:
        if nat.nat == "public":
            where = nat.addresses[0] if nat.addresses else "?"
            return f"public, tcp-direct {where}"
        paths = []
        if nat.rendezvous:
            if nat.holepunch:
                paths.append("holepunch")
            paths.append("webrtc")
            if any(point.relay for point in nat.rendezvous):
                paths.append("relay")
        via = f"via {len(nat.rendezvous)} rendezvous" if nat.rendezvous else "no rendezvous"
        return f"nat:{nat.nat}, {'/'.join(paths) or 'unreachable'} {via}"
    if record.address is None:
        return "client mode (dials out only)"
    host_port = record.address.rsplit("@", 1)[-1]
    reach = record.reach or "direct"
    return f"{reach}, tcp-direct {host_port}" if reach != "direct" else f"direct {host_port}"


def _bandwidth(record: PeerProgress) -> str:
    """The "up/down MB/s" cell (1 MB = 10**6 bytes), or "?" for a peer that did not say."""
    up, down = record.upload_bytes_per_s, record.download_bytes_per_s
    if up is None or down is None:
        return "?"
    return f"{up / 1e6:.1f}/{down / 1e6:.1f}"


def _step_samples(record: PeerProgress) -> str:
    """The "step samples/target" cell: the samples of the peer's latest step, and its target."""
    samples = "?" if record.last_step_samples is None else str(record.last_step_samples)
    target = "?" if record.target is None else str(record.target)
    return f"{samples}/{target}"


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    return f"{seconds:.1f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago"


def format_status(
    records: Sequence[PeerProgress],
    *,
    run_id: str,
    now: float,
    target_batch_size: int | None,
    nat_records: Mapping[PeerID, PeerRecord] | None = None,
) -> str:
    """Format progress records as a table, one row per peer, highest step first.

    Args:
        records: The run's live records.
        run_id: The run's name, for the heading.
        now: The current time (Unix seconds), for "last seen".
        target_batch_size: The run's target, if known, for the heading.
        nat_records: The NAT records (:mod:`p2ptrain.nat.records`) of the
            peers that run NAT traversal, for the "reach/path" column.
    """
    nat_records = nat_records or {}
    view = aggregate(records, target_batch_size=target_batch_size, now=now)
    if not view.records:
        return f"run {run_id!r}: no live peers found"
    headers = (
        "PeerID",
        "reach/path",
        "samples/s",
        "up/down MB/s",
        "last seen",
        "step samples/target",
        "global step",
    )
    rows = [
        (
            r.peer_id.short,
            _reachability(r, nat_records.get(r.peer_id)),
            f"{r.samples_per_s:.1f}",
            _bandwidth(r),
            _ago(now - r.time),
            _step_samples(r),
            str(r.step),
        )
        for r in view.records
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    heading = (
        f"run {run_id!r}: {view.peers_online} peers online, global step {view.global_step}, "
        f"{view.samples_per_s:.1f} samples/s"
    )
    return "\n".join(
        [heading, line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)]
    )


def status_table(config: StatusConfig) -> str:
    """Join the DHT as a client, read the run's progress records and format them.

    Raises:
        LookupFailedError: None of the initial peers answered.
        DHTError: Joining and reading took longer than ``config.timeout``.
    """
    return watch_status(config, render=_table_of(config), count=1)[0]


def status_json(
    records: Sequence[PeerProgress],
    *,
    run_id: str,
    now: float,
    nat_records: Mapping[PeerID, PeerRecord] | None = None,
) -> dict[str, Any]:
    """The status of a run as a JSON-able dict (``p2ptrain status --json``).

    Keys: ``run_id``, ``time``, ``peers_online``, ``global_step``,
    ``samples_per_s`` and ``peers``, one dict per live peer (highest step
    first) with ``peer_id``, ``reach``, ``samples_per_s``,
    ``upload_bytes_per_s``, ``download_bytes_per_s``, ``last_seen_s`` and
    ``global_step``.
    """
    nat_records = nat_records or {}
    view = aggregate(records, target_batch_size=None, now=now)
    return {
        "run_id": run_id,
        "time": now,
        "peers_online": view.peers_online,
        "global_step": view.global_step,
        "samples_per_s": view.samples_per_s,
        "peers": [
            {
                "peer_id": str(r.peer_id),
                "reach": _reachability(r, nat_records.get(r.peer_id)),
                "samples_per_s": r.samples_per_s,
                "upload_bytes_per_s": r.upload_bytes_per_s,
                "download_bytes_per_s": r.download_bytes_per_s,
                "last_seen_s": max(0.0, now - r.time),
                "global_step": r.step,
            }
            for r in view.records
        ],
    }


_Render = Callable[[list[PeerProgress], "dict[PeerID, PeerRecord]", float], str]


def _table_of(config: StatusConfig) -> _Render:
    def render(records: list[PeerProgress], nat: dict[PeerID, PeerRecord], now: float) -> str:
        return format_status(
            records, run_id=config.run_id, now=now, target_batch_size=None, nat_records=nat
        )

    return render


def _json_of(config: StatusConfig) -> _Render:
    def render(records: list[PeerProgress], nat: dict[PeerID, PeerRecord], now: float) -> str:
        return json.dumps(status_json(records, run_id=config.run_id, now=now, nat_records=nat))

    return render


def watch_status(
    config: StatusConfig,
    *,
    render: _Render | None = None,
    as_json: bool = False,
    interval: float = 2.0,
    count: int | None = None,
    show: Callable[[str], None] | None = None,
) -> list[str]:
    """Read the run's status every ``interval`` seconds through one DHT client.

    Args:
        config: Where to read.
        render: Formats one reading (default: the table, or JSON with ``as_json``).
        as_json: Render each reading as one JSON line.
        interval: Seconds between readings.
        count: Readings to take, or ``None`` for as many as until interrupted.
        show: Called with each rendered reading as it comes.

    Returns:
        The rendered readings (only the last one when ``count`` is None).

    Raises:
        LookupFailedError: None of the initial peers answered.
        DHTError: Joining and the first reading took longer than ``config.timeout``.
    """
    import asyncio  # noqa: PLC0415

    from p2ptrain.aio import run  # noqa: PLC0415
    from p2ptrain.dht.api import DHT  # noqa: PLC0415
    from p2ptrain.dht.node_config import DHTNodeConfig  # noqa: PLC0415

    if count is not None and count < 1:
        raise ConfigError("the status needs at least one reading")
    check_number("watch_status.interval", interval, above=0.0)
    draw = render or (_json_of(config) if as_json else _table_of(config))
    shown: list[str] = []

    async def reading(dht: DHT) -> str:
        records = await read_progress(dht, config.run_id)
        nat = await read_nat_records(dht, [r.peer_id for r in records])
        return draw(records, nat, time.time())

    async def loop(dht: DHT) -> None:
        taken = 0
        while count is None or taken < count:
            if taken:
                await asyncio.sleep(interval)  # the refresh period, not a wait for a condition
            try:
                async with asyncio.timeout(config.timeout):
                    text = await reading(dht)
            except TimeoutError:
                raise DHTError(f"no answer from the swarm within {config.timeout:g} s") from None
            taken += 1
            shown[:] = [*shown, text] if count is not None else [text]
            if show is not None:
                show(text)

    async def main() -> None:
        dht_config = DHTNodeConfig(initial_peers=config.initial_peers, client_mode=True)
        try:
            async with asyncio.timeout(config.timeout) as joining:
                async with DHT(node_config=config.node, config=dht_config) as dht:
                    joining.reschedule(None)  # joined: each reading has its own deadline
                    await loop(dht)
        except TimeoutError:
            raise DHTError(f"no answer from the swarm within {config.timeout:g} s") from None

    run(main())
    return shown
