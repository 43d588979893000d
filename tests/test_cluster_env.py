"""Differential tests: ClusterEnv equals gymnasium's SyncVectorEnv, step for step.

Same env functions, same seeds, same actions: observations, rewards, terminations,
truncations and infos (values, dtypes and ``_key`` masks) must be identical, for every space
type, both autoreset modes and every built-in transport, with 2 workers x 3 envs.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv

import aps
from aps.testing import envs as test_envs

WORKERS, ENVS_PER_WORKER, STEPS = 2, 3, 40

ENV_SPECS = ["CartPole-v1", *(f"aps.testing.envs:{cls.__name__}" for cls in test_envs.ALL_ENVS)]
MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP]


def assert_same(actual: Any, expected: Any, where: str = "") -> None:
    """Recursive equality with types and dtypes, the way a user would notice a difference."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), where
        assert set(actual) == set(expected), f"{where}: keys {sorted(actual)} != {sorted(expected)}"
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, tuple):
        assert isinstance(actual, tuple) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{where}[{i}]")
    elif isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray), f"{where}: {type(actual)}"
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{where}: shape {actual.shape} != {expected.shape}"
        if expected.dtype == object:
            for i, (a, e) in enumerate(zip(actual.ravel(), expected.ravel(), strict=True)):
                assert_same(a, e, f"{where}[{i}]")
        else:
            np.testing.assert_array_equal(actual, expected, err_msg=where)
    else:
        assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def make_fn(spec: str) -> Any:
    if ":" in spec:
        cls = getattr(test_envs, spec.split(":")[1])
        return cls
    return lambda: gym.make(spec)


def run_differential(spec: str, transport: str, mode: AutoresetMode) -> None:
    env_fn = make_fn(spec)
    expected = SyncVectorEnv([env_fn] * (WORKERS * ENVS_PER_WORKER), autoreset_mode=mode)
    actual = aps.ClusterEnv.local(
        spec if transport != "memory" else env_fn,
        num_workers=WORKERS,
        envs_per_worker=ENVS_PER_WORKER,
        transport=transport,  # type: ignore[arg-type]
        autoreset_mode=mode,
    )
    try:
        assert actual.num_envs == expected.num_envs
        assert actual.single_observation_space == expected.single_observation_space
        assert actual.single_action_space == expected.single_action_space
        assert actual.observation_space == expected.observation_space
        assert actual.action_space == expected.action_space
        assert actual.metadata["autoreset_mode"] == expected.metadata["autoreset_mode"] == mode

        assert_same(actual.reset(seed=3), expected.reset(seed=3), "reset")
        expected.action_space.seed(5)
        for t in range(STEPS):
            actions = expected.action_space.sample()
            assert_same(actual.step(actions), expected.step(actions), f"step {t}")
        assert_same(actual.reset(seed=11), expected.reset(seed=11), "second reset")
    finally:
        actual.close()
        expected.close()
    assert actual.closed


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("spec", ENV_SPECS)
def test_memory_equals_sync_vector_env(spec: str, mode: AutoresetMode) -> None:
    run_differential(spec, "memory", mode)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("spec", ENV_SPECS)
@pytest.mark.parametrize("transport", ["tcp", "unix", "ws"])
def test_worker_processes_equal_sync_vector_env(
    transport: str, spec: str, mode: AutoresetMode
) -> None:
    run_differential(spec, transport, mode)


def test_is_a_gymnasium_vector_env() -> None:
    envs = aps.ClusterEnv.local("CartPole-v1", num_workers=1, envs_per_worker=2, transport="memory")
    try:
        assert isinstance(envs, gym.vector.VectorEnv)
        # Gymnasium's own vector wrappers accept it.
        wrapped = gym.wrappers.vector.RecordEpisodeStatistics(envs)
        wrapped.reset(seed=0)
        for _ in range(30):
            wrapped.step(wrapped.action_space.sample())
    finally:
        envs.close()
    envs.close()  # idempotent


def test_with_block_closes_the_envs_and_lets_its_error_through() -> None:
    with aps.ClusterEnv.local("CartPole-v1", num_workers=2, transport="tcp") as envs:
        envs.reset(seed=0)
        envs.step(np.zeros(envs.num_envs, dtype=np.int64))
    assert envs.closed
    with pytest.raises(aps.InvalidState, match="closed"):
        envs.step(np.zeros(envs.num_envs, dtype=np.int64))

    with (
        pytest.raises(RuntimeError, match="in the block"),
        aps.ClusterEnv.local("CartPole-v1", num_workers=1, transport="memory") as failing,
    ):
        raise RuntimeError("in the block")
    assert failing.closed


def test_local_seed_makes_the_first_reset_reproducible() -> None:
    envs = aps.ClusterEnv.local(
        "CartPole-v1", num_workers=2, envs_per_worker=2, transport="memory", seed=4
    )
    try:
        obs, _ = envs.reset()
    finally:
        envs.close()
    expected, _ = SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 4).reset(seed=4)
    np.testing.assert_array_equal(obs, expected)


@pytest.mark.parametrize(
    ("transport", "peer"), [(None, "unix:///"), ("unix", "unix:///"), ("tcp", "tcp://127.0.0.1:")]
)
def test_local_workers_connect_over_a_unix_socket_by_default(transport: Any, peer: str) -> None:
    envs = aps.ClusterEnv.local("CartPole-v1", num_workers=2, transport=transport)
    try:
        assert [w.peer[: len(peer)] for w in envs.workers] == [peer, peer]
        envs.reset(seed=0)
        envs.step(envs.action_space.sample())
    finally:
        envs.close()


def test_the_default_falls_back_to_tcp_where_no_unix_socket_can_be_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))  # no directory: no socket
    with pytest.raises(aps.ConnectError, match="no directory for the socket could be made"):
        aps.ClusterEnv.local("CartPole-v1", num_workers=1, transport="unix")
    with caplog.at_level(logging.WARNING, logger="aps.cluster_env"):
        envs = aps.ClusterEnv.local("CartPole-v1", num_workers=1)
    try:
        assert envs.workers[0].peer.startswith("tcp://127.0.0.1:")
        assert "cannot listen on unix://" in caplog.text and "using tcp://" in caplog.text
        envs.reset(seed=0)
    finally:
        envs.close()


def test_drop_is_refused_before_any_worker_starts() -> None:
    # The Learner's word, refused with its reason: a VectorEnv steps every env each call.
    with pytest.raises(aps.ConfigError, match=r"steps all of its num_envs.*'raise' or 'wait'"):
        aps.ClusterEnv.local("CartPole-v1", num_workers=1, on_worker_lost="drop")
    with pytest.raises(aps.ConfigError, match="on_worker_lost='drop' cannot apply"):
        aps.ClusterEnv("memory://", num_workers=1, on_worker_lost="drop")
    with pytest.raises(aps.ConfigError, match="'raise', 'wait' or 'drop', got 'skip'"):
        aps.ClusterEnv("memory://", num_workers=1, on_worker_lost="skip")  # type: ignore[arg-type]


def test_worker_that_cannot_start_fails_fast() -> None:
    # An id no local worker could build is refused in this process, before any starts.
    with pytest.raises(aps.ConfigError, match="no Gymnasium env 'NoSuchEnv-v0'"):
        aps.ClusterEnv.local("NoSuchEnv-v0", num_workers=1, transport="tcp")


def test_lambda_needs_memory_transport() -> None:
    with pytest.raises(aps.ConfigError, match="module-level"):
        aps.ClusterEnv.local(lambda: gym.make("CartPole-v1"), num_workers=1, transport="tcp")


@pytest.mark.parametrize("transport", ["memory", "tcp"])
def test_each_worker_can_get_its_own_env_kwargs(transport: str) -> None:
    envs = aps.ClusterEnv.local(
        "Pendulum-v1",
        num_workers=2,
        envs_per_worker=1,
        transport=transport,  # type: ignore[arg-type]
        env_kwargs=[{"max_episode_steps": 2}, {"max_episode_steps": 3}],
    )
    try:
        envs.reset(seed=0)
        truncations = [envs.step(np.zeros((2, 1), np.float32))[3].tolist() for _ in range(3)]
        # Workers register in any order; their labels say which launch entry each one is.
        limits = {2: None, 3: None}
        for worker in envs.workers:
            limits[[2, 3][int(worker.label)]] = worker.env_offset
        expected = [[False, False] for _ in range(3)]
        expected[1][limits[2]] = True  # the 2-step env truncates at step 2
        expected[2][limits[3]] = True  # the 3-step env at step 3 (the other one resets)
        assert truncations == expected
    finally:
        envs.close()


def test_step_async_and_step_wait_equal_step() -> None:
    expected = SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 4)
    envs = aps.ClusterEnv.local("CartPole-v1", num_workers=2, envs_per_worker=2)
    try:
        assert_same(envs.reset(seed=2), expected.reset(seed=2))
        expected.action_space.seed(0)
        for t in range(20):
            actions = expected.action_space.sample()
            envs.step_async(actions)
            with pytest.raises(aps.InvalidState, match="step_wait"):
                envs.step_async(actions)
            assert_same(envs.step_wait(), expected.step(actions), f"step {t}")
        with pytest.raises(aps.InvalidState, match="without a step_async"):
            envs.step_wait()
        envs.step_async(expected.action_space.sample())  # pending at close: close still works
    finally:
        envs.close()
        expected.close()
