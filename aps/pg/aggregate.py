"""Gradient aggregation rules: when does a round end, and what is its gradient.

A round collects gradients measured at one broadcast point. Workers report gradient *sums*
with their *counts* (a worker may sum several trajectory gradients ``g_H`` before reporting)
and the round id of the point they used. A rule is a frozen dataclass holding only its
parameters; :meth:`~AggregationRule.start` gives a fresh mutable :class:`Round` that the driver
owns and feeds, one call per arriving report::

    round_ = rule.start(round_id, workers, size=layout.size)
    for each report (worker_id, round_id, grad_sum, count), as it arrives:
        round_.add(worker_id, round_id, grad_sum, count)
        if round_.done:
            g = round_.result()       # then broadcast the next point and start the next round
    on losing a worker: round_.remove(worker_id), then check round_.can_finish

Built-ins:

- :class:`Rennala` (homogeneous environments): the first ``batch`` gradients from whichever
  workers finish; the pooled mean. Slow workers are never waited for.
- :class:`Malenia` (heterogeneous environments): at least one gradient from every worker and
  a harmonic mean of the per-worker counts of at least ``batch / n``; the mean of per-worker
  means, so every worker weighs the same whatever its speed.
- :class:`Synchronous` (the synchronized baseline): the first report of every worker; the
  pooled mean. With :class:`~aps.pg.NIGT`'s per-round aggregation a worker's report is its
  whole sum for the round, so fast workers contribute what they sampled while waiting.

A driver that moves only counts during a round (the networked trainer, the simulator) feeds
:meth:`Round.note` with each worker's running count, asks for the sums once
:attr:`Round.ready`, and wraps their :meth:`Round.add` calls in
:meth:`Round.begin_collection` / :meth:`Round.end_collection` so that every sum collected
is aggregated. A driver that all-reduces the sums instead (``aggregation="allreduce"``) hands
the round the reduced vector and the per-worker counts in one :meth:`Round.add_reduced`
call; each worker puts in its sum, or its mean when :attr:`Round.reduces_means`.

Rules common to all rounds:

- A report whose round id differs from the round's is never aggregated; ``add`` returns
  ``False`` and counts its gradients in :attr:`Round.discarded` and :attr:`Round.stale`.
- Once :attr:`Round.done` is ``True`` the round is closed and its result is fixed: later
  reports are discarded (``add`` returns ``False``) and ``remove`` changes no figure but the
  list of removed workers.
- Only the driver's mistakes raise: an unknown worker id, a count that is not an int ``>= 1``,
  a gradient of the wrong shape or with a non-finite entry (:class:`~aps.errors.ConfigError`),
  and :meth:`Round.result` before the round is done (:class:`~aps.errors.InvalidState`).

Losing a worker mid-round (:meth:`Round.remove`): :class:`Rennala` and :class:`Synchronous`
keep the gradients it already sent (every finished trajectory is a valid sample of the one
objective) and carry on with the others. :class:`Malenia` drops them and carries on as if the
round had started without the worker: the estimate then weighs the remaining workers' objectives
only, which changes the objective being optimized. Each rule says so in
:attr:`~AggregationRule.survives_worker_loss`; a driver raises :class:`~aps.errors.WorkerLost`
when it is ``False`` and the user has not allowed training on without the worker, and whenever
:attr:`Round.can_finish` turns ``False`` (no worker left).

Pure code: no event loop, no clock; arrays are numpy float64 vectors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar, Protocol, TypeGuard, runtime_checkable

import numpy as np
import numpy.typing as npt

from aps.errors import ConfigError, InvalidState

__all__ = [
    "AggregationRule",
    "Malenia",
    "MaleniaRound",
    "Rennala",
    "RennalaRound",
    "Round",
    "Synchronous",
    "SynchronousRound",
]

FloatVector = npt.NDArray[np.float64]


def _is_int(value: object) -> TypeGuard[int | np.integer[Any]]:
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def _check_batch(owner: str, value: object) -> None:
    if not _is_int(value) or value < 1:
        raise ConfigError(f"{owner}(batch=...) must be an int >= 1, got {value!r}")


class Round(ABC):
    """The mutable state of one aggregation round; the driver owns it, the rule made it.

    Subclasses decide when the round is done and what its gradient is (:meth:`_is_done`,
    :meth:`_estimate`), which current reports of an active worker they take (:meth:`_wants`),
    and what removing a worker does to its gradients (:attr:`_keep_removed`). Everything else
    (validation, stale reports, closing, figures) is shared here.

    Attributes:
        round_id: the id reports must carry to be aggregated.
        workers: the workers the round started with, in the order given.
        size: the gradient length, or ``None`` until the first accepted report fixes it.
    """

    _keep_removed: ClassVar[bool] = True
    reduces_means: ClassVar[bool] = False
    """Whether, in an all-reduce (:meth:`add_reduced`), each worker puts in its mean
    (sum / count) rather than its sum: ``True`` for :class:`Malenia`'s mean of means."""

    def __init__(self, round_id: int, workers: Sequence[int], *, size: int | None = None) -> None:
        if not _is_int(round_id):
            raise ConfigError(f"round_id must be an int, got {round_id!r}")
        ids = tuple(workers)
        if not ids:
            raise ConfigError("a round needs at least one worker, got none")
        for worker in ids:
            if not _is_int(worker):
                raise ConfigError(f"worker ids must be ints, got {worker!r} in {ids}")
        if len(set(ids)) != len(ids):
            raise ConfigError(f"worker ids must be unique, got {ids}")
        if size is not None and (not _is_int(size) or size < 1):
            raise ConfigError(f"size must be None or an int >= 1, got {size!r}")
        self.round_id = int(round_id)
        self.workers: tuple[int, ...] = tuple(int(worker) for worker in ids)
        self.size = None if size is None else int(size)
        self._sums: dict[int, FloatVector] = {}
        self._counts: dict[int, int] = dict.fromkeys(self.workers, 0)
        self._removed: list[int] = []
        self._discarded = 0
        self._stale = 0
        self._reports = 0
        self._result: FloatVector | None = None
        # Gradients a worker announced (GradientProgress) whose sum has not arrived yet.
        self._noted: dict[int, int] = {}
        self._collecting = False
        # The all-reduced vector (sums, or per-worker means), when the round was reduced.
        self._reduced: FloatVector | None = None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(round_id={self.round_id}, done={self.done}, "
            f"used={self.used}, discarded={self.discarded}, active={list(self.active)})"
        )

    # -- figures -------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """Whether the stop rule held; then the round is closed and :meth:`result` is ready."""
        return self._result is not None

    @property
    def active(self) -> tuple[int, ...]:
        """The workers still in the round (started with, not removed), in order."""
        return tuple(worker for worker in self.workers if worker not in self._removed)

    @property
    def removed(self) -> tuple[int, ...]:
        """The workers removed from this round, in the order they were removed."""
        return tuple(self._removed)

    @property
    def missing(self) -> tuple[int, ...]:
        """Active workers that have not contributed a gradient yet (what a round waits on)."""
        return tuple(worker for worker in self.active if self._counts[worker] == 0)

    @property
    def can_finish(self) -> bool:
        """``False`` when the round is not done and no worker is left to finish it."""
        return self.done or bool(self.active)

    @property
    def contributions(self) -> dict[int, int]:
        """Gradients each worker contributed to the result, for every starting worker.

        A worker whose gradients were dropped (by :class:`Malenia` on removal) shows ``0``.
        The values sum to :attr:`used`.
        """
        return dict(self._counts)

    @property
    def used(self) -> int:
        """Gradients (trajectories, counting a report of count ``k`` as ``k``) aggregated."""
        return sum(self._counts.values())

    @property
    def discarded(self) -> int:
        """Gradients refused or dropped, counting a report of count ``k`` as ``k``.

        Stale reports, late ones (after the round closed), reports from a removed worker,
        surplus reports (:class:`Synchronous`), and gradients dropped on removal
        (:class:`Malenia`).
        """
        return self._discarded

    @property
    def stale(self) -> int:
        """The part of :attr:`discarded` whose round id was not this round's."""
        return self._stale

    @property
    def reports(self) -> int:
        """Reports aggregated (each may carry several gradients)."""
        return self._reports

    # -- events --------------------------------------------------------------------------

    def add(self, worker_id: int, round_id: int, grad_sum: npt.ArrayLike, count: int) -> bool:
        """Offer one report: a sum of ``count`` gradients measured at round ``round_id``'s point.

        The report is aggregated when its round id is this round's, the worker is still in
        the round, the round is not closed, and the rule wants it (:class:`Synchronous` takes
        one report per worker). Otherwise it is discarded: counted in :attr:`discarded` (and
        in :attr:`stale` when the round id differs) and otherwise ignored. The array is
        copied, never kept.

        Args:
            worker_id: one of :attr:`workers`.
            round_id: the round id of the point the gradients were measured at.
            grad_sum: the sum of the ``count`` gradients, a 1-d real vector of :attr:`size`
                entries (float32 is fine; it is accumulated in float64).
            count: how many gradients the sum holds, an int ``>= 1``.

        Returns:
            ``True`` when the report was aggregated, ``False`` when it was discarded.

        Raises:
            ConfigError: an unknown worker, a count that is not an int ``>= 1``, a gradient
                that is not a 1-d real vector of the right length, or one with a non-finite
                entry. These are checked for every report, stale or not; nothing changes.
        """
        if not _is_int(worker_id) or int(worker_id) not in self._counts:
            raise ConfigError(
                f"report from worker {worker_id!r}, which is not in round {self.round_id} "
                f"(workers {list(self.workers)}); start each round with every worker"
            )
        if not _is_int(count) or count < 1:
            raise ConfigError(
                f"report from worker {worker_id} has count {count!r}; "
                "a count is the number of gradients summed, an int >= 1"
            )
        vector = self._check_gradient(int(worker_id), grad_sum)
        worker, n = int(worker_id), int(count)
        if round_id != self.round_id:
            self._discarded += n
            self._stale += n
            return False
        if self.done or worker in self._removed or not self._wants(worker):
            self._discarded += n
            return False
        if self.size is None:
            self.size = int(vector.shape[0])
        if worker in self._sums:
            self._sums[worker] += vector
        else:
            self._sums[worker] = np.array(vector, dtype=np.float64, copy=True)
        self._counts[worker] += n
        self._noted.pop(worker, None)
        self._reports += 1
        self._close_if_done()
        return True

    def add_reduced(self, round_id: int, reduced: npt.ArrayLike, counts: Mapping[int, int]) -> bool:
        """Take the round's gradients as one all-reduced vector, once, instead of :meth:`add`.

        ``reduced`` is the sum over the workers of their gradient sums, or of their means
        (sum / count, zero for a count of 0) when :attr:`reduces_means`; ``counts`` gives
        each worker's count. Workers with a count of 0, removed workers and a stale round id
        contribute nothing; a stale or closed round discards every count, as :meth:`add`.

        Returns:
            ``True`` when aggregated, ``False`` when discarded.

        Raises:
            ConfigError: an unknown or removed worker with a count, a count that is not an
                int ``>= 0``, or a vector of the wrong shape or with a non-finite entry.
            InvalidState: the round already took gradients (by :meth:`add` or an earlier
                :meth:`add_reduced`): sums and means cannot be mixed afterwards.
        """
        checked: dict[int, int] = {}
        for worker, count in counts.items():
            if not _is_int(worker) or int(worker) not in self._counts:
                raise ConfigError(
                    f"reduced count of worker {worker!r}, which is not in round "
                    f"{self.round_id} (workers {list(self.workers)})"
                )
            if not _is_int(count) or count < 0:
                raise ConfigError(
                    f"reduced count {count!r} of worker {worker}; a count is the number of "
                    "gradients summed, an int >= 0"
                )
            checked[int(worker)] = int(count)
        vector = self._check_gradient("the all-reduce", reduced)
        total = sum(checked.values())
        if round_id != self.round_id or self.done:
            self._discarded += total
            self._stale += total if round_id != self.round_id else 0
            return False
        if self._reduced is not None or self._sums:
            raise InvalidState(
                f"round {self.round_id} already took gradients; add_reduced() is called once "
                "per round, instead of add()"
            )
        if self.size is None:
            self.size = int(vector.shape[0])
        gone = [w for w, c in checked.items() if c and w in self._removed]
        if gone:
            raise ConfigError(
                f"removed workers {gone} contributed to round {self.round_id}'s reduced "
                "vector, which cannot be split; reduce over the active workers only"
            )
        taken = False
        for worker, count in checked.items():
            if count == 0:
                continue
            self._counts[worker] += count
            self._noted.pop(worker, None)
            self._reports += 1
            taken = True
        self._reduced = np.array(vector, dtype=np.float64, copy=True)
        self._close_if_done()
        return taken

    @property
    def ready(self) -> bool:
        """Whether the stop rule holds over the gradients aggregated *and* those announced.

        A driver that moves only counts during a round (:meth:`note`) asks every worker for
        its sum once this is ``True``; the round is :attr:`done` when the sums are added.
        """
        if self.done:
            return True
        counts = dict(self._counts)
        for worker, count in self._noted.items():
            counts[worker] += count
        return bool(self.active) and self._holds(counts)

    def note(self, worker_id: int, round_id: int, count: int) -> bool:
        """Note that a worker holds ``count`` gradients of ``round_id``, summed, not sent yet.

        The count replaces the worker's previous one (a worker announces its running total
        since its last sum); :meth:`add` of the worker's sum clears it. Only :attr:`ready`
        uses it: nothing is aggregated until the sum arrives.

        Returns:
            ``True`` when noted, ``False`` when ignored: a stale round id, a closed round, a
            removed worker.

        Raises:
            ConfigError: an unknown worker, or a count that is not an int ``>= 0``.
        """
        if not _is_int(worker_id) or int(worker_id) not in self._counts:
            raise ConfigError(
                f"progress from worker {worker_id!r}, which is not in round {self.round_id} "
                f"(workers {list(self.workers)}); start each round with every worker"
            )
        if not _is_int(count) or count < 0:
            raise ConfigError(
                f"progress from worker {worker_id} has count {count!r}; "
                "a count is the number of gradients summed, an int >= 0"
            )
        worker = int(worker_id)
        if round_id != self.round_id or self.done or worker in self._removed:
            return False
        self._noted[worker] = int(count)
        return True

    def begin_collection(self) -> None:
        """Hold the round open while the workers' sums arrive (call once :attr:`ready`).

        A sum may hold more gradients than its worker announced (it kept sampling until
        asked), so the rule may hold before every sum is in; the round takes them all and
        closes at :meth:`end_collection`.
        """
        self._collecting = True

    def end_collection(self) -> None:
        """Close the round if the rule holds, once every awaited sum arrived.

        Also forgets the announced counts: a round that must be sampled again (a worker was
        removed meanwhile) is announced afresh.
        """
        self._collecting = False
        self._noted.clear()
        if self.active:
            self._close_if_done()

    def remove(self, worker_id: int) -> None:
        """Take a worker that died out of the round.

        Its later reports are discarded. Before the round closes, what happens to the
        gradients it already sent depends on the rule (kept by :class:`Rennala` and
        :class:`Synchronous`, dropped into :attr:`discarded` by :class:`Malenia`), and the
        stop rule is checked again over the remaining workers (removing the last worker a
        :class:`Synchronous` round waits on closes it). After the round closed, the result
        stays as it is. Removing a worker twice is a no-op.

        Check :attr:`can_finish` afterwards: with no worker left an open round never ends.

        Raises:
            ConfigError: the worker is not one of :attr:`workers`.
        """
        if not _is_int(worker_id) or int(worker_id) not in self._counts:
            raise ConfigError(
                f"cannot remove worker {worker_id!r}: it is not in round {self.round_id} "
                f"(workers {list(self.workers)})"
            )
        worker = int(worker_id)
        if worker in self._removed:
            return
        self._removed.append(worker)
        self._noted.pop(worker, None)
        if self.done:
            return
        if not self._keep_removed and self._counts[worker]:
            self._discarded += self._counts[worker]
            self._counts[worker] = 0
            self._sums.pop(worker, None)
        if self.active:
            self._close_if_done()

    def result(self) -> FloatVector:
        """The round's aggregated gradient, fixed when the round closed.

        Returns:
            A read-only float64 vector (the same array on every call; copy it to modify).

        Raises:
            InvalidState: the round is not done yet; the message says what it waits for.
        """
        if self._result is None:
            raise InvalidState(
                f"round {self.round_id} is not done: {self._progress()}; "
                "call result() only once done is True"
            )
        return self._result

    # -- rule hooks ----------------------------------------------------------------------

    def _wants(self, worker: int) -> bool:
        """Whether a current-round report from this active worker is aggregated."""
        return True

    def _is_done(self) -> bool:
        """Whether the stop rule holds now (called after every change while open)."""
        return self._holds(self._counts)

    @abstractmethod
    def _holds(self, counts: dict[int, int]) -> bool:
        """Whether the stop rule holds with these gradient counts per worker."""

    @abstractmethod
    def _estimate(self) -> FloatVector:
        """The round's gradient, a fresh float64 vector (called once, when it closes)."""

    def _progress(self) -> str:
        return f"{self.used} gradients so far"

    # -- helpers -------------------------------------------------------------------------

    def _contributors(self) -> list[int]:
        """Workers whose gradients are in the result, in starting order."""
        return [worker for worker in self.workers if self._counts[worker] > 0]

    def _pooled_mean(self) -> FloatVector:
        contributors = self._contributors()
        total = np.zeros_like(self._sums[contributors[0]])
        for worker in contributors:
            total += self._sums[worker]
        total /= sum(self._counts[worker] for worker in contributors)
        return total

    def _estimate_reduced(self, reduced: FloatVector) -> FloatVector:
        """The round's gradient from an all-reduced vector (default: the pooled mean)."""
        result: FloatVector = reduced / self.used
        return result

    def _close_if_done(self) -> None:
        if self._result is None and not self._collecting and self._is_done():
            if self._reduced is not None:
                result = self._estimate_reduced(self._reduced)
            else:
                result = self._estimate()
            result.setflags(write=False)
            self._result = result

    def _check_gradient(self, worker: int | str, grad_sum: npt.ArrayLike) -> FloatVector:
        source = f"worker {worker}" if isinstance(worker, int) else worker
        array = np.asarray(grad_sum)
        if array.dtype.kind not in "biuf":
            raise ConfigError(
                f"gradient from {source} has dtype {array.dtype}, not a real number type"
            )
        expected = f"({self.size},)" if self.size is not None else "a 1-d vector"
        if array.ndim != 1 or (self.size is not None and array.shape[0] != self.size):
            raise ConfigError(
                f"gradient from {source} has shape {array.shape}, expected {expected}; "
                "flatten gradients with the layout of the weights"
            )
        if array.shape[0] == 0:
            raise ConfigError(f"gradient from {source} is empty")
        if not np.isfinite(array).all():
            raise ConfigError(
                f"gradient from {source} has a non-finite entry; "
                "check its rewards and policy for overflow"
            )
        return np.asarray(array, dtype=np.float64)


class RennalaRound(Round):
    """A :class:`Rennala` round: done at ``batch`` gradients in total, from anyone."""

    def __init__(
        self, round_id: int, workers: Sequence[int], *, batch: int, size: int | None = None
    ) -> None:
        super().__init__(round_id, workers, size=size)
        self.batch = batch

    def _holds(self, counts: dict[int, int]) -> bool:
        return sum(counts.values()) >= self.batch

    def _estimate(self) -> FloatVector:
        return self._pooled_mean()

    def _progress(self) -> str:
        return f"{self.used} of {self.batch} gradients"


class MaleniaRound(Round):
    """A :class:`Malenia` round: done when the harmonic mean of the counts reaches batch/n.

    Every active worker must have contributed at least once; the result is the mean of
    per-worker means.
    """

    _keep_removed = False
    reduces_means = True

    def __init__(
        self, round_id: int, workers: Sequence[int], *, batch: int, size: int | None = None
    ) -> None:
        super().__init__(round_id, workers, size=size)
        self.batch = batch

    @property
    def harmonic_mean(self) -> float:
        """``((1/n) sum_i 1/M_i)^-1`` over the active workers; ``0.0`` while one has none."""
        counts = [self._counts[worker] for worker in self.active]
        if not counts or min(counts) == 0:
            return 0.0
        return float(len(counts) / sum(Fraction(1, c) for c in counts))

    def _holds(self, per_worker: dict[int, int]) -> bool:
        counts = [per_worker[worker] for worker in self.active]
        if not counts or min(counts) == 0:
            return False
        # ((1/n) sum 1/M_i)^-1 >= M/n  <=>  n^2 >= M sum 1/M_i, exactly in rationals.
        n = len(counts)
        return n * n >= self.batch * sum(Fraction(1, c) for c in counts)

    def _estimate(self) -> FloatVector:
        active = self.active
        total = np.zeros_like(self._sums[active[0]])
        for worker in active:
            total += self._sums[worker] / self._counts[worker]
        total /= len(active)
        return total

    def _estimate_reduced(self, reduced: FloatVector) -> FloatVector:
        result: FloatVector = reduced / len(self.active)
        return result

    def _progress(self) -> str:
        missing = self.missing
        if missing:
            return f"workers {list(missing)} have not contributed yet"
        n = len(self.active)
        return (
            f"the harmonic mean of the counts is {self.harmonic_mean:.4g}, "
            f"below batch/n = {self.batch}/{n}"
        )


class SynchronousRound(Round):
    """A :class:`Synchronous` round: the first report of every active worker."""

    def __init__(
        self, round_id: int, workers: Sequence[int], *, share: int = 1, size: int | None = None
    ) -> None:
        super().__init__(round_id, workers, size=size)
        self.share = share

    def _wants(self, worker: int) -> bool:
        # Reports until the share is met (the first one only, with the default share of 1).
        return self._counts[worker] < self.share

    def _holds(self, counts: dict[int, int]) -> bool:
        share = self.share
        return all(counts[worker] >= share for worker in self.active) and sum(counts.values()) > 0

    def _estimate(self) -> FloatVector:
        return self._pooled_mean()

    def _progress(self) -> str:
        return f"workers {list(self.missing)} have not reported yet"


@runtime_checkable
class AggregationRule(Protocol):
    """Starts rounds; a frozen object holding only parameters, safe to share.

    Any object with these two members is a rule. Subclass :class:`Round` for a new stop
    rule or estimator.
    """

    @property
    def survives_worker_loss(self) -> bool:
        """Whether removing a worker mid-run leaves the training objective unchanged.

        ``True`` for rules whose workers all sample one objective (Rennala, Synchronous):
        fewer workers only means fewer gradients. ``False`` for Malenia, whose objective is
        the mean of the workers' objectives: a driver should raise
        :class:`~aps.errors.WorkerLost` unless the user allowed training on without the
        worker.
        """
        ...

    def start(self, round_id: int, workers: Sequence[int], *, size: int | None = None) -> Round:
        """A fresh round over ``workers`` (the ones the point was broadcast to).

        Args:
            round_id: the id the broadcast point carries; reports tagged otherwise are stale.
            workers: the worker ids, unique, at least one.
            size: the gradient length, checked on every report; ``None`` lets the first
                accepted report fix it.

        Raises:
            ConfigError: no workers, duplicate or non-int ids, a non-int round id or a bad
                size.
        """
        ...


@dataclass(frozen=True, slots=True)
class Rennala:
    """Rennala aggregation (homogeneous environments): the first ``batch`` gradients.

    Accepts gradients from any worker, in any proportion; the round ends as soon as the
    total count reaches ``batch`` (a report of count ``k`` counts ``k`` gradients and is taken
    whole, so the total may exceed ``batch``). Result: the pooled mean,
    ``sum of all gradient sums / total count``. Fast workers contribute more, which is right
    when every worker samples the same objective, and slow workers are never waited for.

    Removing a worker keeps the gradients it sent; the round finishes with the others.

    Args:
        batch: ``M``, the number of gradients (trajectories) per round, an int ``>= 1``. The
            paper's grid is ``{20, 30, 50}``, the same for the initial round.

    Raises:
        ConfigError: ``batch`` is not an int ``>= 1``.
    """

    batch: int
    survives_worker_loss: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _check_batch("Rennala", self.batch)
        object.__setattr__(self, "batch", int(self.batch))

    def start(
        self, round_id: int, workers: Sequence[int], *, size: int | None = None
    ) -> RennalaRound:
        """A fresh round (see :meth:`AggregationRule.start`)."""
        return RennalaRound(round_id, workers, batch=self.batch, size=size)


@dataclass(frozen=True, slots=True)
class Malenia:
    """Malenia aggregation (heterogeneous environments): every worker weighs the same.

    Keeps a gradient sum ``s_i`` and a count ``M_i`` per worker. The round ends when every
    active worker contributed at least once and the harmonic mean of the counts reaches
    ``batch / n``::

        ((1/n) sum_i 1/M_i)^-1 >= batch / n      (checked exactly, in rationals)

    with ``n`` the number of active workers. Result: the mean of per-worker means,
    ``(1/n) sum_i s_i / M_i``, an unbiased estimate of the gradient of the average objective
    ``(1/n) sum_i J_i`` however unequal the counts. With equal counts it equals the pooled
    mean (:class:`Rennala`'s estimate). With ``batch <= n`` the round ends as soon as every
    worker contributed once.

    Removing a worker drops the gradients it sent (into :attr:`Round.discarded`) and the round
    continues over the remaining workers, as if it had started without it; this changes the
    objective, hence :attr:`survives_worker_loss` is ``False``.

    Args:
        batch: ``M``, an int ``>= 1``; with ``n`` equally fast workers a round takes about
            ``M/n`` gradients from each.

    Raises:
        ConfigError: ``batch`` is not an int ``>= 1``.
    """

    batch: int
    survives_worker_loss: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _check_batch("Malenia", self.batch)
        object.__setattr__(self, "batch", int(self.batch))

    def start(
        self, round_id: int, workers: Sequence[int], *, size: int | None = None
    ) -> MaleniaRound:
        """A fresh round (see :meth:`AggregationRule.start`)."""
        return MaleniaRound(round_id, workers, batch=self.batch, size=size)


@dataclass(frozen=True, slots=True)
class Synchronous:
    """The synchronized baseline: wait for one report from every worker.

    Takes the first current-round report of each worker and discards its later ones (so a
    worker that keeps sampling, as under :class:`Rennala`, gives exactly one report). The
    round ends when every active worker reported. Result: the pooled mean
    ``sum of gradient sums / total count``; when every report holds one gradient, as in the
    paper's synchronized NIGT (``M = n``, one per worker), that is the average of the ``n``
    gradients.

    Removing a worker keeps its report if it sent one; the round then waits only for the
    others (removing the last worker it waited on closes it).

    Args:
        share: ``None`` (the default): the round ends when every worker has at least one
            gradient, and takes each worker's first report whole, however many gradients it
            holds (a fast worker keeps sampling until asked). An int ``k >= 1``: the paper's
            minibatch NIGT, where each worker computes a fixed share of the batch
            (``M = k n``): the round waits until every worker noted or reported ``k``
            gradients, takes a worker's reports until they hold ``k``, and
            :func:`aps.learner.simulate.simulate` stops each worker at exactly ``k`` (it idles),
            so a round takes ``max_i k h_i``. The networked trainer does not stop its
            workers at ``k``: a worker's sum may hold more, and is taken whole.

    Raises:
        ConfigError: ``share`` is not ``None`` or an int ``>= 1``.
    """

    share: int | None = None
    survives_worker_loss: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.share is not None:
            if not _is_int(self.share) or self.share < 1:
                raise ConfigError(
                    f"Synchronous(share=...) must be None or an int >= 1, got {self.share!r}"
                )
            object.__setattr__(self, "share", int(self.share))

    def start(
        self, round_id: int, workers: Sequence[int], *, size: int | None = None
    ) -> SynchronousRound:
        """A fresh round (see :meth:`AggregationRule.start`)."""
        return SynchronousRound(round_id, workers, share=self.share or 1, size=size)
