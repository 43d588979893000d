"""CleanRL-shaped agents for tests; workers load them by file path (``tests/agents.py:Agent``)."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
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


def _leaf_sizes(space: Any) -> int:
    """Numbers per observation of a (nested) Dict or Tuple space, as FlattenObs lays them out."""
    if isinstance(space, gym.spaces.Dict):
        return sum(_leaf_sizes(sub) for sub in space.spaces.values())
    if isinstance(space, gym.spaces.Tuple):
        return sum(_leaf_sizes(sub) for sub in space.spaces)
    return int(np.prod(space.shape))


class FlattenObs(nn.Module):
    """A dict or tuple of ``[B, ...]`` tensors (nested) to one ``[B, features]`` tensor."""

    def forward(self, obs: Any) -> torch.Tensor:
        leaves: list[torch.Tensor] = []

        def walk(value: Any) -> None:
            if isinstance(value, dict):
                for item in value.values():
                    walk(item)
            elif isinstance(value, tuple):
                for item in value:
                    walk(item)
            else:
                leaves.append(value.reshape(value.shape[0], -1))

        walk(obs)
        return torch.cat(leaves, dim=-1)


class DictAgent(nn.Module):
    """A categorical actor-critic over Dict (or Tuple) observations: ``DictAgent(envs)``.

    Its heads take the observation as the policy hands it over, a dict (or tuple) of float
    tensors in the space's structure, and flatten it first.
    """

    def __init__(self, envs: Any) -> None:
        super().__init__()
        size = _leaf_sizes(envs.single_observation_space)
        self.critic = nn.Sequential(
            FlattenObs(), layer_init(nn.Linear(size, 16)), nn.Tanh(), layer_init(nn.Linear(16, 1))
        )
        self.actor = nn.Sequential(
            FlattenObs(),
            layer_init(nn.Linear(size, 16)),
            nn.Tanh(),
            layer_init(nn.Linear(16, int(envs.single_action_space.n)), std=0.01),
        )
