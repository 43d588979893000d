"""A DETACH chunk's checks against the layout the learner works out once per ``(T, E)``.

The learner tests a chunk's arrays against a layout of its ``(T, E)`` computed on the first
chunk of that shape, and runs the full checks (which name what is wrong) only for a chunk that
does not fit. Here a real worker over TCP on 127.0.0.1 sends honest chunks first, so the
layout is in place, and then a chunk tampered with: it is refused with the error the full
checks give, as it was before the layout existed.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

import aps
from aps.worker.steps import StepServer
from tests.agents import Agent
from tests.conftest import FAST, WorkerTasks
from tests.test_detach import POLICY, Spaces


def _tampered(chunk: Any, tamper: str) -> Any:
    if tamper == "reward":  # one env short
        return dataclasses.replace(chunk, reward=chunk.reward[:, :1])
    if tamper == "logprob":  # one step short
        return dataclasses.replace(chunk, logprob=chunk.logprob[:-1])
    if tamper == "value":
        return dataclasses.replace(chunk, value=chunk.value[:-1])
    if tamper == "actions":
        return dataclasses.replace(chunk, actions=chunk.actions[:-1])
    if tamper == "obs dtype":
        return dataclasses.replace(chunk, obs=chunk.obs.astype(np.float64))
    if tamper == "episode_length":  # one length more than the episodes that ended
        return dataclasses.replace(
            chunk, episode_length=np.append(chunk.episode_length, np.int64(1))
        )
    if tamper == "truncated_obs dict":  # a structured space's shape on an array space
        return dataclasses.replace(chunk, truncated_obs={"obs": chunk.truncated_obs})
    if tamper == "truncated_obs dtype":
        return dataclasses.replace(chunk, truncated_obs=chunk.truncated_obs.astype(np.float64))
    assert tamper == "episode_env"  # an env this worker does not have
    return dataclasses.replace(chunk, episode_env=chunk.episode_env + 100)


class LateTamperingServer(StepServer):
    """An honest DETACH step server until its ``honest`` chunks are sent, then tampering."""

    def __init__(self, *args: Any, tamper: str, honest: int) -> None:
        super().__init__(*args)
        self.tamper = tamper
        self.honest = honest

    async def _rollout(self, request: Any) -> Any:
        chunk = await super()._rollout(request)
        if self.honest:
            self.honest -= 1
            return chunk
        return _tampered(chunk, self.tamper)


class LateTampering(aps.Worker):
    """A DETACH worker whose chunks after the first ``honest`` are tampered with."""

    def __init__(self, *args: Any, tamper: str, honest: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tamper = tamper
        self.honest = honest

    def _new_server(self, envs: Any, collector: Any) -> StepServer:
        return LateTamperingServer(envs, collector, None, tamper=self.tamper, honest=self.honest)


@pytest.mark.parametrize(
    ("tamper", "named"),
    [
        ("reward", "chunk whose reward is an array of shape (30, 1)"),
        ("logprob", "chunk whose logprob is an array of shape (29, 2)"),
        ("value", "chunk whose value is an array of shape (29, 2)"),
        ("actions", "chunk whose actions is an array of shape (29, 2)"),
        ("obs dtype", "chunk whose obs has dtype float64, expected float32"),
        ("episode_length", "chunk whose episode_length is an array of shape"),
        ("episode_env", "episodes of envs outside its 2"),
        ("truncated_obs dict", "truncated observations as dict, expected an array of dtype"),
        ("truncated_obs dtype", "truncated observations as an array of dtype float64"),
    ],
)
async def test_a_chunk_that_no_longer_fits_its_layout_is_refused_as_before(
    workers: WorkerTasks, tamper: str, named: str
) -> None:
    async with aps.Learner(
        "tcp://127.0.0.1:0", num_workers=1, policy=POLICY, timeouts=FAST
    ) as learner:
        worker = LateTampering(
            learner.url,
            "CartPole-v1",
            num_envs=2,
            env_kwargs={"max_episode_steps": 5},
            timeouts=FAST,
            tamper=tamper,
            honest=2,
            policy=POLICY,
        )
        workers.tasks.append(asyncio.create_task(worker.run()))
        await learner.reset(seed=0)
        await learner.publish(Agent(Spaces("CartPole-v1")))
        for _ in range(2):  # the layout of 30-step chunks, then a chunk that fits it
            rollout = await learner.rollout(30)
            assert rollout.reward.shape == (30, 2)
        with pytest.raises(aps.ProtocolError, match=r"^worker 0 sent") as caught:
            await learner.rollout(30)
        assert named in str(caught.value)


async def test_chunks_of_several_lengths_each_fit_their_own_layout(workers: WorkerTasks) -> None:
    async with aps.Learner(
        "tcp://127.0.0.1:0", num_workers=2, policy=POLICY, timeouts=FAST
    ) as learner:
        for _ in range(2):
            workers.start(learner.url, env="CartPole-v1", num_envs=3)
        await learner.reset(seed=0)
        await learner.publish(Agent(Spaces("CartPole-v1")))
        for steps in (4, 7, 4, 1, 7):
            rollout = await learner.rollout(steps)
            assert rollout.reward.shape == (steps, 6)
            assert rollout.obs.shape == (steps, 6, 4)
        received = 0
        stream = learner.chunks(5)
        async for chunk in stream:
            assert chunk.reward.shape == (5, 3)
            received += 1
            if received == 6:
                break
        await stream.aclose()
