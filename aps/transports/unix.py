"""The Unix-socket transport: ``unix:///absolute/path.sock``, for workers on the learner's host.

The frames, flow control and errors are those of :mod:`aps.transports.tcp`; only the socket
differs. A Unix-domain socket skips the TCP/IP stack that loopback TCP runs every message
through, so a small message costs less CPU at both ends and arrives sooner: what a learner
with workers on its own machine pays per step. Access follows file permissions, not ports.

- ``unix://`` (no path) listens on a fresh socket in a new private directory (mode 0700),
  the analogue of TCP port 0; :attr:`UnixListener.url` reports the path, and ``aclose``
  removes the socket and the directory.
- ``unix:///path/learner.sock`` listens there. A socket file left behind by a listener that
  is gone (nothing answers on it) is replaced; a live one, or any other file, is refused.
  ``aclose`` removes the socket file.

Paths must be absolute, and short: the operating system limits a socket's path to
:data:`MAX_PATH_BYTES` bytes.

Example:
    >>> import asyncio
    >>> async def main():
    ...     factory = UnixFactory()
    ...     async with await factory.listen("unix://") as listener:
    ...         client = await factory.connect(listener.url, timeout=5)
    ...         server = await listener.accept()
    ...         await client.send(b"ping")
    ...         frame = await server.receive()
    ...         await client.aclose()
    ...         await server.aclose()
    ...         return frame
    >>> asyncio.run(main())
    b'ping'
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
import sys
import tempfile
from urllib.parse import unquote, urlsplit

from aps.errors import ConfigError, ConnectError
from aps.transports.base import DEFAULT_MAX_FRAME_SIZE
from aps.transports.listener import ACCEPT_BACKLOG
from aps.transports.stream import StreamConnection, dial, reason
from aps.transports.tcp import TCPListener, TCPTransport
from aps.wire.framing import check_max_frame_size

__all__ = ["MAX_PATH_BYTES", "UnixFactory", "UnixListener", "UnixTransport"]

MAX_PATH_BYTES = 107 if sys.platform.startswith("linux") else 103
"""The longest socket path, in bytes: ``sun_path`` holds 108 on Linux (104 on macOS and
the BSDs), the terminating NUL included."""

_SEND_BUFFER = 4 * 2**20

_USAGE = "write it as unix:///absolute/path.sock, or unix:// for a fresh private path"


class UnixTransport(TCPTransport):
    """One Unix-socket connection carrying length-prefixed frames (as :class:`TCPTransport`).

    Created by :meth:`UnixFactory.connect` and :meth:`UnixListener.accept`; :attr:`peer`
    is the listener's URL at both ends (a Unix socket's peer has no address of its own).
    """

    @property
    def is_local(self) -> bool:
        """Always ``True``: a Unix socket's peer is on this host."""
        return True

    def _tune(self, sock: socket.socket) -> None:
        # A Unix stream socket queues at most its sender's SO_SNDBUF (208 KiB by default on
        # Linux) where loopback TCP grows its buffers to megabytes: without this, a 40 MB
        # weights frame takes hundreds of extra wake-ups. The kernel caps it at wmem_max.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BUFFER)


class UnixListener(TCPListener):
    """A listening Unix socket; create it with :meth:`UnixFactory.listen`.

    Its :attr:`url` is the socket's, a generated path resolved
    (``unix:///tmp/aps-x1y2/learner.sock``). ``aclose`` also removes the socket file, and the
    directory made for a generated path.

    Args:
        sock: the bound, listening socket; the listener owns it from here.
        path: its file.
        owned_dir: the directory made for it (removed at ``aclose``), or ``None``.
        max_frame_size: the largest frame an accepted transport sends or receives.
    """

    _transport_type = UnixTransport

    def __init__(
        self, sock: socket.socket, *, path: str, owned_dir: str | None, max_frame_size: int
    ) -> None:
        self._path = path
        self._owned_dir = owned_dir
        super().__init__(sock, url=f"unix://{path}", max_frame_size=max_frame_size)

    @property
    def is_local(self) -> bool:
        """Always ``True``: only this host can connect, as file permissions allow."""
        return True

    @property
    def path(self) -> str:
        """The socket file's path."""
        return self._path

    def _stopped(self) -> None:
        with contextlib.suppress(OSError):  # removed by someone else: nothing to clean
            if stat.S_ISSOCK(os.lstat(self._path).st_mode):
                os.unlink(self._path)
        if self._owned_dir is not None:
            with contextlib.suppress(OSError):
                os.rmdir(self._owned_dir)

    def _peer_for(self, connection: StreamConnection) -> str:
        return self._url

    def _peer_at(self, address: object) -> str:
        return self._url


class UnixFactory:
    """Creates Unix-socket transports and listeners.

    Args:
        max_frame_size: the largest frame sent or received, in bytes (at most 4 GiB - 1).

    Raises:
        ConfigError: ``max_frame_size`` is out of range, or this platform has no Unix sockets.
    """

    def __init__(self, *, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        if not hasattr(socket, "AF_UNIX"):
            raise ConfigError(
                "unix:// transports need Unix-domain sockets, which this platform lacks; "
                "use tcp://127.0.0.1:port"
            )
        self.max_frame_size = check_max_frame_size(max_frame_size)

    async def connect(self, url: str, *, timeout: float | None = None) -> UnixTransport:
        """Connect to ``unix:///path``.

        Raises:
            ConnectError: no socket at that path, nobody listening on it, or no permission.
            Timeout: not connected within ``timeout`` seconds (``None``: no limit).
            ConfigError: ``url`` is malformed.
        """
        path = _parse_url(url, listening=False)
        assert path is not None  # _parse_url refuses a url without one
        transport, connection = await dial(
            lambda: asyncio.get_running_loop().create_unix_connection(
                lambda: StreamConnection(self.max_frame_size), path
            ),
            url,
            timeout,
            there="there",
            at="at that path and that this user may open it",
        )
        return UnixTransport(connection, transport, peer=url, max_frame_size=self.max_frame_size)

    async def listen(self, url: str) -> UnixListener:
        """Bind ``unix:///path`` (or a fresh private path for ``unix://``) and start accepting.

        Raises:
            ConnectError: a live listener or a file that is not a socket holds the path, the
                path cannot be bound (no such directory, no permission), or no directory
                could be made for a fresh one.
            ConfigError: ``url`` is malformed or its path too long.
        """
        path = _parse_url(url, listening=True)
        owned_dir = None
        if path is None:
            try:
                owned_dir, path = _fresh_path()
            except OSError as exc:
                raise ConnectError(
                    f"cannot listen on {url!r}: no directory for the socket could be made "
                    f"({reason(exc)}); set TMPDIR to a writable directory, or listen on "
                    "unix:///writable/path.sock or tcp://127.0.0.1:0",
                    url=url,
                ) from exc
        else:
            _clear_stale(path, url)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            sock.listen(ACCEPT_BACKLOG)
        except OSError as exc:
            sock.close()
            if owned_dir is not None:
                with contextlib.suppress(OSError):
                    os.rmdir(owned_dir)
            raise ConnectError(
                f"cannot listen on {url!r}: {reason(exc)}; check that the directory exists "
                "and this user may write to it",
                url=url,
            ) from exc
        return UnixListener(
            sock, path=path, owned_dir=owned_dir, max_frame_size=self.max_frame_size
        )

    def __repr__(self) -> str:
        return f"UnixFactory(max_frame_size={self.max_frame_size})"


def _parse_url(url: str, *, listening: bool) -> str | None:
    """The socket path of ``url``; ``None`` for ``unix://`` (a fresh path, listeners only)."""
    parts = urlsplit(url)
    if parts.netloc or parts.query or parts.fragment:
        raise ConfigError(
            f"unix url {url!r} has a host, query or fragment part; {_USAGE} "
            "(three slashes before an absolute path)"
        )
    path = unquote(parts.path)
    if not path:
        if listening:
            return None
        raise ConfigError(
            f"unix url {url!r} has no path to connect to; connect to the url the listener "
            "reports (listener.url), which has the path"
        )
    if not os.path.isabs(path) or path.endswith("/"):
        raise ConfigError(f"unix url {url!r} names no socket file by absolute path; {_USAGE}")
    _check_length(path, url)
    return path


def _fresh_path() -> tuple[str, str]:
    """A new directory (mode 0700: this user only) and a socket path in it, short enough.

    Under the temporary directory (``TMPDIR``), or ``/tmp`` where that one's path is too
    long for a socket path.
    """
    for parent in (None, "/tmp"):
        directory = tempfile.mkdtemp(prefix="aps-", dir=parent)
        path = os.path.join(directory, "learner.sock")
        if len(os.fsencode(path)) <= MAX_PATH_BYTES:
            return directory, path
        os.rmdir(directory)
    raise ConfigError(
        f"cannot make a short enough socket path for unix://: {directory!r} is too long; "
        "pass unix:///short/path.sock"
    )


def _check_length(path: str, url: str) -> None:
    size = len(os.fsencode(path))
    if size > MAX_PATH_BYTES:
        raise ConfigError(
            f"the socket path of {url!r} is {size} bytes, over this system's limit of "
            f"{MAX_PATH_BYTES}; pick a shorter path (under /tmp, for instance)"
        )


def _clear_stale(path: str, url: str) -> None:
    """Remove a socket file at ``path`` that no listener answers on.

    Raises:
        ConnectError: a listener answers there, or the file is not a socket.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ConnectError(
            f"cannot listen on {url!r}: the path exists and is not a socket; pick another path",
            url=url,
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)  # a live listener with a full backlog must not block the loop
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        try:
            os.unlink(path)  # its listener is gone
        except OSError as exc:
            raise ConnectError(
                f"cannot listen on {url!r}: the socket file a stopped listener left there "
                f"cannot be removed ({reason(exc)}); remove it or pick another path",
                url=url,
            ) from exc
        return
    except BlockingIOError:
        pass  # alive, its backlog full
    except OSError as exc:
        raise ConnectError(f"cannot listen on {url!r}: {reason(exc)}", url=url) from exc
    finally:
        probe.close()
    raise ConnectError(
        f"cannot listen on {url!r}: another listener is using it; stop that process or pick "
        "another path (unix:// picks a fresh one)",
        url=url,
    )
