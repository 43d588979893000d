"""Worker-side inference (DETACH): act with the local policy copy and record chunks."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
from typing import Any

import numpy as np
from gymnasium.vector import AutoresetMode

from aps.errors import ConfigError, InvalidState, ProtocolError
from aps.multiagent import AGENT_ACTIVE
from aps.vector import AnyVectorEnv
from aps.wire.batching import check_space, empty_batch, map_arrays
from aps.wire.messages import TIMINGS_FORMAT, RolloutChunk, Weights

__all__ = ["MAX_ROLLOUT_STEPS", "Collector"]

MAX_ROLLOUT_STEPS = 1_000_000
"""The most steps one rollout request may ask for (it bounds the worker's buffers)."""


class Collector:
    """Worker-side inference (DETACH): act with the local policy copy, record chunks.

    Keeps the current observations between requests (lockstep resets and steps update them
    too), the policy version in use, and per-env episode returns and lengths. Under the
    ``NextStep`` autoreset mode the step after an episode's end only resets that env; it is
    recorded like any other (reward 0, not done) and not counted in episode lengths.

    A recurrent policy's state (see :mod:`aps.policy`) is kept per env between chunks and
    zeroed before an env acts on the first observation of an episode: the step after the one
    that ended it under ``SameStep``, the step after the reset step under ``NextStep``, and
    every env after a reset. Each chunk carries the state before its first step (after that
    zeroing) and the episode-start flags of its steps. Lockstep steps (the learner's actions)
    do not advance the state; they only mark where episodes start.

    :meth:`collect_async` acts in a thread of its own, so the worker's event loop keeps
    reading frames (a new version on its way, heartbeats) while a chunk is acted; the caller
    loads a new version only between chunks.
    """

    def __init__(
        self,
        envs: AnyVectorEnv,
        policy_path: str,
        mode: AutoresetMode,
        policy_kwargs: dict[str, Any] | None = None,
    ) -> None:
        from aps import policy  # torch is needed only by workers that act

        policy.limit_threads(1)  # many workers share few cores; one thread each is fastest
        self._envs = envs
        # A Dict or Tuple space (nested) is recorded array by array; anything else is refused.
        self._structured = check_space(envs.single_observation_space, "worker-side inference")
        self._policy = policy.Policy.load(
            policy_path,
            envs.single_observation_space,
            envs.single_action_space,
            factory_kwargs=policy_kwargs,
        )
        self._next_step_reset = mode is AutoresetMode.NEXT_STEP
        self.version = -1
        num_envs = envs.num_envs
        self._obs: Any = None  # an array, or a dict or tuple of arrays (structured)
        self._pending_reset = np.zeros(num_envs, dtype=bool)
        self._episode_return = np.zeros(num_envs, dtype=np.float64)
        self._episode_length = np.zeros(num_envs, dtype=np.int64)
        # A recurrent policy's state per env, and where the next observation starts an episode.
        self._state: tuple[np.ndarray[Any, Any], ...] | None = (
            self._policy.initial_state(num_envs) if self._policy.recurrent else None
        )
        self._episode_start = np.ones(num_envs, dtype=bool)
        # A multi-agent env's live-agent mask of the current observations (None: not one).
        self._active: np.ndarray[Any, Any] | None = None
        # One thread, always the same: torch's per-thread state (grad mode) stays put, and
        # chunks cannot overlap.
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def policy(self) -> Any:
        """The worker's :class:`aps.policy.Policy`."""
        return self._policy

    def load(self, weights: Weights) -> None:
        """Load a new version; raises ConfigError when the arrays do not fit the policy."""
        if not isinstance(weights.arrays, dict):
            raise ProtocolError(f"weights must map names to arrays, got {type(weights.arrays)}")
        # The arrays are views of the frame they came in, which nothing else holds: the
        # policy takes that memory as its own rather than copying a large version.
        # float16 arrays (a learner with weight_precision="float16") widen to the module's.
        self._policy.set_weights(weights.arrays, share=True, widen=True)
        if weights.epsilon is not None:
            self._policy.epsilon = weights.epsilon
        self.version = weights.version

    def observe(
        self, obs: Any, done: np.ndarray[Any, Any] | None, info: dict[str, Any] | None = None
    ) -> None:
        """Track observations produced by a lockstep reset (``done=None``) or step.

        ``info``: theirs, for a multi-agent env's live-agent mask (:mod:`aps.multiagent`).
        """
        self._obs = obs
        was_active, self._active = self._active, _active_of(info)
        if done is None:
            self._episode_start[:] = True
        else:
            # NextStep: an episode starts after the reset step, i.e. where this step was one.
            self._episode_start = (self._pending_reset if self._next_step_reset else done).copy()
            self._episode_start |= _joined(was_active, self._active)
        if done is None:
            self._pending_reset[:] = False
            self._episode_return[:] = 0.0
            self._episode_length[:] = 0
        else:
            self._pending_reset = done.copy() if self._next_step_reset else self._pending_reset

    async def collect_async(self, num_steps: int, seq: int = 0) -> RolloutChunk:
        """:meth:`collect` in the collector's thread, leaving the event loop free meanwhile.

        Cancelling the caller does not stop the chunk: it waits for the thread to finish
        before the cancellation goes on, so nothing else touches the envs or the policy
        while a chunk is being acted (a chunk is bounded by ``num_steps``).
        """
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(1, "aps-collector")
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._thread, self.collect, num_steps, seq)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            await asyncio.wait([future])
            raise

    def close(self) -> None:
        """Stop the collector's thread (after the chunk it is acting, if any)."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None

    def collect(self, num_steps: int, seq: int = 0) -> RolloutChunk:
        """Act ``num_steps`` times on every env and return the chunk (answering ``seq``)."""
        if not 1 <= num_steps <= MAX_ROLLOUT_STEPS:
            raise ConfigError(f"num_steps must be in 1..{MAX_ROLLOUT_STEPS}, got {num_steps}")
        if self.version < 0:
            raise ProtocolError("the learner asked for a rollout before sending any weights")
        if self._obs is None:
            raise InvalidState("reset the envs before the first rollout")
        envs, policy = self._envs, self._policy
        version = self.version  # the one version this chunk is acted with, and stamped with
        num_envs = envs.num_envs
        obs = self._obs
        structured = self._structured
        obs_buf: Any = (
            _Steps(envs.single_observation_space, (num_steps, num_envs))
            if structured
            else np.empty((num_steps, *obs.shape), dtype=obs.dtype)
        )
        reward = np.empty((num_steps, num_envs), dtype=np.float64)
        terminated = np.empty((num_steps, num_envs), dtype=np.bool_)
        truncated = np.empty((num_steps, num_envs), dtype=np.bool_)
        actions_buf: np.ndarray[Any, Any] | None = None
        logprob = np.empty((num_steps, num_envs), dtype=np.float32)
        value = np.empty((num_steps, num_envs), dtype=np.float32) if policy.has_critic else None
        ended: list[tuple[float, int, int]] = []
        cut: list[tuple[int, int, np.ndarray[Any, Any]]] = []  # truncated: step, env, last obs
        starts = None if self._state is None else np.empty((num_steps, num_envs), dtype=np.bool_)
        active = None if self._active is None else np.empty((num_steps, num_envs), dtype=np.bool_)
        initial: list[np.ndarray[Any, Any]] | None = None
        # Where the worker's time goes, for the learner's figures: the policy's forward
        # passes, the envs, and the rest of the loop (the chunk's packing).
        clock = time.perf_counter
        began = clock()
        acting = stepping = 0.0
        for t in range(num_steps):
            obs_buf[t] = obs
            act_start = clock()
            if starts is None or self._state is None:
                actions, logprob[t], values = policy.act(obs)
            else:
                starts[t] = start = self._episode_start
                if start.any():
                    for array in self._state:  # our own arrays: the policy returns new ones
                        array[:, start] = 0.0
                if t == 0:
                    initial = list(self._state)  # never written again: the next are new arrays
                actions, logprob[t], values, self._state = policy.act_recurrent(
                    obs, self._state, start
                )
            if actions_buf is None:
                actions_buf = np.empty((num_steps, *actions.shape), dtype=actions.dtype)
            actions_buf[t] = actions
            if value is not None and values is not None:
                value[t] = values
            # The chunk keeps the raw samples; the env gets them within its bounds.
            stepped = policy.env_actions(actions)
            step_start = clock()
            obs, reward[t], terminated[t], truncated[t], info = envs.step(stepped)
            step_end = clock()
            acting += step_start - act_start
            stepping += step_end - step_start
            if active is not None:
                active[t] = self._active
                self._active = _active_of(info)
            if starts is not None:
                # Read before _count_episodes moves _pending_reset on (see observe).
                self._episode_start = (
                    self._pending_reset.copy()
                    if self._next_step_reset
                    else terminated[t] | truncated[t]
                )
                if active is not None:
                    # A multi-agent slot whose agent joins starts an episode with no flag of
                    # its own: its state is zeroed as for any other episode's start.
                    self._episode_start |= _joined(active[t], self._active)
            self._count_episodes(
                reward[t],
                terminated[t] | truncated[t],
                ended,
                None if active is None else active[t],
            )
            for env in np.flatnonzero(truncated[t]):
                # SameStep: obs already holds the reset observation, the last one is in the
                # info; NextStep: obs is still the last one (the reset comes next step).
                if structured:
                    cut.append((t, int(env), _env_obs(info, obs, int(env))))
                    continue
                last = info["final_obs"][env] if "final_obs" in info else obs[env]
                cut.append((t, int(env), np.array(last)))
        assert actions_buf is not None
        self._obs = obs
        returns, lengths, env_ids = zip(*ended, strict=True) if ended else ((), (), ())
        chunk = RolloutChunk(
            version=version,
            obs=obs_buf.arrays if structured else obs_buf,
            actions=actions_buf,
            logprob=logprob,
            value=value,
            reward=reward,
            terminated=terminated,
            truncated=truncated,
            next_obs=map_arrays(np.array, obs) if structured else np.array(obs),
            episode_return=np.array(returns, dtype=np.float64),
            episode_length=np.array(lengths, dtype=np.int64),
            episode_env=np.array(env_ids, dtype=np.int64),
            truncated_obs=(
                self._stack_cut(cut)
                if structured
                else np.stack([c[2] for c in cut])
                if cut
                else np.empty((0, *obs.shape[1:]), obs.dtype)
            ),
            truncated_index=np.array([c[:2] for c in cut], dtype=np.int64).reshape(-1, 2),
            seq=seq,
            initial_state=initial,
            episode_start=starts,
            agent_active=active,
        )
        packing = max(0.0, clock() - began - stepping - acting)
        return dataclasses.replace(chunk, timings=TIMINGS_FORMAT.pack(stepping, acting, packing))

    def _stack_cut(self, cut: list[tuple[int, int, Any]]) -> Any:
        """The truncated steps' last observations of a structured space, ``[K, ...]`` each."""
        # Written into buffers of the space's dtypes: info values may come in others.
        steps = _Steps(self._envs.single_observation_space, (len(cut),))
        for index, (_, _, last) in enumerate(cut):
            steps[index] = last
        return steps.arrays

    def _count_episodes(
        self,
        reward: np.ndarray[Any, Any],
        done: np.ndarray[Any, Any],
        ended: list[tuple[float, int, int]],
        active: np.ndarray[Any, Any] | None = None,
    ) -> None:
        self._episode_return += reward
        # A step counts in an episode's length where it was one: not the reset step of
        # NextStep, nor a slot of a multi-agent env that held no agent.
        counted = ~self._pending_reset
        self._episode_length += counted if active is None else counted & active
        if done.any():
            for env in np.flatnonzero(done):
                ended.append(
                    (float(self._episode_return[env]), int(self._episode_length[env]), int(env))
                )
            self._episode_return[done] = 0.0
            self._episode_length[done] = 0
        if self._next_step_reset:
            self._pending_reset = done.copy()


class _Steps:
    """A chunk's observations of a ``Dict`` or ``Tuple`` space, one buffer per array.

    ``steps[t] = obs`` writes each array of one step's batch into its own ``[T, E, ...]``
    buffer, as ``obs_buf[t] = obs`` does for an array space (whose loop stays as it is).
    """

    __slots__ = ("_leaves", "arrays")

    def __init__(self, space: Any, leading: tuple[int, ...]) -> None:
        self.arrays = empty_batch(space, leading)
        # Each buffer with the keys that lead to it in a step's batch, listed once.
        self._leaves: list[tuple[tuple[Any, ...], np.ndarray[Any, Any]]] = []
        self._collect(self.arrays, ())

    def _collect(self, tree: Any, path: tuple[Any, ...]) -> None:
        if type(tree) is dict:
            for key, item in tree.items():
                self._collect(item, (*path, key))
        elif type(tree) is tuple:
            for index, item in enumerate(tree):
                self._collect(item, (*path, index))
        else:
            self._leaves.append((path, tree))

    def __setitem__(self, step: int, obs: Any) -> None:
        for path, buffer in self._leaves:
            value = obs
            for key in path:
                value = value[key]
            buffer[step] = value


def _env_obs(info: dict[str, Any], obs: Any, env: int) -> Any:
    """Env ``env``'s last observation of a truncated step, a copy in the space's structure.

    Under SameStep it is the info's ``final_obs``; under NextStep the batch ``obs`` still
    holds it (in buffers the next step overwrites: hence the copy).
    """
    last = _pick(obs, info["final_obs"] if "final_obs" in info else obs, env)
    return map_arrays(np.array, last)


def _pick(batch: Any, final: Any, env: int) -> Any:
    """Env ``env``'s part of ``final``, walked in the structure of the batch ``batch``.

    Gymnasium's info batching keeps a dict's values as a dict of per-env arrays (with mask
    keys beside them, which the batch's structure skips), and anything else (a tuple) per
    env in an object array, whose element is then that env's whole value.
    """
    if type(final) is np.ndarray and final.dtype.hasobject:
        return final[env]
    if type(batch) is dict:
        return {key: _pick(item, final[key], env) for key, item in batch.items()}
    if type(batch) is tuple:
        return tuple(_pick(item, final[index], env) for index, item in enumerate(batch))
    return final[env]


def _active_of(info: dict[str, Any] | None) -> np.ndarray[Any, Any] | None:
    """A multi-agent env's live-agent mask in ``info`` (a copy), or ``None`` for other envs."""
    mask = None if info is None else info.get(AGENT_ACTIVE)
    return None if mask is None else np.array(mask, dtype=np.bool_)


def _joined(
    before: np.ndarray[Any, Any] | None, after: np.ndarray[Any, Any] | None
) -> np.ndarray[Any, Any] | bool:
    """The slots whose live-agent mask turned on between two observations (``False``: none)."""
    if before is None or after is None:
        return False
    joined: np.ndarray[Any, Any] = after & ~before
    return joined
