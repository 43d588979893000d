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

Three more are made by wrong variants that a parametrized test runs and must catch: a
simulator that ignores ``kappa_i`` and a round that ends at the first report
(``test_a_round_waits_for_its_batch_and_pays_kappa``; the networked trainer's round too:
``test_a_server_round_waits_for_its_batch``, where the wrong one takes 128 of 1,024), an
all-reduce that sums instead of averaging (``test_an_allreduce_round_averages``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

pytest.importorskip("torch")

import aps
from aps import pg
from aps.learner.simulate import simulate
from aps.pg.aggregate import RennalaRound
from aps.policy import Policy
from aps.wire.messages import GradientProgress, GradientReport, GradientRound
from aps.worker.sampling import GradientSampler
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


# -- Three more mistakes, each made by a wrong variant that the check must catch ------------


class SummingRound(RennalaRound):
    """Wrong: the all-reduced vector taken as the round's gradient, a sum, not the mean."""

    def _estimate_reduced(self, reduced: Any) -> Any:
        return np.array(reduced, dtype=np.float64)


class FirstReportRound(RennalaRound):
    """Wrong: the round ends at the first gradient anyone reports."""

    def _holds(self, counts: dict[int, int]) -> bool:
        return sum(counts.values()) >= 1


@dataclass(frozen=True)
class FirstReport:
    """An aggregation rule that makes :class:`FirstReportRound` rounds."""

    batch: int
    survives_worker_loss: ClassVar[bool] = True

    def start(self, round_id: int, workers: Any, *, size: int | None = None) -> RennalaRound:
        return FirstReportRound(round_id, workers, batch=self.batch, size=size)


def ignores_kappa(*args: Any, **kwargs: Any) -> Any:
    """Wrong: the simulator with every communication time dropped."""
    return simulate(*args, **{**kwargs, "kappa": 0.0})


H, KAPPA, BATCH = [1.0, 2.0, 3.0], [5.0, 7.0, 11.0], 4
# With h = (1, 2, 3), the 4th gradient is ready at time 3 (worker 0 has 3, workers 1 and 2
# one each): every round takes 3 to compute, then max kappa = 11 over its three senders.
READY_AT = 3.0


def charges_compute_and_communication(sim: Any, rule: Any) -> None:
    """Every round lasts until the rule's batch is ready plus max kappa_i over its senders."""
    rounds = list(
        sim(MeanAgent(), lambda: Reveal(LENGTH), h=H, kappa=KAPPA, aggregator=rule, lr=0.1,
            horizon=10, gamma=1.0, iterations=3, seed=0)
    )  # fmt: skip
    previous = 0.0
    for r in rounds:
        senders = [worker for worker, count in r.contributions.items() if count > 0]
        assert r.used >= BATCH and r.compute == READY_AT
        assert r.communication == max(KAPPA[worker] for worker in senders)
        assert r.time == pytest.approx(previous + r.compute + r.communication)
        previous = r.time


@pytest.mark.parametrize(
    ("sim", "rule", "wrong"),
    [
        (simulate, pg.Rennala(batch=BATCH), False),
        (ignores_kappa, pg.Rennala(batch=BATCH), True),
        (simulate, FirstReport(batch=BATCH), True),
    ],
    ids=["right", "simulator-ignores-kappa", "round-ends-at-first-report"],
)
def test_a_round_waits_for_its_batch_and_pays_kappa(sim: Any, rule: Any, wrong: bool) -> None:
    if wrong:
        with pytest.raises(AssertionError):
            charges_compute_and_communication(sim, rule)
    else:
        charges_compute_and_communication(sim, rule)


def averages_the_allreduce(make_round: Any) -> None:
    """An all-reduced round's gradient is the pooled mean: the reduced sum over the count."""
    rng = np.random.default_rng(1)
    sums = [rng.normal(size=5), rng.normal(size=5)]
    round_ = make_round()
    assert round_.add_reduced(4, sums[0] + sums[1], {0: 3, 1: 2}) and round_.done
    np.testing.assert_allclose(round_.result(), (sums[0] + sums[1]) / 5, rtol=1e-12)


@pytest.mark.parametrize(
    ("make_round", "wrong"),
    [
        (lambda: pg.Rennala(batch=5).start(4, [0, 1], size=5), False),
        (lambda: SummingRound(4, [0, 1], batch=5, size=5), True),
    ],
    ids=["right", "allreduce-sums"],
)
def test_an_allreduce_round_averages(make_round: Any, wrong: bool) -> None:
    if wrong:
        with pytest.raises(AssertionError):
            averages_the_allreduce(make_round)
    else:
        averages_the_allreduce(make_round)


async def rounds_hold_their_batch(workers: WorkerTasks, rule: Any, batch: int) -> None:
    """The networked trainer: every round aggregates at least the rule's batch."""
    async with aps.Learner(
        "memory://", num_workers=2, policy=AGENT, autoreset_mode="SameStep", timeouts=FAST
    ) as learner:
        for _ in range(2):
            workers.start(learner.url, env=Reveal, num_envs=ENVS, policy=AGENT)
        await learner.wait_for_workers()
        trainer = pg.NIGT(MeanAgent(), aggregator=rule, lr=0.25, horizon=10)
        async with asyncio.timeout(60):
            stats = [s async for s in trainer.train(learner, 3)]
    assert len(stats) == 3
    assert all(s.used >= batch for s in stats), [s.used for s in stats]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("wrong", [False, True], ids=["right", "server-round-ends-at-first-report"])
async def test_a_server_round_waits_for_its_batch(workers: WorkerTasks, wrong: bool) -> None:
    # 16 envs' worth of trajectories per worker: far more than any one report holds.
    batch = 16 * ENVS
    rule = FirstReport(batch=batch) if wrong else pg.Rennala(batch=batch)
    if wrong:
        with pytest.raises(AssertionError):
            await rounds_hold_their_batch(workers, rule, batch)
    else:
        await rounds_hold_their_batch(workers, rule, batch)
