"""CleanRL-shaped agents for tests; workers load them by file path (``tests/agents.py:Agent``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn


def layer_init(layer: nn.Linear, std: float = float(np.sqrt(2)), bias: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias)
    return layer


class Agent(nn.Module):
    """CleanRL's discrete PPO agent: ``Agent(envs)`` with ``actor`` and ``critic`` heads."""

    def __init__(self, envs: Any) -> None:
        super().__init__()
        size = int(np.prod(envs.single_observation_space.shape))
        self.critic = nn.Sequential(
            layer_init(nn.Linear(size, 16)), nn.Tanh(), layer_init(nn.Linear(16, 1), std=1.0)
        )
        self.actor = nn.Sequential(
            layer_init(nn.Linear(size, 16)),
            nn.Tanh(),
            layer_init(nn.Linear(16, int(envs.single_action_space.n)), std=0.01),
        )


class ContinuousAgent(nn.Module):
    """CleanRL's continuous PPO agent: ``actor_mean``, ``actor_logstd`` and ``critic``."""

    def __init__(self, envs: Any) -> None:
        super().__init__()
        size = int(np.prod(envs.single_observation_space.shape))
        actions = int(np.prod(envs.single_action_space.shape))
        self.critic = nn.Sequential(
            layer_init(nn.Linear(size, 16)), nn.Tanh(), layer_init(nn.Linear(16, 1))
        )
        self.actor_mean = nn.Sequential(
            layer_init(nn.Linear(size, 16)), nn.Tanh(), layer_init(nn.Linear(16, actions), std=0.01)
        )
        self.actor_logstd = nn.Parameter(torch.zeros(1, actions))


class QNetwork(nn.Module):
    """CleanRL's DQN network: ``QNetwork(envs)``, forward gives Q-values."""

    def __init__(self, envs: Any) -> None:
        super().__init__()
        size = int(np.prod(envs.single_observation_space.shape))
        self.network = nn.Sequential(
            nn.Linear(size, 16), nn.ReLU(), nn.Linear(16, int(envs.single_action_space.n))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)  # type: ignore[no-any-return]


class WideAgent(Agent):
    """Same heads, other sizes: its weights do not fit :class:`Agent`."""

    def __init__(self, envs: Any) -> None:
        super().__init__(envs)
        size = int(np.prod(envs.single_observation_space.shape))
        self.critic = nn.Sequential(nn.Linear(size, 32), nn.Tanh(), nn.Linear(32, 1))
