"""An env and an agent whose returns reveal the policy that sampled them (NIGT tests).

:class:`Reveal` pays the action as reward and truncates after ``length`` steps, and its
observation is always zero; :class:`MeanAgent`'s actions are Gaussian around a single
trainable bias ``mu`` (the weight multiplies the zero observation, and the log-std is frozen).
So a trajectory's return is ``length * mu`` plus zero-mean noise: the mean return of a round
says at which point the workers sampled, and every NIGT step moves ``mu`` (and nothing else)
by exactly the step length, up when the gradient is an ascent direction.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces
from torch import nn


class Reveal(gym.Env[np.ndarray, np.ndarray]):
    """Reward = the action; observation 0; truncated after ``length`` steps."""

    def __init__(self, length: int = 3) -> None:
        self.length = length
        self.observation_space = spaces.Box(-1.0, 1.0, (1,), np.float32)
        self.action_space = spaces.Box(-1e6, 1e6, (1,), np.float32)
        self._t = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._t = 0
        return np.zeros(1, np.float32), {}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self._t += 1
        return np.zeros(1, np.float32), float(action[0]), False, self._t >= self.length, {}


class MeanAgent(nn.Module):
    """A Gaussian actor with one trainable parameter that matters: the mean's bias ``mu``."""

    def __init__(self, *spaces: Any, log_std: float = 0.0) -> None:
        super().__init__()
        self.actor_mean = nn.Linear(1, 1)
        nn.init.zeros_(self.actor_mean.weight)
        nn.init.zeros_(self.actor_mean.bias)
        self.actor_logstd = nn.Parameter(torch.full((1, 1), log_std), requires_grad=False)

    @property
    def mu(self) -> float:
        return float(self.actor_mean.bias.detach()[0])
