"""NIGT in virtual time: n simulated workers, one process, the same rules as the networked path.

The paper behind Rennala and Malenia NIGT measures time in a model, not on a cluster: worker
``i`` needs ``h[i]`` time units per trajectory gradient and ``kappa[i]`` per aggregation of
its sum. :func:`simulate` reproduces that model. Each round starts every worker afresh at the
broadcast point; worker ``i``'s ``k``-th gradient is ready at ``start + k * h[i]``. The
completions are fed, in time order, to the round of the *same* aggregation rule the networked
trainer uses (:meth:`~aps.pg.Round.note`, as a worker's progress message would) until
:attr:`~aps.pg.Round.ready`; then every worker's sum is computed from real trajectories
sampled at the point (:class:`~aps.worker.sampling.GradientSampler`, the workers' own sampler, on a
vector env in this process) and added with :meth:`~aps.pg.Round.add`, the aggregation costs
``max(kappa)`` over the workers that send, and the *same* :class:`~aps.pg.NIGTUpdate` step
follows.

What is simulated and what is real: the clock is the model's; the environments, the
trajectories, the gradients, the aggregation and the update are real. Every worker samples
at the same broadcast point, so a round's trajectories for all the workers that share one env
factory are sampled together, on one vector env of up to ``pool`` envs
(:meth:`~aps.worker.sampling.GradientSampler.sample`), with each worker's gradient sum and count
kept apart: a worker's sum holds exactly the count the rule noted. Each env is given a fixed
number of consecutive trajectories before any step and idles once it has run them, so no
trajectory is dropped or selected by its length: with episodes that end early (Hopper) the
sums stay unbiased sums of i.i.d. trajectory gradients at the point.

:class:`~aps.pg.Synchronous` with a ``share`` of ``k`` is the paper's synchronized (minibatch)
NIGT: every worker computes exactly ``k`` gradients and then idles, so a round takes
``max_i k h[i]``. Without a share, fast workers keep sampling until the slowest has one.

:func:`afedpg` runs the paper's main baseline, AFedPG (asynchronous federated policy
gradient), in the same time model: every worker's gradient is applied the moment it arrives,
each one costs its worker ``h[i]`` to compute and ``kappa[i]`` to send.

It lives beside the networked trainer (:mod:`aps.learner.trainer`) because it plays the
learner's part with the same rules and update; the workers' part is their own sampler, which
it imports from the worker (the one place the learner's side does), so that a simulated
worker samples exactly as a real one.
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
from aps.pg.aggregate import AggregationRule, Malenia, Rennala, Synchronous
from aps.pg.nigt import NIGTUpdate, flatten, unflatten

__all__ = ["SimRound", "afedpg", "simulate"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SimRound:
    """One simulated NIGT iteration.

    Attributes:
        iteration: 0, 1, ... (0 is the initial batch).
        time: the virtual time at the end of the round (aggregation included); for
            :func:`afedpg`, when the step's gradient reached the server.
        compute: the virtual time the round's gradients took (until the rule held); for
            :func:`afedpg`, ``h`` of the worker whose gradient was applied.
        communication: the virtual time of the round's aggregation (``max kappa`` of the
            workers that sent a sum); for :func:`afedpg`, ``kappa`` of that worker.
        contributions: gradients used per worker index.
        used: gradients aggregated.
        mean_return: the mean undiscounted return of the trajectories sampled at the point.
        direction_norm: the norm of the momentum direction after the step.
        delay: :func:`afedpg` only: the number of server steps taken between the version the
            gradient was computed at and the step that applied it (0 for NIGT rounds).
        discarded: :func:`afedpg` only: gradients refused as too stale (``max_delay``) since
            the previous step (0 for NIGT rounds).
    """

    iteration: int
    time: float
    compute: float
    communication: float
    contributions: dict[int, int]
    used: int
    mean_return: float
    direction_norm: float
    delay: int = 0
    discarded: int = 0


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
    pool: int = 64,
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
        envs_per_worker: kept for callers of earlier versions: raises ``pool`` to at least
            this many envs.
        seed: seeds the env resets and the policy's sampling.
        pool: the most envs stepped together per distinct env factory, an int ``>= 1``.
            A round's trajectories for every worker of one factory are sampled together on
            one vector env of a power-of-two size up to ``pool`` (see the module
            docstring); more is faster up to the round's count, and the statistics do not
            depend on it.

    Raises:
        ConfigError: times of the wrong length or sign, no stopping criterion, or env
            factories that do not match the workers.
    """
    from aps.wire.messages import GradientRound

    n, times, comm = _check(h, kappa, iterations, time_budget)
    rule: AggregationRule = aggregator or Rennala(batch=8)
    initial = rule
    if initial_batch is not None and isinstance(rule, Rennala | Malenia):
        initial = dataclasses.replace(rule, batch=initial_batch)
    update = NIGTUpdate(lr=lr, momentum=momentum)
    share = rule.share if isinstance(rule, Synchronous) else None
    for name, value in (("pool", pool), ("envs_per_worker", envs_per_worker)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
    pools, pool_of, module_policy = _pools(policy, envs, n, max(pool, envs_per_worker), seed)

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
            if share is None or k < share:  # with a share, the worker idles after it
                heapq.heappush(events, (ready_at + times[worker], worker, k + 1))
        arrays = unflatten(state.point, layout)
        message = GradientRound(round=state.t, arrays=arrays, horizon=horizon, gamma=gamma)
        returns: list[float] = []
        round_.begin_collection()
        for key, sampler_pool in pools.items():
            workers = [i for i in range(n) if pool_of[i] == key and counts[i] > 0]
            if not workers:
                continue
            sums = sampler_pool.draw([counts[i] for i in workers], message, layout, returns)
            for worker, (total, count) in zip(workers, sums, strict=True):
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


def _check(
    h: Sequence[float],
    kappa: Sequence[float] | float,
    iterations: int | None,
    time_budget: float | None,
) -> tuple[int, list[float], list[float]]:
    """The number of workers and their checked times, or ConfigError."""
    n = len(h)
    if n < 1:
        raise ConfigError("h needs one time per worker, got none")
    times = _times("h", h, n, positive=True)
    comm = _times("kappa", kappa, n, positive=False)
    if iterations is None and time_budget is None:
        raise ConfigError("give iterations=..., time_budget=... or both, or it never stops")
    return n, times, comm


class _Pool:
    """Vector envs of one env factory, one per power-of-two size up to ``limit``, made lazily.

    Every size gets its own :class:`~aps.worker.sampling.GradientSampler` (the workers' sampler)
    over a ``SameStep``-autoreset :class:`gymnasium.vector.SyncVectorEnv`, seeded apart.
    """

    def __init__(self, factory: Callable[[], Any], policy: Any, limit: int, seed: int) -> None:
        self.factory, self.policy, self.limit, self.seed = factory, policy, limit, seed
        self.samplers: dict[int, Any] = {}
        self.wrapped: Any = None
        self.sizes = [1 << k for k in range(limit.bit_length()) if 1 << k <= limit]

    def sampler(self, size: int) -> Any:
        """The sampler over ``size`` envs."""
        from gymnasium.vector import AutoresetMode, SyncVectorEnv

        from aps.policy import Policy
        from aps.worker.sampling import GradientSampler

        if size not in self.samplers:
            vector = SyncVectorEnv(
                [self.factory] * size, copy=False, autoreset_mode=AutoresetMode.SAME_STEP
            )
            vector.reset(seed=self.seed + 7919 * size)
            wrapped = (
                self.policy
                if isinstance(self.policy, Policy)
                else Policy(
                    self.policy, vector.single_observation_space, vector.single_action_space
                )
            )
            wrapped.seed(self.seed + 7919 * size)
            self.wrapped = self.wrapped or wrapped
            self.samplers[size] = GradientSampler(vector, wrapped)
        return self.samplers[size]

    def size_for(self, count: int) -> int:
        """The size that samples ``count`` trajectories in the fewest env steps, roughly.

        A vector step costs about one env step of overhead (the policy's forward, the
        loop) plus one per env, idle envs included: minimize ``ceil(count / s) * (s + 2)``.
        """
        return min(self.sizes, key=lambda s: (math.ceil(count / s) * (s + 2), -s))

    def draw(
        self, counts: list[int], message: Any, layout: Any, returns: list[float]
    ) -> list[tuple[Any, int]]:
        """Each group's gradient sum and count, sampled together at ``message``'s point."""
        sampler = self.sampler(self.size_for(sum(counts)))
        sampler.start(message)
        out = []
        for report in sampler.sample(counts):
            assert report is not None
            out.append((layout.flatten(report.gradient, fill_missing=True), report.count))
            returns.extend(float(r) for r in report.episode_return)
        return out


def _pools(
    policy: Any,
    envs: Sequence[Callable[[], Any]] | Callable[[], Any],
    n: int,
    limit: int,
    seed: int,
) -> tuple[dict[int, _Pool], list[int], Any]:
    """One pool per distinct env factory (homogeneous workers share one).

    Returns ``(pools by factory id, each worker's factory id, the policy adapter)``.
    """
    from aps.policy import Policy

    factories = [envs] * n if callable(envs) else list(envs)
    if len(factories) != n:
        raise ConfigError(f"envs has {len(factories)} factories for {n} workers; give 1 or {n}")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ConfigError(f"pool and envs_per_worker must be ints >= 1, got {limit!r}")
    pools: dict[int, _Pool] = {}
    pool_of: list[int] = []
    module_policy: Any = None
    for index, factory in enumerate(factories):
        key = id(factory)
        if key not in pools:
            pools[key] = _Pool(factory, policy, limit, seed + 1000 * index)
            # Build the one-env sampler now: it checks the env and wraps the policy.
            pools[key].sampler(1)
            module_policy = module_policy or pools[key].wrapped
        pool_of.append(key)
    assert isinstance(module_policy, Policy)
    return pools, pool_of, module_policy


def afedpg(
    policy: Any,
    envs: Sequence[Callable[[], Any]] | Callable[[], Any],
    *,
    h: Sequence[float],
    kappa: Sequence[float] | float = 0.0,
    lr: float = 0.01,
    momentum: float = 0.1,
    horizon: int = 200,
    gamma: float = 0.99,
    max_delay: int | None = None,
    iterations: int | None = None,
    time_budget: float | None = None,
    seed: int = 0,
) -> Iterator[SimRound]:
    """Run AFedPG (Lan et al., ICLR 2025) in virtual time, yielding each server step.

    What is implemented, exactly. The server holds ``theta_k``, ``theta_{k-1}`` and a
    momentum direction ``d`` (an :class:`~aps.pg.NIGTState`). A worker that received version
    ``j`` samples *one* trajectory and differentiates ``g_H`` at its lookahead point::

        theta~_j = theta_j + ((1 - alpha) / alpha) (theta_j - theta_{j-1})

    and sends that single gradient. The server applies every gradient the moment it arrives,
    whatever its delay ``k - j``::

        d           = g                          (the first gradient)
        d           = (1 - alpha) d + alpha g    (afterwards)
        theta_{k+1} = theta_k + eta d / ||d||

    and sends ``(theta_{k+1}, theta_k)`` back to that worker only, which starts its next
    trajectory at the new lookahead point. That is one :meth:`~aps.pg.NIGTUpdate.step` per
    arriving gradient, with ``eta = lr`` and ``alpha = momentum``.

    Deviations from the published method, both because its readable description does not
    give them: ``alpha`` and ``eta`` are constants (the paper's delay-adaptive ``alpha_k``
    and decaying ``eta_k`` schedules are not implemented), and a worker's lookahead uses the
    same ``alpha`` as the server. The comparison paper (arXiv 2509.24305) tunes AFedPG on the
    same constant grids as Rennala NIGT; ``python -m experiments.nigt`` sweeps ``alpha``
    (``--alpha``) for want of the schedules.

    Time: worker ``i``'s gradient is ready ``h[i]`` after it received its point and reaches
    the server ``kappa[i]`` later (one vector sent per gradient); the server's step and the
    reply cost no time (the NIGT rounds of :func:`simulate` do not charge the broadcast
    either). Ties are broken by worker index.

    Args:
        policy: as for :func:`simulate`.
        envs: as for :func:`simulate` (one factory per worker: each worker samples its own
            env; AFedPG has no rule against over-weighting fast workers).
        h: virtual time per trajectory gradient, one per worker.
        kappa: virtual time to send one gradient, one per worker or one for all.
        lr: the step length ``eta``.
        momentum: ``alpha`` in ``(0, 1]``.
        horizon: as for :func:`simulate`.
        gamma: as for :func:`simulate`.
        max_delay: refuse a gradient computed more than this many server steps ago (it is
            counted in :attr:`SimRound.discarded`, and its worker gets the current point);
            ``None`` (AFedPG as published) applies every gradient.
        iterations: stop after this many server steps.
        time_budget: stop after the step that passes this virtual time.
        seed: as for :func:`simulate`.

    Raises:
        ConfigError: bad times, no stopping criterion, env factories that do not match the
            workers, or a ``max_delay`` that is not ``None`` or an int ``>= 0``.
    """
    from aps.wire.messages import GradientRound

    n, times, comm = _check(h, kappa, iterations, time_budget)
    if max_delay is not None and (
        isinstance(max_delay, bool) or not isinstance(max_delay, int) or max_delay < 0
    ):
        raise ConfigError(f"max_delay must be None or an int >= 0, got {max_delay!r}")
    update = NIGTUpdate(lr=lr, momentum=momentum)
    pools, pool_of, module_policy = _pools(policy, envs, n, 1, seed)
    vector0, layout = flatten(module_policy.get_weights())
    state = update.start(vector0)
    # Each worker's point and the server step it was sent at.
    points: list[tuple[Any, int]] = [(state.point, 0)] * n
    events = [(times[i] + comm[i], i) for i in range(n)]
    heapq.heapify(events)
    discarded = 0
    step = 0
    clock = 0.0
    while (iterations is None or step < iterations) and (
        time_budget is None or clock < time_budget
    ):
        clock, worker = heapq.heappop(events)
        point, sent_at = points[worker]
        delay = state.t - sent_at
        if max_delay is not None and delay > max_delay:
            discarded += 1
        else:
            message = GradientRound(
                round=sent_at, arrays=unflatten(point, layout), horizon=horizon, gamma=gamma
            )
            returns: list[float] = []
            [(gradient, _)] = pools[pool_of[worker]].draw([1], message, layout, returns)
            state = update.step(state, gradient)
            module_policy.set_weights(unflatten(state.theta, layout))
            yield SimRound(
                iteration=step,
                time=clock,
                compute=times[worker],
                communication=comm[worker],
                contributions={worker: 1},
                used=1,
                mean_return=returns[0],
                direction_norm=state.direction_norm,
                delay=delay,
                discarded=discarded,
            )
            discarded = 0
            step += 1
        points[worker] = (state.point, state.t)
        heapq.heappush(events, (clock + times[worker] + comm[worker], worker))
