"""The Nature DQN agent for stacked frames, as :class:`aps.policy.NatureCNN` exports it.

Kept apart from :mod:`aps.policy`, the adapter every policy goes through: this is one
policy, of one shape, that DETACH workers act with on pixels.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, TypeVar

import torch
from gymnasium import spaces
from torch import nn

from aps.errors import ConfigError

__all__ = ["NatureCNN"]

_Layer = TypeVar("_Layer", nn.Conv2d, nn.Linear)


class NatureCNN(nn.Module):
    """A PPO agent for stacked frames: the Nature DQN conv stack, a categorical actor, a critic.

    ``NatureCNN(envs)`` over ``uint8 [C, H, W]`` observations (channels first, as EnvPool's
    Atari envs and :func:`aps.vector.atari_env` give them, ``H, W >= 36``) and a ``Discrete``
    action space. The trunk ``network`` is that of Mnih et al. 2015 (conv 32 8x8 stride 4,
    conv 64 4x4 stride 2, conv 64 3x3 stride 1, each ReLU, then 512 ReLU units) on inputs
    divided by 255, shared by the heads ``policy_head`` (logits) and ``value_head``, with
    CleanRL's ``ppo_atari.py`` initialization. Workers build it by import path
    (``"aps.policy:NatureCNN"``).

    :class:`Policy` calls ``actor`` and ``critic`` on the observations, each through the
    trunk. Without gradients, the trunk's output for the same input tensor object and the
    same parameters (by their in-place version counters and storage) is reused once, so
    :meth:`Policy.act` runs the trunk once per batch, not once per head. With gradients
    nothing is reused. CleanRL's ``get_value`` and ``get_action_and_value`` are there for
    training loops.

    Raises:
        ConfigError: the observation space is not a 3-d ``Box`` of at least 36 x 36, or the
            action space is not ``Discrete``.
    """

    def __init__(self, envs: Any) -> None:
        super().__init__()
        obs_space, action_space = envs.single_observation_space, envs.single_action_space
        shape = tuple(getattr(obs_space, "shape", None) or ())
        if not isinstance(obs_space, spaces.Box) or len(shape) != 3 or min(shape[1:]) < 36:
            raise ConfigError(
                f"NatureCNN needs frames as a Box of shape [channels, height, width] with "
                f"height and width >= 36, got {obs_space}; stack frames channels first "
                "(aps.vector.atari_env, or EnvPool's Atari envs)"
            )
        if not isinstance(action_space, spaces.Discrete):
            raise ConfigError(f"NatureCNN needs a Discrete action space, got {action_space}")
        self.network = nn.Sequential(
            _conv_init(nn.Conv2d(shape[0], 32, 8, stride=4)),
            nn.ReLU(),
            _conv_init(nn.Conv2d(32, 64, 4, stride=2)),
            nn.ReLU(),
            _conv_init(nn.Conv2d(64, 64, 3, stride=1)),
            nn.ReLU(),
            nn.Flatten(),
        )
        with torch.no_grad():
            flat = int(self.network(torch.zeros(1, *shape)).shape[1])
        self.network.append(_conv_init(nn.Linear(flat, 512)))
        self.network.append(nn.ReLU())
        self.policy_head = _conv_init(nn.Linear(512, int(action_space.n)), std=0.01)
        self.value_head = _conv_init(nn.Linear(512, 1), std=1.0)
        self._memo: tuple[weakref.ref[torch.Tensor], tuple[int, ...], torch.Tensor] | None = None

    def _key(self, x: torch.Tensor) -> tuple[int, ...]:
        # In-place writes bump _version; replacing .data changes the storage pointer.
        key = [x._version]
        for p in self.parameters():
            key += [p._version, p.data_ptr()]
        return tuple(key)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The trunk's 512 features of observations ``x [B, C, H, W]`` (any dtype, 0..255)."""
        if torch.is_grad_enabled():
            self._memo = None
            return self.network(x / 255.0)  # type: ignore[no-any-return]
        memo, self._memo = self._memo, None
        if memo is not None and memo[0]() is x and memo[1] == self._key(x):
            return memo[2]  # the other head of the same batch: reuse it once
        out: torch.Tensor = self.network(x / 255.0)
        self._memo = (weakref.ref(x), self._key(x), out)
        return out

    def actor(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, n]``."""
        return self.policy_head(self.features(x))  # type: ignore[no-any-return]

    def critic(self, x: torch.Tensor) -> torch.Tensor:
        """Values ``[B, 1]``."""
        return self.value_head(self.features(x))  # type: ignore[no-any-return]

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        """CleanRL's ``get_value``: values ``[B, 1]``."""
        return self.critic(x)

    def get_action_and_value(
        self, x: torch.Tensor, action: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """CleanRL's ``get_action_and_value``: one trunk pass for both heads."""
        hidden = self.network(x / 255.0)
        log_probs = torch.log_softmax(self.policy_head(hidden), dim=-1)
        if action is None:
            action = torch.multinomial(log_probs.detach().exp(), 1).squeeze(1)
        log_prob = log_probs.gather(1, action.long().reshape(-1, 1)).squeeze(1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        return action, log_prob, entropy, self.value_head(hidden)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_memo"] = None  # weak references do not copy; the memo is a cache
        return state


def _conv_init(layer: _Layer, std: float = math.sqrt(2), bias: float = 0.0) -> _Layer:
    torch.nn.init.orthogonal_(layer.weight, std)
    if layer.bias is not None:
        torch.nn.init.constant_(layer.bias, bias)
    return layer
