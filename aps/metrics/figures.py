"""The figures a learner keeps of its run: per worker and in total, cumulative, as plain data.

:class:`WorkerMetrics` is one worker's record, which the learner adds to as frames arrive;
:class:`Metrics` is a snapshot of all of them with the learner's own figures
(:attr:`aps.Learner.metrics`). Every count and time is cumulative since the learner started
(a worker's since it joined), so two snapshots give the figures of the time between them:
``later.since(earlier)`` is that window, and its rates (:meth:`Metrics.rates`) are what a
progress line, the live view (``aps top``) and the verdict (:func:`aps.metrics.verdict`)
read.

Where each figure is measured (``docs/observability.md`` says what each means):

- On the worker, and carried in the answers and chunks it sends anyway (three float32 numbers
  in one field, never a message of their own): the time its envs took, its policy's forward passes
  (DETACH), and encoding its answers (compression included).
- On the learner, per connection: bytes each way on the wire and at their full size (before
  compression and frame delta), the time spent decoding the worker's frames, the heartbeat
  round trip, and in lockstep the time from each request to the worker's answer.
- On the learner, in total: its process's CPU time, the time lockstep calls waited for their
  slowest worker, and the chunks waiting for the training loop (DETACH).

This module is plain data with no I/O: it imports nothing from aps.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DIVERGENCE_HISTORY", "Metrics", "WorkerMetrics"]

DIVERGENCE_HISTORY = 1000
"""How many recent divergence values each worker's metrics keep."""

_COUNTERS = (
    "syncs",
    "weight_bytes",
    "transitions",
    "lag_sum",
    "chunks",
    "dropped_chunks",
    "resumes",
    "stalls",
    "env_steps",
    "answers",
    "env_seconds",
    "inference_seconds",
    "encode_seconds",
    "wait_seconds",
    "slowest",
    "bytes_received",
    "bytes_received_raw",
    "bytes_sent",
    "bytes_sent_raw",
    "decode_seconds",
)
"""The cumulative fields of :class:`WorkerMetrics`: what :meth:`WorkerMetrics.since` subtracts."""


@dataclass(slots=True)
class WorkerMetrics:
    """One worker's figures: synchronization and staleness, time, and traffic.

    Counts and times are cumulative since the worker joined; times are in seconds.

    Attributes:
        worker_id: the worker.
        version: the policy version the worker holds (-1: none yet).
        syncs: weight messages sent to it, the first deployment included.
        weight_bytes: bytes of weight arrays sent to it.
        divergences: the most recent divergence values measured for it (KL of its version
            against the learner's, mean over states), oldest first.
        transitions: env transitions received from it in chunks (DETACH).
        lag_sum: sum over those transitions of their policy lag (learner version minus
            behaviour version).
        lag_max: the largest lag of any of them.
        chunks: chunks received from it.
        dropped_chunks: chunks that arrived after their stream was closed and were discarded.
        resumes: times the worker's connection dropped and it came back into its session (a
            worker that comes back without its session joins as a new worker).
        stalled: the worker is at least ``STALL_LAG`` versions behind, and every sync
            decision since it last got weights measured its divergence and declined: the
            pattern of a threshold it can never cross (see :mod:`aps.sync`). Cleared when it
            is synced.
        stalls: times it was found stalled.
        env_steps: env-steps it made: each lockstep step counts its ``E`` envs, each DETACH
            chunk its ``T x E`` transitions (resets are not steps).
        answers: answers that carried its own timings (steps, resets, chunks).
        env_seconds: time its envs took to reset and step, as the worker measured it.
        inference_seconds: time its policy's forward passes took (DETACH), as it measured it.
        encode_seconds: time it took to encode (and compress) its answers; for chunks, the
            acting loop's own work of packing them too (its time outside envs and policy).
        wait_seconds: the time calls that asked every worker (lockstep resets, steps and
            env calls) spent waiting for this worker's answer once the answers before it (in
            env order) were in: over the workers, a call's whole wait. A worker whose answer
            was there by then adds about nothing.
        slowest: calls that asked every worker in which its answer came last, so the call
            waited for it (the last worker the call waited for, as above).
        bytes_received: bytes of its frames on the wire.
        bytes_received_raw: the same with compressed and frame-delta arrays counted at their
            full size (equal to ``bytes_received`` without compression).
        bytes_sent: bytes of the learner's frames to it on the wire (a weights frame shared
            by many workers counts for each).
        bytes_sent_raw: the same with compressed arrays counted at their full size (a frame
            encoded once for many workers, weights, counts at its wire size).
        decode_seconds: the learner's time decoding its frames.
        rtt: the latest heartbeat round trip, learner to worker and back, the worker's and
            the learner's loops included (``None`` until one was measured). A ping goes with
            a heartbeat, which goes only where the learner has sent nothing for a heartbeat
            interval, and only while it reads the connection (so that the pong is timed as it
            arrives): in DETACH streams, all along; in lockstep, only within a call that
            waits that long, and then the worker answers once its step is done.
    """

    worker_id: int
    version: int = -1
    syncs: int = 0
    weight_bytes: int = 0
    divergences: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=DIVERGENCE_HISTORY)
    )
    transitions: int = 0
    lag_sum: int = 0
    lag_max: int = 0
    chunks: int = 0
    dropped_chunks: int = 0
    resumes: int = 0
    stalled: bool = False
    stalls: int = 0
    env_steps: int = 0
    answers: int = 0
    env_seconds: float = 0.0
    inference_seconds: float = 0.0
    encode_seconds: float = 0.0
    wait_seconds: float = 0.0
    slowest: int = 0
    bytes_received: int = 0
    bytes_received_raw: int = 0
    bytes_sent: int = 0
    bytes_sent_raw: int = 0
    decode_seconds: float = 0.0
    rtt: float | None = None

    @property
    def lag_mean(self) -> float:
        """Mean policy lag per transition (0 before any transition)."""
        return self.lag_sum / self.transitions if self.transitions else 0.0

    def snapshot(self) -> WorkerMetrics:
        """An independent copy."""
        copy = dataclasses.replace(self, divergences=collections.deque(maxlen=DIVERGENCE_HISTORY))
        copy.divergences.extend(self.divergences)
        return copy

    def since(self, earlier: WorkerMetrics | None) -> WorkerMetrics:
        """The figures of the time since ``earlier`` (a snapshot of this worker, or ``None``).

        Counters and times are differences; the rest (version, lag_max, stalled, rtt,
        divergences) are this snapshot's.
        """
        copy = self.snapshot()
        if earlier is not None:
            for name in _COUNTERS:
                setattr(copy, name, getattr(self, name) - getattr(earlier, name))
        return copy

    def as_dict(self) -> dict[str, Any]:
        """Every figure as plain numbers, for logs and JSON.

        With ``lag_mean``, and the last and largest kept divergence instead of the history.
        """
        return {
            "worker_id": self.worker_id,
            "version": self.version,
            **{name: getattr(self, name) for name in _COUNTERS},
            "lag_mean": self.lag_mean,
            "lag_max": self.lag_max,
            "divergence_last": self.divergences[-1] if self.divergences else None,
            "divergence_max": max(self.divergences, default=None),
            "stalled": self.stalled,
            "rtt": self.rtt,
        }


def _total(workers: tuple[WorkerMetrics, ...], name: str) -> Any:
    return sum(getattr(w, name) for w in workers)


@dataclass(frozen=True, slots=True, kw_only=True)
class Metrics:
    """A learner's figures at one moment: per worker, in total, and its own.

    Build the figures of a window with :meth:`since`; read rates with :meth:`rates`.
    """

    version: int
    """The learner's newest policy version (0 before the first publish)."""
    workers: tuple[WorkerMetrics, ...]
    """Each worker's figures; workers that were replaced keep theirs, before the others."""
    taken_at: float = 0.0
    """When the snapshot was taken (``time.monotonic()``, seconds)."""
    uptime: float = 0.0
    """Seconds since the learner started (in a window: the window's length)."""
    cpu_seconds: float = 0.0
    """CPU time of the learner's process, all its threads (``time.process_time()``)."""
    lockstep_calls: int = 0
    """Calls that asked every worker and waited for every answer: lockstep resets, steps and
    env calls, and DETACH's ``rollout()``."""
    lockstep_wait_seconds: float = 0.0
    """Time those calls waited, from their first request sent to their last answer."""
    queue_depth: int = 0
    """Chunks received and not yet taken by the training loop (DETACH), now."""
    chunk_wait_seconds: float = 0.0
    """Time the training loop waited inside chunk streams (``chunks()``) for the next chunk:
    the rest of a stream's time is the loop's own (training, mostly)."""

    def since(self, earlier: Metrics | None) -> Metrics:
        """The figures of the time from ``earlier`` to this snapshot.

        Counters and times become differences (``uptime`` the window's length); a worker
        that joined meanwhile counts from zero. With ``earlier=None``, the whole run.
        """
        if earlier is None:
            return self
        before = {w.worker_id: w for w in earlier.workers}
        return dataclasses.replace(
            self,
            workers=tuple(w.since(before.get(w.worker_id)) for w in self.workers),
            uptime=self.taken_at - earlier.taken_at,
            cpu_seconds=self.cpu_seconds - earlier.cpu_seconds,
            lockstep_calls=self.lockstep_calls - earlier.lockstep_calls,
            lockstep_wait_seconds=self.lockstep_wait_seconds - earlier.lockstep_wait_seconds,
            chunk_wait_seconds=self.chunk_wait_seconds - earlier.chunk_wait_seconds,
        )

    @property
    def syncs(self) -> int:
        """Weight messages sent, all workers."""
        return int(_total(self.workers, "syncs"))

    @property
    def weight_bytes(self) -> int:
        """Bytes of weight arrays sent, all workers."""
        return int(_total(self.workers, "weight_bytes"))

    @property
    def transitions(self) -> int:
        """Transitions received in chunks, all workers."""
        return int(_total(self.workers, "transitions"))

    @property
    def env_steps(self) -> int:
        """Env-steps of all workers (see :attr:`WorkerMetrics.env_steps`)."""
        return int(_total(self.workers, "env_steps"))

    @property
    def bytes_received(self) -> int:
        """Bytes from all workers, on the wire."""
        return int(_total(self.workers, "bytes_received"))

    @property
    def bytes_sent(self) -> int:
        """Bytes to all workers, on the wire."""
        return int(_total(self.workers, "bytes_sent"))

    @property
    def lag_mean(self) -> float:
        """Mean policy lag per transition, all workers."""
        total = self.transitions
        return _total(self.workers, "lag_sum") / total if total else 0.0

    @property
    def lag_max(self) -> int:
        """Largest policy lag of any transition."""
        return max((w.lag_max for w in self.workers), default=0)

    @property
    def stalled(self) -> tuple[int, ...]:
        """Ids of the workers stalled now (see :attr:`WorkerMetrics.stalled`)."""
        return tuple(w.worker_id for w in self.workers if w.stalled)

    def rates(self) -> dict[str, float]:
        """Per second of :attr:`uptime`: env-steps, bytes each way, and the learner's CPU share.

        Meant for a window (:meth:`since`); on a whole run they are the run's averages. Keys:
        ``env_steps``, ``bytes_received``, ``bytes_sent``, ``cpu`` (CPU seconds per second:
        1.0 is one core busy). All 0 in a window of no length.
        """
        span = self.uptime
        if not span > 0:
            return dict.fromkeys(("env_steps", "bytes_received", "bytes_sent", "cpu"), 0.0)
        return {
            "env_steps": self.env_steps / span,
            "bytes_received": self.bytes_received / span,
            "bytes_sent": self.bytes_sent / span,
            "cpu": self.cpu_seconds / span,
        }

    def as_dict(self) -> dict[str, Any]:
        """Totals, the learner's figures and each worker's, as plain numbers for logs and JSON.

        Each worker's entry is its :meth:`WorkerMetrics.as_dict`.
        """
        return {
            "version": self.version,
            "taken_at": self.taken_at,
            "uptime": self.uptime,
            "cpu_seconds": self.cpu_seconds,
            "lockstep_calls": self.lockstep_calls,
            "lockstep_wait_seconds": self.lockstep_wait_seconds,
            "queue_depth": self.queue_depth,
            "chunk_wait_seconds": self.chunk_wait_seconds,
            "syncs": self.syncs,
            "weight_bytes": self.weight_bytes,
            "transitions": self.transitions,
            "env_steps": self.env_steps,
            "bytes_received": self.bytes_received,
            "bytes_sent": self.bytes_sent,
            "lag_mean": self.lag_mean,
            "lag_max": self.lag_max,
            "stalled": list(self.stalled),
            "rates": self.rates(),
            "workers": [w.as_dict() for w in self.workers],
        }

    def scalars(self) -> dict[str, float]:
        """Flat ``name: number`` pairs for scalar sinks (TensorBoard, CSV, Prometheus).

        Totals and the learner's figures under their own names (``env_steps``,
        ``cpu_seconds``, ``rates/env_steps``, ...), each worker's under
        ``worker/<id>/<name>``. Figures not measured yet (a ``None`` divergence or round
        trip) are left out; nothing is ``NaN``.
        """
        flat: dict[str, float] = {}
        for key, value in self.as_dict().items():
            if key == "workers":
                for worker in value:
                    prefix = f"worker/{worker['worker_id']}/"
                    for name, item in worker.items():
                        if name != "worker_id":
                            _put(flat, prefix + name, item)
            elif key == "rates":
                for name, item in value.items():
                    _put(flat, f"rates/{name}", item)
            elif key != "stalled":
                _put(flat, key, value)
        flat["stalled"] = float(len(self.stalled))
        return flat


def _put(flat: dict[str, float], name: str, value: Any) -> None:
    if value is None or isinstance(value, str):
        return
    number = float(value)
    if math.isfinite(number):
        flat[name] = number
