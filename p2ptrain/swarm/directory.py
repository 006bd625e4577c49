"""Who serves which stage: stage announcements in the DHT.

Each stage server writes one entry, under its own owner-bound sub-key, in the
dictionary ``<run_id>/stage-<i>``: ``{"a": address, "r": samples/s, "q": queue,
"s": step, "inc", "cs", "ls", "hd", "st"}`` (its commit receipts, :mod:`p2ptrain.swarm.ledger`),
expiring ``announce_ttl`` seconds later (a peer that dies vanishes from the
wiring within that time; the trainers' failed calls drop it sooner). A server
leaving a stage overwrites its entry with ``{"left": true, "a": address}`` and
its final receipts.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from p2ptrain.dht.api import DHT
from p2ptrain.dht.records import key_owner, owner_bound_key
from p2ptrain.errors import IdentityError, P2PTrainError
from p2ptrain.secure.identity import PeerID
from p2ptrain.swarm.ledger import Receipts
from p2ptrain.swarm.wiring import Candidate

__all__ = [
    "SERVER_SUBKEY",
    "StageAnnouncement",
    "announce",
    "read_records",
    "read_stage",
    "stage_key",
    "withdraw",
]

logger = logging.getLogger(__name__)

SERVER_SUBKEY = b"stage-server"


def stage_key(run_id: str, stage: int) -> str:
    """The DHT key of a stage's announcements."""
    return f"{run_id}/stage-{stage}"


@dataclass(frozen=True)
class StageAnnouncement:
    """One stage server's announcement, as read back."""

    peer_id: PeerID
    stage: int
    address: str
    samples_per_s: float
    queue: int
    step: int
    expiration: float
    receipts: Receipts | None = None
    left: bool = False

    def candidate(self) -> Candidate:
        """The wiring's view of it."""
        return Candidate(self.address, self.samples_per_s, self.queue)


async def announce(
    dht: DHT,
    run_id: str,
    stage: int,
    *,
    address: str,
    samples_per_s: float,
    queue: int,
    step: int,
    ttl: float,
    receipts: Receipts | None = None,
) -> bool:
    """Publish (or refresh) this server's entry for ``stage``; whether a replica holds it."""
    value: dict[str, object] = {
        "a": address,
        "r": float(samples_per_s),
        "q": int(queue),
        "s": int(step),
    }
    if receipts is not None:
        value.update(receipts.to_wire())
    return await dht.store(
        stage_key(run_id, stage), value, dht.now() + ttl, subkey=dht.owned_key(SERVER_SUBKEY)
    )


async def withdraw(
    dht: DHT,
    run_id: str,
    stage: int,
    *,
    ttl: float,
    address: str = "",
    receipts: Receipts | None = None,
) -> None:
    """Overwrite this server's entry for ``stage`` with a "left" record (and final receipts)."""
    value: dict[str, object] = {"left": True, "a": address, "r": 0.0, "q": 0, "s": 0}
    if receipts is not None:
        value.update(receipts.to_wire())
    await dht.store(
        stage_key(run_id, stage),
        value,
        dht.now() + ttl,
        subkey=dht.owned_key(SERVER_SUBKEY),
    )


async def read_stage(dht: DHT, run_id: str, stage: int) -> list[StageAnnouncement]:
    """The live servers of ``stage`` (malformed or "left" entries are skipped).

    Raises:
        LookupFailedError: No DHT peer could be asked.
    """
    return [a for a in await read_records(dht, run_id, stage) if not a.left]


async def read_records(dht: DHT, run_id: str, stage: int) -> list[StageAnnouncement]:
    """Every unexpired entry of ``stage``, "left" ones included (``left=True``).

    Raises:
        LookupFailedError: No DHT peer could be asked.
    """
    entries = await dht.get_dictionary(stage_key(run_id, stage))
    found: list[StageAnnouncement] = []
    now = dht.now()
    for subkey, item in entries.items():
        owner = key_owner(subkey)
        if owner is None or subkey != owner_bound_key(SERVER_SUBKEY, owner):
            continue
        value = item.value
        if item.expiration is not None and item.expiration < now:
            continue
        if not isinstance(value, dict):
            continue
        parsed = _parse(value, owner, stage, item.expiration)
        if parsed is not None:
            found.append(parsed)
    return found


def _parse(
    value: dict[object, object], owner: bytes, stage: int, expiration: float | None
) -> StageAnnouncement | None:
    address, rate, queue, step = value.get("a"), value.get("r"), value.get("q"), value.get("s")
    if not isinstance(address, str) or len(address) > 512:
        return None
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not math.isfinite(rate):
        return None
    if isinstance(queue, bool) or not isinstance(queue, int) or queue < 0:
        return None
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return None
    try:
        peer_id = PeerID.from_public_key(owner)
    except IdentityError:
        return None
    if not address.startswith(f"{peer_id}@"):
        return None  # an entry must name its own writer's address
    return StageAnnouncement(
        peer_id,
        stage,
        address,
        max(float(rate), 0.0),
        queue,
        step,
        expiration or math.inf,
        Receipts.from_wire(value),
        value.get("left") is True,
    )


async def read_stage_or_empty(dht: DHT, run_id: str, stage: int) -> list[StageAnnouncement]:
    """:func:`read_stage`, logging a failed lookup and returning ``[]`` instead."""
    try:
        return await read_stage(dht, run_id, stage)
    except P2PTrainError as exc:
        logger.debug("could not read stage %d of %s: %s", stage, run_id, exc)
        return []
