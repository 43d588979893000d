"""How a worker hosts its envs: the vector env backends.

``"sync"`` (the default) steps the envs one after another in the worker's own process, as
:class:`gymnasium.vector.SyncVectorEnv`. ``"async"`` gives each env a subprocess, as
:class:`gymnasium.vector.AsyncVectorEnv` with observations in shared memory where the space
allows it: for hosts with more cores than workers, and envs whose step costs more than a
pipe round trip. ``"envpool"`` runs EnvPool's C++ envs (:class:`EnvPoolVectorEnv`), for the
ids EnvPool has.

Every backend delivers what the worker sends on: batched observations, float64 rewards, bool
terminations and truncations, and infos in Gymnasium's vector layout (each key with a
``_key`` mask). The sync and async backends run the same env code and give identical
results for the same seeds and actions; EnvPool's envs are its own implementations, with
their own random initial states and infos.
"""

from __future__ import annotations

import difflib
import importlib
import logging
import multiprocessing
import warnings
from collections.abc import Callable, Iterable
from typing import Any, TypeAlias

import gymnasium as gym
import numpy as np
from gymnasium.error import CustomSpaceError
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv, VectorEnv
from gymnasium.vector.async_vector_env import AsyncState
from gymnasium.vector.utils import batch_space, concatenate
from gymnasium.vector.vector_env import VectorWrapper

from aps._base._imports import names_a_module
from aps.errors import ConfigError, MissingDependency
from aps.multiagent import MultiAgentVectorEnv, is_parallel_env

__all__ = [
    "VECTOR_BACKENDS",
    "AnyVectorEnv",
    "EnvPoolVectorEnv",
    "EnvProcessTraceback",
    "LeanSyncVectorEnv",
    "atari_env",
    "check_backend",
    "envpool_id",
    "make_vector_env",
]

log = logging.getLogger("aps.worker")

VECTOR_BACKENDS = ("sync", "async", "envpool")
"""The names a worker's ``vector`` argument (``aps worker --vector``) accepts."""

AnyVectorEnv: TypeAlias = VectorEnv[Any, Any, Any]
"""What :func:`make_vector_env` returns, whatever the backend."""

_SEED_LIMIT = 2**31
"""EnvPool seeds are C++ ints: env ``i`` gets ``seed + i``, which must stay below this."""


def check_backend(vector: object) -> str:
    """Return ``vector`` if it names a backend.

    Raises:
        ConfigError: it names none.
    """
    if not isinstance(vector, str) or vector not in VECTOR_BACKENDS:
        raise ConfigError(
            f"vector must be one of {', '.join(map(repr, VECTOR_BACKENDS))}, got {vector!r}; "
            "'sync' steps the envs in the worker's process, 'async' gives each env a "
            "subprocess, 'envpool' runs EnvPool's envs"
        )
    return vector


def make_vector_env(
    vector: str,
    env_fn: Callable[[], gym.Env[Any, Any]],
    *,
    num_envs: int,
    autoreset_mode: AutoresetMode,
    env: object = None,
    env_kwargs: dict[str, Any] | None = None,
    first_env: Any = None,
    multi_agent: bool = False,
) -> AnyVectorEnv:
    """Build ``num_envs`` envs as one vector env of the chosen backend.

    A PettingZoo ParallelEnv as ``first_env`` (what ``env_fn`` builds) makes the vector env
    a :class:`~aps.multiagent.MultiAgentVectorEnv` of ``num_envs`` copies, one slot per
    agent (``sync`` only).

    Args:
        vector: the backend, one of :data:`VECTOR_BACKENDS`.
        env_fn: builds one env (sync and async). For async it must survive pickling
            (cloudpickle): each subprocess builds its own env from it.
        num_envs: how many envs.
        autoreset_mode: Gymnasium's autoreset mode, as the learner asked.
        env: the env spec the worker was given; envpool needs it to be an EnvPool id.
        env_kwargs: keyword arguments for ``envpool.make`` (envpool only; ``env_fn``
            carries them for the other backends).
        first_env: the first env, already built by ``env_fn`` (sync only; the worker built
            it to learn whether the env is multi-agent).
        multi_agent: ``env_fn`` builds PettingZoo ParallelEnvs (known from an earlier
            build), whether or not ``first_env`` is given: a worker that builds its envs
            again (a session it could not resume) has none left.

    Raises:
        ConfigError: the backend cannot run these envs in this mode.
        MissingDependency: envpool is not installed.
    """
    vector = check_backend(vector)
    if first_env is not None and vector != "sync":
        raise ConfigError(f"first_env is for vector='sync' only, got vector={vector!r}")
    if vector == "sync":
        fns = [env_fn] * num_envs
        if first_env is not None:
            fns[0] = lambda: first_env
        try:
            if multi_agent or is_parallel_env(first_env):
                # copy=False: the worker encodes each result before the next step overwrites.
                return MultiAgentVectorEnv(fns, autoreset_mode=autoreset_mode, copy=False)
            return LeanSyncVectorEnv(fns, copy=False, autoreset_mode=autoreset_mode)
        except BaseException:
            if first_env is not None:
                first_env.close()  # built before the call: ours to close when it fails
            raise
    if vector == "async":
        return _RebuildOnError(lambda: _async_vector_env(env_fn, num_envs, autoreset_mode))
    return EnvPoolVectorEnv(
        envpool_id(env), num_envs=num_envs, autoreset_mode=autoreset_mode, env_kwargs=env_kwargs
    )


_ARRAY_SPACES = (
    gym.spaces.Box,
    gym.spaces.Discrete,
    gym.spaces.MultiDiscrete,
    gym.spaces.MultiBinary,
)


class LeanSyncVectorEnv(SyncVectorEnv):
    """:class:`gymnasium.vector.SyncVectorEnv` with a shorter ``step`` for array spaces.

    The results are Gymnasium's, value for value and dtype for dtype, in every autoreset
    mode (a test steps both side by side); only the work around the envs' own ``step`` is
    less: the rewards, terminations and truncations are gathered in lists and made arrays
    once (fresh arrays, as Gymnasium's copies are), the observations are batched with one
    ``np.array`` call instead of Gymnasium's generic ``concatenate``, the actions are
    iterated without ``singledispatch``, an empty info adds nothing, and in ``SameStep``
    the ended envs' ``final_obs`` and masks are laid out once per step, not env by env.
    That work is most of a one-env worker's step beside the env's, and a third of it
    beside CartPole's.

    Observations that do not come out as the batch's exact dtype and shape (an env whose
    observations do not match its space, say) are batched by Gymnasium's own code, with
    its casting and its errors. Spaces other than Box, Discrete, MultiDiscrete and
    MultiBinary, and ``copy=True``, take Gymnasium's ``step`` unchanged.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        batch = self._observations
        self._lean = (
            not self.copy
            and isinstance(self.single_observation_space, _ARRAY_SPACES)
            and isinstance(self.single_action_space, _ARRAY_SPACES)
            and isinstance(batch, np.ndarray)
        )
        self._batch_layout = (batch.dtype, batch.shape) if isinstance(batch, np.ndarray) else None
        # Whether an env ended on the last step (NextStep resets it on this one): a Python
        # bool, so a step where none did reads no numpy array for it.
        self._pending = False

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        """Reset the envs; see :meth:`gymnasium.vector.SyncVectorEnv.reset`.

        A ``reset_mask`` that marks none of these envs leaves them as they are (see
        :func:`marks_none`).
        """
        if marks_none(kwargs.get("options"), self.num_envs):
            return concatenate(self.single_observation_space, self._env_obs, self._observations), {}
        result = super().reset(**kwargs)
        self._pending = bool(self._autoreset_envs.any())
        return result

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Step every env once; see :meth:`gymnasium.vector.SyncVectorEnv.step`."""
        if not self._lean:
            return super().step(actions)
        mode = self.autoreset_mode
        envs = self.envs
        env_obs = self._env_obs
        resets = self._autoreset_envs if self._pending else None
        if mode is AutoresetMode.DISABLED and resets is not None:
            return super().step(actions)  # Gymnasium's assertion, after the envs before
        rewards: list[Any] = []
        terminations: list[Any] = []
        truncations: list[Any] = []
        infos: dict[str, Any] = {}
        # SameStep: the ended envs and their last observations, laid out once after the loop
        # (_flush_final) instead of by one _add_info call per ended env; their infos are
        # batched by _add_info as they come, so a bad info raises where Gymnasium's does.
        # ``eager``: an env's own info holds one of the final keys (or an ended env's info is
        # no dict), so from then on each ended env takes _add_info, in Gymnasium's order.
        ended: list[int] = []
        final_obs: list[Any] = []
        final_info: dict[str, Any] = {}
        eager = False
        reward: Any
        for i, (action, env) in enumerate(zip(iter(actions), envs, strict=True)):
            if resets is not None and mode is AutoresetMode.NEXT_STEP and resets[i]:
                env_obs[i], env_info = env.reset()
                reward, terminated, truncated = 0.0, False, False
            else:
                env_obs[i], reward, terminated, truncated, env_info = env.step(action)
                if mode is AutoresetMode.SAME_STEP and (terminated or truncated):
                    if not eager and type(env_info) is not dict:
                        eager = self._flush_final(infos, ended, final_obs, final_info)
                    if eager:
                        final = {"final_obs": env_obs[i], "final_info": env_info}
                        infos = self._add_info(infos, final, i)
                    else:
                        if not ended:
                            # Gymnasium's key order: the four keys stand where the first
                            # ended env puts them; _flush_final sets their values.
                            infos.update(_FINAL_KEYS)
                        ended.append(i)
                        final_obs.append(env_obs[i])
                        if env_info:
                            final_info = self._add_info(final_info, env_info, i)
                    env_obs[i], env_info = env.reset()
            rewards.append(reward)
            terminations.append(terminated)
            truncations.append(truncated)
            if env_info:
                if not eager and not _FINAL_KEYS.keys().isdisjoint(env_info):
                    eager = self._flush_final(infos, ended, final_obs, final_info)
                infos = self._add_info(infos, env_info, i)
        if ended and not eager:
            self._flush_final(infos, ended, final_obs, final_info)
        obs: Any
        try:
            obs = np.array(env_obs)
        except ValueError:  # observations of unequal shapes
            obs = None
        if obs is None or (obs.dtype, obs.shape) != self._batch_layout:
            # Gymnasium's own batching: its casting rules, and its error for a bad env.
            obs = concatenate(self.single_observation_space, env_obs, self._observations)
        reward_array = np.array(rewards, dtype=np.float64)
        terminated_array = np.array(terminations, dtype=np.bool_)
        truncated_array = np.array(truncations, dtype=np.bool_)
        self._autoreset_envs = np.logical_or(terminated_array, truncated_array)
        self._pending = any(terminations) or any(truncations)
        return obs, reward_array, terminated_array, truncated_array, infos

    def _flush_final(
        self,
        infos: dict[str, Any],
        ended: list[int],
        final_obs: list[Any],
        final_info: dict[str, Any],
    ) -> bool:
        """Set the final keys of ``infos`` for the ``ended`` envs as ``_add_info`` does.

        ``ended`` holds the envs' indices in env order and ``final_obs`` their last
        observations; ``final_info`` is their infos, already batched by ``_add_info``. With
        envs in ``ended``, the four keys already stand in ``infos`` (in Gymnasium's place);
        with none, nothing is added. As Gymnasium's: ``final_obs`` is an object array of the
        observations (``None`` for the other envs), and each key has a mask of its own.
        Returns ``True``: once flushed, the caller goes on with ``_add_info``.
        """
        if not ended:
            return True
        num_envs = self.num_envs
        obs_array = np.full(num_envs, None, dtype=object)
        for i, obs in zip(ended, final_obs, strict=True):
            obs_array[i] = obs  # one by one: assigning a list would broadcast the arrays
        mask = np.zeros(num_envs, dtype=np.bool_)
        mask[ended] = True
        infos["final_obs"] = obs_array
        infos["_final_obs"] = mask
        infos["final_info"] = final_info
        infos["_final_info"] = mask.copy()
        return True


# The keys SameStep's ended envs add to a step's infos, in Gymnasium's order.
_FINAL_KEYS: dict[str, None] = dict.fromkeys(
    ("final_obs", "_final_obs", "final_info", "_final_info")
)


def marks_none(options: object, num_envs: int) -> bool:
    """Whether ``options`` hold a ``reset_mask`` of ``num_envs`` Falses.

    The learner cuts a vector-wide ``reset_mask`` into each worker's part; a worker whose
    part marks none of its envs answers with their current observations and no infos,
    where Gymnasium's own vector envs (which see the whole mask) would refuse the mask.
    """
    if not isinstance(options, dict):
        return False
    mask = options.get("reset_mask")
    return (
        isinstance(mask, np.ndarray)
        and mask.dtype == np.bool_
        and mask.shape == (num_envs,)
        and not mask.any()
    )


def _async_vector_env(
    env_fn: Callable[[], gym.Env[Any, Any]], num_envs: int, mode: AutoresetMode
) -> _AsyncVectorEnv:
    # Not fork: the worker's process runs an event loop and often other threads (the
    # in-process workers of ClusterEnv.local share the learner's), and forking a threaded
    # process can deadlock the child. A fresh process builds its env from the pickled env_fn.
    methods = multiprocessing.get_all_start_methods()
    context = "forkserver" if "forkserver" in methods else "spawn"
    try:
        return _AsyncVectorEnv(
            [env_fn] * num_envs,
            shared_memory=True,
            copy=False,
            context=context,
            autoreset_mode=mode,
        )
    except (TypeError, ValueError) as exc:
        # Spaces with no shared-memory layout (Graph, Sequence: TypeError; a custom space:
        # ValueError from CustomSpaceError) fail before any subprocess starts; their
        # observations travel through the pipes instead. Any other error recurs below.
        if isinstance(exc, ValueError) and not isinstance(exc.__cause__, CustomSpaceError):
            raise
        log.info("observations travel through pipes, not shared memory: %s", exc)
    return _AsyncVectorEnv(
        [env_fn] * num_envs, shared_memory=False, copy=False, context=context, autoreset_mode=mode
    )


class EnvProcessTraceback(Exception):
    """The traceback of an env that raised in its subprocess (the cause of the re-raise)."""


class _AsyncVectorEnv(AsyncVectorEnv):
    """Gymnasium's AsyncVectorEnv, raising env errors without logging them as warnings.

    Gymnasium logs a subprocess's error through :mod:`warnings` before it re-raises the
    error here; where warnings are errors, that warning replaces the env's error and leaves
    the vector env waiting for a step that never comes. Here the env's own exception is
    raised, with its subprocess traceback as the cause, so the learner sees both.
    """

    def _raise_if_errors(self, successes: Iterable[bool]) -> None:
        failed = sum(not success for success in successes)
        if not failed:
            return
        errors = [self.error_queue.get() for _ in range(failed)]
        for index, _, _, _ in errors:
            # The subprocess has ended; its pipe is of no more use (as in Gymnasium's).
            self.parent_pipes[index].close()
            self.parent_pipes[index] = None  # type: ignore[call-overload]
        self._state = AsyncState.DEFAULT
        index, error_type, error, trace = errors[-1]
        if not isinstance(error, BaseException):
            error = error_type(error)
        raise error from EnvProcessTraceback(f"env {index}'s subprocess raised:\n{trace}")


class _RebuildOnError(VectorWrapper):
    """An async vector env that starts its subprocesses afresh after an env raised.

    Gymnasium's :class:`~gymnasium.vector.AsyncVectorEnv` ends the subprocess whose env
    raised and is unusable after that, but a worker outlives an env error (the error goes
    to the learner, which may reset and go on), as it does with the sync backend. The new
    envs need a reset, as after any error. Errors that leave every subprocess alive change
    nothing.
    """

    def __init__(self, build: Callable[[], _AsyncVectorEnv]) -> None:
        self._build = build
        self._pool = build()
        super().__init__(self._pool)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Reset the envs; see :meth:`gymnasium.vector.VectorEnv.reset`.

        A ``reset_mask`` that marks none of these envs leaves them as they are (see
        :func:`marks_none`).
        """
        if marks_none(options, self.num_envs):
            return self._pool.observations, {}
        try:
            return self._pool.reset(seed=seed, options=options)
        except Exception:
            self._recover()
            raise

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Step the envs; see :meth:`gymnasium.vector.VectorEnv.step`."""
        try:
            return self._pool.step(actions)
        except Exception:
            self._recover()
            raise

    def _recover(self) -> None:
        pool = self._pool
        # A subprocess whose env raised has ended, and its pipe is gone.
        pipes: list[Any] = list(pool.parent_pipes)
        if all(pipe is not None for pipe in pipes) and all(p.is_alive() for p in pool.processes):
            return
        pool.close(terminate=True)
        self._pool = self.env = self._build()


def envpool_id(env: object) -> str:
    """Check that EnvPool is installed and has the env ``env`` names; return the id.

    Raises:
        MissingDependency: EnvPool is not installed.
        ConfigError: ``env`` is no string, or no id EnvPool has; the message names the ids
            it has that come closest.
    """
    envpool = _import_envpool()
    if not isinstance(env, str) or names_a_module(env):
        raise ConfigError(
            f"vector='envpool' builds EnvPool's own envs from an id such as 'CartPole-v1', "
            f"not {env!r}; use vector='sync' or 'async' for factories"
        )
    known: list[str] = list(envpool.list_all_envs())
    if env in known:
        return env
    family = env.rpartition("-v")[0] or env
    close = [k for k in known if k.rpartition("-v")[0] == family]
    close += [k for k in difflib.get_close_matches(env, known, n=6, cutoff=0.6) if k not in close]
    hint = f"the closest ids it has: {', '.join(close[:6])}; " if close else ""
    raise ConfigError(
        f"EnvPool {getattr(envpool, '__version__', '?')} has no env {env!r}; {hint}"
        "envpool.list_all_envs() lists them all. Use one of those, or vector='sync' or "
        "'async' to run Gymnasium's"
    )


def _import_envpool() -> Any:
    try:
        # By name: envpool is optional and ships no type information.
        return importlib.import_module("envpool")
    except ImportError as exc:
        raise MissingDependency(
            f"vector='envpool' needs EnvPool ({exc}); install it with "
            "pip install 'aps-rl[envpool]' (Linux only), or use vector='sync' or 'async'"
        ) from exc


class EnvPoolVectorEnv(VectorEnv[Any, Any, Any]):
    """EnvPool's envs as a Gymnasium vector env with the worker's contract.

    EnvPool's Gymnasium mode autoresets like Gymnasium's ``NextStep`` mode (the step after
    an episode's end resets that env, with reward 0 and neither flag set). ``SameStep``
    (what Stable-Baselines3 needs) is built on it: the envs that ended are reset by id
    within the step, their last observations and infos go to ``final_obs`` and
    ``final_info`` as Gymnasium lays them out, and the reset's observations and infos
    take their place. Its differences from Gymnasium's vector envs are mapped here:

    - EnvPool seeds its envs once, when it builds them (env ``i`` gets ``seed + i``, as
      Gymnasium's ``reset(seed=seed)`` does): a reset with a seed builds the pool anew with
      that seed; a reset without one goes on from the envs' current random state.
    - Infos are EnvPool's (``env_id``, ``elapsed_step``, ``players`` and what the env adds),
      each key given its ``_key`` mask (every env has every key).
    - Rewards are float64 and the observation space is batched, as in Gymnasium.
    - Gymnasium's attributes of the envs (``render_mode``, ``metadata``, ``spec``, the
      spaces) are answered by :meth:`get_attr`; EnvPool's envs do not render.

    Reset options are refused: EnvPool takes none but ``reset_mask``, which only
    ``SameStep`` users (policy-gradient rounds) need.

    Args:
        env_id: an EnvPool id (see :func:`envpool_id`).
        num_envs: how many envs.
        autoreset_mode: ``NextStep`` or ``SameStep``.
        env_kwargs: keyword arguments for ``envpool.make`` (``max_episode_steps``,
            ``num_threads``...).
        seed: the seed of the envs before the first seeded reset (default: random).

    Raises:
        ConfigError: another autoreset mode, or arguments ``envpool.make`` refuses.
        MissingDependency: EnvPool is not installed.
    """

    def __init__(
        self,
        env_id: str,
        *,
        num_envs: int,
        autoreset_mode: AutoresetMode = AutoresetMode.NEXT_STEP,
        env_kwargs: dict[str, Any] | None = None,
        seed: int | None = None,
    ) -> None:
        mode = AutoresetMode(autoreset_mode)
        if mode is AutoresetMode.DISABLED:
            raise ConfigError(
                "vector='envpool' autoresets its envs (NextStep, or SameStep on top of it), "
                "but the learner asks for Disabled; create the learner with "
                "autoreset_mode='NextStep' or 'SameStep', or use vector='sync' or 'async'"
            )
        self.autoreset_mode = mode
        self._envpool = _import_envpool()
        self._env_id = env_id
        self._env_kwargs = dict(env_kwargs or {})
        self.num_envs = num_envs
        if seed is None:
            seed = int(np.random.SeedSequence().generate_state(1)[0]) % (_SEED_LIMIT - num_envs)
        self._pool = self._make(seed)
        self.single_observation_space = self._pool.single_observation_space
        self.single_action_space = self._pool.single_action_space
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self.action_space = batch_space(self.single_action_space, num_envs)
        self.metadata = {"autoreset_mode": mode}
        self.render_mode = None

    def _make(self, seed: int) -> Any:
        try:
            pool = self._envpool.make(
                self._env_id,
                env_type="gymnasium",
                num_envs=self.num_envs,
                seed=seed,
                **self._env_kwargs,
            )
        except Exception as exc:
            raise ConfigError(
                f"envpool.make({self._env_id!r}, num_envs={self.num_envs}, seed={seed}, "
                f"**{self._env_kwargs!r}) failed: {type(exc).__name__}: {exc}"
            ) from exc
        with warnings.catch_warnings():
            # A pool builds its spaces on first use (and keeps them), float32 Boxes from
            # float64 bounds, which Gymnasium warns about; nothing a user can act on.
            warnings.filterwarnings("ignore", ".*Box .* precision lowered", UserWarning)
            pool.observation_space, pool.action_space  # noqa: B018
        return pool

    def reset(
        self, *, seed: int | list[int | None] | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Reset every env; a seed builds the envs anew with it (see the class).

        A list of seeds, one per env, is taken when it is what an int gives (``seed + i``
        for env ``i``, as Stable-Baselines3's ``seed()`` sets them) or all ``None``.

        Raises:
            ConfigError: options were given, or a seed that is no int in
                ``[0, 2**31 - num_envs)``, or a list of seeds of another kind.
        """
        if options is not None:
            raise ConfigError(
                f"vector='envpool' takes no reset options, got {options!r}; use vector='sync' "
                "or 'async' for envs that read options"
            )
        if isinstance(seed, list | tuple):
            seed = _first_of_consecutive(seed, self.num_envs)
        if seed is not None:
            if not isinstance(seed, int) or not 0 <= seed < _SEED_LIMIT - self.num_envs:
                raise ConfigError(
                    f"vector='envpool' needs an int seed in [0, {_SEED_LIMIT - self.num_envs}), "
                    f"got {seed!r}"
                )
            self._pool.close()
            self._pool = self._make(seed)
        obs, info = self._pool.reset()
        _check_layout(obs, info)
        return obs, _vector_info(info, self.num_envs)

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Step every env; the results are laid out as Gymnasium's vector envs lay them."""
        if not isinstance(actions, dict):
            actions = np.asarray(actions)  # EnvPool reads dtype and shape; lists have none
        obs, reward, terminated, truncated, info = self._pool.step(actions)
        terminated = np.asarray(terminated, dtype=np.bool_)
        truncated = np.asarray(truncated, dtype=np.bool_)
        infos = _vector_info(info, self.num_envs)
        ended = terminated | truncated
        if self.autoreset_mode is AutoresetMode.SAME_STEP and ended.any():
            obs, infos = self._reset_ended(obs, infos, ended)
        return obs, np.asarray(reward, dtype=np.float64), terminated, truncated, infos

    def _reset_ended(
        self, obs: Any, infos: dict[str, Any], ended: np.ndarray[Any, Any]
    ) -> tuple[Any, dict[str, Any]]:
        """SameStep: reset the ``ended`` envs now, as Gymnasium's ``SameStep`` mode does.

        The step's observations and infos of those envs move to ``final_obs`` and
        ``final_info`` (an object array with ``None`` elsewhere, and infos masked to the
        ended envs); the reset's take their places. A reset env is not reset again by
        EnvPool on the next step: it steps.
        """
        ids = np.flatnonzero(ended)
        final_obs = np.full(self.num_envs, None, dtype=object)
        for i in ids:
            final_obs[i] = _take(obs, int(i))
        final_info = _masked(infos, ended)
        reset_obs, reset_info = self._pool.reset(ids.astype(np.int32))
        obs = _put(obs, ids, reset_obs)
        infos = _put(infos, ids, _vector_info(reset_info, len(ids)), masks=False)
        infos.update(
            final_obs=final_obs,
            _final_obs=ended.copy(),
            final_info=final_info,
            _final_info=ended.copy(),
        )
        return obs, infos

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """Gymnasium's attributes of each env: what EnvPool's envs have in common.

        Raises:
            AttributeError: an attribute that EnvPool's envs do not show.
        """
        known: dict[str, Any] = {
            "render_mode": None,
            "metadata": {"render_modes": []},
            "spec": None,
            "observation_space": self.single_observation_space,
            "action_space": self.single_action_space,
        }
        if name not in known:
            raise AttributeError(
                f"EnvPool's envs show no attribute {name!r} (only {', '.join(known)}); use "
                "vector='sync' or 'async' to reach the envs' own attributes"
            )
        return (known[name],) * self.num_envs

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """:meth:`get_attr`: EnvPool's envs have no methods to call by name."""
        if args or kwargs:
            raise AttributeError(
                f"EnvPool's envs have no method {name!r} to call; use vector='sync' or 'async'"
            )
        return self.get_attr(name)

    def close_extras(self, **kwargs: Any) -> None:
        """Stop EnvPool's threads."""
        self._pool.close()


def _first_of_consecutive(seeds: list[int | None] | tuple[int | None, ...], num_envs: int) -> Any:
    """The int that seeds EnvPool's envs as ``seeds`` asks, or ``None`` for all ``None``.

    Raises:
        ConfigError: ``seeds`` are not ``s, s + 1, ...`` (EnvPool seeds its envs only so).
    """
    if len(seeds) == num_envs and all(seed is None for seed in seeds):
        return None
    first = seeds[0] if seeds else None
    if (
        len(seeds) != num_envs
        or not isinstance(first, int)
        or list(seeds) != [first + i for i in range(num_envs)]
    ):
        raise ConfigError(
            f"vector='envpool' seeds env i with seed + i, so per-env seeds must be "
            f"{num_envs} consecutive ints (or all None), got {list(seeds)!r:.200}; give one int "
            "seed, or use vector='sync' or 'async' for other seeds"
        )
    return first


def _take(value: Any, index: int) -> Any:
    """Env ``index``'s part of a batch (an array, or a dict or tuple of arrays), copied."""
    if isinstance(value, dict):
        return {key: _take(item, index) for key, item in value.items()}
    if isinstance(value, tuple):
        return tuple(_take(item, index) for item in value)
    return np.array(value[index])


def _put(batch: Any, ids: np.ndarray[Any, Any], values: Any, *, masks: bool = True) -> Any:
    """A copy of ``batch`` with the rows ``ids`` replaced by ``values`` (one row per id).

    ``masks=False`` leaves the ``_key`` masks of an info dict as they are (every env has
    every key in EnvPool's infos).
    """
    if isinstance(batch, dict):
        return {
            key: item
            if (not masks and key.startswith("_"))
            else _put(item, ids, values[key], masks=masks)
            for key, item in batch.items()
        }
    if isinstance(batch, tuple):
        return tuple(_put(item, ids, value) for item, value in zip(batch, values, strict=True))
    result = np.array(batch)
    result[ids] = values
    return result


def _masked(infos: dict[str, Any], ended: np.ndarray[Any, Any]) -> dict[str, Any]:
    """The infos of the ``ended`` envs, laid out as Gymnasium's ``final_info``.

    Each key keeps its values, zeroed for the other envs, and its mask is ``ended``.
    """
    result: dict[str, Any] = {}
    for key, value in infos.items():
        if key.startswith("_"):
            continue
        if isinstance(value, dict):
            result[key] = _masked(value, ended)
        else:
            result[key] = np.where(_broadcast(ended, value), value, np.zeros_like(value))
        result[f"_{key}"] = ended.copy()
    return result


def _broadcast(mask: np.ndarray[Any, Any], value: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return mask.reshape(mask.shape + (1,) * (value.ndim - 1))


def _vector_info(info: dict[str, Any], num_envs: int) -> dict[str, Any]:
    """EnvPool's batched info dict in Gymnasium's vector layout: a ``_key`` mask per key."""
    result: dict[str, Any] = {}
    for key, value in info.items():
        if isinstance(value, dict):
            result[key] = _vector_info(value, num_envs)
        else:
            result[key] = np.asarray(value)
        result[f"_{key}"] = np.ones(num_envs, dtype=np.bool_)
    return result


def _check_layout(*values: Any) -> None:
    """Refuse arrays that repeat one element, as EnvPool builds made for NumPy 1 return.

    EnvPool 0.8.4 gives the arrays it hands NumPy 2 zero strides: every observation and info
    entry then repeats the first element (1.2.5 does not).
    """
    for value in values:
        if isinstance(value, dict):
            _check_layout(*value.values())
        elif isinstance(value, tuple | list):
            _check_layout(*value)
        elif isinstance(value, np.ndarray) and any(
            stride == 0 and size > 1
            for stride, size in zip(value.strides, value.shape, strict=True)
        ):
            raise MissingDependency(
                f"EnvPool returned an array of shape {value.shape} with strides {value.strides}: "
                f"this EnvPool build does not work with NumPy {np.__version__}; install "
                "EnvPool >= 1.2 (pip install 'aps-rl[envpool]') or NumPy < 2"
            )


def atari_env(
    env_id: str = "ALE/Pong-v5",
    *,
    noop_max: int = 30,
    frame_skip: int = 4,
    screen_size: int = 84,
    frame_stack: int = 4,
    terminal_on_life_loss: bool = False,
    repeat_action_probability: float = 0.0,
    max_episode_steps: int | None = None,
) -> gym.Env[Any, Any]:
    """An ALE Atari env with Gymnasium's Atari wrappers, built on the worker's side.

    The preprocessing of CleanRL's ``ppo_atari.py`` through Gymnasium's wrappers: up to
    ``noop_max`` no-ops after each reset, ``frame_skip`` frames per step (the max of the
    last two), ``screen_size`` x ``screen_size`` grayscale, and the last ``frame_stack``
    frames stacked, so observations are ``uint8 [frame_stack, screen_size, screen_size]``
    as EnvPool's ``Pong-v5`` gives them. Rewards are the game's own (clip them on the
    learner, as EnvPool leaves them unclipped too). Workers build it by import path:
    ``aps worker URL --env aps.vector:atari_env --env-kwargs '{"env_id": "ALE/Breakout-v5"}'``;
    the id and the numbers are data, the code is this function.

    Args:
        env_id: an ALE id (``"ALE/Pong-v5"``); the emulator's own frame skip is turned off
            since :class:`gymnasium.wrappers.AtariPreprocessing` skips frames.
        noop_max: the most no-op actions after a reset (``0``: none).
        frame_skip: emulator frames per env step, ``>= 1``.
        screen_size: the side of the square frames, ``>= 1``.
        frame_stack: frames per observation, ``>= 1``.
        terminal_on_life_loss: end an episode at each life lost.
        repeat_action_probability: sticky actions (ALE v5's default is 0.25; 0.0 as
            EnvPool's Atari and CleanRL's ``NoFrameskip-v4`` envs).
        max_episode_steps: truncate episodes after this many env steps (``None``: the id's).

    Raises:
        MissingDependency: ``ale_py`` is not installed.
        ConfigError: a number out of range, or an id ALE does not have.
    """
    for name, value, low in (
        ("noop_max", noop_max, 0),
        ("frame_skip", frame_skip, 1),
        ("screen_size", screen_size, 1),
        ("frame_stack", frame_stack, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"atari_env's {name} must be an int >= {low}, got {value!r}")
    if not 0.0 <= float(repeat_action_probability) <= 1.0:
        raise ConfigError(
            "atari_env's repeat_action_probability must be in [0, 1], got "
            f"{repeat_action_probability!r}"
        )
    try:
        ale_py = importlib.import_module("ale_py")
    except ImportError as exc:
        raise MissingDependency(
            f"atari_env needs ale-py ({exc}); install it with pip install 'aps-rl[atari]'"
        ) from exc
    gym.register_envs(ale_py)
    kwargs: dict[str, Any] = {
        "frameskip": 1,
        "repeat_action_probability": repeat_action_probability,
    }
    if max_episode_steps is not None:
        kwargs["max_episode_steps"] = max_episode_steps
    try:
        env = gym.make(env_id, **kwargs)
    except (gym.error.Error, TypeError) as exc:
        raise ConfigError(
            f"atari_env could not make {env_id!r} ({exc}); ALE ids look like 'ALE/Pong-v5'"
        ) from exc
    env = gym.wrappers.AtariPreprocessing(
        env,
        noop_max=noop_max,
        frame_skip=frame_skip,
        screen_size=screen_size,
        terminal_on_life_loss=terminal_on_life_loss,
        grayscale_obs=True,
    )
    return gym.wrappers.FrameStackObservation(env, frame_stack)
