"""SB3's tools on ClusterVecEnv as on DummyVecEnv: VecNormalize, VecMonitor, evaluate_policy, PPO.

Each test runs the same thing over aps workers and over SB3's own ``DummyVecEnv`` of the same
env functions and asserts the results are equal, bit for bit (docs/sb3.md states it).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

pytest.importorskip("stable_baselines3")
import torch
from stable_baselines3 import PPO
from stable_baselines3.common.evaluation import evaluate_policy
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.vec_env import DummyVecEnv, VecEnv, VecMonitor, VecNormalize

from aps.integrations.sb3 import ClusterVecEnv

NUM_WORKERS, ENVS_PER_WORKER = 2, 2
NUM_ENVS = NUM_WORKERS * ENVS_PER_WORKER


def short_cartpole() -> gym.Env[Any, Any]:
    return gym.make("CartPole-v1", max_episode_steps=25)


def monitored_cartpole() -> gym.Env[Any, Any]:
    return Monitor(gym.make("CartPole-v1"))


def both(make: Callable[[], gym.Env[Any, Any]]) -> tuple[ClusterVecEnv, DummyVecEnv]:
    cluster = ClusterVecEnv.local(
        make, num_workers=NUM_WORKERS, envs_per_worker=ENVS_PER_WORKER, transport="memory"
    )
    return cluster, DummyVecEnv([make] * NUM_ENVS)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small networks; the result does not depend on it
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def test_vec_normalize_over_vec_monitor_matches_dummy_vec_env() -> None:
    cluster, dummy = both(short_cartpole)
    actual, expected = VecNormalize(VecMonitor(cluster)), VecNormalize(VecMonitor(dummy))
    try:
        for vec in (actual, expected):
            vec.seed(3)
        np.testing.assert_array_equal(actual.reset(), expected.reset())
        rng = np.random.default_rng(0)
        episodes = 0
        for t in range(100):
            actions = rng.integers(0, 2, NUM_ENVS)
            got, want = actual.step(actions), expected.step(actions)
            for name, a, e in zip(("obs", "rewards", "dones"), got[:3], want[:3], strict=True):
                np.testing.assert_array_equal(a, e, err_msg=f"{name} at step {t}")
            for a_info, e_info in zip(got[3], want[3], strict=True):
                assert ("episode" in a_info) == ("episode" in e_info)
                if "episode" in e_info:
                    episodes += 1
                    assert a_info["episode"]["r"] == e_info["episode"]["r"]
                    assert a_info["episode"]["l"] == e_info["episode"]["l"]
                    np.testing.assert_array_equal(
                        a_info["terminal_observation"], e_info["terminal_observation"]
                    )
        assert episodes >= NUM_ENVS  # VecMonitor saw episodes end on every env
        np.testing.assert_array_equal(actual.obs_rms.mean, expected.obs_rms.mean)
        np.testing.assert_array_equal(actual.obs_rms.var, expected.obs_rms.var)
        np.testing.assert_array_equal(actual.ret_rms.var, expected.ret_rms.var)
    finally:
        actual.close()
        expected.close()


@pytest.mark.usefixtures("one_torch_thread")
def test_ppo_ends_with_the_same_weights_and_evaluates_the_same() -> None:
    def train(vec_env: VecEnv) -> PPO:
        model = PPO(
            "MlpPolicy", vec_env, n_steps=32, batch_size=64, n_epochs=2, seed=0, device="cpu"
        )
        return model.learn(total_timesteps=256)

    cluster, dummy = both(lambda: gym.make("CartPole-v1"))
    try:
        on_cluster, on_dummy = train(cluster), train(dummy)
    finally:
        cluster.close()
        dummy.close()
    weights = zip(
        on_cluster.policy.state_dict().items(), on_dummy.policy.state_dict().items(), strict=True
    )
    for (name, a), (_, e) in weights:
        assert torch.equal(a, e), name

    cluster, dummy = both(monitored_cartpole)
    try:
        results = []
        for vec_env in (cluster, dummy):
            vec_env.seed(11)
            results.append(
                evaluate_policy(on_dummy, vec_env, n_eval_episodes=8, return_episode_rewards=True)
            )
    finally:
        cluster.close()
        dummy.close()
    assert results[0] == results[1]
    assert len(results[0][0]) == 8


@pytest.mark.parametrize("vector", ["async", "envpool"])
def test_sb3_helpers_run_over_workers_that_do_not_hold_their_envs(vector: str) -> None:
    # VecMonitor and evaluate_policy ask env_is_wrapped; a worker whose envs live in
    # subprocesses (async) or in EnvPool answers it as one that holds them does.
    if vector == "envpool":
        pytest.importorskip("envpool")
    make: Any = "CartPole-v1" if vector == "envpool" else monitored_cartpole
    cluster = ClusterVecEnv.local(
        make, num_workers=NUM_WORKERS, envs_per_worker=ENVS_PER_WORKER, vector=vector
    )
    try:
        wrapped = cluster.env_is_wrapped(Monitor)
        assert wrapped == [vector == "async"] * NUM_ENVS
        assert cluster.env_is_wrapped(Monitor, indices=[1, 3]) == [vector == "async"] * 2
        assert cluster.env_is_wrapped(gym.wrappers.TimeLimit) == [vector == "async"] * NUM_ENVS
        assert cluster.env_is_wrapped(gym.wrappers.RecordVideo) == [False] * NUM_ENVS
        # VecMonitor asks whether a Monitor already wraps the envs, and warns where one does.
        asked: Any = (
            pytest.warns(UserWarning, match="already wrapped with a `Monitor`")
            if vector == "async"
            else contextlib.nullcontext()
        )
        with asked:
            vec = VecNormalize(VecMonitor(cluster))
        vec.reset()
        rng = np.random.default_rng(0)
        for _ in range(50):
            vec.step(rng.integers(0, 2, NUM_ENVS))
        assert vec.obs_rms.count > 50 * NUM_ENVS
        model = PPO("MlpPolicy", cluster, n_steps=8, batch_size=32, seed=0, device="cpu")
        cluster.seed(5)
        with warnings.catch_warnings():
            # Over EnvPool no Monitor wraps the envs, and SB3 says so.
            warnings.simplefilter("ignore", UserWarning)
            rewards, lengths = evaluate_policy(
                model, cluster, n_eval_episodes=4, return_episode_rewards=True
            )
        assert len(rewards) == len(lengths) == 4
        assert all(length >= 1 for length in lengths)
    finally:
        cluster.close()
