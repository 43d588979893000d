"""What every launcher shares: the :class:`Launcher` protocol and the :class:`WorkerSpec`.

A launcher starts workers somewhere (subprocesses here, Ray actors, a Slurm job), reports
their state, notices when they die, and stops them. It never carries envs or steps itself:
each worker it starts is an ordinary aps worker that dials the learner's URL, so the learner
needs no access to the nodes' ports.

The learner completes the launcher's spec with what only it knows (its bound URL, its token,
its policy import path) and hands it to :meth:`Launcher.start`::

    launcher = aps.launch.ray("CartPole-v1", num_workers=4, envs_per_worker=8, num_cpus=1)
    envs = aps.ClusterEnv("tcp://0.0.0.0:7000", num_workers=4, token=token, launcher=launcher)
"""

from __future__ import annotations

import json
import math
import socket
import ssl
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, runtime_checkable
from urllib.parse import urlsplit, urlunsplit

from aps.errors import ConfigError
from aps.session import Timeouts
from aps.transports.base import TransportFactory
from aps.transports.registry import tls_client_factory
from aps.vector import check_backend
from aps.worker import EnvSpec

__all__ = [
    "LOG_LEVELS",
    "TOKEN_ENV",
    "LaunchStatus",
    "Launcher",
    "WorkerSpec",
    "client_factory",
    "dialable_url",
    "env_import_path",
    "per_worker",
]

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
"""The log levels ``aps worker --log-level`` accepts."""


TOKEN_ENV = "APS_TOKEN"
"""Environment variable a worker reads its token from (never the command line, which
other users of the machine can see)."""


def env_import_path(env: EnvSpec) -> str:
    """Return a spec a worker subprocess can import: an id, or ``module:name``/``file.py:name``.

    Raises:
        ConfigError: ``env`` is a lambda or a nested function that no other process can
            import.
    """
    if isinstance(env, str):
        return env
    module = getattr(env, "__module__", None)
    qualname = getattr(env, "__qualname__", "")
    if not module or not qualname or "<" in qualname or "." in qualname:
        raise ConfigError(
            f"cannot start {env!r:.200} in a worker process: it is not a module-level "
            "function; pass a Gymnasium id, a 'module:factory' string, a module-level "
            "function, a list of env functions (one per env, as AsyncVectorEnv takes), or use "
            "transport='memory' to run the envs in this process"
        )
    if module == "__main__":
        main_file = getattr(sys.modules["__main__"], "__file__", None)
        if main_file is None:
            raise ConfigError(
                f"cannot start {env!r} in a worker process: it lives in an interactive "
                "__main__; move it to a module or use transport='memory'"
            )
        return f"{Path(main_file).resolve()}:{qualname}"
    return f"{module}:{qualname}"


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerSpec:
    """What each of a launcher's workers runs, and where it dials.

    Per-worker fields are tuples with one entry per worker, or empty for "none" (no kwargs,
    no delay). Launchers that start other processes need ``env`` as a string (a Gymnasium id,
    ``"package.module:factory"`` or ``"path/to/file.py:factory"``); only in-process workers
    take a callable.

    Attributes:
        env: what each worker runs.
        num_workers: how many workers.
        envs_per_worker: envs hosted by each worker.
        env_kwargs: keyword arguments for the env factory, one dict per worker (or empty).
        seed: seed of a worker's first reset when the learner gives none; worker ``i`` seeds
            its env ``j`` with ``seed + i * envs_per_worker + j``, so the envs of all workers
            get distinct seeds, as in one vector env (``None``: unseeded).
        policy: the learner's policy import path. Launchers pass it to each worker as its
            ``--policy`` (a worker runs only a policy its own side names), and the learner
            names it in its welcome.
        token: the learner's token; launchers never put it on a command line.
        url: the learner's address, as workers dial it (filled in by :meth:`for_learner`).
        log_level: the workers' log level.
        compute_delays: seconds each worker sleeps after every env step of a gradient round
            (simulated heterogeneous speeds), one per worker (or empty).
        comm_delays: seconds each worker sleeps before each gradient report (or empty).
        connect_timeout: how long a worker keeps dialing a learner that is not up yet.
        tls_ca: a CA certificate file (PEM) on the workers' machines: workers then dial
            ``tcp://`` or ``wss://`` with TLS and check the learner's certificate against it
            (the learner listens with ``factory=TCPFactory(ssl_context=...)``).
        vector: how each worker runs its envs: ``"sync"``, ``"async"`` or ``"envpool"``
            (see :mod:`aps.vector`).
    """

    env: EnvSpec
    num_workers: int
    envs_per_worker: int = 1
    env_kwargs: tuple[dict[str, Any], ...] = ()
    seed: int | None = None
    policy: str | None = None
    token: str | None = field(default=None, repr=False)
    url: str | None = None
    log_level: str = "WARNING"
    compute_delays: tuple[float, ...] = ()
    comm_delays: tuple[float, ...] = ()
    connect_timeout: float = Timeouts().connect
    tls_ca: str | None = None
    vector: str = "sync"

    @classmethod
    def of(
        cls,
        env: EnvSpec,
        *,
        num_workers: int,
        env_kwargs: Any = None,
        compute_delays: Any = None,
        comm_delays: Any = None,
        **fields: Any,
    ) -> WorkerSpec:
        """Build a spec from a user's arguments.

        The per-worker ones may be one value for all workers, one per worker, or ``None``
        (see :func:`per_worker`).
        """
        return cls(
            env=env,
            num_workers=num_workers,
            env_kwargs=per_worker("env_kwargs", env_kwargs, num_workers, kind=dict),
            compute_delays=per_worker("compute_delays", compute_delays, num_workers, kind=float),
            comm_delays=per_worker("comm_delays", comm_delays, num_workers, kind=float),
            **fields,
        )

    def __post_init__(self) -> None:
        for name in ("num_workers", "envs_per_worker"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        seed = self.seed
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ConfigError(f"seed must be an int or None, got {self.seed!r}")
        check_backend(self.vector)
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        timeout = self.connect_timeout
        if not isinstance(timeout, int | float) or not 0 < timeout < math.inf:
            raise ConfigError(
                f"connect_timeout must be a positive number of seconds, got {timeout!r}"
            )
        for name in ("env_kwargs", "compute_delays", "comm_delays"):
            values = getattr(self, name)
            if len(values) not in (0, self.num_workers):
                raise ConfigError(
                    f"{name} has {len(values)} entries for {self.num_workers} workers; "
                    "give one each, or none"
                )
        for kwargs in self.env_kwargs:
            if not isinstance(kwargs, dict):
                raise ConfigError(f"env_kwargs entries must be dicts, got {kwargs!r}")
        for name in ("compute_delays", "comm_delays"):
            for delay in getattr(self, name):
                if not isinstance(delay, int | float) or not 0 <= delay < 3600:
                    raise ConfigError(f"{name} entries must be seconds in [0, 3600), got {delay!r}")

    def seed_of(self, index: int) -> int | None:
        """The ``--seed`` of worker ``index``: ``seed + index * envs_per_worker``."""
        return None if self.seed is None else self.seed + index * self.envs_per_worker

    def env_kwargs_of(self, index: int) -> dict[str, Any]:
        """Worker ``index``'s env factory keyword arguments."""
        return dict(self.env_kwargs[index]) if self.env_kwargs else {}

    def compute_delay_of(self, index: int) -> float:
        """Worker ``index``'s compute delay in seconds."""
        return float(self.compute_delays[index]) if self.compute_delays else 0.0

    def comm_delay_of(self, index: int) -> float:
        """Worker ``index``'s communication delay in seconds."""
        return float(self.comm_delays[index]) if self.comm_delays else 0.0

    def for_learner(
        self, url: str, *, token: str | bytes | None = None, policy: str | None = None
    ) -> WorkerSpec:
        """This spec completed with a learner's address, token and policy.

        A token or policy already in the spec must agree with the learner's.

        Raises:
            ConfigError: the spec names another token or policy than the learner, or a
                ``bytes`` token is not UTF-8 (workers read tokens as text).
        """
        if isinstance(token, bytes):
            try:
                token = token.decode()
            except UnicodeDecodeError:
                raise ConfigError(
                    "a launcher hands the token to workers as text; use a str token "
                    "(e.g. secrets.token_hex(16))"
                ) from None
        if token is not None and self.token is not None and token != self.token:
            raise ConfigError(
                "the launcher was given another token than the learner; give it to one of them"
            )
        if policy is not None and self.policy is not None and policy != self.policy:
            raise ConfigError(
                f"the launcher names policy {self.policy!r} but the learner {policy!r}; the "
                "learner's policy is the one workers load, give it there"
            )
        return replace(self, url=url, token=token or self.token, policy=policy or self.policy)

    def worker_arguments(self, index: int | None = None) -> list[str]:
        """``aps worker`` options for worker ``index`` (after the URL), never the token.

        With ``index=None`` the per-worker options (seed, kwargs, delays) are left out, for
        launchers that compute them per task.
        """
        if not isinstance(self.env, str):
            raise ConfigError(
                f"a worker in another process needs the env as a string, got {self.env!r}; "
                "use aps.launch.env_import_path(...) or a Gymnasium id"
            )
        arguments = ["--env", self.env, "--num-envs", str(self.envs_per_worker)]
        # The learner that starts them is up: a failed build reaches its user in-band.
        arguments += ["--no-check-env"]
        arguments += ["--log-level", self.log_level]
        arguments += ["--connect-timeout", repr(float(self.connect_timeout))]
        if self.tls_ca is not None:
            arguments += ["--tls-ca", str(self.tls_ca)]
        if self.vector != "sync":
            arguments += ["--vector", self.vector]
        if self.policy is not None:
            arguments += ["--policy", self.policy]
        if index is None:
            return arguments
        arguments += ["--label", str(index)]
        seed = self.seed_of(index)
        if seed is not None:
            arguments += ["--seed", str(seed)]
        if kwargs := self.env_kwargs_of(index):
            arguments += ["--env-kwargs", json.dumps(kwargs)]
        if compute := self.compute_delay_of(index):
            arguments += ["--compute-delay", repr(compute)]
        if comm := self.comm_delay_of(index):
            arguments += ["--comm-delay", repr(comm)]
        return arguments


def client_factory(url: str, tls_ca: str | None) -> TransportFactory | None:
    """The transport factory a worker dials ``url`` with.

    ``None`` (the scheme's own) without a CA file, else the transports' TLS one for
    ``url`` (:func:`aps.transports.tls_client_factory`) trusting the CA certificates in
    ``tls_ca``.

    Raises:
        ConfigError: ``tls_ca`` cannot be read, or the URL's scheme has no TLS here.
    """
    if tls_ca is None:
        return None
    try:
        context = ssl.create_default_context(cafile=tls_ca)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load the CA certificates in {tls_ca!r}: {exc}") from exc
    try:
        return tls_client_factory(url, context)
    except ConfigError as exc:
        raise ConfigError(
            f"a CA file makes workers dial with TLS: {exc}; or drop the CA file"
        ) from exc


def per_worker(
    name: str, values: Any, num_workers: int, *, kind: type[dict[str, Any]] | type[float]
) -> tuple[Any, ...]:
    """Normalize a user's per-worker argument: ``None`` -> ``()``, one value -> one each.

    Raises:
        ConfigError: a sequence of the wrong length.
    """
    if values is None:
        return ()
    if kind is dict:
        if isinstance(values, Mapping):
            return tuple(dict(values) for _ in range(num_workers)) if values else ()
        if not isinstance(values, list | tuple) or not all(isinstance(v, Mapping) for v in values):
            raise ConfigError(
                f"{name} must be a dict of keyword arguments, or a list of one dict per worker, "
                f"got {values!r}"
            )
        items = tuple(dict(v) for v in values)
    else:
        if isinstance(values, int | float):
            return (float(values),) * num_workers if values else ()
        items = tuple(values)
    if len(items) != num_workers:
        raise ConfigError(
            f"{name} has {len(items)} entries for {num_workers} workers; give one each"
        )
    return items


@dataclass(frozen=True, slots=True)
class LaunchStatus:
    """A launcher's report on its workers.

    Attributes:
        launcher: which launcher (``"local"``, ``"ray"``, ``"slurm"``).
        state: the whole launch: ``"not started"``, ``"running"``, ``"stopped"``, or the
            engine's own word (a Slurm job state such as ``"PENDING"``).
        workers: one short line per worker, where the engine knows them.
        detail: what identifies the launch (a job id, a placement group) and the engine's
            reason for its state.
    """

    launcher: str
    state: str
    workers: tuple[str, ...] = ()
    detail: str = ""

    def __str__(self) -> str:
        text = f"{self.launcher} launcher: {self.state}"
        if self.detail:
            text += f" ({self.detail})"
        if self.workers:
            text += "; workers: " + ", ".join(self.workers)
        return text


@runtime_checkable
class Launcher(Protocol):
    """Starts a learner's workers, reports on them, notices their death, and stops them.

    The learner calls :meth:`start` once it is bound, :meth:`watch` while it waits for the
    workers, and :meth:`stop` when it closes.
    """

    @property
    def spec(self) -> WorkerSpec:
        """What each worker runs (without the learner's URL and token until started)."""
        ...

    async def start(self, url: str, spec: WorkerSpec | None = None) -> None:
        """Start the workers dialing ``url``; return without waiting for them to connect.

        Args:
            url: the learner's bound address.
            spec: the workers to start (default :attr:`spec`), usually
                ``launcher.spec.for_learner(url, token=..., policy=...)``.

        Raises:
            LaunchError: the engine refused (with its own words in ``stderr``).
            MissingDependency: the engine's Python package is not installed.
        """
        ...

    async def status(self) -> LaunchStatus:
        """Report the launch's and the workers' state, as the engine sees it."""
        ...

    async def watch(self) -> None:
        """Return never while the workers live; raise when they die before :meth:`stop`.

        Raises:
            WorkerLost: a worker ended early (``worker_id`` is the launcher's index).
            LaunchError: the launch as a whole failed (a Slurm job ended).
        """
        ...

    async def stop(self, grace: float = 5.0) -> None:
        """End the workers; idempotent.

        They get ``grace`` seconds to leave after the learner's goodbye; then the launcher
        ends them (kills processes or actors, cancels the job).
        """
        ...


def dialable_url(url: str, host: str | None = None, *, default_host: str | None = None) -> str:
    """``url`` as workers on other machines dial it.

    Args:
        url: the learner's bound address.
        host: the name or address workers should dial, whatever ``url`` says.
        default_host: what replaces a wildcard host (``0.0.0.0``, ``::``) when ``host`` is
            not given; default this machine's host name. Other addresses stay as they are.
    """
    parts = urlsplit(url)
    if not parts.netloc or (host is None and parts.hostname not in ("0.0.0.0", "::")):
        return url  # memory:// has no host; a specific address is dialable as it is
    name = host or default_host or socket.gethostname()
    if ":" in name and not name.startswith("["):
        name = f"[{name}]"
    netloc = name if parts.port is None else f"{name}:{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))
