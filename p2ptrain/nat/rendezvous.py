"""The rendezvous point: what a public peer runs for NATed peers.

It serves ``nat.register`` (a NATed peer's standing registration) and
``nat.connect`` (a dialer's circuit to a registered peer), and copies circuit
messages between the two streams (:func:`splice`); the protocol is described
in :mod:`p2ptrain.nat.signaling`. Signaling circuits are bounded in messages,
bytes per message and lifetime; relay circuits, offered only with
``NATConfig.relay``, by a :class:`~p2ptrain.nat.relay.CircuitBudget`. A
limit that is hit resets both streams with ``resource_exhausted`` and says
which limit.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from p2ptrain.errors import (
    InvalidArgumentError,
    LocalProtocolError,
    PermissionDeniedError,
    RemoteProtocolError,
    ResourceExhaustedError,
    RPCError,
    UnavailableError,
)
from p2ptrain.nat.config import NATConfig
from p2ptrain.nat.relay import RelayLimiter
from p2ptrain.nat.signaling import (
    ACCEPT,
    CONNECT,
    KINDS,
    REGISTER,
    VERSION,
    connection_of,
    first_message,
    observed_address,
    peer_id_field,
)
from p2ptrain.rpc.connection import Connection
from p2ptrain.rpc.handlers import CallContext, HandlerTable
from p2ptrain.rpc.stream import RPCStream
from p2ptrain.secure.identity import PeerID
from p2ptrain.transport.webrtc_signaling import MAX_SIGNAL_BYTES

__all__ = ["RendezvousServer", "splice"]

logger = logging.getLogger(__name__)


@dataclass
class _Registered:
    peer: PeerID
    connection: Connection
    stream: RPCStream
    observed: str | None


class _SignalBudget:
    """Message count and size limits of a signaling circuit (both directions)."""

    def __init__(self, max_messages: int) -> None:
        self.left = {True: max_messages, False: max_messages}

    def charge(self, forward: bool, nbytes: int) -> float:
        if nbytes > MAX_SIGNAL_BYTES:
            raise ResourceExhaustedError(
                f"a signaling message of {nbytes} bytes (limit {MAX_SIGNAL_BYTES})"
            )
        if self.left[forward] <= 0:
            raise ResourceExhaustedError("too many signaling messages on one circuit")
        self.left[forward] -= 1
        return 0.0


class RendezvousServer:
    """The rendezvous point a public peer runs for NATed peers.

    Args:
        config: Limits (``max_registrations``, signaling limits, relaying).
        stun_port: The port of this peer's STUN responder, told to registrants.
        clock: The limiter's clock (loop time by default).
    """

    def __init__(
        self,
        *,
        config: NATConfig,
        stun_port: int | None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._config = config
        self._stun_port = stun_port
        self._clock = clock or asyncio.get_running_loop().time
        self._registered: dict[PeerID, _Registered] = {}
        self.relay: RelayLimiter | None = (
            RelayLimiter(config.relay_limits, self._clock()) if config.relay else None
        )
        self.circuits = 0

    def install(self, handlers: HandlerTable) -> None:
        """Serve ``nat.register`` and ``nat.connect``."""
        handlers.add_stream(REGISTER, self._on_register, unbounded=True)  # a registration
        handlers.add_stream(CONNECT, self._on_connect, unbounded=True)  # a relayed circuit

    def uninstall(self, handlers: HandlerTable) -> None:
        """Stop serving."""
        handlers.remove(REGISTER)
        handlers.remove(CONNECT)

    def registered(self) -> list[PeerID]:
        """The peers registered here now."""
        return list(self._registered)

    async def _on_register(self, ctx: CallContext, stream: RPCStream) -> None:
        header = await first_message(stream, REGISTER)
        if header.get("v") != VERSION:
            raise InvalidArgumentError(f"unsupported rendezvous version {header.get('v')!r}")
        old = self._registered.get(ctx.peer)
        if old is None and len(self._registered) >= self._config.max_registrations:
            raise ResourceExhaustedError("this rendezvous point serves its maximum of peers")
        conn = connection_of(stream)
        entry = _Registered(ctx.peer, conn, stream, observed_address(conn))
        self._registered[ctx.peer] = entry
        if old is not None:
            old.stream.reset("cancelled", "replaced by a newer registration")
        try:
            await stream.send(
                {"o": entry.observed, "s": self._stun_port, "r": self.relay is not None}
            )
            logger.info("%s registered (seen at %s)", ctx.peer.short, entry.observed)
            async for _ in stream:
                pass  # nothing is expected; the registration lasts until the stream ends
        finally:
            if self._registered.get(ctx.peer) is entry:
                del self._registered[ctx.peer]
                logger.info("%s unregistered", ctx.peer.short)

    async def _on_connect(self, ctx: CallContext, stream: RPCStream) -> None:
        header = await first_message(stream, CONNECT)
        target = peer_id_field(header.get("t"), "t")
        kind = header.get("k")
        if kind not in KINDS:
            raise InvalidArgumentError(f"unknown circuit kind {kind!r}")
        entry = self._registered.get(target)
        if entry is None or entry.connection.closed:
            raise UnavailableError(f"peer {target.short} is not registered at this rendezvous")
        if target == ctx.peer:
            raise InvalidArgumentError("a peer cannot open a circuit to itself")
        now = self._clock()
        charge: Callable[[bool, int], float]
        if kind == "relay":
            if self.relay is None:
                raise PermissionDeniedError("this peer does not relay (NATConfig.relay is off)")
            budget = self.relay.open(ctx.peer, target, now)
            lifetime = budget.expires

            def charge(forward: bool, nbytes: int) -> float:
                return budget.charge(nbytes, self._clock())

            release: Callable[[], None] = budget.close
        else:
            signal = _SignalBudget(self._config.max_signal_messages)
            lifetime = now + self._config.signal_circuit_seconds
            charge = signal.charge

            def release() -> None:
                pass

        caller = connection_of(stream)
        try:
            accept = await entry.connection.open_stream(ACCEPT)
            try:
                await accept.send({"f": ctx.peer.digest, "o": observed_address(caller), "k": kind})
                await stream.send({"o": entry.observed, "y": observed_address(caller)})
                self.circuits += 1
                logger.debug("%s circuit %s -> %s", kind, ctx.peer.short, target.short)
                await splice(stream, accept, charge, lifetime, self._clock)
            finally:
                await accept.aclose()
        finally:
            release()


async def splice(
    a: RPCStream,
    b: RPCStream,
    charge: Callable[[bool, int], float],
    deadline: float | None,
    clock: Callable[[], float],
) -> None:
    """Copy messages a -> b and b -> a until both directions ended or one failed.

    Args:
        a: One stream (the dialer's).
        b: The other (the target's).
        charge: ``charge(forward, nbytes)`` accounts for a message (forward
            is a -> b) and returns the seconds to hold it; it raises
            :class:`~p2ptrain.errors.RPCError` to refuse it, which resets both.
        deadline: When the circuit must close, on ``clock``, or None.
        clock: The clock of ``deadline`` and ``charge``.
    """

    async def copy(src: RPCStream, dst: RPCStream, forward: bool) -> None:
        try:
            async for message in src:
                if message.body is not None:
                    raise InvalidArgumentError("a circuit message carries a payload only")
                hold = charge(forward, len(message.payload))
                if hold > 0:
                    await asyncio.sleep(hold)  # the token bucket's pace, not a wait for an event
                await dst.send(payload=message.payload)
            await dst.end()
        except RPCError as exc:
            src.reset(exc.code, exc.message)
            dst.reset(exc.code, exc.message)
        except (LocalProtocolError, RemoteProtocolError) as exc:
            src.reset("invalid_argument", str(exc))
            dst.reset("invalid_argument", str(exc))

    loop_deadline = None
    if deadline is not None:
        loop_deadline = asyncio.get_running_loop().time() + max(0.0, deadline - clock())
    try:
        async with asyncio.timeout_at(loop_deadline), asyncio.TaskGroup() as group:
            group.create_task(copy(a, b, True))
            group.create_task(copy(b, a, False))
    except TimeoutError:
        message = "the circuit reached its time limit"
        a.reset(ResourceExhaustedError.code, message)
        b.reset(ResourceExhaustedError.code, message)
