"""What a worker runs: env specs (a Gymnasium id, an import path, a callable) and factories."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from typing import Any, Final

import gymnasium as gym

from aps._base._imports import import_object, names_a_module
from aps.errors import ConfigError

__all__ = [
    "WRAPPER_CLASSES",
    "EnvSpec",
    "check_registered",
    "describe",
    "make_env",
    "resolve_env",
    "wrapper_classes",
]

EnvSpec = str | Callable[[], gym.Env[Any, Any]]
"""A Gymnasium id (``"CartPole-v1"``), an import path (``"pkg.mod:make_env"`` or
``"path/to/file.py:make_env"``) or a callable that returns a new env.

A factory (path or callable) may return a PettingZoo ``ParallelEnv`` instead
(``"mpe2.simple_spread_v3:parallel_env"``): the worker then hosts its agents as env slots
(:mod:`aps.multiagent`)."""


def resolve_env(spec: EnvSpec, **env_kwargs: Any) -> Callable[[], gym.Env[Any, Any]]:
    """Turn an env spec into a zero-argument factory.

    Args:
        spec: a Gymnasium id, ``"module:factory"``, ``"path/to/file.py:factory"`` or a
            callable.
        env_kwargs: keyword arguments for ``gym.make`` or the factory.

    Raises:
        ConfigError: the import path cannot be resolved.
    """
    if callable(spec):
        return (lambda: spec(**env_kwargs)) if env_kwargs else spec
    if not isinstance(spec, str) or not spec:
        raise ConfigError(
            f"env must be a Gymnasium id, 'module:factory' or a callable, got {spec!r}"
        )
    # Gymnasium ids may contain ':' too ("ale_py:ALE/Pong-v5" registers through a module).
    # A spec whose attribute part names something importable is a factory path; anything
    # else goes to gym.make, which gives its own clear error for unknown ids.
    if ":" in spec and names_a_module(spec):
        factory = import_object(spec, what="env spec")
        if not callable(factory):
            raise ConfigError(f"{spec!r} names {type(factory).__name__}, not a callable")
        return (lambda: factory(**env_kwargs)) if env_kwargs else factory
    env_id = spec
    return lambda: gym.make(env_id, **env_kwargs)


def check_registered(spec: EnvSpec) -> None:
    """Refuse a Gymnasium id that ``gym.make`` would not find, now rather than when it runs.

    A worker builds its envs only once a learner has welcomed it; without this a typo in the
    id would wait for the learner (a minute, with none up) before it shows. An id whose
    module part (``"ale_py:ALE/Pong-v5"``) does not import, or whose namespace, name or
    version the registry lacks, is refused with Gymnasium's own words ("did you mean ...").
    Callables, factory paths and ids ``gym.make`` resolves by itself (an id without a
    version takes the newest) pass; this builds nothing.

    Raises:
        ConfigError: the module does not import or the registry has no such env.
    """
    if not isinstance(spec, str) or (":" in spec and names_a_module(spec)):
        return
    module, _, env_id = spec.rpartition(":")
    if module:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(
                f"env {spec!r}: its module {module!r} does not import ({exc}); install the "
                "package that registers the env, or fix the id"
            ) from exc
    try:
        gym.spec(env_id)
    except gym.error.UnregisteredEnv as exc:
        raise ConfigError(
            f"no Gymnasium env {spec!r}: {exc} (ids are case-sensitive; an env registered by "
            "a package needs 'package:Id', e.g. 'ale_py:ALE/Pong-v5')"
        ) from exc
    except gym.error.Error:
        pass  # e.g. an id without a version: gym.make takes the newest and warns


WRAPPER_CLASSES: Final = "_aps_wrapper_classes"
"""The attribute :func:`make_env` sets on each env it builds: :func:`wrapper_classes` of it."""


def make_env(spec: EnvSpec, env_kwargs: dict[str, Any]) -> gym.Env[Any, Any]:
    """A new env of ``spec``, carrying its wrapper classes in :data:`WRAPPER_CLASSES`.

    A factory's PettingZoo ``ParallelEnv`` comes back as the factory made it, with the
    attribute too (an empty set: no Gymnasium wrapper wraps it).

    An env in a subprocess (``vector="async"``) can be asked only for attributes, as data:
    noting its wrappers as it is built lets the worker answer ``is_wrapped`` (SB3's
    ``env_is_wrapped``) for it as for an env in its own process. The name is private, so
    the learner's env calls cannot reach it (see :mod:`aps.worker.steps`). An env that
    refuses new attributes goes without, and ``is_wrapped`` on it says so.
    """
    # A module-level function, so that a partial of it pickles: the async backend's
    # subprocesses build their envs by resolving the spec themselves.
    env = resolve_env(spec, **env_kwargs)()
    with contextlib.suppress(AttributeError, TypeError):
        setattr(env, WRAPPER_CLASSES, wrapper_classes(env))
    return env


def wrapper_classes(env: gym.Env[Any, Any]) -> frozenset[str]:
    """Every class (``"module.QualName"``) that a wrapper around ``env`` is an instance of."""
    names: set[str] = set()
    while isinstance(env, gym.Wrapper):
        names.update(f"{c.__module__}.{c.__qualname__}" for c in type(env).__mro__)
        env = env.env
    return frozenset(names)


def describe(spec: EnvSpec) -> str:
    """How ``spec`` is named in logs and in the learner's :class:`~aps.learner.WorkerInfo`."""
    if isinstance(spec, str):
        return spec
    return f"{getattr(spec, '__module__', '?')}:{getattr(spec, '__qualname__', repr(spec))}"
