"""The I/O shell around :mod:`p2ptrain.train.progress`: publish our record, read the swarm's.

One background task on the peer's loop does both. It publishes this peer's
latest :class:`~p2ptrain.train.progress.PeerProgress` when :func:`publish_due`
says so (a new step or blocked flag at once; a new sample count at most every
``publish_interval``; a heartbeat every ``heartbeat_interval``), and reads the
``<run_id>/progress`` dictionary as often as
:func:`~p2ptrain.train.progress.next_fetch_delay` says. The training thread
calls :meth:`ProgressTracker.report` and :meth:`ProgressTracker.view`, which
are thread-safe and never block; coroutines (:meth:`ProgressTracker.wait_for_fetch`)
run on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable

from p2ptrain.dht.api import DHT
from p2ptrain.dht.records import key_owner, owner_bound_key
from p2ptrain.errors import IdentityError, P2PTrainError, RemoteProtocolError
from p2ptrain.secure.identity import PeerID
from p2ptrain.train.progress import (
    PeerProgress,
    ProgressConfig,
    SwarmProgress,
    aggregate,
    next_fetch_delay,
)

__all__ = ["PROGRESS_SUBKEY", "RATE_CHANGE", "ProgressTracker", "progress_key", "publish_due"]

_LEAVE_TIMEOUT = 2.0  # seconds to publish the "left" record when closing

logger = logging.getLogger(__name__)

PROGRESS_SUBKEY = b"progress"
"""Name of the owner-bound sub-key each peer writes its record under."""


RATE_CHANGE = 1.5
"""A reported samples/s this many times above or below the published one is published at once."""


def progress_key(run_id: str) -> str:
    """The DHT key of a run's progress dictionary."""
    return f"{run_id}/progress"


def publish_due(
    local: PeerProgress,
    published: PeerProgress | None,
    *,
    since_publish: float,
    ready: bool,
    config: ProgressConfig,
) -> bool:
    """Whether ``local`` should be published now (pure).

    At once: the first record, a new step, a change of the blocked or closed flag, the
    first samples toward a step (they make the peer one the group waits
    for), samples that make the swarm ready, and a rate that changed by more
    than :data:`RATE_CHANGE` times (the others extrapolate this peer's
    samples from it). Other sample counts at most every ``publish_interval``;
    the record anyway every ``heartbeat_interval``.

    Args:
        local: The peer's latest record.
        published: The record last published, or ``None``.
        since_publish: Seconds since the last publication (attempt).
        ready: The swarm, this record included, is ready to step.
        config: The intervals.
    """
    if published is None or since_publish >= config.heartbeat_interval:
        return True
    if (
        local.step != published.step
        or local.blocked != published.blocked
        or local.closed != published.closed
    ):
        return True
    if local.samples == published.samples:
        return False
    old_rate, new_rate = published.samples_per_s, local.samples_per_s
    if not old_rate / RATE_CHANGE <= new_rate <= old_rate * RATE_CHANGE:
        return True
    first = published.samples == 0  # the first samples toward a step make it a contributor
    return first or ready or since_publish >= config.publish_interval


class ProgressTracker:
    """Publishes this peer's progress and keeps the swarm's, on the peer's loop.

    Args:
        dht: The DHT to publish in and read from.
        run_id: Names the training run.
        config: Publication and read intervals.
        target_batch_size: Samples a step needs (``None``: wait for all to block).
        address: Where this peer serves its state, or ``None`` (client mode).
        reach: How others reach this peer (see :attr:`PeerProgress.reach`).
        bandwidth: Returns this peer's (upload, download) bytes per second as
            the load balancer sees them; read at each report.
        clock: Unix time; records carry it.
        model: This peer's model digest (:attr:`PeerProgress.model`); records
            with another digest are left out of the view (see :attr:`foreign`).
    """

    def __init__(
        self,
        *,
        dht: DHT,
        run_id: str,
        config: ProgressConfig,
        target_batch_size: int | None,
        address: str | None,
        reach: str | None = None,
        bandwidth: Callable[[], tuple[float, float]] | None = None,
        clock: Callable[[], float] = time.time,
        model: str | None = None,
    ) -> None:
        self.dht = dht
        self.key = progress_key(run_id)
        self.config = config
        self.target_batch_size = target_batch_size
        self.model = model
        self.foreign: tuple[PeerProgress, ...] = ()
        self._clock = clock
        self._subkey = dht.owned_key(PROGRESS_SUBKEY)
        self._address = address
        self._reach = reach
        self._bandwidth = bandwidth
        self.last_step_samples: int | None = None
        self._local = self._record(step=0, samples=0, samples_per_s=0.0, blocked=False)
        self._remote: tuple[PeerProgress, ...] = ()
        self._published: PeerProgress | None = None
        self._published_at = -float("inf")
        self._next_fetch = 0.0
        self._fetched_at = 0.0
        self._fetch_started = -float("inf")
        self._waiting = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._fetched: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle (on the loop) -------------------------------------------------------

    async def start(self, *, step: int = 0) -> None:
        """Publish the first record, read the swarm once, then keep both up to date."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._fetched = asyncio.Event()
        self._local = self._record(step=step, samples=0, samples_per_s=0.0, blocked=False)
        await self._publish()
        await self._fetch()
        self._task = self._loop.create_task(self._run(), name=f"progress:{self.key}")

    async def aclose(self) -> None:
        """Stop the background task and publish that this peer left (best effort)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            # Others stop counting this peer now, not when its record expires
            # (a restarted swarm would otherwise wait for peers that are gone).
            self._local = dataclasses.replace(self._local, time=self._clock(), left=True)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_LEAVE_TIMEOUT):
                    await self._publish()

    # -- from the training thread -------------------------------------------------------

    def report(
        self,
        *,
        step: int,
        samples: int,
        samples_per_s: float,
        blocked: bool,
        closed: bool = False,
        batch: int = 0,
    ) -> None:
        """Record this peer's latest progress (thread-safe; published in the background)."""
        self._local = self._record(
            step=step,
            samples=samples,
            samples_per_s=samples_per_s,
            blocked=blocked,
            closed=closed,
            batch=batch,
        )
        self._poke()

    def _record(
        self,
        *,
        step: int,
        samples: int,
        samples_per_s: float,
        blocked: bool,
        closed: bool = False,
        batch: int = 0,
    ) -> PeerProgress:
        upload = download = None
        if self._bandwidth is not None:
            upload, download = self._bandwidth()
        return PeerProgress(
            self.dht.peer_id,
            step,
            samples,
            samples_per_s,
            self._clock(),
            blocked,
            self._address,
            reach=self._reach,
            upload_bytes_per_s=upload,
            download_bytes_per_s=download,
            batch=batch,
            closed=closed,
            last_step_samples=self.last_step_samples,
            target=self.target_batch_size,
            model=self.model,
        )

    def set_waiting(self, waiting: bool) -> None:
        """Tell the tracker this peer waits for the swarm (it then reads more often)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._set_waiting, waiting)

    def _set_waiting(self, waiting: bool) -> None:
        if waiting and not self._waiting:
            self._next_fetch = 0.0
        self._waiting = waiting
        if self._wake is not None:
            self._wake.set()

    def view(self) -> SwarmProgress:
        """The swarm's progress: the last records read, with this peer's latest one."""
        return aggregate(
            (*self._remote, self._local),
            target_batch_size=self.target_batch_size,
            now=self._clock(),
        )

    @property
    def fetched_since(self) -> float:
        """When (``time.monotonic()``) the last completed read of the records started."""
        return self._fetch_started

    @property
    def local(self) -> PeerProgress:
        """This peer's latest record."""
        return self._local

    def _poke(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            loop.call_soon_threadsafe(wake.set)

    # -- on the loop --------------------------------------------------------------------

    async def wait_for_fetch(self, timeout: float) -> bool:
        """Wait until the next read of the swarm's records completes.

        Returns:
            Whether a read completed within ``timeout`` seconds.
        """
        if self._fetched is None:
            raise RuntimeError("the tracker is not started")
        try:
            async with asyncio.timeout(timeout):
                await self._fetched.wait()
        except TimeoutError:
            return False
        return True

    async def refresh(self) -> SwarmProgress:
        """Read the swarm's records now and return the new view."""
        await self._fetch()
        return self.view()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        wake = self._wake
        if wake is None:  # pragma: no cover - start() sets it
            return
        while True:
            wake.clear()
            try:
                await self._tick(loop)
            except Exception:  # the root of the task: log, then carry on later
                logger.exception("progress tracking of %s failed", self.key)
                self._next_fetch = loop.time() + self.config.max_fetch_interval
            deadline = min(self._next_fetch, self._next_publish_check())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):
                    await wake.wait()

    async def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        if publish_due(
            self._local,
            self._published,
            since_publish=now - self._published_at,
            ready=self.view().ready,
            config=self.config,
        ):
            await self._publish()
        # The view changes with this peer's own reports (e.g. its first samples
        # of a run): read again as soon as the new view says, not the old one.
        due = self._fetched_at + next_fetch_delay(self.view(), self.config, waiting=self._waiting)
        self._next_fetch = min(self._next_fetch, due)
        if loop.time() >= self._next_fetch:
            await self._fetch()

    def _next_publish_check(self) -> float:
        config = self.config
        due = self._published_at + config.heartbeat_interval
        published = self._published
        if published is not None and published.samples != self._local.samples:
            due = min(due, self._published_at + config.publish_interval)
        return due

    async def _publish(self) -> None:
        record = self._local
        loop = asyncio.get_running_loop()
        self._published_at = loop.time()
        try:
            await self.dht.store(
                self.key,
                record.to_wire(),
                self.dht.now() + self.config.expiration,
                subkey=self._subkey,
            )
        except P2PTrainError as exc:
            logger.warning("could not publish progress for %s: %s", self.key, exc)
            return
        self._published = record

    async def _fetch(self) -> None:
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        try:
            entries = await self.dht.get_dictionary(self.key)
        except P2PTrainError as exc:
            logger.warning("could not read progress of %s: %s", self.key, exc)
            entries = None
        if entries is not None:
            records = []
            for subkey, item in entries.items():
                owner = key_owner(subkey)
                if owner is None or subkey != owner_bound_key(PROGRESS_SUBKEY, owner):
                    continue
                try:
                    records.append(
                        PeerProgress.from_wire(PeerID.from_public_key(owner), item.value)
                    )
                except (RemoteProtocolError, IdentityError) as exc:
                    logger.debug("ignoring a progress record: %s", exc)
            # Records of another model are not this run's peers (a task that
            # joined the wrong run): they are kept apart, never counted.
            model = self.model
            self._remote = tuple(r for r in records if model is None or r.model in (None, model))
            self.foreign = tuple(r for r in records if not r.left and r not in self._remote)
            self._fetch_started = started
        delay = next_fetch_delay(self.view(), self.config, waiting=self._waiting)
        self._fetched_at = loop.time()
        self._next_fetch = self._fetched_at + delay
        fetched, self._fetched = self._fetched, asyncio.Event()
        if fetched is not None:
            fetched.set()
