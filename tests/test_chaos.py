"""Chaos: workers killed and links cut at random points of a short training run.

Three worker processes act with their policy copies (DETACH) and stream chunks through a
relay; the learner publishes a new version every few chunks. Meanwhile workers are killed
with SIGKILL (a new process takes over their envs) and the relay resets every connection
(the workers resume). Whatever the timing, these must hold:

- nothing hangs: every wait has a deadline;
- no transition is lost or delivered twice: a worker's chunks continue exactly where its
  previous chunk ended (``obs[0]`` is the last ``next_obs``), across any number of resumes;
- every chunk is attributed to the version that acted: its behaviour log-probabilities are
  those of the claimed version's weights;
- the learner's transition count is the sum of the chunks delivered.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import aps  # noqa: E402
from aps.policy import Policy  # noqa: E402
from aps.testing import Relay  # noqa: E402
from tests.agents import Agent  # noqa: E402
from tests.conftest import FAST  # noqa: E402

AGENTS = str(Path(__file__).with_name("agents.py"))
ENVS = 3
STEPS = 16  # per chunk
TIMEOUTS = dataclasses.replace(FAST, step=60.0)  # worker processes import torch on arrival


def start_worker(url: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "aps", "worker", url, "--env", "CartPole-v1"]
    command += ["--num-envs", str(ENVS), "--policy", f"{AGENTS}:Agent"]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def chaos(
    learner: aps.Learner,
    relay: Relay,
    processes: list[subprocess.Popen[bytes]],
    events: list[str],
    seed: int,
) -> None:
    """Every so often, kill a serving worker and start another, or cut every link."""
    rng = np.random.default_rng(seed)
    kills = 0
    for round_ in range(6):
        await asyncio.sleep(float(rng.uniform(0.5, 1.5)))
        if round_ % 3 == 1 and kills < 2:
            serving = {w.pid for w in learner.workers}
            alive = [p for p in processes if p.poll() is None and p.pid in serving]
            victim = alive[int(rng.integers(len(alive)))]
            os.kill(victim.pid, signal.SIGKILL)
            victim.wait(timeout=10)
            processes.append(start_worker(relay.url))
            kills += 1
            events.append("kill")
        else:
            relay.cut()
            events.append("cut")


async def test_training_survives_kills_and_cuts() -> None:
    torch.manual_seed(0)
    processes: list[subprocess.Popen[bytes]] = []
    async with aps.Learner(
        "tcp://127.0.0.1:0",
        num_workers=3,
        policy=f"{AGENTS}:Agent",
        timeouts=TIMEOUTS,
        on_worker_lost="wait",
        reconnect_timeout=60,
    ) as learner:
        relay = Relay(learner.url)
        await relay.start()
        try:
            processes += [start_worker(relay.url) for _ in range(3)]
            await learner.wait_for_workers(timeout=120)
            await asyncio.wait_for(learner.reset(seed=0), 60)
            agent = Agent(learner)
            versions: dict[int, dict[str, Any]] = {}
            versions[await learner.publish(agent)] = copy.deepcopy(agent.state_dict())
            events: list[str] = []
            monkey = asyncio.create_task(chaos(learner, relay, processes, events, seed=1))
            last: dict[int, tuple[int, np.ndarray[Any, Any]]] = {}  # env offset -> (worker, obs)
            counted = continued = 0
            async with asyncio.timeout(240):
                stream = learner.chunks(STEPS)
                async for chunk in stream:
                    counted += chunk.reward.size
                    check_attribution(chunk, versions[chunk.version], learner)
                    before = last.get(chunk.env_offset)
                    if before is not None and before[0] == chunk.worker_id:
                        np.testing.assert_array_equal(chunk.obs[0], before[1])
                        continued += 1
                    last[chunk.env_offset] = (chunk.worker_id, chunk.next_obs)
                    if counted % (4 * STEPS * ENVS) == 0:
                        with torch.no_grad():
                            for parameter in agent.parameters():
                                parameter.add_(0.05 * torch.randn_like(parameter))
                        versions[await learner.publish(agent)] = copy.deepcopy(agent.state_dict())
                    replaced = learner.restarts == events.count("kill")
                    if monkey.done() and replaced and counted >= 60 * STEPS * ENVS:
                        break
                await stream.aclose()
            monkey.result()
            metrics = learner.metrics
            assert metrics.transitions == counted  # replaced workers' counts included
            assert events.count("kill") == 2 and learner.restarts == 2
            assert continued > 0
            chunks = sum(w.chunks for w in metrics.workers)
            resumes = sum(w.resumes for w in metrics.workers)
            print(
                f"chaos: {events}, {counted} transitions in {chunks} chunks, {resumes} resumes, "
                f"{learner.restarts} restarts, {len(versions)} versions"
            )
        finally:
            await relay.aclose()
            for process in processes:
                if process.poll() is None:
                    process.kill()
                process.wait(timeout=10)


def check_attribution(chunk: aps.Chunk, weights: dict[str, Any], learner: aps.Learner) -> None:
    """The chunk's behaviour log-probabilities are those of the version it claims."""
    agent = Agent(learner)
    agent.load_state_dict(weights)
    policy = Policy(agent, learner.single_observation_space, learner.single_action_space)
    obs = chunk.obs.reshape(-1, *chunk.obs.shape[2:])
    actions = chunk.actions.reshape(-1, *chunk.actions.shape[2:])
    with torch.no_grad():
        expected = policy.log_prob(obs, actions).numpy()
    np.testing.assert_allclose(chunk.logprob.reshape(-1), expected, atol=1e-4)
