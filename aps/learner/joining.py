"""Admission after authentication: the workers that proved the token, taken in.

The :class:`~aps.learner.admission.Gate` runs every handshake until the peer has proved the
token, then hands the worker to :meth:`Joining.join`: a worker that resumes its session gets
its slots back, a new one is welcomed (compression, frame delta and the policy agreed, its
envs built, their spaces checked against the workers already admitted) into the next slots or
kept as a spare. :meth:`Joining.wait` waits until every worker is in, watching the launcher
when there is one; :meth:`Joining.describe` is what ``aps check`` is told.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from typing import Any, Protocol

from aps._version import __version__
from aps.errors import (
    MAX_REMOTE_TEXT,
    MAX_REMOTE_TYPE,
    ApsError,
    ConfigError,
    ProtocolError,
    Timeout,
)
from aps.learner.admission import reject
from aps.learner.config import LearnerConfig
from aps.learner.recovery import Recovery, Spare
from aps.learner.slots import Slot, Slots, log
from aps.session import Session
from aps.wire.compression import (
    accepted as accepted_compression,
    choose as choose_compression,
    choose_frame_delta,
)
from aps.wire.messages import ErrorReport, Hello, ProbeResult, ProbeSpaces, Ready, Welcome

__all__ = ["SESSION_ID_SIZE", "Joining"]

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


class Joining:
    """The workers that proved the token, taken into the slot table or kept as spares.

    Args:
        config: the learner's settings (what every welcome offers and checks).
        slots: the slot table a new worker joins and a resumed one returns to.
        recovery: where spares wait, and what a lost worker does.
    """

    def __init__(self, config: LearnerConfig, slots: Slots, recovery: Recovery) -> None:
        self.config = config
        self.slots = slots
        self.recovery = recovery
        self._admitting = 0
        self._next_id = 0

    def describe(self) -> tuple[ProbeResult, ProbeSpaces]:
        """What ``aps check`` is told once it proved the token (the gate adds its proof)."""
        observation_space, action_space = self.slots.spaces or (None, None)
        result = ProbeResult(
            proof=b"",
            aps_version=__version__,
            num_workers=self.config.num_workers,
            workers=sum(slot.attached.is_set() for slot in self.slots.admitted),
            spares=len(self.recovery.spares),
            num_envs=sum(self.slots.counts),
            autoreset_mode=self.config.autoreset_mode.value,
            policy=self.config.policy,
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
        num_workers = self.config.num_workers
        spare = len(self.slots.admitted) + self._admitting >= num_workers
        spares = len(self.recovery.spares)
        if spare and (self.recovery.on_worker_lost != "wait" or spares >= num_workers):
            why = (
                "start the learner with a larger num_workers"
                if self.recovery.on_worker_lost != "wait"
                else f"{spares} spares already wait to replace lost workers"
            )
            await reject(
                session,
                ConfigError(f"this learner already has its {num_workers} workers; {why}"),
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
        config, recovery = self.config, self.recovery
        offered = tuple(hello.compression.split(",")) if hello.compression else ()
        chosen = choose_compression(
            config.compression, offered, local=session.is_local, peer=session.peer
        )
        frame_delta = choose_frame_delta(
            config.compression, offered, local=session.is_local, enabled=config.frame_delta
        )
        await session.send(
            Welcome(
                worker_id=worker_id,
                autoreset_mode=config.autoreset_mode.value,
                policy=config.policy,
                session_id=session_id,
                resumed=resumed,
                policy_kwargs=config.policy_kwargs,
                proof=proof,
                resume_window=(
                    recovery.reconnect_timeout if recovery.on_worker_lost == "wait" else 0.0
                ),
                compression=accepted_compression(chosen, frame_delta),
            )
        )
        session.compress(chosen, frame_delta=frame_delta)  # from the worker's Ready on
        # Building envs runs user code and may take long: the step deadline bounds it.
        ready = await session.receive(
            timeout=config.timeouts.step,
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
        if self.slots.spaces is None:
            self.slots.spaces = (ready.observation_space, ready.action_space)

    async def _resume(self, session: Session, hello: Hello, slot: Slot, proof: bytes) -> None:
        """Take a worker whose connection dropped back into its session and env slots."""
        info = slot.info
        if not (
            slot.outbox.can_resume(hello.served)
            and hello.num_envs == info.num_envs
            and hello.version <= slot.metrics.version
            and info.worker_id not in self.slots.dropped
        ):
            await reject(
                session,
                ProtocolError(
                    f"cannot resume worker {info.worker_id}'s session: it says it answered "
                    f"{hello.served} requests of {info.num_envs} envs holding version "
                    f"{hello.version}, but it was sent {slot.outbox.sent} requests "
                    f"({slot.outbox.received} answered) for {info.num_envs} envs, and version "
                    f"{slot.metrics.version}"
                    + (", and it was dropped" if info.worker_id in self.slots.dropped else "")
                    + "; restart the worker without resuming"
                ),
                proof,
            )
        await self._welcome(session, hello, info.worker_id, slot.session_id, proof, resumed=True)
        # Weights sent before the cut may be lost: the worker's word is what it holds.
        slot.metrics.version = hello.version
        slot.metrics.resumes += 1
        log.warning("worker %d resumed its session from %s", info.worker_id, session.peer)
        await self.slots.attach(slot, session)

    async def _check_spaces(self, session: Session, ready: Ready, hello: Hello) -> None:
        if ready.num_envs != hello.num_envs:
            await reject(
                session,
                ProtocolError(f"hello said {hello.num_envs} envs, ready said {ready.num_envs}"),
            )
        if self.slots.spaces is None:
            return
        observation_space, action_space = self.slots.spaces
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

    async def wait(
        self, timeout: float | None, url: str, refusals: Callable[[], list[str]]
    ) -> None:
        """Wait until all workers are admitted; see :meth:`Learner.wait_for_workers`.

        ``url`` is where the missing workers should connect and ``refusals`` the gate's latest
        refusals, both for the error.
        """
        if self.slots.all_ready.is_set():
            return
        seconds = self.config.timeouts.connect if timeout is None else timeout
        try:
            if self.config.launcher is None:
                async with asyncio.timeout(seconds):
                    await self.slots.all_ready.wait()
            else:
                await self._wait_watching(self.config.launcher, seconds)
        except TimeoutError:
            refused = "; ".join(refusals()[-3:]) or "none"
            message = (
                f"{len(self.slots.admitted)} of {self.config.num_workers} workers arrived at {url} "
                f"within {seconds} s (recent refusals: {refused})"
            )
            if self.config.launcher is None:
                message += "; start the missing workers or raise Timeouts.connect"
            else:
                message += f"; {await self._give_up_launch()}; raise Timeouts.connect if the "
                message += "workers need longer to start"
            raise Timeout(message, operation="wait_for_workers", seconds=seconds) from None
        except ApsError:
            if self.config.launcher is not None:
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
        assert self.config.launcher is not None
        try:
            report = f"{await self.config.launcher.status()}"
        except Exception as exc:  # the report only decorates an error already on its way
            report = f"the launcher could not report its state ({exc!r})"
        try:
            await self.config.launcher.stop(grace=0.0)  # no goodbye was said: nobody leaves alone
        except Exception as exc:
            log.warning("stopping the launcher failed: %r", exc)
            return f"{report}; stopping it failed: {exc}"
        return f"{report}; the launcher has been stopped"
