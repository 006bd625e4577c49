"""PipelineTrainer: pushes micro-batches through a chain of stage peers, forward and back.

Where the model lives: **every block lives in the stage servers; the trainer
holds no parameters**, only the loss function (a parameter-free function of
the last stage's output and the batch's targets). So the embedding and the
head are averaged, moved and capped by the memory budget like any other
block; a trainer can run on a peer with no memory to spare (it only keeps
activations); and no trainer-side state needs its own averaging. The price is
that stage 0 receives the raw inputs (token ids: small) and the last stage
sends back its full output (logits), which the trainer needs for the loss.

One micro-batch::

    x_0 = inputs
    for s in 0..S-1:  x_{s+1} = forward on a peer p_s of stage s (wiring rule)
    loss, g_S = loss(x_S, targets) and its gradient
    for s in S-1..0:  g_s = backward on p_s with g_{s+1}

The trainer keeps every ``x_s`` until the backward through stage ``s`` is
done. A peer that dies, stalls (no reply within ``call_timeout``) or refuses
(its cap is full, it moved, it lost the micro-batch) costs a retry: a forward
is sent to another peer of the stage; a failed backward re-sends the stage's
forward ``x_s`` to another peer and then the backward. Each stage adds a
micro-batch's gradient and samples once (see the commit rule in
:mod:`p2ptrain.swarm.server`); the trainer counts the micro-batch's samples
as delivered once, when the backward through stage 0 is done. A stage with no
live peer pauses the micro-batch with a status line (logged, and in
:meth:`PipelineTrainer.status`) until a peer serves it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from p2ptrain.errors import (
    ConfigError,
    ConnectError,
    ConnectionClosedError,
    MethodNotFoundError,
    P2PTrainError,
    RemoteProtocolError,
    StageUnavailableError,
    UnavailableError,
)
from p2ptrain.node.address import PeerAddress
from p2ptrain.peer import Peer
from p2ptrain.rpc.handlers import Message
from p2ptrain.swarm.compute import compute_pool
from p2ptrain.swarm.config import PipelineTrainerConfig
from p2ptrain.swarm.directory import read_stage
from p2ptrain.swarm.ledger import Receipts
from p2ptrain.swarm.protocol import (
    BACKWARD_METHOD,
    FORWARD_METHOD,
    MB_ID_BYTES,
    RECEIPTS_METHOD,
    RELEASE_METHOD,
    decode_limited,
    encode_for_wire,
    request_body,
)
from p2ptrain.swarm.wiring import Candidate, LinkStats, choose_peer

__all__ = ["LossFunction", "PipelineTrainer", "PipelineTrainerStats"]

logger = logging.getLogger(__name__)

LossFunction = Callable[[torch.Tensor, Any], torch.Tensor]
"""``loss(output_of_last_stage, targets) -> scalar``: a mean over the micro-batch."""


@dataclass
class PipelineTrainerStats:
    """What a trainer did."""

    micro_batches: int = 0
    samples_delivered: int = 0
    retries: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    paused_s: float = 0.0
    last_loss: float | None = None
    replayed_samples: int = 0
    vouched: int = 0
    """Vanished stage peers whose last step another peer of the stage said counted them
    (so what that step counted was not replayed)."""

    def failed(self, reason: str) -> None:
        """Count one failed call by reason (the error's class name)."""
        self.failures[reason] = self.failures.get(reason, 0) + 1


class PipelineTrainer:
    """Trains through the stage servers of a pipeline run.

    Args:
        peer: The started peer to call from (it need not serve a stage).
        config: The run, its number of stages, timeouts and wiring jitter.
        loss: The loss of the last stage's output against the targets.
        seed: Seed of the wiring's randomization (default: from the OS).
        clock: Monotonic seconds for latencies, back-off and refresh (a
            simulation passes its virtual loop's ``time``).
    """

    def __init__(
        self,
        *,
        peer: Peer,
        config: PipelineTrainerConfig,
        loss: LossFunction,
        seed: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(config, PipelineTrainerConfig):
            raise ConfigError("config must be a PipelineTrainerConfig")
        if not callable(loss):
            raise ConfigError("loss must be callable")
        self.peer = peer
        self.config = config
        self.loss = loss
        self.stats = PipelineTrainerStats()
        self._rng = random.Random(seed)
        self._clock = clock
        self._links: dict[str, LinkStats] = {}
        self._candidates: dict[int, tuple[float, list[Candidate]]] = {}
        self._reads: dict[int, asyncio.Future[list[Candidate]]] = {}
        self._waiting: dict[int, float] = {}
        self._unconfirmed: list[_Unconfirmed] = []
        self._replays: set[asyncio.Task[None]] = set()
        self._confirmer: asyncio.Task[None] | None = None
        self._confirming = asyncio.Lock()
        self._receipts_seen: dict[tuple[str, str], Receipts] = {}
        self._unreachable: dict[tuple[str, str], float] = {}
        self._compute = compute_pool("pipeline-loss")

    # -- the synchronous facade --------------------------------------------------------

    def step(
        self,
        inputs: torch.Tensor,
        targets: Any,
        *,
        samples: int | None = None,
        timeout: float | None = None,
    ) -> float:
        """:meth:`train_micro_batch` from an ordinary thread; returns the loss."""
        return self.peer.run(
            self.train_micro_batch(inputs, targets, samples=samples), timeout=timeout
        )

    # -- one micro-batch ---------------------------------------------------------------

    async def train_micro_batch(
        self, inputs: torch.Tensor, targets: Any, *, samples: int | None = None
    ) -> float:
        """Push one micro-batch forward and backward through every stage.

        Args:
            inputs: Stage 0's input; its first dimension counts the samples.
            targets: Whatever ``loss`` needs besides the output.
            samples: The micro-batch's sample count (default ``len(inputs)``).

        Returns:
            The micro-batch's loss.

        Raises:
            StageUnavailableError: A stage had no live peer for ``stage_wait`` seconds.
        """
        n = int(samples if samples is not None else inputs.shape[0])
        mb = os.urandom(MB_ID_BYTES)
        stages = self.config.num_stages
        xs: list[torch.Tensor] = [inputs]
        chain: list[str] = []
        for stage in range(stages):
            output, address = await self._forward(stage, mb, xs[stage], n)
            chain.append(address)
            xs.append(output)
        loss_value, grad = await asyncio.get_running_loop().run_in_executor(
            self._compute, self._loss_and_grad, xs[stages], targets
        )
        for stage in reversed(range(stages)):
            grad = await self._backward(stage, mb, xs[stage], grad, chain, n)
        self.stats.micro_batches += 1
        self.stats.samples_delivered += n
        self.stats.last_loss = loss_value
        return loss_value

    def _loss_and_grad(self, output: torch.Tensor, targets: Any) -> tuple[float, torch.Tensor]:
        out = output.detach().requires_grad_(True)
        with torch.enable_grad():
            loss = self.loss(out, targets)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ConfigError("the pipeline's loss must return a scalar tensor")
            (grad,) = torch.autograd.grad(loss, [out])
        return float(loss.detach()), grad

    async def _forward(
        self, stage: int, mb: bytes, x: torch.Tensor, samples: int
    ) -> tuple[torch.Tensor, str]:
        header, view = encode_for_wire(x, self.config.wire_dtype)
        body = request_body(self.config.run_id, stage, mb, x=header)
        while True:
            address = await self._choose(stage, samples)
            try:
                reply = await self._call(address, FORWARD_METHOD, body, view)
                output = decode_limited(
                    _field(reply, "y"), reply.payload, max_bytes=self.config.max_tensor_bytes
                )
            except (P2PTrainError, TimeoutError) as exc:
                self._failed(stage, address, "forward", exc)
                continue
            return output, address

    async def _backward(  # noqa: PLR0917 - private, one call site
        self,
        stage: int,
        mb: bytes,
        x: torch.Tensor,
        grad: torch.Tensor,
        chain: list[str],
        samples: int,
    ) -> torch.Tensor:
        header, view = encode_for_wire(grad, self.config.wire_dtype)
        body = request_body(self.config.run_id, stage, mb, g=header, n=samples)
        while True:
            address = chain[stage]
            try:
                reply = await self._call(address, BACKWARD_METHOD, body, view)
                found = _field(reply, "g")
                result = (
                    torch.empty(0)
                    if found is None
                    else decode_limited(
                        found, reply.payload, max_bytes=self.config.max_tensor_bytes
                    )
                )
            except (P2PTrainError, TimeoutError) as exc:
                self._failed(stage, address, "backward", exc)
            else:
                self._keep(_Unconfirmed(stage, address, _receipt(reply), x, grad, samples))
                receipts = Receipts.from_wire(reply.body)
                if receipts is not None:
                    self._saw_receipts(address, receipts)
                return result
            # The peer lost the micro-batch (or died): redo the stage's forward elsewhere.
            _, chain[stage] = await self._forward(stage, mb, x, samples)

    async def _call(self, address: str, method: str, body: Any, payload: Any) -> Message:
        link = self._links.setdefault(address, LinkStats())
        link.in_flight += 1
        try:
            timeout = self.config.call_timeout
            async with asyncio.timeout(timeout):
                conn = await self.peer.node.connect(address)  # a first dial is not latency
            started = self._clock()
            reply = await conn.call(method, body, payload, timeout=timeout)
        finally:
            link.in_flight -= 1
        link.observe(self._clock() - started, self.config.latency_smoothing)
        return reply

    # -- the commit ledger: keep each stage's micro-batch until its step counted it ----

    def _keep(self, entry: _Unconfirmed) -> None:
        self._unconfirmed.append(entry)
        if self._confirmer is None or self._confirmer.done():
            self._confirmer = asyncio.get_running_loop().create_task(
                self._confirm_loop(), name="pipeline-confirm"
            )

    def awaiting(self, address: str) -> int:
        """Stage passes on the peer at ``address`` not yet known to be in a step."""
        return sum(e.address == address for e in self._unconfirmed)

    @property
    def unconfirmed(self) -> int:
        """Stage passes of micro-batches not yet known to be in a stage step (or replaying)."""
        return len(self._unconfirmed) + len(self._replays)

    async def _confirm_loop(self) -> None:
        while self._unconfirmed:
            await asyncio.sleep(self.config.refresh_interval)
            await self.confirm()

    async def confirm(self) -> None:
        """Ask the stage peers once what became of the unconfirmed passes (``swarm.receipts``):
        forget what a step counted, replay what was lost (:mod:`p2ptrain.swarm.ledger`).

        A peer that stays unreachable (connection refused or closed) for
        ``gone_after`` seconds lost what its last receipts did not count; one
        that does not answer in time is asked again next round. One round at a time
        (:meth:`settle` beside the confirming loop): two rounds that both found a
        pass lost would replay it twice.
        """
        async with self._confirming:
            await self._confirm_round()

    async def _confirm_round(self) -> None:
        groups: dict[tuple[str, str], list[_Unconfirmed]] = {}
        for entry in self._unconfirmed:
            if entry.receipt is not None:
                groups.setdefault((entry.address, entry.receipt[0]), []).append(entry)
        lost: list[_Unconfirmed] = []
        settled: set[int] = {id(e) for e in self._unconfirmed if e.receipt is None}
        for (address, inc), entries in groups.items():
            receipts = await self._ask_receipts(address, inc, entries[0].stage)
            if receipts is None:
                continue
            for entry in entries:
                seq = entry.receipt[1] if entry.receipt is not None else 0
                fate = receipts.fate(seq)
                if fate == "pending":
                    continue
                settled.add(id(entry))
                if fate == "lost":
                    lost.append(entry)
        self._unconfirmed = [e for e in self._unconfirmed if id(e) not in settled]
        for entry in lost:
            task = asyncio.get_running_loop().create_task(self._replay(entry))
            self._replays.add(task)
            task.add_done_callback(self._replays.discard)

    async def _ask_receipts(self, address: str, inc: str, stage: int) -> Receipts | None:
        """The receipts of ``inc`` at ``address`` (for a server that is gone, restarted
        or unreachable: the last receipts seen, everything after them lost);
        ``None``: no answer this time."""
        try:
            reply = await self.peer.node.call(
                address, RECEIPTS_METHOD, {"inc": inc}, timeout=self.config.call_timeout
            )
        except (ConnectError, ConnectionClosedError, UnavailableError, MethodNotFoundError):
            # Gone only once it stays unreachable for gone_after seconds: a live
            # peer's transient failure must not replay what its steps counted.
            now = self._clock()
            first = (address, inc) not in self._unreachable
            since = self._unreachable.setdefault((address, inc), now)
            gone = now - since >= self.config.gone_after
            if first or gone:
                # A server killed right after a step announced that step's receipts
                # in the directory, where its entry outlives it for announce_ttl: a
                # read begun now (not one in flight, which may predate them).
                await self._read_candidates(stage)
            return await self._settle_gone(address, inc, stage) if gone else None
        except (P2PTrainError, TimeoutError) as exc:
            logger.debug("no receipts from %s: %s", address[:16], exc)
            return None
        self._unreachable.pop((address, inc), None)
        body = reply.body
        if isinstance(body, dict) and body.get("unknown") is True:
            return await self._settle_gone(address, inc, stage)
        receipts = Receipts.from_wire(body)
        if receipts is None or receipts.incarnation != inc:
            return None
        self._saw_receipts(address, receipts)
        return receipts

    async def _settle_gone(self, address: str, inc: str, stage: int) -> Receipts | None:
        """A vanished server's receipts (:func:`_gone`), once the stage's other peers said
        whether the step its last receipts handed commits to counted it; ``None``
        while none can say yet (ask again next round)."""
        seen = self._receipts_seen.get((address, inc))
        if seen is None or seen.handed == seen.contributed:
            return _gone(seen)
        counted = await self._ask_vouches(address, stage, seen)
        if counted is None:
            return None
        self.stats.vouched += counted
        return _gone(seen.settled(counted))

    async def _ask_vouches(self, address: str, stage: int, seen: Receipts) -> bool | None:
        """Ask every other peer of ``stage`` whether its step ``seen.step`` counted the
        server at ``address``. Counted if one says so, not counted if one says not,
        or if every one that answered is past that step and cannot say (it was in
        no group with that server: nothing counted it that survives); ``None``
        while a peer that answered has not reached that step, or none answered."""
        peer_id = _peer_of(address)
        if peer_id is None:
            return False
        # The stage list as read when the server was found gone (or a fresh one).
        candidates = await self._stage_candidates(stage, force=False)
        others = [c.address for c in candidates if c.address != address]
        body = {"inc": seen.incarnation, "peer": peer_id, "stage": stage, "step": seen.step}
        replies = await asyncio.gather(
            *(
                self.peer.node.call(a, RECEIPTS_METHOD, body, timeout=self.config.call_timeout)
                for a in others
            ),
            return_exceptions=True,
        )
        answers = [r.body for r in replies if isinstance(r, Message) and isinstance(r.body, dict)]
        said = [a.get("counted") for a in answers]
        if True in said or False in said:
            return True in said
        behind = any(isinstance(a.get("at"), int) and 0 <= a["at"] <= seen.step for a in answers)
        if not answers or behind:
            return None
        return False

    def _saw_receipts(self, address: str, receipts: Receipts) -> None:
        """Keep the newest receipts of a server's incarnation (from a reply or the
        directory): when the server vanishes, what they count is not replayed."""
        key = (address, receipts.incarnation)
        seen = self._receipts_seen.get(key)
        if seen is None or _newness(receipts) >= _newness(seen):
            self._receipts_seen[key] = receipts

    async def _replay(self, entry: _Unconfirmed) -> None:
        """Push a lost stage pass through another peer of its stage (forward, then backward)."""
        self.stats.replayed_samples += entry.samples
        logger.info("replaying %d samples through stage %d", entry.samples, entry.stage)
        mb = os.urandom(MB_ID_BYTES)
        chain = [""] * (entry.stage + 1)
        _, chain[entry.stage] = await self._forward(entry.stage, mb, entry.x, entry.samples)
        await self._backward(entry.stage, mb, entry.x, entry.grad, chain, entry.samples)

    async def settle(self) -> None:
        """Confirm and replay until no known-lost pass is left (before a clean end).

        Passes still pending on live servers stay pending: they are in those
        servers' accumulators. Passes on a server that stopped answering wait
        until it answers again or counts as gone (``gone_after``) and they are
        replayed.
        """
        while True:
            await self.confirm()
            if self._replays:
                await asyncio.gather(*list(self._replays), return_exceptions=True)
            elif not any(
                e.receipt is not None and (e.address, e.receipt[0]) in self._unreachable
                for e in self._unconfirmed
            ):
                return
            else:
                await asyncio.sleep(self.config.refresh_interval)

    async def aclose(self) -> None:
        """Stop confirming and replaying, and the loss thread (on the peer's loop)."""
        tasks = [t for t in (self._confirmer, *self._replays, *self._reads.values()) if t]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._compute.shutdown(wait=False)

    def close(self) -> None:
        """:meth:`aclose` from an ordinary thread."""
        if self.peer.running:
            self.peer.run(self.aclose(), timeout=10)

    def _failed(self, stage: int, address: str, what: str, exc: BaseException) -> None:
        reason = type(exc).__name__
        self.stats.retries += 1
        self.stats.failed(reason)
        link = self._links.setdefault(address, LinkStats())
        link.failures += 1
        link.avoid_until = self._clock() + self.config.avoid_s
        logger.info(
            "stage %d %s on %s failed (%s: %s); retrying", stage, what, address[:16], reason, exc
        )

    async def release(self, stage: int, mb: bytes, address: str) -> None:
        """Tell a stage peer to drop a held micro-batch (best effort)."""
        body = request_body(self.config.run_id, stage, mb)
        try:
            await self.peer.node.call(
                address, RELEASE_METHOD, body, timeout=self.config.call_timeout
            )
        except (P2PTrainError, TimeoutError) as exc:
            logger.debug("release on %s failed: %s", address[:16], exc)

    # -- wiring ------------------------------------------------------------------------

    async def _choose(self, stage: int, samples: int) -> str:
        """A peer of ``stage`` by the wiring rule; waits (pausing) while the stage has none."""
        waited_since: float | None = None
        while True:
            now = self._clock()
            candidates = await self._stage_candidates(stage, force=waited_since is not None)
            chosen = choose_peer(
                candidates,
                self._links,
                samples=samples,
                now=now,
                rng=self._rng,
                jitter=self.config.jitter,
                explore=self.config.explore,
            )
            if chosen is not None:
                link = self._links.get(chosen.address)
                if link is not None and link.avoid_until > now:
                    # every peer of the stage failed lately: retry, but not in a hot loop
                    await asyncio.sleep(self.config.retry_interval)
                if waited_since is not None:
                    paused = self._clock() - waited_since
                    self.stats.paused_s += paused
                    self._waiting.pop(stage, None)
                    logger.warning("stage %d is served again after %.1f s", stage, paused)
                return chosen.address
            if waited_since is None:
                waited_since = now
                self._waiting[stage] = now
                logger.warning(
                    "stage %d of %s has no live peer: training pauses until one serves it",
                    stage,
                    self.config.run_id,
                )
            limit = self.config.stage_wait
            if limit is not None and now - waited_since > limit:
                self._waiting.pop(stage, None)
                raise StageUnavailableError(
                    f"stage {stage} of {self.config.run_id} had no live peer for {limit:g} s"
                )
            await asyncio.sleep(self.config.retry_interval)

    async def _stage_candidates(self, stage: int, *, force: bool) -> list[Candidate]:
        """The stage's peers as last read from the directory, re-read when older than
        ``refresh_interval`` (or ``force``). Every micro-batch that needs a fresh list
        at once waits on one read of the stage, not a read each."""
        now = self._clock()
        cached = self._candidates.get(stage)
        if cached is not None and not force and now - cached[0] < self.config.refresh_interval:
            return cached[1]
        reading = self._reads.get(stage)
        if reading is None:
            reading = asyncio.ensure_future(self._read_candidates(stage))
            self._reads[stage] = reading
            reading.add_done_callback(lambda _done: self._reads.pop(stage, None))
        return await asyncio.shield(reading)

    async def _read_candidates(self, stage: int) -> list[Candidate]:
        """Read the stage's directory; a failed lookup keeps the last list read (an
        unreachable DHT is not an empty stage)."""
        now = self._clock()
        try:
            found = await read_stage(self.peer.dht, self.config.run_id, stage)
        except P2PTrainError as exc:
            cached = self._candidates.get(stage)
            logger.debug("could not read stage %d (%s); keeping the last list", stage, exc)
            candidates = [] if cached is None else cached[1]
            self._candidates[stage] = (now, candidates)
            return candidates
        for a in found:
            if a.receipts is not None:
                self._saw_receipts(a.address, a.receipts)
        candidates = [a.candidate() for a in found]
        self._candidates[stage] = (now, candidates)
        return candidates

    def status(self) -> str:
        """A one-line status: stages without a peer, micro-batches, samples, retries."""
        paused = ", ".join(
            f"stage {s} has no live peer ({self._clock() - t:.0f} s)"
            for s, t in sorted(self._waiting.items())
        )
        stats = self.stats
        line = (
            f"{stats.micro_batches} micro-batches, {stats.samples_delivered} samples,"
            f" {stats.retries} retries"
        )
        return f"PAUSED: {paused}; {line}" if paused else line


@dataclass(frozen=True)
class _Unconfirmed:
    """A stage pass whose samples no stage step has been seen to count yet."""

    stage: int
    address: str
    receipt: tuple[str, int] | None  # (incarnation, seq), None from an old server
    x: torch.Tensor
    grad: torch.Tensor
    samples: int


def _receipt(reply: Message) -> tuple[str, int] | None:
    body = reply.body
    inc, seq = body.get("inc"), body.get("seq")
    if isinstance(inc, str) and isinstance(seq, int) and not isinstance(seq, bool):
        return inc, seq
    return None


def _gone(seen: Receipts | None) -> Receipts:
    """A vanished server's receipts: what it last said was counted; everything else lost
    (every commit, when it vanished before it ever answered)."""
    if seen is None:
        return Receipts("", 0, ((1, 1 << 62),))
    return Receipts(
        seen.incarnation, seen.contributed, (*seen.lost, (seen.contributed + 1, 1 << 62))
    )


def _newness(receipts: Receipts) -> tuple[int, int, int, int]:
    return receipts.contributed, len(receipts.lost), receipts.step, receipts.handed


def _peer_of(address: str) -> str | None:
    """The peer id in ``address`` (``peerid@host:port``), as a string."""
    try:
        peer_id = PeerAddress.parse(address).peer_id
    except (P2PTrainError, ValueError):
        return None
    return None if peer_id is None else str(peer_id)


def _field(reply: Message, key: str) -> Any:
    body = reply.body
    if not isinstance(body, dict) or key not in body:
        raise RemoteProtocolError(f"a stage peer's reply has no {key!r}")
    return body[key]
