"""The blocking facade: :class:`ClusterEnv`, a real :class:`gymnasium.vector.VectorEnv`.

There is one implementation: the async :class:`~aps.learner.Learner`. ``ClusterEnv`` runs it
on one private event loop (:class:`aps.session._portal.Portal`: run by the caller's
thread during each call, by a keeper thread between calls) and returns each call's
result, so a CleanRL-style script changes one line to spread its envs over processes and machines.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (see _register_exit below)
import contextlib
import dataclasses
import itertools
import logging
import os
import secrets
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Literal, NoReturn, Self, TypeVar, Unpack

import gymnasium as gym
import numpy as np
from gymnasium.vector import VectorEnv

from aps._base._typing import Array, Info
from aps.errors import ConfigError, ConnectError, InvalidState, WorkerError, rebuilt
from aps.launch.local import LocalWorkers
from aps.learner import Learner, WorkerInfo
from aps.learner.config import LearnerOptions, ListenOptions, refuse_unknown
from aps.learner.fanout import WeightGroup
from aps.learner.rollouts import Metrics, Rollout
from aps.session import Timeouts
from aps.session._portal import Pending, Portal
from aps.transports.base import Listener
from aps.transports.registry import default_local_transports, local_listen_url
from aps.wire.compression import check_setting as check_compression
from aps.worker import EnvSpec

__all__ = ["ClusterEnv", "as_raised"]

log = logging.getLogger("aps.cluster_env")

T = TypeVar("T")
X = TypeVar("X")


async def _snapshot(learner: Learner) -> Metrics:
    return learner.metrics


async def _awaited(awaitable: Awaitable[T]) -> T:
    return await awaitable


_UNKNOWN = object()


def _check_on_worker_lost(value: object) -> None:
    """Refuse the one word of the learner's vocabulary a fixed-size vector env cannot keep.

    Raises:
        ConfigError: ``value`` is ``"drop"``. Other words are the learner's to check.
    """
    if value == "drop":
        raise ConfigError(
            "on_worker_lost='drop' cannot apply to a ClusterEnv: a Gymnasium VectorEnv steps "
            "all of its num_envs every call, and a dropped worker's envs would be missing; "
            "use 'raise' or 'wait' (a replacement worker takes the envs over), or "
            "aps.Learner(on_worker_lost='drop') for chunk streams and gradient rounds"
        )


def as_raised(error: WorkerError) -> Exception:
    """The exception an env's error is raised as on the learner, as Gymnasium raises it.

    Gymnasium's ``AsyncVectorEnv`` raises its subprocess's exception again in the main
    process; here a worker's exception of a built-in type of an allow-list
    (:data:`aps.errors.REBUILT_TYPES`: ``RuntimeError``, ``ValueError``, ``AssertionError``...)
    is raised as that type, with the worker's message, and with ``error`` (which holds the
    worker's traceback) as its cause. Any other type (``StopIteration``, ``MemoryError``, the
    env's own, a library's, aps's) is raised as the :class:`~aps.errors.WorkerError` itself,
    which names it. See :func:`aps.errors.rebuilt`.
    """
    return rebuilt(error)


_OPEN: set[ClusterEnv] = set()
"""Envs not closed yet; closed when the interpreter exits."""


def _close_at_exit() -> None:
    """Close every open env, silently: the script ended without ``close()``.

    Registered with :mod:`threading`'s exit hooks where it has them: those run before the
    interpreter stops its thread pools (registered earlier, so they run later), which the
    launchers' ``stop`` still needs; a plain ``atexit`` hook runs after that and fails.
    """
    for env in list(_OPEN):
        try:
            env.close()
        except BaseException as exc:  # exiting: nothing to raise to, and nobody to tell but a log
            log.debug("closing %r at exit failed: %r", env, exc)


# concurrent.futures.thread is imported above, before this registration, because threading
# runs its exit hooks last in, first out: the thread pools stop after our hook has run.
_register_exit = getattr(threading, "_register_atexit", atexit.register)
_register_exit(_close_at_exit)

# A forked child (multiprocessing's default on Linux: AsyncVectorEnv's subprocesses) runs
# threading's exit hooks as it ends; the envs it inherited belong to the parent, whose loop
# thread did not come along: closing them there would wait forever, and would say goodbye
# on the parent's connections.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_OPEN.clear)


def _raise_as_gymnasium(error: WorkerError) -> NoReturn:
    raised = as_raised(error)
    if raised is error:
        raise error
    raise raised from error


def _split(
    num_envs: int | None, num_workers: int | None, envs_per_worker: int | None
) -> tuple[int, int]:
    """``(num_workers, envs_per_worker)`` from what :meth:`ClusterEnv.local` was given."""
    for name, value in (
        ("num_envs", num_envs),
        ("num_workers", num_workers),
        ("envs_per_worker", envs_per_worker),
    ):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
    if num_envs is None:
        return num_workers or 2, envs_per_worker or 1
    if num_workers is None and envs_per_worker is None:
        cpus = os.cpu_count() or 1
        num_workers = max(d for d in range(1, min(num_envs, cpus) + 1) if num_envs % d == 0)
    if num_workers is None:
        assert envs_per_worker is not None
        num_workers = num_envs // envs_per_worker
    if envs_per_worker is None:
        envs_per_worker = num_envs // num_workers
    if num_workers * envs_per_worker != num_envs:
        raise ConfigError(
            f"num_envs={num_envs} cannot be split into num_workers={num_workers} x "
            f"envs_per_worker={envs_per_worker}; give a num_workers that divides num_envs, "
            "or leave num_workers and envs_per_worker out"
        )
    return num_workers, envs_per_worker


class ClusterEnv(VectorEnv):
    """A Gymnasium vector env whose envs live on aps workers.

    ``ClusterEnv(url, num_workers=...)`` listens on ``url`` and waits (up to
    ``timeouts.connect``) for workers started elsewhere (``aps worker URL --env ...``);
    :meth:`local` also starts the workers. Envs are ordered by worker (by label when the
    labels are ``0``..``n-1``, as launchers set them; else by registration), then env
    index; ``reset(seed=s)`` seeds env ``i`` with ``s + i`` as Gymnasium does; autoreset
    happens on the workers exactly as in Gymnasium's own vector envs; infos are merged with
    ``_key`` masks.

    Beyond Gymnasium's ``reset``/``step``, the envs are reached by name as Gymnasium's
    vector envs reach theirs (:meth:`call`, :meth:`get_attr`, :meth:`set_attr`,
    :meth:`render`): on the workers, with arguments and results that travel as data.
    At interpreter exit an env that was not closed is closed (its local workers stop), without
    a word; after :meth:`close`, every method raises :class:`~aps.errors.InvalidState`.

    As Gymnasium's vector envs: ``metadata`` (the envs', with ``autoreset_mode``),
    ``render_mode`` and ``spec`` come from env 0 (``spec`` as ``gymnasium.make_vec(...,
    vectorization_mode="async")`` sets it, so ``gymnasium.make_vec(envs.spec)`` makes the
    same envs locally), ``np_random_seed`` and ``np_random`` hold one entry per env, an
    env's error is raised as its own type when it is a built-in one (:func:`as_raised`),
    and after a step that raised, stepping is refused until :meth:`reset`. A process that
    forks (``AsyncVectorEnv``'s subprocesses, ``multiprocessing``) leaves its envs to the
    parent: in the child they refuse every call, and its exit does not close them.
    """

    def __init__(
        self,
        listen: str | Listener = "tcp://127.0.0.1:0",
        *,
        num_workers: int,
        use_uvloop: bool | None = None,
        on_listening: Callable[[str], object] | None = None,
        _seed: int | None = None,
        **options: Unpack[ListenOptions],
    ) -> None:
        """Listen on ``listen`` and wait for the workers, as the class says.

        Args:
            listen: the URL to bind, or a bound listener.
            num_workers: how many workers to wait for.
            use_uvloop: run the private loop on uvloop. Default: asyncio's own loop, which
                restarts faster in the caller's thread at every call (see
                :mod:`aps.session._portal`).
            on_listening: called with the bound URL (port 0 resolved) before the constructor
                waits for the workers, e.g. to print the command that starts them elsewhere.
            **options: the learner's settings (:class:`~aps.learner.config.ListenOptions`:
                ``token``, ``autoreset_mode``, ``timeouts``, ``policy``, ``launcher``, ...),
                each as :class:`aps.Learner` takes it, with the same default. A launcher's
                workers are stopped when the env closes.

        Raises:
            Timeout: the workers did not all arrive in time.
            ConfigError: bad arguments.

        Example:
            >>> envs = ClusterEnv.local("CartPole-v1", num_workers=2, envs_per_worker=4)
            >>> obs, info = envs.reset(seed=0)
            >>> obs.shape
            (8, 4)
            >>> envs.close()
        """
        refuse_unknown(options, ListenOptions, "ClusterEnv.__init__")
        self.closed = True  # until the workers are in, close() has nothing to do
        _check_on_worker_lost(options.get("on_worker_lost", "raise"))
        self._render_mode: object = _UNKNOWN
        # Why stepping is refused until the next reset (an env raised in a step or reset).
        self._out_of_step: str | None = None
        self._pending_step: Pending[tuple[Any, Array, Array, Array, Info]] | None = None
        self._pending_rollout: Pending[Rollout] | None = None
        self._learner = Learner(listen, num_workers=num_workers, **options)
        self._default_seed = _seed
        self._portal = Portal(use_uvloop)
        try:
            self._portal.call(self._learner.start())  # starts the launcher too, once bound
            if on_listening is not None:
                on_listening(self._learner.url)
            # The wait watches the launcher: workers that die before they connect end it.
            self._portal.call(self._learner.wait_for_workers())
        except BaseException:
            self._portal.call(self._shutdown())
            self._portal.close()
            raise
        _OPEN.add(self)
        self.closed = False
        learner = self._learner
        self.num_envs = learner.num_envs
        self.single_observation_space = learner.single_observation_space
        self.single_action_space = learner.single_action_space
        self.observation_space = learner.observation_space
        self.action_space = learner.action_space
        self.observation_mode = "same"  # every worker's spaces equal the first's
        self.metadata = {"autoreset_mode": learner.autoreset_mode}
        self.spec = None
        self._describe()

    def _describe(self) -> None:
        """Take ``metadata``, ``render_mode`` and ``spec`` from env 0, as Gymnasium's do.

        The vector's ``metadata`` is a copy of the env's with ``autoreset_mode`` set, and its
        ``spec`` is the env's with the vector's arguments in ``kwargs``, as
        :func:`gymnasium.make_vec` sets it (``vectorization_mode="async"``: that spec makes
        the same envs in local subprocesses). Workers that cannot tell (EnvPool's, or an
        env whose metadata cannot travel as data) leave the defaults, with a debug line.
        """
        try:
            metadata, mode, spec = (
                self._portal.call(self._learner.env_call("get_attr", name, indices=[0]))[0]
                for name in ("metadata", "render_mode", "spec")
            )
        except WorkerError as exc:
            log.debug("the envs' metadata, render_mode and spec are unknown: %s", exc)
            return
        if isinstance(metadata, dict):
            # Lists arrive as tuples; Gymnasium's metadata holds lists (render_modes).
            self.metadata = {
                key: list(value) if isinstance(value, tuple) else value
                for key, value in metadata.items()
            }
            self.metadata["autoreset_mode"] = self._learner.autoreset_mode
        if mode is None or isinstance(mode, str):
            self._render_mode = mode
        if isinstance(spec, gym.envs.registration.EnvSpec):
            kwargs = dict(spec.kwargs)
            if self.num_envs != 1:
                kwargs["num_envs"] = self.num_envs
            kwargs["vectorization_mode"] = "async"
            self.spec = dataclasses.replace(spec, kwargs=kwargs)

    @classmethod
    def local(
        cls,
        env: EnvSpec | Sequence[Callable[[], gym.Env[Any, Any]]],
        *,
        num_workers: int | None = None,
        envs_per_worker: int | None = None,
        num_envs: int | None = None,
        transport: Literal["tcp", "unix", "ws", "memory"] | None = None,
        seed: int | None = None,
        env_kwargs: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
        use_uvloop: bool | None = None,
        vector: str = "sync",
        **options: Unpack[LearnerOptions],
    ) -> ClusterEnv:
        """Start ``num_workers`` workers on this machine and connect to them.

        Workers are subprocesses (``tcp``, ``unix``, ``ws``) or tasks on the private loop
        (``memory``); :meth:`close` and interpreter exit stop them. A random token guards the
        learner's address. With ``on_worker_lost="wait"`` a worker that ends early is replaced
        by a new local worker; ``compression="auto"`` never compresses here (every worker is
        on this host), ``"zstd"`` or ``"lz4"`` does.

        Args:
            env: a Gymnasium id, ``"module:factory"``, ``"path.py:factory"`` or a callable
                (module-level for subprocess workers; anything for ``memory``); or, as
                ``AsyncVectorEnv`` takes them, a list of env functions, one per env
                (closures welcome: the local launcher hands each worker process its slice,
                pickled over the process's stdin, never over the network).
            num_workers: how many workers (default 2, or from ``num_envs``).
            envs_per_worker: envs hosted by each worker (default 1, or from ``num_envs``).
            num_envs: the total, split evenly over the workers: given alone, over the
                largest number of workers that divides it and is at most the CPU count.
            transport: ``"unix"`` (a Unix socket in a fresh private directory: less CPU
                per message than loopback TCP), ``"tcp"``, ``"ws"`` or ``"memory"``. The
                default is ``"unix"``, or ``"tcp"`` where the platform has no Unix sockets or
                none can be bound (a warning on the ``aps.cluster_env`` logger says so).
            seed: the seed of the first :meth:`reset` that is given none, so that
                ``local(..., seed=s).reset()`` equals ``reset(seed=s)``.
            env_kwargs: keyword arguments for the env factory, or one dict per worker
                (heterogeneous environments; the spaces must still agree).
            use_uvloop: see the class.
            vector: how each worker runs its envs: ``"sync"`` (one after another),
                ``"async"`` (a subprocess per env, for many-core hosts) or ``"envpool"``
                (EnvPool's envs); see :mod:`aps.vector`.
            **options: the learner's settings (:class:`~aps.learner.config.LearnerOptions`:
                ``autoreset_mode``, ``timeouts``, ``policy``, ``compression``, ...), each as
                :class:`aps.Learner` takes it, with the same default; the address, its token
                and the launcher are this method's own.
        """
        refuse_unknown(options, LearnerOptions, "ClusterEnv.local")
        # The transports to try: the one asked for, or the host's default list, where a
        # later one is the fallback for an earlier one that cannot bind here.
        choices = default_local_transports() if transport is None else (transport,)
        urls = [local_listen_url(name) for name in choices]
        if isinstance(env, list | tuple):
            if num_envs is not None and num_envs != len(env):
                raise ConfigError(
                    f"num_envs={num_envs!r} with {len(env)} env functions; leave num_envs out "
                    "(a list of env functions makes one env each)"
                )
            num_envs = len(env)
        num_workers, envs_per_worker = _split(num_envs, num_workers, envs_per_worker)
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ConfigError(f"seed must be an int or None, got {seed!r}")
        timeouts = options.get("timeouts")
        if timeouts is not None and not isinstance(timeouts, Timeouts):
            raise ConfigError(f"timeouts must be an aps.Timeouts or None, got {timeouts!r}")
        check_compression(options.get("compression", "auto"))  # before any worker starts
        on_worker_lost = options.get("on_worker_lost", "raise")
        _check_on_worker_lost(on_worker_lost)

        def start(url: str) -> ClusterEnv:
            token = secrets.token_hex(16)
            launcher = LocalWorkers(
                env,
                num_workers=num_workers,
                envs_per_worker=envs_per_worker,
                env_kwargs=env_kwargs,
                token=token,
                timeouts=timeouts,
                use_uvloop=use_uvloop,
                restart=on_worker_lost == "wait",
                vector=vector,
            )
            return cls(
                url,
                num_workers=num_workers,
                token=token,
                use_uvloop=use_uvloop,
                launcher=launcher,
                _seed=seed,
                **options,
            )

        for url, fallback in itertools.pairwise(urls):
            try:
                return start(url)
            except ConnectError as exc:
                # The default is a convenience: where no Unix socket can be bound here (no
                # writable temporary directory, a file system without sockets), TCP still is.
                log.warning("cannot listen on %s (%s); using %s", url, exc, fallback)
        return start(urls[-1])

    async def _shutdown(self) -> None:
        await self._learner.aclose()  # stops the launcher too

    @property
    def workers(self) -> tuple[WorkerInfo, ...]:
        """The workers, in env order."""
        return self._learner.workers

    @property
    def url(self) -> str:
        """The address the workers dial (port 0 resolved); see also ``on_listening``."""
        return self._learner.url

    def reset(
        self,
        *,
        seed: int | Sequence[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> tuple[Any, Info]:
        """Reset every env; see :meth:`aps.Learner.reset` (an int, or one seed per env)."""
        if seed is None:
            seed, self._default_seed = self._default_seed, None
        result = self._batch_result(
            self._portal.call, self._learner.reset(seed=seed, options=options), "reset"
        )
        if options is None or np.all(options.get("reset_mask", True)):
            self._out_of_step = None  # every env was reset: in step again
        return result

    def step(self, actions: Any) -> tuple[Any, Array, Array, Array, Info]:
        """Step every env; see :meth:`aps.Learner.step`.

        An env that raises makes the step raise as Gymnasium's ``AsyncVectorEnv`` does (a
        built-in type as itself, see :func:`as_raised`); the other envs have stepped, so
        the batch is out of step and ``step`` refuses until :meth:`reset`.

        Raises:
            InvalidState: a ``step_async()`` is pending, or an env raised in the last step
                or reset.
        """
        if self._pending_step is not None:
            raise InvalidState("step() called while a step_async() is pending; call step_wait()")
        self._check_in_step("step")
        return self._batch_result(self._portal.call, self._learner.step(actions), "step")

    def _check_in_step(self, operation: str) -> None:
        if self.closed:
            # Before the out-of-step test: after close() that advice (reset) no longer helps.
            raise InvalidState("this ClusterEnv is closed; create a new one to step again")
        if self._out_of_step is not None:
            raise InvalidState(
                f"{operation}() refused: {self._out_of_step}, so some envs stepped and others "
                "did not; call reset() before stepping again (Gymnasium's AsyncVectorEnv "
                "refuses to go on too)"
            )

    def _batch_result(self, wait: Callable[[X], T], on: X, operation: str) -> T:
        """``wait(on)``; an env's error raised as Gymnasium's, and remembered."""
        try:
            return wait(on)
        except WorkerError as exc:
            self._out_of_step = (
                f"an env on worker {exc.worker_id} raised {exc.remote_type} in the last "
                f"{operation}()"
            )
            _raise_as_gymnasium(exc)

    def _env_call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run an env call; an env's error raised as Gymnasium's (see :func:`as_raised`)."""
        try:
            return self._portal.call(coroutine)
        except WorkerError as exc:
            _raise_as_gymnasium(exc)

    def step_async(self, actions: Any) -> None:
        """Send the actions and return at once; :meth:`step_wait` collects the results.

        The workers step while the caller computes (Gymnasium's ``AsyncVectorEnv`` names).

        Raises:
            InvalidState: a step is already pending, or an env raised in the last step or
                reset (see :meth:`step`).
        """
        if self._pending_step is not None:
            raise InvalidState("step_async() called twice; call step_wait() in between")
        self._check_in_step("step_async")
        self._pending_step = self._portal.submit(self._learner.step(actions))

    def step_wait(self) -> tuple[Any, Array, Array, Array, Info]:
        """Wait for the step :meth:`step_async` started; see :meth:`aps.Learner.step`.

        Raises:
            InvalidState: no step is pending.
        """
        pending, self._pending_step = self._pending_step, None
        if pending is None:
            raise InvalidState("step_wait() called without a step_async() before it")
        return self._batch_result(Pending.result, pending, "step")

    def publish(self, agent: Any, *, epsilon: float | None = None) -> int:
        """Make ``agent``'s weights a new policy version; see :meth:`aps.Learner.publish`."""
        return self._portal.call(self._learner.publish(agent, epsilon=epsilon))

    def form_weight_group(self, *, timeout: float | None = None) -> WeightGroup:
        """Fan versions out through one gloo group; see :meth:`aps.Learner.form_weight_group`."""
        return self._portal.call(self._learner.form_weight_group(timeout=timeout))

    @property
    def weight_group(self) -> WeightGroup | None:
        """The weight group versions fan out through, or ``None``; see :meth:`form_weight_group`."""
        return self._learner.weight_group

    def rollout(self, num_steps: int) -> Rollout:
        """Workers act ``num_steps`` times with their policies; see :meth:`aps.Learner.rollout`."""
        if self._pending_rollout is not None:
            raise InvalidState(
                "rollout() called while a rollout_async() is pending; call rollout_wait()"
            )
        return self._portal.call(self._learner.rollout(num_steps))

    def rollout_async(self, num_steps: int) -> None:
        """Start a :meth:`rollout` and return at once; :meth:`rollout_wait` collects it.

        The workers act while the caller trains on the previous batch, so acting and
        training overlap, at the price of staleness: the batch is acted with the versions
        synced when it started, one update behind the weights it will be trained on. The
        sync strategy decides at the start, as for :meth:`rollout`; :meth:`publish` first,
        to make the newest weights a candidate.

        Raises:
            InvalidState: a rollout is already pending.
        """
        if self._pending_rollout is not None:
            raise InvalidState("rollout_async() called twice; call rollout_wait() in between")
        self._pending_rollout = self._portal.submit(self._learner.rollout(num_steps))

    def rollout_wait(self) -> Rollout:
        """Wait for the rollout :meth:`rollout_async` started; see :meth:`aps.Learner.rollout`.

        Raises:
            InvalidState: no rollout is pending.
        """
        pending, self._pending_rollout = self._pending_rollout, None
        if pending is None:
            raise InvalidState("rollout_wait() called without a rollout_async() before it")
        return pending.result()

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Call method ``name(*args, **kwargs)`` of every env, on the workers.

        Gymnasium's ``VectorEnv.call``: an attribute that is not callable is returned as it
        is. Arguments and results travel as data; see :meth:`aps.Learner.call`.

        Returns:
            One value per env, in env order.

        Raises:
            ConfigError: ``name`` is not a str (to run a routine against the learner, use
                :meth:`call_learner`), or an argument is not plain data.
            WorkerError: an env raised, or returned a value that is not plain data.
        """
        if not isinstance(name, str):
            raise ConfigError(
                f"call() takes the name of an env method, as Gymnasium's vector envs do, got "
                f"{name!r}; to run an await-based routine against the learner, use "
                "call_learner(function)"
            )
        return self._env_call(self._learner.call(name, *args, **kwargs))

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """The value of attribute ``name`` of every env, in env order; see :meth:`call`.

        Spaces, env specs and ``np_random`` come back as Gymnasium's own objects, rebuilt
        from data; a Generator is a copy in the env's current state (drawing from it leaves
        the env's random state alone).
        """
        return self._env_call(self._learner.get_attr(name))

    def set_attr(self, name: str, values: Any) -> None:
        """Set attribute ``name`` of every env; see :meth:`aps.Learner.set_attr`."""
        self._env_call(self._learner.set_attr(name, values))

    def render(self) -> tuple[Any, ...] | None:
        """Every env's ``render()``, in env order, as Gymnasium's vector envs return it.

        Frames for ``render_mode="rgb_array"``; a ``None`` per env for envs made without a
        render mode.
        """
        return self._env_call(self._learner.render())

    @property
    def np_random_seed(self) -> tuple[int, ...]:  # type: ignore[override]
        """Every env's ``np_random_seed``, in env order (Gymnasium's vector envs' tuple)."""
        return self.get_attr("np_random_seed")

    @property  # type: ignore[misc]
    def np_random(self) -> tuple[np.random.Generator, ...]:  # type: ignore[override]
        """A copy of every env's ``np_random`` Generator, in env order (see :meth:`get_attr`)."""
        return self.get_attr("np_random")

    @property
    def render_mode(self) -> str | None:
        """The envs' ``render_mode``, asked of the workers once."""
        if self._render_mode is _UNKNOWN:
            modes = self.get_attr("render_mode")
            self._render_mode = modes[0] if modes else None
        assert self._render_mode is None or isinstance(self._render_mode, str)
        return self._render_mode

    @render_mode.setter
    def render_mode(self, mode: str | None) -> None:
        # Gymnasium's base class assigns it; the workers' envs decide it, so this only
        # replaces what the property reports.
        self._render_mode = mode

    def call_learner(self, function: Callable[[Learner], Awaitable[T]]) -> T:
        """Run an await-based routine against this env's learner, blocking until it returns.

        For algorithms written for :class:`aps.Learner` (``aps.pg.NIGT``'s blocking ``run``
        uses it): ``envs.call_learner(lambda learner: learner.rollout(8))``.
        """
        return self._portal.call(_awaited(function(self._learner)))

    @property
    def metrics(self) -> Metrics:
        """The learner's figures now: see :attr:`aps.Learner.metrics` and :mod:`aps.metrics`.

        Taken on the learner's loop, so the snapshot is consistent while workers answer.
        """
        return self._portal.call(_snapshot(self._learner))

    def close(self, **kwargs: Any) -> None:
        """Say goodbye to the workers, stop local ones and end the private loop; idempotent.

        Waits for a pending ``step_async``/``rollout_async`` first (its result or error is
        dropped). Afterwards every call raises :class:`~aps.errors.InvalidState` saying the
        env is closed. A ``with`` block and the interpreter's exit call it too. As
        Gymnasium's ``VectorEnv.close`` does, it calls :meth:`close_extras` once.
        """
        super().close(**kwargs)

    def close_extras(self, **kwargs: Any) -> None:
        """Say goodbye to the workers, stop local ones, and end the private loop.

        In a forked child, where the env is the parent's, this only marks the copy closed.
        """
        _OPEN.discard(self)
        if self._portal.forked:
            return
        pending: Pending[Any] | None
        for pending in (self._pending_step, self._pending_rollout):
            if pending is not None:
                with contextlib.suppress(Exception):  # closing: a failed last one changes nothing
                    pending.result()
        self._pending_step = self._pending_rollout = None
        try:
            self._portal.call(self._shutdown())
        finally:
            self._portal.close()

    def __enter__(self) -> Self:
        """``with ClusterEnv.local(...) as envs:`` closes the envs as the block ends.

        Gymnasium's ``Env`` has this; its ``VectorEnv`` (1.x) does not.
        """
        return self

    def __exit__(self, *exc_info: object) -> Literal[False]:
        """Close the envs; an error raised in the block propagates."""
        self.close()
        return False

    def __repr__(self) -> str:
        return f"ClusterEnv(num_envs={getattr(self, 'num_envs', '?')}, closed={self.closed})"
