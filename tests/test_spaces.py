"""Spaces travel as plain data and come back equal; everything else is refused clearly."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from hypothesis import given, settings, strategies as st

from aps.errors import ConfigError, WireError
from aps.wire import codec
from aps.wire.messages import Ready
from aps.wire.spaces import MAX_SPACE_DEPTH, space_from_wire, space_to_wire

INF = np.inf

EXAMPLES: list[gym.Space[Any]] = [
    spaces.Box(-1.0, 1.0, (3,), np.float32),
    spaces.Box(-INF, INF, (2, 2), np.float64),
    spaces.Box(np.array([-INF, 0.0], np.float32), np.array([1.0, INF], np.float32)),
    spaces.Box(0, 255, (4, 4, 3), np.uint8),
    spaces.Box(-5, 5, (2,), np.int32),
    spaces.Box(-INF, INF, (1,), np.int64),
    spaces.Box(0, 1, (3,), np.bool_),
    spaces.Box(-1.0, 1.0, (), np.float16),
    spaces.Box(0.0, 1.0, (0,), np.float32),
    spaces.Discrete(3),
    spaces.Discrete(5, start=-2),
    spaces.Discrete(7, start=1, dtype=np.int32),
    spaces.Discrete(2, dtype=np.uint8),
    spaces.MultiDiscrete([3, 4]),
    spaces.MultiDiscrete(np.array([[2, 3], [4, 5]]), start=[[1, 0], [-1, 2]], dtype=np.int16),
    spaces.MultiBinary(5),
    spaces.MultiBinary([2, 3]),
    spaces.Dict({"b": spaces.Discrete(2), "a": spaces.Box(0, 1, (2,))}),
    spaces.Dict({"z": spaces.Discrete(2), "a": spaces.MultiBinary(2)}, sort_keys=False),
    spaces.Dict({}),
    spaces.Tuple([spaces.Discrete(2), spaces.Box(0, 1, (1,))]),
    spaces.Tuple([]),
    spaces.Dict(
        {
            "image": spaces.Box(0, 255, (2, 2), np.uint8),
            "state": spaces.Tuple(
                [spaces.MultiDiscrete([2, 2]), spaces.Dict({"x": spaces.Discrete(3, start=1)})]
            ),
        }
    ),
]


def assert_identical(got: gym.Space[Any], want: gym.Space[Any]) -> None:
    """``==`` plus what ``==`` does not look at (exact bounds, key order, dtypes)."""
    assert got == want
    assert type(got) is type(want)
    if isinstance(want, spaces.Box):
        assert isinstance(got, spaces.Box)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got.low, want.low)
        np.testing.assert_array_equal(got.high, want.high)
        assert got.low.flags.writeable
    elif isinstance(want, spaces.Dict):
        assert isinstance(got, spaces.Dict)
        assert list(got.spaces) == list(want.spaces)
        assert got.sort_keys == want.sort_keys
        for key in want.spaces:
            assert_identical(got[key], want[key])
    elif isinstance(want, spaces.Tuple):
        assert isinstance(got, spaces.Tuple)
        for g, w in zip(got.spaces, want.spaces, strict=True):
            assert_identical(g, w)
    else:
        assert got.dtype == want.dtype


@pytest.mark.parametrize("space", EXAMPLES, ids=str)
def test_round_trip(space: gym.Space[Any]) -> None:
    assert_identical(space_from_wire(space_to_wire(space)), space)


@pytest.mark.parametrize("space", EXAMPLES, ids=str)
def test_round_trip_through_the_codec(space: gym.Space[Any]) -> None:
    sent = Ready(observation_space=space, action_space=spaces.Discrete(2), num_envs=1)
    got = codec.decode(codec.encode(sent))
    assert isinstance(got, Ready)
    assert_identical(got.observation_space, space)
    assert got == sent


def test_the_wire_form_is_plain_data() -> None:
    wire = space_to_wire(
        spaces.Dict({"a": spaces.Discrete(3, start=1), "b": spaces.MultiBinary(2)})
    )
    assert wire == {
        "type": "Dict",
        "sort_keys": True,
        "spaces": [
            ["a", {"type": "Discrete", "dtype": "int64", "n": 3, "start": 1}],
            ["b", {"type": "MultiBinary", "n": 2}],
        ],
    }


def test_sending_does_not_share_arrays_with_the_space() -> None:
    space = spaces.Box(0.0, 1.0, (2,))
    wire = space_to_wire(space)
    wire["low"][0] = 0.5
    assert space.low[0] == 0.0


# A strategy of nested supported spaces.
_dtypes_float = st.sampled_from([np.float16, np.float32, np.float64])
_dtypes_int = st.sampled_from([np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16])
_shapes = st.lists(st.integers(0, 3), max_size=3).map(tuple)


@st.composite
def _boxes(draw: st.DrawFn) -> gym.Space[Any]:
    shape = draw(_shapes)
    if draw(st.booleans()):
        dtype = draw(_dtypes_float)
        low = draw(st.sampled_from([-INF, -1.0, 0.0]))
        high = draw(st.sampled_from([INF, 1.0, 2.5]))
    else:
        dtype = draw(_dtypes_int)
        low, high = draw(st.sampled_from([(0, 1), (0, 100), (3, 3)]))
    return spaces.Box(low, high, shape, dtype)


_leaves = st.one_of(
    _boxes(),
    st.builds(
        spaces.Discrete,
        st.integers(1, 100),
        start=st.integers(-50, 50),
        dtype=st.sampled_from([np.int32, np.int64]),
    ),
    st.builds(
        lambda nvec, dtype: spaces.MultiDiscrete(nvec, dtype=dtype),
        st.lists(st.integers(1, 9), min_size=1, max_size=4),
        st.sampled_from([np.int8, np.int64]),
    ),
    st.builds(spaces.MultiBinary, st.integers(1, 8) | st.lists(st.integers(1, 3), max_size=3)),
)
_nested = st.recursive(
    _leaves,
    lambda children: st.one_of(
        st.builds(spaces.Tuple, st.lists(children, max_size=3)),
        st.builds(
            lambda d, sort: spaces.Dict(d, sort_keys=sort),
            st.dictionaries(st.text(max_size=4), children, max_size=3),
            st.booleans(),
        ),
    ),
    max_leaves=8,
)


@settings(max_examples=60, deadline=None)
@given(_nested)
def test_any_nesting_round_trips(space: gym.Space[Any]) -> None:
    assert_identical(space_from_wire(space_to_wire(space)), space)
    got = codec.decode(codec.encode(Ready(observation_space=space, action_space=space, num_envs=2)))
    assert isinstance(got, Ready)
    assert_identical(got.action_space, space)


# --------------------------------------------------------------------------------------------
# Refusals on the sending side


class MyBox(spaces.Box):
    pass


@pytest.mark.parametrize(
    ("space", "name"),
    [
        (spaces.Text(5), "Text"),
        (spaces.Graph(spaces.Box(0, 1, (2,)), spaces.Discrete(2)), "Graph"),
        (spaces.Sequence(spaces.Discrete(2)), "Sequence"),
        (spaces.OneOf([spaces.Discrete(2), spaces.Box(0, 1, (1,))]), "OneOf"),
        (MyBox(0, 1, (2,)), "MyBox"),
    ],
)
def test_unsupported_spaces_are_refused_with_the_fix(space: gym.Space[Any], name: str) -> None:
    with pytest.raises(ConfigError) as info:
        space_to_wire(space)
    message = str(info.value)
    assert f"space is a {name} (" in message
    assert "only Box, Discrete, MultiDiscrete, MultiBinary, Dict and Tuple" in message
    assert "FlattenObservation" in message


def test_a_nested_unsupported_space_is_named_by_its_path() -> None:
    space = spaces.Dict({"a": spaces.Tuple([spaces.Discrete(2), spaces.Text(3)])})
    with pytest.raises(ConfigError, match=r"space\['a'\]\[1\] is a Text"):
        space_to_wire(space)


def test_unsupported_dtypes_and_keys_are_refused() -> None:
    with pytest.raises(ConfigError, match="has dtype float128"):
        space_to_wire(spaces.Box(0, 1, (2,), np.longdouble))
    with pytest.raises(ConfigError, match="the key 3 of type int"):
        space_to_wire(spaces.Dict({3: spaces.Discrete(2)}))  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match="non-space int"):
        space_to_wire(3)  # type: ignore[arg-type]


def test_the_codec_refuses_unsupported_spaces_before_sending() -> None:
    with pytest.raises(ConfigError, match="Text"):
        codec.encode(
            Ready(observation_space=spaces.Text(3), action_space=spaces.Discrete(2), num_envs=1)
        )


# --------------------------------------------------------------------------------------------
# Refusals on the receiving side


def _box(**changes: Any) -> dict[str, Any]:
    wire = space_to_wire(spaces.Box(0.0, 1.0, (2,)))
    wire.update(changes)
    return wire


def _deep(levels: int) -> dict[str, Any]:
    wire: dict[str, Any] = space_to_wire(spaces.Discrete(2))
    for _ in range(levels):
        wire = {"type": "Tuple", "spaces": [wire]}
    return wire


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (3, "must be a map"),
        ({"type": "Text"}, "unknown space type 'Text'"),
        ({"type": 1}, "unknown space type 1"),
        ({k: v for k, v in _box().items() if k != "high"}, r"missing fields \['high'\]"),
        (_box(extra=1), r"extra fields \[\"'extra'\"\]"),
        (_box(dtype="float128"), "has dtype 'float128'"),
        (_box(dtype=3), "has dtype 3"),
        (_box(low=np.zeros(2)), r"space.low must be an array of float32, got array of float64"),
        (_box(low=[0.0, 0.0]), "got list"),
        (_box(low=np.zeros(3, np.float32)), r"low of shape \(3,\) but high of shape \(2,\)"),
        (_box(low=np.full(2, 2.0, np.float32)), "not a valid space: Box all low values"),
        (_box(low=np.full(2, np.nan, np.float32)), "not a valid space"),
        ({"type": "Discrete", "dtype": "int64", "n": 0, "start": 0}, "n=0"),
        ({"type": "Discrete", "dtype": "int8", "n": 200, "start": 0}, "does not fit dtype int8"),
        ({"type": "Discrete", "dtype": "float32", "n": 2, "start": 0}, "has dtype 'float32'"),
        ({"type": "Discrete", "dtype": "int64", "n": True, "start": 0}, "n must be an int"),
        (
            {
                "type": "MultiDiscrete",
                "dtype": "int64",
                "nvec": np.zeros(2, np.int64),
                "start": np.zeros(2, np.int64),
            },
            "nvec",
        ),
        ({"type": "MultiBinary", "n": 2**40}, "over the limit"),
        ({"type": "MultiBinary", "n": (2**20, 2**20)}, "over the limit"),
        ({"type": "MultiBinary", "n": (1,) * 33}, "at most 32"),
        ({"type": "MultiBinary", "n": 0}, "not a valid space"),
        ({"type": "MultiBinary", "n": "3"}, "must be an int or a list"),
        (
            {"type": "Dict", "sort_keys": True, "spaces": [["a", _box()], ["a", _box()]]},
            "repeats the key",
        ),
        ({"type": "Dict", "sort_keys": True, "spaces": [[1, _box()]]}, "pairs"),
        ({"type": "Dict", "sort_keys": 1, "spaces": []}, "sort_keys must be a bool"),
        ({"type": "Dict", "sort_keys": True, "spaces": 3}, "must be a list"),
        ({"type": "Tuple", "spaces": {"a": 1}}, "must be a list"),
        ({"type": "Tuple", "spaces": [3]}, r"space\[0\] must be a map"),
        (_deep(MAX_SPACE_DEPTH + 1), "nests deeper"),
    ],
)
def test_malformed_descriptions_raise_wire_error(data: Any, match: str) -> None:
    with pytest.raises(WireError, match=match):
        space_from_wire(data)


def test_the_deepest_allowed_nesting_is_accepted() -> None:
    assert isinstance(space_from_wire(_deep(MAX_SPACE_DEPTH)), spaces.Tuple)


def test_gymnasium_errors_are_chained() -> None:
    with pytest.raises(WireError) as info:
        space_from_wire(_box(low=np.full(2, 2.0, np.float32)))
    assert isinstance(info.value.__cause__, ValueError)
