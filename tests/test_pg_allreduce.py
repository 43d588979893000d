"""NIGT's all-reduce aggregation: one gloo all-reduce over the sums instead of server reports."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)

import aps  # noqa: E402
from aps import pg  # noqa: E402
from aps.gradients import ring_allreduce_bytes  # noqa: E402
from tests.agents import ContinuousAgent  # noqa: E402
from tests.conftest import FAST, WorkerTasks  # noqa: E402
from tests.test_detach import Spaces  # noqa: E402

POLICY = f"{Path(__file__).with_name('agents.py')}:ContinuousAgent"


@pytest.mark.parametrize("rule", [pg.Rennala(batch=5), pg.Malenia(batch=4), pg.Synchronous()])
def test_a_reduced_round_gives_the_same_gradient_as_the_sums(rule: pg.AggregationRule) -> None:
    rng = np.random.default_rng(0)
    sums = {0: rng.normal(size=6), 1: rng.normal(size=6), 2: rng.normal(size=6)}
    counts = {0: 3, 1: 1, 2: 2}
    by_sums = rule.start(7, [0, 1, 2], size=6)
    by_sums.begin_collection()
    for worker, s in sums.items():
        by_sums.add(worker, 7, s, counts[worker])
    by_sums.end_collection()
    reduced = rule.start(7, [0, 1, 2], size=6)
    share = {w: s / counts[w] if reduced.reduces_means else s for w, s in sums.items()}
    reduced.begin_collection()
    assert reduced.add_reduced(7, sum(share.values()), counts)
    reduced.end_collection()
    assert by_sums.done and reduced.done
    np.testing.assert_allclose(reduced.result(), by_sums.result(), rtol=1e-12)
    assert reduced.contributions == by_sums.contributions and reduced.used == 6
    assert not reduced.add_reduced(7, np.ones(6), {0: 1})  # closed: discarded
    assert reduced.discarded == 1


def test_a_round_is_reduced_once() -> None:
    round_ = pg.Rennala(batch=100).start(1, [0], size=2)
    assert round_.add_reduced(1, np.ones(2), {0: 1}) and not round_.done
    with pytest.raises(aps.InvalidState, match="once per round"):
        round_.add_reduced(1, np.ones(2), {0: 1})


def test_a_reduced_round_refuses_bad_input() -> None:
    round_ = pg.Rennala(batch=2).start(1, [0, 1], size=3)
    with pytest.raises(aps.ConfigError, match="worker 5"):
        round_.add_reduced(1, np.ones(3), {5: 1})
    with pytest.raises(aps.ConfigError, match="int >= 0"):
        round_.add_reduced(1, np.ones(3), {0: -1})
    with pytest.raises(aps.ConfigError, match=r"shape \(4,\)"):
        round_.add_reduced(1, np.ones(4), {0: 1})
    assert not round_.add_reduced(0, np.ones(3), {0: 2})  # stale: discarded
    assert round_.stale == 2 and not round_.done


def test_the_option_is_checked() -> None:
    agent = ContinuousAgent(Spaces("Pendulum-v1"))
    with pytest.raises(aps.ConfigError, match="'server' or 'allreduce', got 'ring'"):
        pg.NIGT(agent, aggregation="ring")  # type: ignore[arg-type]
    with pytest.raises(aps.ConfigError, match="on_worker_lost='raise'"):
        pg.NIGT(agent, aggregation="allreduce", on_worker_lost="drop")


def test_ring_bytes() -> None:
    assert ring_allreduce_bytes(400, 1) == 0
    assert ring_allreduce_bytes(400, 2) == 400
    assert ring_allreduce_bytes(400, 4) == 600


# More workers in one process than the event loop's default thread pool has threads: each
# worker's part of the all-reduce blocks a thread until every rank has joined.
CROWD = min(32, (os.cpu_count() or 1) + 4) + 1


@pytest.mark.parametrize("count", [2, CROWD])
async def test_reduce_gradients_sums_what_the_workers_counted(
    workers: WorkerTasks, count: int
) -> None:
    """Learner-level: the counts in the reduced vector are the ones the workers answer."""
    async with aps.Learner(
        "tcp://127.0.0.1:0",
        num_workers=count,
        policy=POLICY,
        autoreset_mode="SameStep",
        timeouts=FAST,
        token="t" * 32,
    ) as learner:
        for _ in range(count):
            workers.start(learner.url, env="Pendulum-v1", num_envs=2, token="t" * 32)
        await learner.wait_for_workers()
        agent = ContinuousAgent(Spaces("Pendulum-v1"))
        weights = {k: v.detach().numpy() for k, v in agent.state_dict().items()}
        size = sum(v.size for v in weights.values())
        await learner.start_round(0, weights, horizon=5, gamma=0.9)
        seen: set[int] = set()
        while len(seen) < count:
            worker_id, message = await learner.next_report()
            if isinstance(message, aps.wire.messages.GradientProgress) and message.count:
                seen.add(worker_id)
        reduced, sent = await learner.reduce_gradients(0, size=size)
        assert reduced.shape == (size + count,) and sent > 0
        answered: dict[int, int] = {}
        while len(answered) < count:
            worker_id, message = await learner.next_report()
            if isinstance(message, aps.wire.messages.GradientsReduced):
                assert message.round == 0 and len(message.episode_return) == message.count
                answered[worker_id] = message.count
        ids = [w.worker_id for w in learner.gradient_workers]
        assert [int(c) for c in reduced[size:]] == [answered[i] for i in ids]
        assert all(answered.values()) and np.isfinite(reduced).all()
        assert np.abs(reduced[:size]).sum() > 0
        with pytest.raises(aps.ConfigError, match="round 3"):
            await learner.reduce_gradients(3, size=size)
        await learner.stop_gradients()


@pytest.mark.parametrize("rule", [pg.Rennala(batch=4), pg.Malenia(batch=4)])
def test_allreduce_and_server_training_over_worker_processes(rule: pg.AggregationRule) -> None:
    """Real worker processes over TCP: both aggregations train; bytes per round reported."""
    envs = aps.ClusterEnv.local(
        "Pendulum-v1",
        num_workers=2,
        envs_per_worker=2,
        policy=POLICY,
        autoreset_mode="SameStep",
        transport="tcp",
    )
    try:
        figures = {}
        for aggregation in ("server", "allreduce"):
            agent = ContinuousAgent(envs)
            size = sum(p.numel() for p in agent.parameters())
            before = torch.cat([p.detach().ravel() for p in agent.parameters()]).clone()
            trainer = pg.NIGT(
                agent, aggregator=rule, lr=0.01, momentum=1.0, horizon=10, aggregation=aggregation
            )
            stats = trainer.run(envs, 2)
            after = torch.cat([p.detach().ravel() for p in agent.parameters()])
            assert len(stats) == 2
            for s in stats:
                assert s.aggregation == aggregation and s.aggregations == 1
                assert s.used >= 2 and sum(s.contributions.values()) == s.used
                assert np.isfinite(s.mean_return) and s.aggregation_bytes > 0
            # Two steps of exactly lr each (momentum 1: normalized gradient steps).
            assert float((after - before).norm()) <= 0.02 + 1e-5
            figures[aggregation] = stats
        # All-reduce: the ring payload of (size + 2 counts) float32 over 3 ranks, computed.
        vector = 4 * (size + 2)
        assert all(
            s.aggregation_bytes == 3 * ring_allreduce_bytes(vector, 3) for s in figures["allreduce"]
        )
        # Server: the encoded sums (only the parameters that got a gradient: this agent's
        # critic gets none), part of what the learner received.
        for s in figures["server"]:
            assert 0 < s.aggregation_bytes < s.bytes_received
    finally:
        envs.close()


async def test_a_worker_that_cannot_take_part_fails_the_all_reduce_clearly(
    workers: WorkerTasks,
) -> None:
    """A worker whose part fails (here: a layout of the wrong size) reports why, and the
    learner's all-reduce ends with a Timeout naming the fix instead of hanging."""
    timeouts = aps.Timeouts(
        connect=10.0, handshake=2.0, step=2.0, heartbeat_interval=0.2, heartbeat_timeout=10.0
    )
    async with aps.Learner(
        "tcp://127.0.0.1:0",
        num_workers=1,
        policy=POLICY,
        autoreset_mode="SameStep",
        timeouts=timeouts,
        token="t" * 32,
    ) as learner:
        workers.start(learner.url, env="Pendulum-v1", token="t" * 32)
        await learner.wait_for_workers()
        agent = ContinuousAgent(Spaces("Pendulum-v1"))
        weights = {k: v.detach().numpy() for k, v in agent.state_dict().items()}
        await learner.start_round(0, weights, horizon=5, gamma=0.9)
        while True:
            _, message = await learner.next_report()
            if isinstance(message, aps.wire.messages.GradientProgress) and message.count:
                break
        with pytest.raises(aps.Timeout, match="aggregation='server'"):
            await learner.reduce_gradients(0, size=3)
        with pytest.raises(aps.WorkerError, match="learner's layout 3"):
            while True:
                await learner.next_report()
        await learner.stop_gradients()


def test_a_workers_part_is_its_report_flattened_in_the_learners_layout() -> None:
    """What a worker puts into the all-reduce equals what the server path aggregates from its
    report (the learner's layout, zeros for parameters without a gradient), plus its count."""
    from aps.wire.messages import GradientReport, ReduceGradients
    from aps.worker.rounds import RoundSum

    rng = np.random.default_rng(1)
    point = {
        "b": np.zeros((2, 3), np.float32),
        "critic": np.zeros(4, np.float32),
        "a": np.zeros(5, np.float32),
    }
    layout = pg.flatten(point)[1]
    summed = RoundSum(3)
    for count in (2, 1):
        gradient = {n: rng.normal(size=point[n].shape).astype(np.float32) for n in ("a", "b")}
        summed.add(
            GradientReport(round=3, gradient=gradient, count=count, episode_return=np.ones(count))
        )
    report = summed.report()
    expected = layout.flatten(report.gradient, fill_missing=True)
    for mean in (False, True):
        request = ReduceGradients(
            round=3,
            host="",
            port=1,
            prefix="p",
            rank=2,
            world_size=3,
            size=15,
            mean=mean,
            timeout=1.0,
        )
        part = summed.vector(point, request)
        assert part.dtype == np.float32 and part.shape == (17,)
        np.testing.assert_allclose(part[:15], expected / (3 if mean else 1), rtol=1e-6)
        assert part[15:].tolist() == [0.0, 3.0]
    with pytest.raises(ValueError, match="learner's layout 9"):
        summed.vector(point, dataclasses.replace(request, size=9))
