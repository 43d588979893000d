"""aps.learner.simulate: NIGT in virtual time with the networked path's rules and update."""

from __future__ import annotations

import math
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

pytest.importorskip("torch")

import aps
from aps import pg
from aps.learner.simulate import afedpg, simulate
from tests.pg_agents import MeanAgent, Reveal


def test_rennala_counts_follow_the_time_model() -> None:
    # Completions: worker 0 at 1, 2, 3, 4; worker 1 at 2, 4; worker 2 at 4: the seventh
    # gradient is ready at t = 4, when the counts are 4, 2 and 1.
    agent = MeanAgent()
    rounds = list(
        simulate(
            agent,
            Reveal,
            h=[1.0, 2.0, 4.0],
            kappa=[0.5, 0.25, 3.0],
            aggregator=pg.Rennala(batch=7),
            lr=0.25,
            momentum=1.0,
            horizon=10,
            gamma=1.0,
            iterations=3,
        )
    )
    for t, r in enumerate(rounds):
        assert r.contributions == {0: 4, 1: 2, 2: 1} and r.used == 7
        assert (r.compute, r.communication) == (4.0, 3.0)  # one aggregation: the slowest link
        assert r.time == pytest.approx(7.0 * (t + 1))
    # The same NIGT step as the networked trainer: mu goes up by exactly lr a round.
    assert agent.mu == pytest.approx(0.75, abs=1e-6)


def test_malenia_waits_until_the_harmonic_mean_of_counts_holds() -> None:
    # n = 2, batch 4: 1/M_0 + 1/M_1 <= 1 first holds at t = 20 (M_1 = 2, M_0 = 20).
    [r] = simulate(
        MeanAgent(),
        [Reveal, lambda: Reveal(length=2)],
        h=[1.0, 10.0],
        aggregator=pg.Malenia(batch=4),
        horizon=10,
        iterations=1,
    )
    assert r.contributions == {0: 20, 1: 2} and r.compute == 20.0 and r.communication == 0.0


def test_synchronous_waits_for_the_slowest_and_the_budget_stops_the_run() -> None:
    rounds = list(
        simulate(
            MeanAgent(),
            Reveal,
            h=[math.sqrt(i + 1) for i in range(10)],
            kappa=1.0,
            aggregator=pg.Synchronous(),
            horizon=10,
            time_budget=10.0,
        )
    )
    slowest = math.sqrt(10)
    assert all(r.compute == slowest and r.used >= 10 for r in rounds)
    assert len(rounds) == math.ceil(10.0 / (slowest + 1.0))
    assert all(np.isfinite(r.mean_return) for r in rounds)


def test_bad_times_are_refused() -> None:
    with pytest.raises(aps.ConfigError, match="h entries must be finite and > 0"):
        next(simulate(MeanAgent(), Reveal, h=[1.0, 0.0], iterations=1))
    with pytest.raises(aps.ConfigError, match="kappa has 3 entries for 2 workers"):
        next(simulate(MeanAgent(), Reveal, h=[1.0, 2.0], kappa=[0, 0, 0], iterations=1))
    with pytest.raises(aps.ConfigError, match="never stops"):
        next(simulate(MeanAgent(), Reveal, h=[1.0]))


def test_vector_sampling_sums_exactly_the_counted_gradients() -> None:
    # envs_per_worker (kept for earlier callers) raises the sampling pool to 4 envs; the sums
    # still hold exactly the 4, 2 and 1 gradients the rule counted. Other pool sizes:
    # test_pg_simulate_sampling.py.
    [r] = simulate(
        MeanAgent(),
        Reveal,
        h=[1.0, 2.0, 4.0],
        aggregator=pg.Rennala(batch=7),
        horizon=10,
        iterations=1,
        envs_per_worker=4,
    )
    assert r.contributions == {0: 4, 1: 2, 2: 1} and r.used == 7


def test_afedpg_applies_each_gradient_on_arrival_with_its_delay() -> None:
    # Worker i returns a gradient every h_i + kappa_i: worker 0 at 1.5, 3, 4.5, 6, ...,
    # worker 1 at 2.25, 4.5, 6.75, ..., worker 2 at 7. The delay is the number of server
    # steps since the worker got its point (ties go to the lower index).
    agent = MeanAgent()
    steps = list(
        afedpg(
            agent,
            Reveal,
            h=[1.0, 2.0, 4.0],
            kappa=[0.5, 0.25, 3.0],
            lr=0.25,
            momentum=1.0,
            horizon=10,
            gamma=1.0,
            iterations=8,
        )
    )
    assert [(s.time, *s.contributions, s.delay) for s in steps] == [
        (1.5, 0, 0),
        (2.25, 1, 1),
        (3.0, 0, 1),
        (4.5, 0, 0),
        (4.5, 1, 2),
        (6.0, 0, 1),
        (6.75, 1, 1),
        (7.0, 2, 7),
    ]
    assert all(s.used == 1 and s.discarded == 0 for s in steps)
    assert [s.communication for s in steps][:2] == [0.5, 0.25]  # one send per gradient
    # Every step moves mu by exactly +-lr (momentum 1: the normalized single gradient), so
    # after 8 steps mu is an even multiple of lr.
    k = agent.mu / 0.25
    assert k == pytest.approx(round(k), abs=1e-5) and round(k) % 2 == 0


def test_afedpg_refuses_gradients_older_than_max_delay() -> None:
    steps = list(
        afedpg(
            MeanAgent(),
            Reveal,
            h=[1.0, 2.0, 4.0],
            kappa=[0.5, 0.25, 3.0],
            horizon=10,
            max_delay=0,
            iterations=8,
        )
    )
    # Same arrivals as above; the stale ones (every gradient but the fresh ones) are refused.
    assert all(s.delay == 0 for s in steps)
    assert sum(s.discarded for s in steps) > 0
    with pytest.raises(aps.ConfigError, match="max_delay must be None or an int >= 0"):
        next(afedpg(MeanAgent(), Reveal, h=[1.0], max_delay=-1, iterations=1))


class Quadratic(gym.Env[np.ndarray, np.ndarray]):
    """One step; reward -(action - 3)^2; observation 0."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
    action_space = gym.spaces.Box(-100.0, 100.0, (1,), np.float32)

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict]:
        return np.zeros(1, np.float32), -float((action[0] - 3.0) ** 2), True, False, {}


def test_afedpg_converges_on_a_quadratic() -> None:
    # J(mu) = -(mu - 3)^2 - sigma^2: from mu = 0, normalized steps of 0.05 with momentum
    # must reach and stay near the maximum at 3, despite delays from four unequal workers.
    agent = MeanAgent(log_std=-1.0)
    steps = list(
        afedpg(
            agent,
            Quadratic,
            h=[1.0, 2.0, 3.0, 4.0],
            kappa=0.5,
            lr=0.05,
            momentum=0.2,
            horizon=1,
            iterations=400,
        )
    )
    assert max(s.delay for s in steps) >= 2
    assert agent.mu == pytest.approx(3.0, abs=0.5)


def test_sampler_limit_must_be_a_positive_int() -> None:
    from gymnasium.vector import AutoresetMode, SyncVectorEnv

    from aps.policy import Policy
    from aps.wire.messages import GradientRound
    from aps.worker.sampling import GradientSampler

    envs = SyncVectorEnv([Reveal] * 2, autoreset_mode=AutoresetMode.SAME_STEP)
    policy = Policy(MeanAgent(), envs.single_observation_space, envs.single_action_space)
    sampler = GradientSampler(envs, policy)
    sampler.start(GradientRound(round=0, arrays=policy.get_weights(), horizon=1, gamma=1.0))
    with pytest.raises(aps.ConfigError, match="limit must be None or an int >= 1, got 0"):
        sampler.step(limit=0)
    report = sampler.step(limit=1)  # both trajectories end (horizon 1); one is reported
    assert report is not None and report.count == 1 and len(report.episode_return) == 1
