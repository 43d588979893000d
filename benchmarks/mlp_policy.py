"""The policy the ``aps-detach`` contender's workers act with: CleanRL's PPO agent.

Two small MLPs (64-64, tanh), an actor for the logits of a ``Discrete`` action space and a
critic, as in CleanRL's ``ppo.py``. Workers import this file by path
(``benchmarks/mlp_policy.py:Agent``) and run it through :class:`aps.policy.Policy`, so the
inference they pay for is the one a PPO run on aps pays.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from torch import nn

HIDDEN = 64


def _mlp(inputs: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(inputs, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, outputs),
    )


class Agent(nn.Module):
    """Actor (logits) and critic (value) over a flat ``Box`` observation."""

    def __init__(self, envs: Any) -> None:
        super().__init__()
        inputs = int(np.prod(envs.single_observation_space.shape))
        self.actor = _mlp(inputs, int(envs.single_action_space.n))
        self.critic = _mlp(inputs, 1)
