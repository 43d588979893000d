"""The TCP transport: ``tcp://host:port``, optionally with TLS.

Frames travel behind the 4-byte length header of :mod:`aps.wire.framing`, read by an
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
import contextlib
import ipaddress
import logging
import socket
import ssl
from urllib.parse import urlsplit

from aps._base._resource import AsyncResource
from aps._base._typing import Frame
from aps.errors import (
    ConfigError,
    ConnectionLost,
    EndOfStream,
    FrameTooLarge,
    InvalidState,
    TransportClosed,
)
from aps.transports._util import (
    address_url,
    check_ssl_side,
    format_host,
    is_loopback_host,
    owned_payload,
)
from aps.transports.base import DEFAULT_MAX_FRAME_SIZE
from aps.transports.budget import DEFAULT_LIMIT, DEFAULT_PER_HOST, Ticket
from aps.transports.listener import SocketFactory, SocketListener, bind
from aps.transports.stream import (
    StreamConnection,
    dial,
    looks_like_tls,
    reason,
    tls_hint,
)
from aps.wire.framing import (
    HEADER_SIZE,
    frame_header,
    frame_view,
)

log = logging.getLogger(__name__)

__all__ = ["TCPFactory", "TCPListener", "TCPTransport"]


# Frames up to this size are copied behind their header and written with one call (one
# syscall, one TCP segment for small messages). Larger payloads are written separately so the
# payload is not copied just to prepend four bytes.
_COALESCE_LIMIT = 64 * 2**10

# How long aclose() waits for buffered frames (and the TLS close_notify exchange) to go out
# before it aborts the connection. A live peer takes milliseconds; a dead one must not block
# its closer forever.
_CLOSE_TIMEOUT = 5.0


class TCPTransport(AsyncResource):
    """One TCP (or TLS) connection carrying length-prefixed frames.

    Created by :meth:`TCPFactory.connect` and :meth:`TCPListener.accept`.

    Attributes:
        max_frame_size: the largest frame this end sends or receives, in bytes.
    """

    def __init__(
        self,
        connection: StreamConnection,
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
        self._tls = transport.get_extra_info("sslcontext") is not None
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
    def preauth(self) -> Ticket | None:
        """The pre-auth ticket of an accepted connection still counted, else ``None``.

        See :mod:`aps.transports.budget`; a dialed connection has none.
        """
        ticket = self._connection.preauth
        return ticket if ticket is not None and ticket.held else None

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
                        f"connection to {self.peer} lost while sending: {reason(exc)}"
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
                except FrameTooLarge as exc:
                    await self.aclose()
                    if not self._tls and looks_like_tls(exc.size.to_bytes(4, "little")):
                        raise ConnectionLost(tls_hint(self.peer)) from exc
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
                f"connection to {self.peer} lost while receiving: {reason(error)}"
            )
            lost.__cause__ = error
            return lost
        partial = connection.decoder.partial
        if partial is None:
            if not connection.received_any and not self._tls and self.preauth is None:
                # A dialed connection closed before a single byte: what a TLS listener does
                # to a plain client once its handshake deadline passes.
                return EndOfStream(
                    f"{self.peer} closed the connection before sending anything; if it "
                    "listens with TLS, dial it with TLS (--tls-ca)"
                )
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

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<{type(self).__name__} peer={self.peer!r} {state}>"


class TCPListener(SocketListener[TCPTransport]):
    """A bound TCP (or TLS) server socket; create it with :meth:`TCPFactory.listen`.

    The listener accepts connections itself, so that every one is counted from its first
    byte: each takes a :class:`~aps.transports.budget.Ticket` of :attr:`preauth` at accept,
    before its TLS handshake, and is aborted when the budget evicts it or its deadline
    passes. A TLS connection costs nothing but its socket until its first bytes arrive; bytes
    that are not a TLS hello close it with one line. When the process runs out of file
    descriptors, accepting pauses briefly and one line per interval says so
    (:class:`~aps.transports.stream.Acceptor`). See
    :class:`~aps.transports.listener.SocketListener` for the arguments.
    """

    _transport_type = TCPTransport

    def _protocol(self, ticket: Ticket) -> StreamConnection:
        connection = StreamConnection(self._max_frame_size, self._on_connect)
        connection.preauth = ticket
        return connection

    def _take(self, transport: TCPTransport) -> bool:
        return not transport._connection.lost

    def _on_connect(self, connection: StreamConnection) -> None:
        assert connection.transport is not None  # this runs in connection_made
        if connection.preauth is not None:
            connection.preauth.on_abort(connection.transport.abort)
        self._arrived(
            self._transport_type(
                connection,
                connection.transport,
                peer=self._peer_for(connection),
                max_frame_size=self._max_frame_size,
            )
        )

    def _peer_for(self, connection: StreamConnection) -> str:
        """How logs name the peer of ``connection`` (its transport's address)."""
        assert connection.transport is not None
        return _peer_of(connection.transport, self._scheme, fallback=f"{self._scheme}://unknown")


class TCPFactory(SocketFactory):
    """Creates TCP transports and listeners, with TLS if given SSL contexts.

    Args:
        ssl_context: TLS for both sides; ``None`` means plain TCP.
        server_ssl_context: TLS for :meth:`listen` only (overrides ``ssl_context``).
        client_ssl_context: TLS for :meth:`connect` only (overrides ``ssl_context``).
        max_frame_size: the largest frame sent or received, in bytes (at most 4 GiB - 1).
        preauth_limit: connections each listener holds before they proved the token (TLS
            handshakes included); see :mod:`aps.transports.budget`.
        preauth_per_host: of those, idle ones from one source address.
        source: the local IP address :meth:`connect` binds before it dials (any free port),
            so that a host with several addresses chooses which one its connections come
            from (a fleet of workers on one machine spread over ``127.0.0.x``, for the
            learner's per-address budget); ``None`` lets the system choose.

    Raises:
        ConfigError: ``max_frame_size`` or a pre-auth limit is out of range, or ``source``
            is not an IP address literal.
    """

    def __init__(
        self,
        *,
        ssl_context: ssl.SSLContext | None = None,
        server_ssl_context: ssl.SSLContext | None = None,
        client_ssl_context: ssl.SSLContext | None = None,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        preauth_limit: int = DEFAULT_LIMIT,
        preauth_per_host: int = DEFAULT_PER_HOST,
        source: str | None = None,
    ) -> None:
        super().__init__(
            ssl_context=ssl_context,
            server_ssl_context=server_ssl_context,
            client_ssl_context=client_ssl_context,
            max_frame_size=max_frame_size,
            preauth_limit=preauth_limit,
            preauth_per_host=preauth_per_host,
        )
        self.source = _check_source(source)

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
        transport, connection = await dial(
            lambda: asyncio.get_running_loop().create_connection(
                lambda: StreamConnection(self.max_frame_size),
                host,
                port,
                ssl=context,
                local_addr=None if self.source is None else (self.source, 0),
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
        :attr:`TCPListener.url` names one port that reaches the listener. An empty host
        binds IPv6 and IPv4 on one socket where the system can.

        Raises:
            ConnectError: the address is in use, not local, or does not resolve.
            ConfigError: ``url`` is malformed, or the SSL context is a client-side one.
        """
        scheme, host, port = _parse_url(url, listening=True)
        context = check_ssl_side(self._server_ssl, "server", url, "TCPFactory")
        sock = await bind(url, host, port, dual_stack=True)
        bound_host, bound_port = sock.getsockname()[:2]
        return TCPListener(
            sock,
            url=f"{scheme}://{format_host(bound_host)}:{bound_port}",
            max_frame_size=self.max_frame_size,
            ssl_context=context,
            preauth=self._preauth(),
        )

    def __repr__(self) -> str:
        tls = "tls" if self._server_ssl or self._client_ssl else "plain"
        source = "" if self.source is None else f", source={self.source!r}"
        return f"TCPFactory({tls}, max_frame_size={self.max_frame_size}{source})"


def _check_source(source: object) -> str | None:
    """``source`` as :meth:`TCPFactory.connect` binds it, or ConfigError."""
    if source is None:
        return None
    try:
        # A literal only: resolving a name here would block, and a name may have several.
        return str(ipaddress.ip_address(source if isinstance(source, str) else ""))
    except ValueError:
        raise ConfigError(
            f"source must be an IP address of this host such as '127.0.0.2' or '::1' "
            f"(or None), got {source!r}"
        ) from None


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


def _peer_of(transport: asyncio.BaseTransport, scheme: str, *, fallback: str) -> str:
    return address_url(scheme, transport.get_extra_info("peername"), fallback)
