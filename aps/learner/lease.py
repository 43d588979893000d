"""The lease: the workers held for one mode, and the modes the pool can be in.

What the pool's workers are used for now is its :class:`Mode`, which only a :class:`Lease`
writes (``async with pool.lease(Mode.X, operation):``). Taking a lease ends a mode a caller
left open, refuses what cannot run now and enters the mode; releasing it turns a worker's
failure into :attr:`Mode.BROKEN` (workers out of step for good) and always leaves. The pool
keeps the state (:meth:`~aps.learner.pool.WorkerPool.lease`); this module writes the sequence
once, so that no mode writes it by hand.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Self

from aps.errors import ApsError, InvalidState, ProtocolError, Timeout, WorkerError, WorkerLost

if TYPE_CHECKING:  # the pool imports this module; the pool is only a type here
    from aps.learner.pool import WorkerPool

__all__ = ["Lease", "Mode"]


class Mode(enum.Enum):
    """What the pool's workers are used for now; only a :class:`Lease` writes it."""

    IDLE = "idle"
    EXCHANGE = "exchange"
    """One request per worker and their answers: a reset, step, rollout or env call."""
    PARTIAL = "partial batch"
    """Steps sent to some workers and not all received (``send``/``recv``)."""
    STREAM = "stream"
    """A chunk stream."""
    ROUNDS = "gradient rounds"
    """Gradient mode, until it is stopped."""
    BROKEN = "broken"
    """The workers are out of step for good; every later operation refuses (see
    :attr:`~aps.learner.pool.WorkerPool.broken`)."""


@dataclass(frozen=True, slots=True)
class _State:
    """The pool's mode, and what the broken mode carries."""

    mode: Mode
    error: ApsError | None = None
    """Why the workers are out of step (``Mode.BROKEN`` only)."""
    interrupted: Mode | None = None
    """The lease a break ended before its holder left it (``Mode.BROKEN`` only): a chunk
    stream left open is still ended when the next operation begins."""


_LEASES: dict[Mode, _State] = {mode: _State(mode) for mode in Mode if mode is not Mode.BROKEN}
"""The state of each mode but the broken one, made once: a lease is taken per step."""


class Lease:
    """The workers held for one mode, from :meth:`take` to :meth:`release`.

    Made by :meth:`~aps.learner.pool.WorkerPool.lease`; an async context manager, or an
    object a mode keeps across calls (partial steps from ``send`` to ``recv``, gradient rounds
    from their start to their stop). The one place the lease sequence is written: taking it
    ends the mode a caller left open, refuses what cannot run now and enters the mode;
    releasing it judges the failure that ended it, runs the mode's wind-down
    (:meth:`on_release`) and leaves the mode, whatever happened.
    """

    __slots__ = (
        "_drained",
        "_end",
        "_every_worker",
        "_held",
        "_pool",
        "_running",
        "_verb",
        "_wind_down",
        "mode",
        "operation",
    )

    def __init__(
        self,
        pool: WorkerPool,
        mode: Mode,
        operation: str,
        running: str,
        every_worker: bool,
        verb: str | None,
        drained: bool,
        end: Callable[[], Awaitable[None]] | None,
    ) -> None:
        self._pool = pool
        self.mode = mode
        self.operation = operation
        self._running = running
        self._every_worker = every_worker
        self._verb = verb
        self._drained = drained
        self._end = end
        self._wind_down: Callable[[], Awaitable[None]] | None = None
        self._held = False

    @property
    def broken(self) -> ApsError | None:
        """Why the workers are out of step for good, if they are (see the pool's ``broken``)."""
        return self._pool.broken

    async def take(self) -> Self:
        """End the mode a caller left open, refuse what cannot run now, enter the mode.

        Taking a lease already held does nothing.

        Raises:
            InvalidState: the workers are out of step for good, some were dropped and the
                operation needs every worker's envs, or another operation holds them.
        """
        if self._held:
            return self
        pool = self._pool
        if self._end is not None:
            pool._enders[self.mode] = self._end
        end = pool._abandoned()  # awaited only when one is open: no coroutine per step
        if end is not None:
            await end()
        pool._refuse(self.operation, self._running, self._every_worker, self._verb)
        pool._state = _LEASES[self.mode]
        self._held = True
        return self

    def on_release(self, wind_down: Callable[[], Awaitable[None]]) -> None:
        """Run ``wind_down`` on release: after the failure was judged, before the mode is left.

        It sees broken workers as broken (a chunk stream then receives nothing more); what it
        raises is judged as the holder's failure is, and propagates.
        """
        self._wind_down = wind_down

    def fail(self, error: ApsError) -> None:
        """Put the workers out of step for good, naming ``error``; the lease is still held.

        For what the holder judges itself: a wind-down that did not end cleanly and raises
        nothing. A later failure says why in its place.
        """
        self._pool.break_for_good(error)

    async def release(self, failure: BaseException | None = None) -> None:
        """Judge ``failure`` (what ended the lease, if anything), wind down, leave the mode.

        A worker's failure (:class:`WorkerLost`, :class:`Timeout`, :class:`ProtocolError`)
        breaks the workers for good, naming it; so does an interruption (anything but an
        env's :class:`WorkerError`), since replies may still be in flight, unless the mode
        is ``drained``. The mode is left even when the wind-down raises. Releasing a lease
        not held does nothing.
        """
        if not self._held:
            return
        self._held = False
        try:
            if failure is not None:
                self._judge(failure)
            if self._wind_down is not None:
                try:
                    await self._wind_down()
                except BaseException as exc:
                    self._judge(exc)
                    raise
        finally:
            self._pool._leave(self.mode)

    def _judge(self, failure: BaseException) -> None:
        if isinstance(failure, WorkerLost | Timeout | ProtocolError):
            self.fail(failure)
        elif not self._drained and not isinstance(failure, WorkerError):
            self.fail(InvalidState(f"{self.operation}() was interrupted ({failure!r})"))

    __aenter__ = take

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        failure: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if failure is None and self._wind_down is None and self._held:
            self._held = False  # the common case, a step that went well, in one call
            self._pool._leave(self.mode)
            return
        await self.release(failure)
