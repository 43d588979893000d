"""Weight-sync strategies: when does a new policy version travel to a worker.

A strategy is any object with ``should_sync(ctx: SyncContext) -> bool``
(:class:`SyncStrategy`). The learner builds a :class:`SyncContext` per worker and decision
point and sends its newest weights when the strategy answers ``True``. Strategies hold only
parameters and are pure, so they are tested with decision tables and no event loop.

Built-ins:

- :class:`AlwaysSync`: every new version goes to every worker (baseline).
- :class:`FixedInterval`: every ``versions`` versions or every ``steps`` env steps (baseline).
- :class:`APS`: when the worker's policy diverged from the learner's by more than a KL
  threshold, or once it is ``max_lag`` versions behind (16 by default; ``None``: no bound).
- :class:`RelativeAPS`: :class:`APS` with its threshold in updates' worth of drift (the
  divergence over the learner's own last-update KL on the same states), bounded by ``max_lag``.
- :class:`AnyOf`, :class:`AllOf`: compose strategies, short-circuiting in order.
- :class:`Never`: keep the first version forever (the zero-traffic reference).
"""

from __future__ import annotations

from aps.sync.base import SyncContext, SyncStrategy
from aps.sync.strategies import (
    APS,
    AllOf,
    AlwaysSync,
    AnyOf,
    FixedInterval,
    Never,
    RelativeAPS,
)

__all__ = [
    "APS",
    "AllOf",
    "AlwaysSync",
    "AnyOf",
    "FixedInterval",
    "Never",
    "RelativeAPS",
    "SyncContext",
    "SyncStrategy",
]
