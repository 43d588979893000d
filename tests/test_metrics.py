"""The learner's figures (aps.metrics), each checked against a workload whose value is known.

Envs that sleep a known time per step give lower bounds on the env time, the lockstep wait
and the CPU-free share; deterministic envs give byte counts that compression must reproduce
at full size; a worker that lies about its timings is refused like any malformed answer.
Only lower bounds on time are asserted: a shared machine may always be slower.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import time
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

import aps
from aps.metrics import Metrics, WorkerMetrics
from aps.testing.chaos import until
from aps.wire import codec
from aps.wire.messages import TIMINGS_FORMAT, Message, StepResult
from tests.conftest import FAST, WorkerTasks
from tests.test_attacks_learner import start_altered

TCP = "tcp://127.0.0.1:0"
ENVS = 2
SLEEP = 0.01

pytestmark = pytest.mark.timeout(90)


class SleepyEnv(gym.Env[np.ndarray, np.int64]):
    """Sleeps :data:`SLEEP` seconds a step; observations of zeros (they compress well).

    Every instance adds the time its steps took, by its own clock, to :attr:`stepped`: what
    the workers' figures must account for.
    """

    SIZE = 4096
    stepped = 0.0

    def __init__(self) -> None:
        self.observation_space = spaces.Box(-1.0, 1.0, (self.SIZE,), np.float32)
        self.action_space = spaces.Discrete(2)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        return np.zeros(self.SIZE, np.float32), {}

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        started = time.perf_counter()
        time.sleep(SLEEP)
        SleepyEnv.stepped += time.perf_counter() - started
        return np.zeros(self.SIZE, np.float32), 1.0, False, False, {}


SLEEPY = "tests.test_metrics:SleepyEnv"


def test_a_window_is_the_difference_of_two_snapshots() -> None:
    first = WorkerMetrics(worker_id=0, env_steps=10, env_seconds=1.0, bytes_received=100)
    later = dataclasses.replace(first, env_steps=30, env_seconds=1.5, bytes_received=400, rtt=0.002)
    joined = WorkerMetrics(worker_id=1, env_steps=5)
    before = Metrics(version=1, workers=(first,), taken_at=10.0, uptime=3.0, cpu_seconds=2.0)
    now = Metrics(version=2, workers=(later, joined), taken_at=12.0, uptime=5.0, cpu_seconds=3.0)
    window = now.since(before)
    assert window.uptime == 2.0 and window.cpu_seconds == 1.0 and window.version == 2
    assert [w.env_steps for w in window.workers] == [20, 5]  # a newcomer counts from zero
    assert window.workers[0].env_seconds == pytest.approx(0.5)
    assert window.workers[0].rtt == 0.002  # a reading, not a counter
    assert window.rates() == {
        "env_steps": 12.5,
        "bytes_received": 150.0,
        "bytes_sent": 0.0,
        "cpu": 0.5,
    }
    flat = now.scalars()
    assert flat["worker/0/env_steps"] == 30 and flat["worker/1/env_steps"] == 5
    assert "worker/1/rtt" not in flat  # not measured: left out, never NaN
    assert flat["env_steps"] == 35 and flat["rates/env_steps"] == 7.0


async def test_lockstep_figures_match_the_workload(workers: WorkerTasks) -> None:
    steps = 20
    async with aps.Learner(TCP, num_workers=2, timeouts=FAST) as learner:
        for _ in range(2):
            workers.start(learner.url, env=SLEEPY, num_envs=ENVS)
        await learner.reset(seed=0)
        earlier = learner.metrics
        # The workers are tasks of this process, their envs of the class the env path names
        # (pytest may have imported this file under another name).
        sleepy = importlib.import_module(SLEEPY.split(":")[0]).SleepyEnv
        sleepy.stepped = 0.0
        actions = np.zeros(2 * ENVS, np.int64)
        for _ in range(steps):
            await learner.step(actions)
        metrics = learner.metrics
    assert metrics.lockstep_calls == steps + 1
    # No clock is compared with a constant: each figure with what brackets it. The workers'
    # env time holds their envs' steps; each call waits for every worker's envs.
    window = metrics.since(earlier)
    env_total = sum(w.env_seconds for w in window.workers)
    assert env_total >= sleepy.stepped > 0
    assert window.lockstep_wait_seconds >= env_total / len(window.workers)
    assert metrics.uptime >= metrics.lockstep_wait_seconds
    assert metrics.cpu_seconds > earlier.cpu_seconds  # the steps took the learner's CPU
    for worker in metrics.workers:
        assert worker.env_steps == steps * ENVS
        assert worker.answers == steps + 1
        assert worker.env_seconds > 0
        assert worker.encode_seconds > 0 and worker.decode_seconds > 0
        assert worker.inference_seconds == 0  # the learner chose the actions
        assert worker.bytes_received_raw == worker.bytes_received  # no compression
        # Each answer holds a whole observation batch: ENVS x SIZE float32s at least.
        assert worker.bytes_received >= (steps + 1) * ENVS * SleepyEnv.SIZE * 4
        assert worker.bytes_sent > 0
    # The learner waited for one of the two in every call; together they hold the wait.
    assert sum(w.slowest for w in metrics.workers) == steps + 1
    assert sum(w.wait_seconds for w in metrics.workers) <= metrics.lockstep_wait_seconds


async def run_compressed(workers: WorkerTasks, compression: str) -> WorkerMetrics:
    async with aps.Learner(TCP, num_workers=1, timeouts=FAST, compression=compression) as learner:
        workers.start(learner.url, env=SLEEPY, num_envs=ENVS, compression=compression)
        await learner.reset(seed=0)
        for _ in range(5):
            await learner.step(np.zeros(ENVS, np.int64))
        return learner.metrics.workers[0]


async def test_compressed_bytes_count_at_their_full_size(workers: WorkerTasks) -> None:
    pytest.importorskip("zstandard")
    plain = await run_compressed(workers, "none")
    packed = await run_compressed(workers, "zstd")
    # Zeros compress hundreds of times; at full size the frames are the plain run's (the
    # array headers of the two encodings differ by a few bytes a frame).
    assert packed.bytes_received * 20 < packed.bytes_received_raw
    assert packed.bytes_received_raw == pytest.approx(plain.bytes_received, rel=0.01)


async def test_detach_figures_split_env_and_policy_time(workers: WorkerTasks) -> None:
    pytest.importorskip("torch")
    from tests.agents import Agent
    from tests.test_detach import POLICY, Spaces

    steps = 8
    async with aps.Learner(TCP, num_workers=1, policy=POLICY, timeouts=FAST) as learner:
        workers.start(learner.url, env="CartPole-v1", num_envs=ENVS)
        await learner.reset(seed=0)
        await learner.publish(Agent(Spaces("CartPole-v1")))
        chunks = 0
        async for _ in learner.chunks(steps, max_in_flight=2):
            chunks += 1
            if chunks == 3:
                # The loop holds the stream: what the worker sends meanwhile waits in it.
                await until(lambda: learner.metrics.queue_depth >= 1)
                break
        metrics = learner.metrics
        worker = metrics.workers[0]
    assert worker.chunks >= 3 and worker.env_steps == worker.transitions
    assert worker.env_steps == worker.chunks * steps * ENVS
    assert worker.inference_seconds > 0 and worker.env_seconds > 0
    assert worker.answers >= worker.chunks  # the reset's answer too
    assert metrics.chunk_wait_seconds > 0  # the stream waited for its first chunks


async def test_the_round_trip_is_measured_while_a_stream_waits(workers: WorkerTasks) -> None:
    pytest.importorskip("torch")
    from tests.agents import Agent
    from tests.test_detach import POLICY, Spaces

    async with aps.Learner(TCP, num_workers=1, policy=POLICY, timeouts=FAST) as learner:
        workers.start(learner.url, env="CartPole-v1", num_envs=ENVS)
        await learner.reset(seed=0)
        await learner.publish(Agent(Spaces("CartPole-v1")))
        async for _ in learner.chunks(4, max_in_flight=1):
            # The stream reads while the loop holds it; FAST heartbeats every 0.2 s of quiet
            # carry a ping, which the worker's loop answers while its thread acts.
            await until(lambda: learner.metrics.workers[0].rtt is not None)
            break
        rtt = learner.metrics.workers[0].rtt
    assert rtt is not None and rtt > 0


def lying(timings: Any) -> Any:
    def alter(message: Message) -> bytes:
        assert isinstance(message, StepResult)
        return codec.encode(dataclasses.replace(message, timings=timings))

    return alter


@pytest.mark.parametrize(
    "timings",
    [
        TIMINGS_FORMAT.pack(float("nan"), 0.0, 0.0),
        TIMINGS_FORMAT.pack(0.0, float("inf"), 0.0),
        TIMINGS_FORMAT.pack(0.0, 0.0, -1.0),
        TIMINGS_FORMAT.pack(1e9, 0.0, 0.0),
        bytes(11),
        bytes(13),
    ],
)
async def test_a_worker_that_reports_impossible_timings_is_lost(
    workers: WorkerTasks, timings: Any
) -> None:
    async with aps.Learner(TCP, num_workers=2, timeouts=FAST, on_worker_lost="raise") as learner:
        workers.start(learner.url, num_envs=ENVS)
        await until(lambda: len(learner.workers) == 1)
        bad, task = start_altered(workers, learner.url, (StepResult,), lying(timings))
        await learner.reset(seed=0)
        with pytest.raises(aps.ProtocolError, match=f"^worker {bad.worker_id} sent timings "):
            await learner.step(np.zeros(2 * ENVS, np.int64))
        await asyncio.wait_for(task, 20)
        liar = next(w for w in learner.metrics.workers if w.worker_id == bad.worker_id)
        assert liar.env_steps == 0 and liar.answers == 1  # its reset counted, not its step


def test_the_blocking_env_and_the_sb3_adapter_show_the_same_figures() -> None:
    pytest.importorskip("stable_baselines3")
    from aps.integrations.sb3 import ClusterVecEnv

    vec_env = ClusterVecEnv.local(
        "CartPole-v1", num_workers=2, envs_per_worker=ENVS, transport="memory"
    )
    try:
        vec_env.reset()
        for _ in range(5):
            vec_env.step(np.zeros(2 * ENVS, np.int64))
        metrics = vec_env.metrics
        assert metrics.lockstep_calls >= 6  # the reset, five steps, and SB3's env calls
        assert [w.env_steps for w in metrics.workers] == [5 * ENVS, 5 * ENVS]
        assert vec_env.envs.metrics.env_steps == metrics.env_steps == 10 * ENVS
    finally:
        vec_env.close()
