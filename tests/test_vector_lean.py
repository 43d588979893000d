"""The worker's ``LeanSyncVectorEnv`` against Gymnasium's ``SyncVectorEnv``, side by side.

Same env functions, seeds and actions: every step's observations, rewards, terminations,
truncations and infos must be equal, values and dtypes, in every autoreset mode and for
every space type (array spaces take the short step, the others Gymnasium's).
"""

from __future__ import annotations

import functools
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
    env_fn: Callable[[], gym.Env[Any, Any]] | list[Callable[[], gym.Env[Any, Any]]],
    mode: AutoresetMode,
    num_envs: int,
    steps: int,
) -> None:
    """Step both vector envs side by side; ``env_fn`` may be one function per env."""
    env_fns = env_fn if isinstance(env_fn, list) else [env_fn] * num_envs
    lean = LeanSyncVectorEnv(env_fns, copy=False, autoreset_mode=mode)
    plain = SyncVectorEnv(env_fns, copy=False, autoreset_mode=mode)
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


class EndingEnv(gym.Env[Any, Any]):
    """Episodes of exactly ``length`` steps, with infos chosen to stress SameStep's keys.

    ``style`` picks the info: ``"end"`` only on the ending step (nested dicts, arrays and a
    numpy scalar, as RecordEpisodeStatistics gives), ``"every"`` on every step and on reset,
    ``"int"``, ``"float"``, ``"f32"``, ``"bool"`` the ending step's ``score`` of that type
    (one key of several dtypes across envs), ``"clash"`` the final keys in the env's own
    info, ``"none"`` an ending step whose info is ``None``.
    """

    observation_space = gym.spaces.Box(-1e6, 1e6, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, length: int, style: str) -> None:
        self._length = length
        self._style = style
        self._t = 0
        self._episodes = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        super().reset(seed=seed)
        self._t = 0
        self._episodes += 1
        info: dict[str, Any] = {}
        if self._style == "every":
            info["reset_count"] = np.int64(self._episodes)
        return self._obs(), info

    def _obs(self) -> Any:
        return np.array([self._t, self._episodes * 100 + self._length], dtype=np.float32)

    def step(self, action: Any) -> tuple[Any, float, bool, bool, Any]:
        self._t += 1
        t, ended = self._t, self._t >= self._length
        info: Any = {}
        style = self._style
        if style == "every":
            info = {"vec": np.arange(3, dtype=np.int16) * t, "flag": t % 2 == 0}
        elif style == "clash" and t % 2 == 1:
            info = {"final_obs": np.ones(2) * t, "_final_info": t}
        elif ended and style == "end":
            returns = np.float64(t + 0.5)
            info = {"episode": {"r": returns, "l": np.int32(t), "t": np.array([t, -t])}}
        elif ended and style in ("int", "float", "f32", "bool"):
            kinds = {"int": int, "float": float, "f32": np.float32, "bool": bool}
            info = {"score": kinds[style](t % 2), "label": f"env of {self._length}"}
        elif ended and style == "none":
            info = None
        truncated = ended and self._length % 2 == 1
        return self._obs(), float(t), ended and not truncated, truncated, info


def ending(length: int, style: str) -> Callable[[], gym.Env[Any, Any]]:
    return functools.partial(EndingEnv, length, style)


SAME_STEP_CASES: dict[str, list[Callable[[], gym.Env[Any, Any]]]] = {
    # All end on the same steps, with infos on those steps only; steps between end none.
    "all_at_once": [ending(3, "end")] * 4,
    # Several of five end at once on some steps, one or none on others.
    "several": [
        ending(2, "end"),
        ending(3, "end"),
        ending(2, "end"),
        ending(6, "end"),
        ending(1, "end"),
    ],
    # One key whose type differs across envs: the first ended env fixes the array's dtype.
    "dtype_mix": [ending(2, "int"), ending(2, "float"), ending(3, "f32"), ending(2, "bool")],
    "dtype_mix_reversed": [
        ending(2, "bool"),
        ending(3, "f32"),
        ending(2, "float"),
        ending(2, "int"),
    ],
    # Envs before the first ended one add keys first: the final keys' place in the order.
    "info_before_end": [ending(7, "every"), ending(2, "end"), ending(5, "every"), ending(3, "end")],
    # The env's own info holds final keys: Gymnasium's _add_info merges them with the ends'.
    "clash": [ending(2, "end"), ending(3, "clash"), ending(4, "end"), ending(5, "clash")],
    "clash_first": [ending(3, "clash"), ending(2, "end"), ending(2, "every")],
    "none_info": [ending(2, "end"), ending(3, "none"), ending(2, "end")],
    # RecordEpisodeStatistics's infos carry wall-clock times; "end" has its layout without.
}


@pytest.mark.parametrize("case", list(SAME_STEP_CASES))
def test_same_step_infos_equal_gymnasium(case: str) -> None:
    env_fns = SAME_STEP_CASES[case]
    run_both(env_fns, AutoresetMode.SAME_STEP, len(env_fns), steps=60)


def test_same_step_masks_are_arrays_of_their_own() -> None:
    envs = LeanSyncVectorEnv([ending(2, "end")] * 3, copy=False, autoreset_mode="SameStep")
    try:
        envs.reset(seed=0)
        envs.step(np.zeros(3, dtype=np.int64))
        infos = envs.step(np.zeros(3, dtype=np.int64))[4]
        assert list(infos) == ["final_obs", "_final_obs", "final_info", "_final_info"]
        assert infos["_final_obs"] is not infos["_final_info"]
        assert infos["_final_obs"].all() and infos["final_obs"].dtype == object
    finally:
        envs.close()


class CountingLeanEnv(LeanSyncVectorEnv):
    """Counts the calls of Gymnasium's generic info batching, ``_add_info``."""

    calls = 0

    def _add_info(self, vector_infos: Any, env_info: Any, env_num: int) -> Any:
        CountingLeanEnv.calls += 1
        return super()._add_info(vector_infos, env_info, env_num)


def test_same_step_ends_with_empty_infos_take_no_generic_batching() -> None:
    """CartPole's ended envs have empty infos: their final keys need no ``_add_info``."""
    envs = CountingLeanEnv(
        [lambda: gym.make("CartPole-v1")] * 4, copy=False, autoreset_mode="SameStep"
    )
    try:
        envs.reset(seed=0)  # Gymnasium's reset calls _add_info for every env
        CountingLeanEnv.calls = 0
        ends = 0
        for _ in range(100):
            infos = envs.step(np.ones(4, dtype=np.int64))[4]
            ends += int(infos["_final_obs"].sum()) if infos else 0
        assert ends > 4  # always pushing right ends episodes within ~10 steps
        assert CountingLeanEnv.calls == 0
    finally:
        envs.close()
