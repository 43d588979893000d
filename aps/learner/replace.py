"""Recovery and spares: what a lost worker does to its slot, as ``on_worker_lost`` says.

:class:`Recovery` handles the loss of the connection serving a slot: it raises
:class:`~aps.errors.WorkerLost` (``"raise"``, ``"drop"``), or waits (``"wait"``) for the
worker to resume its session or for a spare (a worker admitted while every slot was taken)
to take the slot over. A worker that broke the protocol is disconnected for good. A
replacement's unanswered requests are void, the modes are told (their
:class:`~aps.learner.slots.SlotHooks`), and its envs are noted as not reset yet: what a
replacement means to the envs is said here once, for every mode (:meth:`Recovery.needs_reset`,
:meth:`Recovery.envs_reset`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from aps.errors import ApsError, ProtocolError, WorkerLost
from aps.learner.rollouts import WorkerMetrics
from aps.learner.slots import Remote, SlotHooks, Slots, log
from aps.session import Session
from aps.wire.messages import Hello

__all__ = ["OnWorkerLost", "Recovery", "Spare", "lost"]

OnWorkerLost = Literal["raise", "wait", "drop"]


def lost(remote: Remote, operation: str, exc: BaseException) -> WorkerLost:
    """The :class:`WorkerLost` for ``remote``, lost during ``operation`` because of ``exc``."""
    info = remote.info
    return WorkerLost(
        f"worker {info.worker_id} ({info.env_id} x {info.num_envs} at {info.peer}, pid "
        f"{info.pid}) was lost during {operation}: {exc}",
        worker_id=info.worker_id,
    )


@dataclass(slots=True, eq=False)
class Spare:
    """A worker admitted while every slot was taken: it waits to replace a lost one."""

    session: Session
    hello: Hello
    worker_id: int
    session_id: bytes


class Recovery:
    """Losses, resumes and replacements of the workers serving ``slots``.

    Args:
        slots: the slot table.
        hooks: the modes to tell when the worker serving a slot changes (read when told).
        on_worker_lost: what a loss does (see :class:`~aps.learner.Learner`).
        reconnect_timeout: seconds ``"wait"`` waits for a resume or a replacement.
    """

    def __init__(
        self,
        slots: Slots,
        hooks: Sequence[SlotHooks],
        *,
        on_worker_lost: OnWorkerLost,
        reconnect_timeout: float,
    ) -> None:
        self._slots = slots
        self._hooks = hooks
        self.on_worker_lost: OnWorkerLost = on_worker_lost
        self.reconnect_timeout = reconnect_timeout
        self.spares: list[Spare] = []
        self.restarts = 0
        """Workers that replaced lost ones."""
        self.closing = asyncio.Event()
        """Set when the learner begins closing: nothing waits for a lost worker any more."""
        self.was_reset = False
        """Whether the envs were reset at least once (a replacement's are then reset too)."""
        self._unreset: set[Remote] = set()  # slots whose replacement's envs await their reset
        self._replaced: set[Remote] = set()  # slots replaced since their last failure noticed
        self._reset_listeners: list[Callable[[Remote], None]] = []

    # What a replacement means to the envs: one answer for every mode.

    def needs_reset(self, remote: Remote) -> bool:
        """Whether ``remote``'s envs are a replacement's that no mode has reset yet.

        A replacement's envs need a reset once the envs were reset (see :attr:`was_reset`):
        a mode resets them with :meth:`~aps.learner.requests.Requests.reset_replacement` (or a
        :data:`~aps.learner.requests.FRESH_RESET` request of its own) before they act.
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
        for remote in self._slots.remotes:
            self.envs_reset(remote)
        self.was_reset = True

    # Spares.

    def keep_spare(self, spare: Spare) -> None:
        """Keep a worker admitted while every slot was taken, to replace a lost one."""
        spare.session.start_heartbeats()
        self.spares.append(spare)
        log.info("worker %d from %s waits as a spare", spare.worker_id, spare.session.peer)

    async def fill_vacancies(self) -> None:
        """Give each lost worker's slots to a spare with as many envs, if there is one."""
        for remote in self._slots.remotes:
            if remote.attached.is_set():
                continue
            for spare in self.spares:
                if spare.hello.num_envs == remote.info.num_envs:
                    self.spares.remove(spare)
                    await self._replace(remote, spare)
                    break

    async def _replace(self, remote: Remote, spare: Spare) -> None:
        slots = self._slots
        was, hello = remote.info, spare.hello
        remote.info = dataclasses.replace(
            was,
            worker_id=spare.worker_id,
            env_id=hello.env_id,
            host=hello.host,
            pid=hello.pid,
            label=hello.label,
            peer=spare.session.peer,
        )
        slots.former.append(remote.metrics)
        remote.metrics = WorkerMetrics(worker_id=spare.worker_id)
        slots.rekey(remote, spare.session_id)
        void = remote.outbox.void()
        self._replaced.add(remote)
        if self.was_reset:
            self._unreset.add(remote)
        for hooks in self._hooks:
            hooks.replaced(remote, void)
        self.restarts += 1
        log.warning(
            "worker %d from %s took over the envs %d..%d of lost worker %d",
            *(spare.worker_id, spare.session.peer, was.env_offset),
            *(was.env_offset + was.num_envs - 1, was.worker_id),
        )
        await slots.attach(remote, spare.session)

    # Losses.

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
        self._slots.rekey(remote, None)
        await remote.session.aclose(f"the learner disconnected this worker: {named}")
        return named

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
            raise lost(remote, operation, exc) from exc
        if remote.attached.is_set():
            remote.attached.clear()
            log.warning(
                "%s; waiting up to %s s for it to resume or for a replacement",
                *(lost(remote, operation, exc), self.reconnect_timeout),
            )
            # No goodbye: a worker that was only stalled (stopped, swapping, a slow env) sees
            # a dropped connection when it wakes up, and dials again to resume.
            await remote.session.aclose(goodbye=False)
            await self.fill_vacancies()
        try:
            async with asyncio.timeout(self.reconnect_timeout):
                await self._attached_or_closing(remote)
        except TimeoutError:
            raise WorkerLost(
                f"{lost(remote, operation, exc)}, and no worker resumed its session or "
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
            asyncio.ensure_future(self.closing.wait()),
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
