"""The Stable-Baselines3 VecEnv: equal to SB3's DummyVecEnv step for step, and PPO learns on it."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

import aps

pytest.importorskip("stable_baselines3")
from stable_baselines3 import PPO
from stable_baselines3.common.evaluation import evaluate_policy
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.vec_env import DummyVecEnv

from aps.integrations.sb3 import ClusterVecEnv
from aps.testing import envs as test_envs

NUM_WORKERS, ENVS_PER_WORKER = 2, 2
NUM_ENVS = NUM_WORKERS * ENVS_PER_WORKER
MAX_STEPS = 25  # short episodes: terminations and truncations both happen in the test


def short_cartpole() -> gym.Env[Any, Any]:
    return gym.make("CartPole-v1", max_episode_steps=MAX_STEPS)


@pytest.fixture(params=["memory", "unix"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[ClusterVecEnv, DummyVecEnv]]:
    transport = request.param
    actual = ClusterVecEnv.local(
        short_cartpole if transport == "memory" else "CartPole-v1",
        env_kwargs=None if transport == "memory" else {"max_episode_steps": MAX_STEPS},
        num_workers=NUM_WORKERS,
        envs_per_worker=ENVS_PER_WORKER,
        transport=transport,
    )
    expected = DummyVecEnv([short_cartpole] * NUM_ENVS)
    try:
        yield actual, expected
    finally:
        actual.close()
        expected.close()


def assert_infos_equal(actual: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert set(a) == set(e), f"env {i}: {sorted(a)} != {sorted(e)}"
        for key in e:
            if isinstance(e[key], np.ndarray):
                assert a[key].dtype == e[key].dtype
                np.testing.assert_array_equal(a[key], e[key], err_msg=f"env {i} {key}")
            else:
                assert a[key] == e[key], f"env {i} {key}: {a[key]!r} != {e[key]!r}"


def test_equals_dummy_vec_env_step_for_step(pair: tuple[ClusterVecEnv, DummyVecEnv]) -> None:
    actual, expected = pair
    assert actual.num_envs == expected.num_envs
    assert actual.observation_space == expected.observation_space
    assert actual.action_space == expected.action_space
    assert actual.render_mode == expected.render_mode
    for vec in (actual, expected):
        vec.seed(3)
    obs = actual.reset()
    np.testing.assert_array_equal(obs, expected.reset())
    assert_infos_equal(actual.reset_infos, expected.reset_infos)
    rng = np.random.default_rng(0)
    dones_seen = truncations_seen = 0
    for t in range(120):
        actions = rng.integers(0, 2, NUM_ENVS)
        got = actual.step(actions)
        want = expected.step(actions)
        np.testing.assert_array_equal(got[0], want[0], err_msg=f"obs at step {t}")
        assert got[1].dtype == want[1].dtype
        np.testing.assert_array_equal(got[1], want[1], err_msg=f"rewards at step {t}")
        np.testing.assert_array_equal(got[2], want[2], err_msg=f"dones at step {t}")
        assert_infos_equal(got[3], want[3])
        assert_infos_equal(actual.reset_infos, expected.reset_infos)
        dones_seen += int(want[2].sum())
        truncations_seen += sum(info["TimeLimit.truncated"] for info in want[3])
    assert dones_seen > truncations_seen > 0  # both endings were compared


def test_attributes_methods_and_wrappers_match(pair: tuple[ClusterVecEnv, DummyVecEnv]) -> None:
    actual, expected = pair
    for vec in (actual, expected):
        vec.set_attr("gravity", 4.0, indices=[1, 3])
    assert actual.get_attr("gravity") == expected.get_attr("gravity") == [9.8, 4.0, 9.8, 4.0]
    assert actual.get_attr("gravity", indices=[3, 0]) == [4.0, 9.8]
    assert actual.env_method("get_wrapper_attr", "gravity", indices=2) == [9.8]
    assert actual.env_method("get_wrapper_attr", "length") == expected.env_method(
        "get_wrapper_attr", "length"
    )
    assert actual.has_attr("gravity") and not actual.has_attr("no_such_attribute")
    for wrapper in (gym.wrappers.TimeLimit, gym.Wrapper, Monitor):
        assert actual.env_is_wrapped(wrapper) == expected.env_is_wrapped(wrapper)
    assert actual.env_is_wrapped(gym.wrappers.TimeLimit) == [True] * NUM_ENVS
    assert actual.env_is_wrapped(Monitor) == [False] * NUM_ENVS


def test_over_subprocess_vectors_equals_dummy_vec_env() -> None:
    # SB3's VecEnv.__init__ asks every env for render_mode: a worker whose envs live in
    # subprocesses answers for all of them at once, and the steps are DummyVecEnv's.
    actual = ClusterVecEnv.local(
        "CartPole-v1",
        env_kwargs={"max_episode_steps": MAX_STEPS},
        num_workers=NUM_WORKERS,
        envs_per_worker=ENVS_PER_WORKER,
        transport="unix",
        vector="async",
    )
    expected = DummyVecEnv([short_cartpole] * NUM_ENVS)
    try:
        test_equals_dummy_vec_env_step_for_step((actual, expected))
        assert actual.get_attr("gravity") == expected.get_attr("gravity")
        assert actual.env_method("get_wrapper_attr", "length") == expected.env_method(
            "get_wrapper_attr", "length"
        )
        with pytest.raises(aps.WorkerError, match=r"needs a worker that holds its envs"):
            actual.get_attr("gravity", indices=[1])
    finally:
        actual.close()
        expected.close()


@pytest.mark.skipif(importlib.util.find_spec("envpool") is None, reason="EnvPool is not installed")
def test_over_envpool_resets_finished_envs_within_the_step() -> None:
    # EnvPool's envs are its own (their own initial states), so only the contract is held:
    # dones at the time limit, the terminal observation, the reset that follows.
    vec_env = ClusterVecEnv.local(
        "CartPole-v1",
        env_kwargs={"max_episode_steps": 5},
        num_workers=1,
        envs_per_worker=3,
        transport="unix",
        vector="envpool",
    )
    try:
        assert vec_env.render_mode is None and vec_env.get_attr("render_mode") == [None] * 3
        vec_env.seed(4)
        obs = vec_env.reset()
        assert obs.shape == (3, 4) and [i["elapsed_step"] for i in vec_env.reset_infos] == [0] * 3
        for t in range(10):
            obs, reward, dones, infos = vec_env.step(np.full(3, t % 2, dtype=np.int64))
            assert reward.dtype == np.float32 and reward.tolist() == [1.0] * 3
            assert dones.tolist() == [t % 5 == 4] * 3
            for info, reset_info in zip(infos, vec_env.reset_infos, strict=True):
                assert info["TimeLimit.truncated"] == (t % 5 == 4)
                if t % 5 == 4:
                    assert info["terminal_observation"].shape == (4,)
                    assert info["elapsed_step"] == 5 and reset_info["elapsed_step"] == 0
                else:
                    assert info["elapsed_step"] == t % 5 + 1
    finally:
        vec_env.close()


def test_needs_the_same_step_autoreset_mode() -> None:
    envs = aps.ClusterEnv.local("CartPole-v1", num_workers=1, transport="memory")
    try:
        with pytest.raises(aps.ConfigError, match="autoreset_mode='SameStep'"):
            ClusterVecEnv(envs)
    finally:
        envs.close()


def random_return(vec_env: DummyVecEnv, episodes: int) -> float:
    """The mean return of uniformly random actions, measured on ``vec_env``."""
    rng = np.random.default_rng(1)
    returns: list[float] = []
    running = np.zeros(vec_env.num_envs)
    vec_env.seed(11)
    vec_env.reset()
    while len(returns) < episodes:
        _, reward, done, _ = vec_env.step(rng.integers(0, 2, vec_env.num_envs))
        running += reward
        returns.extend(running[done])
        running[done] = 0.0
    return float(np.mean(returns[:episodes]))


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    # Small networks: torch's thread pool only contends with the workers for the cores.
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_torch_thread")
def test_ppo_learns_cartpole_on_cluster_envs() -> None:
    vec_env = ClusterVecEnv.local(
        "CartPole-v1", num_workers=2, envs_per_worker=2, transport="unix", seed=0
    )
    try:
        model = PPO(
            "MlpPolicy", vec_env, n_steps=128, batch_size=128, n_epochs=4, seed=0, device="cpu"
        )
        model.learn(total_timesteps=8192)
        evaluation = DummyVecEnv([lambda: Monitor(gym.make("CartPole-v1"))] * 4)
        evaluation.seed(11)
        trained, _ = evaluate_policy(model, evaluation, n_eval_episodes=20, deterministic=True)
        baseline = random_return(DummyVecEnv([lambda: gym.make("CartPole-v1")] * 4), 20)
    finally:
        vec_env.close()
    # Random play lasts about 22 steps; a policy that learned balances far longer.
    assert trained > 3 * baseline, (trained, baseline)


class FlatTupleEnv(test_envs.TinyEnv):
    """A flat Tuple of array spaces: the Tuple observations SB3 itself takes."""

    def __init__(self) -> None:
        space = gym.spaces.Tuple(
            (gym.spaces.Discrete(3), gym.spaces.Box(-1.0, 1.0, (2,), np.float32))
        )
        super().__init__(space, gym.spaces.Discrete(3), max_steps=5, rich_info=False)


@pytest.mark.parametrize(
    "env_cls",
    [
        test_envs.BoxEnv,
        test_envs.DiscreteEnv,
        test_envs.MultiDiscreteEnv,
        test_envs.MultiBinaryEnv,
        FlatTupleEnv,
    ],
    ids=lambda cls: cls.__name__,
)
def test_every_space_sb3_takes_equals_dummy_vec_env(env_cls: type[test_envs.TinyEnv]) -> None:
    actual = ClusterVecEnv.local(
        env_cls, num_workers=NUM_WORKERS, envs_per_worker=ENVS_PER_WORKER, transport="memory"
    )
    expected = DummyVecEnv([env_cls] * NUM_ENVS)
    try:
        assert actual.observation_space == expected.observation_space
        for vec in (actual, expected):
            vec.seed(5)
        pairs = [(actual.reset(), expected.reset())]
        space = expected.action_space
        space.seed(0)
        ended = 0
        for _ in range(12):
            actions = np.stack([space.sample() for _ in range(NUM_ENVS)])
            got, want = actual.step(actions), expected.step(actions)
            pairs.append((got[0], want[0]))
            np.testing.assert_array_equal(got[1], want[1])
            np.testing.assert_array_equal(got[2], want[2])
            ended += int(want[2].sum())
        for got_obs, want_obs in pairs:
            for a, e in zip(
                got_obs if isinstance(want_obs, tuple) else (got_obs,),
                want_obs if isinstance(want_obs, tuple) else (want_obs,),
                strict=True,
            ):
                assert a.dtype == e.dtype
                np.testing.assert_array_equal(a, e)
        assert ended > 0  # episodes ended and reset within the steps compared
    finally:
        actual.close()
        expected.close()


@pytest.mark.parametrize("env_cls", [test_envs.DictEnv, test_envs.TupleEnv])
def test_nested_spaces_are_refused_by_sb3_itself(env_cls: type[test_envs.TinyEnv]) -> None:
    # A Dict or Tuple inside a Dict or Tuple: SB3's own VecEnvs refuse it, so the adapter's
    # column of docs/envs.md says so rather than claiming it.
    with pytest.raises(NotImplementedError, match="Nested observation spaces"):
        DummyVecEnv([env_cls])
