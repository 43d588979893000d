"""The streaming modes' pumps: what a worker's receive returns or raises reaches the inbox.

Driven by scripted receives (the pumps do no I/O of their own); the modes' tests run them
over real sockets.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

import aps
from aps.errors import WorkerError, WorkerLost
from aps.learner.pool import Slot, WorkerInfo
from aps.learner.pump import Pumps
from aps.learner.rollouts import WorkerMetrics
from aps.wire.messages import ErrorReport, GradientProgress, Message


def make_slot(worker_id: int = 0) -> Slot:
    info = WorkerInfo(
        worker_id=worker_id, env_offset=0, num_envs=1, env_id="E", host="h", pid=1, peer="p"
    )
    # The pumps never touch the session: the modes' receives do.
    return Slot(info=info, session=None, metrics=WorkerMetrics(worker_id), session_id=b"")  # type: ignore[arg-type]


def progress(count: int) -> GradientProgress:
    return GradientProgress(round=0, count=count)


def scripted(*steps: Message | BaseException | None) -> tuple[list[int], object]:
    """A receive playing ``steps`` in turn (an exception is raised), then waiting forever."""
    calls: list[int] = []
    script: Iterator[Message | BaseException | None] = iter(steps)

    async def receive(slot: Slot) -> Message | aps.ApsError | None:
        calls.append(slot.info.worker_id)
        step = next(script, None)
        if step is None and len(calls) > len(steps):
            await asyncio.Event().wait()
        if isinstance(step, WorkerLost):
            return step  # returned: delivered while the pump goes on
        if isinstance(step, BaseException):
            raise step
        return step

    return calls, receive


@pytest.fixture
async def pool() -> object:
    async with aps.Learner("memory://", num_workers=1) as learner:
        yield learner._pool


async def test_an_error_a_receive_raises_reaches_the_consumer_and_ends_the_pump(
    pool: object,
) -> None:
    calls, receive = scripted(progress(1), RuntimeError("catch-up failed"))
    pumps = Pumps(pool, receive, name="test")  # type: ignore[arg-type]
    slot = make_slot()
    pumps.start([slot])
    first = await asyncio.wait_for(pumps.get(), 10)
    assert first == (slot, progress(1))
    got, error = await asyncio.wait_for(pumps.get(), 10)
    assert got is slot and isinstance(error, RuntimeError)
    with pytest.raises(RuntimeError, match="catch-up failed"):
        pumps.unwrap(got, error)
    await asyncio.sleep(0)
    assert len(calls) == 2  # the pump ended: nobody receives from that worker any more
    assert await pumps.stop() == []


async def test_a_returned_error_is_delivered_and_nothing_is_delivered_for_none(
    pool: object,
) -> None:
    lost = WorkerLost("worker 0 was lost and worker 1 took over", worker_id=0)
    _, receive = scripted(lost, None, progress(2))
    pumps = Pumps(pool, receive, name="test")  # type: ignore[arg-type]
    slot = make_slot()
    pumps.start([slot])
    assert await asyncio.wait_for(pumps.get(), 10) == (slot, lost)
    assert await asyncio.wait_for(pumps.get(), 10) == (slot, progress(2))
    await pumps.stop()


async def test_an_error_report_unwraps_as_the_workers_error(pool: object) -> None:
    pumps = Pumps(pool, scripted()[1], name="test")  # type: ignore[arg-type]
    report = ErrorReport(message="env exploded", remote_type="ValueError", traceback="tb")
    with pytest.raises(WorkerError, match="env exploded") as caught:
        pumps.unwrap(make_slot(3), report)
    assert caught.value.worker_id == 3
    assert pumps.unwrap(make_slot(), progress(4)) == progress(4)


async def test_a_full_inbox_holds_the_pumps_back_and_stop_returns_what_was_left(
    pool: object,
) -> None:
    calls, receive = scripted(*(progress(n) for n in range(10)))
    pumps = Pumps(pool, receive, name="test", backlog=1)  # type: ignore[arg-type]
    admitted = [make_slot(0), make_slot(1)]
    pumps.start(admitted)
    for _ in range(20):
        await asyncio.sleep(0)
    # One message fills the inbox; each pump then holds one more, waiting to put it, and
    # receives nothing further until the consumer takes one.
    assert len(calls) == 3 and set(calls) == {0, 1}
    left = await pumps.stop()
    assert [item for _, item in left] == [progress(0)]
