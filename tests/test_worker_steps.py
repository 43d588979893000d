"""The step server's checks of the actions the learner sends, on real envs.

The actions of a step come from the network: whatever their form, a step either runs with
actions ``check_batch`` accepts or is answered with an error report naming them.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

from aps.testing import envs as test_envs
from aps.vector import make_vector_env
from aps.wire import codec
from aps.wire.messages import ErrorReport, StepRequest, StepResult
from aps.worker.steps import StepServer


def server_for(env_fn: Any, num_envs: int) -> StepServer:
    envs = make_vector_env(
        "sync", env_fn, num_envs=num_envs, autoreset_mode=AutoresetMode.NEXT_STEP
    )
    envs.reset(seed=0)
    return StepServer(envs, None, seed=0)


def cartpole() -> gym.Env[Any, Any]:
    return gym.make("CartPole-v1")


GOOD = [
    np.array([0, 1, 1]),
    np.array([1, 0, 1], dtype=np.int32),
    np.array([0, 1, 1], dtype=np.uint8),
    [0, 1, 0],  # not an array: check_batch converts it
]
BAD = [
    (np.array([0, 1]), "shape"),
    (np.array([[0], [1], [1]]), "shape"),
    (np.array([0.0, 1.0, 1.0]), "dtype"),
    (np.array(1), "shape"),
    (None, "shape"),
]


@pytest.mark.parametrize("actions", GOOD, ids=repr)
def test_actions_that_fit_are_stepped(actions: Any) -> None:
    server = server_for(cartpole, 3)
    try:
        # Decoded as the worker gets it: arrays are read-only views of the frame.
        request = codec.decode(codec.encode(StepRequest(actions=actions, seq=0)))
        assert isinstance(request, StepRequest)
        answer = server._step(request)
        assert isinstance(answer, StepResult)
        assert answer.obs.shape == (3, 4)
    finally:
        server.close()


@pytest.mark.parametrize(("actions", "word"), BAD, ids=repr)
def test_actions_that_do_not_fit_are_refused_by_name(actions: Any, word: str) -> None:
    server = server_for(cartpole, 3)
    try:
        request = codec.decode(codec.encode(StepRequest(actions=actions, seq=4)))
        assert isinstance(request, StepRequest)
        answer = server._step(request)
        assert isinstance(answer, ErrorReport)
        assert answer.seq == 4
        assert "the learner sent bad actions" in answer.message
        assert word in answer.message
    finally:
        server.close()


def test_box_actions_of_the_wrong_shape_are_refused() -> None:
    server = server_for(lambda: test_envs.BoxEnv(), 2)
    try:
        space = server.envs.single_action_space
        assert isinstance(space, gym.spaces.Box)
        good = np.zeros((2, *space.shape), dtype=np.float32)
        assert isinstance(server._step(StepRequest(actions=good)), StepResult)
        bad = np.zeros((2, *space.shape, 1), dtype=np.float32)
        answer = server._step(StepRequest(actions=bad))
        assert isinstance(answer, ErrorReport) and "shape" in answer.message
    finally:
        server.close()
