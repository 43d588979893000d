"""Worker-side inference (DETACH) with versioned weights and the sync strategies.

Real workers (tasks over memory://, and worker processes over tcp://) act with CleanRL-shaped
agents from tests/agents.py; the learner publishes versions and the strategies decide.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import aps  # noqa: E402
from aps import sync  # noqa: E402
from aps.worker.steps import StepServer  # noqa: E402
from tests.agents import Agent, ContinuousAgent, QNetwork, WideAgent  # noqa: E402
from tests.conftest import FAST, WorkerTasks  # noqa: E402

AGENTS = str(Path(__file__).with_name("agents.py"))
POLICY = f"{AGENTS}:Agent"


class Spaces:
    def __init__(self, env_id: str) -> None:
        env = gym.make(env_id)
        self.single_observation_space = env.observation_space
        self.single_action_space = env.action_space


def perturb(agent: torch.nn.Module, scale: float) -> None:
    with torch.no_grad():
        for p in agent.parameters():
            p.add_(scale * torch.randn_like(p))


async def start(
    workers: WorkerTasks,
    *,
    policy: str = POLICY,
    strategy: Any = None,
    env: str = "CartPole-v1",
    num_workers: int = 2,
    num_envs: int = 3,
    mode: str = "SameStep",
) -> aps.Learner:
    learner = aps.Learner(
        "memory://",
        num_workers=num_workers,
        policy=policy,
        sync=strategy,
        autoreset_mode=mode,
        timeouts=FAST,
    )
    await learner.start()
    for _ in range(num_workers):
        workers.start(learner.url, env=env, num_envs=num_envs)
    await learner.reset(seed=0)
    return learner


@pytest.fixture
async def learner_factory(workers: WorkerTasks) -> AsyncIterator[Any]:
    made: list[aps.Learner] = []

    async def make(**kwargs: Any) -> aps.Learner:
        learner = await start(workers, **kwargs)
        made.append(learner)
        return learner

    yield make
    for learner in made:
        await learner.aclose()


async def test_rollout_shapes_versions_and_behaviour_logprobs(learner_factory: Any) -> None:
    learner = await learner_factory()
    agent = Agent(Spaces("CartPole-v1"))
    assert await learner.publish(agent) == 1
    batch = await learner.rollout(8)
    assert batch.obs.shape == (8, 6, 4) and batch.obs.dtype == np.float32
    assert batch.actions.shape == (8, 6) and batch.actions.dtype == np.int64
    assert batch.logprob.shape == batch.value.shape == batch.reward.shape == (8, 6)
    assert batch.next_obs.shape == (6, 4)
    assert (batch.policy_version == 1).all() and (batch.lag == 0).all()
    # The behaviour log-probs and values are what version 1 gives at those states.
    with torch.no_grad():
        obs = torch.as_tensor(batch.obs)
        logp = torch.log_softmax(agent.actor(obs), -1)
        expected = logp.gather(-1, torch.as_tensor(batch.actions)[..., None])[..., 0]
        values = agent.critic(obs)[..., 0]
    np.testing.assert_allclose(batch.logprob, expected.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(batch.value, values.numpy(), rtol=1e-5, atol=1e-6)
    # Consecutive rollouts continue the same episodes: next_obs is where the next one starts.
    again = await learner.rollout(2)
    np.testing.assert_array_equal(again.obs[0], batch.next_obs)


async def test_episode_statistics_in_same_step_mode(learner_factory: Any) -> None:
    learner = await learner_factory(num_workers=1, num_envs=4)
    await learner.publish(Agent(Spaces("CartPole-v1")))
    batch = await learner.rollout(200)
    ends = batch.terminated | batch.truncated
    assert len(batch.episode_return) == int(ends.sum()) > 0
    np.testing.assert_array_equal(batch.episode_return, batch.episode_length)  # CartPole: +1/step
    for env in range(4):
        steps = np.flatnonzero(ends[:, env])
        lengths = batch.episode_length[batch.episode_env == env]
        np.testing.assert_array_equal(lengths[1:], np.diff(steps))


async def test_always_sync_moves_every_version(learner_factory: Any) -> None:
    learner = await learner_factory(strategy=sync.AlwaysSync())
    agent = Agent(Spaces("CartPole-v1"))
    for version in (1, 2, 3):
        perturb(agent, 0.1)
        assert await learner.publish(agent) == version
        batch = await learner.rollout(4)
        assert (batch.policy_version == version).all() and (batch.lag == 0).all()
    metrics = learner.metrics
    assert [w.syncs for w in metrics.workers] == [3, 3]
    nbytes = sum(p.numel() * 4 for p in agent.state_dict().values())
    assert metrics.weight_bytes == 2 * 3 * nbytes


async def test_aps_syncs_on_divergence_and_max_lag(learner_factory: Any) -> None:
    learner = await learner_factory(strategy=sync.APS(kl_threshold=1e9, max_lag=3))
    agent = Agent(Spaces("CartPole-v1"))
    await learner.publish(agent)  # the first version always travels
    await learner.rollout(4)
    for version in (2, 3):
        perturb(agent, 0.5)
        await learner.publish(agent)
        batch = await learner.rollout(4)
        assert (batch.policy_version == 1).all() and (batch.lag == version - 1).all()
    perturb(agent, 0.5)
    await learner.publish(agent)  # lag reaches max_lag: forced sync
    batch = await learner.rollout(4)
    assert (batch.policy_version == 4).all()
    metrics = learner.metrics
    assert [w.syncs for w in metrics.workers] == [2, 2]
    assert metrics.lag_max == 2
    # Divergence was measured twice per worker (versions 2 and 3), never at max_lag.
    assert all(len(w.divergences) == 2 and min(w.divergences) > 0 for w in metrics.workers)


async def test_aps_divergence_is_the_kl_on_the_states_acted_on(learner_factory: Any) -> None:
    learner = await learner_factory(num_workers=1, strategy=sync.APS(kl_threshold=0.0))
    agent = Agent(Spaces("CartPole-v1"))
    await learner.publish(agent)
    old = {k: v.clone() for k, v in agent.state_dict().items()}
    batch = await learner.rollout(16)
    perturb(agent, 0.3)
    await learner.publish(agent)
    await learner.rollout(1)
    [measured] = learner.metrics.workers[0].divergences
    behaviour = Agent(Spaces("CartPole-v1"))
    behaviour.load_state_dict(old)
    with torch.no_grad():
        states = torch.as_tensor(batch.obs.reshape(-1, 4))
        p = torch.distributions.Categorical(logits=behaviour.actor(states))
        q = torch.distributions.Categorical(logits=agent.actor(states))
        expected = torch.distributions.kl_divergence(p, q).mean().item()
    assert measured == pytest.approx(expected, rel=1e-4)


async def test_aps_never_measures_equal_versions(learner_factory: Any) -> None:
    learner = await learner_factory(strategy=sync.APS(kl_threshold=0.0))
    await learner.publish(Agent(Spaces("CartPole-v1")))
    for _ in range(3):
        await learner.rollout(2)
    assert all(w.syncs == 1 and not w.divergences for w in learner.metrics.workers)


async def test_fixed_interval_in_versions(learner_factory: Any) -> None:
    learner = await learner_factory(strategy=sync.FixedInterval(versions=2))
    agent = Agent(Spaces("CartPole-v1"))
    seen = []
    for _ in range(5):
        await learner.publish(agent)
        seen.append(int((await learner.rollout(1)).policy_version[0, 0]))
    assert seen == [1, 1, 3, 3, 5]


@pytest.mark.parametrize(
    ("strategy", "stalls"),
    [
        (sync.APS(kl_threshold=1e9, max_lag=None), True),  # a threshold it never crosses
        (sync.APS(kl_threshold=1e9, max_lag=20), False),  # bounded staleness
        (sync.FixedInterval(versions=1000), False),  # stale by design, nothing measured
    ],
    ids=["aps-unbounded", "aps-max-lag", "fixed-interval"],
)
async def test_a_worker_the_strategy_never_syncs_is_reported_stalled(
    learner_factory: Any, caplog: pytest.LogCaptureFixture, strategy: Any, stalls: bool
) -> None:
    from aps.learner.rollouts import STALL_LAG

    learner = await learner_factory(strategy=strategy)
    agent = Agent(Spaces("CartPole-v1"))
    for version in range(1, STALL_LAG + 3):
        perturb(agent, 0.01)
        await learner.publish(agent)
        await learner.rollout(1)
        if version == STALL_LAG:  # lag STALL_LAG - 1 at this rollout's decision: not yet
            assert learner.metrics.stalled == ()
    metrics = learner.metrics
    assert metrics.stalled == ((0, 1) if stalls else ())
    assert [w.stalls for w in metrics.workers] == [int(stalls)] * 2
    warnings = [r for r in caplog.records if "max_lag=16" in r.getMessage()]
    assert len(warnings) == int(stalls)  # one warning per learner, whatever the workers
    if stalls:
        # Synced at last (here by a strategy swap), a worker is no longer stalled.
        learner.sync = sync.AlwaysSync()
        await learner.rollout(1)
        assert learner.metrics.stalled == () and metrics.as_dict()["stalled"] == [0, 1]


@pytest.mark.parametrize("precision", ["exact", "float16"])
async def test_weight_precision_sets_what_travels_and_what_workers_act_with(
    precision: str,
) -> None:
    from aps.policy import compact_weights

    agent = Agent(Spaces("CartPole-v1"))
    perturb(agent, 0.3)
    exact = {k: v.numpy().copy() for k, v in agent.state_dict().items()}
    async with aps.Learner(
        "memory://", num_workers=1, policy=POLICY, timeouts=FAST, weight_precision=precision
    ) as learner:
        worker = aps.Worker(learner.url, "CartPole-v1", num_envs=2, timeouts=FAST, policy=POLICY)
        task = asyncio.create_task(worker.run())
        await learner.reset(seed=0)
        await learner.publish(agent)
        await learner.rollout(2)
        assert worker._server is not None and worker._server.collector is not None
        held = worker._server.collector.policy.get_weights()
        sent = learner.metrics.weight_bytes
    await task
    nbytes = sum(a.nbytes for a in exact.values())
    if precision == "exact":
        assert sent == nbytes
        for name, array in exact.items():
            np.testing.assert_array_equal(held[name], array)
    else:
        assert sent == nbytes // 2  # every array of the agent is float32
        rounded = compact_weights(exact)
        for name, array in exact.items():
            assert held[name].dtype == array.dtype  # widened back to the module's dtype
            np.testing.assert_array_equal(held[name], rounded[name].astype(array.dtype))
        assert any(not np.array_equal(held[n], exact[n]) for n in exact)  # really rounded


async def test_a_weight_precision_it_does_not_know_is_refused() -> None:
    with pytest.raises(aps.ConfigError, match="weight_precision must be 'exact' or 'float16'"):
        aps.Learner("memory://", num_workers=1, weight_precision="int8")  # type: ignore[arg-type]


async def test_published_versions_stay_bounded(learner_factory: Any) -> None:
    # No staleness bound: the workers keep version 1 while 50 newer ones are published.
    learner = await learner_factory(strategy=sync.APS(kl_threshold=1e9, max_lag=None))
    agent = Agent(Spaces("CartPole-v1"))
    await learner.publish(agent)
    await learner.rollout(1)
    for _ in range(50):
        await learner.publish(agent)
    versions = learner._detach.versions
    assert versions is not None and len(versions) == 2  # v1 (held) and v51
    await learner.rollout(1)  # workers on a stale version keep producing valid chunks
    assert all(w.version == 1 for w in learner.metrics.workers)


async def test_chunks_stream_with_publishing_inside_the_loop(learner_factory: Any) -> None:
    learner = await learner_factory(
        policy=f"{AGENTS}:QNetwork", strategy=sync.AlwaysSync(), num_envs=2
    )
    agent = QNetwork(Spaces("CartPole-v1"))
    await learner.publish(agent, epsilon=0.5)
    last: dict[int, int] = {}
    count = 0
    async for chunk in learner.chunks(5, max_in_flight=3):
        assert chunk.obs.shape == (5, 2, 4) and chunk.value is None
        assert chunk.version >= last.get(chunk.worker_id, 0)  # versions never go back
        assert chunk.lag == learner.version - chunk.version >= 0
        last[chunk.worker_id] = chunk.version
        perturb(agent, 0.01)
        await learner.publish(agent, epsilon=0.1)  # off-policy: publish after every update
        count += 1
        if count == 12:
            break
    assert set(last) == {0, 1}
    # Leaving the loop ended the stream: lockstep calls work again.
    batch = await learner.rollout(2)
    assert (batch.policy_version == learner.version).all()
    metrics = learner.metrics
    assert sum(w.chunks for w in metrics.workers) == 12 + 2
    assert metrics.lag_max >= 1  # pipelined chunks were acted with older versions


async def test_gaussian_policy_on_a_box_env(learner_factory: Any) -> None:
    learner = await learner_factory(
        policy=f"{AGENTS}:ContinuousAgent", env="Pendulum-v1", strategy=sync.APS(kl_threshold=0.01)
    )
    agent = ContinuousAgent(Spaces("Pendulum-v1"))
    await learner.publish(agent)
    batch = await learner.rollout(4)
    assert batch.actions.shape == (4, 6, 1) and batch.actions.dtype == np.float32
    with torch.no_grad():
        agent.actor_logstd.add_(1.0)  # the std grows e-fold: a large, known divergence
    await learner.publish(agent)
    batch = await learner.rollout(4)
    assert (batch.policy_version == 2).all()
    expected = 0.5 * (np.exp(-2.0) - 1.0) + 1.0  # KL(N(m,1) || N(m,e)) per dimension
    assert learner.metrics.workers[0].divergences[-1] == pytest.approx(expected, rel=1e-5)


async def test_misuse_is_refused_clearly(workers: WorkerTasks) -> None:
    async with aps.Learner("memory://", num_workers=1, timeouts=FAST) as plain:
        workers.start(plain.url)
        await plain.reset(seed=0)
        with pytest.raises(aps.InvalidState, match="policy="):
            await plain.rollout(4)
    async with aps.Learner("memory://", num_workers=1, policy=POLICY, timeouts=FAST) as learner:
        workers.start(learner.url)
        await learner.wait_for_workers()
        with pytest.raises(aps.InvalidState, match="reset"):
            await learner.rollout(4)
        await learner.reset(seed=0)
        with pytest.raises(aps.InvalidState, match="publish"):
            await learner.rollout(4)
        with pytest.raises(aps.ConfigError, match="num_steps"):
            await learner.rollout(0)
    with pytest.raises(aps.ConfigError, match="should_sync"):
        aps.Learner("memory://", num_workers=1, policy=POLICY, sync=object())  # type: ignore[arg-type]


async def test_weights_that_do_not_fit_fail_the_next_rollout(learner_factory: Any) -> None:
    learner = await learner_factory(num_workers=1)
    await learner.publish(WideAgent(Spaces("CartPole-v1")))
    with pytest.raises(aps.WorkerError, match="critic"):
        await learner.rollout(2)


async def test_a_policy_that_cannot_load_refuses_the_worker(workers: WorkerTasks) -> None:
    learner = aps.Learner("memory://", num_workers=1, policy=f"{AGENTS}:Nope", timeouts=FAST)
    async with learner:
        task = workers.start(learner.url)
        with pytest.raises(aps.ConfigError, match="Nope"):
            await asyncio.wait_for(task, 10)
        with pytest.raises(aps.Timeout, match="could not build its envs or policy"):
            await learner.wait_for_workers(timeout=0.5)


def test_cluster_env_rollout_over_worker_processes() -> None:
    envs = aps.ClusterEnv.local(
        "CartPole-v1",
        num_workers=2,
        envs_per_worker=2,
        policy=POLICY,
        sync=sync.APS(kl_threshold=0.05),
        autoreset_mode="SameStep",
    )
    try:
        agent = Agent(envs)
        envs.reset(seed=1)
        envs.publish(agent)
        batch = envs.rollout(16)
        assert batch.obs.shape == (16, 4, 4) and (batch.policy_version == 1).all()
        assert envs.metrics.syncs == 2
    finally:
        envs.close()


def test_cluster_env_rollout_async_overlaps_acting_with_training() -> None:
    envs = aps.ClusterEnv.local(
        "CartPole-v1",
        num_workers=2,
        envs_per_worker=2,
        policy=POLICY,
        sync=sync.AlwaysSync(),
        autoreset_mode="SameStep",
    )
    try:
        agent = Agent(envs)
        envs.reset(seed=1)
        envs.publish(agent)
        envs.rollout_async(8)
        with pytest.raises(aps.InvalidState, match="rollout_wait"):
            envs.rollout_async(8)
        with pytest.raises(aps.InvalidState, match="rollout_wait"):
            envs.rollout(8)
        perturb(agent, 0.5)  # "training" while the workers act the batch
        first = envs.rollout_wait()
        assert first.obs.shape == (8, 4, 4) and (first.policy_version == 1).all()
        envs.publish(agent)  # version 2, trained while the first batch was acted
        envs.rollout_async(8)
        second = envs.rollout_wait()
        assert (second.policy_version == 2).all() and (second.lag == 0).all()
        # The second batch goes on where the first left off, on the same envs.
        np.testing.assert_array_equal(second.obs[0], first.next_obs)
        with pytest.raises(aps.InvalidState, match="without a rollout_async"):
            envs.rollout_wait()
        envs.rollout_async(4)  # pending at close: close still works
    finally:
        envs.close()


async def test_epsilon_travels_with_its_version(learner_factory: Any) -> None:
    learner = await learner_factory(
        policy=f"{AGENTS}:QNetwork", num_workers=1, strategy=sync.APS(kl_threshold=0.0)
    )
    agent = QNetwork(Spaces("CartPole-v1"))
    await learner.publish(agent, epsilon=0.5)
    await learner.rollout(8)
    await learner.publish(agent, epsilon=0.1)  # same weights, less exploration
    await learner.rollout(1)
    [measured] = learner.metrics.workers[0].divergences
    p, q = 1 - 0.5 / 2, 1 - 0.1 / 2  # probability of the greedy action, 2 actions
    expected = p * np.log(p / q) + (1 - p) * np.log((1 - p) / (1 - q))
    assert measured == pytest.approx(expected, rel=1e-5)


async def test_seeded_reset_makes_worker_actions_reproducible(workers: WorkerTasks) -> None:
    def agent() -> Agent:
        torch.manual_seed(0)
        return Agent(Spaces("CartPole-v1"))

    runs = []
    for _ in range(2):
        learner = await start(workers, num_workers=1)
        async with learner:
            await learner.publish(agent())
            runs.append((await learner.rollout(32)).actions)
            await learner.reset(seed=0)
            runs.append((await learner.rollout(32)).actions)
    np.testing.assert_array_equal(runs[0], runs[2])
    np.testing.assert_array_equal(runs[1], runs[3])
    np.testing.assert_array_equal(runs[0], runs[1])  # same seed, same weights, same actions


@pytest.mark.parametrize("mode", ["SameStep", "NextStep"])
async def test_truncated_steps_keep_their_last_observation(workers: WorkerTasks, mode: str) -> None:
    learner = aps.Learner(
        "memory://", num_workers=2, policy=POLICY, autoreset_mode=mode, timeouts=FAST
    )
    async with learner:
        for _ in range(2):
            workers.start(learner.url, num_envs=2, env_kwargs={"max_episode_steps": 5})
        await learner.reset(seed=0)
        await learner.publish(Agent(Spaces("CartPole-v1")))
        batch = await learner.rollout(30)
    cuts = np.argwhere(batch.truncated)
    assert len(cuts) > 0
    np.testing.assert_array_equal(np.sort(batch.truncated_index, axis=0), np.sort(cuts, axis=0))
    for (t, env), last in zip(batch.truncated_index, batch.truncated_obs, strict=True):
        if t + 1 < len(batch.obs):
            following = batch.obs[t + 1, env]
            if mode == "NextStep":  # the reset comes on the next step: obs still shows it
                np.testing.assert_array_equal(last, following)
            else:  # the env already reset: only truncated_obs has the last observation
                assert not np.array_equal(last, following)


class TamperingServer(StepServer):
    """An honest DETACH step server whose chunks are then tampered with as ``tamper`` says."""

    def __init__(self, *args: Any, tamper: str) -> None:
        super().__init__(*args)
        self.tamper = tamper

    async def _rollout(self, request: Any) -> Any:
        chunk = await super()._rollout(request)
        if self.tamper == "obs":  # one step short
            return dataclasses.replace(chunk, obs=chunk.obs[:-1])
        if self.tamper == "next_obs":  # one env too many
            return dataclasses.replace(chunk, next_obs=np.concatenate([chunk.next_obs] * 2))
        if self.tamper == "episode_env":  # an env this worker does not have
            return dataclasses.replace(chunk, episode_env=chunk.episode_env + 100)
        # truncated observations said to be at other steps than the truncated ones
        return dataclasses.replace(chunk, truncated_index=chunk.truncated_index[::-1] + 1)


class Tampering(aps.Worker):
    """An honest DETACH worker whose chunks are tampered with (see TamperingServer)."""

    def __init__(self, *args: Any, tamper: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tamper = tamper

    def _new_server(self, envs: Any, collector: Any) -> StepServer:
        return TamperingServer(envs, collector, None, tamper=self.tamper)


@pytest.mark.parametrize(
    ("tamper", "named"),
    [
        ("obs", "chunk whose obs is an array of shape (29, 2, 4)"),
        ("next_obs", "chunk whose next_obs is an array of shape (4, 4)"),
        ("episode_env", "episodes of envs outside its 2"),
        ("truncated_index", "not its truncated steps"),
    ],
)
async def test_a_chunk_that_does_not_fit_the_worker_is_refused(
    workers: WorkerTasks, tamper: str, named: str
) -> None:
    async with aps.Learner("memory://", num_workers=1, policy=POLICY, timeouts=FAST) as learner:
        bad = Tampering(
            learner.url,
            "CartPole-v1",
            num_envs=2,
            env_kwargs={"max_episode_steps": 5},
            timeouts=FAST,
            tamper=tamper,
            policy=POLICY,
        )
        workers.tasks.append(asyncio.create_task(bad.run()))
        await learner.reset(seed=0)
        await learner.publish(Agent(Spaces("CartPole-v1")))
        with pytest.raises(aps.ProtocolError, match="not a compatible aps worker") as caught:
            await learner.rollout(30)
        assert named in str(caught.value)


def test_env_actions_clip_box_samples_and_pass_discrete_ones() -> None:
    from aps.policy import Policy

    box = Policy(ContinuousAgent(Spaces("Pendulum-v1")), *vars(Spaces("Pendulum-v1")).values())
    raw = np.array([[-5.0], [0.5], [7.0]], np.float32)
    np.testing.assert_array_equal(box.env_actions(raw), [[-2.0], [0.5], [2.0]])
    assert raw[0, 0] == -5.0  # the raw samples stay as they were
    discrete = Policy(Agent(Spaces("CartPole-v1")), *vars(Spaces("CartPole-v1")).values())
    actions = np.array([0, 1, 1])
    assert discrete.env_actions(actions) is actions


class HangsOnce(gym.Wrapper[Any, Any, Any, Any]):
    """CartPole whose fifth step hangs for ``seconds`` (an env stuck in a driver, say)."""

    def __init__(self, seconds: float = 4.0) -> None:
        super().__init__(gym.make("CartPole-v1"))
        self.steps, self.seconds = 0, seconds

    def step(self, action: Any) -> Any:
        self.steps += 1
        if self.steps == 5:
            __import__("time").sleep(self.seconds)
        return super().step(action)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_chunk_whose_env_hangs_is_due_a_steps_time_per_step_heartbeats_or_not(
    workers: WorkerTasks, stream: bool
) -> None:
    # The worker acts in a thread of its own, and its loop heartbeats every 0.05 s all the
    # while: only a deadline from the request catches the hang (2 steps x 0.5 s) before the
    # env wakes up (4 s) and the chunk arrives, late but whole.
    timeouts = dataclasses.replace(FAST, step=0.5, heartbeat_interval=0.05)
    async with aps.Learner(
        "memory://", num_workers=1, policy=POLICY, timeouts=timeouts, autoreset_mode="SameStep"
    ) as learner:
        workers.start(learner.url, env=HangsOnce, num_envs=1, timeouts=timeouts)
        await learner.reset(seed=0)
        await learner.publish(Agent(Spaces("CartPole-v1")))
        await learner.rollout(2)  # steps 1-2 (3-4 follow)
        with pytest.raises(aps.WorkerLost) as lost:
            if stream:
                async for _ in learner.chunks(2, max_in_flight=1):
                    pass
            else:
                for _ in range(3):
                    await asyncio.wait_for(learner.rollout(2), 30)
        assert "heartbeats" in repr(lost.value.__cause__)
