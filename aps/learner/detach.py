"""DETACH: workers act with their own policy copy; weights travel when the sync strategy says.

:class:`Detach` implements :meth:`Learner.publish`, :meth:`Learner.rollout` and
:meth:`Learner.chunks`. It keeps the published versions
(:class:`~aps.learner.rollouts.PolicyVersions`, encoded once however many workers they go
to), asks the sync strategy before each request whether a worker gets the newest one
(measuring the worker's divergence only when the strategy asks for it), and checks and
accounts for every chunk: its shapes, the version it was acted with, and the policy lag of
its transitions.

With ``overlap`` a version the strategy chose goes right *after* the request it was decided
for, not before: the worker acts that request with the version it holds while the new one
travels, and applies it between chunks, from its next request on (TCP keeps the order). Only a
worker that holds no version yet waits for one. So the learner always knows which version a
request is acted with (the one sent before it), chunks stay stamped with exactly one version,
and APS measures the divergence of the version the worker holds.

Per worker slot it keeps what the sync decision needs (steps and seconds since the last sync,
the states the worker acted on last); as the pool's :class:`~aps.learner.pool.SlotHooks`
it rehydrates a worker that resumed without the newest weights, and asks a replacement for the
chunks its predecessor owed a stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from types import AsyncGeneratorType
from typing import Any, NamedTuple

import numpy as np

from aps._base._typing import ArrayTree
from aps.errors import ApsError, ConfigError, InvalidState, ProtocolError, WorkerLost
from aps.learner.fanout import WeightGroup
from aps.learner.lease import Lease, Mode
from aps.learner.pool import Slot, WorkerPool, expect
from aps.learner.pump import Item, Pumps
from aps.learner.requests import worker_error
from aps.learner.rollouts import (
    STALL_LAG,
    Chunk,
    PolicyVersions,
    Rollout,
    WeightPrecision,
    sample_sequences,
    sample_states,
)
from aps.session.protocol import MAX_IN_FLIGHT
from aps.sync import SyncContext, SyncStrategy
from aps.wire.batching import batch_layout, check_part, misfit
from aps.wire.messages import (
    ErrorReport,
    Message,
    Request,
    RolloutChunk,
    RolloutRequest,
    Weights,
)

__all__ = ["Detach"]

log = logging.getLogger(__name__)

MAX_STATE_ARRAYS = 16
"""The most arrays a recurrent chunk's initial state may hold (an LSTM's is two)."""

MAX_STATE_MAGNITUDE = 1e6
"""The largest magnitude a recurrent state's value may have. An LSTM's ``h`` is within 1 and
its ``c`` grows by at most 1 a step, so this is an episode of a million steps; larger or
non-finite values are a broken worker, refused before they reach a replay or a training
step."""


class _Layout(NamedTuple):
    """What the arrays of a chunk of ``T`` steps of ``E`` envs must be (see ``Detach._fits``)."""

    expected: tuple[int, int]  # (T, E): the per-step arrays
    obs: tuple[int, ...]  # (T, E, *observation shape)
    next_obs: tuple[int, ...]  # (E, *observation shape)
    dtype: Any  # the observation space's (None: any)
    obs_shape: tuple[int, ...]
    structured: bool  # a Dict or Tuple space: its arrays are checked one by one


@dataclass(slots=True)
class _SlotSync:
    """What the sync strategy and the chunk checks know of the worker serving one slot."""

    steps_since_sync: int = 0
    synced_at: float = 0.0
    last_chunk_version: int = 0
    acted_on: ArrayTree | None = None  # the observations of its latest chunk
    # A recurrent policy's chunk: its initial state and episode starts, to replay acted_on.
    acted_recurrent: tuple[tuple[np.ndarray[Any, Any], ...], np.ndarray[Any, Any]] | None = None
    preparing: bool = False  # its reset is outstanding: chunk requests wait (counted in lost)
    lost: int = 0  # chunks its predecessor owed the stream, to ask of it
    declined_all: bool = True  # every decision since its last sync measured and declined


class Detach:
    """Versions, sync decisions, rollouts and chunk streams; see the :class:`Learner` methods.

    Args:
        pool: the workers.
        policy: the policy import path the workers act with (``None``: no DETACH).
        sync: the sync strategy.
        precision: how weights travel (see :class:`~aps.learner.rollouts.PolicyVersions`).
        overlap: send a chosen version after the request it was decided for, so the worker
            keeps acting while it travels (see the module's docstring).
    """

    def __init__(
        self,
        pool: WorkerPool,
        policy: str | None,
        sync: SyncStrategy,
        precision: WeightPrecision = "exact",
        overlap: bool = False,
    ) -> None:
        self._pool = pool
        self.overlap = overlap
        self._late: set[Slot] = set()  # rollout(): workers whose version follows the request
        self._policy = policy
        self.sync = sync
        self._precision: WeightPrecision = precision
        self.versions: PolicyVersions | None = None
        self._slots: dict[Slot, _SlotSync] = {}
        self._stream: AsyncGenerator[Chunk, None] | None = None
        self._previous_stream: AsyncGenerator[Chunk, None] | None = None
        self._warned_stall = False
        self._keep_previous = False
        self._pumps: Pumps | None = None  # the open stream's, while chunks() runs
        # Per (T, E): what a chunk's arrays must be (see _fits), worked out once.
        self._layouts: dict[tuple[int, int], _Layout] = {}
        self.chunk_wait = 0.0
        """Seconds chunk streams waited for their next chunk, in all (the learner's figures)."""
        self.group: WeightGroup | None = None
        """The weight group versions fan out through, while it lasts (see :meth:`form_group`)."""

    def _books(self, slot: Slot) -> _SlotSync:
        books = self._slots.get(slot)
        if books is None:
            books = self._slots[slot] = _SlotSync()
        return books

    def require_policy(self, operation: str) -> PolicyVersions:
        """The versions, created on first use.

        Raises:
            InvalidState: the learner has no policy.
        """
        if self._policy is None:
            raise InvalidState(
                f"{operation}() needs workers that act: create the learner with "
                "policy='package.module:make_agent' (or 'path/to/script.py:Agent')"
            )
        if self.versions is None:
            spaces = self._pool.slots.require_workers()
            self.versions = PolicyVersions(*spaces, precision=self._precision)
        return self.versions

    @property
    def version(self) -> int:
        """The newest published version (0 before the first publish)."""
        return 0 if self.versions is None else self.versions.current

    @property
    def queue_depth(self) -> int:
        """Chunks the open stream received and the training loop has not taken (0: none open)."""
        return 0 if self._pumps is None else self._pumps.depth

    # What a new connection needs (SlotHooks).

    def replaced(self, slot: Slot, void: Sequence[Request]) -> None:
        """Forget the lost worker; its replacement owes the stream the chunks it owed."""
        books = self._books(slot)
        books.lost += sum(isinstance(r, RolloutRequest) for r in void)
        books.steps_since_sync = books.last_chunk_version = 0
        books.acted_on = None
        books.acted_recurrent = None
        books.declined_all = True

    async def rejoined(self, slot: Slot) -> None:
        """Send a resumed worker the newest version if it no longer holds it.

        Also when it holds none: its first version may have been lost with the connection
        that carried it, and the rollout requests replayed next need one.
        """
        versions = self.versions
        held = slot.metrics.version
        if versions is not None and versions.current and held != versions.current:
            await self._send_weights(slot)

    # Versions and their synchronization.

    async def publish(self, agent: Any, *, epsilon: float | None) -> int:
        """:meth:`Learner.publish`, once the workers are admitted."""
        pool = self._pool
        versions = self.require_policy("publish")
        version = versions.publish(agent, epsilon=epsilon)
        await self._fan_out(version)
        for slot in pool.slots.admitted:
            if slot.metrics.version < 0 and slot.info.worker_id not in pool.slots.dropped:
                try:
                    await self._send_weights(slot)
                except WorkerLost as exc:
                    # Outside any lease: publishing does not hold the workers (a chunk stream
                    # publishes from inside its loop), yet a worker without its first version
                    # can act no more.
                    pool.break_for_good(exc)
                    raise
        self._prune()
        return version

    async def form_group(self, timeout: float) -> WeightGroup:
        """:meth:`Learner.form_weight_group`."""
        self.require_policy("form_weight_group")
        self.end_group("a new group forms")
        self.group = await WeightGroup.form(self._pool, timeout)
        return self.group

    def end_group(self, why: str) -> None:
        """Close the weight group, if any: versions travel over the sessions from now on."""
        group, self.group = self.group, None
        if group is not None:
            group.close()
            log.warning("the weight group ended (%s): versions travel over the sessions", why)

    async def _fan_out(self, version: int) -> None:
        """Send ``version`` through the weight group, or end a group that cannot carry it."""
        group, versions = self.group, self.versions
        if group is None or versions is None:
            return
        broken = group.intact()
        if broken is None:
            try:
                await group.send(self._pool, version, versions.frame(version))
                return
            except (ApsError, RuntimeError) as exc:
                broken = f"version {version}'s collective failed: {exc}"
        self.end_group(broken)

    async def _maybe_sync(self, slot: Slot, *, overlap: bool = False) -> bool:
        """Ask the strategy whether ``slot`` gets the newest version, and send it if so.

        With ``overlap`` a chosen version is not sent: the caller sends it (``True``) right
        after the request it was decided for. A worker that holds no version gets one now.
        ``slot.metrics.version`` (``held``) is the version the worker acts the next request
        with, since every version sent to it so far precedes that request on the wire: the
        divergence is measured against it.
        """
        versions = self.versions
        if versions is None or versions.current == 0:
            raise InvalidState("publish(agent) before the first rollout")
        held = slot.metrics.version
        if held == versions.current:
            return False
        if held < 0:
            await self._send_weights(slot)
            return False
        books = self._books(slot)

        def measure(version: int) -> float:
            acted_on, recurrent = books.acted_on, books.acted_recurrent
            # No chunk yet: nothing to measure on, so treat the worker as far away.
            if acted_on is None:
                return math.inf
            if recurrent is not None:
                # The action distribution depends on the state: replay the chunk's steps
                # through both versions from the state the worker started it with.
                acted: Any = acted_on  # an array: recurrent policies take array observations
                obs, starts, state = sample_sequences(
                    acted, recurrent[1], recurrent[0], versions.states_for(acted)
                )
                return versions.divergence(version, obs, state=state, episode_start=starts)
            return versions.divergence(
                version, sample_states(acted_on, versions.states_for(acted_on))
            )

        def divergence() -> float:
            # Measured once per decision: the context keeps the value (SyncContext.divergence
            # calls this at most once), the metrics record it.
            value = measure(held)
            slot.metrics.divergences.append(value)
            return value

        def update_drift() -> float:
            # From the first ask on, the previous version outlives pruning (see _prune).
            self._keep_previous = True
            previous = versions.current - 1
            return measure(previous) if versions.has(previous) else math.nan

        context = SyncContext(
            worker_id=slot.info.worker_id,
            worker_version=held,
            learner_version=versions.current,
            steps_since_sync=books.steps_since_sync,
            seconds_since_sync=time.monotonic() - books.synced_at,
            measure_divergence=divergence,
            measure_update_drift=update_drift,
        )
        if self.sync.should_sync(context):
            if overlap:
                return True
            await self._send_weights(slot)
            self._prune()
            return False
        books.declined_all &= context.divergence_measured
        lag = versions.current - held
        if books.declined_all and lag >= STALL_LAG and not slot.metrics.stalled:
            self._stalled(slot, held, versions.current, context.divergence())
        return False

    def _stalled(self, slot: Slot, held: int, current: int, divergence: float) -> None:
        metrics = slot.metrics
        metrics.stalled = True
        metrics.stalls += 1
        if not self._warned_stall:
            self._warned_stall = True  # once per learner: the metrics count every stall
            log.warning(
                "worker %d still acts with version %d while the learner is at %d: every sync "
                "decision since its last weights measured its divergence (last %.3g) and "
                "declined. A threshold above what an update can move a stale policy by (PPO "
                "clips against it) is never crossed, and learning stalls; bound staleness "
                "with APS(kl_threshold, max_lag=16) or lower the threshold (metrics.stalled "
                "lists stalled workers)",
                *(slot.info.worker_id, held, current, divergence),
            )

    async def _send_weights(self, slot: Slot) -> None:
        versions = self.versions
        assert versions is not None
        version = versions.current
        group = self.group
        if group is not None and group.carried(version) and group.member(slot):
            # The arrays came by the group: the session says only which version to act with.
            await self._pool.requests.send(
                slot, Weights(version=version, arrays=None, epsilon=None)
            )
        else:
            message = Weights(
                version=version, arrays=versions.weights(version), epsilon=versions.epsilon
            )
            # Encoded once, when published, however many workers it goes to.
            frame = versions.frame(version, slot.session.compression)
            await self._pool.requests.send(slot, message, frame)
        metrics = slot.metrics
        metrics.version = version
        metrics.syncs += 1
        metrics.weight_bytes += versions.nbytes(version)
        metrics.stalled = False
        books = self._books(slot)
        books.steps_since_sync = 0
        books.synced_at = time.monotonic()
        books.declined_all = True

    def _prune(self) -> None:
        if self.versions is not None:
            held = {r.metrics.version for r in self._pool.slots.admitted}
            if self._keep_previous:  # a strategy measures one update's drift against it
                held.add(self.versions.current - 1)
            self.versions.prune(held)

    # Chunks.

    def _validate(self, slot: Slot, message: Message) -> None:
        """Refuse a chunk that does not fit what this learner sent ``slot``.

        Raises:
            ProtocolError: naming the worker, the field, and what was expected and received.
        """
        if type(message) is RolloutChunk:
            self._check_chunk(slot, message)

    def _check_chunk(self, slot: Slot, message: RolloutChunk) -> None:
        info = slot.info
        steps = message.reward.shape[0] if message.reward.ndim == 2 else -1
        layout = self._fits(message, steps, info.num_envs) if steps >= 1 else None
        if layout is not None:
            # The arrays' shapes and dtypes are right: what is left looks at their values.
            self._check_values(slot, message, steps, layout[4], structured=False)
            return
        if steps < 1:
            raise ProtocolError(
                f"worker {info.worker_id} sent a chunk whose reward has shape "
                f"{message.reward.shape}, expected (T, {info.num_envs}) with T >= 1; the "
                "worker is not a compatible aps worker"
            )
        expected = (steps, info.num_envs)
        observation_space, _ = self._pool.slots.require_workers()
        obs_shape = observation_space.shape or ()
        # A Dict or Tuple space (nested): its observations are checked below, array by array.
        structured = batch_layout(observation_space, 1) is None
        # One value per episode that ended: 1-d arrays of one length (-1 matches no shape).
        ended = message.episode_return
        episodes = (ended.shape[0] if ended.ndim == 1 else -1,)
        arrays: list[tuple[str, Any, tuple[int, ...], str | None]] = [
            (name, getattr(message, name), expected, None)
            for name in ("reward", "terminated", "truncated", "logprob")
        ]
        if not structured:
            arrays += [
                ("obs", message.obs, expected + obs_shape, None),
                ("next_obs", message.next_obs, (info.num_envs, *obs_shape), None),
            ]
        arrays += [
            ("episode_return", message.episode_return, episodes, None),
            ("episode_length", message.episode_length, episodes, None),
            ("episode_env", message.episode_env, episodes, None),
        ]
        if message.value is not None:
            arrays.append(("value", message.value, expected, None))
        bad = misfit(arrays)
        if bad is None and message.actions.shape[:2] != expected:
            bad = f"actions is an array of shape {message.actions.shape}, expected {expected} + ..."
        if bad is not None:
            raise ProtocolError(
                f"worker {info.worker_id} sent a chunk whose {bad}, for {steps} steps of its "
                f"{info.num_envs} envs; the worker is not a compatible aps worker"
            )
        dtype = observation_space.dtype
        for name in () if structured else ("obs", "next_obs"):
            got = getattr(message, name).dtype
            if dtype is not None and got != dtype:
                raise ProtocolError(
                    f"worker {info.worker_id} sent a chunk whose {name} has dtype {got}, "
                    f"expected {dtype} (the observation space's); all workers must run envs "
                    "with the same spaces"
                )
        self._check_values(slot, message, steps, obs_shape, structured=structured)

    def _check_values(
        self,
        slot: Slot,
        message: RolloutChunk,
        steps: int,
        obs_shape: tuple[int, ...],
        *,
        structured: bool,
    ) -> None:
        """The checks of :meth:`_check_chunk` once the chunk's ``(T, E)`` arrays fit."""
        info = slot.info
        episode_env = message.episode_env
        if len(episode_env) and (episode_env.min() < 0 or episode_env.max() >= info.num_envs):
            raise ProtocolError(
                f"worker {info.worker_id} sent episodes of envs outside its "
                f"{info.num_envs}; the worker is not a compatible aps worker"
            )
        cuts = int(np.count_nonzero(message.truncated))
        if structured:
            self._check_structured(slot, message, (steps, info.num_envs), cuts)
        last_obs = (cuts, *obs_shape)
        truncated_obs: Any = message.truncated_obs  # structured: checked above
        obs: Any = message.obs  # an array unless structured (checked above)
        if not structured and not (
            type(truncated_obs) is np.ndarray and truncated_obs.dtype == obs.dtype
        ):
            # The codec lets a dict or tuple of arrays through (the field's type allows a
            # structured space's); an array space's chunk carries one array like its obs.
            got = (
                f"an array of dtype {truncated_obs.dtype}"
                if type(truncated_obs) is np.ndarray
                else type(truncated_obs).__name__
            )
            raise ProtocolError(
                f"worker {info.worker_id} sent truncated observations as {got}, expected an "
                f"array of dtype {obs.dtype} like its observations; the worker is not "
                "a compatible aps worker"
            )
        if message.truncated_index.shape != (cuts, 2) or (
            not structured and truncated_obs.shape != last_obs
        ):
            raise ProtocolError(
                f"worker {info.worker_id} sent truncated observations of shape "
                f"{getattr(truncated_obs, 'shape', '(structured)')} at indices of shape "
                f"{message.truncated_index.shape} for {cuts} truncated steps, expected "
                f"{last_obs} and {(cuts, 2)}; the worker is not a compatible aps worker"
            )
        # With no truncated step, the shapes above already say the indices are right.
        if cuts and not np.array_equal(message.truncated_index, np.argwhere(message.truncated)):
            raise ProtocolError(
                f"worker {info.worker_id} sent truncated observations at (step, env) indices "
                "that are not its truncated steps; the worker is not a compatible aps worker"
            )
        self._check_recurrent(slot, message, steps)
        active = message.agent_active
        if active is not None and not (
            type(active) is np.ndarray
            and active.dtype == np.bool_
            and active.shape == (steps, info.num_envs)
        ):
            raise ProtocolError(
                f"worker {info.worker_id} sent a chunk whose agent_active is "
                f"{_described(active)}, expected a bool array of shape "
                f"{(steps, info.num_envs)}; the worker is not a compatible aps worker"
            )
        books = self._books(slot)
        if not books.last_chunk_version <= message.version <= slot.metrics.version:
            raise ProtocolError(
                f"worker {info.worker_id} sent a chunk acted with version {message.version}, "
                f"but it was sent versions up to {slot.metrics.version} and already used "
                f"{books.last_chunk_version}; refusing to attribute it"
            )

    def _fits(self, message: RolloutChunk, steps: int, envs: int) -> _Layout | None:
        """The layout of ``(T, E)`` chunks if ``message``'s arrays fit it, else ``None``.

        The same rule as :meth:`_check_chunk`'s checks of the arrays' types, shapes and the
        observations' dtype, tested against a layout worked out once per ``(T, E)``.
        ``None`` for anything else, structured observations included: the full checks then
        name what is wrong.
        """
        layout = self._layouts.get((steps, envs))
        if layout is None:
            observation_space, _ = self._pool.slots.require_workers()
            structured = batch_layout(observation_space, 1) is None
            obs_shape = observation_space.shape or ()
            layout = self._layouts[(steps, envs)] = _Layout(
                (steps, envs),
                (steps, envs, *obs_shape),
                (envs, *obs_shape),
                observation_space.dtype,
                obs_shape,
                structured,
            )
        if layout.structured:
            return None  # a Dict or Tuple space: checked array by array
        expected, dtype = layout.expected, layout.dtype
        ndarray = np.ndarray
        m = message
        obs, next_obs, ended, value = m.obs, m.next_obs, m.episode_return, m.value
        fits = (
            type(m.reward) is ndarray
            and m.reward.shape == expected
            and type(m.terminated) is ndarray
            and m.terminated.shape == expected
            and type(m.truncated) is ndarray
            and m.truncated.shape == expected
            and type(m.logprob) is ndarray
            and m.logprob.shape == expected
            and type(obs) is ndarray
            and obs.shape == layout.obs
            and type(next_obs) is ndarray
            and next_obs.shape == layout.next_obs
            and type(ended) is ndarray
            and ended.ndim == 1
            and type(m.episode_length) is ndarray
            and m.episode_length.shape == ended.shape
            and type(m.episode_env) is ndarray
            and m.episode_env.shape == ended.shape
            and (value is None or (type(value) is ndarray and value.shape == expected))
            and m.actions.shape[:2] == expected
            and (dtype is None or (obs.dtype == dtype and next_obs.dtype == dtype))
        )
        return layout if fits else None

    def _check_structured(
        self, slot: Slot, message: RolloutChunk, expected: tuple[int, int], cuts: int
    ) -> None:
        """AnswerCheck a chunk's observations of a ``Dict`` or ``Tuple`` space, array by array.

        The rule of lockstep's observations (:func:`~aps.wire.batching.check_part`), with the
        chunk's leading axes: ``(T, E)`` for ``obs``, ``(E,)`` for ``next_obs``, ``(K,)`` for
        ``truncated_obs``.
        """
        observation_space, _ = self._pool.slots.require_workers()
        info = slot.info
        try:
            check_part(observation_space, message.obs, expected, "obs")
            check_part(observation_space, message.next_obs, expected[1:], "next_obs")
            check_part(observation_space, message.truncated_obs, (cuts,), "truncated_obs")
        except ProtocolError as exc:
            raise ProtocolError(
                f"worker {info.worker_id} sent a chunk whose {exc}, for {expected[0]} steps "
                f"of its {info.num_envs} envs and {cuts} truncated steps; the worker is not a "
                "compatible aps worker"
            ) from None

    def _check_recurrent(self, slot: Slot, message: RolloutChunk, steps: int) -> None:
        """Refuse a recurrent state that does not fit the policy and the worker's envs.

        A feed-forward policy's chunk has neither ``initial_state`` nor ``episode_start``; a
        recurrent one's has both: ``episode_start`` bools ``[T, E]``, and 1 to
        :data:`MAX_STATE_ARRAYS` finite float arrays with ``E`` on axis 1, of at most
        :data:`MAX_STATE_MAGNITUDE`, shaped as the published policy's state for ``E`` envs.
        """
        info = slot.info
        envs = info.num_envs
        state, starts = message.initial_state, message.episode_start
        versions = self.versions
        expected = None if versions is None else versions.state_shapes(envs)
        problem: str | None = None
        if state is None and starts is None:
            if expected:
                problem = (
                    f"initial_state is missing, but the policy is recurrent (a state of "
                    f"shapes {expected} for {envs} envs)"
                )
        elif state is None or starts is None:
            problem = (
                f"initial_state is {_described(state)} and episode_start is "
                f"{_described(starts)}: a recurrent chunk has both, a feed-forward one neither"
            )
        elif expected == []:
            problem = "initial_state is set, but the policy is feed-forward (it has no state)"
        elif (
            type(starts) is not np.ndarray
            or starts.dtype != np.bool_
            or (starts.shape != (steps, envs))
        ):
            problem = (
                f"episode_start is {_described(starts)}, expected a bool array of shape "
                f"{(steps, envs)}"
            )
        elif type(state) not in (list, tuple) or not 1 <= len(state) <= MAX_STATE_ARRAYS:
            problem = (
                f"initial_state is {_described(state)}, expected a list of 1 to "
                f"{MAX_STATE_ARRAYS} float arrays"
            )
        else:
            problem = _state_problem(state, envs, expected)
        if problem is not None:
            raise ProtocolError(
                f"worker {info.worker_id} sent a chunk whose {problem}; the worker is not a "
                "compatible aps worker (workers and learner must run the same policy)"
            )

    def _accept_chunk(self, slot: Slot, message: RolloutChunk) -> Chunk:
        """Account for a chunk that passed :meth:`_validate`; the learner's view of it."""
        info = slot.info
        steps = message.reward.shape[0]
        books = self._books(slot)
        books.last_chunk_version = message.version
        versions = self.versions
        assert versions is not None
        lag = versions.current - message.version
        transitions = steps * info.num_envs
        metrics = slot.metrics
        metrics.chunks += 1
        metrics.transitions += transitions
        metrics.env_steps += transitions
        metrics.lag_sum += lag * transitions
        if lag > metrics.lag_max:
            metrics.lag_max = lag
        books.steps_since_sync += transitions
        books.acted_on = message.obs  # sampled only if a divergence is measured on it
        state, starts = message.initial_state, message.episode_start
        books.acted_recurrent = None if state is None or starts is None else (tuple(state), starts)
        return Chunk.of(message, worker_id=info.worker_id, env_offset=info.env_offset, lag=lag)

    async def rollout(self, num_steps: int) -> Rollout:
        """:meth:`Learner.rollout`, once the workers are admitted."""
        pool = self._pool
        self.require_policy("rollout")
        if not pool.recovery.was_reset:
            raise InvalidState("call reset() before rollout()")
        requests = [RolloutRequest(num_steps=num_steps)] * len(pool.slots.admitted)
        self._late.clear()
        answers = await pool.exchange(
            requests,
            "rollout",
            redo=self._redo,
            before=self._before,
            after=self._after,
            validate=self._validate,
            within=self._due(num_steps),
        )
        results = [expect(a, RolloutChunk) for a in answers]
        admitted = pool.slots.admitted
        chunks = [self._accept_chunk(r, m) for r, m in zip(admitted, results, strict=True)]
        return Rollout.from_chunks(chunks)

    async def _before(self, slot: Slot) -> None:
        await self._prepare(slot, "rollout")
        if await self._maybe_sync(slot, overlap=self.overlap):
            self._late.add(slot)

    async def _after(self, slot: Slot) -> None:
        """Send the version chosen for ``slot`` behind its request (``overlap``)."""
        if slot in self._late:
            self._late.discard(slot)
            await self._send_weights(slot)
            self._prune()

    async def _redo(self, slot: Slot, request: Request, operation: str) -> Message:
        """A rollout asked of a worker that was replaced: reset the new one's envs, ask again."""
        pool = self._pool
        answer = await pool.requests.reset_replacement(slot, operation)
        if isinstance(answer, ErrorReport):
            return answer
        pool.recovery.note_reset(slot)
        await self._maybe_sync(slot)
        assert isinstance(request, RolloutRequest)
        due = self._due(request.num_steps)
        chunk = await pool.requests.call(slot, request, operation, self._validate, within=due)
        return chunk if chunk is not None else await self._redo(slot, request, operation)

    def _due(self, num_steps: int) -> float:
        """How long after its request a chunk of ``num_steps`` steps may take.

        A step's time (``Timeouts.step``) per step. Heartbeats do not extend it: a worker
        acts in a thread of its own while its loop keeps heartbeating, so only this catches
        an env that hangs mid-chunk.
        """
        return num_steps * self._pool.config.timeouts.step

    def chunks(self, num_steps: int, max_in_flight: int) -> AsyncGenerator[Chunk, None]:
        """:meth:`Learner.chunks`."""
        if not isinstance(max_in_flight, int) or not 1 <= max_in_flight <= MAX_IN_FLIGHT:
            raise ConfigError(f"max_in_flight must be in 1..{MAX_IN_FLIGHT}, got {max_in_flight!r}")
        if not isinstance(num_steps, int) or isinstance(num_steps, bool) or num_steps < 1:
            raise ConfigError(f"num_steps must be an int >= 1, got {num_steps!r}")
        previous, self._stream = self._stream, self._chunk_stream(num_steps, max_in_flight)
        self._previous_stream = previous
        return self._stream

    async def end_stream(self) -> None:
        """End an abandoned chunk stream (a new operation is about to use the workers).

        Not the stream that is running: one taking its own lease ends nothing but itself.
        """
        stream = self._stream
        running = isinstance(stream, AsyncGeneratorType) and stream.ag_running
        if stream is not None and not running:
            await stream.aclose()

    async def _chunk_stream(
        self, num_steps: int, max_in_flight: int
    ) -> AsyncGenerator[Chunk, None]:
        pool = self._pool
        previous, self._previous_stream = self._previous_stream, None
        if previous is not None:
            await previous.aclose()
        await pool.wait_for_workers()
        self.require_policy("chunks")
        if not pool.recovery.was_reset:
            raise InvalidState("call reset() before chunks()")
        this = self._stream
        async with pool.lease(
            Mode.STREAM,
            "chunks",
            running="another reset/step/rollout is running",
            every_worker=False,
            verb="stream",
            drained=True,
            end=self.end_stream,
        ) as lease:
            # The pumps' receive is _receive_chunk itself, not a coroutine awaiting it: one
            # coroutine fewer per chunk.
            receive = functools.partial(self._receive_chunk, num_steps=num_steps)
            pumps = self._pumps = Pumps(pool, receive, name="aps chunks")
            active = pool.slots.active()

            async def wind_down() -> None:
                try:
                    await self._drain(await pumps.stop(), active, lease)
                finally:
                    if self._pumps is pumps:
                        self._pumps = None
                    if self._stream is this:
                        self._stream = None

            lease.on_release(wind_down)
            for slot in active:
                self._books(slot).lost = 0
                await self._prepare(slot, "chunks")
                for _ in range(max_in_flight):
                    await self._request_chunk(slot, num_steps)
            pumps.start(active)
            clock = time.perf_counter
            while True:
                waiting = clock()
                slot, item = await pumps.get()
                self.chunk_wait += clock() - waiting
                if isinstance(item, WorkerLost) and pool.recovery.on_worker_lost == "drop":
                    await pumps.drop(slot, item)
                    active.remove(slot)
                    if active:
                        continue
                message = pumps.unwrap(slot, item)
                chunk = self._accept_chunk(slot, expect(message, RolloutChunk))
                yield chunk
                await self._request_chunk(slot, num_steps)

    async def _prepare(self, slot: Slot, operation: str) -> None:
        """Reset a replacement's envs before it acts on its own."""
        pool = self._pool
        if pool.recovery.needs_reset(slot):
            books = self._books(slot)
            books.preparing = True
            try:
                answer = await pool.requests.reset_replacement(slot, operation)
            finally:
                books.preparing = False
            if isinstance(answer, ErrorReport):
                raise worker_error(slot, answer)
            pool.recovery.note_reset(slot)

    async def _request_chunk(self, slot: Slot, num_steps: int) -> None:
        books = self._books(slot)
        if books.preparing:
            # A reset is outstanding (lockstep on the wire): ask once it is answered.
            books.lost += 1
            return
        late = await self._maybe_sync(slot, overlap=self.overlap)
        outbox = slot.outbox
        # Built with the numbers the outbox gives it (as lockstep builds its steps), so that
        # numbering keeps it as it is rather than copying it: this runs for every chunk.
        request = RolloutRequest(num_steps=num_steps, seq=outbox.sent, acked=outbox.received)
        await self._pool.requests.send_request(slot, request)
        if late:
            await self._send_weights(slot)
            self._prune()

    async def _receive_chunk(self, slot: Slot, num_steps: int) -> Message | None:
        """A stream's next answer from ``slot`` (its pump's receive; see :mod:`.pump`).

        A replacement worker is reset and asked for as many chunks as its predecessor owed
        (``None``: nothing to deliver yet).
        """
        operation = "chunks"
        answer = await self._pool.requests.answer_from(
            slot, operation, self._validate, within=self._due(num_steps)
        )
        if answer is None:
            await self._prepare(slot, operation)
            books = self._books(slot)
            owed, books.lost = books.lost, 0
            for _ in range(owed):
                await self._request_chunk(slot, num_steps)
        return answer

    async def _drain(self, left: Sequence[Item], admitted: Sequence[Slot], lease: Lease) -> None:
        """Receive the answers still owed after a stream ends, so lockstep can resume.

        The stream's wind-down (its lease judged what ended it first, and judges what this
        raises). ``left``: what the pumps delivered and the stream did not take.
        """
        pool = self._pool
        failure: WorkerLost | ProtocolError | None = None
        for slot, message in left:
            if isinstance(message, RolloutChunk):
                slot.metrics.dropped_chunks += 1
            elif isinstance(message, (WorkerLost, ProtocolError)) and failure is None:
                failure = message
        if lease.broken is not None:
            return
        if failure is not None and pool.recovery.on_worker_lost == "raise":
            # A worker failed after the stream's last chunk and before its end: under "raise"
            # that is the caller's error, as it would have been one chunk sooner.
            raise failure
        try:
            async with asyncio.timeout(pool.config.timeouts.step + pool.recovery.reconnect_timeout):
                for slot in admitted:
                    if not slot.attached.is_set():
                        # Lost and waited for: its chunks are dropped whenever it resumes.
                        slot.outbox.forget()
                        continue
                    while slot.outbox.pending:
                        late = await pool.requests.answer_from(slot, "the end of the chunk stream")
                        if late is None:
                            break  # a replacement owes nothing; it is reset before its use
                        if isinstance(late, RolloutChunk):
                            slot.metrics.dropped_chunks += 1
        except (WorkerLost, ProtocolError) as exc:
            if pool.recovery.on_worker_lost == "raise":
                raise  # as a failure the pumps delivered, above
            lease.fail(InvalidState(f"the chunk stream did not end cleanly ({exc!r})"))
        except (TimeoutError, ApsError) as exc:
            lease.fail(InvalidState(f"the chunk stream did not end cleanly ({exc!r})"))

    async def aclose(self) -> None:
        """End the chunk stream, if one is open, and the weight group."""
        if self._stream is not None:
            with contextlib.suppress(ApsError):
                await self._stream.aclose()
        group, self.group = self.group, None
        if group is not None:
            group.close()


def _described(value: object) -> str:
    if type(value) is np.ndarray:
        return f"an array of shape {value.shape} and dtype {value.dtype}"
    if isinstance(value, list | tuple):
        return f"a {type(value).__name__} of {len(value)}"
    return "None" if value is None else f"a {type(value).__name__}"


def _state_problem(
    state: Sequence[Any], envs: int, expected: list[tuple[int, ...]] | None
) -> str | None:
    """What is wrong with a recurrent chunk's initial state arrays, or ``None``."""
    if expected is not None and len(state) != len(expected):
        return f"initial_state holds {len(state)} arrays, the policy's state {len(expected)}"
    for i, array in enumerate(state):
        if type(array) is not np.ndarray or array.dtype.kind != "f":
            return f"initial_state[{i}] is {_described(array)}, expected a float array"
        if array.ndim < 2 or array.shape[1] != envs:
            return (
                f"initial_state[{i}] has shape {array.shape}, expected the worker's {envs} "
                "envs on axis 1 ([layers, envs, hidden])"
            )
        if expected is not None and array.shape != expected[i]:
            return f"initial_state[{i}] has shape {array.shape}, the policy's is {expected[i]}"
        if array.size and not (
            np.isfinite(array).all() and np.abs(array).max() <= MAX_STATE_MAGNITUDE
        ):
            return (
                f"initial_state[{i}] holds values that are not finite or exceed "
                f"{MAX_STATE_MAGNITUDE:g} in magnitude"
            )
    return None
