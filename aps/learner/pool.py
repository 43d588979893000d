"""The worker pool: sessions, recovery, and one request/answer service for the modes.

:class:`WorkerPool` owns everything about the workers as connections: it listens (its
:class:`~aps.learner.admission.Gate` runs every handshake until the peer has proved the
token), takes in the workers that did (spaces that agree, spares), lets a worker whose
connection dropped resume its session and a spare take over a lost worker's env slots, and
applies ``on_worker_lost``. Each admitted worker's env slots are a :class:`Remote`.

The modes (:mod:`~aps.learner.lockstep`, :mod:`~aps.learner.detach`,
:mod:`~aps.learner.rounds`) talk to workers only through the pool's numbered request/answer
service (:meth:`WorkerPool.send_request`, :meth:`WorkerPool.answer_from`,
:meth:`WorkerPool.exchange`): requests carry sequence numbers, a resumed worker gets again
what it did not answer, and answers arrive exactly once (the books are kept by each slot's
:class:`~aps.delivery.Outbox`, which does no I/O). A malformed answer is its worker's failure,
handled as its loss (see :meth:`WorkerPool.fail`). When a connection takes over a slot, the
pool asks each mode's :class:`SlotHooks` what that worker needs first (its weights, the
current gradient round); the pool itself knows nothing of any mode. What the workers are
used for now is the pool's :class:`Mode`, which only the pool writes: a mode enters with
:meth:`WorkerPool.enter` and leaves with :meth:`WorkerPool.leave`, and a mode that can be
left open (a chunk stream) registers how it ends (:meth:`WorkerPool.on_abandon`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import secrets
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

import gymnasium as gym
from gymnasium.vector import AutoresetMode

from aps import transports
from aps._version import __version__
from aps.compression import choose as choose_compression
from aps.delivery import Accepted, Outbox
from aps.errors import (
    ApsError,
    ConfigError,
    EndOfStream,
    InvalidState,
    ProtocolError,
    Timeout,
    TransportError,
    WorkerError,
    WorkerLost,
)
from aps.learner.admission import Gate, reject
from aps.learner.rollouts import WorkerMetrics
from aps.messages import (
    ErrorReport,
    Hello,
    Message,
    ProbeResult,
    ProbeSpaces,
    Ready,
    Request,
    ResetRequest,
    Welcome,
)
from aps.session import Session, Timeouts
from aps.transports.base import Listener, TransportFactory

__all__ = [
    "Mode",
    "OnWorkerLost",
    "Remote",
    "SlotHooks",
    "WorkerInfo",
    "WorkerPool",
    "expect",
]


class Mode(enum.Enum):
    """What the pool's workers are used for now; only the pool writes it.

    A mode enters through :meth:`WorkerPool.enter` and ends with :meth:`WorkerPool.leave`.
    """

    IDLE = "idle"
    EXCHANGE = "exchange"
    """One request per worker and their answers: a reset, step, rollout or env call."""
    PARTIAL = "partial batch"
    """Steps sent to some workers and not all received (``send``/``recv``)."""
    STREAM = "stream"
    """A chunk stream."""
    ROUNDS = "gradient rounds"
    """Gradient mode, until it is stopped."""
    BROKEN = "broken"
    """The workers are out of step for good; every later operation refuses (see
    :attr:`WorkerPool.broken`)."""


@dataclass(frozen=True, slots=True)
class _State:
    """The pool's mode, and what the broken mode carries."""

    mode: Mode
    error: ApsError | None = None
    """Why the workers are out of step (``Mode.BROKEN`` only)."""
    interrupted: Mode | None = None
    """The lease a break ended before its holder left it (``Mode.BROKEN`` only): a chunk
    stream left open is still ended when the next operation begins."""


FRESH_RESET = ResetRequest(seed=None, options=None)
"""What a replacement's envs get before they act (each worker seeds them its own way)."""

SESSION_ID_SIZE = 16
"""Random bytes in a session id (what a worker resumes its session with)."""

OnWorkerLost = Literal["raise", "wait", "drop"]

log = logging.getLogger(__name__)

_M = TypeVar("_M", bound=Message)


def expect(message: Message, kind: type[_M]) -> _M:
    """``message``, which the protocol table allows to be nothing but a ``kind``."""
    assert isinstance(message, kind), message
    return message


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


class Launcher(Protocol):
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


@dataclass(slots=True, eq=False)
class Remote:
    """One worker's env slots, and the connection serving them now.

    The connection changes when the worker resumes its session and the worker itself when a
    replacement takes the slots over; ``generation`` counts both. Modes keep their own
    per-slot state, keyed by the remote (identity).
    """

    info: WorkerInfo
    session: Session
    metrics: WorkerMetrics
    session_id: bytes
    # Numbered requests (see aps.delivery), and the generation of the connection serving
    # the slot: ``delivered`` is the generation that got every unanswered request.
    outbox: Outbox = field(default_factory=Outbox)
    generation: int = 0
    delivered: int = 0
    attached: asyncio.Event = field(default_factory=asyncio.Event)


class SlotHooks(Protocol):
    """What a mode does when the worker serving a slot changes."""

    def replaced(self, remote: Remote, void: Sequence[Request]) -> None:
        """A new worker took over ``remote``; ``void`` are the lost worker's unanswered requests.

        The mode forgets what it knew of the lost worker (it is called before anything is sent
        to the new one).
        """

    async def rejoined(self, remote: Remote) -> None:
        """A connection took over ``remote`` (resumed or replaced): send what it needs first.

        Called before the unanswered requests are sent again; send with
        :meth:`WorkerPool.send`.
        """


Check = Callable[["Remote", Message], None]
"""A mode's test of a fresh answer: raises :class:`ProtocolError` when it does not fit."""

Redo = Callable[[Remote, Request, str], Awaitable[Message]]
"""How a mode answers a request whose worker was replaced meanwhile (see exchange)."""


@dataclass(slots=True, eq=False)
class _Spare:
    """A worker admitted while every slot was taken: it waits to replace a lost one."""

    session: Session
    hello: Hello
    worker_id: int
    session_id: bytes


class WorkerPool:
    """The learner's workers: admission, sessions, recovery and numbered requests.

    Arguments are the :class:`~aps.learner.Learner`'s of the same names, checked there.
    """

    def __init__(
        self,
        listen: str | Listener,
        *,
        num_workers: int,
        token: bytes | None,
        autoreset_mode: AutoresetMode,
        timeouts: Timeouts,
        insecure: bool,
        factory: TransportFactory | None,
        policy: str | None,
        launcher: Launcher | None,
        on_worker_lost: OnWorkerLost,
        reconnect_timeout: float,
    ) -> None:
        if token is not None and not token.strip():
            raise ConfigError(
                "the token is empty (or only whitespace), which anyone can prove; pass a "
                "random one (aps token makes one), or token=None on a loopback address"
            )
        self._listen = listen
        self.num_workers = num_workers
        self._token = token
        self.autoreset_mode = autoreset_mode
        self.timeouts = timeouts
        self._insecure = insecure
        self._factory = factory
        self._policy = policy
        self.policy_kwargs: dict[str, Any] | None = None
        """The policy factory's keyword arguments, sent in every welcome (set by the learner)."""
        self.compression = "auto"
        """The learner's compression setting, applied in every welcome (set by the learner)."""
        self.launcher = launcher
        self.on_worker_lost: OnWorkerLost = on_worker_lost
        self.reconnect_timeout = reconnect_timeout
        self.hooks: list[SlotHooks] = []
        """The modes to tell when the worker serving a slot changes."""

        self._launched = False
        self._listener: Listener | None = None
        self._gate: Gate | None = None
        self._closing = asyncio.Event()
        self._admitting = 0
        self._next_id = 0
        self.remotes: list[Remote] = []
        """The admitted workers' slots, in env order."""
        self._by_session: dict[bytes, Remote] = {}
        self._spares: list[_Spare] = []
        self.dropped: set[int] = set()
        """Worker ids left out of chunk streams and gradient rounds."""
        self.former: list[WorkerMetrics] = []
        """Metrics of workers that were replaced."""
        self.restarts = 0
        """Workers that replaced lost ones."""
        self._all_ready = asyncio.Event()
        self.spaces: tuple[gym.Space[Any], gym.Space[Any]] | None = None
        self.counts: list[int] = []
        """Envs per worker, in env order."""
        self.offsets: list[int] = []
        """Global index of each worker's first env."""
        self.was_reset = False
        """Whether the envs were reset at least once (a replacement's are then reset too)."""
        self._unreset: set[Remote] = set()  # slots whose replacement's envs await their reset
        self._replaced: set[Remote] = set()  # slots replaced since their last receive noticed
        self._reset_listeners: list[Callable[[Remote], None]] = []
        self._state = _State(Mode.IDLE)
        self._enders: dict[Mode, Callable[[], Awaitable[None]]] = {}
        self.closed = False

    # Lifecycle.

    async def start(self) -> None:
        """Bind the address and start admitting workers; see :meth:`Learner.start`."""
        if self.closed:
            raise InvalidState("this learner is closed; create a new one")
        if self._listener is not None:
            return
        if isinstance(self._listen, str):
            factory = self._factory or transports.get_factory(transports.scheme_of(self._listen))
            listener = await factory.listen(self._listen)
        else:
            listener = self._listen
        if self._token is None and not self._insecure and not transports.is_local(listener):
            if isinstance(self._listen, str):
                await listener.aclose()  # bound by this call: nobody else will close it
            raise ConfigError(
                f"refusing to listen on {listener.url!r} without a token: anyone who can reach "
                "it could attach a worker; pass token=... (workers use --token-file), or "
                "insecure=True on a network you trust"
            )
        self._listener = listener
        self._gate = Gate(
            self._listener,
            token=self._token,
            timeouts=self.timeouts,
            join=self.join,
            describe=self.describe,
        )
        self._gate.start()
        log.info("learner listening on %s for %d workers", self.url, self.num_workers)
        if self.launcher is not None and not self._launched:
            self._launched = True
            try:
                spec = self.launcher.spec.for_learner(
                    self.url, token=self._token, policy=self._policy
                )
                await self.launcher.start(self.url, spec)
            except BaseException:
                await self.aclose()
                raise

    @property
    def url(self) -> str:
        """The bound address, with port 0 resolved."""
        if self._listener is None:
            raise InvalidState("the learner is not started; use 'async with' or await start()")
        return self._listener.url

    @property
    def is_local(self) -> bool:
        """Whether the listener says its workers are on this host (see ``transports.is_local``)."""
        return self._listener is not None and transports.is_local(self._listener)

    @property
    def refused(self) -> int:
        """Connections refused or turned away since the learner started.

        A count for monitoring and tests; the log sums floods up instead of listing them.
        """
        return 0 if self._gate is None else self._gate.refused

    @property
    def refusals(self) -> list[str]:
        """The latest refusals (``"PEER: TYPE: reason"``), newest last, a few at most."""
        return [] if self._gate is None else self._gate.refusals

    async def settle_admissions(self) -> None:
        """Wait (up to the handshake deadline) for the handshakes in progress to end."""
        if self._gate is not None:
            await self._gate.settle(self.timeouts.handshake)

    def begin_close(self) -> None:
        """Stop waiting for lost workers: a close must not wait ``reconnect_timeout``."""
        self._closing.set()

    async def aclose(self) -> None:
        """Stop admitting, say goodbye to every worker, stop the launcher; idempotent."""
        if self.closed:
            return
        self.closed = True
        self.begin_close()
        if self._gate is not None:
            await self._gate.aclose()
        if self._listener is not None:
            await self._listener.aclose()
        sessions = [r.session for r in self.remotes] + [s.session for s in self._spares]
        await asyncio.gather(
            *(session.aclose("the learner is closing") for session in sessions),
            return_exceptions=True,
        )
        if self.launcher is not None:
            await self.launcher.stop()

    # Admission.

    def describe(self) -> tuple[ProbeResult, ProbeSpaces]:
        """What ``aps check`` is told once it proved the token (the gate adds its proof)."""
        observation_space, action_space = self.spaces or (None, None)
        result = ProbeResult(
            proof=b"",
            aps_version=__version__,
            num_workers=self.num_workers,
            workers=sum(remote.attached.is_set() for remote in self.remotes),
            spares=len(self._spares),
            num_envs=sum(self.counts),
            autoreset_mode=self.autoreset_mode.value,
            policy=self._policy,
        )
        return result, ProbeSpaces(observation_space=observation_space, action_space=action_space)

    async def join(self, session: Session, hello: Hello, proof: bytes) -> None:
        """Take a worker that proved the token: resume its session, or admit it or a spare.

        ``proof`` is this learner's, for the worker to check (see :mod:`aps.learner.admission`).

        Raises:
            ApsError: the worker is refused (it was told why).
        """
        if not isinstance(hello.num_envs, int) or hello.num_envs < 1:
            await reject(
                session, ConfigError(f"num_envs must be >= 1, got {hello.num_envs}"), proof
            )
        resumed = self._by_session.get(hello.resume) if hello.resume else None
        if resumed is not None:
            await self._resume(session, hello, resumed, proof)
            return
        # A new worker (or one whose session this learner does not know: it restarted).
        spare = len(self.remotes) + self._admitting >= self.num_workers
        if spare and (self.on_worker_lost != "wait" or len(self._spares) >= self.num_workers):
            why = (
                "start the learner with a larger num_workers"
                if self.on_worker_lost != "wait"
                else f"{len(self._spares)} spares already wait to replace lost workers"
            )
            await reject(
                session,
                ConfigError(f"this learner already has its {self.num_workers} workers; {why}"),
                proof,
            )
        self._admitting += 0 if spare else 1
        try:
            worker_id = self._next_id
            self._next_id += 1
            session_id = secrets.token_bytes(SESSION_ID_SIZE)
            await self._welcome(session, hello, worker_id, session_id, proof, resumed=False)
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
        self,
        session: Session,
        hello: Hello,
        worker_id: int,
        session_id: bytes,
        proof: bytes,
        *,
        resumed: bool,
    ) -> None:
        """Send the welcome and wait until the worker's envs are ready with the right spaces."""
        offered = tuple(hello.compression.split(",")) if hello.compression else ()
        chosen = choose_compression(
            self.compression, offered, local=session.is_local, peer=session.peer
        )
        await session.send(
            Welcome(
                worker_id=worker_id,
                autoreset_mode=self.autoreset_mode.value,
                policy=self._policy,
                session_id=session_id,
                resumed=resumed,
                policy_kwargs=self.policy_kwargs,
                proof=proof,
                resume_window=self.reconnect_timeout if self.on_worker_lost == "wait" else 0.0,
                compression=chosen,
            )
        )
        session.compress(chosen)  # from the worker's Ready on, both ways
        # Building envs runs user code and may take long: the step deadline bounds it.
        ready = await session.receive(
            timeout=self.timeouts.step, operation="the worker to build its envs"
        )
        if isinstance(ready, ErrorReport):
            raise ConfigError(
                f"the worker could not build its envs or policy: "
                f"{ready.remote_type}: {ready.message}"
            )
        assert isinstance(ready, Ready)
        await self._check_spaces(session, ready, hello)
        if self.spaces is None:
            self.spaces = (ready.observation_space, ready.action_space)

    async def _resume(self, session: Session, hello: Hello, remote: Remote, proof: bytes) -> None:
        """Take a worker whose connection dropped back into its session and env slots."""
        info = remote.info
        if not (
            remote.outbox.can_resume(hello.served)
            and hello.num_envs == info.num_envs
            and hello.version <= remote.metrics.version
            and info.worker_id not in self.dropped
        ):
            await reject(
                session,
                ProtocolError(
                    f"cannot resume worker {info.worker_id}'s session: it says it answered "
                    f"{hello.served} requests of {info.num_envs} envs holding version "
                    f"{hello.version}, but it was sent {remote.outbox.sent} requests "
                    f"({remote.outbox.received} answered) for {info.num_envs} envs, and version "
                    f"{remote.metrics.version}"
                    + (", and it was dropped" if info.worker_id in self.dropped else "")
                    + "; restart the worker without resuming"
                ),
                proof,
            )
        await self._welcome(session, hello, info.worker_id, remote.session_id, proof, resumed=True)
        # Weights sent before the cut may be lost: the worker's word is what it holds.
        remote.metrics.version = hello.version
        remote.metrics.resumes += 1
        log.warning("worker %d resumed its session from %s", info.worker_id, session.peer)
        await self._attach(remote, session)

    async def _attach(self, remote: Remote, session: Session) -> None:
        """Make ``session`` the one serving ``remote`` and close the one it replaces."""
        old, remote.session = remote.session, session
        remote.generation += 1
        session.start_heartbeats()
        remote.attached.set()
        # A call still waiting on the old connection fails at once and carries on here.
        await old.aclose("another connection took over this worker's session")

    async def _fill_vacancies(self) -> None:
        """Give each lost worker's slots to a spare with as many envs, if there is one."""
        for remote in self.remotes:
            if remote.attached.is_set():
                continue
            for spare in self._spares:
                if spare.hello.num_envs == remote.info.num_envs:
                    self._spares.remove(spare)
                    await self._replace(remote, spare)
                    break

    async def _replace(self, remote: Remote, spare: _Spare) -> None:
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
        self.former.append(remote.metrics)
        remote.metrics = WorkerMetrics(worker_id=spare.worker_id)
        self._by_session.pop(remote.session_id, None)  # gone already if it was disowned
        remote.session_id = spare.session_id
        self._by_session[spare.session_id] = remote
        void = remote.outbox.void()
        self._replaced.add(remote)
        if self.was_reset:
            self._unreset.add(remote)
        for hooks in self.hooks:
            hooks.replaced(remote, void)
        self.restarts += 1
        log.warning(
            "worker %d from %s took over the envs %d..%d of lost worker %d",
            *(spare.worker_id, spare.session.peer, lost.env_offset),
            *(lost.env_offset + lost.num_envs - 1, lost.worker_id),
        )
        await self._attach(remote, spare.session)

    async def _check_spaces(self, session: Session, ready: Ready, hello: Hello) -> None:
        if ready.num_envs != hello.num_envs:
            await reject(
                session,
                ProtocolError(f"hello said {hello.num_envs} envs, ready said {ready.num_envs}"),
            )
        if self.spaces is None:
            return
        observation_space, action_space = self.spaces
        for name, theirs, ours in (
            ("observation", ready.observation_space, observation_space),
            ("action", ready.action_space, action_space),
        ):
            if theirs != ours:
                await reject(
                    session,
                    ConfigError(
                        f"worker {hello.env_id!r} has {name} space {theirs}, but the workers "
                        f"already admitted have {ours}; every worker must run envs with the "
                        "same spaces"
                    ),
                )

    def _register(self, session: Session, hello: Hello, worker_id: int, session_id: bytes) -> None:
        offset = sum(self.counts)
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
        remote = Remote(
            info=info,
            session=session,
            metrics=WorkerMetrics(worker_id=worker_id),
            session_id=session_id,
        )
        remote.attached.set()
        self.remotes.append(remote)
        self._by_session[session_id] = remote
        self.counts.append(hello.num_envs)
        self.offsets.append(offset)
        session.start_heartbeats()
        last = offset + hello.num_envs - 1
        log.info(
            "worker %d admitted from %s: %d x %s (envs %d..%d)",
            *(worker_id, session.peer, hello.num_envs, hello.env_id, offset, last),
        )
        if len(self.remotes) == self.num_workers:
            self._order_by_label()
            self._all_ready.set()

    def _order_by_label(self) -> None:
        """Put the workers in launch order once all are in, when a launcher numbered them.

        Workers arrive in any order; a launcher labels them ``"0"``, ``"1"``, ... and gives
        worker ``i`` its share of the envs (env functions, per-worker seeds and kwargs) in
        that order, so the env order follows the labels. Nothing has used the offsets yet.
        """
        labels = [r.info.label for r in self.remotes]
        if sorted(labels) != [str(i) for i in range(len(labels))]:
            return  # not a launcher's numbering (workers started by hand): arrival order
        self.remotes.sort(key=lambda r: int(r.info.label))
        offset = 0
        for index, remote in enumerate(self.remotes):
            remote.info = dataclasses.replace(remote.info, env_offset=offset)
            self.counts[index] = remote.info.num_envs
            self.offsets[index] = offset
            offset += remote.info.num_envs

    async def wait_for_workers(self, timeout: float | None = None) -> None:
        """Wait until all workers are admitted; see :meth:`Learner.wait_for_workers`."""
        await self.start()
        if self._all_ready.is_set():
            return
        seconds = self.timeouts.connect if timeout is None else timeout
        try:
            if self.launcher is None:
                async with asyncio.timeout(seconds):
                    await self._all_ready.wait()
            else:
                await self._wait_watching(self.launcher, seconds)
        except TimeoutError:
            refused = "; ".join(self.refusals[-3:]) or "none"
            message = (
                f"{len(self.remotes)} of {self.num_workers} workers arrived at {self.url} "
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

    async def _wait_watching(self, launcher: Launcher, seconds: float) -> None:
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

    def require_workers(self) -> tuple[gym.Space[Any], gym.Space[Any]]:
        """The single observation and action spaces, once every worker is admitted."""
        if self.spaces is None or not self._all_ready.is_set():
            raise InvalidState(
                "the workers have not all arrived yet; await wait_for_workers() or reset() first"
            )
        return self.spaces

    def active(self) -> list[Remote]:
        """The slots not dropped, in env order."""
        return [r for r in self.remotes if r.info.worker_id not in self.dropped]

    # The pool's mode: written here only.

    @property
    def mode(self) -> Mode:
        """What the workers are used for now."""
        return self._state.mode

    @property
    def busy(self) -> bool:
        """An operation (a step, a stream, gradient mode) is using the workers."""
        return self._state.mode not in (Mode.IDLE, Mode.BROKEN)

    @property
    def broken(self) -> ApsError | None:
        """Why the workers can no longer be used together, once that happened (for good)."""
        return self._state.error

    def enter(
        self,
        mode: Mode,
        operation: str,
        *,
        running: str = "another operation is running",
        every_worker: bool = True,
        verb: str | None = None,
    ) -> None:
        """Lease the workers for ``mode``; :meth:`leave` gives them back.

        ``every_worker``: the operation needs every worker's envs (chunk streams and
        gradient rounds go on without dropped workers). ``verb``: what the learner can no
        longer do once broken, for the error (default: ``operation``).

        Raises:
            InvalidState: see :meth:`check`.
        """
        self.check(operation, running=running, every_worker=every_worker, verb=verb)
        self._state = _State(mode)

    def on_abandon(self, mode: Mode, end: Callable[[], Awaitable[None]]) -> None:
        """Register how a mode the caller left open ends when another operation begins.

        A chunk stream the caller stopped iterating holds the workers until it is closed:
        the stream's mode registers its closing here, and the next operation runs it (see
        :meth:`end_abandoned`). Modes without such a hook refuse the next operation instead.
        """
        self._enders[mode] = end

    async def end_abandoned(self) -> None:
        """End the mode holding the workers if it registered how (see :meth:`on_abandon`).

        A mode a break interrupted is ended too: its holder still has it open.
        """
        state = self._state
        held = state.interrupted if state.mode is Mode.BROKEN else state.mode
        end = None if held is None else self._enders.get(held)
        if end is not None:
            await end()

    def leave(self, mode: Mode) -> None:
        """End the lease of ``mode`` (nothing if another mode holds the workers).

        Broken workers stay broken; the lease the break interrupted is over.
        """
        state = self._state
        if state.mode is mode:
            self._state = _State(Mode.IDLE)
        elif state.mode is Mode.BROKEN and state.interrupted is mode:
            self._state = dataclasses.replace(state, interrupted=None)

    # What a replacement means to the envs: one path for every mode.

    def needs_reset(self, remote: Remote) -> bool:
        """Whether ``remote``'s envs are a replacement's that no mode has reset yet.

        A replacement's envs have not been reset by the learner once the envs were (see
        :attr:`was_reset`): a mode resets them with :meth:`reset_replacement` (or a
        :data:`FRESH_RESET` request of its own) before they act.
        """
        return remote in self._unreset

    def on_envs_reset(self, listener: Callable[[Remote], None]) -> None:
        """Call ``listener(remote)`` whenever a slot's envs are noted as reset.

        For a mode whose own per-slot state follows the envs (lockstep's pending
        ``NextStep`` reset step): a reset by any mode ends it.
        """
        self._reset_listeners.append(listener)

    def envs_reset(self, remote: Remote) -> None:
        """Note that ``remote``'s envs were just reset, by whichever mode did it."""
        self._unreset.discard(remote)
        for listener in self._reset_listeners:
            listener(remote)

    def mark_reset(self) -> None:
        """Note that every slot's envs were reset (a replacement's are then reset first)."""
        for remote in self.remotes:
            self.envs_reset(remote)
        self.was_reset = True

    async def reset_replacement(
        self, remote: Remote, operation: str, check: Check | None = None
    ) -> Message:
        """Reset the envs of the worker that took ``remote`` over, before they act.

        :data:`FRESH_RESET` goes to each later replacement in turn until one answers. The
        answer is returned, a :class:`~aps.messages.ResetResult` or an
        :class:`~aps.messages.ErrorReport`; the caller notes the reset with
        :meth:`envs_reset` once it used the answer (lockstep stitches it into a step first,
        and reads :meth:`needs_reset` to flag the lost worker's episodes as ended).

        Raises:
            WorkerLost | ProtocolError: as :meth:`answer_from`.
        """
        return await self.call_until_answered(remote, FRESH_RESET, operation, check)

    def break_for_good(self, exc: ApsError) -> None:
        """Enter :attr:`Mode.BROKEN`: every later operation refuses, with ``exc``.

        A later break says why in its place. The lease a break interrupted ends when its
        holder leaves it (see :meth:`leave`).
        """
        state = self._state
        if state.mode is Mode.BROKEN:
            self._state = dataclasses.replace(state, error=exc)
        else:
            held = None if state.mode is Mode.IDLE else state.mode
            self._state = _State(Mode.BROKEN, exc, held)

    def check(
        self,
        operation: str,
        *,
        running: str = "another operation is running",
        every_worker: bool = True,
        verb: str | None = None,
    ) -> None:
        """Refuse an operation over every worker's envs that the learner cannot make now.

        ``running`` says what keeps the pool busy, for the error.

        Raises:
            InvalidState: the workers are out of step for good, some were dropped, or another
                operation is running.
        """
        broken = self._state.error
        if broken is not None:
            raise InvalidState(
                f"this learner can no longer {verb or operation}: {broken}; start a new one"
            )
        if self.dropped and every_worker:
            raise InvalidState(
                f"{operation}() needs every worker's envs, and workers {sorted(self.dropped)} "
                "were dropped (on_worker_lost='drop'); use chunks(), or on_worker_lost='wait'"
            )
        if self._state.mode is not Mode.IDLE:
            raise InvalidState(f"{operation}() called while {running}")

    def forget_answers(self, remote: Remote) -> None:
        """Stop waiting for the answers ``remote`` owes: they are dropped when they come.

        For a caller that no longer needs them (a chunk stream that ends) while the worker is
        lost and may resume much later.
        """
        remote.outbox.forget()

    def drop(self, remote: Remote) -> None:
        """Leave ``remote`` out of chunk streams and gradient rounds from now on."""
        self.dropped.add(remote.info.worker_id)
        remote.outbox.drop()

    # One request per worker, all at once.

    async def exchange(
        self,
        requests: Sequence[Request],
        operation: str,
        *,
        redo: Redo,
        before: Callable[[Remote], Awaitable[None]] | None = None,
        after: Callable[[Remote], Awaitable[None]] | None = None,
        check: Check | None = None,
        running: str = "another operation is running",
    ) -> list[Message]:
        """Send one request per worker, then collect one answer from each, in worker order.

        ``before`` runs for each worker before any request is sent, ``after`` right after
        its request was sent (weights that follow it); ``redo`` gives the answer when a
        replacement took a worker over before answering (its envs start afresh); ``check``
        tests each answer (see :meth:`answer_from`). A mode left open ends first (see
        :meth:`end_abandoned`), then the pool is checked (:meth:`check`, with ``running``):
        callers do not check it again. While it runs the pool is busy; a failure that leaves
        the workers out of step marks the pool broken.

        Raises:
            InvalidState: see :meth:`check`.
            WorkerError: an env raised on a worker (the others' answers are still received).
            WorkerLost | Timeout | ProtocolError: a worker failed; the pool is broken.
        """
        await self.end_abandoned()
        self.enter(Mode.EXCHANGE, operation, running=running)
        try:
            return await self._exchange(requests, operation, redo, before, after, check)
        except (WorkerLost, Timeout, ProtocolError) as exc:
            self.break_for_good(exc)
            raise
        except BaseException as exc:
            # Cancelled or failed halfway: replies may still be in flight, so the
            # lockstep with the workers is lost for good.
            if not isinstance(exc, WorkerError):
                self.break_for_good(InvalidState(f"{operation}() was interrupted ({exc!r})"))
            raise
        finally:
            self.leave(Mode.EXCHANGE)

    async def _exchange(
        self,
        requests: Sequence[Request],
        operation: str,
        redo: Redo,
        before: Callable[[Remote], Awaitable[None]] | None,
        after: Callable[[Remote], Awaitable[None]] | None,
        check: Check | None,
    ) -> list[Message]:
        remotes = self.remotes
        if before is not None:
            # Every worker's preparation first (weights, say), then the requests: large
            # frames handed to several connections travel at the same time.
            for remote in remotes:
                await before(remote)
        for remote, request in zip(remotes, requests, strict=True):
            await self.send_request(remote, request)
            if after is not None:
                await after(remote)
        answers: list[Message] = []
        failure: WorkerError | None = None
        for remote, request in zip(remotes, requests, strict=True):
            answer = await self.answer_from(remote, operation, check)
            if answer is None:  # a replacement took over: its envs start afresh
                answer = await redo(remote, request, operation)
            if isinstance(answer, ErrorReport):
                failure = failure or self.worker_error(remote, answer)
                continue
            answers.append(answer)
        if failure is not None:
            raise failure
        return answers

    # Numbered requests, and what happens when a worker is lost.

    async def send_request(self, remote: Remote, request: Request) -> None:
        """Number ``request`` for ``remote`` and send it (or keep it for after a resume)."""
        request = remote.outbox.number(request)
        if remote.delivered == remote.generation and remote.attached.is_set():
            await self.send(remote, request)

    async def send(self, remote: Remote, message: Message, frame: bytes | None = None) -> None:
        """Send an unnumbered message to ``remote``; a broken connection is noticed later.

        Raises:
            WorkerLost: sending failed under ``on_worker_lost="raise"``. Otherwise the
                connection is closed, and the next receive recovers it.
        """
        try:
            await remote.session.send(message, frame=frame)
        except TransportError as exc:
            if self.on_worker_lost == "raise":
                raise self.lost(remote, type(message).__name__, exc) from exc
            # Whatever was unanswered goes again on the connection that takes over.
            remote.delivered = -1
            await remote.session.aclose("sending failed")

    async def answer_from(
        self, remote: Remote, operation: str, check: Check | None = None
    ) -> Message | None:
        """Receive ``remote``'s next answer, exactly once.

        ``check`` looks at each fresh answer before it is returned and raises
        :class:`ProtocolError` for one that does not fit (wrong shapes, say): a malformed
        answer, like an unexpected message or a wrong sequence number, is its worker's
        failure, handled as its loss under ``on_worker_lost`` (see :meth:`fail`).

        Returns ``None`` when a replacement worker took over: the requests of the lost one
        are void.

        Raises:
            WorkerLost: the worker was lost (and, under ``"wait"``, did not come back); a
                worker silent for ``timeouts.step`` is lost, with the Timeout as the cause.
            ProtocolError: the worker broke the protocol (under ``on_worker_lost="raise"``;
                it was disconnected).
        """
        while True:
            generation = remote.generation
            try:
                if remote.delivered != generation:
                    await self.catch_up(remote)
                message = await remote.session.receive(
                    timeout=self.timeouts.step,
                    operation=f"worker {remote.info.worker_id}'s {operation}",
                )
                accepted = remote.outbox.accept(message)
                if accepted is not Accepted.FRESH:
                    continue
                if check is not None and type(message) is not ErrorReport:
                    check(remote, message)
                return message
            except (EndOfStream, TransportError, Timeout, ProtocolError) as exc:
                # A silent worker is a lost one, under every on_worker_lost (the Timeout is
                # the WorkerLost's cause); under "wait" it may resume when it wakes up.
                if await self.fail(remote, generation, operation, exc):
                    return None

    async def fail(self, remote: Remote, generation: int, operation: str, exc: ApsError) -> bool:
        """Handle a failure of ``remote``'s connection ``generation`` as ``on_worker_lost`` says.

        A lost connection (``EndOfStream``, a transport error, silence) may be resumed; a
        :class:`ProtocolError` (the worker sent something malformed) disconnects the worker
        for good, with a goodbye, and its session can no longer be resumed: under ``"raise"``
        the error is raised, naming the worker; under ``"wait"`` a replacement takes the
        slot over; under ``"drop"`` it is lost like any other.

        Returns once another connection serves ``remote``: ``True`` when a replacement
        worker took it over (once per replacement: the requests of the lost one are void),
        ``False`` when the worker resumed its session.

        Raises:
            ProtocolError: the worker broke the protocol, under ``"raise"``.
            WorkerLost: see :meth:`recover`.
        """
        if isinstance(exc, ProtocolError) and remote.generation == generation:
            exc = await self._disown(remote, exc)
            if self.on_worker_lost == "raise":
                raise exc
        await self.recover(remote, generation, operation, exc)
        replaced = remote in self._replaced
        self._replaced.discard(remote)
        return replaced

    async def _disown(self, remote: Remote, exc: ProtocolError) -> ProtocolError:
        """Disconnect the worker serving ``remote`` for breaking the protocol.

        Returns:
            The error, its message naming the worker.
        """
        worker = f"worker {remote.info.worker_id}"
        named = exc if str(exc).startswith(worker) else ProtocolError(f"{worker}: {exc}")
        log.warning("%s; disconnecting it", named)
        # No resume: what it would send again is what it sent.
        self._by_session.pop(remote.session_id, None)
        await remote.session.aclose(f"the learner disconnected this worker: {named}")
        return named

    async def call(
        self, remote: Remote, request: Request, operation: str, check: Check | None = None
    ) -> Message | None:
        """Send one request to ``remote`` and receive its answer (``None``: replaced meanwhile)."""
        await self.send_request(remote, request)
        return await self.answer_from(remote, operation, check)

    async def call_until_answered(
        self, remote: Remote, request: Request, operation: str, check: Check | None = None
    ) -> Message:
        """:meth:`call`, sent again to each replacement until one of them answers."""
        while (answer := await self.call(remote, request, operation, check)) is None:
            pass
        return answer

    async def catch_up(self, remote: Remote) -> None:
        """Bring a connection that took over up to date: what the modes say, then requests."""
        generation = remote.generation
        for hooks in self.hooks:
            await hooks.rejoined(remote)
        # Requests sent meanwhile were only queued; the loop sends those too, in order.
        # Requests numbered meanwhile were only queued: the live queue is read, so they go too.
        unanswered = remote.outbox.resend()
        index = 0
        while index < len(unanswered):
            await self.send(remote, unanswered[index])
            if remote.delivered == -1 or remote.generation != generation:
                return  # failed again: the next receive notices
            index += 1
        remote.delivered = generation

    async def recover(
        self, remote: Remote, generation: int, operation: str, exc: BaseException
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
            raise self.lost(remote, operation, exc) from exc
        if remote.attached.is_set():
            remote.attached.clear()
            log.warning(
                "%s; waiting up to %s s for it to resume or for a replacement",
                *(self.lost(remote, operation, exc), self.reconnect_timeout),
            )
            # No goodbye: a worker that was only stalled (stopped, swapping, a slow env) sees
            # a dropped connection when it wakes up, and dials again to resume.
            await remote.session.aclose(goodbye=False)
            await self._fill_vacancies()
        try:
            async with asyncio.timeout(self.reconnect_timeout):
                await self._attached_or_closing(remote)
        except TimeoutError:
            raise WorkerLost(
                f"{self.lost(remote, operation, exc)}, and no worker resumed its session or "
                f"took its envs over within {self.reconnect_timeout} s; start a replacement "
                "worker sooner or raise reconnect_timeout",
                worker_id=remote.info.worker_id,
            ) from exc

    async def _attached_or_closing(self, remote: Remote) -> None:
        """Wait until a connection serves ``remote`` again.

        Raises:
            WorkerLost: the learner began closing first.
        """
        if remote.attached.is_set():
            return
        waits = [
            asyncio.ensure_future(remote.attached.wait()),
            asyncio.ensure_future(self._closing.wait()),
        ]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        if not remote.attached.is_set():
            raise WorkerLost(
                f"worker {remote.info.worker_id} was lost and the learner closed before it resumed",
                worker_id=remote.info.worker_id,
            )

    def worker_error(self, remote: Remote, report: ErrorReport) -> WorkerError:
        """The :class:`WorkerError` for an error ``remote`` reported."""
        return WorkerError(
            report.message,
            worker_id=remote.info.worker_id,
            remote_type=report.remote_type,
            remote_traceback=report.traceback,
        )

    def lost(self, remote: Remote, operation: str, exc: BaseException) -> WorkerLost:
        """The :class:`WorkerLost` for ``remote``, lost during ``operation`` because of ``exc``."""
        info = remote.info
        return WorkerLost(
            f"worker {info.worker_id} ({info.env_id} x {info.num_envs} at {info.peer}, pid "
            f"{info.pid}) was lost during {operation}: {exc}",
            worker_id=info.worker_id,
        )
