"""The worker pool: the workers as connections, and the one service the modes use.

:class:`WorkerPool` composes the pool's rooms and owns what the workers are used for now:

- it listens (its :class:`~aps.learner.admission.Gate` runs every handshake until the peer
  has proved the token), and takes in the workers that did: spaces that agree, a resumed
  session, spares;
- :mod:`~aps.learner.slots`: the slot table, each admitted worker's env slots (a
  :class:`~aps.learner.slots.Remote`) in env order;
- :mod:`~aps.learner.replace`: recovery and spares, ``on_worker_lost`` applied, a spare
  taking a lost worker's slots over, and what a replacement means to the envs;
- :mod:`~aps.learner.requests`: the numbered request/answer service the modes talk to the
  workers through (``pool.requests``; :meth:`WorkerPool.exchange` sends one request per
  worker while it holds them all): requests carry sequence numbers, a resumed worker gets again
  what it did not answer, and answers arrive exactly once (the books are kept by each slot's
  :class:`~aps.delivery.Outbox`, which does no I/O). A malformed answer is its worker's
  failure, handled as its loss.

When a connection takes over a slot, the pool asks each mode's :class:`SlotHooks` what that
worker needs first (its weights, the current gradient round); the pool itself knows nothing of
any mode. What the workers are used for now is the pool's :class:`Mode`, which only the pool
writes, through a :class:`Lease` (``async with pool.lease(Mode.X, operation):``): taking it
ends a mode a caller left open, refuses what cannot run now and enters the mode; releasing it
turns a worker's failure into :attr:`Mode.BROKEN` (workers out of step for good) and always
leaves.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import gymnasium as gym

from aps import transports
from aps._version import __version__
from aps.compression import (
    accepted as accepted_compression,
    choose as choose_compression,
    choose_frame_delta,
)
from aps.errors import (
    MAX_REMOTE_TEXT,
    MAX_REMOTE_TYPE,
    ApsError,
    ConfigError,
    InvalidState,
    ProtocolError,
    Timeout,
    WorkerError,
)
from aps.learner.admission import Gate, reject
from aps.learner.config import LearnerConfig
from aps.learner.lease import _LEASES, Lease, Mode, _State
from aps.learner.replace import OnWorkerLost, Recovery, Spare
from aps.learner.requests import FRESH_RESET, Redo, Requests, worker_error
from aps.learner.rollouts import WorkerMetrics
from aps.learner.slots import Check, Remote, SlotHooks, Slots, WorkerInfo, expect, log
from aps.messages import (
    ErrorReport,
    Hello,
    Message,
    ProbeResult,
    ProbeSpaces,
    Ready,
    Request,
    Welcome,
)
from aps.session import Session
from aps.transports.base import Listener

__all__ = [
    "FRESH_RESET",
    "Check",
    "LearnerMode",
    "Lease",
    "Mode",
    "OnWorkerLost",
    "Redo",
    "Remote",
    "SlotHooks",
    "WorkerInfo",
    "WorkerPool",
    "expect",
]

SESSION_ID_SIZE = 16
"""Random bytes in a session id (what a worker resumes its session with)."""


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


class LearnerMode(SlotHooks, Protocol):
    """A mode over the pool, as the pool and the learner see it.

    Registered in :attr:`WorkerPool.modes`, which the pool tells when the worker serving a
    slot changes (:class:`SlotHooks`) and the learner ends, in order, when it closes.
    """

    async def aclose(self) -> None:
        """End what the mode holds (a chunk stream, gradient rounds, steps sent); idempotent."""


class WorkerPool:
    """The learner's workers: admission, sessions, recovery and numbered requests.

    Args:
        config: the learner's settings, checked where they were built
            (:meth:`~aps.learner.config.LearnerConfig.build`); the pool and its gate read them
            and nobody writes them.
        figures: the learner's figures as plain data, for ``aps top``; a callable rather than
            a setting because it reads the learner's live state, which exists only once the
            learner does.
    """

    def __init__(self, config: LearnerConfig, *, figures: Callable[[], dict[str, Any]]) -> None:
        self.config = config
        # The settings under the names the pool's code reads them by.
        self._listen = config.listen
        self.num_workers = config.num_workers
        self._token = config.token
        self.autoreset_mode = config.autoreset_mode
        self.timeouts = config.timeouts
        self._insecure = config.insecure
        self._factory = config.factory
        self._policy = config.policy
        self.policy_kwargs = config.policy_kwargs
        """The policy factory's keyword arguments, sent in every welcome."""
        self.compression = config.compression
        """The learner's compression setting, applied in every welcome."""
        self.frame_delta = config.frame_delta
        """Whether workers that offer frame delta may use it."""
        self.figures = figures
        """The learner's figures as plain data, for ``aps top``."""
        self.launcher = config.launcher
        self.modes: list[LearnerMode] = []
        """The modes, registered by the learner: told when the worker serving a slot changes,
        ended in this order when the learner closes."""
        self.slots = Slots(config.num_workers)
        """The slot table."""
        self.recovery = Recovery(
            self.slots,
            self.modes,
            on_worker_lost=config.on_worker_lost,
            reconnect_timeout=config.reconnect_timeout,
        )
        """Losses, resumes, spares and replacements."""
        self.requests = Requests(self.slots, self.recovery, self.modes, config.timeouts)
        """Numbered requests and their answers."""
        self.spaces: tuple[gym.Space[Any], gym.Space[Any]] | None = None

        self._launched = False
        self._listener: Listener | None = None
        self._gate: Gate | None = None
        self._admitting = 0
        self._next_id = 0
        self._state = _LEASES[Mode.IDLE]
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
            figures=lambda: self.figures(),
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
        self.recovery.closing.set()

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
        sessions = [r.session for r in self.remotes] + [s.session for s in self.recovery.spares]
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
            spares=len(self.recovery.spares),
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
        resumed = self.slots.by_session(hello.resume)
        if resumed is not None:
            await self._resume(session, hello, resumed, proof)
            return
        # A new worker (or one whose session this learner does not know: it restarted).
        spare = len(self.remotes) + self._admitting >= self.num_workers
        spares = len(self.recovery.spares)
        if spare and (self.on_worker_lost != "wait" or spares >= self.num_workers):
            why = (
                "start the learner with a larger num_workers"
                if self.on_worker_lost != "wait"
                else f"{spares} spares already wait to replace lost workers"
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
            self.recovery.keep_spare(Spare(session, hello, worker_id, session_id))
            await self.recovery.fill_vacancies()
        else:
            self.slots.register(session, hello, worker_id, session_id)

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
        frame_delta = choose_frame_delta(
            self.compression, offered, local=session.is_local, enabled=self.frame_delta
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
                compression=accepted_compression(chosen, frame_delta),
            )
        )
        session.compress(chosen, frame_delta=frame_delta)  # from the worker's Ready on
        # Building envs runs user code and may take long: the step deadline bounds it.
        ready = await session.receive(
            timeout=self.timeouts.step,
            operation="the worker to build its envs",
            since=asyncio.get_running_loop().time(),  # heartbeats do not extend it
        )
        if isinstance(ready, ErrorReport):
            # Capped as WorkerError caps it: the worker chose that text.
            raise ConfigError(
                f"the worker could not build its envs or policy: "
                f"{ready.remote_type[:MAX_REMOTE_TYPE]}: {ready.message[:MAX_REMOTE_TEXT]}"
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
        await self.slots.attach(remote, session)

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

    async def wait_for_workers(self, timeout: float | None = None) -> None:
        """Wait until all workers are admitted; see :meth:`Learner.wait_for_workers`."""
        await self.start()
        if self.slots.all_ready.is_set():
            return
        seconds = self.timeouts.connect if timeout is None else timeout
        try:
            if self.launcher is None:
                async with asyncio.timeout(seconds):
                    await self.slots.all_ready.wait()
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
        waiting = asyncio.create_task(self.slots.all_ready.wait())
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
        if self.spaces is None or not self.slots.all_ready.is_set():
            raise InvalidState(
                "the workers have not all arrived yet; await wait_for_workers() or reset() first"
            )
        return self.spaces

    # The pool's mode: written here only, through a lease.

    @property
    def mode(self) -> Mode:
        """What the workers are used for now."""
        return self._state.mode

    @property
    def broken(self) -> ApsError | None:
        """Why the workers can no longer be used together, once that happened (for good)."""
        return self._state.error

    def lease(
        self,
        mode: Mode,
        operation: str,
        *,
        running: str = "another operation is running",
        every_worker: bool = True,
        verb: str | None = None,
        drained: bool = False,
        end: Callable[[], Awaitable[None]] | None = None,
    ) -> Lease:
        """The workers for ``mode``, as a scope: ``async with pool.lease(Mode.X, "op"):``.

        See :class:`Lease`; a mode that holds the workers across calls keeps the lease and
        calls its :meth:`~Lease.take` and :meth:`~Lease.release`. ``running``: what keeps the
        pool busy, for the error. ``every_worker``: the operation needs every worker's envs
        (chunk streams and gradient rounds go on without dropped workers). ``verb``: what the
        learner can no longer do once broken, for the error (default: ``operation``).
        ``drained``: the mode receives what is in flight when it ends (a chunk stream), so an
        interruption leaves the workers in step; only a worker's failure breaks them. ``end``:
        how the mode ends when its caller left it open and another operation begins (a chunk
        stream the caller stopped iterating); without one, the next operation refuses.
        """
        return Lease(self, mode, operation, running, every_worker, verb, drained, end)

    def break_for_good(self, exc: ApsError) -> None:
        """Enter :attr:`Mode.BROKEN`: every later operation refuses, with ``exc``.

        For a failure noticed outside any lease (a lease judges its own: see
        :meth:`Lease.release`). A later break says why in its place. The lease a break
        interrupted ends when its holder releases it.
        """
        state = self._state
        if state.mode is Mode.BROKEN:
            self._state = dataclasses.replace(state, error=exc)
        else:
            held = None if state.mode is Mode.IDLE else state.mode
            self._state = _State(Mode.BROKEN, exc, held)

    def _abandoned(self) -> Callable[[], Awaitable[None]] | None:
        """How the mode holding the workers ends, if its lease said how (``end``).

        A mode a break interrupted is ended too: its holder still has it open.
        """
        state = self._state
        held = state.interrupted if state.mode is Mode.BROKEN else state.mode
        return None if held is None else self._enders.get(held)

    def _refuse(self, operation: str, running: str, every_worker: bool, verb: str | None) -> None:
        """Refuse an operation over every worker's envs that the learner cannot make now.

        Raises:
            InvalidState: the workers are out of step for good, some were dropped, or another
                operation is running.
        """
        broken = self._state.error
        if broken is not None:
            raise InvalidState(
                f"this learner can no longer {verb or operation}: {broken}; start a new one"
            )
        if every_worker and self.slots.dropped:
            raise InvalidState(
                f"{operation}() needs every worker's envs, and workers "
                f"{sorted(self.slots.dropped)} were dropped (on_worker_lost='drop'); use "
                "chunks(), or on_worker_lost='wait'"
            )
        if self._state.mode is not Mode.IDLE:
            raise InvalidState(f"{operation}() called while {running}")

    def _leave(self, mode: Mode) -> None:
        """End the lease of ``mode`` (nothing if another mode holds the workers).

        Broken workers stay broken; the lease the break interrupted is over.
        """
        state = self._state
        if state.mode is mode:
            self._state = _LEASES[Mode.IDLE]
        elif state.mode is Mode.BROKEN and state.interrupted is mode:
            self._state = dataclasses.replace(state, interrupted=None)

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
        within: float | None = None,
        lease: Lease | None = None,
    ) -> list[Message]:
        """Send one request per worker, then collect one answer from each, in worker order.

        ``before`` runs for each worker before any request is sent, ``after`` right after
        its request was sent (weights that follow it); ``redo`` gives the answer when a
        replacement took a worker over before answering (its envs start afresh); ``check``
        tests each answer, and ``within`` makes each answer due that many seconds after its
        request, heartbeats or not (``None``: a silence deadline; see
        :meth:`Requests.answer_from`). It runs under a lease of :attr:`Mode.EXCHANGE` (with
        ``running``; see :meth:`lease`), or under ``lease``, one of that mode the caller took
        already (to check its arguments while holding the workers), released here.

        Raises:
            InvalidState: the lease refused (see :meth:`Lease.take`).
            WorkerError: an env raised on a worker (the others' answers are still received).
            WorkerLost | Timeout | ProtocolError: a worker failed; the pool is broken.
        """
        if lease is None:
            lease = self.lease(Mode.EXCHANGE, operation, running=running)
        async with lease:
            return await self.requests.exchange(
                requests, operation, redo, before, after, check, within
            )

    # The slot table, recovery and the request service, as the modes reach them.

    @property
    def remotes(self) -> list[Remote]:
        """The admitted workers' slots, in env order."""
        return self.slots.remotes

    @property
    def counts(self) -> list[int]:
        """Envs per worker, in env order."""
        return self.slots.counts

    @property
    def offsets(self) -> list[int]:
        """Global index of each worker's first env."""
        return self.slots.offsets

    @property
    def dropped(self) -> set[int]:
        """Worker ids left out of chunk streams and gradient rounds."""
        return self.slots.dropped

    @property
    def former(self) -> list[WorkerMetrics]:
        """Metrics of workers that were replaced."""
        return self.slots.former

    @property
    def restarts(self) -> int:
        """Workers that replaced lost ones."""
        return self.recovery.restarts

    @property
    def on_worker_lost(self) -> OnWorkerLost:
        """What a lost worker does (see :class:`~aps.learner.Learner`)."""
        return self.recovery.on_worker_lost

    @property
    def reconnect_timeout(self) -> float:
        """Seconds ``"wait"`` waits for a resume or a replacement."""
        return self.recovery.reconnect_timeout

    @property
    def was_reset(self) -> bool:
        """Whether the envs were reset at least once (a replacement's are then reset too)."""
        return self.recovery.was_reset

    def active(self) -> list[Remote]:
        """The slots not dropped, in env order."""
        return self.slots.active()

    def drop(self, remote: Remote) -> None:
        """Leave ``remote`` out of chunk streams and gradient rounds from now on."""
        self.slots.drop(remote)

    def forget_answers(self, remote: Remote) -> None:
        """Stop waiting for the answers ``remote`` owes: they are dropped when they come.

        For a caller that no longer needs them (a chunk stream that ends) while the worker is
        lost and may resume much later.
        """
        remote.outbox.forget()

    def needs_reset(self, remote: Remote) -> bool:
        """See :meth:`Recovery.needs_reset <aps.learner.replace.Recovery.needs_reset>`."""
        return self.recovery.needs_reset(remote)

    def envs_reset(self, remote: Remote) -> None:
        """Note that ``remote``'s envs were just reset, by whichever mode did it."""
        self.recovery.envs_reset(remote)

    def mark_reset(self) -> None:
        """Note that every slot's envs were reset (a replacement's are then reset first)."""
        self.recovery.mark_reset()

    def worker_error(self, remote: Remote, report: ErrorReport) -> WorkerError:
        """The :class:`WorkerError` for an error ``remote`` reported."""
        return worker_error(remote, report)
