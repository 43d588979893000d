"""How a policy takes observations: checked against its space, flattened, made tensors.

:class:`aps.policy.Policy` takes the observations of a ``Box``, ``Discrete``, ``MultiBinary`` or
``MultiDiscrete`` space as arrays, and those of a ``Dict`` or ``Tuple`` space (nested) as a dict
or tuple of arrays in the space's structure (see :mod:`aps.policy`). :class:`ObservationsMixin`
holds the policy's methods that check them against the space, flatten their leading axes (for
:meth:`~aps.policy.Policy.kl`) and turn them into tensors of the module's parameter dtype and
device; :func:`_first_leaf` and :func:`_first_space` find the first array of such a structure
and the first leaf of such a space.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces
from torch import nn

from aps.errors import ConfigError, ProtocolError
from aps.wire.batching import check_part, map_arrays

__all__ = ["ObservationsMixin"]

_OBSERVATION_SPACES = (spaces.Box, spaces.Discrete, spaces.MultiBinary, spaces.MultiDiscrete)
_STRUCTURED_SPACES = (spaces.Dict, spaces.Tuple)


class ObservationsMixin:
    """The observation handling of :class:`aps.policy.Policy`, which sets these attributes."""

    _module: nn.Module
    _observation_space: gym.Space[Any]
    _obs_shape: tuple[int, ...]
    _structured: bool
    _first_ndim: int

    def _placement(self) -> tuple[torch.device, torch.dtype]:
        for tensor in _tensors(self._module):
            if tensor.is_floating_point():
                return tensor.device, tensor.dtype
        return torch.device("cpu"), torch.float32

    def _observations(self, obs: Any, *, leading: int) -> Any:
        if self._structured:  # never on the NumPy heads' path, which only arrays take
            return self._to_tensor(self._checked_tree(obs, leading=leading))
        return self._to_tensor(self._checked(obs, leading=leading))

    def _checked(self, obs: np.ndarray, *, leading: int) -> np.ndarray:
        array = np.asarray(obs)
        expected = array.ndim == len(self._obs_shape) + leading and (
            array.shape[leading:] == self._obs_shape
        )
        if not expected or array.shape[0] == 0:
            raise ConfigError(
                f"observations of shape {array.shape} do not match [batch, "
                f"*{self._obs_shape}] with batch >= 1 for {self._observation_space}"
            )
        return array

    def _checked_tree(self, obs: Any, *, leading: int | None) -> Any:
        """``obs`` as arrays in the space's structure, each ``[*lead, *shape]``, one ``lead``.

        ``lead`` is ``leading`` axes long (``None``: as many as the first array has beyond its
        space's shape) and holds at least one state.
        """
        if type(obs) is not dict and type(obs) is not tuple:
            kind = "dict" if isinstance(self._observation_space, spaces.Dict) else "tuple"
            raise ConfigError(
                f"observations for {self._observation_space} must be a {kind} of arrays in "
                f"the space's structure, got {type(obs).__qualname__}"
            )
        tree = map_arrays(np.asarray, obs)
        first = _first_leaf(tree)
        depth = first.ndim - self._first_ndim if leading is None else leading
        lead = tuple(first.shape[: max(depth, 0)])
        try:
            if depth < 1 or len(lead) < depth or 0 in lead:
                raise ProtocolError(f"its first array has shape {first.shape}")
            check_part(self._observation_space, tree, lead, "observations", exact_dtype=False)
        except ProtocolError as exc:
            raise ConfigError(
                f"observations do not match {self._observation_space} with leading axes "
                f"{lead} (at least one state): {exc}; pass one array per subspace, each "
                "[batch, *subspace.shape]"
            ) from None
        return tree

    def _flatten(self, obs: Any) -> Any:
        if self._structured:
            tree = self._checked_tree(obs, leading=None)
            depth = _first_leaf(tree).ndim - self._first_ndim
            return map_arrays(lambda a: a.reshape((-1, *a.shape[depth:])), tree)
        array = np.asarray(obs)
        depth = len(self._obs_shape)
        if array.ndim <= depth or array.shape[array.ndim - depth :] != self._obs_shape:
            raise ConfigError(
                f"observations of shape {array.shape} do not match [..., *{self._obs_shape}] "
                f"for {self._observation_space}"
            )
        flat = array.reshape((-1, *self._obs_shape))
        if flat.shape[0] == 0:
            raise ConfigError(
                f"kl needs at least one state, got observations of shape {array.shape}"
            )
        return flat

    def _to_tensor(self, array: Any) -> Any:
        device, dtype = self._placement()
        if self._structured:  # a dict or tuple of tensors, in the space's structure
            return map_arrays(lambda a: torch.tensor(a, dtype=dtype, device=device), array)
        return torch.tensor(array, dtype=dtype, device=device)  # a copy: inputs may be read-only


def _first_leaf(tree: Any) -> Any:
    """The first array (or tensor) of a dict or tuple of them, nested; a leaf is its own."""
    while type(tree) is dict or type(tree) is tuple:
        if not tree:
            # Never StopIteration or IndexError: the caller's error names what was given.
            raise ConfigError(
                "observations hold an empty dict or tuple; give every subspace its batch "
                "of arrays, as the observation space lays them out"
            )
        tree = next(iter(tree.values())) if type(tree) is dict else tree[0]
    return tree


def _first_space(space: gym.Space[Any]) -> gym.Space[Any]:
    while isinstance(space, _STRUCTURED_SPACES):
        space = next(iter(space.spaces.values())) if isinstance(space, spaces.Dict) else space[0]
    return space


def _tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()
