"""The connections under the WebSocket transport: gathering fragments, refusing before the token.

websockets' ``ClientConnection`` and ``ServerConnection`` with aps's seams (imported by
:mod:`aps.transports.websocket` once the ``websockets`` package is there):

- :class:`Gathering` assembles a fragmented message as its fragments arrive
  (:class:`Gatherer`), at both ends;
- :class:`PreauthConnection` is a listener's connection: it counts against its listener's
  :class:`WaitingRoom` until accepted, refuses what no aps peer sends before it proved the
  token, and writes large immutable payloads without copying them (:func:`send_uncopied`).
"""

from __future__ import annotations

import asyncio
import functools
import struct
from collections.abc import Callable
from typing import Any, cast

from websockets.asyncio.client import ClientConnection
from websockets.asyncio.connection import Connection
from websockets.asyncio.server import Server, ServerConnection
from websockets.frames import Frame as WsFrame, Opcode
from websockets.protocol import Event, Protocol, Side, State
from websockets.server import ServerProtocol

from aps._base._buffers import allocate, seal
from aps.transports.budget import PreauthBudget, Ticket

__all__ = [
    "LIMIT_ATTRIBUTE",
    "MAX_OPENING_BYTES",
    "PREAUTH_CONTROL_FRAMES",
    "UNACCEPTED_FRAME_SIZE",
    "UNACCEPTED_QUEUE",
    "UNCOPIED_SIZE",
    "Gatherer",
    "Gathering",
    "GatheringClient",
    "PreauthConnection",
    "TooManyFragments",
    "WaitingRoom",
    "max_fragments",
    "send_uncopied",
]

LIMIT_ATTRIBUTE = (
    "max_message_size" if hasattr(Protocol(Side.SERVER), "max_message_size") else "max_size"
)
"""The protocol's limit on incoming messages: ``max_message_size`` in current websockets
(beside a limit per fragment), ``max_size`` in older releases such as 13."""

MAX_OPENING_BYTES = 16 * 1024
"""The most bytes a connection may send before its opening handshake is done: the HTTP
request and its headers (an aps client sends a few hundred). More closes it at once."""

UNACCEPTED_FRAME_SIZE = 16 * 1024
"""The largest message read from a connection nobody has accepted yet (in at most
``max_fragments(UNACCEPTED_FRAME_SIZE)`` fragments); accept() restores the listener's limit.

As large as the handshake frames a learner reads until the token is proved
(``aps.wire.codec.HANDSHAKE_FRAME_SIZE``): an aps peer sends nothing before it is accepted."""

PREAUTH_CONTROL_FRAMES = 8
"""Pings and pongs a connection may send while it holds a pre-auth ticket; more closes it.
An aps peer sends none (aps has its own heartbeats)."""

# Bytes websockets parses at a time from a connection that holds a pre-auth ticket: at most
# a few hundred frame objects exist before the first of them can be refused.
_PREAUTH_READ = 4096

UNACCEPTED_QUEUE = 1
"""Messages queued before a connection is accepted, at most (websockets' ``max_queue``): each
is within :data:`UNACCEPTED_FRAME_SIZE`, and nobody reads them until accept, which restores
websockets' default."""

UNCOPIED_SIZE = 64 * 1024
"""Data frames of at least this many bytes that a listener sends leave without a copy."""


def max_fragments(limit: int) -> int:
    """The most fragments of one message under a message limit of ``limit`` bytes.

    aps itself sends :data:`~aps.transports.websocket.FRAGMENT_SIZE` pieces; a peer may use
    smaller ones, down to 16 KiB on average, plus a few. Before accept (a 16 KiB limit) that
    is 65 fragments: a pending connection cannot park thousands of one-byte (or empty)
    fragments.
    """
    return 64 + limit // (16 * 1024)


class TooManyFragments(Exception):
    """A message came in more fragments than :func:`max_fragments` allows (closes it)."""

    def __init__(self, count: int, limit: int) -> None:
        super().__init__(
            f"a message in more than {count - 1} fragments under a limit of {limit} bytes; "
            f"at most {max_fragments(limit)} are read"
        )


class Gatherer:
    """Assembles a fragmented binary message as its fragments arrive.

    websockets itself keeps every fragment until the last one and then joins them: a 40 MB
    message holds 40 MB of fragments and a fresh 40 MB ``bytes``, all memory the process has
    not touched for a while. Here each fragment is copied into the message when it arrives
    and freed at once, so the fragments' memory is reused. The message itself goes into a
    buffer of the size the previous fragmented message had, from :mod:`aps._base._buffers`, which
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


class Gathering(Connection):
    """A connection (client or server) that gathers fragmented messages with a :class:`Gatherer`.

    Mixed in before websockets' ``ClientConnection`` or ``ServerConnection``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.aps_gatherer = Gatherer()
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
                handed_on = self.aps_gatherer.add(event, getattr(self.protocol, LIMIT_ATTRIBUTE))
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


class GatheringClient(Gathering, ClientConnection):
    """A client connection that gathers fragmented messages as they arrive."""


def send_uncopied(
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


class WaitingRoom:
    """A listener's connections that opened and wait to be accepted, and what they cost.

    Args:
        budget: the listener's pre-auth budget, told of each connection refused here.

    Attributes:
        oversized: connections closed for sending more than :data:`MAX_OPENING_BYTES` before
            their opening handshake was done.
    """

    def __init__(self, budget: PreauthBudget) -> None:
        self.budget = budget
        self.oversized = 0
        self._waiting: set[PreauthConnection] = set()

    def __len__(self) -> int:
        return len(self._waiting)

    def enter(self, connection: PreauthConnection) -> None:
        """``connection``'s socket opened: it waits (opening handshake, accept queue)."""
        self._waiting.add(connection)
        connection.aps_waiting = True

    def leave(self, connection: object) -> None:
        """``connection`` no longer waits: it was accepted, or it ended."""
        if isinstance(connection, PreauthConnection) and connection.aps_waiting:
            connection.aps_waiting = False
            self._waiting.discard(connection)

    def abort_all(self) -> None:
        """Abort every connection still waiting, as their listener closes.

        They would otherwise live on until their deadline, after their listener (and perhaps
        their loop) ended.
        """
        for connection in list(self._waiting):
            connection.transport.abort()


class PreauthConnection(Gathering, ServerConnection):
    """A listener's connection: counted in ``room`` until accepted, bounded until the token.

    Gathers fragmented messages as the client does, and writes large immutable payloads
    without a copy (:func:`send_uncopied`). While ``ticket`` is held (until accept, or until
    the token is proved once a learner's gate adopted the budget), a text message or more
    than :data:`PREAUTH_CONTROL_FRAMES` pings and pongs close it at once, and what it sends
    is parsed :data:`_PREAUTH_READ` bytes at a time; before its opening handshake is done,
    more than :data:`MAX_OPENING_BYTES` close it.

    Args:
        server: the websockets server whose handler takes it once its opening handshake is
            done.
        room: where its listener counts the connections it has not handed out.
        ticket: its share of the listener's pre-auth budget, taken at accept.
        max_frame_size: its listener's frame limit; until accepted, messages are held to
            :data:`UNACCEPTED_FRAME_SIZE` below it, and :data:`UNACCEPTED_QUEUE` of them.
        close_timeout: seconds websockets waits for the peer's half of the closing handshake.
    """

    aps_waiting = False

    def __init__(
        self,
        server: Server,
        *,
        room: WaitingRoom,
        ticket: Ticket,
        max_frame_size: int,
        close_timeout: float,
    ) -> None:
        limit = min(max_frame_size, UNACCEPTED_FRAME_SIZE)
        super().__init__(
            ServerProtocol(max_size=limit, logger=server.logger),
            server,
            ping_interval=None,  # aps has its own heartbeats
            ping_timeout=None,
            close_timeout=close_timeout,
            max_queue=UNACCEPTED_QUEUE,
        )
        protocol = self.protocol
        protocol.send_frame = functools.partial(  # type: ignore[method-assign]
            send_uncopied, protocol, protocol.send_frame
        )
        self.aps_room = room
        self.aps_ticket: Ticket | None = ticket
        self.aps_opening_bytes = 0
        self.aps_control_frames = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        ticket = self.aps_ticket
        if ticket is not None:
            ticket.on_abort(cast(asyncio.Transport, transport).abort)
        super().connection_made(transport)
        self.aps_room.enter(self)

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
                    self.aps_room.budget.note(
                        f"{ticket.peer}: ConnectionLost: {why} before proving the token; closed it"
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
                self.aps_room.oversized += 1
                ticket = self.aps_ticket
                if ticket is not None and ticket.held:
                    ticket.release()
                    self.aps_room.budget.note(
                        f"{ticket.peer}: ConnectionLost: sent more than "
                        f"{MAX_OPENING_BYTES} bytes of opening handshake; closed it"
                    )
                self.transport.abort()
                return
        super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.aps_room.leave(self)
        if self.aps_ticket is not None:
            self.aps_ticket.release()
        super().connection_lost(exc)
