"""The agent module a policy wraps: its factory loaded, the module built, its weights as arrays.

:mod:`aps.policy` re-exports every name here; see it for how a policy reaches a worker.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium.vector.utils import batch_space
from torch import nn

from aps._base._imports import import_object
from aps.errors import ConfigError
from aps.policy._numpy_heads import numpy_dtype

__all__ = [
    "PolicySpec",
    "VectorEnvSpaces",
    "build_module",
    "compact_weights",
    "limit_threads",
    "load_policy_factory",
    "weights_nbytes",
    "widened",
]

PolicySpec = str | Callable[..., nn.Module]
"""An import path (``"pkg.module:make_agent"``, ``"path/to/script.py:Agent"``) or a callable
that builds the agent module."""


def limit_threads(n: int = 1) -> None:
    """Limit the CPU threads this process acts with to ``n``: torch's and NumPy's BLAS.

    Call it once in each worker process: many workers on few cores each running a thread
    pool of one thread per core oversubscribe the machine. That holds for torch's intra-op
    threads and for the BLAS library under NumPy, which :meth:`Policy.act` uses for plain MLP
    heads and whose idle threads spin on a core for a while after each call. The BLAS limit
    goes through ``threadpoolctl``, which knows OpenBLAS, MKL and BLIS. aps calls this in
    its workers, never on import.

    Raises:
        ConfigError: ``n`` is not an int >= 1.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"limit_threads needs an int >= 1, got {n!r}")
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(n)
    threadpool_limits(limits=n, user_api="blas")  # for the life of the process


def weights_nbytes(weights: Mapping[str, np.ndarray]) -> int:
    """The total size in bytes of the arrays of a weights dict (what a sync puts on the wire)."""
    return sum(int(array.nbytes) for array in weights.values())


def compact_weights(weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``weights`` with every float array wider than ``float16`` rounded to ``float16``.

    Half the bytes of a float32 policy on the wire; :meth:`Policy.set_weights` with
    ``widen=True`` loads the result into the full-precision module. Other arrays (integer
    buffers, float16 ones) are passed through as they are.
    """
    return {
        name: array.astype(np.float16) if array.dtype.kind == "f" and array.itemsize > 2 else array
        for name, array in weights.items()
    }


def widened(
    weights: Mapping[str, np.ndarray], state: Mapping[str, torch.Tensor]
) -> Mapping[str, np.ndarray]:
    """``weights`` with each float16 array cast back to the dtype of its tensor in ``state``.

    What :func:`compact_weights` rounded is loaded into the full-precision module this way;
    arrays that are not float16, or that ``state`` does not hold, are passed through.
    """
    out = dict(weights)
    for name, array in weights.items():
        tensor = state.get(name)
        if not isinstance(array, np.ndarray) or tensor is None or array.dtype != np.float16:
            continue  # set_weights reports whatever is wrong with it
        expected = numpy_dtype(tensor.dtype)
        if expected is not None and expected.kind == "f" and expected.itemsize > 2:
            out[name] = array.astype(expected)
    return out


def load_policy_factory(spec: PolicySpec) -> Callable[..., nn.Module]:
    """Resolve a policy import path to the callable that builds the agent.

    Args:
        spec: ``"pkg.module:attr"`` (imported with :func:`importlib.import_module`),
            ``"path/to/script.py:attr"`` (the file is executed once per process as a module
            under a private name, so its ``if __name__ == "__main__":`` block does not run; a
            relative path is relative to the current directory), or a callable, returned as
            is. ``attr`` may be dotted (``"pkg.module:Agents.small"``).

    Returns:
        The callable; :func:`build_module` calls it.

    Raises:
        ConfigError: the path is malformed, the module or file cannot be imported (the
            original exception is chained), the attribute is missing or not callable.
    """
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise ConfigError(
            f"a policy must be 'pkg.module:factory', 'path/to/script.py:Factory' or a "
            f"callable, got {spec!r}"
        )
    target = import_object(spec, what="policy")
    if not callable(target):
        raise ConfigError(
            f"policy {spec!r} names a {type(target).__name__}, not a class or function"
        )
    return target  # type: ignore[no-any-return]


@dataclass(frozen=True)
class VectorEnvSpaces:
    """The spaces of a one-env vector env, for factories written as ``Agent(envs)``.

    CleanRL's agents read ``envs.single_observation_space`` and ``envs.single_action_space``
    (and some ``envs.observation_space``); this object has those, and nothing else of a
    vector env.

    Attributes:
        single_observation_space: the observation space of one env.
        single_action_space: the action space of one env.
        observation_space: ``single_observation_space`` batched for one env.
        action_space: ``single_action_space`` batched for one env.
        num_envs: always 1.
    """

    single_observation_space: gym.Space[Any]
    single_action_space: gym.Space[Any]
    observation_space: gym.Space[Any]
    action_space: gym.Space[Any]
    num_envs: int = 1

    @classmethod
    def of(cls, observation_space: gym.Space[Any], action_space: gym.Space[Any]) -> VectorEnvSpaces:
        """Build the stand-in from the single spaces."""
        return cls(
            single_observation_space=observation_space,
            single_action_space=action_space,
            observation_space=batch_space(observation_space, 1),
            action_space=batch_space(action_space, 1),
        )


def _takes_envs(factory: Callable[..., Any], given: Mapping[str, Any]) -> bool:
    """Whether the factory has exactly one required positional parameter left to fill."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [
        p
        for p in signature.parameters.values()
        if p.kind in positional and p.default is p.empty and p.name not in given
    ]
    variadic = any(
        p.kind is inspect.Parameter.VAR_POSITIONAL for p in signature.parameters.values()
    )
    return len(required) == 1 and not variadic


def build_module(
    factory: Callable[..., nn.Module],
    observation_space: gym.Space[Any],
    action_space: gym.Space[Any],
    **kwargs: Any,
) -> nn.Module:
    """Call a policy factory and check that it built an ``nn.Module``.

    When the factory has exactly one required positional parameter (CleanRL's
    ``Agent(envs)``), it is called with a :class:`VectorEnvSpaces`; otherwise with
    ``(observation_space, action_space)``. ``kwargs`` are passed through either way.

    Args:
        factory: a class or function, usually from :func:`load_policy_factory`.
        observation_space: the observation space of one env.
        action_space: the action space of one env.
        kwargs: extra keyword arguments for the factory.

    Raises:
        ConfigError: the factory raised (the exception is chained) or returned something
            other than an ``nn.Module``.
    """
    name = getattr(factory, "__qualname__", repr(factory))
    try:
        if _takes_envs(factory, kwargs):
            module = factory(VectorEnvSpaces.of(observation_space, action_space), **kwargs)
        else:
            module = factory(observation_space, action_space, **kwargs)
    except Exception as exc:
        raise ConfigError(
            f"policy factory {name} raised {type(exc).__name__}: {exc}; it is called as "
            "factory(envs) with envs.single_observation_space/single_action_space, or as "
            "factory(observation_space, action_space)"
        ) from exc
    if not isinstance(module, nn.Module):
        raise ConfigError(
            f"policy factory {name} returned {type(module).__name__}, not a torch.nn.Module"
        )
    return module


def _attr(module: nn.Module, name: str) -> Any:
    return getattr(module, name)
