"""A recurrent policy's state: its zero state, a step from a state, a chunk replayed.

The contract a recurrent agent meets (``get_states``, the state's shape and where its zero
state comes from) is in :mod:`aps.policy`'s doc. :class:`RecurrentMixin` holds the methods of
:class:`aps.policy.Policy` that run it: the agent's zero state, checked; ``get_states`` on steps
from a given state, checked; and a chunk's steps replayed through two policies from the chunk's
initial state, for :meth:`~aps.policy.Policy.kl`. The state itself is kept by whoever acts.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from aps.errors import ConfigError
from aps.policy._agent_module import _attr
from aps.policy._observations import ObservationsMixin

__all__ = ["RecurrentMixin"]


class RecurrentMixin(ObservationsMixin):
    """The state handling of a recurrent :class:`aps.policy.Policy`, which sets these attributes."""

    _single_state: bool

    def _zero_state(self, batch: int, *, cpu: bool = False) -> tuple[torch.Tensor, ...]:
        """The agent's zero state for ``batch`` envs (see :mod:`aps.policy`), checked."""
        module, what = self._module, type(self._module).__name__
        make = getattr(module, "initial_state", None)
        if callable(make):
            state: Any = make(batch)
        elif isinstance(getattr(module, "lstm", None), nn.LSTM):
            lstm: nn.LSTM = module.lstm  # type: ignore[assignment]
            layers = lstm.num_layers * (2 if lstm.bidirectional else 1)
            out = lstm.proj_size or lstm.hidden_size
            device, dtype = self._placement()
            state = (
                torch.zeros(layers, batch, out, device=device, dtype=dtype),
                torch.zeros(layers, batch, lstm.hidden_size, device=device, dtype=dtype),
            )
        elif isinstance(getattr(module, "gru", None), nn.GRU):
            gru: nn.GRU = module.gru  # type: ignore[assignment]
            layers = gru.num_layers * (2 if gru.bidirectional else 1)
            device, dtype = self._placement()
            state = torch.zeros(layers, batch, gru.hidden_size, device=device, dtype=dtype)
        else:
            raise ConfigError(
                f"{what} has get_states but aps cannot tell its zero state: give it an "
                "initial_state(batch_size) method, or an nn.LSTM attribute named lstm or an "
                "nn.GRU attribute named gru"
            )
        self._single_state = isinstance(state, torch.Tensor)
        tensors = (state,) if isinstance(state, torch.Tensor) else tuple(state)
        for tensor in tensors:
            if (
                not isinstance(tensor, torch.Tensor)
                or not tensor.is_floating_point()
                or tensor.ndim < 2
                or tensor.shape[1] != batch
            ):
                raise ConfigError(
                    f"{what}'s zero state for {batch} envs holds "
                    f"{_describe(tensor)}; a state is a float tensor or tuple of float tensors "
                    f"with the batch on axis 1 ([layers, {batch}, hidden])"
                )
        return tuple(t.cpu() for t in tensors) if cpu else tensors

    def _features(
        self, x: torch.Tensor, state: tuple[np.ndarray, ...], episode_start: np.ndarray
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """``get_states`` on ``x`` ``[T * B, ...]`` from ``state``; features and new state."""
        device, dtype = self._placement()
        batch = len(state[0][0]) if state and np.ndim(state[0]) >= 2 else -1
        done = np.asarray(episode_start).reshape(-1)
        if batch < 1 or done.shape[0] != x.shape[0] or x.shape[0] % batch:
            raise ConfigError(
                f"a recurrent step needs a state with the batch on axis 1 and one episode-start "
                f"flag per observation; got {x.shape[0]} observations, {done.shape[0]} flags "
                f"and a state of shapes {[np.shape(s) for s in state]}"
            )
        tensors = tuple(torch.tensor(np.asarray(s), dtype=dtype, device=device) for s in state)
        given: Any = tensors[0] if self._single_state and len(tensors) == 1 else tensors
        flags = torch.tensor(done, dtype=dtype, device=device)
        out = _attr(self._module, "get_states")(x, given, flags)
        what = type(self._module).__name__
        if not isinstance(out, tuple) or len(out) != 2 or not isinstance(out[0], torch.Tensor):
            raise ConfigError(
                f"{what}.get_states returned {_describe(out)}, not (features, new_state)"
            )
        features, new_state = out
        new = (new_state,) if isinstance(new_state, torch.Tensor) else tuple(new_state)
        if [tuple(t.shape) for t in new] != [tuple(t.shape) for t in tensors]:
            raise ConfigError(
                f"{what}.get_states returned a state of shapes "
                f"{[tuple(t.shape) for t in new]} for one of shapes "
                f"{[tuple(t.shape) for t in tensors]}; the state must keep its shapes"
            )
        return features.reshape(x.shape[0], -1), new

    def _replayed(
        self,
        other: RecurrentMixin,
        obs: np.ndarray,
        state: tuple[np.ndarray, ...],
        episode_start: np.ndarray,
        max_states: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Both policies' features over a chunk's steps, replayed from its initial state."""
        array = np.asarray(obs)
        starts = np.asarray(episode_start)
        if (
            array.ndim != 2 + len(self._obs_shape)
            or array.shape[2:] != self._obs_shape
            or starts.shape != array.shape[:2]
            or array.shape[0] == 0
            or array.shape[1] == 0
        ):
            raise ConfigError(
                f"a recurrent kl replays a chunk: observations of shape {array.shape} and "
                f"episode starts of shape {starts.shape} do not match [T, E, "
                f"*{self._obs_shape}] and [T, E] with T, E >= 1"
            )
        steps, envs = starts.shape
        keep = envs if max_states is None else max(1, min(envs, max_states // steps))
        index = np.linspace(0, envs - 1, num=keep).round().astype(np.int64)
        x = array[:, index].reshape(steps * keep, *self._obs_shape)
        done = starts[:, index].reshape(-1)
        initial = tuple(np.asarray(s)[:, index] for s in state)
        f0, _ = self._features(self._to_tensor(x), initial, done)
        f1, _ = other._features(other._to_tensor(x), initial, done)
        return f0, f1


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    return f"a {type(value).__name__}"
