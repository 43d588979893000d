"""A policy's plain-MLP heads evaluated with NumPy, on views of the module's parameters.

:meth:`aps.policy.Policy.act` runs on every env step of a worker that acts itself, where
torch's cost per operation dominates a small MLP's forward pass. A head that is exactly an
``nn.Sequential`` of ``nn.Linear``, ``nn.Tanh``, ``nn.ReLU`` and ``nn.Identity`` (CleanRL's
PPO agents) is the same function in NumPy, several times faster at a worker's batch sizes.
:class:`NumpyHeads` holds views (so an optimizer's in-place steps are seen) and a
:class:`_Watch` that tells when the module's heads or parameters were replaced, or hooked, so
the policy can rebuild them or let torch act.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces
from torch import nn

from aps.errors import ConfigError

__all__ = ["LOG_SQRT_2PI", "NumpyHeads", "check_no_nan", "numpy_dtype"]

LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


def numpy_dtype(dtype: torch.dtype) -> np.dtype[Any] | None:
    """The NumPy dtype of a torch dtype, or ``None`` where NumPy has none (bfloat16)."""
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:  # bfloat16 and other types numpy lacks
        return None


def check_no_nan(log_probs: np.ndarray, module: nn.Module) -> None:
    """Refuse to sample from NaN probabilities; ``log_probs`` is ``[B]`` or ``[B, n]``."""
    if np.isnan(log_probs).any():
        rows = int(np.isnan(log_probs).reshape(log_probs.shape[0], -1).any(axis=1).sum())
        raise ConfigError(
            f"{type(module).__name__} gave NaN action probabilities for {rows} of "
            f"{log_probs.shape[0]} observations; its weights or the observations hold NaN "
            "or inf (a diverged update?): check them before acting"
        )


_Activation = Callable[[np.ndarray], np.ndarray]


def _tanh(x: np.ndarray) -> np.ndarray:
    np.tanh(x, out=x)
    return x


def _relu(x: np.ndarray) -> np.ndarray:
    np.maximum(x, 0, out=x)
    return x


_ACTIVATIONS: dict[type[nn.Module], _Activation | None] = {
    nn.Tanh: _tanh,
    nn.ReLU: _relu,
    nn.Identity: None,
}
_NUMPY_DTYPES = (torch.float32, torch.float64)


class _NotPlain(Exception):
    """Raised while building NumPy heads from a module they cannot evaluate."""


class _Watch:
    """What a NumPy head was built from, to tell when it no longer is the module's.

    ``slots`` are ``(dict, key, object)``: a child module in its parent's ``_modules`` or a
    parameter in its module's ``_parameters``; ``tensors`` are the parameters with the
    address of their data when the views were taken; ``modules`` are checked for hooks.
    """

    def __init__(self) -> None:
        self.slots: list[tuple[dict[str, Any], str, object]] = []
        self.tensors: list[tuple[torch.Tensor, int]] = []
        self.modules: list[nn.Module] = []

    def child(self, parent: nn.Module, name: str) -> nn.Module | None:
        value = parent._modules.get(name)
        self.slots.append((parent._modules, name, value))
        if value is not None:
            self.modules.append(value)
        return value

    def parameter(self, module: nn.Module, name: str) -> np.ndarray | None:
        """A NumPy view of ``module.<name>``, or ``None`` where it has no such parameter.

        Raises:
            _NotPlain: the parameter is not a CPU tensor of a float dtype NumPy computes in.
        """
        tensor = module._parameters.get(name)
        self.slots.append((module._parameters, name, tensor))
        if tensor is None:
            return None
        if tensor.device.type != "cpu" or tensor.dtype not in _NUMPY_DTYPES:
            raise _NotPlain
        self.tensors.append((tensor, tensor.data_ptr()))
        return tensor.detach().numpy()

    def current(self) -> bool:
        return all(owner.get(key) is value for owner, key, value in self.slots) and all(
            tensor.data_ptr() == address for tensor, address in self.tensors
        )

    def hooked(self) -> bool:
        hooks = torch.nn.modules.module
        if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
            return True
        return any(m._forward_hooks or m._forward_pre_hooks for m in self.modules)


class _NumpyMLP:
    """An ``nn.Sequential`` of linear layers and activations, evaluated with NumPy.

    The layers hold views of the module's parameters, so an optimizer's in-place steps are
    seen; replaced tensors are caught by :class:`_Watch`. Inputs are never written.
    """

    def __init__(self, layers: list[tuple[np.ndarray, np.ndarray | None] | _Activation]) -> None:
        self._layers = layers

    @classmethod
    def of(cls, parent: nn.Module, name: str, watch: _Watch) -> _NumpyMLP | None:
        """The head ``parent.<name>`` as a NumPy MLP, or ``None`` if it is anything else."""
        head = watch.child(parent, name)
        if head is None or type(head) is not nn.Sequential:  # a subclass may override forward
            return None
        layers: list[tuple[np.ndarray, np.ndarray | None] | _Activation] = []
        for key in list(head._modules):
            layer = watch.child(head, key)
            kind = type(layer)
            if layer is not None and kind is nn.Linear:
                weight = watch.parameter(layer, "weight")
                if weight is None:
                    return None
                layers.append((weight.T, watch.parameter(layer, "bias")))
            elif layer is not None and kind in _ACTIVATIONS:
                activation = _ACTIVATIONS[kind]
                if activation is not None:
                    layers.append(activation)
            else:
                return None
        return cls(layers) if any(isinstance(layer, tuple) for layer in layers) else None

    def __call__(self, x: np.ndarray) -> np.ndarray:
        owned = False  # activations work in place, but never on the caller's array
        for layer in self._layers:
            if isinstance(layer, tuple):
                weight_t, bias = layer
                x = x @ weight_t
                if bias is not None:
                    x += bias
                owned = True
            else:
                x = layer(x if owned else x.copy())
                owned = True
        return x


class NumpyHeads:
    """A policy's heads as NumPy MLPs, and :meth:`aps.policy.Policy.act` computed with them.

    Built only when every head the policy calls is a plain MLP whose parameters are CPU
    tensors of one float dtype (float32 or float64); see the module doc.
    """

    def __init__(
        self,
        module: nn.Module,
        action_space: gym.Space[Any],
        watch: _Watch,
        dtype: np.dtype[Any],
        actor: _NumpyMLP,
        critic: _NumpyMLP | None,
        log_std: np.ndarray | None,
    ) -> None:
        # What act needs of the policy, copied: a reference back would make a cycle.
        self._module = module
        space = action_space
        self._start = int(space.start) if isinstance(space, spaces.Discrete) else 0
        self._action_shape = tuple(space.shape or ())
        self._watch = watch
        self._dtype = dtype
        self._actor = actor
        self._critic = critic
        self._log_std = log_std

    @classmethod
    def of(
        cls,
        module: nn.Module,
        kind: str,
        *,
        has_critic: bool,
        action_space: gym.Space[Any],
        flat_obs: bool,
    ) -> NumpyHeads | None:
        """The heads of a policy's ``module``, or ``None`` where torch must act.

        Args:
            module: the agent.
            kind: the policy's kind (``"categorical"``, ``"gaussian"`` or ``"q"``).
            has_critic: whether the agent has a ``critic`` head to evaluate too.
            action_space: the single action space.
            flat_obs: whether observations reach the heads as ``[B, features]`` arrays.
        """
        if kind == "q" or not flat_obs:
            return None
        watch = _Watch()
        try:
            actor = _NumpyMLP.of(module, "actor" if kind == "categorical" else "actor_mean", watch)
            critic = _NumpyMLP.of(module, "critic", watch) if has_critic else None
            log_std = None
            if kind == "gaussian":
                log_std = watch.parameter(module, "actor_logstd")
        except _NotPlain:
            return None
        if actor is None or (has_critic and critic is None):
            return None
        if kind == "gaussian" and log_std is None:
            return None  # a plain tensor attribute, not a parameter: torch acts
        dtypes = {tensor.dtype for tensor, _ in watch.tensors}
        if len(dtypes) != 1:
            return None
        dtype = numpy_dtype(dtypes.pop())
        assert dtype is not None
        return cls(module, action_space, watch, dtype, actor, critic, log_std)

    def current(self) -> bool:
        """Whether the heads still are the module's, with the same parameter tensors."""
        return self._watch.current()

    def hooked(self) -> bool:
        """Whether a forward hook is registered (globally or on a layer of the heads)."""
        return self._watch.hooked()

    def act(
        self, obs: np.ndarray, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """:meth:`aps.policy.Policy.act` on checked observations, sampling from ``rng``."""
        x = np.asarray(obs, dtype=self._dtype)
        out = self._actor(x)
        if self._log_std is not None:
            log_std = np.broadcast_to(self._log_std, out.shape)
            noise = rng.standard_normal(out.shape, dtype=self._dtype)
            sample = out + np.exp(log_std) * noise
            log_prob = (-0.5 * np.square(noise) - log_std - LOG_SQRT_2PI).sum(-1)
            shape = (sample.shape[0], *self._action_shape)
            actions = sample.astype(np.float32, copy=False).reshape(shape)
        else:
            logits = out - out.max(axis=-1, keepdims=True)
            # Gumbel-max: the argmax of the logits plus Gumbel noise is a sample of their
            # softmax (a row's constant shift does not move it).
            gumbel = -np.log(-np.log(rng.random(logits.shape)))
            index = np.argmax(logits + gumbel, axis=-1)
            log_sum = np.log(np.exp(logits).sum(axis=-1))
            log_prob = logits[np.arange(index.shape[0]), index] - log_sum
            check_no_nan(log_prob, self._module)  # a NaN or +inf logit makes its row NaN
            actions = index.astype(np.int64, copy=False) + self._start
        values = None
        if self._critic is not None:
            values = self._critic(x).reshape(-1).astype(np.float32, copy=False)
        return actions, log_prob.astype(np.float32, copy=False), values
