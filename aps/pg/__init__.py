"""Asynchronous policy-gradient aggregation: the pure parts of Rennala NIGT and Malenia NIGT.

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
- :class:`NIGT` (in :mod:`aps.pg.trainer`, the one module here that does I/O): the trainer
  that drives a :class:`~aps.learner.Learner`'s workers with the pieces above; ``aps.pg``
  imports it on first use of the name, so importing the pure parts imports no learner.
- :mod:`aps.pg.reinforce` (``reward_to_go``, ``surrogate``): the estimator ``g_H`` with
  absolute discount. It needs torch, so it is a submodule to import explicitly
  (``from aps.pg.reinforce import surrogate``): ``import aps.pg`` never imports torch.
- :mod:`aps.pg.simulate` (``simulate``, ``afedpg``): the same rounds and update in virtual
  time, with per-worker gradient times ``h_i`` and aggregation times ``kappa_i``, real envs
  stepped in one process (the paper's experimental model), and the AFedPG baseline (every
  gradient applied on arrival) in the same time model.
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
    from aps.pg.trainer import NIGT, RoundStats

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
    """The trainer's names, imported on first use.

    The trainer drives a :class:`~aps.learner.Learner`; importing it here eagerly would make
    every import of the pure rules (the learner's and the worker's included) import the
    learner, and close an import circle.
    """
    if name in ("NIGT", "RoundStats"):
        from aps.pg import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
