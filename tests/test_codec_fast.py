"""The codec's fast paths for small messages: byte-identical frames, identical decoding."""

from __future__ import annotations

import dataclasses
import gc
import math
import types
import typing
from enum import IntEnum
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from aps.errors import WireError
from aps.wire import _wire, codec
from aps.wire.codec import DTYPES
from aps.wire.messages import (
    MESSAGE_TYPES,
    Challenge,
    ErrorReport,
    Goodbye,
    Message,
    ProbeSpaces,
    Ready,
    ResetRequest,
    StepRequest,
    StepResult,
    Weights,
)
from tests.test_codec import any_message, plain_data


def test_the_generic_encoder_leaves_no_cyclic_garbage() -> None:
    # A dict value takes the generic path, whose Packer calls back into Python for the
    # numpy scalar; the packer and its default() must not keep each other alive.
    message = ResetRequest(seed=1, options={"a": (1, np.float32(2.0))})
    codec.encode(message)
    enabled = gc.isenabled()
    gc.disable()
    try:
        gc.collect()
        for _ in range(3):
            codec.encode(message)
        assert gc.collect() == 0
    finally:
        if enabled:
            gc.enable()


# --------------------------------------------------------------------------------------------
# The encoder's fast path (_pack_small) writes exactly what the generic packer writes.


def packs(message: Message) -> tuple[bytes | None, bytes]:
    """The fast path's frame (``None``: not taken) and the generic packer's, for one message."""
    spec = codec._SPECS_BY_CLASS[type(message)]
    return codec._pack_small(spec, message), codec._pack_frame(codec._body(spec, message))


def assert_fast_and_identical(message: Message) -> None:
    fast, generic = packs(message)
    assert fast is not None, "the fast path refused a simple message"
    assert fast == generic
    assert codec.encode(message) == generic


def _layout(array: np.ndarray[Any, Any], layout: str) -> np.ndarray[Any, Any]:
    if layout == "fortran":
        return np.asfortranarray(array)
    if layout == "strided" and array.ndim >= 1:
        return np.repeat(array, 2, axis=0)[::2]
    return array


@st.composite
def small_arrays(draw: st.DrawFn) -> np.ndarray[Any, Any]:
    """Arrays the fast path takes: wire dtypes in native order, any layout, under 64 KiB."""
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=5, min_side=0, max_side=6))
    array = draw(hnp.arrays(dtype, shape))
    return _layout(array, draw(st.sampled_from(["c", "fortran", "strided"])))


_ints = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([2**k + d for k in (5, 7, 8, 15, 16, 31, 32, 63) for d in (-1, 0, 1)]),
    st.sampled_from([-(2**k) + d for k in (5, 7, 15, 31, 63) for d in (-1, 0, 1)]),
)
simple_values = st.one_of(
    st.none(),
    st.booleans(),
    _ints.filter(lambda v: -(2**63) <= v < 2**64),
    st.floats(),
    st.text(max_size=40),
    st.binary(max_size=40),
    st.just({}),
    small_arrays(),
)


def _simple_strategy(hint: Any) -> st.SearchStrategy[Any]:
    if hint is Any:
        return simple_values
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return st.one_of([_simple_strategy(h) for h in typing.get_args(hint)])
    if hint is type(None):
        return st.none()
    if hint is int:
        return _ints.filter(lambda v: -(2**63) <= v < 2**64)
    if hint is float:
        return st.one_of(st.floats(), st.integers(-(2**63), 2**64 - 1))
    if hint is str:
        return st.text(max_size=300)
    if hint is bytes:
        return st.binary(max_size=300)
    if hint is bool:
        return st.booleans()
    if typing.get_origin(hint) is np.ndarray:
        return small_arrays()
    # The structured branches of an ArrayTree (a Dict or Tuple space's batch) are no simple
    # values: such chunks take the generic path, which tests/test_detach_structured.py and
    # test_codec.py's round trips cover; here the field draws its array branch only.
    if typing.get_origin(hint) in (dict, tuple):
        return st.nothing()
    raise AssertionError(f"no strategy for {hint!r}; extend the test")


def simple_messages(cls: type[Message]) -> st.SearchStrategy[Message]:
    hints = typing.get_type_hints(cls)
    fields = {f.name: _simple_strategy(hints[f.name]) for f in dataclasses.fields(cls)}
    return st.builds(cls, **fields)


# Every type without space fields (those always take the generic path).
_SIMPLE_TYPES = [c for c in MESSAGE_TYPES.values() if c not in (Ready, ProbeSpaces)]


@pytest.mark.parametrize("cls", _SIMPLE_TYPES, ids=lambda c: c.TAG)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_simple_messages_take_the_fast_path_and_pack_identically(
    cls: type[Message], data: st.DataObject
) -> None:
    assert_fast_and_identical(data.draw(simple_messages(cls)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(any_message)
def test_any_message_packs_identically_whichever_path_it_takes(message: Message) -> None:
    fast, generic = packs(message)
    assert fast is None or fast == generic
    assert codec.encode(message) == generic


@pytest.mark.parametrize(
    "value",
    [
        *(0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1),
        *(-1, -32, -33, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1, -(2**63)),
    ],
)
def test_int_boundaries_pack_identically(value: int) -> None:
    assert_fast_and_identical(StepRequest(actions=value, seq=value if value >= 0 else 0))
    assert_fast_and_identical(ErrorReport(remote_type="", message="", traceback="", seq=value))


@pytest.mark.parametrize("size", [0, 1, 31, 32, 255, 256, 65535, 65536])
def test_str_and_bytes_lengths_pack_identically(size: int) -> None:
    assert_fast_and_identical(Goodbye(reason="x" * size))
    assert_fast_and_identical(Goodbye(reason="é" * (size // 2)))  # utf-8 bytes, not characters
    assert_fast_and_identical(Challenge(protocol_version=2, nonce=b"\x01" * size))


def test_floats_pack_identically() -> None:
    values = [0.0, -0.0, 1.5, math.inf, -math.inf, math.nan, 5e-324, 1.7976931348623157e308]
    for value in values:
        assert_fast_and_identical(StepRequest(actions=value))
    assert_fast_and_identical(Weights(version=1, arrays=None, epsilon=3))  # an int for a float


@pytest.mark.parametrize(
    ("array", "payload"),
    [
        (np.zeros(0, np.float64), 8),  # fixext 8: the header alone
        (np.ones(1, np.float64), 16),  # fixext 16
        (np.array(True), 9),  # ext 8, a 0-d array
        (np.ones((0, 3), np.int16), 8),  # an empty array with a shape
        (np.arange(247, dtype=np.uint8), 255),  # the largest ext 8
        (np.arange(248, dtype=np.uint8), 256),  # the smallest ext 16
        (np.ones(65519, np.uint8), 65535),  # the largest ext 16 (the header is 16 bytes)
    ],
)
def test_array_payload_lengths_pack_identically(array: np.ndarray[Any, Any], payload: int) -> None:
    assert len(_wire.array_header(array.dtype.str, array.shape)) + array.nbytes == payload
    assert_fast_and_identical(StepRequest(actions=array))
    decoded = codec.decode(codec.encode(StepRequest(actions=array)))
    assert isinstance(decoded, StepRequest)
    assert np.array_equal(decoded.actions, array) and decoded.actions.dtype == array.dtype


def test_a_64_kib_payload_leaves_the_fast_path_even_under_64_kib_of_data() -> None:
    # The decoder views payloads of 64 KiB or more in the frame, so they are laid out aligned
    # there by the generic path (the smallest ext 32: 65,520 bytes of data, 16 of header).
    array = np.ones(65520, np.uint8)
    message = StepRequest(actions=array)
    assert packs(message)[0] is None
    decoded = codec.decode(codec.encode(message))
    assert isinstance(decoded, StepRequest)
    assert np.array_equal(decoded.actions, array)


def test_array_layouts_pack_identically() -> None:
    base = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    for array in (base, np.asfortranarray(base), base[:, ::2, ::-1], base.T, base[1]):
        assert_fast_and_identical(StepRequest(actions=array))
    many = np.zeros((1,) * codec.MAX_NDIM)
    assert_fast_and_identical(StepRequest(actions=many))


def test_a_step_result_takes_the_fast_path() -> None:
    assert_fast_and_identical(
        StepResult(
            obs=np.zeros((64, 4), np.float32),
            reward=np.ones(64),
            terminated=np.zeros(64, bool),
            truncated=np.zeros(64, bool),
            info={},
            seq=70_000,
        )
    )


class _Level(IntEnum):
    HIGH = 3


def _object_array() -> np.ndarray[Any, Any]:
    array = np.empty(1, dtype=object)
    array[0] = "x"
    return array


@pytest.mark.parametrize(
    "value",
    [
        np.float32(1.0),  # numpy scalars
        np.float64(1.0),  # a float subclass
        _Level.HIGH,  # an int subclass
        np.str_("x"),
        {"a": 1},  # containers
        (1, 2),
        [1],
        _object_array(),
        np.zeros(3, ">f4"),  # big-endian
        np.zeros(2**13, np.float64),  # 64 KiB: the large-array path
        np.zeros((1,) * 33),  # too many dimensions: the generic path raises
        np.zeros(2, np.complex64),  # an unsupported dtype: likewise
        2**64,  # beyond 64 bits: likewise
        -(2**63) - 1,
        "\ud800",  # a lone surrogate: likewise
    ],
    ids=repr,
)
def test_other_values_take_the_generic_path(value: Any) -> None:
    message = StepRequest(actions=value)
    spec = codec._SPECS_BY_CLASS[StepRequest]
    assert codec._pack_small(spec, message) is None
    try:
        expected = codec._pack_frame(codec._body(spec, message))
    except Exception:  # what the generic path refuses, encode() refuses with a WireError
        with pytest.raises(WireError):
            codec.encode(message)
    else:
        assert codec.encode(message) == expected


def test_large_arrays_still_travel_as_views_of_the_frame() -> None:
    big = np.arange(2**14, dtype=np.float32)  # 64 KiB
    message = StepRequest(actions=big, seq=1)
    frame = codec.encode(message)
    decoded = codec.decode(frame)
    assert isinstance(decoded, StepRequest)
    assert decoded.actions.base is frame  # decoded by the large-array path, without a copy
    assert np.array_equal(decoded.actions, big)


# --------------------------------------------------------------------------------------------
# Containers on the fast path (encode's): SameStep infos and other nested values.


def packs_nested(message: Message) -> tuple[bytes | None, bytes]:
    """As :func:`packs`, with the fast path writing containers (as encode() runs it)."""
    spec = codec._SPECS_BY_CLASS[type(message)]
    fast = codec._pack_small(spec, message, containers=True)
    return fast, codec._pack_frame(codec._body(spec, message))


def assert_nested_fast_and_identical(message: Message) -> None:
    fast, generic = packs_nested(message)
    assert fast is not None, "the fast path refused a message of simple containers"
    assert fast == generic
    assert codec.encode(message) == generic


def _objects(*elements: Any, shape: tuple[int, ...] | None = None) -> np.ndarray[Any, Any]:
    array = np.empty(len(elements), dtype=object)
    for index, element in enumerate(elements):
        array[index] = element
    return array.reshape(shape if shape is not None else (len(elements),))


def same_step_result(num_envs: int, ended: list[int], final_info: dict[str, Any]) -> StepResult:
    final_obs = _objects(*([None] * num_envs))
    mask = np.zeros(num_envs, bool)
    for i in ended:
        final_obs[i] = np.arange(4, dtype=np.float32) + i
        mask[i] = True
    info = {"final_obs": final_obs, "_final_obs": mask, "final_info": final_info}
    info["_final_info"] = mask.copy()
    return StepResult(
        obs=np.zeros((num_envs, 4), np.float32),
        reward=np.ones(num_envs),
        terminated=mask.copy(),
        truncated=np.zeros(num_envs, bool),
        info=info,
        seq=5,
    )


@pytest.mark.parametrize("num_envs", [1, 15, 16, 32, 300])
def test_a_same_step_result_takes_the_fast_path_and_decodes_equal(num_envs: int) -> None:
    episode = {"r": np.zeros(num_envs), "l": np.zeros(num_envs, np.int32)}
    for final_info in ({}, {"episode": episode, "_episode": np.ones(num_envs, bool)}):
        message = same_step_result(num_envs, [0, num_envs - 1], final_info)
        assert_nested_fast_and_identical(message)
        decoded = codec.decode(codec.encode(message))
        assert isinstance(decoded, StepResult)
        final_obs = decoded.info["final_obs"]
        assert final_obs.dtype == object and final_obs.shape == (num_envs,)
        for got, want in zip(final_obs, message.info["final_obs"], strict=True):
            assert (got is None and want is None) or (
                got.dtype == want.dtype and np.array_equal(got, want)
            )
        assert list(decoded.info["final_info"]) == list(final_info)


@pytest.mark.parametrize("count", [0, 1, 2, 3, 5, 7, 13, 14, 15, 16, 60, 61, 250, 8000])
def test_object_array_and_container_lengths_pack_identically(count: int) -> None:
    # Object array payloads of every ext length form (fixext 1 to 16, ext 8, 16, 32) and
    # maps and arrays of every header form around the sizes where they change.
    values: list[Any] = [
        _objects(*([None] * count)),
        _objects(*([None] * count), shape=(1, count, 1)),
        _objects(*(["x" * 3] * count)),
        {str(k): k for k in range(count)},
        [None] * count,
        tuple(range(count)),
    ]
    for value in values:
        assert_nested_fast_and_identical(StepRequest(actions=value))


def test_nested_values_of_every_kind_pack_identically() -> None:
    scalars = {name: np.dtype(name).type(1) for name in DTYPES}
    value = {
        "scalars": scalars,
        "objects": _objects(
            None, 1, -(2**63), 2**64 - 1, 1.5, True, "é", b"\x00", (1, [2]), {"a": None}
        ),
        "nested": _objects(_objects(_objects(np.float32(2)), np.ones(2, np.int8))),
        "arrays": [np.zeros((2, 3), np.uint16), np.asfortranarray(np.ones((3, 2)))],
        "empty": ({}, [], (), _objects()),
    }
    assert_nested_fast_and_identical(ResetRequest(seed=1, options=value))


def _deep_objects(levels: int) -> np.ndarray[Any, Any]:
    value: Any = None
    for _ in range(levels):
        value = _objects(value)
    return typing.cast("np.ndarray[Any, Any]", value)


@pytest.mark.parametrize(
    "value",
    [
        {1: "a"},  # a non-str key: the generic path raises
        {"a": {2: None}},
        [{"a": _objects({b"k": 1})}],
        _deep_objects(codec.MAX_OBJECT_DEPTH + 1),  # too deep: likewise
        {"a": _Level.HIGH},  # an int subclass
        {"a": np.str_("x")},
        {"a": np.zeros(3, ">f4")},  # big-endian
        {"a": np.zeros(2**13, np.float64)},  # 64 KiB: the large-array path
        _objects(np.zeros(2**13, np.float64)),
        {"a": 2**64},
        ["\ud800"],
        {"\ud800": 1},
        np.zeros(2, dtype=[("a", object)]),  # a structured dtype holding objects
    ],
    ids=repr,
)
def test_other_nested_values_take_the_generic_path(value: Any) -> None:
    message = StepRequest(actions=value)
    spec = codec._SPECS_BY_CLASS[StepRequest]
    assert codec._pack_small(spec, message, containers=True) is None
    try:
        expected = codec._pack_frame(codec._body(spec, message))
    except Exception:
        with pytest.raises(WireError):
            codec.encode(message)
    else:
        assert codec.encode(message) == expected


def test_object_arrays_at_the_depth_limit_pack_identically() -> None:
    assert_nested_fast_and_identical(StepRequest(actions=_deep_objects(codec.MAX_OBJECT_DEPTH)))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=plain_data)
def test_plain_data_packs_identically_on_the_nested_fast_path(value: Any) -> None:
    fast, generic = packs_nested(StepRequest(actions=value))
    assert fast is None or fast == generic
