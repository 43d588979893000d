"""PolicyVersions: a published version is its encoded Weights frame, and it never changes."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from aps.learner.rollouts import PolicyVersions, sample_states  # noqa: E402
from aps.wire import codec  # noqa: E402
from aps.wire.messages import Weights  # noqa: E402
from tests.agents import Agent  # noqa: E402


class Envs:
    """What an agent's constructor reads: the single spaces."""

    single_observation_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
    single_action_space = gym.spaces.Discrete(2)


def make() -> tuple[PolicyVersions, torch.nn.Module]:
    versions = PolicyVersions(Envs.single_observation_space, Envs.single_action_space)
    return versions, Agent(Envs())


def state(agent: torch.nn.Module) -> dict[str, np.ndarray]:
    return {name: t.detach().numpy().copy() for name, t in agent.state_dict().items()}


def test_a_version_is_a_snapshot_that_training_does_not_change() -> None:
    versions, agent = make()
    first = state(agent)
    assert versions.publish(agent) == 1
    with torch.no_grad():
        for parameter in agent.parameters():
            parameter.add_(1.0)  # training goes on in the agent
    assert versions.publish(agent) == 2
    for name, array in versions.weights(1).items():
        np.testing.assert_array_equal(array, first[name])
        assert not array.flags.writeable
    for name, array in versions.weights(2).items():
        np.testing.assert_array_equal(array, first[name] + 1.0)


def test_the_frame_is_the_weights_message_of_the_version() -> None:
    versions, agent = make()
    versions.publish(agent, epsilon=None)
    message = codec.decode(versions.frame(1))
    assert isinstance(message, Weights) and message.version == 1 and message.epsilon is None
    assert message.arrays.keys() == state(agent).keys()
    for name, array in state(agent).items():
        np.testing.assert_array_equal(message.arrays[name], array)
    expected = Weights(version=1, arrays=state(agent), epsilon=None)
    assert versions.frame(1) == codec.encode(expected)


def test_pruned_versions_let_go_of_their_frames() -> None:
    versions, agent = make()
    for _ in range(5):
        versions.publish(agent)
    versions.prune({2})
    assert len(versions) == 2
    versions.frame(2), versions.frame(5)
    with pytest.raises(KeyError):
        versions.frame(3)


class Big(torch.nn.Module):
    """An agent whose frames are large enough to be kept and reused (over 1 MiB)."""

    def __init__(self) -> None:
        super().__init__()
        self.actor = torch.nn.Sequential(torch.nn.Linear(4, 600), torch.nn.Linear(600, 2))
        self.critic = torch.nn.Sequential(torch.nn.Linear(4, 600), torch.nn.Linear(600, 600))
        self.critic.append(torch.nn.Linear(600, 1))


def test_reused_frames_never_change_a_kept_version() -> None:
    versions = PolicyVersions(Envs.single_observation_space, Envs.single_action_space)
    agent = Big()
    snapshots = {}
    for version in range(1, 9):
        with torch.no_grad():
            for parameter in agent.parameters():
                parameter.fill_(float(version))
        assert versions.publish(agent) == version
        snapshots[version] = state(agent)
        assert len(versions.frame(version)) > 2**20
        versions.prune({2})  # version 2 stays; the others' frames are let go and reused
    for version in (2, 8):
        for name, array in versions.weights(version).items():
            np.testing.assert_array_equal(array, snapshots[version][name])
        decoded = codec.decode(versions.frame(version))
        assert isinstance(decoded, Weights) and decoded.version == version


def test_the_states_a_divergence_is_measured_on_fit_a_byte_budget() -> None:
    box = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
    versions = PolicyVersions(box, gym.spaces.Discrete(2))
    # Small observations: max_states, whatever the chunk (1024 CartPole states are 16 KiB).
    assert versions.states_for(np.zeros((128, 8, 4), np.float32)) == 1024
    # Atari frames (28,224 bytes each): as many as fit in 4 MiB.
    frames = np.zeros((128, 8, 4, 84, 84), np.uint8)
    assert versions.states_for(frames) == 4 * 2**20 // (4 * 84 * 84) == 148
    # A structured observation counts every array of a state.
    tree = {"image": frames, "extra": np.zeros((128, 8, 1000), np.float64)}
    assert versions.states_for(tree) == 4 * 2**20 // (4 * 84 * 84 + 8000)
    # Very large states: never fewer than the floor.
    huge = np.zeros((2, 1, 2**22), np.uint8)
    assert versions.states_for(huge) == PolicyVersions.MIN_SAMPLED_STATES
    # Both limits are the versions' own settings.
    tight = PolicyVersions(box, gym.spaces.Discrete(2), max_states=10, max_sample_bytes=2**30)
    assert tight.states_for(frames) == 10
    assert sample_states(frames, versions.states_for(frames)).shape == (148, 4, 84, 84)
