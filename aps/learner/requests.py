"""Numbered requests and their answers over each slot's :class:`~aps.session.delivery.Outbox`.

:class:`Requests` is the service every mode talks to the workers through: a request is
numbered and sent (or kept for after a resume), an answer is received exactly once, a
connection that took a slot over is brought up to date (what the modes say first, then the
unanswered requests), and a failure is handed to :class:`~aps.learner.recovery.Recovery`.
The books (numbering, acknowledgement, resending, voiding) are the outbox's, which does no
I/O; this room does the sending and receiving.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence

from aps.errors import EndOfStream, ProtocolError, Timeout, TransportError, WorkerError
from aps.learner.recovery import Recovery, lost
from aps.learner.slots import AnswerCheck, Slot, SlotHooks, Slots
from aps.session import Timeouts
from aps.session.delivery import Accepted
from aps.wire.messages import (
    TIMINGS,
    TIMINGS_FORMAT,
    ErrorReport,
    Message,
    Request,
    ResetRequest,
    ResetResult,
    RolloutChunk,
    StepResult,
)

__all__ = ["FRESH_RESET", "Redo", "Requests", "worker_error"]

FRESH_RESET = ResetRequest(seed=None, options=None)
"""What a replacement's envs get before they act (each worker seeds them its own way)."""

Redo = Callable[[Slot, Request, str], Awaitable[Message]]
"""How a mode answers a request whose worker was replaced meanwhile (see exchange)."""


WAITED = 1e-4
"""Seconds an answer must have been waited for to count as not already there: taking an
answer that arrived meanwhile (decoding a step's frame) costs tens of microseconds."""

MAX_TIMING = 86_400.0
"""The largest timing a worker may report for one answer, in seconds (a day)."""

_TIMED = (ResetResult, StepResult, RolloutChunk)


def _record(slot: Slot, answer: ResetResult | StepResult | RolloutChunk) -> None:
    """Count ``answer`` in its worker's figures, with the timings it carries.

    See :data:`~aps.wire.messages.TIMINGS`; an answer without timings adds only its count.

    Raises:
        ProtocolError: ``timings`` is not three numbers of seconds in 0..:data:`MAX_TIMING`
            (nothing is added then).
    """
    timings = answer.timings
    env = inference = encode = 0.0
    if timings is not None:
        # Written out (this runs per answer); NaN fails both comparisons.
        if len(timings) == TIMINGS_FORMAT.size:
            env, inference, encode = TIMINGS_FORMAT.unpack(timings)
        if not (
            len(timings) == TIMINGS_FORMAT.size
            and 0.0 <= env <= MAX_TIMING
            and 0.0 <= inference <= MAX_TIMING
            and 0.0 <= encode <= MAX_TIMING
        ):
            shown = TIMINGS_FORMAT.unpack(timings) if len(timings) == 12 else timings[:40]
            raise ProtocolError(
                f"worker {slot.info.worker_id} sent timings {shown!r} in its "
                f"{type(answer).__name__}; expected {TIMINGS_FORMAT.size} bytes of three "
                f"float32 seconds ({', '.join(TIMINGS)}), each in 0..{MAX_TIMING}: the worker "
                "is not a compatible aps worker"
            )
    metrics = slot.metrics
    metrics.answers += 1
    if type(answer) is StepResult:
        metrics.env_steps += slot.info.num_envs
    metrics.env_seconds += env
    metrics.inference_seconds += inference
    metrics.encode_seconds += encode


def worker_error(slot: Slot, report: ErrorReport) -> WorkerError:
    """The :class:`WorkerError` for an error ``slot`` reported."""
    return WorkerError(
        report.message,
        worker_id=slot.info.worker_id,
        remote_type=report.remote_type,
        remote_traceback=report.traceback,
    )


class Requests:
    """Numbered requests to the workers serving ``slots``, and their answers.

    Args:
        slots: the slot table.
        recovery: what a failure does.
        hooks: the modes to ask what a connection that took a slot over needs first.
        timeouts: ``timeouts.step`` bounds every wait for an answer: as an answer deadline
            (from the request, heartbeats or not) where the caller passes ``within``, else
            as a silence deadline (see :meth:`answer_from`).
    """

    def __init__(
        self, slots: Slots, recovery: Recovery, hooks: Sequence[SlotHooks], timeouts: Timeouts
    ) -> None:
        self._slots = slots
        self._recovery = recovery
        self._hooks = hooks
        self._timeouts = timeouts
        self.calls = 0
        """Exchanges run (lockstep resets, steps and env calls; DETACH's resets)."""
        self.wait_seconds = 0.0
        """Their time, from the first request sent to the last answer, in total."""

    async def send_request(self, slot: Slot, request: Request) -> None:
        """Number ``request`` for ``slot`` and send it (or keep it for after a resume)."""
        request = slot.outbox.number(request)
        # The answer deadline counts from here (see answer_from); a request only queued for
        # a resume is timed again when catch_up sends it.
        slot.asked = asyncio.get_running_loop().time()
        if slot.delivered == slot.generation and slot.attached.is_set():
            # send()'s body, written out: this runs per request (every lockstep step), one
            # coroutine fewer.
            try:
                await slot.session.send(request)
            except TransportError as exc:
                await self._send_failed(slot, request, exc)

    async def send(self, slot: Slot, message: Message, frame: bytes | None = None) -> None:
        """Send an unnumbered message to ``slot``; a broken connection is noticed later.

        Raises:
            WorkerLost: sending failed under ``on_worker_lost="raise"``. Otherwise the
                connection is closed, and the next receive recovers it.
        """
        try:
            await slot.session.send(message, frame=frame)
        except TransportError as exc:
            await self._send_failed(slot, message, exc)

    async def _send_failed(self, slot: Slot, message: Message, exc: TransportError) -> None:
        """What a failed send does: see :meth:`send`."""
        if self._recovery.on_worker_lost == "raise":
            raise lost(slot, type(message).__name__, exc) from exc
        # Whatever was unanswered goes again on the connection that takes over.
        slot.delivered = -1
        await slot.session.aclose("sending failed")

    async def answer_from(
        self,
        slot: Slot,
        operation: str,
        validate: AnswerCheck | None = None,
        *,
        within: float | None = None,
    ) -> Message | None:
        """Receive ``slot``'s next answer, exactly once.

        ``within`` (seconds) makes it an answer deadline: the answer is due that long after
        the latest request sent on the connection (see :meth:`send_request`), and heartbeats
        do not extend it: a worker that stalls and keeps heartbeating is lost then. Lockstep
        passes ``timeouts.step``: one reset, step or env call; DETACH ``num_steps`` times
        it, for a chunk. ``None`` is a silence deadline: the worker may be silent for at
        most ``timeouts.step``, and any frame restarts it (for waits whose length the pool
        cannot bound).

        ``validate`` looks at each fresh answer before it is returned and raises
        :class:`ProtocolError` for one that does not fit (wrong shapes, say): a malformed
        answer, like an unexpected message or a wrong sequence number, is its worker's
        failure, handled as its loss under ``on_worker_lost`` (see :meth:`Recovery.fail`).

        Returns ``None`` when a replacement worker took over: the requests of the lost one
        are void.

        Raises:
            WorkerLost: the worker was lost (and, under ``"wait"``, did not come back); a
                worker past its deadline is lost, with the Timeout as the cause.
            ProtocolError: the worker broke the protocol (under ``on_worker_lost="raise"``;
                it was disconnected).
        """
        while True:
            generation = slot.generation
            try:
                if slot.delivered != generation:
                    await self.catch_up(slot)
                if within is None:
                    message = await slot.session.receive(
                        timeout=self._timeouts.step,
                        operation=f"worker {slot.info.worker_id}'s {operation}",
                    )
                else:
                    message = await slot.session.receive(
                        timeout=within,
                        operation=f"worker {slot.info.worker_id}'s {operation}",
                        since=slot.asked,
                    )
                accepted = slot.outbox.accept(message)
                if accepted is not Accepted.FRESH:
                    continue
                if isinstance(message, _TIMED):
                    _record(slot, message)
                if validate is not None and type(message) is not ErrorReport:
                    validate(slot, message)
                return message
            except (EndOfStream, TransportError, Timeout, ProtocolError) as exc:
                # A silent worker is a lost one, under every on_worker_lost (the Timeout is
                # the WorkerLost's cause); under "wait" it may resume when it wakes up.
                if await self._recovery.fail(slot, generation, operation, exc):
                    return None

    async def call(
        self,
        slot: Slot,
        request: Request,
        operation: str,
        validate: AnswerCheck | None = None,
        *,
        within: float | None = None,
    ) -> Message | None:
        """Send one request to ``slot`` and receive its answer (``None``: replaced meanwhile).

        ``within``: as :meth:`answer_from`.
        """
        await self.send_request(slot, request)
        return await self.answer_from(slot, operation, validate, within=within)

    async def call_until_answered(
        self,
        slot: Slot,
        request: Request,
        operation: str,
        validate: AnswerCheck | None = None,
        *,
        within: float | None = None,
    ) -> Message:
        """:meth:`call`, sent again to each replacement until one of them answers."""
        while (
            answer := await self.call(slot, request, operation, validate, within=within)
        ) is None:
            pass
        return answer

    async def reset_replacement(
        self, slot: Slot, operation: str, validate: AnswerCheck | None = None
    ) -> Message:
        """Reset the envs of the worker that took ``slot`` over, before they act.

        :data:`FRESH_RESET` goes to each later replacement in turn until one answers. The
        answer is returned, a :class:`~aps.wire.messages.ResetResult` or an
        :class:`~aps.wire.messages.ErrorReport`; the caller notes the reset
        (:meth:`Recovery.note_reset`) once it used the answer (lockstep stitches it into a
        step first, and reads :meth:`Recovery.needs_reset` to flag the lost worker's
        episodes as ended).

        The answer is due ``timeouts.step`` after each request (see :meth:`answer_from`).

        Raises:
            WorkerLost | ProtocolError: as :meth:`answer_from`.
        """
        return await self.call_until_answered(
            slot, FRESH_RESET, operation, validate, within=self._timeouts.step
        )

    async def catch_up(self, slot: Slot) -> None:
        """Bring a connection that took over up to date: what the modes say, then requests."""
        generation = slot.generation
        for hooks in self._hooks:
            await hooks.rejoined(slot)
        # Requests numbered meanwhile were only queued: the live queue is read, so they go too.
        unanswered = slot.outbox.resend()
        index = 0
        while index < len(unanswered):
            await self.send(slot, unanswered[index])
            if slot.delivered == -1 or slot.generation != generation:
                return  # failed again: the next receive notices
            index += 1
        slot.delivered = generation
        if unanswered:
            # What was unanswered was asked again just now: its answer is due from here.
            slot.asked = asyncio.get_running_loop().time()

    async def exchange(
        self,
        requests: Sequence[Request],
        operation: str,
        redo: Redo,
        before: Callable[[Slot], Awaitable[None]] | None = None,
        after: Callable[[Slot], Awaitable[None]] | None = None,
        validate: AnswerCheck | None = None,
        within: float | None = None,
    ) -> list[Message]:
        """One request per slot, then one answer from each, in env order.

        See :meth:`WorkerPool.exchange`, which holds the workers while this runs; ``within``
        as :meth:`answer_from` (each answer's deadline counts from the latest request sent
        to its worker).

        Raises:
            WorkerError: an env raised on a worker (the others' answers are still received).
            WorkerLost | Timeout | ProtocolError: a worker failed.
        """
        admitted = self._slots.admitted
        if before is not None:
            # Every worker's preparation first (weights, say), then the requests: large
            # frames handed to several connections travel at the same time.
            for slot in admitted:
                await before(slot)
        clock = time.perf_counter
        began = clock()
        for slot, request in zip(admitted, requests, strict=True):
            await self.send_request(slot, request)
            if after is not None:
                await after(slot)
        answers: list[Message] = []
        failure: WorkerError | None = None
        # Answers are taken in env order, so the worker whose answer came last is the last
        # one this loop had to wait for: each wait is the time its answer came after the
        # ones before it (see WorkerMetrics.wait_seconds).
        slowest: Slot | None = None
        for slot, request in zip(admitted, requests, strict=True):
            waiting = clock()
            answer = await self.answer_from(slot, operation, validate, within=within)
            if answer is None:  # a replacement took over: its envs start afresh
                answer = await redo(slot, request, operation)
            waited = clock() - waiting
            slot.metrics.wait_seconds += waited
            if waited > WAITED or slowest is None:
                slowest = slot
            if isinstance(answer, ErrorReport):
                failure = failure or worker_error(slot, answer)
                continue
            answers.append(answer)
        if slowest is not None:
            slowest.metrics.slowest += 1
        self.calls += 1
        self.wait_seconds += clock() - began
        if failure is not None:
            # The report (a worker's text, up to a frame) is not kept alive by this frame,
            # which the raised error's traceback holds: the error has the capped text.
            answer = None
            raise failure
        return answers
