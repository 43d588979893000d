"""Gradient rounds (Rennala / Malenia NIGT): the learner's side, driven by :mod:`aps.pg`.

:class:`GradientRounds` implements :meth:`Learner.start_round`, :meth:`Learner.next_report`,
:meth:`Learner.collect_gradients`, :meth:`Learner.drop_worker` and
:meth:`Learner.stop_gradients`. In gradient mode every worker samples at the broadcast point
and sums its gradients locally; during a round only its counts arrive
(:class:`~aps.wire.messages.GradientProgress`), and each worker sends its sum once when the
learner collects the round. One pump per worker moves what arrives into a small shared inbox
(:mod:`~aps.learner.pump`; backpressure when the caller falls behind). As the pool's
:class:`~aps.learner.pool.SlotHooks` it sends the current round (and its collection, if one
was asked for) to a worker that resumed its session; a replacement joins at the next round.

:meth:`GradientRounds.reduce` is the all-reduce aggregation (``aggregation="allreduce"``):
instead of asking for each worker's sum, the learner opens a store for the round
(:class:`~aps.gradients.RoundStore`), sends each worker its rank over its session
(:class:`~aps.wire.messages.ReduceGradients`) and takes part in one gloo all-reduce as rank 0,
contributing zeros. Gloo's connections are not authenticated: see the store's docstring.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from aps._base._typing import Array
from aps.errors import (
    ApsError,
    ConfigError,
    EndOfStream,
    InvalidState,
    ProtocolError,
    Timeout,
    TransportError,
    WorkerLost,
)
from aps.gradients import RoundStore, allreduce_sum
from aps.learner.lease import Lease, Mode
from aps.learner.pool import Slot, WorkerInfo, WorkerPool, expect
from aps.learner.pump import Pumps
from aps.session.protocol import State
from aps.wire import codec
from aps.wire.messages import (
    CollectGradients,
    GradientProgress,
    GradientReport,
    GradientRound,
    GradientsReduced,
    Message,
    ReduceGradients,
    Request,
    StopGradients,
)

__all__ = ["REPORT_BACKLOG", "GradientRounds"]

REPORT_BACKLOG = 8
"""Messages (mostly progress counts) the learner buffers per worker; beyond them the workers
wait (backpressure)."""

_WILDCARDS = frozenset({"", "0.0.0.0", "::"})


def store_host(url: str, local: bool) -> tuple[str, str]:
    """Where the store is: the host workers dial, and the address the learner binds.

    ``local``: the learner's listener says its workers are on this host (memory, Unix, a
    loopback address), so the store is on the loopback too. Otherwise the first is empty
    when the learner listens on a wildcard address: each worker then dials the host it
    reached the learner at.
    """
    if local:
        return "127.0.0.1", "127.0.0.1"
    host = urlsplit(url).hostname or ""
    if host in _WILDCARDS:
        return "", "0.0.0.0" if host != "::" else "::"
    return host, host


class _RoundFrames:
    """A round and its frame per codec, each encoded once however many workers it goes to.

    The round's arrays (the policy's weights) are as large as a weights message, so a worker
    whose connection negotiated a codec (:mod:`aps.wire.compression`) gets them compressed, as
    weights are (:meth:`aps.learner.rollouts.PolicyVersions.frame`).
    """

    def __init__(self, message: GradientRound) -> None:
        self.message = message
        self._frames: dict[str, bytes] = {}

    def frame(self, slot: Slot) -> bytes:
        """The frame for ``slot``'s session, encoded with its codec on first use."""
        name = slot.session.compression
        frame = self._frames.get(name)
        if frame is None:
            frame = self._frames[name] = slot.session.encode(self.message)
        return frame


class GradientRounds:
    """Gradient mode over the pool's workers; see the :class:`Learner` methods."""

    def __init__(self, pool: WorkerPool) -> None:
        self._pool = pool
        self.active = False
        self._remotes: list[Slot] = []
        self._pumps: Pumps | None = None
        self._behind: set[Slot] = set()  # took over by a resume or replacement: catch up
        self._round: _RoundFrames | None = None
        # The workers the current round was sent to: a replacement joins at the next round.
        self._members: frozenset[int] = frozenset()
        self._collect: tuple[CollectGradients, bytes] | None = None
        self._lease: Lease | None = None  # held from the first start_round() to aclose()

    @property
    def workers(self) -> tuple[WorkerInfo, ...]:
        """The workers taking part (all, minus those dropped)."""
        return tuple(r.info for r in self._remotes)

    # What a new connection needs (SlotHooks).

    def replaced(self, slot: Slot, void: Sequence[Request]) -> None:
        """Nothing to forget: a replacement starts sampling at the current round."""

    async def rejoined(self, slot: Slot) -> None:
        """Send the current round to a worker that resumed its session.

        A replacement (a new worker id) is not part of the round under way, whose aggregation
        rule counts the workers it started with; it receives the next round.
        """
        if self._round is not None and slot.info.worker_id in self._members:
            await self._pool.requests.send(slot, self._round.message, self._round.frame(slot))
            if self._collect is not None:
                await self._pool.requests.send(slot, *self._collect)

    # Rounds.

    async def start_round(
        self, round_id: int, arrays: dict[str, Array], *, horizon: int, gamma: float
    ) -> int:
        """:meth:`Learner.start_round`, once the workers are admitted and a policy is set."""
        pool = self._pool
        if not self.active:
            # Held until aclose(): its wind-down stops every worker (see _stop_workers).
            lease = pool.lease(
                Mode.ROUNDS, "start_round", every_worker=False, verb="train", drained=True
            )
            self._lease = await lease.take()
            lease.on_release(self._stop_workers)
            self.active = True
            self._remotes = pool.slots.active()
            # Gradient mode samples from fresh resets; a replacement needs no reset now.
            for slot in self._remotes:
                pool.recovery.note_reset(slot)
            self._pumps = Pumps(
                pool,
                self._receive,
                name="aps reports",
                backlog=REPORT_BACKLOG * pool.slots.num_workers,
            )
            self._pumps.start(self._remotes)
        message = GradientRound(round=round_id, arrays=arrays, horizon=horizon, gamma=gamma)
        self._round = frames = _RoundFrames(message)
        self._members = frozenset(r.info.worker_id for r in self._remotes)
        self._collect = None
        sent = 0
        for slot in self._remotes:
            frame = frames.frame(slot)
            await pool.requests.send(slot, message, frame)
            sent += len(frame)
        return sent

    async def collect(self, round_id: int) -> int:
        """:meth:`Learner.collect_gradients`."""
        if not self.active or self._round is None:
            raise InvalidState("call start_round() before collect_gradients()")
        if round_id != self._round.message.round:
            raise ConfigError(
                f"cannot collect round {round_id}: the round under way is "
                f"{self._round.message.round}; collect the round last started"
            )
        message = CollectGradients(round=round_id)
        frame = codec.encode(message)
        self._collect = (message, frame)
        for slot in self._remotes:
            if slot.info.worker_id in self._members:
                await self._pool.requests.send(slot, message, frame)
        return len(frame) * len(self._remotes)

    async def reduce(
        self, round_id: int, *, size: int, mean: bool
    ) -> tuple[np.ndarray[Any, Any], int]:
        """:meth:`Learner.reduce_gradients`."""
        pool = self._pool
        if not self.active or self._round is None:
            raise InvalidState("call start_round() before reduce_gradients()")
        if round_id != self._round.message.round:
            raise ConfigError(
                f"cannot reduce round {round_id}: the round under way is "
                f"{self._round.message.round}; reduce the round last started"
            )
        if not isinstance(size, int) or size < 1:
            raise ConfigError(f"size must be an int >= 1 (the gradient length), got {size!r}")
        members = [r for r in self._remotes if r.info.worker_id in self._members]
        if not members:
            raise InvalidState(f"no worker is left to reduce round {round_id}")
        world = len(members) + 1
        seconds = pool.config.timeouts.step
        host, bind = store_host(pool.url, pool.is_local)
        store = await asyncio.to_thread(RoundStore, bind, world, seconds)
        sent = 0
        try:
            for rank, slot in enumerate(members, start=1):
                message = ReduceGradients(
                    round=round_id,
                    host=host,
                    port=store.port,
                    prefix=store.prefix,
                    rank=rank,
                    world_size=world,
                    size=size,
                    mean=mean,
                    timeout=seconds,
                )
                frame = codec.encode(message)
                await pool.requests.send(slot, message, frame)
                sent += len(frame)
            zeros = np.zeros(size + world - 1, dtype=np.float32)
            try:
                async with asyncio.timeout(seconds + 5.0):
                    reduced = await asyncio.to_thread(
                        allreduce_sum,
                        zeros,
                        host=bind,
                        port=store.port,
                        prefix=store.prefix,
                        rank=0,
                        world_size=world,
                        timeout=seconds,
                        store=store.store,
                        bind=bind,
                    )
            except (TimeoutError, RuntimeError) as exc:
                raise Timeout(
                    f"the all-reduce of round {round_id} over {world - 1} workers did not "
                    f"finish in {seconds} s ({exc}); a worker was lost or cannot reach "
                    f"{bind}:{store.port}; raise Timeouts.step, open that port between the "
                    "machines, or use aggregation='server'",
                    operation="reduce_gradients",
                    seconds=seconds,
                ) from exc
        finally:
            store.close()
        return reduced, sent

    async def _receive(self, slot: Slot) -> Message | ApsError | None:
        """One worker's next gradient message (its pump's receive; see :mod:`.pump`).

        The inbox holds a few reports per worker (backpressure beyond them). A worker that
        resumes or is replaced gets the current round again (on the next receive, once the
        replacement was announced as the loss of the worker it replaced).
        """
        pool = self._pool
        if slot in self._behind:
            self._behind.discard(slot)
            await pool.requests.catch_up(slot)
        generation = slot.generation
        try:
            return await slot.session.receive(
                timeout=pool.config.timeouts.heartbeat_timeout,
                operation=f"worker {slot.info.worker_id}'s gradients",
            )
        except (EndOfStream, TransportError, Timeout, ProtocolError) as exc:
            lost = slot.info.worker_id
            replaced = await pool.recovery.fail(slot, generation, "gradients", exc)
            self._behind.add(slot)
            if not replaced:
                return None
            took_over = f"worker {lost} was lost and worker {slot.info.worker_id} took over"
            return WorkerLost(took_over, worker_id=lost)

    async def next_report(
        self,
    ) -> tuple[int, GradientProgress | GradientReport | GradientsReduced]:
        """:meth:`Learner.next_report`."""
        pool = self._pool
        pumps = self._pumps
        if not self.active or pumps is None:
            raise InvalidState("call start_round() before next_report()")
        seconds = pool.config.timeouts.step
        try:
            async with asyncio.timeout(seconds):
                slot, item = await pumps.get()
        except TimeoutError:
            raise Timeout(
                f"no gradient report from any worker for {seconds} s; raise "
                "Timeouts.step if trajectories are that slow",
                operation="next_report",
                seconds=seconds,
            ) from None
        if isinstance(item, WorkerLost) and pool.recovery.on_worker_lost == "drop":
            if slot in self._remotes:
                self._remotes.remove(slot)
            await pumps.drop(slot, item)
        message = pumps.unwrap(slot, item)
        if isinstance(message, GradientProgress | GradientsReduced):
            return slot.info.worker_id, message
        return slot.info.worker_id, expect(message, GradientReport)

    def drop_worker(self, worker_id: int) -> None:
        """:meth:`Learner.drop_worker`."""
        pool = self._pool
        for slot in self._remotes:
            if slot.info.worker_id == worker_id:
                self._remotes.remove(slot)
                pool.slots.drop(slot)
                return
        slots = pool.slots
        if worker_id in slots.dropped or any(m.worker_id == worker_id for m in slots.former):
            return
        raise ConfigError(f"worker {worker_id} is not taking part in gradient rounds")

    async def aclose(self) -> None:
        """:meth:`Learner.stop_gradients`: leave gradient mode (nothing if not in it)."""
        lease = self._lease
        if not self.active or lease is None:
            return
        try:
            await lease.release()
        finally:
            self.active = False
            self._lease = self._pumps = None
            self._round = self._collect = None

    async def _stop_workers(self) -> None:
        """The lease's wind-down: every worker stops and confirms; late reports are dropped."""
        pool = self._pool
        if self._pumps is not None:
            await self._pumps.stop()
        self._behind.clear()
        try:
            async with asyncio.timeout(pool.config.timeouts.step):
                for slot in self._remotes:
                    await slot.session.send(StopGradients())
                    while slot.session.state is State.STOPPING:
                        await slot.session.receive(timeout=None, operation="gradients to stop")
        except (TimeoutError, ApsError) as exc:
            assert self._lease is not None
            self._lease.fail(InvalidState(f"gradient mode did not end cleanly ({exc!r})"))
