"""Lost workers, dropped connections and resumed sessions, with real sockets and processes.

The links run through a relay (tests/chaos.py) that can lose bytes and cut connections, so
each failure happens at a chosen point of the conversation; worker processes die by SIGKILL.
Results are checked against a Gymnasium vector env run without failures.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import SyncVectorEnv

import aps
from aps.testing import Relay, until
from tests.conftest import FAST, TEST_POLICIES

ENVS = 3  # per worker
LOOPBACK = "tcp://127.0.0.1:0"


def reference(num_envs: int, seed: int = 0) -> SyncVectorEnv:
    envs = SyncVectorEnv([lambda: gym.make("CartPole-v1")] * num_envs)
    envs.reset(seed=seed)
    return envs


def same_step(got: tuple[Any, ...], want: tuple[Any, ...], envs: slice = slice(None)) -> None:
    for name, a, b in zip(("obs", "reward", "terminated", "truncated"), got, want, strict=False):
        np.testing.assert_array_equal(a[envs], b[envs], err_msg=name)


class Workers:
    """Worker tasks (with their Worker objects) and worker processes, cleaned up at the end."""

    def __init__(self) -> None:
        self.objects: list[aps.Worker] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.processes: list[subprocess.Popen[bytes]] = []

    def task(self, url: str, **kwargs: Any) -> aps.Worker:
        kwargs.setdefault("timeouts", FAST)
        kwargs.setdefault("allow_policy", TEST_POLICIES)
        worker = aps.Worker(url, "CartPole-v1", num_envs=ENVS, **kwargs)
        self.objects.append(worker)
        self.tasks.append(asyncio.create_task(worker.run()))
        return worker

    def process(self, url: str, *args: str) -> subprocess.Popen[bytes]:
        command = [sys.executable, "-m", "aps", "worker", url, "--env", "CartPole-v1"]
        process = subprocess.Popen(
            [*command, "--num-envs", str(ENVS), "--allow-policy", TEST_POLICIES[0], *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.processes.append(process)
        return process

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=5)
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=10)


@pytest.fixture
async def fleet() -> AsyncIterator[Workers]:
    workers = Workers()
    try:
        yield workers
    finally:
        await workers.close()


@pytest.fixture
async def relay_learner() -> AsyncIterator[tuple[aps.Learner, Relay]]:
    learner = aps.Learner(
        LOOPBACK, num_workers=2, timeouts=FAST, on_worker_lost="wait", reconnect_timeout=20
    )
    async with learner:
        relay = Relay(learner.url)
        await relay.start()
        try:
            yield learner, relay
        finally:
            await relay.aclose()


def served(worker: aps.Worker) -> int:
    """The requests of ``worker``'s session it has answered (its own count)."""
    server = worker._server
    return -1 if server is None else server.served


def actions(seed: int) -> Iterator[np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    while True:
        yield rng.integers(0, 2, size=2 * ENVS)


async def test_an_answer_lost_in_a_cut_is_sent_again_not_run_again(
    relay_learner: tuple[aps.Learner, Relay], fleet: Workers
) -> None:
    learner, relay = relay_learner
    workers = [fleet.task(relay.url) for _ in range(2)]
    ref = reference(2 * ENVS)
    await asyncio.wait_for(learner.reset(seed=0), 20)
    moves = actions(0)
    for _ in range(3):
        action = next(moves)
        same_step(await asyncio.wait_for(learner.step(action), 20), ref.step(action))
    # Both workers run the step, but their answers never reach the learner.
    relay.lose_to_learner = True
    action = next(moves)
    pending = asyncio.create_task(learner.step(action))
    await until(lambda: all(served(w) == 5 for w in workers))
    relay.cut()
    same_step(await asyncio.wait_for(pending, 30), ref.step(action))
    assert [w.replayed for w in workers] == [1, 1]
    assert [w.resumes for w in workers] == [1, 1]
    assert [m.resumes for m in learner.metrics.workers] == [1, 1]
    action = next(moves)
    same_step(await asyncio.wait_for(learner.step(action), 20), ref.step(action))


async def test_a_request_lost_in_a_cut_is_sent_again(
    relay_learner: tuple[aps.Learner, Relay], fleet: Workers
) -> None:
    learner, relay = relay_learner
    workers = [fleet.task(relay.url) for _ in range(2)]
    ref = reference(2 * ENVS)
    await asyncio.wait_for(learner.reset(seed=0), 20)
    relay.lose_to_worker = True  # the step requests vanish on the way
    action = next(actions(1))
    pending = asyncio.create_task(learner.step(action))
    await asyncio.sleep(0.05)  # let the requests be swallowed (the outcome does not depend on it)
    relay.cut()
    same_step(await asyncio.wait_for(pending, 30), ref.step(action))
    assert [w.replayed for w in workers] == [0, 0]
    assert [served(w) for w in workers] == [2, 2]  # reset and step, each run once


async def test_random_cuts_change_nothing(
    relay_learner: tuple[aps.Learner, Relay], fleet: Workers
) -> None:
    learner, relay = relay_learner
    workers = [fleet.task(relay.url) for _ in range(2)]
    ref = reference(2 * ENVS)
    await asyncio.wait_for(learner.reset(seed=0), 20)
    rng = np.random.default_rng(2)
    loop = asyncio.get_running_loop()
    moves = actions(2)
    for t in range(120):
        if t % 8 == 3:  # a cut at a random moment around this step
            loop.call_later(float(rng.uniform(0, 0.003)), relay.cut)
        action = next(moves)
        same_step(await asyncio.wait_for(learner.step(action), 30), ref.step(action))
    assert relay.cuts == 15
    assert sum(w.resumes for w in workers) >= 1  # at least one cut hit a live connection
    assert learner.restarts == 0


def kill(process: subprocess.Popen[bytes]) -> None:
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=10)


async def test_a_replacement_takes_the_slots_of_a_killed_worker(fleet: Workers) -> None:
    async with aps.Learner(
        LOOPBACK, num_workers=2, timeouts=FAST, on_worker_lost="wait", reconnect_timeout=30
    ) as learner:
        victim = fleet.process(learner.url, "--seed", "0")
        await until(lambda: len(learner.workers) == 1, 30)
        fleet.task(learner.url)
        await asyncio.wait_for(learner.wait_for_workers(), 30)
        first = learner.workers[0]
        survivor = slice(ENVS, 2 * ENVS)  # the task worker arrived second
        assert learner.workers[1].pid == os.getpid()
        ref = reference(2 * ENVS)
        await asyncio.wait_for(learner.reset(seed=0), 20)
        moves = actions(3)
        for _ in range(3):
            action = next(moves)
            same_step(await asyncio.wait_for(learner.step(action), 20), ref.step(action))
        kill(victim)
        fleet.process(learner.url, "--seed", "7")  # dials in, waits as a spare or takes over
        action = next(moves)
        obs, reward, terminated, truncated, info = await asyncio.wait_for(learner.step(action), 60)
        want = ref.step(action)
        same_step((obs, reward, terminated, truncated), want, survivor)
        lost = slice(0, ENVS)
        assert truncated[lost].all() and not terminated[lost].any() and not reward[lost].any()
        assert info["worker_restarted"][lost].all() and info["_worker_restarted"][lost].all()
        assert not info["_worker_restarted"][survivor].any()
        assert learner.restarts == 1
        now = learner.workers[0]
        assert now.worker_id != first.worker_id and now.env_offset == 0
        # NextStep: the step after the truncation is the replacement envs' reset step.
        reset_obs = obs[lost].copy()
        action = next(moves)
        obs, reward, terminated, truncated, _ = await asyncio.wait_for(learner.step(action), 20)
        same_step((obs, reward, terminated, truncated), ref.step(action), survivor)
        assert not (truncated[lost].any() or terminated[lost].any() or reward[lost].any())
        assert not np.array_equal(obs[lost], reset_obs)  # a second, unseeded reset
        for _ in range(3):
            action = next(moves)
            result = await asyncio.wait_for(learner.step(action), 20)
            same_step(result, ref.step(action), survivor)
            assert result[1][lost].all()  # the replacement's envs step again


async def test_a_spare_replaces_a_lost_worker_at_once(fleet: Workers) -> None:
    async with aps.Learner(
        LOOPBACK, num_workers=1, timeouts=FAST, on_worker_lost="wait", reconnect_timeout=30
    ) as learner:
        victim = fleet.process(learner.url)
        await asyncio.wait_for(learner.reset(seed=0), 30)
        spare = fleet.task(learner.url)
        await until(lambda: spare.worker_id is not None)
        assert len(learner.workers) == 1 and learner.workers[0].worker_id == 0
        kill(victim)
        *_, truncated, info = await asyncio.wait_for(learner.step(np.zeros(ENVS, np.int64)), 30)
        assert truncated.all() and info["worker_restarted"].all()
        assert learner.workers[0].worker_id == spare.worker_id == 1


async def test_wait_gives_up_after_reconnect_timeout(fleet: Workers) -> None:
    async with aps.Learner(
        LOOPBACK, num_workers=1, timeouts=FAST, on_worker_lost="wait", reconnect_timeout=0.5
    ) as learner:
        victim = fleet.process(learner.url)
        await asyncio.wait_for(learner.reset(seed=0), 30)
        kill(victim)
        with pytest.raises(aps.WorkerLost, match=r"worker 0 .* within 0.5 s") as caught:
            await asyncio.wait_for(learner.step(np.zeros(ENVS, np.int64)), 30)
        assert caught.value.worker_id == 0
        with pytest.raises(aps.InvalidState, match="can no longer step"):
            await learner.step(np.zeros(ENVS, np.int64))


async def test_raise_names_a_worker_killed_mid_run(fleet: Workers) -> None:
    async with aps.Learner(LOOPBACK, num_workers=2, timeouts=FAST) as learner:
        victim = fleet.process(learner.url)
        fleet.process(learner.url)
        await asyncio.wait_for(learner.reset(seed=0), 30)
        lost = next(w.worker_id for w in learner.workers if w.pid == victim.pid)
        kill(victim)
        with pytest.raises(aps.WorkerLost, match=f"worker {lost} ") as caught:
            await asyncio.wait_for(learner.step(np.zeros(2 * ENVS, np.int64)), 30)
        assert caught.value.worker_id == lost


async def test_a_new_worker_is_refused_while_full_unless_waiting(fleet: Workers) -> None:
    async with aps.Learner(LOOPBACK, num_workers=1, timeouts=FAST) as learner:
        fleet.task(learner.url)
        await asyncio.wait_for(learner.wait_for_workers(), 30)
        extra = aps.Worker(learner.url, "CartPole-v1", timeouts=FAST)
        with pytest.raises(aps.ConfigError, match="already has its 1 workers"):
            await asyncio.wait_for(extra.run(), 30)


async def test_a_worker_resumes_only_its_own_session(fleet: Workers) -> None:
    """A resume that claims answers the learner never asked for is refused."""
    async with aps.Learner(
        LOOPBACK, num_workers=1, timeouts=FAST, on_worker_lost="wait", reconnect_timeout=5
    ) as learner:
        honest = fleet.task(learner.url)
        await asyncio.wait_for(learner.reset(seed=0), 30)
        forger = aps.Worker(learner.url, "CartPole-v1", num_envs=ENVS, timeouts=FAST)
        forger._session_id = honest._session_id
        forger._served = 99
        with pytest.raises(aps.ProtocolError, match="cannot resume worker 0's session"):
            await asyncio.wait_for(forger.run(), 30)
        result = await asyncio.wait_for(learner.step(np.zeros(ENVS, np.int64)), 30)
        assert result[1].all()  # the honest worker keeps its slots


@pytest.mark.timeout(300)  # two worker processes that import torch, on a loaded machine
async def test_drop_goes_on_with_the_other_workers(
    fleet: Workers, caplog: pytest.LogCaptureFixture
) -> None:
    agents = str(Path(__file__).with_name("agents.py"))
    torch = pytest.importorskip("torch")
    from tests.agents import Agent

    async with aps.Learner(
        LOOPBACK,
        num_workers=2,
        timeouts=dataclasses.replace(FAST, step=60.0),  # worker processes import torch
        on_worker_lost="drop",
        policy=f"{agents}:Agent",
    ) as learner:
        victim = fleet.process(learner.url)
        fleet.process(learner.url)
        await learner.wait_for_workers(timeout=90)  # processes that import torch start slowly
        await asyncio.wait_for(learner.reset(seed=0), 60)
        torch.manual_seed(0)
        await learner.publish(Agent(learner))
        lost = next(w.worker_id for w in learner.workers if w.pid == victim.pid)

        def others() -> int:
            return sum(m.chunks for m in learner.metrics.workers if m.worker_id != lost)

        def dropped() -> bool:
            return any("dropped it, going on" in r.getMessage() for r in caplog.records)

        # The loop ends on what it tests, whatever the workers' speed: the victim is killed
        # once both have sent a chunk (a slow starter is waited for), and the loop goes on
        # until the learner dropped it and the other worker sent 10 chunks after the kill.
        seen: set[int] = set()
        others_at_kill: int | None = None
        async with asyncio.timeout(90):
            async for chunk in learner.chunks(8):
                seen.add(chunk.worker_id)
                if others_at_kill is None and len(seen) == 2:
                    kill(victim)
                    others_at_kill = others()
                if others_at_kill is not None and others() >= others_at_kill + 10 and dropped():
                    break
        with pytest.raises(aps.InvalidState, match=rf"workers \[{lost}\] were dropped"):
            await learner.step(np.zeros(2 * ENVS, np.int64))
        async with asyncio.timeout(30):  # a new stream goes on without it
            async for chunk in learner.chunks(4):
                assert chunk.worker_id != lost
                break


async def test_a_worker_without_reconnect_ends_when_its_link_drops(
    relay_learner: tuple[aps.Learner, Relay],
) -> None:
    _, relay = relay_learner
    worker = aps.Worker(relay.url, "CartPole-v1", timeouts=FAST, reconnect=False)
    task = asyncio.create_task(worker.run())
    await until(lambda: worker.worker_id is not None)
    relay.cut()
    with pytest.raises(aps.TransportError):
        await asyncio.wait_for(task, 20)


async def test_a_worker_joins_a_restarted_learner_as_a_new_worker(fleet: Workers) -> None:
    async with aps.Learner(LOOPBACK, num_workers=1, timeouts=FAST) as first:
        relay = Relay(first.url)
        await relay.start()
        try:
            worker = fleet.task(relay.url, seed=5)
            await asyncio.wait_for(first.reset(seed=0), 20)
            await asyncio.wait_for(first.step(np.zeros(ENVS, np.int64)), 20)
            # The learner "restarts": a new one takes over the address the workers dial.
            async with aps.Learner(LOOPBACK, num_workers=1, timeouts=FAST) as second:
                relay.retarget(second.url)
                relay.cut()
                ref = SyncVectorEnv([lambda: gym.make("CartPole-v1")] * ENVS)
                obs, _ = await asyncio.wait_for(second.reset(seed=3), 30)
                np.testing.assert_array_equal(obs, ref.reset(seed=3)[0])
                action = np.ones(ENVS, np.int64)
                same_step(await asyncio.wait_for(second.step(action), 20), ref.step(action))
                assert worker.resumes == 0 and second.workers[0].worker_id == 0
        finally:
            await relay.aclose()


async def test_a_first_version_lost_in_a_cut_is_sent_again_before_the_replayed_rollout(
    fleet: Workers,
) -> None:
    torch = pytest.importorskip("torch")
    from tests.agents import Agent

    agents = Path(__file__).with_name("agents.py")
    learner = aps.Learner(
        LOOPBACK,
        num_workers=1,
        policy=f"{agents}:Agent",
        timeouts=FAST,
        on_worker_lost="wait",
        reconnect_timeout=20,
    )
    async with learner:
        relay = Relay(learner.url)
        await relay.start()
        try:
            worker = fleet.task(relay.url)
            await asyncio.wait_for(learner.reset(seed=0), 20)
            # The first version and the rollout request both vanish on the way, then the link
            # is cut: the worker resumes holding no version, and the request is replayed.
            relay.lose_to_worker = True
            torch.manual_seed(0)
            env = gym.make("CartPole-v1")
            spaces = aps.policy.VectorEnvSpaces.of(env.observation_space, env.action_space)
            await asyncio.wait_for(learner.publish(Agent(spaces)), 20)
            pending = asyncio.create_task(learner.rollout(4))
            await until(lambda: learner.metrics.workers[0].syncs == 1)
            await asyncio.sleep(0.2)  # the request is on its way into the void too
            relay.lose_to_worker = False
            relay.cut()
            rollout = await asyncio.wait_for(pending, 30)
            assert rollout.obs.shape == (4, ENVS, 4)
            assert (rollout.policy_version == 1).all()
            assert worker.resumes == 1
            assert learner.metrics.workers[0].syncs == 2  # sent again on the new connection
        finally:
            await relay.aclose()
