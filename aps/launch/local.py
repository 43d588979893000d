"""Start workers on this machine: subprocesses for real transports, tasks for ``memory://``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import cloudpickle
import gymnasium as gym

from aps.errors import ConfigError, InvalidState, WorkerLost
from aps.launch._thunks import ENV_SPEC, EnvFns, stdin_command
from aps.launch.base import TOKEN_ENV, LaunchStatus, WorkerSpec, env_import_path
from aps.session import Timeouts
from aps.worker import EnvSpec, Worker
from aps.worker.envs import check_registered

__all__ = ["LocalWorkers", "env_import_path", "terminate"]

log = logging.getLogger("aps.launch")


class LocalWorkers:
    """Runs ``num_workers`` workers on this machine for one learner URL; a :class:`Launcher`.

    Workers for ``memory://`` run as tasks on the caller's event loop (the memory transport
    only reaches within one process); every other scheme gets one ``python -m aps worker``
    subprocess per worker.

    Args:
        env: what each worker runs, or a list of ``num_workers * envs_per_worker`` env
            functions (thunks, closures welcome, as ``AsyncVectorEnv`` takes them): worker
            ``i`` builds its envs with its slice of them, received as they are (``memory://``)
            or pickled over its stdin (subprocesses; see :mod:`aps.launch._thunks`).
        num_workers: how many workers.
        envs_per_worker: envs hosted by each worker.
        env_kwargs: keyword arguments for the env factory; a list gives each worker its own
            (heterogeneous environments, e.g. ``[{"g": 9.8}, {"g": 4.0}]``).
        compute_delays: per-worker seconds slept after each env step of a gradient round
            (simulated heterogeneous speeds, e.g. ``[sqrt(i) * 0.01 for i in range(1, n + 1)]``).
        comm_delays: per-worker seconds slept before each gradient report.
        token: the learner's token, handed to subprocesses through their environment.
        timeouts: deadlines for in-process workers.
        use_uvloop: forwarded to subprocess workers (``--no-uvloop`` when ``False``).
        log_level: subprocess workers' log level (they share the caller's terminal).
        seed: first-reset seed when the learner gives none (see :class:`WorkerSpec`).
        restart: start a new worker in place of one that ends early (a crash, a kill), up to
            ``max_restarts`` times in all; pair it with the learner's
            ``on_worker_lost="wait"``, which gives the new worker the lost one's envs.
        max_restarts: the most replacements :attr:`restart` starts.
        vector: how each worker runs its envs: ``"sync"``, ``"async"`` (a subprocess per
            env) or ``"envpool"`` (see :mod:`aps.vector`).
        tls_ca: a CA certificate file (PEM): subprocess workers dial with TLS and check the
            learner's certificate against it (``aps worker --tls-ca``).
        policy: the policy import path the workers may run (``aps worker --policy``). A
            learner started with this launcher passes its own; workers started by hand for a
            learner with a policy need it.
    """

    def __init__(
        self,
        env: EnvSpec | Sequence[Callable[[], gym.Env[Any, Any]]],
        *,
        num_workers: int,
        envs_per_worker: int,
        env_kwargs: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
        compute_delays: Sequence[float] | None = None,
        comm_delays: Sequence[float] | None = None,
        token: str | None = None,
        timeouts: Timeouts | None = None,
        use_uvloop: bool | None = None,
        log_level: str = "WARNING",
        seed: int | None = None,
        restart: bool = False,
        max_restarts: int = 100,
        vector: str = "sync",
        tls_ca: str | None = None,
        policy: str | None = None,
    ) -> None:
        if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
            raise ConfigError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
        self._env_fns: list[Callable[[], gym.Env[Any, Any]]] = []
        spec_env: Any = env
        if isinstance(env, list | tuple):
            self._env_fns = _check_env_fns(env, num_workers, envs_per_worker, env_kwargs, vector)
            spec_env = ENV_SPEC
        elif vector != "envpool":
            # The workers run here, with this interpreter's packages: an id they would refuse
            # is refused now, in the caller's own process, before any worker starts.
            check_registered(spec_env)
        self._spec = WorkerSpec.of(
            spec_env,
            num_workers=num_workers,
            envs_per_worker=envs_per_worker,
            env_kwargs=env_kwargs,
            compute_delays=compute_delays,
            comm_delays=comm_delays,
            token=token,
            log_level=log_level,
            seed=seed,
            connect_timeout=(timeouts or Timeouts()).connect,
            vector=vector,
            tls_ca=tls_ca,
            policy=policy,
        )
        self.num_workers = num_workers
        self.envs_per_worker = envs_per_worker
        self._timeouts = timeouts
        self._use_uvloop = use_uvloop
        self._processes: list[subprocess.Popen[bytes]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._state = "not started"
        self.restart = restart
        self.max_restarts = max_restarts
        self.restarts = 0
        """Workers started in place of ones that ended early."""
        self._respawn: list[Callable[[], Any]] = []  # per worker: how to start it again
        self._supervisor: asyncio.Task[None] | None = None

    @property
    def spec(self) -> WorkerSpec:
        """What each worker runs."""
        return self._spec

    async def start(self, url: str, spec: WorkerSpec | None = None) -> None:
        """Start the workers dialing ``url``; returns without waiting for them to connect.

        Args:
            url: the learner's address.
            spec: the workers (default :attr:`spec`); a learner passes its token and policy in.
        """
        spec = replace(spec or self._spec, url=url)
        if self._state == "running":
            raise InvalidState("these local workers are already started; stop() them first")
        if url.startswith("memory:"):
            if spec.tls_ca is not None:
                raise ConfigError(
                    f"tls_ca={spec.tls_ca!r} with {url}: in-process memory:// workers have no "
                    "TLS; drop tls_ca or listen on tcp://"
                )
            self._start_tasks(url, spec)
        else:
            self._start_processes(url, spec)
        self._state = "running"
        if self.restart:
            self._supervisor = asyncio.create_task(self._supervise(), name="aps local restarts")

    async def _supervise(self) -> None:
        """Start a new worker in place of each one that ended, while restarts remain."""
        while self.restarts < self.max_restarts:
            for index, process in enumerate(self._processes):
                if process.poll() is not None and self.restarts < self.max_restarts:
                    log.warning(
                        "local worker %d (pid %d) exited with %s; starting a new one",
                        *(index, process.pid, process.returncode),
                    )
                    self._processes[index] = self._respawn[index]()
                    self.restarts += 1
            for index, task in enumerate(self._tasks):
                if task.done() and self.restarts < self.max_restarts:
                    log.warning("local worker task %d ended; starting a new one", index)
                    self._tasks[index] = self._respawn[index]()
                    self.restarts += 1
            await asyncio.sleep(0.1)

    def _start_tasks(self, url: str, spec: WorkerSpec) -> None:
        for index in range(spec.num_workers):

            def start(index: int = index) -> asyncio.Task[None]:
                worker = Worker(
                    url,
                    EnvFns(self._slice(index)) if self._env_fns else spec.env,
                    num_envs=spec.envs_per_worker,
                    seed=spec.seed_of(index),
                    env_kwargs=spec.env_kwargs_of(index),
                    token=spec.token,
                    timeouts=self._timeouts,
                    compute_delay=spec.compute_delay_of(index),
                    comm_delay=spec.comm_delay_of(index),
                    label=str(index),
                    policy=spec.policy,
                    vector=spec.vector,
                )
                return asyncio.create_task(worker.run(), name=f"aps worker {index}")

            self._respawn.append(start)
            self._tasks.append(start())

    def _slice(self, index: int) -> list[Callable[[], gym.Env[Any, Any]]]:
        """Worker ``index``'s env functions."""
        size = self._spec.envs_per_worker
        return self._env_fns[index * size : (index + 1) * size]

    def _start_processes(self, url: str, spec: WorkerSpec) -> None:
        spec = replace(spec, env=env_import_path(spec.env))
        # -P: the current directory must not shadow the aps this process runs (the workers
        # get this process's import path through PYTHONPATH instead).
        command = [sys.executable, "-P", "-m", "aps", "worker", url]
        payloads: list[bytes | None] = [None] * spec.num_workers
        if self._env_fns:
            command = [*stdin_command(), url]
            payloads = [
                _pickled(self._slice(i), i * spec.envs_per_worker) for i in range(spec.num_workers)
            ]
        if self._use_uvloop is False:
            command.append("--no-uvloop")
        environ = dict(os.environ)
        if spec.token is not None:
            environ[TOKEN_ENV] = spec.token
        # The workers import the same code as this process: give them its import path.
        paths = [p or os.getcwd() for p in sys.path]
        environ["PYTHONPATH"] = os.pathsep.join(paths)
        for index in range(spec.num_workers):
            arguments = command + spec.worker_arguments(index)
            self._respawn.append(partial(_spawn, arguments, environ, payloads[index]))
            self._processes.append(self._respawn[index]())

    async def status(self) -> LaunchStatus:
        """The launch state and each worker's: ``pid N running``, ``exited with N``."""
        workers = []
        for process in self._processes:
            code = process.poll()
            what = "running" if code is None else f"exited with {code}"
            workers.append(f"pid {process.pid} {what}")
        for index, task in enumerate(self._tasks):
            workers.append(f"task {index} {'done' if task.done() else 'running'}")
        return LaunchStatus("local", self._state, tuple(workers))

    async def watch(self) -> None:
        """Return never while the workers live; raise when one of them ends early.

        With :attr:`restart`, a worker that ends is replaced instead, until the restarts
        run out.

        Raises:
            WorkerLost: a worker process exited or a worker task finished before its learner
                closed; the message carries the exit status or the error.
        """
        while True:
            if not self.restart or self.restarts >= self.max_restarts:
                self._raise_if_ended()
            await asyncio.sleep(0.05)

    def _raise_if_ended(self) -> None:
        for index, process in enumerate(self._processes):
            code = process.poll()
            if code is not None:
                raise WorkerLost(
                    f"local worker process {index} (pid {process.pid}) exited with status "
                    f"{code} before the learner closed; its output (stderr) says why",
                    worker_id=index,
                )
        for index, task in enumerate(self._tasks):
            if task.done():
                exc = task.exception() if not task.cancelled() else None
                raise WorkerLost(
                    f"local worker task {index} ended early: {exc!r}", worker_id=index
                ) from exc

    async def stop(self, grace: float = 5.0) -> None:
        """Wait up to ``grace`` seconds for the workers to leave, then end them; idempotent."""
        if self._supervisor is not None:
            self._supervisor.cancel()
            await asyncio.wait([self._supervisor])
            self._supervisor = None
        if self._tasks:
            done, pending = await asyncio.wait(self._tasks, timeout=grace)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    log.debug("worker task ended with %r", task.exception())
            self._tasks.clear()
        if self._processes:
            await asyncio.to_thread(terminate, self._processes, grace)
            self._processes.clear()
        if self._state == "running":
            self._state = "stopped"


def _check_env_fns(
    env_fns: Sequence[object],
    num_workers: int,
    envs_per_worker: int,
    env_kwargs: object,
    vector: str,
) -> list[Callable[[], gym.Env[Any, Any]]]:
    """Check a list of env functions against the workers that will build them."""
    for index, fn in enumerate(env_fns):
        if not callable(fn):
            raise ConfigError(
                f"env function {index} is {fn!r:.100}, not a callable; a list of env functions "
                "holds one function per env, each returning a new env"
            )
    total = num_workers * envs_per_worker if isinstance(num_workers, int) else None
    if isinstance(envs_per_worker, int) and len(env_fns) != total:
        raise ConfigError(
            f"{len(env_fns)} env functions for {num_workers} workers x {envs_per_worker} envs "
            f"= {total} envs; give one function per env (num_envs=len(env_fns) splits them)"
        )
    if env_kwargs:
        raise ConfigError(
            "env_kwargs with a list of env functions: the functions take no arguments; "
            "bind the keyword arguments inside each function"
        )
    if vector != "sync":
        raise ConfigError(
            f"vector={vector!r} with a list of env functions: each worker builds them in its "
            "own process one by one; use vector='sync' (more workers give more processes)"
        )
    return list(env_fns)  # type: ignore[arg-type]


def _pickled(fns: list[Callable[[], gym.Env[Any, Any]]], first: int) -> bytes:
    """``fns`` as the bytes a worker subprocess reads from its stdin (cloudpickle)."""
    try:
        return cloudpickle.dumps(fns)  # type: ignore[no-any-return]  # untyped package
    except Exception as exc:
        raise ConfigError(
            f"cannot hand env functions {first}..{first + len(fns) - 1} to a worker process: "
            f"pickling them failed ({type(exc).__name__}: {exc}); build what they capture "
            "inside the function, or use transport='memory' to run the envs in this process"
        ) from exc


def _spawn(arguments: list[str], environ: dict[str, str], payload: bytes | None) -> Any:
    """Start a worker process; one that reads env functions gets them on its stdin."""
    if payload is None:
        return subprocess.Popen(arguments, env=environ)
    process = subprocess.Popen(arguments, env=environ, stdin=subprocess.PIPE)
    assert process.stdin is not None
    try:
        process.stdin.write(payload)
    except BrokenPipeError:
        pass  # the child ended before reading: watch() reports its exit status
    finally:
        with contextlib.suppress(BrokenPipeError):
            process.stdin.close()
    return process


def terminate(processes: list[subprocess.Popen[bytes]], grace: float) -> None:
    """Wait up to ``grace`` seconds in all for ``processes`` to exit, then terminate, then kill.

    Blocking; safe to call from an ``atexit`` hook.
    """
    deadline = time.monotonic() + grace
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=max(deadline - time.monotonic(), 0.0))
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
