"""Every failure aps raises on purpose is an :class:`ApsError`.

The tree::

    ApsError(Exception)
    ├── ConfigError(ApsError, ValueError)         a bad argument, URL, space or registration
    ├── MissingDependency(ApsError, ImportError)  an optional extra is not installed
    ├── WireError(ApsError, ValueError)           bytes that do not decode to a valid message
    │   ├── FrameTooLarge(WireError)              .size, .limit
    │   └── VersionMismatch(WireError)            .ours, .theirs
    ├── TransportError(ApsError)                  what a transport backend raised, chained
    │   ├── ConnectError(TransportError)          could not establish a connection (.url)
    │   ├── ConnectionLost(TransportError)        reset, abnormal close, OS error
    │   ├── EndOfStream(TransportError)           the peer closed cleanly (receive only)
    │   └── TransportClosed(TransportError)       this side already called aclose()
    ├── ProtocolError(ApsError)                   the peer broke the aps protocol
    ├── InvalidState(ApsError, RuntimeError)      the caller broke the API
    ├── AuthError(ApsError)                       a token proof was wrong or missing
    ├── WorkerError(ApsError)                     an env raised on a worker (remote type, traceback)
    ├── WorkerLost(ApsError)                      a worker vanished mid-operation (.worker_id)
    ├── LaunchError(ApsError)                     a launcher could not start or keep its workers
    │                                             (.stderr: the cluster engine's own words)
    └── Timeout(ApsError, TimeoutError)           a deadline passed (.operation, .seconds)

Messages are lowercase, show the offending value and the limit, and name the fix.
"""

from __future__ import annotations

__all__ = [
    "ApsError",
    "AuthError",
    "ConfigError",
    "ConnectError",
    "ConnectionLost",
    "EndOfStream",
    "FrameTooLarge",
    "InvalidState",
    "LaunchError",
    "MissingDependency",
    "ProtocolError",
    "Timeout",
    "TransportClosed",
    "TransportError",
    "VersionMismatch",
    "WireError",
    "WorkerError",
    "WorkerLost",
]


class ApsError(Exception):
    """Base class of every error aps raises on purpose."""


class ConfigError(ApsError, ValueError):
    """A bad argument: a URL, a size, a space, a registration, an action batch."""


class MissingDependency(ApsError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


class WireError(ApsError, ValueError):
    """Bytes that do not decode to a valid message."""


class FrameTooLarge(WireError):
    """A frame (or an array inside one) is larger than the configured limit."""

    def __init__(self, size: int, limit: int, what: str = "frame") -> None:
        self.size = size
        self.limit = limit
        super().__init__(
            f"{what} of {size} bytes exceeds the limit of {limit} bytes; "
            "raise max_frame_size on both sides if this size is intended"
        )


class VersionMismatch(WireError):
    """The peer speaks another version of the aps protocol."""

    def __init__(self, ours: int, theirs: object) -> None:
        self.ours = ours
        self.theirs = theirs
        super().__init__(
            f"peer speaks aps protocol version {theirs!r}, this side speaks {ours}; "
            "install the same aps release on the learner and the workers"
        )


class TransportError(ApsError):
    """A transport failed; the backend's exception is chained as ``__cause__``."""


class ConnectError(TransportError):
    """A connection could not be established."""

    def __init__(self, message: str, *, url: str = "") -> None:
        self.url = url
        super().__init__(message)


class ConnectionLost(TransportError):
    """The connection broke: a reset, an abnormal close or an OS error."""


class EndOfStream(TransportError):
    """The peer closed the connection cleanly; no more frames will arrive."""


class TransportClosed(TransportError):
    """This side already closed the transport."""


class ProtocolError(ApsError):
    """The peer broke the aps protocol (an unexpected message or a bad handshake)."""


class InvalidState(ApsError, RuntimeError):
    """The caller used the API out of order (step before reset, concurrent receive, ...)."""


class AuthError(ApsError):
    """A peer failed to prove it knows the shared token."""


class WorkerError(ApsError):
    """An environment raised on a worker.

    The remote exception is not rebuilt (that would need pickle); its type name and
    formatted traceback travel as text.
    """

    def __init__(
        self,
        message: str,
        *,
        worker_id: int,
        remote_type: str,
        remote_traceback: str,
    ) -> None:
        self.worker_id = worker_id
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback
        self.message = message
        super().__init__(f"worker {worker_id} raised {remote_type}: {message}")

    def __str__(self) -> str:
        head = super().__str__()
        if not self.remote_traceback:
            return head
        return f"{head}\n\nremote traceback:\n{self.remote_traceback.rstrip()}"


class WorkerLost(ApsError):
    """A worker disconnected or went silent while the learner needed it."""

    def __init__(self, message: str, *, worker_id: int) -> None:
        self.worker_id = worker_id
        super().__init__(message)


class LaunchError(ApsError):
    """A launcher could not start its workers, or the cluster job holding them failed.

    ``stderr`` holds what the cluster engine said (``sbatch``'s error output, the tail of a
    failed job's log), verbatim, so that the fix the engine suggests is not lost.
    """

    def __init__(self, message: str, *, stderr: str = "") -> None:
        self.stderr = stderr
        super().__init__(message)

    def __str__(self) -> str:
        head = super().__str__()
        if not self.stderr.strip():
            return head
        return f"{head}\n\nit said:\n{self.stderr.rstrip()}"


class Timeout(ApsError, TimeoutError):
    """A deadline passed."""

    def __init__(self, message: str, *, operation: str, seconds: float | None) -> None:
        self.operation = operation
        self.seconds = seconds
        super().__init__(message)
