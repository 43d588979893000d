"""The worker's session loop: dial the learner, prove the token, serve, resume after a drop.

A worker dials the learner (workers always dial out, so the learner needs no access to the
workers' ports), proves it knows the token, learns the autoreset mode, builds its envs as one
Gymnasium vector env (:class:`~gymnasium.vector.SyncVectorEnv` by default, see
:mod:`aps.vector` for the others) and then hands each request to its
:class:`~aps.worker.steps.StepServer` (resets, steps and rollouts) or to gradient mode
(:func:`~aps.worker.rounds.serve_rounds`).

A connection that drops (not a goodbye) is dialed again, with exponential backoff and jitter,
until ``timeouts.connect`` passes; the worker then resumes its session: envs, policy and the
answers the learner has not acknowledged are kept, so the learner loses nothing and no
request runs twice. A learner that no longer knows the session (it restarted) admits the
worker as a new one, and the worker rebuilds its envs.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import random
import socket
from typing import Any

from gymnasium.vector import AutoresetMode

from aps import transports
from aps.errors import (
    ApsError,
    AuthError,
    ConfigError,
    ConnectError,
    EndOfStream,
    ProtocolError,
    Timeout,
    TransportError,
    VersionMismatch,
)
from aps.gradients import GradientSampler
from aps.messages import (
    PROTOCOL_VERSION,
    Challenge,
    EnvCall,
    ErrorReport,
    GradientRound,
    Hello,
    Ready,
    Reject,
    ResetRequest,
    RolloutRequest,
    StepRequest,
    Weights,
    Welcome,
)
from aps.protocol import Role, prove
from aps.session import Session, Timeouts
from aps.transports.base import Transport, TransportFactory
from aps.vector import AnyVectorEnv, check_backend, envpool_id, make_vector_env
from aps.worker.collector import Collector
from aps.worker.envs import EnvSpec, describe, make_env, resolve_env
from aps.worker.rounds import serve_rounds
from aps.worker.steps import StepServer

__all__ = ["Worker"]

log = logging.getLogger(__name__)

_REJECTIONS: dict[str, type[ApsError]] = {
    "AuthError": AuthError,
    "VersionMismatch": ProtocolError,
    "ConfigError": ConfigError,
}


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
        compute_delay: seconds to sleep after every env step of a gradient round, to simulate
            a slower machine (heterogeneous workers, e.g. ``sqrt(i) * base``).
        comm_delay: seconds to sleep before sending each gradient report, to simulate a
            slower link.
        label: free text shown in the learner's :class:`~aps.learner.WorkerInfo` (launchers
            put the worker's index there, to tie learner worker ids to what they started).
        vector: how the envs run (:mod:`aps.vector`): ``"sync"`` one after another in this
            process, ``"async"`` one subprocess each (the env spec must then build in a
            fresh process: an id, an import path, or a callable cloudpickle can carry),
            ``"envpool"`` EnvPool's envs (``env`` an EnvPool id; ``NextStep`` autoreset only).

        reconnect: dial again and resume when the connection drops (``False``: end with the
            error instead).

    Raises:
        ConfigError: a bad argument, such as an unknown ``vector`` or an id EnvPool lacks.
        MissingDependency: ``vector="envpool"`` without EnvPool installed.

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
        compute_delay: float = 0.0,
        comm_delay: float = 0.0,
        label: str = "",
        reconnect: bool = True,
        vector: str = "sync",
    ) -> None:
        if not isinstance(num_envs, int) or isinstance(num_envs, bool) or num_envs < 1:
            raise ConfigError(f"num_envs must be an int >= 1, got {num_envs!r}")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ConfigError(f"seed must be an int or None, got {seed!r}")
        self._learner = learner
        self._vector = check_backend(vector)
        self._env = env
        self._env_kwargs = dict(env_kwargs or {})
        if self._vector == "envpool":
            envpool_id(env)  # refuse an id EnvPool lacks now, not after dialing
        else:
            resolve_env(env, **self._env_kwargs)  # refuse a bad import path now
        self._env_fn = functools.partial(make_env, env, self._env_kwargs)
        self._env_name = describe(env)
        self.num_envs = num_envs
        self._seed = seed
        self._token = token.encode() if isinstance(token, str) else token
        self._timeouts = timeouts or Timeouts()
        self._factory = factory
        for name, delay in (("compute_delay", compute_delay), ("comm_delay", comm_delay)):
            if not isinstance(delay, int | float) or not 0 <= delay < 3600:
                raise ConfigError(f"{name} must be a number of seconds in [0, 3600), got {delay!r}")
        if not isinstance(label, str) or len(label) > 200:
            raise ConfigError(f"label must be a string of at most 200 characters, got {label!r}")
        self.label = label
        self._compute_delay = float(compute_delay)
        self._comm_delay = float(comm_delay)
        self._server: StepServer | None = None  # this session's envs; kept over resumes
        self._reconnect = reconnect
        self._session_id = b""
        self.worker_id: int | None = None
        self.resumes = 0
        """How many times this worker resumed its session after a dropped connection."""
        self.replayed = 0
        """Answers sent again from the cache after a resume (their requests did not rerun)."""

    async def run(self) -> None:
        """Connect, serve the learner until it says goodbye, then close the envs.

        A dropped connection is dialed again and the session resumed (see the module
        docstring), unless ``reconnect`` is off.

        Raises:
            ConnectError | Timeout: the learner could not be reached within
                ``timeouts.connect`` (first or again), or went silent for
                ``timeouts.heartbeat_timeout`` and ``reconnect`` is off.
            AuthError: the learner refused the token.
            ConfigError: the learner refused this worker's envs (spaces that disagree with
                the other workers', or too many workers).
            ProtocolError: the learner broke the protocol or speaks another version.
            ConnectionLost: the connection broke and ``reconnect`` is off.
        """
        loop = asyncio.get_running_loop()
        lost_at: float | None = None  # when the session's connection last dropped
        try:
            while True:
                session = Session(
                    await self._connect(),
                    Role.WORKER,
                    heartbeat_interval=self._timeouts.heartbeat_interval,
                )
                try:
                    await self._handshake(session)
                    lost_at = None
                    session.start_heartbeats()
                    await self._serve(session)
                    return
                except (TransportError, Timeout) as exc:
                    lost_at = loop.time() if lost_at is None else lost_at
                    # A learner that keeps failing the resume is given up on like one that
                    # cannot be reached: after timeouts.connect.
                    late = loop.time() - lost_at > self._timeouts.connect
                    if late or not self._can_resume(session, exc):
                        raise
                    log.warning(
                        "worker %s lost its learner at %s (%s); dialing again to resume",
                        *(self.worker_id, session.peer, exc),
                    )
                finally:
                    await session.aclose()
        finally:
            self._forget_session()

    def _can_resume(self, session: Session, exc: BaseException) -> bool:
        """Whether a failure is a dropped connection this worker should dial again after."""
        if not self._reconnect or not isinstance(self._learner, str):
            return False  # a transport handed in cannot be dialed again
        if isinstance(exc, EndOfStream) and session.goodbye is not None:
            return False  # the learner said goodbye: the run is over
        # Only a session that got as far as a welcome has something to resume; a learner that
        # cannot be reached at all is reported by _connect's own deadline.
        return bool(self._session_id)

    async def _connect(self) -> Transport:
        if not isinstance(self._learner, str):
            return self._learner
        url = self._learner
        factory = self._factory or transports.get_factory(transports.scheme_of(url))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeouts.connect
        attempt = 0
        while True:
            left = deadline - loop.time()
            try:
                return await factory.connect(url, timeout=max(left, 0.01))
            except (ConnectError, Timeout) as exc:
                # The learner may simply not be up yet (or restarting): retry until the
                # deadline.
                delay = self._backoff(attempt)
                if loop.time() + delay >= deadline:
                    raise Timeout(
                        f"could not reach the learner at {url} within "
                        f"{self._timeouts.connect} s (last error: {exc}); start the learner "
                        "first or raise Timeouts.connect",
                        operation="connect",
                        seconds=self._timeouts.connect,
                    ) from exc
                await asyncio.sleep(delay)
                attempt += 1

    @staticmethod
    def _backoff(attempt: int) -> float:
        """Seconds to wait before dial ``attempt + 1``: exponential, with jitter.

        The jitter keeps many workers that lost one learner from dialing it at one instant.
        """
        ceiling = min(0.05 * 2**attempt, 2.0)
        return random.uniform(ceiling / 2, ceiling)

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
                label=self.label,
                resume=self._session_id,
                served=0 if self._server is None else self._server.served,
                version=-1 if self._server is None else self._server.version,
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
        if answer.resumed and self._server is not None:
            self.resumes += 1
            log.info("worker %d resumed its session", answer.worker_id)
        else:
            self._forget_session()
        self._session_id = answer.session_id
        if self._server is None:
            self._server = await self._make_envs(session, answer)
        envs = self._server.envs
        await session.send(
            Ready(
                observation_space=envs.single_observation_space,
                action_space=envs.single_action_space,
                num_envs=self.num_envs,
            )
        )

    def _forget_session(self) -> None:
        """Start over as a new worker: fresh envs, no answers kept."""
        if self._server is not None:
            self._server.close()
            self._server = None

    async def _make_envs(self, session: Session, answer: Welcome) -> StepServer:
        envs: AnyVectorEnv | None = None
        try:
            mode = AutoresetMode(answer.autoreset_mode)
            # Building the envs is the user's code and may be slow: it is outside the
            # handshake deadline on purpose, bounded by the learner's wait instead.
            envs = make_vector_env(
                self._vector,
                self._env_fn,
                num_envs=self.num_envs,
                autoreset_mode=mode,
                env=self._env,
                env_kwargs=self._env_kwargs,
            )
            collector = (
                None
                if answer.policy is None
                else Collector(envs, answer.policy, mode, dict(answer.policy_kwargs or {}))
            )
        except Exception as exc:
            await session.send(ErrorReport.of(exc))
            what = "envs" if envs is None else f"policy {answer.policy!r}"
            if envs is not None:
                envs.close()
            raise ConfigError(f"could not build the {what} for {self._env_name!r}: {exc}") from exc
        log.info(
            "worker %d ready: %d x %s (%s)",
            answer.worker_id,
            self.num_envs,
            self._env_name,
            self._vector,
        )
        return self._new_server(envs, collector)

    def _new_server(self, envs: AnyVectorEnv, collector: Collector | None) -> StepServer:
        """The step server of a new session; a subclass may serve with its own."""
        return StepServer(envs, collector, self._seed)

    async def _serve(self, session: Session) -> None:
        server = self._server
        assert server is not None
        timeout = self._timeouts.heartbeat_timeout
        while True:
            try:
                request = await session.receive(timeout=timeout, operation="the next request")
            except EndOfStream:
                if session.goodbye is None:
                    raise  # closed without a goodbye: the connection dropped
                return
            if isinstance(request, StepRequest | ResetRequest | RolloutRequest | EnvCall):
                if await server.answer(session, request):
                    self.replayed += 1
            elif isinstance(request, Weights):
                server.load_weights(request)
            elif isinstance(request, GradientRound):
                await serve_rounds(
                    session,
                    request,
                    functools.partial(self._gradient_sampler, server),
                    heartbeat_timeout=timeout,
                    compute_delay=self._compute_delay,
                    comm_delay=self._comm_delay,
                )
            else:  # Reject after Ready: the learner refused our spaces.
                assert isinstance(request, Reject)
                raise _REJECTIONS.get(request.kind, ProtocolError)(
                    f"the learner refused this worker: {request.reason}"
                )

    @staticmethod
    def _gradient_sampler(server: StepServer) -> GradientSampler:
        if server.collector is None:
            raise ProtocolError(
                "the learner started gradient rounds but gave this worker no policy; create "
                "the learner with policy='module:factory'"
            )
        return GradientSampler(server.envs, server.collector.policy)
