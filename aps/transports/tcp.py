"""The TCP transport: ``tcp://host:port``, optionally with TLS.

Frames travel behind the 4-byte length header of :mod:`aps.framing`, read by an
:class:`asyncio.BufferedProtocol` straight into the frame decoder's memory: a large frame is
allocated once, at its announced size after the size check, and filled by the socket reads.
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
import collections
import contextlib
import socket
import ssl
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Self, cast
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
    FrameDecoder,
    check_max_frame_size,
    frame_header,
    frame_view,
)
from aps.transports._util import (
    AcceptQueue,
    check_ssl_side,
    detach,
    format_host,
    is_loopback_host,
    owned_payload,
    tls_refused,
)
from aps.transports.base import DEFAULT_MAX_FRAME_SIZE

__all__ = ["TCPFactory", "TCPListener", "TCPTransport"]

# Reading pauses once whole frames of this many bytes wait for receive(), so a slow consumer
# bounds the memory a fast peer can make it hold. A frame being read is always finished.
_READ_LIMIT = 2 * 2**20

# send() waits while more than this many bytes wait in the write buffer, besides the last
# large frame (one over this size): a small frame does not wait for a large one to leave.
_BACKLOG = 64 * 2**10

# Frames up to this size are copied behind their header and written with one call (one
# syscall, one TCP segment for small messages). Larger payloads are written separately so the
# payload is not copied just to prepend four bytes.
_COALESCE_LIMIT = 64 * 2**10

# How long aclose() waits for buffered frames (and the TLS close_notify exchange) to go out
# before it aborts the connection. A live peer takes milliseconds; a dead one must not block
# its closer forever.
_CLOSE_TIMEOUT = 5.0


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or type(exc).__name__


class _Connection(asyncio.BufferedProtocol):
    """The event loop's side of one connection: frames in, write flow control out.

    Bytes are read straight into the :class:`~aps.framing.FrameDecoder`'s memory: a large
    frame is allocated once at its announced size (after the size check) and filled by the
    socket reads themselves, so it is neither grown nor copied on its way in.
    """

    def __init__(
        self, max_frame_size: int, on_connect: Callable[[_Connection], None] | None = None
    ) -> None:
        self.decoder = FrameDecoder(max_frame_size)
        self.transport: asyncio.Transport | None = None
        self._on_connect = on_connect
        self._loop = asyncio.get_running_loop()
        self._over_ssl = False
        self._reading_paused = False
        self._writing_paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._drain_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        # The wire size of the last large frame written since the buffer last drained, and
        # the bytes written after it: small frames may queue behind one large frame.
        self._large = 0
        self._after_large = 0
        # Set when the peer ended its side (eof) or the connection is gone (lost).
        self.eof = False
        self.lost = False
        self.lost_error: BaseException | None = None
        self.closed: asyncio.Future[None] = self._loop.create_future()

    # asyncio.BufferedProtocol callbacks.

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's do not subclass asyncio.Transport).
        self.transport = cast(asyncio.Transport, transport)
        self._over_ssl = transport.get_extra_info("sslcontext") is not None
        # Nothing is read until the first receive(): the owner may first lower the frame
        # limit (a session does, until the peer proved the token), and a connection waiting
        # to be accepted costs its kernel buffer only, never a frame-sized one here. A TLS
        # client is the exception: its last handshake message leaves only when it reads or
        # writes, and its owner lowers the limit before control returns to the loop anyway.
        if self._on_connect is not None or not self._over_ssl:
            self._pause_reading()
        if self._on_connect is not None:
            self._on_connect(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.decoder.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        decoder = self.decoder
        decoder.buffer_updated(nbytes)
        if decoder.ready_bytes or decoder.failed:
            if decoder.ready_bytes >= _READ_LIMIT or decoder.failed:
                # A refused header leaves nothing worth reading: receive() closes.
                self._pause_reading()
            self.wake()

    def eof_received(self) -> bool:
        self.eof = True
        self.wake()
        # Plain TCP stays open for writing after the peer's FIN (as asyncio streams do);
        # TLS cannot half-close.
        return not self._over_ssl

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.lost_error = exc
        self.wake()
        while self._drain_waiters:
            waiter = self._drain_waiters.popleft()
            if not waiter.done():
                if exc is None:
                    waiter.set_result(None)
                else:
                    waiter.set_exception(exc)
        if not self.closed.done():
            self.closed.set_result(None)

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._large = self._after_large = 0  # the buffer drained: nothing large waits
        self.wake_senders()

    # Used by TCPTransport.

    def wake(self) -> None:
        """Wake the pending receive(), if any, to look at the state again."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def wake_senders(self) -> None:
        """Wake every send() waiting for buffer space (aclose does too, so they see it)."""
        while self._drain_waiters:
            waiter = self._drain_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self) -> None:
        """Wait until :meth:`wake` is called; cancelling loses nothing."""
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def frame_taken(self) -> None:
        """receive() took a frame: read again if the backlog is small enough now."""
        if self._reading_paused and self.decoder.ready_bytes < _READ_LIMIT:
            self._reading_paused = False
            assert self.transport is not None
            if not self.transport.is_closing():
                self.transport.resume_reading()

    def handed_over(self, nbytes: int) -> None:
        """Count a frame of ``nbytes`` (header included) just written to the transport."""
        if nbytes > _BACKLOG:
            self._large = nbytes
            self._after_large = 0
        else:
            self._after_large += nbytes

    def writable(self) -> bool:
        """Whether a frame may be written at once: nothing to drain, nothing broken."""
        transport = self.transport
        return not (
            self._writing_paused or self.lost or transport is None or transport.is_closing()
        )

    async def drain(self, transport: asyncio.Transport) -> None:
        """Wait while the write buffer holds more than 64 KiB besides the last large frame.

        A wait lasts until the buffer is back below asyncio's low-water mark (16 KiB by
        default), which also forgets the large frame.

        Raises:
            ConnectionResetError: the connection is gone (or broke meanwhile).
        """
        allowance = _BACKLOG
        if self._after_large <= _BACKLOG:
            allowance += self._large
        if self._writing_paused and not self.lost:
            if transport.get_write_buffer_size() > allowance:
                waiter = self._loop.create_future()
                self._drain_waiters.append(waiter)
                try:
                    await waiter
                finally:
                    if waiter in self._drain_waiters:
                        self._drain_waiters.remove(waiter)
        if self.lost:
            raise self.lost_error or ConnectionResetError("connection lost")

    def _pause_reading(self) -> None:
        if not self._reading_paused:
            self._reading_paused = True
            assert self.transport is not None
            if not self.transport.is_closing():
                self.transport.pause_reading()


class TCPTransport:
    """One TCP (or TLS) connection carrying length-prefixed frames.

    Created by :meth:`TCPFactory.connect` and :meth:`TCPListener.accept`.

    Attributes:
        max_frame_size: the largest frame this end sends or receives, in bytes.
    """

    def __init__(
        self,
        connection: _Connection,
        transport: asyncio.Transport,
        *,
        peer: str,
        max_frame_size: int,
    ) -> None:
        self._connection = connection
        self._transport = transport
        self._peer_name = peer
        self._max_frame_size = max_frame_size
        connection.decoder.max_frame_size = max_frame_size
        self._send_lock = asyncio.Lock()
        self._senders = 0  # send() calls holding or waiting for the lock
        self._receiving = False
        self._closed = False
        address = transport.get_extra_info("peername")
        self._is_local = isinstance(address, tuple) and is_loopback_host(str(address[0]))
        sock = self._transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):  # an option the platform lacks: go without
                self._tune(sock)

    def _tune(self, sock: socket.socket) -> None:
        """Set the socket options this kind of connection wants."""
        # asyncio usually sets this already; small frames (heartbeats, step replies) must not
        # wait for Nagle's algorithm.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    @property
    def peer(self) -> str:
        """The other end's address (``tcp://host:port``), for logs and errors."""
        return self._peer_name

    @property
    def is_local(self) -> bool:
        """Whether the other end is on this host (a loopback address); see :func:`is_local`."""
        return self._is_local

    @property
    def max_frame_size(self) -> int:
        """The largest frame this end sends or receives, in bytes.

        Assigning it applies to frames whose header has not been read yet (reading starts
        at the first :meth:`receive`).
        """
        return self._max_frame_size

    @max_frame_size.setter
    def max_frame_size(self, value: int) -> None:
        self._connection.decoder.max_frame_size = value
        self._max_frame_size = value

    async def send(self, frame: Frame) -> None:
        """Send one whole frame; concurrent calls are serialized.

        ``send`` hands the frame to the event loop and returns without waiting for it to
        leave, as long as the connection holds at most 64 KiB of unsent data besides the
        last large frame (over 64 KiB) it was handed; otherwise it first waits for the
        buffer to drain. So a large frame and the small ones after it do not wait for each
        other, a large frame sent to several peers one after the other goes out to all of
        them at once, and a connection never holds more than two large frames plus 64 KiB.
        A ``bytes`` payload is buffered as is, without a copy (other buffer types are copied
        once, so that mutating them after ``send`` returns cannot change what is sent). A
        connection that breaks after the frame was handed over raises on the next call.

        Cancellation: while waiting for another sender or for earlier frames to leave,
        nothing is sent; the frame is then handed over whole in one synchronous step.
        Either way the stream stays in step.

        Raises:
            TransportClosed: this side already closed (also raised if it closes meanwhile).
            FrameTooLarge: the frame exceeds ``max_frame_size``; nothing was sent.
            ConnectionLost: the connection broke.
        """
        if self._closed:
            raise TransportClosed(f"cannot send to {self.peer}: this transport is closed")
        data: bytes | memoryview
        if type(frame) is bytes:
            data, size = frame, len(frame)  # what the codec makes: no view needed
        else:
            data = frame_view(frame)
            size = data.nbytes
        if size > self._max_frame_size:
            raise FrameTooLarge(size, self._max_frame_size)
        if not self._senders and self._connection.writable():
            # Nobody queued and nothing to wait for (the common case): hand the frame over
            # at once, without the lock's awaits.
            self._write(data, size)
            return
        self._senders += 1
        try:
            await self._send_in_turn(data, size)
        finally:
            self._senders -= 1

    async def _send_in_turn(self, data: bytes | memoryview, size: int) -> None:
        connection = self._connection
        async with self._send_lock:
            try:
                if not self._closed:
                    await connection.drain(self._transport)
                    if self._transport.is_closing() and not self._closed:
                        # Bytes written now would be dropped without a word.
                        raise ConnectionResetError("the connection is closing")
            except Exception as exc:  # what broke the connection: any backend error
                if not self._closed:
                    raise ConnectionLost(
                        f"connection to {self.peer} lost while sending: {_reason(exc)}"
                    ) from exc
            if self._closed:
                raise TransportClosed(f"cannot send to {self.peer}: this transport is closed")
            self._write(data, size)

    def _write(self, data: bytes | memoryview, size: int) -> None:
        if size <= _COALESCE_LIMIT:
            self._transport.write(frame_header(size) + data)
        else:
            self._transport.write(frame_header(size))
            self._transport.write(data if isinstance(data, bytes) else owned_payload(data))
        self._connection.handed_over(HEADER_SIZE + size)

    async def receive(self) -> bytes:
        """Wait for the next whole frame.

        Frames that arrived before the connection ended (cleanly or not) are returned
        first. Cancellation: no frame is lost; bytes stay in the decoder until a whole
        frame is there.

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
        connection = self._connection
        connection.frame_taken()  # reading starts (or resumes) when someone receives
        try:
            while True:
                try:
                    frame = connection.decoder.next_frame()
                except FrameTooLarge:
                    await self.aclose()
                    raise
                if frame is not None:
                    connection.frame_taken()
                    return frame
                if self._closed:
                    raise TransportClosed(
                        f"cannot receive from {self.peer}: this transport was closed"
                    )
                if connection.eof or connection.lost:
                    raise self._ended()
                await connection.wait()
        finally:
            self._receiving = False

    def _ended(self) -> EndOfStream | ConnectionLost:
        """The error for a connection that ended with no whole frame left to return."""
        connection = self._connection
        error = connection.lost_error
        if error is not None:
            lost = ConnectionLost(
                f"connection to {self.peer} lost while receiving: {_reason(error)}"
            )
            lost.__cause__ = error
            return lost
        partial = connection.decoder.partial
        if partial is None:
            return EndOfStream(f"{self.peer} closed the connection")
        arrived, expected = partial
        return ConnectionLost(
            f"{self.peer} closed the connection in the middle of a frame "
            f"({arrived} of {expected} bytes arrived)"
        )

    async def aclose(self) -> None:
        """Close the connection after flushing frames already sent.

        Idempotent and never raises a backend error. Wakes a pending ``receive`` (and a
        ``send`` waiting for buffer space) at once; waits up to a few seconds for buffered
        frames to leave, then aborts. If cancelled, the connection is aborted before the
        cancellation propagates.
        """
        if self._closed:
            return
        self._closed = True
        connection = self._connection
        connection.wake()
        connection.wake_senders()
        transport = self._transport
        try:
            transport.close()
            async with asyncio.timeout(_CLOSE_TIMEOUT):
                await asyncio.shield(connection.closed)
        except asyncio.CancelledError:
            transport.abort()
            raise
        except Exception:
            # A reset, a TLS error or the timeout: the connection is unusable either way.
            transport.abort()

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
        return f"<{type(self).__name__} peer={self.peer!r} {state}>"


class TCPListener:
    """A bound TCP (or TLS) server socket; create it with :meth:`TCPFactory.listen`."""

    _transport_type = TCPTransport

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

    @property
    def is_local(self) -> bool:
        """Whether only this host can connect: the bound address is a loopback one."""
        return is_loopback_host(urlsplit(self._url).hostname or "")

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
        return f"<{type(self).__name__} {self.url}>"

    def _on_connect(self, connection: _Connection) -> None:
        assert connection.transport is not None  # this runs in connection_made
        transport = self._transport_type(
            connection,
            connection.transport,
            peer=self._peer_for(connection),
            max_frame_size=self._max_frame_size,
        )
        if not self._queue.put(transport):
            # The listener closed while this connection was being set up.
            detach(transport.aclose)

    def _peer_for(self, connection: _Connection) -> str:
        assert connection.transport is not None
        return _peer_of(connection.transport, self._scheme, fallback=f"{self._scheme}://unknown")


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
            AuthError: the learner's TLS certificate failed verification.
            Timeout: not connected within ``timeout`` seconds (``None``: no limit).
            ConfigError: ``url`` is malformed, or the SSL context is a server-side one.
        """
        scheme, host, port = _parse_url(url, listening=False)
        assert host is not None  # _parse_url refuses a url without one
        context = check_ssl_side(self._client_ssl, "client", url, "TCPFactory")
        transport, connection = await _dial(
            lambda: asyncio.get_running_loop().create_connection(
                lambda: _Connection(self.max_frame_size), host, port, ssl=context
            ),
            url,
            timeout,
            there="there (with matching TLS settings)",
            at="at that address with matching TLS settings",
        )
        # uvloop may call connection_made only after create_connection returned, so the
        # transport comes from here.
        return TCPTransport(
            connection,
            transport,
            peer=_peer_of(transport, scheme, fallback=url),
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
            max_frame_size = self.max_frame_size
            server = await asyncio.get_running_loop().create_server(
                lambda: _Connection(max_frame_size, listener._on_connect),
                host,
                port,
                ssl=context,
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


async def _dial(
    opening: Callable[[], Awaitable[tuple[asyncio.BaseTransport, _Connection]]],
    url: str,
    timeout: float | None,
    *,
    there: str,
    at: str,
) -> tuple[asyncio.Transport, _Connection]:
    """Open a connection with ``opening()`` within ``timeout``, its errors made aps's.

    ``there`` and ``at`` finish the advice of the errors: "check that a listener runs
    {there} or raise the timeout", "check that a listener runs {at}".

    Raises:
        ConnectError: refused, unreachable, or the handshake failed.
        AuthError: the peer's TLS certificate failed verification (never worth a retry).
        Timeout: not connected within ``timeout`` seconds.
    """
    try:
        async with asyncio.timeout(timeout) as deadline:
            transport, connection = await opening()
    except TimeoutError as exc:
        if deadline.expired():
            raise Timeout(
                f"connecting to {url!r} took longer than {timeout} s; check that a listener "
                f"runs {there} or raise the timeout",
                operation="connect",
                seconds=timeout,
            ) from exc
        raise ConnectError(f"cannot connect to {url!r}: {_reason(exc)}", url=url) from exc
    except ssl.SSLCertVerificationError as exc:
        # Not a learner that is not up yet: dialing again meets the same certificate.
        raise tls_refused(url, exc) from exc
    except OSError as exc:
        raise ConnectError(
            f"cannot connect to {url!r}: {_reason(exc)}; check that a listener runs {at}",
            url=url,
        ) from exc
    # A stream transport (uvloop's do not subclass asyncio.Transport).
    return cast(asyncio.Transport, transport), connection


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


def _peer_of(transport: asyncio.BaseTransport, scheme: str, *, fallback: str) -> str:
    address = transport.get_extra_info("peername")
    if isinstance(address, tuple) and len(address) >= 2:
        return f"{scheme}://{format_host(str(address[0]))}:{address[1]}"
    return fallback
