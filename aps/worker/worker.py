"""The worker's session loop: dial the learner, prove the token, serve, resume after a drop.

A worker dials the learner (workers always dial out, so the learner needs no access to the
workers' ports), proves it knows the token, learns the autoreset mode, builds its envs as one
Gymnasium vector env (:class:`~gymnasium.vector.SyncVectorEnv` by default, see
:mod:`aps.vector` for the others) and then hands each request to its
:class:`~aps.worker.steps.StepServer` (resets, steps and rollouts) or to gradient mode
(:func:`~aps.worker.rounds.serve_rounds`).

Every failed attempt to join, whether the dial or the handshake failed (a learner not up yet,
a proxy in front of a dead one, a learner too busy to start another handshake), is followed
by a wait that grows exponentially, with jitter, before the next; the worker gives up after
``timeouts.connect``. A connection that drops (not a goodbye) is dialed again the same way,
for no longer than the learner keeps the session (its Welcome says how long), and the worker
then resumes its session: envs, policy and the answers the learner has not acknowledged are
kept, so the learner loses nothing and no request runs twice. A learner that no longer knows
the session (it restarted) admits the worker as a new one, and the worker rebuilds its envs.

The worker acts on nothing the learner says before the learner has proved the token (when
the worker has one), and it imports only the policy its own operator named (``policy``) or
allowed (``allow_policy``): the learner's Welcome names it, but never chooses it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import random
import socket
from collections.abc import Sequence
from typing import Any, cast
from urllib.parse import urlsplit

from gymnasium.vector import AutoresetMode

from aps import transports
from aps._base._imports import PolicyPin, names_a_module
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
from aps.multiagent import agents_per_env, is_parallel_env
from aps.session import Session, Timeouts
from aps.session.protocol import NONCE_SIZE, REQUESTS, Role, check_learner_proof, worker_proof
from aps.transports.base import Transport, TransportFactory
from aps.vector import AnyVectorEnv, check_backend, envpool_id, make_vector_env
from aps.wire.compression import (
    check_setting as check_compression,
    offer as offer_compression,
    parse_accepted,
)
from aps.wire.messages import (
    PROTOCOL_VERSION,
    Challenge,
    ErrorReport,
    GradientRound,
    GroupWeights,
    Hello,
    Ready,
    Reject,
    Request,
    Weights,
    Welcome,
)
from aps.worker.collector import Collector
from aps.worker.envs import EnvSpec, check_registered, describe, make_env, resolve_env
from aps.worker.rounds import serve_rounds
from aps.worker.sampling import GradientSampler
from aps.worker.steps import StepServer

__all__ = ["Worker"]

log = logging.getLogger(__name__)

_REJECTIONS: dict[str, type[ApsError]] = {
    "AuthError": AuthError,
    "VersionMismatch": ProtocolError,
    "ConfigError": ConfigError,
}


_MAX_REASON = 500
"""The longest goodbye reason a worker sends (its error's type and message, cut)."""


def _reason(exc: BaseException) -> str:
    """What a worker's goodbye says about the error it leaves with (nothing if cancelled)."""
    if not isinstance(exc, Exception):
        return ""
    return f"{type(exc).__name__}: {exc}"[:_MAX_REASON]


class _Retry(Exception):
    """An attempt to join failed in a way worth another attempt, after ``wait`` s at least."""

    def __init__(self, error: ApsError, wait: float = 0.0) -> None:
        super().__init__(str(error))
        self.error = error
        self.wait = wait


class Worker:
    """Hosts ``num_envs`` copies of an env and serves one learner.

    A factory (an import path or a callable) that returns a PettingZoo ``ParallelEnv`` makes
    the worker a host of agents (:mod:`aps.multiagent`): each agent of each of the
    ``num_envs`` copies is one env slot for the learner, ``num_envs * len(possible_agents)``
    in all, with the agents' shared spaces and the live-agent mask
    ``info["agent_active"]``. The worker learns this by building its first env before it
    first dials (and keeps that env as its first copy); ``vector="sync"`` only.

    Args:
        learner: the learner's URL (``"tcp://host:port"``), or a connected transport.
        env: what to run, see :data:`EnvSpec`.
        num_envs: how many copies this worker hosts (of a multi-agent env: env copies, each
            with all its agents).
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
        policy: the import path of the one policy this worker may run
            (``"pkg.module:make_agent"`` or ``"path/to/script.py:Agent"``). A learner whose
            Welcome names another is refused (launchers pass the learner's automatically).
        allow_policy: more policies this worker may run, as patterns of import paths matched
            by structure (:class:`aps._base._imports.PolicyPin`): ``"mypkg.agents:*"``,
            ``"/srv/agents/*.py:Agent"``, where ``*`` stands for part of one name or path
            segment and never crosses ``.``, ``/`` or ``:``. Without ``policy`` and
            ``allow_policy`` the worker runs no policy: only a learner that chooses the
            actions can use it.
        compression: the codecs this worker offers the learner, which chooses
            (:mod:`aps.wire.compression`): ``"auto"`` (default) every one it can import, ``"zstd"``
            or ``"lz4"`` that one, ``"none"`` none.
        frame_delta: offer to send rollout chunks' frame stacks (observations of shape
            ``(K, ...)`` that shift by one frame a step) as their newest frames
            (:mod:`aps.wire.frame_delta`); the learner accepts where it compresses. ``False``, or
            ``compression="none"``, sends them whole.
        allow_private_env_calls: let the learner's env calls (``call``, ``get_attr``,
            ``set_attr``) reach private and dunder names (``_max_episode_steps``,
            ``__class__``); by default only public names, and the learner's caller gets a
            :class:`~aps.WorkerError` naming the refusal.

    Raises:
        ConfigError: a bad argument, such as an unknown ``vector``, an id EnvPool lacks, or
            an empty token.
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
        policy: str | None = None,
        allow_policy: Sequence[str] = (),
        compression: str = "auto",
        allow_private_env_calls: bool = False,
        frame_delta: bool = True,
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
            check_registered(env)  # and an id with a typo, before any dialing
        self._env_fn = functools.partial(make_env, env, self._env_kwargs)
        self._env_name = describe(env)
        self.num_envs = num_envs
        self._seed = seed
        self._token = token.encode() if isinstance(token, str) else token
        if self._token is not None and not self._token.strip():
            raise ConfigError(
                "the token is empty (or only whitespace), which anyone can prove; give the "
                "worker the learner's token (--token-file with the file aps token wrote), or "
                "none at all for a learner without one"
            )
        if policy is not None and (not isinstance(policy, str) or ":" not in policy):
            raise ConfigError(
                f"policy must be an import path 'pkg.module:attr' or 'path/to/file.py:attr', "
                f"got {policy!r}"
            )
        if isinstance(allow_policy, str) or not all(isinstance(p, str) for p in allow_policy):
            raise ConfigError(
                f"allow_policy must be a list of import path patterns, got {allow_policy!r}"
            )
        self.policy = policy
        self.allow_policy = tuple(allow_policy)
        self.compression = check_compression(compression)
        if not isinstance(frame_delta, bool):
            raise ConfigError(f"frame_delta must be True or False, got {frame_delta!r}")
        self.frame_delta = frame_delta
        self._pin = PolicyPin(policy, self.allow_policy)  # refuses a malformed pattern now
        self._policy_path: str | None = None  # what the pin let this session import
        self._allow_private_env_calls = bool(allow_private_env_calls)
        self._resume_window = 0.0  # from the learner's Welcome: how long it keeps our session
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
        # Agents per env copy of a multi-agent env (0: a Gymnasium env; None: not known yet),
        # and the env built to learn it, kept as the first env of the first build.
        self._agents: int | None = None
        self._first_env: Any = None
        self._reconnect = reconnect
        self._session_id = b""
        self.worker_id: int | None = None
        self.resumes = 0
        """How many times this worker resumed its session after a dropped connection."""
        self.replayed = 0
        """Answers sent again from the cache after a resume (their requests did not rerun)."""

    async def run(self) -> None:
        """Connect, serve the learner until it says goodbye, then close the envs.

        A failed attempt to join (dial or handshake) is retried with backoff, and a dropped
        connection is dialed again and the session resumed (see the module docstring),
        unless ``reconnect`` is off.

        Raises:
            Timeout: the learner could not be reached or joined within ``timeouts.connect``
                (first or again; after a drop, within the learner's resume window), or went
                silent for ``timeouts.heartbeat_timeout`` and ``reconnect`` is off.
            AuthError: the learner refused the token, did not prove it knows the token, or
                its TLS certificate failed verification.
            ConfigError: the learner refused this worker's envs (spaces that disagree with
                the other workers', or too many workers), or named a policy this worker
                was not allowed to run.
            ProtocolError: the learner broke the protocol or speaks another version.
            ConnectionLost: the connection broke and ``reconnect`` is off.
        """
        loop = asyncio.get_running_loop()
        outage: float | None = None  # when the current run of failed attempts began
        attempt = 0
        try:
            # Before dialing: user code, perhaps slow, that the handshake deadline should
            # not cover.
            self._learn_agents()
            while True:
                try:
                    session = await self._join()
                except _Retry as retry:
                    now = loop.time()
                    outage = now if outage is None else outage
                    window = self._window()
                    delay = max(retry.wait, self._backoff(attempt))
                    if now + delay - outage >= window:
                        error = self._gave_up(window, retry.error)
                        log.warning("worker %s gives up: %s", self._name(), error)
                        raise error from retry.error
                    # The first failure of an outage says why (a TLS mismatch, a refused token);
                    # the retries that follow would repeat it every backoff.
                    log.log(
                        logging.WARNING if attempt == 0 else logging.DEBUG,
                        "joining the learner failed (%s); again in %.2f s, for up to %.0f s",
                        retry,
                        delay,
                        window,
                    )
                    await asyncio.sleep(delay)
                    attempt += 1
                    continue
                outage, attempt = None, 0
                reason = ""  # why this worker leaves, for the learner (its goodbye)
                try:
                    session.start_heartbeats()
                    await self._serve(session)
                    return
                except (TransportError, Timeout) as exc:
                    if session.goodbye is not None:
                        # A send failed after the learner's goodbye: the run is over, as
                        # when the goodbye is read first.
                        log.info("the learner ended this worker's session: %s", session.goodbye)
                        return
                    if not self._can_resume(session, exc):
                        reason = _reason(exc)
                        if session.goodbye is None:
                            log.warning("worker %s gives up: %s", self._name(), exc)
                        raise
                    outage = loop.time()
                    log.warning(
                        "worker %s lost its learner at %s (%s); dialing again to resume",
                        *(self.worker_id, session.peer, exc),
                    )
                except BaseException as exc:
                    reason = _reason(exc)
                    raise
                finally:
                    await session.aclose(reason)
        finally:
            self._forget_session()
            first, self._first_env = self._first_env, None
            if first is not None:
                first.close()

    @property
    def num_slots(self) -> int:
        """The env slots this worker offers the learner.

        ``num_envs``, times the agents per copy of a multi-agent env (known once :meth:`run`
        has built the first env).
        """
        return self.num_envs * max(self._agents or 0, 1)

    def _learn_agents(self) -> None:
        """Build the first env, once, to learn whether it is a multi-agent env.

        The Hello must say how many env slots this worker offers before the learner's
        Welcome, and a factory's env says whether it is a ParallelEnv only once built. Ids
        (never multi-agent) and EnvPool build nothing here. An env that fails to build is
        left for the build after the Welcome, which tells the learner why.

        Raises:
            ConfigError: a multi-agent env with ``vector`` other than ``"sync"``, or whose
                agents do not share their spaces.
        """
        if self._agents is not None:
            return
        spec = self._env
        if self._vector == "envpool" or not (
            callable(spec) or (isinstance(spec, str) and ":" in spec and names_a_module(spec))
        ):
            self._agents = 0
            return
        try:
            env = self._env_fn()
        except Exception:
            self._agents = 0
            return
        if not is_parallel_env(env):
            self._agents = 0
            if self._vector == "sync":
                self._first_env = env
            else:
                env.close()
            return
        try:
            if self._vector != "sync":
                raise ConfigError(
                    f"{self._env_name!r} builds a PettingZoo ParallelEnv, whose agents a "
                    f"worker hosts in its own process; use vector='sync', not {self._vector!r}"
                )
            self._agents = agents_per_env(env)
        except BaseException:
            env.close()
            raise
        self._first_env = env

    def _name(self) -> str:
        """This worker in log lines: its id once admitted, and its label."""
        name = "(not admitted)" if self.worker_id is None else str(self.worker_id)
        return f"{name} [{self.label}]" if self.label else name

    def _window(self) -> float:
        """How long a run of failed attempts may last.

        The connect timeout, and after a drop no longer than the learner keeps the session.
        """
        window = self._timeouts.connect
        if self._session_id and self._resume_window > 0:
            window = min(window, self._resume_window)
        return window

    def _gave_up(self, window: float, error: ApsError) -> ApsError:
        if isinstance(error, AuthError | ProtocolError | ConfigError):
            return error  # a refusal means more than "could not reach"
        return Timeout(
            f"could not reach the learner at {self._learner} within {window} s (last "
            f"error: {error}); start the learner first or raise Timeouts.connect "
            "(aps worker --connect-timeout)",
            operation="connect",
            seconds=window,
        )

    async def _join(self) -> Session:
        """One attempt: dial, handshake, envs ready. The session, or why it failed.

        Raises:
            _Retry: the attempt failed in a way another one may not.
            ApsError: a failure no other attempt can mend (a refusal from a learner that
                proved the token, a policy this worker may not run, a bad certificate).
        """
        try:
            transport = await self._connect()
        except (ConnectError, Timeout) as exc:
            if not isinstance(self._learner, str):
                raise
            if _unresolvable(exc):
                raise ConfigError(
                    f"the learner's host in {self._learner!r} does not resolve "
                    f"({_unresolvable(exc)}); check its spelling, or give its IP address"
                ) from exc
            raise _Retry(exc) from exc
        session = Session(
            transport, Role.WORKER, heartbeat_interval=self._timeouts.heartbeat_interval
        )
        try:
            await self._handshake(session)
        except _Retry:
            await session.aclose()
            raise
        except (TransportError, Timeout) as exc:
            await session.aclose()
            if not isinstance(self._learner, str):
                raise
            raise _Retry(exc) from exc
        except ProtocolError as exc:
            await session.aclose()
            if session.is_authenticated:
                raise
            raise self._unverified(exc) from exc
        except BaseException as exc:
            # The learner's user hears why (a space that cannot travel, envs that failed
            # to build), not only this worker's stderr.
            await session.aclose(_reason(exc))
            raise
        return session

    def _can_resume(self, session: Session, exc: BaseException) -> bool:
        """Whether a failure is a dropped connection this worker should dial again after."""
        if not self._reconnect or not isinstance(self._learner, str):
            return False  # a transport handed in cannot be dialed again
        if isinstance(exc, EndOfStream) and session.goodbye is not None:
            return False  # the learner said goodbye: the run is over
        # Only a session that got as far as a welcome has something to resume.
        return bool(self._session_id)

    async def _connect(self) -> Transport:
        """Dial the learner once (a transport handed in is returned as it is).

        Raises:
            ConnectError | Timeout: the dial failed (the caller decides whether to retry).
            AuthError: the learner's TLS certificate failed verification.
        """
        if not isinstance(self._learner, str):
            return self._learner
        url = self._learner
        factory = self._factory or transports.get_factory(transports.scheme_of(url))
        return await factory.connect(url, timeout=self._timeouts.connect)

    @staticmethod
    def _backoff(attempt: int) -> float:
        """Seconds to wait before attempt ``attempt + 1``: exponential, with jitter.

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
        if isinstance(challenge, Reject):  # busy: the learner has not even challenged us
            raise self._refused(challenge, verified=False)
        assert isinstance(challenge, Challenge)  # the protocol table allows nothing else
        if challenge.protocol_version != PROTOCOL_VERSION:
            raise self._unverified(VersionMismatch(PROTOCOL_VERSION, challenge.protocol_version))
        nonce = os.urandom(NONCE_SIZE)
        token = self._token
        # The proof covers our own nonce: a peer that relays it gains nothing it can replay.
        proof = b"" if token is None else worker_proof(token, challenge.nonce, nonce)
        offered = offer_compression(self.compression, frame_delta=self.frame_delta)
        self._learn_agents()
        await session.send(
            Hello(
                protocol_version=PROTOCOL_VERSION,
                proof=proof,
                env_id=self._env_name,
                num_envs=self.num_slots,
                seed=self._seed,
                host=socket.gethostname(),
                pid=os.getpid(),
                label=self.label,
                resume=self._session_id,
                served=0 if self._server is None else self._server.served,
                version=-1 if self._server is None else self._server.version,
                nonce=nonce,
                compression=",".join(offered),
            )
        )
        answer = await session.receive(timeout=None, operation="the learner's welcome")
        assert isinstance(answer, Welcome | Reject)  # the protocol table allows nothing else
        try:
            check_learner_proof(
                answer.proof,
                token=token,
                learner_nonce=challenge.nonce,
                worker_nonce=nonce,
                peer=session.peer,
            )
        except AuthError as exc:
            if isinstance(answer, Reject) and not answer.proof:
                # A learner that found our proof wrong cannot prove its own: its refusal
                # is the news, unverified.
                raise self._refused(answer, verified=False) from None
            raise self._unverified(exc) from None
        if isinstance(answer, Reject):
            raise self._refused(answer, verified=True)
        session.authenticated()
        codec, frame_delta = parse_accepted(answer.compression, offered, peer=session.peer)
        session.compress(codec, frame_delta=frame_delta)  # from our Ready on, both ways
        return answer

    def _unverified(self, error: ApsError) -> ApsError | _Retry:
        """What to do about a failure caused by a peer that has not proved the token.

        A worker resuming its session tries again (the real learner may be back on the
        port after whoever answered meanwhile); a new one reports the failure.
        """
        if self._session_id and isinstance(self._learner, str):
            return _Retry(error)
        return error

    def _refused(self, reject: Reject, *, verified: bool) -> ApsError | _Retry:
        error = _REJECTIONS.get(reject.kind, ProtocolError)(
            f"the learner refused this worker: {reject.reason}"
        )
        if reject.retry_after > 0 and isinstance(self._learner, str):
            return _Retry(error, wait=min(reject.retry_after, 30.0))  # busy, not a refusal
        return error if verified else self._unverified(error)

    def _check_policy(self, policy: str | None) -> str | None:
        """The import path to load for the policy the learner names, or a refusal.

        Raises:
            ConfigError: the operator did not name or allow that policy (see
                :class:`aps._base._imports.PolicyPin`), naming it and the flag that would allow it.
        """
        return None if policy is None else self._pin.check(policy)

    async def _build_envs(self, session: Session, answer: Welcome) -> None:
        try:
            self._policy_path = self._check_policy(answer.policy)
        except ConfigError as exc:
            await session.send(ErrorReport.of(exc))
            raise
        self._resume_window = answer.resume_window
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
                num_envs=self.num_slots,
            )
        )

    def _forget_session(self) -> None:
        """Start over as a new worker: fresh envs, no answers kept."""
        if self._server is not None:
            if self._server.collector is not None:
                self._server.collector.close()  # its thread, before the envs it steps
            self._server.close()
            self._server = None

    async def _make_envs(self, session: Session, answer: Welcome) -> StepServer:
        envs: AnyVectorEnv | None = None
        try:
            mode = AutoresetMode(answer.autoreset_mode)
            # Building the envs is the user's code and may be slow: it is outside the
            # handshake deadline on purpose, bounded by the learner's wait instead.
            first, self._first_env = self._first_env, None
            envs = make_vector_env(
                self._vector,
                self._env_fn,
                num_envs=self.num_envs,
                autoreset_mode=mode,
                env=self._env,
                env_kwargs=self._env_kwargs,
                first_env=first,
                multi_agent=bool(self._agents),
            )
            collector = (
                None
                if self._policy_path is None
                else Collector(envs, self._policy_path, mode, dict(answer.policy_kwargs or {}))
            )
        except Exception as exc:
            await session.send(ErrorReport.of(exc))
            what = "envs" if envs is None else f"policy {answer.policy!r}"
            if envs is not None:
                envs.close()
            raise ConfigError(f"could not build the {what} for {self._env_name!r}: {exc}") from exc
        # Not "ready" yet: the learner may still refuse these envs (spaces that disagree
        # with the other workers'); _serve says so once the learner's first request came.
        log.info(
            "worker %d built %d x %s (%s) and offers them to the learner",
            answer.worker_id,
            self.num_envs,
            self._env_name,
            self._vector,
        )
        return self._new_server(envs, collector)

    def _new_server(self, envs: AnyVectorEnv, collector: Collector | None) -> StepServer:
        """The step server of a new session; a subclass may serve with its own."""
        return StepServer(
            envs, collector, self._seed, allow_private_env_calls=self._allow_private_env_calls
        )

    async def _serve(self, session: Session) -> None:
        server = self._server
        assert server is not None
        server.learner_host = urlsplit(session.peer).hostname or "127.0.0.1"
        server.max_frame_size = session.max_frame_size
        timeout = self._timeouts.heartbeat_timeout
        serving = False  # until a request shows that the learner took our envs
        while True:
            try:
                request = await session.receive(timeout=timeout, operation="the next request")
            except EndOfStream:
                if session.goodbye is None:
                    raise  # closed without a goodbye: the connection dropped
                log.info(
                    "worker %s stops: the learner at %s said goodbye (%s)",
                    *(self._name(), session.peer, session.goodbye or "no reason given"),
                )
                return
            if not serving and not isinstance(request, Reject):
                serving = True
                log.info("worker %s serves the learner at %s", self._name(), session.peer)
            # Every numbered request, of any kind (aps.session.protocol.REQUESTS): one lookup, which
            # the step every lockstep step brings costs no more than a type test.
            if type(request) in REQUESTS:
                if await server.answer(session, cast(Request, request)):
                    self.replayed += 1
            elif isinstance(request, Weights):
                # Between chunks: a version that arrived while a chunk was acted (in the
                # collector's thread) was read meanwhile and applies from the next request.
                if request.arrays is None:  # it came by the weight group
                    weights = await server.group_weights(request)
                    if weights is not None:
                        server.load_weights(weights)
                else:
                    server.load_weights(request)
            elif isinstance(request, GroupWeights):
                server.announce_weights(request)
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


def _unresolvable(exc: BaseException) -> str | None:
    """Why a dial failed for a host name that does not exist, or ``None``.

    Only a definite answer counts (the resolver says there is no such name); a resolver that
    failed for now (``EAI_AGAIN``: a DNS server not answering, a name not yet published) is
    worth dialing again.
    """
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, socket.gaierror) and seen.errno in _NO_SUCH_NAME:
            return str(seen.strerror or seen)
        seen = seen.__cause__ or seen.__context__
    return None


_NO_SUCH_NAME = frozenset(
    getattr(socket, name) for name in ("EAI_NONAME", "EAI_NODATA") if hasattr(socket, name)
)
