"""Recurrent policies in DETACH: the state per env on the worker, in the chunk, on the learner.

The worker's collector keeps an LSTM state per env (tests/recurrent_agents.py, CleanRL's
``ppo_atari_lstm.py`` agent), zeroes it where an episode starts and sends the state before each
chunk's first step; the learner checks it, exposes it in ``Rollout`` and replays it for APS.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import aps  # noqa: E402
from aps.policy import Policy, VectorEnvSpaces  # noqa: E402
from aps.wire import codec  # noqa: E402
from aps.wire.messages import RolloutChunk, Weights  # noqa: E402
from aps.worker.collector import Collector  # noqa: E402
from aps.worker.steps import StepServer  # noqa: E402
from tests.conftest import FAST, WorkerTasks  # noqa: E402
from tests.recurrent_agents import GRUAgent, LSTMAgent  # noqa: E402

AGENTS = str(Path(__file__).with_name("recurrent_agents.py"))
POLICY = f"{AGENTS}:LSTMAgent"
ALLOW = (f"{AGENTS}:*",)
CARTPOLE = VectorEnvSpaces.of(
    *[gym.make("CartPole-v1").observation_space] * 1, gym.spaces.Discrete(2)
)


def short_cartpole() -> gym.Env[Any, Any]:
    return gym.make("CartPole-v1", max_episode_steps=7)


def vector(num_envs: int, mode: gym.vector.AutoresetMode) -> gym.vector.SyncVectorEnv:
    return gym.vector.SyncVectorEnv([short_cartpole] * num_envs, autoreset_mode=mode)


MODES = [gym.vector.AutoresetMode.SAME_STEP, gym.vector.AutoresetMode.NEXT_STEP]


@pytest.mark.parametrize("mode", MODES, ids=["SameStep", "NextStep"])
def test_the_chunk_carries_the_state_a_reference_agent_has_at_its_start(
    mode: gym.vector.AutoresetMode,
) -> None:
    num_envs = 3
    envs = vector(num_envs, mode)
    collector = Collector(envs, POLICY, mode)
    policy = collector.policy
    assert policy.recurrent
    collector.load(Weights(version=1, arrays=policy.get_weights(), epsilon=None))
    obs, _ = envs.reset(seed=11)
    collector.observe(obs, None)
    # The reference: the same agent in-process over the same envs and seeds, stepped with the
    # chunks' actions, its state reset the way CleanRL's loop resets it.
    agent = copy.deepcopy(policy.module)
    ref_envs = vector(num_envs, mode)
    ref_obs, _ = ref_envs.reset(seed=11)
    state = (torch.zeros(1, num_envs, 16), torch.zeros(1, num_envs, 16))
    start = np.ones(num_envs, dtype=bool)
    reset_step = np.zeros(num_envs, dtype=bool)  # NextStep: this step only resets the env
    zero_starts = 0
    for steps in (7, 7, 5, 9, 8):
        chunk = collector.collect(steps)
        assert chunk.initial_state is not None and chunk.episode_start is not None
        masked = tuple(
            (1.0 - torch.tensor(start, dtype=torch.float32)).view(1, -1, 1) * s for s in state
        )
        for got, want in zip(chunk.initial_state, masked, strict=True):
            np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6)
        # Reset at episode ends: an env whose episode starts at the chunk's first step
        # starts from the zero state.
        for got in chunk.initial_state:
            assert not got[:, chunk.episode_start[0]].any()
        zero_starts += int(chunk.episode_start[0].sum())
        for t in range(steps):
            np.testing.assert_array_equal(chunk.obs[t], ref_obs)
            np.testing.assert_array_equal(chunk.episode_start[t], start)
            with torch.no_grad():
                _, state = agent.get_states(
                    torch.tensor(ref_obs), state, torch.tensor(start, dtype=torch.float32)
                )
            ref_obs, _, terminated, truncated, _ = ref_envs.step(chunk.actions[t])
            done = terminated | truncated
            if mode is gym.vector.AutoresetMode.SAME_STEP:
                start = done
            else:  # the episode starts after the step that resets the env
                start, reset_step = reset_step, done
    assert zero_starts > 0  # episodes of 7 steps: some chunk began with a fresh episode
    envs.close()
    ref_envs.close()


def test_the_state_is_not_in_the_weights_and_acting_leaves_them_alone() -> None:
    envs = vector(2, MODES[0])
    collector = Collector(envs, POLICY, MODES[0])
    policy = collector.policy
    names = {name for name, _ in policy.module.named_parameters()}
    weights = policy.get_weights()
    assert set(weights) == names  # no state buffer travels with a version
    assert not list(policy.module.buffers())
    collector.load(Weights(version=1, arrays=weights, epsilon=None))
    collector.observe(envs.reset(seed=0)[0], None)
    collector.collect(6)
    after = policy.get_weights()
    for name, array in weights.items():
        np.testing.assert_array_equal(after[name], array)


def test_a_gru_state_of_one_tensor_and_its_own_zero_state() -> None:
    policy = Policy(GRUAgent(CARTPOLE), CARTPOLE.single_observation_space, gym.spaces.Discrete(2))
    state = policy.initial_state(4)
    assert [s.shape for s in state] == [(2, 4, 8)]
    _, _, values, new = policy.act_recurrent(np.ones((4, 4), np.float32), state, np.zeros(4, bool))
    assert values is None and new[0].shape == (2, 4, 8) and new[0].any()


def test_recurrent_kl_replays_the_chunk_from_its_initial_state() -> None:
    spaces = (CARTPOLE.single_observation_space, gym.spaces.Discrete(2))
    policy = Policy(LSTMAgent(CARTPOLE), *spaces, seed=0)
    other = policy.clone()
    rng = np.random.default_rng(0)
    obs = rng.standard_normal((6, 3, 4)).astype(np.float32)
    starts = np.zeros((6, 3), bool)
    state = tuple(rng.standard_normal(s.shape).astype(np.float32) for s in policy.initial_state(3))
    assert policy.kl(other, obs, state=state, episode_start=starts) == 0.0
    with torch.no_grad():
        other.module.lstm.weight_hh_l0.add_(0.5 * torch.randn_like(other.module.lstm.weight_hh_l0))
        other.module.actor.weight.mul_(100.0)
    moved = policy.kl(other, obs, state=state, episode_start=starts)
    assert moved > 0.0
    # The state matters: from another initial state the divergence differs.
    zeros = policy.initial_state(3)
    assert policy.kl(other, obs, state=zeros, episode_start=starts) != moved
    with pytest.raises(aps.ConfigError, match="needs state= and episode_start="):
        policy.kl(other, obs)
    with pytest.raises(aps.ConfigError, match="act with act_recurrent"):
        policy.act(obs[0])


def test_feed_forward_chunks_are_unchanged_on_the_wire() -> None:
    t, e = 4, 2
    chunk = RolloutChunk(
        version=1,
        obs=np.zeros((t, e, 4), np.float32),
        actions=np.zeros((t, e), np.int64),
        logprob=np.zeros((t, e), np.float32),
        value=None,
        reward=np.zeros((t, e)),
        terminated=np.zeros((t, e), bool),
        truncated=np.zeros((t, e), bool),
        next_obs=np.zeros((e, 4), np.float32),
        episode_return=np.zeros(0),
        episode_length=np.zeros(0, np.int64),
        episode_env=np.zeros(0, np.int64),
        truncated_obs=np.zeros((0, 4), np.float32),
        truncated_index=np.zeros((0, 2), np.int64),
    )
    frame = codec.encode(chunk)
    # The map holds the tag, the 15 fields a chunk had before recurrent states and the
    # worker's timings (every answer's, since protocol 9): 17 keys.
    assert frame[0] == 0xDE and int.from_bytes(frame[1:3], "big") == 17
    assert b"initial_state" not in frame and b"episode_start" not in frame
    decoded = codec.decode(frame)
    assert isinstance(decoded, RolloutChunk)
    assert decoded.initial_state is None and decoded.episode_start is None
    recurrent = dataclasses.replace(
        chunk, initial_state=[np.ones((1, e, 3), np.float32)], episode_start=np.ones((t, e), bool)
    )
    back = codec.decode(codec.encode(recurrent))
    assert isinstance(back, RolloutChunk)
    np.testing.assert_array_equal(back.initial_state[0], np.ones((1, e, 3)))
    np.testing.assert_array_equal(back.episode_start, np.ones((t, e), bool))


async def test_a_rollout_exposes_the_initial_state_and_aps_measures_on_it(
    workers: WorkerTasks,
) -> None:
    strategy = aps.sync.APS(kl_threshold=1e9, max_lag=None)  # measures, never syncs
    async with aps.Learner(
        "memory://", num_workers=2, policy=POLICY, sync=strategy, timeouts=FAST
    ) as learner:
        for _ in range(2):
            workers.start(
                learner.url, num_envs=3, allow_policy=ALLOW, env_kwargs={"max_episode_steps": 9}
            )
        await learner.reset(seed=0)
        agent = LSTMAgent(CARTPOLE)
        await learner.publish(agent)
        first = await learner.rollout(6)
        assert first.initial_state is not None and first.episode_start is not None
        assert [s.shape for s in first.initial_state] == [(1, 6, 16), (1, 6, 16)]
        assert first.episode_start.shape == (6, 6) and first.episode_start[0].all()
        assert not any(s.any() for s in first.initial_state)  # every episode starts at reset
        second = await learner.rollout(6)
        assert second.initial_state is not None and any(s.any() for s in second.initial_state)
        with torch.no_grad():
            agent.actor.weight.mul_(50.0)
            agent.lstm.weight_hh_l0.add_(torch.randn_like(agent.lstm.weight_hh_l0))
        await learner.publish(agent)
        await learner.rollout(6)
        divergences = [d for w in learner.metrics.workers for d in w.divergences]
        assert divergences and all(0.0 < d < float("inf") for d in divergences)


class TamperingServer(StepServer):
    def __init__(self, *args: Any, tamper: str) -> None:
        super().__init__(*args)
        self.tamper = tamper

    async def _rollout(self, request: Any) -> Any:
        chunk = await super()._rollout(request)
        state = chunk.initial_state
        if self.tamper == "envs":  # one env too many
            return dataclasses.replace(
                chunk, initial_state=[np.concatenate([s] * 2, 1) for s in state]
            )
        if self.tamper == "nan":
            return dataclasses.replace(chunk, initial_state=[s * np.nan for s in state])
        if self.tamper == "starts":
            return dataclasses.replace(chunk, episode_start=chunk.episode_start[:-1])
        return dataclasses.replace(chunk, initial_state=None, episode_start=None)


class Tampering(aps.Worker):
    def __init__(self, *args: Any, tamper: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tamper = tamper

    def _new_server(self, envs: Any, collector: Any) -> StepServer:
        return TamperingServer(envs, collector, None, tamper=self.tamper)


@pytest.mark.parametrize(
    ("tamper", "named"),
    [
        ("envs", "initial_state[0] has shape (1, 4, 16), expected the worker's 2 envs on axis 1"),
        ("nan", "initial_state[0] holds values that are not finite"),
        ("starts", "episode_start is an array of shape (4, 2) and dtype bool, expected"),
        ("none", "initial_state is missing, but the policy is recurrent"),
    ],
)
async def test_a_malformed_state_is_that_workers_protocol_error(
    workers: WorkerTasks, tamper: str, named: str
) -> None:
    async with aps.Learner("memory://", num_workers=1, policy=POLICY, timeouts=FAST) as learner:
        bad = Tampering(
            learner.url, "CartPole-v1", num_envs=2, timeouts=FAST, tamper=tamper, policy=POLICY
        )
        workers.tasks.append(asyncio.create_task(bad.run()))
        await learner.reset(seed=0)
        await learner.publish(LSTMAgent(CARTPOLE))
        with pytest.raises(aps.ProtocolError, match="not a compatible aps worker") as caught:
            await learner.rollout(5)
        assert "worker 0 sent a chunk whose" in str(caught.value)
        assert named in str(caught.value)


def test_a_recurrent_policy_on_structured_observations_is_refused_with_the_fix() -> None:
    space = gym.spaces.Dict({"position": gym.spaces.Box(-1.0, 1.0, (4,), np.float32)})
    with pytest.raises(aps.ConfigError, match="recurrent policies take array observations"):
        Policy(LSTMAgent(CARTPOLE), space, gym.spaces.Discrete(2))
