"""The torch adapter: CleanRL-shaped agents act, compare and move weights through aps.policy."""

from __future__ import annotations

import gc
import math
import sys
import textwrap
import warnings
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gymnasium import spaces
from torch import nn
from torch.distributions import Categorical, Normal, kl_divergence

from aps.errors import ConfigError
from aps.policy import (
    Policy,
    VectorEnvSpaces,
    build_module,
    compact_weights,
    limit_threads,
    load_policy_factory,
    weights_nbytes,
)

OBS = spaces.Box(-np.inf, np.inf, shape=(4,), dtype=np.float32)
DISCRETE = spaces.Discrete(3)
BOX = spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)


# Agents shaped like CleanRL's (ppo.py, ppo_continuous_action.py, dqn.py), written here.


def layer_init(layer: nn.Linear, std: float = math.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    """Categorical actor-critic, built from a vector env like CleanRL's PPO agent."""

    def __init__(self, envs: Any) -> None:
        super().__init__()
        obs_dim = int(np.array(envs.single_observation_space.shape).prod())
        self.critic = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 16)),
            nn.Tanh(),
            layer_init(nn.Linear(16, 16)),
            nn.Tanh(),
            layer_init(nn.Linear(16, 1), std=1.0),
        )
        self.actor = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 16)),
            nn.Tanh(),
            layer_init(nn.Linear(16, 16)),
            nn.Tanh(),
            layer_init(nn.Linear(16, envs.single_action_space.n), std=0.01),
        )

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(x)  # type: ignore[no-any-return]


class ContinuousAgent(nn.Module):
    """Gaussian actor-critic like CleanRL's ppo_continuous_action agent."""

    def __init__(self, envs: Any) -> None:
        super().__init__()
        obs_dim = int(np.array(envs.single_observation_space.shape).prod())
        act_dim = int(np.prod(envs.single_action_space.shape))
        self.critic = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 16)), nn.Tanh(), layer_init(nn.Linear(16, 1), std=1.0)
        )
        self.actor_mean = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 16)),
            nn.Tanh(),
            layer_init(nn.Linear(16, act_dim), std=0.01),
        )
        self.actor_logstd = nn.Parameter(torch.zeros(1, act_dim))


class QNetwork(nn.Module):
    """A DQN Q-network like CleanRL's dqn.py, built from the two spaces."""

    def __init__(self, observation_space: spaces.Box, action_space: spaces.Discrete) -> None:
        super().__init__()
        self.network = nn.Sequential(
            nn.Linear(int(np.prod(observation_space.shape)), 12),
            nn.ReLU(),
            nn.Linear(12, int(action_space.n)),
        )
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)  # type: ignore[no-any-return]


def categorical(seed: int = 0, **options: Any) -> Policy:
    torch.manual_seed(seed)
    return Policy(build_module(Agent, OBS, DISCRETE), OBS, DISCRETE, seed=seed, **options)


def gaussian(seed: int = 0) -> Policy:
    torch.manual_seed(seed)
    return Policy(build_module(ContinuousAgent, OBS, BOX), OBS, BOX, seed=seed)


def qpolicy(seed: int = 0, **options: Any) -> Policy:
    torch.manual_seed(seed)
    return Policy(build_module(QNetwork, OBS, DISCRETE), OBS, DISCRETE, seed=seed, **options)


def observations(n: int = 32, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, 4)).astype(np.float32)


def perturb(policy: Policy, scale: float, seed: int = 1) -> Policy:
    other = policy.clone()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in other.module.parameters():
            parameter.add_(scale * torch.randn(parameter.shape, generator=generator))
    return other


def tensor(obs: np.ndarray) -> torch.Tensor:
    return torch.as_tensor(obs, dtype=torch.float32)


# -- kinds and factories -------------------------------------------------------------------


def test_kinds_are_detected_from_attributes() -> None:
    assert (categorical().kind, categorical().has_critic) == ("categorical", True)
    assert (gaussian().kind, gaussian().has_critic) == ("gaussian", True)
    assert (qpolicy().kind, qpolicy().has_critic) == ("q", False)


def test_actor_without_critic() -> None:
    class ActorOnly(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.actor = nn.Linear(4, 3)

    policy = Policy(ActorOnly(), OBS, DISCRETE, seed=0)
    assert policy.kind == "categorical" and not policy.has_critic
    assert policy.act(observations(5))[2] is None


def test_envs_style_factory_gets_a_vector_env_stand_in() -> None:
    seen: list[Any] = []

    def make(envs: Any, hidden: int = 8) -> nn.Module:
        seen.append(envs)
        return nn.Linear(4, 3)

    build_module(make, OBS, DISCRETE)
    (envs,) = seen
    assert isinstance(envs, VectorEnvSpaces)
    assert envs.single_observation_space == OBS and envs.single_action_space == DISCRETE
    assert envs.observation_space.shape == (1, 4)
    assert envs.action_space == spaces.MultiDiscrete([3])
    assert envs.num_envs == 1


def test_two_space_factory_and_keyword_arguments() -> None:
    calls: list[tuple[Any, ...]] = []

    def make(observation_space: Any, action_space: Any, hidden: int = 8) -> nn.Module:
        calls.append((observation_space, action_space, hidden))
        return nn.Linear(4, 3)

    build_module(make, OBS, DISCRETE, hidden=5)
    assert calls == [(OBS, DISCRETE, 5)]

    def keyword_only(envs: Any, *, hidden: int) -> nn.Module:
        calls.append((hidden, envs))
        return nn.Linear(4, 3)

    build_module(keyword_only, OBS, DISCRETE, hidden=2)
    assert isinstance(calls[-1][1], VectorEnvSpaces)


def test_factory_failures_are_config_errors() -> None:
    def broken(envs: Any) -> nn.Module:
        raise KeyError("nope")

    with pytest.raises(ConfigError, match="broken raised KeyError") as info:
        build_module(broken, OBS, DISCRETE)
    assert isinstance(info.value.__cause__, KeyError)

    def not_a_module(observation_space: Any, action_space: Any) -> Any:
        return {"weights": 1}

    with pytest.raises(ConfigError, match=r"returned dict, not a torch\.nn\.Module"):
        build_module(not_a_module, OBS, DISCRETE)


# -- acting --------------------------------------------------------------------------------


def test_categorical_act_shapes_and_log_probs() -> None:
    policy = categorical()
    obs = observations(64)
    actions, log_probs, values = policy.act(obs)
    assert actions.shape == (64,) and actions.dtype == np.int64
    assert log_probs.shape == (64,) and log_probs.dtype == np.float32
    assert values is not None and values.shape == (64,) and values.dtype == np.float32
    assert set(actions.tolist()) <= {0, 1, 2}
    module: Agent = policy.module  # type: ignore[assignment]
    with torch.no_grad():
        expected = Categorical(logits=module.actor(tensor(obs))).log_prob(torch.as_tensor(actions))  # type: ignore[no-untyped-call]
        expected_values = module.critic(tensor(obs)).squeeze(1)
    np.testing.assert_allclose(log_probs, expected.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(values, expected_values.numpy(), rtol=1e-5, atol=1e-6)


def test_gaussian_act_shapes_and_log_probs() -> None:
    policy = gaussian()
    module: ContinuousAgent = policy.module  # type: ignore[assignment]
    with torch.no_grad():
        module.actor_logstd.fill_(-0.5)
    obs = observations(64).astype(np.float64)  # any float dtype is accepted
    actions, log_probs, values = policy.act(obs)
    assert actions.shape == (64, 2) and actions.dtype == np.float32
    assert log_probs.shape == (64,) and log_probs.dtype == np.float32
    assert values is not None and values.shape == (64,)
    with torch.no_grad():
        mean = module.actor_mean(tensor(obs))
        dist = Normal(mean, module.actor_logstd.expand_as(mean).exp())
        expected = dist.log_prob(torch.as_tensor(actions)).sum(1)  # type: ignore[no-untyped-call]
    np.testing.assert_allclose(log_probs, expected.numpy(), rtol=1e-5, atol=1e-5)
    # Raw samples, not clipped: some fall outside [-1, 1] with std exp(-0.5) around ~0.
    assert np.abs(actions).max() > 1.0


def test_multi_dimensional_box_actions_keep_the_space_shape() -> None:
    box = spaces.Box(-1.0, 1.0, shape=(2, 3), dtype=np.float32)

    class Agent6(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.actor_mean = nn.Linear(4, 6)
            self.actor_logstd = nn.Parameter(torch.zeros(1, 6))

    actions, log_probs, values = Policy(Agent6(), OBS, box, seed=0).act(observations(5))
    assert actions.shape == (5, 2, 3) and log_probs.shape == (5,) and values is None


def test_discrete_start_offsets_actions() -> None:
    space = spaces.Discrete(3, start=-1)
    policy = Policy(build_module(Agent, OBS, space), OBS, space, seed=0)
    actions, _, _ = policy.act(observations(200))
    assert set(actions.tolist()) == {-1, 0, 1}


def test_epsilon_greedy_log_probs_and_greedy_limit() -> None:
    policy = qpolicy(epsilon=0.2)
    obs = observations(500)
    actions, log_probs, values = policy.act(obs)
    assert values is None and actions.dtype == np.int64 and log_probs.dtype == np.float32
    with torch.no_grad():
        greedy = policy.module(tensor(obs)).argmax(1).numpy()
    expected = np.where(actions == greedy, np.log(0.8 + 0.2 / 3), np.log(0.2 / 3))
    np.testing.assert_allclose(log_probs, expected, rtol=1e-5)
    assert 0.8 < np.mean(actions == greedy) < 0.95  # 1 - epsilon + epsilon / n = 0.867

    policy.epsilon = 0.0
    actions, log_probs, _ = policy.act(obs)
    np.testing.assert_array_equal(actions, greedy)
    np.testing.assert_array_equal(log_probs, np.zeros(500, dtype=np.float32))

    policy.epsilon = 1.0
    actions, log_probs, _ = policy.act(obs)
    np.testing.assert_allclose(log_probs, np.full(500, np.log(1 / 3)), rtol=1e-6)


def test_boltzmann_log_probs() -> None:
    policy = qpolicy(exploration="boltzmann", temperature=0.5)
    obs = observations(50)
    actions, log_probs, _ = policy.act(obs)
    with torch.no_grad():
        dist = Categorical(logits=policy.module(tensor(obs)) / 0.5)
        expected = dist.log_prob(torch.as_tensor(actions))  # type: ignore[no-untyped-call]
    np.testing.assert_allclose(log_probs, expected.numpy(), rtol=1e-5, atol=1e-6)
    assert policy.behaviour_params() == {"temperature": 0.5}


@pytest.mark.parametrize("make", [categorical, gaussian, qpolicy])
def test_seeding_is_reproducible_and_private(make: Any) -> None:
    obs = observations(128)
    first, second = make(), make()
    first.seed(7)
    second.seed(7)
    global_state = torch.get_rng_state()
    a = first.act(obs)
    b = second.act(obs)
    assert torch.equal(torch.get_rng_state(), global_state)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    second.seed(8)
    assert not np.array_equal(first.act(obs)[0], second.act(obs)[0])


def test_act_refuses_misshapen_observations() -> None:
    policy = categorical()
    with pytest.raises(ConfigError, match=r"shape \(4,\) do not match \[batch, \*\(4,\)\]"):
        policy.act(np.zeros(4))
    with pytest.raises(ConfigError, match=r"shape \(2, 5\)"):
        policy.act(np.zeros((2, 5)))
    with pytest.raises(ConfigError, match="batch >= 1"):
        policy.act(np.zeros((0, 4)))


def test_read_only_observations_are_accepted() -> None:
    obs = observations(3)
    obs.flags.writeable = False
    categorical().act(obs)  # warnings are errors in this suite


# -- acting with NumPy ---------------------------------------------------------------------


def torch_twin(policy: Policy) -> Policy:
    """A policy over the same module that always acts with torch."""
    return Policy(
        policy.module, policy.observation_space, policy.action_space, seed=0, inference="torch"
    )


def assert_acts_like_torch(policy: Policy, obs: np.ndarray) -> None:
    """The log-probabilities and values ``act`` returns are torch's for the same actions."""
    actions, log_probs, values = policy.act(obs)
    with torch.no_grad():
        expected = torch_twin(policy).log_prob(obs, actions).numpy()
        dtype = next(policy.module.parameters()).dtype
        expected_values = policy.module.critic(torch.tensor(obs, dtype=dtype))
    np.testing.assert_allclose(log_probs, expected, rtol=1e-5, atol=1e-5)
    assert values is not None
    np.testing.assert_allclose(values, expected_values.reshape(-1).numpy(), rtol=1e-5, atol=1e-6)


def test_cleanrl_agents_act_with_numpy_and_others_with_torch() -> None:
    assert categorical().inference == "numpy" and gaussian().inference == "numpy"
    assert qpolicy().inference == "torch"  # a custom forward: only torch knows it
    assert categorical(inference="torch").inference == "torch"
    with pytest.raises(ConfigError, match="inference must be 'auto' or 'torch', got 'jax'"):
        categorical(inference="jax")


@pytest.mark.parametrize(
    "layer",
    [nn.LayerNorm(16), nn.Dropout(0.5), type("MyTanh", (nn.Tanh,), {})()],
    ids=["layernorm", "dropout", "tanh-subclass"],
)
def test_heads_that_are_not_plain_mlps_act_with_torch(layer: nn.Module) -> None:
    policy = categorical()
    module: Agent = policy.module  # type: ignore[assignment]
    module.actor = nn.Sequential(nn.Linear(4, 16), layer, nn.Linear(16, 3))
    fresh = Policy(module, OBS, DISCRETE, seed=0)
    assert fresh.inference == "torch"
    assert policy.inference == "torch"  # the replaced head is noticed by an older policy too
    policy.act(observations(8))


def test_numpy_samples_follow_the_softmax() -> None:
    policy = categorical()
    module: Agent = policy.module  # type: ignore[assignment]
    with torch.no_grad():
        module.actor[-1].weight.zero_()
        module.actor[-1].bias.copy_(torch.tensor([0.0, 1.0, -1.0]))
    obs = observations(20_000)
    actions, log_probs, _ = policy.act(obs)
    probs = torch.softmax(torch.tensor([0.0, 1.0, -1.0]), 0).numpy()
    counts = np.bincount(actions, minlength=3)
    sigma = np.sqrt(len(obs) * probs * (1 - probs))
    assert np.all(np.abs(counts - len(obs) * probs) < 5 * sigma), (counts, probs)
    np.testing.assert_allclose(log_probs, np.log(probs)[actions], rtol=1e-5)


@pytest.mark.parametrize("make", [categorical, gaussian])
def test_numpy_acting_matches_torch_and_follows_in_place_updates(make: Any) -> None:
    policy = make()
    obs = observations(64)
    assert_acts_like_torch(policy, obs)
    optimizer = torch.optim.SGD(policy.module.parameters(), lr=0.1)
    loss = policy.log_prob(obs, policy.act(obs)[0]).mean()
    loss.backward()
    optimizer.step()  # in place: the NumPy views see it
    assert policy.inference == "numpy"
    assert_acts_like_torch(policy, obs)


def test_numpy_acting_follows_replaced_tensors() -> None:
    policy, source = categorical(), perturb(categorical(), 0.5)
    obs = observations(64)
    policy.set_weights(source.get_weights(), share=True)  # the parameters take new memory
    assert policy.inference == "numpy"
    assert_acts_like_torch(policy, obs)
    policy.module.double()
    assert policy.inference == "numpy"
    assert_acts_like_torch(policy, obs.astype(np.float64))
    policy.module.critic = nn.Sequential(nn.Linear(4, 1))  # float32 among float64: torch
    assert policy.inference == "torch"
    policy.module.critic.double()
    assert policy.inference == "torch"  # the policy no longer qualified: torch from now on
    assert_acts_like_torch(policy, obs.astype(np.float64))


def test_a_forward_hook_makes_torch_act_while_it_is_registered() -> None:
    policy = categorical()
    module: Agent = policy.module  # type: ignore[assignment]
    calls: list[int] = []
    handle = module.actor[2].register_forward_hook(lambda m, i, o: calls.append(len(o)))
    assert policy.inference == "torch"
    policy.act(observations(5))
    assert calls == [5]
    handle.remove()
    assert policy.inference == "numpy"
    policy.act(observations(5))
    assert calls == [5]
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        assert policy.inference == "torch"
    finally:
        handle.remove()


@pytest.mark.parametrize("inference", ["auto", "torch"])
def test_nan_weights_are_refused_when_acting(inference: Any) -> None:
    policy = categorical(inference=inference)
    module: Agent = policy.module  # type: ignore[assignment]
    with torch.no_grad():
        module.actor[0].weight[0, 0] = float("nan")
    obs = observations(6)
    obs[::2, 0] = 0.0  # NaN * 0 is still NaN: every row
    with pytest.raises(ConfigError, match="NaN action probabilities for 6 of 6 observations"):
        policy.act(obs)


def test_numpy_acting_never_writes_the_observations() -> None:
    policy = categorical()
    module: Agent = policy.module  # type: ignore[assignment]
    module.critic = nn.Sequential(nn.Tanh(), nn.Linear(4, 1))  # an activation comes first
    obs = observations(8) * 3
    obs.flags.writeable = False
    before = obs.copy()
    assert policy.inference == "numpy"
    assert_acts_like_torch(policy, obs)
    np.testing.assert_array_equal(obs, before)


# -- divergence ----------------------------------------------------------------------------


def test_categorical_kl_matches_torch() -> None:
    p, obs = categorical(), observations(100)
    q = perturb(p, 0.3)
    with torch.no_grad():
        l0 = p.module.actor(tensor(obs))  # type: ignore[operator]
        l1 = q.module.actor(tensor(obs))  # type: ignore[operator]
        expected = kl_divergence(Categorical(logits=l0), Categorical(logits=l1)).mean().item()
    assert expected > 1e-3
    assert p.kl(q, obs) == pytest.approx(expected, rel=1e-4)
    assert q.kl(p, obs) != pytest.approx(expected, rel=1e-3)  # the direction matters


def test_gaussian_kl_matches_torch() -> None:
    p, obs = gaussian(), observations(100)
    q = perturb(p, 0.2)
    m0: ContinuousAgent = p.module  # type: ignore[assignment]
    m1: ContinuousAgent = q.module  # type: ignore[assignment]
    with torch.no_grad():
        mean0, mean1 = m0.actor_mean(tensor(obs)), m1.actor_mean(tensor(obs))
        d0 = Normal(mean0, m0.actor_logstd.exp().expand_as(mean0))
        d1 = Normal(mean1, m1.actor_logstd.exp().expand_as(mean1))
        expected = kl_divergence(d0, d1).sum(1).mean().item()
    assert expected > 1e-3
    assert p.kl(q, obs) == pytest.approx(expected, rel=1e-4)


def test_epsilon_greedy_kl_matches_the_hand_formula() -> None:
    p, obs = qpolicy(epsilon=0.1), observations(200)
    q = perturb(p, 0.5)
    q.epsilon = 0.3
    with torch.no_grad():
        g0 = p.module(tensor(obs)).argmax(1).numpy()
        g1 = q.module(tensor(obs)).argmax(1).numpy()
    assert 0 < np.mean(g0 != g1) < 1

    def probs(greedy: np.ndarray, epsilon: float) -> np.ndarray:
        out = np.full((len(greedy), 3), epsilon / 3)
        out[np.arange(len(greedy)), greedy] += 1 - epsilon
        return out

    a, b = probs(g0, 0.1), probs(g1, 0.3)
    expected = float(np.mean(np.sum(a * np.log(a / b), axis=1)))
    assert p.kl(q, obs) == pytest.approx(expected, rel=1e-5)


def test_epsilon_zero_kl_is_infinite_when_argmax_differs() -> None:
    p, obs = qpolicy(epsilon=0.0), observations(200)
    q = perturb(p, 0.5)
    assert math.isinf(p.kl(q, obs))
    assert p.kl(p.clone(), obs) == 0.0


def test_boltzmann_kl_matches_torch() -> None:
    p, obs = qpolicy(exploration="boltzmann", temperature=2.0), observations(50)
    q = perturb(p, 0.3)
    with torch.no_grad():
        d0 = Categorical(logits=p.module(tensor(obs)) / 2.0)
        d1 = Categorical(logits=q.module(tensor(obs)) / 2.0)
        expected = kl_divergence(d0, d1).mean().item()
    assert p.kl(q, obs) == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("make", [categorical, gaussian, qpolicy])
def test_kl_of_a_policy_with_itself_is_zero(make: Any) -> None:
    p, obs = make(), observations(64)
    assert p.kl(p, obs) == 0.0
    assert p.kl(p.clone(), obs) == 0.0


def test_kl_subsamples_evenly_and_deterministically() -> None:
    p, obs = categorical(), observations(100)
    q = perturb(p, 0.3)
    index = np.linspace(0, 99, num=10).astype(np.int64)
    assert index[0] == 0 and index[-1] == 99 and len(set(index.tolist())) == 10
    assert p.kl(q, obs, max_states=10) == p.kl(q, obs[index], max_states=None)
    assert p.kl(q, obs, max_states=10) != p.kl(q, obs, max_states=None)
    assert p.kl(q, obs, max_states=100) == p.kl(q, obs, max_states=None)
    assert p.kl(q, obs, max_states=1) == p.kl(q, obs[:1])


def test_kl_flattens_leading_dimensions() -> None:
    p, obs = gaussian(), observations(24)
    q = perturb(p, 0.2)
    assert p.kl(q, obs.reshape(6, 4, 4)) == pytest.approx(p.kl(q, obs), rel=1e-12)


def test_kl_refusals() -> None:
    p = categorical()
    with pytest.raises(ConfigError, match="cannot compare a categorical policy"):
        p.kl(qpolicy(), observations())
    with pytest.raises(ConfigError, match="max_states must be None or an int >= 1, got 0"):
        p.kl(p, observations(), max_states=0)
    with pytest.raises(ConfigError, match="at least one state"):
        p.kl(p, np.zeros((0, 4)))
    with pytest.raises(ConfigError, match=r"do not match \[\.\.\., \*\(4,\)\]"):
        p.kl(p, np.zeros((3, 5)))


# -- weights -------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [categorical, gaussian, qpolicy])
def test_weight_round_trip_is_exact(make: Any) -> None:
    source, target = make(seed=1), make(seed=2)
    weights = source.get_weights()
    assert list(weights) == list(source.module.state_dict())
    assert all(a.flags.c_contiguous for a in weights.values())
    obs = observations(16)
    assert target.kl(source, obs) > 0
    for array in weights.values():
        array.flags.writeable = False  # as decoded from the wire
    target.set_weights(weights)
    back = target.get_weights()
    assert list(back) == list(weights)
    for name in weights:
        assert back[name].dtype == weights[name].dtype
        np.testing.assert_array_equal(back[name], weights[name])
    source.seed(3)
    target.seed(3)
    for a, b in zip(source.act(obs), target.act(obs), strict=True):
        if a is None:
            assert b is None
        else:
            np.testing.assert_array_equal(a, b)
    assert target.kl(source, obs) == 0.0


def test_weights_are_copies_with_buffers_and_their_dtypes() -> None:
    policy = qpolicy()
    weights = policy.get_weights()
    assert weights["calls"].dtype == np.int64 and weights["calls"].shape == ()
    weights["network.0.weight"][:] = 0
    assert not torch.all(policy.module.get_parameter("network.0.weight") == 0)
    assert weights_nbytes(weights) == sum(a.nbytes for a in weights.values())
    assert weights_nbytes(weights) == (4 * 12 + 12 + 12 * 3 + 3) * 4 + 8


def test_weights_of_non_contiguous_tensors_are_c_contiguous_copies() -> None:
    policy = qpolicy()
    layer = policy.module.get_submodule("network.0")
    transposed = torch.arange(12 * 4, dtype=torch.float32).reshape(12, 4).t().contiguous().t()
    assert not transposed.is_contiguous()
    with torch.no_grad():
        layer.weight = torch.nn.Parameter(transposed)
    array = policy.get_weights()["network.0.weight"]
    assert array.flags.c_contiguous and array.flags.writeable
    np.testing.assert_array_equal(array, transposed.numpy())
    array[0, 0] = -1.0
    assert layer.weight[0, 0] == 0.0


def test_float64_modules_act_and_round_trip() -> None:
    torch.manual_seed(0)
    module = build_module(QNetwork, OBS, DISCRETE).double()
    policy = Policy(module, OBS, DISCRETE, seed=0)
    weights = policy.get_weights()
    assert weights["network.0.weight"].dtype == np.float64
    policy.act(observations(3))
    policy.set_weights(weights)


def test_compact_weights_load_widened_and_only_when_asked() -> None:
    policy = categorical()
    exact = policy.get_weights()
    compact = compact_weights({**exact, "steps": np.arange(3, dtype=np.int64)})
    assert compact["steps"].dtype == np.int64  # not a float: as it was
    del compact["steps"]
    assert all(array.dtype == np.float16 for array in compact.values())
    with pytest.raises(ConfigError, match="has dtype float16, the module's is float32"):
        policy.set_weights(compact)  # no casting unless asked
    policy.set_weights(compact, widen=True)
    for name, array in policy.get_weights().items():
        assert array.dtype == np.float32
        np.testing.assert_array_equal(array, compact[name].astype(np.float32))
    wider = {**exact, "critic.0.bias": exact["critic.0.bias"].astype(np.float64)}
    with pytest.raises(ConfigError, match="has dtype float64"):  # widen is float16 only
        policy.set_weights(wider, widen=True)


def test_set_weights_refuses_before_changing_anything() -> None:
    policy = categorical()
    good = policy.get_weights()
    before = {name: array.copy() for name, array in good.items()}

    def refused(weights: dict[str, Any], match: str) -> None:
        with pytest.raises(ConfigError, match=match):
            policy.set_weights(weights)
        for name, array in policy.get_weights().items():
            np.testing.assert_array_equal(array, before[name])

    changed = {name: np.zeros_like(array) for name, array in good.items()}
    missing = dict(changed)
    del missing["actor.0.weight"]
    refused(missing, r"missing 'actor\.0\.weight'")
    refused({**changed, "extra": np.zeros(1)}, r"unexpected 'extra'")
    refused(
        {**changed, "critic.0.bias": np.zeros(17, np.float32)},
        r"'critic\.0\.bias' has shape \(17,\), the module's is \(16,\)",
    )
    refused(
        {**changed, "critic.0.bias": np.zeros(16, np.float64)},
        r"'critic\.0\.bias' has dtype float64, the module's is float32",
    )
    refused({**changed, "critic.0.bias": [0.0] * 16}, r"'critic\.0\.bias' is a list")
    many = {f"extra{i}": np.zeros(1) for i in range(12)}
    refused({**changed, **many}, "and 4 more")


def test_bfloat16_weights_are_refused_with_the_fix() -> None:
    policy = qpolicy()
    policy.module.to(torch.bfloat16)
    with pytest.raises(ConfigError, match=r"bfloat16.*module\.float\(\)"):
        policy.get_weights()


def test_clone_is_independent_and_samples_alike() -> None:
    policy = categorical()
    twin = policy.clone()
    obs = observations(64)
    np.testing.assert_array_equal(policy.act(obs)[0], twin.act(obs)[0])
    with torch.no_grad():
        for parameter in twin.module.parameters():
            parameter.zero_()
    assert any(bool(p.abs().sum() > 0) for p in policy.module.parameters())
    assert twin.kind == policy.kind and twin.has_critic


# -- exploration parameters ----------------------------------------------------------------


def test_behaviour_params() -> None:
    q = qpolicy()
    assert q.epsilon == 0.05 and q.behaviour_params() == {"epsilon": 0.05}
    q.set_behaviour_params({"epsilon": 0.5})
    assert q.epsilon == 0.5
    with pytest.raises(ConfigError, match=r"unknown behaviour parameters \['temperature'\]"):
        q.set_behaviour_params({"temperature": 2.0})
    with pytest.raises(ConfigError, match=r"epsilon must be a number in \[0, 1\], got 1.5"):
        q.set_behaviour_params({"epsilon": 1.5})
    assert q.epsilon == 0.5
    with pytest.raises(ConfigError, match=r"got -0\.1"):
        q.epsilon = -0.1
    p = categorical()
    assert p.behaviour_params() == {}
    with pytest.raises(ConfigError, match="epsilon applies to Q-network policies only"):
        p.epsilon = 0.1
    with pytest.raises(ConfigError, match="temperature must be a finite number > 0, got 0"):
        qpolicy(exploration="boltzmann", temperature=0)
    with pytest.raises(ConfigError, match="exploration must be 'epsilon' or 'boltzmann'"):
        qpolicy(exploration="softmax")
    assert "epsilon=0.5" in repr(q)


# -- unsupported agents --------------------------------------------------------------------


class GaussianHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.actor_mean = nn.Linear(4, 2)
        self.actor_logstd = nn.Parameter(torch.zeros(1, 2))


class CategoricalHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.actor = nn.Linear(4, 3)


@pytest.mark.parametrize(
    ("module", "observation_space", "action_space", "match"),
    [
        (GaussianHead(), OBS, DISCRETE, r"Gaussian head \(actor_logstd, actor_mean\).*Discrete"),
        (CategoricalHead(), OBS, BOX, r"found actor; a Box action space needs both actor_mean"),
        (nn.Linear(4, 2), OBS, BOX, "found no actor head"),
        (CategoricalHead(), OBS, spaces.MultiDiscrete([3, 3]), "MultiDiscrete.*not supported"),
        (
            CategoricalHead(),
            OBS,
            spaces.Box(0, 3, shape=(2,), dtype=np.int64),
            r"Box\(0, 3, \(2,\), int64\) is not supported",
        ),
        (
            CategoricalHead(),
            spaces.Dict({"x": OBS, "name": spaces.Text(4)}),
            DISCRETE,
            "a policy cannot take the Text space",
        ),
        (CategoricalHead(), spaces.Text(4), DISCRETE, "observation space Text"),
        (nn.Linear(4, 5), OBS, DISCRETE, r"forward returned shape \[2, 5\].*needs \[2, 3\]"),
        (
            nn.Sequential(nn.Linear(5, 3)),
            OBS,
            DISCRETE,
            "on a batch of 2 observations of shape \\(4,\\) raised RuntimeError",
        ),
    ],
    ids=[
        "gaussian-discrete",
        "categorical-box",
        "nothing-box",
        "multidiscrete",
        "int-box",
        "dict-obs-with-text",
        "text-obs",
        "q-width",
        "q-input",
    ],
)
def test_unsupported_agents_are_refused(
    module: nn.Module, observation_space: Any, action_space: Any, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        Policy(module, observation_space, action_space)


def test_misshapen_heads_are_refused() -> None:
    class BadLogStd(GaussianHead):
        def __init__(self) -> None:
            super().__init__()
            self.actor_logstd = nn.Parameter(torch.zeros(1, 3))

    with pytest.raises(ConfigError, match=r"actor_logstd returned shape \[1, 3\].*needs \[1, 2\]"):
        Policy(BadLogStd(), OBS, BOX)

    class NotATensor(GaussianHead):
        def __init__(self) -> None:
            super().__init__()
            del self.actor_logstd
            self.actor_logstd = 0.0  # type: ignore[assignment]

    with pytest.raises(ConfigError, match="actor_logstd is a float; a Gaussian policy needs"):
        Policy(NotATensor(), OBS, BOX)

    class BadCritic(CategoricalHead):
        def __init__(self) -> None:
            super().__init__()
            self.critic = nn.Linear(4, 2)

    with pytest.raises(ConfigError, match=r"critic returned shape \[2, 2\]"):
        Policy(BadCritic(), OBS, DISCRETE)

    with pytest.raises(ConfigError, match=r"wraps a torch\.nn\.Module, got function"):
        Policy(lambda x: x, OBS, DISCRETE)  # type: ignore[arg-type]


def test_probe_leaves_train_mode_alone() -> None:
    module = build_module(Agent, OBS, DISCRETE)
    module.train()
    module.get_submodule("actor").eval()
    Policy(module, OBS, DISCRETE)
    assert module.training
    assert not module.get_submodule("actor").training
    assert module.get_submodule("critic").training


# -- loading by import path ----------------------------------------------------------------

AGENT_SOURCE = textwrap.dedent(
    """
    import torch
    from torch import nn

    class Agent(nn.Module):
        def __init__(self, envs):
            super().__init__()
            n = envs.single_action_space.n
            self.actor = nn.Linear(envs.single_observation_space.shape[0], n)
            self.critic = nn.Linear(envs.single_observation_space.shape[0], 1)

    class Makers:
        @staticmethod
        def q(observation_space, action_space):
            return nn.Linear(observation_space.shape[0], action_space.n)

    NOT_CALLABLE = 3

    if __name__ == "__main__":
        raise SystemExit("a script's main block must not run on import")
    """
)


def test_load_from_a_file_path(tmp_path: Path) -> None:
    script = tmp_path / "my-agent.py"
    script.write_text(AGENT_SOURCE)
    factory = load_policy_factory(f"{script}:Agent")
    assert factory is load_policy_factory(f"{script}:Agent")  # imported once per process
    policy = Policy.load(f"{script}:Agent", OBS, DISCRETE, seed=0)
    assert policy.kind == "categorical" and policy.has_critic
    assert Policy.load(f"{script}:Makers.q", OBS, DISCRETE, epsilon=0.2).epsilon == 0.2


def test_load_from_a_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "aps_test_agents"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "ppo.py").write_text(AGENT_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        policy = Policy.load("aps_test_agents.ppo:Agent", OBS, DISCRETE)
        assert policy.kind == "categorical"
        assert load_policy_factory(Agent) is Agent  # a callable passes through
    finally:
        for name in [n for n in sys.modules if n.startswith("aps_test_agents")]:
            del sys.modules[name]


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("no_colon_here", "is not an import path"),
        (":Agent", "is not an import path"),
        ("{dir}/missing.py:Agent", "policy file .*missing.py' does not exist"),
        ("{dir}/agent.py:Nope", "has no attribute 'Nope'"),
        ("{dir}/agent.py:Makers.nope", "has no attribute 'Makers.nope'"),
        ("{dir}/agent.py:NOT_CALLABLE", "names a int, not a class or function"),
        ("{dir}/raises.py:Agent", "raised ZeroDivisionError: division by zero"),
        ("aps_no_such_module_here:Agent", "cannot import module 'aps_no_such_module_here'"),
        (3, "got 3"),
    ],
)
def test_load_errors_name_the_path(tmp_path: Path, spec: Any, match: str) -> None:
    (tmp_path / "agent.py").write_text(AGENT_SOURCE)
    (tmp_path / "raises.py").write_text("1 / 0\n")
    if isinstance(spec, str):
        spec = spec.replace("{dir}", str(tmp_path))
    with pytest.raises(ConfigError, match=match):
        load_policy_factory(spec)


# -- threads -------------------------------------------------------------------------------


def test_limit_threads() -> None:
    from threadpoolctl import threadpool_info, threadpool_limits

    def blas_threads() -> list[int]:
        return [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]

    before = torch.get_num_threads(), max(blas_threads())
    try:
        torch.set_num_threads(2)
        threadpool_limits(limits=2, user_api="blas")
        assert blas_threads() and max(blas_threads()) == 2  # NumPy's BLAS is loaded
        limit_threads(1)
        assert torch.get_num_threads() == 1
        assert blas_threads() == [1] * len(blas_threads())
    finally:
        torch.set_num_threads(before[0])
        threadpool_limits(limits=before[1], user_api="blas")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="limit_threads needs an int >= 1"):
            limit_threads(bad)  # type: ignore[arg-type]


def test_shared_weights_are_the_arrays_memory_and_act_as_copied_ones() -> None:
    from aps.wire import codec
    from aps.wire.messages import Weights

    source = qpolicy()
    with torch.no_grad():
        for parameter in source.module.parameters():
            parameter.add_(0.5)
    frame = codec.encode(Weights(version=1, arrays=source.get_weights(), epsilon=None))
    decoded = codec.decode(frame)
    assert isinstance(decoded, Weights)
    copied, shared = qpolicy(), qpolicy()
    copied.set_weights(decoded.arrays)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # sharing read-only arrays warns nothing
        shared.set_weights(decoded.arrays, share=True)
    for name, tensor in shared.module.state_dict().items():
        assert tensor.data_ptr() == decoded.arrays[name].ctypes.data, name  # no copy
        np.testing.assert_array_equal(tensor.numpy(), source.get_weights()[name])
    obs = np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32)
    copied.seed(3)
    shared.seed(3)
    for ours, theirs in zip(shared.act(obs)[:2], copied.act(obs)[:2], strict=True):
        np.testing.assert_array_equal(ours, theirs)
    arrays = decoded.arrays
    del decoded, frame
    gc.collect()
    for name, tensor in shared.module.state_dict().items():  # the tensors keep it alive
        np.testing.assert_array_equal(tensor.numpy(), source.get_weights()[name])
    # A later copying load gives the tensors their own memory back: nothing writes the arrays.
    shared.set_weights(copied.get_weights())
    with torch.no_grad():
        for parameter in shared.module.parameters():
            parameter.zero_()
    for name, array in arrays.items():
        np.testing.assert_array_equal(array, source.get_weights()[name])
        assert shared.module.state_dict()[name].data_ptr() != array.ctypes.data


def test_loading_shared_weights_lets_the_old_ones_go_at_once() -> None:
    policy, source = categorical(), perturb(categorical(), 0.5)
    first = {name: np.array(array) for name, array in source.get_weights().items()}
    policy.set_weights(first, share=True)
    policy.act(observations(4))  # the NumPy heads view the first arrays now
    held = weakref.ref(first["actor.0.weight"])  # the tensor took this array's memory
    second = {name: np.array(array) for name, array in categorical().get_weights().items()}
    policy.set_weights(second, share=True)
    del first
    gc.collect()
    assert held() is None  # nothing of the policy holds the first version's memory
    assert policy.inference == "numpy"


@pytest.mark.parametrize("make", [categorical, gaussian])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_modules_act_through_torch(make: Any, dtype: torch.dtype) -> None:
    policy = make()
    policy.module.to(dtype)  # replaces every tensor: the heads are examined again
    assert policy.inference == "torch"  # NumPy lacks bfloat16 and is slow in float16
    actions, log_probs, values = policy.act(observations(8))
    assert log_probs.dtype == np.float32 and np.isfinite(log_probs).all()
    assert values is not None and values.dtype == np.float32
    assert actions.shape[0] == 8
    built = Policy(policy.module, OBS, policy.action_space, seed=0)  # built in that dtype
    assert built.inference == "torch"
    built.act(observations(8))
