"""The REINFORCE estimator ``g_H`` with reward-to-go and absolute discount.

For one trajectory ``tau = (s_0, a_0, r_0, ..., s_{H-1}, a_{H-1}, r_{H-1})`` sampled with the
policy ``pi_theta``::

    g_H(tau, theta) = sum_{t<H} ( sum_{h=t}^{H-1} gamma^h r_h ) grad_theta log pi_theta(a_t|s_t)

an unbiased estimate of the gradient of the truncated return
``J_H(theta) = E[sum_{h<H} gamma^h r_h]``. The discount is *absolute*: step ``h`` weighs
``gamma^h`` counted from the start of the trajectory, not ``gamma^(h-t)`` counted from ``t``;
the relative form estimates something else.

The trajectory must be *sampled and differentiated at the same point*: under NIGT that is the
broadcast (extrapolated) point :attr:`aps.pg.NIGTState.point`, never the learner's current
parameters. A trajectory must start at the env's reset (``h = 0``); a worker that receives a
new point abandons unfinished trajectories instead of continuing them.

:func:`reward_to_go` is numpy only; :func:`surrogate` needs torch, which is why this module is
not imported by ``import aps.pg``; import it explicitly.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
import torch

from aps.errors import ConfigError

__all__ = ["reward_to_go", "surrogate"]


def _check_gamma(gamma: object) -> float:
    if isinstance(gamma, bool) or not isinstance(gamma, int | float):
        raise ConfigError(f"gamma must be a number in [0, 1], got {gamma!r}")
    value = float(gamma)
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise ConfigError(f"gamma must be in [0, 1], got {gamma!r}")
    return value


def reward_to_go(rewards: npt.ArrayLike, gamma: float) -> npt.NDArray[np.float64]:
    """The weight of each step's log-probability in ``g_H``: discounted rewards from ``t`` on.

    ``weight_t = sum_{h=t}^{H-1} gamma^h r_h``, with the absolute discount ``gamma^h``
    (``weight_0`` is the trajectory's discounted return; ``weight_t - weight_{t+1} =
    gamma^t r_t``). ``gamma ** 0`` is 1, also for ``gamma == 0``.

    Args:
        rewards: the rewards ``r_0 .. r_{H-1}`` of one trajectory from its reset, a 1-d real
            array (may be empty).
        gamma: the discount factor, in ``[0, 1]``.

    Returns:
        A fresh float64 array with the shape of ``rewards``.

    Raises:
        ConfigError: ``rewards`` is not a 1-d real array, or ``gamma`` is outside ``[0, 1]``.
    """
    discount = _check_gamma(gamma)
    array = np.asarray(rewards)
    if array.ndim != 1 or array.dtype.kind not in "biuf":
        raise ConfigError(
            f"rewards must be a 1-d real array (one trajectory), got a {array.dtype} array "
            f"of shape {array.shape}"
        )
    r = array.astype(np.float64)
    discounted = np.power(discount, np.arange(r.shape[0], dtype=np.float64)) * r
    # A fresh copy: a reversed view of one entry counts as contiguous but keeps its negative
    # stride, which torch.as_tensor refuses.
    return np.cumsum(discounted[::-1])[::-1].copy()


def surrogate(
    log_probs: torch.Tensor,
    rewards: npt.ArrayLike | torch.Tensor,
    gamma: float,
) -> torch.Tensor:
    """A scalar whose gradient with respect to the policy parameters is one trajectory's g_H.

    Returns ``sum_t weight_t * log_probs[t]`` with ``weight = reward_to_go(rewards, gamma)``
    held constant, so ``surrogate(...).backward()`` leaves ``g_H(tau, theta)`` in the
    parameters' ``.grad``: an *ascent* direction (the gradient of the return, not of a loss;
    negate it for an optimizer that minimizes). Summing the surrogates of several trajectories
    before ``backward`` gives the sum of their ``g_H``, the gradient sum a worker reports.

    Sample the actions and compute ``log_probs`` with the policy at the broadcast
    (extrapolated) point, from the env's reset, and differentiate there.

    Args:
        log_probs: ``log pi_theta(a_t | s_t)`` for ``t = 0 .. H-1``, a 1-d tensor attached to
            the graph of the policy parameters.
        rewards: ``r_0 .. r_{H-1}``, a 1-d array or tensor of the same length (a tensor is
            detached; no gradient flows through rewards).
        gamma: the discount factor, in ``[0, 1]``.

    Returns:
        A 0-d tensor with the dtype and device of ``log_probs``.

    Raises:
        ConfigError: ``log_probs`` is not 1-d, ``rewards`` has another length, or ``gamma`` is
            outside ``[0, 1]``.
    """
    if log_probs.ndim != 1:
        raise ConfigError(
            f"log_probs must be 1-d (one trajectory), got shape {tuple(log_probs.shape)}"
        )
    if isinstance(rewards, torch.Tensor):
        rewards = rewards.detach().cpu().numpy()
    weights = reward_to_go(rewards, gamma)
    if weights.shape[0] != log_probs.shape[0]:
        raise ConfigError(
            f"one trajectory needs one reward per log-probability, got {weights.shape[0]} "
            f"rewards and {log_probs.shape[0]} log-probabilities"
        )
    weight = torch.as_tensor(weights, dtype=log_probs.dtype, device=log_probs.device)
    return (weight * log_probs).sum()
