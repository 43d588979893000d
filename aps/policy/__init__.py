"""The torch adapter: a CleanRL-style agent, used by aps without editing it.

This is the only aps module that imports torch; nothing else imports it, so the remote-env
path runs without torch installed.

A policy reaches a worker as an import path (``"pkg.module:make_agent"`` or
``"path/to/script.py:Agent"``, see :func:`load_policy_factory`) plus weights that travel as
numpy arrays (:meth:`Policy.get_weights`, :meth:`Policy.set_weights`); no pickle anywhere.
The factory is called with the single observation and action spaces, or, when it takes one
positional argument like CleanRL's ``Agent(envs)``, with a small stand-in for a one-env vector
env (:class:`VectorEnvSpaces`).

:class:`Policy` recognises three kinds of agent by their attributes:

- ``"categorical"``: ``actor`` maps observations to logits ``[B, n]``; optional ``critic``
  maps them to values ``[B, 1]``. Needs a ``Discrete`` action space.
- ``"gaussian"``: ``actor_mean`` maps observations to means ``[B, D]`` and ``actor_logstd`` is
  a tensor (usually an ``nn.Parameter`` of shape ``[1, D]``) broadcastable to them; optional
  ``critic``. Needs a float ``Box`` action space with ``D`` = the product of its shape.
- ``"q"``: none of those attributes; ``module(obs)`` returns Q-values ``[B, n]`` (CleanRL's
  ``QNetwork``). Needs a ``Discrete`` action space. The behaviour policy is epsilon-greedy
  (default, ``epsilon=0.05``) or Boltzmann (``exploration="boltzmann"``, ``temperature``).

The heads are called on the observations directly (as float tensors of the module's
parameter dtype and device), so agents whose heads expect a shared trunk's output are not
supported as is. For a ``Dict`` or ``Tuple`` observation space (nested, its leaves ``Box``,
``Discrete``, ``MultiDiscrete`` or ``MultiBinary``) the heads receive the observation in the
space's structure: a dict (the space's key order) or tuple of such float tensors, each
``[B, *leaf.shape]``, as SB3's ``MultiInputPolicy`` and CleanRL-style agents over dict
observations take them; such heads always act through torch. The module's train/eval mode
is left alone: put agents with dropout or batch norm in eval mode for acting.

A *recurrent* agent (an LSTM or GRU, shaped like CleanRL's ``ppo_atari_lstm.py`` ``Agent``) has a
``get_states(x, state, done)`` method; :attr:`Policy.recurrent` is then true and the heads
(``actor``, or ``actor_mean`` and ``actor_logstd``, and an optional ``critic``) are called on the
features it returns, not on the observations. The contract, which CleanRL's agent meets as it
is:

- ``get_states(x, state, done) -> (features, new_state)``: ``x`` holds ``T * B`` observations,
  step-major (``[T * B, *obs_shape]``; ``T = 1`` when acting), ``done`` ``[T * B]`` floats, 1.0
  where that observation is the first of an episode (the agent zeroes the state before it),
  ``state`` the state before the first of the ``T`` steps. ``features`` is ``[T * B, F]``.
- The state is a tensor or a tuple of tensors whose batch axis is axis 1 (``[layers, B,
  hidden]``, torch's RNN convention). Its zero state comes from ``initial_state(batch_size)``
  when the agent has that method, else from an ``nn.LSTM`` attribute named ``lstm`` (a tuple
  ``(h, c)``) or an ``nn.GRU`` attribute named ``gru`` (a tensor).
- The state is never part of the module (not a parameter, not a buffer): it is kept per env by
  whoever acts (:meth:`Policy.act_recurrent` takes and returns it), so it never travels with
  the weights.

Recurrent Q-networks and :meth:`Policy.log_prob` (gradient rounds) are not supported.

:meth:`Policy.act` runs on every env step of a worker that acts itself (DETACH, APS), where
torch's cost per operation, not the arithmetic, dominates a small MLP's forward pass: each
of the ten or so operations of a 64-64 actor-critic costs several microseconds of dispatch.
So a head that is a plain MLP, exactly an ``nn.Sequential`` of ``nn.Linear``, ``nn.Tanh``,
``nn.ReLU`` and ``nn.Identity`` (CleanRL's PPO agents), is evaluated with NumPy on views of
the module's own parameters: the same function, several times faster at the batch sizes of
a worker. Every other head, and every head with a hook, runs in torch; so do
:meth:`Policy.log_prob` (gradients) and :meth:`Policy.kl`. ``inference="torch"`` turns the
NumPy path off.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Mapping
from typing import Any, Literal

import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces
from torch import nn

from aps.errors import ConfigError
from aps.policy._agent_module import (
    PolicySpec,
    VectorEnvSpaces,
    _attr,
    build_module,
    compact_weights,
    limit_threads,
    load_policy_factory,
    weights_nbytes,
    widened,
)
from aps.policy._nature_cnn import NatureCNN
from aps.policy._numpy_heads import LOG_SQRT_2PI, NumpyHeads, check_no_nan, numpy_dtype
from aps.policy._observations import (
    _OBSERVATION_SPACES,
    _STRUCTURED_SPACES,
    ObservationsMixin,
    _first_leaf,
    _first_space,
)
from aps.policy._recurrent import RecurrentMixin
from aps.wire.batching import check_space, empty_batch, map_arrays

__all__ = [
    "Exploration",
    "Inference",
    "NatureCNN",
    "Policy",
    "PolicyKind",
    "PolicySpec",
    "VectorEnvSpaces",
    "build_module",
    "compact_weights",
    "limit_threads",
    "load_policy_factory",
    "weights_nbytes",
]

PolicyKind = Literal["categorical", "gaussian", "q"]
"""What :class:`Policy` found: a categorical actor, a Gaussian actor or a Q-network."""

Exploration = Literal["epsilon", "boltzmann"]
"""How a Q-network policy explores: epsilon-greedy or a softmax of ``Q / temperature``."""

Inference = Literal["auto", "torch"]
"""How :meth:`Policy.act` runs the heads: ``"auto"`` evaluates plain MLP heads with NumPy and
everything else with torch; ``"torch"`` always uses torch."""


_PROBE_BATCH = 2


# ---------------------------------------------------------------------------------------------
# The policy.


def _check_fraction(name: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0.0 <= float(value) <= 1.0
    ):
        raise ConfigError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def _check_temperature(value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(f"temperature must be a finite number > 0, got {value!r}")
    return float(value)


class Policy(RecurrentMixin, ObservationsMixin):
    """A CleanRL-style agent seen as a behaviour policy: act, compare, move weights.

    Args:
        module: the agent; its kind is detected from its attributes (see the module doc).
        observation_space: the observation space of one env (``Box``, ``Discrete``,
            ``MultiBinary`` or ``MultiDiscrete``; observations become float tensors), or a
            ``Dict`` or ``Tuple`` of these, nested (observations become a dict or tuple of
            float tensors, in the space's structure).
        action_space: the action space of one env: ``Discrete`` or a float ``Box``.
        exploration: for Q-networks, ``"epsilon"`` (epsilon-greedy) or ``"boltzmann"``
            (softmax of ``Q / temperature``). Ignored for actor policies.
        epsilon: the epsilon-greedy random-action probability, in ``[0, 1]``.
        temperature: the Boltzmann temperature, ``> 0``.
        seed: seeds the private sampling generators; ``None`` seeds them from the OS.
        inference: ``"auto"`` (default) lets :meth:`act` evaluate plain MLP heads with NumPy
            (see the module doc); ``"torch"`` runs every head in torch. The two sample from
            the same distributions with different random streams, and agree to float
            rounding in log-probabilities and values.

    The constructor runs the heads once on a batch of two zero observations (in eval mode,
    without gradients, the modes restored after) to check the output shapes.

    Raises:
        ConfigError: an unsupported space or space/agent combination, missing or misshapen
            heads, or a bad exploration parameter. The message names what was found and
            what is supported.
    """

    def __init__(
        self,
        module: nn.Module,
        observation_space: gym.Space[Any],
        action_space: gym.Space[Any],
        *,
        exploration: Exploration = "epsilon",
        epsilon: float = 0.05,
        temperature: float = 1.0,
        seed: int | None = None,
        inference: Inference = "auto",
    ) -> None:
        if not isinstance(module, nn.Module):
            raise ConfigError(f"a policy wraps a torch.nn.Module, got {type(module).__name__}")
        if not isinstance(observation_space, _OBSERVATION_SPACES + _STRUCTURED_SPACES):
            raise ConfigError(
                f"observation space {observation_space} is not supported; a policy takes "
                "Box, Discrete, MultiBinary or MultiDiscrete observations, or Dict and Tuple "
                "spaces of them"
            )
        # A dict or tuple of arrays: its leaves are checked once, here.
        self._structured = check_space(observation_space, "a policy")
        self._first_ndim = len(_first_space(observation_space).shape or ())
        if exploration not in ("epsilon", "boltzmann"):
            raise ConfigError(f"exploration must be 'epsilon' or 'boltzmann', got {exploration!r}")
        if inference not in ("auto", "torch"):
            raise ConfigError(f"inference must be 'auto' or 'torch', got {inference!r}")
        self._module = module
        self._shared = False  # the CPU tensors are views of arrays given to set_weights
        self._observation_space = observation_space
        self._action_space = action_space
        self._obs_shape: tuple[int, ...] = tuple(observation_space.shape or ())
        self._kind: PolicyKind = _detect_kind(module, action_space)
        self._recurrent = callable(getattr(module, "get_states", None))
        self._single_state = False  # the agent's state is one tensor, not a tuple (a GRU's)
        if self._recurrent and self._kind == "q":
            raise ConfigError(
                f"{type(module).__name__} has get_states but no actor head; a recurrent policy "
                "needs actor (logits) or actor_mean and actor_logstd, recurrent Q-networks are "
                "not supported"
            )
        if self._recurrent and self._structured:
            # The replay of a chunk from its state (APS's KL) takes one array per step.
            raise ConfigError(
                f"{type(module).__name__} has get_states, and the observation space "
                f"{observation_space!r:.120} is a Dict or Tuple: recurrent policies take array "
                "observations; flatten the observations first (gymnasium.wrappers."
                "FlattenObservation) or use a feed-forward policy"
            )
        self._has_critic = self._kind != "q" and callable(getattr(module, "critic", None))
        self._exploration: Exploration = exploration
        self._epsilon = _check_fraction("epsilon", epsilon)
        self._temperature = _check_temperature(temperature)
        self._generator = torch.Generator()
        self._rng = np.random.default_rng()
        if seed is None:
            self._generator.seed()
        else:
            self.seed(seed)
        self._probe()
        self._inference: Inference = inference
        self._heads = self._build_heads() if inference == "auto" else None

    @classmethod
    def load(
        cls,
        spec: PolicySpec,
        observation_space: gym.Space[Any],
        action_space: gym.Space[Any],
        *,
        exploration: Exploration = "epsilon",
        epsilon: float = 0.05,
        temperature: float = 1.0,
        seed: int | None = None,
        inference: Inference = "auto",
        factory_kwargs: Mapping[str, Any] | None = None,
    ) -> Policy:
        """Import, build and wrap: ``Policy(build_module(load_policy_factory(spec), ...))``.

        This is what a worker does with the import path it is given. ``factory_kwargs`` go to
        the factory (the learner's ``policy_kwargs``); the other keyword arguments are those
        of :class:`Policy`.

        Raises:
            ConfigError: from any of the three steps.
        """
        factory = load_policy_factory(spec)
        module = build_module(factory, observation_space, action_space, **(factory_kwargs or {}))
        return cls(
            module,
            observation_space,
            action_space,
            exploration=exploration,
            epsilon=epsilon,
            temperature=temperature,
            seed=seed,
            inference=inference,
        )

    # -- what it is ------------------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The wrapped agent (not a copy)."""
        return self._module

    @property
    def kind(self) -> PolicyKind:
        """``"categorical"``, ``"gaussian"`` or ``"q"``."""
        return self._kind

    @property
    def observation_space(self) -> gym.Space[Any]:
        """The observation space of one env."""
        return self._observation_space

    @property
    def action_space(self) -> gym.Space[Any]:
        """The action space of one env."""
        return self._action_space

    @property
    def recurrent(self) -> bool:
        """Whether the agent has a state (``get_states``, see the module doc).

        A recurrent policy acts with :meth:`act_recurrent`, and its :meth:`kl` replays a
        chunk's steps from the chunk's initial state.
        """
        return self._recurrent

    @property
    def has_critic(self) -> bool:
        """Whether :meth:`act` returns values (an actor policy with a ``critic`` head)."""
        return self._has_critic

    @property
    def inference(self) -> Literal["numpy", "torch"]:
        """What :meth:`act` evaluates the heads with now: ``"numpy"`` or ``"torch"``.

        ``"numpy"`` while every head is a plain MLP without hooks (see the module doc) and
        the policy was built with ``inference="auto"``; otherwise ``"torch"``. The heads are
        examined when the policy is built and again when a head, layer or parameter they
        used is replaced; a policy whose heads stop qualifying then acts with torch for
        good. A hook makes torch act only while it is registered.
        """
        return "torch" if self._numpy_heads() is None else "numpy"

    @property
    def exploration(self) -> Exploration:
        """How a Q-network policy explores (meaningless for actor policies)."""
        return self._exploration

    @property
    def epsilon(self) -> float:
        """The epsilon-greedy random-action probability, in ``[0, 1]``.

        Settable; setting it on an actor policy raises :class:`~aps.errors.ConfigError`.
        """
        return self._epsilon

    @epsilon.setter
    def epsilon(self, value: float) -> None:
        self._require_q("epsilon")
        self._epsilon = _check_fraction("epsilon", value)

    @property
    def temperature(self) -> float:
        """The Boltzmann temperature, ``> 0``. Settable like :attr:`epsilon`."""
        return self._temperature

    @temperature.setter
    def temperature(self, value: float) -> None:
        self._require_q("temperature")
        self._temperature = _check_temperature(value)

    def behaviour_params(self) -> dict[str, float]:
        """The exploration parameters that shape the behaviour distribution, beside weights.

        ``{"epsilon": ...}`` for an epsilon-greedy Q policy, ``{"temperature": ...}`` for a
        Boltzmann one, ``{}`` for actor policies (their weights say everything). A version of a
        Q policy is its weights plus these: send them along, keep them with stored versions.
        """
        if self._kind != "q":
            return {}
        if self._exploration == "epsilon":
            return {"epsilon": self._epsilon}
        return {"temperature": self._temperature}

    def set_behaviour_params(self, params: Mapping[str, float]) -> None:
        """Set what :meth:`behaviour_params` returned (all keys optional).

        Raises:
            ConfigError: a key this policy does not have, or a value out of range; nothing
                is changed then.
        """
        allowed = set(self.behaviour_params())
        unknown = sorted(set(params) - allowed)
        if unknown:
            raise ConfigError(
                f"unknown behaviour parameters {unknown} for this {self._kind} policy; "
                f"it has {sorted(allowed)}"
            )
        epsilon = _check_fraction("epsilon", params.get("epsilon", self._epsilon))
        temperature = _check_temperature(params.get("temperature", self._temperature))
        self._epsilon, self._temperature = epsilon, temperature

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v}" for k, v in self.behaviour_params().items())
        return (
            f"Policy(kind={self._kind!r}, module={type(self._module).__name__}, "
            f"action_space={self._action_space}, has_critic={self._has_critic}{extra})"
        )

    # -- acting ----------------------------------------------------------------------------

    def seed(self, seed: int) -> None:
        """Seed the private sampling generators (the global RNGs are never touched).

        One generator serves the torch path of :meth:`act` and one the NumPy path. Both are
        seeded, so a seed fixes the actions whichever path acts; the two paths draw
        different actions from the same seed.

        Raises:
            ConfigError: ``seed`` is not an int torch accepts.
        """
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"seed must be an int, got {seed!r}")
        try:
            self._generator.manual_seed(seed)
        except RuntimeError as exc:
            raise ConfigError(f"seed {seed} is out of torch's range: {exc}") from exc
        self._rng = np.random.default_rng(seed % 2**64)  # torch also takes negative seeds

    def act(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Sample one action per observation from the behaviour policy, without gradients.

        Args:
            obs: observations ``[B, *observation_space.shape]``, ``B >= 1``, any numeric dtype
                (converted to the module's float dtype; the array is not modified).

        Returns:
            ``(actions, log_probs, values)``:

            - actions: ``[B]`` int64 for ``Discrete`` (offset by the space's ``start``), or
              ``[B, *action_space.shape]`` float32 for ``Box``. Box actions are the raw
              Gaussian samples, not clipped to the bounds (as in CleanRL, whose envs clip
              with ``ClipAction``); clip a copy before stepping an env that needs it.
            - log_probs: ``[B]`` float32, the log-probability of each action under the
              behaviour policy (for Q policies, under the epsilon-greedy or Boltzmann
              distribution; for Box, of the unclipped sample, summed over dimensions).
            - values: ``[B]`` float32 from the critic, or ``None`` without a critic.

        Raises:
            ConfigError: ``obs`` has the wrong shape, or the actor gave NaN action
                probabilities (NaN or inf in the weights or observations).
        """
        if self._recurrent:
            raise ConfigError(
                f"{type(self._module).__name__} is recurrent: act with act_recurrent(obs, "
                "state, episode_start), which takes and returns its state"
            )
        heads = self._numpy_heads()
        if heads is not None:
            return heads.act(self._checked(obs, leading=1), self._rng)
        return self._sample(self._observations(obs, leading=1))

    def _sample(self, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """:meth:`act`'s torch path on the heads' inputs ``x`` (observations or features)."""
        with torch.no_grad():
            if self._kind == "gaussian":
                mean, log_std = self._gaussian(x)
                noise = torch.randn(mean.shape, generator=self._generator, dtype=mean.dtype)
                sample = mean + log_std.exp() * noise
                log_prob = (-0.5 * noise.square() - log_std - LOG_SQRT_2PI).sum(-1)
                shape = (sample.shape[0], *(self._action_space.shape or ()))
                actions = sample.to(torch.float32).reshape(shape).numpy()
            else:
                log_probs = self._categorical(x)
                check_no_nan(log_probs.float().numpy(), self._module)  # float: bfloat16
                index = torch.multinomial(log_probs.exp(), 1, generator=self._generator)
                log_prob = log_probs.gather(1, index).squeeze(1)
                start = int(self._action_space.start)  # type: ignore[attr-defined]
                actions = (index.squeeze(1) + start).to(torch.int64).numpy()
            values = None
            if self._has_critic:
                values = self._values(x).numpy()
        return actions, log_prob.to(torch.float32).numpy(), values

    def initial_state(self, batch_size: int) -> tuple[np.ndarray, ...]:
        """The zero state of a recurrent policy for ``batch_size`` envs, as float arrays.

        Each array has the batch axis at axis 1 (``[layers, batch_size, hidden]`` for an
        ``nn.LSTM``'s ``h`` and ``c``); a GRU's single tensor is a tuple of one array.

        Raises:
            ConfigError: the policy is not recurrent, or the agent's zero state is not a
                tensor or tuple of float tensors with the batch on axis 1.
        """
        if not self._recurrent:
            raise ConfigError(f"{type(self._module).__name__} is not recurrent: it has no state")
        return tuple(t.to(torch.float32).cpu().numpy() for t in self._zero_state(batch_size))

    def act_recurrent(
        self, obs: np.ndarray, state: tuple[np.ndarray, ...], episode_start: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, tuple[np.ndarray, ...]]:
        """:meth:`act` for a recurrent policy: one step from ``state``, without gradients.

        Args:
            obs: observations ``[B, *observation_space.shape]``.
            state: the state before this step, as :meth:`initial_state` shapes it for ``B``.
            episode_start: ``[B]`` bools, true where ``obs`` is the first observation of an
                episode: the agent zeroes those envs' state before acting (``done`` of
                ``get_states``).

        Returns:
            ``(actions, log_probs, values, new_state)``: the first three as :meth:`act` returns
            them, ``new_state`` float32 arrays shaped like ``state``.

        Raises:
            ConfigError: the policy is not recurrent, or shapes that do not fit.
        """
        if not self._recurrent:
            raise ConfigError(f"{type(self._module).__name__} is not recurrent: act with act()")
        x = self._observations(obs, leading=1)
        with torch.no_grad():
            features, new_state = self._features(x, state, np.asarray(episode_start))
        actions, log_prob, values = self._sample(features)
        new = tuple(t.to(torch.float32).cpu().numpy() for t in new_state)
        return actions, log_prob, values, new

    def log_prob(self, obs: np.ndarray, actions: np.ndarray) -> torch.Tensor:
        """Log-probabilities of ``actions`` at ``obs`` under this policy, WITH gradients.

        For policy-gradient estimators: ``log_prob(...)`` is differentiable with respect to
        the module's parameters. Box actions are the raw (unclipped) samples.

        Args:
            obs: observations ``[B, *observation_space.shape]``.
            actions: ``[B]`` integer actions (``Discrete``) or ``[B, *action_space.shape]``.

        Returns:
            A float tensor ``[B]`` (summed over action dimensions for Box).

        Raises:
            ConfigError: shapes that do not fit, or a recurrent policy (not supported).
        """
        if self._recurrent:
            raise ConfigError(
                f"log_prob of the recurrent {type(self._module).__name__} needs its state: "
                "gradient rounds take feed-forward policies only"
            )
        x = self._observations(obs, leading=1)
        batch = _first_leaf(x).shape[0]
        if self._kind == "gaussian":
            mean, log_std = self._gaussian(x)
            a = torch.as_tensor(np.asarray(actions), dtype=mean.dtype).reshape(batch, -1)
            if a.shape != mean.shape:
                raise ConfigError(
                    f"actions of shape {tuple(a.shape)} do not fit means {tuple(mean.shape)}"
                )
            z = (a - mean) / log_std.exp()
            return (-0.5 * z.square() - log_std - LOG_SQRT_2PI).sum(-1)
        index = np.asarray(actions).reshape(-1).astype(np.int64)
        if index.shape[0] != batch:
            raise ConfigError(f"got {index.shape[0]} actions for {batch} observations")
        start = int(self._action_space.start)  # type: ignore[attr-defined]
        log_probs = self._categorical(x)
        return log_probs.gather(1, torch.as_tensor(index - start)[:, None]).squeeze(1)

    def env_actions(self, actions: np.ndarray) -> np.ndarray:
        """The actions to hand the env: Box samples clipped to the space's bounds (a copy).

        :meth:`act` returns unbounded Gaussian samples because their log-probabilities are
        of them; an env gets them clipped, as CleanRL's ``ClipAction`` wrapper does. Other
        actions are returned as they are.
        """
        space = self._action_space
        if isinstance(space, spaces.Box):
            clipped: np.ndarray = np.clip(actions, space.low, space.high)
            return clipped
        return actions

    # -- comparing -------------------------------------------------------------------------

    def kl(
        self,
        other: Policy,
        obs: np.ndarray,
        *,
        max_states: int | None = 1024,
        state: tuple[np.ndarray, ...] | None = None,
        episode_start: np.ndarray | None = None,
    ) -> float:
        """Mean over states of ``KL(self(.|s) || other(.|s))``, in nats, in closed form.

        ``self`` is the behaviour policy (the version a worker acted with) and ``other`` the
        learner's current one, the direction APS uses. Per state:

        - categorical: ``sum_a p0(a) (log p0(a) - log p1(a))`` from ``log_softmax`` of the
          logits;
        - Gaussian: ``sum_d [log(s1/s0) + (s0^2 + (m0 - m1)^2) / (2 s1^2) - 1/2]``;
        - Q policies: the categorical KL of the two behaviour distributions (epsilon-greedy:
          ``epsilon/n`` on every action plus ``1 - epsilon`` on the first argmax; Boltzmann:
          ``softmax(Q / temperature)``), each with its own parameters. With ``epsilon == 0``
          on both sides, a state whose argmax differs has infinite KL, so the mean is
          ``inf``.

        Cost: one forward pass of each policy over at most ``max_states`` states, no gradients.
        When there are more states than that, an evenly spaced, deterministic subsample of
        ``max_states`` of them (the first and the last included) is used.

        A recurrent policy's action distribution depends on its state, so the states are the
        steps of a chunk: ``obs`` ``[T, E, ...]``, ``episode_start`` ``[T, E]`` and ``state``
        (the chunk's initial state, batch axis 1 = ``E``) are replayed through each policy's
        ``get_states`` from that same initial state, and the KL is averaged over the ``T x E``
        steps. Subsampling keeps whole envs (an evenly spaced ``max(1, max_states // T)`` of
        them), so at most ``max(max_states, T)`` steps are evaluated. Both policies start from
        the state the worker's policy had: the learner's newest version never acted there, and
        the state it would have reached cannot be known without replaying from each episode's
        start.

        Args:
            other: a policy of the same kind over the same spaces.
            obs: observations ``[..., *observation_space.shape]`` with at least one state;
                leading dimensions (``[T, E]`` for a chunk) are flattened. Exactly ``[T, E,
                ...]`` for a recurrent policy.
            max_states: the most states to evaluate; ``None`` for all of them.
            state: a recurrent policy's state before the first step, for the ``E`` envs
                (required for a recurrent policy, refused otherwise).
            episode_start: ``[T, E]`` bools, where the state was zeroed (recurrent only).

        Returns:
            The mean KL, ``>= 0``; ``0.0`` for identical policies; may be ``inf``.

        Raises:
            ConfigError: ``other`` is of another kind or over other spaces, ``obs`` has the
                wrong shape or no state, ``max_states`` is not ``None`` or an int >= 1, or
                ``state`` and ``episode_start`` are missing for a recurrent policy (or given
                for another).
        """
        if not isinstance(other, Policy):
            raise ConfigError(f"kl compares two Policy objects, got {type(other).__name__}")
        if max_states is not None and (
            isinstance(max_states, bool) or not isinstance(max_states, int) or max_states < 1
        ):
            raise ConfigError(f"max_states must be None or an int >= 1, got {max_states!r}")
        if (
            other._kind != self._kind
            or other._action_space != self._action_space
            or other._obs_shape != self._obs_shape
            or (self._structured and other._observation_space != self._observation_space)
        ):
            raise ConfigError(
                f"cannot compare a {self._kind} policy over {self._action_space} with a "
                f"{other._kind} policy over {other._action_space}; KL needs two versions of "
                "the same agent"
            )
        if (
            self._recurrent != other._recurrent
            or self._recurrent != (state is not None)
            or ((state is None) != (episode_start is None))
        ):
            raise ConfigError(
                "kl of recurrent policies needs state= and episode_start= (a chunk's initial "
                "state and episode starts), and those of feed-forward policies takes neither; "
                f"got a {'recurrent' if self._recurrent else 'feed-forward'} policy, a "
                f"{'recurrent' if other._recurrent else 'feed-forward'} one, state "
                f"{'given' if state is not None else 'None'} and episode_start "
                f"{'given' if episode_start is not None else 'None'}"
            )
        with torch.no_grad():
            if state is not None and episode_start is not None:
                x0, x1 = self._replayed(other, obs, state, episode_start, max_states)
            else:
                flat = self._flatten(obs)
                states = _first_leaf(flat).shape[0]
                if max_states is not None and states > max_states:
                    index = np.linspace(0, states - 1, num=max_states).astype(np.int64)
                    # A structured observation is subsampled array by array, at one index.
                    flat = map_arrays(lambda a: a[index], flat)
                x0 = self._to_tensor(flat)
                x1 = other._to_tensor(flat)
            if self._kind == "gaussian":
                m0, l0 = (t.double() for t in self._gaussian(x0))
                m1, l1 = (t.double() for t in other._gaussian(x1))
                per_state = (
                    (l1 - l0) + ((2 * l0).exp() + (m0 - m1).square()) / (2 * (2 * l1).exp()) - 0.5
                ).sum(-1)
            else:
                p0_log = self._categorical(x0).double()
                p1_log = other._categorical(x1).double()
                p0 = p0_log.exp()
                terms = torch.where(p0 > 0, p0 * (p0_log - p1_log), torch.zeros_like(p0))
                per_state = terms.sum(-1)
            mean = float(per_state.mean())
        return max(mean, 0.0)  # rounding may leave a tiny negative for near-equal policies

    # -- weights ---------------------------------------------------------------------------

    def get_weights(self, *, copy: bool = True) -> dict[str, np.ndarray]:
        """The module's ``state_dict`` as numpy arrays.

        Args:
            copy: ``True`` gives C-contiguous copies. ``False`` gives views of the tensors
                where they are on the CPU (copies elsewhere), valid only until the module
                changes: for a caller that copies them at once (a publish encodes them).

        Returns:
            ``{name: array}`` with the ``state_dict`` names and order, each array with the
            tensor's own dtype and shape, buffers included.

        Raises:
            ConfigError: a tensor has a dtype numpy lacks (``bfloat16``); convert the module
                to float32 first.
        """
        weights: dict[str, np.ndarray] = {}
        for name, tensor in self._module.state_dict().items():
            if numpy_dtype(tensor.dtype) is None:
                raise ConfigError(
                    f"weight {name!r} has dtype {tensor.dtype}, which numpy cannot hold; "
                    "convert the module to float32 (module.float()) before publishing it"
                )
            tensor = tensor.detach()
            if copy:
                # The copy is made by torch and viewed by numpy. np.array(..., copy=True)
                # would allocate through numpy, which advises transparent huge pages for
                # large arrays: on virtual machines that return free memory to their host,
                # first-touch huge pages made a 40 MB snapshot take about 100 ms, not 15-30.
                tensor = tensor.to("cpu", copy=True, memory_format=torch.contiguous_format)
            weights[name] = tensor.cpu().numpy()
        return weights

    def set_weights(
        self, weights: Mapping[str, np.ndarray], *, share: bool = False, widen: bool = False
    ) -> None:
        """Load arrays from :meth:`get_weights` (of any module built by the same factory).

        The round trip is exact: same names, shapes, dtypes and bits. Everything is checked
        before anything is written, so a refused dict leaves the module unchanged. Read-only
        arrays (decoded from the wire) are fine; they are copied into the module's tensors.

        Args:
            weights: ``{name: array}`` as :meth:`get_weights` returns it.
            share: the module's CPU parameters and buffers take the arrays' memory instead
                of a copy of it (tensors elsewhere are copied). For a caller that owns the
                arrays and never changes them, as a worker owns the frame a version came
                in: loading a large policy then copies nothing. The module must not change
                its tensors in place afterwards (acting does not).
            widen: ``float16`` arrays are widened to the module's float dtype where it is
                wider (weights that travelled compact, see :func:`compact_weights`); every
                other dtype must still match exactly.

        Raises:
            ConfigError: missing or unexpected names, a value that is not an array, or a
                shape or dtype that differs from the module's (no casting beyond ``widen``);
                the message lists them.
        """
        if widen:
            weights = widened(weights, self._module.state_dict())
        state = self._module.state_dict()
        problems: list[str] = []
        missing = [name for name in state if name not in weights]
        unexpected = [name for name in weights if name not in state]
        if missing:
            problems.append(f"missing {_names(missing)}")
        if unexpected:
            problems.append(f"unexpected {_names(unexpected)}")
        for name, tensor in state.items():
            array: object = weights.get(name)
            if array is None:
                continue
            if not isinstance(array, np.ndarray):
                problems.append(f"{name!r} is a {type(array).__name__}, not a numpy array")
                continue
            if array.shape != tuple(tensor.shape):
                problems.append(
                    f"{name!r} has shape {array.shape}, the module's is {tuple(tensor.shape)}"
                )
            expected = numpy_dtype(tensor.dtype)
            if array.dtype != expected:
                problems.append(f"{name!r} has dtype {array.dtype}, the module's is {expected}")
        if problems:
            raise ConfigError(
                f"cannot load weights into {type(self._module).__name__}: "
                + "; ".join(problems)
                + "; weights must come from get_weights of the same agent"
            )
        live: dict[str, torch.Tensor] = {}
        if share or self._shared:
            live.update(self._module.named_parameters(remove_duplicate=False))
            live.update(self._module.named_buffers(remove_duplicate=False))
        with torch.no_grad():
            for name, tensor in state.items():
                array = weights[name]
                target = live.get(name)
                if target is not None and target.device.type == "cpu":
                    if not share:
                        # The tensors still hold shared (read-only) memory: give them their
                        # own again rather than writing into it.
                        array = np.array(array, order="C")
                    with warnings.catch_warnings():
                        # Read-only arrays (views of a received frame): torch warns that it
                        # could write them, which acting never does.
                        warnings.simplefilter("ignore", UserWarning)
                        target.data = torch.from_numpy(array)
                elif tensor.device.type == "cpu":
                    np.copyto(tensor.numpy(), array, casting="no")
                else:
                    tensor.copy_(torch.tensor(array))
        self._shared = share
        # Rebuilt now, not at the next act: the NumPy heads' views of replaced tensors
        # would keep the memory they came in (a whole weights frame) alive until then.
        self._numpy_heads()

    def clone(self) -> Policy:
        """An independent copy, for the learner's scratch copy that loads old versions.

        The module is deep-copied; the spaces and exploration parameters are the same, and
        the generator starts in the same state (so both sample the same actions next).
        """
        twin = copy.copy(self)
        twin._module = copy.deepcopy(self._module)  # its own memory, even if ours is shared
        twin._shared = False
        twin._generator = torch.Generator()
        twin._generator.set_state(self._generator.get_state())
        twin._rng = copy.deepcopy(self._rng)
        twin._heads = twin._build_heads() if self._inference == "auto" else None
        return twin

    # -- internals -------------------------------------------------------------------------

    def _require_q(self, name: str) -> None:
        if self._kind != "q":
            raise ConfigError(
                f"{name} applies to Q-network policies only; this policy is {self._kind}"
            )

    def _build_heads(self) -> NumpyHeads | None:
        if self._recurrent:
            return None  # the heads take the state's features: torch runs get_states anyway
        return NumpyHeads.of(
            self._module,
            self._kind,
            has_critic=self.has_critic,
            action_space=self.action_space,
            flat_obs=bool(self._obs_shape) and not self._structured,
        )

    def _numpy_heads(self) -> NumpyHeads | None:
        """The NumPy heads to act with now, or ``None`` for torch.

        They are rebuilt when a head, layer or parameter of theirs was replaced (a
        ``set_weights(share=True)``, a ``module.to(...)``); the module is then examined
        again, and if it no longer qualifies, torch acts from then on. A hook makes torch
        act for as long as it is registered.
        """
        heads = self._heads
        if heads is None:
            return None
        if not heads.current():
            heads = self._heads = self._build_heads()
            if heads is None:
                return None
        return None if heads.hooked() else heads

    def _gaussian(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Means and log-stds ``[B, D]`` on the CPU."""
        mean = _call(self._module, "actor_mean", x)
        log_std = _attr(self._module, "actor_logstd")
        return mean.cpu(), log_std.expand_as(mean).cpu()

    def _categorical(self, x: torch.Tensor) -> torch.Tensor:
        """Log-probabilities ``[B, n]`` on the CPU (``-inf`` for impossible actions)."""
        if self._kind == "categorical":
            return torch.log_softmax(_call(self._module, "actor", x).cpu(), dim=-1)
        q = self._module(x).cpu()
        if self._exploration == "boltzmann":
            return torch.log_softmax(q / self._temperature, dim=-1)
        n = q.shape[-1]
        probs = torch.full_like(q, self._epsilon / n)
        greedy = q.argmax(dim=-1, keepdim=True)
        probs.scatter_add_(1, greedy, torch.full_like(greedy, 1.0 - self._epsilon, dtype=q.dtype))
        return probs.log()

    def _values(self, x: torch.Tensor) -> torch.Tensor:
        return _call(self._module, "critic", x).reshape(-1).to(torch.float32).cpu()

    def _probe(self) -> None:
        """Run the heads once on zeros and check the output shapes; modes are restored."""
        modes = [(m, m.training) for m in self._module.modules()]
        batch: Any = np.zeros((_PROBE_BATCH, *self._obs_shape), dtype=np.float32)
        if self._structured:
            batch = map_arrays(
                lambda a: np.zeros(a.shape, np.float32),
                empty_batch(self._observation_space, (_PROBE_BATCH,)),
            )
        what = type(self._module).__name__
        try:
            self._module.eval()
            x = self._to_tensor(batch)
            with torch.no_grad():
                if self._recurrent:
                    zeros = tuple(t.numpy() for t in self._zero_state(_PROBE_BATCH, cpu=True))
                    x, _ = self._features(x, zeros, np.ones(_PROBE_BATCH, dtype=bool))
                outputs = self._probe_outputs(x)
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(
                f"running {what} ({self._kind} policy) on a batch of {_PROBE_BATCH} "
                f"observations of shape {self._obs_shape} raised {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            for module, training in modes:
                module.training = training
        for head, shape, expected in outputs:
            if shape != expected:
                raise ConfigError(
                    f"{what}.{head} returned shape {list(shape)} for a batch of "
                    f"{_PROBE_BATCH} observations; a {self._kind} policy over "
                    f"{self._action_space} needs {list(expected)}"
                )

    def _probe_outputs(self, x: torch.Tensor) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
        b = _PROBE_BATCH
        outputs: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
        if self._kind == "gaussian":
            dims = math.prod(self._action_space.shape or ())
            mean = _call(self._module, "actor_mean", x)
            outputs.append(("actor_mean", tuple(mean.shape), (b, dims)))
            log_std = _attr(self._module, "actor_logstd")
            if not isinstance(log_std, torch.Tensor):
                raise ConfigError(
                    f"{type(self._module).__name__}.actor_logstd is a "
                    f"{type(log_std).__name__}; a Gaussian policy needs a tensor (an "
                    f"nn.Parameter of shape [1, {dims}])"
                )
            try:
                log_std.expand_as(mean)
            except RuntimeError:
                outputs.append(("actor_logstd", tuple(log_std.shape), (1, dims)))
        else:
            n = int(self._action_space.n)  # type: ignore[attr-defined]
            head = "actor" if self._kind == "categorical" else "forward"
            out = (
                _call(self._module, "actor", x) if self._kind == "categorical" else self._module(x)
            )
            if not isinstance(out, torch.Tensor):
                raise ConfigError(
                    f"{type(self._module).__name__}.{head} returned {type(out).__name__}, "
                    f"not a tensor of shape [batch, {n}]"
                )
            outputs.append((head, tuple(out.shape), (b, n)))
        if self._has_critic:
            value = _call(self._module, "critic", x)
            shape = tuple(value.shape)
            outputs.append(("critic", shape, shape if value.numel() == b else (b, 1)))
        return outputs


def _detect_kind(module: nn.Module, action_space: gym.Space[Any]) -> PolicyKind:
    what = type(module).__name__
    has = {name for name in ("actor", "actor_mean", "actor_logstd") if hasattr(module, name)}
    supported = (
        "aps.policy supports a categorical actor (actor -> logits) or a Q-network "
        "(module(obs) -> Q-values) over Discrete, and a Gaussian actor (actor_mean, "
        "actor_logstd) over a float Box"
    )
    if isinstance(action_space, spaces.Discrete):
        if "actor_mean" in has or "actor_logstd" in has:
            raise ConfigError(
                f"{what} has a Gaussian head ({', '.join(sorted(has))}) but the action space "
                f"is {action_space}; {supported}"
            )
        return "categorical" if "actor" in has else "q"
    if isinstance(action_space, spaces.Box) and np.issubdtype(action_space.dtype, np.floating):
        if {"actor_mean", "actor_logstd"} <= has:
            return "gaussian"
        found = f"found {', '.join(sorted(has))}" if has else "found no actor head"
        raise ConfigError(
            f"{what} over the action space {action_space}: {found}; a Box action space "
            f"needs both actor_mean and actor_logstd; {supported}"
        )
    raise ConfigError(f"the action space {action_space} is not supported; {supported}")


def _call(module: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    out = _attr(module, name)(x)
    if not isinstance(out, torch.Tensor):
        raise ConfigError(
            f"{type(module).__name__}.{name} returned {type(out).__name__}, not a tensor"
        )
    return out


def _names(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"{shown}{more}"
