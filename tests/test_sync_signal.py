"""RelativeAPS: APS's divergence measured in updates' worth of drift.

Decision tables on constructed contexts (no event loop), and one real DETACH run on
CartPole over memory:// where it syncs on drift, well before ``max_lag``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium as gym
import pytest

from aps.errors import ConfigError, InvalidState
from aps.sync import APS, AnyOf, FixedInterval, RelativeAPS, SyncContext, SyncStrategy


def forbidden() -> float:
    raise AssertionError("measured, but the decision must not have needed it")


def ctx(worker: int, learner: int, *, kl: float | None = None, drift: float | None = None) -> Any:
    """A context whose divergence is ``kl`` and one update's drift ``drift``.

    Without a value, measuring that quantity fails the test, so every row also checks that
    nothing needless is measured.
    """

    def constant(value: float | None) -> Callable[[], float]:
        if value is None:
            return forbidden
        return lambda: value

    return SyncContext(
        worker_id=0,
        worker_version=worker,
        learner_version=learner,
        measure_divergence=constant(kl),
        measure_update_drift=constant(drift),
    )


TABLE: list[tuple[SyncStrategy, SyncContext, bool]] = [
    # Nothing to send: no measurement at all.
    (RelativeAPS(updates=4), ctx(3, 3), False),
    (RelativeAPS(updates=4), ctx(4, 3), False),
    # The first version is the role's business; a consulted strategy sends it unmeasured.
    (RelativeAPS(updates=4), ctx(-1, 0), True),
    (RelativeAPS(updates=4), ctx(-1, 7), True),
    # max_lag syncs without measuring.
    (RelativeAPS(updates=4), ctx(0, 16), True),
    (RelativeAPS(updates=4, max_lag=3), ctx(5, 8), True),
    # Both sides of the threshold: 4 updates' worth of drift 0.0027 is 0.0108 nats.
    (RelativeAPS(updates=4), ctx(0, 5, kl=0.0107, drift=0.0027), False),
    (RelativeAPS(updates=4), ctx(0, 5, kl=0.0108, drift=0.0027), False),  # strict
    (RelativeAPS(updates=4), ctx(0, 5, kl=0.0109, drift=0.0027), True),
    # The same worker against a learner that moves ten times as far per update: not behind.
    (RelativeAPS(updates=4), ctx(0, 5, kl=0.0109, drift=0.027), False),
    # Scale-free: the same ratio decides on an env whose KLs are 100x smaller.
    (RelativeAPS(updates=4), ctx(0, 5, kl=0.000107, drift=0.000027), False),
    (RelativeAPS(updates=4), ctx(0, 5, kl=0.000109, drift=0.000027), True),
    # A fractional number of updates.
    (RelativeAPS(updates=1.5), ctx(0, 2, kl=0.0031, drift=0.002), True),
    (RelativeAPS(updates=1.5), ctx(0, 2, kl=0.0029, drift=0.002), False),
    # A learner whose last update did not move: any measurable divergence is behind.
    (RelativeAPS(updates=4), ctx(0, 5, kl=1e-9, drift=0.0), True),
    (RelativeAPS(updates=4), ctx(0, 5, kl=0.0, drift=0.0), False),
    # NaN (the previous version no longer kept) or inf decide safely.
    (RelativeAPS(updates=4), ctx(0, 5, kl=0.5, drift=math.nan), False),
    (RelativeAPS(updates=4), ctx(0, 5, kl=math.nan, drift=0.001), False),
    (RelativeAPS(updates=4), ctx(0, 5, kl=math.inf, drift=0.001), True),
    # Unbounded: only the ratio decides, however stale.
    (RelativeAPS(updates=4, max_lag=None), ctx(0, 1000, kl=0.01, drift=0.01), False),
    (RelativeAPS(updates=4, max_lag=None), ctx(0, 1000, kl=0.05, drift=0.01), True),
    # Composes: the interval answers first and nothing is measured.
    (AnyOf(FixedInterval(versions=2), RelativeAPS(updates=4)), ctx(0, 2), True),
]


@pytest.mark.parametrize(("strategy", "context", "expected"), TABLE)
def test_decision_table(strategy: SyncStrategy, context: SyncContext, expected: bool) -> None:
    assert strategy.should_sync(context) is expected


def test_the_same_context_where_aps_never_fires() -> None:
    # MinAtar's measured medians: lag 8 at a mean KL of 0.0232, one update 0.0027 nats.
    context = ctx(0, 8, kl=0.0232, drift=0.0027)
    assert not APS(kl_threshold=0.05).should_sync(context)
    assert RelativeAPS(updates=4).should_sync(context)


def test_each_quantity_is_measured_once_per_context() -> None:
    calls = {"kl": 0, "drift": 0}

    def kl() -> float:
        calls["kl"] += 1
        return 0.02

    def drift() -> float:
        calls["drift"] += 1
        return 0.01

    context = SyncContext(
        worker_id=0,
        worker_version=1,
        learner_version=4,
        measure_divergence=kl,
        measure_update_drift=drift,
    )
    both = AnyOf(RelativeAPS(updates=3), RelativeAPS(updates=1))
    assert both.should_sync(context)
    assert calls == {"kl": 1, "drift": 1}


def test_a_context_without_the_drift_says_what_to_pass() -> None:
    context = SyncContext(
        worker_id=0, worker_version=1, learner_version=4, measure_divergence=lambda: 0.1
    )
    with pytest.raises(InvalidState, match="measure_update_drift"):
        RelativeAPS(updates=4).should_sync(context)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"updates": 0},
        {"updates": -1.0},
        {"updates": math.inf},
        {"updates": math.nan},
        {"updates": True},
        {"updates": "4"},
        {"updates": 4, "max_lag": 0},
        {"updates": 4, "max_lag": 2.5},
        {"updates": 4, "max_lag": True},
    ],
)
def test_bad_parameters_are_refused_naming_the_value(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="RelativeAPS") as info:
        RelativeAPS(**kwargs)
    bad = kwargs.get("max_lag", kwargs["updates"])
    assert repr(bad) in str(info.value)


def test_it_is_a_frozen_strategy_with_float_updates() -> None:
    strategy = RelativeAPS(updates=4)
    assert isinstance(strategy, SyncStrategy)
    assert strategy.updates == 4.0 and isinstance(strategy.updates, float)
    assert strategy.max_lag == 16


# -- a real DETACH run ------------------------------------------------------------------------

AGENTS = str(Path(__file__).with_name("agents.py"))


@pytest.mark.timeout(60)
async def test_a_detach_run_syncs_on_drift_before_max_lag(workers: Any) -> None:
    torch = pytest.importorskip("torch")
    import aps
    from tests.agents import Agent
    from tests.conftest import FAST

    class Spaces:
        env = gym.make("CartPole-v1")
        single_observation_space = env.observation_space
        single_action_space = env.action_space

    torch.manual_seed(0)
    agent = Agent(Spaces())
    # Every update moves the weights one step along the same direction, so a worker k
    # versions behind has drifted more than k updates' worth (KL grows about quadratically
    # along a line): more than 2 at k = 2, and exactly 1 at k = 1.
    direction = [0.05 * torch.randn_like(p) for p in agent.parameters()]
    learner = aps.Learner(
        "memory://",
        num_workers=2,
        policy=f"{AGENTS}:Agent",
        sync=RelativeAPS(updates=2, max_lag=16),
        timeouts=FAST,
    )
    async with learner:
        for _ in range(2):
            workers.start(learner.url, env="CartPole-v1", num_envs=3)
        await learner.reset(seed=0)
        await learner.publish(agent)
        lags = []
        for _ in range(12):
            await learner.rollout(8)
            with torch.no_grad():
                for p, d in zip(agent.parameters(), direction, strict=True):
                    p.add_(d)
            await learner.publish(agent)
            batch = await learner.rollout(8)
            lags.append(int(batch.lag.max()))
        metrics = learner.metrics
    # 13 versions, never 16 behind: max_lag never forced a sync, the drift did.
    assert max(lags) == 1 and metrics.lag_max <= 1
    for worker in metrics.workers:
        assert worker.syncs >= 6  # the first version, then one every two publishes or so
        assert worker.divergences and min(worker.divergences) > 0
