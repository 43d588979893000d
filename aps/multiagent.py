"""Multi-agent (PettingZoo) envs on a worker: one vector env whose env slots are agents.

A PettingZoo :class:`~pettingzoo.ParallelEnv` steps all its live agents at once with dicts
keyed by agent name. :class:`MultiAgentVectorEnv` hosts ``N`` copies of one as a Gymnasium
:class:`~gymnasium.vector.VectorEnv` of ``N * len(possible_agents)`` slots: slot
``copy * A + k`` is agent ``possible_agents[k]`` of env copy ``copy``. To the learner (and
to a worker's policy in DETACH) every slot is an env like any other, with the agents' shared
single observation and action spaces, so one policy acts for every agent (parameter
sharing), as SuperSuit's vector envs and PufferLib's emulation lay agents out.

Agents leave (they terminate or are truncated) and join (an agent of ``possible_agents``
enters ``env.agents``) within an episode. Which slots hold a live agent is the mask
``info["agent_active"]`` (a bool array, one per slot, with its ``info["_agent_active"]``
mask all True, as Gymnasium lays out vector infos), returned with every observation:

- ``agent_active[i]`` is True when slot ``i``'s observation is a live agent's: the next
  step takes slot ``i``'s action, and that step's reward and flags are its transition.
- A slot returned with ``agent_active[i] == False`` holds no agent: its observation is
  zeros (of the space's dtype, which may lie outside a Box's bounds), its action is ignored
  and the next step gives it reward 0 and neither flag. A learner masks those transitions
  out with the mask it got alongside the observation it acted on.
- An agent's last step has its own reward and ``terminated`` or ``truncated`` as
  PettingZoo reports them; under ``NextStep`` its slot's observation is the agent's last
  one, under ``SameStep`` it is in ``info["final_obs"]`` (and its info in
  ``info["final_info"]``) while the slot shows zeros or the reset's observation.

An env copy whose agents are all gone (``env.agents`` empty) ends and is reset by the
autoreset mode, as Gymnasium's vector envs reset an env: ``NextStep`` on the next step
(every slot of that copy then has reward 0 and neither flag; the reset's agents are
active), ``SameStep`` within the step. Under ``Disabled`` an ended copy's slots stay
inactive (steps leave it alone) until a reset whose ``reset_mask`` marks one of its slots.

Rewards and the flags of each slot are PettingZoo's for that agent (reward 0 and False for
an agent absent from the dicts), per-agent infos are laid out per slot in Gymnasium's
vector layout. All agents must share one observation space and one action space; pad
heterogeneous agents to one (SuperSuit's ``pad_observations_v0`` and
``pad_action_space_v0``) before handing the env over.

PettingZoo is not imported here: a ParallelEnv is recognized by its members
(:func:`is_parallel_env`), so ``aps`` needs PettingZoo only where the env's own code does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space, create_empty_array, iterate

from aps.errors import ConfigError, InvalidState

__all__ = [
    "AGENT_ACTIVE",
    "MultiAgentVectorEnv",
    "agents_per_env",
    "is_parallel_env",
]

AGENT_ACTIVE = "agent_active"
"""The info key of the live-agent mask (see the module docstring)."""

_SUPPORTED = (
    gym.spaces.Box,
    gym.spaces.Discrete,
    gym.spaces.MultiDiscrete,
    gym.spaces.MultiBinary,
    gym.spaces.Dict,
    gym.spaces.Tuple,
)


def is_parallel_env(env: object) -> bool:
    """Whether ``env`` is a PettingZoo ParallelEnv (or acts as one), not a Gymnasium env.

    Recognized by its members: ``possible_agents``, and ``observation_space`` and
    ``action_space`` that are methods taking an agent (a Gymnasium env has them as
    spaces), ``reset`` and ``step``.
    """
    if isinstance(env, gym.Env):
        return False
    try:
        return (
            hasattr(env, "possible_agents")
            and callable(getattr(env, "observation_space", None))
            and callable(getattr(env, "action_space", None))
            and callable(getattr(env, "reset", None))
            and callable(getattr(env, "step", None))
        )
    except Exception:  # a property that raises: not an env we can host
        return False


def agents_per_env(env: Any) -> int:
    """How many slots one copy of the ParallelEnv ``env`` takes: ``len(possible_agents)``.

    Raises:
        ConfigError: ``env`` has no agents, or its agents do not share one observation space
            and one action space (the message names the agents and their spaces).
    """
    agents = _possible_agents(env)
    _shared_spaces(env, agents)
    return len(agents)


def _possible_agents(env: Any) -> list[Any]:
    agents = list(getattr(env, "possible_agents", None) or ())
    if not agents:
        raise ConfigError(
            f"the multi-agent env {type(env).__name__} has no possible_agents "
            f"(got {getattr(env, 'possible_agents', None)!r}); a PettingZoo ParallelEnv must "
            "list every agent that may ever act in possible_agents"
        )
    return agents


def _shared_spaces(env: Any, agents: list[Any]) -> tuple[gym.Space[Any], gym.Space[Any]]:
    """The one observation space and one action space all ``agents`` of ``env`` have."""
    first = agents[0]
    for kind in ("observation_space", "action_space"):
        space_of = getattr(env, kind)
        spaces = {agent: space_of(agent) for agent in agents}
        differ = [agent for agent in agents if spaces[agent] != spaces[first]]
        if differ:
            shown = ", ".join(f"{agent!r}: {spaces[agent]}" for agent in [first, *differ[:3]])
            raise ConfigError(
                f"the agents of {type(env).__name__} do not share one {kind} ({shown}); one "
                "policy acts for every agent (parameter sharing), so pad them to one space "
                "(supersuit's pad_observations_v0 / pad_action_space_v0) or host each kind of "
                "agent in an env of its own"
            )
        if not isinstance(spaces[first], _SUPPORTED):
            raise ConfigError(
                f"the agents of {type(env).__name__} have the {kind} {spaces[first]}; a "
                "multi-agent env's agents need Box, Discrete, MultiDiscrete, MultiBinary, or a "
                "Dict or Tuple of these"
            )
    return env.observation_space(first), env.action_space(first)


class MultiAgentVectorEnv(VectorEnv[Any, Any, Any]):
    """Copies of a PettingZoo ParallelEnv as one vector env of agents (see the module).

    ``num_envs`` is ``len(env_fns) * agents_per_env``; slot ``c * A + k`` is agent ``k`` of
    ``possible_agents`` in copy ``c``.

    Seeds: ``reset(seed=s)`` resets copy ``c`` with ``s + c``; a list of per-slot seeds
    (``num_envs`` of them, as the learner sends) seeds copy ``c`` with its first slot's.
    ``options["reset_mask"]`` (a bool per slot) resets the copies with a marked slot, and
    leaves the others as they are; other options go to each copy's ``reset``.

    ``get_attr`` and ``call`` reach each copy once and give its answer for each of its
    slots; ``set_attr`` with one value per slot sets each copy to its first slot's.

    Args:
        env_fns: one function per copy, each returning a new ParallelEnv.
        autoreset_mode: how ended copies are reset (see the module docstring).
        copy: return a fresh observation array from each call (``False``: the same buffer,
            overwritten by the next call; the worker encodes each result first).

    Raises:
        ConfigError: a function returned no ParallelEnv, the copies' agents differ, or the
            agents do not share their spaces.
    """

    def __init__(
        self,
        env_fns: Sequence[Callable[[], Any]],
        *,
        autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
        copy: bool = True,
    ) -> None:
        if not env_fns:
            raise ConfigError("a multi-agent vector env needs at least one env function")
        self.envs: list[Any] = []
        try:
            for fn in env_fns:
                env = fn()
                self.envs.append(env)
                if not is_parallel_env(env):
                    raise ConfigError(
                        f"a multi-agent vector env hosts PettingZoo ParallelEnvs, but an env "
                        f"function returned {type(env).__name__}; mixing Gymnasium envs and "
                        "ParallelEnvs on one worker is not possible"
                    )
            agents = _possible_agents(self.envs[0])
            for env in self.envs[1:]:
                if list(env.possible_agents) != agents:
                    raise ConfigError(
                        f"the env copies disagree on their agents: {agents!r} and "
                        f"{list(env.possible_agents)!r}; every copy must list the same "
                        "possible_agents in the same order"
                    )
            obs_space, act_space = _shared_spaces(self.envs[0], agents)
        except BaseException:
            self.close_extras()
            raise
        self.autoreset_mode = AutoresetMode(autoreset_mode)
        self.possible_agents = agents
        self.agents_per_env = len(agents)
        self.num_envs = len(self.envs) * self.agents_per_env
        self.single_observation_space = obs_space
        self.single_action_space = act_space
        self.observation_space = batch_space(obs_space, self.num_envs)
        self.action_space = batch_space(act_space, self.num_envs)
        self.metadata = {"autoreset_mode": self.autoreset_mode}
        self.render_mode = None
        self.copy = copy
        self._index = {agent: k for k, agent in enumerate(agents)}
        self._obs = create_empty_array(obs_space, self.num_envs, fn=np.zeros)
        self._active = np.zeros(self.num_envs, dtype=np.bool_)
        self._ended = np.zeros(len(self.envs), dtype=np.bool_)  # all agents gone
        self._started = False

    # -- reset -------------------------------------------------------------------------

    def reset(
        self,
        *,
        seed: int | Sequence[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """Reset the copies (all, or those ``options["reset_mask"]`` marks); see the class.

        Raises:
            ConfigError: a seed list or ``reset_mask`` of another length than ``num_envs``.
        """
        copies: Sequence[int] = range(len(self.envs))
        options = dict(options) if options is not None else None
        mask = None if options is None else options.pop("reset_mask", None)
        if mask is not None:
            mask = np.asarray(mask, dtype=np.bool_)
            if mask.shape != (self.num_envs,):
                raise ConfigError(
                    f"reset_mask must hold one bool per slot ({self.num_envs}), got shape "
                    f"{mask.shape}"
                )
            marked = mask.reshape(len(self.envs), self.agents_per_env).any(axis=1)
            copies = [int(c) for c in np.flatnonzero(marked)]  # the copies a slot marks
        seeds = self._copy_seeds(seed)
        infos: dict[str, Any] = {}
        for c in copies:
            infos = self._reset_copy(c, seeds[c], options or None, infos)
        self._started = True
        return self._result_obs(), self._with_mask(infos)

    def _copy_seeds(self, seed: int | Sequence[int | None] | None) -> list[int | None]:
        count = len(self.envs)
        if seed is None:
            return [None] * count
        if isinstance(seed, int | np.integer):
            return [int(seed) + c for c in range(count)]
        seeds = list(seed)
        if len(seeds) != self.num_envs:
            raise ConfigError(
                f"a list of seeds needs one per slot ({self.num_envs}: {len(self.envs)} copies "
                f"x {self.agents_per_env} agents), got {len(seeds)}; copy c takes slot "
                f"c * {self.agents_per_env}'s seed"
            )
        return [seeds[c * self.agents_per_env] for c in range(count)]

    def _reset_copy(
        self, c: int, seed: int | None, options: dict[str, Any] | None, infos: dict[str, Any]
    ) -> dict[str, Any]:
        env = self.envs[c]
        observations, env_infos = env.reset(seed=seed, options=options)
        self._ended[c] = False
        base = c * self.agents_per_env
        live = set(env.agents)
        for k, agent in enumerate(self.possible_agents):
            slot = base + k
            if agent in live and agent in observations:
                _write(self._obs, slot, observations[agent])
                self._active[slot] = True
                info = env_infos.get(agent) if isinstance(env_infos, dict) else None
                if info:
                    infos = self._add_info(infos, info, slot)
            else:
                _zero(self._obs, slot)
                self._active[slot] = False
        return infos

    # -- step --------------------------------------------------------------------------

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        """Step every copy once with its live agents' actions; see the module docstring.

        Raises:
            InvalidState: the envs were never reset.
        """
        if not self._started:
            raise InvalidState("reset the multi-agent vector env before its first step")
        n = self.agents_per_env
        per_slot = (
            actions
            if isinstance(actions, np.ndarray)
            else list(iterate(self.action_space, actions))
        )
        reward = np.zeros(self.num_envs, dtype=np.float64)
        terminated = np.zeros(self.num_envs, dtype=np.bool_)
        truncated = np.zeros(self.num_envs, dtype=np.bool_)
        infos: dict[str, Any] = {}
        final_obs: np.ndarray[Any, Any] | None = None
        final_info: dict[str, Any] = {}
        final_mask: np.ndarray[Any, Any] | None = None
        mode = self.autoreset_mode
        for c, env in enumerate(self.envs):
            base = c * n
            if self._ended[c]:
                if mode is AutoresetMode.NEXT_STEP:
                    infos = self._reset_copy(c, None, None, infos)
                # Disabled: the copy waits for a reset_mask; its slots stay inactive zeros.
                continue
            live = [agent for agent in env.agents if agent in self._index]
            step_actions = {agent: per_slot[base + self._index[agent]] for agent in live}
            observations, rewards, terms, truncs, env_infos = env.step(step_actions)
            now_live = set(env.agents)
            ended_copy = not now_live
            for k, agent in enumerate(self.possible_agents):
                slot = base + k
                reward[slot] = rewards.get(agent, 0.0)
                term = bool(terms.get(agent, False))
                trunc = bool(truncs.get(agent, False))
                terminated[slot], truncated[slot] = term, trunc
                info = env_infos.get(agent) if isinstance(env_infos, dict) else None
                seen = agent in observations
                if seen:
                    _write(self._obs, slot, observations[agent])
                else:
                    _zero(self._obs, slot)
                self._active[slot] = seen and agent in now_live
                if mode is AutoresetMode.SAME_STEP and (term or trunc):
                    # SameStep: an agent's last observation and info move to final_obs and
                    # final_info, as Gymnasium moves an ended env's.
                    if final_obs is None:
                        final_obs = np.full(self.num_envs, None, dtype=object)
                        final_mask = np.zeros(self.num_envs, dtype=np.bool_)
                    assert final_mask is not None
                    final_obs[slot] = _take(self._obs, slot) if seen else None
                    final_mask[slot] = True
                    if info:
                        final_info = self._add_info(final_info, info, slot)
                    _zero(self._obs, slot)
                elif info:
                    infos = self._add_info(infos, info, slot)
            if ended_copy:
                self._ended[c] = True
                if mode is AutoresetMode.SAME_STEP:
                    infos = self._reset_copy(c, None, None, infos)
        if final_obs is not None:
            assert final_mask is not None
            infos["final_obs"] = final_obs
            infos["_final_obs"] = final_mask
            infos["final_info"] = final_info
            infos["_final_info"] = final_mask.copy()
        return self._result_obs(), reward, terminated, truncated, self._with_mask(infos)

    # -- helpers -----------------------------------------------------------------------

    def _result_obs(self) -> Any:
        return _copied(self._obs) if self.copy else self._obs

    def _with_mask(self, infos: dict[str, Any]) -> dict[str, Any]:
        infos[AGENT_ACTIVE] = self._active.copy()
        infos[f"_{AGENT_ACTIVE}"] = np.ones(self.num_envs, dtype=np.bool_)
        return infos

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """``name`` of each copy, once per slot of that copy."""
        return tuple(
            value for env in self.envs for value in [getattr(env, name)] * self.agents_per_env
        )

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Call ``name`` on each copy once (an attribute is read); its answer per slot."""
        results = []
        for env in self.envs:
            member = getattr(env, name)
            results.append(member(*args, **kwargs) if callable(member) else member)
        return tuple(value for result in results for value in [result] * self.agents_per_env)

    def set_attr(self, name: str, values: Any) -> None:
        """Set ``name`` on every copy.

        ``values`` is one value for all, or one per slot (copy ``c`` takes slot
        ``c * agents_per_env``'s).

        Raises:
            ConfigError: a list or tuple of another length than ``num_envs``.
        """
        if isinstance(values, list | tuple):
            if len(values) != self.num_envs:
                raise ConfigError(
                    f"set_attr({name!r}) needs one value per slot ({self.num_envs}), got "
                    f"{len(values)}"
                )
            per_copy = [values[c * self.agents_per_env] for c in range(len(self.envs))]
        else:
            per_copy = [values] * len(self.envs)
        for env, value in zip(self.envs, per_copy, strict=True):
            setattr(env, name, value)

    def close_extras(self, **kwargs: Any) -> None:
        """Close every copy."""
        for env in getattr(self, "envs", ()):
            with contextlib.suppress(Exception):
                env.close()


def _write(batch: Any, index: int, value: Any) -> None:
    """Put one agent's observation in row ``index`` of the batch (arrays, dicts, tuples)."""
    if isinstance(batch, dict):
        for key, item in batch.items():
            _write(item, index, value[key])
    elif isinstance(batch, tuple):
        for item, part in zip(batch, value, strict=True):
            _write(item, index, part)
    else:
        batch[index] = value


def _zero(batch: Any, index: int) -> None:
    if isinstance(batch, dict):
        for item in batch.values():
            _zero(item, index)
    elif isinstance(batch, tuple):
        for item in batch:
            _zero(item, index)
    else:
        batch[index] = 0


def _take(batch: Any, index: int) -> Any:
    if isinstance(batch, dict):
        return {key: _take(item, index) for key, item in batch.items()}
    if isinstance(batch, tuple):
        return tuple(_take(item, index) for item in batch)
    return np.array(batch[index])


def _copied(batch: Any) -> Any:
    if isinstance(batch, dict):
        return {key: _copied(item) for key, item in batch.items()}
    if isinstance(batch, tuple):
        return tuple(_copied(item) for item in batch)
    return np.array(batch)
