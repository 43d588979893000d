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

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

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


MAX_REMOTE_TEXT: Final = 64 * 1024
"""The most characters of a worker's error message, and of its traceback, a learner keeps."""

MAX_REMOTE_TYPE: Final = 256
"""The most characters of a worker's exception type name a learner keeps."""


def _cut(text: str, limit: int, what: str) -> str:
    """``text``, or its first ``limit`` characters and a note saying it was cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n[the worker's {what} was cut: {len(text)} characters, {limit} kept]"


class WorkerError(ApsError):
    """An environment raised on a worker.

    The remote exception is not rebuilt (that would need pickle); its type name and
    formatted traceback travel as text. A worker chooses that text, so it is capped:
    ``message`` and ``remote_traceback`` at :data:`MAX_REMOTE_TEXT` characters each,
    ``remote_type`` at :data:`MAX_REMOTE_TYPE`, each with a note where it was cut.
    :func:`rebuilt` raises a few built-in types as themselves.
    """

    def __init__(
        self,
        message: str,
        *,
        worker_id: int,
        remote_type: str,
        remote_traceback: str,
    ) -> None:
        # Cut before anything is formatted: a worker's 200 MiB message must not be copied
        # into every string built from it.
        message = _cut(message, MAX_REMOTE_TEXT, "message")
        remote_type = _cut(remote_type, MAX_REMOTE_TYPE, "type name")
        remote_traceback = _cut(remote_traceback, MAX_REMOTE_TEXT, "traceback")
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


REBUILT_TYPES: Final[Mapping[str, type[Exception]]] = MappingProxyType(
    {
        f"builtins.{kind.__name__}": kind
        for kind in (
            ArithmeticError,
            AssertionError,
            AttributeError,
            FileNotFoundError,
            FloatingPointError,
            IndexError,
            KeyError,
            LookupError,
            NotImplementedError,
            OSError,
            OverflowError,
            PermissionError,
            RuntimeError,
            TypeError,
            ValueError,
            ZeroDivisionError,
        )
    }
)
"""The exception types a worker's error is raised as on the learner, by qualified name.

Plain :class:`Exception` subclasses that envs raise and callers catch for what they say.
Never a type that steers control flow: ``StopIteration`` and ``StopAsyncIteration`` (they
would end a ``map`` or a generator on the learner silently), ``GeneratorExit``,
``KeyboardInterrupt``, ``SystemExit`` (not even :class:`Exception`), ``MemoryError`` and
``RecursionError`` (the learner's own state), ``TimeoutError``, ``ConnectionError`` and
``EOFError`` (the learner's own I/O), ``ImportError`` (the learner's own imports).
"""


def rebuilt(error: WorkerError) -> Exception:
    """The exception ``error`` is raised as on the learner, as Gymnasium raises an env's.

    A worker's exception whose qualified type name is in :data:`REBUILT_TYPES` is raised as
    that type, with the worker's (capped) message and ``error`` as its cause; any other is
    ``error`` itself, which names the type. The type is looked up on this side by name:
    nothing from the worker is unpickled or chooses code.
    """
    kind = REBUILT_TYPES.get(error.remote_type)
    if kind is None:
        return error
    raised = kind(error.message)
    raised.__cause__ = error
    return raised


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
