"""Recovery and spares: what a lost worker does to its slot, as ``on_worker_lost`` says.

:class:`Recovery` handles the loss of the connection serving a slot: it raises
:class:`~aps.errors.WorkerLost` (``"raise"``, ``"drop"``), or waits (``"wait"``) for the
worker to resume its session or for a spare (a worker admitted while every slot was taken)
to take the slot over. A worker that broke the protocol is disconnected for good. A
replacement's unanswered requests are void, the modes are told (their
:class:`~aps.learner.slots.SlotHooks`), and its envs are noted as not reset yet: what a
replacement means to the envs is said here once, for every mode (:meth:`Recovery.needs_reset`,
:meth:`Recovery.note_reset`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from aps.errors import ApsError, ProtocolError, WorkerLost
from aps.learner.rollouts import WorkerMetrics
from aps.learner.slots import Slot, SlotHooks, Slots, log
from aps.session import Session
from aps.wire.messages import Hello

__all__ = ["OnWorkerLost", "Recovery", "Spare", "lost"]

OnWorkerLost = Literal["raise", "wait", "drop"]


def lost(slot: Slot, operation: str, exc: BaseException) -> WorkerLost:
    """The :class:`WorkerLost` for ``slot``, lost during ``operation`` because of ``exc``."""
    info = slot.info
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
        self._awaiting_reset: set[Slot] = set()  # slots whose replacement's envs await their reset
        self._replaced: set[Slot] = set()  # slots replaced since their last failure noticed
        self._reset_listeners: list[Callable[[Slot], None]] = []
        # Why the learner ended a slot's connection itself, by the connection's generation:
        # a receive that finds it closed then fails with that reason, not as a lost worker.
        self._broke: dict[Slot, tuple[int, ProtocolError]] = {}

    # What a replacement means to the envs: one answer for every mode. One word for it:
    # modes *reset* envs (reset_replacement, a FRESH_RESET request, Lockstep.reset); the
    # books here only *note* it (note_reset, note_reset_all) and tell who asked (on_reset);
    # needs_reset and was_reset read the books.

    def needs_reset(self, slot: Slot) -> bool:
        """Whether ``slot``'s envs are a replacement's that no mode has reset yet.

        A replacement's envs need a reset once the envs were reset (see :attr:`was_reset`):
        a mode resets them with :meth:`~aps.learner.requests.Requests.reset_replacement` (or a
        :data:`~aps.learner.requests.FRESH_RESET` request of its own) before they act.
        """
        return slot in self._awaiting_reset

    def on_reset(self, listener: Callable[[Slot], None]) -> None:
        """Call ``listener(slot)`` whenever a slot's envs are noted as reset.

        For a mode whose own per-slot state follows the envs (lockstep's pending
        ``NextStep`` reset step): a reset by any mode ends it.
        """
        self._reset_listeners.append(listener)

    def note_reset(self, slot: Slot) -> None:
        """Note that ``slot``'s envs were just reset, by whichever mode did it."""
        self._awaiting_reset.discard(slot)
        for listener in self._reset_listeners:
            listener(slot)

    def note_reset_all(self) -> None:
        """Note that every slot's envs were reset (a replacement's are then reset first)."""
        for slot in self._slots.admitted:
            self.note_reset(slot)
        self.was_reset = True

    # Spares.

    def keep_spare(self, spare: Spare) -> None:
        """Keep a worker admitted while every slot was taken, to replace a lost one."""
        spare.session.start_heartbeats()
        self.spares.append(spare)
        log.info("worker %d from %s waits as a spare", spare.worker_id, spare.session.peer)

    async def fill_vacancies(self) -> None:
        """Give each lost worker's slots to a spare with as many envs, if there is one."""
        for slot in self._slots.admitted:
            if slot.attached.is_set():
                continue
            for spare in self.spares:
                if spare.hello.num_envs == slot.info.num_envs:
                    self.spares.remove(spare)
                    await self._replace(slot, spare)
                    break

    async def _replace(self, slot: Slot, spare: Spare) -> None:
        slots = self._slots
        was, hello = slot.info, spare.hello
        slot.info = dataclasses.replace(
            was,
            worker_id=spare.worker_id,
            env_id=hello.env_id,
            host=hello.host,
            pid=hello.pid,
            label=hello.label,
            peer=spare.session.peer,
        )
        slots.former.append(slot.metrics)
        slot.metrics = WorkerMetrics(worker_id=spare.worker_id)
        slots.rekey(slot, spare.session_id)
        void = slot.outbox.void()
        self._replaced.add(slot)
        if self.was_reset:
            self._awaiting_reset.add(slot)
        for hooks in self._hooks:
            hooks.replaced(slot, void)
        self.restarts += 1
        log.warning(
            "worker %d from %s took over the envs %d..%d of lost worker %d",
            *(spare.worker_id, spare.session.peer, was.env_offset),
            *(was.env_offset + was.num_envs - 1, was.worker_id),
        )
        await slots.attach(slot, spare.session)

    # Losses.

    async def fail(self, slot: Slot, generation: int, operation: str, exc: ApsError) -> bool:
        """Handle a failure of ``slot``'s connection ``generation`` as ``on_worker_lost`` says.

        A lost connection (``EndOfStream``, a transport error, silence) may be resumed; a
        :class:`ProtocolError` (the worker sent something malformed) disconnects the worker
        for good, with a goodbye, and its session can no longer be resumed: under ``"raise"``
        the error is raised, naming the worker; under ``"wait"`` a replacement takes the
        slot over; under ``"drop"`` it is lost like any other.

        Returns once another connection serves ``slot``: ``True`` when a replacement
        worker took it over (once per replacement: the requests of the lost one are void),
        ``False`` when the worker resumed its session.

        A failure of a connection the learner itself ended for a protocol break is that break
        (its :class:`ProtocolError`, again), whatever the receive that found it closed saw:
        the one who noticed the break first may have been cancelled before it could raise it
        (a chunk stream's pump, stopped at the stream's end).

        Raises:
            ProtocolError: the worker broke the protocol, under ``"raise"``.
            WorkerLost: see :meth:`recover`.
        """
        broke = self._broke.get(slot)
        if broke is not None and broke[0] == generation == slot.generation:
            exc = broke[1]
            if self.on_worker_lost == "raise":
                raise exc
        elif isinstance(exc, ProtocolError) and slot.generation == generation:
            exc = await self._disown(slot, exc)
            if self.on_worker_lost == "raise":
                raise exc
        await self.recover(slot, generation, operation, exc)
        replaced = slot in self._replaced
        self._replaced.discard(slot)
        return replaced

    async def _disown(self, slot: Slot, exc: ProtocolError) -> ProtocolError:
        """Disconnect the worker serving ``slot`` for breaking the protocol.

        Returns:
            The error, its message naming the worker.
        """
        worker = f"worker {slot.info.worker_id}"
        named = exc if str(exc).startswith(worker) else ProtocolError(f"{worker}: {exc}")
        log.warning("%s; disconnecting it", named)
        # Noted before the close, which a cancelled caller may not see through.
        self._broke[slot] = (slot.generation, named)
        # No resume: what it would send again is what it sent.
        self._slots.rekey(slot, None)
        await slot.session.aclose(f"the learner disconnected this worker: {named}")
        return named

    async def recover(
        self, slot: Slot, generation: int, operation: str, exc: BaseException
    ) -> None:
        """Handle the loss of ``slot``'s connection ``generation`` as ``on_worker_lost`` says.

        Returns once another connection serves ``slot`` (resumed or replaced).

        Raises:
            WorkerLost: under ``"raise"`` and ``"drop"``; under ``"wait"`` when nothing took
                over within ``reconnect_timeout``.
        """
        if slot.generation != generation:
            return  # a resume already took over
        if self.on_worker_lost != "wait":
            raise lost(slot, operation, exc) from exc
        if slot.attached.is_set():
            slot.attached.clear()
            log.warning(
                "%s; waiting up to %s s for it to resume or for a replacement",
                *(lost(slot, operation, exc), self.reconnect_timeout),
            )
            # No goodbye: a worker that was only stalled (stopped, swapping, a slow env) sees
            # a dropped connection when it wakes up, and dials again to resume.
            await slot.session.aclose(goodbye=False)
            await self.fill_vacancies()
        try:
            async with asyncio.timeout(self.reconnect_timeout):
                await self._attached_or_closing(slot)
        except TimeoutError:
            raise WorkerLost(
                f"{lost(slot, operation, exc)}, and no worker resumed its session or "
                f"took its envs over within {self.reconnect_timeout} s; start a replacement "
                "worker sooner or raise reconnect_timeout",
                worker_id=slot.info.worker_id,
            ) from exc

    async def _attached_or_closing(self, slot: Slot) -> None:
        """Wait until a connection serves ``slot`` again.

        Raises:
            WorkerLost: the learner began closing first.
        """
        if slot.attached.is_set():
            return
        waits = [
            asyncio.ensure_future(slot.attached.wait()),
            asyncio.ensure_future(self.closing.wait()),
        ]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        if not slot.attached.is_set():
            raise WorkerLost(
                f"worker {slot.info.worker_id} was lost and the learner closed before it resumed",
                worker_id=slot.info.worker_id,
            )
