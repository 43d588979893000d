"""``aps top URL``: a learner's figures, live, in a terminal.

The view dials the learner as ``aps check`` does (:func:`aps.cli._probe.watch_learner`: the
token proved both ways), then asks for the learner's figures every interval and redraws:
a header (the learner, its version and uptime, its workers, its env-steps per second,
bytes per second each way, its CPU and where its time waits), one row per worker and a
last line for the verdict of :func:`aps.metrics.verdict` where this aps has one.

Each figure of a rate or a time per step is of the last interval: two consecutive answers
are rebuilt as :class:`~aps.metrics.Metrics` (:func:`metrics_of`) and the later one's
:meth:`~aps.metrics.Metrics.since` the earlier is the window every column reads. The
window's length is the difference of the learner's own snapshot times, so the network's
delays do not skew a rate; a learner that does not stamp its snapshots gives no window,
and its rates show as ``-``. Counts (versions, syncs, resumes) are totals since the start.

Drawn with plain ANSI sequences on the terminal's alternate screen, which is left as it was
on exit (Ctrl-C included); without a terminal, or with ``--once``, one plain view of one
interval is printed instead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import shutil
import textwrap
import types
from collections.abc import Mapping
from typing import Any, TextIO

from aps.cli._probe import CheckResult, Watch, watch_learner
from aps.errors import ConfigError, ProtocolError
from aps.metrics import Metrics, WorkerMetrics
from aps.transports.base import TransportFactory

__all__ = ["MAX_INTERVAL", "MIN_INTERVAL", "View", "metrics_of", "top"]

MIN_INTERVAL = 0.1
"""The shortest interval between two requests: a learner answers a view at most 10 times a
second (``aps.learner.admission.WATCH_RATE``)."""

MAX_INTERVAL = 10.0
"""The longest interval: a learner closes a view silent for 30 s
(``aps.learner.admission.WATCH_TIMEOUT``); this leaves room for a slow network."""

_ENTER = "\x1b[?1049h\x1b[?25l"  # the alternate screen, cursor hidden
_LEAVE = "\x1b[?25h\x1b[?1049l"  # the cursor shown, back to the screen as it was
_HOME = "\x1b[H"
_TO_END_OF_LINE = "\x1b[K"
_TO_END_OF_SCREEN = "\x1b[J"

_WORKER_FIELDS = tuple(f.name for f in dataclasses.fields(WorkerMetrics) if f.name != "divergences")
_METRICS_FIELDS = tuple(f.name for f in dataclasses.fields(Metrics) if f.name != "workers")


def _field(data: Mapping[str, Any], name: str, where: str) -> Any:
    value = data[name]
    if value is not None and not isinstance(value, int | float):
        raise ProtocolError(
            f"the learner's figures hold {where}{name}={value!r}, expected a number; the "
            "learner is not an aps this aps top can read"
        )
    return value


def metrics_of(data: Mapping[str, Any]) -> Metrics:
    """The :class:`Metrics` that :meth:`Metrics.as_dict` gave ``data``, as far as it tells.

    A worker's divergences come back as their last value alone; keys this aps does not know
    (a newer learner's, ``workers_connected``) are ignored, and fields missing from ``data``
    keep their defaults.

    Raises:
        ProtocolError: a figure is not a number, or ``workers`` is not a list of mappings.
    """
    workers: list[WorkerMetrics] = []
    entries = data.get("workers", ())
    if not isinstance(entries, list | tuple):
        raise ProtocolError(
            f"the learner's figures hold workers={entries!r}, expected a list of mappings"
        )
    for entry in entries:
        if not isinstance(entry, Mapping) or "worker_id" not in entry:
            raise ProtocolError(
                f"the learner's figures hold a worker entry {entry!r}, expected a mapping "
                "with a worker_id"
            )
        where = f"worker {entry['worker_id']!r}: "
        fields = {name: _field(entry, name, where) for name in _WORKER_FIELDS if name in entry}
        worker = WorkerMetrics(**fields)
        last = _field(entry, "divergence_last", where) if "divergence_last" in entry else None
        if last is not None:
            worker.divergences.append(float(last))
        workers.append(worker)
    fields = {name: _field(data, name, "") for name in _METRICS_FIELDS if name in data}
    return Metrics(workers=tuple(workers), **fields)


def _clock(seconds: float) -> str:
    whole = int(seconds)
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


def _per_second(amount: float, span: float, scale: float = 1.0) -> str:
    if not span > 0:
        return "-"
    rate = amount / span / scale
    return f"{rate:,.0f}" if rate >= 100 else f"{rate:.1f}"


def _share(seconds: float, span: float) -> str:
    return f"{100 * seconds / span:.0f}%" if span > 0 else "-"


def _ms_per(seconds: float, count: int) -> str:
    if not count:
        return "-"
    ms = 1e3 * seconds / count
    return f"{ms:.3f}" if ms < 10 else f"{ms:.1f}"


def _verdict(window: Metrics) -> str:
    """The verdict line, where this aps has :func:`aps.metrics.verdict`; else empty."""
    found: Any = getattr(importlib.import_module("aps.metrics"), "verdict", None)
    if isinstance(found, types.ModuleType):  # a module of that name: its function
        found = getattr(found, "verdict", None)
    return "" if not callable(found) else f"verdict: {found(window)}"


_COLUMNS = (
    ("worker", 6),
    ("steps/s", 9),
    ("env ms", 8),
    ("inf ms", 8),
    ("enc ms", 8),
    ("in kB/s", 9),
    ("out kB/s", 9),
    ("raw/wire", 8),
    ("rtt ms", 7),
    ("lag", 6),
    ("syncs", 6),
    ("resumes", 7),
)


def _row(values: tuple[str, ...]) -> str:
    return " ".join(f"{value:>{width}}" for value, (_, width) in zip(values, _COLUMNS, strict=True))


@dataclasses.dataclass(frozen=True)
class View:
    """What the view knows besides the figures: the learner's address and its opening.

    Attributes:
        url: the learner's address, as dialed.
        opened: what the learner said when the view opened (the workers it expects).
    """

    url: str
    opened: CheckResult

    def lines(self, earlier: Metrics | None, later: Metrics, connected: int | None) -> list[str]:
        """The view of the window from ``earlier`` to ``later`` (``None``: the whole run).

        ``connected``: the learner's workers connected now (``None``: not told).
        """
        window = later.since(earlier)
        span = window.uptime
        workers = f"{'?' if connected is None else connected}/{self.opened.num_workers}"
        length = "whole run" if earlier is None else f"{span:.2f} s" if span > 0 else "none"
        header = (
            f"aps top  {self.url}  version {later.version}  up {_clock(later.uptime)}  "
            f"workers {workers}"
        )
        flow = (
            f"env-steps/s {_per_second(window.env_steps, span)}  "
            f"in {_per_second(window.bytes_received, span, 1e3)} kB/s  "
            f"out {_per_second(window.bytes_sent, span, 1e3)} kB/s  "
            f"cpu {_share(window.cpu_seconds, span)}  "
            f"lockstep wait {_share(window.lockstep_wait_seconds, span)}  "
            f"queue {later.queue_depth}  window {length}"
        )
        rows = [_row(tuple(name for name, _ in _COLUMNS))]
        for total, part in zip(later.workers, window.workers, strict=True):
            wire = part.bytes_received + part.bytes_sent
            raw = part.bytes_received_raw + part.bytes_sent_raw
            rows.append(
                _row(
                    (
                        str(total.worker_id),
                        _per_second(part.env_steps, span),
                        _ms_per(part.env_seconds, part.env_steps),
                        _ms_per(part.inference_seconds, part.env_steps),
                        _ms_per(part.encode_seconds, part.env_steps),
                        _per_second(part.bytes_received, span, 1e3),
                        _per_second(part.bytes_sent, span, 1e3),
                        f"{raw / wire:.2f}" if wire else "-",
                        "-" if total.rtt is None else f"{1e3 * total.rtt:.1f}",
                        f"{part.lag_mean:.2f}" if part.transitions else "-",
                        str(total.syncs),
                        str(total.resumes),
                    )
                )
            )
        if not later.workers:
            rows.append("(no worker has joined yet)")
        return [header, flow, "", *rows, "", _verdict(window)]


async def _snapshot(watch: Watch) -> tuple[Metrics, int | None]:
    data = await watch.figures()
    connected = data.get("workers_connected")
    return metrics_of(data), connected if isinstance(connected, int) else None


def _draw(out: TextIO, lines: list[str]) -> None:
    """Redraw the screen in place: each line cleared to its end, no flicker of a full clear.

    Lines wider than the terminal are cut, except the last (the verdict), which wraps.
    """
    columns, rows = shutil.get_terminal_size()
    *body, last = lines
    wrapped = textwrap.wrap(last, columns, subsequent_indent="  ") or [""]
    shown = [line[:columns] for line in body + wrapped][: max(rows - 1, 1)]
    out.write(_HOME + "".join(line + _TO_END_OF_LINE + "\n" for line in shown))
    out.write(_TO_END_OF_SCREEN)
    out.flush()


async def top(
    url: str,
    *,
    token: str | None,
    factory: TransportFactory | None = None,
    interval: float = 1.0,
    screen: bool,
    out: TextIO,
    timeout: float = 10.0,
) -> None:
    """Show the learner at ``url`` live until cancelled, or (``screen=False``) once.

    Args:
        url: the learner's address, as a worker dials it.
        token: the learner's token (``None``: prove none).
        factory: dial with this factory (TLS, say) instead of the scheme's own.
        interval: seconds between two requests, from :data:`MIN_INTERVAL` to
            :data:`MAX_INTERVAL`.
        screen: redraw ``out`` (a terminal) in place until cancelled; ``False``: print one
            plain view, of one interval, and return.
        out: where to write.
        timeout: the longest the opening, and each answer, may take, in seconds.

    Raises:
        ConfigError: ``interval`` is out of bounds; or, as :func:`aps.cli._probe.check_learner`
            raises, the learner refused the view.
        EndOfStream: the learner ended the view (its goodbye says why: closing, or as many
            views as it serves already).
    """
    if not MIN_INTERVAL <= interval <= MAX_INTERVAL:
        raise ConfigError(
            f"--interval must be from {MIN_INTERVAL} to {MAX_INTERVAL} seconds, got {interval}: "
            f"a learner answers a view at most {1 / MIN_INTERVAL:.0f} times a second and "
            "closes one silent for 30 s"
        )
    loop = asyncio.get_running_loop()
    async with watch_learner(url, token=token, factory=factory, timeout=timeout) as watch:
        view = View(url, watch.result)
        earlier, connected = await _snapshot(watch)
        if not screen:
            await asyncio.sleep(interval)
            later, connected = await _snapshot(watch)
            out.write("\n".join(view.lines(earlier, later, connected)) + "\n")
            out.flush()
            return
        out.write(_ENTER)
        try:
            _draw(out, view.lines(None, earlier, connected))
            due = loop.time()
            while True:
                due += interval
                await asyncio.sleep(max(due - loop.time(), 0.0))
                later, connected = await _snapshot(watch)
                _draw(out, view.lines(earlier, later, connected))
                earlier = later
        finally:
            out.write(_LEAVE)
            out.flush()
