"""The learner role: accept workers and step all their envs as one batch.

A :class:`Learner` listens on one URL, admits ``num_workers`` workers (handshake, token proof,
spaces that agree), and then exposes their envs in one stable order (worker registration
order, then env index) through :meth:`Learner.reset` and :meth:`Learner.step`. Each call sends
one message per worker, never one per env, and stitches the replies with array operations.

A bad peer (malformed frames, a wrong token, the wrong protocol version, disagreeing spaces,
a slow handshake) is refused with a specific error, logged and closed; the learner keeps
serving everyone else.

A worker that is lost (its process died, its connection dropped or it went silent past a
deadline) is handled as ``on_worker_lost`` says: ``"raise"`` :class:`~aps.errors.WorkerLost`
from the pending call, ``"wait"`` up to ``reconnect_timeout`` for the worker to resume its
session or for a replacement to take its env slots, or ``"drop"`` it from chunk streams and
gradient rounds. Requests are numbered (see :mod:`aps.messages`), so a resumed worker's
answers arrive exactly once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import ipaddress
import logging
import math
import os
import secrets
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, Protocol, Self, TypeVar
from urllib.parse import urlsplit

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_space

from aps import codec, transports
from aps._typing import Array, Info
from aps.batching import check_batch, concat, merge_infos, split
from aps.collect import Chunk, Metrics, PolicyVersions, Rollout, WorkerMetrics, sample_states
from aps.errors import (
    ApsError,
    AuthError,
    ConfigError,
    EndOfStream,
    InvalidState,
    ProtocolError,
    Timeout,
    TransportClosed,
    TransportError,
    VersionMismatch,
    WorkerError,
    WorkerLost,
)
from aps.messages import (
    PROTOCOL_VERSION,
    Challenge,
    ErrorReport,
    GradientReport,
    GradientRound,
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
from aps.protocol import MAX_IN_FLIGHT, NONCE_SIZE, Role, State, check_hello
from aps.session import Session, Timeouts
from aps.sync import AlwaysSync, SyncContext, SyncStrategy
from aps.transports.base import Listener, TransportFactory

__all__ = ["Learner", "WorkerInfo"]

MAX_HANDSHAKES = 64
"""The most connections a learner admits at once; more are closed at once."""


REPORT_BACKLOG = 2
"""Gradient reports the learner buffers per worker; beyond them the workers wait (backpressure)."""

SESSION_ID_SIZE = 16
"""Random bytes in a session id (what a worker resumes its session with)."""

OnWorkerLost = Literal["raise", "wait", "drop"]

log = logging.getLogger("aps.learner")

_R = TypeVar("_R", bound=Message)

StepReturn = tuple[Any, Array, Array, Array, Info]
"""``(observations, rewards, terminations, truncations, infos)``, batched over all envs."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerInfo:
    """What the learner knows about one admitted worker."""

    worker_id: int
    """Unique within this learner, in order of arrival."""
    env_offset: int
    """Global index of the worker's first env."""
    num_envs: int
    env_id: str
    host: str
    pid: int
    peer: str
    label: str = ""
    """What the worker was started as (a launcher sets its index: ``"0"``, ``"1"``, ...)."""


class _Launcher(Protocol):
    """An :class:`aps.launch.Launcher` as the learner sees it.

    The launchers live in a higher layer than the roles (they start workers), so the learner
    names only the members it calls, without importing them.
    """

    @property
    def spec(self) -> Any: ...  # an aps.launch.WorkerSpec

    async def start(self, url: str, spec: Any = None) -> None: ...

    async def status(self) -> object: ...

    async def watch(self) -> None: ...

    async def stop(self, grace: float = ...) -> None: ...


_Inbox = asyncio.Queue[tuple["_Remote", Message | BaseException]]


def _expect(message: Message, kind: type[_R]) -> _R:
    assert isinstance(message, kind), message  # the protocol table allows nothing else
    return message


"""Replies from several workers, and their failures, in arrival order."""


@dataclass(slots=True, eq=False)
class _Remote:
    """One worker's env slots, and the connection serving them now.

    The connection changes when the worker resumes its session and the worker itself when a
    replacement takes the slots over; ``generation`` counts both.
    """

    info: WorkerInfo
    session: Session
    metrics: WorkerMetrics
    session_id: bytes
    steps_since_sync: int = 0
    synced_at: float = 0.0
    last_chunk_version: int = 0
    states: Array | None = None  # a sample of the states it acted on last, for divergence
    # Numbered requests: the next seq, the answers received, the requests not answered yet
    # (oldest first, sent again after a resume) and the generation they were all sent on.
    sent: int = 0
    received: int = 0
    unanswered: collections.deque[Request] = field(default_factory=collections.deque)
    generation: int = 0
    delivered: int = 0
    attached: asyncio.Event = field(default_factory=asyncio.Event)
    # A replacement took over: the requests of the lost worker are void (``lost`` of them),
    # and its envs have not been reset yet.
    restarted: bool = False
    lost: int = 0
    needs_reset: bool = False
    preparing: bool = False  # its reset is outstanding: other requests wait (counted in lost)
    reset_next: bool = False  # NextStep: the step after a restart is the envs' reset


@dataclass(slots=True, eq=False)
class _Spare:
    """A worker admitted while every slot was taken: it waits to replace a lost one."""

    session: Session
    hello: Hello
    worker_id: int
    session_id: bytes


@functools.lru_cache(maxsize=1024)
def _row_ids(env_offset: int, num_envs: int, worker_id: int) -> tuple[Array, Array]:
    """A worker's rows in :meth:`Learner.recv`: global env ids, and its id on each row."""
    rows = np.arange(env_offset, env_offset + num_envs), np.full(num_envs, worker_id, np.int64)
    for array in rows:
        array.flags.writeable = False  # shared by every recv(), which hands out copies
    return rows


def _is_loopback(url: str) -> bool:
    parts = urlsplit(url)
    if parts.scheme in ("memory", "unix"):  # this process; this host, by file permission
        return True
    host = parts.hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Learner:
    """Admits workers and steps their envs as one batch; an async context manager.

    Args:
        listen: the URL to bind (``"tcp://127.0.0.1:0"``, ``"ws://0.0.0.0:7000"``,
            ``"memory://"``) or a bound :class:`~aps.transports.Listener`.
        num_workers: how many workers to wait for.
        token: a shared secret workers must prove they know (HMAC challenge; the token never
            crosses the wire). Required when listening on a non-loopback address.
        autoreset_mode: Gymnasium's autoreset mode, applied on the workers.
        timeouts: the deadlines, see :class:`~aps.session.Timeouts`.
        insecure: allow a non-loopback address without a token.
        factory: the transport factory to listen with, instead of the URL scheme's; this is
            where TLS and a frame size limit other than 256 MiB are set, e.g.
            ``TCPFactory(ssl_context=..., max_frame_size=...)``.
        policy: import path of the policy workers act with (``"pkg.module:make_agent"`` or
            ``"path/to/script.py:Agent"``, called with the single observation and action
            spaces); enables :meth:`publish`, :meth:`rollout` and :meth:`chunks`.
        sync: when a worker gets a newly published version (:mod:`aps.sync`); default
            :class:`~aps.sync.AlwaysSync`.
        launcher: an :class:`aps.launch.Launcher` (``aps.launch.local/ray/slurm(...)``) that
            starts the workers: the learner starts it once bound (handing it the URL, the
            token and the policy), watches it while waiting for the workers (a launch that
            fails ends the wait at once), and stops it when it closes or when the workers do
            not all arrive in time.
        on_worker_lost: what a lost worker does to the call that notices it. ``"raise"``
            (default): :class:`~aps.errors.WorkerLost`, and the learner is unusable.
            ``"wait"``: wait up to ``reconnect_timeout`` seconds for the worker to resume its
            session (the call then completes as if nothing happened) or for a new worker with
            the same number of envs to take its slots (a :meth:`step` then reports those envs
            ``truncated`` with ``info["worker_restarted"]``). While every slot is taken, new
            workers are kept as spares for this. ``"drop"``: chunk streams and gradient
            rounds go on with the other workers; lockstep calls raise.
        reconnect_timeout: seconds ``"wait"`` waits for a resume or a replacement.

    Entering the context binds the address (see :attr:`url`); the first :meth:`reset` waits
    for the workers (or call :meth:`wait_for_workers`).

    Example:
        >>> async def main():  # doctest: +SKIP
        ...     async with Learner("tcp://127.0.0.1:0", num_workers=2) as learner:
        ...         print(learner.url)  # start the workers against this URL
        ...         obs, info = await learner.reset(seed=0)
        ...         obs, rew, term, trunc, info = await learner.step(learner.action_space.sample())
    """

    def __init__(
        self,
        listen: str | Listener = "tcp://127.0.0.1:0",
        *,
        num_workers: int,
        token: str | bytes | None = None,
        autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
        timeouts: Timeouts | None = None,
        insecure: bool = False,
        factory: TransportFactory | None = None,
        policy: str | None = None,
        sync: SyncStrategy | None = None,
        launcher: _Launcher | None = None,
        on_worker_lost: OnWorkerLost = "raise",
        reconnect_timeout: float = 60.0,
    ) -> None:
        if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1:
            raise ConfigError(f"num_workers must be an int >= 1, got {num_workers!r}")
        if on_worker_lost not in ("raise", "wait", "drop"):
            raise ConfigError(
                f"on_worker_lost must be 'raise', 'wait' or 'drop', got {on_worker_lost!r}"
            )
        if (
            not isinstance(reconnect_timeout, int | float)
            or isinstance(reconnect_timeout, bool)
            or not reconnect_timeout > 0
        ):
            raise ConfigError(
                f"reconnect_timeout must be a positive number of seconds, got {reconnect_timeout!r}"
            )
        self.on_worker_lost: OnWorkerLost = on_worker_lost
        self.reconnect_timeout = float(reconnect_timeout)
        try:
            mode = AutoresetMode(autoreset_mode)
        except ValueError:
            choices = ", ".join(repr(m.value) for m in AutoresetMode)
            raise ConfigError(
                f"autoreset_mode must be one of {choices}, got {autoreset_mode!r}"
            ) from None
        if mode is AutoresetMode.DISABLED:
            raise ConfigError(
                "autoreset_mode 'Disabled' is not supported; use 'NextStep' or 'SameStep'"
            )
        self._listen = listen
        self.num_workers = num_workers
        self._token = token.encode() if isinstance(token, str) else token
        self.autoreset_mode = mode
        self._timeouts = timeouts or Timeouts()
        self._insecure = insecure
        self._factory = factory
        if policy is not None and (not isinstance(policy, str) or ":" not in policy):
            raise ConfigError(
                f"policy must be an import path 'package.module:factory' or "
                f"'path/to/file.py:factory', got {policy!r}"
            )
        self.policy = policy
        sync = AlwaysSync() if sync is None else sync
        if not isinstance(sync, SyncStrategy):
            raise ConfigError(
                f"sync must have a should_sync(ctx) method (see aps.sync), got {sync!r}"
            )
        self.sync = sync
        self.launcher = launcher
        self._launched = False
        self._versions: PolicyVersions | None = None
        self._gradient_mode = False
        self._gradient_remotes: list[_Remote] = []
        self._gradient_pumps: list[asyncio.Task[None]] = []
        self._gradient_inbox: _Inbox = asyncio.Queue(REPORT_BACKLOG * num_workers)
        self._round: tuple[GradientRound, bytes] | None = None
        self._stream: AsyncGenerator[Chunk, None] | None = None
        self._previous_stream: AsyncGenerator[Chunk, None] | None = None

        self._listener: Listener | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._admissions: set[asyncio.Task[None]] = set()
        self._admitting = 0
        self._next_id = 0
        self._remotes: list[_Remote] = []
        self._by_session: dict[bytes, _Remote] = {}
        self._spares: list[_Spare] = []
        self._dropped: set[int] = set()  # worker ids left out of chunk streams and rounds
        self._former: list[WorkerMetrics] = []  # metrics of workers that were replaced
        self.restarts = 0
        """Workers that replaced lost ones."""
        self._all_ready = asyncio.Event()
        self._refusals: list[str] = []
        self._spaces: tuple[gym.Space[Any], gym.Space[Any]] | None = None
        self._counts: list[int] = []
        self._offsets: list[int] = []
        self._busy = False
        self._partial: dict[_Remote, asyncio.Task[Message]] = {}  # send() -> recv()
        self._answered: asyncio.Future[None] | None = None  # recv() waits; an answer wakes it
        self._was_reset = False
        self._broken: ApsError | None = None
        self._closed = False

    # Lifecycle.

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Bind the address and start admitting workers; idempotent.

        Raises:
            ConfigError: a non-loopback address without a token (and not ``insecure``), or a
                malformed URL.
            ConnectError: the address cannot be bound.
            LaunchError | MissingDependency: the launcher could not start the workers (the
                learner is closed again).
        """
        if self._closed:
            raise InvalidState("this learner is closed; create a new one")
        if self._listener is not None:
            return
        url = self._listen if isinstance(self._listen, str) else self._listen.url
        if self._token is None and not self._insecure and not _is_loopback(url):
            raise ConfigError(
                f"refusing to listen on {url!r} without a token: anyone who can reach it could "
                "attach a worker; pass token=... (workers use --token-file), or insecure=True "
                "on a network you trust"
            )
        if isinstance(self._listen, str):
            factory = self._factory or transports.get_factory(transports.scheme_of(self._listen))
            self._listener = await factory.listen(self._listen)
        else:
            self._listener = self._listen
        self._accept_task = asyncio.create_task(self._accept_loop(), name="aps accept loop")
        log.info("learner listening on %s for %d workers", self.url, self.num_workers)
        if self.launcher is not None and not self._launched:
            self._launched = True
            try:
                spec = self.launcher.spec.for_learner(
                    self.url, token=self._token, policy=self.policy
                )
                await self.launcher.start(self.url, spec)
            except BaseException:
                await self.aclose()
                raise

    @property
    def url(self) -> str:
        """The bound address, with port 0 resolved; workers dial it."""
        if self._listener is None:
            raise InvalidState("the learner is not started; use 'async with' or await start()")
        return self._listener.url

    async def aclose(self) -> None:
        """Say goodbye to every worker and stop listening; idempotent."""
        if self._closed:
            return
        if self._stream is not None:
            with contextlib.suppress(ApsError):
                await self._stream.aclose()
        if self._gradient_mode:
            await self.stop_gradients()
        await self._cancel_partial()
        self._closed = True
        if self._accept_task is not None:
            self._accept_task.cancel()
        for task in list(self._admissions):
            task.cancel()
        tasks = [t for t in (self._accept_task, *self._admissions) if t is not None]
        if tasks:
            await asyncio.wait(tasks)
        if self._listener is not None:
            await self._listener.aclose()
        sessions = [r.session for r in self._remotes] + [s.session for s in self._spares]
        await asyncio.gather(
            *(session.aclose("the learner is closing") for session in sessions),
            return_exceptions=True,
        )
        if self.launcher is not None:
            await self.launcher.stop()

    # Admission.

    async def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            try:
                transport = await self._listener.accept()
            except TransportClosed:
                return
            except TransportError as exc:
                log.warning("accept failed: %s", exc)
                await asyncio.sleep(0.05)
                continue
            if len(self._admissions) >= MAX_HANDSHAKES:
                # A flood of connections that never finish their handshake must not hold
                # unbounded resources; each pending one already ends at the handshake deadline.
                log.warning(
                    "refused %s: %d handshakes already in progress", transport.peer, MAX_HANDSHAKES
                )
                await transport.aclose()
                continue
            session = Session(
                transport,
                Role.LEARNER,
                heartbeat_interval=self._timeouts.heartbeat_interval,
            )
            task = asyncio.create_task(self._admit(session), name=f"aps admit {session.peer}")
            self._admissions.add(task)
            task.add_done_callback(self._admissions.discard)

    async def _admit(self, session: Session) -> None:
        admitted = False
        reason = ""
        try:
            await self._handshake(session)
            admitted = True
        except ApsError as exc:
            reason = self._refuse(session, exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # A bug must not leave a silent task behind: refuse the worker and say why.
            log.exception("admitting %s failed unexpectedly", session.peer)
            reason = self._refuse(session, exc)
        finally:
            if not admitted:
                # The goodbye tells the peer why (unless a Reject or a goodbye already did).
                await session.aclose(reason)

    def _refuse(self, session: Session, exc: BaseException) -> str:
        """Log and remember why ``session`` was refused; return the reason for its goodbye."""
        reason = f"{type(exc).__name__}: {exc}"
        text = f"{session.peer}: {reason}"
        self._refusals.append(text)
        del self._refusals[:-20]  # keep the last few for error messages, never grow
        log.warning("refused a worker at %s", text)
        return reason[:200]

    async def _reject(self, session: Session, error: ApsError) -> None:
        with contextlib.suppress(TransportError, InvalidState):
            await session.send(Reject(kind=type(error).__name__, reason=str(error)))
        raise error

    async def _handshake(self, session: Session) -> None:
        timeouts = self._timeouts
        nonce = os.urandom(NONCE_SIZE)
        try:
            async with asyncio.timeout(timeouts.handshake):
                await session.send(Challenge(protocol_version=PROTOCOL_VERSION, nonce=nonce))
                hello = await session.receive(timeout=None, operation="the worker's hello")
        except TimeoutError as exc:
            if isinstance(exc, Timeout):
                raise
            raise Timeout(
                f"no hello from {session.peer} within {timeouts.handshake} s; dropped it",
                operation="handshake",
                seconds=timeouts.handshake,
            ) from None
        assert isinstance(hello, Hello)  # the protocol table allows nothing else
        try:
            check_hello(hello, nonce=nonce, token=self._token)
        except (VersionMismatch, AuthError) as exc:
            await self._reject(session, exc)
        if not isinstance(hello.num_envs, int) or hello.num_envs < 1:
            await self._reject(session, ConfigError(f"num_envs must be >= 1, got {hello.num_envs}"))
        resumed = self._by_session.get(hello.resume) if hello.resume else None
        if resumed is not None:
            await self._resume(session, hello, resumed)
            return
        # A new worker (or one whose session this learner does not know: it restarted).
        spare = len(self._remotes) + self._admitting >= self.num_workers
        if spare and (self.on_worker_lost != "wait" or len(self._spares) >= self.num_workers):
            why = (
                "start the learner with a larger num_workers"
                if self.on_worker_lost != "wait"
                else f"{len(self._spares)} spares already wait to replace lost workers"
            )
            await self._reject(
                session,
                ConfigError(f"this learner already has its {self.num_workers} workers; {why}"),
            )
        self._admitting += 0 if spare else 1
        try:
            worker_id = self._next_id
            self._next_id += 1
            session_id = secrets.token_bytes(SESSION_ID_SIZE)
            await self._welcome(session, hello, worker_id, session_id, resumed=False)
        finally:
            self._admitting -= 0 if spare else 1
        if spare:
            session.start_heartbeats()
            self._spares.append(_Spare(session, hello, worker_id, session_id))
            log.info("worker %d from %s waits as a spare", worker_id, session.peer)
            await self._fill_vacancies()
        else:
            self._register(session, hello, worker_id, session_id)

    async def _welcome(
        self, session: Session, hello: Hello, worker_id: int, session_id: bytes, *, resumed: bool
    ) -> None:
        """Send the welcome and wait until the worker's envs are ready with the right spaces."""
        await session.send(
            Welcome(
                worker_id=worker_id,
                autoreset_mode=self.autoreset_mode.value,
                policy=self.policy,
                session_id=session_id,
                resumed=resumed,
            )
        )
        # Building envs runs user code and may take long: the step deadline bounds it.
        ready = await session.receive(
            timeout=self._timeouts.step, operation="the worker to build its envs"
        )
        if isinstance(ready, ErrorReport):
            raise ConfigError(
                f"the worker could not build its envs or policy: "
                f"{ready.remote_type}: {ready.message}"
            )
        assert isinstance(ready, Ready)
        await self._check_spaces(session, ready, hello)
        if self._spaces is None:
            self._spaces = (ready.observation_space, ready.action_space)

    async def _resume(self, session: Session, hello: Hello, remote: _Remote) -> None:
        """Take a worker whose connection dropped back into its session and env slots."""
        info = remote.info
        if not (
            remote.received <= hello.served <= remote.sent
            and hello.num_envs == info.num_envs
            and hello.version <= remote.metrics.version
            and info.worker_id not in self._dropped
        ):
            await self._reject(
                session,
                ProtocolError(
                    f"cannot resume worker {info.worker_id}'s session: it says it answered "
                    f"{hello.served} requests of {info.num_envs} envs holding version "
                    f"{hello.version}, but it was sent {remote.sent} requests "
                    f"({remote.received} answered) for {info.num_envs} envs, and version "
                    f"{remote.metrics.version}"
                    + (", and it was dropped" if info.worker_id in self._dropped else "")
                    + "; restart the worker without resuming"
                ),
            )
        await self._welcome(session, hello, info.worker_id, remote.session_id, resumed=True)
        # Weights sent before the cut may be lost: the worker's word is what it holds.
        remote.metrics.version = hello.version
        remote.metrics.resumes += 1
        log.warning("worker %d resumed its session from %s", info.worker_id, session.peer)
        await self._attach(remote, session)

    async def _attach(self, remote: _Remote, session: Session) -> None:
        """Make ``session`` the one serving ``remote`` and close the one it replaces."""
        old, remote.session = remote.session, session
        remote.generation += 1
        session.start_heartbeats()
        remote.attached.set()
        # A call still waiting on the old connection fails at once and carries on here.
        await old.aclose("another connection took over this worker's session")

    async def _fill_vacancies(self) -> None:
        """Give each lost worker's slots to a spare with as many envs, if there is one."""
        for remote in self._remotes:
            if remote.attached.is_set():
                continue
            for spare in self._spares:
                if spare.hello.num_envs == remote.info.num_envs:
                    self._spares.remove(spare)
                    await self._replace(remote, spare)
                    break

    async def _replace(self, remote: _Remote, spare: _Spare) -> None:
        lost, hello = remote.info, spare.hello
        remote.info = dataclasses.replace(
            lost,
            worker_id=spare.worker_id,
            env_id=hello.env_id,
            host=hello.host,
            pid=hello.pid,
            label=hello.label,
            peer=spare.session.peer,
        )
        self._former.append(remote.metrics)
        remote.metrics = WorkerMetrics(worker_id=spare.worker_id)
        del self._by_session[remote.session_id]
        remote.session_id = spare.session_id
        self._by_session[spare.session_id] = remote
        # Chunks the lost worker owed a stream are asked of the new one (see _chunk_pump).
        remote.lost += sum(isinstance(r, RolloutRequest) for r in remote.unanswered)
        remote.unanswered.clear()
        remote.sent = remote.received = 0
        remote.steps_since_sync = remote.last_chunk_version = 0
        remote.states = None
        remote.restarted = True
        remote.needs_reset = self._was_reset
        self.restarts += 1
        log.warning(
            "worker %d from %s took over the envs %d..%d of lost worker %d",
            *(spare.worker_id, spare.session.peer, lost.env_offset),
            *(lost.env_offset + lost.num_envs - 1, lost.worker_id),
        )
        await self._attach(remote, spare.session)

    async def _check_spaces(self, session: Session, ready: Ready, hello: Hello) -> None:
        if ready.num_envs != hello.num_envs:
            await self._reject(
                session,
                ProtocolError(f"hello said {hello.num_envs} envs, ready said {ready.num_envs}"),
            )
        if self._spaces is None:
            return
        observation_space, action_space = self._spaces
        for name, theirs, ours in (
            ("observation", ready.observation_space, observation_space),
            ("action", ready.action_space, action_space),
        ):
            if theirs != ours:
                await self._reject(
                    session,
                    ConfigError(
                        f"worker {hello.env_id!r} has {name} space {theirs}, but the workers "
                        f"already admitted have {ours}; every worker must run envs with the "
                        "same spaces"
                    ),
                )

    def _register(self, session: Session, hello: Hello, worker_id: int, session_id: bytes) -> None:
        offset = sum(self._counts)
        info = WorkerInfo(
            worker_id=worker_id,
            env_offset=offset,
            num_envs=hello.num_envs,
            env_id=hello.env_id,
            host=hello.host,
            pid=hello.pid,
            label=hello.label,
            peer=session.peer,
        )
        remote = _Remote(
            info=info,
            session=session,
            metrics=WorkerMetrics(worker_id=worker_id),
            session_id=session_id,
        )
        remote.attached.set()
        self._remotes.append(remote)
        self._by_session[session_id] = remote
        self._counts.append(hello.num_envs)
        self._offsets.append(offset)
        session.start_heartbeats()
        last = offset + hello.num_envs - 1
        log.info(
            "worker %d admitted from %s: %d x %s (envs %d..%d)",
            *(worker_id, session.peer, hello.num_envs, hello.env_id, offset, last),
        )
        if len(self._remotes) == self.num_workers:
            self._all_ready.set()

    async def wait_for_workers(self, timeout: float | None = None) -> None:
        """Wait until all ``num_workers`` workers are admitted.

        Args:
            timeout: seconds to wait; default ``timeouts.connect``.

        With a launcher, the wait also watches it: workers that die before they connect end
        the wait at once, and on any failure the launcher is stopped (its job cancelled).

        Raises:
            Timeout: not all workers arrived in time; the message says how many did, why any
                were refused, and what the launcher reports (a Slurm job's state).
            WorkerLost | LaunchError: the launcher's workers died before they all connected.
        """
        await self.start()
        if self._all_ready.is_set():
            return
        seconds = self._timeouts.connect if timeout is None else timeout
        try:
            if self.launcher is None:
                async with asyncio.timeout(seconds):
                    await self._all_ready.wait()
            else:
                await self._wait_watching(self.launcher, seconds)
        except TimeoutError:
            refused = "; ".join(self._refusals[-3:]) or "none"
            message = (
                f"{len(self._remotes)} of {self.num_workers} workers arrived at {self.url} "
                f"within {seconds} s (recent refusals: {refused})"
            )
            if self.launcher is None:
                message += "; start the missing workers or raise Timeouts.connect"
            else:
                message += f"; {await self._give_up_launch()}; raise Timeouts.connect if the "
                message += "workers need longer to start"
            raise Timeout(message, operation="wait_for_workers", seconds=seconds) from None
        except ApsError:
            if self.launcher is not None:
                await self._give_up_launch()
            raise

    async def _wait_watching(self, launcher: _Launcher, seconds: float) -> None:
        """Wait for the workers while the launcher watches them; TimeoutError when late."""
        waiting = asyncio.create_task(self._all_ready.wait())
        watching = asyncio.create_task(launcher.watch())
        try:
            done, _ = await asyncio.wait(
                {waiting, watching}, timeout=seconds, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            waiting.cancel()
            watching.cancel()
            await asyncio.wait({waiting, watching})
        if waiting in done:
            return
        if watching in done:
            watching.result()  # raises the launcher's WorkerLost or LaunchError
        raise TimeoutError

    async def _give_up_launch(self) -> str:
        """Stop the launcher after a failed wait; return what it reported just before."""
        assert self.launcher is not None
        try:
            report = f"{await self.launcher.status()}"
        except Exception as exc:  # the report only decorates an error already on its way
            report = f"the launcher could not report its state ({exc!r})"
        try:
            await self.launcher.stop(grace=0.0)  # no goodbye was said: nobody leaves alone
        except Exception as exc:
            log.warning("stopping the launcher failed: %r", exc)
            return f"{report}; stopping it failed: {exc}"
        return f"{report}; the launcher has been stopped"

    # The batch.

    @property
    def workers(self) -> tuple[WorkerInfo, ...]:
        """The admitted workers in env order."""
        return tuple(r.info for r in self._remotes)

    @property
    def num_envs(self) -> int:
        """Total envs over all workers (known once the workers are admitted)."""
        self._require_workers()
        return sum(self._counts)

    @property
    def single_observation_space(self) -> gym.Space[Any]:
        """The observation space of one env, as the workers reported it."""
        return self._require_workers()[0]

    @property
    def single_action_space(self) -> gym.Space[Any]:
        """The action space of one env, as the workers reported it."""
        return self._require_workers()[1]

    @property
    def observation_space(self) -> gym.Space[Any]:
        """The batched observation space over all envs."""
        return batch_space(self.single_observation_space, self.num_envs)

    @property
    def action_space(self) -> gym.Space[Any]:
        """The batched action space over all envs."""
        return batch_space(self.single_action_space, self.num_envs)

    def _require_workers(self) -> tuple[gym.Space[Any], gym.Space[Any]]:
        if self._spaces is None or not self._all_ready.is_set():
            raise InvalidState(
                "the workers have not all arrived yet; await wait_for_workers() or reset() first"
            )
        return self._spaces

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, Info]:
        """Reset every env; waits for the workers first if needed.

        Args:
            seed: global env ``i`` is seeded with ``seed + i``, as Gymnasium's vector envs do.
                ``None`` lets each worker use its own seed on its first reset.
            options: passed to every env's ``reset``.

        Returns:
            ``(observations, infos)`` batched over all envs.

        Raises:
            WorkerError: an env raised on a worker.
            WorkerLost: a worker disconnected; this learner can no longer step.
            Timeout: a worker took longer than ``timeouts.step``.
        """
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ConfigError(f"seed must be an int or None, got {seed!r}")
        await self.wait_for_workers()
        requests = [
            ResetRequest(seed=None if seed is None else seed + offset, options=options)
            for offset in self._offsets
        ]
        answers = await self._exchange(requests, "reset")
        results = [_expect(a, ResetResult) for a in answers]
        for remote in self._remotes:
            remote.needs_reset = remote.reset_next = False
        observation_space = self.single_observation_space
        obs = concat(observation_space, [r.obs for r in results], self._counts)
        info = merge_infos(
            list(zip(self._offsets, (r.info for r in results), strict=True)), self.num_envs
        )
        self._was_reset = True
        return obs, info

    async def step(self, actions: Any) -> StepReturn:
        """Step every env with its action.

        Args:
            actions: one batched action for all envs, shaped like :attr:`action_space`.

        Returns:
            ``(observations, rewards, terminations, truncations, infos)``, as a Gymnasium
            vector env returns them (autoreset as :attr:`autoreset_mode` says). Envs whose
            worker was replaced during the step (``on_worker_lost="wait"``) end their episode
            there: ``truncated``, reward 0, ``info["worker_restarted"]``, and the observation
            is the replacement's reset observation; under ``NextStep`` their next step is the
            reset step.

        Raises:
            ConfigError: ``actions`` has the wrong shape or dtype (nothing was sent).
            InvalidState: called before :meth:`reset`, or concurrently.
            WorkerError: an env raised on a worker.
            WorkerLost: a worker was lost (and did not come back in time under ``"wait"``);
                this learner can no longer step.
            Timeout: a worker took longer than ``timeouts.step``.
        """
        if not self._was_reset:
            raise InvalidState("call reset() before step()")
        requests = self._step_requests(self._remotes, actions, self._counts)
        answers = await self._exchange(requests, "step")
        return self._step_results(self._remotes, answers)

    def _step_requests(
        self, remotes: Sequence[_Remote], actions: Any, counts: Sequence[int]
    ) -> list[Request]:
        space = self.single_action_space
        batch = check_batch(space, actions, sum(counts))
        # A replacement's envs are reset instead of stepped (see _restarted_step).
        return [
            ResetRequest(seed=None, options=None)
            if remote.needs_reset or remote.reset_next
            else StepRequest(actions=part)
            for remote, part in zip(remotes, split(space, batch, counts), strict=True)
        ]

    def _step_results(self, remotes: Sequence[_Remote], answers: Sequence[Message]) -> StepReturn:
        """Stitch the step answers of ``remotes`` (in env order) into one batch.

        Raises:
            ProtocolError: an answer is not a step of exactly its worker's envs; this
                learner can no longer step then.
        """
        try:
            return self._stitch(remotes, answers)
        except ProtocolError as exc:
            self._broken = exc
            raise

    def _stitch(self, remotes: Sequence[_Remote], answers: Sequence[Message]) -> StepReturn:
        obs: list[Any] = []
        reward: list[Array] = []
        terminated: list[Array] = []
        truncated: list[Array] = []
        infos: list[tuple[int, Info]] = []
        counts: list[int] = []
        offset = 0
        for remote, answer in zip(remotes, answers, strict=True):
            if type(answer) is not StepResult:
                answer = (
                    self._restarted_step(remote, answer)
                    if isinstance(answer, ResetResult)
                    else _expect(answer, StepResult)
                )
            count = remote.info.num_envs
            for name, array, kinds in (
                ("reward", answer.reward, "fiu"),
                ("terminated", answer.terminated, "b"),
                ("truncated", answer.truncated, "b"),
            ):
                if array.shape != (count,) or array.dtype.kind not in kinds:
                    raise ProtocolError(
                        f"worker {remote.info.worker_id} sent a step whose {name} is an array of "
                        f"shape {array.shape} and dtype {array.dtype}, expected shape ({count},) "
                        f"and a {'bool' if kinds == 'b' else 'numeric'} dtype; the worker is not "
                        "a compatible aps worker"
                    )
            obs.append(answer.obs)
            reward.append(answer.reward)
            terminated.append(answer.terminated)
            truncated.append(answer.truncated)
            infos.append((offset, answer.info))
            counts.append(count)
            offset += count
        # Concatenating copies even a single worker's batch: users get writable arrays.
        return (
            concat(self.single_observation_space, obs, counts),
            np.concatenate(reward),
            np.concatenate(terminated),
            np.concatenate(truncated),
            merge_infos(infos, offset),
        )

    # Partial batches (EnvPool's asynchronous API): send to some workers, take who is ready.

    async def send(self, actions: Any, worker_ids: Sequence[int] | None = None) -> None:
        """Step the envs of some workers without waiting for them; :meth:`recv` takes results.

        With this and :meth:`recv` a learner overlaps its own work (inference, updates) with
        the workers' stepping, and never waits for the slowest worker: send to the workers
        :meth:`recv` returned, while the others are still stepping.

        Args:
            actions: a batch of actions for the envs of ``worker_ids``, in that order
                (``sum`` of their ``num_envs`` rows).
            worker_ids: the workers to step (default: every worker); none may have a step
                sent and not yet received.

        Raises:
            ConfigError: an unknown or repeated worker id, or actions of the wrong shape
                (nothing was sent).
            InvalidState: called before :meth:`reset`, for a worker whose last step is not
                received yet, or while another kind of operation runs.
        """
        if not self._was_reset:
            raise InvalidState("call reset() before send()")
        if not self._partial:
            await self._lockstep("send")
        remotes = self._select(worker_ids)
        requests = self._step_requests(remotes, actions, [r.info.num_envs for r in remotes])
        self._busy = True
        for remote, request in zip(remotes, requests, strict=True):
            # Registered first: a send that fails below is still answered (or raised) in recv.
            task = asyncio.create_task(
                self._partial_answer(remote, request), name=f"aps step {remote.info.worker_id}"
            )
            task.add_done_callback(self._wake_recv)
            self._partial[remote] = task
            try:
                await self._send_request(remote, request)
            except WorkerLost as exc:
                self._broken = exc
                await self._cancel_partial()
                raise

    def _select(self, worker_ids: Sequence[int] | None) -> list[_Remote]:
        by_id = {r.info.worker_id: r for r in self._remotes}
        ids = list(by_id) if worker_ids is None else list(worker_ids)
        if len(set(ids)) != len(ids) or not ids:
            raise ConfigError(f"worker_ids must be distinct and not empty, got {worker_ids!r}")
        for worker_id in ids:
            remote = by_id.get(worker_id)
            if remote is None:
                raise ConfigError(
                    f"no worker {worker_id!r}; the workers are {sorted(by_id)} (see .workers)"
                )
            if remote in self._partial:
                raise InvalidState(
                    f"worker {worker_id} still has a step sent and not received; recv() first"
                )
        return [by_id[i] for i in ids]

    def _wake_recv(self, task: asyncio.Task[Message]) -> None:
        waiter = self._answered
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _partial_answer(self, remote: _Remote, request: Request) -> Message:
        answer = await self._answer_from(remote, "step")
        if answer is None:
            answer = await self._after_restart(remote, request, "step")
        return answer

    async def recv(self, min_workers: int = 1) -> StepReturn:
        """Wait until ``min_workers`` of the workers sent to have answered; return their envs.

        Returns every worker that has answered by then (at least ``min_workers``), in env
        order, batched like :meth:`step`; ``info["env_id"]`` holds each row's global env
        index (as EnvPool does) and ``info["worker_id"]`` the id of the worker that stepped
        it, so ``np.unique(info["worker_id"])`` are the workers to :meth:`send` to next.

        Raises:
            ConfigError: ``min_workers`` is not between 1 and the workers awaited.
            InvalidState: nothing was sent, another ``recv()`` is waiting, or the steps it
                waits for were cancelled meanwhile (by :meth:`aclose`, or a :meth:`send`
                that lost a worker).
            WorkerError | WorkerLost | Timeout: as :meth:`step`.
        """
        waiting = self._partial
        if not waiting:
            raise InvalidState("send() before recv()")
        if self._answered is not None:
            raise InvalidState("recv() is already waiting in another task; recv from one task")
        if not isinstance(min_workers, int) or not 1 <= min_workers <= len(waiting):
            raise ConfigError(
                f"min_workers must be in 1..{len(waiting)} (the workers sent to), "
                f"got {min_workers!r}"
            )
        while sum(task.done() for task in waiting.values()) < min_workers:
            if len(waiting) < min_workers:  # cancelled meanwhile, by aclose() or a failed send()
                raise InvalidState(
                    "the steps recv() waited for were cancelled: "
                    f"{self._broken or 'the learner closed'}"
                )
            # One future, woken by each answer, instead of asyncio.wait's callbacks on every
            # pending task per call: recv() runs once per answer with min_workers=1.
            self._answered = waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._answered = None
        ready = [r for r in self._remotes if r in waiting and waiting[r].done()]
        answers: list[Message] = []
        failure: BaseException | None = None
        for remote in ready:
            task = waiting.pop(remote)
            error = task.exception() if not task.cancelled() else InvalidState("cancelled")
            if error is not None:
                failure = failure or error
            elif isinstance(answer := task.result(), ErrorReport):
                failure = failure or self._worker_error(remote, answer)
            else:
                answers.append(answer)
        if isinstance(failure, WorkerLost | Timeout | ProtocolError):
            self._broken = failure
            await self._cancel_partial()
        if not waiting:
            self._busy = False
        if failure is not None:
            raise failure
        try:
            result = self._step_results(ready, answers)
        except ProtocolError:
            await self._cancel_partial()  # the learner is broken: no step is awaited any more
            raise
        rows = [_row_ids(r.info.env_offset, r.info.num_envs, r.info.worker_id) for r in ready]
        env_ids = np.concatenate([env for env, _ in rows])  # copies: the cache stays intact
        info = result[4]
        info["env_id"], info["_env_id"] = env_ids, np.ones(len(env_ids), dtype=np.bool_)
        info["worker_id"] = np.concatenate([worker for _, worker in rows])
        info["_worker_id"] = np.ones(len(env_ids), dtype=np.bool_)
        return result

    async def _cancel_partial(self) -> None:
        tasks = list(self._partial.values())
        self._partial.clear()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        if tasks:
            self._busy = False

    def _restarted_step(self, remote: _Remote, reset: ResetResult) -> StepResult:
        """Turn the reset of a replacement worker's envs into their step result.

        The first one ends the lost worker's episodes (truncated, flagged); under ``NextStep``
        a second reset on the next step plays the part of the autoreset step.
        """
        n = remote.info.num_envs
        restarted = remote.needs_reset
        remote.needs_reset = False
        remote.reset_next = restarted and self.autoreset_mode is AutoresetMode.NEXT_STEP
        info = dict(reset.info)
        if restarted:
            info["worker_restarted"] = np.ones(n, dtype=np.bool_)
            info["_worker_restarted"] = np.ones(n, dtype=np.bool_)
        return StepResult(
            obs=reset.obs,
            reward=np.zeros(n, dtype=np.float64),
            terminated=np.zeros(n, dtype=np.bool_),
            truncated=np.full(n, restarted, dtype=np.bool_),
            info=info,
        )

    async def _lockstep(self, operation: str) -> None:
        """Refuse a lockstep call the learner cannot make now; end an abandoned stream."""
        if self._stream is not None:
            await self._stream.aclose()  # a new operation ends an abandoned chunk stream
        if self._broken is not None:
            raise InvalidState(
                f"this learner can no longer {operation}: {self._broken}; start a new one"
            )
        if self._dropped:
            raise InvalidState(
                f"{operation}() needs every worker's envs, and workers {sorted(self._dropped)} "
                "were dropped (on_worker_lost='drop'); use chunks(), or on_worker_lost='wait'"
            )
        if self._busy:
            what = "sent steps are not all received (recv())" if self._partial else "running"
            raise InvalidState(f"{operation}() called while another operation is {what}")

    async def _exchange(self, requests: Sequence[Request], operation: str) -> list[Message]:
        """Send one request per worker, then collect one answer from each, in worker order."""
        await self._lockstep(operation)
        self._busy = True
        try:
            return await self._exchange_unguarded(requests, operation)
        except (WorkerLost, Timeout, ProtocolError) as exc:
            self._broken = exc
            raise
        except BaseException as exc:
            # Cancelled or failed halfway: replies may still be in flight, so the
            # lockstep with the workers is lost for good.
            if not isinstance(exc, WorkerError):
                self._broken = InvalidState(f"{operation}() was interrupted ({exc!r})")
            raise
        finally:
            self._busy = False

    async def _exchange_unguarded(
        self, requests: Sequence[Request], operation: str
    ) -> list[Message]:
        remotes = self._remotes
        for remote, request in zip(remotes, requests, strict=True):
            if isinstance(request, RolloutRequest):
                await self._prepare(remote, operation)
                await self._maybe_sync(remote)
            await self._send_request(remote, request)
        answers: list[Message] = []
        failure: WorkerError | None = None
        for remote, request in zip(remotes, requests, strict=True):
            answer = await self._answer_from(remote, operation)
            if answer is None:  # a replacement took over: its envs start afresh
                answer = await self._after_restart(remote, request, operation)
            if isinstance(answer, ErrorReport):
                failure = failure or self._worker_error(remote, answer)
                continue
            answers.append(answer)
        if failure is not None:
            raise failure
        return answers

    # Numbered requests, and what happens when a worker is lost.

    async def _send_request(self, remote: _Remote, request: Request) -> None:
        """Number ``request`` for ``remote`` and send it (or keep it for after a resume)."""
        if type(request) is StepRequest:
            # The per-step path: built directly, at half the cost of dataclasses.replace.
            request = StepRequest(actions=request.actions, seq=remote.sent, acked=remote.received)
        else:
            request = dataclasses.replace(request, seq=remote.sent, acked=remote.received)
        remote.sent += 1
        remote.unanswered.append(request)
        if remote.delivered == remote.generation and remote.attached.is_set():
            await self._send(remote, request)

    async def _send(self, remote: _Remote, message: Message, frame: bytes | None = None) -> None:
        """Send to ``remote``; a broken connection is noticed by the next receive."""
        try:
            await remote.session.send(message, frame=frame)
        except TransportError as exc:
            if self.on_worker_lost == "raise":
                raise self._lost(remote, type(message).__name__, exc) from exc
            # Whatever was unanswered goes again on the connection that takes over.
            remote.delivered = -1
            await remote.session.aclose("sending failed")

    async def _answer_from(self, remote: _Remote, operation: str) -> Message | None:
        """Receive ``remote``'s next answer, exactly once.

        Returns ``None`` when a replacement worker took over: the requests of the lost one
        are void.

        Raises:
            WorkerLost: the worker was lost (and, under ``"wait"``, did not come back).
            Timeout: the worker took longer than ``timeouts.step`` (under ``"raise"``; the
                other choices treat a silent worker as lost).
            ProtocolError: the worker broke the protocol.
        """
        while True:
            generation = remote.generation
            try:
                if remote.delivered != generation:
                    await self._resend(remote)
                message = await remote.session.receive(
                    timeout=self._timeouts.step,
                    operation=f"worker {remote.info.worker_id}'s {operation}",
                )
            except (EndOfStream, TransportError, Timeout) as exc:
                if isinstance(exc, Timeout) and self.on_worker_lost == "raise":
                    raise
                await self._recover(remote, generation, operation, exc)
                if remote.restarted:
                    remote.restarted = False
                    return None
                continue
            if self._accept_answer(remote, message):
                return message

    def _accept_answer(self, remote: _Remote, message: Message) -> bool:
        """Count an answer in; ``False`` for one already received (sent again on a resume)."""
        seq = getattr(message, "seq", None)
        if seq is None or seq > remote.received or not remote.unanswered:
            raise ProtocolError(
                f"worker {remote.info.worker_id} sent {type(message).__name__} answering request "
                f"{seq}, but the next answer due is {remote.received} of {remote.sent} sent; "
                "the worker is not a compatible aps worker"
            )
        if seq < remote.received:
            return False
        remote.unanswered.popleft()
        remote.received += 1
        return True

    async def _resend(self, remote: _Remote) -> None:
        """Bring a connection that took over up to date: weights, then unanswered requests."""
        generation = remote.generation
        versions = self._versions
        if versions is not None and versions.current and remote.metrics.version >= 0:
            if remote.metrics.version != versions.current:
                await self._send_weights(remote)  # rehydrate a resumed worker
        # Requests sent meanwhile were only queued; the loop sends those too, in order.
        index = 0
        while index < len(remote.unanswered):
            await self._send(remote, remote.unanswered[index])
            if remote.delivered == -1 or remote.generation != generation:
                return  # failed again: the next receive notices
            index += 1
        remote.delivered = generation

    async def _recover(
        self, remote: _Remote, generation: int, operation: str, exc: BaseException
    ) -> None:
        """Handle the loss of ``remote``'s connection ``generation`` as ``on_worker_lost`` says.

        Returns once another connection serves ``remote`` (resumed or replaced).

        Raises:
            WorkerLost: under ``"raise"`` and ``"drop"``; under ``"wait"`` when nothing took
                over within ``reconnect_timeout``.
        """
        if remote.generation != generation:
            return  # a resume already took over
        if self.on_worker_lost != "wait":
            raise self._lost(remote, operation, exc) from exc
        if remote.attached.is_set():
            remote.attached.clear()
            log.warning(
                "%s; waiting up to %s s for it to resume or for a replacement",
                *(self._lost(remote, operation, exc), self.reconnect_timeout),
            )
            await remote.session.aclose("the learner lost this connection")
            await self._fill_vacancies()
        try:
            async with asyncio.timeout(self.reconnect_timeout):
                await remote.attached.wait()
        except TimeoutError:
            raise WorkerLost(
                f"{self._lost(remote, operation, exc)}, and no worker resumed its session or "
                f"took its envs over within {self.reconnect_timeout} s; start a replacement "
                "worker sooner or raise reconnect_timeout",
                worker_id=remote.info.worker_id,
            ) from exc

    async def _call(self, remote: _Remote, request: Request, operation: str) -> Message:
        """Send one request to ``remote`` and return its answer (from whoever serves it)."""
        await self._send_request(remote, request)
        answer = await self._answer_from(remote, operation)
        if answer is None:
            return await self._after_restart(remote, request, operation)
        return answer

    async def _after_restart(self, remote: _Remote, request: Request, operation: str) -> Message:
        """The answer to ``request`` from a replacement of the worker it was sent to.

        A reset is sent again as it was. Otherwise the replacement's envs are reset first: for
        a step that reset is the answer (see :meth:`_restarted_step`); a rollout is then
        asked again.
        """
        if isinstance(request, ResetRequest):
            return await self._call(remote, request, operation)
        reset = await self._call(remote, ResetRequest(seed=None, options=None), operation)
        if isinstance(request, StepRequest) or isinstance(reset, ErrorReport):
            return reset
        remote.needs_reset = False
        await self._maybe_sync(remote)
        return await self._call(remote, request, operation)

    # Worker-side inference (DETACH) and weight synchronization.

    def _require_policy(self, operation: str) -> PolicyVersions:
        if self.policy is None:
            raise InvalidState(
                f"{operation}() needs workers that act: create the learner with "
                "policy='package.module:make_agent' (or 'path/to/script.py:Agent')"
            )
        if self._versions is None:
            self._versions = PolicyVersions(self.single_observation_space, self.single_action_space)
        return self._versions

    @property
    def version(self) -> int:
        """The newest published policy version (0 before the first :meth:`publish`)."""
        return 0 if self._versions is None else self._versions.current

    @property
    def metrics(self) -> Metrics:
        """Syncs, weight bytes, divergences and policy lag, per worker and in total.

        Workers that were replaced keep their entries, before the current ones.
        """
        workers = (*self._former, *(r.metrics for r in self._remotes))
        return Metrics(version=self.version, workers=tuple(w.snapshot() for w in workers))

    async def publish(self, agent: Any, *, epsilon: float | None = None) -> int:
        """Make ``agent``'s current weights a new policy version.

        Workers that hold no version yet get it at once; for the others the sync strategy
        decides, before each of their next rollouts, whether it travels.

        Args:
            agent: the ``nn.Module`` being trained (a CleanRL-style agent; see
                :mod:`aps.policy`) or an :class:`aps.policy.Policy`.
            epsilon: exploration rate for epsilon-greedy Q-policies (``None``: unchanged).

        Returns:
            The new version number (1, 2, ...).

        Raises:
            InvalidState: the learner has no ``policy``.
            ConfigError: the agent is not a policy aps can run.
            WorkerLost: a worker disconnected while receiving its first version.
        """
        await self.wait_for_workers()
        versions = self._require_policy("publish")
        version = versions.publish(agent, epsilon=epsilon)
        for remote in self._remotes:
            if remote.metrics.version < 0 and remote.info.worker_id not in self._dropped:
                try:
                    await self._send_weights(remote)
                except WorkerLost as exc:
                    self._broken = exc
                    raise
        self._prune()
        return version

    async def _maybe_sync(self, remote: _Remote) -> None:
        versions = self._versions
        if versions is None or versions.current == 0:
            raise InvalidState("publish(agent) before the first rollout")
        held = remote.metrics.version
        if held == versions.current:
            return
        if held < 0:
            await self._send_weights(remote)
            return
        measured: list[float] = []

        def divergence() -> float:
            if not measured:
                states = remote.states
                # No chunk yet: nothing to measure on, so treat the worker as far away.
                value = math.inf if states is None else versions.divergence(held, states)
                measured.append(value)
                remote.metrics.divergences.append(value)
            return measured[0]

        context = SyncContext(
            worker_id=remote.info.worker_id,
            worker_version=held,
            learner_version=versions.current,
            steps_since_sync=remote.steps_since_sync,
            seconds_since_sync=time.monotonic() - remote.synced_at,
            measure_divergence=divergence,
        )
        if self.sync.should_sync(context):
            await self._send_weights(remote)
            self._prune()

    async def _send_weights(self, remote: _Remote) -> None:
        versions = self._versions
        assert versions is not None
        version = versions.current
        message = Weights(
            version=version, arrays=versions.weights(version), epsilon=versions.epsilon
        )
        # Encoded once, when published, however many workers it goes to.
        await self._send(remote, message, versions.frame(version))
        metrics = remote.metrics
        metrics.version = version
        metrics.syncs += 1
        metrics.weight_bytes += versions.nbytes(version)
        remote.steps_since_sync = 0
        remote.synced_at = time.monotonic()

    def _prune(self) -> None:
        if self._versions is not None:
            self._versions.prune({r.metrics.version for r in self._remotes})

    def _accept_chunk(self, remote: _Remote, message: RolloutChunk) -> Chunk:
        """Check a chunk against what this learner sent that worker, and account for it."""
        info = remote.info
        steps = message.reward.shape[0] if message.reward.ndim == 2 else -1
        expected = (steps, info.num_envs)
        for name in ("reward", "terminated", "truncated", "logprob"):
            shape = getattr(message, name).shape
            if steps < 1 or shape != expected:
                raise ProtocolError(
                    f"worker {info.worker_id} sent a chunk whose {name} has shape {shape}, "
                    f"expected (T, {info.num_envs}); the worker is not a compatible aps worker"
                )
        obs_shape = self.single_observation_space.shape or ()
        shapes = {
            "obs": (message.obs.shape, expected + obs_shape),
            "next_obs": (message.next_obs.shape, (info.num_envs, *obs_shape)),
            "actions": (message.actions.shape[:2], expected),
        }
        if message.value is not None:
            shapes["value"] = (message.value.shape, expected)
        # One value per episode that ended: 1-d arrays of one length (-1 matches no shape).
        ended = message.episode_return
        episodes = (ended.shape[0] if ended.ndim == 1 else -1,)
        shapes["episode_return"] = (message.episode_return.shape, episodes)
        shapes["episode_length"] = (message.episode_length.shape, episodes)
        shapes["episode_env"] = (message.episode_env.shape, episodes)
        for name, (shape, wanted) in shapes.items():
            if shape != wanted:
                raise ProtocolError(
                    f"worker {info.worker_id} sent a chunk whose {name} has shape {shape}, "
                    f"expected {wanted} for {steps} steps of its {info.num_envs} envs; the "
                    "worker is not a compatible aps worker"
                )
        if np.any((message.episode_env < 0) | (message.episode_env >= info.num_envs)):
            raise ProtocolError(
                f"worker {info.worker_id} sent episodes of envs outside its "
                f"{info.num_envs}; the worker is not a compatible aps worker"
            )
        cuts = int(np.count_nonzero(message.truncated))
        last_obs = (cuts, *obs_shape)
        if message.truncated_index.shape != (cuts, 2) or message.truncated_obs.shape != last_obs:
            raise ProtocolError(
                f"worker {info.worker_id} sent truncated observations of shape "
                f"{message.truncated_obs.shape} at indices of shape "
                f"{message.truncated_index.shape} for {cuts} truncated steps, expected "
                f"{last_obs} and {(cuts, 2)}; the worker is not a compatible aps worker"
            )
        if not np.array_equal(message.truncated_index, np.argwhere(message.truncated)):
            raise ProtocolError(
                f"worker {info.worker_id} sent truncated observations at (step, env) indices "
                "that are not its truncated steps; the worker is not a compatible aps worker"
            )
        if not remote.last_chunk_version <= message.version <= remote.metrics.version:
            raise ProtocolError(
                f"worker {info.worker_id} sent a chunk acted with version {message.version}, "
                f"but it was sent versions up to {remote.metrics.version} and already used "
                f"{remote.last_chunk_version}; refusing to attribute it"
            )
        remote.last_chunk_version = message.version
        versions = self._versions
        assert versions is not None
        lag = versions.current - message.version
        transitions = steps * info.num_envs
        metrics = remote.metrics
        metrics.chunks += 1
        metrics.transitions += transitions
        metrics.lag_sum += lag * transitions
        metrics.lag_max = max(metrics.lag_max, lag)
        remote.steps_since_sync += transitions
        remote.states = sample_states(message.obs, versions.max_states)
        return Chunk(
            worker_id=info.worker_id,
            env_offset=info.env_offset,
            version=message.version,
            lag=lag,
            obs=message.obs,
            actions=message.actions,
            logprob=message.logprob,
            value=message.value,
            reward=message.reward,
            terminated=message.terminated,
            truncated=message.truncated,
            next_obs=message.next_obs,
            episode_return=message.episode_return,
            episode_length=message.episode_length,
            episode_env=message.episode_env + info.env_offset,
            truncated_obs=message.truncated_obs,
            truncated_index=message.truncated_index + np.array([0, info.env_offset]),
        )

    async def rollout(self, num_steps: int) -> Rollout:
        """Have every worker act ``num_steps`` times with its policy copy; gather the batch.

        Before asking a worker, the sync strategy decides whether it gets the newest version.
        All workers act at once; the result is ``[num_steps, num_envs]`` in env order.

        Raises:
            InvalidState: no policy, nothing published, no reset yet, or another call running.
            WorkerError: an env or the policy raised on a worker.
            WorkerLost | Timeout | ProtocolError: a worker failed; the learner is unusable.
        """
        if not isinstance(num_steps, int) or isinstance(num_steps, bool) or num_steps < 1:
            raise ConfigError(f"num_steps must be an int >= 1, got {num_steps!r}")
        await self.wait_for_workers()
        self._require_policy("rollout")
        if not self._was_reset:
            raise InvalidState("call reset() before rollout()")
        requests = [RolloutRequest(num_steps=num_steps)] * len(self._remotes)
        answers = await self._exchange(requests, "rollout")
        results = [_expect(a, RolloutChunk) for a in answers]
        try:
            chunks = [self._accept_chunk(r, m) for r, m in zip(self._remotes, results, strict=True)]
        except ProtocolError as exc:
            self._broken = exc
            raise
        return Rollout.from_chunks(chunks)

    def chunks(self, num_steps: int, *, max_in_flight: int = 2) -> AsyncGenerator[Chunk, None]:
        """Stream chunks of ``num_steps`` steps from every worker, as they arrive.

        Each worker keeps acting without waiting for the others: it has up to
        ``max_in_flight`` requests outstanding, and a new one is sent when the caller takes
        one of its chunks (so a slow consumer bounds the memory on both sides, and a chunk
        is at most ``max_in_flight`` chunks older than the consumer). The sync strategy runs
        before each request. Publish from inside the loop to train off-policy.

        Leaving the loop (break, an error, or the next reset/step/rollout) stops the
        stream; chunks still in flight are received and dropped (counted in
        :attr:`metrics` as ``dropped_chunks``).

        Raises:
            InvalidState: no policy, nothing published, no reset yet, or another call running.
            WorkerError: an env or the policy raised on a worker.
            WorkerLost | Timeout | ProtocolError: a worker failed; the learner is unusable.
        """
        if not isinstance(max_in_flight, int) or not 1 <= max_in_flight <= MAX_IN_FLIGHT:
            raise ConfigError(f"max_in_flight must be in 1..{MAX_IN_FLIGHT}, got {max_in_flight!r}")
        if not isinstance(num_steps, int) or isinstance(num_steps, bool) or num_steps < 1:
            raise ConfigError(f"num_steps must be an int >= 1, got {num_steps!r}")
        previous, self._stream = self._stream, self._chunk_stream(num_steps, max_in_flight)
        self._previous_stream = previous
        return self._stream

    async def _chunk_stream(
        self, num_steps: int, max_in_flight: int
    ) -> AsyncGenerator[Chunk, None]:
        previous, self._previous_stream = self._previous_stream, None
        if previous is not None:
            await previous.aclose()
        await self.wait_for_workers()
        self._require_policy("chunks")
        if not self._was_reset:
            raise InvalidState("call reset() before chunks()")
        if self._broken is not None:
            raise InvalidState(
                f"this learner can no longer stream: {self._broken}; start a new one"
            )
        if self._busy:
            raise InvalidState("chunks() called while another reset/step/rollout is running")
        self._busy = True
        this = self._stream
        inbox: _Inbox
        inbox = asyncio.Queue()
        pumps: list[asyncio.Task[None]] = []
        active = [r for r in self._remotes if r.info.worker_id not in self._dropped]
        try:
            for remote in active:
                remote.lost = 0
                await self._prepare(remote, "chunks")
                for _ in range(max_in_flight):
                    await self._request_chunk(remote, num_steps)
            pumps = [
                asyncio.create_task(
                    self._chunk_pump(remote, inbox, num_steps),
                    name=f"aps chunks {remote.info.worker_id}",
                )
                for remote in active
            ]
            while True:
                remote, message = await inbox.get()
                if isinstance(message, WorkerLost) and self.on_worker_lost == "drop":
                    await self._drop(remote, message)
                    active.remove(remote)
                    if active:
                        continue
                if isinstance(message, BaseException):
                    raise message
                if isinstance(message, ErrorReport):
                    raise self._worker_error(remote, message)
                chunk = self._accept_chunk(remote, _expect(message, RolloutChunk))
                yield chunk
                await self._request_chunk(remote, num_steps)
        except (WorkerLost, Timeout, ProtocolError) as exc:
            self._broken = exc
            raise
        finally:
            for pump in pumps:
                pump.cancel()
            if pumps:
                await asyncio.wait(pumps)
            await self._drain(inbox, active)
            self._busy = False
            if self._stream is this:
                self._stream = None

    async def _prepare(self, remote: _Remote, operation: str) -> None:
        """Reset a replacement's envs before it acts on its own."""
        if remote.needs_reset:
            remote.preparing = True
            try:
                reset = ResetRequest(seed=None, options=None)
                answer = await self._call(remote, reset, operation)
            finally:
                remote.preparing = False
            if isinstance(answer, ErrorReport):
                raise self._worker_error(remote, answer)
            remote.needs_reset = remote.reset_next = False

    async def _request_chunk(self, remote: _Remote, num_steps: int) -> None:
        if remote.preparing:
            # A reset is outstanding (lockstep on the wire): ask once it is answered.
            remote.lost += 1
            return
        await self._maybe_sync(remote)
        await self._send_request(remote, RolloutRequest(num_steps=num_steps))

    async def _chunk_pump(self, remote: _Remote, inbox: _Inbox, num_steps: int) -> None:
        """Move one worker's chunks into a shared inbox until cancelled.

        A replacement worker is reset and asked for as many chunks as its predecessor owed.
        A failure ends the pump and goes into the inbox too, for the consumer to raise.
        """
        operation = "chunks"
        while True:
            try:
                answer = await self._answer_from(remote, operation)
                if answer is None:
                    await self._prepare(remote, operation)
                    owed, remote.lost = remote.lost, 0
                    for _ in range(owed):
                        await self._request_chunk(remote, num_steps)
                    continue
            except ApsError as exc:
                inbox.put_nowait((remote, exc))
                return
            inbox.put_nowait((remote, answer))

    async def _drop(self, remote: _Remote, lost: WorkerLost) -> None:
        """Leave ``remote`` out of chunk streams and gradient rounds from now on."""
        self._dropped.add(remote.info.worker_id)
        remote.unanswered.clear()
        log.warning("%s; dropped it, going on with the other workers", lost)
        await remote.session.aclose("the learner dropped this worker")

    async def _drain(self, inbox: _Inbox, remotes: Sequence[_Remote]) -> None:
        """Receive the answers still owed after a stream ends, so lockstep can resume."""
        while not inbox.empty():
            remote, message = inbox.get_nowait()
            if isinstance(message, RolloutChunk):
                remote.metrics.dropped_chunks += 1
        if self._broken is not None:
            return
        try:
            async with asyncio.timeout(self._timeouts.step + self.reconnect_timeout):
                for remote in remotes:
                    while remote.unanswered:
                        late = await self._answer_from(remote, "the end of the chunk stream")
                        if late is None:
                            break  # a replacement owes nothing; it is reset before its use
                        if isinstance(late, RolloutChunk):
                            remote.metrics.dropped_chunks += 1
        except (TimeoutError, ApsError) as exc:
            self._broken = InvalidState(f"the chunk stream did not end cleanly ({exc!r})")

    # Policy-gradient rounds (Rennala / Malenia NIGT); aps.pg.NIGT drives these.

    @property
    def gradient_workers(self) -> tuple[WorkerInfo, ...]:
        """The workers taking part in gradient rounds (all, minus those dropped)."""
        return tuple(r.info for r in self._gradient_remotes)

    async def start_round(
        self, round_id: int, arrays: dict[str, Array], *, horizon: int, gamma: float
    ) -> int:
        """Broadcast a gradient round: every worker samples at ``arrays`` from now on.

        The first call enters gradient mode (reports start flowing, see :meth:`next_report`);
        later calls replace the round. Reports of earlier rounds may still arrive: they carry
        their round id.

        Returns:
            The bytes put on the wire (the encoded round, once per worker).

        Raises:
            InvalidState: no policy, or another operation is running.
            WorkerLost: a worker disconnected (see :meth:`drop_worker`).
        """
        await self.wait_for_workers()
        self._require_policy("start_round")
        if not self._gradient_mode:
            if self._stream is not None:
                await self._stream.aclose()
            if self._broken is not None:
                raise InvalidState(f"this learner can no longer train: {self._broken}")
            if self._busy:
                raise InvalidState("start_round() called while another operation is running")
            self._busy = self._gradient_mode = True
            self._gradient_remotes = [
                r for r in self._remotes if r.info.worker_id not in self._dropped
            ]
            for remote in self._gradient_remotes:
                # Gradient mode samples from fresh resets; a replacement needs no reset now.
                remote.needs_reset = remote.reset_next = False
            self._gradient_pumps = [
                asyncio.create_task(self._report_pump(r), name=f"aps reports {r.info.worker_id}")
                for r in self._gradient_remotes
            ]
        message = GradientRound(round=round_id, arrays=arrays, horizon=horizon, gamma=gamma)
        frame = codec.encode(message)
        self._round = (message, frame)
        for remote in self._gradient_remotes:
            await self._send(remote, message, frame)
        return len(frame) * len(self._gradient_remotes)

    async def _report_pump(self, remote: _Remote) -> None:
        """Move one worker's gradient reports into the shared inbox until cancelled.

        The inbox holds a few reports per worker; when the caller falls behind, pumps wait,
        the sockets fill and the workers block on sending (backpressure). A worker that
        resumes or is replaced gets the current round again; a replacement is announced as
        the loss of the worker it replaced.
        """
        inbox = self._gradient_inbox
        while True:
            generation = remote.generation
            try:
                message = await remote.session.receive(
                    timeout=self._timeouts.heartbeat_timeout,
                    operation=f"worker {remote.info.worker_id}'s gradients",
                )
            except (EndOfStream, TransportError, Timeout) as exc:
                lost = remote.info.worker_id
                try:
                    await self._recover(remote, generation, "gradients", exc)
                except WorkerLost as error:
                    await inbox.put((remote, error))
                    return
                if remote.restarted:
                    remote.restarted = False
                    replaced = (
                        f"worker {lost} was lost and worker {remote.info.worker_id} took over"
                    )
                    await inbox.put((remote, WorkerLost(replaced, worker_id=lost)))
                if self._round is not None:
                    await self._send(remote, *self._round)
                continue
            except ApsError as exc:
                await inbox.put((remote, exc))
                return
            await inbox.put((remote, message))

    async def next_report(self) -> tuple[int, GradientReport]:
        """Wait for the next gradient report from any worker: ``(worker_id, report)``.

        Raises:
            InvalidState: not in gradient mode.
            WorkerError: sampling or differentiating raised on a worker.
            WorkerLost: a worker disconnected; :meth:`drop_worker` it to go on without it
                (under ``on_worker_lost="drop"`` it is dropped already; under ``"wait"`` this
                announces a replacement, whose reports count from the next round).
            Timeout: no report for ``timeouts.step`` seconds.
        """
        if not self._gradient_mode:
            raise InvalidState("call start_round() before next_report()")
        try:
            async with asyncio.timeout(self._timeouts.step):
                remote, message = await self._gradient_inbox.get()
        except TimeoutError:
            raise Timeout(
                f"no gradient report from any worker for {self._timeouts.step} s; raise "
                "Timeouts.step if trajectories are that slow",
                operation="next_report",
                seconds=self._timeouts.step,
            ) from None
        if isinstance(message, WorkerLost) and self.on_worker_lost == "drop":
            self.drop_worker(remote.info.worker_id)
            await remote.session.aclose("the learner dropped this worker")
        if isinstance(message, BaseException):
            raise message
        if isinstance(message, ErrorReport):
            raise self._worker_error(remote, message)
        return remote.info.worker_id, _expect(message, GradientReport)

    def drop_worker(self, worker_id: int) -> None:
        """Leave a lost worker out of the rest of gradient mode.

        The learner's env batch no longer matches its workers afterwards, so lockstep calls
        (reset, step, rollout) refuse from then on. Dropping a worker that was dropped or
        replaced already does nothing.
        """
        for remote in self._gradient_remotes:
            if remote.info.worker_id == worker_id:
                self._gradient_remotes.remove(remote)
                self._dropped.add(worker_id)
                return
        if worker_id in self._dropped or any(m.worker_id == worker_id for m in self._former):
            return
        raise ConfigError(f"worker {worker_id} is not taking part in gradient rounds")

    async def stop_gradients(self) -> None:
        """Leave gradient mode: every worker stops and confirms; late reports are dropped."""
        if not self._gradient_mode:
            return
        for pump in self._gradient_pumps:
            pump.cancel()
        await asyncio.wait(self._gradient_pumps)
        try:
            async with asyncio.timeout(self._timeouts.step):
                for remote in self._gradient_remotes:
                    await remote.session.send(StopGradients())
                    while remote.session.state is State.STOPPING:
                        await remote.session.receive(timeout=None, operation="gradients to stop")
        except (TimeoutError, ApsError) as exc:
            self._broken = InvalidState(f"gradient mode did not end cleanly ({exc!r})")
        finally:
            self._gradient_mode = self._busy = False
            self._gradient_inbox = asyncio.Queue(REPORT_BACKLOG * self.num_workers)
            self._round = None

    def _worker_error(self, remote: _Remote, report: ErrorReport) -> WorkerError:
        return WorkerError(
            report.message,
            worker_id=remote.info.worker_id,
            remote_type=report.remote_type,
            remote_traceback=report.traceback,
        )

    def _lost(self, remote: _Remote, operation: str, exc: BaseException) -> WorkerLost:
        info = remote.info
        return WorkerLost(
            f"worker {info.worker_id} ({info.env_id} x {info.num_envs} at {info.peer}, pid "
            f"{info.pid}) was lost during {operation}: {exc}",
            worker_id=info.worker_id,
        )
