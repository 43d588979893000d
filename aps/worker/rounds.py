"""Gradient mode on a worker: sum gradients locally at the broadcast point, send the sum once.

Each :class:`~aps.messages.GradientRound` starts a round: the worker samples trajectories at
the round's point and adds their gradients ``g_H`` to a local sum. Only the count travels
while the round runs (:class:`~aps.messages.GradientProgress`, a few bytes, whenever it
grows), so that the learner can apply its aggregation rule; when the rule is met the learner
sends :class:`~aps.messages.CollectGradients` and the worker sends its sum, once, as a
:class:`~aps.messages.GradientReport`, then waits for the next round.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np

from aps.gradients import GradientSampler
from aps.messages import (
    CollectGradients,
    ErrorReport,
    GradientProgress,
    GradientReport,
    GradientRound,
    GradientsStopped,
    Message,
    StopGradients,
)
from aps.session import Session

__all__ = ["RoundSum", "serve_rounds"]


class RoundSum:
    """The gradients one worker summed in one round: the sum by name, the count, the returns.

    Sums accumulate in float64 and are sent in each parameter's own dtype.
    """

    def __init__(self, round_id: int) -> None:
        self.round = round_id
        self.count = 0
        self._sums: dict[str, np.ndarray[Any, Any]] = {}
        self._dtypes: dict[str, np.dtype[Any]] = {}
        self._returns: list[float] = []

    def add(self, report: GradientReport) -> None:
        """Add the gradients of one sampler report (of this round)."""
        for name, array in report.gradient.items():
            values = np.asarray(array)
            self._dtypes.setdefault(name, values.dtype)
            if name in self._sums:
                self._sums[name] += values
            else:
                self._sums[name] = values.astype(np.float64)
        self.count += report.count
        self._returns.extend(float(r) for r in np.asarray(report.episode_return).reshape(-1))

    def report(self) -> GradientReport:
        """The sum as one report (an empty gradient when nothing was summed)."""
        return GradientReport(
            round=self.round,
            gradient={n: s.astype(self._dtypes[n]) for n, s in self._sums.items()},
            count=self.count,
            episode_return=np.asarray(self._returns, dtype=np.float64),
        )


async def serve_rounds(
    session: Session,
    first: GradientRound,
    make_sampler: Callable[[], GradientSampler],
    *,
    heartbeat_timeout: float,
    compute_delay: float = 0.0,
    comm_delay: float = 0.0,
) -> None:
    """Sample, sum and report gradients round after round until the learner stops gradient mode.

    A reader task moves the learner's messages into a queue so that new rounds and requests
    for the sum are seen between env steps; each new round replaces the current one at once
    (its partial sum is dropped). A round the sampler cannot start (``make_sampler`` or the
    round itself is bad) is reported to the learner as an error, and the worker waits for the
    next one. A request for the sum of a round this worker is not sampling is answered with
    an empty report, so the learner never waits on it.

    Args:
        session: the learner's session.
        first: the round that started gradient mode.
        make_sampler: builds the sampler, once, on the first round.
        heartbeat_timeout: how long the learner may be silent.
        compute_delay: seconds to sleep after every env step (a slower machine, simulated).
        comm_delay: seconds to sleep before sending each round's sum (a slower link,
            simulated: charged once per aggregation).

    Raises:
        TransportError | Timeout | ProtocolError: the session failed.
    """
    inbox: asyncio.Queue[Message | BaseException] = asyncio.Queue()
    reader = asyncio.create_task(_read_until_stop(session, inbox, heartbeat_timeout))
    sampler: GradientSampler | None = None
    summed: RoundSum | None = None
    message: Message | BaseException = first
    try:
        while True:
            if isinstance(message, BaseException):
                raise message
            if isinstance(message, StopGradients):
                await session.send(GradientsStopped())
                return
            if isinstance(message, GradientRound):
                summed = None
                try:
                    sampler = sampler or make_sampler()
                    sampler.start(message)
                    summed = RoundSum(message.round)
                except Exception as exc:  # the learner hears why; the next round may do
                    await session.send(ErrorReport.of(exc))
            elif isinstance(message, CollectGradients):
                if summed is None or summed.round != message.round:
                    summed = RoundSum(message.round)  # nothing of that round here
                if comm_delay:
                    await asyncio.sleep(comm_delay)
                await session.send(summed.report())
                summed = None
            while summed is not None and sampler is not None and inbox.empty():
                report = _sample(sampler)
                if isinstance(report, ErrorReport):
                    await session.send(report)
                    summed = None
                    break
                if report is not None:
                    summed.add(report)
                    await session.send(GradientProgress(round=summed.round, count=summed.count))
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
