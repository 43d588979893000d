"""The TCP transport: ``tcp://host:port``, optionally with TLS.

Frames travel over asyncio streams behind the 4-byte length header of :mod:`aps.framing`.
Listening on port 0 binds a free port, which :attr:`TCPListener.url` reports; IPv6 literals
go in brackets (``tcp://[::1]:0``). An empty host (``tcp://:5555``) listens on all
interfaces.

TLS is configured on the factory with :class:`ssl.SSLContext` objects, never in the URL:

- ``ssl_context`` is used for both ``listen`` and ``connect``;
- ``server_ssl_context`` / ``client_ssl_context`` override it for one side.

A learner typically builds ``TCPFactory(ssl_context=server_ctx)`` (a
``ssl.PROTOCOL_TLS_SERVER`` context with a certificate chain) and its workers
``TCPFactory(ssl_context=client_ctx)`` (for instance ``ssl.create_default_context(cafile=...)``).
A client context verifies the host name in the URL against the certificate.

Example:
    >>> import asyncio
    >>> async def main():
    ...     factory = TCPFactory()
    ...     async with await factory.listen("tcp://127.0.0.1:0") as listener:
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
import socket
import ssl
from types import TracebackType
from typing import Self
from urllib.parse import urlsplit

from aps._typing import Frame
from aps.errors import (
    ConfigError,
    ConnectError,
    ConnectionLost,
    EndOfStream,
    FrameTooLarge,
    InvalidState,
    Timeout,
    TransportClosed,
)
from aps.framing import (
    HEADER_SIZE,
    check_max_frame_size,
    frame_header,
    frame_view,
    parse_header,
)
from aps.transports._util import AcceptQueue, check_ssl_side, detach, format_host, owned_payload
from aps.transports.base import DEFAULT_MAX_FRAME_SIZE

__all__ = ["TCPFactory", "TCPListener", "TCPTransport"]

# The StreamReader pauses the socket once twice this many bytes wait unread. readexactly()
# is not bounded by it; a larger value means fewer pause/resume round trips for big frames.
_READ_LIMIT = 2**20

# Frames up to this size are copied behind their header and written with one call (one
# syscall, one TCP segment for small messages). Larger payloads are written separately so the
# payload is not copied just to prepend four bytes.
_COALESCE_LIMIT = 64 * 2**10

# How long aclose() waits for buffered frames (and the TLS close_notify exchange) to go out
# before it aborts the connection. A live peer takes milliseconds; a dead one must not block
# its closer forever.
_CLOSE_TIMEOUT = 5.0


class _ClosedLocally(Exception):
    """Injected into the stream reader by aclose() to wake a pending receive."""


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or type(exc).__name__


class TCPTransport:
    """One TCP (or TLS) connection carrying length-prefixed frames.

    Created by :meth:`TCPFactory.connect` and :meth:`TCPListener.accept`.

    Attributes:
        max_frame_size: the largest frame this end sends or receives, in bytes.
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        peer: str,
        max_frame_size: int,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._peer_name = peer
        self.max_frame_size = max_frame_size
        self._send_lock = asyncio.Lock()
        self._receiving = False
        self._closed = False
        # The body length announced by a header that receive() consumed before it was
        # cancelled: the next receive() must read that body, not a new header.
        self._pending_length: int | None = None
        sock = writer.get_extra_info("socket")
        if sock is not None:
            try:
                # asyncio usually sets this already; small frames (heartbeats, step replies)
                # must not wait for Nagle's algorithm.
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    @property
    def peer(self) -> str:
        """The other end's address (``tcp://host:port``), for logs and errors."""
        return self._peer_name

    async def send(self, frame: Frame) -> None:
        """Send one whole frame; concurrent calls are serialized.

        Cancellation: the frame is handed to the event loop's buffer in one synchronous step,
        so cancelling while waiting for buffer space still delivers it whole, and cancelling
        while waiting for another sender delivers nothing. Either way the stream stays in
        step.

        Raises:
            TransportClosed: this side already closed (also raised if it closes meanwhile).
            FrameTooLarge: the frame exceeds ``max_frame_size``; nothing was sent.
            ConnectionLost: the connection broke.
        """
        if self._closed:
            raise TransportClosed(f"cannot send to {self.peer}: this transport is closed")
        view = frame_view(frame)
        size = view.nbytes
        if size > self.max_frame_size:
            raise FrameTooLarge(size, self.max_frame_size)
        async with self._send_lock:
            if self._closed:
                raise TransportClosed(f"cannot send to {self.peer}: this transport is closed")
            writer = self._writer
            try:
                if size <= _COALESCE_LIMIT:
                    writer.write(frame_header(size) + view)
                else:
                    writer.write(frame_header(size))
                    writer.write(owned_payload(view))
                await writer.drain()
            except (OSError, RuntimeError, _ClosedLocally) as exc:
                # uvloop raises RuntimeError for a write to a transport the peer's reset has
                # already closed; asyncio's own loop drops such writes silently.
                if self._closed:
                    raise TransportClosed(
                        f"cannot send to {self.peer}: this transport was closed"
                    ) from None
                raise ConnectionLost(
                    f"connection to {self.peer} lost while sending: {_reason(exc)}"
                ) from exc
            if self._closed:
                # aclose() ran while this frame waited for buffer space; an abort may have
                # dropped it, so do not report success.
                raise TransportClosed(f"cannot send to {self.peer}: this transport was closed")

    async def receive(self) -> bytes:
        """Wait for the next whole frame.

        Cancellation: no frame is lost. Bytes stay in the stream buffer until a whole frame
        is there, and a header already read is remembered for the next call.

        Raises:
            EndOfStream: the peer closed cleanly, at a frame boundary.
            TransportClosed: this side closed (also wakes a pending call).
            ConnectionLost: the connection broke, or closed in the middle of a frame.
            FrameTooLarge: the peer announced a frame over ``max_frame_size`` (the transport
                closes).
            InvalidState: another task is already receiving.
        """
        if self._receiving:
            raise InvalidState(
                f"receive() on the transport to {self.peer} is already running in another "
                "task; receive from one task at a time"
            )
        if self._closed:
            raise TransportClosed(f"cannot receive from {self.peer}: this transport is closed")
        self._receiving = True
        try:
            if self._pending_length is None:
                length = parse_header(await self._reader.readexactly(HEADER_SIZE))
                if length > self.max_frame_size:
                    await self.aclose()
                    raise FrameTooLarge(length, self.max_frame_size)
                self._pending_length = length
            frame = await self._reader.readexactly(self._pending_length)
            self._pending_length = None
            return frame
        except asyncio.IncompleteReadError as exc:
            if self._closed:
                raise TransportClosed(
                    f"cannot receive from {self.peer}: this transport was closed"
                ) from None
            if self._pending_length is None and not exc.partial:
                raise EndOfStream(f"{self.peer} closed the connection") from None
            expected = HEADER_SIZE if self._pending_length is None else self._pending_length
            raise ConnectionLost(
                f"{self.peer} closed the connection in the middle of a frame "
                f"({len(exc.partial)} of {expected} bytes arrived)"
            ) from exc
        except (OSError, _ClosedLocally) as exc:
            if self._closed:
                raise TransportClosed(
                    f"cannot receive from {self.peer}: this transport was closed"
                ) from None
            raise ConnectionLost(
                f"connection to {self.peer} lost while receiving: {_reason(exc)}"
            ) from exc
        finally:
            self._receiving = False

    async def aclose(self) -> None:
        """Close the connection after flushing frames already sent.

        Idempotent and never raises a backend error. Wakes a pending ``receive`` at once;
        waits up to a few seconds for buffered frames to leave, then aborts. If cancelled,
        the connection is aborted before the cancellation propagates.
        """
        if self._closed:
            return
        self._closed = True
        self._reader.set_exception(_ClosedLocally())
        writer = self._writer
        try:
            writer.close()
            async with asyncio.timeout(_CLOSE_TIMEOUT):
                await writer.wait_closed()
        except asyncio.CancelledError:
            writer.transport.abort()
            raise
        except Exception:
            # A reset, a TLS error or the timeout: the connection is unusable either way.
            writer.transport.abort()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<TCPTransport peer={self.peer!r} {state}>"


class TCPListener:
    """A bound TCP (or TLS) server socket; create it with :meth:`TCPFactory.listen`."""

    def __init__(self, *, scheme: str, requested: str, max_frame_size: int) -> None:
        self._scheme = scheme
        self._url = requested
        self._max_frame_size = max_frame_size
        self._server: asyncio.Server | None = None
        self._queue: AcceptQueue[TCPTransport] = AcceptQueue(f"listener {requested}")

    @property
    def url(self) -> str:
        """The bound address, port 0 resolved: ``tcp://127.0.0.1:54321``."""
        return self._url

    async def accept(self) -> TCPTransport:
        """Wait for the next connection (after its TLS handshake, if any).

        Cancellation: no connection is lost.

        Raises:
            TransportClosed: the listener was closed (also wakes a pending call).
        """
        return await self._queue.get()

    async def aclose(self) -> None:
        """Stop listening and wake pending ``accept`` calls; idempotent.

        Connections already accepted stay open; connections nobody accepted are closed.
        """
        if self._queue.closed:
            return
        if self._server is not None:
            # Closes the listening sockets at once. Server.wait_closed() is not awaited: since
            # Python 3.12 it also waits for every accepted connection to end.
            self._server.close()
        for transport in self._queue.close():
            await transport.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<TCPListener {self.url}>"

    def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        transport = TCPTransport(
            reader,
            writer,
            peer=_peer_of(writer, self._scheme, fallback=f"{self._scheme}://unknown"),
            max_frame_size=self._max_frame_size,
        )
        if not self._queue.put(transport):
            # The listener closed while this connection was being set up.
            detach(transport.aclose)


class TCPFactory:
    """Creates TCP transports and listeners, with TLS if given SSL contexts.

    Args:
        ssl_context: TLS for both sides; ``None`` means plain TCP.
        server_ssl_context: TLS for :meth:`listen` only (overrides ``ssl_context``).
        client_ssl_context: TLS for :meth:`connect` only (overrides ``ssl_context``).
        max_frame_size: the largest frame sent or received, in bytes (at most 4 GiB - 1).

    Raises:
        ConfigError: ``max_frame_size`` is out of range.
    """

    def __init__(
        self,
        *,
        ssl_context: ssl.SSLContext | None = None,
        server_ssl_context: ssl.SSLContext | None = None,
        client_ssl_context: ssl.SSLContext | None = None,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    ) -> None:
        self.max_frame_size = check_max_frame_size(max_frame_size)
        self._server_ssl = server_ssl_context or ssl_context
        self._client_ssl = client_ssl_context or ssl_context

    async def connect(self, url: str, *, timeout: float | None = None) -> TCPTransport:
        """Connect to ``tcp://host:port`` (and complete the TLS handshake, if configured).

        Raises:
            ConnectError: refused, unreachable, unresolvable, or the TLS handshake failed.
            Timeout: not connected within ``timeout`` seconds (``None``: no limit).
            ConfigError: ``url`` is malformed, or the SSL context is a server-side one.
        """
        scheme, host, port = _parse_url(url, listening=False)
        context = check_ssl_side(self._client_ssl, "client", url, "TCPFactory")
        try:
            async with asyncio.timeout(timeout) as deadline:
                reader, writer = await asyncio.open_connection(
                    host, port, ssl=context, limit=_READ_LIMIT
                )
        except TimeoutError as exc:
            if deadline.expired():
                raise Timeout(
                    f"connecting to {url!r} took longer than {timeout} s; check that a "
                    "listener runs there (with matching TLS settings) or raise the timeout",
                    operation="connect",
                    seconds=timeout,
                ) from exc
            raise ConnectError(f"cannot connect to {url!r}: {_reason(exc)}", url=url) from exc
        except OSError as exc:
            raise ConnectError(
                f"cannot connect to {url!r}: {_reason(exc)}; check that a listener runs at "
                "that address with matching TLS settings",
                url=url,
            ) from exc
        return TCPTransport(
            reader,
            writer,
            peer=_peer_of(writer, scheme, fallback=url),
            max_frame_size=self.max_frame_size,
        )

    async def listen(self, url: str) -> TCPListener:
        """Bind ``tcp://host:port`` and start accepting.

        Port 0 binds a free port. If the host then resolves to several addresses (as
        ``localhost`` may, to IPv4 and IPv6), only the first is bound, so that
        :attr:`TCPListener.url` names one port that reaches the listener.

        Raises:
            ConnectError: the address is in use, not local, or does not resolve.
            ConfigError: ``url`` is malformed, or the SSL context is a client-side one.
        """
        scheme, host, port = _parse_url(url, listening=True)
        context = check_ssl_side(self._server_ssl, "server", url, "TCPFactory")
        listener = TCPListener(scheme=scheme, requested=url, max_frame_size=self.max_frame_size)
        try:
            if port == 0:
                host = await _first_address(host)
            server = await asyncio.start_server(
                listener._on_connect, host, port, ssl=context, limit=_READ_LIMIT
            )
        except OSError as exc:
            raise ConnectError(
                f"cannot listen on {url!r}: {_reason(exc)}; pick another port "
                "(0 picks a free one) or stop the process that holds it",
                url=url,
            ) from exc
        bound_host, bound_port = server.sockets[0].getsockname()[:2]
        listener._server = server
        listener._url = f"{scheme}://{format_host(bound_host)}:{bound_port}"
        return listener

    def __repr__(self) -> str:
        tls = "tls" if self._server_ssl or self._client_ssl else "plain"
        return f"TCPFactory({tls}, max_frame_size={self.max_frame_size})"


def _parse_url(url: str, *, listening: bool) -> tuple[str, str | None, int]:
    usage = "write it as tcp://host:port (IPv6: tcp://[::1]:port)"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"tcp url {url!r} is malformed ({exc}); {usage}") from exc
    if not parts.scheme or not parts.netloc:
        raise ConfigError(f"tcp url {url!r} is malformed; {usage}")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise ConfigError(
            f"tcp url {url!r} has a path, query, fragment or user part; tcp urls take none: {usage}"
        )
    if port is None:
        raise ConfigError(f"tcp url {url!r} has no port; {usage}")
    host = parts.hostname or None
    if not listening:
        if host is None:
            raise ConfigError(f"tcp url {url!r} has no host to connect to; {usage}")
        if port == 0:
            raise ConfigError(
                f"cannot connect to port 0 in {url!r}; connect to the url the listener "
                "reports (listener.url), which has the real port"
            )
    return parts.scheme, host, port


async def _first_address(host: str | None) -> str:
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    return str(infos[0][4][0])


def _peer_of(writer: asyncio.StreamWriter, scheme: str, *, fallback: str) -> str:
    address = writer.get_extra_info("peername")
    if isinstance(address, tuple) and len(address) >= 2:
        return f"{scheme}://{format_host(str(address[0]))}:{address[1]}"
    return fallback
