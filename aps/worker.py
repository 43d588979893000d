"""The worker role: host a Gymnasium vector env and answer the learner's requests.

A worker dials the learner (workers always dial out, so the learner needs no access to the
workers' ports), proves it knows the token, learns the autoreset mode, builds its envs as one
Gymnasium vector env (:class:`~gymnasium.vector.SyncVectorEnv` by default, see
:mod:`aps.vector` for the others) and then answers reset and step requests with whole
batches, one message per request. An env that raises does not end the worker: the error
travels to the learner as text (type and traceback) and the worker keeps serving.

A connection that drops (not a goodbye) is dialed again, with exponential backoff and jitter,
until ``timeouts.connect`` passes; the worker then resumes its session: envs, policy and the
answers the learner has not acknowledged are kept, so the learner loses nothing and no
request runs twice. A learner that no longer knows the session (it restarted) admits the
worker as a new one, and the worker rebuilds its envs.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import random
import socket
import traceback
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode

from aps import codec, transports
from aps._imports import import_object, names_a_module
from aps.batching import check_batch
from aps.errors import (
    ApsError,
    AuthError,
    ConfigError,
    ConnectError,
    EndOfStream,
    InvalidState,
    ProtocolError,
    Timeout,
    TransportError,
    VersionMismatch,
)
from aps.gradients import GradientSampler
from aps.messages import (
    PROTOCOL_VERSION,
    Answer,
    Challenge,
    ErrorReport,
    GradientReport,
    GradientRound,
    GradientsStopped,
    Hello,
    Message,
    Ready,
    Reject,
    Request,
    ResetRequest,
    ResetResult,
    RolloutChunk,
    RolloutRequest,
    StepRequest,
    StepResult,
    StopGradients,
    Weights,
    Welcome,
)
from aps.protocol import MAX_IN_FLIGHT, Role, prove
from aps.session import Session, Timeouts
from aps.transports.base import Transport, TransportFactory
from aps.vector import AnyVectorEnv, check_backend, envpool_id, make_vector_env

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


_ANSWERS: dict[type[Message], type[Message]] = {
    ResetRequest: ResetResult,
    StepRequest: StepResult,
    RolloutRequest: RolloutChunk,
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
    if ":" in spec and names_a_module(spec):
        factory = import_object(spec, what="env spec")
        if not callable(factory):
            raise ConfigError(f"{spec!r} names {type(factory).__name__}, not a callable")
        return (lambda: factory(**env_kwargs)) if env_kwargs else factory
    env_id = spec
    return lambda: gym.make(env_id, **env_kwargs)


def _make_env(spec: EnvSpec, env_kwargs: dict[str, Any]) -> gym.Env[Any, Any]:
    # A module-level function, so that a partial of it pickles: the async backend's
    # subprocesses build their envs by resolving the spec themselves.
    return resolve_env(spec, **env_kwargs)()


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
        self._env_fn = functools.partial(_make_env, env, self._env_kwargs)
        self._env_name = _describe(env)
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
        self._envs: AnyVectorEnv | None = None
        self._collector: _Collector | None = None
        self._weights_error: ApsError | None = None
        self._pending_seed = seed
        self._reconnect = reconnect
        self._session_id = b""
        self._served = 0  # requests of this session answered
        self._answers: collections.OrderedDict[int, tuple[Message, bytes]] = (
            collections.OrderedDict()
        )
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
            if self._envs is not None:
                self._envs.close()
                self._envs = None

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
                served=self._served,
                version=-1 if self._collector is None else self._collector.version,
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
        if answer.resumed and self._envs is not None:
            self.resumes += 1
            log.info("worker %d resumed its session", answer.worker_id)
        else:
            self._forget_session()
        self._session_id = answer.session_id
        if self._envs is None:
            await self._make_envs(session, answer)
        assert self._envs is not None
        await session.send(
            Ready(
                observation_space=self._envs.single_observation_space,
                action_space=self._envs.single_action_space,
                num_envs=self.num_envs,
            )
        )

    def _forget_session(self) -> None:
        """Start over as a new worker: fresh envs, no answers kept."""
        if self._envs is not None:
            self._envs.close()
        self._envs = self._collector = None
        self._weights_error = None
        self._pending_seed = self._seed
        self._served = 0
        self._answers.clear()

    async def _make_envs(self, session: Session, answer: Welcome) -> None:
        try:
            mode = AutoresetMode(answer.autoreset_mode)
            # Building the envs is the user's code and may be slow: it is outside the
            # handshake deadline on purpose, bounded by the learner's wait instead.
            self._envs = make_vector_env(
                self._vector,
                self._env_fn,
                num_envs=self.num_envs,
                autoreset_mode=mode,
                env=self._env,
                env_kwargs=self._env_kwargs,
            )
            if answer.policy is not None:
                self._collector = _Collector(self._envs, answer.policy, mode)
        except Exception as exc:
            await session.send(_report(exc))
            what = "envs" if self._envs is None else f"policy {answer.policy!r}"
            raise ConfigError(f"could not build the {what} for {self._env_name!r}: {exc}") from exc
        log.info(
            "worker %d ready: %d x %s (%s)",
            answer.worker_id,
            self.num_envs,
            self._env_name,
            self._vector,
        )

    async def _serve(self, session: Session) -> None:
        envs = self._envs
        assert envs is not None
        timeout = self._timeouts.heartbeat_timeout
        while True:
            try:
                request = await session.receive(timeout=timeout, operation="the next request")
            except EndOfStream:
                if session.goodbye is None:
                    raise  # closed without a goodbye: the connection dropped
                return
            if isinstance(request, StepRequest | ResetRequest | RolloutRequest):
                await self._answer(session, envs, request)
            elif isinstance(request, Weights):
                self._load_weights(request)
            elif isinstance(request, GradientRound):
                await self._gradient_mode(session, request)
            else:  # Reject after Ready: the learner refused our spaces.
                assert isinstance(request, Reject)
                raise _REJECTIONS.get(request.kind, ProtocolError)(
                    f"the learner refused this worker: {request.reason}"
                )

    async def _answer(self, session: Session, envs: AnyVectorEnv, request: Request) -> None:
        """Answer request ``seq`` once: run it, or send the kept answer if it already ran.

        Every answer is kept until the learner acknowledges it (``acked``), so that after a
        resume the learner gets the answers it missed without any request running twice.
        """
        answers = self._answers
        while answers and next(iter(answers)) < request.acked:
            answers.popitem(last=False)
        seq = request.seq
        if seq < self._served:
            kept = answers.get(seq)
            expected = _ANSWERS[type(request)]
            if kept is None or not isinstance(kept[0], expected | ErrorReport):
                raise ProtocolError(
                    f"the learner asked again for answer {seq} ({type(request).__name__}), "
                    "which this worker no longer holds; the learner is not a compatible aps "
                    "learner"
                )
            self.replayed += 1
            await session.send(kept[0], frame=kept[1])
            return
        if seq != self._served:
            raise ProtocolError(
                f"the learner sent request {seq} but the next one is {self._served}; a request "
                "was lost, the learner is not a compatible aps learner"
            )
        answer: Answer
        if isinstance(request, StepRequest):
            answer = self._step(envs, request)
        elif isinstance(request, ResetRequest):
            answer = self._reset(envs, request)
        else:
            answer = self._rollout(request)
        # Encoded once: the frame is what is sent, and what is kept for a resend.
        frame = codec.encode(answer)
        answers[seq] = (answer, frame)
        while len(answers) > MAX_IN_FLIGHT:
            answers.popitem(last=False)
        self._served += 1
        await session.send(answer, frame=frame)

    async def _gradient_mode(self, session: Session, first: GradientRound) -> None:
        """Sample and report gradients until the learner stops gradient mode.

        A reader task moves the learner's messages into a queue so that new rounds are seen
        between env steps; each new round replaces the current one at once.
        """
        inbox: asyncio.Queue[Message | BaseException] = asyncio.Queue()
        reader = asyncio.create_task(self._read_until_stop(session, inbox))
        sampler: GradientSampler | None = None
        message: Message | BaseException = first
        try:
            while True:
                if isinstance(message, BaseException):
                    raise message
                if isinstance(message, StopGradients):
                    await session.send(GradientsStopped())
                    return
                sampling = False
                if isinstance(message, GradientRound):
                    try:
                        sampler = sampler or self._gradient_sampler()
                        sampler.start(message)
                        sampling = True
                    except Exception as exc:  # the learner hears why; the next round may do
                        await session.send(_report(exc))
                while sampling and sampler is not None and inbox.empty():
                    report = self._sample(sampler)
                    if isinstance(report, ErrorReport):
                        await session.send(report)
                        break
                    if report is not None:
                        if self._comm_delay:
                            await asyncio.sleep(self._comm_delay)
                        await session.send(report)
                    # Simulated slowness (heterogeneous workers); also lets the reader run.
                    await asyncio.sleep(self._compute_delay)
                message = await inbox.get()
        finally:
            reader.cancel()
            await asyncio.wait([reader])

    def _gradient_sampler(self) -> GradientSampler:
        if self._collector is None:
            raise ProtocolError(
                "the learner started gradient rounds but gave this worker no policy; create "
                "the learner with policy='module:factory'"
            )
        assert self._envs is not None
        return GradientSampler(self._envs, self._collector.policy)

    @staticmethod
    def _sample(sampler: GradientSampler) -> GradientReport | ErrorReport | None:
        try:
            return sampler.step()
        except Exception as exc:
            return _report(exc)

    async def _read_until_stop(
        self, session: Session, inbox: asyncio.Queue[Message | BaseException]
    ) -> None:
        while True:
            try:
                message = await session.receive(
                    timeout=self._timeouts.heartbeat_timeout, operation="the next round"
                )
            except Exception as exc:
                inbox.put_nowait(exc)
                return
            inbox.put_nowait(message)
            if isinstance(message, StopGradients):
                return

    def _load_weights(self, weights: Weights) -> None:
        # A bad weights message cannot be answered (weights have no reply); it is kept and
        # reported by the next rollout, which then fails with the reason.
        if self._collector is None:
            self._weights_error = ProtocolError(
                "the learner sent weights to a worker without a policy"
            )
            return
        try:
            self._collector.load(weights)
            self._weights_error = None
        except ApsError as exc:
            self._weights_error = exc

    def _rollout(self, request: RolloutRequest) -> RolloutChunk | ErrorReport:
        seq = request.seq
        if self._collector is None:
            return _report(
                ProtocolError(
                    "the learner asked for a rollout but gave this worker no policy; "
                    "create the learner with policy='module:factory'"
                ),
                seq,
            )
        if self._weights_error is not None:
            return _report(self._weights_error, seq)
        try:
            return self._collector.collect(request.num_steps, seq)
        except Exception as exc:
            return _report(exc, seq)

    def _step(self, envs: AnyVectorEnv, request: StepRequest) -> StepResult | ErrorReport:
        try:
            actions = check_batch(envs.single_action_space, request.actions, self.num_envs)
        except ConfigError as exc:
            return _report(ProtocolError(f"the learner sent bad actions: {exc}"), request.seq)
        try:
            obs, reward, terminated, truncated, info = envs.step(actions)
        except Exception as exc:
            return _report(exc, request.seq)
        if self._collector is not None:
            self._collector.observe(obs, terminated | truncated)
        return StepResult(
            obs=obs,
            reward=reward,
            terminated=terminated,
            truncated=truncated,
            info=info,
            seq=request.seq,
        )

    def _reset(self, envs: AnyVectorEnv, request: ResetRequest) -> ResetResult | ErrorReport:
        seed = request.seed if request.seed is not None else self._pending_seed
        self._pending_seed = None
        options = dict(request.options) if request.options is not None else None
        try:
            obs, info = envs.reset(seed=seed, options=options)
        except Exception as exc:
            return _report(exc, request.seq)
        if self._collector is not None:
            self._collector.observe(obs, None)
            if seed is not None:
                # Seeded resets make the worker's action sampling reproducible too.
                self._collector.policy.seed(seed)
        return ResetResult(obs=obs, info=info, seq=request.seq)


MAX_ROLLOUT_STEPS = 1_000_000
"""The most steps one rollout request may ask for (it bounds the worker's buffers)."""


class _Collector:
    """Worker-side inference (DETACH): act with the local policy copy, record chunks.

    Keeps the current observations between requests (lockstep resets and steps update them
    too), the policy version in use, and per-env episode returns and lengths. Under the
    ``NextStep`` autoreset mode the step after an episode's end only resets that env; it is
    recorded like any other (reward 0, not done) and not counted in episode lengths.
    """

    def __init__(self, envs: AnyVectorEnv, policy_path: str, mode: AutoresetMode) -> None:
        from aps import policy  # torch is needed only by workers that act

        policy.limit_threads(1)  # many workers share few cores; one thread each is fastest
        self._envs = envs
        self._policy = policy.Policy.load(
            policy_path, envs.single_observation_space, envs.single_action_space
        )
        if not isinstance(envs.observation_space.sample(), np.ndarray):
            raise ConfigError(
                f"worker-side inference needs array observations, got "
                f"{envs.single_observation_space}; use lockstep stepping for dict or tuple spaces"
            )
        self._next_step_reset = mode is AutoresetMode.NEXT_STEP
        self.version = -1
        num_envs = envs.num_envs
        self._obs: np.ndarray[Any, Any] | None = None
        self._pending_reset = np.zeros(num_envs, dtype=bool)
        self._episode_return = np.zeros(num_envs, dtype=np.float64)
        self._episode_length = np.zeros(num_envs, dtype=np.int64)

    @property
    def policy(self) -> Any:
        """The worker's :class:`aps.policy.Policy`."""
        return self._policy

    def load(self, weights: Weights) -> None:
        """Load a new version; raises ConfigError when the arrays do not fit the policy."""
        if not isinstance(weights.arrays, dict):
            raise ProtocolError(f"weights must map names to arrays, got {type(weights.arrays)}")
        # The arrays are views of the frame they came in, which nothing else holds: the
        # policy takes that memory as its own rather than copying a large version.
        self._policy.set_weights(weights.arrays, share=True)
        if weights.epsilon is not None:
            self._policy.epsilon = weights.epsilon
        self.version = weights.version

    def observe(self, obs: Any, done: np.ndarray[Any, Any] | None) -> None:
        """Track observations produced by a lockstep reset (``done=None``) or step."""
        self._obs = obs
        if done is None:
            self._pending_reset[:] = False
            self._episode_return[:] = 0.0
            self._episode_length[:] = 0
        else:
            self._pending_reset = done.copy() if self._next_step_reset else self._pending_reset

    def collect(self, num_steps: int, seq: int = 0) -> RolloutChunk:
        """Act ``num_steps`` times on every env and return the chunk (answering ``seq``)."""
        if not 1 <= num_steps <= MAX_ROLLOUT_STEPS:
            raise ConfigError(f"num_steps must be in 1..{MAX_ROLLOUT_STEPS}, got {num_steps}")
        if self.version < 0:
            raise ProtocolError("the learner asked for a rollout before sending any weights")
        if self._obs is None:
            raise InvalidState("reset the envs before the first rollout")
        envs, policy = self._envs, self._policy
        num_envs = envs.num_envs
        obs = self._obs
        obs_buf = np.empty((num_steps, *obs.shape), dtype=obs.dtype)
        reward = np.empty((num_steps, num_envs), dtype=np.float64)
        terminated = np.empty((num_steps, num_envs), dtype=np.bool_)
        truncated = np.empty((num_steps, num_envs), dtype=np.bool_)
        actions_buf: np.ndarray[Any, Any] | None = None
        logprob = np.empty((num_steps, num_envs), dtype=np.float32)
        value = np.empty((num_steps, num_envs), dtype=np.float32) if policy.has_critic else None
        ended: list[tuple[float, int, int]] = []
        cut: list[tuple[int, int, np.ndarray[Any, Any]]] = []  # truncated: step, env, last obs
        for t in range(num_steps):
            obs_buf[t] = obs
            actions, logprob[t], values = policy.act(obs)
            if actions_buf is None:
                actions_buf = np.empty((num_steps, *actions.shape), dtype=actions.dtype)
            actions_buf[t] = actions
            if value is not None and values is not None:
                value[t] = values
            # The chunk keeps the raw samples; the env gets them within its bounds.
            stepped = policy.env_actions(actions)
            obs, reward[t], terminated[t], truncated[t], info = envs.step(stepped)
            self._count_episodes(reward[t], terminated[t] | truncated[t], ended)
            for env in np.flatnonzero(truncated[t]):
                # SameStep: obs already holds the reset observation, the last one is in the
                # info; NextStep: obs is still the last one (the reset comes next step).
                last = info["final_obs"][env] if "final_obs" in info else obs[env]
                cut.append((t, int(env), np.array(last)))
        assert actions_buf is not None
        self._obs = obs
        returns, lengths, env_ids = zip(*ended, strict=True) if ended else ((), (), ())
        return RolloutChunk(
            version=self.version,
            obs=obs_buf,
            actions=actions_buf,
            logprob=logprob,
            value=value,
            reward=reward,
            terminated=terminated,
            truncated=truncated,
            next_obs=np.array(obs),
            episode_return=np.array(returns, dtype=np.float64),
            episode_length=np.array(lengths, dtype=np.int64),
            episode_env=np.array(env_ids, dtype=np.int64),
            truncated_obs=(
                np.stack([c[2] for c in cut]) if cut else np.empty((0, *obs.shape[1:]), obs.dtype)
            ),
            truncated_index=np.array([c[:2] for c in cut], dtype=np.int64).reshape(-1, 2),
            seq=seq,
        )

    def _count_episodes(
        self,
        reward: np.ndarray[Any, Any],
        done: np.ndarray[Any, Any],
        ended: list[tuple[float, int, int]],
    ) -> None:
        self._episode_return += reward
        self._episode_length += ~self._pending_reset
        if done.any():
            for env in np.flatnonzero(done):
                ended.append(
                    (float(self._episode_return[env]), int(self._episode_length[env]), int(env))
                )
            self._episode_return[done] = 0.0
            self._episode_length[done] = 0
        if self._next_step_reset:
            self._pending_reset = done.copy()


def _report(exc: BaseException, seq: int | None = None) -> ErrorReport:
    return ErrorReport(
        remote_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
        message=str(exc),
        traceback="".join(traceback.format_exception(exc)),
        seq=seq,
    )
