"""A spare worker that takes over a lost one joins NIGT's gradient rounds at the next round."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("torch")

import aps
from aps import pg
from aps.testing import until
from tests.agents import ContinuousAgent
from tests.conftest import FAST, TEST_POLICIES, WorkerTasks
from tests.test_detach import Spaces
from tests.test_pg_training import POLICY


@pytest.mark.timeout(60)
async def test_a_spare_replacing_a_lost_worker_joins_at_the_next_round(
    workers: WorkerTasks,
) -> None:
    async with aps.Learner(
        "memory://",
        num_workers=2,
        policy=POLICY,
        autoreset_mode="SameStep",
        timeouts=FAST,
        on_worker_lost="wait",
        reconnect_timeout=30,
    ) as learner:
        for _ in range(2):
            workers.start(learner.url, env="Pendulum-v1", num_envs=2)
        await learner.wait_for_workers()
        spare = aps.Worker(
            learner.url, "Pendulum-v1", num_envs=2, timeouts=FAST, allow_policy=TEST_POLICIES
        )
        workers.tasks.append(asyncio.create_task(spare.run()))
        await until(lambda: spare.worker_id is not None)
        assert [w.worker_id for w in learner.workers] == [0, 1]
        agent = ContinuousAgent(Spaces("Pendulum-v1"))
        trainer = pg.NIGT(
            agent, aggregator=pg.Rennala(batch=8), lr=0.01, horizon=20, on_worker_lost="drop"
        )
        run = trainer.train(learner, 6)
        seen = [await run.__anext__()]
        workers.tasks[1].cancel()  # worker 1 is lost mid-training; the spare (2) takes over
        async for stats in run:
            seen.append(stats)
        assert [s.iteration for s in seen] == list(range(6))
        assert all(s.used >= 8 for s in seen)
        assert learner.restarts == 1
        assert [w.worker_id for w in learner.workers] == [0, 2]
        # The replacement samples from the round after it joined on: its gradients count.
        assert sum(s.contributions.get(2, 0) for s in seen) > 0
        assert all(1 not in s.contributions for s in seen[2:])
