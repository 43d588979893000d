"""Learning from stale data: advantage targets and a PPO loss that correct for policy lag.

A DETACH worker acts with the policy version it holds, which may be several versions behind
the learner's (:attr:`aps.Rollout.lag`). The log-probabilities a rollout carries
(:attr:`aps.Rollout.logprob`) are the *behaviour* policy's, the version that acted; the
learner's own policy at the start of an update is the *proximal* (or *target*) policy. These
functions turn a rollout's arrays into what a policy-gradient update needs while correcting
for the gap between the two:

- :func:`gae`: generalized advantage estimation (Schulman et al. 2016), the zero-lag
  reference path: advantages and value targets that assume the data is on-policy.
- :func:`vtrace`: V-trace (Espeholt et al. 2018, "IMPALA"): value targets and
  policy-gradient advantages with truncated importance weights (``rho_bar``, ``c_bar``)
  between the behaviour policy and the target policy.
- :func:`decoupled_ppo_loss`: decoupled PPO (Hilton et al. 2021, "Batch size-invariance for
  policy optimization"): the clipped ratio anchored at the proximal policy, each sample
  weighted by the truncated ratio proximal / behaviour.
- :func:`truncated_ratio` (the importance weights both use) and :func:`spread_truncated`
  (a rollout's truncated-step values on its ``[T, E]`` grid).

At zero lag (behaviour == target) each reduces exactly to the on-policy path: V-trace with
``rho_bar = c_bar = 1`` gives GAE's value targets for the same ``lam`` (and GAE(1)'s
advantages at ``lam = 1``), and the decoupled loss is PPO's clipped loss.

Conventions shared by :func:`gae` and :func:`vtrace`:

- Arrays lead with ``[T, E]``: ``T`` steps of ``E`` envs, as a :class:`~aps.Rollout` holds
  them (any further axes are batch axes too); ``bootstrap_value`` is ``[E]``, the value of
  the observation after the last step (``Rollout.next_obs``).
- ``terminated[t]``: step ``t`` ended its episode in a terminal state; nothing is
  bootstrapped past it.
- ``truncated[t]`` with ``truncated_value[t]``: step ``t`` ended its episode by a cut (a
  time limit); the return is bootstrapped from ``truncated_value[t]``, the value of the
  observation the step reached (under ``SameStep`` autoreset ``obs[t + 1]`` is already the
  next episode's, so pass the critic's values of ``Rollout.truncated_obs`` placed by
  :func:`spread_truncated`). A step both terminated and truncated counts as terminated. To
  end truncated episodes without a bootstrap (CleanRL's ``dones``), pass
  ``terminated | truncated`` as ``terminated`` and no ``truncated``.
- Either way an episode's end cuts the recursion: no advantage or trace crosses it.
- Every step gets a value. Steps a loss should skip (the reset step after an episode's end
  under ``NextStep`` autoreset, slots with ``Rollout.agent_active`` False) are the caller's
  to mask.
- Results are fresh float64 arrays shaped like ``rewards``.

Targets are numpy; only the loss is torch. This module never imports torch: the loss takes
and returns tensors and uses their methods.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from aps._base._typing import Array
from aps.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = [
    "Targets",
    "decoupled_ppo_loss",
    "gae",
    "spread_truncated",
    "truncated_ratio",
    "vtrace",
]


@dataclass(frozen=True, slots=True)
class Targets:
    """What an actor-critic update trains on, per step: ``[T, E]`` float64 arrays.

    Attributes:
        advantages: the policy-gradient advantage of each step's action.
        returns: the value target of each step's observation (GAE's lambda-return, or
            V-trace's ``vs``).
    """

    advantages: Array
    returns: Array


def gae(
    rewards: npt.ArrayLike,
    values: npt.ArrayLike,
    bootstrap_value: npt.ArrayLike,
    terminated: npt.ArrayLike,
    *,
    gamma: float,
    lam: float,
    truncated: npt.ArrayLike | None = None,
    truncated_value: npt.ArrayLike | None = None,
) -> Targets:
    """Generalized advantage estimation: on-policy advantages and lambda-returns.

    ``delta_t = r_t + gamma * V(next_t) - V_t`` (no ``V(next_t)`` past a terminal step) and
    ``A_t = delta_t + gamma * lam * A_{t+1}`` within an episode; ``returns = A + values``.
    The next value is ``values[t + 1]``, ``bootstrap_value`` after the last step, or
    ``truncated_value[t]`` where step ``t`` was truncated.

    Args:
        rewards: ``[T, E]`` rewards.
        values: ``[T, E]`` values of the observations acted on (the learner's critic, or the
            workers' ``Rollout.value``).
        bootstrap_value: ``[E]`` values of the observations after the last step.
        terminated: ``[T, E]`` bools: the step ended its episode in a terminal state.
        gamma: the discount, in ``[0, 1]``.
        lam: GAE's lambda, in ``[0, 1]``: 0 is the one-step TD error, 1 the Monte Carlo
            return bootstrapped at the rollout's end.
        truncated: ``[T, E]`` bools: the step ended its episode by a cut (see the module's
            conventions); give ``truncated_value`` with it.
        truncated_value: ``[T, E]`` values to bootstrap truncated steps from, read only
            where ``truncated`` (:func:`spread_truncated` builds it).

    Returns:
        The advantages and lambda-returns, fresh float64 arrays shaped like ``rewards``.

    Raises:
        ConfigError: a shape differs from ``rewards``' (or ``[E]`` for ``bootstrap_value``),
            ``gamma`` or ``lam`` is outside ``[0, 1]``, or only one of ``truncated`` and
            ``truncated_value`` was given.
    """
    gamma = _unit("gamma", gamma)
    lam = _unit("lam", lam)
    r, v, boot, term, trunc, tval = _episodes(
        rewards, values, bootstrap_value, terminated, truncated, truncated_value
    )
    next_values = _next_values(v, boot, trunc, tval, term)
    going_on = ~(term | trunc)  # the episode goes on after step t: the recursion crosses
    delta = r + gamma * next_values - v
    advantages = np.empty_like(delta)
    carried = np.zeros(delta.shape[1:])
    for t in reversed(range(delta.shape[0])):
        # gamma * lam * going_on * carried, in this order, as vtrace forms gamma * c: at
        # zero lag with c_bar >= 1 its traces are lam and its value targets equal these.
        carried = delta[t] + gamma * lam * going_on[t] * carried
        advantages[t] = carried
    return Targets(advantages=advantages, returns=advantages + v)


def vtrace(
    behaviour_logprob: npt.ArrayLike,
    target_logprob: npt.ArrayLike,
    rewards: npt.ArrayLike,
    values: npt.ArrayLike,
    bootstrap_value: npt.ArrayLike,
    terminated: npt.ArrayLike,
    *,
    gamma: float,
    lam: float = 1.0,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
    truncated: npt.ArrayLike | None = None,
    truncated_value: npt.ArrayLike | None = None,
) -> Targets:
    """V-trace value targets and policy-gradient advantages (IMPALA, Espeholt et al. 2018).

    With ``ratio_t = pi(a_t|x_t) / mu(a_t|x_t)`` (target over behaviour),
    ``rho_t = min(rho_bar, ratio_t)`` and ``c_t = lam * min(c_bar, ratio_t)``::

        delta_t = rho_t * (r_t + gamma * V(next_t) - V_t)
        vs_t    = V_t + delta_t + gamma * c_t * (vs_{t+1} - V_{t+1})
        adv_t   = rho_t * (r_t + gamma * vs(next_t) - V_t)

    within an episode; past a terminal step nothing is bootstrapped, and at the rollout's
    end or a truncated step ``vs(next_t)`` is the bootstrap value itself (``bootstrap_value``
    or ``truncated_value[t]``: its correction ``vs - V`` is 0, as the paper's ``v_{s+n}``).

    At zero lag (``target_logprob == behaviour_logprob``) with ``rho_bar, c_bar >= 1`` every
    ratio is 1: ``vs`` equals :func:`gae`'s returns for the same ``lam``, and at ``lam = 1``
    the advantages equal GAE(1)'s (the n-step return minus the value).

    Args:
        behaviour_logprob: ``[T, E]`` log-probabilities of the actions under the policy that
            acted (``Rollout.logprob``).
        target_logprob: ``[T, E]`` their log-probabilities under the policy being evaluated
            (the learner's, at the start of the update).
        rewards: ``[T, E]`` rewards.
        values: ``[T, E]`` the learner's values of the observations acted on.
        bootstrap_value: ``[E]`` values of the observations after the last step.
        terminated: ``[T, E]`` bools: the step ended its episode in a terminal state.
        gamma: the discount, in ``[0, 1]``.
        lam: the trace's lambda, in ``[0, 1]`` (the paper's section 4.2 variant; 1 is plain
            V-trace).
        rho_bar: cap of the importance weight in ``delta_t`` and the advantage, ``> 0``: it
            sets which policy's value ``vs`` estimates (``pi`` itself for ``rho_bar =
            inf``, a policy between ``mu`` and ``pi`` below).
        c_bar: cap of the trace's weight, in ``(0, rho_bar]``: it sets how fast the
            estimate converges, not to what.
        truncated: ``[T, E]`` bools: the step ended its episode by a cut (see the module's
            conventions); give ``truncated_value`` with it.
        truncated_value: ``[T, E]`` values to bootstrap truncated steps from, read only
            where ``truncated`` (:func:`spread_truncated` builds it).

    Returns:
        ``advantages`` (the policy-gradient advantages) and ``returns`` (the targets ``vs``),
        fresh float64 arrays shaped like ``rewards``.

    Raises:
        ConfigError: a shape differs from ``rewards``' (or ``[E]`` for ``bootstrap_value``),
            ``gamma`` or ``lam`` is outside ``[0, 1]``, ``rho_bar`` or ``c_bar`` is not
            positive, ``rho_bar < c_bar``, or only one of ``truncated`` and
            ``truncated_value`` was given.
    """
    gamma = _unit("gamma", gamma)
    lam = _unit("lam", lam)
    no_cap = "; IMPALA used 1, math.inf is no cap"
    rho_bar = _cap("rho_bar", rho_bar, 0.0, hint=no_cap)
    c_bar = _cap("c_bar", c_bar, 0.0, hint=no_cap)
    if rho_bar < c_bar:
        raise ConfigError(
            f"V-trace needs rho_bar >= c_bar (the trace may not weigh more than the "
            f"correction it carries), got rho_bar={rho_bar} < c_bar={c_bar}; raise rho_bar "
            f"or lower c_bar (IMPALA used 1 and 1)"
        )
    r, v, boot, term, trunc, tval = _episodes(
        rewards, values, bootstrap_value, terminated, truncated, truncated_value
    )
    behaviour = _like("behaviour_logprob", behaviour_logprob, r.shape)
    target = _like("target_logprob", target_logprob, r.shape)
    rho = truncated_ratio(target, behaviour, rho_bar)
    c = lam * truncated_ratio(target, behaviour, c_bar)
    next_values = _next_values(v, boot, trunc, tval, term)
    going_on = ~(term | trunc)
    delta = rho * (r + gamma * next_values - v)
    corrections = np.empty_like(delta)  # vs - V
    carried = np.zeros(delta.shape[1:])
    for t in reversed(range(delta.shape[0])):
        carried = delta[t] + gamma * c[t] * going_on[t] * carried
        corrections[t] = carried
    vs = v + corrections
    # vs of the next observation: vs_{t+1} inside an episode, the bootstrap value itself at
    # the rollout's end and at a truncated step, 0 past a terminal one (as next_values).
    next_vs = next_values.copy()
    next_vs[:-1] += np.where(going_on[:-1], corrections[1:], 0.0)
    advantages = rho * (r + gamma * next_vs - v)
    return Targets(advantages=advantages, returns=vs)


def decoupled_ppo_loss(
    new_logprob: torch.Tensor,
    proximal_logprob: torch.Tensor,
    behaviour_logprob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_coef: float,
    weight_cap: float = 1.0,
) -> torch.Tensor:
    """Decoupled PPO's per-sample policy loss (Hilton et al. 2021), to be averaged.

    ``ratio = pi_new / pi_prox`` is clipped to ``[1 - clip_coef, 1 + clip_coef]`` around the
    proximal policy (the learner's at the start of the update, not the stale one that
    acted), and each sample is weighted by ``w = min(weight_cap, pi_prox / pi_behaviour)``,
    the importance weight that corrects for the behaviour policy::

        loss = w * max(-A * ratio, -A * clip(ratio, 1 - clip_coef, 1 + clip_coef))

    When ``proximal_logprob`` is ``behaviour_logprob`` (zero lag, or plain PPO: pass the
    behaviour log-probabilities twice), ``w`` is exactly 1 and this is PPO's clipped loss
    (CleanRL's ``torch.max(pg_loss1, pg_loss2)``), bit for bit.

    The gradient flows through ``new_logprob`` only: the other three are detached.

    Args:
        new_logprob: ``[B]`` log-probabilities of the actions under the policy being
            trained, attached to its graph.
        proximal_logprob: ``[B]`` their log-probabilities under the learner's policy at the
            start of the update (computed once per update, with no grad).
        behaviour_logprob: ``[B]`` their log-probabilities under the policy that acted
            (``Rollout.logprob``).
        advantages: ``[B]`` advantages (normalized or not, as the caller's PPO does).
        clip_coef: PPO's clip range, ``> 0``.
        weight_cap: the cap of ``w``, ``>= 1``: 1 truncates as V-trace's ``rho_bar = 1``
            (the default), ``math.inf`` leaves the weight untruncated. A cap below 1 would
            scale even on-policy samples, so it is refused.

    Returns:
        ``[B]`` losses (a tensor on the inputs' device, with ``new_logprob``'s graph); take
        their mean (or a masked mean) for the update.

    Raises:
        ConfigError: the four tensors differ in shape (broadcasting ``[B, 1]`` against
            ``[B]`` would silently make ``[B, B]``), ``clip_coef`` is not positive, or
            ``weight_cap < 1``.
    """
    clip = _cap("clip_coef", clip_coef, 0.0, hint="; PPO's usual clip range is 0.1 to 0.3")
    cap = _cap(
        "weight_cap",
        weight_cap,
        1.0,
        inclusive=True,
        hint=(
            "; a cap below 1 would scale on-policy samples too: 1 truncates as V-trace's "
            "rho_bar = 1 does, math.inf is no cap"
        ),
    )
    shape = tuple(new_logprob.shape)
    for name, tensor in (
        ("proximal_logprob", proximal_logprob),
        ("behaviour_logprob", behaviour_logprob),
        ("advantages", advantages),
    ):
        if tuple(tensor.shape) != shape:
            raise ConfigError(
                f"{name} must have new_logprob's shape {shape}, got {tuple(tensor.shape)}; "
                f"index every tensor with the same minibatch and flatten them alike"
            )
    proximal = proximal_logprob.detach()
    advantage = advantages.detach()
    ratio = (new_logprob - proximal).exp()
    weight = (proximal - behaviour_logprob.detach()).exp().clamp(max=cap)
    unclipped = -advantage * ratio
    clipped = -advantage * ratio.clamp(1.0 - clip, 1.0 + clip)
    return weight * unclipped.maximum(clipped)


def truncated_ratio(
    target_logprob: npt.ArrayLike, behaviour_logprob: npt.ArrayLike, cap: float
) -> Array:
    """Importance weights ``min(cap, exp(target - behaviour))``, float64, never above ``cap``.

    A ratio too large for float64 is ``inf`` before the cap, never a warning; a
    ``-inf`` behaviour log-probability (an action the behaviour policy could not take) gives
    the cap.

    Raises:
        ConfigError: the two differ in shape, or ``cap`` is not positive.
    """
    limit = _cap("cap", cap, 0.0, hint="; 1 truncates as V-trace's rho_bar = 1, math.inf is no cap")
    target = np.asarray(target_logprob, dtype=np.float64)
    behaviour = _like("behaviour_logprob", behaviour_logprob, target.shape, "target_logprob's")
    with np.errstate(over="ignore", invalid="ignore"):
        ratio = np.exp(target - behaviour)
    return np.minimum(limit, ratio)


def spread_truncated(
    truncated_index: npt.ArrayLike, values: npt.ArrayLike, shape: tuple[int, int]
) -> Array:
    """The values of a rollout's truncated observations on its ``[T, E]`` grid.

    ``values[k]`` is the critic's value of ``Rollout.truncated_obs[k]``, the observation
    step ``truncated_index[k] = (t, env)`` reached before its env reset; the result holds
    it at ``[t, env]`` and 0 elsewhere, as :func:`gae` and :func:`vtrace` take
    ``truncated_value``.

    Args:
        truncated_index: ``[K, 2]`` integer (step, env) pairs (``Rollout.truncated_index``).
        values: ``[K]`` values.
        shape: ``(T, E)``, the rollout's ``reward.shape``.

    Raises:
        ConfigError: ``truncated_index`` is not ``[K, 2]`` integers inside ``shape``, or
            ``values`` is not ``[K]``.
    """
    index = np.asarray(truncated_index)
    if index.ndim != 2 or index.shape[1] != 2 or (index.size and index.dtype.kind not in "iu"):
        raise ConfigError(
            f"truncated_index must be [K, 2] integer (step, env) pairs, got a {index.dtype} "
            f"array of shape {index.shape}; pass Rollout.truncated_index"
        )
    vals = np.asarray(values, dtype=np.float64)
    if vals.shape != (index.shape[0],):
        raise ConfigError(
            f"values must hold one value per truncated step, shape ({index.shape[0]},), got "
            f"{vals.shape}; evaluate the critic on Rollout.truncated_obs and flatten it"
        )
    steps, envs = shape
    if index.size and not (
        (index[:, 0] >= 0).all()
        and (index[:, 0] < steps).all()
        and (index[:, 1] >= 0).all()
        and (index[:, 1] < envs).all()
    ):
        raise ConfigError(
            f"truncated_index holds (step, env) pairs outside the rollout's shape {shape}: "
            f"steps {index[:, 0].min()}..{index[:, 0].max()}, envs "
            f"{index[:, 1].min()}..{index[:, 1].max()}; pass the rollout's own reward.shape"
        )
    grid = np.zeros(shape, dtype=np.float64)
    grid[index[:, 0], index[:, 1]] = vals
    return grid


# -- checks -------------------------------------------------------------------------------------


def _unit(name: str, value: object) -> float:
    """``value`` as a float in ``[0, 1]`` (a discount or a lambda)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name} must be a number in [0, 1], got {value!r}")
    number = float(value)
    if not 0.0 <= number <= 1.0:  # NaN fails too
        raise ConfigError(f"{name} must be in [0, 1], got {value!r}")
    return number


def _cap(
    name: str, value: object, floor: float, *, inclusive: bool = False, hint: str = ""
) -> float:
    """``value`` as a float above ``floor`` (at or above with ``inclusive``); ``inf`` allowed.

    ``hint`` ends the error's message: what to pass instead.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    number = float(value)
    ok = number >= floor if inclusive else number > floor
    if not ok or math.isnan(number):
        bound = f">= {floor:g}" if inclusive else f"> {floor:g}"
        raise ConfigError(f"{name} must be {bound}, got {value!r}{hint}")
    return number


def _like(
    name: str, value: npt.ArrayLike, shape: tuple[int, ...], of: str = "the rewards'"
) -> Array:
    """``value`` as a float64 array of ``shape`` (``of``'s), or a ConfigError naming both."""
    array = np.asarray(value)
    if array.shape != shape:
        raise ConfigError(
            f"{name} must have {of} shape {shape} (one entry per step and env), got "
            f"{array.shape}; give every array the rollout's [T, E] layout"
        )
    if array.dtype.kind not in "biuf":
        raise ConfigError(f"{name} must hold real numbers, got a {array.dtype} array")
    return array.astype(np.float64, copy=False)


def _flags(name: str, value: npt.ArrayLike, shape: tuple[int, ...]) -> npt.NDArray[np.bool_]:
    """``value`` as a bool array of ``shape`` (ints and floats count as nonzero = True)."""
    return np.not_equal(_like(name, value, shape), 0.0)


def _episodes(
    rewards: npt.ArrayLike,
    values: npt.ArrayLike,
    bootstrap_value: npt.ArrayLike,
    terminated: npt.ArrayLike,
    truncated: npt.ArrayLike | None,
    truncated_value: npt.ArrayLike | None,
) -> tuple[Array, Array, Array, npt.NDArray[np.bool_], npt.NDArray[np.bool_], Array]:
    """The checked rollout arrays GAE and V-trace share, as float64 (flags as bools)."""
    r = np.asarray(rewards)
    if r.ndim < 1 or r.shape[0] < 1:
        raise ConfigError(
            f"rewards must be [T, E] with T >= 1 steps, got shape {r.shape}; pass the "
            f"rollout's reward array"
        )
    shape = r.shape
    r = _like("rewards", r, shape)
    v = _like("values", values, shape)
    boot = np.asarray(bootstrap_value)
    if boot.shape != shape[1:]:
        raise ConfigError(
            f"bootstrap_value must be [E] = {shape[1:]} (one value per env, of the "
            f"observation after the last step), got {boot.shape}; evaluate the critic on "
            f"Rollout.next_obs and flatten it"
        )
    boot = _like("bootstrap_value", boot, shape[1:])
    term = _flags("terminated", terminated, shape)
    if (truncated is None) != (truncated_value is None):
        given, missing = (
            ("truncated", "truncated_value")
            if truncated_value is None
            else ("truncated_value", "truncated")
        )
        raise ConfigError(
            f"{given} was given without {missing}: a truncated step is bootstrapped from the "
            f"value of the observation it reached; pass both (spread_truncated builds "
            f"truncated_value), or pass terminated | truncated as terminated to end truncated "
            f"episodes without a bootstrap"
        )
    if truncated is None:
        return r, v, boot, term, np.zeros(shape, dtype=np.bool_), np.zeros(shape)
    assert truncated_value is not None
    trunc = _flags("truncated", truncated, shape) & ~term  # terminal wins: no bootstrap
    tval = _like("truncated_value", truncated_value, shape)
    return r, v, boot, term, trunc, tval


def _next_values(
    values: Array,
    bootstrap_value: Array,
    truncated: npt.NDArray[np.bool_],
    truncated_value: Array,
    terminated: npt.NDArray[np.bool_],
) -> Array:
    """The value of the observation each step reached; 0 where the step terminated.

    ``values[t + 1]``, ``bootstrap_value`` after the last step, ``truncated_value[t]`` where
    step ``t`` was truncated. Zeroing terminal steps keeps a non-finite value there (a reset
    observation the critic has never seen) out of the arithmetic.
    """
    next_values = np.empty_like(values)
    next_values[:-1] = values[1:]
    next_values[-1] = bootstrap_value
    next_values = np.where(truncated, truncated_value, next_values)
    return np.where(terminated, 0.0, next_values)
