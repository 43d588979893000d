"""The WebSocket transport: ``ws://host:port/path`` and ``wss://host:port/path``.

Built on the ``websockets`` package (install it with ``pip install 'aps-rl[websocket]'``);
importing :mod:`aps` or :mod:`aps.transports` does not import it. One frame is one binary
WebSocket message. Compression is off (frames are mostly arrays, and deflate costs more CPU
than it saves), and so are WebSocket pings: aps sends its own heartbeats.

``wss://`` needs TLS contexts, given to the factory as for TCP: ``ssl_context`` for both
sides, ``server_ssl_context`` / ``client_ssl_context`` for one. A ``wss://`` client without a
context uses the system's trusted certificates. ``ws://`` never uses TLS.

A peer that sends a text message breaks the contract: ``receive`` closes the connection with
WebSocket code 1003 and raises :class:`~aps.errors.ConnectionLost`.

The server ignores the request path; :attr:`WebSocketListener.url` keeps the one it was given.
Clients connect directly: proxy settings in the environment (``HTTPS_PROXY``...), which
``websockets`` 15 and later would honour, are ignored, so that a worker reaches a learner on
the local network (or 127.0.0.1) whatever the shell exports.

Large frames travel as fragmented messages (:data:`FRAGMENT_SIZE`). Both ends gather the
fragments they receive as they arrive (a ``Gatherer``, hooked into the connections'
``process_event``), and a listener writes large immutable payloads without copying them
into each frame (``send_uncopied``, in place of its protocol's ``send_frame``): both in
:mod:`aps.transports._websocket_connections`, with the connection a listener bounds until
its peer proved the token. Those two seams of websockets' sans-I/O design, and its
protocol's ``writes`` list, have the same shape in websockets 14.2 to 17.4, the releases the
WebSocket tests pass on.

A listener accepts its sockets itself (:class:`~aps.transports.listener.SocketListener`), so
that each counts against its pre-auth budget from the first byte, TLS included; it builds each
``ServerConnection`` (with its ``ServerProtocol``) as websockets' ``serve`` would, and hands
it to the connection handler of a websockets ``Server`` that is never bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import ssl
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from aps._base._resource import AsyncResource
from aps._base._typing import Frame
from aps.errors import (
    ConfigError,
    ConnectError,
    ConnectionLost,
    EndOfStream,
    FrameTooLarge,
    InvalidState,
    MissingDependency,
    Timeout,
    TransportClosed,
)
from aps.transports._util import (
    address_url,
    check_ssl_side,
    format_host,
    is_loopback_host,
    owned_payload,
    tls_refused,
)
from aps.transports.budget import DEFAULT_LIMIT, Ticket
from aps.transports.listener import SocketFactory, SocketListener, bind
from aps.wire.framing import check_max_frame_size, frame_view

try:
    from websockets.asyncio.client import ClientConnection, connect as ws_connect
    from websockets.asyncio.server import Server, ServerConnection, serve as ws_serve
    from websockets.exceptions import (
        ConnectionClosed,
        ConnectionClosedOK,
        InvalidURI,
        PayloadTooBig,
        WebSocketException,
    )
    from websockets.frames import CloseCode
except ImportError as exc:  # pragma: no cover - exercised by hiding the package in a test
    raise MissingDependency(
        "the ws:// and wss:// transports need the websockets package (version 14.2 or newer); "
        "install it with pip install 'aps-rl[websocket]'"
    ) from exc

# Imported once websockets is known to be there; the limits and seams are named here too,
# where they were first defined.
from aps.transports._websocket_connections import (
    LIMIT_ATTRIBUTE,
    MAX_OPENING_BYTES as MAX_OPENING_BYTES,
    PREAUTH_CONTROL_FRAMES as PREAUTH_CONTROL_FRAMES,
    UNACCEPTED_FRAME_SIZE as UNACCEPTED_FRAME_SIZE,
    UNCOPIED_SIZE as UNCOPIED_SIZE,
    GatheringClient,
    PreauthConnection,
    TooManyFragments as TooManyFragments,
    WaitingRoom,
    max_fragments as max_fragments,
)

__all__ = ["WebSocketFactory", "WebSocketListener", "WebSocketTransport"]

# websockets 15 added proxy support, on by default; older releases lack the argument.
_DIRECT: dict[str, Any] = (
    {"proxy": None} if "proxy" in inspect.signature(ws_connect.__init__).parameters else {}
)

# Seconds websockets waits for the peer's half of the closing handshake before it drops the
# TCP connection. A live peer answers in milliseconds.
_CLOSE_TIMEOUT = 5.0

FRAGMENT_SIZE = 1 << 20
"""Frames larger than this travel as a fragmented WebSocket message of pieces this size.

websockets buffers and slices each incoming WebSocket frame whole: one 40 MB frame costs the
receiver three fresh 40 MB buffers (its stream buffer, the slice, the message), and fresh
memory is what large transfers pay for. In 1 MiB fragments the first two stay small and are
reused, and the receiving end copies each fragment into the message as it arrives (see
:class:`~aps.transports._websocket_connections.Gatherer`). The peer sees one message.
(256 KiB fragments cost a weight sync the same CPU, 64 KiB ones more: see
benchmarks/README.md.)
"""


def _fragments(view: memoryview) -> Iterator[memoryview]:
    for start in range(0, view.nbytes, FRAGMENT_SIZE):
        yield view[start : start + FRAGMENT_SIZE]


def _retrieve(task: asyncio.Future[None]) -> None:
    # A send whose caller was cancelled fails unobserved; the next send or receive reports
    # the broken connection.
    if not task.cancelled():
        task.exception()


class WebSocketTransport(AsyncResource):
    """One WebSocket connection; each frame is one binary message.

    Created by :meth:`WebSocketFactory.connect` and :meth:`WebSocketListener.accept`.

    Attributes:
        max_frame_size: the largest frame this end sends or receives, in bytes.
    """

    def __init__(
        self,
        connection: ClientConnection | ServerConnection,
        *,
        peer: str,
        max_frame_size: int,
    ) -> None:
        self._connection = connection
        self._peer_name = peer
        self._max_frame_size = max_frame_size
        self._receiving = False
        self._closed = False
        self._sending: asyncio.Future[None] | None = None  # a large frame still leaving
        address = connection.remote_address
        self._is_local = isinstance(address, tuple) and is_loopback_host(str(address[0]))

    @property
    def peer(self) -> str:
        """The other end's address (``ws://host:port``), for logs and errors."""
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
        ticket: Ticket | None = getattr(self._connection, "aps_ticket", None)
        return ticket if ticket is not None and ticket.held else None

    @property
    def max_frame_size(self) -> int:
        """The largest frame this end sends or receives, in bytes.

        Assigning it applies to messages whose first fragment has not arrived yet.
        """
        return self._max_frame_size

    @max_frame_size.setter
    def max_frame_size(self, value: int) -> None:
        value = check_max_frame_size(value, ceiling=2**63 - 1)
        setattr(self._connection.protocol, LIMIT_ATTRIBUTE, value)
        self._max_frame_size = value

    async def send(self, frame: Frame) -> None:
        """Send one frame as one binary message; concurrent calls never interleave.

        A frame of at most :data:`FRAGMENT_SIZE` bytes is written to the socket buffer in one
        synchronous step before ``send`` waits for the buffer to drain. A larger one is
        handed over and sent in the background (as TCP does): ``send`` returns at once, so
        that frames to several peers travel at the same time. Every later ``send`` first
        waits for a large frame handed over to leave, so frames keep their order and a
        connection holds at most one. A connection that breaks meanwhile raises on the
        next call. Either way, what is sent
        is a copy or an immutable ``bytes``, so a mutable buffer can be reused afterwards.

        Cancellation: a frame is delivered whole or not at all; a call cancelled while it
        waits for a large frame to leave sends nothing.

        Raises:
            TransportClosed: this side already closed.
            FrameTooLarge: the frame exceeds ``max_frame_size``; nothing was sent.
            ConnectionLost: the connection broke or the peer closed it.
        """
        if self._closed:
            raise TransportClosed(f"cannot send to {self.peer}: this transport is closed")
        view = frame_view(frame)
        if view.nbytes > self.max_frame_size:
            raise FrameTooLarge(view.nbytes, self.max_frame_size)
        try:
            previous = self._sending
            if previous is not None:
                # Frames go out in order: after the large one handed over (which websockets
                # would make them wait for anyway, once it has started).
                await asyncio.shield(previous)
                if self._sending is previous:
                    self._sending = None
                previous.result()  # a failure surfaces on the next call
            if view.nbytes <= FRAGMENT_SIZE:
                await self._connection.send(view)
                return
            # Fragments keep the receiver's buffers small (see FRAGMENT_SIZE); the message
            # waits for the socket between fragments, so it goes on in a task of its own,
            # which also completes it if the caller is cancelled later: it is never left half
            # sent for the next message to interleave with.
            fragments = _fragments(memoryview(owned_payload(view)))
            self._sending = asyncio.ensure_future(self._connection.send(fragments))
            self._sending.add_done_callback(_retrieve)
        except (ConnectionClosed, OSError) as exc:
            if self._closed:
                raise TransportClosed(
                    f"cannot send to {self.peer}: this transport was closed"
                ) from None
            raise ConnectionLost(f"connection to {self.peer} lost while sending: {exc}") from exc

    async def receive(self) -> bytes:
        """Wait for the next binary message.

        Cancellation: no frame is lost (websockets keeps the message for the next call).

        Raises:
            EndOfStream: the peer closed normally and every message was received.
            TransportClosed: this side closed (also wakes a pending call).
            ConnectionLost: the connection broke, or the peer sent a text message.
            FrameTooLarge: the peer sent a message over ``max_frame_size`` (the
                connection closes with code 1009).
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
            message = await self._connection.recv()
        except ConnectionClosed as exc:
            raise self._closed_error(exc) from exc
        finally:
            self._receiving = False
        if isinstance(message, str):
            await self._close(CloseCode.UNSUPPORTED_DATA, "aps expects binary messages")
            raise ConnectionLost(
                f"{self.peer} sent a text message; aps transports carry binary messages only, "
                "so check that the peer is an aps endpoint"
            )
        return message

    async def aclose(self) -> None:
        """Perform the WebSocket closing handshake after frames already sent.

        Idempotent and never raises a backend error. A pending ``receive`` wakes with
        TransportClosed when the handshake ends (milliseconds with a live peer, at most a
        few seconds otherwise).
        """
        await self._close(CloseCode.NORMAL_CLOSURE, "")

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<WebSocketTransport peer={self.peer!r} {state}>"

    async def _close(self, code: int, reason: str) -> None:
        if self._closed:
            return
        self._closed = True
        sending = self._sending
        try:
            if sending is not None and not sending.done():
                # Frames already handed over leave before the closing handshake (a live
                # peer reads them; a stuck one is cut off at the close timeout).
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(sending), _CLOSE_TIMEOUT)
            await self._connection.close(code, reason)
        except asyncio.CancelledError:
            self._connection.transport.abort()
            raise
        except Exception:
            # Closing is best effort; the connection is unusable either way.
            self._connection.transport.abort()

    def _closed_error(
        self, exc: ConnectionClosed
    ) -> TransportClosed | EndOfStream | FrameTooLarge | ConnectionLost:
        if self._closed:
            return TransportClosed(f"cannot receive from {self.peer}: this transport was closed")
        cause = exc.__cause__
        # We closed with 1009 first (not echoing the peer's own 1009): we refused its message.
        sent, rcvd = getattr(exc, "sent", None), getattr(exc, "rcvd", None)
        too_big = (
            sent is not None
            and sent.code == CloseCode.MESSAGE_TOO_BIG
            and (rcvd is None or getattr(exc, "rcvd_then_sent", None) is False)
        )
        if isinstance(cause, PayloadTooBig) or too_big:
            self._closed = True
            # websockets 14 and later report the sizes; older releases only a message, and
            # before 17.4 a message over the limit in fragments arrives as our 1009 close.
            size = (getattr(cause, "size", None) or 0) + (getattr(cause, "current_size", None) or 0)
            return FrameTooLarge(max(size, self.max_frame_size + 1), self.max_frame_size)
        if isinstance(exc, ConnectionClosedOK):
            return EndOfStream(f"{self.peer} closed the connection")
        return ConnectionLost(f"connection to {self.peer} lost: {exc}")


MAX_OPENING = DEFAULT_LIMIT
"""The most connections a listener holds before they proved the token (its pre-auth budget's
default limit; opening handshakes and connections waiting in the accept queue included)."""

# websockets' default queue of received messages (high and low water marks), which accept()
# restores (see UNACCEPTED_QUEUE).
_ACCEPTED_QUEUE = (16, 4)


class _Quiet(logging.LoggerAdapter):  # type: ignore[type-arg]
    """websockets' server logger, its per-connection INFO lines demoted to DEBUG.

    websockets says "connection closed" at INFO for every connection: under a flood of
    connections that never prove anything, a line each (the budget's report sums them up).
    """

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        super().log(logging.DEBUG if level == logging.INFO else level, msg, *args, **kwargs)


_SERVER_LOG = _Quiet(logging.getLogger("websockets.server"), {})


class _Serving:
    """Stands in for the asyncio server websockets' own ``serve`` makes (this listener accepts)."""

    def __init__(self, listener: WebSocketListener) -> None:
        self._listener = listener

    def is_serving(self) -> bool:
        return self._listener.is_serving()


class WebSocketListener(SocketListener[WebSocketTransport]):
    """A WebSocket server; create it with :meth:`WebSocketFactory.listen`.

    The listener accepts connections itself (as the TCP one does): every connection takes a
    :class:`~aps.transports.budget.Ticket` of :attr:`preauth` from accept, before its TLS
    handshake (``wss://``) and its opening handshake, and is aborted when the budget evicts
    it or its deadline passes, so idle connections can neither use up the process's file
    descriptors nor keep an honest worker out. Until it is accepted, a connection may send
    :data:`MAX_OPENING_BYTES` of opening handshake, messages of at most
    :data:`UNACCEPTED_FRAME_SIZE` and, in fragments, few of them (see
    :class:`~aps.transports._websocket_connections.Gatherer`). While its ticket is held
    (until accept, or until the token is proved once a learner's gate adopted the budget), a
    text message or more than :data:`PREAUTH_CONTROL_FRAMES` pings and pongs close it at
    once, and what it sends is parsed a few KiB at a time
    (:class:`~aps.transports._websocket_connections.PreauthConnection`). The server ignores
    the request path; :attr:`url` keeps the one the listener was given. See
    :class:`~aps.transports.listener.SocketListener` for the arguments.
    """

    def _prepare(self) -> None:
        self._room = WaitingRoom(self.preauth)
        # websockets' server object, never bound: it runs each connection's opening handshake
        # and handler (its per-connection logic), while this listener accepts the sockets.
        self._server: Server = ws_serve(
            self._handle,
            open_timeout=None,  # the pre-auth budget's deadline covers the opening
            logger=_SERVER_LOG,
            compression=None,
            ping_interval=None,
            close_timeout=_CLOSE_TIMEOUT,
        )
        # What websockets asks of the asyncio server it would have made: whether it serves
        # (a connection's opening handshake answers 503 once it does not).
        self._server.server = _Serving(self)  # type: ignore[assignment]

    def is_serving(self) -> bool:
        """Whether the listener still accepts connections."""
        return not self._queue.closed

    @property
    def opening(self) -> int:
        """Connections not accepted yet (opening handshakes and the accept queue)."""
        return len(self._room)

    @property
    def oversized(self) -> int:
        """Connections closed for sending too much opening handshake.

        More than :data:`MAX_OPENING_BYTES` before their opening handshake was done.
        """
        return self._room.oversized

    @property
    def refused(self) -> int:
        """Connections closed before they were accepted.

        Evicted to make room, refused when the budget was full, or sending too much opening
        handshake.
        """
        return self.preauth.evicted + self.preauth.refused + self.oversized

    def _protocol(self, ticket: Ticket) -> PreauthConnection:
        return PreauthConnection(
            self._server,
            room=self._room,
            ticket=ticket,
            max_frame_size=self._max_frame_size,
            close_timeout=_CLOSE_TIMEOUT,
        )

    def _take(self, transport: WebSocketTransport) -> bool:
        connection = transport._connection
        self._room.leave(connection)
        if connection.transport.is_closing():
            return False
        transport.max_frame_size = self._max_frame_size
        messages: Any = getattr(connection, "recv_messages", None)
        if hasattr(messages, "high") and hasattr(messages, "low"):
            messages.high, messages.low = _ACCEPTED_QUEUE
        return True

    def _stopped(self) -> None:
        self._room.abort_all()

    async def _handle(self, connection: ServerConnection) -> None:
        # websockets closes a connection when its handler returns, so the handler lives as
        # long as the transport: it waits for the connection to end, by either side.
        self._arrived(
            WebSocketTransport(
                connection,
                peer=_peer_of(connection, self._url),
                max_frame_size=min(self._max_frame_size, UNACCEPTED_FRAME_SIZE),
            )
        )
        await connection.wait_closed()


class WebSocketFactory(SocketFactory):
    """Creates WebSocket transports and listeners for ``ws://`` and ``wss://`` URLs.

    Args:
        ssl_context: TLS for both sides of ``wss://``.
        server_ssl_context: TLS for ``wss://`` listeners (overrides ``ssl_context``).
        client_ssl_context: TLS for ``wss://`` clients (overrides ``ssl_context``);
            without one, clients trust the system's certificate authorities.
        max_frame_size: the largest frame sent or received, in bytes.
        preauth_limit: connections each listener holds before they proved the token (TLS
            and opening handshakes included); see :mod:`aps.transports.budget`.
        preauth_per_host: of those, idle ones from one source address.

    Raises:
        ConfigError: ``max_frame_size`` or a pre-auth limit is out of range.
    """

    max_frame_ceiling = 2**63 - 1  # a WebSocket frame's length has 63 bits

    async def connect(self, url: str, *, timeout: float | None = None) -> WebSocketTransport:
        """Connect to a ``ws://`` or ``wss://`` URL and complete the opening handshake.

        Raises:
            ConnectError: refused, unreachable, or the server did not speak WebSocket.
            AuthError: the learner's TLS certificate failed verification.
            Timeout: not connected within ``timeout`` seconds (``None``: no limit).
            ConfigError: ``url`` is malformed, or the SSL context is a server-side one.
        """
        secure = _parse_url(url, listening=False)[0]
        context = (
            check_ssl_side(self._client_ssl, "client", url, "WebSocketFactory") if secure else None
        )
        try:
            async with asyncio.timeout(timeout) as deadline:
                connection = await ws_connect(
                    url,
                    ssl=context,
                    max_size=self.max_frame_size,
                    open_timeout=None,
                    # A plain frame pipe: no compression, no pings (aps has heartbeats).
                    compression=None,
                    ping_interval=None,
                    close_timeout=_CLOSE_TIMEOUT,
                    create_connection=GatheringClient,
                    **_DIRECT,
                )
        except TimeoutError as exc:
            if deadline.expired():
                raise Timeout(
                    f"connecting to {url!r} took longer than {timeout} s; check that a "
                    "listener runs there (with matching TLS settings) or raise the timeout",
                    operation="connect",
                    seconds=timeout,
                ) from exc
            raise ConnectError(f"cannot connect to {url!r}: {exc}", url=url) from exc
        except InvalidURI as exc:
            raise ConfigError(f"websocket url {url!r} is malformed: {exc}") from exc
        except ssl.SSLCertVerificationError as exc:
            raise tls_refused(url, exc) from exc
        except (OSError, WebSocketException) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ConnectError(
                f"cannot connect to {url!r}: {reason or type(exc).__name__}; check that an "
                "aps websocket listener runs at that address with matching TLS settings",
                url=url,
            ) from exc
        return WebSocketTransport(
            connection, peer=_peer_of(connection, url), max_frame_size=self.max_frame_size
        )

    async def listen(self, url: str) -> WebSocketListener:
        """Bind ``ws://host:port`` (or ``wss://``) and start accepting.

        Raises:
            ConnectError: the address is in use, not local, or does not resolve.
            ConfigError: ``url`` is malformed, or ``wss://`` lacks a server SSL context.
        """
        secure, host, port, path = _parse_url(url, listening=True)
        context = (
            check_ssl_side(self._server_ssl, "server", url, "WebSocketFactory") if secure else None
        )
        if secure and context is None:
            raise ConfigError(
                f"cannot listen on {url!r} without a certificate; pass "
                "server_ssl_context= (an ssl.PROTOCOL_TLS_SERVER context with "
                "load_cert_chain) to WebSocketFactory, or use ws://"
            )
        sock = await bind(url, host, port, dual_stack=False)
        bound_host, bound_port = sock.getsockname()[:2]
        scheme = "wss" if secure else "ws"
        return WebSocketListener(
            sock,
            url=f"{scheme}://{format_host(bound_host)}:{bound_port}{path}",
            max_frame_size=self.max_frame_size,
            ssl_context=context,
            preauth=self._preauth(),
        )

    def __repr__(self) -> str:
        return f"WebSocketFactory(max_frame_size={self.max_frame_size})"


def _parse_url(url: str, *, listening: bool) -> tuple[bool, str | None, int, str]:
    usage = "write it as ws://host:port/path or wss://host:port/path"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"websocket url {url!r} is malformed ({exc}); {usage}") from exc
    scheme = parts.scheme.lower()
    if scheme not in ("ws", "wss") or not parts.netloc:
        raise ConfigError(f"websocket url {url!r} is malformed; {usage}")
    if port is None:
        if listening:
            raise ConfigError(
                f"websocket url {url!r} has no port to listen on; {usage} (port 0 picks a free one)"
            )
        port = 443 if scheme == "wss" else 80
    host = parts.hostname or None
    if not listening and host is None:
        raise ConfigError(f"websocket url {url!r} has no host to connect to; {usage}")
    if not listening and port == 0:
        raise ConfigError(
            f"cannot connect to port 0 in {url!r}; connect to the url the listener reports "
            "(listener.url), which has the real port"
        )
    path = parts.path or "/"
    if parts.query:
        path = f"{path}?{parts.query}"
    return scheme == "wss", host, port, path


def _peer_of(connection: ClientConnection | ServerConnection, fallback: str) -> str:
    scheme = fallback.partition("://")[0] or "ws"
    return address_url(scheme, connection.remote_address, fallback)
