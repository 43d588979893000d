"""GradientSampler.sample and Synchronous(share=k): the batch sampling aps.learner.simulate uses."""

from __future__ import annotations

import math
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

pytest.importorskip("torch")

import torch
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from torch import nn

import aps
from aps import pg
from aps.learner.simulate import simulate
from aps.pg.reinforce import surrogate
from aps.policy import Policy
from aps.wire.messages import GradientRound
from aps.worker.sampling import GradientSampler
from tests.pg_agents import MeanAgent, Reveal


class Wander(gym.Env[np.ndarray, np.ndarray]):
    """Episodes of random length: terminates with probability 0.3 a step; rewards vary."""

    observation_space = gym.spaces.Box(-10.0, 10.0, (2,), np.float32)
    action_space = gym.spaces.Box(-1e6, 1e6, (1,), np.float32)

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self._x = self.np_random.normal(size=2).astype(np.float32)
        return self._x.copy(), {}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict]:
        reward = float(np.tanh(action[0]) * self._x[0] + self._x[1])
        self._x = (0.9 * self._x + self.np_random.normal(size=2)).astype(np.float32)
        return self._x.copy(), reward, bool(self.np_random.random() < 0.3), False, {}


class Logged(gym.Wrapper[np.ndarray, np.ndarray, np.ndarray, np.ndarray]):
    """Records every transition (obs acted on, action, reward) and every reset, per env."""

    def __init__(self, env: gym.Env[Any, Any], log: list[tuple[Any, ...]]) -> None:
        super().__init__(env)
        self.log = log
        self._obs: np.ndarray | None = None

    def reset(self, **kwargs: Any) -> tuple[np.ndarray, dict]:
        self._obs, info = self.env.reset(**kwargs)
        self.log.append(("reset",))
        return self._obs, info

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.log.append(("step", self._obs, np.array(action, copy=True), float(reward)))
        self._obs = obs
        return obs, reward, terminated, truncated, info


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.actor_mean = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))
        self.actor_logstd = nn.Parameter(torch.zeros(1, 1))


def _one_at_a_time(policy: Policy, trajectory: list[tuple[Any, ...]], gamma: float) -> np.ndarray:
    """The gradient of one trajectory, by itself."""
    module = policy.module
    module.zero_grad(set_to_none=True)
    obs = np.stack([t[1] for t in trajectory])
    actions = np.stack([t[2] for t in trajectory])
    rewards = np.asarray([t[3] for t in trajectory])
    surrogate(policy.log_prob(obs, actions), rewards, gamma).backward()
    return np.concatenate([p.grad.detach().numpy().ravel() for p in module.parameters()])


def _flat(report: Any, module: nn.Module) -> np.ndarray:
    return np.concatenate(
        [report.gradient[name].ravel() for name, _ in module.named_parameters()]
    ).astype(np.float64)


def test_sample_gives_each_group_exactly_its_trajectories_gradient_sum() -> None:
    horizon, gamma, counts = 6, 0.9, [3, 0, 5, 2]
    logs: list[list[tuple[Any, ...]]] = []

    def make() -> gym.Env[Any, Any]:
        logs.append([])
        return Logged(Wander(), logs[-1])

    envs = SyncVectorEnv([make] * 4, autoreset_mode=AutoresetMode.SAME_STEP)
    envs.reset(seed=3)
    torch.manual_seed(0)
    policy = Policy(Mlp(), envs.single_observation_space, envs.single_action_space)
    policy.seed(1)
    sampler = GradientSampler(envs, policy)
    sampler.start(GradientRound(round=0, arrays=policy.get_weights(), horizon=horizon, gamma=gamma))
    for log in logs:
        log.clear()
    reports = sampler.sample(counts)
    assert reports[1] is None
    assert [r.count if r else 0 for r in reports] == counts

    # Each env's trajectories, in order, from its own log: a trajectory runs from a reset to
    # the next reset, at most ``horizon`` steps (the sampler resets an env at the horizon).
    trajectories: list[list[list[tuple[Any, ...]]]] = []
    for log in logs:
        mine: list[list[tuple[Any, ...]]] = []
        for entry in log:
            if entry[0] == "reset":
                mine.append([])
            else:
                mine[-1].append(entry)
        trajectories.append([t for t in mine if t])
    quota = [3, 3, 2, 2]  # 10 trajectories over 4 envs, as evenly as possible
    for env, q in enumerate(quota):
        assert len(trajectories[env]) >= q and all(
            1 <= len(t) <= horizon for t in trajectories[env][:q]
        )

    def sums(order: list[tuple[int, int]]) -> list[np.ndarray]:
        gradients = [_one_at_a_time(policy, trajectories[env][k], gamma) for k, env in order]
        out, start = [], 0
        for count in counts:
            out.append(np.sum(gradients[start : start + count], axis=0))
            start += count
        return out

    documented = [(k, env) for k in range(3) for env in range(4) if k < quota[env]]
    expected = sums(documented)
    for group, count in enumerate(counts):
        if count:
            got = _flat(reports[group], policy.module)
            np.testing.assert_allclose(got, expected[group], rtol=1e-4, atol=1e-5)
            returns = sorted(sum(t[3] for t in trajectories[env][k]) for k, env in documented)
            assert set(np.round(reports[group].episode_return, 5)) <= set(np.round(returns, 5))
    # The check can fail: the same trajectories attributed env-major give other sums.
    wrong = sums(sorted(documented, key=lambda key: (key[1], key[0])))
    assert not np.allclose(wrong[0], expected[0], rtol=1e-4, atol=1e-5)


def test_sample_refuses_bad_counts_and_gives_nothing_for_none() -> None:
    envs = SyncVectorEnv([Reveal] * 2, autoreset_mode=AutoresetMode.SAME_STEP)
    policy = Policy(MeanAgent(), envs.single_observation_space, envs.single_action_space)
    sampler = GradientSampler(envs, policy)
    sampler.start(GradientRound(round=0, arrays=policy.get_weights(), horizon=3, gamma=1.0))
    with pytest.raises(aps.ConfigError, match="counts must be ints >= 0, got -1"):
        sampler.sample([1, -1])
    assert sampler.sample([0, 0]) == [None, None]
    # step() works again after sample(): every env starts afresh.
    [report] = sampler.sample([5])
    assert report is not None and report.count == 5
    while (step := sampler.step()) is None:
        pass
    assert step.count == 2


@pytest.mark.parametrize("pool", [1, 8, 64])
def test_simulate_sums_hold_exactly_the_noted_counts_for_any_pool(pool: int) -> None:
    [r] = simulate(
        MeanAgent(),
        Reveal,
        h=[1.0, 2.0, 4.0],
        aggregator=pg.Rennala(batch=7),
        horizon=10,
        iterations=1,
        pool=pool,
    )
    assert r.contributions == {0: 4, 1: 2, 2: 1} and r.used == 7


def test_malenia_harmonic_rule_holds_with_one_shared_pool() -> None:
    # Both workers share one env factory, so their trajectories come from one vector env;
    # 1/M_0 + 1/M_1 <= 1/2 first holds at t = 20 (M_0 = 20, M_1 = 2), as with two factories.
    rounds = list(
        simulate(
            MeanAgent(),
            Reveal,
            h=[1.0, 10.0],
            aggregator=pg.Malenia(batch=4),
            horizon=10,
            iterations=2,
            pool=16,
        )
    )
    assert all(r.contributions == {0: 20, 1: 2} and r.compute == 20.0 for r in rounds)


def test_synchronous_share_gives_k_each_and_waits_max_k_h() -> None:
    h = [math.sqrt(i + 1) for i in range(10)]
    rounds = list(
        simulate(
            MeanAgent(),
            Reveal,
            h=h,
            kappa=1.0,
            aggregator=pg.Synchronous(share=2),
            horizon=10,
            iterations=3,
        )
    )
    for t, r in enumerate(rounds):
        assert r.contributions == dict.fromkeys(range(10), 2) and r.used == 20
        assert r.compute == pytest.approx(2 * max(h))
        assert r.time == pytest.approx((t + 1) * (2 * max(h) + 1.0))
    # Without a share, fast workers keep sampling until the slowest has one.
    [r] = simulate(MeanAgent(), Reveal, h=h, aggregator=pg.Synchronous(), horizon=10, iterations=1)
    assert r.contributions[0] == math.floor(max(h)) and r.compute == max(h)


def test_synchronous_share_round_takes_reports_until_the_share() -> None:
    round_ = pg.Synchronous(share=2).start(0, [0, 1], size=1)
    round_.note(0, 0, 2)
    round_.note(1, 0, 1)
    assert not round_.ready
    round_.note(1, 0, 2)
    assert round_.ready
    assert round_.add(0, 0, [1.0], 1) and round_.add(0, 0, [1.0], 1)
    assert not round_.add(0, 0, [1.0], 1)  # past its share: discarded
    assert round_.add(1, 0, [4.0], 2)
    assert round_.done and round_.contributions == {0: 2, 1: 2}
    assert round_.result() == pytest.approx([1.5])
    assert pg.Synchronous() == pg.Synchronous(share=None)
    with pytest.raises(aps.ConfigError, match=r"Synchronous\(share=...\) must be None or an int"):
        pg.Synchronous(share=0)
