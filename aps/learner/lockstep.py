"""Lockstep stepping: the learner chooses every action, and envs step as one batch.

:class:`Lockstep` implements :meth:`Learner.reset`, :meth:`Learner.step`, the env calls by
name (:meth:`Learner.call`, ``get_attr``, ``set_attr``, ``render``) and the partial
batches of :meth:`Learner.send` / :meth:`Learner.recv` (EnvPool's asynchronous API) over the
pool's request/answer service: one message per worker per step, stitched with array
operations. A worker replaced during a step ends its envs' episodes there (``truncated``,
``info["worker_restarted"]``).
"""

from __future__ import annotations

import asyncio
import bisect
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
from gymnasium.vector import AutoresetMode

from aps._base._typing import Array, Info
from aps.errors import ConfigError, InvalidState, ProtocolError, Timeout, WireError, WorkerLost
from aps.learner.lease import Lease, Mode
from aps.learner.pool import FRESH_RESET, Slot, WorkerPool, expect
from aps.learner.requests import worker_error
from aps.wire import codec
from aps.wire.batching import (
    action_layout,
    batch_layout,
    check_batch,
    check_info,
    check_part,
    concat,
    merge_infos,
    misfit,
    split,
)
from aps.wire.messages import (
    EnvCall,
    EnvCallResult,
    ErrorReport,
    Message,
    Request,
    ResetRequest,
    ResetResult,
    StepRequest,
    StepResult,
)

__all__ = ["Lockstep", "StepReturn"]

StepReturn = tuple[Any, Array, Array, Array, Info]
"""``(observations, rewards, terminations, truncations, infos)``, batched over all envs."""


@functools.lru_cache(maxsize=1024)
def _row_ids(env_offset: int, num_envs: int, worker_id: int) -> tuple[Array, Array]:
    """A worker's rows in :meth:`Lockstep.recv`: global env ids, and its id on each row."""
    rows = np.arange(env_offset, env_offset + num_envs), np.full(num_envs, worker_id, np.int64)
    for array in rows:
        array.flags.writeable = False  # shared by every recv(), which hands out copies
    return rows


class Lockstep:
    """Reset and step every worker's envs as one batch; see the :class:`Learner` methods."""

    def __init__(self, pool: WorkerPool) -> None:
        self._pool = pool
        self._partial: dict[Slot, asyncio.Task[Message]] = {}  # send() -> recv()
        self._lease: Lease | None = None  # held from the first send() to the last recv()
        self._answered: asyncio.Future[None] | None = None  # recv() waits; an answer wakes it
        # Slots whose next step is the NextStep reset step after a replacement's first reset
        # (see _restarted_step); whichever mode resets their envs next ends that.
        self._reset_next: set[Slot] = set()
        pool.recovery.on_reset(self._reset_next.discard)
        # Worked out once from the spaces, which never change once known (see _validate and
        # _step_requests): the batch layout of each worker size's observations, and the
        # action batches check_batch accepts as they are.
        self._obs_layouts: dict[int, tuple[tuple[int, ...], np.dtype[Any]] | None] = {}
        self._action_layouts: dict[int, tuple[tuple[int, ...], str] | None] = {}

    # What a new connection needs (SlotHooks): nothing. A step it owes is redone by the
    # exchange (see _redo), a partial step by its own task, and a replacement's envs are
    # reset first wherever the pool's recovery says so.

    def replaced(self, slot: Slot, void: Sequence[Request]) -> None:
        """Nothing to forget: the lockstep keeps no state of the lost worker's."""

    async def rejoined(self, slot: Slot) -> None:
        """Nothing to send first: the unanswered requests are sent again by the pool."""

    async def reset(
        self, *, seed: int | Sequence[int | None] | None, options: dict[str, Any] | None
    ) -> tuple[Any, Info]:
        """:meth:`Learner.reset`, once the workers are admitted."""
        pool = self._pool
        slots = pool.slots
        requests: list[Request]
        # A reset_mask (checked by the caller) is cut into each worker's part.
        mask = None if options is None else options.get("reset_mask")
        parts = [
            options
            if options is None or mask is None
            else {**options, "reset_mask": mask[offset : offset + count]}
            for offset, count in zip(slots.offsets, slots.counts, strict=True)
        ]
        if seed is None or isinstance(seed, int):
            requests = [
                ResetRequest(seed=None if seed is None else seed + offset, options=part)
                for offset, part in zip(slots.offsets, parts, strict=True)
            ]
        else:
            requests = [
                ResetRequest(seed=None, seeds=tuple(seed[offset : offset + count]), options=part)
                for offset, count, part in zip(slots.offsets, slots.counts, parts, strict=True)
            ]
        answers = await pool.exchange(
            requests,
            "reset",
            redo=self._redo,
            validate=self._validate,
            running=self._running(),
            within=pool.config.timeouts.step,
        )
        results = [expect(a, ResetResult) for a in answers]
        observation_space, _ = slots.require_workers()
        obs = concat(observation_space, [r.obs for r in results], slots.counts)
        info = merge_infos(
            list(zip(slots.offsets, (r.info for r in results), strict=True)), sum(slots.counts)
        )
        pool.recovery.note_reset_all()
        return obs, info

    async def step(self, actions: Any) -> StepReturn:
        """:meth:`Learner.step`."""
        pool = self._pool
        if not pool.recovery.was_reset:
            raise InvalidState("call reset() before step()")
        requests = self._step_requests(pool.slots.admitted, actions, pool.slots.counts)
        async with pool.lease(Mode.EXCHANGE, "step", running=self._running()):
            answers = await pool.requests.exchange(
                requests,
                "step",
                self._redo,
                validate=self._validate,
                within=pool.config.timeouts.step,
            )
            # Stitched under the lease: answers that do not stitch break the workers.
            return self._stitch(pool.slots.admitted, answers)

    async def env_call(
        self,
        kind: str,
        name: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        values: Sequence[Any] | None = None,
        indices: Sequence[int] | None = None,
    ) -> tuple[Any, ...]:
        """One :class:`~aps.wire.messages.EnvCall` per worker; one value per env reached.

        ``indices`` (global env indices, checked by the caller; ``None``: every env) says
        which envs, in the order of the values returned; ``values`` (for ``set_attr``) holds
        one value per env reached, in that order.

        Raises:
            ConfigError: an argument is not plain data (nothing was sent).
            WorkerError: an env raised, or returned a value that is not plain data.
        """
        pool = self._pool
        # Taken before the arguments are encoded: a learner that cannot call says so first.
        lease = await pool.lease(Mode.EXCHANGE, kind, running=self._running()).take()
        try:
            requests, places = self._call_requests(kind, name, args, kwargs, values, indices)
        except BaseException:
            await lease.release()  # nothing was sent: the workers are in step
            raise
        answers = await pool.exchange(
            requests, kind, redo=self._redo_call, within=pool.config.timeouts.step, lease=lease
        )
        result: list[Any] = [None] * sum(len(where) for where in places)
        for slot, answer, where in zip(pool.slots.admitted, answers, places, strict=True):
            got = expect(answer, EnvCallResult).values
            if len(got) != len(where):
                raise ProtocolError(
                    f"worker {slot.info.worker_id} answered {kind}({name!r}) with {len(got)} "
                    f"values for {len(where)} envs; the worker is not a compatible aps worker"
                )
            for place, value in zip(where, got, strict=True):
                result[place] = value
        return tuple(result)

    def _call_requests(
        self,
        kind: str,
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None,
        values: Sequence[Any] | None,
        indices: Sequence[int] | None,
    ) -> tuple[list[Request], list[list[int]]]:
        """One :class:`~aps.wire.messages.EnvCall` per worker, checked to travel; their places.

        Raises:
            ConfigError: an argument is not plain data.
        """
        pool = self._pool
        chosen = range(sum(pool.slots.counts)) if indices is None else indices
        # Each worker's own env indices, and where in the result each of its values goes.
        local: list[list[int]] = [[] for _ in pool.slots.admitted]
        places: list[list[int]] = [[] for _ in pool.slots.admitted]
        for place, index in enumerate(chosen):
            worker = bisect.bisect_right(pool.slots.offsets, index) - 1
            local[worker].append(index - pool.slots.offsets[worker])
            places[worker].append(place)
        requests: list[Request] = []
        for own, where in zip(local, places, strict=True):
            part = args if values is None else (tuple(values[p] for p in where),)
            reach = None if indices is None else tuple(own)
            requests.append(EnvCall(kind=kind, name=name, args=part, kwargs=kwargs, indices=reach))
        for request in requests:
            try:
                codec.encode(request)  # checked before anything is sent: the batch stays whole
            except WireError as exc:
                raise ConfigError(
                    f"the arguments of {kind}({name!r}) cannot travel to the workers: {exc}; "
                    "pass plain data (numbers, strings, numpy arrays, tuples, dicts with str keys)"
                ) from None
        return requests, places

    async def _redo_call(self, slot: Slot, request: Request, operation: str) -> Message:
        """An env call sent to a worker that was replaced goes to its replacement as it was."""
        pool = self._pool
        return await pool.requests.call_until_answered(
            slot, request, operation, within=pool.config.timeouts.step
        )

    def _running(self) -> str:
        """What keeps the pool busy, for the error of a lease refused."""
        if self._partial:
            return "sent steps are not all received; recv() first"
        return "another operation is running"

    async def _redo(self, slot: Slot, request: Request, operation: str) -> Message:
        """The answer to ``request`` from a replacement of the worker it was sent to.

        A reset is sent again as it was; for a step, the replacement's envs are reset and
        that reset is the answer (see :meth:`_restarted_step`).
        """
        pool = self._pool
        if isinstance(request, ResetRequest):
            return await pool.requests.call_until_answered(
                slot, request, operation, self._validate, within=pool.config.timeouts.step
            )
        return await pool.requests.reset_replacement(slot, operation, self._validate)

    def _validate(self, slot: Slot, answer: Message) -> None:
        """Refuse a reset or step answer that is not a batch of exactly ``slot``'s envs.

        Its info too (:func:`~aps.wire.batching.check_info`): a malformed one, or one that
        reaches other workers' envs, is that worker's fault, like a malformed obs, and
        not the learner's end when the infos are merged.

        Raises:
            ProtocolError: naming the worker, the field, and what was expected and received.
        """
        count = slot.info.num_envs
        if type(answer) is StepResult:
            shape = (count,)
            bad = misfit(
                (
                    ("reward", answer.reward, shape, "fiu"),
                    ("terminated", answer.terminated, shape, "b"),
                    ("truncated", answer.truncated, shape, "b"),
                )
            )
            if bad is not None:
                raise ProtocolError(
                    f"worker {slot.info.worker_id} sent a step whose {bad}; the worker is "
                    "not a compatible aps worker"
                )
            what = "step"
        elif type(answer) is ResetResult:
            what = "reset"
        else:
            return
        info = answer.info
        if type(info) is not dict or info:  # most steps carry no info: nothing to check
            try:
                check_info(info, count)
            except ProtocolError as exc:
                raise ProtocolError(
                    f"worker {slot.info.worker_id} sent a {what} whose {exc}; the worker is "
                    "not a compatible aps worker"
                ) from None
        obs = answer.obs
        # An array space's batch, tested here; the others (and the error) are check_part's.
        try:
            layout = self._obs_layouts[count]
        except KeyError:
            observation_space, _ = self._pool.slots.require_workers()
            layout = self._obs_layouts[count] = batch_layout(observation_space, count)
        if (
            layout is not None
            and type(obs) is np.ndarray
            and obs.shape == layout[0]
            and obs.dtype == layout[1]
        ):
            return
        observation_space, _ = self._pool.slots.require_workers()
        try:
            check_part(observation_space, obs, count, "obs")
        except ProtocolError as exc:
            raise ProtocolError(
                f"worker {slot.info.worker_id} sent a {what} whose {exc}; all workers must "
                "run envs with the same spaces"
            ) from None

    def _step_requests(
        self, admitted: Sequence[Slot], actions: Any, counts: Sequence[int]
    ) -> list[Request]:
        pool = self._pool
        total = sum(counts)
        try:
            layout = self._action_layouts[total]
        except KeyError:
            _, space = pool.slots.require_workers()
            layout = self._action_layouts[total] = action_layout(space, total)
        parts: list[Any]
        if (
            layout is not None
            and type(actions) is np.ndarray
            and actions.shape == layout[0]
            and actions.dtype.kind in layout[1]
        ):
            # check_batch's test for an array space (it returns such an array as it is),
            # and split's cut of it into C-contiguous views.
            batch = actions if actions.flags.c_contiguous else np.ascontiguousarray(actions)
            parts = []
            start = 0
            for count in counts:
                parts.append(batch[start : start + count])
                start += count
        else:
            _, space = pool.slots.require_workers()
            parts = split(space, check_batch(space, actions, total), counts)
        # A replacement's envs are reset instead of stepped (see _restarted_step). Each step
        # request is built with the numbers its outbox will give it, so numbering it
        # (Outbox.number) does not build it a second time.
        reset_next = self._reset_next
        return [
            FRESH_RESET
            if slot in reset_next or pool.recovery.needs_reset(slot)
            else StepRequest(actions=part, seq=slot.outbox.sent, acked=slot.outbox.received)
            for slot, part in zip(admitted, parts, strict=True)
        ]

    def _stitch(self, admitted: Sequence[Slot], answers: Sequence[Message]) -> StepReturn:
        """Stitch the step answers of ``admitted`` (in env order) into one batch.

        Raises:
            ProtocolError: an answer is not a step of exactly its worker's envs (under a
                lease, which then breaks the workers).
        """
        obs: list[Any] = []
        reward: list[Array] = []
        terminated: list[Array] = []
        truncated: list[Array] = []
        infos: list[tuple[int, Info]] = []
        counts: list[int] = []
        offset = 0
        for slot, answer in zip(admitted, answers, strict=True):
            if type(answer) is not StepResult:
                answer = (
                    self._restarted_step(slot, answer)
                    if isinstance(answer, ResetResult)
                    else expect(answer, StepResult)
                )
            count = slot.info.num_envs  # the arrays fit: see _check
            obs.append(answer.obs)
            reward.append(answer.reward)
            terminated.append(answer.terminated)
            truncated.append(answer.truncated)
            infos.append((offset, answer.info))
            counts.append(count)
            offset += count
        # Concatenating copies even a single worker's batch: users get writable arrays. Each
        # part passed _check, so an array space's parts are joined without checking again.
        if self._obs_layouts.get(counts[0]) is not None:
            joined = np.concatenate(obs)
        else:
            observation_space, _ = self._pool.slots.require_workers()
            joined = concat(observation_space, obs, counts)
        return (
            joined,
            np.concatenate(reward),
            np.concatenate(terminated),
            np.concatenate(truncated),
            merge_infos(infos, offset),
        )

    def _restarted_step(self, slot: Slot, reset: ResetResult) -> StepResult:
        """Turn the reset of a replacement worker's envs into their step result.

        The first one ends the lost worker's episodes (truncated, flagged); under ``NextStep``
        a second reset on the next step plays the part of the autoreset step.
        """
        n = slot.info.num_envs
        pool = self._pool
        restarted = pool.recovery.needs_reset(slot)
        pool.recovery.note_reset(slot)  # ends a pending reset step too
        if restarted and pool.config.autoreset_mode is AutoresetMode.NEXT_STEP:
            self._reset_next.add(slot)
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

    # Partial batches (EnvPool's asynchronous API): send to some workers, take who is ready.

    async def send(self, actions: Any, worker_ids: Sequence[int] | None) -> None:
        """:meth:`Learner.send`."""
        pool = self._pool
        if not pool.recovery.was_reset:
            raise InvalidState("call reset() before send()")
        lease = self._lease
        if lease is None:
            # Held until every step sent is received (recv) or cancelled (aclose).
            lease = await pool.lease(Mode.PARTIAL, "send", drained=True).take()
            lease.on_release(self._cancel_steps)
        try:
            admitted = self._select(worker_ids)
            requests = self._step_requests(admitted, actions, [r.info.num_envs for r in admitted])
        except BaseException:
            if lease is not self._lease:
                await lease.release()  # nothing was sent: the workers are free again
            raise
        self._lease = lease
        for slot, request in zip(admitted, requests, strict=True):
            # Registered first: a send that fails below is still answered (or raised) in recv.
            task = asyncio.create_task(
                self._partial_answer(slot, request), name=f"aps step {slot.info.worker_id}"
            )
            task.add_done_callback(self._wake_recv)
            self._partial[slot] = task
            try:
                await pool.requests.send_request(slot, request)
            except WorkerLost as exc:
                await self._release(exc)
                raise

    def _select(self, worker_ids: Sequence[int] | None) -> list[Slot]:
        by_id = {r.info.worker_id: r for r in self._pool.slots.admitted}
        ids = list(by_id) if worker_ids is None else list(worker_ids)
        if len(set(ids)) != len(ids) or not ids:
            raise ConfigError(f"worker_ids must be distinct and not empty, got {worker_ids!r}")
        for worker_id in ids:
            slot = by_id.get(worker_id)
            if slot is None:
                raise ConfigError(
                    f"no worker {worker_id!r}; the workers are {sorted(by_id)} (see .workers)"
                )
            if slot in self._partial:
                raise InvalidState(
                    f"worker {worker_id} still has a step sent and not received; recv() first"
                )
        return [by_id[i] for i in ids]

    def _wake_recv(self, task: asyncio.Task[Message]) -> None:
        waiter = self._answered
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _partial_answer(self, slot: Slot, request: Request) -> Message:
        pool = self._pool
        answer = await pool.requests.answer_from(
            slot, "step", self._validate, within=pool.config.timeouts.step
        )
        if answer is None:
            answer = await self._redo(slot, request, "step")
        return answer

    async def recv(self, min_workers: int) -> StepReturn:
        """:meth:`Learner.recv`."""
        pool = self._pool
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
                    f"{pool.broken or 'the learner closed'}"
                )
            # One future, woken by each answer, instead of asyncio.wait's callbacks on every
            # pending task per call: recv() runs once per answer with min_workers=1.
            self._answered = waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._answered = None
        ready = [r for r in pool.slots.admitted if r in waiting and waiting[r].done()]
        answers: list[Message] = []
        failure: BaseException | None = None
        for slot in ready:
            task = waiting.pop(slot)
            error = task.exception() if not task.cancelled() else InvalidState("cancelled")
            if error is not None:
                failure = failure or error
            elif isinstance(answer := task.result(), ErrorReport):
                failure = failure or worker_error(slot, answer)
            else:
                answers.append(answer)
        result: StepReturn | None = None
        if failure is None:
            try:
                result = self._stitch(ready, answers)
            except ProtocolError as exc:
                failure = exc
        if isinstance(failure, WorkerLost | Timeout | ProtocolError):
            await self._release(failure)  # broken: no step is awaited any more
        elif not waiting:
            await self._release()
        if failure is not None:
            raise failure
        assert result is not None
        rows = [_row_ids(r.info.env_offset, r.info.num_envs, r.info.worker_id) for r in ready]
        env_ids = np.concatenate([env for env, _ in rows])  # copies: the cache stays intact
        info = result[4]
        info["env_id"], info["_env_id"] = env_ids, np.ones(len(env_ids), dtype=np.bool_)
        info["worker_id"] = np.concatenate([worker for _, worker in rows])
        info["_worker_id"] = np.ones(len(env_ids), dtype=np.bool_)
        return result

    async def _release(self, failure: BaseException | None = None) -> None:
        """Release the partial lease, judging ``failure``; steps outstanding are cancelled."""
        lease, self._lease = self._lease, None
        if lease is not None:
            await lease.release(failure)

    async def _cancel_steps(self) -> None:
        """The partial lease's wind-down: cancel the steps sent and not received."""
        tasks = list(self._partial.values())
        self._partial.clear()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    async def aclose(self) -> None:
        """Cancel the steps sent and not received; the pool is free again."""
        await self._release()
