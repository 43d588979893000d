"""The weight group: each version leaves the learner once, whatever the number of workers.

Without a group the learner sends every synced worker its own copy of a version over the
worker's session, so its uplink per version grows with the workers synced (6.7 MB, the
Nature CNN, to 1,024 workers is 6.9 GB). A :class:`WeightGroup` is a gloo group
(``torch.distributed``) of the learner, rank 0, and the workers admitted when it formed: each
published version goes out in one collective (:func:`aps.gradients.spread`: a scatter, then an
all-gather among all ranks), in which the learner sends less than two copies however many
workers there are, and the workers pass the pieces among themselves.

The session still decides: the sync strategy chooses per worker, as without a group, when it
acts with a new version; the version then travels as a small ``Weights(version,
arrays=None)`` over the session, and the worker takes the arrays the collective brought
(:mod:`aps.worker.fanout`). So APS's decisions, the chunks' version stamps and the lag
accounting are the same; what the group changes is where the bytes travel. Every member
receives every version, so a worker's downlink carries every version (where APS would have
sent it few): the group is for fleets whose learner's uplink is the bound.

A group lasts while its members do. A member that is lost, replaced or resumed (its
announcements may have been lost with its connection), or a collective that fails, ends the
group for good: the learner closes it, logs why, and sends versions over the sessions again.
Gloo's connections are not authenticated or encrypted (see :class:`aps.gradients.RoundStore`):
form a group on a network you trust.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Any

import numpy as np

from aps.errors import ApsError, InvalidState, Timeout
from aps.gradients import RoundStore, join_group, spread, spread_buffer, spread_bytes
from aps.learner.pool import Slot, WorkerPool, expect
from aps.learner.rounds import store_host
from aps.session import Session
from aps.wire.messages import GroupWeights, JoinWeightGroup, Message, Request, WeightGroupJoined

__all__ = ["WeightGroup"]

log = logging.getLogger("aps.learner")


class WeightGroup:
    """The learner's side of a formed weight group (see the module's docstring).

    Made by :meth:`form`; :meth:`send` fans one version out; :meth:`close` ends it.
    """

    def __init__(
        self, store: RoundStore, group: Any, members: dict[Slot, Session], timeout: float
    ) -> None:
        self._store = store
        self._group = group
        self._members = members
        self.timeout = timeout
        self.world_size = len(members) + 1
        self.versions = 0
        """Versions fanned out."""
        self._newest = 0  # the newest version this group carried
        self.bytes_sent = 0
        """What the learner sent in the collectives, by :func:`aps.gradients.spread_bytes`."""

    @classmethod
    async def form(cls, pool: WorkerPool, timeout: float) -> WeightGroup:
        """Form a group of the learner and the pool's admitted workers, ranked in their order.

        Every worker joins, or none does.

        Raises:
            InvalidState: no member, or one was replaced while the group formed.
            WorkerError: a worker could not join (no torch on it, say).
            Timeout: the group did not form within ``timeout`` seconds.
        """
        members = list(pool.slots.admitted)
        if not members:
            raise InvalidState("a weight group needs at least one admitted worker")
        world = len(members) + 1
        host, bind = store_host(pool.url, pool.is_local)
        store = await asyncio.to_thread(RoundStore, bind, world, timeout)
        root = asyncio.ensure_future(
            asyncio.to_thread(
                join_group,
                host=bind,
                port=store.port,
                prefix=store.prefix,
                rank=0,
                world_size=world,
                timeout=timeout,
                store=store.store,
                bind=bind,
            )
        )
        requests = [
            JoinWeightGroup(
                host=host,
                port=store.port,
                prefix=store.prefix,
                rank=rank,
                world_size=world,
                timeout=timeout,
            )
            for rank in range(1, world)
        ]
        try:
            answers = await pool.exchange(
                requests, "joining the weight group", redo=_no_redo, within=timeout
            )
            for answer in answers:
                expect(answer, WeightGroupJoined)
            async with asyncio.timeout(timeout + 5.0):
                group = await asyncio.shield(root)
        except BaseException as exc:
            root.add_done_callback(_shut)
            store.close()
            if isinstance(exc, TimeoutError | RuntimeError):
                raise _timeout(
                    f"the weight group of {world - 1} workers", timeout, bind, store.port
                ) from exc
            raise
        log.info("%d workers formed a weight group with the learner", world - 1)
        return cls(store, group, {slot: slot.session for slot in members}, timeout)

    def intact(self) -> str | None:
        """Why the group can fan out no more (a member lost, replaced or resumed), or ``None``."""
        for slot, session in self._members.items():
            if slot.session is not session or not slot.attached.is_set():
                return f"worker {slot.info.worker_id} lost the connection it joined with"
        return None

    def carried(self, version: int) -> bool:
        """Whether ``version`` is the newest version this group fanned out (its members hold it)."""
        return version == self._newest

    def member(self, slot: Slot) -> bool:
        """Whether ``slot``'s worker receives versions by the group."""
        return self._members.get(slot) is slot.session

    async def send(self, pool: WorkerPool, version: int, frame: bytes) -> None:
        """Fan ``frame``, version ``version``'s Weights, out to every member; the collective ends.

        Raises:
            Timeout: the collective did not end within the group's timeout (a member lost).
            RuntimeError: gloo failed.
        """
        digest = await asyncio.to_thread(_sha256, frame)
        announcement = GroupWeights(version=version, nbytes=len(frame), sha256=digest)
        for slot in self._members:
            await pool.requests.send(slot, announcement)
        buffer = spread_buffer(len(frame), self.world_size)
        buffer.numpy()[: len(frame)] = np.frombuffer(frame, dtype=np.uint8)
        try:
            async with asyncio.timeout(self.timeout + 5.0):
                await asyncio.to_thread(spread, self._group, 0, self.world_size, buffer)
        except TimeoutError as exc:
            raise _timeout(f"version {version}'s fan-out", self.timeout, "", 0) from exc
        self.versions += 1
        self._newest = version
        self.bytes_sent += spread_bytes(len(frame), self.world_size)

    def close(self) -> None:
        """Leave the group; the members' collectives under way fail, and they leave too."""
        group, self._group = self._group, None
        if group is not None:
            group.shutdown()
        self._store.close()


async def _no_redo(slot: Slot, request: Request, operation: str) -> Message:
    raise InvalidState(
        f"worker {slot.info.worker_id} was replaced while the weight group formed; form it again"
    )


def _shut(root: asyncio.Future[Any]) -> None:
    if not root.cancelled() and root.exception() is None:
        root.result().shutdown()


def _sha256(frame: bytes) -> bytes:
    return hashlib.sha256(frame).digest()


def _timeout(what: str, seconds: float, bind: str, port: int) -> ApsError:
    where = f" or cannot reach {bind}:{port}" if port else ""
    return Timeout(
        f"{what} did not finish in {seconds} s: a worker was lost{where}; raise "
        "Timeouts.step, open the port between the machines, or do without a weight group",
        operation="weight group",
        seconds=seconds,
    )
