"""Worker-side policy gradients: sample trajectories at a point and report REINFORCE sums.

:class:`GradientSampler` is plain synchronous code: the worker's event loop calls
:meth:`GradientSampler.start` on each :class:`~aps.messages.GradientRound` and
:meth:`GradientSampler.step` between reads of its connection. One call steps every env once;
when trajectories end (termination, truncation, or ``horizon`` steps) their gradients are
summed into one :class:`~aps.messages.GradientReport`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv

from aps.errors import ConfigError, ProtocolError
from aps.messages import GradientReport, GradientRound

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
        import torch

        from aps.pg.reinforce import surrogate

        round_, obs = self._round, self._obs
        assert round_ is not None and obs is not None, "start() a round first"
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
        if cut.any():
            # Reached the horizon without ending: start that env's next trajectory afresh.
            reset_obs, _ = self._envs.reset(options={"reset_mask": cut})
            next_obs = np.where(cut.reshape(-1, *([1] * (next_obs.ndim - 1))), reset_obs, next_obs)
        self._obs = next_obs
        if limit is not None and len(ended) > limit:
            for env in ended[limit:]:
                self._traj_obs[env].clear()
                self._traj_actions[env].clear()
                self._traj_rewards[env].clear()
            ended = ended[:limit]
        if not ended:
            return None
        module = self._policy.module
        module.zero_grad(set_to_none=True)
        total: Any = 0.0
        returns = []
        for env in ended:
            log_probs = self._policy.log_prob(
                np.stack(self._traj_obs[env]), np.stack(self._traj_actions[env])
            )
            total = total + surrogate(log_probs, np.asarray(self._traj_rewards[env]), round_.gamma)
            returns.append(sum(self._traj_rewards[env]))
            self._traj_obs[env].clear()
            self._traj_actions[env].clear()
            self._traj_rewards[env].clear()
        assert isinstance(total, torch.Tensor)
        total.backward()  # type: ignore[no-untyped-call]
        gradient = {
            name: parameter.grad.detach().cpu().numpy().copy()
            for name, parameter in module.named_parameters()
            if parameter.grad is not None
        }
        return GradientReport(
            round=round_.round,
            gradient=gradient,
            count=len(ended),
            episode_return=np.asarray(returns, dtype=np.float64),
        )
