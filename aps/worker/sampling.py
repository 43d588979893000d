"""Worker-side policy gradients: sample trajectories at a point and report REINFORCE sums.

:class:`GradientSampler` is plain synchronous code: the worker's event loop calls
:meth:`GradientSampler.start` on each :class:`~aps.wire.messages.GradientRound` and
:meth:`GradientSampler.step` between reads of its connection. One call steps every env once;
when trajectories end (termination, truncation, or ``horizon`` steps) their gradients are
summed into one :class:`~aps.wire.messages.GradientReport`. The workers and the virtual-time
simulator (:mod:`aps.learner.simulate`) share it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from gymnasium.vector import AutoresetMode, VectorEnv

from aps.errors import ConfigError, ProtocolError
from aps.wire.messages import GradientReport, GradientRound

__all__ = ["GradientSampler"]


class GradientSampler:
    """Samples trajectories with the broadcast policy and computes g_H at the same point.

    Every trajectory starts at an env reset (a round resets every env) and lasts until the
    env terminates or truncates, or for ``horizon`` steps, whichever comes first: the
    estimator ``g_H = sum_t (sum_{h>=t} gamma^h r_h) grad log pi(a_t|s_t)`` assumes exactly
    that. The envs must autoreset in ``SameStep`` mode, so every step is a real transition.

    Args:
        envs: the worker's vector env.
        policy: an :class:`aps.policy.Policy` (torch).
    """

    def __init__(self, envs: VectorEnv[Any, Any, Any], policy: Any) -> None:
        if envs.metadata.get("autoreset_mode") is not AutoresetMode.SAME_STEP:
            raise ConfigError(
                "policy-gradient rounds need envs that autoreset in the same step; create the "
                "learner with autoreset_mode='SameStep'"
            )
        self._envs = envs
        self._policy = policy
        self._round: GradientRound | None = None
        self._obs: np.ndarray[Any, Any] | None = None
        n = envs.num_envs
        self._traj_obs: list[list[np.ndarray[Any, Any]]] = [[] for _ in range(n)]
        self._traj_actions: list[list[np.ndarray[Any, Any]]] = [[] for _ in range(n)]
        self._traj_rewards: list[list[float]] = [[] for _ in range(n)]

    def start(self, round_: GradientRound) -> None:
        """Load the round's point, drop unfinished trajectories, reset every env.

        Raises:
            ConfigError | ProtocolError: the arrays do not fit the policy, or the round's
                horizon or discount is out of range.
        """
        if not isinstance(round_.arrays, dict):
            raise ProtocolError(f"round arrays must map names to arrays, got {type(round_.arrays)}")
        if round_.horizon < 1:
            raise ConfigError(f"horizon must be >= 1, got {round_.horizon}")
        if not 0.0 <= round_.gamma <= 1.0:
            raise ConfigError(f"gamma must be in [0, 1], got {round_.gamma}")
        self._policy.set_weights(round_.arrays)
        self._round = round_
        self._obs, _ = self._envs.reset()
        for buffers in (self._traj_obs, self._traj_actions, self._traj_rewards):
            for buffer in buffers:
                buffer.clear()

    @property
    def round(self) -> int:
        """The round being sampled (-1 before the first)."""
        return -1 if self._round is None else self._round.round

    def step(self, limit: int | None = None) -> GradientReport | None:
        """Step every env once; return the report of the trajectories that ended, if any.

        Args:
            limit: report at most this many of the trajectories that ended in this step, the
                first ones in env order; the others are dropped (their envs start afresh like
                every env whose trajectory ended). ``None`` (the default) reports them all.
                Which ones are dropped depends on the env index only, never on a return, so
                the sum stays an unbiased sum of ``limit`` trajectory gradients when the
                episodes have a fixed length (every env ends in the same step). A driver that
                needs exactly ``k`` gradients passes the number still missing.

        Raises:
            ConfigError: ``limit`` is not ``None`` or an int ``>= 1``.
        """
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, int) or limit < 1
        ):
            raise ConfigError(f"limit must be None or an int >= 1, got {limit!r}")
        round_ = self._round
        assert round_ is not None, "start() a round first"
        if self._obs is None:  # after sample(): every env starts afresh
            self._obs, _ = self._envs.reset()
        obs = self._obs
        actions, _, _ = self._policy.act(obs)
        # Record the states acted on before stepping: the vector env reuses its observation
        # buffer, so ``obs`` changes in place when it steps.
        for env in range(self._envs.num_envs):
            self._traj_obs[env].append(obs[env].copy())
        next_obs, reward, terminated, truncated, _ = self._envs.step(
            self._policy.env_actions(actions)
        )
        ended: list[int] = []
        for env in range(self._envs.num_envs):
            self._traj_actions[env].append(actions[env])
            self._traj_rewards[env].append(float(reward[env]))
            if terminated[env] or truncated[env] or len(self._traj_rewards[env]) >= round_.horizon:
                ended.append(env)
        cut = np.zeros(self._envs.num_envs, dtype=bool)
        for env in ended:
            cut[env] = not (terminated[env] or truncated[env])
        self._obs = self._restart(cut, next_obs)
        if limit is not None and len(ended) > limit:
            for env in ended[limit:]:
                self._traj_obs[env].clear()
                self._traj_actions[env].clear()
                self._traj_rewards[env].clear()
            ended = ended[:limit]
        if not ended:
            return None
        trajectories = []
        for env in ended:
            trajectories.append(
                (
                    np.stack(self._traj_obs[env]),
                    np.stack(self._traj_actions[env]),
                    np.asarray(self._traj_rewards[env], dtype=np.float64),
                )
            )
            self._traj_obs[env].clear()
            self._traj_actions[env].clear()
            self._traj_rewards[env].clear()
        return self._report(trajectories)

    def _restart(self, cut: npt.NDArray[np.bool_], next_obs: Any) -> Any:
        """``next_obs``, with the envs in ``cut`` started afresh.

        Those envs reached the horizon without their episode ending, so their next
        trajectory starts from a reset.
        """
        if not cut.any():
            return next_obs
        reset_obs, _ = self._envs.reset(options={"reset_mask": cut})
        return np.where(cut.reshape(-1, *([1] * (next_obs.ndim - 1))), reset_obs, next_obs)

    def _report(self, trajectories: Sequence[tuple[Any, Any, Any]]) -> GradientReport:
        """The sum of these ``(obs, actions, rewards)`` trajectories' gradients at the point.

        One forward pass over all their steps and one backward pass over the sum of their
        REINFORCE surrogates.
        """
        import torch

        from aps.pg.reinforce import surrogate

        round_ = self._round
        assert round_ is not None, "start() a round first"
        log_probs = self._policy.log_prob(
            np.concatenate([obs for obs, _, _ in trajectories]),
            np.concatenate([actions for _, actions, _ in trajectories]),
        )
        module = self._policy.module
        module.zero_grad(set_to_none=True)
        total: Any = 0.0
        offset = 0
        for _, _, rewards in trajectories:
            piece = log_probs[offset : offset + len(rewards)]
            total = total + surrogate(piece, rewards, round_.gamma)
            offset += len(rewards)
        assert isinstance(total, torch.Tensor)
        total.backward()  # type: ignore[no-untyped-call]
        return GradientReport(
            round=round_.round,
            gradient={
                name: parameter.grad.detach().cpu().numpy().copy()
                for name, parameter in module.named_parameters()
                if parameter.grad is not None
            },
            count=len(trajectories),
            episode_return=np.asarray(
                [float(rewards.sum()) for _, _, rewards in trajectories], dtype=np.float64
            ),
        )

    def sample(self, counts: Sequence[int]) -> list[GradientReport | None]:
        """Sample ``sum(counts)`` trajectories at the round's point: one report per group.

        The batch form of :meth:`step` for a driver that knows in advance how many
        trajectories it needs (the virtual-time simulator, where every worker that samples
        this env samples at the same broadcast point). Every env starts afresh (a reset) and
        is given a *quota*, fixed before any step: the ``C = sum(counts)`` trajectories are
        spread over ``min(C, num_envs)`` envs as evenly as possible, and an env runs exactly
        its quota of consecutive trajectories, then idles (it is still stepped with the
        others, its transitions are ignored) until every env met its quota. Every trajectory
        started is kept, so none is selected by its length or return: with episodes that end
        early (Hopper) a fast-ending env does not produce extra trajectories, and the sum is
        an unbiased sum of ``C`` i.i.d. trajectory gradients at the point.

        Trajectories go to groups by a fixed order of ``(k-th trajectory of an env, env)``
        set before sampling: group 0 gets the first ``counts[0]``, group 1 the next
        ``counts[1]``, and so on. Each group's gradients are summed and differentiated
        apart, so report ``g`` holds exactly ``counts[g]`` gradients.

        Args:
            counts: trajectories per group, ints ``>= 0``.

        Returns:
            One report per group, ``None`` for a count of 0.

        Raises:
            ConfigError: a count that is not an int ``>= 0``.
        """
        checked: list[int] = []
        for count in counts:
            if isinstance(count, bool) or not isinstance(count, int | np.integer) or count < 0:
                raise ConfigError(f"counts must be ints >= 0, got {count!r} in {list(counts)}")
            checked.append(int(count))
        round_ = self._round
        assert round_ is not None, "start() a round first"
        total = sum(checked)
        reports: list[GradientReport | None] = [None] * len(checked)
        if total == 0:
            return reports
        n = self._envs.num_envs
        used = min(n, total)
        quota = np.zeros(n, dtype=np.int64)
        quota[:used] = total // used
        quota[: total % used] += 1
        # The fixed order of trajectories, (k, env) -> group, decided before any step.
        group_of: dict[tuple[int, int], int] = {}
        order = [(k, env) for k in range(int(quota.max())) for env in range(used) if k < quota[env]]
        bounds = np.cumsum(checked)
        for index, key in enumerate(order):
            group_of[key] = int(np.searchsorted(bounds, index, side="right"))
        for buffers in (self._traj_obs, self._traj_actions, self._traj_rewards):
            for buffer in buffers:
                buffer.clear()
        obs, _ = self._envs.reset()
        active = quota > 0
        done = np.zeros(n, dtype=np.int64)
        begin = np.zeros(n, dtype=np.int64)
        step_obs: list[np.ndarray[Any, Any]] = []
        step_actions: list[np.ndarray[Any, Any]] = []
        step_rewards: list[np.ndarray[Any, Any]] = []
        # (group, env, first step, end step) of every trajectory, in the order they ended.
        trajectories: list[tuple[int, int, int, int]] = []
        t = 0
        while active.any():
            actions, _, _ = self._policy.act(obs)
            # Copies: the vector env reuses its observation buffer.
            step_obs.append(np.array(obs, copy=True))
            step_actions.append(np.array(actions, copy=True))
            next_obs, reward, terminated, truncated, _ = self._envs.step(
                self._policy.env_actions(actions)
            )
            step_rewards.append(np.asarray(reward, dtype=np.float64).copy())
            over = np.asarray(terminated) | np.asarray(truncated)
            ended = active & (over | (t + 1 - begin >= round_.horizon))
            next_obs = self._restart(ended & ~over, next_obs)
            for slot in map(int, np.flatnonzero(ended)):
                trajectories.append(
                    (group_of[(int(done[slot]), slot)], slot, int(begin[slot]), t + 1)
                )
                done[slot] += 1
                begin[slot] = t + 1
                if done[slot] >= quota[slot]:
                    active[slot] = False
            obs = next_obs
            t += 1
        all_obs, all_actions = np.stack(step_obs), np.stack(step_actions)
        all_rewards = np.stack(step_rewards)
        for group in range(len(checked)):
            mine = [
                (all_obs[a:b, env], all_actions[a:b, env], all_rewards[a:b, env])
                for owner, env, a, b in trajectories
                if owner == group
            ]
            if mine:
                reports[group] = self._report(mine)
        # The envs are mid-trajectory or idle: a later step() starts from a reset.
        self._obs = None
        return reports
