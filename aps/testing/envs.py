"""Tiny deterministic envs for tests and docs.

One env per space type, each a few lines of numpy. Given the same seed they produce the same
observations, rewards, episode ends and info dicts, so a remote run can be compared step for
step with ``gymnasium.vector.SyncVectorEnv``. Episodes last 1 to ``max_steps`` steps (drawn
from the env's random generator, so envs in one vector env end at different times) and end by
termination (even lengths) or truncation (odd lengths).

Info dicts vary on purpose, to exercise Gymnasium's info batching: ints, floats, bools, numpy
scalars (including ``np.bool_``), arrays, strings, ``None``, nested dicts, keys that only some
envs or some steps have, and a key that is an int for some envs and an integral float for
others. They hold no lists (which travel as tuples).

Workers can build them by import path, for example ``"aps.testing.envs:BoxEnv"``.
"""

from __future__ import annotations

import copy
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

__all__ = [
    "ALL_ENVS",
    "ArrayObsEnv",
    "BoxEnv",
    "DictEnv",
    "DictObsEnv",
    "DiscreteEnv",
    "DiscreteObsEnv",
    "MultiBinaryEnv",
    "MultiBinaryObsEnv",
    "MultiDiscreteEnv",
    "MultiDiscreteObsEnv",
    "NestedObsEnv",
    "TinyEnv",
    "TupleEnv",
    "TupleObsEnv",
]


class TinyEnv(gym.Env[Any, Any]):
    """A deterministic env over given spaces; subclasses pick the spaces.

    Observations are samples of the observation space drawn from the env's own random
    generator. The reward is ``0.5 * t`` plus the sum of the action's numbers.

    Args:
        max_steps: the longest episode, in steps (at least 1).
        rich_info: whether step infos carry the varied keys listed in the module docstring;
            without it they carry only ``"t"``.
    """

    def __init__(
        self,
        observation_space: gym.Space[Any],
        action_space: gym.Space[Any],
        *,
        max_steps: int = 5,
        rich_info: bool = True,
    ) -> None:
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        # A copy of its own: ``_observe`` reseeds the space, and envs stepped on several
        # threads (workers in one process) must not share one generator.
        self.observation_space = copy.deepcopy(observation_space)
        self.action_space = action_space
        self._max_steps = max_steps
        self._rich_info = rich_info
        self._t = 0
        self._length = 1
        self._episodes = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Start an episode; ``options={"max_steps": k}`` overrides the episode length bound."""
        super().reset(seed=seed)
        max_steps = self._max_steps
        if options is not None and "max_steps" in options:
            max_steps = int(options["max_steps"])
        self._t = 0
        self._length = int(self.np_random.integers(1, max_steps + 1))
        self._episodes += 1
        info: dict[str, Any] = {"episode": self._episodes, "seeded": seed is not None}
        if self._rich_info and self._episodes % 2 == 0:
            info["reset_note"] = f"episode {self._episodes}"
        return self._observe(), info

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        """Advance one step; the episode ends after its drawn length."""
        self._t += 1
        reward = 0.5 * self._t + _action_sum(action)
        ended = self._t >= self._length
        terminated = ended and self._length % 2 == 0
        truncated = ended and not terminated
        return self._observe(), reward, terminated, truncated, self._step_info()

    def _observe(self) -> Any:
        # Seeding the space from the env's generator keeps observations a pure function of
        # the reset seed, whatever the space type.
        self.observation_space.seed(int(self.np_random.integers(2**31)))
        return self.observation_space.sample()

    def _step_info(self) -> dict[str, Any]:
        t = self._t
        info: dict[str, Any] = {"t": t}
        if not self._rich_info:
            return info
        u = float(self.np_random.random())
        info["score"] = u * 10.0
        info["np_f32"] = np.float32(u)
        info["np_i16"] = np.int16(t)
        if t % 2 == 0:
            info["even"] = True
        if u < 0.5:
            info["vec"] = np.arange(3, dtype=np.float32) * t
        if u < 0.3:
            info["label"] = f"step {t}"
        if u > 0.6:
            info["nested"] = {"a": t, "b": np.full(2, u), "deep": {"c": np.int16(t)}}
        if u > 0.8:
            info["np_bool"] = np.bool_(u > 0.9)
        if 0.4 < u < 0.5:
            info["nothing"] = None
        # Integral either way, so casting into the first env's dtype loses nothing.
        info["mixed"] = t if u < 0.5 else float(t)
        return info


def _action_sum(action: Any) -> float:
    if isinstance(action, dict):
        return sum(_action_sum(value) for value in action.values())
    if isinstance(action, tuple):
        return sum(_action_sum(value) for value in action)
    return float(np.sum(action))


class BoxEnv(TinyEnv):
    """Box observations (3 float32) and Box actions (2 float32)."""

    def __init__(self, *, max_steps: int = 5, rich_info: bool = True) -> None:
        super().__init__(
            spaces.Box(-1.0, 1.0, (3,), np.float32),
            spaces.Box(-1.0, 1.0, (2,), np.float32),
            max_steps=max_steps,
            rich_info=rich_info,
        )


class DiscreteEnv(TinyEnv):
    """Discrete observations (5 values from 2) and Discrete actions (3 values)."""

    def __init__(self, *, max_steps: int = 5, rich_info: bool = True) -> None:
        super().__init__(
            spaces.Discrete(5, start=2),
            spaces.Discrete(3),
            max_steps=max_steps,
            rich_info=rich_info,
        )


class MultiDiscreteEnv(TinyEnv):
    """MultiDiscrete observations ([3, 4], int32) and MultiDiscrete actions ([2, 2])."""

    def __init__(self, *, max_steps: int = 5, rich_info: bool = True) -> None:
        super().__init__(
            spaces.MultiDiscrete([3, 4], dtype=np.int32),
            spaces.MultiDiscrete([2, 2]),
            max_steps=max_steps,
            rich_info=rich_info,
        )


class MultiBinaryEnv(TinyEnv):
    """MultiBinary observations of shape (2, 3) and MultiBinary actions (4)."""

    def __init__(self, *, max_steps: int = 5, rich_info: bool = True) -> None:
        super().__init__(
            spaces.MultiBinary((2, 3)),
            spaces.MultiBinary(4),
            max_steps=max_steps,
            rich_info=rich_info,
        )


class DictEnv(TinyEnv):
    """Nested Dict observations and Dict actions (a Discrete and a Box)."""

    def __init__(self, *, max_steps: int = 5, rich_info: bool = True) -> None:
        super().__init__(
            spaces.Dict(
                {
                    "position": spaces.Box(-2.0, 2.0, (2,), np.float64),
                    "count": spaces.Discrete(4),
                    "inner": spaces.Dict({"flags": spaces.MultiBinary(2)}),
                }
            ),
            spaces.Dict(
                {"move": spaces.Discrete(3), "force": spaces.Box(-1.0, 1.0, (1,), np.float32)}
            ),
            max_steps=max_steps,
            rich_info=rich_info,
        )


class TupleEnv(TinyEnv):
    """Nested Tuple observations (uint8 image, Discrete, Tuple) and Tuple actions."""

    def __init__(self, *, max_steps: int = 5, rich_info: bool = True) -> None:
        super().__init__(
            spaces.Tuple(
                (
                    spaces.Box(0, 255, (2, 2), np.uint8),
                    spaces.Discrete(2),
                    spaces.Tuple((spaces.MultiDiscrete([2, 3]),)),
                )
            ),
            spaces.Tuple((spaces.Discrete(2), spaces.Box(-1.0, 1.0, (1,), np.float32))),
            max_steps=max_steps,
            rich_info=rich_info,
        )


class DictObsEnv(TinyEnv):
    """:class:`DictEnv`'s nested Dict observations with ``Discrete(3)`` actions.

    Structured observations and an action space a worker's own policy acts in (DETACH).
    """

    def __init__(self, *, max_steps: int = 5, rich_info: bool = True) -> None:
        super().__init__(
            DictEnv().observation_space,
            spaces.Discrete(3),
            max_steps=max_steps,
            rich_info=rich_info,
        )


class ArrayObsEnv(TinyEnv):
    """Observations of one array space (``Box`` here) with ``Discrete(3)`` actions.

    What a DETACH worker's own policy acts in, for each array space: the subclasses pick
    the others.
    """

    OBSERVATION_SPACE: spaces.Space[Any] = spaces.Box(-1.0, 1.0, (3,), np.float32)

    def __init__(self, *, max_steps: int = 5, rich_info: bool = True) -> None:
        super().__init__(
            self.OBSERVATION_SPACE, spaces.Discrete(3), max_steps=max_steps, rich_info=rich_info
        )


class DiscreteObsEnv(ArrayObsEnv):
    """:class:`DiscreteEnv`'s observations (``Discrete(5, start=2)``), ``Discrete(3)`` actions."""

    OBSERVATION_SPACE = spaces.Discrete(5, start=2)


class MultiDiscreteObsEnv(ArrayObsEnv):
    """``MultiDiscrete([3, 4])`` (int32) observations, ``Discrete(3)`` actions."""

    OBSERVATION_SPACE = spaces.MultiDiscrete([3, 4], dtype=np.int32)


class MultiBinaryObsEnv(ArrayObsEnv):
    """``MultiBinary((2, 3))`` observations, ``Discrete(3)`` actions."""

    OBSERVATION_SPACE = spaces.MultiBinary((2, 3))


class TupleObsEnv(TinyEnv):
    """:class:`TupleEnv`'s nested Tuple observations with ``Discrete(3)`` actions (as above)."""

    def __init__(self, *, max_steps: int = 5, rich_info: bool = True) -> None:
        super().__init__(
            TupleEnv().observation_space,
            spaces.Discrete(3),
            max_steps=max_steps,
            rich_info=rich_info,
        )


class NestedObsEnv(TinyEnv):
    """A Dict holding a Tuple that holds a Dict, every leaf type once, ``Discrete(2)`` actions."""

    def __init__(self, *, max_steps: int = 5, rich_info: bool = True) -> None:
        super().__init__(
            spaces.Dict(
                {
                    "image": spaces.Box(0, 255, (2, 3, 3), np.uint8),
                    "parts": spaces.Tuple(
                        (
                            spaces.Discrete(3, start=1),
                            spaces.Dict(
                                {
                                    "velocity": spaces.Box(-1.0, 1.0, (2,), np.float32),
                                    "gears": spaces.MultiDiscrete([2, 4]),
                                }
                            ),
                            spaces.MultiBinary(3),
                        )
                    ),
                }
            ),
            spaces.Discrete(2),
            max_steps=max_steps,
            rich_info=rich_info,
        )


ALL_ENVS: tuple[type[TinyEnv], ...] = (
    BoxEnv,
    DiscreteEnv,
    MultiDiscreteEnv,
    MultiBinaryEnv,
    DictEnv,
    TupleEnv,
)
"""Every tiny env, one per space type, for parametrized tests."""
