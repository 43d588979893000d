"""A transport that speaks aps messages: codec, protocol checks, heartbeats and deadlines.

:class:`Session` is the only place where the protocol meets I/O and time. It encodes what the
role sends, decodes and checks what arrives, answers nothing on its own, sends a heartbeat
when the role has been quiet for ``heartbeat_interval`` seconds, and turns every silence
longer than a deadline, and every answer later than one, into :class:`~aps.errors.Timeout`.

Until the role calls :meth:`Session.authenticated` (the peer proved the token), a session
reads only handshake-sized frames and decodes them with :func:`aps.wire.codec.decode_handshake`:
a peer that has proved nothing cannot make this side allocate more than a few KiB. The
transport's own limit is lowered meanwhile when it exposes a settable ``max_frame_size``
(every built-in does), so a large frame is refused from its header, before its body is read.

Once the handshake chose a codec (:meth:`Session.compress`), the session encodes with it and
accepts arrays compressed with it, and no other; the arrays of one frame may inflate to the
session's frame limit, no more (see :mod:`aps.wire.compression`). Frame delta
(:mod:`aps.wire.frame_delta`) is chosen with it: a session that negotiated it sends its rollout
chunks' frame stacks as newest frames and accepts them so; one that did not refuses them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Final

from aps.errors import (
    ConfigError,
    EndOfStream,
    InvalidState,
    ProtocolError,
    Timeout,
    TransportClosed,
    TransportError,
    WireError,
)
from aps.metrics.figures import WorkerMetrics
from aps.session.protocol import Connection, Role, State
from aps.transports.base import DEFAULT_MAX_FRAME_SIZE, Transport, is_local
from aps.wire import codec, compression
from aps.wire.messages import Goodbye, Heartbeat, Message

__all__ = ["OFF_LOOP_BYTES", "OFF_LOOP_INFLATING_BYTES", "Session", "Timeouts"]

OFF_LOOP_BYTES: Final = 4 * 2**20
"""Frames of at least this many bytes are decoded in a thread, off the event loop: decoding
one (a large weights version, a chunk of pixels) takes milliseconds, which the loop spends
serving the other connections meanwhile. Smaller frames decode on the loop, where a thread's
hand-off (tens of µs) would cost more than the decode."""

OFF_LOOP_INFLATING_BYTES: Final = 64 * 2**10
"""The same threshold on a connection that negotiated compression or frame delta, where a
small frame may inflate or rebuild to far more than its size (a 47 KB Pong chunk with zstd
and frame delta is 27.6 MiB of observations: about 14 ms of work)."""

log = logging.getLogger("aps.session")


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeouts:
    """Every deadline aps applies, in seconds.

    Attributes:
        connect: how long a worker keeps dialing a learner that is not up yet, and how long
            a learner waits for all its workers to arrive.
        handshake: the longest a connection may take from accept to ready; a slow or silent
            peer is dropped after it.
        step: the longest a worker may take to answer one reset, step or env call, counted
            from the request: heartbeats do not extend it (they prove the connection, not
            progress).
        heartbeat_interval: a side that has sent nothing for this long sends a heartbeat.
        heartbeat_timeout: the longest silence a worker tolerates from its learner. A learner
            that blocks its event loop longer than this (a long update in an await loop) must
            raise it.
    """

    connect: float = 60.0
    handshake: float = 10.0
    step: float = 120.0
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 120.0

    def __post_init__(self) -> None:
        for name in ("connect", "handshake", "step", "heartbeat_interval", "heartbeat_timeout"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise ConfigError(
                    f"Timeouts.{name} must be a positive number of seconds, got {value!r}"
                )


@dataclass(slots=True)
class _Wait:
    """One :meth:`Session.receive` call waiting under a deadline."""

    task: asyncio.Task[Any]
    deadline: float  # in loop time
    cancelling: int  # the task's cancel requests when the call began
    expired: bool = False  # the watchdog cancelled the task for this call's deadline


class Session:
    """One connection's message layer over a :class:`~aps.transports.Transport`.

    Not safe for two concurrent :meth:`receive` calls (the transport refuses them); sends
    from several tasks are fine.
    """

    def __init__(
        self,
        transport: Transport,
        role: Role,
        *,
        heartbeat_interval: float = 1.0,
    ) -> None:
        self._transport = transport
        self._connection = Connection(role)
        # The transport enforces its own limit before allocating; decoding applies the same
        # one so a plug-in without a limit is still bounded.
        self._max_frame_size: int = getattr(transport, "max_frame_size", DEFAULT_MAX_FRAME_SIZE)
        self._authenticated = False
        self._limit_transport(min(self._max_frame_size, codec.HANDSHAKE_FRAME_SIZE))
        self._compression = "none"
        self._compressor: compression.Compressor | None = None
        self._frame_delta = False
        self._encoding = compression.accepted("none", False)
        self._inflation = codec.InflationRate()  # what the peer's arrays may inflate to, per s
        self._decoding: asyncio.Future[Message] | None = None  # a large frame, in a thread
        self._off_loop = OFF_LOOP_BYTES  # frames this large decode in a thread
        self._heartbeat_interval = heartbeat_interval
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._last_send = time.monotonic()
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop receive() runs in
        self._waiting: _Wait | None = None  # the receive() call now waiting, with a deadline
        self._wait: _Wait | None = None  # the one _Wait object each receive() call fills in
        self._watchdog: asyncio.TimerHandle | None = None  # fires by that call's deadline
        self.goodbye: str | None = None
        self.tally: WorkerMetrics | None = None
        """Where this connection counts its traffic, decoding time and round trip (the
        learner's record of the worker); ``None``: not counted, and heartbeats carry no ping.
        See :class:`aps.metrics.WorkerMetrics` for what each figure means."""
        self._saved_seen = 0  # the compressor's savings already counted in bytes_sent_raw
        self._ping: tuple[int, float] | None = None  # the ping awaiting its pong, and when
        """The reason the peer gave when it said goodbye (``None``: it did not)."""

    @property
    def peer(self) -> str:
        """The transport's description of the other end."""
        return self._transport.peer

    @property
    def max_frame_size(self) -> int:
        """The largest frame this session accepts once the peer is authenticated, in bytes."""
        return self._max_frame_size

    @property
    def is_authenticated(self) -> bool:
        """Whether :meth:`authenticated` was called: frames of any allowed size are read."""
        return self._authenticated

    def authenticated(self) -> None:
        """The peer proved the token (or none is needed): read frames up to the full limit."""
        if not self._authenticated:
            self._authenticated = True
            self._limit_transport(self._max_frame_size)

    def _limit_transport(self, size: int) -> None:
        # A plug-in transport without the attribute (or with a read-only one) keeps its own
        # limit; decode_handshake still refuses a large frame before decoding it.
        if hasattr(self._transport, "max_frame_size"):
            with contextlib.suppress(AttributeError, TypeError):
                self._transport.max_frame_size = size

    @property
    def is_local(self) -> bool:
        """Whether the peer is on this host, as the transport says (see ``transports.is_local``)."""
        return is_local(self._transport)

    @property
    def compression(self) -> str:
        """The codec this connection compresses large arrays with (``"none"``: none)."""
        return self._compression

    @property
    def frame_delta(self) -> bool:
        """Whether chunks' frame stacks travel as newest frames (:mod:`aps.wire.frame_delta`)."""
        return self._frame_delta

    @property
    def encoding(self) -> str:
        """How this connection encodes, as the Welcome said it (``"zstd,frame-delta"``).

        Two sessions with the same encoding make the same frame of a message: a frame kept
        for a resend may be sent again as is where the encoding is unchanged.
        """
        return self._encoding  # read per answer a worker keeps: made once, in compress()

    def compress(self, name: str, *, frame_delta: bool = False) -> None:
        """Compress with ``name`` from the next frame on, both ways (the handshake's choice).

        ``frame_delta``: the handshake chose frame delta as well, both ways.

        Raises:
            ConfigError: ``name`` is neither a codec of :data:`aps.wire.compression.CODECS` nor
                ``"none"``.
        """
        chosen = compression.compressor(name)
        # A counter of its own, so that the bytes it saves count for this connection only.
        self._compressor = None if chosen is None else dataclasses.replace(chosen, saved=[0])
        self._saved_seen = 0
        self._compression = name
        self._frame_delta = frame_delta
        self._encoding = compression.accepted(name, frame_delta)
        inflates = name != "none" or frame_delta
        self._off_loop = OFF_LOOP_INFLATING_BYTES if inflates else OFF_LOOP_BYTES

    def encode(self, message: Message) -> bytes:
        """``message`` as this session sends it: compressed as negotiated.

        Raises:
            WireError: the message holds a value the codec cannot carry.
        """
        return codec.encode(message, compressor=self._compressor, frame_delta=self._frame_delta)

    @property
    def state(self) -> State:
        """The protocol state of this connection."""
        return self._connection.state

    @property
    def rollouts_pending(self) -> int:
        """Rollout requests sent or received on this connection and not yet answered."""
        return self._connection.rollouts_pending

    async def send(self, message: Message, *, frame: bytes | None = None) -> None:
        """Encode ``message``, check the protocol allows it, and send it.

        Args:
            message: what to send.
            frame: ``message`` already encoded, when the caller sends the same message to
                many peers (weights) and encodes it once: plain (:func:`aps.wire.codec.encode`),
                which every peer reads, or with this session's compressor (:meth:`encode`).

        Raises:
            WireError: the message holds a value the codec cannot carry (nothing was sent).
            InvalidState: the protocol does not allow this message now.
            TransportClosed: the session is closed (by this side, or after the peer's goodbye).
            TransportError: the transport failed.
        """
        if self._closed:
            # Closed by this side or after the peer's goodbye: a connection that is gone,
            # not a protocol misuse.
            raise TransportClosed(f"cannot send to {self.peer}: the session is closed")
        # _send's body, written out: this runs for every message, one coroutine fewer.
        if frame is None:
            frame = codec.encode(
                message, compressor=self._compressor, frame_delta=self._frame_delta
            )
        self._connection.send(message)
        self._last_send = time.monotonic()
        tally = self.tally
        if tally is not None:
            if self._compressor is None:
                size = len(frame)
                tally.bytes_sent += size
                tally.bytes_sent_raw += size
            else:
                self._count_sent(len(frame))
        await self._transport.send(frame)

    def _count_sent(self, size: int) -> None:
        """Count a frame of ``size`` bytes sent, and what compression saved meanwhile."""
        tally = self.tally
        assert tally is not None
        compressor = self._compressor
        saved = 0
        if compressor is not None and compressor.saved is not None:
            # Savings since the last frame counted: this frame's, or a frame the caller
            # encoded with encode() and passes in.
            saved = compressor.saved[0] - self._saved_seen
            self._saved_seen = compressor.saved[0]
        tally.bytes_sent += size
        tally.bytes_sent_raw += size + saved

    async def _send(self, message: Message, frame: bytes | None = None) -> None:
        """:meth:`send` without the closed check (the goodbye of :meth:`aclose`)."""
        if frame is None:
            frame = codec.encode(
                message, compressor=self._compressor, frame_delta=self._frame_delta
            )
        self._connection.send(message)
        self._last_send = time.monotonic()
        await self._transport.send(frame)

    async def receive(
        self, *, timeout: float | None, operation: str, since: float | None = None
    ) -> Message:
        """Wait for the next message other than a heartbeat.

        Two kinds of deadline:

        - ``since=None``, a silence deadline: ``timeout`` is the longest silence tolerated,
          and any frame, heartbeats included, restarts it. For a side that waits for the
          peer's next move (a worker waiting for requests): heartbeats prove the connection.
        - ``since`` given, an answer deadline: the message is due ``timeout`` seconds after
          ``since`` (loop time, :meth:`asyncio.AbstractEventLoop.time`: when the request
          went out), whatever arrives meanwhile. For a side waiting for the answer to its
          request: heartbeats prove the connection, not progress, so a peer that stalls
          and keeps heartbeating still misses it.

        Args:
            timeout: seconds, as above; ``None`` waits forever.
            operation: what the caller is waiting for, for the error message.
            since: the loop time the answer deadline counts from; ``None``: a silence
                deadline.

        Raises:
            Timeout: nothing arrived for ``timeout`` seconds, or (``since`` given) no
                message other than a heartbeat arrived by ``since + timeout``.
            EndOfStream: the peer said goodbye or closed the connection.
            ProtocolError: the peer sent a malformed or unexpected frame; the session closes.
            TransportError: the transport failed.

        Cancellation: safe; no message is lost.
        """
        while True:
            decoding = self._decoding  # a large frame that a cancelled call left decoding
            if decoding is None:
                # The deadline's bookkeeping is written out here rather than in a coroutine of
                # its own: this runs for every message at both ends.
                # An answer deadline is armed again after a heartbeat, at the same instant.
                wait = None if timeout is None else self._arm(timeout, since)
                try:
                    frame = await self._transport.receive()
                except asyncio.CancelledError:
                    if (
                        wait is not None
                        and wait.expired
                        and wait.task.uncancel() <= wait.cancelling
                    ):
                        if since is not None:
                            raise Timeout(
                                f"no answer from {self.peer} within {timeout} s of the "
                                f"request while waiting for {operation} (heartbeats do not "
                                "count: the peer is connected but not answering); its env is "
                                "stuck or slow (raise the matching Timeouts field if it is "
                                "only slow)",
                                operation=operation,
                                seconds=timeout,
                            ) from None
                        raise Timeout(
                            f"nothing from {self.peer} for {timeout} s while waiting for "
                            f"{operation}; the peer is stuck or the network is down (raise "
                            "the matching Timeouts field if it is only slow)",
                            operation=operation,
                            seconds=timeout,
                        ) from None
                    raise
                finally:
                    self._waiting = None
                if len(frame) >= self._off_loop and self._authenticated:
                    # Decoding a large frame (or inflating a smaller one) would hold the loop
                    # for ms: a thread does it while the loop serves the other connections.
                    loop = asyncio.get_running_loop()
                    decoding = self._decoding = loop.run_in_executor(None, self._decode, frame)
            try:
                if decoding is None:
                    message = self._decode(frame)
                else:
                    # Cancelled here, the decoding goes on and the next call takes its message.
                    message = await asyncio.shield(decoding)
                    self._decoding = None
                    if self._closed:
                        # Closed meanwhile (by another task): as a receive on a closed
                        # transport ends, not with a message of a session that is over.
                        raise TransportClosed(
                            f"the session with {self.peer} was closed while a frame was decoded"
                        )
                self._connection.receive(message)
            except (WireError, ProtocolError) as exc:
                self._decoding = None
                await self._abort(f"protocol error: {exc}")
                if isinstance(exc, ProtocolError):
                    raise
                raise ProtocolError(f"{self.peer} sent a malformed frame: {exc}") from exc
            if isinstance(message, Heartbeat):
                if message.ping is not None:
                    await self._pong(message.ping)
                elif message.pong is not None:
                    self._ponged(message.pong)
                continue
            if isinstance(message, Goodbye):
                self.goodbye = message.reason
                await self.aclose()
                raise EndOfStream(f"{self.peer} closed the session: {message.reason or 'bye'}")
            return message

    def _decode(self, frame: bytes) -> Message:
        """``frame`` as a message: no I/O and no loop, so that it may run in a thread."""
        if not self._authenticated:
            return codec.decode_handshake(frame)
        tally = self.tally
        if tally is None:
            return codec.decode(
                frame,
                max_frame_size=self._max_frame_size,
                compression=self._compression,
                frame_delta=self._frame_delta,
                rate=self._inflation,
            )
        started = time.perf_counter()
        expanded = self._inflation.expanded
        message = codec.decode(
            frame,
            max_frame_size=self._max_frame_size,
            compression=self._compression,
            frame_delta=self._frame_delta,
            rate=self._inflation,
        )
        tally.decode_seconds += time.perf_counter() - started
        size = len(frame)
        tally.bytes_received += size
        tally.bytes_received_raw += size + self._inflation.expanded - expanded
        return message

    async def _pong(self, ping: int) -> None:
        """Answer the peer's ping at once: its round trip is measured by it."""
        with contextlib.suppress(TransportError, InvalidState):
            await self.send(Heartbeat(pong=ping))

    def _ponged(self, pong: int) -> None:
        """The peer answered a ping: the round trip, if it is the one awaited."""
        ping = self._ping
        if ping is not None and ping[0] == pong and self.tally is not None:
            self.tally.rtt = time.perf_counter() - ping[1]
            self._ping = None

    def _arm(self, timeout: float, since: float | None) -> _Wait:
        """Note the deadline of the receive() call that begins: ``timeout`` s from now.

        (Or from ``since``, in loop time, for an answer deadline: see :meth:`receive`.)

        ``asyncio.timeout`` by hand, and without a timer per call: this runs for every
        message at both ends, and arming and cancelling a loop timer costs about 2 us each
        time. Instead each call notes its deadline in a :class:`_Wait`, and one watchdog
        timer per session (see :meth:`_watch`) fires no later than the deadline of the call
        that is waiting; a watchdog that fires early re-arms for that deadline. The rule is
        that of ``asyncio.timeout``: the deadline's cancellation becomes :class:`Timeout`
        only if nothing else cancelled the task meanwhile (see :meth:`receive`).
        """
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        if task is None:
            raise InvalidState("Session.receive() must run in a task")
        deadline = (loop.time() if since is None else since) + timeout
        # One _Wait per session, filled in again by each call: receive() calls never overlap
        # (the transport refuses that), and a call reads only its own fields, before the next.
        wait = self._wait
        if wait is None:
            wait = self._wait = _Wait(task, deadline, task.cancelling())
        else:
            wait.task, wait.deadline, wait.cancelling = task, deadline, task.cancelling()
            wait.expired = False
        self._waiting = wait
        watchdog = self._watchdog
        if watchdog is None or watchdog.when() > wait.deadline:
            if watchdog is not None:
                watchdog.cancel()
            self._watchdog = loop.call_at(wait.deadline, self._watch)
        return wait

    def _watch(self) -> None:
        """The watchdog: expire the waiting call if its deadline passed, else wait for it."""
        self._watchdog = None
        wait = self._waiting
        if wait is None or wait.expired:
            return  # nobody waits: the next call arms a new watchdog
        assert self._loop is not None
        if self._loop.time() < wait.deadline:
            self._watchdog = self._loop.call_at(wait.deadline, self._watch)
            return
        wait.expired = True
        wait.task.cancel()

    def start_heartbeats(self) -> None:
        """Send a heartbeat whenever this side has been quiet for ``heartbeat_interval``."""
        if self._heartbeat_task is None:
            self._heartbeat_task = asyncio.create_task(
                self._heartbeats(), name=f"aps heartbeats to {self.peer}"
            )

    async def _heartbeats(self) -> None:
        interval = self._heartbeat_interval
        with contextlib.suppress(TransportError, InvalidState):
            while not self._closed:
                quiet = time.monotonic() - self._last_send
                if quiet >= interval:
                    if self.tally is None or self._waiting is None:
                        # A pong is timed when it is read: where nobody reads (a lockstep
                        # learner between calls) it would be timed late, so no ping.
                        await self.send(Heartbeat())
                    else:
                        # A ping that is never answered is replaced by the next one.
                        count = self._ping[0] + 1 if self._ping is not None else 1
                        self._ping = (count, time.perf_counter())
                        await self.send(Heartbeat(ping=count))
                    quiet = 0.0
                await asyncio.sleep(interval - quiet)

    async def _abort(self, reason: str) -> None:
        # Before authentication the role logs the refusal (summed up in a flood).
        report = log.warning if self._authenticated else log.debug
        report("closing the connection to %s: %s", self.peer, reason)
        await self.aclose(reason[:200])

    async def aclose(self, reason: str = "", *, goodbye: bool = True) -> None:
        """Say goodbye (best effort) and close the transport; idempotent, never raises.

        ``goodbye=False`` closes without one: the peer sees a dropped connection, and a
        worker dials again to resume its session instead of ending.
        """
        if self._closed:
            return
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()  # it holds this session alive until it fires
            self._watchdog = None
        self._wait = None  # the last receiving task, held by nothing else here
        if self._decoding is not None:
            # Not cancelled: a receive() may be awaiting it (and sees the session closed once
            # it is done); its outcome is retrieved, so a failed decode is not logged as lost.
            self._decoding.add_done_callback(_retrieve)
            self._decoding = None
        try:
            if self._heartbeat_task is not None:
                self._heartbeat_task.cancel()
                # wait() rather than await: a cancellation of *this* task must not be
                # swallowed.
                await asyncio.wait([self._heartbeat_task])
            if goodbye and self._connection.state not in (State.CLOSED, State.START):
                with contextlib.suppress(TransportError, InvalidState, WireError, TimeoutError):
                    # A peer that stopped reading must not hold this close up.
                    async with asyncio.timeout(1.0):
                        await self._send(Goodbye(reason=reason))  # past the closed check
        finally:
            # Even when cancelled above: the session counts as closed from the first call,
            # so this is the only chance to close the connection (the transport aborts it
            # if cancelled again).
            await self._transport.aclose()


def _retrieve(future: asyncio.Future[Message]) -> None:
    """Read a done future's outcome, so that asyncio does not log it as never retrieved."""
    if not future.cancelled():
        future.exception()
