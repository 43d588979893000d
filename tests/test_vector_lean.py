"""The worker's ``LeanSyncVectorEnv`` against Gymnasium's ``SyncVectorEnv``, side by side.

Same env functions, seeds and actions: every step's observations, rewards, terminations,
truncations and infos must be equal, values and dtypes, in every autoreset mode and for
every space type (array spaces take the short step, the others Gymnasium's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from aps.testing import envs as test_envs
from aps.vector import LeanSyncVectorEnv, make_vector_env

MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]
ENVS: dict[str, Callable[[], gym.Env[Any, Any]]] = {
    "box": lambda: test_envs.BoxEnv(max_steps=4),
    "discrete": lambda: test_envs.DiscreteEnv(max_steps=4),
    "multidiscrete": lambda: test_envs.MultiDiscreteEnv(max_steps=4),
    "multibinary": lambda: test_envs.MultiBinaryEnv(max_steps=4),
    "dict": lambda: test_envs.DictEnv(max_steps=4),
    "tuple": lambda: test_envs.TupleEnv(max_steps=4),
    "cartpole": lambda: gym.make("CartPole-v1"),
}


def assert_equal(got: Any, want: Any, where: str) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), where
        for key in want:
            assert_equal(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want), where
        for k, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_equal(g, w, f"{where}[{k}]")
    elif isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray), where
        assert got.dtype == want.dtype and got.shape == want.shape, where
        if want.dtype == object:
            for k, (g, w) in enumerate(zip(got, want, strict=True)):
                assert_equal(g, w, f"{where}[{k}]")
        else:
            np.testing.assert_array_equal(got, want, err_msg=where)
    else:
        assert type(got) is type(want) and got == want, where


def run_both(
    env_fn: Callable[[], gym.Env[Any, Any]], mode: AutoresetMode, num_envs: int, steps: int
) -> None:
    lean = LeanSyncVectorEnv([env_fn] * num_envs, copy=False, autoreset_mode=mode)
    plain = SyncVectorEnv([env_fn] * num_envs, copy=False, autoreset_mode=mode)
    try:
        lean.action_space.seed(3)
        assert_equal(lean.reset(seed=7), plain.reset(seed=7), "reset")
        for t in range(steps):
            actions = lean.action_space.sample()
            if mode is AutoresetMode.DISABLED and plain._autoreset_envs.any():
                mask = plain._autoreset_envs.copy()
                got, want = (
                    lean.reset(options={"reset_mask": mask}),
                    plain.reset(options={"reset_mask": mask}),
                )
                assert_equal(got, want, f"reset at step {t}")
            # Compared before the next step: copy=False hands out buffers that are reused.
            assert_equal(lean.step(actions), plain.step(actions), f"step {t}")
    finally:
        lean.close()
        plain.close()


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("kind", list(ENVS))
@pytest.mark.parametrize("num_envs", [1, 3])
def test_lean_steps_equal_gymnasium(kind: str, mode: AutoresetMode, num_envs: int) -> None:
    run_both(ENVS[kind], mode, num_envs, steps=30)


class WrongDtypeEnv(test_envs.BoxEnv):
    """Observations of float64 for a float32 space: Gymnasium's batching casts them."""

    def _observe(self) -> Any:
        return np.asarray(super()._observe(), dtype=np.float64)


class WrongShapeEnv(test_envs.BoxEnv):
    """Observations one element short after the first step: Gymnasium's batching refuses."""

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = super().step(action)
        return obs[:-1], reward, terminated, truncated, info


@pytest.mark.parametrize("mode", MODES[:2], ids=lambda m: m.value)
def test_observations_off_their_space_are_batched_by_gymnasium(mode: AutoresetMode) -> None:
    run_both(WrongDtypeEnv, mode, 3, steps=20)


@pytest.mark.parametrize("num_envs", [1, 3])
def test_observations_of_the_wrong_shape_raise_gymnasiums_error(num_envs: int) -> None:
    lean = LeanSyncVectorEnv([WrongShapeEnv] * num_envs, copy=False)
    plain = SyncVectorEnv([WrongShapeEnv] * num_envs, copy=False)
    try:
        lean.reset(seed=0)
        plain.reset(seed=0)
        actions = plain.action_space.sample()
        with pytest.raises(ValueError) as want:
            plain.step(actions)
        with pytest.raises(ValueError) as got:
            lean.step(actions)
        assert str(got.value) == str(want.value)
    finally:
        lean.close()
        plain.close()


def test_the_sync_backend_is_the_lean_one() -> None:
    envs = make_vector_env(
        "sync", ENVS["cartpole"], num_envs=2, autoreset_mode=AutoresetMode.NEXT_STEP
    )
    try:
        assert isinstance(envs, LeanSyncVectorEnv)
    finally:
        envs.close()
