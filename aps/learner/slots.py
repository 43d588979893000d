"""The slot table: each admitted worker's env slots, in env order, and who serves them now.

A :class:`Slot` is one worker's env slots and the connection serving them; the
:class:`Slots` table holds them in env order, finds one by the session id a worker resumes
with, and tells which are left out (dropped). The slots outlive their workers: a resumed
connection or a replacement worker takes a slot over (:mod:`~aps.learner.recovery`), and the
modes key their own per-slot state by the slot. Nothing here does I/O but closing the
connection a new one replaces.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import gymnasium as gym

from aps.errors import InvalidState
from aps.learner.rollouts import WorkerMetrics
from aps.session import Session
from aps.session.delivery import Outbox
from aps.wire.messages import Hello, Message, Request

__all__ = ["AnswerCheck", "Slot", "SlotHooks", "Slots", "WorkerInfo", "expect"]

log = logging.getLogger("aps.learner.pool")  # one logger for the pool and its rooms

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


@dataclass(slots=True, eq=False)
class Slot:
    """One worker's env slots, and the connection serving them now.

    The connection changes when the worker resumes its session and the worker itself when a
    replacement takes the slots over; ``generation`` counts both. Modes keep their own
    per-slot state, keyed by the slot (identity).
    """

    info: WorkerInfo
    session: Session
    metrics: WorkerMetrics
    session_id: bytes
    # Numbered requests (see aps.session.delivery), and the generation of the connection serving
    # the slot: ``delivered`` is the generation that got every unanswered request.
    outbox: Outbox = field(default_factory=Outbox)
    generation: int = 0
    delivered: int = 0
    attached: asyncio.Event = field(default_factory=asyncio.Event)
    # Loop time the latest request went out on the connection serving the slot: where an
    # answer deadline counts from (see Requests.answer_from).
    asked: float = 0.0


class SlotHooks(Protocol):
    """What a mode does when the worker serving a slot changes."""

    def replaced(self, slot: Slot, void: Sequence[Request]) -> None:
        """A new worker took over ``slot``; ``void`` are the lost worker's unanswered requests.

        The mode forgets what it knew of the lost worker (it is called before anything is sent
        to the new one).
        """

    async def rejoined(self, slot: Slot) -> None:
        """A connection took over ``slot`` (resumed or replaced): send what it needs first.

        Called before the unanswered requests are sent again; send with
        :meth:`Requests.send <aps.learner.requests.Requests.send>`.
        """


AnswerCheck = Callable[[Slot, Message], None]
"""A mode's test of a fresh answer: raises :class:`ProtocolError` when it does not fit."""


class Slots:
    """The admitted workers' slots, in env order, for ``num_workers`` workers."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.admitted: list[Slot] = []
        """The admitted workers' slots, in env order."""
        self.counts: list[int] = []
        """Envs per worker, in env order."""
        self.offsets: list[int] = []
        """Global index of each worker's first env."""
        self.dropped: set[int] = set()
        """Worker ids left out of chunk streams and gradient rounds."""
        self.former: list[WorkerMetrics] = []
        """Metrics of workers that were replaced."""
        self.all_ready = asyncio.Event()
        """Set once every worker is admitted (and the slots are in their final order)."""
        self.spaces: tuple[gym.Space[Any], gym.Space[Any]] | None = None
        """The observation and action spaces of the first worker admitted (the others were
        checked against them)."""
        self._by_session: dict[bytes, Slot] = {}

    def require_workers(self) -> tuple[gym.Space[Any], gym.Space[Any]]:
        """The single observation and action spaces, once every worker is admitted."""
        if self.spaces is None or not self.all_ready.is_set():
            raise InvalidState(
                "the workers have not all arrived yet; await wait_for_workers() or reset() first"
            )
        return self.spaces

    def register(self, session: Session, hello: Hello, worker_id: int, session_id: bytes) -> None:
        """Give a newly admitted worker the next slots (the last worker puts them in order)."""
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
        slot = Slot(
            info=info,
            session=session,
            metrics=WorkerMetrics(worker_id=worker_id),
            session_id=session_id,
        )
        session.tally = slot.metrics
        slot.attached.set()
        self.admitted.append(slot)
        self._by_session[session_id] = slot
        self.counts.append(hello.num_envs)
        self.offsets.append(offset)
        session.start_heartbeats()
        last = offset + hello.num_envs - 1
        log.info(
            "worker %d admitted from %s: %d x %s (envs %d..%d)",
            *(worker_id, session.peer, hello.num_envs, hello.env_id, offset, last),
        )
        if len(self.admitted) == self.num_workers:
            self._order_by_label()
            self.all_ready.set()

    def _order_by_label(self) -> None:
        """Put the workers in launch order once all are in, when a launcher numbered them.

        Workers arrive in any order; a launcher labels them ``"0"``, ``"1"``, ... and gives
        worker ``i`` its share of the envs (env functions, per-worker seeds and kwargs) in
        that order, so the env order follows the labels. Nothing has used the offsets yet.
        """
        labels = [r.info.label for r in self.admitted]
        if sorted(labels) != [str(i) for i in range(len(labels))]:
            return  # not a launcher's numbering (workers started by hand): arrival order
        self.admitted.sort(key=lambda r: int(r.info.label))
        offset = 0
        for index, slot in enumerate(self.admitted):
            slot.info = dataclasses.replace(slot.info, env_offset=offset)
            self.counts[index] = slot.info.num_envs
            self.offsets[index] = offset
            offset += slot.info.num_envs

    def by_session(self, session_id: bytes | None) -> Slot | None:
        """The slot whose session has this id (``None``: none, or it can no longer resume)."""
        return self._by_session.get(session_id) if session_id else None

    def rekey(self, slot: Slot, session_id: bytes | None) -> None:
        """Let ``slot`` be resumed with ``session_id`` only (``None``: with none)."""
        self._by_session.pop(slot.session_id, None)  # gone already if it was disowned
        if session_id is not None:
            slot.session_id = session_id
            self._by_session[session_id] = slot

    async def attach(self, slot: Slot, session: Session) -> None:
        """Make ``session`` the one serving ``slot`` and close the one it replaces."""
        old, slot.session = slot.session, session
        session.tally = slot.metrics  # the worker's figures go on across connections
        slot.generation += 1
        session.start_heartbeats()
        slot.attached.set()
        # A call still waiting on the old connection fails at once and carries on here.
        await old.aclose("another connection took over this worker's session")

    def active(self) -> list[Slot]:
        """The slots not dropped, in env order."""
        return [r for r in self.admitted if r.info.worker_id not in self.dropped]

    def drop(self, slot: Slot) -> None:
        """Leave ``slot`` out of chunk streams and gradient rounds from now on."""
        self.dropped.add(slot.info.worker_id)
        slot.outbox.drop()
