"""Deprecated alias of :mod:`aps.learner.rollouts`, where the DETACH results now live.

``aps.collect`` sat beside :mod:`aps.worker.collector` while holding the learner's side (the
chunks, rollouts, sync metrics and policy versions the learner builds); the names are the
same in their new room, and the classes are in :mod:`aps` too. Each name read from here
still works and warns (:class:`DeprecationWarning`).
"""

from __future__ import annotations

import warnings
from typing import Any

from aps.learner import rollouts as _rollouts


def __getattr__(name: str) -> Any:
    if name.startswith("__") or not hasattr(_rollouts, name):
        raise AttributeError(f"module 'aps.collect' has no attribute {name!r}")
    warnings.warn(
        f"aps.collect is deprecated; import {name} from aps.learner.rollouts "
        "(Chunk, Rollout, Metrics and WorkerMetrics also from aps)",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(_rollouts, name)
