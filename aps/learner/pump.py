"""One task per worker moving what it sends into one inbox: the streaming modes' plumbing.

A mode that receives from every worker at once (DETACH's chunk streams, gradient rounds)
gives :class:`Pumps` a ``receive`` function: one task per worker calls it in a loop and puts
what it returns into a shared inbox, in arrival order, for the mode's consumer to take with
:meth:`Pumps.get`. Whatever a pump raises goes into the inbox too, and that pump ends: an
error while a worker is brought up to date (a catch-up, a replacement's reset) reaches the
consumer instead of vanishing with its task. A bounded inbox is backpressure: when the
consumer falls behind, the pumps wait, the sockets fill and the workers block on sending.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from aps.errors import ApsError, WorkerLost
from aps.learner.pool import Slot, WorkerPool
from aps.learner.requests import worker_error
from aps.wire.messages import ErrorReport, Message

__all__ = ["Item", "Pumps", "Receive"]

log = logging.getLogger(__name__)

Item = tuple[Slot, Message | BaseException]
"""What the inbox holds: a worker's slot, and its message or its failure."""

Receive = Callable[[Slot], Awaitable[Message | ApsError | None]]
"""A mode's next receive from one worker: a message, or an error to deliver while the pump
goes on (a replacement, announced as its predecessor's loss), or ``None``: nothing to deliver
this time (the worker was brought up to date). Raising ends the pump; the error is delivered."""


class Pumps:
    """One pump per worker into one inbox; see the module's docstring.

    Args:
        pool: the workers.
        receive: the mode's receive (see :data:`Receive`).
        name: the tasks' name, followed by each worker's id.
        backlog: the inbox's size (0: unbounded).
    """

    def __init__(self, pool: WorkerPool, receive: Receive, *, name: str, backlog: int = 0) -> None:
        self._pool = pool
        self._receive = receive
        self._name = name
        self._inbox: asyncio.Queue[Item] = asyncio.Queue(backlog)
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def depth(self) -> int:
        """What the workers delivered and nobody took yet."""
        return self._inbox.qsize()

    def start(self, admitted: Sequence[Slot]) -> None:
        """Start one pump for each of ``admitted``."""
        self._tasks += [
            asyncio.create_task(self._pump(slot), name=f"{self._name} {slot.info.worker_id}")
            for slot in admitted
        ]

    async def _pump(self, slot: Slot) -> None:
        while True:
            try:
                item = await self._receive(slot)
            except Exception as exc:  # delivered: the consumer raises it
                await self._inbox.put((slot, exc))
                return
            if item is not None:
                await self._inbox.put((slot, item))

    def get(self) -> Coroutine[Any, Any, Item]:
        """The next thing any worker delivered, in arrival order (await it).

        The inbox's own coroutine, not one awaiting it: the stream awaits one per chunk.
        """
        return self._inbox.get()

    def unwrap(self, slot: Slot, item: Message | BaseException) -> Message:
        """``item`` as a message of ``slot``'s.

        Raises:
            BaseException: the failure it is.
            WorkerError: it is the error ``slot`` reported.
        """
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, ErrorReport):
            raise worker_error(slot, item)
        return item

    async def drop(self, slot: Slot, lost: WorkerLost) -> None:
        """Leave ``slot`` out of chunk streams and gradient rounds (``on_worker_lost="drop"``)."""
        self._pool.slots.drop(slot)
        log.warning("%s; dropped it, going on with the other workers", lost)
        await slot.session.aclose("the learner dropped this worker")

    async def stop(self) -> list[Item]:
        """Cancel the pumps and wait for them; return what they delivered and nobody took."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        left: list[Item] = []
        while not self._inbox.empty():
            left.append(self._inbox.get_nowait())
        return left
