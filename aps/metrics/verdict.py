"""What bounds a run: the envs, inference, the wire, the learner, or one slow worker.

:func:`verdict` reads a window of a learner's figures (``later.since(earlier)``, see
:mod:`aps.metrics.figures`) and names the part the run waits for, with a line that gives the
numbers it decided on::

    earlier = learner.metrics
    ...                                    # a few seconds of the run
    print(verdict(learner.metrics.since(earlier)))
    # env-bound: the learner waits for workers 88% of its time, and envs take 91% of ...

The rule, in order:

Too little data
    ``unknown`` when the window is shorter than :data:`MIN_WINDOW` (0.5 s), when no lockstep
    call reached the workers and no chunk arrived in it, and, past the learner's own test
    below, when no answer in it carried the workers' timings.

Lockstep (the window holds more lockstep calls than chunks)
    The learner's time splits into waiting inside lockstep calls (``lockstep_wait_seconds``,
    from a call's first request to its last answer) and the rest: its own loop, choosing
    actions, training, anything between calls. A call waits for the answer that comes last,
    so the workers' figures are read through ``slowest`` (the calls each answered last): the
    env time of the answer a call waited for is each worker's env time per answer
    (``env_seconds / answers``) weighted by the calls it answered last.

    1. ``learner`` when the waits are under :data:`WAIT_SHARE` (half) of the window: the
       workers answer faster than the learner asks.
    2. ``straggler`` (``worker`` names it) when, with two workers or more, one answered last
       in more than :data:`STRAGGLER_CALLS` (half) of the calls, its env time per answer is
       at least :data:`STRAGGLER_RATIO` (1.5) times the median of the other workers', and its
       envs take at least :data:`ENV_SHARE` (half) of a call's wait: its envs are what the
       calls wait for, and the others' are faster.
    3. ``env`` when the envs take at least :data:`ENV_SHARE` (half) of a call's wait
       (``lockstep_wait_seconds / lockstep_calls``).
    4. Else ``wire``: the rest of a call's wait is the network both ways, encoding and
       decoding, and the worker's own loop around its envs. The line gives the bytes each
       way, the compression and the heartbeat round trip, and names a worker that answered
       last in most calls (one slow link looks so).

    Only the learner's own clock times a call: per-worker ``wait_seconds`` are not read, so
    the verdict holds however a call's wait is shared out among its workers.

DETACH (chunks)
    Workers act on their own, so their time decides: a worker is busy while its envs step,
    its policy acts and it encodes a chunk (``env_seconds + inference_seconds +
    encode_seconds``), and otherwise idle, waiting for a request or for its chunk to leave.
    The busy share is the mean over the workers that answered, of busy time over the window.

    1. Busy at least :data:`BUSY_SHARE` (half) of the window: the workers are the bound, and
       the largest part of their busy time names it: ``env``, ``inference``, or ``wire`` for
       encoding.
    2. Idle most of the window: the learner holds them back (``learner``) when it waits for
       chunks for under :data:`WAIT_SHARE` of the window: inside ``rollout()`` calls (a
       rollout asks every worker and waits for every chunk, and counts with the lockstep
       calls: the window's chunks came from rollouts where its calls times its workers reach
       its chunks) or inside a chunk stream (``chunk_wait_seconds``); when chunks
       wait for its training loop (``queue_depth`` above 0 at the window's end), or when its
       process uses at least :data:`LEARNER_CPU` (0.8) of a core (receiving, decoding,
       training).
    3. Else ``wire``: neither side is busy, so requests and chunks spend the time in transit.

The thresholds are deliberately coarse: a verdict is meant for the runs where one part
dominates, and a run near a threshold is bound by both sides about equally, which the shares
show.

This module is plain data with no I/O: it imports only :mod:`aps.metrics.figures`.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from aps.metrics.figures import Metrics, WorkerMetrics

__all__ = [
    "BUSY_SHARE",
    "ENV_SHARE",
    "LEARNER_CPU",
    "MIN_WINDOW",
    "STRAGGLER_CALLS",
    "STRAGGLER_RATIO",
    "WAIT_SHARE",
    "Bound",
    "Verdict",
    "verdict",
]

Bound = Literal["env", "inference", "wire", "learner", "straggler", "unknown"]
"""What a run waits for (see :func:`verdict` for each)."""

MIN_WINDOW = 0.5
"""Seconds: a shorter window gives ``unknown`` (a few calls say little on a busy host)."""

WAIT_SHARE = 0.5
"""Lockstep: the learner is the bound when its calls wait for workers less than this share of
the window."""

STRAGGLER_CALLS = 0.5
"""Lockstep: a straggler answered last in more than this share of the calls."""

STRAGGLER_RATIO = 1.5
"""Lockstep: a straggler's env time per answer is at least this many times the other
workers' median."""

ENV_SHARE = 0.5
"""Lockstep: the envs are the bound when they take at least this share of a call's wait (the
answer it waited for); the wire when they take less."""

BUSY_SHARE = 0.5
"""DETACH: workers busy at least this share of the window are the bound."""

LEARNER_CPU = 0.8
"""DETACH: CPU seconds per second of the learner's process at which idle workers are the
learner's doing (with no chunk waiting for it)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    """What bounds the run in a window of its figures; ``str(verdict)`` is :attr:`line`."""

    bound: Bound
    """What the run waits for: ``env``, ``inference``, ``wire``, ``learner``, ``straggler``
    (one worker, :attr:`worker`), or ``unknown`` (too little data; :attr:`line` says why)."""
    worker: int | None = None
    """The straggler's worker id (``None`` for every other bound)."""
    line: str
    """One line for a person: the bound and the figures that say so."""
    shares: dict[str, float] = field(default_factory=dict)
    """The fractions the verdict was decided on, each in ``[0, 1]``.

    Lockstep, of the learner's time: ``learner`` (its own loop) and ``workers`` (its waits for
    them) add up to 1, and ``env`` and ``wire`` split ``workers`` as the answers it waited for
    were split (both 0 when no answer carried the workers' timings). DETACH, of the workers'
    time (they add up to 1): ``env``, ``inference``, ``encode`` and ``idle``. Empty when
    ``unknown``.
    """

    def __str__(self) -> str:
        return self.line


def verdict(window: Metrics) -> Verdict:
    """What bounds the run in ``window``, by the rule of this module's docstring.

    Args:
        window: figures of a stretch of the run, ``later.since(earlier)`` (a whole run's
            snapshot works too: its averages since the learner started).

    Returns:
        The bound, the straggler where there is one, the line and the shares.
    """
    span = window.uptime
    if not span >= MIN_WINDOW:
        return _unknown(
            f"the window is {span:.2f} s long; a verdict needs at least {MIN_WINDOW} s "
            "(take the two snapshots further apart)"
        )
    chunks = sum(w.chunks for w in window.workers)
    if window.lockstep_calls == 0 and chunks == 0:
        return _unknown(
            f"no lockstep call reached the workers and no chunk arrived in this {span:.1f} s window"
        )
    timed = [w for w in window.workers if w.answers > 0]
    if window.lockstep_calls > chunks:
        return _lockstep(window, timed)
    if not timed:
        return _untimed(span)
    return _detach(window, timed)


def _unknown(why: str) -> Verdict:
    return Verdict(bound="unknown", line=f"unknown: {why}")


def _untimed(span: float) -> Verdict:
    return _unknown(f"no answer in this {span:.1f} s window carried the workers' timings")


def _lockstep(window: Metrics, timed: list[WorkerMetrics]) -> Verdict:
    span = window.uptime
    calls = window.lockstep_calls
    wait = _clamp(window.lockstep_wait_seconds / span)
    per_call = window.lockstep_wait_seconds / calls
    # The answer a call waited for is its last: weight each worker by the calls it answered
    # last (evenly where none was counted).
    weights = [float(w.slowest) for w in timed]
    if not any(weights):
        weights = [1.0] * len(timed)
    env = min(_weighted([w.env_seconds / w.answers for w in timed], weights), per_call)
    share = env / per_call if timed and per_call > 0 else None
    shares = _waits(wait, share)
    if wait < WAIT_SHARE:
        return Verdict(
            bound="learner",
            line=(
                f"learner-bound: the learner waits for workers only {_pct(wait)} of its time "
                f"({_time(per_call)} a call, {calls} calls); its own loop between calls takes "
                f"{_pct(1 - wait)} (its process uses {_cpu(window.cpu_seconds / span)})"
            ),
            shares=shares,
        )
    if share is None:
        return _untimed(span)
    last = _last(timed, calls)
    head = f"the learner waits for workers {_pct(wait)} of its time"
    if last is not None:
        own = last.env_seconds / last.answers
        others = statistics.median(w.env_seconds / w.answers for w in timed if w is not last)
        if own >= STRAGGLER_RATIO * others and own >= ENV_SHARE * per_call:
            return Verdict(
                bound="straggler",
                worker=last.worker_id,
                line=(
                    f"straggler: worker {last.worker_id} answered last in "
                    f"{_pct(last.slowest / calls)} of the calls; its envs take {_time(own)} an "
                    f"answer, the other workers' {_time(others)} (median); {head} "
                    f"({_time(per_call)} a call)"
                ),
                shares=shares,
            )
    head += ", and envs take"
    if share >= ENV_SHARE:
        steps = sum(w.env_steps for w in timed)
        per_step = sum(w.env_seconds for w in timed) / steps if steps else 0.0
        return Verdict(
            bound="env",
            line=(
                f"env-bound: {head} {_pct(share)} of each call's wait ({_time(env)} of "
                f"{_time(per_call)}; {_time(per_step)} an env-step); the wire and encoding the "
                f"other {_pct(1 - share)}"
            ),
            shares=shares,
        )
    line = (
        f"wire-bound: {head} only {_pct(share)} of each call's wait ({_time(env)} of "
        f"{_time(per_call)}); the rest is the wire both ways and encoding ({_coding(timed)}); "
        f"{_traffic(window)}"
    )
    if last is not None:
        line += (
            f"; worker {last.worker_id} answered last in {_pct(last.slowest / calls)} of the calls"
        )
    return Verdict(bound="wire", line=line, shares=shares)


def _last(workers: list[WorkerMetrics], calls: int) -> WorkerMetrics | None:
    """The worker that answered last in most calls, with two workers or more, or ``None``."""
    if len(workers) < 2:
        return None
    last = max(workers, key=lambda w: w.slowest)
    return last if last.slowest > STRAGGLER_CALLS * calls else None


def _detach(window: Metrics, timed: list[WorkerMetrics]) -> Verdict:
    span = window.uptime
    seconds = {
        "env": sum(w.env_seconds for w in timed),
        "inference": sum(w.inference_seconds for w in timed),
        "encode": sum(w.encode_seconds for w in timed),
    }
    # Of the workers' time: the mean over the workers that answered of each part's share.
    parts = {name: _clamp(total / span / len(timed)) for name, total in seconds.items()}
    busy = _clamp(sum(parts.values()))
    shares = {**parts, "idle": 1 - busy}
    if busy >= BUSY_SHARE:
        largest = max(parts, key=lambda name: parts[name])
        bound: Bound = "wire" if largest == "encode" else "env" if largest == "env" else "inference"
        steps = sum(w.env_steps for w in timed)
        per_step = f" ({_time(seconds[largest] / steps)} an env-step)" if steps else ""
        rest = ", ".join(f"{_NAMES[name]} {_pct(parts[name])}" for name in parts if name != largest)
        return Verdict(
            bound=bound,
            line=(
                f"{bound}-bound: workers are busy {_pct(busy)} of the time: "
                f"{_NAMES[largest]} {_pct(parts[largest])}{per_step}, {rest}"
            ),
            shares=shares,
        )
    cpu = window.cpu_seconds / span
    idle = f"workers are busy only {_pct(busy)} of the time"
    calls = window.lockstep_calls
    chunks = sum(w.chunks for w in timed)
    rollouts = calls * len(timed) >= chunks
    streamed = window.chunk_wait_seconds > 0
    waited = window.chunk_wait_seconds + (window.lockstep_wait_seconds if rollouts else 0.0)
    wait = _clamp(waited / span)
    if (rollouts or streamed) and wait < WAIT_SHARE:
        # rollout() asks every worker and waits for every chunk, a stream waits for the next
        # one: the learner's time outside those waits is its own loop (training, mostly),
        # which the idle workers wait for.
        how = f"{calls} rollouts" if rollouts else "a chunk stream"
        return Verdict(
            bound="learner",
            line=(
                f"learner-bound: {idle}, and the learner waits for their chunks only "
                f"{_pct(wait)} of its time ({how}); its own loop between them takes "
                f"{_pct(1 - wait)} (its process uses {_cpu(cpu)})"
            ),
            shares={**shares, "wait": wait},
        )
    waiting = window.queue_depth
    if waiting > 0:
        return Verdict(
            bound="learner",
            line=(
                f"learner-bound: {idle} and {_chunks(waiting)} for the training loop; the "
                f"learner's process uses {_cpu(cpu)}"
            ),
            shares=shares,
        )
    if cpu >= LEARNER_CPU:
        decode = sum(w.decode_seconds for w in window.workers) / span
        return Verdict(
            bound="learner",
            line=(
                f"learner-bound: {idle} and no chunk waits for the training loop, but the "
                f"learner's process uses {_cpu(cpu)} (decoding {_pct(_clamp(decode))} of the "
                "time, the rest receiving and training)"
            ),
            shares=shares,
        )
    return Verdict(
        bound="wire",
        line=(
            f"wire-bound: {idle}, no chunk waits for the training loop and the learner's "
            f"process uses {_cpu(cpu)}: requests and chunks spend the time in transit "
            f"({_traffic(window)})"
        ),
        shares=shares,
    )


_NAMES = {"env": "envs", "inference": "inference", "encode": "encoding"}


def _waits(wait: float, env: float | None) -> dict[str, float]:
    """Lockstep shares of the learner's time; ``env``: the envs' share of the waits, if known."""
    if env is None:
        return {"learner": 1 - wait, "workers": wait, "env": 0.0, "wire": 0.0}
    return {"learner": 1 - wait, "workers": wait, "env": wait * env, "wire": wait * (1 - env)}


def _coding(workers: Sequence[WorkerMetrics]) -> str:
    answers = sum(w.answers for w in workers)
    encode = sum(w.encode_seconds for w in workers) / answers
    decode = sum(w.decode_seconds for w in workers) / answers
    return f"encoding {_time(encode)}, decoding {_time(decode)} an answer"


def _traffic(window: Metrics) -> str:
    """Bytes each way per second, the compression where there was any, the round trip."""
    rates = window.rates()
    inbound = f"{_rate(rates['bytes_received'])} in"
    received = window.bytes_received
    raw = sum(w.bytes_received_raw for w in window.workers)
    if received > 0 and raw > received:
        inbound += f" ({raw / received:.1f}x compressed)"
    text = f"{inbound}, {_rate(rates['bytes_sent'])} out"
    trips = [w.rtt for w in window.workers if w.rtt is not None]
    if trips:
        text += f"; round trip {_time(statistics.median(trips))}"
    return text


def _weighted(values: Sequence[float], weights: Sequence[float]) -> float:
    total = sum(weights)
    return sum(v * w for v, w in zip(values, weights, strict=True)) / total if total else 0.0


def _clamp(share: float) -> float:
    return min(max(share, 0.0), 1.0)


def _pct(share: float) -> str:
    return f"{share:.0%}"


def _time(seconds: float) -> str:
    """Three significant figures, in ms below a second: 0.45 ms, 12.0 ms, 250 ms, 1.20 s."""
    if seconds >= 1:
        return f"{seconds:.2f} s"
    ms = seconds * 1e3
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.1f} ms" if ms >= 10 else f"{ms:.2f} ms"


def _cpu(per_second: float) -> str:
    return f"{per_second:.0%} of a core" if per_second < 1.5 else f"{per_second:.1f} cores"


def _rate(per_second: float) -> str:
    if per_second >= 1e6:
        return f"{per_second / 1e6:.1f} MB/s"
    if per_second >= 1e3:
        return f"{per_second / 1e3:.1f} kB/s"
    return f"{per_second:.0f} B/s"


def _chunks(count: int) -> str:
    return "1 chunk waits" if count == 1 else f"{count} chunks wait"
