"""What a run's time goes to: the learner's figures, a verdict on what bounds the run, export.

:class:`Metrics` is the snapshot :attr:`aps.Learner.metrics` returns (also
:attr:`aps.ClusterEnv.metrics` and the Stable-Baselines3 adapter's); see
``docs/observability.md`` for every figure and what it means.
"""

from __future__ import annotations

from aps.metrics.figures import Metrics, WorkerMetrics
from aps.metrics.prometheus import PrometheusCollector, PrometheusServer, serve_prometheus
from aps.metrics.verdict import Verdict, verdict
from aps.metrics.writers import (
    CSVWriter,
    JSONLinesWriter,
    MetricsLogger,
    MetricsWriter,
    TensorBoardWriter,
    window_rates,
)

__all__ = [
    "Metrics",
    "WorkerMetrics",
    "Verdict",
    "verdict",
    "MetricsWriter",
    "CSVWriter",
    "JSONLinesWriter",
    "TensorBoardWriter",
    "MetricsLogger",
    "window_rates",
    "PrometheusCollector",
    "PrometheusServer",
    "serve_prometheus",
]
