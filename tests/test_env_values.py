"""Values that env calls return, as data: spaces, env specs and numpy Generators.

:func:`aps.wire.spaces.value_to_wire` tags them on the worker and :func:`value_from_wire`
rebuilds them on the learner; what a peer sends that describes none of them validly is a
``WireError``, and a user's own dict is never taken for a tagged one.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import pytest

import aps
from aps.wire import codec
from aps.wire.messages import EnvCallResult
from aps.wire.spaces import VALUE_TAG, value_from_wire, value_to_wire


def travel(value: Any) -> Any:
    """``value`` as the learner gets it from a worker's env call."""
    frame = codec.encode(EnvCallResult(values=(value_to_wire(value),), seq=0))
    message = codec.decode(frame)
    assert isinstance(message, EnvCallResult)
    return value_from_wire(message.values[0])


@pytest.mark.parametrize(
    "value",
    [
        gym.spaces.Box(-1.0, 1.0, (3,), np.float32),
        gym.spaces.Dict({"a": gym.spaces.Discrete(3), "b": gym.spaces.MultiBinary(2)}),
        gym.spec("CartPole-v1"),
        gym.make("CartPole-v1").spec,
        {VALUE_TAG: "space", "space": 1},  # a user's dict that looks tagged stays a dict
        {"nested": [gym.spaces.Discrete(2), {"x": 1}]},
        (1, "two", None),
    ],
)
def test_values_come_back_equal(value: Any) -> None:
    back = travel(value)
    if isinstance(value, dict) and "nested" in value:
        assert back["nested"][0] == value["nested"][0] and back["nested"][1] == {"x": 1}
    else:
        assert back == value
        assert type(back) is type(value)


@pytest.mark.parametrize(
    "bits",
    [np.random.PCG64, np.random.PCG64DXSM, np.random.MT19937, np.random.Philox, np.random.SFC64],
)
def test_a_generator_comes_back_as_a_copy_in_its_state(bits: Any) -> None:
    generator = np.random.Generator(bits(7))
    generator.random(5)  # not at its start
    copy = travel(generator)
    assert type(copy) is np.random.Generator and type(copy.bit_generator) is bits
    np.testing.assert_array_equal(copy.random(4), generator.random(4))
    np.testing.assert_array_equal(copy.integers(0, 10**9, 4), generator.integers(0, 10**9, 4))


def test_a_space_that_cannot_travel_is_named() -> None:
    with pytest.raises(aps.ConfigError, match="Text"):
        value_to_wire(gym.spaces.Text(4))


@pytest.mark.parametrize(
    ("wire", "match"),
    [
        ({VALUE_TAG: "pickle", "data": b""}, "unknown kind 'pickle'"),
        ({VALUE_TAG: "space"}, "has the fields"),
        ({VALUE_TAG: "space", "space": {"type": "Text"}}, "Text"),
        ({VALUE_TAG: "env_spec", "fields": {"id": "X-v0"}}, "must have the fields"),
        ({VALUE_TAG: "generator", "bit_generator": "os.system", "state": {}}, "a Generator over"),
        (
            {VALUE_TAG: "generator", "bit_generator": "PCG64", "state": {"state": "9" * 200}},
            "integer in decimal",
        ),
        (
            {VALUE_TAG: "generator", "bit_generator": "PCG64", "state": {"state": "x"}},
            "integer in decimal",
        ),
        (
            {VALUE_TAG: "generator", "bit_generator": "PCG64", "state": {"nope": "1"}},
            "numpy refuses",
        ),
        ({VALUE_TAG: "map", "items": 3}, "not a map"),
    ],
)
def test_bad_tagged_values_are_wire_errors(wire: dict[str, Any], match: str) -> None:
    with pytest.raises(aps.WireError, match=match):
        value_from_wire(wire)


def test_a_bad_env_spec_is_a_wire_error() -> None:
    fields = value_to_wire(gym.spec("CartPole-v1"))["fields"]
    for name, bad in (("id", 5), ("kwargs", 3), ("additional_wrappers", [{"name": 1}])):
        with pytest.raises(aps.WireError):
            value_from_wire({VALUE_TAG: "env_spec", "fields": {**fields, name: bad}})
