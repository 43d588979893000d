"""Gradient mode on a worker: sum gradients locally at the broadcast point, send the sum once.

Each :class:`~aps.wire.messages.GradientRound` starts a round: the worker samples trajectories at
the round's point and adds their gradients ``g_H`` to a local sum. Only the count travels
while the round runs (:class:`~aps.wire.messages.GradientProgress`, a few bytes, whenever it
grows), so that the learner can apply its aggregation rule; when the rule is met the learner
sends :class:`~aps.wire.messages.CollectGradients` and the worker sends its sum, once, as a
:class:`~aps.wire.messages.GradientReport`, then waits for the next round. Under all-reduce
aggregation the learner sends :class:`~aps.wire.messages.ReduceGradients` instead: the worker puts
its sum into one gloo all-reduce with the learner and the other workers
(:func:`~aps.gradients.allreduce_sum`, in a thread) and answers
:class:`~aps.wire.messages.GradientsReduced`, with its count and returns only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from aps.gradients import allreduce_sum, in_own_thread
from aps.session import Session
from aps.wire.messages import (
    CollectGradients,
    ErrorReport,
    GradientProgress,
    GradientReport,
    GradientRound,
    GradientsReduced,
    GradientsStopped,
    Message,
    ReduceGradients,
    StopGradients,
)
from aps.worker.sampling import GradientSampler

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

    def reduced(self) -> GradientsReduced:
        """What the worker answers once its sum went into the all-reduce."""
        return GradientsReduced(
            round=self.round,
            count=self.count,
            episode_return=np.asarray(self._returns, dtype=np.float64),
        )

    def vector(self, point: Mapping[str, Any], request: ReduceGradients) -> np.ndarray[Any, Any]:
        """This worker's part of an all-reduce (see :class:`~aps.wire.messages.ReduceGradients`).

        The sum (or mean) is flattened in the order of ``point``, the round's arrays, with
        zeros for parameters that got no gradient; the count goes into this rank's slot.

        Raises:
            ValueError: a gradient the point does not name, or a length other than the
                learner's ``size``.
        """
        unknown = sorted(set(self._sums) - set(point))
        if unknown:
            raise ValueError(f"gradients {unknown} are not parameters of round {self.round}")
        parts = []
        for name, array in point.items():
            shape = np.shape(array)
            part = self._sums.get(name)
            parts.append(np.zeros(int(np.prod(shape))) if part is None else part.reshape(-1))
        flat = np.concatenate(parts) if parts else np.zeros(0)
        if flat.size != request.size:
            raise ValueError(
                f"this worker's gradient has {flat.size} entries, the learner's layout "
                f"{request.size}; the learner and the workers must build the same policy"
            )
        if request.mean and self.count:
            flat = flat / self.count
        counts = np.zeros(request.world_size - 1)
        counts[request.rank - 1] = self.count
        return np.concatenate([flat, counts]).astype(np.float32)


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
    current: GradientRound | None = None
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
                current = message
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
            elif isinstance(message, ReduceGradients):
                if summed is None or summed.round != message.round:
                    summed = RoundSum(message.round)  # nothing of that round here
                if comm_delay:
                    await asyncio.sleep(comm_delay)
                point = current.arrays if current and current.round == message.round else {}
                await session.send(await _reduce(session, summed, point, message))
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


async def _reduce(
    session: Session, summed: RoundSum, point: Mapping[str, Any], request: ReduceGradients
) -> GradientsReduced | ErrorReport:
    """Run this worker's part of the round's all-reduce, in a thread (gloo blocks)."""
    try:
        if not point and summed.count:
            raise ValueError(f"round {request.round} is not the round this worker sampled")
        vector = summed.vector(point, request) if point else _zeros(request)
        host = request.host or urlsplit(session.peer).hostname or "127.0.0.1"
        await in_own_thread(
            allreduce_sum,
            vector=vector,
            host=host,
            port=request.port,
            prefix=request.prefix,
            rank=request.rank,
            world_size=request.world_size,
            timeout=request.timeout,
        )
    except Exception as exc:  # the learner hears why; its own part fails too
        return ErrorReport.of(exc)
    return summed.reduced()


def _zeros(request: ReduceGradients) -> np.ndarray[Any, Any]:
    return np.zeros(request.size + request.world_size - 1, dtype=np.float32)


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
