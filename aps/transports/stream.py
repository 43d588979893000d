"""Byte-stream plumbing shared by the built-in stream transports (TCP, TLS, Unix sockets).

Also meant for plug-in transports over a byte stream: :class:`StreamConnection` is an
:class:`asyncio.BufferedProtocol` that reads frames (behind :mod:`aps.wire.framing`'s 4-byte
header) straight into the decoder's memory and does the write flow control; :func:`dial`
opens a connection with aps's errors and deadline; :func:`reason` words an OS error;
:class:`AcceptTrouble` turns ``EMFILE`` and its kin into a pause with one log line per
interval; :func:`raise_fd_limit` lifts the soft file-descriptor limit once per process.
A plug-in that uses them needs nothing private from :mod:`aps.transports.tcp`.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import functools
import logging
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import cast

from aps.errors import ConnectError, Timeout
from aps.transports._util import tls_refused
from aps.transports.budget import PreauthBudget, Ticket
from aps.wire.framing import FrameDecoder

log = logging.getLogger(__name__)

__all__ = [
    "BACKLOG",
    "READ_LIMIT",
    "AcceptTrouble",
    "Acceptor",
    "StreamConnection",
    "dial",
    "looks_like_tls",
    "raise_fd_limit",
    "reason",
]

# Reading pauses once whole frames of this many bytes wait for receive(), so a slow consumer
# bounds the memory a fast peer can make it hold. A frame being read is always finished.
READ_LIMIT = 2 * 2**20

# send() waits while more than this many bytes wait in the write buffer, besides the last
# large frame (one over this size): a small frame does not wait for a large one to leave.
BACKLOG = 64 * 2**10


def reason(exc: BaseException) -> str:
    """A lowercase description of ``exc`` for error messages (an OSError's strerror)."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or type(exc).__name__


class StreamConnection(asyncio.BufferedProtocol):
    """The event loop's side of one connection: frames in, write flow control out.

    Bytes are read straight into the :class:`~aps.wire.framing.FrameDecoder`'s memory: a large
    frame is allocated once at its announced size (after the size check) and filled by the
    socket reads themselves, so it is neither grown nor copied on its way in.
    """

    def __init__(
        self, max_frame_size: int, on_connect: Callable[[StreamConnection], None] | None = None
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
        self.received_any = False
        """Whether any byte arrived (a peer that ends before saying anything is worth a hint)."""
        self.preauth: Ticket | None = None
        """The listener's pre-auth ticket for this connection, released when it ends."""

    # asyncio.BufferedProtocol callbacks.

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Take the event loop's transport; reading waits for the first receive."""
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
        """Where the next bytes go: the decoder's own memory."""
        return self.decoder.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        """Take the bytes just read; wake the receiver once a frame is whole."""
        self.received_any = True
        decoder = self.decoder
        decoder.buffer_updated(nbytes)
        if decoder.ready_bytes or decoder.failed:
            if decoder.ready_bytes >= READ_LIMIT or decoder.failed:
                # A refused header leaves nothing worth reading: receive() closes.
                self._pause_reading()
            self.wake()

    def eof_received(self) -> bool:
        """The peer ended its side: wake the receiver."""
        self.eof = True
        self.wake()
        # Plain TCP stays open for writing after the peer's FIN (as asyncio streams do);
        # TLS cannot half-close.
        return not self._over_ssl

    def connection_lost(self, exc: Exception | None) -> None:
        """The connection is gone: release its ticket, wake receiver and senders."""
        if self.preauth is not None:
            self.preauth.release()
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
        """The write buffer is full: senders wait."""
        self._writing_paused = True

    def resume_writing(self) -> None:
        """The write buffer drained: wake the senders."""
        self._writing_paused = False
        self._large = self._after_large = 0  # the buffer drained: nothing large waits
        self.wake_senders()

    # Used by the transport that owns the connection.

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
        if self._reading_paused and self.decoder.ready_bytes < READ_LIMIT:
            self._reading_paused = False
            assert self.transport is not None
            if not self.transport.is_closing():
                self.transport.resume_reading()

    def handed_over(self, nbytes: int) -> None:
        """Count a frame of ``nbytes`` (header included) just written to the transport."""
        if nbytes > BACKLOG:
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
        allowance = BACKLOG
        if self._after_large <= BACKLOG:
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


async def dial(
    opening: Callable[[], Awaitable[tuple[asyncio.BaseTransport, StreamConnection]]],
    url: str,
    timeout: float | None,
    *,
    there: str,
    at: str,
) -> tuple[asyncio.Transport, StreamConnection]:
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
        raise ConnectError(f"cannot connect to {url!r}: {reason(exc)}", url=url) from exc
    except ssl.SSLCertVerificationError as exc:
        # Not a learner that is not up yet: dialing again meets the same certificate.
        raise tls_refused(url, exc) from exc
    except ssl.SSLError as exc:
        if _plain_answer(exc):
            raise ConnectError(
                f"cannot connect to {url!r}: it does not look like TLS: the listener answered "
                "the TLS hello with bytes that are not TLS; dial it without TLS (no --tls-ca), "
                "or give the listener a certificate",
                url=url,
            ) from exc
        raise ConnectError(
            f"cannot connect to {url!r}: the TLS handshake failed ({reason(exc)}); check that "
            f"a listener runs {at}",
            url=url,
        ) from exc
    except OSError as exc:
        raise ConnectError(
            f"cannot connect to {url!r}: {reason(exc)}; check that a listener runs {at}",
            url=url,
        ) from exc
    # A stream transport (uvloop's do not subclass asyncio.Transport).
    return cast(asyncio.Transport, transport), connection


def _plain_answer(exc: ssl.SSLError) -> bool:
    """Whether a TLS client's handshake failed because the server's bytes are not TLS."""
    text = f"{exc.reason or ''} {exc}".lower()
    return (
        "wrong_version_number" in text
        or "wrong version number" in text
        or ("record layer failure" in text)
    )


TLS_RECORD = b"\x16\x03"
"""The first two bytes of a TLS handshake record (content type 22, major version 3)."""


def looks_like_tls(first: bytes) -> bool:
    """Whether a stream that begins with ``first`` (one byte or more) is a TLS hello."""
    return bool(first) and TLS_RECORD.startswith(first[:2])


def tls_hint(peer: str) -> str:
    """The one line a plain listener says of a peer whose first bytes are a TLS hello."""
    return (
        f"{peer} looks like TLS: it sent a TLS ClientHello to a listener without TLS; dial "
        "it with a plain tcp:// url (no --tls-ca), or give the listener a certificate"
    )


ACCEPT_PAUSE = 0.25
"""Seconds a listener stops accepting after the process ran out of file descriptors."""

ACCEPT_LOG_INTERVAL = 10.0
"""Seconds between two log lines about accept failures; the failures between are counted."""

# What accept() raises when the process or the system has no descriptor (or memory) left:
# the connection stays in the kernel's backlog until a descriptor is free.
_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class AcceptTrouble:
    """Accept failures as a state: pause, log one line per interval with a count, resume.

    Running out of file descriptors under a flood of connections is expected; a log line
    per failed ``accept`` is not (a flood of connections must not become a flood of lines).

    Args:
        what: how log lines name the listener (``"listener tcp://127.0.0.1:5555"``).
    """

    def __init__(self, what: str) -> None:
        self._what = what
        self._last_log = -ACCEPT_LOG_INTERVAL
        self._unlogged = 0
        self.failures = 0
        """Failed accepts since the listener started."""

    def exhausted(self, exc: OSError) -> bool:
        """Whether ``exc`` says the process ran out of descriptors (pause and retry)."""
        return exc.errno in _EXHAUSTED

    def note(self, exc: OSError) -> float:
        """Count a failed accept; log at most once per interval. Returns the pause, in seconds."""
        self.failures += 1
        self._unlogged += 1
        now = time.monotonic()
        if now - self._last_log >= ACCEPT_LOG_INTERVAL:
            self._last_log = now
            count, self._unlogged = self._unlogged, 0
            if self.exhausted(exc):
                log.warning(
                    "%s: accept failed %d times since the last report (%s): out of file "
                    "descriptors; pausing %.2f s at each, raise ulimit -n if honest workers "
                    "meet this",
                    *(self._what, count, reason(exc), ACCEPT_PAUSE),
                )
            else:
                log.warning(
                    "%s: accept failed %d times since the last report (%s); retrying",
                    *(self._what, count, reason(exc)),
                )
        return ACCEPT_PAUSE


_fd_limit_raised = False


def raise_fd_limit() -> tuple[int, int] | None:
    """Raise the soft limit on open files towards the hard one, once per process.

    A learner holds a descriptor per connection, pending ones included; the soft limit is
    often 1,024 while the hard one is far higher. Logs one line when it raised the limit.
    Returns ``(old, new)`` when it raised it, ``None`` otherwise (no ``resource`` module,
    already at the hard limit, or refused).
    """
    global _fd_limit_raised
    if _fd_limit_raised:
        return None
    _fd_limit_raised = True
    try:
        import resource
    except ImportError:  # not on this platform
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # An unlimited hard limit is not a value the kernel takes for the soft one (Linux caps
    # it at fs.nr_open); 2**20 is its default there.
    target = 2**20 if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft >= target:
        return None
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return None
    log.info("raised the open-file limit from %d to %d (the hard limit)", soft, target)
    return soft, target


class Acceptor:
    """Accepts connections on a listening socket, each counted from its first byte.

    Each accepted socket takes a :class:`~aps.transports.budget.Ticket` of ``budget`` at
    once, before any TLS or protocol state exists, or is closed at once when the budget is
    full. With ``ssl_context``, the socket costs nothing but itself until its first bytes
    arrive; bytes that are not a TLS hello close it (reported to the budget in one line),
    and the TLS handshake runs under the ticket's deadline. Then
    ``loop.connect_accepted_socket`` hands it to ``protocol(ticket)``, whose
    ``connection_made`` should point the ticket's abort at its transport
    (:meth:`Ticket.on_abort`). Failed accepts pause accepting (:class:`AcceptTrouble`).

    Args:
        sock: a bound, listening socket; the acceptor owns it from here.
        budget: the listener's pre-auth budget.
        ssl_context: a server-side context for TLS, or ``None``.
        protocol: makes the protocol of one connection.
        peer: how logs name the peer at an address ``accept`` returned.
        what: how logs name the listener.
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        budget: PreauthBudget,
        ssl_context: ssl.SSLContext | None,
        protocol: Callable[[Ticket], asyncio.BaseProtocol],
        peer: Callable[[object], str],
        what: str,
    ) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._budget = budget
        self._ssl = ssl_context
        self._protocol = protocol
        self._peer = peer
        self._what = what
        self._closed = False
        self._opening: set[asyncio.Task[bool]] = set()
        self.trouble = AcceptTrouble(what)
        """Failed accepts (out of file descriptors, say), counted and logged in intervals."""
        self._task = asyncio.get_running_loop().create_task(
            self._accept_loop(), name=f"aps accept ({what})"
        )

    async def aclose(self) -> None:
        """Stop accepting, close the socket and abort the connections still opening."""
        if self._closed:
            return
        self._closed = True
        self._task.cancel()
        await asyncio.wait([self._task])
        self._sock.close()
        for task in list(self._opening):
            task.cancel()
        if self._opening:
            await asyncio.wait(self._opening)

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, address = await loop.sock_accept(self._sock)
            except OSError as exc:
                # Out of descriptors: the connection waits in the kernel's backlog while
                # accepting pauses, and the log says so once per interval.
                await asyncio.sleep(self.trouble.note(exc))
                continue
            try:
                self._arrived(conn, address)
            except Exception:
                # Nothing about one connection may stop the listener from accepting the next.
                log.exception("setting up a connection on %s failed", self._what)
                conn.close()

    def _arrived(self, conn: socket.socket, address: object) -> None:
        """Count ``conn`` against the budget (or close it at once) and start opening it."""
        conn.setblocking(False)
        peer = self._peer(address)
        host = str(address[0]) if isinstance(address, tuple) and address else peer
        ticket = self._budget.enter(peer, host, abort=conn.close)
        if ticket is None:
            conn.close()  # every ticket taken, busy ones included: nothing is cheaper
            return
        task = asyncio.get_running_loop().create_task(self._open(conn, ticket))

        def cancel() -> None:
            task.cancel()

        ticket.on_abort(cancel)
        self._opening.add(task)
        task.add_done_callback(functools.partial(self._opened, conn, ticket))

    def _opened(self, conn: socket.socket, ticket: Ticket, task: asyncio.Task[bool]) -> None:
        """``task`` ended: close ``conn`` (and end its ticket) unless a protocol owns it now."""
        self._opening.discard(task)
        # A task cancelled before its first step (evicted in the same burst of accepts that
        # admitted it) never runs its handlers, and its socket, kept alive by the frame the
        # cancellation's traceback holds, would wait for the garbage collector. A task that
        # ran has no reader left on the socket, and a transport that took it closes it
        # again harmlessly; one that opened keeps it.
        if task.cancelled():
            conn.close()
            ticket.release()
        elif (error := task.exception()) is not None:
            conn.close()
            ticket.release()  # idempotent: the budget counts the connection no longer
            log.error("opening a connection on %s failed", self._what, exc_info=error)
        elif not task.result():
            conn.close()

    async def _open(self, conn: socket.socket, ticket: Ticket) -> bool:
        """Hand ``conn`` to a protocol (after its TLS handshake, if any); whether it did."""
        loop = asyncio.get_running_loop()
        opened = False
        try:
            context = self._ssl
            if context is not None:
                first = await _first_bytes(conn)
                if not first:
                    ticket.release()  # it left before saying anything
                    conn.close()
                    return False
                if not looks_like_tls(first):
                    ticket.release()
                    conn.close()
                    self._budget.note(
                        f"{ticket.peer}: ConnectionLost: it does not look like TLS: its first "
                        "bytes are not a TLS hello; dial it with TLS (--tls-ca)"
                    )
                    return False
            protocol = self._protocol(ticket)
            # The TLS handshake runs under the ticket's deadline; cancelling this task (an
            # eviction, the deadline) aborts it, and the protocol's connection_made hands
            # the abort over to its transport once it is open.
            await loop.connect_accepted_socket(
                lambda: protocol,
                sock=conn,
                ssl=context,
                ssl_handshake_timeout=None if context is None else ticket.remaining(),
            )
            opened = True
            return True
        except asyncio.CancelledError:
            # Evicted, past its deadline, or the listener closed: the socket goes now.
            if not opened:
                conn.close()
            ticket.release()
            raise
        except (OSError, ConnectionError, TimeoutError) as exc:  # ssl.SSLError included
            conn.close()
            if ticket.held:
                ticket.release()
                self._budget.note(f"{ticket.peer}: ConnectionLost: {reason(exc)}")
            return False


async def _first_bytes(conn: socket.socket) -> bytes:
    """Wait until ``conn`` is readable and peek at its first bytes without reading them.

    ``b""``: the peer closed (or reset) the connection before sending anything.
    """
    loop = asyncio.get_running_loop()
    while True:
        try:
            return conn.recv(len(TLS_RECORD), socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            return b""
        readable = loop.create_future()
        fd = conn.fileno()
        loop.add_reader(fd, _resolve, readable)
        try:
            await readable
        finally:
            loop.remove_reader(fd)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
