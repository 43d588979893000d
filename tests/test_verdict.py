"""The verdict on what bounds a run: constructed windows with exact lines, then real runs.

The constructed windows hold round figures, so each line is known to the character and each
threshold is tested on both sides. The real runs put a learner and two worker processes over
TCP on 127.0.0.1 in a shape whose bound is not in doubt (envs that sleep, one worker that sleeps
four times longer, a learner that sleeps between steps, a throttled link) and check the verdict
names it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

import aps
from aps.metrics import Metrics, Verdict, WorkerMetrics, verdict
from aps.metrics.verdict import (
    BUSY_SHARE,
    ENV_SHARE,
    LEARNER_CPU,
    MIN_WINDOW,
    STRAGGLER_RATIO,
    WAIT_SHARE,
)
from aps.testing import Relay

MS = 1e-3


def worker(worker_id: int, **figures: Any) -> WorkerMetrics:
    return WorkerMetrics(worker_id=worker_id, **figures)


def answering(
    worker_id: int, *, answers: int, env: float, slowest: int, envs: int = 4, **figures: Any
) -> WorkerMetrics:
    """A lockstep worker: ``answers`` answers of ``env`` seconds in its ``envs`` envs."""
    return worker(
        worker_id,
        answers=answers,
        env_steps=answers * envs,
        env_seconds=answers * env,
        slowest=slowest,
        **figures,
    )


def lockstep(
    *workers: WorkerMetrics,
    uptime: float = 2.0,
    calls: int = 1000,
    wait: float = 1.8,
    cpu: float = 0.4,
) -> Metrics:
    return Metrics(
        version=0,
        workers=workers,
        uptime=uptime,
        lockstep_calls=calls,
        lockstep_wait_seconds=wait,
        cpu_seconds=cpu,
    )


def acting(
    worker_id: int,
    *,
    env: float,
    inference: float = 0.0,
    encode: float = 0.0,
    chunks: int = 10,
    steps: int = 4000,
    **figures: Any,
) -> WorkerMetrics:
    """A DETACH worker that sent ``chunks`` chunks of ``steps`` env-steps in all."""
    return worker(
        worker_id,
        answers=chunks,
        chunks=chunks,
        transitions=steps,
        env_steps=steps,
        env_seconds=env,
        inference_seconds=inference,
        encode_seconds=encode,
        **figures,
    )


def detach(
    *workers: WorkerMetrics, uptime: float = 2.0, cpu: float = 0.2, queue: int = 0
) -> Metrics:
    return Metrics(version=3, workers=workers, uptime=uptime, cpu_seconds=cpu, queue_depth=queue)


# Lockstep.


def test_envs_that_take_most_of_each_call_bind_a_lockstep_run() -> None:
    window = lockstep(
        answering(0, answers=1000, env=1.6 * MS, slowest=500),
        answering(1, answers=1000, env=1.6 * MS, slowest=500),
    )
    result = verdict(window)
    assert result == Verdict(bound="env", line=result.line, shares=result.shares)
    assert result.worker is None
    assert result.line == (
        "env-bound: the learner waits for workers 90% of its time, and envs take 89% of each "
        "call's wait (1.60 ms of 1.80 ms; 0.40 ms an env-step); the wire and encoding the "
        "other 11%"
    )
    env = 1.6 / 1.8
    assert result.shares == pytest.approx(
        {"learner": 0.1, "workers": 0.9, "env": 0.9 * env, "wire": 0.9 * (1 - env)}
    )
    assert str(result) == result.line


def test_how_a_calls_wait_is_shared_out_among_its_workers_changes_nothing() -> None:
    # From each request to its answer, or each answer after the ones before it: the call's
    # wait is the learner's own clock, and only the workers' env times are read.
    def window(first: float, second: float) -> Metrics:
        return lockstep(
            answering(0, answers=1000, env=1.6 * MS, slowest=500, wait_seconds=first),
            answering(1, answers=1000, env=1.6 * MS, slowest=500, wait_seconds=second),
        )

    assert verdict(window(1.8, 1.8)) == verdict(window(1.8, 0.01)) == verdict(window(0, 0))


def test_the_rest_of_each_call_binds_a_lockstep_run_to_the_wire() -> None:
    window = lockstep(
        answering(
            0,
            answers=190,
            env=0.5 * MS,
            slowest=114,
            encode_seconds=190 * 0.2 * MS,
            decode_seconds=190 * 0.1 * MS,
            bytes_received=12_000_000,
            bytes_received_raw=24_000_000,
            bytes_sent=1_000_000,
            rtt=9 * MS,
        ),
        answering(
            1,
            answers=190,
            env=0.5 * MS,
            slowest=76,
            encode_seconds=190 * 0.2 * MS,
            decode_seconds=190 * 0.1 * MS,
            bytes_received=8_000_000,
            bytes_received_raw=16_000_000,
            bytes_sent=1_000_000,
            rtt=11 * MS,
        ),
        calls=190,
        wait=1.9,
    )
    result = verdict(window)
    assert (result.bound, result.worker) == ("wire", None)
    assert result.line == (
        "wire-bound: the learner waits for workers 95% of its time, and envs take only 5% of "
        "each call's wait (0.50 ms of 10.0 ms); the rest is the wire both ways and encoding "
        "(encoding 0.20 ms, decoding 0.10 ms an answer); 10.0 MB/s in (2.0x compressed), "
        "1.0 MB/s out; round trip 10.0 ms; worker 0 answered last in 60% of the calls"
    )
    assert result.shares == pytest.approx(
        {"learner": 0.05, "workers": 0.95, "env": 0.95 * 0.05, "wire": 0.95 * 0.95}
    )


def test_a_wire_line_leaves_out_what_it_did_not_see() -> None:
    # No compression, no round trip measured, no worker last in most calls (a lone one).
    window = lockstep(answering(0, answers=1000, env=0.5 * MS, slowest=1000, bytes_received=3_000))
    assert verdict(window).line.endswith("; 1.5 kB/s in, 0 B/s out")


def test_the_answers_a_lockstep_run_waited_for_decide_not_the_average_answer() -> None:
    # Worker 0 answers last in 90% of the calls and its envs are quick; worker 1's are slow,
    # but it is rarely the one waited for. Averaged evenly the envs would take half a call.
    window = lockstep(
        answering(0, answers=180, env=1 * MS, slowest=162),
        answering(1, answers=180, env=9 * MS, slowest=18),
        calls=180,
    )
    result = verdict(window)
    assert (result.bound, result.worker) == ("wire", None)
    assert "envs take only 18% of each call's wait (1.80 ms of 10.0 ms)" in result.line
    assert result.line.endswith("; worker 0 answered last in 90% of the calls")


def test_envs_at_exactly_half_of_a_call_still_bind_the_run() -> None:
    assert ENV_SHARE == 0.5
    half = lockstep(answering(0, answers=180, env=5 * MS, slowest=180), calls=180)
    assert verdict(half).bound == "env"
    under = lockstep(answering(0, answers=180, env=4.99 * MS, slowest=180), calls=180)
    assert verdict(under).bound == "wire"


def test_a_learner_that_waits_under_half_its_time_is_the_bound() -> None:
    window = lockstep(
        answering(0, answers=200, env=1 * MS, slowest=100),
        answering(1, answers=200, env=1 * MS, slowest=100),
        calls=200,
        wait=0.4,
        cpu=1.9,
    )
    result = verdict(window)
    assert (result.bound, result.worker) == ("learner", None)
    assert result.line == (
        "learner-bound: the learner waits for workers only 20% of its time (2.00 ms a call, "
        "200 calls); its own loop between calls takes 80% (its process uses 95% of a core)"
    )
    assert result.shares == pytest.approx({"learner": 0.8, "workers": 0.2, "env": 0.1, "wire": 0.1})


def test_a_learner_is_named_from_its_own_figures_without_the_workers_timings() -> None:
    window = lockstep(worker(0), worker(1), calls=50, wait=0.2, cpu=3.6)
    result = verdict(window)
    assert result.bound == "learner"
    assert "only 10% of its time (4.00 ms a call, 50 calls)" in result.line
    assert result.line.endswith("(its process uses 1.8 cores)")
    assert result.shares == pytest.approx({"learner": 0.9, "workers": 0.1, "env": 0, "wire": 0})


def test_waits_of_exactly_half_the_window_leave_the_learner_out() -> None:
    assert WAIT_SHARE == 0.5
    slow_envs = answering(0, answers=1000, env=0.9 * MS, slowest=1000)
    assert verdict(lockstep(slow_envs, wait=1.0)).bound == "env"
    assert verdict(lockstep(slow_envs, wait=0.998)).bound == "learner"


def test_one_worker_whose_slow_envs_the_calls_wait_for_is_a_straggler() -> None:
    window = lockstep(
        answering(0, answers=200, env=2 * MS, slowest=5),
        answering(1, answers=200, env=2.2 * MS, slowest=5),
        answering(7, answers=200, env=8 * MS, slowest=190),
        answering(3, answers=200, env=1.9 * MS, slowest=0),
        calls=200,
    )
    result = verdict(window)
    assert (result.bound, result.worker) == ("straggler", 7)
    assert result.line == (
        "straggler: worker 7 answered last in 95% of the calls; its envs take 8.00 ms an "
        "answer, the other workers' 2.00 ms (median); the learner waits for workers 90% of "
        "its time (9.00 ms a call)"
    )
    assert result.shares["workers"] == pytest.approx(0.9)


@pytest.mark.parametrize(
    ("slowest", "ratio", "bound"),
    [
        (181, STRAGGLER_RATIO, "straggler"),  # every threshold just met
        (180, STRAGGLER_RATIO, "env"),  # last in half the calls: not most of them
        (181, STRAGGLER_RATIO - 0.01, "env"),  # its envs not slow enough against the others
    ],
)
def test_a_straggler_needs_most_calls_and_envs_well_slower_than_the_others(
    slowest: int, ratio: float, bound: str
) -> None:
    window = lockstep(
        answering(0, answers=360, env=2 * MS * ratio, slowest=slowest),
        answering(1, answers=360, env=2 * MS, slowest=360 - slowest),
        calls=360,
        wait=1.44,  # 4 ms a call: the straggler's envs take 3 of them
    )
    assert verdict(window).bound == bound


def test_a_worker_the_calls_wait_for_on_its_link_is_named_in_a_wire_verdict() -> None:
    # Its envs are three times the other's, but they take a tenth of the calls' wait.
    window = lockstep(
        answering(0, answers=180, env=3 * MS, slowest=171),
        answering(1, answers=180, env=1 * MS, slowest=9),
        calls=180,
    )
    result = verdict(window)
    assert (result.bound, result.worker) == ("wire", None)
    assert result.line.endswith("; worker 0 answered last in 95% of the calls")


def test_a_lone_worker_is_never_a_straggler() -> None:
    window = lockstep(answering(4, answers=180, env=9 * MS, slowest=180), calls=180)
    result = verdict(window)
    assert (result.bound, result.worker) == ("env", None)


def test_a_worker_that_joined_without_answers_is_left_out_of_the_lockstep_figures() -> None:
    window = lockstep(answering(0, answers=1000, env=1.6 * MS, slowest=1000), worker(1))
    assert "(1.60 ms of 1.80 ms; 0.40 ms an env-step)" in verdict(window).line


# DETACH.


def test_envs_that_keep_acting_workers_busy_bind_a_detach_run() -> None:
    window = detach(
        acting(0, env=1.6, inference=0.2, encode=0.04),
        acting(1, env=1.6, inference=0.2, encode=0.04),
    )
    result = verdict(window)
    assert (result.bound, result.worker) == ("env", None)
    assert result.line == (
        "env-bound: workers are busy 92% of the time: envs 80% (0.40 ms an env-step), "
        "inference 10%, encoding 2%"
    )
    assert result.shares == pytest.approx(
        {"env": 0.8, "inference": 0.1, "encode": 0.02, "idle": 0.08}
    )


def test_forward_passes_that_keep_acting_workers_busy_bind_it_to_inference() -> None:
    window = detach(acting(0, env=0.3, inference=1.4, encode=0.1, steps=2000))
    result = verdict(window)
    assert result.bound == "inference"
    assert result.line == (
        "inference-bound: workers are busy 90% of the time: inference 70% (0.70 ms an "
        "env-step), envs 15%, encoding 5%"
    )


def test_workers_busy_encoding_their_chunks_bind_it_to_the_wire() -> None:
    window = detach(acting(0, env=0.2, inference=0.2, encode=1.2, steps=400))
    result = verdict(window)
    assert result.bound == "wire"
    assert result.line == (
        "wire-bound: workers are busy 80% of the time: encoding 60% (3.00 ms an env-step), "
        "envs 10%, inference 10%"
    )


def test_idle_workers_with_chunks_waiting_are_held_back_by_the_learner() -> None:
    window = detach(acting(0, env=0.3, inference=0.1), acting(1, env=0.3, inference=0.1), queue=6)
    result = verdict(window)
    assert result.bound == "learner"
    assert result.line == (
        "learner-bound: workers are busy only 20% of the time and 6 chunks wait for the "
        "training loop; the learner's process uses 10% of a core"
    )
    assert result.shares["idle"] == pytest.approx(0.8)
    one = verdict(dataclasses.replace(window, queue_depth=1))
    assert "and 1 chunk waits for the training loop" in one.line


def test_idle_workers_and_a_learner_that_rarely_waits_in_rollout_name_the_learner() -> None:
    # rollout() asks both workers and waits for both chunks: 10 calls, 20 chunks, waits of
    # 0.4 s in a 2 s window; the learner trains the other 1.6 s while the workers idle.
    window = dataclasses.replace(
        detach(acting(0, env=0.2), acting(1, env=0.2), cpu=0.9),
        lockstep_calls=10,
        lockstep_wait_seconds=0.4,
    )
    result = verdict(window)
    assert result.bound == "learner"
    assert result.line == (
        "learner-bound: workers are busy only 10% of the time, and the learner waits for "
        "their chunks only 20% of its time (10 rollouts); its own loop between them takes "
        "80% (its process uses 45% of a core)"
    )
    assert result.shares["wait"] == pytest.approx(0.2)
    # Waiting most of the window: not the learner's loop.
    waited = dataclasses.replace(window, lockstep_wait_seconds=1.2)
    assert verdict(waited).bound == "wire"
    # A chunk stream with a reset in the window: its chunks came without calls, and what it
    # waited is the stream's own figure.
    stream = dataclasses.replace(window, lockstep_calls=1)
    assert verdict(stream).bound == "wire"
    held = dataclasses.replace(stream, chunk_wait_seconds=0.3)
    result = verdict(held)
    assert result.bound == "learner"
    assert result.line == (
        "learner-bound: workers are busy only 10% of the time, and the learner waits for "
        "their chunks only 15% of its time (a chunk stream); its own loop between them takes "
        "85% (its process uses 45% of a core)"
    )
    assert verdict(dataclasses.replace(stream, chunk_wait_seconds=1.2)).bound == "wire"


def test_idle_workers_and_a_busy_learner_process_name_the_learner() -> None:
    window = detach(acting(0, env=0.4, decode_seconds=0.2), cpu=1.8)
    result = verdict(window)
    assert result.bound == "learner"
    assert result.line == (
        "learner-bound: workers are busy only 20% of the time and no chunk waits for the "
        "training loop, but the learner's process uses 90% of a core (decoding 10% of the "
        "time, the rest receiving and training)"
    )


def test_idle_workers_and_an_idle_learner_name_the_wire() -> None:
    window = detach(
        acting(0, env=0.4, bytes_received=6_000_000, bytes_sent=40_000, rtt=40 * MS),
        acting(1, env=0.4, bytes_received=4_000_000, bytes_sent=40_000, rtt=60 * MS),
    )
    result = verdict(window)
    assert result.bound == "wire"
    assert result.line == (
        "wire-bound: workers are busy only 20% of the time, no chunk waits for the training "
        "loop and the learner's process uses 10% of a core: requests and chunks spend the "
        "time in transit (5.0 MB/s in, 40.0 kB/s out; round trip 50.0 ms)"
    )


def test_the_detach_thresholds_on_both_sides() -> None:
    assert (BUSY_SHARE, LEARNER_CPU) == (0.5, 0.8)
    assert verdict(detach(acting(0, env=1.0))).bound == "env"
    assert verdict(detach(acting(0, env=0.998))).bound == "wire"
    assert verdict(detach(acting(0, env=0.4), cpu=1.6)).bound == "learner"
    assert verdict(detach(acting(0, env=0.4), cpu=1.59)).bound == "wire"


def test_a_detach_mean_leaves_out_workers_that_sent_no_chunk() -> None:
    window = detach(acting(0, env=1.6, inference=0.2, encode=0.04), worker(1))
    assert verdict(window).shares["env"] == pytest.approx(0.8)


def test_a_window_of_chunks_and_a_reset_is_a_detach_window() -> None:
    window = dataclasses.replace(detach(acting(0, env=1.6), acting(1, env=1.6)), lockstep_calls=1)
    assert verdict(window).line.startswith("env-bound: workers are busy 80% of the time")


# Too little data.


def test_a_short_window_is_unknown_and_says_how_long_it_was() -> None:
    short = lockstep(answering(0, answers=100, env=1 * MS, slowest=100), uptime=0.4)
    result = verdict(short)
    assert result == Verdict(
        bound="unknown",
        line="unknown: the window is 0.40 s long; a verdict needs at least 0.5 s (take the "
        "two snapshots further apart)",
    )
    assert result.shares == {}
    enough = dataclasses.replace(
        short, uptime=MIN_WINDOW, lockstep_wait_seconds=0.45, lockstep_calls=400
    )
    assert verdict(enough).bound == "env"


def test_a_window_where_the_workers_were_asked_nothing_is_unknown() -> None:
    result = verdict(Metrics(version=0, workers=(worker(0),), uptime=3.0, cpu_seconds=0.1))
    assert result.line == (
        "unknown: no lockstep call reached the workers and no chunk arrived in this 3.0 s window"
    )


def test_waits_without_the_workers_timings_are_unknown() -> None:
    assert verdict(lockstep(worker(0), worker(1))).line == (
        "unknown: no answer in this 2.0 s window carried the workers' timings"
    )
    chunks_only = detach(worker(0, chunks=4))
    assert verdict(chunks_only).bound == "unknown"


def test_a_window_of_two_snapshots_gives_the_verdict_of_the_time_between_them() -> None:
    def snapshot(at: float, answers: int, env: float, wait: float) -> Metrics:
        figures = worker(
            0,
            answers=answers,
            env_steps=4 * answers,
            env_seconds=env,
            wait_seconds=wait,
            slowest=answers,
        )
        return Metrics(
            version=0,
            workers=(figures,),
            taken_at=at,
            uptime=at,
            lockstep_calls=answers,
            lockstep_wait_seconds=wait,
        )

    # The first 10 s: 1000 calls of 2 ms, a learner busy with its own loop between them. The
    # next 2 s: 900 calls of 2.1 ms, 2 ms of them in the envs.
    earlier = snapshot(10.0, 1000, 1000 * 1 * MS, 1000 * 2 * MS)
    later = snapshot(
        12.0, 1900, earlier.workers[0].env_seconds + 900 * 2 * MS, 2.0 + 900 * 2.1 * MS
    )
    assert verdict(earlier).bound == "learner"
    result = verdict(later.since(earlier))
    assert result.bound == "env"
    assert result.line.startswith("env-bound: the learner waits for workers 94% of its time")
    assert "(2.00 ms of 2.10 ms; 0.50 ms an env-step)" in result.line


# Real runs: a learner and two worker processes over TCP on 127.0.0.1, 120 lockstep steps.

SLEEPY = f"{Path(__file__).resolve()}:sleepy_env"
WARMUP = 5  # steps before the window: the first ones pay for imports and first allocations
STEPS = 120
TIMEOUTS = aps.Timeouts(
    connect=30.0, handshake=10.0, step=20.0, heartbeat_interval=0.5, heartbeat_timeout=20.0
)


class Sleepy(gym.Env[np.ndarray[Any, Any], np.int64]):
    """Steps that sleep ``delay`` seconds and observe ``size`` float32 zeros; no episode ends."""

    def __init__(self, delay: float = 0.0, size: int = 4) -> None:
        self.delay = delay
        self.observation_space = spaces.Box(-1.0, 1.0, (size,), np.float32)
        self.action_space = spaces.Discrete(2)
        self._obs = np.zeros(size, np.float32)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray[Any, Any], dict[str, Any]]:
        super().reset(seed=seed)
        return self._obs, {}

    def step(
        self, action: np.int64
    ) -> tuple[np.ndarray[Any, Any], float, bool, bool, dict[str, Any]]:
        if self.delay:
            time.sleep(self.delay)
        return self._obs, 0.0, False, False, {}


def sleepy_env(delay: float = 0.0, size: int = 4) -> Sleepy:
    """The worker processes' env factory (they import it by this file's path)."""
    return Sleepy(delay, size)


class Fleet:
    """Worker processes of the sleepy env, killed at the end."""

    def __init__(self) -> None:
        self.processes: list[subprocess.Popen[bytes]] = []

    def start(self, url: str, *, delay: float = 0.0, size: int = 4) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-m", "aps", "worker", url, "--env", SLEEPY, "--no-check-env"]
        command += ["--env-kwargs", json.dumps({"delay": delay, "size": size})]
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.processes.append(process)
        return process

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=10)


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    workers = Fleet()
    try:
        yield workers
    finally:
        workers.close()


@pytest.fixture
async def learner() -> AsyncIterator[aps.Learner]:
    async with aps.Learner("tcp://127.0.0.1:0", num_workers=2, timeouts=TIMEOUTS) as learner:
        yield learner


async def window_of(learner: aps.Learner, *, pause: float = 0.0) -> Metrics:
    """The figures of :data:`STEPS` lockstep steps; ``pause``: the learner's own time a step."""
    await learner.wait_for_workers(timeout=60)
    await asyncio.wait_for(learner.reset(seed=0), 30)
    actions = np.zeros(learner.num_envs, dtype=np.int64)
    for _ in range(WARMUP):
        await asyncio.wait_for(learner.step(actions), 30)
    earlier = learner.metrics
    for _ in range(STEPS):
        await asyncio.wait_for(learner.step(actions), 30)
        if pause:
            await asyncio.sleep(pause)  # the learner's own work between its calls
    return learner.metrics.since(earlier)


def worker_of(learner: aps.Learner, process: subprocess.Popen[bytes]) -> int:
    return next(w.worker_id for w in learner.workers if w.pid == process.pid)


@pytest.mark.timeout(90)
async def test_a_run_of_envs_that_sleep_is_env_bound(learner: aps.Learner, fleet: Fleet) -> None:
    for _ in range(2):
        fleet.start(learner.url, delay=0.01)
    window = await window_of(learner)
    result = verdict(window)
    assert result.bound == "env", result.line
    for figures in window.workers:
        assert figures.answers == STEPS
        # A call waits for each worker's envs: their time lies within the calls' waits.
        assert 0 < figures.env_seconds <= window.lockstep_wait_seconds


@pytest.mark.timeout(90)
async def test_a_worker_whose_envs_sleep_four_times_longer_is_the_straggler(
    learner: aps.Learner, fleet: Fleet
) -> None:
    slow = fleet.start(learner.url, delay=0.02)
    fleet.start(learner.url, delay=0.005)
    window = await window_of(learner)
    result = verdict(window)
    straggler = worker_of(learner, slow)
    assert (result.bound, result.worker) == ("straggler", straggler), result.line
    assert result.line.startswith(f"straggler: worker {straggler} answered last in ")
    figures = next(w for w in window.workers if w.worker_id == straggler)
    assert 0 < figures.env_seconds <= window.lockstep_wait_seconds


@pytest.mark.timeout(90)
async def test_a_learner_that_pauses_between_fast_steps_is_learner_bound(
    learner: aps.Learner, fleet: Fleet
) -> None:
    for _ in range(2):
        fleet.start(learner.url)
    window = await window_of(learner, pause=0.01)
    result = verdict(window)
    assert result.bound == "learner", result.line
    assert window.lockstep_calls == STEPS
    assert result.shares["learner"] > WAIT_SHARE


OBS_FLOATS = 16384  # a 64 KiB observation per answer
LINK_RATE = 4e6  # bytes a second each way of each link: 16 ms of wire per answer


class SlowLink(Relay):
    """The relay over a link of :data:`LINK_RATE` bytes a second each way.

    Its pipe is the relay's own with a wait of each piece's time on such a link before it is
    passed on (and nothing is ever lost).
    """

    @staticmethod
    async def _pipe(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, lose: Callable[[], bool]
    ) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(1 << 16):
                await asyncio.sleep(len(data) / LINK_RATE)
                writer.write(data)
                await writer.drain()
        writer.transport.abort()


@pytest.mark.timeout(90)
async def test_large_observations_over_a_slow_link_are_wire_bound(
    learner: aps.Learner, fleet: Fleet
) -> None:
    link = SlowLink(learner.url)
    await link.start()
    try:
        for _ in range(2):
            fleet.start(link.url, size=OBS_FLOATS)
        window = await window_of(learner)
    finally:
        await link.aclose()
    result = verdict(window)
    assert result.bound == "wire", result.line
    # Every answer carried its worker's observation: 64 KiB each, at least.
    assert window.bytes_received >= 2 * STEPS * OBS_FLOATS * 4
