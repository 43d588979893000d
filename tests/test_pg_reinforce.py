"""The REINFORCE estimator g_H: reward-to-go by hand, and E[g_H] = grad J_H by enumeration."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from aps.errors import ConfigError
from aps.pg import NIGTUpdate, flatten, unflatten
from aps.pg.reinforce import reward_to_go, surrogate

# -- reward_to_go ----------------------------------------------------------------------------


def test_reward_to_go_by_hand() -> None:
    # weight_t = sum_{h >= t} 0.5^h r_h with r = [1, 2, 3]:
    #   t=0: 1 + 0.5*2 + 0.25*3 = 2.75;  t=1: 1 + 0.75 = 1.75;  t=2: 0.75.
    # (The relative discount 0.5^(h-t) would give [2.75, 3.5, 3.0].)
    weights = reward_to_go(np.array([1.0, 2.0, 3.0]), 0.5)
    assert weights.dtype == np.float64
    assert np.allclose(weights, [2.75, 1.75, 0.75], rtol=0, atol=1e-15)


@pytest.mark.parametrize(
    ("rewards", "gamma", "expected"),
    [
        ([1.0, 2.0, 3.0], 1.0, [6.0, 5.0, 3.0]),
        ([1.0, 2.0, 3.0], 0.0, [1.0, 0.0, 0.0]),  # gamma^0 = 1
        ([4.0], 0.9, [4.0]),
        ([0.0, 0.0, -1.0], 0.9, [-0.81, -0.81, -0.81]),
        ([1, 1], 0.5, [1.5, 0.5]),  # int rewards
        ([], 0.99, []),
    ],
)
def test_reward_to_go_table(rewards: list[float], gamma: float, expected: list[float]) -> None:
    assert np.allclose(reward_to_go(np.array(rewards), gamma), expected, rtol=0, atol=1e-12)


@settings(max_examples=100, deadline=None)
@given(
    rewards=hnp.arrays(np.float64, st.integers(1, 30), elements=st.floats(-10, 10)),
    gamma=st.floats(0.0, 1.0),
)
def test_reward_to_go_differences_are_discounted_rewards(rewards: np.ndarray, gamma: float) -> None:
    weights = reward_to_go(rewards, gamma)
    h = np.arange(rewards.shape[0])
    assert weights[0] == pytest.approx(float(np.sum(gamma**h * rewards)), abs=1e-9)
    assert np.allclose(weights[:-1] - weights[1:], (gamma**h * rewards)[:-1], atol=1e-9)
    assert weights[-1] == pytest.approx(gamma ** h[-1] * rewards[-1], abs=1e-12)


@pytest.mark.parametrize("gamma", [-0.1, 1.01, float("nan"), float("inf"), True, "0.9"])
def test_bad_gamma_is_refused(gamma: object) -> None:
    with pytest.raises(ConfigError, match="gamma"):
        reward_to_go(np.ones(3), gamma)  # type: ignore[arg-type]


def test_rewards_must_be_one_trajectory() -> None:
    with pytest.raises(ConfigError, match="1-d"):
        reward_to_go(np.ones((2, 3)), 0.9)
    with pytest.raises(ConfigError, match="1-d"):
        reward_to_go(np.array(["a"]), 0.9)


# -- surrogate -------------------------------------------------------------------------------


def test_surrogate_gradient_is_the_reward_to_go() -> None:
    log_probs = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    surrogate(log_probs, np.array([1.0, 2.0, 3.0]), 0.5).backward()  # type: ignore[no-untyped-call]
    assert log_probs.grad is not None
    assert torch.allclose(log_probs.grad, torch.tensor([2.75, 1.75, 0.75], dtype=torch.float64))


def test_surrogate_of_a_one_step_trajectory() -> None:
    # A reversed one-entry array keeps a negative stride that torch refuses.
    log_probs = torch.zeros(1, requires_grad=True)
    surrogate(log_probs, np.array([2.0]), 0.9).backward()  # type: ignore[no-untyped-call]
    assert log_probs.grad is not None and log_probs.grad.tolist() == [2.0]


def test_surrogate_keeps_dtype_and_detaches_tensor_rewards() -> None:
    log_probs = torch.tensor([-0.5, -1.0], requires_grad=True)
    rewards = torch.tensor([1.0, 1.0], requires_grad=True)
    value = surrogate(log_probs, rewards, 1.0)
    assert value.dtype == torch.float32 and value.ndim == 0
    assert value.item() == pytest.approx(2.0 * -0.5 + 1.0 * -1.0)
    value.backward()  # type: ignore[no-untyped-call]
    assert rewards.grad is None  # no gradient flows through the rewards


def test_surrogate_checks_shapes() -> None:
    with pytest.raises(ConfigError, match="2 rewards and 3 log-probabilities"):
        surrogate(torch.zeros(3), np.ones(2), 0.9)
    with pytest.raises(ConfigError, match="1-d"):
        surrogate(torch.zeros(2, 3), np.ones(3), 0.9)


# -- E[g_H] = grad J_H on a tiny deterministic env, by enumerating every trajectory ----------
#
# Two states, two actions, horizon 3. The next state is (s + a) mod 2 from s_0 = 0, and the
# reward r(s, a) is a fixed table. The policy is a tabular softmax over logits[s, a], shared
# across time steps, so a state recurs within a trajectory and the discount's form matters.

H = 3
GAMMA = 0.9
REWARD = torch.tensor([[1.0, -0.5], [2.0, 0.25]], dtype=torch.float64)


def trajectories() -> list[tuple[list[int], list[int], list[float]]]:
    """Every (states, actions, rewards) of length H; the env is deterministic."""
    out = []
    for actions in itertools.product((0, 1), repeat=H):
        states, rewards, s = [], [], 0
        for a in actions:
            states.append(s)
            rewards.append(float(REWARD[s, a]))
            s = (s + a) % 2
        out.append((states, list(actions), rewards))
    return out


def log_probs_of(logits: torch.Tensor, states: list[int], actions: list[int]) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1)[states, actions]


def exact_objective(logits: torch.Tensor) -> torch.Tensor:
    """J_H = sum over trajectories of P(tau) * sum_h gamma^h r_h."""
    total = torch.zeros((), dtype=torch.float64)
    for states, actions, rewards in trajectories():
        p = log_probs_of(logits, states, actions).sum().exp()
        ret = sum(GAMMA**h * r for h, r in enumerate(rewards))
        total = total + p * ret
    return total


def expected_estimate(logits: torch.Tensor, weights_of: object = None) -> torch.Tensor:
    """sum over trajectories of P(tau) * g_H(tau), each g_H from the surrogate's gradient."""
    expectation = torch.zeros_like(logits)
    for states, actions, rewards in trajectories():
        leaf = logits.detach().clone().requires_grad_(True)
        log_probs = log_probs_of(leaf, states, actions)
        if weights_of is None:
            value = surrogate(log_probs, np.array(rewards), GAMMA)
        else:  # a deliberately wrong estimator, to show the test can fail
            assert callable(weights_of)
            value = (torch.as_tensor(weights_of(rewards)) * log_probs).sum()
        (grad,) = torch.autograd.grad(value, leaf)
        p = log_probs.detach().sum().exp()
        expectation += p * grad
    return expectation


def relative_reward_to_go(rewards: list[float]) -> np.ndarray:
    return np.array([sum(GAMMA ** (h - t) * rewards[h] for h in range(t, H)) for t in range(H)])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_expected_g_h_is_the_gradient_of_j_h(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 2, generator=generator, dtype=torch.float64)
    theta = logits.clone().requires_grad_(True)
    (exact,) = torch.autograd.grad(exact_objective(theta), theta)
    estimate = expected_estimate(logits)
    assert torch.allclose(estimate, exact, rtol=1e-10, atol=1e-12)
    # The probabilities sum to one, so the enumeration is complete.
    total = sum(float(log_probs_of(logits, s, a).sum().exp()) for s, a, _ in trajectories())
    assert total == pytest.approx(1.0, abs=1e-12)
    # The relative discount gamma^(h-t) estimates something else.
    wrong = expected_estimate(logits, relative_reward_to_go)
    assert not torch.allclose(wrong, exact, rtol=1e-3, atol=1e-6)


def test_nigt_climbs_j_h_with_gradients_taken_at_the_broadcast_point() -> None:
    weights = {"logits": np.zeros((2, 2), dtype=np.float32)}
    theta, layout = flatten(weights)
    rule = NIGTUpdate(lr=0.05, momentum=0.5)
    state = rule.start(theta)

    def logits_at(vector: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(unflatten(vector, layout)["logits"], dtype=torch.float64)

    start = float(exact_objective(logits_at(state.theta)))
    for _ in range(30):
        point = logits_at(state.point).requires_grad_(True)
        (grad,) = torch.autograd.grad(exact_objective(point), point)  # = E[g_H] at the point
        state = rule.step(state, layout.flatten({"logits": grad.numpy()}))
    assert float(exact_objective(logits_at(state.theta))) > start + 0.3
