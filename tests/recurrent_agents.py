"""Recurrent agents in the shape of CleanRL's ``ppo_atari_lstm.py``, for the DETACH tests.

Workers load them by file path (``tests/recurrent_agents.py:LSTMAgent``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn


def layer_init(layer: nn.Linear, std: float = float(np.sqrt(2)), bias: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias)
    return layer


class LSTMAgent(nn.Module):
    """CleanRL's LSTM agent (``get_states``/``get_action_and_value``), with an MLP trunk."""

    def __init__(self, envs: Any, hidden: int = 16) -> None:
        super().__init__()
        size = int(np.prod(envs.single_observation_space.shape))
        self.network = nn.Sequential(layer_init(nn.Linear(size, hidden)), nn.Tanh())
        self.lstm = nn.LSTM(hidden, hidden)
        for name, param in self.lstm.named_parameters():
            if "bias" in name:
                nn.init.constant_(param, 0)
            elif "weight" in name:
                nn.init.orthogonal_(param, 1.0)
        self.actor = layer_init(nn.Linear(hidden, int(envs.single_action_space.n)), std=0.01)
        self.critic = layer_init(nn.Linear(hidden, 1), std=1.0)

    def get_states(
        self, x: torch.Tensor, lstm_state: tuple[torch.Tensor, torch.Tensor], done: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        hidden = self.network(x)
        batch_size = lstm_state[0].shape[1]
        hidden = hidden.reshape((-1, batch_size, self.lstm.input_size))
        done = done.reshape((-1, batch_size))
        new_hidden = []
        for h, d in zip(hidden, done, strict=True):
            h, lstm_state = self.lstm(
                h.unsqueeze(0),
                (
                    (1.0 - d).view(1, -1, 1) * lstm_state[0],
                    (1.0 - d).view(1, -1, 1) * lstm_state[1],
                ),
            )
            new_hidden += [h]
        return torch.flatten(torch.cat(new_hidden), 0, 1), lstm_state


class GRUAgent(nn.Module):
    """A GRU agent whose state is one tensor, its zero state from ``initial_state``."""

    def __init__(self, envs: Any, hidden: int = 8) -> None:
        super().__init__()
        size = int(np.prod(envs.single_observation_space.shape))
        self.rnn = nn.GRU(size, hidden, num_layers=2)
        self.actor = nn.Linear(hidden, int(envs.single_action_space.n))

    def initial_state(self, batch_size: int) -> torch.Tensor:
        return torch.zeros(self.rnn.num_layers, batch_size, self.rnn.hidden_size)

    def get_states(
        self, x: torch.Tensor, state: torch.Tensor, done: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch_size = state.shape[1]
        x = x.reshape((-1, batch_size, x.shape[-1]))
        done = done.reshape((-1, batch_size))
        out = []
        for xt, d in zip(x, done, strict=True):
            h, state = self.rnn(xt.unsqueeze(0), (1.0 - d).view(1, -1, 1) * state)
            out.append(h)
        return torch.flatten(torch.cat(out), 0, 1), state
