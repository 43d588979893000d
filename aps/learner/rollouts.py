"""What worker-side inference (DETACH) hands the learner: chunks, rollouts and sync metrics.

These are plain data: numpy arrays and counters, built by :class:`~aps.learner.Learner` from
the workers' :class:`~aps.wire.messages.RolloutChunk` messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from aps._base._typing import Array, ArrayTree
from aps.errors import ConfigError
from aps.metrics.figures import Metrics, WorkerMetrics
from aps.wire import codec
from aps.wire.batching import map_arrays
from aps.wire.compression import CODECS, compressor
from aps.wire.messages import RolloutChunk, Weights

__all__ = [
    "STALL_LAG",
    "Chunk",
    "Metrics",
    "PolicyVersions",
    "Rollout",
    "WeightPrecision",
    "WorkerMetrics",
    "sample_sequences",
    "sample_states",
]

WeightPrecision = Literal["exact", "float16"]
"""How published weights travel: as the module holds them, or with floats rounded to float16."""

STALL_LAG = 64
"""Versions behind at which a worker whose every sync decision declined on a measured
divergence counts as stalled: four times the default ``APS(max_lag=16)``, so a bounded APS
never reaches it, while a threshold above what the learner's updates can move a stale
policy by (PPO clipped against it) is reported long before the run ends."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Chunk:
    """``T`` steps of one worker's ``E`` envs, acted with one policy version.

    The worker's :class:`~aps.wire.messages.RolloutChunk` as it arrived (``wire``; its arrays are
    views of the frame, never copied), with what the learner adds: the worker, its envs' global
    offset and the policy lag. Build one with :meth:`of`.

    Arrays lead with ``[T, E]`` (``next_obs`` with ``[E]``). For a ``Dict`` or ``Tuple``
    observation space (nested), ``obs``, ``next_obs`` and ``truncated_obs`` are a dict (in the
    space's key order) or tuple of such arrays, in the space's structure. Under the
    ``NextStep`` autoreset mode, a step right after an episode ended only reset that env: its
    action was ignored and its reward is 0. Use ``SameStep`` for algorithms that treat every
    step as a transition.

    The arrays (``obs``, ``actions``, ``logprob``, ``value``, ``reward``, ``terminated``,
    ``truncated``, ``next_obs``, ``episode_return``, ``episode_length``, ``truncated_obs``)
    and ``version`` are the message's, read through properties.

    Attributes:
        worker_id: the worker that produced it.
        env_offset: global index of the worker's first env.
        lag: learner version when the chunk was delivered, minus ``version``.
        wire: the worker's message (its env indices are the worker's own).
        episode_env: the global env indices of the episodes that ended in this chunk.
        truncated_index: where the truncated observations are, ``[K, 2]``: (step, global env
            index).
    """

    worker_id: int
    env_offset: int
    lag: int
    wire: RolloutChunk
    episode_env: Array
    truncated_index: Array

    @classmethod
    def of(cls, wire: RolloutChunk, *, worker_id: int, env_offset: int, lag: int) -> Chunk:
        """The learner's view of ``wire``, from the worker whose first env is ``env_offset``.

        Only the env indices change (the worker's own become global ones); every other
        array is the message's.
        """
        ended, index = wire.episode_env, wire.truncated_index
        return cls(
            worker_id=worker_id,
            env_offset=env_offset,
            lag=lag,
            wire=wire,
            episode_env=ended + env_offset if env_offset and len(ended) else ended,
            truncated_index=(
                index + np.array([0, env_offset]) if env_offset and len(index) else index
            ),
        )

    @property
    def version(self) -> int:
        """The policy version every action in the chunk was chosen with."""
        return self.wire.version

    @property
    def obs(self) -> ArrayTree:
        """The observation each action was chosen on."""
        return self.wire.obs

    @property
    def actions(self) -> Array:
        """The actions taken."""
        return self.wire.actions

    @property
    def logprob(self) -> Array:
        """Behaviour log-probabilities of those actions (float32)."""
        return self.wire.logprob

    @property
    def value(self) -> Array | None:
        """The worker's critic values (float32), or ``None`` without a critic."""
        return self.wire.value

    @property
    def reward(self) -> Array:
        """Rewards (float64)."""
        return self.wire.reward

    @property
    def terminated(self) -> Array:
        """Termination flags."""
        return self.wire.terminated

    @property
    def truncated(self) -> Array:
        """Truncation flags."""
        return self.wire.truncated

    @property
    def next_obs(self) -> ArrayTree:
        """Observations after the last step, to bootstrap from."""
        return self.wire.next_obs

    @property
    def episode_return(self) -> Array:
        """Returns of the episodes that ended in this chunk."""
        return self.wire.episode_return

    @property
    def episode_length(self) -> Array:
        """Their lengths."""
        return self.wire.episode_length

    @property
    def truncated_obs(self) -> ArrayTree:
        """The last observation of every truncated step, ``[K, ...]``.

        The observation that ``obs`` does not show because the env reset, to bootstrap from.
        """
        return self.wire.truncated_obs

    @property
    def initial_state(self) -> tuple[Array, ...] | None:
        """A recurrent policy's state before the chunk's first step, or ``None``.

        Float arrays with the env axis at axis 1 (``[layers, E, hidden]``: an LSTM's ``h``
        and ``c``), as the worker held them after zeroing the envs whose episode starts at
        step 0: the state truncated backpropagation through time starts the chunk from.
        ``None`` for a feed-forward policy.
        """
        state = self.wire.initial_state
        return None if state is None else tuple(state)

    @property
    def episode_start(self) -> Array | None:
        """``[T, E]`` bools of a recurrent policy: where an observation starts an episode.

        The worker zeroed an env's state before acting on such an observation (the ``done``
        it gave the agent's ``get_states``, CleanRL's ``dones`` buffer). ``None`` for a
        feed-forward policy.
        """
        return self.wire.episode_start

    @property
    def agent_active(self) -> Array | None:
        """``[T, E]`` bools of a multi-agent env: where a slot held a live agent.

        False where the slot held none (reward 0, no flags, the action ignored): leave
        those steps out of a loss. ``None`` for any other env. See :mod:`aps.multiagent`.
        """
        return self.wire.agent_active

    @property
    def num_steps(self) -> int:
        """``T``."""
        return int(self.reward.shape[0])

    @property
    def num_envs(self) -> int:
        """``E``."""
        return int(self.reward.shape[1])


@dataclass(frozen=True, slots=True, kw_only=True)
class Rollout:
    """``T`` steps of every env, ``[T, num_envs]``, gathered from one chunk per worker.

    The fields are those of :class:`Chunk` concatenated along the env axis (the episode and
    truncation lists one after the other, with global env indices), plus the policy version
    and lag of every transition (workers may hold different versions).

    For a ``Dict`` or ``Tuple`` observation space (nested), ``obs`` ``[T, num_envs, ...]``,
    ``next_obs`` ``[num_envs, ...]`` and ``truncated_obs`` ``[K, ...]`` are a dict (in the
    space's key order) or tuple of arrays with those leading axes, in the space's structure,
    as Gymnasium batches such a space: ``rollout.obs["position"][t, env]``.
    """

    obs: ArrayTree
    actions: Array
    logprob: Array
    value: Array | None
    reward: Array
    terminated: Array
    truncated: Array
    next_obs: ArrayTree
    policy_version: Array
    lag: Array
    episode_return: Array
    episode_length: Array
    episode_env: Array
    truncated_obs: ArrayTree
    truncated_index: Array
    initial_state: tuple[Array, ...] | None = None
    """A recurrent policy's state before the rollout's first step, per env: float arrays
    ``[layers, num_envs, hidden]`` (see :attr:`Chunk.initial_state`); ``None`` for a
    feed-forward policy. Replay ``obs`` from it with ``episode_start`` as ``done`` to get the
    features every step was acted on (truncated BPTT over the rollout)."""
    episode_start: Array | None = None
    """``[T, num_envs]`` bools of a recurrent policy: where the state was zeroed before a
    step (see :attr:`Chunk.episode_start`); ``None`` for a feed-forward policy."""
    agent_active: Array | None = None
    """``[T, num_envs]`` bools of a multi-agent env: where a slot held a live agent (see
    :attr:`Chunk.agent_active`; a worker of another env counts as all live); ``None`` when
    no worker runs a multi-agent env."""

    @classmethod
    def from_chunks(cls, chunks: list[Chunk]) -> Rollout:
        """Concatenate chunks of equal ``T`` along the env axis, in the given order."""

        def cat(name: str, axis: int = 1) -> Array:
            return np.concatenate([getattr(c, name) for c in chunks], axis=axis)

        def cat_obs(name: str, axis: int = 1) -> ArrayTree:
            # A structured observation (a Dict or Tuple space's) is joined array by array.
            parts = [getattr(c, name) for c in chunks]
            if type(parts[0]) is np.ndarray:
                return np.concatenate(parts, axis=axis)
            joined: ArrayTree = map_arrays(
                lambda *arrays: np.concatenate(arrays, axis=axis), *parts
            )
            return joined

        steps = chunks[0].num_steps

        def per_transition(name: str) -> Array:
            return np.concatenate(
                [np.full((steps, c.num_envs), getattr(c, name), dtype=np.int64) for c in chunks],
                axis=1,
            )

        return cls(
            obs=cat_obs("obs"),
            actions=cat("actions"),
            logprob=cat("logprob"),
            value=cat("value") if all(c.value is not None for c in chunks) else None,
            reward=cat("reward"),
            terminated=cat("terminated"),
            truncated=cat("truncated"),
            next_obs=cat_obs("next_obs", axis=0),
            policy_version=per_transition("version"),
            lag=per_transition("lag"),
            episode_return=cat("episode_return", axis=0),
            episode_length=cat("episode_length", axis=0),
            episode_env=cat("episode_env", axis=0),
            truncated_obs=cat_obs("truncated_obs", axis=0),
            truncated_index=cat("truncated_index", axis=0),
            agent_active=_agent_active(chunks),
            **_recurrent_parts(chunks),
        )


def _agent_active(chunks: list[Chunk]) -> Array | None:
    """A rollout's live-agent mask, joined along the env axis (``None``: no multi-agent env)."""
    if all(c.agent_active is None for c in chunks):
        return None
    return np.concatenate(
        [
            np.ones((c.num_steps, c.num_envs), np.bool_)
            if c.agent_active is None
            else c.agent_active
            for c in chunks
        ],
        axis=1,
    )


def _recurrent_parts(chunks: list[Chunk]) -> dict[str, Any]:
    """A rollout's ``initial_state`` and ``episode_start``, joined along the env axis."""
    states = [c.initial_state for c in chunks if c.initial_state is not None]
    starts = [c.episode_start for c in chunks if c.episode_start is not None]
    if len(states) != len(chunks) or len(starts) != len(chunks):
        return {}
    return {
        "initial_state": tuple(
            np.concatenate(parts, axis=1) for parts in zip(*states, strict=True)
        ),
        "episode_start": np.concatenate(starts, axis=1),
    }


class PolicyVersions:
    """The policy versions a learner has published and still needs, and the KL between them.

    Only the newest version and versions some worker still holds are kept (:meth:`prune`), so
    a learner that publishes faster than workers sync holds a bounded number of copies.
    Divergence is measured on the learner with two scratch copies of the policy (one loaded
    with the current version, one with the worker's): zero extra bytes on the wire.

    A version is snapshotted by encoding it: its :class:`~aps.wire.messages.Weights` frame is made
    once, straight from the agent's tensors, and its arrays are read-only views of that frame.
    So a publish copies the weights once (into memory reused from earlier frames where
    possible), and the frame sent to every worker is the version itself.

    With ``precision="float16"`` a version's float arrays are rounded to float16 when it is
    published: that is what travels and what workers act with, and divergences are measured
    against it too, so APS compares the policies the workers really hold.

    A divergence is measured on at most ``max_states`` states, and on fewer when they are
    large: at most ``max_sample_bytes`` of observations, but never fewer than
    ``MIN_SAMPLED_STATES`` (:meth:`states_for`). Its cost is two forward passes over them on
    the learner's event loop, once per sync decision of each worker that acts with an older
    version: CartPole's 1024 states take a fraction of a millisecond, but 1024 Atari frames
    through the Nature CNN took 0.8-0.9 s on one CPU core (``benchmarks/decision_cost.py``),
    which is what made APS's learner step slower than always-sync's. The budget keeps
    about 150 frames of 84 x 84 x 4 (0.13 s there), and the mean KL's estimate over them
    stays within about a tenth of itself.

    torch is imported on the first :meth:`publish`, never before.
    """

    MIN_SAMPLED_STATES = 64
    """The fewest states a divergence is measured on when the chunk has them, whatever their
    size."""

    def __init__(
        self,
        observation_space: Any,
        action_space: Any,
        *,
        max_states: int = 1024,
        max_sample_bytes: int = 4 * 2**20,
        precision: WeightPrecision = "exact",
    ) -> None:
        if precision not in ("exact", "float16"):
            raise ConfigError(f"weight precision must be 'exact' or 'float16', got {precision!r}")
        self.precision: WeightPrecision = precision
        self._spaces = (observation_space, action_space)
        self.max_states = max_states
        self.max_sample_bytes = max_sample_bytes
        self.current = 0
        self.epsilon: float | None = None
        self._weights: dict[int, dict[str, Array]] = {}
        self._frames: dict[int, bytes] = {}
        self._compressed: dict[tuple[int, str], bytes] = {}
        self._behaviour: dict[int, dict[str, float]] = {}
        self._nbytes: dict[int, int] = {}
        self._wrapped: Any = None  # the Policy around the user's agent, built once
        # A recurrent policy's state shapes per env count, asked for every chunk's check.
        self._state_shapes: dict[int, list[tuple[int, ...]]] = {}
        self._live: Any = None  # Policy holding the current version
        self._probe: Any = None  # Policy holding whichever old version was measured last
        self._probe_version = -1
        self._live_version = -1

    def publish(self, agent: Any, *, epsilon: float | None = None) -> int:
        """Snapshot ``agent``'s weights as a new version and return its number (1, 2, ...).

        Args:
            agent: an ``nn.Module`` the policy adapter understands, or an
                :class:`aps.policy.Policy`.
            epsilon: exploration rate for epsilon-greedy Q-policies (``None``: unchanged).

        Raises:
            ConfigError: the agent is not a policy aps can run (or ``epsilon`` was given for
                a policy that does not explore with it).
        """
        from aps.policy import Policy, compact_weights

        if isinstance(agent, Policy):
            policy = agent
        elif self._wrapped is not None and self._wrapped.module is agent:
            policy = self._wrapped  # wrapping checks the heads with a forward pass: once
        else:
            policy = self._wrapped = Policy(agent, *self._spaces)
        if self._live is None:
            # Scratch copies: training goes on in the user's agent, these hold versions.
            self._live, self._probe = policy.clone(), policy.clone()
        if epsilon is not None:
            self._live.epsilon = epsilon
            self.epsilon = epsilon
        version = self.current + 1
        arrays = policy.get_weights(copy=False)
        if self.precision == "float16":
            arrays = compact_weights(arrays)
        frame = codec.encode(Weights(version=version, arrays=arrays, epsilon=self.epsilon))
        weights = codec.decode(frame, max_frame_size=len(frame))
        assert isinstance(weights, Weights)
        self.current = version
        self._frames[version] = frame
        self._weights[version] = weights.arrays
        # The behaviour of a version includes its exploration rate, kept for its KL later.
        self._behaviour[version] = self._live.behaviour_params()
        self._nbytes[version] = sum(a.nbytes for a in weights.arrays.values())
        return version

    def weights(self, version: int) -> dict[str, Array]:
        """The arrays of ``version`` (which must still be kept), read-only."""
        return self._weights[version]

    def frame(self, version: int, compression: str = "none") -> bytes:
        """The encoded :class:`~aps.wire.messages.Weights` of ``version`` (which must be kept).

        With a codec (a connection's negotiated :mod:`aps.wire.compression`), the frame is
        compressed once per version and codec, however many workers it goes to.
        """
        if compression == "none":
            return self._frames[version]
        key = (version, compression)
        frame = self._compressed.get(key)
        if frame is None:
            plain = self._frames[version]
            message = codec.decode(plain, max_frame_size=len(plain))  # views, as published
            frame = codec.encode(message, compressor=compressor(compression))
            self._compressed[key] = frame
        return frame

    def has(self, version: int) -> bool:
        """Whether ``version`` is still kept (published and not pruned)."""
        return version in self._weights

    def nbytes(self, version: int) -> int:
        """Bytes of ``version``'s arrays."""
        return self._nbytes[version]

    def states_for(self, obs: ArrayTree) -> int:
        """How many of a chunk's states a divergence is measured on.

        ``max_states``, or fewer where the states of ``obs`` ``[T, E, ...]`` would hold more
        than ``max_sample_bytes``, but at least :attr:`MIN_SAMPLED_STATES`.
        """
        sizes: list[int] = []
        map_arrays(lambda a: sizes.append(a.itemsize * int(np.prod(a.shape[2:]))), obs)
        within = self.max_sample_bytes // max(sum(sizes), 1)
        return int(min(self.max_states, max(self.MIN_SAMPLED_STATES, within)))

    def divergence(
        self,
        version: int,
        obs: ArrayTree,
        *,
        state: tuple[Array, ...] | None = None,
        episode_start: Array | None = None,
    ) -> float:
        """Mean over ``obs`` of KL(pi_version(.|s) || pi_current(.|s)); 0 for the current one.

        For a recurrent policy, ``obs`` ``[T, E, ...]`` are a chunk's steps, replayed through
        both versions from the chunk's initial ``state`` with its ``episode_start`` flags
        (see :meth:`aps.policy.Policy.kl`; :func:`sample_sequences` picks them).
        """
        if version == self.current:
            return 0.0
        if self._live_version != self.current:
            # Loaded only when measured: strategies that never measure never pay for it.
            self._live.set_weights(self._weights[self.current], widen=True)
            self._live_version = self.current
        if self._probe_version != version:
            self._probe.set_weights(self._weights[version], widen=True)
            self._probe.set_behaviour_params(self._behaviour[version])
            self._probe_version = version
        if state is not None:
            return float(
                self._probe.kl(
                    self._live,
                    obs,
                    max_states=self.max_states,
                    state=state,
                    episode_start=episode_start,
                )
            )
        return float(self._probe.kl(self._live, obs, max_states=self.max_states))

    def state_shapes(self, num_envs: int) -> list[tuple[int, ...]] | None:
        """The shapes of the published policy's state for ``num_envs`` envs.

        ``[]`` for a feed-forward policy; ``None`` before the first publish (not known yet).
        """
        policy = self._wrapped if self._wrapped is not None else self._live
        if policy is None:
            return None
        if not policy.recurrent:
            return []
        # The shapes follow from the module, built once (``_wrapped``): computed once per
        # env count, not allocated for every chunk.
        shapes = self._state_shapes.get(num_envs)
        if shapes is None:
            shapes = [array.shape for array in policy.initial_state(num_envs)]
            self._state_shapes[num_envs] = shapes
        return shapes

    def prune(self, held: set[int]) -> None:
        """Forget every version but the current one and those in ``held``."""
        keep = held | {self.current}
        for version in [v for v in self._weights if v not in keep]:
            del self._weights[version]
            del self._frames[version]
            for name in CODECS:
                self._compressed.pop((version, name), None)
            del self._nbytes[version]
            del self._behaviour[version]

    def __len__(self) -> int:
        return len(self._weights)


def sample_sequences(
    obs: Array, episode_start: Array, state: tuple[Array, ...], max_states: int
) -> tuple[Array, Array, tuple[Array, ...]]:
    """A recurrent chunk's whole steps of at most ``max(1, max_states // T)`` of its envs.

    ``obs`` ``[T, E, ...]``, ``episode_start`` ``[T, E]`` and the initial ``state`` (env axis
    1) of the same evenly spaced envs, copied so that they outlive the frame they came from.
    A recurrent policy's states are replayed step by step, so envs are sampled, not steps.
    """
    steps, envs = episode_start.shape
    keep = max(1, min(envs, max_states // max(steps, 1)))
    index = np.linspace(0, envs - 1, keep).round().astype(np.int64)
    return obs[:, index], episode_start[:, index], tuple(s[:, index] for s in state)


def sample_states(obs: ArrayTree, max_states: int) -> ArrayTree:
    """Flatten ``[T, E, ...]`` observations to states and keep at most ``max_states``.

    The sample is evenly spaced (deterministic) and copied, so it outlives the frame it came
    from. A structured observation (a dict or tuple of arrays, nested) is sampled at the same
    states in each of its arrays, and keeps its structure.
    """
    if type(obs) is not np.ndarray:
        sampled: ArrayTree = map_arrays(lambda array: sample_states(array, max_states), obs)
        return sampled
    states = obs.reshape(-1, *obs.shape[2:])
    if states.shape[0] > max_states:
        index = np.linspace(0, states.shape[0] - 1, max_states).round().astype(np.int64)
        return states[index]
    return states.copy()
