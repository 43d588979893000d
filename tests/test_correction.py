"""aps.correction: GAE, V-trace and decoupled PPO against definitions, hand arithmetic and rollouts.

The exact properties draw rewards and values from multiples of 1/4 and discounts from
{0, 1/2, 3/4, 1}: every sum and product of a few such numbers is a float64 without rounding,
so two different ways of computing the same return must agree bit for bit.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import aps
from aps.correction import (
    Targets,
    decoupled_ppo_loss,
    gae,
    spread_truncated,
    truncated_ratio,
    vtrace,
)
from tests.conftest import FAST, WorkerTasks

# -- references -----------------------------------------------------------------------------------


def nstep_returns(
    rewards: Any,
    bootstrap: Any,
    terminated: Any,
    truncated: Any,
    truncated_value: Any,
    gamma: float,
) -> np.ndarray:
    """Each step's discounted return summed forward from its definition, in Python floats.

    Rewards until the episode ends or the rollout does; then nothing past a terminal step,
    ``gamma * truncated_value`` past a truncated one, ``gamma * bootstrap`` past the last.
    """
    steps, envs = np.shape(rewards)
    out = np.zeros((steps, envs))
    for env in range(envs):
        for t in range(steps):
            total, discount, k = 0.0, 1.0, t
            while True:
                total += discount * float(rewards[k][env])
                if terminated[k][env]:
                    break
                if truncated[k][env]:
                    total += discount * gamma * float(truncated_value[k][env])
                    break
                if k == steps - 1:
                    total += discount * gamma * float(bootstrap[env])
                    break
                discount *= gamma
                k += 1
            out[t, env] = total
    return out


def ppo_clipped_loss(new: Any, old: Any, advantages: Any, clip: float) -> Any:
    """CleanRL's ppo.py, line for line: the loss the decoupled one must reduce to."""
    import torch

    ratio = (new - old).exp()
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1 - clip, 1 + clip)
    return torch.max(pg_loss1, pg_loss2)


# -- strategies ---------------------------------------------------------------------------------

QUARTERS = st.integers(-16, 16).map(lambda k: k / 4)  # exact in float64
GAMMAS = st.sampled_from([0.0, 0.5, 0.75, 1.0])
FLOATS = st.floats(-1e3, 1e3, allow_nan=False)
LOGPROBS = st.floats(-30.0, 0.0, allow_nan=False)


@st.composite
def rollouts(draw: st.DrawFn, numbers: st.SearchStrategy[float] = QUARTERS) -> dict[str, Any]:
    """A ``[T, E]`` rollout's arrays with terminal and truncated steps anywhere."""
    steps, envs = draw(st.integers(1, 6)), draw(st.integers(1, 3))

    def grid(elements: st.SearchStrategy[Any]) -> np.ndarray:
        cells = draw(st.lists(elements, min_size=steps * envs, max_size=steps * envs))
        return np.array(cells).reshape(steps, envs)

    terminated = grid(st.booleans())
    return {
        "rewards": grid(numbers),
        "values": grid(numbers),
        "bootstrap_value": np.array(draw(st.lists(numbers, min_size=envs, max_size=envs))),
        "terminated": terminated,
        "truncated": grid(st.booleans()),
        "truncated_value": grid(numbers),
        "logprob": grid(LOGPROBS),
    }


def episodes(r: dict[str, Any]) -> dict[str, Any]:
    """The arguments gae and vtrace share, from a drawn rollout."""
    return {
        "rewards": r["rewards"],
        "values": r["values"],
        "bootstrap_value": r["bootstrap_value"],
        "terminated": r["terminated"],
        "truncated": r["truncated"],
        "truncated_value": r["truncated_value"],
    }


def reference(r: dict[str, Any], gamma: float) -> np.ndarray:
    return nstep_returns(
        r["rewards"],
        r["bootstrap_value"],
        r["terminated"],
        r["truncated"] & ~r["terminated"],  # a terminal step is not bootstrapped
        r["truncated_value"],
        gamma,
    )


# -- zero lag: the reference path -----------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(r=rollouts(), gamma=GAMMAS)
def test_gae_at_lambda_1_is_the_n_step_return_exactly(r: dict[str, Any], gamma: float) -> None:
    targets = gae(**episodes(r), gamma=gamma, lam=1.0)
    expected = reference(r, gamma)
    np.testing.assert_array_equal(targets.returns, expected)
    np.testing.assert_array_equal(targets.advantages, expected - r["values"])


@settings(max_examples=100, deadline=None)
@given(r=rollouts(), gamma=GAMMAS)
def test_gae_at_lambda_0_is_the_one_step_td_error(r: dict[str, Any], gamma: float) -> None:
    targets = gae(**episodes(r), gamma=gamma, lam=0.0)
    following = np.vstack([r["values"][1:], r["bootstrap_value"][None]])
    following = np.where(r["truncated"], r["truncated_value"], following)
    following = np.where(r["terminated"], 0.0, following)
    np.testing.assert_array_equal(
        targets.advantages, r["rewards"] + gamma * following - r["values"]
    )


BARS = st.sampled_from([(1.0, 1.0), (2.0, 1.0), (2.0, 2.0), (math.inf, 1.5), (math.inf, math.inf)])


@settings(max_examples=200, deadline=None)
@given(r=rollouts(), gamma=GAMMAS, bars=BARS)
def test_vtrace_at_zero_lag_with_lambda_1_is_the_n_step_return_and_gae_1(
    r: dict[str, Any], gamma: float, bars: tuple[float, float]
) -> None:
    rho_bar, c_bar = bars  # any caps >= 1: every ratio is exp(0) = 1, under them
    lp = r["logprob"]
    targets = vtrace(lp, lp, **episodes(r), gamma=gamma, rho_bar=rho_bar, c_bar=c_bar)
    np.testing.assert_array_equal(targets.returns, reference(r, gamma))
    np.testing.assert_array_equal(
        targets.advantages, gae(**episodes(r), gamma=gamma, lam=1.0).advantages
    )


@settings(max_examples=200, deadline=None)
@given(
    r=rollouts(FLOATS),
    gamma=st.floats(0.0, 1.0),
    lam=st.floats(0.0, 1.0),
    bars=BARS,
)
def test_vtrace_value_targets_at_zero_lag_are_gae_returns_bit_for_bit_for_any_lambda(
    r: dict[str, Any], gamma: float, lam: float, bars: tuple[float, float]
) -> None:
    lp = r["logprob"]
    rho_bar, c_bar = bars
    targets = vtrace(lp, lp, **episodes(r), gamma=gamma, lam=lam, rho_bar=rho_bar, c_bar=c_bar)
    np.testing.assert_array_equal(targets.returns, gae(**episodes(r), gamma=gamma, lam=lam).returns)


@settings(max_examples=200, deadline=None)
@given(
    data=st.lists(
        st.tuples(
            st.floats(-20, 0, width=32), st.floats(-20, 0, width=32), st.floats(-10, 10, width=32)
        ),
        min_size=1,
        max_size=64,
    ),
    clip=st.sampled_from([0.1, 0.2, 0.3]),
    cap=st.sampled_from([1.0, 2.0, math.inf]),
)
def test_decoupled_loss_is_ppos_clipped_loss_when_proximal_is_behaviour(
    data: list[tuple[float, float, float]], clip: float, cap: float
) -> None:
    torch = pytest.importorskip("torch")
    new, old, adv = (
        torch.tensor(column, dtype=torch.float32) for column in zip(*data, strict=True)
    )
    loss = decoupled_ppo_loss(new, old, old, adv, clip_coef=clip, weight_cap=cap)
    assert torch.equal(loss, ppo_clipped_loss(new, old, adv, clip))


# -- truncation bounds ----------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    pairs=st.lists(st.tuples(st.floats(-1e4, 1e4), st.floats(-1e4, 1e4)), min_size=1),
    cap=st.floats(1e-3, 1e3) | st.just(math.inf),
)
def test_truncated_ratios_never_exceed_their_cap(
    pairs: list[tuple[float, float]], cap: float
) -> None:
    target, behaviour = (np.array(column) for column in zip(*pairs, strict=True))
    weights = truncated_ratio(target, behaviour, cap)  # overflow would warn, and warnings fail
    assert weights.dtype == np.float64 and weights.shape == target.shape
    assert (weights <= cap).all() and (weights >= 0.0).all()
    gap = target - behaviour
    under = gap < min(math.log(cap) - 1e-9, 700.0)  # below the cap (and float64's largest)
    np.testing.assert_allclose(weights[under], np.exp(gap[under]), rtol=1e-12)


@settings(max_examples=100, deadline=None)
@given(r=rollouts(FLOATS), excess=st.floats(0.0, 1e3), gamma=st.floats(0.0, 1.0))
def test_vtrace_ratios_above_the_caps_count_as_the_caps(
    r: dict[str, Any], excess: float, gamma: float
) -> None:
    # rho_bar = c_bar = 1: a target that makes every ratio >= 1 weighs each step exactly 1,
    # as at zero lag.
    lp = r["logprob"]
    ahead = vtrace(lp, lp + excess, **episodes(r), gamma=gamma)
    same = vtrace(lp, lp, **episodes(r), gamma=gamma)
    np.testing.assert_array_equal(ahead.returns, same.returns)
    np.testing.assert_array_equal(ahead.advantages, same.advantages)


@settings(max_examples=200, deadline=None)
@given(
    data=st.lists(
        st.tuples(st.floats(-30, 0), st.floats(-30, 0), st.floats(-30, 0), st.floats(-10, 10)),
        min_size=1,
        max_size=32,
    ),
    cap=st.sampled_from([1.0, 1.5, 4.0]),
)
def test_decoupled_weights_never_exceed_the_cap(
    data: list[tuple[float, float, float, float]], cap: float
) -> None:
    torch = pytest.importorskip("torch")
    new, prox, behaviour, adv = (
        torch.tensor(c, dtype=torch.float64) for c in zip(*data, strict=True)
    )
    loss = decoupled_ppo_loss(new, prox, behaviour, adv, clip_coef=0.2, weight_cap=cap)
    unweighted = ppo_clipped_loss(new, prox, adv, 0.2)  # the clip anchored at the proximal
    assert (loss.abs() <= cap * unweighted.abs() * (1 + 1e-12)).all()
    expected = torch.minimum(torch.tensor(cap, dtype=torch.float64), (prox - behaviour).exp())
    torch.testing.assert_close(loss, expected * unweighted, rtol=1e-12, atol=0.0)


# -- small cases by hand --------------------------------------------------------------------------


def test_gae_by_hand() -> None:
    # gamma 0.5, lambda 0.5, one env, rewards 1, 0, 2, values 1, 2, 4, bootstrap 8:
    #   delta_2 = 2 + 0.5 * 8 - 4 = 2        A_2 = 2
    #   delta_1 = 0 + 0.5 * 4 - 2 = 0        A_1 = 0 + 0.25 * 2 = 0.5
    #   delta_0 = 1 + 0.5 * 2 - 1 = 1        A_0 = 1 + 0.25 * 0.5 = 1.125
    # returns = A + V = 2.125, 2.5, 6.
    targets = gae([[1], [0], [2]], [[1], [2], [4]], [8], [[0], [0], [0]], gamma=0.5, lam=0.5)
    assert targets.advantages.tolist() == [[1.125], [0.5], [2.0]]
    assert targets.returns.tolist() == [[2.125], [2.5], [6.0]]


def test_gae_ends_episodes_by_hand() -> None:
    # gamma 0.5, lambda 1, two envs, rewards 1 then 2, values 3 then 5, bootstrap 4.
    # Step 1 (both envs): delta = 2 + 0.5 * 4 - 5 = -1 = A_1, return 4.
    # Env 0 terminates at step 0: delta = 1 - 3 = -2, and nothing crosses: A_0 = -2, return 1.
    # Env 1 is truncated at step 0, its last observation worth 10: delta = 1 + 0.5 * 10 - 3 = 3,
    # nothing crosses: A_0 = 3, return 6.
    targets = gae(
        [[1, 1], [2, 2]],
        [[3, 3], [5, 5]],
        [4, 4],
        [[True, False], [False, False]],
        gamma=0.5,
        lam=1.0,
        truncated=[[False, True], [False, False]],
        truncated_value=spread_truncated([[0, 1]], [10.0], (2, 2)),
    )
    assert targets.advantages.tolist() == [[-2.0, 3.0], [-1.0, -1.0]]
    assert targets.returns.tolist() == [[1.0, 6.0], [4.0, 4.0]]


@pytest.mark.parametrize(
    ("ratios", "rho_bar", "c_bar", "lam", "advantages", "returns"),
    [
        # gamma 0.5, rewards 1, 2, values 2, 4, bootstrap 6; lambda 1, ratios 0.5 and 2 first.
        # rho_bar = c_bar = 1: rho = c = 0.5, 1.
        #   delta_1 = 1 * (2 + 0.5 * 6 - 4) = 1       vs_1 = 4 + 1 = 5
        #   delta_0 = 0.5 * (1 + 0.5 * 4 - 2) = 0.5   vs_0 = 2 + 0.5 + 0.5 * 0.5 * 1 = 2.75
        #   adv_1 = 1 * (2 + 0.5 * 6 - 4) = 1 (vs after the last step: the bootstrap, 6)
        #   adv_0 = 0.5 * (1 + 0.5 * vs_1 - 2) = 0.5 * 1.5 = 0.75
        ((0.5, 2.0), 1.0, 1.0, 1.0, [0.75, 1.0], [2.75, 5.0]),
        # rho_bar = 2, c_bar = 1: rho = 0.5, 2 and c = 0.5, 1.
        #   delta_1 = 2 * 1 = 2                       vs_1 = 6
        #   delta_0 = 0.5                             vs_0 = 2 + 0.5 + 0.5 * 0.5 * 2 = 3
        #   adv_1 = 2 * 1 = 2; adv_0 = 0.5 * (1 + 0.5 * 6 - 2) = 1
        ((0.5, 2.0), 2.0, 1.0, 1.0, [1.0, 2.0], [3.0, 6.0]),
        # rho_bar = c_bar = 0.25: rho = c = 0.25 at both steps.
        #   delta_1 = 0.25                            vs_1 = 4.25
        #   delta_0 = 0.25                            vs_0 = 2 + 0.25 + 0.5 * 0.25 * 0.25 = 2.28125
        #   adv_1 = 0.25; adv_0 = 0.25 * (1 + 0.5 * 4.25 - 2) = 0.28125
        ((0.5, 2.0), 0.25, 0.25, 1.0, [0.28125, 0.25], [2.28125, 4.25]),
        # Ratios 2 and 0.5, rho_bar = 2, c_bar = 1: rho = 2, 0.5 and c = 1, 0.5.
        #   delta_1 = 0.5 * (2 + 0.5 * 6 - 4) = 0.5   vs_1 = 4.5
        #   delta_0 = 2 * (1 + 0.5 * 4 - 2) = 2       vs_0 = 2 + 2 + 0.5 * 1 * 0.5 = 4.25
        #   adv_1 = 0.5 * 1 = 0.5; adv_0 = 2 * (1 + 0.5 * 4.5 - 2) = 2.5
        ((2.0, 0.5), 2.0, 1.0, 1.0, [2.5, 0.5], [4.25, 4.5]),
        # The same with lambda 0.5: c_0 = 0.5 * 1, vs_0 = 2 + 2 + 0.5 * 0.5 * 0.5 = 4.125;
        # the advantages do not change (vs_1 is the same).
        ((2.0, 0.5), 2.0, 1.0, 0.5, [2.5, 0.5], [4.125, 4.5]),
    ],
)
def test_vtrace_by_hand(
    ratios: tuple[float, float],
    rho_bar: float,
    c_bar: float,
    lam: float,
    advantages: list[float],
    returns: list[float],
) -> None:
    behaviour = np.log([[0.5], [0.25]])
    target = behaviour + np.log(np.array(ratios)[:, None])
    targets = vtrace(
        behaviour,
        target,
        [[1], [2]],
        [[2], [4]],
        [6],
        [[False], [False]],
        gamma=0.5,
        lam=lam,
        rho_bar=rho_bar,
        c_bar=c_bar,
    )
    np.testing.assert_allclose(targets.advantages[:, 0], advantages, rtol=1e-12)
    np.testing.assert_allclose(targets.returns[:, 0], returns, rtol=1e-12)


def test_vtrace_cuts_its_trace_at_episode_ends_by_hand() -> None:
    # gamma 1, ratios 0.5 everywhere (rho = c = 0.5), rewards 1, values 0, bootstrap 0 and
    # the truncated step's last observation worth 4. Env 0 terminates at step 0, env 1 is
    # truncated at step 0; step 1 is the next episode's.
    #   step 1: delta = 0.5 * (1 + 0 - 0) = 0.5, vs = 0.5, adv = 0.5 * 1 = 0.5
    #   env 0, step 0: delta = 0.5 * 1 = 0.5, no trace across: vs = 0.5, adv = 0.5 * 1 = 0.5
    #   env 1, step 0: delta = 0.5 * (1 + 4) = 2.5, vs = 2.5, adv = 0.5 * (1 + 4) = 2.5
    half = np.log(0.5)
    targets = vtrace(
        np.zeros((2, 2)),
        np.full((2, 2), half),
        np.ones((2, 2)),
        np.zeros((2, 2)),
        np.zeros(2),
        [[True, False], [False, False]],
        gamma=1.0,
        truncated=[[False, True], [False, False]],
        truncated_value=[[0.0, 4.0], [0.0, 0.0]],
    )
    np.testing.assert_allclose(targets.returns, [[0.5, 2.5], [0.5, 0.5]], rtol=1e-12)
    np.testing.assert_allclose(targets.advantages, [[0.5, 2.5], [0.5, 0.5]], rtol=1e-12)


def test_decoupled_loss_by_hand() -> None:
    torch = pytest.importorskip("torch")
    # clip 0.2; ratio new / prox 1.5 or 0.5, weight prox / behaviour 0.5 or 3 (capped at 1):
    #   s0: ratio 1.5, A  2, w 0.5: max(-3, -2 * 1.2 = -2.4) = -2.4, * 0.5 = -1.2
    #   s1: ratio 1.5, A -2, w 1:   max( 3,  2 * 1.2 =  2.4) =  3,   * 1   =  3
    #   s2: ratio 0.5, A  2, w 1:   max(-1, -2 * 0.8 = -1.6) = -1,   * 1   = -1
    #   s3: ratio 0.5, A -2, w 0.5: max( 1,  2 * 0.8 =  1.6) =  1.6, * 0.5 =  0.8
    # With no cap, s1 weighs 3: 9.
    prox = torch.log(torch.tensor([0.4, 0.3, 0.6, 0.2], dtype=torch.float64))
    new = (
        prox + torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5], dtype=torch.float64))
    ).requires_grad_()
    behaviour = prox - torch.log(torch.tensor([0.5, 3.0, 1.0, 0.5], dtype=torch.float64))
    adv = torch.tensor([2.0, -2.0, 2.0, -2.0], dtype=torch.float64)
    loss = decoupled_ppo_loss(new, prox, behaviour, adv, clip_coef=0.2)
    torch.testing.assert_close(loss, torch.tensor([-1.2, 3.0, -1.0, 0.8], dtype=torch.float64))
    uncapped = decoupled_ppo_loss(new, prox, behaviour, adv, clip_coef=0.2, weight_cap=math.inf)
    torch.testing.assert_close(uncapped[1], torch.tensor(9.0, dtype=torch.float64))
    # Clipped samples (s0, s3) carry no gradient; the others d(-w * A * ratio)/d new:
    # s1: -1 * -2 * 1.5 = 3; s2: -1 * 2 * 0.5 = -1.
    loss.sum().backward()
    assert new.grad is not None
    torch.testing.assert_close(new.grad, torch.tensor([0.0, 3.0, -1.0, 0.0], dtype=torch.float64))


def test_the_loss_gradient_flows_through_the_new_log_probs_only() -> None:
    torch = pytest.importorskip("torch")
    new, prox, behaviour, adv = (torch.randn(8, requires_grad=True) for _ in range(4))
    decoupled_ppo_loss(new, prox, behaviour, adv, clip_coef=0.2).mean().backward()
    assert new.grad is not None and new.grad.abs().sum() > 0
    assert prox.grad is None and behaviour.grad is None and adv.grad is None


def test_spread_truncated_places_each_value_at_its_step_and_env() -> None:
    grid = spread_truncated(np.array([[0, 2], [3, 0]]), [1.5, -2.0], (4, 3))
    expected = np.zeros((4, 3))
    expected[0, 2], expected[3, 0] = 1.5, -2.0
    np.testing.assert_array_equal(grid, expected)
    assert grid.dtype == np.float64
    empty = spread_truncated(np.empty((0, 2), np.int64), np.empty(0, np.float32), (2, 2))
    np.testing.assert_array_equal(empty, np.zeros((2, 2)))


# -- shapes and dtypes ----------------------------------------------------------------------------


def test_targets_are_fresh_float64_arrays_shaped_like_the_rewards() -> None:
    rng = np.random.default_rng(0)
    rewards = rng.integers(-3, 3, size=(5, 4, 2))  # ints, and a trailing batch axis
    values = rng.standard_normal((5, 4, 2)).astype(np.float32)
    boot = rng.standard_normal((4, 2)).astype(np.float32)
    terminated = rng.random((5, 4, 2)) < 0.2
    logprob = np.log(rng.random((5, 4, 2))).astype(np.float32)
    kept = [a.copy() for a in (rewards, values, boot, terminated, logprob)]
    for targets in (
        gae(rewards, values, boot, terminated, gamma=0.9, lam=0.95),
        vtrace(logprob, logprob * 0.5, rewards, values, boot, terminated, gamma=0.9),
    ):
        assert isinstance(targets, Targets)
        for array in (targets.advantages, targets.returns):
            assert array.shape == (5, 4, 2) and array.dtype == np.float64
            assert np.isfinite(array).all()
            assert not np.shares_memory(array, values)
    for before, after in zip(kept, (rewards, values, boot, terminated, logprob), strict=True):
        np.testing.assert_array_equal(before, after)  # inputs are never written to


def test_the_loss_keeps_its_inputs_shape_dtype_and_graph() -> None:
    torch = pytest.importorskip("torch")
    new = torch.zeros(6, dtype=torch.float32, requires_grad=True)
    others = [torch.zeros(6, dtype=torch.float32) for _ in range(3)]
    loss = decoupled_ppo_loss(new, *others, clip_coef=0.2)
    assert loss.shape == (6,) and loss.dtype == torch.float32 and loss.requires_grad


def test_importing_the_corrections_loads_no_torch() -> None:
    code = "import sys, aps.correction; assert 'torch' not in sys.modules, 'torch was imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


# -- errors ---------------------------------------------------------------------------------------

T, E = 3, 2
GOOD: dict[str, Any] = {
    "rewards": np.zeros((T, E)),
    "values": np.zeros((T, E)),
    "bootstrap_value": np.zeros(E),
    "terminated": np.zeros((T, E), bool),
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"values": np.zeros((T, E + 1))},
            r"values must have the rewards' shape \(3, 2\).*\(3, 3\)",
        ),
        ({"terminated": np.zeros(T)}, r"terminated must have the rewards' shape \(3, 2\).*\(3,\)"),
        (
            {"bootstrap_value": np.zeros((1, E))},
            r"bootstrap_value must be \[E\] = \(2,\).*\(1, 2\)",
        ),
        ({"rewards": np.zeros((0, E))}, r"T >= 1 steps, got shape \(0, 2\)"),
        ({"values": np.full((T, E), "x")}, r"values must hold real numbers, got a <U1"),
        ({"gamma": 1.5}, r"gamma must be in \[0, 1\], got 1.5"),
        ({"gamma": True}, r"gamma must be a number in \[0, 1\], got True"),
        ({"lam": -0.1}, r"lam must be in \[0, 1\], got -0.1"),
        ({"lam": math.nan}, r"lam must be in \[0, 1\], got nan"),
        ({"truncated": np.zeros((T, E), bool)}, r"truncated was given without truncated_value"),
        ({"truncated_value": np.zeros((T, E))}, r"truncated_value was given without truncated"),
        (
            {"truncated": np.zeros((T, E), bool), "truncated_value": np.zeros(E)},
            r"truncated_value must have the rewards' shape \(3, 2\).*\(2,\)",
        ),
    ],
)
def test_gae_names_the_bad_value_the_limit_and_the_fix(
    change: dict[str, Any], message: str
) -> None:
    kwargs = {**GOOD, "gamma": 0.9, "lam": 0.95, **change}
    with pytest.raises(aps.ConfigError, match=message):
        gae(**kwargs)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"rho_bar": 0.5, "c_bar": 1.0},
            r"rho_bar >= c_bar.*rho_bar=0.5 < c_bar=1.0.*raise rho_bar",
        ),
        ({"c_bar": 0.0}, r"c_bar must be > 0, got 0.0; IMPALA used 1, math.inf is no cap"),
        ({"rho_bar": -1.0}, r"rho_bar must be > 0, got -1.0"),
        ({"rho_bar": "1"}, r"rho_bar must be a number, got '1'"),
        (
            {"target_logprob": np.zeros((T, E + 1))},
            r"target_logprob must have the rewards'.*\(3, 3\)",
        ),
        (
            {"behaviour_logprob": np.zeros(T * E)},
            r"behaviour_logprob must have the rewards'.*\(6,\)",
        ),
    ],
)
def test_vtrace_names_the_bad_value_the_limit_and_the_fix(
    change: dict[str, Any], message: str
) -> None:
    kwargs = {
        **GOOD,
        "behaviour_logprob": np.zeros((T, E)),
        "target_logprob": np.zeros((T, E)),
        "gamma": 0.9,
        **change,
    }
    with pytest.raises(aps.ConfigError, match=message):
        vtrace(**kwargs)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"proximal_logprob": (8, 1)},
            r"proximal_logprob must have new_logprob's shape \(8,\), got \(8, 1\)",
        ),
        ({"advantages": (4,)}, r"advantages must have new_logprob's shape \(8,\), got \(4,\)"),
        ({"clip_coef": 0.0}, r"clip_coef must be > 0, got 0.0; PPO's usual clip range"),
        ({"weight_cap": 0.5}, r"weight_cap must be >= 1, got 0.5; a cap below 1 would scale"),
        ({"weight_cap": math.nan}, r"weight_cap must be >= 1, got nan"),
    ],
)
def test_the_loss_names_the_bad_value_the_limit_and_the_fix(
    change: dict[str, Any], message: str
) -> None:
    torch = pytest.importorskip("torch")
    kwargs: dict[str, Any] = {"clip_coef": 0.2}
    for name in ("new_logprob", "proximal_logprob", "behaviour_logprob", "advantages"):
        kwargs[name] = torch.zeros(change.get(name, (8,)))
    kwargs.update({k: v for k, v in change.items() if not isinstance(v, tuple)})
    with pytest.raises(aps.ConfigError, match=message):
        decoupled_ppo_loss(**kwargs)


@pytest.mark.parametrize(
    ("index", "values", "message"),
    [
        (np.array([[0, 5]]), [1.0], r"outside the rollout's shape \(3, 2\).*envs 5\.\.5"),
        (np.array([[-1, 0]]), [1.0], r"outside the rollout's shape \(3, 2\).*steps -1\.\.-1"),
        (
            np.array([0, 1]),
            [1.0],
            r"\[K, 2\] integer \(step, env\) pairs, got a int64 array of shape \(2,\)",
        ),
        (np.array([[0.0, 1.0]]), [1.0], r"\[K, 2\] integer .* got a float64 array"),
        (np.array([[0, 1]]), [1.0, 2.0], r"one value per truncated step, shape \(1,\), got \(2,\)"),
    ],
)
def test_spread_truncated_refuses_what_does_not_fit(index: Any, values: Any, message: str) -> None:
    with pytest.raises(aps.ConfigError, match=message):
        spread_truncated(index, values, (3, 2))


def test_truncated_ratio_refuses_a_cap_that_is_not_positive_and_mismatched_shapes() -> None:
    with pytest.raises(aps.ConfigError, match=r"cap must be > 0, got 0; 1 truncates"):
        truncated_ratio([0.0], [0.0], 0)
    with pytest.raises(aps.ConfigError, match=r"target_logprob's shape \(2,\).*\(3,\)"):
        truncated_ratio([0.0, 0.0], [0.0, 0.0, 0.0], 1.0)


# -- a real rollout -------------------------------------------------------------------------------

POLICY = f"{Path(__file__).with_name('agents.py')}:Agent"


class Spaces:
    single_observation_space = gym.make("CartPole-v1").observation_space
    single_action_space = gym.make("CartPole-v1").action_space


async def test_a_rollouts_truncated_steps_bootstrap_from_their_last_observation(
    workers: WorkerTasks,
) -> None:
    torch = pytest.importorskip("torch")
    from tests.agents import Agent

    learner = aps.Learner(
        "memory://", num_workers=2, policy=POLICY, autoreset_mode="SameStep", timeouts=FAST
    )
    async with learner:
        for _ in range(2):
            workers.start(learner.url, num_envs=2, env_kwargs={"max_episode_steps": 5})
        await learner.reset(seed=0)
        torch.manual_seed(0)
        agent = Agent(Spaces())
        await learner.publish(agent)
        b = await learner.rollout(12)
    assert b.truncated.any()  # episodes of at most 5 steps in 12

    def critic(obs: Any) -> np.ndarray:
        with torch.no_grad():
            value = agent.critic(torch.as_tensor(obs, dtype=torch.float32)).squeeze(-1)
        return value.numpy().astype(np.float64)

    values, boot = critic(b.obs), critic(b.next_obs)
    last = spread_truncated(b.truncated_index, critic(b.truncated_obs), b.reward.shape)
    ends = {"truncated": b.truncated, "truncated_value": last}
    targets = gae(b.reward, values, boot, b.terminated, gamma=0.9, lam=1.0, **ends)
    cut = b.truncated & ~b.terminated
    expected = nstep_returns(b.reward, boot, b.terminated, cut, last, 0.9)
    np.testing.assert_allclose(targets.returns, expected, rtol=1e-12)
    for (t, env), obs in zip(b.truncated_index, b.truncated_obs, strict=True):
        if cut[t, env]:  # the value of the observation the step reached, not the reset one
            assert targets.returns[t, env] == pytest.approx(b.reward[t, env] + 0.9 * critic(obs))
    # The first rollout is acted with the version published: zero lag, V-trace is GAE.
    assert (b.lag == 0).all()
    same = vtrace(b.logprob, b.logprob, b.reward, values, boot, b.terminated, gamma=0.9, **ends)
    np.testing.assert_array_equal(same.returns, targets.returns)
