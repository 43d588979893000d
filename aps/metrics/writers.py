"""Writing a learner's figures to files as the run goes: CSV, JSON lines and TensorBoard.

Each writer takes :class:`~aps.metrics.Metrics` snapshots (:attr:`aps.Learner.metrics`) one
at a time and writes everything in them, plus the figures of the *window* since its previous
write (the first window runs from the learner's start):

- ``window/seconds``: the window's length;
- ``window/env_steps_per_second``, ``window/bytes_received_per_second``,
  ``window/bytes_sent_per_second``: env-steps and wire bytes per second in the window;
- ``window/cpu_seconds_per_second``: the learner process's CPU seconds per second in the
  window (1.0 is one core busy).

The snapshot's own ``rates/...`` figures are averages over the whole run; the window's show
the run now. :class:`MetricsLogger` paces the writes so that a training loop can ask every
iteration::

    with aps.metrics.MetricsLogger(learner, [aps.metrics.CSVWriter("figures.csv")]) as log:
        for update in range(updates):
            ...
            log.tick()  # writes when 10 s passed since the last write

Writers work in the thread that calls them and read nothing of the learner themselves.
"""

from __future__ import annotations

import csv
import importlib
import json
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from aps._base._resource import Resource
from aps.errors import ConfigError, InvalidState, MissingDependency
from aps.metrics.figures import Metrics, WorkerMetrics

if TYPE_CHECKING:
    from aps.cluster_env import ClusterEnv
    from aps.learner import Learner

__all__ = [
    "CSVWriter",
    "JSONLinesWriter",
    "MetricsLogger",
    "MetricsWriter",
    "TensorBoardWriter",
    "window_rates",
]

_RATE_NAMES = {"cpu": "cpu_seconds_per_second"}
"""Window names of :meth:`Metrics.rates` keys that are not ``<key>_per_second``."""

_WORKER_FIELDS = tuple(name for name in WorkerMetrics(worker_id=0).as_dict() if name != "worker_id")
"""A worker's figures under ``worker/<id>/``, measured or not yet (the CSV's columns)."""


def window_rates(metrics: Metrics, previous: Metrics | None) -> dict[str, float]:
    """The figures of the window from ``previous`` to ``metrics``: its length and its rates.

    Keys (without the ``window/`` prefix the writers give them): ``seconds``, and each of
    :meth:`Metrics.rates` per second (``env_steps_per_second``, ...,
    ``cpu_seconds_per_second``). With ``previous=None`` the window is the whole run.
    """
    window = metrics.since(previous)
    figures = {"seconds": window.uptime}
    for name, value in window.rates().items():
        figures[_RATE_NAMES.get(name, f"{name}_per_second")] = value
    return figures


class MetricsWriter(Protocol):
    """Where :class:`MetricsLogger` sends snapshots: anything with ``write`` and ``close``.

    The writers here are also context managers that close on leaving the block.
    """

    def write(self, metrics: Metrics) -> None:
        """Write one snapshot (and the window since this writer's previous one)."""
        ...

    def close(self) -> None:
        """Flush and release the file; idempotent. Writing afterwards raises InvalidState."""
        ...


class _Writer(Resource, MetricsWriter):
    """The part every writer shares: the previous snapshot, closing, the context manager."""

    _previous: Metrics | None = None
    _closed: bool = False

    def _window(self, metrics: Metrics) -> dict[str, float]:
        """The window since this writer's previous snapshot, which ``metrics`` now becomes."""
        if self._closed:
            raise InvalidState(f"this {type(self).__name__} is closed; make a new one to write")
        figures = window_rates(metrics, self._previous)
        self._previous = metrics
        return figures

    def close(self) -> None:
        """Flush and release the file; idempotent."""
        self._closed = True


class CSVWriter(_Writer):
    """A CSV file of one row per snapshot, one column per figure.

    The columns: ``time`` (Unix seconds), every :meth:`Metrics.scalars` figure, and the
    window's (``window/...``). The file is created anew (an existing one is replaced).

    The header is the names of the first snapshot, each worker with all its figures
    (``worker/<id>/rtt`` before a round trip was measured too: an empty cell). A worker that
    joins later brings new columns: the header then grows, and the file is rewritten once
    with those columns added at the end, empty in the earlier rows. So every row has every
    column, and ``csv.DictReader`` or ``pandas.read_csv`` read the whole file as one table; a
    rewrite costs one pass over the file and happens only as workers join. Each row is
    flushed as it is written.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        """The file written."""
        self._file = self.path.open("w", newline="", encoding="utf-8")
        self._columns: list[str] = []

    def write(self, metrics: Metrics) -> None:
        """Append a row for ``metrics``; new names add columns (see the class)."""
        window = self._window(metrics)
        row: dict[str, Any] = {"time": time.time(), **metrics.scalars()}
        row.update((f"window/{name}", value) for name, value in window.items())
        names = [*row]
        for worker in metrics.workers:
            names += (f"worker/{worker.worker_id}/{name}" for name in _WORKER_FIELDS)
        known = set(self._columns)
        new = list(dict.fromkeys(name for name in names if name not in known))
        if new:
            self._add_columns(new)
        csv.DictWriter(self._file, self._columns, restval="").writerow(row)
        self._file.flush()

    def _add_columns(self, new: list[str]) -> None:
        """Extend the header by ``new``: rewrite the file with them, empty in earlier rows."""
        first = not self._columns
        self._columns += new
        if first:
            csv.writer(self._file).writerow(self._columns)
            return
        self._file.close()
        # Written beside the file and renamed over it, so a crash leaves the old file whole.
        spare = self.path.with_name(self.path.name + ".new")
        with (
            self.path.open(newline="", encoding="utf-8") as old,
            spare.open("w", newline="", encoding="utf-8") as out,
        ):
            rows = csv.reader(old)
            writer = csv.writer(out)
            next(rows)  # the old header
            writer.writerow(self._columns)
            padding = [""] * len(new)
            writer.writerows(row + padding for row in rows)
        os.replace(spare, self.path)
        self._file = self.path.open("a", newline="", encoding="utf-8")

    def close(self) -> None:
        """Close the file; idempotent."""
        super().close()
        self._file.close()


class JSONLinesWriter(_Writer):
    """A file of one JSON object per line and snapshot.

    Each object: ``time`` (Unix seconds), every figure of :meth:`Metrics.as_dict` (the
    workers' as a list, figures not measured yet as ``null``), and ``window``: the window's
    figures (:func:`window_rates`, without the prefix). The file is created anew; each line
    is flushed as it is written.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        """The file written."""
        self._file = self.path.open("w", encoding="utf-8")

    def write(self, metrics: Metrics) -> None:
        """Append the line of ``metrics``."""
        window = self._window(metrics)
        line = {"time": time.time(), **metrics.as_dict(), "window": window}
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file; idempotent."""
        super().close()
        self._file.close()


class TensorBoardWriter(_Writer):
    """TensorBoard scalars of each snapshot, on the env-steps axis.

    Every :meth:`Metrics.scalars` figure is written as ``aps/<name>``, the window's as
    ``aps/window/<name>``. The step axis is the run's env-steps (:attr:`Metrics.env_steps`,
    all workers), so the curves line up with training curves logged per env-step; the wall
    time of each point is when it was written. Uses ``torch.utils.tensorboard``, or
    ``tensorboardX`` where torch is absent.

    Args:
        logdir: the run's directory (TensorBoard's ``--logdir`` or one below it); the event
            file is written there.

    Raises:
        MissingDependency: neither ``torch.utils.tensorboard`` (with ``tensorboard``) nor
            ``tensorboardX`` can be imported.
    """

    def __init__(self, logdir: str | os.PathLike[str]) -> None:
        self.logdir = Path(logdir)
        """Where the event file is written."""
        self._summary: Any = _summary_writer_class()(log_dir=str(self.logdir))

    def write(self, metrics: Metrics) -> None:
        """Add the scalars of ``metrics`` at step ``metrics.env_steps`` and flush them."""
        window = self._window(metrics)
        step = metrics.env_steps
        for name, value in metrics.scalars().items():
            self._summary.add_scalar(f"aps/{name}", value, global_step=step)
        for name, value in window.items():
            self._summary.add_scalar(f"aps/window/{name}", value, global_step=step)
        self._summary.flush()

    def close(self) -> None:
        """Flush and close the event file; idempotent."""
        if not self._closed:
            self._summary.close()
        super().close()


def _summary_writer_class() -> Any:
    """TensorBoard's ``SummaryWriter``: torch's, else tensorboardX's."""
    failures = []
    for module in ("torch.utils.tensorboard", "tensorboardX"):
        try:
            return importlib.import_module(module).SummaryWriter
        except ImportError as exc:
            failures.append(f"{module}: {exc}")
    raise MissingDependency(
        "TensorBoardWriter needs torch.utils.tensorboard (torch with the tensorboard package) "
        f"or tensorboardX, and neither imports ({'; '.join(failures)}); install the "
        "metrics extra with pip install 'aps-rl[metrics]'"
    )


class MetricsLogger(Resource):
    """Writes a learner's snapshot to writers at most once per ``interval`` seconds.

    Meant to be called every iteration of a training loop: :meth:`tick` reads the clock and
    returns at once unless ``interval`` seconds passed since the last write (the first tick
    writes). Leaving a ``with`` block, or :meth:`close`, writes a last snapshot and closes
    the writers, so the end of the run is in every file.

    Args:
        source: where snapshots come from: an :class:`aps.Learner`, an :class:`aps.ClusterEnv`
            (their ``metrics``), or a callable returning a :class:`Metrics`. It is read in
            the thread that calls :meth:`tick`: a learner's own loop, or a ClusterEnv's
            caller.
        writers: the writers (:class:`MetricsWriter`) each snapshot goes to, in order.
        interval: the least seconds between two writes by :meth:`tick` (0: every tick).
        clock: the monotonic clock the interval is measured with.

    Raises:
        ConfigError: ``interval`` is negative or not a number, or ``source`` is neither a
            learner nor callable.
    """

    def __init__(
        self,
        source: Learner | ClusterEnv | Callable[[], Metrics],
        writers: Iterable[MetricsWriter],
        interval: float = 10.0,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(interval, int | float) or isinstance(interval, bool) or interval < 0:
            raise ConfigError(f"interval must be a number of seconds >= 0, got {interval!r}")
        self.read = reader(source)
        """Returns the snapshot to write."""
        self.writers = tuple(writers)
        """The writers, in order."""
        self.interval = float(interval)
        """The least seconds between two writes by :meth:`tick`."""
        self._clock = clock
        self._last: float | None = None
        self._closed = False

    def tick(self) -> bool:
        """Write a snapshot if ``interval`` seconds passed since the last write (or none was).

        Returns:
            Whether it wrote.
        """
        now = self._clock()
        if self._last is not None and now - self._last < self.interval:
            return False
        self.write()
        return True

    def write(self) -> None:
        """Write a snapshot to every writer now, whatever the interval.

        Raises:
            InvalidState: the logger is closed.
        """
        if self._closed:
            raise InvalidState("this MetricsLogger is closed; make a new one to write")
        self._last = self._clock()
        metrics = self.read()
        for writer in self.writers:
            writer.write(metrics)

    def close(self) -> None:
        """Write a last snapshot, then close every writer; idempotent.

        The writers are closed even when the last snapshot cannot be read or written.
        """
        if self._closed:
            return
        try:
            self.write()
        finally:
            self._closed = True
            for writer in self.writers:
                writer.close()


def reader(source: Any) -> Callable[[], Metrics]:
    """A function returning ``source``'s snapshot in the calling thread.

    ``source`` is anything with a ``metrics`` attribute (a Learner, a ClusterEnv) or a
    callable returning a :class:`Metrics`.

    Raises:
        ConfigError: ``source`` is neither.
    """
    if hasattr(type(source), "metrics"):
        return lambda: source.metrics
    if callable(source):
        return source  # type: ignore[no-any-return]
    raise ConfigError(
        "the figures' source must be an aps.Learner, an aps.ClusterEnv or a callable that "
        f"returns aps.metrics.Metrics, got {source!r}"
    )
