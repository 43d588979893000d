"""Admission: the learner's gate, everything that happens before a peer has proved the token.

:class:`Gate` accepts connections and runs each handshake in a task of its own: it sends a
challenge, waits (briefly) for the hello, checks the peer's proof of the token, and hands a
peer that proved it to the pool (``join``) together with this learner's own proof, which the
worker checks before it believes anything (see ``docs/security.md``).

A peer whose Hello says ``probe=True`` (``aps check``) is answered instead, once its proof
checked out: a :class:`~aps.wire.messages.ProbeResult` with this learner's proof and what a
``describe`` callback says of the learner, then, when the probe asks for them (it has
checked that proof and reads large frames), its spaces, then the end. A probe goes
through the same limits and deadlines as any handshake until it is answered; then it is the
first to make room for a newcomer and has a short deadline to ask for the spaces. It never
reaches ``join`` and is never counted as a refusal; a probe with a wrong proof is refused
like any worker, and learns nothing else.

A probe that has the spaces may stay and watch (``aps top``): it asks for the learner's
figures (:class:`~aps.wire.messages.MetricsRequest`) and each request is answered with a
:class:`~aps.wire.messages.ProbeMetrics` of what a ``figures`` callback gives
(:meth:`aps.metrics.Metrics.as_dict`) and ``workers_connected``. Its first request must
come within the probe's short deadline, on its pre-auth ticket; then the ticket is released
(the watcher proved the token) and the watcher holds one of :data:`MAX_WATCHERS` places
instead: a watcher beyond them is told so in the goodbye that closes it. A watcher is paced,
not refused: each answer goes out at least ``1 / WATCH_RATE`` s after the one before, and a
watcher silent for :data:`WATCH_TIMEOUT` seconds is closed. The learner's close ends them all.

Nothing an unauthenticated peer does may cost the learner much or keep honest workers out.
Every connection spends one :class:`~aps.transports.budget.PreauthBudget` from its first
byte: the listener's, which counts TLS and WebSocket opening handshakes too, and which the
gate adopts (its deadline becomes ``Timeouts.handshake``, from accept); for a listener
without one, the gate's own. At most :data:`MAX_HANDSHAKES` connections are pending and
:data:`MAX_HANDSHAKES_PER_HOST` idle ones per address, an idle one is aborted at once to make
room for a newer connection, a learner that is busy says when to dial again, and refusals
are logged in bursts, not one line each (a flood of bad connections must not become a flood
of log lines).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

from aps.errors import (
    ApsError,
    AuthError,
    EndOfStream,
    InvalidState,
    ProtocolError,
    Timeout,
    TransportClosed,
    TransportError,
    VersionMismatch,
)
from aps.session import Session, Timeouts
from aps.session.protocol import NONCE_SIZE, Role, check_hello, learner_proof
from aps.transports.base import Listener, Transport
from aps.transports.budget import (
    DEFAULT_LIMIT,
    DEFAULT_PER_HOST,
    PreauthBudget,
    Ticket,
    budget_of,
    ticket_of,
)
from aps.transports.stream import raise_fd_limit
from aps.wire.messages import (
    PROTOCOL_VERSION,
    Challenge,
    Hello,
    MetricsRequest,
    ProbeMetrics,
    ProbeResult,
    ProbeSpaces,
    Reject,
    SpacesRequest,
)

log = logging.getLogger(__name__)

__all__ = [
    "MAX_HANDSHAKES",
    "MAX_HANDSHAKES_PER_HOST",
    "MAX_WATCHERS",
    "WATCH_RATE",
    "WATCH_TIMEOUT",
    "Describe",
    "Gate",
    "Join",
    "reject",
]

MAX_HANDSHAKES = DEFAULT_LIMIT
"""The most handshakes a learner runs at once.

A new connection beyond it takes the place of the oldest one that has not said hello yet
from the address holding the most of those (an honest worker says hello one round trip
after it connects, and a flood from a few addresses evicts its own first, so idle
connections cannot keep one out); when every handshake in progress is past its hello, the new
connection is told ``Reject(retry_after=...)`` and the worker dials again later."""

MAX_HANDSHAKES_PER_HOST = DEFAULT_PER_HOST
"""The most handshakes from one address that have not said hello; a new one from that
address takes the place of its oldest."""

MAX_WATCHERS = 8
"""The most live views (``aps top``) a learner serves at once; the next one is closed with a
goodbye that says so."""

WATCH_RATE = 10.0
"""The most requests a second a learner answers for one live view. A view that asks faster
is paced, never refused: its answer waits until ``1 / WATCH_RATE`` s after the one before."""

WATCH_TIMEOUT = 30.0
"""Seconds a live view may stay silent between two requests before the learner closes it."""

BUSY_RETRY_AFTER = 1.0
"""Seconds a worker turned away while the learner is busy waits before dialing again."""

REFUSAL_LOG_INTERVAL = 10.0
"""Seconds of the window in which at most :data:`REFUSAL_LOG_BURST` refusals are logged one
by one; the rest are summed up in one line."""

REFUSAL_LOG_BURST = 5


class _RefusalLog:
    """Logs refusals as warnings up to a burst per window, then one summary line.

    A flood of bad connections must not become a flood of warnings; the refusals past the
    burst are logged at debug level.
    """

    def __init__(self) -> None:
        self._window = -REFUSAL_LOG_INTERVAL  # start of the current window (monotonic)
        self._logged = 0
        self._unlogged = 0
        self._latest = ""
        self.total = 0
        """Refusals and evictions since the learner started."""

    def note(self, text: str) -> None:
        self.total += 1
        now = time.monotonic()
        if now - self._window >= REFUSAL_LOG_INTERVAL:
            self.flush()
            self._window, self._logged = now, 0
        if self._logged < REFUSAL_LOG_BURST:
            self._logged += 1
            log.warning("refused a worker at %s", text)
        else:
            # Still one record per refusal, for whoever listens at debug level.
            log.debug("refused a worker at %s", text)
            self._unlogged += 1
            self._latest = text

    def flush(self) -> None:
        """Log the summary of the refusals not logged one by one, if any."""
        if self._unlogged:
            log.warning(
                "refused %d more connections within %.0f s without logging each (the last: %s)",
                *(self._unlogged, REFUSAL_LOG_INTERVAL, self._latest),
            )
            self._unlogged = 0


def _cancel(holder: list[asyncio.Task[None]]) -> None:
    """Abort a handshake the gate counts itself: cancel its task, which closes it.

    A task that never ran is closed by its done-callback (``Gate._ended``).
    """
    if holder:
        holder[0].cancel()


def _host_of(peer: str) -> str:
    """The address part of a transport's peer description (``tcp://1.2.3.4:5`` -> ``1.2.3.4``)."""
    try:
        return urlsplit(peer).hostname or peer
    except ValueError:
        return peer


async def reject(session: Session, error: ApsError, proof: bytes = b"") -> None:
    """Send the peer a Reject for ``error``, then raise ``error``.

    ``proof`` is the learner's, once the worker's proof was checked.
    """
    with contextlib.suppress(TransportError, InvalidState):
        await session.send(Reject(kind=type(error).__name__, reason=str(error), proof=proof))
    raise error


Join = Callable[[Session, Hello, bytes], Awaitable[None]]
"""What takes a peer that proved the token: ``join(session, hello, learner_proof)``."""

Describe = Callable[[], tuple[ProbeResult, ProbeSpaces]]
"""What a probe that proved the token is told; the Gate puts its own proof in the result."""

Figures = Callable[[], dict[str, Any]]
"""The learner's figures now, as :meth:`aps.metrics.Metrics.as_dict` gives them (``aps top``)."""


class Gate:
    """Accepts connections on ``listener`` and admits those that prove the token.

    Args:
        listener: where connections arrive.
        token: the shared secret (``None``: no proof asked, on loopback).
        timeouts: ``handshake`` bounds the wait for a hello; ``heartbeat_interval`` is the
            sessions'.
        join: takes each peer that proved the token; an :class:`ApsError` it raises refuses
            the peer (logged, remembered, and the peer told why).
        describe: what a probe (``aps check``) that proved the token is told.
        figures: the learner's figures (:meth:`aps.metrics.Metrics.as_dict`), which a
            watching probe (``aps top``) is sent at each of its requests with
            ``workers_connected`` (from ``describe``) added.
    """

    def __init__(
        self,
        listener: Listener,
        *,
        token: bytes | None,
        timeouts: Timeouts,
        join: Join,
        describe: Describe,
        figures: Figures,
    ) -> None:
        self._listener = listener
        self._token = token
        self.timeouts = timeouts
        self._join = join
        self._describe = describe
        self._figures = figures
        self._accept_task: asyncio.Task[None] | None = None
        self._admissions: set[asyncio.Task[None]] = set()
        # The admission tasks that are serving a live view now (a subset of _admissions).
        self._watching: set[asyncio.Task[None]] = set()
        self._refusal_log = _RefusalLog()
        # One budget from the first byte: the listener's own when it has one (its TLS and
        # WebSocket handshakes count), else the gate's, for its handshakes alone.
        budget = budget_of(listener)
        self._shared = budget is not None
        self._budget = budget or PreauthBudget(
            limit=MAX_HANDSHAKES, per_host=MAX_HANDSHAKES_PER_HOST, deadline=timeouts.handshake
        )
        self.refusals: list[str] = []
        """The latest refusals (``"PEER: TYPE: reason"``), newest last, a few at most."""

    def start(self) -> None:
        """Start accepting connections.

        The gate adopts the listener's pre-auth budget (its deadline becomes
        ``timeouts.handshake``, from accept) and raises the process's soft limit on open
        files towards the hard one, once, saying so in one log line.
        """
        if self._accept_task is None:
            self._budget.adopt(deadline=self.timeouts.handshake, report=self._refusal_log.note)
            raise_fd_limit()
            self._accept_task = asyncio.create_task(self._accept_loop(), name="aps accept loop")

    @property
    def refused(self) -> int:
        """Connections refused or turned away since the gate opened."""
        return self._refusal_log.total

    @property
    def watchers(self) -> int:
        """Live views (``aps top``) served now."""
        return len(self._watching)

    async def settle(self, seconds: float) -> None:
        """Wait up to ``seconds`` for the handshakes in progress to end (admitted or refused).

        Live views are past their handshake: they are not waited for.
        """
        pending = self._admissions - self._watching
        if pending:
            await asyncio.wait(pending, timeout=seconds)

    async def aclose(self) -> None:
        """Stop accepting and cancel every handshake in progress (the listener stays open)."""
        self._refusal_log.flush()
        if self._accept_task is not None:
            self._accept_task.cancel()
        for task in list(self._admissions):
            task.cancel()
        tasks = [t for t in (self._accept_task, *self._admissions) if t is not None]
        if tasks:
            await asyncio.wait(tasks)
        # The cancelled ones started tasks that close their sessions (see _ended): those too.
        while self._admissions:
            await asyncio.wait(list(self._admissions))

    async def _accept_loop(self) -> None:
        while True:
            try:
                transport = await self._listener.accept()
            except TransportClosed:
                return
            except TransportError as exc:
                log.warning("accept failed: %s", exc)
                await asyncio.sleep(0.05)
                continue
            try:
                self._admit_later(transport)
            except Exception:
                # Nothing about one connection may stop the learner from accepting the next.
                log.exception("admitting a connection from %s failed", transport.peer)
                detached = asyncio.create_task(transport.aclose(), name="aps close")
                self._admissions.add(detached)
                detached.add_done_callback(self._admissions.discard)

    def _admit_later(self, transport: Transport) -> None:
        """Start admitting ``transport`` in a task of its own (or turn it away)."""
        session = Session(
            transport,
            Role.LEARNER,
            heartbeat_interval=self.timeouts.heartbeat_interval,
        )
        ticket = ticket_of(transport)
        if ticket is None and self._shared:
            # Its ticket already ended (evicted or timed out while it waited to be
            # accepted, and reported then): nothing is left to say to it.
            task = asyncio.create_task(session.aclose(), name="aps drop")
        else:
            if ticket is None:
                # A listener without a budget of its own: the gate counts its handshakes.
                holder: list[asyncio.Task[None]] = []
                ticket = self._budget.enter(
                    session.peer, _host_of(session.peer), abort=lambda: _cancel(holder)
                )
                if ticket is None:
                    self._refusal_log.note(
                        f"{session.peer}: Busy: the learner is overloaded; dropped"
                    )
                    task = asyncio.create_task(session.aclose(), name="aps drop")
                    self._track(task)
                    return
                if not ticket.busy:
                    task = asyncio.create_task(
                        self._admit(session, ticket), name=f"aps admit {session.peer}"
                    )
                    holder.append(task)
                    self._track(task, session)
                    return
            if ticket.busy:
                task = asyncio.create_task(self._turn_away(session, ticket), name="aps turn away")
            else:
                task = asyncio.create_task(
                    self._admit(session, ticket), name=f"aps admit {session.peer}"
                )
        self._track(task, session)

    def _track(self, task: asyncio.Task[None], session: Session | None = None) -> None:
        self._admissions.add(task)
        task.add_done_callback(functools.partial(self._ended, session))

    def _ended(self, session: Session | None, task: asyncio.Task[None]) -> None:
        self._admissions.discard(task)
        if session is not None and task.cancelled():
            # A task cancelled before its first step (its ticket evicted in the burst of
            # connections that brought it, or the gate closing) never ran the finally that
            # closes its session: close it here, not when the collector finds it. (One that
            # ran closed it already; closing again is a no-op.)
            self._track(asyncio.get_running_loop().create_task(session.aclose(goodbye=False)))

    async def _turn_away(self, session: Session, ticket: Ticket) -> None:
        """Tell a connection the learner is busy, and when to dial again."""
        limit = self._budget.limit
        self._refusal_log.note(
            f"{session.peer}: Busy: {limit} handshakes in progress; told to dial again"
        )
        reason = f"the learner is busy with {limit} handshakes; dial again"
        try:
            with contextlib.suppress(ApsError):
                async with asyncio.timeout(1.0):
                    await session.send(
                        Reject(kind="Busy", reason=reason, retry_after=BUSY_RETRY_AFTER)
                    )
        finally:
            ticket.release()
            await session.aclose()

    async def _admit(self, session: Session, ticket: Ticket) -> None:
        admitted = False
        reason = ""
        try:
            admitted = await self._authenticate(session, ticket)
            reason = "" if admitted else "the check is over"
        except ApsError as exc:
            reason = self._refuse(session, exc, ticket)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # A bug must not leave a silent task behind: refuse the worker and say why.
            log.exception("admitting %s failed unexpectedly", session.peer)
            reason = self._refuse(session, exc, ticket)
        finally:
            ticket.release()
            if not admitted:
                # The goodbye tells the peer why (unless a Reject or a goodbye already did).
                await session.aclose(reason)

    def _refuse(self, session: Session, exc: BaseException, ticket: Ticket) -> str:
        """Log and remember why ``session`` was refused; return the reason for its goodbye.

        A connection the budget ended (evicted, past its deadline) was reported by it.
        """
        reason = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, EndOfStream) and session.goodbye:
            # The worker's own words, from its goodbye, not the transport's "closed".
            reason = f"{type(exc).__name__}: the worker left: {session.goodbye}"
        text = f"{session.peer}: {reason}"
        self.refusals.append(text)
        del self.refusals[:-20]  # keep the last few for error messages, never grow
        if ticket.ended is None:
            self._refusal_log.note(text)
        return reason[:200]

    async def _authenticate(self, session: Session, ticket: Ticket) -> bool:
        """Challenge the peer; once it proved the token, hand it to ``join`` with our proof.

        The hello must arrive before the ticket's deadline, counted from accept (TLS and
        WebSocket handshakes included). Returns whether the peer was handed to ``join``:
        ``False`` for a probe, answered.
        """
        timeouts = self.timeouts
        nonce = os.urandom(NONCE_SIZE)
        # This deadline falls a little before the budget's, so that a silent peer is told why
        # in a goodbye; the budget's abort stays the backstop for a gate that cannot run.
        margin = min(0.2 * ticket.deadline, 0.5)
        try:
            async with asyncio.timeout(max(ticket.remaining() - margin, 0.001)):
                await session.send(Challenge(protocol_version=PROTOCOL_VERSION, nonce=nonce))
                hello = await session.receive(timeout=None, operation="the worker's hello")
                ticket.greeted()
        except TimeoutError as exc:
            if isinstance(exc, Timeout):
                raise
            raise Timeout(
                f"no hello from {session.peer} within {timeouts.handshake} s of its "
                "connection; dropped it",
                operation="handshake",
                seconds=timeouts.handshake,
            ) from None
        assert isinstance(hello, Hello)  # the protocol table allows nothing else
        try:
            check_hello(hello, nonce=nonce, token=self._token)
        except (VersionMismatch, AuthError) as exc:
            await reject(session, exc)
        # The worker proved the token: from here on its frames may be large (its spaces), and
        # every answer carries this learner's proof, which the worker checks before acting.
        session.authenticated()
        proof = b"" if self._token is None else learner_proof(self._token, nonce, hello.nonce)
        if hello.probe:
            await self._answer_probe(session, proof, ticket)
            return False
        # Past the pre-auth stage: the pool's own deadlines hold from here.
        ticket.release()
        await self._join(session, hello, proof)
        return True

    async def _answer_probe(self, session: Session, proof: bytes, ticket: Ticket) -> None:
        """Tell a probe that proved the token about this learner; the caller closes it.

        Once answered, the probe keeps its ticket at the lowest stage: it has
        :data:`~aps.transports.budget.PROBE_DEADLINE` seconds to ask for the spaces, and a
        newcomer evicts it before any other connection, so idle probes holding the token
        never keep a worker out. A probe that leaves early (or breaks the protocol) is
        logged at debug level: it is not a refused worker. The spaces are sent only when
        asked for: until then the probe's frame limit is a handshake's.
        """
        result, spaces = self._describe()
        try:
            async with asyncio.timeout(ticket.remaining()):
                await session.send(dataclasses.replace(result, proof=proof))
            ticket.answered()
            async with asyncio.timeout(ticket.remaining()):
                request = await session.receive(timeout=None, operation="the check's request")
                assert isinstance(request, SpacesRequest)  # the protocol table allows no other
                await session.send(spaces)
        except (TransportError, ProtocolError, TimeoutError) as exc:
            log.debug("a check from %s left before its answer: %r", session.peer, exc)
            return
        log.info("answered a check from %s", session.peer)
        await self._watch(session, ticket)

    async def _watch(self, session: Session, ticket: Ticket) -> None:
        """Serve a probe that asks for the figures (``aps top``) until it leaves.

        A check leaves here (its goodbye ends the wait). A view's first request comes within
        the probe's deadline, on its ticket; then it holds a watcher's place instead of the
        ticket, or is closed with a goodbye naming :data:`MAX_WATCHERS` when none is free.
        Each answer waits until ``1 / WATCH_RATE`` s after the one before (a sleep, so a
        view that asks faster is slowed, not refused), and each request must come within
        :data:`WATCH_TIMEOUT` s of the answer before it; the caller closes the session.
        """
        try:
            ticket.answered()  # the short deadline again, from the spaces sent
            async with asyncio.timeout(ticket.remaining()):
                request = await session.receive(timeout=None, operation="a view's request")
        except (TransportError, ProtocolError, TimeoutError):
            return  # a check that got its spaces and left, as it should
        assert isinstance(request, MetricsRequest)  # the protocol table allows no other
        ticket.release()  # it proved the token: from here the watchers' limit bounds it
        if len(self._watching) >= MAX_WATCHERS:
            log.info(
                "closed a live view from %s: %d are served already", session.peer, MAX_WATCHERS
            )
            await session.aclose(
                f"the learner serves at most {MAX_WATCHERS} live views (aps top) at once and "
                f"serves {MAX_WATCHERS} now; close one of them, or try again later"
            )
            return
        task = asyncio.current_task()
        assert task is not None
        self._watching.add(task)
        loop = asyncio.get_running_loop()
        answered = -math.inf
        try:
            while True:
                pause = answered + 1.0 / WATCH_RATE - loop.time()
                if pause > 0:
                    await asyncio.sleep(pause)
                connected = self._describe()[0].workers
                figures = {**self._figures(), "workers_connected": connected}
                # A view that stops reading must not hold this task: the send has a deadline.
                async with asyncio.timeout(WATCH_TIMEOUT):
                    await session.send(ProbeMetrics(metrics=figures))
                answered = loop.time()
                request = await session.receive(
                    timeout=WATCH_TIMEOUT, operation="the live view's next request"
                )
                assert isinstance(request, MetricsRequest)  # the protocol table allows no other
        except Timeout:
            log.info("closed a live view from %s: silent for %s s", session.peer, WATCH_TIMEOUT)
            await session.aclose(
                f"no request from this live view for {WATCH_TIMEOUT} s; closed it (a view "
                f"asks at least every {WATCH_TIMEOUT} s)"
            )
        except (TransportError, ProtocolError, TimeoutError) as exc:
            log.debug("a live view from %s ended: %r", session.peer, exc)
        except asyncio.CancelledError:
            await session.aclose("the learner is closing")
            raise
        finally:
            self._watching.discard(task)
