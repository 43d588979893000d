"""Reliable delivery without I/O: the learner's outbox and the worker's answer cache.

Driven by events, as the protocol's tests are: no sockets, no event loop. The property test
plays random interleavings of requests, answers, dropped connections, resumes, replacements
and streams that end early against a model of a TCP connection (in order, and a cut loses
whatever is in flight both ways), and checks that nothing is lost or duplicated.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from aps.errors import ProtocolError
from aps.session.delivery import Accepted, AnswerCache, Outbox
from aps.wire.messages import (
    EnvCall,
    ErrorReport,
    ResetRequest,
    ResetResult,
    StepRequest,
    StepResult,
)


def answer(seq: int, payload: object = None) -> ResetResult:
    return ResetResult(obs=payload, info={}, seq=seq)


def test_requests_are_numbered_in_order_and_carry_the_answers_received() -> None:
    outbox = Outbox()
    first = outbox.number(ResetRequest(seed=None, options=None))
    second = outbox.number(EnvCall(kind="call", name="f"))
    assert (first.seq, first.acked, second.seq, second.acked) == (0, 0, 1, 0)
    assert outbox.accept(answer(0)) is Accepted.FRESH
    third = outbox.number(ResetRequest(seed=None, options=None))
    assert (third.seq, third.acked) == (2, 1)
    assert list(outbox.resend()) == [second, third]


def test_a_step_built_with_the_outbox_numbers_is_not_built_again() -> None:
    outbox = Outbox()
    step = StepRequest(actions=[1, 2], seq=outbox.sent, acked=outbox.received)
    assert outbox.number(step) is step
    stale = StepRequest(actions=[1, 2], seq=7, acked=3)
    renumbered = outbox.number(stale)
    assert (renumbered.seq, renumbered.acked) == (1, 0)


def test_an_answer_sent_again_after_a_resume_is_a_duplicate() -> None:
    outbox = Outbox()
    outbox.number(ResetRequest(seed=None, options=None))
    outbox.number(ResetRequest(seed=None, options=None))
    assert outbox.accept(answer(0)) is Accepted.FRESH
    assert outbox.accept(answer(0)) is Accepted.DUPLICATE
    assert outbox.accept(answer(1)) is Accepted.FRESH
    assert outbox.pending == 0


@pytest.mark.parametrize("seq", [1, 5, -1, None, "0", True])
def test_an_answer_that_skips_or_was_never_asked_for_is_refused(seq: Any) -> None:
    outbox = Outbox()
    outbox.number(ResetRequest(seed=None, options=None))
    with pytest.raises(ProtocolError, match=rf"answering request {seq}.* due is 0 of 1 sent"):
        outbox.accept(answer(seq))
    assert outbox.pending == 1  # nothing was counted


def test_an_answer_with_nothing_owed_is_refused() -> None:
    with pytest.raises(ProtocolError, match="due is 0 of 0 sent"):
        Outbox().accept(answer(0))


def test_a_replacement_voids_what_the_lost_worker_owed_and_counts_afresh() -> None:
    outbox = Outbox()
    sent = [outbox.number(ResetRequest(seed=i, options=None)) for i in range(3)]
    outbox.accept(answer(0))
    assert outbox.void() == tuple(sent[1:])
    assert (outbox.sent, outbox.received, outbox.pending) == (0, 0, 0)
    assert outbox.number(ResetRequest(seed=None, options=None)).seq == 0


def test_forgotten_answers_are_discarded_then_answers_are_fresh_again() -> None:
    outbox = Outbox()
    for _ in range(2):
        outbox.number(ResetRequest(seed=None, options=None))
    outbox.forget()
    assert outbox.discarding == 2
    outbox.number(ResetRequest(seed=None, options=None))
    assert [outbox.accept(answer(i)) for i in range(3)] == [
        Accepted.DISCARDED,
        Accepted.DISCARDED,
        Accepted.FRESH,
    ]


def test_resume_fits_only_a_worker_that_served_what_was_sent_and_not_received() -> None:
    outbox = Outbox()
    for _ in range(3):
        outbox.number(ResetRequest(seed=None, options=None))
    outbox.accept(answer(0))
    assert [outbox.can_resume(n) for n in range(5)] == [False, True, True, True, False]


def test_the_cache_runs_the_next_request_and_sends_a_kept_one_again() -> None:
    cache: AnswerCache[str] = AnswerCache()
    assert cache.lookup(0, 0) is None
    assert cache.keep("a0") == 0
    assert cache.lookup(1, 0) is None
    cache.keep("a1")
    assert cache.lookup(0, 0) == "a0"  # a resume: sent again, not run again
    assert (cache.served, len(cache)) == (2, 2)


def test_the_cache_forgets_what_the_learner_acknowledged() -> None:
    cache: AnswerCache[str] = AnswerCache()
    for name in ("a0", "a1", "a2"):
        assert cache.lookup(cache.served, 0) is None
        cache.keep(name)
    assert cache.lookup(2, 2) == "a2"
    assert len(cache) == 1
    with pytest.raises(ProtocolError, match="answer 1, which this worker no longer holds"):
        cache.lookup(1, 2)


def test_the_cache_refuses_a_request_that_skips_one() -> None:
    cache: AnswerCache[str] = AnswerCache()
    with pytest.raises(ProtocolError, match="sent request 1 but the next one is 0"):
        cache.lookup(1, 0)


def test_the_cache_keeps_at_most_its_limit() -> None:
    cache: AnswerCache[int] = AnswerCache(limit=2)
    for seq in range(4):
        cache.lookup(seq, 0)
        cache.keep(seq)
    assert len(cache) == 2
    assert cache.lookup(3, 0) == 3
    with pytest.raises(ProtocolError, match="no longer holds"):
        cache.lookup(1, 0)


class Slot:
    """One worker slot: a learner's outbox, a worker's cache, and a connection between them.

    Each request carries a payload id; a worker "runs" a request by logging its id, and its
    answer carries the id back. A cut connection loses everything in flight both ways.
    """

    def __init__(self) -> None:
        self.outbox = Outbox()
        self.cache: AnswerCache[ResetResult] = AnswerCache()
        self.worker = 0  # which worker serves the slot (a replacement is the next)
        self.ran: collections.Counter[tuple[int, int]] = collections.Counter()
        self.connected = True  # a request sent on a cut connection is lost with it
        self.to_worker: collections.deque[Any] = collections.deque()
        self.to_learner: collections.deque[ResetResult] = collections.deque()
        self.sent: list[int] = []
        self.delivered: list[int] = []
        self.voided: list[int] = []
        self.discarded: list[int] = []
        self.forgotten: set[int] = set()

    def pending(self) -> list[int]:
        return [request.seed for request in self.outbox.unanswered]

    def send(self) -> None:
        payload = len(self.sent)
        self.sent.append(payload)
        request = self.outbox.number(ResetRequest(seed=payload, options=None))
        if self.connected:
            self.to_worker.append(request)

    def worker_answers(self) -> None:
        if self.to_worker:
            request = self.to_worker.popleft()
            kept = self.cache.lookup(request.seq, request.acked)
            if kept is None:
                self.ran[self.worker, request.seed] += 1
                kept = answer(request.seq, request.seed)
                self.cache.keep(kept)
            self.to_learner.append(kept)

    def learner_receives(self) -> None:
        if self.to_learner:
            message = self.to_learner.popleft()
            accepted = self.outbox.accept(message)
            if accepted is Accepted.FRESH:
                self.delivered.append(message.obs)
            elif accepted is Accepted.DISCARDED:
                self.discarded.append(message.obs)

    def cut(self) -> None:
        self.connected = False
        self.to_worker.clear()
        self.to_learner.clear()

    def resume(self) -> None:
        # Without a cut first, the worker dials again while the old connection still
        # delivers: requests and answers may then arrive twice.
        assert self.outbox.can_resume(self.cache.served)
        self.connected = True
        self.to_worker.extend(self.outbox.resend())

    def cut_and_resume(self) -> None:
        self.cut()
        self.resume()

    def replace(self) -> None:
        self.cut()  # a replacement takes over a lost worker's slot
        self.voided.extend(request.seed for request in self.outbox.void())
        self.cache = AnswerCache()
        self.worker += 1
        self.connected = True

    def stream_ends(self) -> None:
        self.outbox.forget()
        self.forgotten.update(self.pending())

    def check(self) -> None:
        # Each request is in exactly one place: answered, discarded, voided or pending.
        accounted = self.delivered + self.discarded + self.voided + self.pending()
        assert sorted(accounted) == self.sent
        # Answers arrive in the order asked, and only those nobody waits for are discarded.
        assert self.delivered == sorted(self.delivered)
        assert set(self.discarded) <= self.forgotten
        # No worker runs a request twice; every answer received was run.
        assert all(count == 1 for count in self.ran.values())
        ran = {payload for _, payload in self.ran}
        assert set(self.delivered) <= ran and set(self.discarded) <= ran


EVENTS = (
    *("send", "worker_answers", "learner_receives") * 3,
    "cut",
    "resume",
    "cut_and_resume",
    "replace",
    "stream_ends",
)
"""What can happen next; losses are rarer than sends and answers, so that many go through."""


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(EVENTS), min_size=10, max_size=80))
def test_no_interleaving_loses_or_duplicates_a_request(events: list[str]) -> None:
    slot = Slot()
    for event in events:
        getattr(slot, event)()
        slot.check()


def test_an_answer_of_the_wrong_kind_is_refused_and_not_counted() -> None:
    outbox = Outbox()
    outbox.number(ResetRequest(seed=None, options=None))
    step = StepResult(obs=None, reward=None, terminated=None, truncated=None, info={}, seq=0)
    with pytest.raises(ProtocolError, match="sent StepResult answering request 0, a ResetRequest"):
        outbox.accept(step)
    assert outbox.pending == 1
    report = ErrorReport(remote_type="E", message="m", traceback="", seq=0)
    assert outbox.accept(report) is Accepted.FRESH  # an error report answers any request
