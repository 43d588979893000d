"""The blocking way into aps's event loop: borrowed by callers, kept between calls.

``aps.session._portal.Portal`` runs a call's coroutine in the caller's thread and leaves the loop
to its keeper thread between calls. These tests pin down who runs the loop when, that the
loop is served between calls, that a thread which cannot borrow it still gets its answer,
and that interrupting, closing and misuse end cleanly. Every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from aps.errors import InvalidState
from aps.session._portal import GRACE, Portal

WAIT = 10.0  # seconds: a deadline for each cross-thread wait, far above what any takes


@pytest.fixture(params=[False, True], ids=["asyncio", "uvloop"])
def portal(request: pytest.FixtureRequest) -> Portal:
    made = Portal(use_uvloop=request.param)
    request.addfinalizer(made.close)
    return made


async def _thread_ident() -> int:
    await asyncio.sleep(0)
    return threading.get_ident()


def test_a_call_runs_in_the_callers_thread(portal: Portal) -> None:
    me = threading.get_ident()
    assert [portal.call(_thread_ident()) for _ in range(50)] == [me] * 50


def test_a_call_returns_the_result_and_raises_the_error(portal: Portal) -> None:
    async def fail() -> None:
        await asyncio.sleep(0)
        raise ValueError("from the coroutine")

    with pytest.raises(ValueError, match="from the coroutine"):
        portal.call(fail())
    assert portal.call(_thread_ident()) == threading.get_ident()  # usable after an error


def test_the_keeper_serves_the_loop_between_calls(portal: Portal) -> None:
    served = threading.Event()
    ran_on: list[int] = []

    async def schedule() -> None:
        def later() -> None:
            ran_on.append(threading.get_ident())
            served.set()

        asyncio.get_running_loop().call_later(GRACE * 3, later)

    portal.call(schedule())
    # No call runs now: only the keeper can run the callback.
    assert served.wait(WAIT), "the loop was not run between calls"
    assert ran_on != [threading.get_ident()]


def test_a_caller_takes_the_loop_back_from_the_keeper(portal: Portal) -> None:
    portal.call(_thread_ident())
    time.sleep(GRACE * 5)  # the keeper runs the loop by now
    assert portal.call(_thread_ident()) == threading.get_ident()


def test_submit_runs_in_the_background(portal: Portal) -> None:
    started = threading.Event()

    async def work() -> str:
        started.set()
        await asyncio.sleep(0.01)
        return "done"

    pending = portal.submit(work())
    assert started.wait(WAIT), "a submitted coroutine did not start without a caller"
    assert pending.result() == "done"


def test_a_second_threads_call_is_answered_while_the_first_runs_the_loop(
    portal: Portal,
) -> None:
    # The first call waits for an event only the second call sets: the second call cannot
    # borrow the loop (the first thread runs it) and must be run by that thread or the keeper.
    gate: list[asyncio.Event] = []

    async def make_gate() -> None:
        gate.append(asyncio.Event())

    portal.call(make_gate())

    async def wait_for_gate() -> str:
        await asyncio.wait_for(gate[0].wait(), WAIT)
        return "opened"

    async def open_gate() -> int:
        gate[0].set()
        return threading.get_ident()

    results: dict[str, object] = {}

    def first() -> None:
        results["first"] = portal.call(wait_for_gate())

    thread = threading.Thread(target=first)
    thread.start()
    time.sleep(GRACE)  # let the first thread borrow the loop
    results["second"] = portal.call(open_gate())
    thread.join(WAIT)
    assert not thread.is_alive()
    assert results["first"] == "opened"


def test_a_thread_running_its_own_loop_gets_answers_through_the_keeper(portal: Portal) -> None:
    async def jupyter_cell() -> int:
        # A blocking call from a coroutine of another loop, as in a notebook.
        return portal.call(_thread_ident())

    ran_on = asyncio.run(jupyter_cell())
    assert ran_on != threading.get_ident()


def test_a_blocking_call_from_the_loop_itself_is_refused(portal: Portal) -> None:
    async def reenter() -> None:
        inner = _thread_ident()
        portal.call(inner)

    with pytest.raises(InvalidState, match="from its own event loop"):
        portal.call(reenter())


def test_an_interrupted_call_cancels_its_coroutine(portal: Portal) -> None:
    cancelled = threading.Event()

    async def long() -> None:
        def interrupt() -> None:
            raise KeyboardInterrupt  # as Ctrl-C does, between two callbacks

        asyncio.get_running_loop().call_later(0.02, interrupt)
        try:
            await asyncio.sleep(WAIT)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(KeyboardInterrupt):
        portal.call(long())
    assert cancelled.wait(WAIT), "the interrupted coroutine was not cancelled"
    assert portal.call(_thread_ident()) == threading.get_ident()


def _send_sigint(after: threading.Event | float) -> threading.Thread:
    """Send this process SIGINT from another thread, after a delay or an event."""

    def send() -> None:
        if isinstance(after, threading.Event):
            after.wait(WAIT)
        else:
            time.sleep(after)
        os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=send)
    thread.start()
    return thread


def test_ctrl_c_cancels_the_coroutine_at_an_await_then_raises(portal: Portal) -> None:
    steps: list[str] = []

    async def long() -> None:
        steps.append("started")
        try:
            await asyncio.sleep(WAIT)
        except asyncio.CancelledError:
            steps.append("cancelled at the await")
            raise

    sender = _send_sigint(0.05)
    with pytest.raises(KeyboardInterrupt):
        portal.call(long())
    sender.join(WAIT)
    # Cancelled inside the call, at its await, before KeyboardInterrupt reached the caller.
    assert steps == ["started", "cancelled at the await"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert portal.call(_thread_ident()) == threading.get_ident()


def test_a_second_ctrl_c_raises_at_once(portal: Portal) -> None:
    first = threading.Event()
    ended = threading.Event()

    async def stubborn() -> None:
        try:
            await asyncio.sleep(WAIT)
        except asyncio.CancelledError:
            first.set()
        try:
            await asyncio.sleep(WAIT)  # ignores the first cancellation
        finally:
            ended.set()

    first_sender = _send_sigint(0.05)
    second_sender = _send_sigint(first)
    with pytest.raises(KeyboardInterrupt):
        portal.call(stubborn())
    first_sender.join(WAIT)
    second_sender.join(WAIT)
    assert ended.wait(WAIT), "the coroutine left behind was not cancelled"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_close_ends_the_keeper_and_refuses_later_calls(portal: Portal) -> None:
    portal.call(_thread_ident())
    time.sleep(GRACE * 3)  # the keeper is running the loop
    portal.close()
    portal.close()  # idempotent
    assert not portal._keeper.is_alive()
    with pytest.raises(InvalidState, match="closed"):
        portal.call(_thread_ident())
    with pytest.raises(InvalidState, match="closed"):
        portal.submit(_thread_ident())


def test_a_programs_own_sigint_handler_is_left_in_place(portal: Portal) -> None:
    def own(signum: int, frame: object) -> None:
        pass

    previous = signal.signal(signal.SIGINT, own)
    try:
        assert portal.call(_thread_ident()) == threading.get_ident()
        assert signal.getsignal(signal.SIGINT) is own
    finally:
        signal.signal(signal.SIGINT, previous)
