"""An agent whose size is a keyword argument, for ``policy_kwargs`` (loaded by file path)."""

from __future__ import annotations

from typing import Any

import numpy as np
from torch import nn


class SizedAgent(nn.Module):
    """CleanRL's discrete agent with ``hidden_size`` units per hidden layer."""

    def __init__(self, envs: Any, hidden_size: int = 64) -> None:
        super().__init__()
        size = int(np.prod(envs.single_observation_space.shape))
        actions = int(envs.single_action_space.n)
        self.critic = nn.Sequential(
            nn.Linear(size, hidden_size), nn.Tanh(), nn.Linear(hidden_size, 1)
        )
        self.actor = nn.Sequential(
            nn.Linear(size, hidden_size), nn.Tanh(), nn.Linear(hidden_size, actions)
        )
