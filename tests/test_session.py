"""Session.receive's deadline: Timeout after silence, cancellation kept apart, nothing lost."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest

import aps.session
from aps.errors import EndOfStream, ProtocolError, Timeout, TransportClosed
from aps.session import OFF_LOOP_BYTES, OFF_LOOP_INFLATING_BYTES, Session
from aps.session.protocol import PROTOCOL_VERSION, Role
from aps.transports.memory import memory_transport_pair
from aps.wire.messages import Challenge, Weights
from tests.conftest import benchmark_module

CHALLENGE = Challenge(protocol_version=PROTOCOL_VERSION, nonce=b"0123456789abcdef")


async def pair() -> tuple[Session, Session]:
    worker_end, learner_end = memory_transport_pair()
    return Session(worker_end, Role.WORKER), Session(learner_end, Role.LEARNER)


async def test_silence_past_the_deadline_is_a_timeout_and_the_session_goes_on() -> None:
    worker, learner = await pair()
    with pytest.raises(Timeout) as caught:
        await worker.receive(timeout=0.05, operation="the challenge")
    assert caught.value.seconds == 0.05 and "the challenge" in str(caught.value)
    await learner.send(CHALLENGE)
    assert await worker.receive(timeout=5, operation="the challenge") == CHALLENGE


async def test_a_frame_in_time_leaves_no_deadline_behind() -> None:
    worker, learner = await pair()
    await learner.send(CHALLENGE)
    assert await worker.receive(timeout=0.05, operation="the challenge") == CHALLENGE
    await asyncio.sleep(0.15)  # a deadline left running would cancel this task here


async def test_cancelling_a_receive_is_a_cancellation_and_loses_nothing() -> None:
    worker, learner = await pair()
    waiting = asyncio.create_task(worker.receive(timeout=60, operation="the challenge"))
    await asyncio.sleep(0.01)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await learner.send(CHALLENGE)
    assert await worker.receive(timeout=5, operation="the challenge") == CHALLENGE


async def test_a_cancellation_racing_the_deadline_stays_a_cancellation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    worker, _learner = await pair()
    watch = Session._watch

    def watch_and_cancel(self: Session) -> None:
        wait = self._waiting
        watch(self)
        if wait is not None and wait.expired:
            wait.task.cancel()  # someone else cancels the task as the deadline passes

    monkeypatch.setattr(Session, "_watch", watch_and_cancel)
    waiting = asyncio.create_task(worker.receive(timeout=0.05, operation="the challenge"))
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(waiting, 5)
    assert waiting.cancelled()


async def test_a_shorter_deadline_after_a_longer_one_still_times_out() -> None:
    worker, learner = await pair()
    await learner.send(CHALLENGE)
    assert await worker.receive(timeout=60, operation="the challenge") == CHALLENGE
    # The watchdog armed for 60 s must not delay this call's deadline.
    with pytest.raises(Timeout):
        await asyncio.wait_for(worker.receive(timeout=0.05, operation="the challenge"), 10)


async def test_a_longer_deadline_outlives_the_watchdog_of_an_earlier_call() -> None:
    worker, learner = await pair()
    await learner.send(CHALLENGE)
    assert await worker.receive(timeout=0.05, operation="the challenge") == CHALLENGE
    # The watchdog armed for the first call fires during this one and must only re-arm.
    waiting = asyncio.create_task(worker.receive(timeout=5, operation="the challenge"))
    await asyncio.sleep(0.2)
    assert not waiting.done()
    await learner.aclose()  # its goodbye ends the wait: not a Timeout
    with pytest.raises(EndOfStream):
        await asyncio.wait_for(waiting, 10)


async def test_closing_stops_the_watchdog() -> None:
    worker, _learner = await pair()
    with pytest.raises(Timeout):
        await worker.receive(timeout=0.01, operation="the challenge")
    waiting = asyncio.create_task(worker.receive(timeout=60, operation="the challenge"))
    await asyncio.sleep(0.01)
    assert worker._watchdog is not None
    waiting.cancel()
    await asyncio.wait([waiting])
    await worker.aclose()
    assert worker._watchdog is None


async def test_a_close_cancelled_halfway_still_closes_the_connection() -> None:
    """The session counts as closed from aclose's first call, so a cancelled first call must
    still close the connection: a second call returns at once and nothing else would."""
    from aps.transports.tcp import TCPFactory

    factory = TCPFactory()
    async with await factory.listen("tcp://127.0.0.1:0") as listener:
        dialed = await factory.connect(listener.url, timeout=10)
        accepted = await listener.accept()
        session = Session(accepted, Role.LEARNER)
        session.start_heartbeats()
        await asyncio.sleep(0)  # the heartbeat task is running: aclose must wait for it
        closing = asyncio.create_task(session.aclose(goodbye=False))
        await asyncio.sleep(0)  # aclose now waits for the heartbeat task to end
        closing.cancel()
        await asyncio.wait([closing])
        await session.aclose()  # returns at once
        with pytest.raises(EndOfStream):
            await asyncio.wait_for(dialed.receive(), 10)
        await dialed.aclose()


async def authenticated_pair() -> tuple[Session, Session]:
    """Two sessions past the handshake, whose protocol checks let anything through.

    What these tests look at is how a frame is read and decoded, not which message the
    protocol allows when: that is tests/test_protocol.py's part.
    """
    worker, learner = await pair()
    for session in (worker, learner):
        session.authenticated()
        session._connection.receive = lambda message: None  # type: ignore[method-assign]
        session._connection.send = lambda message: None  # type: ignore[method-assign]
    return worker, learner


def large_weights() -> Weights:
    arrays = {"w": np.arange(OFF_LOOP_BYTES // 4 * 3, dtype=np.float32)}  # 12 MiB
    return Weights(version=3, arrays=arrays, epsilon=None)


async def test_a_large_frame_decodes_in_a_thread_and_a_cancelled_receive_loses_nothing() -> None:
    worker, learner = await authenticated_pair()
    sent = large_weights()
    await learner.send(sent)
    waiting = asyncio.create_task(worker.receive(timeout=60, operation="weights"))
    while worker._decoding is None:  # noqa: ASYNC110 - waiting for the hand-off to a thread
        await asyncio.sleep(0)
    waiting.cancel()  # while the thread decodes
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await learner.send(CHALLENGE)  # behind it on the wire
    got = await worker.receive(timeout=60, operation="weights")
    assert isinstance(got, Weights) and got.version == 3
    np.testing.assert_array_equal(got.arrays["w"], sent.arrays["w"])
    assert await worker.receive(timeout=5, operation="the challenge") == CHALLENGE
    assert worker._decoding is None


async def test_a_malformed_large_frame_is_a_protocol_error_off_the_loop_too() -> None:
    worker, learner = await authenticated_pair()
    await learner._transport.send(b"\xc1" * (OFF_LOOP_BYTES + 1))  # 0xc1: never valid msgpack
    with pytest.raises(ProtocolError, match="malformed frame"):
        await worker.receive(timeout=60, operation="weights")
    assert worker._decoding is None


async def test_small_frames_decode_on_the_loop() -> None:
    worker, learner = await authenticated_pair()
    threads = decoding_threads(worker)
    await learner.send(Weights(version=1, arrays={"w": np.zeros(4, np.float32)}, epsilon=None))
    got = await worker.receive(timeout=5, operation="weights")
    assert isinstance(got, Weights) and threads == [threading.main_thread()]


def test_the_loop_stall_benchmark_runs_both_ways() -> None:
    with benchmark_module("loop_stall") as loop_stall:
        rows = [asyncio.run(loop_stall.run(5.0, 1, "zstd", off)) for off in (True, False)]
    assert [row["off_loop"] for row in rows] == [True, False]
    assert all(row["longest_gap_ms"] > 0 for row in rows)
    assert aps.session.OFF_LOOP_BYTES == OFF_LOOP_BYTES  # put back


async def test_closing_the_session_while_a_frame_decodes_ends_the_receive_as_closed() -> None:
    worker, learner = await authenticated_pair()
    await learner.send(large_weights())
    waiting = asyncio.create_task(worker.receive(timeout=60, operation="weights"))
    while worker._decoding is None:  # noqa: ASYNC110 - waiting for the hand-off to a thread
        await asyncio.sleep(0)
    await worker.aclose()  # another task closes it: the receive is not cancelled by that
    with pytest.raises(TransportClosed, match="closed while a frame was decoded"):
        await waiting


def decoding_threads(session: Session) -> list[threading.Thread]:
    """The threads ``session`` decodes its frames in, from now on (a list that grows)."""
    threads: list[threading.Thread] = []
    decode = session._decode

    def spy(frame: bytes) -> Any:
        threads.append(threading.current_thread())
        return decode(frame)

    session._decode = spy  # type: ignore[method-assign]
    return threads


@pytest.mark.parametrize("codec", ["none", "zstd"])
async def test_frames_decode_off_the_loop_from_a_size_that_depends_on_inflating(
    codec: str,
) -> None:
    worker, learner = await authenticated_pair()
    for session in (worker, learner):
        session.compress(codec)
    threads = decoding_threads(worker)
    # Random floats: zstd barely shrinks them, so the frame is about 256 KiB either way.
    values = np.random.default_rng(0).random(2**16).astype(np.float32)
    message = Weights(version=2, arrays={"w": values}, epsilon=None)
    assert OFF_LOOP_INFLATING_BYTES <= len(learner.encode(message)) < OFF_LOOP_BYTES
    await learner.send(message)
    got = await worker.receive(timeout=60, operation="weights")
    assert isinstance(got, Weights) and got.version == 2
    np.testing.assert_array_equal(got.arrays["w"], values)
    # Off the loop only where the connection inflates: there a frame this size may be many.
    on_loop = threads == [threading.main_thread()]
    assert on_loop == (codec == "none"), threads
