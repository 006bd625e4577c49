"""The explicit table of RPC handlers a node serves."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from p2ptrain.errors import ConfigError
from p2ptrain.secure.identity import PeerID

if TYPE_CHECKING:
    from p2ptrain.rpc.stream import RPCStream

__all__ = ["CallContext", "HandlerTable", "Message", "StreamHandler", "UnaryHandler"]


class Message(NamedTuple):
    """One RPC message: a msgpack-able body plus optional raw bytes (tensor data)."""

    body: Any = None
    payload: bytes | bytearray | memoryview = b""


@dataclass(frozen=True)
class CallContext:
    """What a handler knows about the call it serves."""

    peer: PeerID
    method: str
    deadline: float | None
    """Loop time by which the call must finish, or None."""
    path: str
    """The transport path of the connection, e.g. ``tcp-direct``."""
    remote_address: str = "?"
    """Where the caller's connection comes from, as the transport sees it."""


UnaryHandler = Callable[[CallContext, Message], Awaitable[Message]]
StreamHandler = Callable[[CallContext, "RPCStream"], Awaitable[None]]


@dataclass(frozen=True)
class _Entry:
    handler: UnaryHandler | StreamHandler
    streaming: bool
    unbounded: bool = False


class HandlerTable:
    """Maps method names to handlers.

    A unary handler takes one request message and returns one response. A
    stream handler gets the :class:`~p2ptrain.rpc.stream.RPCStream` and may
    receive and send any number of messages (server streaming and
    bidirectional streaming are both this).
    """

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def add_unary(self, method: str, handler: UnaryHandler) -> None:
        """Serve ``method`` with a request/response handler."""
        self._add(method, _Entry(handler, streaming=False))

    def add_stream(self, method: str, handler: StreamHandler, *, unbounded: bool = False) -> None:
        """Serve ``method`` with a streaming handler.

        Every handler is cancelled once it ran ``ConnectionConfig.handler_timeout``
        (or at the caller's deadline, if sooner); ``unbounded=True`` exempts a
        method whose streams live as long as the caller keeps them (a
        registration, a relayed circuit): only the caller's deadline, the
        stream caps and the connection's life bound it.
        """
        self._add(method, _Entry(handler, streaming=True, unbounded=unbounded))

    def remove(self, method: str) -> None:
        """Stop serving ``method``."""
        self._entries.pop(method, None)

    def _add(self, method: str, entry: _Entry) -> None:
        if not method or len(method) > 128:
            raise ConfigError("a method name must be 1 to 128 characters")
        if method in self._entries:
            raise ConfigError(f"method {method!r} already has a handler")
        self._entries[method] = entry

    def lookup(self, method: str) -> _Entry | None:
        """The handler entry of ``method``, or None if not served."""
        return self._entries.get(method)

    def __contains__(self, method: object) -> bool:
        return method in self._entries

    def methods(self) -> list[str]:
        """Names of every method served."""
        return sorted(self._entries)
