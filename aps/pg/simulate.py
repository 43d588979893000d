"""NIGT in virtual time: n simulated workers, one process, the same rules as the networked path.

The paper behind Rennala and Malenia NIGT measures time in a model, not on a cluster: worker
``i`` needs ``h[i]`` time units per trajectory gradient and ``kappa[i]`` per aggregation of
its sum. :func:`simulate` reproduces that model. Each round starts every worker afresh at the
broadcast point; worker ``i``'s ``k``-th gradient is ready at ``start + k * h[i]``. The
completions are fed, in time order, to the round of the *same* aggregation rule the networked
trainer uses (:meth:`~aps.pg.Round.note`, as a worker's progress message would) until
:attr:`~aps.pg.Round.ready`; then every worker's sum is computed from real trajectories
sampled at the point (:class:`~aps.gradients.GradientSampler`, the workers' own sampler, on a
vector env in this process) and added with :meth:`~aps.pg.Round.add`, the aggregation costs
``max(kappa)`` over the workers that send, and the *same* :class:`~aps.pg.NIGTUpdate` step
follows.

What is simulated and what is real: the clock is the model's; the environments, the
trajectories, the gradients, the aggregation and the update are real. A worker's sum is drawn
from its env's sampler in whole vector steps, so it may hold a few more trajectories than the
count the rule saw (at most ``envs_per_worker - 1``); the estimator stays unbiased.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from aps.errors import ConfigError
from aps.pg.aggregate import AggregationRule, Malenia, Rennala
from aps.pg.nigt import NIGTUpdate, flatten, unflatten

__all__ = ["SimRound", "simulate"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SimRound:
    """One simulated NIGT iteration.

    Attributes:
        iteration: 0, 1, ... (0 is the initial batch).
        time: the virtual time at the end of the round (aggregation included).
        compute: the virtual time the round's gradients took (until the rule held).
        communication: the virtual time of the round's aggregation (``max kappa`` of the
            workers that sent a sum).
        contributions: gradients used per worker index.
        used: gradients aggregated.
        mean_return: the mean undiscounted return of the trajectories sampled at the point.
        direction_norm: the norm of the momentum direction after the step.
    """

    iteration: int
    time: float
    compute: float
    communication: float
    contributions: dict[int, int]
    used: int
    mean_return: float
    direction_norm: float


def _times(name: str, values: Sequence[float] | float, n: int, *, positive: bool) -> list[float]:
    seq = [float(values)] * n if isinstance(values, int | float) else [float(v) for v in values]
    if len(seq) != n:
        raise ConfigError(f"{name} has {len(seq)} entries for {n} workers; give one per worker")
    for value in seq:
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            limit = "> 0" if positive else ">= 0"
            raise ConfigError(f"{name} entries must be finite and {limit}, got {value!r}")
    return seq


def simulate(
    policy: Any,
    envs: Sequence[Callable[[], Any]] | Callable[[], Any],
    *,
    h: Sequence[float],
    kappa: Sequence[float] | float = 0.0,
    aggregator: AggregationRule | None = None,
    lr: float = 0.01,
    momentum: float = 0.1,
    horizon: int = 200,
    gamma: float = 0.99,
    initial_batch: int | None = None,
    iterations: int | None = None,
    time_budget: float | None = None,
    envs_per_worker: int = 1,
    seed: int = 0,
) -> Iterator[SimRound]:
    """Run Rennala, Malenia or synchronized NIGT in virtual time, yielding each round.

    Args:
        policy: the agent (an ``nn.Module`` the policy adapter understands, or an
            :class:`aps.policy.Policy`); its parameters hold ``theta`` after every round.
        envs: one env factory for every worker (homogeneous), or one per worker (each
            worker samples its own env: the heterogeneous setting).
        h: virtual time per trajectory gradient, one per worker (its length is ``n``).
        kappa: virtual time per aggregation of a worker's sum, one per worker or one for all.
        aggregator: as for :class:`aps.pg.NIGT` (the same rule classes).
        lr: as for :class:`aps.pg.NIGT`.
        momentum: as for :class:`aps.pg.NIGT`.
        horizon: as for :class:`aps.pg.NIGT`.
        gamma: as for :class:`aps.pg.NIGT`.
        initial_batch: as for :class:`aps.pg.NIGT`.
        iterations: stop after this many rounds.
        time_budget: stop after the round that passes this virtual time.
        envs_per_worker: envs stepped together per distinct env (vectorized sampling).
            With 1 (the default) every worker's sum holds exactly the gradients the rule
            counted; more is faster but may add up to ``envs_per_worker - 1`` per worker.
        seed: seeds the env resets and the policy's sampling.

    Raises:
        ConfigError: times of the wrong length or sign, no stopping criterion, or env
            factories that do not match the workers.
    """
    from gymnasium.vector import AutoresetMode, SyncVectorEnv

    from aps.gradients import GradientSampler
    from aps.messages import GradientRound
    from aps.policy import Policy

    n = len(h)
    if n < 1:
        raise ConfigError("h needs one time per worker, got none")
    times = _times("h", h, n, positive=True)
    comm = _times("kappa", kappa, n, positive=False)
    if iterations is None and time_budget is None:
        raise ConfigError("give iterations=..., time_budget=... or both, or it never stops")
    factories = [envs] * n if callable(envs) else list(envs)
    if len(factories) != n:
        raise ConfigError(f"envs has {len(factories)} factories for {n} workers; give 1 or {n}")
    rule: AggregationRule = aggregator or Rennala(batch=8)
    initial = rule
    if initial_batch is not None and isinstance(rule, Rennala | Malenia):
        initial = dataclasses.replace(rule, batch=initial_batch)
    update = NIGTUpdate(lr=lr, momentum=momentum)

    # One sampler per distinct factory: homogeneous workers share one vector env.
    samplers: dict[int, GradientSampler] = {}
    sampler_of: list[GradientSampler] = []
    module_policy: Any = None
    for index, factory in enumerate(factories):
        key = id(factory)
        if key not in samplers:
            vector = SyncVectorEnv(
                [factory] * envs_per_worker, copy=False, autoreset_mode=AutoresetMode.SAME_STEP
            )
            vector.reset(seed=seed + 1000 * index)
            wrapped = (
                policy
                if isinstance(policy, Policy)
                else Policy(policy, vector.single_observation_space, vector.single_action_space)
            )
            wrapped.seed(seed + index)
            module_policy = module_policy or wrapped
            samplers[key] = GradientSampler(vector, wrapped)
        sampler_of.append(samplers[key])
    assert isinstance(module_policy, Policy)

    vector0, layout = flatten(module_policy.get_weights())
    state = update.start(vector0)
    clock = 0.0
    iteration = 0
    while (iterations is None or iteration < iterations) and (
        time_budget is None or clock < time_budget
    ):
        round_ = (initial if iteration == 0 else rule).start(
            state.t, list(range(n)), size=layout.size
        )
        # Completions in time order: (time, worker, k-th gradient).
        events = [(times[i], i, 1) for i in range(n)]
        heapq.heapify(events)
        ready_at = 0.0
        counts = dict.fromkeys(range(n), 0)
        while not round_.ready:
            ready_at, worker, k = heapq.heappop(events)
            counts[worker] = k
            round_.note(worker, state.t, k)
            heapq.heappush(events, (ready_at + times[worker], worker, k + 1))
        arrays = unflatten(state.point, layout)
        message = GradientRound(round=state.t, arrays=arrays, horizon=horizon, gamma=gamma)
        for sampler in samplers.values():
            sampler.start(message)
        returns: list[float] = []
        round_.begin_collection()
        for worker in range(n):
            if counts[worker] == 0:
                continue
            total, count = _draw(sampler_of[worker], counts[worker], layout, returns)
            round_.add(worker, state.t, total, count)
        round_.end_collection()
        senders = [i for i in range(n) if counts[i] > 0]
        communication = max(comm[i] for i in senders)
        state = update.step(state, round_.result())
        module_policy.set_weights(unflatten(state.theta, layout))
        clock += ready_at + communication
        yield SimRound(
            iteration=iteration,
            time=clock,
            compute=ready_at,
            communication=communication,
            contributions=dict(round_.contributions),
            used=round_.used,
            mean_return=float(np.mean(returns)) if returns else math.nan,
            direction_norm=state.direction_norm,
        )
        iteration += 1


def _draw(sampler: Any, count: int, layout: Any, returns: list[float]) -> tuple[Any, int]:
    """Step ``sampler`` until ``count`` trajectories ended: their gradient sum and count."""
    total = np.zeros(layout.size, dtype=np.float64)
    got = 0
    while got < count:
        report = sampler.step()
        if report is None:
            continue
        total += layout.flatten(report.gradient, fill_missing=True)
        got += report.count
        returns.extend(float(r) for r in report.episode_return)
    return total, got
