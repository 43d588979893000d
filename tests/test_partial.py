"""EnvPool-style partial batches on the learner: send(actions, worker_ids) and recv(min_workers)."""

from __future__ import annotations

import asyncio
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import SyncVectorEnv

import aps
from tests.conftest import FAST, WorkerTasks
from tests.test_learner import Exploding

WORKERS, ENVS = 3, 2


@pytest.fixture
async def learner(workers: WorkerTasks) -> Any:
    async with aps.Learner("memory://", num_workers=WORKERS, timeouts=FAST) as learner:
        for _ in range(WORKERS):
            workers.start(learner.url, num_envs=ENVS)
        await asyncio.wait_for(learner.reset(seed=0), 20)
        yield learner


def reference() -> list[SyncVectorEnv]:
    """One single-env reference per env, seeded as the learner's reset seeds it."""
    refs = []
    for i in range(WORKERS * ENVS):
        env = SyncVectorEnv([lambda: gym.make("CartPole-v1")])
        env.reset(seed=i)
        refs.append(env)
    return refs


def envs_of(learner: aps.Learner, worker_id: int) -> list[int]:
    info = next(w for w in learner.workers if w.worker_id == worker_id)
    return list(range(info.env_offset, info.env_offset + info.num_envs))


async def test_workers_step_independently_and_results_carry_env_ids(learner: aps.Learner) -> None:
    refs = reference()
    rng = np.random.default_rng(0)
    ids = [w.worker_id for w in learner.workers]
    pending: dict[int, np.ndarray[Any, Any]] = {}  # worker -> actions in flight
    for worker_id in ids:
        pending[worker_id] = rng.integers(0, 2, size=ENVS)
        await learner.send(pending[worker_id], [worker_id])
    for _ in range(60):
        obs, reward, terminated, truncated, info = await asyncio.wait_for(learner.recv(), 20)
        env_ids = info["env_id"]
        assert len(env_ids) % ENVS == 0 and len(env_ids) == len(obs) == len(reward)
        answered = sorted({int(e) // ENVS for e in env_ids})
        for row, env in enumerate(env_ids):
            worker_id = next(w for w in ids if env in envs_of(learner, w))
            assert info["worker_id"][row] == worker_id
            action = pending[worker_id][env - envs_of(learner, worker_id)[0]]
            want = refs[env].step(np.array([action]))
            np.testing.assert_array_equal(obs[row], want[0][0])
            assert (reward[row], terminated[row], truncated[row]) == (
                want[1][0],
                want[2][0],
                want[3][0],
            )
        # Send again only to the workers that answered, while the others may still step.
        for position in answered:
            worker_id = learner.workers[position].worker_id
            pending[worker_id] = rng.integers(0, 2, size=ENVS)
            await learner.send(pending[worker_id], [worker_id])
    await asyncio.wait_for(learner.recv(min_workers=WORKERS), 20)


async def test_send_to_all_then_recv_all_equals_step(learner: aps.Learner) -> None:
    actions = np.zeros(WORKERS * ENVS, dtype=np.int64)
    await learner.send(actions)
    obs, reward, *_, info = await asyncio.wait_for(learner.recv(min_workers=WORKERS), 20)
    assert obs.shape == (WORKERS * ENVS, 4) and reward.all()
    np.testing.assert_array_equal(info["env_id"], np.arange(WORKERS * ENVS))
    owners = [w.worker_id for w in learner.workers for _ in range(ENVS)]
    np.testing.assert_array_equal(info["worker_id"], owners)
    # Lockstep works again once everything sent was received.
    await asyncio.wait_for(learner.step(actions), 20)


async def test_misuse_is_refused(learner: aps.Learner) -> None:
    with pytest.raises(aps.InvalidState, match="send"):
        await learner.recv()
    first = learner.workers[0].worker_id
    with pytest.raises(aps.ConfigError, match="no worker 99"):
        await learner.send(np.zeros(ENVS, np.int64), [99])
    with pytest.raises(aps.ConfigError, match="distinct"):
        await learner.send(np.zeros(2 * ENVS, np.int64), [first, first])
    with pytest.raises(aps.ConfigError):
        await learner.send(np.zeros(ENVS + 1, np.int64), [first])
    await learner.send(np.zeros(ENVS, np.int64), [first])
    with pytest.raises(aps.InvalidState, match="recv"):
        await learner.send(np.zeros(ENVS, np.int64), [first])
    with pytest.raises(aps.InvalidState, match="not all received"):
        await learner.step(np.zeros(WORKERS * ENVS, np.int64))
    with pytest.raises(aps.ConfigError, match="min_workers"):
        await learner.recv(min_workers=2)
    await asyncio.wait_for(learner.recv(), 20)


async def test_an_env_error_is_raised_by_recv_and_the_rest_goes_on(workers: WorkerTasks) -> None:
    async with aps.Learner("memory://", num_workers=2, timeouts=FAST) as learner:
        workers.start(learner.url, env=Exploding)  # raises on its third step
        workers.start(learner.url, env=Exploding)
        await asyncio.wait_for(learner.reset(seed=0), 20)
        first, second = (w.worker_id for w in learner.workers)
        for ids in ([first, second], [first]):
            await learner.send(np.zeros(len(ids), np.int64), ids)
            await asyncio.wait_for(learner.recv(min_workers=len(ids)), 20)
        await learner.send(np.zeros(2, np.int64), [first, second])
        with pytest.raises(aps.WorkerError, match="exploded") as caught:
            await asyncio.wait_for(learner.recv(min_workers=2), 20)
        assert caught.value.worker_id == first
        await asyncio.wait_for(learner.reset(seed=1), 20)  # the learner is still usable
        await learner.send(np.zeros(1, np.int64), [second])
        *_, info = await asyncio.wait_for(learner.recv(), 20)
        assert info["env_id"].tolist() == [1]


async def test_a_waiting_recv_refuses_a_second_and_raises_when_its_steps_are_cancelled(
    workers: WorkerTasks,
) -> None:
    learner = aps.Learner(
        "memory://", num_workers=1, timeouts=FAST, on_worker_lost="wait", reconnect_timeout=60
    )
    async with learner:
        worker = workers.start(learner.url)
        await asyncio.wait_for(learner.reset(seed=0), 20)
        worker.cancel()  # gone: the learner waits for it to come back, and recv() with it
        await asyncio.wait({worker})
        await learner.send(np.zeros(1, np.int64))
        receiving = asyncio.create_task(learner.recv())
        await asyncio.sleep(0.05)
        assert not receiving.done()
        with pytest.raises(aps.InvalidState, match="already waiting in another task"):
            await learner.recv()
        await learner.aclose()  # cancels the step recv() waits for
        with pytest.raises(aps.InvalidState, match="cancelled: the learner closed"):
            await asyncio.wait_for(receiving, 5)
