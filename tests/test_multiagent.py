"""Multi-agent (PettingZoo) envs on workers: a vector env of agents, one slot per agent.

Real workers (tasks over memory://, ``aps worker`` processes over tcp:// on 127.0.0.1) host
PettingZoo ParallelEnvs; every test compares what the learner sees with the raw
ParallelEnvs stepped here, in this process, with the same seeds and actions. ``DyingAgents``
(below) has agents that leave at different steps, by termination and by truncation, and one
that joins mid-episode; ``simple_spread`` (mpe2) is a real one.

The worker processes import this file by path to build ``DyingAgents``: it imports nothing
from ``tests``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

pettingzoo = pytest.importorskip("pettingzoo")

import aps  # noqa: E402
from aps.errors import ConfigError  # noqa: E402
from aps.multiagent import MultiAgentVectorEnv, agents_per_env, is_parallel_env  # noqa: E402

HERE = Path(__file__).resolve()
DYING = f"{HERE}:DyingAgents"
SPREAD = "mpe2.simple_spread_v3:parallel_env"

# When each agent leaves (after how many steps of the episode), and how: a1 is truncated,
# the others terminate. a3 joins after step 2.
ENDS = {"a0": 3, "a1": 5, "a2": 7, "a3": 6}
JOINS = {"a3": 2}


class DyingAgents(pettingzoo.ParallelEnv):  # type: ignore[misc]
    """Four agents of one Box/Discrete space: three from the start, one that joins.

    Observations are ``[offset + t, agent index]`` (``offset`` drawn from the seed), the
    reward is the agent's action plus 10 times its index, so a wrong routing of actions
    or observations shows, and each info says the step.
    """

    metadata = {"name": "dying_agents_v0"}  # noqa: RUF012

    def __init__(self) -> None:
        self.possible_agents = ["a0", "a1", "a2", "a3"]
        self.agents: list[str] = []
        self._space = gym.spaces.Box(0.0, 1e6, (2,), np.float32)
        self._actions = gym.spaces.Discrete(3)
        self._rng = np.random.default_rng()
        self._t = 0
        self._offset = 0

    def observation_space(self, agent: str) -> gym.Space[Any]:
        return self._space

    def action_space(self, agent: str) -> gym.Space[Any]:
        return self._actions

    def _obs(self, agent: str) -> np.ndarray[Any, Any]:
        index = self.possible_agents.index(agent)
        return np.array([self._offset + self._t, index], dtype=np.float32)

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self._offset = int(self._rng.integers(0, 1000))
        self._t = 0
        self.agents = ["a0", "a1", "a2"]
        return {a: self._obs(a) for a in self.agents}, {a: {"t": 0} for a in self.agents}

    def step(self, actions: dict[str, Any]) -> Any:
        assert set(actions) == set(self.agents), (actions, self.agents)
        self._t += 1
        acting = list(self.agents)
        rewards = {a: float(actions[a]) + 10.0 * self.possible_agents.index(a) for a in acting}
        over = {a: self._t >= ENDS[a] for a in acting}
        terminations = {a: over[a] and a != "a1" for a in acting}
        truncations = {a: over[a] and a == "a1" for a in acting}
        self.agents = [a for a in acting if not over[a]]
        for agent, when in JOINS.items():
            if self._t == when:
                self.agents.append(agent)
        shown = acting + [a for a in self.agents if a not in acting]
        observations = {a: self._obs(a) for a in shown}
        infos = {a: {"t": self._t} for a in shown}
        return observations, rewards, terminations, truncations, infos

    def close(self) -> None:
        pass


class Oracle:
    """The raw ParallelEnvs, stepped here with the documented autoreset rules.

    Each step gives, per slot, what the learner should see: observation (zeros where no
    agent shows one), reward, flags, whether the slot holds a live agent afterwards, and
    (SameStep) the last observation of the agents that ended.
    """

    def __init__(self, make: Callable[[], Any], copies: int, mode: AutoresetMode) -> None:
        self.envs = [make() for _ in range(copies)]
        self.agents = list(self.envs[0].possible_agents)
        self.n = len(self.agents)
        self.mode = mode
        self.pending = [False] * copies
        space = self.envs[0].observation_space(self.agents[0])
        self.zeros = np.zeros(space.shape, space.dtype)

    def _show(self, observations: dict[str, Any], live: list[str]) -> list[Any]:
        return [observations.get(a, self.zeros) if a in live else self.zeros for a in self.agents]

    def reset(self, seeds: list[int]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        obs, active = [], []
        for env, seed in zip(self.envs, seeds, strict=True):
            observations, _ = env.reset(seed=seed)
            obs += self._show(observations, env.agents)
            active += [a in env.agents for a in self.agents]
        self.pending = [False] * len(self.envs)
        return np.array(obs), np.array(active)

    def step(self, actions: np.ndarray[Any, Any]) -> dict[str, Any]:
        obs, reward, term, trunc, active, final = [], [], [], [], [], {}
        for c, env in enumerate(self.envs):
            base = c * self.n
            if self.pending[c]:
                observations, _ = env.reset()
                self.pending[c] = False
                obs += self._show(observations, env.agents)
                reward += [0.0] * self.n
                term += [False] * self.n
                trunc += [False] * self.n
                active += [a in env.agents for a in self.agents]
                continue
            moves = {a: actions[base + self.agents.index(a)] for a in env.agents}
            observations, rewards, terms, truncs, _ = env.step(moves)
            shown = [observations.get(a, self.zeros) for a in self.agents]
            ended = [bool(terms.get(a, False)) or bool(truncs.get(a, False)) for a in self.agents]
            reward += [float(rewards.get(a, 0.0)) for a in self.agents]
            term += [bool(terms.get(a, False)) for a in self.agents]
            trunc += [bool(truncs.get(a, False)) for a in self.agents]
            live = [a in env.agents for a in self.agents]
            if self.mode is AutoresetMode.SAME_STEP:
                for k, done in enumerate(ended):
                    if done:
                        final[base + k] = shown[k]
                        shown[k] = self.zeros
            if not env.agents:
                if self.mode is AutoresetMode.SAME_STEP:
                    again, _ = env.reset()
                    shown = self._show(again, env.agents)
                    live = [a in env.agents for a in self.agents]
                else:
                    self.pending[c] = True
            obs += shown
            active += live
        return {
            "obs": np.array(obs),
            "reward": np.array(reward),
            "terminated": np.array(term),
            "truncated": np.array(trunc),
            "active": np.array(active),
            "final": final,
        }


def seeds_of(copies: int, n: int) -> tuple[list[int], list[int]]:
    """Per-slot seeds for the learner, and the seed each copy takes (its first slot's)."""
    slots = [1000 + i for i in range(copies * n)]
    return slots, slots[::n]


def compare(envs: Any, oracle: Oracle, steps: int, seed: int) -> None:
    slot_seeds, copy_seeds = seeds_of(len(oracle.envs), oracle.n)
    obs, info = envs.reset(seed=slot_seeds)
    want_obs, want_active = oracle.reset(copy_seeds)
    np.testing.assert_array_equal(obs, want_obs)
    np.testing.assert_array_equal(info["agent_active"], want_active)
    assert info["_agent_active"].all()
    rng = np.random.default_rng(seed)
    kept_active = 0
    for t in range(steps):
        actions = rng.integers(0, envs.single_action_space.n, size=envs.num_envs)
        obs, reward, terminated, truncated, info = envs.step(actions)
        want = oracle.step(actions)
        np.testing.assert_array_equal(obs, want["obs"], err_msg=f"step {t}")
        np.testing.assert_array_equal(reward, want["reward"], err_msg=f"step {t}")
        np.testing.assert_array_equal(terminated, want["terminated"], err_msg=f"step {t}")
        np.testing.assert_array_equal(truncated, want["truncated"], err_msg=f"step {t}")
        np.testing.assert_array_equal(info["agent_active"], want["active"], err_msg=f"step {t}")
        assert info["_agent_active"].all()
        kept_active += int(want["active"].sum())
        if want["final"]:
            mask = info["_final_obs"]
            assert sorted(np.flatnonzero(mask)) == sorted(want["final"])
            for slot, last in want["final"].items():
                np.testing.assert_array_equal(info["final_obs"][slot], last)
        else:
            assert not info.get("_final_obs", np.zeros(1, bool)).any()
    assert kept_active > 0


def make_spread() -> Any:
    from mpe2 import simple_spread_v3

    return simple_spread_v3.parallel_env()


MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["memory", "tcp"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_simple_spread_through_workers_equals_pettingzoo(
    transport: str, mode: AutoresetMode
) -> None:
    pytest.importorskip("mpe2")
    with aps.ClusterEnv.local(
        SPREAD, num_workers=2, envs_per_worker=2, transport=transport, autoreset_mode=mode
    ) as envs:
        assert envs.num_envs == 2 * 2 * 3  # workers x copies x agents
        assert envs.single_observation_space == make_spread().observation_space("agent_0")
        compare(envs, Oracle(make_spread, 4, mode), steps=1000, seed=7)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["memory", "tcp"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_agents_that_leave_and_join_through_workers(transport: str, mode: AutoresetMode) -> None:
    with aps.ClusterEnv.local(
        DYING, num_workers=2, envs_per_worker=2, transport=transport, autoreset_mode=mode
    ) as envs:
        assert envs.num_envs == 2 * 2 * 4
        compare(envs, Oracle(DyingAgents, 4, mode), steps=1000, seed=3)


def test_the_mask_follows_each_agent_through_an_episode() -> None:
    envs = MultiAgentVectorEnv([DyingAgents], autoreset_mode=AutoresetMode.NEXT_STEP)
    _, info = envs.reset(seed=0)
    seen = [info["agent_active"].tolist()]
    for _ in range(9):
        _, _, _, _, info = envs.step(np.zeros(4, dtype=np.int64))
        seen.append(info["agent_active"].tolist())
    T, F = True, False
    assert seen == [
        [T, T, T, F],  # reset: a3 has not joined
        [T, T, T, F],
        [T, T, T, T],  # a3 joined after step 2
        [F, T, T, T],  # a0 terminated at step 3
        [F, T, T, T],
        [F, F, T, T],  # a1 truncated at step 5
        [F, F, T, F],  # a3 terminated at step 6
        [F, F, F, F],  # a2 at step 7: the copy ended
        [T, T, T, F],  # NextStep: this step reset it
        [T, T, T, F],
    ]


def test_dead_slots_show_zeros_take_no_reward_and_ignore_actions() -> None:
    envs = MultiAgentVectorEnv([DyingAgents], autoreset_mode=AutoresetMode.NEXT_STEP)
    envs.reset(seed=0)
    for _ in range(4):
        obs, reward, terminated, truncated, info = envs.step(np.full(4, 2))
    # After step 4: a0 left at step 3, so its slot is padding.
    assert not info["agent_active"][0]
    np.testing.assert_array_equal(obs[0], np.zeros(2, np.float32))
    assert reward[0] == 0.0 and not terminated[0] and not truncated[0]
    np.testing.assert_array_equal(reward[1:], [12.0, 22.0, 32.0])
    assert info["t"][1:].tolist() == [4, 4, 4] and not info["_t"][0]


def test_same_step_moves_each_leaving_agents_last_observation_to_final_obs() -> None:
    envs = MultiAgentVectorEnv([DyingAgents], autoreset_mode=AutoresetMode.SAME_STEP)
    obs, _ = envs.reset(seed=0)
    offset = obs[0, 0]
    for _ in range(3):
        obs, _, terminated, _, info = envs.step(np.zeros(4, dtype=np.int64))
    assert terminated.tolist() == [True, False, False, False]
    assert info["_final_obs"].tolist() == [True, False, False, False]
    np.testing.assert_array_equal(info["final_obs"][0], [offset + 3, 0])
    assert info["final_info"]["t"][0] == 3 and info["final_info"]["_t"].tolist()[0]
    np.testing.assert_array_equal(obs[0], [0, 0])


def test_disabled_mode_waits_for_a_reset_mask() -> None:
    envs = MultiAgentVectorEnv([DyingAgents] * 2, autoreset_mode=AutoresetMode.DISABLED)
    envs.reset(seed=0)
    for _ in range(7):
        _, _, _, _, info = envs.step(np.zeros(8, dtype=np.int64))
    assert not info["agent_active"].any()
    _, reward, _, _, info = envs.step(np.ones(8, dtype=np.int64))
    assert not reward.any() and not info["agent_active"].any()
    mask = np.zeros(8, dtype=bool)
    mask[5] = True  # a slot of copy 1: copy 1 resets, copy 0 stays ended
    _, info = envs.reset(options={"reset_mask": mask})
    assert info["agent_active"].tolist() == [False] * 4 + [True, True, True, False]


def test_seeds_reach_each_copy() -> None:
    a = MultiAgentVectorEnv([DyingAgents] * 3)
    b = MultiAgentVectorEnv([DyingAgents] * 3)
    obs_a, _ = a.reset(seed=5)
    obs_b, _ = b.reset(seed=[5, 0, 0, 0, 6, 0, 0, 0, 7, 0, 0, 0])
    np.testing.assert_array_equal(obs_a, obs_b)
    raw = DyingAgents()
    first, _ = raw.reset(seed=6)
    np.testing.assert_array_equal(obs_a[4], first["a0"])


class Mixed(DyingAgents):
    def observation_space(self, agent: str) -> gym.Space[Any]:
        if agent == "a2":
            return gym.spaces.Box(0.0, 1.0, (3,), np.float32)
        return super().observation_space(agent)


def test_agents_with_different_spaces_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"'a2': Box\(0\.0, 1\.0, \(3,\)") as caught:
        MultiAgentVectorEnv([Mixed])
    assert "observation_space" in str(caught.value)
    assert "pad_observations_v0" in str(caught.value)


def test_a_parallel_env_is_recognized_without_being_a_gymnasium_env() -> None:
    assert is_parallel_env(DyingAgents())
    assert not is_parallel_env(gym.make("CartPole-v1"))
    assert agents_per_env(DyingAgents()) == 4


def test_a_worker_refuses_a_multi_agent_env_in_subprocesses() -> None:
    worker = aps.Worker("memory://nowhere", DYING, vector="async")
    with pytest.raises(ConfigError, match="vector='sync'"):
        worker._learn_agents()


def test_the_worker_offers_a_slot_per_agent_of_each_copy() -> None:
    worker = aps.Worker("memory://nowhere", DYING, num_envs=3)
    worker._learn_agents()
    assert worker.num_slots == 12
    gym_worker = aps.Worker("memory://nowhere", "CartPole-v1", num_envs=3)
    gym_worker._learn_agents()
    assert gym_worker.num_slots == 3


AGENTS = str(HERE.with_name("agents.py"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["memory", "tcp"])
def test_detach_the_workers_policy_acts_for_every_slot(transport: str) -> None:
    pytest.importorskip("torch")
    from tests.agents import Agent  # here: worker processes import this file by path

    steps = 24
    with aps.ClusterEnv.local(
        DYING,
        num_workers=2,
        envs_per_worker=1,
        transport=transport,
        policy=f"{AGENTS}:Agent",
        autoreset_mode="NextStep",
    ) as envs:
        envs.publish(Agent(envs))
        envs.reset(seed=0)
        rollout = envs.rollout(steps)
    assert rollout.obs.shape == (steps, 8, 2)
    assert rollout.actions.shape == (steps, 8)
    # The oracle's mask for one copy, from the reset on (period 8 under NextStep).
    oracle = MultiAgentVectorEnv([DyingAgents], autoreset_mode=AutoresetMode.NEXT_STEP)
    _, info = oracle.reset(seed=0)
    masks = []
    for _ in range(steps):
        masks.append(info["agent_active"])
        _, _, _, _, info = oracle.step(np.zeros(4, dtype=np.int64))
    active = np.tile(np.array(masks), (1, 2))  # both workers' copies follow one schedule
    # A slot without a live agent earns nothing; a live agent earns its action plus 10
    # times its index, so a reward shows whose action the env took.
    assert not active.all() and active.any()
    # The chunks carry the mask: the learner knows which steps were an agent's transition.
    assert rollout.agent_active is not None
    np.testing.assert_array_equal(rollout.agent_active, active)
    assert (rollout.reward[~active] == 0).all()
    index = np.tile(np.arange(4), 2)
    expected = rollout.actions + 10.0 * index
    np.testing.assert_array_equal(rollout.reward[active], expected[active])
    # An agent's episode is as long as the steps it was live: slots without an agent count
    # in no episode (a0 lives 3 steps, a1 5, a2 7, a3 from step 2 to 6).
    lengths = dict(zip(rollout.episode_env.tolist(), rollout.episode_length.tolist(), strict=False))
    assert {env % 4: length for env, length in lengths.items()} == {0: 3, 1: 5, 2: 7, 3: 4}


@pytest.mark.timeout(180)
def test_the_parameter_sharing_example_runs_with_a_tiny_budget(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("mpe2")
    import subprocess
    import sys

    script = HERE.parent.parent / "examples" / "ppo_pettingzoo.py"
    tiny = ["--total-timesteps", "384", "--num-steps", "16", "--copies-per-worker", "1"]
    proc = subprocess.run(
        [sys.executable, str(script), *tiny],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "6 agent slots" in proc.stdout
    assert "summary: first mean agent return" in proc.stdout


def test_a_worker_builds_its_multi_agent_envs_again_without_its_first_env() -> None:
    # A worker whose session could not be resumed builds its envs anew: the first env it
    # built to count agents is gone, and the envs must still be a vector env of agents.
    from aps.vector import make_vector_env

    envs = make_vector_env(
        "sync",
        DyingAgents,
        num_envs=2,
        autoreset_mode=AutoresetMode.NEXT_STEP,
        multi_agent=True,
    )
    try:
        assert isinstance(envs, MultiAgentVectorEnv) and envs.num_envs == 8
    finally:
        envs.close()


@pytest.mark.timeout(120)
def test_env_calls_on_chosen_slots_of_a_multi_agent_worker() -> None:
    with aps.ClusterEnv.local(DYING, num_workers=1, envs_per_worker=2, transport="memory") as envs:
        envs.reset(seed=0)

        def call(kind: str, name: str, **kwargs: Any) -> Any:
            return envs.call_learner(lambda learner: learner.env_call(kind, name, **kwargs))

        # SB3's env_is_wrapped: one answer per slot; no Gymnasium wrapper wraps a ParallelEnv.
        assert call("is_wrapped", "gymnasium.core.Wrapper") == (False,) * 8
        assert call("is_wrapped", "gymnasium.core.Wrapper", indices=[1, 6]) == (False, False)
        # A read of chosen slots reads their copies; every slot of a copy sees the same.
        names = call("get_attr", "possible_agents", indices=[0, 5])
        assert names == (("a0", "a1", "a2", "a3"),) * 2  # lists travel as tuples
        with pytest.raises(aps.WorkerError, match="once per agent slot"):
            call("call", "close", indices=[0, 1])


@pytest.mark.timeout(300)
def test_a_recurrent_agent_starts_fresh_where_an_agent_joins() -> None:
    pytest.importorskip("torch")
    steps = 10
    with aps.ClusterEnv.local(
        DYING,
        num_workers=1,
        envs_per_worker=1,
        transport="memory",
        policy=f"{HERE.with_name('recurrent_agents.py')}:LSTMAgent",
        autoreset_mode="NextStep",
    ) as envs:
        from tests.recurrent_agents import LSTMAgent

        envs.publish(LSTMAgent(envs))
        envs.reset(seed=0)
        rollout = envs.rollout(steps)
    active, starts = rollout.agent_active, rollout.episode_start
    assert active is not None and starts is not None
    joined = active[1:] & ~active[:-1]
    assert joined[:, 3].any()  # a3 joins at step 2
    # Where a slot's agent joins, its state was zeroed, as at any episode's start.
    assert starts[1:][joined].all()
