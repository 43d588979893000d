"""What a run's time goes to: the learner's figures, a verdict on what bounds the run, export.

:class:`Metrics` is the snapshot :attr:`aps.Learner.metrics` returns (also
:attr:`aps.ClusterEnv.metrics` and the Stable-Baselines3 adapter's); see
``docs/observability.md`` for every figure and what it means.
"""

from __future__ import annotations

from aps.metrics.figures import Metrics, WorkerMetrics
from aps.metrics.verdict import Verdict, verdict

__all__ = ["Metrics", "WorkerMetrics", "Verdict", "verdict"]
