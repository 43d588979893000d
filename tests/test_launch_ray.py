"""The Ray launcher against a real local Ray (2 CPUs, no dashboard, a small object store)."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from collections.abc import Iterator
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import SyncVectorEnv

import aps
import aps.launch
from tests.conftest import FAST
from tests.test_cluster_env import assert_same

WORKERS, ENVS_PER_WORKER, STEPS = 2, 3, 40


def test_missing_ray_is_a_missing_dependency(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now raises ImportError
    with pytest.raises(aps.MissingDependency, match=r"pip install 'aps-rl\[ray\]'"):
        aps.launch.ray("CartPole-v1", num_workers=2)


SMALL_RAY = {
    "num_cpus": 2,
    "include_dashboard": False,
    "object_store_memory": 100 * 1024 * 1024,
    "log_to_driver": False,
}


def test_launcher_starts_and_shuts_down_its_own_ray() -> None:
    # Runs before the module's shared Ray instance exists (tests run in file order).
    ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'aps-rl[ray]'")
    if ray.is_initialized():
        pytest.skip("Ray is already running in this process; this test needs it down")
    workers = aps.launch.ray(
        "CartPole-v1", num_workers=2, num_cpus=0.5, placement="pack", init_kwargs=SMALL_RAY
    )
    envs = aps.ClusterEnv("tcp://127.0.0.1:0", num_workers=2, launcher=workers)
    try:
        assert ray.is_initialized()
        envs.reset(seed=0)
        assert "PACK CREATED" in envs.call_learner(lambda learner: workers.status()).detail
    finally:
        envs.close()
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def ray() -> Iterator[Any]:
    ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'aps-rl[ray]'")
    ray.init(**SMALL_RAY)
    try:
        yield ray
    finally:
        ray.shutdown()


def launcher(**kwargs: Any) -> aps.launch.RayWorkers:
    kwargs.setdefault("num_workers", WORKERS)
    kwargs.setdefault("envs_per_worker", ENVS_PER_WORKER)
    kwargs.setdefault("connect_timeout", 30.0)
    return aps.launch.ray("CartPole-v1", num_cpus=0.5, **kwargs)


def test_ray_workers_step_like_sync_vector_env(ray: Any) -> None:
    workers = launcher()
    expected = SyncVectorEnv([lambda: gym.make("CartPole-v1")] * (WORKERS * ENVS_PER_WORKER))
    envs = aps.ClusterEnv("tcp://127.0.0.1:0", num_workers=WORKERS, token="t0k", launcher=workers)
    try:
        # Each worker runs in its own Ray actor process, not here.
        pids = {w.pid for w in envs.workers}
        assert len(pids) == WORKERS and os.getpid() not in pids
        assert pids == {ray.get(a.where.remote())[1] for a in workers.actors}
        assert_same(envs.reset(seed=0), expected.reset(seed=0), "reset")
        rng = np.random.default_rng(0)
        for t in range(STEPS):
            actions = rng.integers(0, 2, size=WORKERS * ENVS_PER_WORKER)
            assert_same(envs.step(actions), expected.step(actions), f"step {t}")
        status = envs.call_learner(lambda learner: workers.status())
        assert status.launcher == "ray" and status.state == "running"
        assert "CREATED" in status.detail
        assert status.workers == ("actor 0 running", "actor 1 running")
    finally:
        envs.close()
        expected.close()
    # Closing said goodbye (the actors finished), then killed them and freed the group.
    for actor in workers.actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.where.remote(), timeout=30)


def test_killed_actor_is_reported_by_watch_and_by_the_learner(ray: Any) -> None:
    workers = launcher()
    envs = aps.ClusterEnv("tcp://127.0.0.1:0", num_workers=WORKERS, launcher=workers)
    try:
        envs.reset(seed=0)
        ray.kill(workers.actors[1])
        with pytest.raises(aps.WorkerLost) as lost:
            envs.call_learner(lambda learner: workers.watch())
        assert lost.value.worker_id == 1
        assert "Ray worker actor 1" in str(lost.value) and "died" in str(lost.value)
        with pytest.raises(aps.WorkerLost):
            for _ in range(100):  # the learner notices on its next exchange
                envs.step(envs.action_space.sample())
    finally:
        envs.close()


async def test_killed_actor_ends_the_wait_and_the_launcher_is_stopped(ray: Any) -> None:
    workers = launcher()
    # Three workers wanted, two launched: only the launcher's report can end this wait early.
    learner = aps.Learner("tcp://127.0.0.1:0", num_workers=3, launcher=workers, timeouts=FAST)
    async with learner:
        ray.kill(workers.actors[0])
        with pytest.raises(aps.WorkerLost) as lost:
            await learner.wait_for_workers(timeout=60)
        assert lost.value.worker_id == 0 and "died" in str(lost.value)
        assert (await workers.status()).state == "stopped"
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(workers.actors[1].where.remote(), timeout=30)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def test_restarted_actor_dials_again(ray: Any) -> None:
    workers = launcher(restart=True, max_restarts=2)
    url = f"tcp://127.0.0.1:{free_port()}"
    # Start the workers before the learner listens: they keep dialing meanwhile.
    await workers.start(url, workers.spec.for_learner(url, token="t0k"))
    try:
        first = workers.actors[0]
        before = ray.get(first.where.remote(), timeout=60)[1]
        ray.kill(first, no_restart=False)
        # Calls go to the restarted actor once the old process is gone (an early one may
        # still reach the old process before the kill lands).
        for _ in range(600):
            after = ray.get(first.where.remote(), timeout=60)[1]
            if after != before:
                break
            await asyncio.sleep(0.1)
        assert after != before
        async with aps.Learner(url, num_workers=WORKERS, token="t0k", timeouts=FAST) as learner:
            await learner.reset(seed=0)
            assert after in {w.pid for w in learner.workers}
            await learner.step(learner.action_space.sample())
            assert (await workers.status()).workers == ("actor 0 running", "actor 1 running")

            # Once the learner has all its workers, a restarted worker is refused: aps does
            # not hand a lost worker's env slots to a newcomer.
            ray.kill(workers.actors[1], no_restart=False)
            with pytest.raises(aps.WorkerLost):
                for _ in range(100):
                    await learner.step(learner.action_space.sample())
            with pytest.raises(aps.WorkerLost, match="already has its 2 workers") as lost:
                await workers.watch()
            assert lost.value.worker_id == 1
    finally:
        await workers.stop()


def test_restarted_actor_takes_over_the_lost_workers_envs_under_wait(ray: Any) -> None:
    # What docs/multi-machine.md promises for restart=True with on_worker_lost="wait".
    workers = launcher(restart=True, max_restarts=2)
    envs = aps.ClusterEnv(
        "tcp://127.0.0.1:0",
        num_workers=WORKERS,
        launcher=workers,
        on_worker_lost="wait",
        reconnect_timeout=60,
    )
    try:
        envs.reset(seed=0)
        before = {w.pid for w in envs.workers}
        ray.kill(workers.actors[1], no_restart=False)
        restarted = np.zeros(WORKERS * ENVS_PER_WORKER, dtype=bool)
        for _ in range(200):
            *_, truncated, info = envs.step(envs.action_space.sample())
            if "worker_restarted" in info:
                restarted = info["_worker_restarted"]
                assert truncated[restarted].all()
                break
        # The restarted actor's worker holds the lost worker's envs (the last three).
        assert restarted.tolist() == [False] * ENVS_PER_WORKER + [True] * ENVS_PER_WORKER
        after = {w.pid for w in envs.workers}
        assert len(after - before) == 1
        envs.step(envs.action_space.sample())
    finally:
        envs.close()
