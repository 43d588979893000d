"""The built-in sync strategies: two baselines, APS and RelativeAPS, combinators, and Never.

Every built-in is a frozen dataclass that holds only its parameters, checks them when built
(:class:`~aps.errors.ConfigError` naming the value), and answers ``False`` whenever the worker
already holds the learner's version (``ctx.lag <= 0``). A worker that holds no version at all
(``ctx.worker_version == -1``) is the role's business, not a strategy's: the learner always
sends it the first version. If consulted anyway, every built-in but :class:`Never` answers
``True`` for it without measuring a divergence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from aps.errors import ConfigError
from aps.sync.base import SyncContext, SyncStrategy

__all__ = ["APS", "AllOf", "AlwaysSync", "AnyOf", "FixedInterval", "Never", "RelativeAPS"]


def _check_count(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{owner}({name}=...) must be an int >= 1, got {value!r}")


@dataclass(frozen=True, slots=True)
class AlwaysSync:
    """Send every new version to every worker: sync whenever ``ctx.lag > 0``.

    The always-sync baseline. "Always" means after every learner update, not every step:
    a worker that holds the current version gets nothing.
    """

    def should_sync(self, ctx: SyncContext) -> bool:
        """Return ``True`` exactly when the worker lacks the learner's current version."""
        return ctx.lag > 0


@dataclass(frozen=True, slots=True)
class Never:
    """Never send weights after the first deployment.

    Workers act with the version they received first for the whole run. Useful as the
    zero-traffic end of a benchmark, and in tests.
    """

    def should_sync(self, ctx: SyncContext) -> bool:
        """Return ``False``, always."""
        return False


@dataclass(frozen=True, slots=True)
class FixedInterval:
    """The fixed-interval baseline: sync every ``versions`` versions or every ``steps`` steps.

    Give exactly one of the two.

    Args:
        versions: sync when the worker is at least this many versions behind
            (``ctx.lag >= versions``). ``1`` behaves like :class:`AlwaysSync`.
        steps: sync when the worker took at least this many env steps (one per env per step)
            since its last sync and a newer version exists (``ctx.lag > 0``).

    Raises:
        ConfigError: neither or both are given, or a value is not an int >= 1.
    """

    versions: int | None = None
    steps: int | None = None

    def __post_init__(self) -> None:
        if (self.versions is None) == (self.steps is None):
            raise ConfigError(
                f"FixedInterval needs exactly one of versions= or steps=, "
                f"got versions={self.versions!r}, steps={self.steps!r}"
            )
        if self.versions is not None:
            _check_count("FixedInterval", "versions", self.versions)
        if self.steps is not None:
            _check_count("FixedInterval", "steps", self.steps)

    def should_sync(self, ctx: SyncContext) -> bool:
        """Return ``True`` when the interval has passed and the worker lacks the current version."""
        lag = ctx.lag
        if lag <= 0:
            return False
        if not ctx.holds_weights:
            return True
        if self.versions is not None:
            return lag >= self.versions
        assert self.steps is not None  # __post_init__ guarantees one of the two
        return ctx.steps_since_sync >= self.steps


@dataclass(frozen=True, slots=True)
class APS:
    """Adaptive Policy Synchronization: sync when the worker's policy drifted too far.

    The decision, in order:

    1. ``ctx.lag <= 0``: no sync, and the divergence is not measured (it is 0 by definition).
    2. the worker holds no version: sync, without measuring.
    3. ``max_lag`` is set and ``ctx.lag >= max_lag``: sync, without measuring.
    4. otherwise: sync when ``ctx.divergence() > kl_threshold`` (strict).

    The divergence the learner measures is the mean over the states the worker just acted on
    of ``KL(pi_worker_version(.|s) || pi_learner(.|s))`` (see :meth:`aps.policy.Policy.kl`), so
    ``kl_threshold`` is a per-state KL in nats, independent of how many envs a worker runs.

    Why staleness is bounded by default: without a bound, a threshold above what the learner
    can move in the worker's states freezes that worker on an old version for good. PPO
    clipped against the workers' stale behaviour policy (the paper's objective) is the
    common case: each update moves the policy at most about the clip range away from the
    policy that collected the data, so the learner never gets further than a threshold of
    0.05 or more from a frozen worker, the divergence never crosses it, and the worker acts
    with its first policy for the whole run while the learner trains on its data. Nothing
    fails and nothing says so. Measured (``examples/ppo_cluster.py --no-decoupled``,
    CartPole-v1, 100k env steps, 2 workers x 8 envs, 195 versions): without a bound,
    thresholds 0.05 and 1.0 both ended at a return of 25 with the workers 194 versions
    behind. With a bound and a threshold that never fires, so that ``max_lag`` alone
    decides, bounds of 4, 8 and 16 versions learned (mean final returns 409, 433 and 469 over
    seeds 1-3; always-sync 296 in the same runs) and 32 fell to 308. So the default is 16,
    the largest bound that kept the return; a never-firing APS then still sends 1/16 of
    always-sync's weights in a loop that publishes once per batch (see docs/detach.md).
    Versions are counted as published: a loop that publishes several per batch (DQN's one per
    gradient step) reaches the bound sooner.

    Args:
        kl_threshold: the per-state mean KL, in nats, above which the worker is synced.
            ``>= 0`` and finite; ``0`` syncs on any measurable drift.
        max_lag: a worker this many versions behind is synced whatever the divergence,
            bounding staleness. An int ``>= 1``; default 16 (see above). ``None`` removes the
            bound: the paper's unbounded APS, which can freeze workers as described.

    Raises:
        ConfigError: a negative, infinite or NaN threshold, or a ``max_lag`` that is neither
            an int >= 1 nor ``None``.
    """

    kl_threshold: float
    max_lag: int | None = 16

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "kl_threshold",
            _number("APS", "kl_threshold", self.kl_threshold, "a KL in nats, e.g. 0.01"),
        )
        _check_max_lag("APS", self.max_lag)

    def should_sync(self, ctx: SyncContext) -> bool:
        """Return ``True`` when the worker is too stale or its divergence exceeds the threshold."""
        by_lag = _by_lag(ctx, self.max_lag)
        if by_lag is not None:
            return by_lag
        return ctx.divergence() > self.kl_threshold


@dataclass(frozen=True, slots=True)
class RelativeAPS:
    """APS with its threshold in updates' worth of drift: a signal that means the same on pixels.

    The decision, in order:

    1. ``ctx.lag <= 0``: no sync, nothing measured.
    2. the worker holds no version: sync, without measuring.
    3. ``max_lag`` is set and ``ctx.lag >= max_lag``: sync, without measuring.
    4. otherwise: sync when ``ctx.divergence() > updates * ctx.update_drift()`` (strict),
       both measured on the same states the worker just acted on. A NaN on either side
       (the previous version no longer kept) syncs nothing; ``max_lag`` still bounds it.

    ``ctx.divergence()`` is :class:`APS`'s signal, the mean per-state ``KL(pi_worker ||
    pi_learner)``; ``ctx.update_drift()`` is the same KL of the learner's previous version
    from its newest: how far one update moves the policy on those states. Their ratio counts
    how many updates' worth the worker has fallen behind, whatever the env's own scale.

    Why not an absolute threshold: measured on MinAtar Breakout (``benchmarks/staleness.py``,
    PPO, 1024 env-steps per update, 3 seeds; ``docs/detach.md``, "A signal for pixels"), one
    update moved the policy by a median mean KL of 0.0027 nats, 0.27x the smallest threshold
    people give APS (0.01) and 0.05x a common one (0.05). The mean KL grew about linearly with
    the lag, reaching 0.042 at 16 versions: ``APS(0.05)`` never fires there and every sync
    comes from ``max_lag``, as it did on Atari. The 95th percentile of the per-state KL was
    4.3-4.7x the mean at every lag, so a tail statistic is the same signal at another scale
    and still needs a threshold tuned per env. The ratio to the same update's own drift was
    close to the lag itself (medians 4.7 at lag 4, 8.8 at 8, 16.7 at 16; alike on every seed)
    and varied from update to update (25th-75th percentiles 3.0-7.2 at lag 4): it syncs
    sooner while the policy moves the same way update after update, later while it wanders.

    What it costs: a second KL measurement per decision (two forward passes over at most
    ``max_states`` states), and the learner keeps the previous version's weights once a
    decision has asked for its drift.

    Args:
        updates: how many updates' worth of drift the worker may fall behind before it is
            synced; a finite number ``> 0``. On the workload above, 4 synced at about lag 4.
        max_lag: a worker this many versions behind is synced whatever the divergence, as in
            :class:`APS`. An int ``>= 1``; default 16. ``None`` removes the bound.

    Raises:
        ConfigError: ``updates`` not a finite number > 0, or a ``max_lag`` that is neither an
            int >= 1 nor ``None``.
    """

    updates: float
    max_lag: int | None = 16

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "updates",
            _number(
                "RelativeAPS",
                "updates",
                self.updates,
                "updates' worth of drift, e.g. 4",
                above=True,
            ),
        )
        _check_max_lag("RelativeAPS", self.max_lag)

    def should_sync(self, ctx: SyncContext) -> bool:
        """Return ``True`` when the worker is too stale or more than ``updates`` updates behind."""
        by_lag = _by_lag(ctx, self.max_lag)
        if by_lag is not None:
            return by_lag
        return ctx.divergence() > self.updates * ctx.update_drift()


def _number(owner: str, name: str, value: object, what: str, *, above: bool = False) -> float:
    """``value`` as a float: a finite number >= 0 (> 0 with ``above``), else ConfigError."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or (value <= 0 if above else value < 0)
    ):
        bound = "> 0" if above else ">= 0"
        raise ConfigError(
            f"{owner}({name}=...) must be a finite number {bound} ({what}), got {value!r}"
        )
    return float(value)


def _check_max_lag(owner: str, lag: object) -> None:
    if lag is not None and (isinstance(lag, bool) or not isinstance(lag, int) or lag < 1):
        raise ConfigError(
            f"{owner}(max_lag=...) must be an int >= 1 (versions), or None for no staleness "
            f"bound, got {lag!r}"
        )


def _by_lag(ctx: SyncContext, max_lag: int | None) -> bool | None:
    """What the lag alone decides for APS's kind (``None``: the divergence decides).

    Nothing while the worker holds the newest version; always while it holds none; always
    at ``max_lag`` versions behind.
    """
    lag = ctx.lag
    if lag <= 0:
        return False
    if not ctx.holds_weights or (max_lag is not None and lag >= max_lag):
        return True
    return None


def _check_members(owner: str, strategies: tuple[object, ...]) -> None:
    if not strategies:
        raise ConfigError(f"{owner}() needs at least one strategy, got none")
    for index, strategy in enumerate(strategies):
        if not isinstance(strategy, SyncStrategy):
            raise ConfigError(
                f"{owner} argument {index} is {strategy!r} ({type(strategy).__name__}), "
                "not a sync strategy; pass objects with a should_sync(ctx) method"
            )


@dataclass(frozen=True, slots=True, init=False, repr=False)
class AnyOf:
    """Sync when any of the strategies says so.

    The strategies are asked in the order given and the first ``True`` ends the decision,
    so put cheap strategies first: ``AnyOf(FixedInterval(versions=16), APS(0.01))`` never
    measures a divergence for a worker 16 or more versions behind. Answers ``False`` when
    ``ctx.lag <= 0`` without asking anyone.

    Args:
        strategies: one or more strategies.

    Raises:
        ConfigError: no strategies, or an argument without a ``should_sync`` method.
    """

    strategies: tuple[SyncStrategy, ...]

    def __init__(self, *strategies: SyncStrategy) -> None:
        _check_members("AnyOf", strategies)
        object.__setattr__(self, "strategies", strategies)

    def __repr__(self) -> str:
        return f"AnyOf({', '.join(map(repr, self.strategies))})"

    def should_sync(self, ctx: SyncContext) -> bool:
        """Return ``True`` at the first strategy that does, asking them in order."""
        if ctx.lag <= 0:
            return False
        return any(strategy.should_sync(ctx) for strategy in self.strategies)


@dataclass(frozen=True, slots=True, init=False, repr=False)
class AllOf:
    """Sync only when every strategy says so; a rate limit for another strategy.

    The strategies are asked in the order given and the first ``False`` ends the decision:
    ``AllOf(FixedInterval(steps=1024), APS(0.01))`` measures the divergence only for workers
    that took 1024 steps since their last sync, and syncs those that drifted. Answers
    ``False`` when ``ctx.lag <= 0`` without asking anyone.

    Args:
        strategies: one or more strategies.

    Raises:
        ConfigError: no strategies, or an argument without a ``should_sync`` method.
    """

    strategies: tuple[SyncStrategy, ...]

    def __init__(self, *strategies: SyncStrategy) -> None:
        _check_members("AllOf", strategies)
        object.__setattr__(self, "strategies", strategies)

    def __repr__(self) -> str:
        return f"AllOf({', '.join(map(repr, self.strategies))})"

    def should_sync(self, ctx: SyncContext) -> bool:
        """Return ``False`` at the first strategy that does, asking them in order."""
        if ctx.lag <= 0:
            return False
        return all(strategy.should_sync(ctx) for strategy in self.strategies)
