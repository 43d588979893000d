"""End-to-end checks that a wrong NIGT trainer or worker cannot pass.

Built on :mod:`tests.pg_agents`: every NIGT step must move the one parameter that matters
(``mu``) by exactly ``lr`` and upwards (ascent on a return that grows with ``mu``), and the
mean return of each round must be ``length * mu`` at the extrapolated point that round
broadcast, ``theta_t + ((1 - eta) / eta) (theta_t - theta_{t-1})``.

Each wrong trainer fails one of these (checked by making each mistake in turn):

- broadcasting ``theta_t`` instead of the extrapolated point, never writing the new weights
  into the policy, workers ascending along the negated gradient:
  ``test_nigt_steps_exactly_lr_uphill_and_samples_at_the_extrapolated_point``;
- workers ignoring the broadcast weights: both of the first two tests;
- workers carrying trajectories across rounds:
  ``test_a_round_samples_from_fresh_resets_with_the_broadcast_weights``;
- the trainer taking a report or a count of an earlier round as current:
  ``test_messages_of_an_earlier_round_are_never_aggregated``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

import aps
from aps import pg
from aps.messages import GradientProgress, GradientReport, GradientRound
from aps.pg.sampling import GradientSampler
from aps.policy import Policy
from tests.conftest import FAST, WorkerTasks
from tests.pg_agents import MeanAgent, Reveal

AGENT = f"{Path(__file__).with_name('pg_agents.py')}:MeanAgent"
LENGTH = 3
ENVS = 64


@pytest.mark.timeout(120)
async def test_nigt_steps_exactly_lr_uphill_and_samples_at_the_extrapolated_point(
    workers: WorkerTasks,
) -> None:
    lr, eta, batch = 0.25, 0.5, 4 * ENVS
    async with aps.Learner(
        "memory://", num_workers=2, policy=AGENT, autoreset_mode="SameStep", timeouts=FAST
    ) as learner:
        for _ in range(2):
            workers.start(learner.url, env=Reveal, num_envs=ENVS, policy=AGENT)
        await learner.wait_for_workers()
        agent = MeanAgent()
        trainer = pg.NIGT(
            agent, aggregator=pg.Rennala(batch=batch), lr=lr, momentum=eta, horizon=10, gamma=1.0
        )
        weights = [np.concatenate([p.detach().numpy().ravel() for p in agent.parameters()])]
        mus = [agent.mu]
        returns = []
        async for stats in trainer.train(learner, 4):
            assert stats.used >= batch
            returns.append(stats.mean_return)
            weights.append(np.concatenate([p.detach().numpy().ravel() for p in agent.parameters()]))
            mus.append(agent.mu)
    # The trainer wrote each step into the policy, and each step had length lr exactly (a
    # global norm, float32 weights) and went uphill.
    steps = np.diff(np.stack(weights), axis=0)
    np.testing.assert_allclose(np.linalg.norm(steps, axis=1), lr, rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.diff(mus), lr, rtol=0, atol=1e-6)
    # Round t sampled at the extrapolated point (theta_t itself in round 0), and only there:
    # a round's mean return is LENGTH * mu_point with a standard error of sqrt(LENGTH / batch)
    # ~ 0.11; the point and theta_t differ by LENGTH * lr = 0.75 in return.
    factor = (1 - eta) / eta
    points = [mus[0]] + [mus[t] + factor * (mus[t] - mus[t - 1]) for t in range(1, 4)]
    np.testing.assert_allclose(returns, LENGTH * np.asarray(points), rtol=0, atol=0.4)


def test_a_round_samples_from_fresh_resets_with_the_broadcast_weights() -> None:
    from gymnasium.vector import AutoresetMode, SyncVectorEnv

    envs = SyncVectorEnv(
        [lambda: Reveal(LENGTH)] * 2, copy=False, autoreset_mode=AutoresetMode.SAME_STEP
    )
    agent = MeanAgent(log_std=-12.0)  # actions are mu to within 1e-5
    policy = Policy(agent, envs.single_observation_space, envs.single_action_space)
    sampler = GradientSampler(envs, policy)
    weights = policy.get_weights()
    sampler.start(GradientRound(round=0, arrays=weights, horizon=10, gamma=1.0))
    assert sampler.step() is None  # one step into round 0's trajectories at mu = 0
    weights["actor_mean.bias"] = np.array([100.0], np.float32)
    sampler.start(GradientRound(round=1, arrays=weights, horizon=10, gamma=1.0))
    reports = [sampler.step() for _ in range(LENGTH)]
    # The trajectories of round 1 start at its start and use only its weights: LENGTH steps,
    # each paying mu = 100.
    assert reports[:-1] == [None] * (LENGTH - 1)
    last = reports[-1]
    assert last is not None and last.round == 1 and last.count == 2
    np.testing.assert_allclose(last.episode_return, [LENGTH * 100.0] * 2, atol=1e-2)


class LateNetwork:
    """A learner whose network delivers the previous round's messages again, late.

    Before the first message of each round after the first, the trainer gets the last real
    report of the previous round once more, and a progress message of that round claiming a
    huge count: a trainer that ignores round ids aggregates the report, or closes the round on
    the count.
    """

    def __init__(self, learner: aps.Learner) -> None:
        self._learner = learner
        self._last: tuple[int, GradientReport] | None = None
        self._late: list[tuple[int, GradientProgress | GradientReport]] = []
        self.replayed: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._learner, name)

    async def start_round(self, round_id: int, *args: Any, **kwargs: Any) -> int:
        late = self._last is not None and self._last[1].round == round_id - 1
        if late and len(self.replayed) < round_id:  # once per round, not on a resample
            assert self._last is not None
            worker, report = self._last
            self._late = [(worker, GradientProgress(round=report.round, count=10**6))]
            self._late.append((worker, report))
            self.replayed.append(report.count)
        return await self._learner.start_round(round_id, *args, **kwargs)

    async def next_report(self) -> tuple[int, GradientProgress | GradientReport]:
        if self._late:
            return self._late.pop(0)
        worker, message = await self._learner.next_report()
        if isinstance(message, GradientReport) and message.count:
            self._last = (worker, message)
        return worker, message


@pytest.mark.timeout(120)
async def test_messages_of_an_earlier_round_are_never_aggregated(workers: WorkerTasks) -> None:
    batch = 2 * ENVS
    async with aps.Learner(
        "memory://", num_workers=2, policy=AGENT, autoreset_mode="SameStep", timeouts=FAST
    ) as learner:
        for _ in range(2):
            workers.start(learner.url, env=Reveal, num_envs=ENVS, policy=AGENT)
        await learner.wait_for_workers()
        late = LateNetwork(learner)
        trainer = pg.NIGT(MeanAgent(), aggregator=pg.Rennala(batch=batch), lr=0.25, horizon=10)
        async with asyncio.timeout(60):  # a trainer fooled by the late count may never end
            stats = [s async for s in trainer.train(late, 3)]  # type: ignore[arg-type]
    assert len(late.replayed) == 2
    for replayed, round_stats in zip(late.replayed, stats[1:], strict=True):
        # The late report is discarded (nothing else is in this setting), and the late count
        # did not close the round early.
        assert round_stats.discarded == replayed
        assert round_stats.used >= batch and round_stats.aggregations == 1
