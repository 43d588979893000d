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
fragments they receive as they arrive (:class:`_Gatherer`, hooked into the connections'
``process_event``), and a listener writes large immutable payloads without copying them
into each frame (:func:`_send_uncopied`, in place of its protocol's ``send_frame``). Those
two seams of websockets' sans-I/O design, and its protocol's ``writes`` list, have the same
shape in websockets 14.2 to 17.4, the releases the WebSocket tests pass on.

A listener accepts its sockets itself (:class:`~aps.transports.stream.Acceptor`), so that
each counts against its pre-auth budget from the first byte, TLS included; it builds each
``ServerConnection`` (with its ``ServerProtocol``) as websockets' ``serve`` would, and hands
it to the connection handler of a websockets ``Server`` that is never bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import os
import socket
import ssl
import struct
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, Self, cast
from urllib.parse import urlsplit

from aps._buffers import allocate, seal
from aps._typing import Frame
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
from aps.framing import check_max_frame_size, frame_view
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
from aps.transports.budget import DEFAULT_LIMIT, DEFAULT_PER_HOST, PreauthBudget, Ticket
from aps.transports.stream import Acceptor

try:
    from websockets.asyncio.client import ClientConnection, connect as ws_connect
    from websockets.asyncio.connection import Connection
    from websockets.asyncio.server import Server, ServerConnection, serve as ws_serve
    from websockets.exceptions import (
        ConnectionClosed,
        ConnectionClosedOK,
        InvalidURI,
        PayloadTooBig,
        WebSocketException,
    )
    from websockets.frames import CloseCode, Frame as WsFrame, Opcode
    from websockets.protocol import Event, Protocol, Side, State
    from websockets.server import ServerProtocol
except ImportError as exc:  # pragma: no cover - exercised by hiding the package in a test
    raise MissingDependency(
        "the ws:// and wss:// transports need the websockets package (version 14.2 or newer); "
        "install it with pip install 'aps-rl[websocket]'"
    ) from exc

__all__ = ["WebSocketFactory", "WebSocketListener", "WebSocketTransport"]

# websockets 15 added proxy support, on by default; older releases lack the argument.
_DIRECT: dict[str, Any] = (
    {"proxy": None} if "proxy" in inspect.signature(ws_connect.__init__).parameters else {}
)

# The protocol's limit on incoming messages: max_message_size in current websockets (beside
# a limit per fragment), max_size in older releases such as 13.
_LIMIT = "max_message_size" if hasattr(Protocol(Side.SERVER), "max_message_size") else "max_size"

# Seconds websockets waits for the peer's half of the closing handshake before it drops the
# TCP connection. A live peer answers in milliseconds.
_CLOSE_TIMEOUT = 5.0

FRAGMENT_SIZE = 1 << 20
"""Frames larger than this travel as a fragmented WebSocket message of pieces this size.

websockets buffers and slices each incoming WebSocket frame whole: one 40 MB frame costs the
receiver three fresh 40 MB buffers (its stream buffer, the slice, the message), and fresh
memory is what large transfers pay for. In 1 MiB fragments the first two stay small and are
reused, and the receiving end copies each fragment into the message as it arrives (see
:class:`_Gatherer`). The peer sees one message. (256 KiB fragments cost a weight sync the
same CPU, 64 KiB ones more: see benchmarks/README.md.)
"""


def max_fragments(limit: int) -> int:
    """The most fragments of one message under a message limit of ``limit`` bytes.

    aps itself sends :data:`FRAGMENT_SIZE` pieces; a peer may use smaller ones, down to
    16 KiB on average, plus a few. Before accept (a 16 KiB limit) that is 65 fragments: a
    pending connection cannot park thousands of one-byte (or empty) fragments.
    """
    return 64 + limit // (16 * 1024)


class TooManyFragments(Exception):
    """A message came in more fragments than :func:`max_fragments` allows (closes it)."""

    def __init__(self, count: int, limit: int) -> None:
        super().__init__(
            f"a message in more than {count - 1} fragments under a limit of {limit} bytes; "
            f"at most {max_fragments(limit)} are read"
        )


class _Gatherer:
    """Assembles a fragmented binary message as its fragments arrive.

    websockets itself keeps every fragment until the last one and then joins them: a 40 MB
    message holds 40 MB of fragments and a fresh 40 MB ``bytes``, all memory the process has
    not touched for a while. Here each fragment is copied into the message when it arrives
    and freed at once, so the fragments' memory is reused. The message itself goes into a
    buffer of the size the previous fragmented message had, from :mod:`aps._buffers`, which
    reuses one that nothing refers to any more (weights arrive at the same size every time).
    A message of another size is joined from its fragments, as websockets would.

    Nothing larger than the connection's message limit is allocated: the guess is taken only
    within the limit, and websockets refuses a message whose fragments exceed the limit
    before it reads the fragment that would. A message in more than :func:`max_fragments`
    pieces is refused (:class:`TooManyFragments`), and pieces are joined into one growing
    buffer as they come, so tiny fragments cost their bytes, not an object each. A text
    message's fragments are handed on as they come (websockets assembles them, and aps
    refuses the message), but counted against the same limit.
    """

    def __init__(self) -> None:
        self.expected = 0  # the size of the last fragmented message
        self._buffer: bytes | bytearray | None = None
        self._view: memoryview | None = None
        self._joined = bytearray()  # the message so far, when there is no guessed buffer
        self._size = 0
        self._count = 0
        self._gathering = False
        self._passing = False  # a fragmented text message: counted, handed on as it comes

    def add(self, frame: WsFrame, limit: int | None) -> WsFrame | None:
        """Return the frame to hand on: ``frame``, a whole message, or ``None`` for now.

        ``limit``: the connection's largest message in bytes (``None``: no limit).

        Raises:
            TooManyFragments: the message came in more pieces than the limit allows.
        """
        if frame.opcode is Opcode.BINARY and not frame.fin:
            self.clear()
            self._gathering = True
            guess = self.expected
            if 0 < guess and len(frame.data) <= guess and (limit is None or guess <= limit):
                self._buffer, self._view = allocate(guess)
        elif frame.opcode is Opcode.TEXT and not frame.fin:
            self.clear()
            self._passing = True
        elif frame.opcode is not Opcode.CONT or not (self._gathering or self._passing):
            return frame  # a whole message, or a control frame
        self._count += 1
        if limit is not None and self._count > max_fragments(limit):
            count = self._count
            self.clear()
            raise TooManyFragments(count, limit)
        if self._passing:
            # websockets keeps a text message's fragments as frames until the last one:
            # counted here all the same, so that it cannot keep thousands of them.
            if frame.fin:
                self._passing = False
                self._count = 0
            return frame
        data = frame.data
        end = self._size + len(data)
        view = self._view
        if view is not None and end <= view.nbytes:
            view[self._size : end] = data
        else:
            if view is not None:  # longer than the previous one: join it instead
                self._joined += view[: self._size]
                self._drop_buffer()
            self._joined += data
        self._size = end
        if not frame.fin:
            return None
        return WsFrame(Opcode.BINARY, self._finish())

    def _finish(self) -> bytes:
        self._gathering = False
        self._count = 0
        self.expected = size = self._size
        view, buffer = self._view, self._buffer
        if view is None or buffer is None:
            message = bytes(self._joined)
            self._joined = bytearray()
            return message
        self._view = self._buffer = None
        if size == view.nbytes:
            view.release()
            return seal(buffer)
        message = bytes(view[:size])  # shorter than the previous one
        view.release()
        return message

    def clear(self) -> None:
        """Forget a message half gathered (the connection ended), so its buffer is reused."""
        self._gathering = False
        self._passing = False
        self._size = 0
        self._count = 0
        self._joined = bytearray()
        self._drop_buffer()

    def _drop_buffer(self) -> None:
        if self._view is not None:
            self._view.release()
        self._view = self._buffer = None


class _Gathering(Connection):
    """A connection (client or server) that gathers fragmented messages with a :class:`_Gatherer`.

    Mixed in before websockets' ``ClientConnection`` or ``ServerConnection``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.aps_gatherer = _Gatherer()
        self.aps_refused = False
        """Whether the connection was aborted for what it sent (the rest is dropped)."""

    def aps_refuse(self) -> None:
        """Abort the connection now; events already parsed from its bytes go nowhere."""
        self.aps_refused = True
        self.aps_gatherer.clear()
        self.transport.abort()

    def process_event(self, event: Event) -> None:
        if self.aps_refused:
            # One read may hold thousands of frames, parsed before the first is seen here:
            # none after the refusal may reach websockets' queues.
            return
        if isinstance(event, WsFrame):  # not the opening handshake
            try:
                handed_on = self.aps_gatherer.add(event, getattr(self.protocol, _LIMIT))
            except TooManyFragments:
                # Closed at once: its fragments are gone, and so is anything after them.
                self.aps_refuse()
                return
            if handed_on is None:
                return  # gathering: websockets sees the message once it is whole
            event = handed_on
        super().process_event(event)

    def connection_lost(self, exc: Exception | None) -> None:
        self.aps_gatherer.clear()
        super().connection_lost(exc)


class _GatheringClient(_Gathering, ClientConnection):
    """A client connection that gathers fragmented messages as they arrive."""


UNCOPIED_SIZE = 64 * 1024
"""Data frames of at least this many bytes that a listener sends leave without a copy."""


def _send_uncopied(
    protocol: ServerProtocol, serialize: Callable[[WsFrame], None], frame: WsFrame
) -> None:
    """A listener's ``protocol.send_frame``: large immutable payloads leave without a copy.

    websockets builds every frame it sends into a new buffer, header and payload, which costs
    a copy of each fragment of a large frame (a client must copy anyway, to mask). A server's
    frames are not masked, so here a large payload that nothing can change (``bytes``, or a
    flat view of ``bytes``) goes to the socket as it is, after a header built alone.
    Everything else takes websockets' own path: small and control frames, mutable payloads
    (the caller may reuse its buffer once ``send`` returns), extensions, debug logging.
    """
    data = frame.data
    immutable = type(data) is bytes or (
        isinstance(data, memoryview)
        and type(data.obj) is bytes
        and data.format == "B"
        and data.ndim == 1
        and data.c_contiguous
    )
    if not immutable or len(data) < UNCOPIED_SIZE or protocol.extensions or protocol.debug:
        serialize(frame)
        return
    frame.check()
    head = (
        (0b10000000 if frame.fin else 0)
        | (0b01000000 if frame.rsv1 else 0)
        | (0b00100000 if frame.rsv2 else 0)
        | (0b00010000 if frame.rsv3 else 0)
        | frame.opcode
    )
    # 127: a 64-bit length follows (the form for payloads of 64 KiB or more); no mask bit.
    protocol.writes.append(struct.pack("!BBQ", head, 127, len(data)))
    protocol.writes.append(data)  # type: ignore[arg-type]  # a bytes-like, written as is


def _fragments(view: memoryview) -> Iterator[memoryview]:
    for start in range(0, view.nbytes, FRAGMENT_SIZE):
        yield view[start : start + FRAGMENT_SIZE]


def _retrieve(task: asyncio.Future[None]) -> None:
    # A send whose caller was cancelled fails unobserved; the next send or receive reports
    # the broken connection.
    if not task.cancelled():
        task.exception()


class WebSocketTransport:
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
        setattr(self._connection.protocol, _LIMIT, value)
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

MAX_OPENING_BYTES = 16 * 1024
"""The most bytes a connection may send before its opening handshake is done: the HTTP
request and its headers (an aps client sends a few hundred). More closes it at once."""

UNACCEPTED_FRAME_SIZE = 16 * 1024
"""The largest message read from a connection nobody has accepted yet (in at most
``max_fragments(UNACCEPTED_FRAME_SIZE)`` fragments); accept() restores the listener's limit.

As large as the handshake frames a learner reads until the token is proved
(``aps.codec.HANDSHAKE_FRAME_SIZE``): an aps peer sends nothing before it is accepted."""

PREAUTH_CONTROL_FRAMES = 8
"""Pings and pongs a connection may send while it holds a pre-auth ticket; more closes it.
An aps peer sends none (aps has its own heartbeats)."""

# Bytes websockets parses at a time from a connection that holds a pre-auth ticket: at most
# a few hundred frame objects exist before the first of them can be refused.
_PREAUTH_READ = 4096

# Messages queued before a connection is accepted, at most (websockets' max_queue): each is
# within UNACCEPTED_FRAME_SIZE, and nobody reads them until accept. accept() restores
# websockets' default.
_UNACCEPTED_QUEUE = 1
_ACCEPTED_QUEUE = (16, 4)

# Connections the kernel queues for accept() while the listener is busy or paused.
_ACCEPT_BACKLOG = 128


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


class WebSocketListener:
    """A WebSocket server; create it with :meth:`WebSocketFactory.listen`.

    The listener accepts connections itself (as the TCP one does): every connection takes a
    :class:`~aps.transports.budget.Ticket` of :attr:`preauth` from accept, before its TLS
    handshake (``wss://``) and its opening handshake, and is aborted when the budget evicts
    it or its deadline passes, so idle connections can neither use up the process's file
    descriptors nor keep an honest worker out. Until it is accepted, a connection may send
    :data:`MAX_OPENING_BYTES` of opening handshake, messages of at most
    :data:`UNACCEPTED_FRAME_SIZE` and, in fragments, few of them (see :class:`_Gatherer`).
    While its ticket is held (until accept, or until the token is proved once a learner's
    gate adopted the budget), a text message or more than :data:`PREAUTH_CONTROL_FRAMES`
    pings and pongs close it at once, and what it sends is parsed a few KiB at a time.
    """

    def __init__(
        self,
        *,
        requested: str,
        max_frame_size: int,
        ssl_context: ssl.SSLContext | None = None,
        preauth: PreauthBudget | None = None,
    ) -> None:
        self._url = requested
        self._max_frame_size = max_frame_size
        self._ssl = ssl_context
        self.preauth = preauth if preauth is not None else PreauthBudget()
        """The pre-auth budget of this listener's connections; see :mod:`aps.transports.budget`."""
        self._acceptor: Acceptor | None = None
        self._queue: AcceptQueue[WebSocketTransport] = AcceptQueue(f"listener {requested}")
        self._waiting: set[ServerConnection] = set()
        self.oversized = 0
        """Connections closed for sending more than :data:`MAX_OPENING_BYTES` before their
        opening handshake was done."""
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
        return len(self._waiting)

    @property
    def refused(self) -> int:
        """Connections closed before they were accepted.

        Evicted to make room, refused when the budget was full, or sending too much opening
        handshake.
        """
        return self.preauth.evicted + self.preauth.refused + self.oversized

    def _connection_class(self) -> type[ServerConnection]:
        """The ServerConnection that counts this listener's unaccepted connections."""
        listener = self

        class _Counted(_Gathering, ServerConnection):
            """Counts unaccepted connections; gathers fragmented messages as the client does."""

            aps_waiting = False

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                protocol = self.protocol
                protocol.send_frame = functools.partial(  # type: ignore[method-assign]
                    _send_uncopied, protocol, protocol.send_frame
                )
                self.aps_ticket: Ticket | None = None
                self.aps_opening_bytes = 0
                self.aps_control_frames = 0

            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                ticket = self.aps_ticket
                if ticket is not None:
                    ticket.on_abort(cast(asyncio.Transport, transport).abort)
                super().connection_made(transport)
                listener._waiting.add(self)
                self.aps_waiting = True

            def process_event(self, event: Event) -> None:
                ticket = self.aps_ticket
                if (
                    isinstance(event, WsFrame)
                    and ticket is not None
                    and ticket.held
                    and not self.aps_refused
                ):
                    why = self._aps_preauth_refusal(event)
                    if why:
                        ticket.release()
                        if self.aps_waiting:
                            # Not accepted yet: nobody else will say why it ended (once
                            # accepted, the learner's gate logs the lost connection itself).
                            listener.preauth.note(
                                f"{ticket.peer}: ConnectionLost: {why} before proving the "
                                "token; closed it"
                            )
                        self.aps_refuse()
                        return
                super().process_event(event)

            def _aps_preauth_refusal(self, frame: WsFrame) -> str:
                """Why ``frame`` closes a connection that has not proved anything, or ``""``."""
                if frame.opcode is Opcode.TEXT:
                    # websockets keeps a text message's fragments as frames, and aps
                    # refuses text anyway: an aps peer never sends any.
                    return "sent a text message"
                if frame.opcode in (Opcode.PING, Opcode.PONG):
                    # Each ping is answered whether or not the peer reads: pongs would
                    # pile up in the write buffer.
                    self.aps_control_frames += 1
                    if self.aps_control_frames > PREAUTH_CONTROL_FRAMES:
                        return f"sent more than {PREAUTH_CONTROL_FRAMES} pings or pongs"
                return ""

            def data_received(self, data: bytes) -> None:
                ticket = self.aps_ticket
                if (
                    ticket is None
                    or not ticket.held
                    or len(data) <= _PREAUTH_READ
                    or self.protocol.state is not State.OPEN  # the opening is capped in bytes
                ):
                    self._aps_data_received(data)
                    return
                # Before the token is proved, websockets parses a read in small pieces: one
                # read of tiny frames would otherwise become thousands of frame objects at
                # once, before the first of them could be refused.
                view = memoryview(data)
                for start in range(0, len(view), _PREAUTH_READ):
                    if self.aps_refused or self.transport.is_closing():
                        return
                    self._aps_data_received(bytes(view[start : start + _PREAUTH_READ]))

            def _aps_data_received(self, data: bytes) -> None:
                if self.protocol.state is State.CONNECTING:
                    # websockets buffers a request line and headers up to 1 MiB; a pending
                    # connection may cost a few KiB.
                    self.aps_opening_bytes += len(data)
                    if self.aps_opening_bytes > MAX_OPENING_BYTES:
                        listener.oversized += 1
                        ticket = self.aps_ticket
                        if ticket is not None and ticket.held:
                            ticket.release()
                            listener.preauth.note(
                                f"{ticket.peer}: ConnectionLost: sent more than "
                                f"{MAX_OPENING_BYTES} bytes of opening handshake; closed it"
                            )
                        self.transport.abort()
                        return
                super().data_received(data)

            def connection_lost(self, exc: Exception | None) -> None:
                listener.taken(self)
                if self.aps_ticket is not None:
                    self.aps_ticket.release()
                super().connection_lost(exc)

        return _Counted

    def taken(self, connection: ServerConnection) -> None:
        """``connection`` no longer waits: it was accepted, or it ended."""
        if getattr(connection, "aps_waiting", False):
            connection.aps_waiting = False  # type: ignore[attr-defined]
            self._waiting.discard(connection)

    @property
    def url(self) -> str:
        """The bound address, port 0 resolved: ``ws://127.0.0.1:54321/``."""
        return self._url

    @property
    def is_local(self) -> bool:
        """Whether only this host can connect: the bound address is a loopback one."""
        return is_loopback_host(urlsplit(self._url).hostname or "")

    async def accept(self) -> WebSocketTransport:
        """Wait for the next connection whose opening handshake succeeded.

        A connection that ended while it waited is skipped. Unless the budget was adopted
        (by a learner's gate), the connection's ticket is released here.

        Cancellation: no connection is lost.

        Raises:
            TransportClosed: the listener was closed (also wakes a pending call).
        """
        while True:
            transport = await self._queue.get()
            connection = transport._connection
            self.taken(connection)  # type: ignore[arg-type]
            if connection.transport.is_closing():
                detach(transport.aclose)
                continue
            ticket: Ticket | None = getattr(connection, "aps_ticket", None)
            if ticket is not None and not self.preauth.holds_after_accept:
                ticket.release()
            transport.max_frame_size = self._max_frame_size
            messages: Any = getattr(connection, "recv_messages", None)
            if hasattr(messages, "high") and hasattr(messages, "low"):
                messages.high, messages.low = _ACCEPTED_QUEUE
            return transport

    async def aclose(self) -> None:
        """Stop listening and wake pending ``accept`` calls; idempotent.

        Connections already accepted stay open; connections nobody accepted are closed.
        """
        if self._queue.closed:
            return
        unaccepted = self._queue.close()
        if self._acceptor is not None:
            await self._acceptor.aclose()
        for transport in unaccepted:
            await transport.aclose()
        # Connections still in their opening handshake would otherwise live on until their
        # deadline, after their listener (and perhaps their loop) ended.
        for connection in list(self._waiting):
            connection.transport.abort()

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
        return f"<WebSocketListener {self.url}>"

    def _serve(self, sock: socket.socket) -> None:
        """Start accepting on the bound, listening ``sock``."""
        counted = self._connection_class()
        server = self._server
        limit = min(self._max_frame_size, UNACCEPTED_FRAME_SIZE)

        def protocol(ticket: Ticket) -> ServerConnection:
            connection = counted(
                ServerProtocol(max_size=limit, logger=server.logger),
                server,
                ping_interval=None,
                ping_timeout=None,
                close_timeout=_CLOSE_TIMEOUT,
                max_queue=_UNACCEPTED_QUEUE,
            )
            connection.aps_ticket = ticket  # type: ignore[attr-defined]
            return connection

        self._acceptor = Acceptor(
            sock,
            budget=self.preauth,
            ssl_context=self._ssl,
            protocol=protocol,
            peer=self._peer_at,
            what=f"listener {self._url}",
        )

    def _peer_at(self, address: object) -> str:
        scheme = self._url.partition("://")[0] or "ws"
        if isinstance(address, tuple) and len(address) >= 2:
            return f"{scheme}://{format_host(str(address[0]))}:{address[1]}"
        return f"{scheme}://unknown"

    async def _handle(self, connection: ServerConnection) -> None:
        # websockets closes a connection when its handler returns, so the handler lives as
        # long as the transport: it waits for the connection to end, by either side.
        transport = WebSocketTransport(
            connection,
            peer=_peer_of(connection, self._url),
            max_frame_size=min(self._max_frame_size, UNACCEPTED_FRAME_SIZE),
        )
        if not self._queue.put(transport):
            detach(transport.aclose)
        await connection.wait_closed()


class WebSocketFactory:
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

    def __init__(
        self,
        *,
        ssl_context: ssl.SSLContext | None = None,
        server_ssl_context: ssl.SSLContext | None = None,
        client_ssl_context: ssl.SSLContext | None = None,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        preauth_limit: int = DEFAULT_LIMIT,
        preauth_per_host: int = DEFAULT_PER_HOST,
    ) -> None:
        self.max_frame_size = check_max_frame_size(max_frame_size, ceiling=2**63 - 1)
        self._preauth_limits = {"limit": preauth_limit, "per_host": preauth_per_host}
        PreauthBudget(**self._preauth_limits)  # refuses bad limits now, not at listen
        self._server_ssl = server_ssl_context or ssl_context
        self._client_ssl = client_ssl_context or ssl_context

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
                    create_connection=_GatheringClient,
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
        listener = WebSocketListener(
            requested=url,
            max_frame_size=self.max_frame_size,
            ssl_context=context,
            preauth=PreauthBudget(**self._preauth_limits),
        )
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
            family, _, _, _, address = infos[0]
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                if os.name == "posix":  # as asyncio does: rebinding a port in TIME_WAIT
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(address)
                sock.listen(_ACCEPT_BACKLOG)
            except BaseException:
                sock.close()
                raise
        except OSError as exc:
            raise ConnectError(
                f"cannot listen on {url!r}: {(exc.strerror or str(exc)).lower()}; pick another "
                "port (0 picks a free one) or stop the process that holds it",
                url=url,
            ) from exc
        bound_host, bound_port = sock.getsockname()[:2]
        scheme = "wss" if secure else "ws"
        listener._url = f"{scheme}://{format_host(bound_host)}:{bound_port}{path}"
        listener._serve(sock)
        return listener

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
    address = connection.remote_address
    scheme = fallback.partition("://")[0] or "ws"
    if isinstance(address, tuple) and len(address) >= 2:
        return f"{scheme}://{format_host(str(address[0]))}:{address[1]}"
    return fallback
