"""The worker role: host a Gymnasium vector env and answer the learner's requests.

A worker dials the learner (workers always dial out, so the learner needs no access to the
workers' ports), proves it knows the token, learns the autoreset mode, builds its envs as one
:class:`gymnasium.vector.SyncVectorEnv` and then answers reset and step requests with whole
batches, one message per request. An env that raises does not end the worker: the error
travels to the learner as text (type and traceback) and the worker keeps serving.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import logging
import os
import socket
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium as gym
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from aps import transports
from aps.batching import check_batch
from aps.errors import (
    ApsError,
    AuthError,
    ConfigError,
    ConnectError,
    EndOfStream,
    ProtocolError,
    Timeout,
    VersionMismatch,
)
from aps.messages import (
    PROTOCOL_VERSION,
    Challenge,
    ErrorReport,
    Hello,
    Ready,
    Reject,
    ResetRequest,
    ResetResult,
    StepRequest,
    StepResult,
    Welcome,
)
from aps.protocol import Role, prove
from aps.session import Session, Timeouts
from aps.transports.base import Transport, TransportFactory

__all__ = ["EnvSpec", "Worker", "resolve_env"]

log = logging.getLogger("aps.worker")

EnvSpec = str | Callable[[], gym.Env[Any, Any]]
"""A Gymnasium id (``"CartPole-v1"``), an import path (``"pkg.mod:make_env"`` or
``"path/to/file.py:make_env"``) or a callable that returns a new env."""

_REJECTIONS: dict[str, type[ApsError]] = {
    "AuthError": AuthError,
    "VersionMismatch": ProtocolError,
    "ConfigError": ConfigError,
}


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
    if ":" in spec:
        factory = _import_factory(spec)
        if factory is not None:
            return (lambda: factory(**env_kwargs)) if env_kwargs else factory
    env_id = spec
    return lambda: gym.make(env_id, **env_kwargs)


def _import_factory(spec: str) -> Callable[..., gym.Env[Any, Any]] | None:
    location, _, name = spec.rpartition(":")
    if location.endswith(".py"):
        path = Path(location)
        if not path.is_file():
            raise ConfigError(f"env file {location!r} does not exist (from env spec {spec!r})")
        module_name = f"_aps_env_{path.stem}_{abs(hash(path.resolve()))}"
        module = sys.modules.get(module_name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(module_name, path)
            if loader_spec is None or loader_spec.loader is None:
                raise ConfigError(f"cannot import {location!r} (from env spec {spec!r})")
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[module_name] = module
            loader_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(location)
        except ImportError:
            return None
    factory = getattr(module, name, None)
    if factory is None:
        raise ConfigError(f"{location!r} has no attribute {name!r} (from env spec {spec!r})")
    if not callable(factory):
        raise ConfigError(f"{spec!r} names {type(factory).__name__}, not a callable")
    return factory  # type: ignore[no-any-return]


def _describe(spec: EnvSpec) -> str:
    if isinstance(spec, str):
        return spec
    return f"{getattr(spec, '__module__', '?')}:{getattr(spec, '__qualname__', repr(spec))}"


class Worker:
    """Hosts ``num_envs`` copies of an env and serves one learner.

    Args:
        learner: the learner's URL (``"tcp://host:port"``), or a connected transport.
        env: what to run, see :data:`EnvSpec`.
        num_envs: how many copies this worker hosts.
        seed: the seed of the first reset when the learner resets without one (env ``j``
            gets ``seed + j``); ``None`` leaves the envs unseeded.
        token: the learner's shared secret, if it has one.
        env_kwargs: keyword arguments for the env factory.
        timeouts: deadlines; ``connect`` bounds how long the worker keeps dialing.
        factory: a transport factory to dial with, instead of the URL scheme's registered one
            (TLS and frame size limits are set there).

    Example:
        >>> worker = Worker("tcp://127.0.0.1:7000", "CartPole-v1", num_envs=8)  # doctest: +SKIP
        >>> asyncio.run(worker.run())  # doctest: +SKIP
    """

    def __init__(
        self,
        learner: str | Transport,
        env: EnvSpec,
        *,
        num_envs: int = 1,
        seed: int | None = None,
        token: str | bytes | None = None,
        env_kwargs: dict[str, Any] | None = None,
        timeouts: Timeouts | None = None,
        factory: TransportFactory | None = None,
    ) -> None:
        if not isinstance(num_envs, int) or isinstance(num_envs, bool) or num_envs < 1:
            raise ConfigError(f"num_envs must be an int >= 1, got {num_envs!r}")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ConfigError(f"seed must be an int or None, got {seed!r}")
        self._learner = learner
        self._env_fn = resolve_env(env, **(env_kwargs or {}))
        self._env_name = _describe(env)
        self.num_envs = num_envs
        self._seed = seed
        self._token = token.encode() if isinstance(token, str) else token
        self._timeouts = timeouts or Timeouts()
        self._factory = factory
        self._envs: SyncVectorEnv | None = None
        self._pending_seed = seed
        self.worker_id: int | None = None

    async def run(self) -> None:
        """Connect, serve the learner until it says goodbye, then close the envs.

        Raises:
            ConnectError | Timeout: the learner could not be reached within
                ``timeouts.connect``, or went silent for ``timeouts.heartbeat_timeout``.
            AuthError: the learner refused the token.
            ConfigError: the learner refused this worker's envs (spaces that disagree with
                the other workers', or too many workers).
            ProtocolError: the learner broke the protocol or speaks another version.
            ConnectionLost: the connection broke.
        """
        transport = await self._connect()
        session = Session(
            transport,
            Role.WORKER,
            heartbeat_interval=self._timeouts.heartbeat_interval,
        )
        try:
            await self._handshake(session)
            session.start_heartbeats()
            await self._serve(session)
        finally:
            await session.aclose()
            if self._envs is not None:
                self._envs.close()
                self._envs = None

    async def _connect(self) -> Transport:
        if not isinstance(self._learner, str):
            return self._learner
        url = self._learner
        factory = self._factory or transports.get_factory(transports.scheme_of(url))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeouts.connect
        delay = 0.05
        while True:
            left = deadline - loop.time()
            try:
                return await factory.connect(url, timeout=max(left, 0.01))
            except (ConnectError, Timeout) as exc:
                # The learner may simply not be up yet: retry until the deadline.
                if loop.time() + delay >= deadline:
                    raise Timeout(
                        f"could not reach the learner at {url} within "
                        f"{self._timeouts.connect} s (last error: {exc}); start the learner "
                        "first or raise Timeouts.connect",
                        operation="connect",
                        seconds=self._timeouts.connect,
                    ) from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def _handshake(self, session: Session) -> None:
        seconds = self._timeouts.handshake
        try:
            async with asyncio.timeout(seconds):
                answer = await self._greet(session)
        except TimeoutError as exc:
            if isinstance(exc, Timeout):
                raise
            raise Timeout(
                f"the learner at {session.peer} did not finish the handshake within {seconds} s; "
                "is it an aps learner speaking the same transport (TLS or not)?",
                operation="handshake",
                seconds=seconds,
            ) from None
        await self._build_envs(session, answer)

    async def _greet(self, session: Session) -> Welcome:
        challenge = await session.receive(timeout=None, operation="the learner's challenge")
        assert isinstance(challenge, Challenge)  # the protocol table allows nothing else
        if challenge.protocol_version != PROTOCOL_VERSION:
            raise VersionMismatch(PROTOCOL_VERSION, challenge.protocol_version)
        proof = prove(self._token, challenge.nonce) if self._token is not None else b""
        await session.send(
            Hello(
                protocol_version=PROTOCOL_VERSION,
                proof=proof,
                env_id=self._env_name,
                num_envs=self.num_envs,
                seed=self._seed,
                host=socket.gethostname(),
                pid=os.getpid(),
            )
        )
        answer = await session.receive(timeout=None, operation="the learner's welcome")
        if isinstance(answer, Reject):
            raise _REJECTIONS.get(answer.kind, ProtocolError)(
                f"the learner refused this worker: {answer.reason}"
            )
        assert isinstance(answer, Welcome)
        return answer

    async def _build_envs(self, session: Session, answer: Welcome) -> None:
        self.worker_id = answer.worker_id
        try:
            mode = AutoresetMode(answer.autoreset_mode)
            # Building the envs is the user's code and may be slow: it is outside the
            # handshake deadline on purpose, bounded by the learner's wait instead.
            self._envs = SyncVectorEnv(
                [self._env_fn] * self.num_envs, copy=False, autoreset_mode=mode
            )
        except Exception as exc:
            await session.send(_report(exc))
            raise ConfigError(f"could not build the envs {self._env_name!r}: {exc}") from exc
        await session.send(
            Ready(
                observation_space=self._envs.single_observation_space,
                action_space=self._envs.single_action_space,
                num_envs=self.num_envs,
            )
        )
        log.info("worker %d ready: %d x %s", answer.worker_id, self.num_envs, self._env_name)

    async def _serve(self, session: Session) -> None:
        envs = self._envs
        assert envs is not None
        timeout = self._timeouts.heartbeat_timeout
        while True:
            try:
                request = await session.receive(timeout=timeout, operation="the next request")
            except EndOfStream:
                return
            if isinstance(request, StepRequest):
                await session.send(self._step(envs, request))
            elif isinstance(request, ResetRequest):
                await session.send(self._reset(envs, request))
            else:  # Reject after Ready: the learner refused our spaces.
                assert isinstance(request, Reject)
                raise _REJECTIONS.get(request.kind, ProtocolError)(
                    f"the learner refused this worker: {request.reason}"
                )

    def _step(self, envs: SyncVectorEnv, request: StepRequest) -> StepResult | ErrorReport:
        try:
            actions = check_batch(envs.single_action_space, request.actions, self.num_envs)
        except ConfigError as exc:
            return _report(ProtocolError(f"the learner sent bad actions: {exc}"))
        try:
            obs, reward, terminated, truncated, info = envs.step(actions)
        except Exception as exc:
            return _report(exc)
        return StepResult(
            obs=obs, reward=reward, terminated=terminated, truncated=truncated, info=info
        )

    def _reset(self, envs: SyncVectorEnv, request: ResetRequest) -> ResetResult | ErrorReport:
        seed = request.seed if request.seed is not None else self._pending_seed
        self._pending_seed = None
        options = dict(request.options) if request.options is not None else None
        try:
            obs, info = envs.reset(seed=seed, options=options)
        except Exception as exc:
            return _report(exc)
        return ResetResult(obs=obs, info=info)


def _report(exc: BaseException) -> ErrorReport:
    return ErrorReport(
        remote_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
        message=str(exc),
        traceback="".join(traceback.format_exception(exc)),
    )
