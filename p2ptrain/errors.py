"""The exception tree of p2ptrain.

Every error the package raises on purpose derives from :class:`P2PTrainError`,
so ``except P2PTrainError`` catches them all. OS and library errors are
translated at the I/O edge and chained with ``raise ... from``.

::

    P2PTrainError
    ├── ConfigError                      bad argument or config value (ValueError too)
    ├── MissingDependencyError           an optional extra is not installed (ImportError too)
    ├── IdentityError                    unreadable key file, bad public key
    ├── ProtocolError                    a frame or message breaks the wire protocol
    │   ├── LocalProtocolError           we were asked to send something invalid
    │   └── RemoteProtocolError          the other side sent something invalid
    │       ├── FrameTooLargeError       length header above the configured maximum
    │       ├── TensorFormatError        bad dtype, shape or payload size
    │       ├── FlowControlError         more than a stream's window or a buffer allows
    │       └── IntegrityError           a sealed record failed to authenticate (tampered,
    │                                    replayed, reordered, dropped, truncated, injected)
    ├── HandshakeError                   the authenticated handshake failed
    │   ├── AuthenticationError          bad signature, wrong PeerID, replay
    │   └── AdmissionError               refused by the swarm's admission policy
    ├── TransportError
    │   ├── ConnectError                 could not open a connection
    │   ├── ConnectionClosedError        the connection is gone
    │   ├── TransportTimeoutError        a connection-level operation timed out
    │   └── NATTraversalError            every path to a peer failed; ``attempts`` says why
    ├── StreamEndedError                 the remote finished sending on a stream
    ├── RPCError                         an RPC failed; ``code`` says how
    │   ├── MethodNotFoundError          no handler for the method
    │   ├── InvalidArgumentError         the handler rejected the request
    │   ├── DeadlineExceededError        the call's deadline passed
    │   ├── RPCCancelledError            the other side cancelled the stream
    │   ├── ResourceExhaustedError       a limit was hit (size, rate, credit)
    │   ├── PermissionDeniedError        the caller is not allowed
    │   ├── UnavailableError             the peer is shutting down or unreachable
    │   └── RemoteInternalError          the remote handler crashed
    ├── DHTError
    │   ├── RecordRejectedError          bad signature, oversized, bad expiration
    │   └── LookupFailedError            no node answered
    ├── AllReduceError
    │   ├── MatchmakingError             no group could be formed in time
    │   └── PeerDroppedError             a peer of the group failed; ``peer`` names it
    └── TrainingError                    the training layer could not do its job
        ├── StateSyncError               no peer provided a usable state
        ├── CheckpointError              a checkpoint cannot be written or read
        ├── RunMismatchError             this peer's model is not its run's
        ├── TrainingStoppedError         a step reached the trainer's stop time
        ├── ConcurrentStepError          step() entered while another step() ran
        └── PipelineError                pipeline (SWARM) training could not do its job
            ├── StageUnavailableError    no live peer serves a stage right now
            └── MemoryBudgetError        a stage does not fit this peer's memory budget
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AdmissionError",
    "AllReduceError",
    "AuthenticationError",
    "CheckpointError",
    "ConcurrentStepError",
    "ConfigError",
    "ConnectError",
    "ConnectionClosedError",
    "DHTError",
    "DeadlineExceededError",
    "FlowControlError",
    "FrameTooLargeError",
    "HandshakeError",
    "IdentityError",
    "IntegrityError",
    "InvalidArgumentError",
    "LocalProtocolError",
    "LookupFailedError",
    "MatchmakingError",
    "MemoryBudgetError",
    "MethodNotFoundError",
    "MissingDependencyError",
    "NATTraversalError",
    "P2PTrainError",
    "PeerDroppedError",
    "PermissionDeniedError",
    "PipelineError",
    "ProtocolError",
    "RPCCancelledError",
    "RPCError",
    "RecordRejectedError",
    "RemoteInternalError",
    "RemoteProtocolError",
    "ResourceExhaustedError",
    "RunMismatchError",
    "StageUnavailableError",
    "StateSyncError",
    "StreamEndedError",
    "TensorFormatError",
    "TrainingError",
    "TrainingStoppedError",
    "TransportError",
    "TransportTimeoutError",
    "UnavailableError",
    "rpc_error_from_code",
]


class P2PTrainError(Exception):
    """Root of every error p2ptrain raises on purpose."""


class ConfigError(P2PTrainError, ValueError):
    """A configuration value or argument is invalid."""


class MissingDependencyError(P2PTrainError, ImportError):
    """An optional extra (``p2ptrain[plot]``, say) is needed and not installed."""


class IdentityError(P2PTrainError):
    """A key file cannot be read or a public key is malformed."""


class ProtocolError(P2PTrainError):
    """A frame or message violates the wire protocol."""


class LocalProtocolError(ProtocolError):
    """We were asked to send something the protocol does not allow."""


class RemoteProtocolError(ProtocolError):
    """The remote side sent something the protocol does not allow."""


class FrameTooLargeError(RemoteProtocolError):
    """A frame's length header exceeds the configured maximum."""


class FlowControlError(RemoteProtocolError):
    """The remote sent more than a stream's window (or the connection's buffer) allows."""


class TensorFormatError(RemoteProtocolError):
    """A tensor header names a bad dtype or disagrees with its payload size."""


class IntegrityError(RemoteProtocolError):
    """A sealed record did not authenticate: it was altered, replayed, reordered,
    dropped, truncated or injected on the way. The connection is closed and
    nothing from the record reaches the application."""


class HandshakeError(P2PTrainError):
    """The authenticated handshake did not complete."""

    from_remote: bool = False
    """True when the remote refused us (its REFUSE frame), False when we refused."""


class AuthenticationError(HandshakeError):
    """The remote failed to prove its identity (bad signature, wrong PeerID)."""


class AdmissionError(HandshakeError):
    """The swarm's admission policy refused the connection."""


class TransportError(P2PTrainError):
    """A connection-level failure."""


class ConnectError(TransportError):
    """A connection could not be opened."""


class ConnectionClosedError(TransportError):
    """The connection was closed, by either side or by a failure."""


class TransportTimeoutError(TransportError):
    """A connection-level operation (handshake, read) timed out."""


class StreamEndedError(P2PTrainError):
    """The remote half-closed the stream: no more messages will arrive.

    Not a failure; ``async for`` over a stream ends on it quietly.
    """


class RPCError(P2PTrainError):
    """An RPC failed. ``code`` is the wire code carried to the caller."""

    code = "unknown"

    def __init__(self, message: str = "", *, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details or {}

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}" if self.message else f"[{self.code}]"


class MethodNotFoundError(RPCError):
    """The remote has no handler for the requested method."""

    code = "not_found"


class InvalidArgumentError(RPCError):
    """The handler rejected the request as malformed."""

    code = "invalid_argument"


class DeadlineExceededError(RPCError):
    """The call did not complete before its deadline."""

    code = "deadline_exceeded"


class RPCCancelledError(RPCError):
    """The other side cancelled the stream."""

    code = "cancelled"


class ResourceExhaustedError(RPCError):
    """A size, rate or capacity limit was hit."""

    code = "resource_exhausted"


class PermissionDeniedError(RPCError):
    """The caller is not allowed to perform this call."""

    code = "permission_denied"


class UnavailableError(RPCError):
    """The peer is shutting down, or the connection dropped mid-call."""

    code = "unavailable"


class RemoteInternalError(RPCError):
    """The remote handler raised an unexpected exception."""

    code = "internal"


_RPC_ERRORS_BY_CODE: dict[str, type[RPCError]] = {
    cls.code: cls
    for cls in (
        MethodNotFoundError,
        InvalidArgumentError,
        DeadlineExceededError,
        RPCCancelledError,
        ResourceExhaustedError,
        PermissionDeniedError,
        UnavailableError,
        RemoteInternalError,
    )
}


def rpc_error_from_code(code: str, message: str, details: dict[str, Any] | None = None) -> RPCError:
    """Build the typed exception for a wire error code (unknown codes give RPCError)."""
    cls = _RPC_ERRORS_BY_CODE.get(code)
    if cls is None:
        err = RPCError(message, details=details)
        err.code = code
        return err
    return cls(message, details=details)


class NATTraversalError(TransportError):
    """Every path to a peer failed. ``attempts`` maps each path to why it failed."""

    def __init__(self, message: str, attempts: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.attempts = attempts or {}

    def __str__(self) -> str:
        if not self.attempts:
            return super().__str__()
        reasons = "; ".join(f"{path}: {why}" for path, why in self.attempts.items())
        return f"{super().__str__()} ({reasons})"


class DHTError(P2PTrainError):
    """A DHT operation failed."""


class RecordRejectedError(DHTError):
    """A record was refused: bad signature, too large, or bad expiration."""


class LookupFailedError(DHTError):
    """A lookup could not reach any node."""


class AllReduceError(P2PTrainError):
    """An all-reduce round failed."""


class MatchmakingError(AllReduceError):
    """No group could be formed within the time window."""


class PeerDroppedError(AllReduceError):
    """A member of the group failed during the round."""

    def __init__(self, message: str, *, peer: str) -> None:
        super().__init__(message)
        self.peer = peer


class TrainingError(P2PTrainError):
    """The training layer could not do its job."""


class StateSyncError(TrainingError):
    """No peer provided a usable training state (unreachable, corrupt, or incompatible)."""


class CheckpointError(TrainingError):
    """A checkpoint cannot be written or read."""


class RunMismatchError(TrainingError):
    """This peer's model (parameter shapes and dtypes) differs from the one its run trains."""


class TrainingStoppedError(TrainingError):
    """A step still waited for the swarm at the trainer's stop time; it was not applied."""


class ConcurrentStepError(TrainingError):
    """``step()`` was called while another ``step()`` of the same optimizer ran.

    The collaborative optimizers are not re-entrant: two steps at once would
    average one swarm step twice and count its samples twice."""


class PipelineError(TrainingError):
    """Pipeline (SWARM) training could not do its job."""


class StageUnavailableError(PipelineError):
    """No live peer serves a stage right now (the pipeline pauses until one does)."""


class MemoryBudgetError(PipelineError):
    """A stage's parameters and optimizer state do not fit this peer's memory budget."""
