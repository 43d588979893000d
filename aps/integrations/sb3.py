"""A Stable-Baselines3 ``VecEnv`` whose envs live on aps workers.

:class:`ClusterVecEnv` adapts a :class:`aps.ClusterEnv` to SB3's ``VecEnv`` API, so any SB3
algorithm trains on remote envs unchanged::

    from stable_baselines3 import PPO
    from aps.integrations.sb3 import ClusterVecEnv

    vec_env = ClusterVecEnv.local("CartPole-v1", num_envs=8)
    PPO("MlpPolicy", vec_env).learn(10_000)
    vec_env.close()

It behaves as SB3's ``DummyVecEnv`` over the same env functions (a test holds them equal,
step for step): ``dones`` is ``terminated | truncated``; a finished env is reset at once and
its last observation is in ``infos[i]["terminal_observation"]``,
``infos[i]["TimeLimit.truncated"]`` says whether it was cut short, and the reset's info is
in :attr:`reset_infos`; rewards are ``float32``; :meth:`seed` and :meth:`set_options` apply
to the next :meth:`reset`. ``get_attr``, ``set_attr``, ``env_method`` and
``env_is_wrapped`` run on the workers, with arguments and results that travel as data (a
wrapper class travels as its name; spaces, env specs and Generators are rebuilt);
``env_is_wrapped`` answers over every worker backend (always ``False`` over EnvPool, whose
envs no Gymnasium wrapper wraps); choosing envs with ``indices`` for the other calls needs
workers that hold their envs in their own process (``vector="sync"``, the default), while
calls on every env (``indices=None``, as SB3's algorithms make them) work over
``vector="async"`` and ``"envpool"`` too. An env
that raises makes the call raise as :class:`aps.ClusterEnv` does (a built-in type as
itself); after a failed step the adapter refuses to step until :meth:`reset`. Differences from
``DummyVecEnv``: info values are the numpy scalars of Gymnasium's vector infos, and
per-env reset options must all be equal (aps sends one options dict to every env).

Needs the optional extra ``aps-rl[sb3]`` (``stable-baselines3``).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode

from aps.cluster_env import ClusterEnv, as_raised
from aps.errors import ConfigError, MissingDependency, WorkerError
from aps.metrics.figures import Metrics
from aps.worker import EnvSpec

try:
    from stable_baselines3.common.vec_env import VecEnv
    from stable_baselines3.common.vec_env.base_vec_env import (
        VecEnvIndices,
        VecEnvObs,
        VecEnvStepReturn,
    )
except ImportError as exc:  # pragma: no cover - the extra is installed where this is tested
    raise MissingDependency(
        "aps.integrations.sb3 needs Stable-Baselines3; install it with pip install 'aps-rl[sb3]'"
    ) from exc

__all__ = ["ClusterVecEnv"]


class ClusterVecEnv(VecEnv):
    """Stable-Baselines3's ``VecEnv`` over the envs of a :class:`aps.ClusterEnv`.

    Args:
        envs: a ClusterEnv made with ``autoreset_mode="SameStep"`` (SB3 resets a finished
            env within the step); the adapter closes it in :meth:`close`.

    Raises:
        ConfigError: ``envs`` is not a ClusterEnv with the ``SameStep`` autoreset mode.
    """

    def __init__(self, envs: ClusterEnv) -> None:
        if not isinstance(envs, ClusterEnv):
            raise ConfigError(f"envs must be an aps.ClusterEnv, got {envs!r}")
        mode = envs.metadata.get("autoreset_mode")
        if mode is not AutoresetMode.SAME_STEP:
            raise ConfigError(
                f"ClusterVecEnv needs a ClusterEnv with autoreset_mode='SameStep' (SB3 resets a "
                f"finished env within the step), got {mode!r}; make it with "
                "ClusterVecEnv.local(...) or ClusterEnv(..., autoreset_mode='SameStep')"
            )
        self.envs = envs
        super().__init__(envs.num_envs, envs.single_observation_space, envs.single_action_space)

    @classmethod
    def local(cls, env: EnvSpec, **kwargs: Any) -> ClusterVecEnv:
        """Start workers on this machine: :meth:`aps.ClusterEnv.local`, in ``SameStep`` mode.

        Args:
            env: what each worker runs (see :meth:`aps.ClusterEnv.local`).
            **kwargs: the other arguments of :meth:`aps.ClusterEnv.local`.
        """
        if kwargs.get("autoreset_mode", AutoresetMode.SAME_STEP) != AutoresetMode.SAME_STEP:
            raise ConfigError(
                f"ClusterVecEnv runs its envs with autoreset_mode='SameStep', got "
                f"{kwargs['autoreset_mode']!r}; leave autoreset_mode out"
            )
        kwargs["autoreset_mode"] = AutoresetMode.SAME_STEP
        return cls(ClusterEnv.local(env, **kwargs))

    def reset(self) -> VecEnvObs:
        """Reset every env with the seeds and options set since the last reset."""
        seeds = self._seeds
        options = self._options
        if any(o != options[0] for o in options):
            raise ConfigError(
                f"set_options gave the envs different options ({options!r:.200}); aps sends "
                "one options dict to every env, so give the same to all"
            )
        obs, info = self.envs.reset(
            seed=None if all(s is None for s in seeds) else list(seeds),
            options=options[0] or None,
        )
        self.reset_infos = _per_env(info, self.num_envs)
        self._reset_seeds()
        self._reset_options()
        return obs  # type: ignore[no-any-return]

    def step_async(self, actions: np.ndarray) -> None:
        """Send the actions; the workers step while the caller goes on."""
        self.envs.step_async(actions)

    def step_wait(self) -> VecEnvStepReturn:
        """Wait for the step; finished envs are reset, as SB3's ``VecEnv`` contract says."""
        obs, reward, terminated, truncated, info = self.envs.step_wait()
        dones = terminated | truncated
        per_env = _per_env(info, self.num_envs)
        infos: list[dict[str, Any]] = []
        for i, env_info in enumerate(per_env):
            if dones[i]:
                final = env_info.pop("final_info", {})
                final["terminal_observation"] = env_info.pop("final_obs")
                self.reset_infos[i] = env_info
                env_info = final
            env_info["TimeLimit.truncated"] = bool(truncated[i] and not terminated[i])
            infos.append(env_info)
        return obs, reward.astype(np.float32), dones, infos

    @property
    def metrics(self) -> Metrics:
        """The learner's figures now (:attr:`aps.ClusterEnv.metrics`; see :mod:`aps.metrics`)."""
        return self.envs.metrics

    def close(self) -> None:
        """Close the ClusterEnv (its local workers stop); idempotent."""
        self.envs.close()

    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        """Attribute ``attr_name`` of the chosen envs (``AttributeError`` when one lacks it)."""
        return list(self._env_call("get_attr", attr_name, indices=self._indices(indices)))

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        """Set attribute ``attr_name`` of the chosen envs to ``value``."""
        chosen = self._indices(indices)
        reached = self.num_envs if chosen is None else len(chosen)
        self._env_call("set_attr", attr_name, values=[value] * reached, indices=chosen)

    def env_method(
        self,
        method_name: str,
        *method_args: Any,
        indices: VecEnvIndices = None,
        **method_kwargs: Any,
    ) -> list[Any]:
        """Call ``method_name(*method_args, **method_kwargs)`` on the chosen envs."""
        return list(
            self._env_call(
                "call",
                method_name,
                args=method_args,
                kwargs=method_kwargs or None,
                indices=self._indices(indices),
            )
        )

    def env_is_wrapped(
        self, wrapper_class: type[gym.Wrapper[Any, Any, Any, Any]], indices: VecEnvIndices = None
    ) -> list[bool]:
        """Whether ``wrapper_class`` (or a subclass, matched by name) wraps each chosen env."""
        name = f"{wrapper_class.__module__}.{wrapper_class.__qualname__}"
        chosen = self._indices(indices)
        return [bool(v) for v in self._env_call("is_wrapped", name, indices=chosen)]

    def get_images(self) -> Sequence[np.ndarray | None]:
        """Every env's frame (envs made with ``render_mode="rgb_array"``)."""
        if self.render_mode != "rgb_array":
            warnings.warn(
                f"the render mode is {self.render_mode!r}, but get_images needs 'rgb_array'",
                stacklevel=2,
            )
            return [None] * self.num_envs
        return list(self.envs.render() or ())

    def _indices(self, indices: VecEnvIndices) -> list[int] | None:
        """The chosen envs; ``None`` for all of them.

        ``None`` stays ``None``: a worker answers for all its envs at once whatever holds
        them (subprocesses, EnvPool), but only one that holds them itself answers for
        chosen ones. SB3's own calls (``render_mode`` in ``VecEnv.__init__``) reach all.
        """
        if indices is None:
            return None
        return [int(i) for i in self._get_indices(indices)]

    def _env_call(self, kind: str, name: str, **kwargs: Any) -> tuple[Any, ...]:
        try:
            return self.envs.call_learner(lambda learner: learner.env_call(kind, name, **kwargs))
        except WorkerError as exc:
            raised = as_raised(exc)
            if raised is exc:
                raise
            raise raised from exc


def _per_env(info: dict[str, Any], num_envs: int) -> list[dict[str, Any]]:
    """Split a Gymnasium vector info (arrays with ``_key`` masks) into one dict per env."""
    result: list[dict[str, Any]] = [{} for _ in range(num_envs)]
    for key, value in info.items():
        if key.startswith("_"):
            continue
        mask = info.get(f"_{key}")
        if isinstance(value, dict):
            for i, env_value in enumerate(_per_env(value, num_envs)):
                if mask is None or mask[i]:
                    result[i][key] = env_value
            continue
        for i in range(num_envs):
            if mask is None or mask[i]:
                item = value[i]
                # Decoded arrays are read-only views; SB3 and torch expect to own them.
                result[i][key] = np.array(item) if isinstance(item, np.ndarray) else item
    return result
