"""Gradient mode on a worker: sample at the broadcast point and report, round after round."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aps.gradients import GradientSampler
from aps.messages import (
    ErrorReport,
    GradientReport,
    GradientRound,
    GradientsStopped,
    Message,
    StopGradients,
)
from aps.session import Session

__all__ = ["serve_rounds"]


async def serve_rounds(
    session: Session,
    first: GradientRound,
    make_sampler: Callable[[], GradientSampler],
    *,
    heartbeat_timeout: float,
    compute_delay: float = 0.0,
    comm_delay: float = 0.0,
) -> None:
    """Sample and report gradients until the learner stops gradient mode.

    A reader task moves the learner's messages into a queue so that new rounds are seen
    between env steps; each new round replaces the current one at once. A round the sampler
    cannot start (``make_sampler`` or the round itself is bad) is reported to the learner as
    an error, and the worker waits for the next one.

    Args:
        session: the learner's session.
        first: the round that started gradient mode.
        make_sampler: builds the sampler, once, on the first round.
        heartbeat_timeout: how long the learner may be silent.
        compute_delay: seconds to sleep after every env step (a slower machine, simulated).
        comm_delay: seconds to sleep before sending each report (a slower link, simulated).

    Raises:
        TransportError | Timeout | ProtocolError: the session failed.
    """
    inbox: asyncio.Queue[Message | BaseException] = asyncio.Queue()
    reader = asyncio.create_task(_read_until_stop(session, inbox, heartbeat_timeout))
    sampler: GradientSampler | None = None
    message: Message | BaseException = first
    try:
        while True:
            if isinstance(message, BaseException):
                raise message
            if isinstance(message, StopGradients):
                await session.send(GradientsStopped())
                return
            sampling = False
            if isinstance(message, GradientRound):
                try:
                    sampler = sampler or make_sampler()
                    sampler.start(message)
                    sampling = True
                except Exception as exc:  # the learner hears why; the next round may do
                    await session.send(ErrorReport.of(exc))
            while sampling and sampler is not None and inbox.empty():
                report = _sample(sampler)
                if isinstance(report, ErrorReport):
                    await session.send(report)
                    break
                if report is not None:
                    if comm_delay:
                        await asyncio.sleep(comm_delay)
                    await session.send(report)
                # Simulated slowness (heterogeneous workers); also lets the reader run.
                await asyncio.sleep(compute_delay)
            message = await inbox.get()
    finally:
        reader.cancel()
        await asyncio.wait([reader])


def _sample(sampler: GradientSampler) -> GradientReport | ErrorReport | None:
    try:
        return sampler.step()
    except Exception as exc:
        return ErrorReport.of(exc)


async def _read_until_stop(
    session: Session, inbox: asyncio.Queue[Message | BaseException], heartbeat_timeout: float
) -> None:
    while True:
        try:
            message = await session.receive(timeout=heartbeat_timeout, operation="the next round")
        except Exception as exc:
            inbox.put_nowait(exc)
            return
        inbox.put_nowait(message)
        if isinstance(message, StopGradients):
            return
