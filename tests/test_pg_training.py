"""Rennala / Malenia / synchronized NIGT driven over real workers (memory:// and tcp://)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import aps  # noqa: E402
from aps import pg  # noqa: E402
from tests.agents import ContinuousAgent  # noqa: E402
from tests.conftest import FAST, WorkerTasks  # noqa: E402
from tests.test_detach import Spaces  # noqa: E402

POLICY = f"{Path(__file__).with_name('agents.py')}:ContinuousAgent"


async def learner_with(workers: WorkerTasks, delays: list[float], num_envs: int = 2) -> aps.Learner:
    learner = aps.Learner(
        "memory://",
        num_workers=len(delays),
        policy=POLICY,
        autoreset_mode="SameStep",
        timeouts=FAST,
    )
    await learner.start()
    for delay in delays:
        workers.start(learner.url, env="Pendulum-v1", num_envs=num_envs, compute_delay=delay)
    await learner.wait_for_workers()
    return learner


def flat(agent: torch.nn.Module) -> np.ndarray:
    return np.concatenate([p.detach().numpy().ravel() for p in agent.state_dict().values()])


async def test_rennala_steps_by_exactly_lr_and_reports_figures(workers: WorkerTasks) -> None:
    async with await learner_with(workers, [0.0, 0.0]) as learner:
        agent = ContinuousAgent(Spaces("Pendulum-v1"))
        points = [flat(agent)]
        trainer = pg.NIGT(agent, aggregator=pg.Rennala(batch=4), lr=0.05, momentum=0.5, horizon=10)
        stats = []
        async for s in trainer.train(learner, 3):
            stats.append(s)
            points.append(flat(agent))
        assert [s.iteration for s in stats] == [0, 1, 2]
        assert all(s.used >= 4 and sum(s.contributions.values()) == s.used for s in stats)
        assert all(s.bytes_sent > 0 and s.bytes_received > 0 for s in stats)
        assert all(np.isfinite(s.mean_return) for s in stats)
        # Every step moves the parameters by exactly lr (one global norm; float32 weights).
        steps = np.linalg.norm(np.diff(np.stack(points), axis=0), axis=1)
        np.testing.assert_allclose(steps, 0.05, rtol=0, atol=1e-6)
        # Gradient mode ended: lockstep calls work again.
        obs, _ = await learner.reset(seed=0)
        assert obs.shape == (4, 3)


async def test_rennala_does_not_wait_for_a_slow_worker(workers: WorkerTasks) -> None:
    async with await learner_with(workers, [0.0, 0.5]) as learner:
        agent = ContinuousAgent(Spaces("Pendulum-v1"))
        trainer = pg.NIGT(agent, aggregator=pg.Rennala(batch=4), lr=0.01, horizon=5)
        [stats] = [s async for s in trainer.train(learner, 1)]
        # The slow worker needs 2.5 s per trajectory; the fast one finishes the round first.
        assert stats.contributions[0] >= 4 and stats.contributions[1] == 0


async def test_malenia_hears_from_every_worker(workers: WorkerTasks) -> None:
    async with await learner_with(workers, [0.0, 0.02]) as learner:
        agent = ContinuousAgent(Spaces("Pendulum-v1"))
        trainer = pg.NIGT(agent, aggregator=pg.Malenia(batch=4), lr=0.01, horizon=5)
        async for stats in trainer.train(learner, 2):
            assert stats.contributions[0] >= 1 and stats.contributions[1] >= 1


async def test_synchronous_takes_one_report_per_worker(workers: WorkerTasks) -> None:
    async with await learner_with(workers, [0.0, 0.0], num_envs=1) as learner:
        agent = ContinuousAgent(Spaces("Pendulum-v1"))
        trainer = pg.NIGT(agent, aggregator=pg.Synchronous(), lr=0.01, horizon=5)
        async for stats in trainer.train(learner, 2):
            assert stats.contributions == {0: 1, 1: 1}


async def test_a_lost_worker_raises_or_is_dropped(workers: WorkerTasks) -> None:
    async with await learner_with(workers, [0.0, 0.0]) as learner:
        agent = ContinuousAgent(Spaces("Pendulum-v1"))
        trainer = pg.NIGT(agent, aggregator=pg.Rennala(batch=1000), lr=0.01, horizon=5)
        run = trainer.train(learner, 1)
        pending = asyncio.ensure_future(run.__anext__())
        await asyncio.sleep(0.3)
        workers.tasks[1].cancel()
        with pytest.raises(aps.WorkerLost):
            await asyncio.wait_for(pending, 10)
        await run.aclose()
    async with await learner_with(workers, [0.0, 0.0]) as learner:
        trainer = pg.NIGT(
            agent, aggregator=pg.Rennala(batch=30), lr=0.01, horizon=5, on_worker_lost="drop"
        )
        run = trainer.train(learner, 2)
        first = await run.__anext__()
        workers.tasks[-1].cancel()
        second = await run.__anext__()
        assert first.used >= 30 and second.used >= 30
        await run.aclose()
    with pytest.raises(aps.ConfigError, match="Malenia"):
        pg.NIGT(agent, aggregator=pg.Malenia(batch=4), on_worker_lost="drop")


def test_the_old_spelling_continue_still_means_drop_and_warns() -> None:
    agent = ContinuousAgent(Spaces("Pendulum-v1"))
    with pytest.warns(DeprecationWarning, match="spelled 'drop'"):
        trainer = pg.NIGT(agent, on_worker_lost="continue")
    assert trainer.on_worker_lost == "drop"
    with pytest.raises(aps.ConfigError, match="'wait' is the Learner's choice"):
        pg.NIGT(agent, on_worker_lost="wait")
    with pytest.raises(aps.ConfigError, match=r"'raise' or 'drop' .* got 'skip'"):
        pg.NIGT(agent, on_worker_lost="skip")  # type: ignore[arg-type]


async def test_rounds_need_same_step_autoreset(workers: WorkerTasks) -> None:
    async with aps.Learner("memory://", num_workers=1, policy=POLICY, timeouts=FAST) as learner:
        workers.start(learner.url, env="Pendulum-v1")
        trainer = pg.NIGT(ContinuousAgent(Spaces("Pendulum-v1")), lr=0.01, horizon=5)
        with pytest.raises(aps.WorkerError, match="SameStep"):
            async for _ in trainer.train(learner, 1):
                pass


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_blocking_run_over_worker_processes(transport: str) -> None:
    envs = aps.ClusterEnv.local(
        "Pendulum-v1",
        num_workers=2,
        envs_per_worker=2,
        policy=POLICY,
        autoreset_mode="SameStep",
        transport=transport,  # type: ignore[arg-type]
    )
    try:
        agent = ContinuousAgent(envs)
        size = sum(p.numel() for p in agent.parameters())
        stats = pg.NIGT(agent, aggregator=pg.Rennala(batch=4), lr=0.01, horizon=10).run(envs, 2)
        assert len(stats) == 2 and all(s.used >= 4 for s in stats)
        for s in stats:
            # One aggregation per round: each worker's float32 sum travels once (at most two
            # sums' worth of gradient bytes); everything else is counts of a few dozen bytes.
            assert s.aggregations == 1
            progress = s.messages_received - 2
            assert progress >= 1
            assert s.bytes_received <= 2 * (4 * size + 512) + 64 * progress
    finally:
        envs.close()


def test_the_sampler_records_the_states_it_acted_on() -> None:
    import gymnasium as gym
    from gymnasium.vector import AutoresetMode, SyncVectorEnv

    from aps.policy import Policy
    from aps.wire.messages import GradientRound
    from aps.worker.sampling import GradientSampler

    # copy=False and SameStep, as workers build their envs: the obs buffer is reused.
    envs = SyncVectorEnv(
        [lambda: gym.make("Pendulum-v1")] * 2, copy=False, autoreset_mode=AutoresetMode.SAME_STEP
    )
    policy = Policy(ContinuousAgent(envs), envs.single_observation_space, envs.single_action_space)
    sampler = GradientSampler(envs, policy)
    sampler.start(GradientRound(round=0, arrays=policy.get_weights(), horizon=3, gamma=0.9))
    seen = []
    for _ in range(2):
        seen.append(sampler._obs.copy())  # type: ignore[union-attr]
        sampler.step()
    np.testing.assert_array_equal(np.stack(sampler._traj_obs[0]), np.stack([s[0] for s in seen]))
