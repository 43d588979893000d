"""The worker pool: the workers' lifecycle, the lease on them, and one request each.

:class:`WorkerPool` does three things: it listens and closes (its
:class:`~aps.learner.admission.Gate` runs every handshake until the peer has proved the token,
then hands it to :mod:`~aps.learner.joining`, which takes it in), it owns what the workers are
used for now (:meth:`WorkerPool.lease`), and it sends one request per worker while it holds
them all (:meth:`WorkerPool.exchange`). The modes reach its parts through the members that
hold them, never through properties that forward:

- ``pool.slots`` (:mod:`~aps.learner.slots`): the slot table, each admitted worker's env slots
  (a :class:`~aps.learner.slots.Slot`) in env order;
- ``pool.recovery`` (:mod:`~aps.learner.recovery`): recovery and spares, ``on_worker_lost``
  applied, a spare taking a lost worker's slots over, and what a replacement means to the envs;
- ``pool.requests`` (:mod:`~aps.learner.requests`): the numbered request/answer service:
  requests carry sequence numbers, a resumed worker gets again what it did not answer, and
  answers arrive exactly once (the books are kept by each slot's
  :class:`~aps.session.delivery.Outbox`, which does no I/O). A malformed answer is its worker's
  failure, handled as its loss;
- ``pool.config`` (:mod:`~aps.learner.config`): the learner's settings, frozen.

When a connection takes over a slot, the pool asks each mode's :class:`SlotHooks` what that
worker needs first (its weights, the current gradient round); the pool itself knows nothing of
any mode. What the workers are used for now is the pool's :class:`~aps.learner.lease.Mode`,
which only a :class:`~aps.learner.lease.Lease` writes (``async with pool.lease(Mode.X,
operation):``): taking it ends a mode a caller left open, refuses what cannot run now and
enters the mode; releasing it turns a worker's failure into ``Mode.BROKEN`` (workers out of
step for good) and always leaves.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from aps import transports
from aps.errors import ApsError, ConfigError, InvalidState
from aps.learner.admission import Gate
from aps.learner.config import LearnerConfig
from aps.learner.joining import Joining
from aps.learner.lease import _LEASES, Lease, Mode, _State
from aps.learner.recovery import OnWorkerLost, Recovery
from aps.learner.requests import FRESH_RESET, Redo, Requests
from aps.learner.slots import AnswerCheck, Slot, SlotHooks, Slots, WorkerInfo, expect, log
from aps.transports.base import Listener
from aps.wire.messages import Message, Request

__all__ = [
    "FRESH_RESET",
    "AnswerCheck",
    "LearnerMode",
    "Lease",
    "Mode",
    "OnWorkerLost",
    "Redo",
    "Slot",
    "SlotHooks",
    "WorkerInfo",
    "WorkerPool",
    "expect",
]


class LearnerMode(SlotHooks, Protocol):
    """A mode over the pool, as the pool and the learner see it.

    Registered in :attr:`WorkerPool.modes`, which the pool tells when the worker serving a
    slot changes (:class:`SlotHooks`) and the learner ends, in order, when it closes.
    """

    async def aclose(self) -> None:
        """End what the mode holds (a chunk stream, gradient rounds, steps sent); idempotent."""


class WorkerPool:
    """The learner's workers: their lifecycle, the lease on them and one request each.

    Args:
        config: the learner's settings, checked where they were built
            (:meth:`~aps.learner.config.LearnerConfig.build`); the pool and its rooms read them
            and nobody writes them.
        figures: the learner's figures as plain data, for ``aps top``; a callable rather than
            a setting because it reads the learner's live state, which exists only once the
            learner does.
    """

    def __init__(self, config: LearnerConfig, *, figures: Callable[[], dict[str, Any]]) -> None:
        self.config = config
        self.figures = figures
        """The learner's figures as plain data, for ``aps top``."""
        self.modes: list[LearnerMode] = []
        """The modes, registered by the learner: told when the worker serving a slot changes,
        ended in this order when the learner closes."""
        self.slots = Slots(config.num_workers)
        """The slot table."""
        self.recovery = Recovery(
            self.slots,
            self.modes,
            on_worker_lost=config.on_worker_lost,
            reconnect_timeout=config.reconnect_timeout,
        )
        """Losses, resumes, spares and replacements."""
        self.requests = Requests(self.slots, self.recovery, self.modes, config.timeouts)
        """Numbered requests and their answers."""
        self.joining = Joining(config, self.slots, self.recovery)
        """Admission after authentication: the workers the gate lets through, taken in."""

        self._launched = False
        self._listener: Listener | None = None
        self._gate: Gate | None = None
        self._state = _LEASES[Mode.IDLE]
        self._enders: dict[Mode, Callable[[], Awaitable[None]]] = {}
        self.closed = False

    # Lifecycle.

    async def start(self) -> None:
        """Bind the address and start admitting workers; see :meth:`Learner.start`."""
        if self.closed:
            raise InvalidState("this learner is closed; create a new one")
        if self._listener is not None:
            return
        config = self.config
        if isinstance(config.listen, str):
            scheme = transports.scheme_of(config.listen)
            listener = await (config.factory or transports.get_factory(scheme)).listen(
                config.listen
            )
        else:
            listener = config.listen
        if config.token is None and not config.insecure and not transports.is_local(listener):
            if isinstance(config.listen, str):
                await listener.aclose()  # bound by this call: nobody else will close it
            raise ConfigError(
                f"refusing to listen on {listener.url!r} without a token: anyone who can reach "
                "it could attach a worker; pass token=... (workers use --token-file), or "
                "insecure=True on a network you trust"
            )
        self._listener = listener
        self._gate = Gate(
            self._listener,
            token=config.token,
            timeouts=config.timeouts,
            join=self.joining.join,
            describe=self.joining.describe,
            figures=lambda: self.figures(),
        )
        self._gate.start()
        log.info("learner listening on %s for %d workers", self.url, config.num_workers)
        if config.launcher is not None and not self._launched:
            self._launched = True
            try:
                spec = config.launcher.spec.for_learner(
                    self.url, token=config.token, policy=config.policy
                )
                await config.launcher.start(self.url, spec)
            except BaseException:
                await self.aclose()
                raise

    async def wait_for_workers(self, timeout: float | None = None) -> None:
        """Start, then wait until all workers are admitted; see :meth:`Learner.wait_for_workers`."""
        await self.start()
        await self.joining.wait(timeout, self.url, lambda: self.refusals)

    @property
    def url(self) -> str:
        """The bound address, with port 0 resolved."""
        if self._listener is None:
            raise InvalidState("the learner is not started; use 'async with' or await start()")
        return self._listener.url

    @property
    def is_local(self) -> bool:
        """Whether the listener says its workers are on this host (see ``transports.is_local``)."""
        return self._listener is not None and transports.is_local(self._listener)

    @property
    def refused(self) -> int:
        """Connections refused or turned away since the learner started.

        A count for monitoring and tests; the log sums floods up instead of listing them.
        """
        return 0 if self._gate is None else self._gate.refused

    @property
    def refusals(self) -> list[str]:
        """The latest refusals (``"PEER: TYPE: reason"``), newest last, a few at most."""
        return [] if self._gate is None else self._gate.refusals

    async def settle_admissions(self) -> None:
        """Wait (up to the handshake deadline) for the handshakes in progress to end."""
        if self._gate is not None:
            await self._gate.settle(self.config.timeouts.handshake)

    def begin_close(self) -> None:
        """Stop waiting for lost workers: a close must not wait ``reconnect_timeout``."""
        self.recovery.closing.set()

    async def aclose(self) -> None:
        """Stop admitting, say goodbye to every worker, stop the launcher; idempotent."""
        if self.closed:
            return
        self.closed = True
        self.begin_close()
        if self._gate is not None:
            await self._gate.aclose()
        if self._listener is not None:
            await self._listener.aclose()
        sessions = [r.session for r in self.slots.admitted] + [
            s.session for s in self.recovery.spares
        ]
        await asyncio.gather(
            *(session.aclose("the learner is closing") for session in sessions),
            return_exceptions=True,
        )
        if self.config.launcher is not None:
            await self.config.launcher.stop()

    # The pool's mode: written here only, through a lease.

    @property
    def mode(self) -> Mode:
        """What the workers are used for now."""
        return self._state.mode

    @property
    def broken(self) -> ApsError | None:
        """Why the workers can no longer be used together, once that happened (for good)."""
        return self._state.error

    def lease(
        self,
        mode: Mode,
        operation: str,
        *,
        running: str = "another operation is running",
        every_worker: bool = True,
        verb: str | None = None,
        drained: bool = False,
        end: Callable[[], Awaitable[None]] | None = None,
    ) -> Lease:
        """The workers for ``mode``, as a scope: ``async with pool.lease(Mode.X, "op"):``.

        See :class:`Lease`; a mode that holds the workers across calls keeps the lease and
        calls its :meth:`~Lease.take` and :meth:`~Lease.release`. ``running``: what keeps the
        pool busy, for the error. ``every_worker``: the operation needs every worker's envs
        (chunk streams and gradient rounds go on without dropped workers). ``verb``: what the
        learner can no longer do once broken, for the error (default: ``operation``).
        ``drained``: the mode receives what is in flight when it ends (a chunk stream), so an
        interruption leaves the workers in step; only a worker's failure breaks them. ``end``:
        how the mode ends when its caller left it open and another operation begins (a chunk
        stream the caller stopped iterating); without one, the next operation refuses.
        """
        return Lease(self, mode, operation, running, every_worker, verb, drained, end)

    def break_for_good(self, exc: ApsError) -> None:
        """Enter :attr:`Mode.BROKEN`: every later operation refuses, with ``exc``.

        For a failure noticed outside any lease (a lease judges its own: see
        :meth:`Lease.release`). A later break says why in its place. The lease a break
        interrupted ends when its holder releases it.
        """
        state = self._state
        if state.mode is Mode.BROKEN:
            self._state = dataclasses.replace(state, error=exc)
        else:
            held = None if state.mode is Mode.IDLE else state.mode
            self._state = _State(Mode.BROKEN, exc, held)

    def _abandoned(self) -> Callable[[], Awaitable[None]] | None:
        """How the mode holding the workers ends, if its lease said how (``end``).

        A mode a break interrupted is ended too: its holder still has it open.
        """
        state = self._state
        held = state.interrupted if state.mode is Mode.BROKEN else state.mode
        return None if held is None else self._enders.get(held)

    def _refuse(self, operation: str, running: str, every_worker: bool, verb: str | None) -> None:
        """Refuse an operation over every worker's envs that the learner cannot make now.

        Raises:
            InvalidState: the workers are out of step for good, some were dropped, or another
                operation is running.
        """
        broken = self._state.error
        if broken is not None:
            raise InvalidState(
                f"this learner can no longer {verb or operation}: {broken}; start a new one"
            )
        if every_worker and self.slots.dropped:
            raise InvalidState(
                f"{operation}() needs every worker's envs, and workers "
                f"{sorted(self.slots.dropped)} were dropped (on_worker_lost='drop'); use "
                "chunks(), or on_worker_lost='wait'"
            )
        if self._state.mode is not Mode.IDLE:
            raise InvalidState(f"{operation}() called while {running}")

    def _leave(self, mode: Mode) -> None:
        """End the lease of ``mode`` (nothing if another mode holds the workers).

        Broken workers stay broken; the lease the break interrupted is over.
        """
        state = self._state
        if state.mode is mode:
            self._state = _LEASES[Mode.IDLE]
        elif state.mode is Mode.BROKEN and state.interrupted is mode:
            self._state = dataclasses.replace(state, interrupted=None)

    # One request per worker, all at once.

    async def exchange(
        self,
        requests: Sequence[Request],
        operation: str,
        *,
        redo: Redo,
        before: Callable[[Slot], Awaitable[None]] | None = None,
        after: Callable[[Slot], Awaitable[None]] | None = None,
        validate: AnswerCheck | None = None,
        running: str = "another operation is running",
        within: float | None = None,
        lease: Lease | None = None,
    ) -> list[Message]:
        """Send one request per worker, then collect one answer from each, in worker order.

        ``before`` runs for each worker before any request is sent, ``after`` right after
        its request was sent (weights that follow it); ``redo`` gives the answer when a
        replacement took a worker over before answering (its envs start afresh); ``validate``
        tests each answer, and ``within`` makes each answer due that many seconds after its
        request, heartbeats or not (``None``: a silence deadline; see
        :meth:`Requests.answer_from`). It runs under a lease of :attr:`Mode.EXCHANGE` (with
        ``running``; see :meth:`lease`), or under ``lease``, one of that mode the caller took
        already (to check its arguments while holding the workers), released here.

        Raises:
            InvalidState: the lease refused (see :meth:`Lease.take`).
            WorkerError: an env raised on a worker (the others' answers are still received).
            WorkerLost | Timeout | ProtocolError: a worker failed; the pool is broken.
        """
        if lease is None:
            lease = self.lease(Mode.EXCHANGE, operation, running=running)
        async with lease:
            return await self.requests.exchange(
                requests, operation, redo, before, after, validate, within
            )
