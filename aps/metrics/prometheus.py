"""A learner's figures for Prometheus: a ``/metrics`` endpoint and the collector behind it.

Nothing is served unless :func:`serve_prometheus` is called; it binds ``127.0.0.1`` unless
told otherwise. The endpoint has no token: whoever reaches the port reads the figures (never
weights, observations or the token), so a non-loopback host logs a warning. Each scrape takes
a fresh snapshot (:attr:`aps.Learner.metrics`) and answers in Prometheus's text format, or in
OpenMetrics when the scraper asks for it (``Accept: application/openmetrics-text``). It needs
``prometheus_client`` (``pip install 'aps-rl[metrics]'``).

Rates are not exported: Prometheus computes them from the counters
(``rate(aps_env_steps_total[1m])``).

The learner's figures (totals over all workers, and its own):

============================================  =======  ============================================
name                                          type     meaning
============================================  =======  ============================================
``aps_policy_version``                        gauge    the newest published policy version
``aps_uptime_seconds``                        gauge    seconds since the learner started
``aps_learner_cpu_seconds_total``             counter  CPU time of the learner's process
``aps_lockstep_calls_total``                  counter  lockstep calls (reset, step) sent to workers
``aps_lockstep_wait_seconds_total``           counter  time those calls waited for their answers
``aps_queue_depth``                           gauge    chunks received, not yet taken (DETACH)
``aps_chunk_wait_seconds_total``              counter  time chunk streams waited for a chunk
``aps_syncs_total``                           counter  weight messages sent
``aps_weight_bytes_total``                    counter  bytes of weight arrays sent
``aps_transitions_total``                     counter  transitions received in chunks (DETACH)
``aps_env_steps_total``                       counter  env-steps of all workers
``aps_bytes_received_total``                  counter  bytes from the workers, on the wire
``aps_bytes_sent_total``                      counter  bytes to the workers, on the wire
``aps_policy_lag_mean``                       gauge    mean policy lag per transition, whole run
``aps_policy_lag_max``                        gauge    largest policy lag of any transition
``aps_workers_stalled``                       gauge    workers stalled now
============================================  =======  ============================================

Each worker's figures, labelled ``worker="<id>"`` (workers that were replaced keep theirs):

============================================  =======  ============================================
name                                          type     meaning
============================================  =======  ============================================
``aps_worker_policy_version``                 gauge    the version it holds (-1: none yet)
``aps_worker_syncs_total``                    counter  weight messages sent to it
``aps_worker_weight_bytes_total``             counter  bytes of weight arrays sent to it
``aps_worker_transitions_total``              counter  transitions received from it (DETACH)
``aps_worker_policy_lag``                     summary  policy lag of those transitions: ``_sum``
                                                       is the sum of their lags, ``_count``
                                                       their number
``aps_worker_policy_lag_max``                 gauge    largest lag of any of them
``aps_worker_chunks_total``                   counter  chunks received from it
``aps_worker_dropped_chunks_total``           counter  chunks that came after their stream ended
``aps_worker_resumes_total``                  counter  times it came back into its session
``aps_worker_stalled``                        gauge    1 while it is stalled, else 0
``aps_worker_stalls_total``                   counter  times it was found stalled
``aps_worker_env_steps_total``                counter  env-steps its answers carried
``aps_worker_answers_total``                  counter  answers that carried its timings
``aps_worker_env_seconds_total``              counter  time its envs took (it measured)
``aps_worker_inference_seconds_total``        counter  time its policy's forward passes took
``aps_worker_encode_seconds_total``           counter  time it took to encode its answers
``aps_worker_wait_seconds_total``             counter  lockstep: request to answer (learner)
``aps_worker_slowest_calls_total``            counter  lockstep calls in which it answered last
``aps_worker_bytes_received_total``           counter  bytes of its frames, on the wire
``aps_worker_bytes_received_raw_total``       counter  the same at full size (uncompressed)
``aps_worker_bytes_sent_total``               counter  bytes of the learner's frames to it
``aps_worker_bytes_sent_raw_total``           counter  the same at full size (uncompressed)
``aps_worker_decode_seconds_total``           counter  the learner's time decoding its frames
``aps_worker_rtt_seconds``                    gauge    latest heartbeat round trip (absent until
                                                       one was measured)
``aps_worker_divergence``                     gauge    latest divergence of its version from the
                                                       learner's (absent until measured)
``aps_worker_divergence_max``                 gauge    largest divergence kept for it
============================================  =======  ============================================

Threads: the server answers each scrape on a thread of its own. The snapshot is taken on the
event loop that was running where :func:`serve_prometheus` was called (or on ``loop``): call
it from a coroutine on the learner's loop, and nothing of the learner is read while the loop
changes it. A loop busy for longer than ``timeout`` (a long synchronous update on its thread)
answers that scrape with 503, and Prometheus records it as failed. For a ClusterEnv the
snapshot is taken through :meth:`aps.ClusterEnv.call_learner`, which is safe from any thread.
Called outside any event loop with no ``loop``, the source is read in the scraping thread: a
callable must then be safe to call from another thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from aps._base._resource import Resource
from aps.errors import ConfigError, InvalidState, MissingDependency, Timeout
from aps.metrics.figures import Metrics, WorkerMetrics
from aps.metrics.writers import reader
from aps.transports._util import format_host, is_loopback_host

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from aps.cluster_env import ClusterEnv
    from aps.learner import Learner

__all__ = ["PrometheusCollector", "PrometheusServer", "serve_prometheus"]

log = logging.getLogger("aps.metrics")

_LEARNER: tuple[tuple[str, str, str, Callable[[Metrics], float]], ...] = (
    ("policy_version", "gauge", "The newest published policy version.", lambda m: m.version),
    ("uptime_seconds", "gauge", "Seconds since the learner started.", lambda m: m.uptime),
    (
        "learner_cpu_seconds",
        "counter",
        "CPU time of the learner's process, all its threads.",
        lambda m: m.cpu_seconds,
    ),
    (
        "lockstep_calls",
        "counter",
        "Lockstep calls (reset, step) that reached workers.",
        lambda m: m.lockstep_calls,
    ),
    (
        "lockstep_wait_seconds",
        "counter",
        "Time lockstep calls waited, from their first request to their last answer.",
        lambda m: m.lockstep_wait_seconds,
    ),
    (
        "queue_depth",
        "gauge",
        "Chunks received and not yet taken by the training loop (DETACH).",
        lambda m: m.queue_depth,
    ),
    (
        "chunk_wait_seconds",
        "counter",
        "Time chunk streams waited for their next chunk (DETACH).",
        lambda m: m.chunk_wait_seconds,
    ),
    ("syncs", "counter", "Weight messages sent, all workers.", lambda m: m.syncs),
    (
        "weight_bytes",
        "counter",
        "Bytes of weight arrays sent, all workers.",
        lambda m: m.weight_bytes,
    ),
    (
        "transitions",
        "counter",
        "Transitions received in chunks, all workers (DETACH).",
        lambda m: m.transitions,
    ),
    ("env_steps", "counter", "Env-steps of all workers.", lambda m: m.env_steps),
    (
        "bytes_received",
        "counter",
        "Bytes from all workers, on the wire.",
        lambda m: m.bytes_received,
    ),
    ("bytes_sent", "counter", "Bytes to all workers, on the wire.", lambda m: m.bytes_sent),
    (
        "policy_lag_mean",
        "gauge",
        "Mean policy lag per transition over the whole run.",
        lambda m: m.lag_mean,
    ),
    ("policy_lag_max", "gauge", "Largest policy lag of any transition.", lambda m: m.lag_max),
    ("workers_stalled", "gauge", "Workers stalled now.", lambda m: len(m.stalled)),
)
"""The learner's families: name after ``aps_`` (counters without ``_total``), type, help,
value."""

_WORKER: tuple[tuple[str, str, str, Callable[[WorkerMetrics], float | None]], ...] = (
    ("policy_version", "gauge", "The policy version it holds (-1: none).", lambda w: w.version),
    ("syncs", "counter", "Weight messages sent to it.", lambda w: w.syncs),
    ("weight_bytes", "counter", "Bytes of weight arrays sent to it.", lambda w: w.weight_bytes),
    (
        "transitions",
        "counter",
        "Transitions received from it in chunks (DETACH).",
        lambda w: w.transitions,
    ),
    ("policy_lag_max", "gauge", "Largest policy lag of its transitions.", lambda w: w.lag_max),
    ("chunks", "counter", "Chunks received from it.", lambda w: w.chunks),
    (
        "dropped_chunks",
        "counter",
        "Chunks that arrived after their stream was closed.",
        lambda w: w.dropped_chunks,
    ),
    ("resumes", "counter", "Times it came back into its session.", lambda w: w.resumes),
    ("stalled", "gauge", "1 while it is stalled, else 0.", lambda w: float(w.stalled)),
    ("stalls", "counter", "Times it was found stalled.", lambda w: w.stalls),
    ("env_steps", "counter", "Env-steps its answers carried.", lambda w: w.env_steps),
    ("answers", "counter", "Answers that carried its own timings.", lambda w: w.answers),
    (
        "env_seconds",
        "counter",
        "Time its envs took to reset and step, as it measured.",
        lambda w: w.env_seconds,
    ),
    (
        "inference_seconds",
        "counter",
        "Time its policy's forward passes took (DETACH), as it measured.",
        lambda w: w.inference_seconds,
    ),
    (
        "encode_seconds",
        "counter",
        "Time it took to encode its answers.",
        lambda w: w.encode_seconds,
    ),
    (
        "wait_seconds",
        "counter",
        "Lockstep: time from each request to its answer, as the learner measured.",
        lambda w: w.wait_seconds,
    ),
    (
        "slowest_calls",
        "counter",
        "Lockstep calls in which its answer came last.",
        lambda w: w.slowest,
    ),
    (
        "bytes_received",
        "counter",
        "Bytes of its frames, on the wire.",
        lambda w: w.bytes_received,
    ),
    (
        "bytes_received_raw",
        "counter",
        "Bytes of its frames at full size (before compression and frame delta).",
        lambda w: w.bytes_received_raw,
    ),
    (
        "bytes_sent",
        "counter",
        "Bytes of the learner's frames to it, on the wire.",
        lambda w: w.bytes_sent,
    ),
    (
        "bytes_sent_raw",
        "counter",
        "Bytes of the learner's frames to it at full size (before compression).",
        lambda w: w.bytes_sent_raw,
    ),
    (
        "decode_seconds",
        "counter",
        "The learner's time decoding its frames.",
        lambda w: w.decode_seconds,
    ),
    ("rtt_seconds", "gauge", "Its latest heartbeat round trip.", lambda w: w.rtt),
    (
        "divergence",
        "gauge",
        "Latest divergence of its version from the learner's.",
        lambda w: w.divergences[-1] if w.divergences else None,
    ),
    (
        "divergence_max",
        "gauge",
        "Largest divergence kept for it.",
        lambda w: max(w.divergences, default=None),
    ),
)
"""Each worker's families, after ``aps_worker_``, labelled ``worker``; ``None``: not
measured yet, no sample."""

_LAG = "aps_worker_policy_lag"
"""The one summary: ``_sum`` the worker's lag sum, ``_count`` its transitions."""


def metric_names() -> tuple[str, ...]:
    """Every family's name as exposed (counters with ``_total``), learner's first."""
    names = [
        *(f"aps_{name}{_suffix(kind)}" for name, kind, _, _ in _LEARNER),
        *(f"aps_worker_{name}{_suffix(kind)}" for name, kind, _, _ in _WORKER),
        _LAG,
    ]
    return tuple(names)


def _suffix(kind: str) -> str:
    return "_total" if kind == "counter" else ""


class PrometheusCollector:
    """A ``prometheus_client`` collector: each :meth:`collect` takes a fresh snapshot.

    :func:`serve_prometheus` serves one; register one in a registry to export the figures
    from a server you already run
    (``prometheus_client.REGISTRY.register(PrometheusCollector(learner))``).

    Args:
        source: an :class:`aps.Learner`, an :class:`aps.ClusterEnv`, or a callable returning
            a :class:`Metrics` (see the module on threads).
        loop: the event loop to take snapshots on. Default: the loop running in the calling
            thread (a Learner's, when made in a coroutine on it); none outside one (the
            source is then read in the scraping thread); for a ClusterEnv, its own
            (through ``call_learner``).
        timeout: seconds a snapshot waits for a busy ``loop``.

    Raises:
        ConfigError: a ``timeout`` that is not a positive number; a ``source`` of another
            kind.
    """

    def __init__(
        self,
        source: Learner | ClusterEnv | Callable[[], Metrics],
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        timeout: float = 5.0,
    ) -> None:
        if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not timeout > 0:
            raise ConfigError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        self.timeout = float(timeout)
        """Seconds a snapshot waits for a busy loop."""
        self._read: Callable[[], Metrics] = reader(source)
        # Told apart by what they offer, not by class: aps.learner and aps.cluster_env import
        # aps.metrics, so importing them here would close a cycle.
        call_learner = getattr(source, "call_learner", None)
        if callable(call_learner) and loop is None:  # a ClusterEnv: its portal is thread-safe
            self._read = lambda: call_learner(_metrics_of)
        elif loop is None:
            loop = _running_loop()
        self._loop = loop

    def snapshot(self) -> Metrics:
        """A fresh snapshot, taken on the loop if there is one (see the class).

        Raises:
            Timeout: the loop did not run it within ``timeout`` seconds.
            InvalidState: the loop is closed (or the ClusterEnv).
            Exception: what the source raised.
        """
        loop = self._loop
        if loop is None or _running_loop() is loop:
            return self._read()
        answer: concurrent.futures.Future[Metrics] = concurrent.futures.Future()

        def take() -> None:
            if answer.set_running_or_notify_cancel():
                try:
                    answer.set_result(self._read())
                except BaseException as exc:
                    answer.set_exception(exc)

        try:
            loop.call_soon_threadsafe(take)
        except RuntimeError:  # asyncio's word for a closed loop
            raise InvalidState("the learner's event loop is closed; no figures to read") from None
        try:
            return answer.result(self.timeout)
        except TimeoutError:
            answer.cancel()
            raise Timeout(
                f"the learner's event loop did not take a snapshot within {self.timeout} s "
                "(a long synchronous step on its thread?); raise timeout= or move that work "
                "off the loop",
                operation="metrics snapshot",
                seconds=self.timeout,
            ) from None

    def collect(self) -> Iterator[Metric]:
        """The families of a fresh snapshot (see the module for names).

        Raises:
            Timeout | InvalidState | Exception: see :meth:`snapshot`.
        """
        return iter(families(self.snapshot()))


def families(metrics: Metrics) -> list[Metric]:
    """The Prometheus families of ``metrics`` (see the module for the names)."""
    from prometheus_client.metrics_core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        SummaryMetricFamily,
    )

    def family(name: str, kind: str, text: str, labels: list[str] | None = None) -> Any:
        cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        return cls(name, text, labels=labels)

    found: list[Metric] = []
    for name, kind, text, total in _LEARNER:
        one = family(f"aps_{name}", kind, text)
        one.add_metric([], float(total(metrics)))
        found.append(one)
    # One entry per id: should a replaced worker's id come back, its newest record wins.
    workers = list({w.worker_id: w for w in metrics.workers}.values())
    for name, kind, text, figure in _WORKER:
        each = family(f"aps_worker_{name}", kind, text, ["worker"])
        for worker in workers:
            number = figure(worker)
            if number is not None:
                each.add_metric([str(worker.worker_id)], float(number))
        found.append(each)
    lag = SummaryMetricFamily(
        _LAG, "Policy lag of its transitions (sum and count).", labels=["worker"]
    )
    for worker in workers:
        lag.add_metric([str(worker.worker_id)], worker.transitions, float(worker.lag_sum))
    found.append(lag)
    return found


async def _metrics_of(learner: Learner) -> Metrics:
    return learner.metrics


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class PrometheusServer(Resource):
    """A running ``/metrics`` endpoint (:func:`serve_prometheus` starts one).

    Stop it with :meth:`close` or by leaving a ``with`` block.
    """

    def __init__(self, collector: PrometheusCollector, host: str, port: int) -> None:
        server_class = _Server6 if ":" in host else _Server
        self._server: _Server = server_class((host, port), _Handler)
        self._server.collector = collector
        self.host: str = str(self._server.server_address[0])
        """The address it listens on, as bound (``"0.0.0.0"`` for ``""``)."""
        self.port: int = self._server.server_address[1]
        """The port it listens on (the one chosen when asked for port 0)."""
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.1},
            name=f"aps-prometheus-{self.port}",
            daemon=True,
        )
        self._thread.start()
        self._closed = False

    @property
    def url(self) -> str:
        """The endpoint's URL, ``http://host:port/metrics``."""
        return f"http://{format_host(self.host)}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port; idempotent. A scrape under way is dropped."""
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


class _Server(ThreadingHTTPServer):
    """The HTTP server, each request on a daemon thread, with the collector it serves."""

    collector: PrometheusCollector


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    """``GET /metrics``: the figures; 404 elsewhere; 503 when no snapshot could be taken."""

    server_version = "aps"

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] != "/metrics":
            self._answer(404, "text/plain; charset=utf-8", b"aps serves its figures at /metrics\n")
            return
        from prometheus_client.exposition import choose_encoder

        assert isinstance(self.server, _Server)
        collector = self.server.collector
        encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
        try:
            metrics = collector.snapshot()
        except Exception as exc:  # whatever the source raised: the scrape fails, the server stays
            log.warning("a scrape of %s got no figures: %s", self.path, exc)
            self._answer(503, "text/plain; charset=utf-8", f"{exc}\n".encode())
            return
        self._answer(200, content_type, encoder(_Fixed(metrics)))

    def _answer(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: a scrape every few seconds is no news (http.server writes each to stderr)."""


class _Fixed:
    """A collector over one snapshot already taken."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return iter(families(self.metrics))


def serve_prometheus(
    source: Learner | ClusterEnv | Callable[[], Metrics],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    loop: asyncio.AbstractEventLoop | None = None,
    timeout: float = 5.0,
) -> PrometheusServer:
    """Serve ``source``'s figures at ``http://host:port/metrics`` until closed.

    A thread of its own serves the endpoint; each scrape takes a fresh snapshot (see the
    module for the names, and for which thread reads the learner).

    Args:
        source: an :class:`aps.Learner` (call this from a coroutine on its loop), an
            :class:`aps.ClusterEnv`, or a callable returning a :class:`Metrics`.
        host: the address to listen on. Loopback by default; any other address logs a
            warning, since the endpoint asks for no token.
        port: the port (0: any free one; read it from the result's ``port``).
        loop: see :class:`PrometheusCollector`.
        timeout: seconds a scrape waits for a busy loop before answering 503.

    Returns:
        The running server: ``url``, ``port``, ``close()``.

    Raises:
        MissingDependency: ``prometheus_client`` is not installed.
        ConfigError: see :class:`PrometheusCollector`.
        OSError: the address cannot be bound (the port is taken).
    """
    try:
        import prometheus_client  # noqa: F401 - checked here, used per scrape
    except ImportError as exc:
        raise MissingDependency(
            "serve_prometheus needs the prometheus_client package; install the metrics extra "
            "with pip install 'aps-rl[metrics]'"
        ) from exc
    collector = PrometheusCollector(source, loop=loop, timeout=timeout)
    server = PrometheusServer(collector, host, port)
    # The bound address decides: "localhost" or "127.1" are loopback, "" is every interface.
    if not is_loopback_host(server.host):
        log.warning(
            "aps serves its figures at %s, which is not a loopback address: anyone who can "
            "reach it reads them without the token (pass host='127.0.0.1' to keep them local)",
            server.url,
        )
    return server
