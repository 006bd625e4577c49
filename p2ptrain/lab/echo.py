"""One unary ``echo`` handler for tests and for checking a deployment by hand.

It answers with what came in and how it came: the request's body under
``"body"``, the caller's PeerID (as the server authenticated it) under
``"peer"``, the transport path (``tcp-direct``, ``relay``, ``webrtc-direct``,
...) under ``"path"``, and the request's payload as its own payload::

    node.handlers.add_unary("echo", echo)
    reply = await other.call(node.address, "echo", {"k": 1}, b"data")
    assert reply.body["body"] == {"k": 1} and bytes(reply.payload) == b"data"
"""

from __future__ import annotations

from p2ptrain.rpc.handlers import CallContext, Message

__all__ = ["echo"]


async def echo(context: CallContext, request: Message) -> Message:
    """Reply with the request's body, payload, caller and path (see the module docstring)."""
    body = {"body": request.body, "peer": str(context.peer), "path": context.path}
    return Message(body, request.payload)
