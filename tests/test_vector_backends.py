"""Worker vector backends: ``sync``, ``async`` (a subprocess per env) and ``envpool``.

The sync and async backends run the same env code, so through a real learner they must give
identical observations, rewards, flags and infos step for step. EnvPool runs its own
implementations: its CartPole has Gymnasium's dynamics but its own random initial states,
so it is compared transition by transition and by episode accounting, not step for step.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, SyncVectorEnv

import aps
from aps.cli import main
from aps.launch import WorkerSpec
from aps.testing import envs as test_envs
from aps.vector import EnvPoolVectorEnv, envpool_id, make_vector_env
from tests.test_cluster_env import assert_same, make_fn

WORKERS, ENVS_PER_WORKER, STEPS = 2, 3, 40
MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP]

needs_envpool = pytest.mark.skipif(
    importlib.util.find_spec("envpool") is None,
    reason="EnvPool is not installed (pip install 'aps-rl[envpool]')",
)


class PidEnv(test_envs.BoxEnv):
    """A BoxEnv whose reset info says which process runs it."""

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        obs, info = super().reset(seed=seed, options=options)
        info["pid"] = os.getpid()
        return obs, info


class ExplodingEnv(test_envs.BoxEnv):
    """Raises on its third step after a reset."""

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        self.steps = 0
        obs, info = super().reset(seed=seed, options=options)
        self._length = 1000  # no episode ends before the explosion
        return obs, info

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        self.steps += 1
        if self.steps == 3:
            raise RuntimeError("the env exploded")
        return super().step(action)


class CoinSpace(gym.Space[int]):
    """A space of Gymnasium's kind but none of its types: 0 or 1."""

    def sample(self, mask: Any = None, probability: Any = None) -> int:
        return int(self.np_random.integers(2))

    def contains(self, x: Any) -> bool:
        return x in (0, 1)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CoinSpace)

    def __hash__(self) -> int:
        return hash(CoinSpace)


def local(spec: str, transport: str, vector: str, **kwargs: Any) -> aps.ClusterEnv:
    return aps.ClusterEnv.local(
        spec if transport != "memory" else make_fn(spec),
        num_workers=WORKERS,
        envs_per_worker=ENVS_PER_WORKER,
        transport=transport,  # type: ignore[arg-type]
        vector=vector,
        **kwargs,
    )


def run_sync_against_async(spec: str, transport: str, mode: AutoresetMode) -> None:
    made: list[aps.ClusterEnv] = []
    try:
        for vector in ("sync", "async"):
            made.append(local(spec, transport, vector, autoreset_mode=mode))
        sync_envs, async_envs = made
        assert async_envs.single_observation_space == sync_envs.single_observation_space
        assert async_envs.single_action_space == sync_envs.single_action_space
        assert async_envs.metadata["autoreset_mode"] == mode

        assert_same(async_envs.reset(seed=3), sync_envs.reset(seed=3), "reset")
        sync_envs.action_space.seed(5)
        for t in range(STEPS):
            actions = sync_envs.action_space.sample()
            assert_same(async_envs.step(actions), sync_envs.step(actions), f"step {t}")
        # Reset options travel to every env (the tiny envs read max_steps; CartPole none).
        options = None if spec == "CartPole-v1" else {"max_steps": 2}
        assert_same(
            async_envs.reset(seed=11, options=options),
            sync_envs.reset(seed=11, options=options),
            "second reset",
        )
        for t in range(10):
            actions = sync_envs.action_space.sample()
            assert_same(async_envs.step(actions), sync_envs.step(actions), f"after reset {t}")
    finally:
        for envs in made:
            envs.close()


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize(
    "spec", ["CartPole-v1", "aps.testing.envs:DictEnv", "aps.testing.envs:TupleEnv"]
)
def test_async_equals_sync_through_a_learner(spec: str, mode: AutoresetMode) -> None:
    run_sync_against_async(spec, "memory", mode)


def test_async_worker_processes_equal_sync() -> None:
    # Workers as `aps worker --vector async` subprocesses, each with its own env subprocesses.
    run_sync_against_async("aps.testing.envs:DictEnv", "tcp", AutoresetMode.SAME_STEP)


@pytest.mark.parametrize(
    ("vector", "transport"), [("sync", "tcp"), ("async", "tcp"), ("async", "memory")]
)
def test_async_runs_each_env_in_its_own_process(vector: str, transport: str) -> None:
    env = f"{Path(__file__)}:PidEnv" if transport == "tcp" else PidEnv
    envs = aps.ClusterEnv.local(
        env,
        num_workers=WORKERS,
        envs_per_worker=ENVS_PER_WORKER,
        transport=transport,  # type: ignore[arg-type]
        vector=vector,
    )
    try:
        _, info = envs.reset(seed=0)
        workers = envs.workers
    finally:
        envs.close()
    for worker in workers:
        pids = info["pid"][worker.env_offset : worker.env_offset + worker.num_envs].tolist()
        if vector == "sync":
            assert pids == [worker.pid] * ENVS_PER_WORKER
        else:
            assert worker.pid not in pids and len(set(pids)) == ENVS_PER_WORKER


@pytest.mark.parametrize(
    ("observation_space", "shared"),
    [
        (spaces.Box(-1, 1, (3,)), True),
        (spaces.Sequence(spaces.Discrete(3)), False),
        (CoinSpace(), False),
    ],
    ids=["box", "sequence", "custom"],
)
def test_async_shares_memory_where_the_space_allows(
    observation_space: gym.Space[Any], shared: bool
) -> None:
    # Gymnasium has no shared-memory layout for Sequence or custom spaces: those observations
    # go through pipes (the learner refuses such spaces, but the worker gets to report them).
    env_fn = functools.partial(test_envs.TinyEnv, observation_space, spaces.Discrete(2))
    expected = SyncVectorEnv([env_fn] * 2)
    actual = make_vector_env("async", env_fn, num_envs=2, autoreset_mode=AutoresetMode.NEXT_STEP)
    try:
        assert actual.unwrapped.shared_memory is shared  # type: ignore[attr-defined]
        assert_same(actual.reset(seed=0), expected.reset(seed=0), "reset")
        for t in range(12):
            actions = np.array([t % 2, 1], dtype=np.int64)
            assert_same(actual.step(actions), expected.step(actions), f"step {t}")
    finally:
        actual.close()
        expected.close()


def test_async_worker_outlives_an_env_error() -> None:
    # AsyncVectorEnv loses the subprocess whose env raised; the worker starts new ones, so
    # the learner can reset and go on, as with the sync backend.
    envs = aps.ClusterEnv.local(
        ExplodingEnv, num_workers=1, envs_per_worker=2, transport="memory", vector="async"
    )
    try:
        for _ in range(2):
            envs.reset(seed=0)
            envs.step(envs.action_space.sample())
            envs.step(envs.action_space.sample())
            with pytest.raises(RuntimeError, match="the env exploded") as caught:
                envs.step(envs.action_space.sample())
            cause = caught.value.__cause__
            assert isinstance(cause, aps.WorkerError)
            assert cause.remote_type == "builtins.RuntimeError"
        obs, _ = envs.reset(seed=1)
        expected, _ = SyncVectorEnv([ExplodingEnv] * 2).reset(seed=1)
        np.testing.assert_array_equal(obs, expected)
    finally:
        envs.close()


def test_async_rollouts_equal_sync_rollouts() -> None:
    torch = pytest.importorskip("torch")
    from tests.agents import Agent

    policy = f"{Path(__file__).with_name('agents.py')}:Agent"
    torch.manual_seed(0)
    agent = Agent(gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")]))
    made: list[aps.ClusterEnv] = []
    try:
        for vector in ("sync", "async"):
            envs = local("CartPole-v1", "memory", vector, policy=policy, autoreset_mode="SameStep")
            made.append(envs)
            envs.publish(agent)
            envs.reset(seed=4)
        first, second = ([envs.rollout(30) for _ in range(2)] for envs in made)
        for a, b in zip(first, second, strict=True):
            for field in dataclasses.fields(a):
                assert_same(getattr(b, field.name), getattr(a, field.name), field.name)
    finally:
        for envs in made:
            envs.close()


# Choosing a backend: arguments, the command line, launchers.


@pytest.mark.parametrize("bad", ["fast", "Sync", "", None, 1])
def test_unknown_backends_are_refused(bad: Any) -> None:
    match = rf"vector must be one of 'sync', 'async', 'envpool', got {bad!r}"
    with pytest.raises(aps.ConfigError, match=match):
        aps.Worker("tcp://127.0.0.1:1", "CartPole-v1", vector=bad)
    with pytest.raises(aps.ConfigError, match=match):
        WorkerSpec(env="CartPole-v1", num_workers=1, vector=bad)
    with pytest.raises(aps.ConfigError, match=match):
        aps.ClusterEnv.local("CartPole-v1", num_workers=1, vector=bad)


def test_cli_refuses_an_unknown_backend(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["worker", "tcp://127.0.0.1:1", "--env", "CartPole-v1", "--vector", "fast"])
    assert caught.value.code == 2
    assert "--vector: invalid choice: 'fast'" in capsys.readouterr().err


@pytest.mark.parametrize("vector", ["sync", "async", "envpool"])
def test_launchers_pass_the_backend_on(vector: str, capsys: pytest.CaptureFixture[str]) -> None:
    spec = WorkerSpec(env="CartPole-v1", num_workers=2, vector=vector)
    arguments = spec.worker_arguments(1)
    if vector == "sync":
        assert "--vector" not in arguments  # the default: command lines stay as they were
    else:
        assert arguments[arguments.index("--vector") + 1] == vector
    assert (
        main(["slurm-script", "tcp://head:7000", "--env", "CartPole-v1", "--vector", vector]) == 0
    )
    script = capsys.readouterr().out
    assert (f"--vector {vector}" in script) == (vector != "sync")


def test_envpool_missing_is_a_missing_dependency(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "envpool", None)  # what `import envpool` meets uninstalled
    with pytest.raises(aps.MissingDependency, match=r"pip install 'aps-rl\[envpool\]'"):
        aps.Worker("tcp://127.0.0.1:1", "CartPole-v1", vector="envpool")


# EnvPool.


@needs_envpool
@pytest.mark.parametrize(
    ("env", "closest"),
    [
        ("LunarLander-v9", "LunarLander-v3, LunarLander-v2"),
        ("CartPol-v1", "CartPole-v1"),
        ("Xq-v7", "envpool.list_all_envs"),
    ],
)
def test_envpool_refuses_ids_it_lacks_naming_close_ones(env: str, closest: str) -> None:
    with pytest.raises(aps.ConfigError, match=rf"has no env '{env}'.*{closest}"):
        aps.Worker("tcp://127.0.0.1:1", env, vector="envpool")


@needs_envpool
def test_cli_envpool_refusal_names_the_id(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["worker", "tcp://127.0.0.1:1", "--env", "LunarLander-v9", "--vector", "envpool"]
    assert main(argv) == 1
    assert "ConfigError: EnvPool" in capsys.readouterr().err


@needs_envpool
@pytest.mark.parametrize("env", ["aps.testing.envs:BoxEnv", test_envs.BoxEnv])
def test_envpool_refuses_factories(env: Any) -> None:
    with pytest.raises(aps.ConfigError, match="builds EnvPool's own envs from an id"):
        envpool_id(env)


@needs_envpool
def test_envpool_refuses_disabled_autoreset() -> None:
    with pytest.raises(aps.ConfigError, match="asks for Disabled"):
        EnvPoolVectorEnv("CartPole-v1", num_envs=1, autoreset_mode=AutoresetMode.DISABLED)


@needs_envpool
def test_envpool_same_step_resets_within_the_step_as_gymnasium() -> None:
    # Truncation after 5 steps comes before CartPole can fall with alternating pushes, so
    # rewards, flags and the SameStep layout match Gymnasium's step for step; EnvPool's
    # observations are its own, so the reset ones are checked against its elapsed_step.
    kwargs = {"max_episode_steps": 5}
    num_envs = 3
    actual = EnvPoolVectorEnv(
        "CartPole-v1", num_envs=num_envs, autoreset_mode=AutoresetMode.SAME_STEP, env_kwargs=kwargs
    )
    expected = SyncVectorEnv(
        [lambda: gym.make("CartPole-v1", **kwargs)] * num_envs,
        autoreset_mode=AutoresetMode.SAME_STEP,
    )
    try:
        obs, _ = actual.reset(seed=5)
        expected.reset(seed=5)
        ends = 0
        for t in range(12):
            actions = np.full(num_envs, t % 2, dtype=np.int64)
            next_obs, reward, terminated, truncated, info = actual.step(actions)
            _, ref_reward, ref_terminated, ref_truncated, ref_info = expected.step(actions)
            np.testing.assert_array_equal(reward, ref_reward)
            np.testing.assert_array_equal(terminated, ref_terminated)
            np.testing.assert_array_equal(truncated, ref_truncated)
            assert ("final_obs" in info) == ("final_obs" in ref_info)
            if "final_obs" not in info:
                assert info["elapsed_step"].tolist() == [t % 5 + 1] * num_envs
                obs = next_obs
                continue
            ends += 1
            np.testing.assert_array_equal(info["_final_obs"], ref_info["_final_obs"])
            np.testing.assert_array_equal(info["_final_info"], ref_info["_final_info"])
            assert info["final_obs"].dtype == object and info["final_obs"][0].shape == (4,)
            assert info["final_info"]["elapsed_step"].tolist() == [5] * num_envs
            # The envs were reset within the step: the next one steps them (elapsed 1).
            assert info["elapsed_step"].tolist() == [0] * num_envs
            assert not np.array_equal(next_obs, np.stack(list(info["final_obs"])))
            obs = next_obs
        after, reward, *_ = actual.step(np.zeros(num_envs, dtype=np.int64))
        assert ends == 2 and reward.tolist() == [1.0] * num_envs
        assert obs.shape == after.shape
    finally:
        actual.close()
        expected.close()


@needs_envpool
def test_envpool_answers_gymnasiums_attributes() -> None:
    pool = EnvPoolVectorEnv("CartPole-v1", num_envs=2)
    try:
        assert pool.get_attr("render_mode") == (None, None)
        assert pool.get_attr("observation_space") == (pool.single_observation_space,) * 2
        assert pool.call("spec") == (None, None)
        with pytest.raises(AttributeError, match="no attribute 'gravity'"):
            pool.get_attr("gravity")
    finally:
        pool.close()


@needs_envpool
def test_envpool_cartpole_has_gymnasium_dynamics() -> None:
    # EnvPool draws its own initial states, so whole trajectories differ from Gymnasium's;
    # each transition must not: Gymnasium's CartPole put in EnvPool's state and given the
    # same action lands on EnvPool's next state (to float32 rounding), with the same reward
    # and termination. The step after an episode's end is the NextStep reset step.
    num_envs = 4
    pool = EnvPoolVectorEnv("CartPole-v1", num_envs=num_envs)
    reference = gym.make("CartPole-v1").unwrapped
    reference.reset(seed=0)
    rng = np.random.default_rng(0)
    try:
        obs, info = pool.reset(seed=3)
        ended = np.zeros(num_envs, dtype=bool)
        transitions = episodes = 0
        for _ in range(400):
            actions = rng.integers(0, 2, num_envs)
            next_obs, reward, terminated, truncated, info = pool.step(actions)
            assert reward.dtype == np.float64 and terminated.dtype == truncated.dtype == np.bool_
            for env in range(num_envs):
                if ended[env]:
                    assert (reward[env], terminated[env], truncated[env]) == (0.0, False, False)
                    assert info["elapsed_step"][env] == 0
                    continue
                reference.state = obs[env].astype(np.float64)
                reference.steps_beyond_terminated = None
                expected, r, term, _, _ = reference.step(int(actions[env]))
                np.testing.assert_allclose(next_obs[env], expected, rtol=0, atol=1e-6)
                assert (reward[env], terminated[env]) == (r, term)
                transitions += 1
            ended = terminated | truncated
            episodes += int(ended.sum())
            obs = next_obs
        assert transitions > 1000 and episodes > 50  # many transitions, many resets
    finally:
        pool.close()


@needs_envpool
def test_envpool_through_a_learner() -> None:
    # Truncation after 5 steps comes before CartPole can fall with alternating pushes, so
    # rewards and episode ends match Gymnasium's NextStep vector env step for step.
    kwargs = {"max_episode_steps": 5}
    envs = aps.ClusterEnv.local(
        "CartPole-v1",
        num_workers=WORKERS,
        envs_per_worker=ENVS_PER_WORKER,
        transport="memory",
        vector="envpool",
        env_kwargs=kwargs,
    )
    num_envs = WORKERS * ENVS_PER_WORKER
    expected = SyncVectorEnv([lambda: gym.make("CartPole-v1", **kwargs)] * num_envs)
    try:
        assert envs.single_observation_space == expected.single_observation_space
        assert envs.single_action_space == expected.single_action_space
        obs, info = envs.reset(seed=7)
        expected.reset(seed=7)
        assert obs.shape == (num_envs, 4) and obs.dtype == np.float32
        assert set(info) >= {"elapsed_step", "_elapsed_step", "env_id", "_env_id"}
        assert info["elapsed_step"].tolist() == [0] * num_envs and info["_elapsed_step"].all()
        # Env i is seeded with 7 + i across workers, as Gymnasium seeds a vector env.
        single = EnvPoolVectorEnv("CartPole-v1", num_envs=1)
        try:
            for env in range(num_envs):
                np.testing.assert_array_equal(obs[env], single.reset(seed=7 + env)[0][0])
        finally:
            single.close()
        for t in range(18):
            actions = np.full(num_envs, t % 2, dtype=np.int64)
            obs, reward, terminated, truncated, info = envs.step(actions)
            _, ref_reward, ref_terminated, ref_truncated, _ = expected.step(actions)
            assert obs.shape == (num_envs, 4) and obs.dtype == np.float32
            np.testing.assert_array_equal(reward, ref_reward)
            np.testing.assert_array_equal(terminated, ref_terminated)
            np.testing.assert_array_equal(truncated, ref_truncated)
            assert info["elapsed_step"].tolist() == [(t + 1) % 6] * num_envs
        assert_same(envs.reset(seed=7)[0], envs.reset(seed=7)[0], "seeded resets repeat")
        with pytest.raises(aps.WorkerError, match="takes no reset options"):
            envs.reset(options={"max_steps": 2})
    finally:
        envs.close()
        expected.close()


@needs_envpool
def test_envpool_rollouts_count_episodes() -> None:
    pytest.importorskip("torch")
    from tests.agents import Agent

    envs = aps.ClusterEnv.local(
        "CartPole-v1",
        num_workers=1,
        envs_per_worker=4,
        transport="memory",
        vector="envpool",
        env_kwargs={"max_episode_steps": 5},
        policy=f"{Path(__file__).with_name('agents.py')}:Agent",
    )
    try:
        envs.publish(Agent(envs))
        envs.reset(seed=0)
        rollout = envs.rollout(24)
    finally:
        envs.close()
    # NextStep: 5 real steps, then one reset step that is no transition of any episode.
    assert rollout.truncated.sum(axis=0).tolist() == [4] * 4
    assert rollout.episode_length.tolist() == [5] * 16
    assert rollout.episode_return.tolist() == [5.0] * 16


def test_broken_envpool_arrays_are_refused() -> None:
    # EnvPool 0.8.4 under NumPy 2 hands out arrays with zero strides: every entry repeats
    # the first. Such an array (made by NumPy itself here) must not pass as observations.
    from aps.vector import _check_layout

    repeated = np.broadcast_to(np.float32(0.25), (3, 4))
    with pytest.raises(aps.MissingDependency, match=r"strides \(0, 0\).*EnvPool >= 1.2"):
        _check_layout(repeated, {})
    with pytest.raises(aps.MissingDependency):
        _check_layout(np.zeros((3, 4)), {"env_id": np.broadcast_to(np.int32(0), (3,))})
    _check_layout(np.zeros((3, 4)), {"env_id": np.arange(3), "one": np.zeros((1, 1))[:, :1]})


@needs_envpool
def test_envpool_takes_consecutive_per_env_seeds_as_one() -> None:
    pool = EnvPoolVectorEnv("CartPole-v1", num_envs=3)
    try:
        by_int, _ = pool.reset(seed=11)
        by_list, _ = pool.reset(seed=[11, 12, 13])
        np.testing.assert_array_equal(by_list, by_int)
        pool.reset(seed=[None, None, None])  # goes on unseeded
        with pytest.raises(aps.ConfigError, match="3 consecutive ints"):
            pool.reset(seed=[11, 13, 12])
        with pytest.raises(aps.ConfigError, match="3 consecutive ints"):
            pool.reset(seed=[11, None, 13])
    finally:
        pool.close()
