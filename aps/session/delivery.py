"""Reliable delivery of numbered requests, as state machines with no I/O.

Requests (resets, steps, rollouts, env calls, and the kinds modes add: see
:data:`aps.session.protocol.REQUESTS`) are numbered per worker session: ``seq``
counts from 0, every answer carries the ``seq`` it answers, and ``acked`` tells the worker
how many answers the learner has received (see :mod:`aps.wire.messages`). Two objects keep the
books, one at each end, and neither touches a socket, a clock or the event loop, so they
are tested like :mod:`aps.session.protocol`, by feeding them events:

- :class:`Outbox`, the learner's side of one worker slot: :meth:`~Outbox.number` a request,
  :meth:`~Outbox.accept` an answer as fresh or as a duplicate (sent again after a resume),
  :meth:`~Outbox.resend` what a resumed connection must get again, :meth:`~Outbox.void`
  what a replacement worker will never answer, and :meth:`~Outbox.forget` the answers
  nobody waits for any more.
- :class:`AnswerCache`, the worker's side of one session: :meth:`~AnswerCache.lookup` a
  request (run it, or send the kept answer again), :meth:`~AnswerCache.keep` an answer until
  the learner acknowledges it.

The rule they keep together: over any interleaving of requests, answers, dropped
connections, resumes and replacements, the learner receives each request's answer exactly
once (or learns it was voided), and a worker runs each request at most once.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from typing import Generic, TypeVar

from aps.errors import ProtocolError
from aps.session.protocol import ANSWERS, MAX_IN_FLIGHT
from aps.wire.messages import ErrorReport, Message, Request

# ANSWERS (what answers each kind of request) is read from the request kinds' rows,
# aps.session.protocol.REQUESTS; it is named here too, where the outbox checks answers against it.
__all__ = ["ANSWERS", "Accepted", "AnswerCache", "Outbox"]

_A = TypeVar("_A")


class Accepted(enum.Enum):
    """What :meth:`Outbox.accept` made of an answer."""

    FRESH = "fresh"
    """The answer to the oldest unanswered request: hand it to whoever waits."""
    DUPLICATE = "duplicate"
    """An answer received already (sent again after a resume): ignore it."""
    DISCARDED = "discarded"
    """A fresh answer that nobody waits for any more (see :meth:`Outbox.forget`)."""


class Outbox:
    """The learner's numbered requests to one worker slot.

    ``sent`` and ``received`` count requests numbered and answers accepted; ``unanswered``
    holds the requests numbered and not answered yet, oldest first.
    """

    __slots__ = ("_discard", "received", "sent", "unanswered")

    def __init__(self) -> None:
        self.sent = 0
        self.received = 0
        self.unanswered: collections.deque[Request] = collections.deque()
        self._discard = 0

    def __repr__(self) -> str:
        return f"Outbox(sent={self.sent}, received={self.received}, discard={self._discard})"

    @property
    def pending(self) -> int:
        """Answers still owed (discarded ones included)."""
        return len(self.unanswered)

    @property
    def discarding(self) -> int:
        """Answers owed that will be discarded when they come (see :meth:`forget`)."""
        return self._discard

    def number(self, request: Request) -> Request:
        """Give ``request`` the next ``seq`` (and the current ``acked``) and note it unanswered.

        Returns:
            The numbered request, to send now or after a resume (``request`` itself when it
            carries those numbers already: lockstep builds each step with ``seq=sent`` and
            ``acked=received``, so that the per-step path builds it once).
        """
        if request.seq != self.sent or request.acked != self.received:
            request = dataclasses.replace(request, seq=self.sent, acked=self.received)
        self.sent += 1
        self.unanswered.append(request)
        return request

    def accept(self, message: Message) -> Accepted:
        """Take ``message`` as the answer it says it is (its ``seq``).

        Raises:
            ProtocolError: ``message`` answers a request that was not sent, skips one, or is
                not what answers that request (see :data:`ANSWERS`): the worker is not a
                compatible aps worker. Nothing is counted; the text names the request
                numbers, and the caller prefixes it with the worker's name.
        """
        seq = getattr(message, "seq", None)
        # An answer from before the last MAX_IN_FLIGHT received cannot be one sent again.
        if (
            type(seq) is not int
            or not max(0, self.received - MAX_IN_FLIGHT) <= seq <= self.received
            or (seq == self.received and not self.unanswered)
        ):
            raise ProtocolError(
                f"sent {type(message).__name__} answering request {seq}, but the next answer "
                f"due is {self.received} of {self.sent} sent; the worker is not a compatible "
                "aps worker"
            )
        if seq < self.received:
            return Accepted.DUPLICATE
        kind = type(message)
        asked = type(self.unanswered[0])
        if kind is not ANSWERS[asked] and kind is not ErrorReport:
            raise ProtocolError(
                f"sent {kind.__name__} answering request {seq}, a {asked.__name__}, which a "
                f"{ANSWERS[asked].__name__} answers; the worker is not a compatible aps worker"
            )
        self.unanswered.popleft()
        self.received += 1
        if self._discard:
            self._discard -= 1
            return Accepted.DISCARDED
        return Accepted.FRESH

    def resend(self) -> collections.deque[Request]:
        """What a connection that resumed the session must get again, in order.

        The live queue, not a copy: requests numbered while the resend runs are in it too.
        A worker answers the requests it served already from its :class:`AnswerCache`, so
        sending them all again is safe.
        """
        return self.unanswered

    def can_resume(self, served: int) -> bool:
        """Whether a worker that says it answered ``served`` requests fits this outbox."""
        return self.received <= served <= self.sent

    def void(self) -> tuple[Request, ...]:
        """A new worker takes the slot over: start a fresh count; the unanswered are void.

        Returns:
            The requests the lost worker did not answer (none of them will be answered).
        """
        void = tuple(self.unanswered)
        self.unanswered.clear()
        self.sent = self.received = self._discard = 0
        return void

    def forget(self) -> None:
        """Nobody waits for the answers owed now: they are accepted as discarded."""
        self._discard = len(self.unanswered)

    def drop(self) -> None:
        """The slot is left out for good: nothing it owes is waited for."""
        self.unanswered.clear()
        self._discard = 0


class AnswerCache(Generic[_A]):
    """A worker's answers to one session's requests, kept until acknowledged.

    ``served`` counts the requests answered (the ``served`` of a resuming worker's Hello).
    An answer is whatever the caller keeps (the worker keeps the message and its encoded
    frame, to send again without encoding it twice).

    Args:
        limit: answers kept at most; the learner never has more unacknowledged (it pipelines
            at most :data:`~aps.session.protocol.MAX_IN_FLIGHT` requests).
    """

    __slots__ = ("_kept", "_limit", "served")

    def __init__(self, limit: int = MAX_IN_FLIGHT) -> None:
        self.served = 0
        self._kept: collections.OrderedDict[int, _A] = collections.OrderedDict()
        self._limit = limit

    def __len__(self) -> int:
        return len(self._kept)

    def lookup(self, seq: int, acked: int) -> _A | None:
        """Forget the answers acknowledged (below ``acked``); what request ``seq`` gets.

        Returns:
            ``None``: ``seq`` is the next request, to run (then :meth:`keep` its answer).
            Otherwise the kept answer, to send again.

        Raises:
            ProtocolError: ``seq`` skips a request, or asks again for an answer already
                acknowledged (the learner is not a compatible aps learner).
        """
        kept = self._kept
        while kept and next(iter(kept)) < acked:
            kept.popitem(last=False)
        if seq == self.served:
            return None
        if seq > self.served:
            raise ProtocolError(
                f"the learner sent request {seq} but the next one is {self.served}; a request "
                "was lost, the learner is not a compatible aps learner"
            )
        answer = kept.get(seq)
        if answer is None:
            raise ProtocolError(
                f"the learner asked again for answer {seq}, which this worker no longer holds "
                f"(answers below {acked} were acknowledged); the learner is not a compatible "
                "aps learner"
            )
        return answer

    def keep(self, answer: _A) -> int:
        """Keep the answer to request ``served`` (the one :meth:`lookup` said to run).

        Returns:
            The ``seq`` it answers.
        """
        seq = self.served
        self._kept[seq] = answer
        while len(self._kept) > self._limit:
            self._kept.popitem(last=False)
        self.served += 1
        return seq
