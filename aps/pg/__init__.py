"""Asynchronous policy-gradient aggregation: the pure rules of Rennala NIGT and Malenia NIGT.

Workers sample trajectories at a point the learner broadcast, compute REINFORCE gradients
``g_H`` there and report gradient sums with counts and the round id; the learner aggregates a
round's reports with a rule and takes one NIGT step. This package holds the pieces that are
pure functions of data (no event loop, no sockets, no clock reads), tested with tables:

- :class:`NIGTUpdate` / :class:`NIGTState`: the NIGT outer loop (extrapolated point,
  momentum, normalized ascent step) on flat float64 vectors; :func:`flatten`,
  :func:`unflatten` and :class:`Layout` convert named arrays (torch state dicts) to and from
  one vector.
- :class:`Rennala`, :class:`Malenia`, :class:`Synchronous`: aggregation rules; each starts a
  mutable :class:`Round` that the driver feeds with reports.
- :mod:`aps.pg.reinforce` (``reward_to_go``, ``surrogate``): the estimator ``g_H`` with
  absolute discount. It needs torch, so it is a submodule to import explicitly
  (``from aps.pg.reinforce import surrogate``): ``import aps.pg`` never imports torch.

The drivers that do I/O live with their roles: the trainer :class:`NIGT` beside the learner's
modes (:mod:`aps.learner.trainer`; still named ``aps.pg.NIGT``, imported on first use of the
name, so importing the pure rules imports no learner), the workers' sampler beside the worker
(:mod:`aps.worker.sampling`), and the virtual-time runs of the paper's model, ``simulate``
and ``afedpg``, beside the trainer (:mod:`aps.learner.simulate`). The old module paths
``aps.pg.trainer``, ``aps.pg.sampling`` and ``aps.pg.simulate`` still import (the very
modules).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aps.pg.aggregate import (
    AggregationRule,
    Malenia,
    MaleniaRound,
    Rennala,
    RennalaRound,
    Round,
    Synchronous,
    SynchronousRound,
)
from aps.pg.nigt import Layout, NIGTState, NIGTUpdate, flatten, unflatten

if TYPE_CHECKING:
    from aps.learner.trainer import NIGT, RoundStats

__all__ = [
    # The trainer (drives an aps Learner; the rest of this package is pure).
    "NIGT",
    "RoundStats",
    # The NIGT outer loop and flat vectors.
    "Layout",
    "NIGTState",
    "NIGTUpdate",
    "flatten",
    "unflatten",
    # Aggregation rules and their rounds.
    "AggregationRule",
    "Malenia",
    "MaleniaRound",
    "Rennala",
    "RennalaRound",
    "Round",
    "Synchronous",
    "SynchronousRound",
]


def __getattr__(name: str) -> Any:
    """The trainer's public names, imported on first use.

    The trainer drives a :class:`~aps.learner.Learner`, a layer above these rules; importing
    it here eagerly would make every import of the rules (the learner's and the worker's
    included) import the learner. This lookup is the one upward reference of the layer, for
    the name users write, and ``tests/test_layers.py`` allows exactly it.
    """
    if name in ("NIGT", "RoundStats"):
        from aps.learner.trainer import NIGT, RoundStats

        return {"NIGT": NIGT, "RoundStats": RoundStats}[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
