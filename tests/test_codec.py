"""The codec: golden bytes, round trips of every message type, and the decoding contract."""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

import gymnasium as gym
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from aps._base._typing import ArrayTree
from aps.errors import ConfigError, FrameTooLarge, WireError
from aps.wire import _specs, codec
from aps.wire.codec import DTYPES, EXT_NDARRAY, EXT_OBJECT_ARRAY, EXT_SCALAR, MAX_OBJECT_DEPTH
from aps.wire.messages import (
    MESSAGE_TYPES,
    Goodbye,
    Heartbeat,
    Hello,
    Message,
    Ready,
    ResetRequest,
    StepRequest,
    StepResult,
    Weights,
)

# --------------------------------------------------------------------------------------------
# Helpers


def same(got: Any, want: Any) -> bool:
    """Deep equality that also compares types, dtypes and shapes (lists arrive as tuples)."""
    if isinstance(want, list):
        want = tuple(want)
    if isinstance(want, np.ndarray):
        if not (isinstance(got, np.ndarray) and got.shape == want.shape):
            return False
        if want.dtype == object:
            return got.dtype == object and all(
                same(g, w) for g, w in zip(got.reshape(-1), want.reshape(-1), strict=True)
            )
        expected = want.dtype.newbyteorder("<") if want.dtype.byteorder == ">" else want.dtype
        return got.dtype == expected and np.array_equal(got, want, equal_nan=want.dtype.kind == "f")
    if isinstance(want, np.generic):
        return (
            type(got) is type(want)
            and got.dtype == want.dtype
            and (got == want or (bool(np.isnan(want)) if want.dtype.kind == "f" else False))
        )
    if isinstance(want, dict):
        return (
            type(got) is dict
            and list(got) == list(want)
            and all(same(got[k], want[k]) for k in want)
        )
    if isinstance(want, tuple):
        return (
            type(got) is tuple
            and len(got) == len(want)
            and all(same(g, w) for g, w in zip(got, want, strict=True))
        )
    if isinstance(want, gym.Space):
        return bool(got == want)
    if isinstance(want, float) and math.isnan(want):
        return type(got) is float and math.isnan(got)
    return type(got) is type(want) and bool(got == want)


def same_message(got: Message, want: Message) -> bool:
    return type(got) is type(want) and all(
        same(getattr(got, f.name), getattr(want, f.name)) for f in dataclasses.fields(want)
    )


# Requests carry seq and acked, answers seq: filled in for tests about other fields.
_REQUEST, _ANSWER = ("seq", "acked"), ("seq",)
_NUMBERED = {"reset": _REQUEST, "step": _REQUEST, "rollout": _REQUEST}
_NUMBERED.update(reset_result=_ANSWER, step_result=_ANSWER, chunk=_ANSWER)


def frame(body: dict[str, Any]) -> bytes:
    """A hand-made frame, for inputs the encoder would refuse to make."""
    body = {**dict.fromkeys(_NUMBERED.get(str(body.get("t")), ()), 0), **body}
    if body.get("t") == "reset":
        body.setdefault("seeds", None)
    if body.get("t") in ("step_result", "reset_result"):
        body.setdefault("timings", None)
    return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]


def array_ext(dtype: str, shape: list[int], raw: bytes, pad: bool = True) -> msgpack.ExtType:
    header = msgpack.packb([dtype, shape])
    padding = b"\0" * (-len(header) % 8) if pad else b""
    return msgpack.ExtType(EXT_NDARRAY, header + padding + raw)


STEP_RESULT = StepResult(
    obs=np.zeros((2, 4), np.float32),
    reward=np.ones(2),
    terminated=np.zeros(2, bool),
    truncated=np.zeros(2, bool),
    info={},
)

# --------------------------------------------------------------------------------------------
# Golden bytes: the wire format is a contract with other implementations and releases.


def test_golden_heartbeat_and_goodbye() -> None:
    assert codec.encode(Heartbeat()) == b"\x81\xa1t\xa9heartbeat"
    assert codec.encode(Goodbye(reason="done")) == b"\x82\xa1t\xa7goodbye\xa6reason\xa4done"


def test_golden_array() -> None:
    encoded = codec.encode(StepRequest(actions=np.array([1, 0], np.int64), seq=3, acked=2))
    assert encoded == (
        b"\x84\xa1t\xa4step\xa7actions"
        + b"\xc7\x18\x01"  # ext 8, 24 bytes, code 1 (EXT_NDARRAY)
        + b"\x92\xa3<i8\x91\x02"  # ["<i8", [2]]
        + b"\x00"  # padding to 8 bytes
        + b"\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00"
        + b"\xa3seq\x03\xa5acked\x02"  # the request's number, the answers received
    )


def test_golden_scalar_and_object_array() -> None:
    info = {"s": np.float32(1.0), "o": np.array([None, "a"], dtype=object)}
    assert codec.encode(ResetRequest(seed=None, options=info)) == (
        b"\x86\xa1t\xa5reset\xa4seed\xc0\xa7options\x82"
        + b"\xa1s\xc7\x0c\x02"  # "s": ext 8, 12 bytes, code 2 (EXT_SCALAR)
        + b"\x92\xa3<f4\x90\x00\x00"  # ["<f4", []] and padding to 8 bytes
        + b"\x00\x00\x80?"  # 1.0 as little-endian float32
        + b"\xa1o\xc7\x07\x03"  # "o": ext 8, 7 bytes, code 3 (EXT_OBJECT_ARRAY)
        + b"\x92\x91\x02\x92\xc0\xa1a"  # [[2], [nil, "a"]]
        + b"\xa3seq\x00\xa5acked\x00\xa5seeds\xc0"
    )


# --------------------------------------------------------------------------------------------
# Round trips of every message type, built from the annotations so new types are covered.


@st.composite
def arrays(draw: st.DrawFn, min_dims: int = 0) -> np.ndarray[Any, Any]:
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    if dtype.itemsize > 1 and draw(st.booleans()):
        dtype = dtype.newbyteorder(">")
    shape = draw(hnp.array_shapes(min_dims=min_dims, max_dims=4, min_side=0, max_side=4))
    array = draw(hnp.arrays(dtype, shape))
    layout = draw(st.sampled_from(["c", "fortran", "strided"]))
    if layout == "fortran":
        array = np.asfortranarray(array)
    elif layout == "strided" and array.ndim >= 1:
        array = np.repeat(array, 2, axis=0)[::2]  # a strided view
    return array


scalars = st.sampled_from(DTYPES).flatmap(
    lambda name: hnp.from_dtype(np.dtype(name)).map(lambda v: np.dtype(name).type(v))
)

_leaf_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=8),
    scalars,
    arrays(),
)


def _object_array(elements: list[Any]) -> np.ndarray[Any, Any]:
    array = np.empty(len(elements), dtype=object)
    for index, element in enumerate(elements):
        array[index] = element
    return array


plain_data = st.recursive(
    _leaf_values,
    lambda children: st.one_of(
        st.lists(children, max_size=3).map(tuple),
        st.lists(children, max_size=3),
        st.dictionaries(st.text(max_size=5), children, max_size=3),
        st.lists(children, max_size=4).map(_object_array),
    ),
    max_leaves=10,
)

_spaces = st.sampled_from(
    [
        gym.spaces.Discrete(3),
        gym.spaces.Box(-1, 1, (2,)),
        gym.spaces.Dict(
            {"a": gym.spaces.MultiBinary(3), "b": gym.spaces.Tuple([gym.spaces.Discrete(2)])}
        ),
        gym.spaces.MultiDiscrete([2, 5]),
    ]
)


def _strategy_for(hint: Any) -> st.SearchStrategy[Any]:
    if hint is Any:
        return plain_data
    if hint == ArrayTree:  # a chunk's observations: an array, or dicts and tuples of them
        return st.recursive(
            arrays(),
            lambda children: st.one_of(
                st.dictionaries(st.text(max_size=4), children, max_size=3),
                st.lists(children, max_size=3).map(tuple),
            ),
            max_leaves=6,
        )
    if typing.get_origin(hint) in (typing.Union, __import__("types").UnionType):
        return st.one_of([_strategy_for(h) for h in typing.get_args(hint)])
    if hint is type(None):
        return st.none()
    if hint is int:
        return st.integers(-(2**63), 2**64 - 1)
    if hint is float:
        return st.floats()
    if hint is str:
        return st.text()
    if hint is bytes:
        return st.binary()
    if hint is bool:
        return st.booleans()
    if typing.get_origin(hint) is np.ndarray:
        return arrays()
    if hint is gym.Space or typing.get_origin(hint) is gym.Space:
        return _spaces
    raise AssertionError(f"no strategy for {hint!r}; extend the test")


def messages_of(cls: type[Message]) -> st.SearchStrategy[Message]:
    hints = typing.get_type_hints(cls)
    fields = {f.name: _strategy_for(hints[f.name]) for f in dataclasses.fields(cls)}
    if cls is Ready:
        # More envs than a step's observations could fit in a frame are refused (see
        # test_a_ready_whose_envs_could_never_step_is_refused).
        fields["num_envs"] = st.integers(-(2**63), 2**16)
    return st.builds(cls, **fields)


any_message = st.sampled_from(sorted(MESSAGE_TYPES.values(), key=lambda c: c.TAG)).flatmap(
    messages_of
)


@pytest.mark.parametrize("cls", list(MESSAGE_TYPES.values()), ids=lambda c: c.TAG)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_message_type_round_trips(cls: type[Message], data: st.DataObject) -> None:
    message = data.draw(messages_of(cls))
    decoded = codec.decode(codec.encode(message))
    assert same_message(decoded, message)


@settings(max_examples=150, deadline=None)
@given(arrays())
def test_every_dtype_and_shape_round_trips(array: np.ndarray[Any, Any]) -> None:
    decoded = codec.decode(codec.encode(StepRequest(actions=array)))
    assert isinstance(decoded, StepRequest)
    got = decoded.actions
    assert same(got, array)
    assert got.dtype.byteorder in "<|="
    assert not got.flags.writeable
    assert got.flags.c_contiguous and got.flags.aligned


@settings(max_examples=80, deadline=None)
@given(scalars)
def test_numpy_scalars_stay_numpy_scalars(value: np.generic) -> None:
    decoded = codec.decode(codec.encode(ResetRequest(seed=None, options=value)))
    assert isinstance(decoded, ResetRequest)
    assert same(decoded.options, value)


def test_numpy_float64_is_not_sent_as_a_python_float() -> None:
    # np.float64 subclasses float; without strict types msgpack would send a plain float.
    decoded = codec.decode(codec.encode(ResetRequest(seed=None, options=(np.float64(2.5), 2.5))))
    assert isinstance(decoded, ResetRequest)
    assert type(decoded.options[0]) is np.float64 and type(decoded.options[1]) is float


def test_lists_tuples_and_subclasses_arrive_as_plain_types() -> None:
    from collections import OrderedDict
    from enum import IntEnum

    class Level(IntEnum):
        HIGH = 3

    value = {"l": [1, [2]], "t": (3,), "o": OrderedDict(a=1), "e": Level.HIGH, "s": np.str_("x")}
    decoded = codec.decode(codec.encode(ResetRequest(seed=None, options=value)))
    assert isinstance(decoded, ResetRequest)
    assert decoded.options == {"l": (1, (2,)), "t": (3,), "o": {"a": 1}, "e": 3, "s": "x"}
    assert type(decoded.options["e"]) is int and type(decoded.options["s"]) is str


def test_decoded_arrays_are_read_only_views_of_the_payload() -> None:
    decoded = codec.decode(codec.encode(STEP_RESULT))
    assert isinstance(decoded, StepResult)
    with pytest.raises(ValueError, match="read-only"):
        decoded.obs[0, 0] = 1.0
    assert isinstance(decoded.obs.base, bytes)  # no copy beyond msgpack's payload bytes
    writable = np.array(decoded.obs)
    writable[0, 0] = 1.0


def test_large_arrays_encode_as_inline_packing_with_their_data_aligned() -> None:
    message = _large_weights()
    encoded = codec.encode(message)
    # Valid msgpack throughout: unpacked and packed again, with the payloads as they are, it
    # gives back the same bytes.
    unpacked = msgpack.unpackb(encoded, raw=False, ext_hook=msgpack.ExtType)
    assert msgpack.packb(unpacked, use_bin_type=True) == encoded
    arrays = message.arrays
    payloads = {name: unpacked["arrays"][name] for name in ("big", "swapped", "strided", "fortran")}
    payloads["deep"] = unpacked["arrays"]["nested"]["deep"][0]
    values = {name: arrays[name] for name in ("big", "swapped", "strided", "fortran")}
    values["deep"] = arrays["nested"]["deep"][0]
    for name, ext in payloads.items():
        value = values[name]
        little = value.dtype.newbyteorder("<")
        header = msgpack.packb([little.str, list(value.shape)])
        raw = np.ascontiguousarray(value).astype(little).tobytes()
        assert ext.code == EXT_NDARRAY
        assert ext.data.startswith(header) and ext.data.endswith(raw), name
        padding = ext.data[len(header) : len(ext.data) - len(raw)]
        assert padding == bytes(len(padding)) and len(padding) <= codec.MAX_PADDING, name
        at = encoded.index(ext.data) + len(header) + len(padding)
        assert at % codec.ALIGNMENT == 0, (name, at)
    # Small arrays keep the padding to a multiple of 8 within their payload.
    assert unpacked["arrays"]["small"] == array_ext("<i2", [5], arrays["small"].tobytes())


def test_decoded_large_arrays_are_aligned() -> None:
    encoded = codec.encode(_large_weights())
    decoded = codec.decode(encoded)
    assert isinstance(decoded, Weights)
    base = np.frombuffer(encoded, np.uint8).ctypes.data
    for name in ("big", "swapped", "strided", "fortran"):
        array = decoded.arrays[name]
        assert array.flags.aligned, name
        assert (array.ctypes.data - base) % codec.ALIGNMENT == 0, name


@pytest.mark.parametrize("count", range(16_370, 16_390))
def test_arrays_around_the_large_size_decode_aligned(count: int) -> None:
    # Payloads of 64 KiB or more are viewed in the frame, so an array whose data is a little
    # under 64 KiB but whose payload, header included, is not must be laid out as a large one.
    values = np.arange(count, dtype=np.float32)
    step = codec.decode(codec.encode(StepRequest(actions=values, seq=1, acked=0)))  # fast path
    weights = codec.decode(codec.encode(Weights(version=1, arrays={"w": values}, epsilon=None)))
    assert isinstance(step, StepRequest) and isinstance(weights, Weights)
    for decoded in (step.actions, weights.arrays["w"]):
        np.testing.assert_array_equal(decoded, values)
        assert decoded.flags.aligned and decoded.ctypes.data % 8 == 0, count


def test_array_padding_of_0_to_63_zero_bytes_is_accepted() -> None:
    raw = np.arange(3, dtype=np.float32).tobytes()
    big = np.ones(20_000, np.float32)
    header = msgpack.packb(["<f4", [3]])
    big_header = msgpack.packb(["<f4", [20_000]])
    for padding in (0, 1, 7, 8, 63):
        actions = msgpack.ExtType(EXT_NDARRAY, header + bytes(padding) + raw)
        decoded = codec.decode(frame({"t": "step", "actions": actions}))
        assert isinstance(decoded, StepRequest)
        np.testing.assert_array_equal(decoded.actions, [0.0, 1.0, 2.0])
        ext = msgpack.ExtType(EXT_NDARRAY, big_header + bytes(padding) + big.tobytes())
        reset = codec.decode(frame({"t": "reset", "seed": None, "options": {"a": ext}}))
        assert isinstance(reset, ResetRequest) and reset.options is not None
        np.testing.assert_array_equal(reset.options["a"], big)


def test_large_arrays_decode_as_read_only_views_of_the_frame() -> None:
    message = _large_weights()
    encoded = codec.encode(message)
    decoded = codec.decode(encoded)
    assert same_message(decoded, message)
    assert isinstance(decoded, Weights)
    for name in ("big", "swapped", "strided", "fortran"):
        array = decoded.arrays[name]
        assert array.base is encoded, name  # a view of the frame: no copy at all
        assert not array.flags.writeable
    assert decoded.arrays["nested"]["deep"][0].base is encoded
    # Small arrays still come the ordinary way, as views of msgpack's payload copy.
    assert decoded.arrays["small"].base is not encoded
    with pytest.raises(ValueError, match="read-only"):
        decoded.arrays["big"][0, 0] = 1.0


def test_large_arrays_in_a_mutable_buffer_are_copied() -> None:
    encoded = codec.encode(_large_weights())
    for buffer in (bytearray(encoded), memoryview(bytearray(encoded))):
        decoded = codec.decode(buffer)
        assert isinstance(decoded, Weights)
        assert same_message(decoded, _large_weights())
        big = decoded.arrays["big"]
        assert not big.flags.writeable
        buffer[len(buffer) // 2] ^= 0xFF  # the caller's buffer changes; the array does not
        assert np.array_equal(big, _large_weights().arrays["big"])


def test_frames_with_many_objects_still_view_their_large_arrays() -> None:
    many = {f"k{i}": i for i in range(3000)}  # 6000 objects: the walk charges every one
    big = np.arange(20_000, dtype=np.float64)
    encoded = codec.encode(ResetRequest(seed=1, options={"many": many, "big": big}))
    decoded = codec.decode(encoded)
    assert isinstance(decoded, ResetRequest)
    assert decoded.options["many"] == many
    assert np.array_equal(decoded.options["big"], big)
    assert decoded.options["big"].base is encoded


def test_the_internal_reference_code_is_refused_on_the_wire() -> None:
    big = np.zeros(20_000, np.float64)
    for forged in (
        msgpack.ExtType(127, b"\x00\x00\x00\x00"),  # what decode() uses as a reference
        msgpack.ExtType(127, b"\x00" * 100),
    ):
        data = frame(
            {
                "t": "reset",
                "seed": None,
                "options": {"a": forged, "b": array_ext("<f8", [20_000], big.tobytes())},
            }
        )
        with pytest.raises(WireError, match="unknown msgpack extension code 127"):
            codec.decode(data)


def test_large_arrays_with_a_lying_header_are_refused() -> None:
    raw = np.ones(10_000, np.float64).tobytes()  # not zero: padding cannot hide in it
    for ext, match in (
        (array_ext("<f8", [10_001], raw), "80008 bytes"),
        (
            msgpack.ExtType(EXT_NDARRAY, msgpack.packb(["<f8", [9_999]]) + b"\1" * 8 + raw[8:]),
            "padding is not zero bytes",
        ),
        (
            msgpack.ExtType(EXT_NDARRAY, msgpack.packb(["<f8", [10_000]]) + bytes(64) + raw),
            "only 0 to 63 zero bytes of padding fit",
        ),
        (array_ext("<c16", [5_000], raw), "not supported"),
    ):
        data = frame({"t": "reset", "seed": None, "options": {"a": ext}})
        with pytest.raises(WireError, match=match):
            codec.decode(data)


def test_decode_accepts_bytearray_and_memoryview() -> None:
    encoded = codec.encode(STEP_RESULT)
    for buffer in (bytearray(encoded), memoryview(encoded)):
        assert same_message(codec.decode(buffer), STEP_RESULT)


def test_object_arrays_round_trip_with_their_shape() -> None:
    inner = _object_array([np.zeros(2, np.float32), None])
    grid = np.empty((2, 2), dtype=object)
    grid[0, 0], grid[0, 1], grid[1, 0], grid[1, 1] = "a", {"x": (1, 2)}, inner, np.int8(3)
    zero_d = np.empty((), dtype=object)
    zero_d[()] = b"raw"
    for value in (grid, zero_d, np.empty((0, 3), dtype=object), _object_array([(1,), (2,)])):
        decoded = codec.decode(codec.encode(ResetRequest(seed=None, options=value)))
        assert isinstance(decoded, ResetRequest)
        assert same(decoded.options, value)
        assert not decoded.options.flags.writeable


def test_object_array_nesting_is_bounded_on_both_sides() -> None:
    value: Any = "leaf"
    for _ in range(MAX_OBJECT_DEPTH):
        value = _object_array([value])
    assert same(codec.decode(codec.encode(ResetRequest(seed=None, options=value))).options, value)  # type: ignore[attr-defined]
    too_deep = _object_array([value])
    with pytest.raises(WireError, match=r"field 'options' of ResetRequest: options.* nest deeper"):
        codec.encode(ResetRequest(seed=None, options=too_deep))
    # A peer that ignores the limit is refused while decoding.
    payload = msgpack.packb([[1], ["leaf"]])
    for levels in range(1, MAX_OBJECT_DEPTH + 2):
        crafted = frame(
            {"t": "reset", "seed": None, "options": msgpack.ExtType(EXT_OBJECT_ARRAY, payload)}
        )
        if levels <= MAX_OBJECT_DEPTH:
            assert isinstance(codec.decode(crafted), ResetRequest)
        else:
            with pytest.raises(WireError, match="nest deeper"):
                codec.decode(crafted)
        payload = msgpack.packb([[1], [msgpack.ExtType(EXT_OBJECT_ARRAY, payload)]])


# --------------------------------------------------------------------------------------------
# Refusals while encoding


def test_unsupported_dtypes_are_named_with_the_whitelist_and_the_field() -> None:
    message = StepResult(
        obs=np.zeros(2, np.complex64),
        reward=np.zeros(2),
        terminated=np.zeros(2, bool),
        truncated=np.zeros(2, bool),
        info={},
    )
    with pytest.raises(WireError) as info:
        codec.encode(message)
    text = str(info.value)
    assert "field 'obs' of StepResult" in text
    assert "numpy dtype complex64" in text
    assert "bool, int8, int16, int32, int64, uint8, uint16, uint32, uint64, float16" in text
    for bad in (np.array(["a"]), np.zeros(1, "datetime64[s]"), np.zeros(1, np.longdouble)):
        with pytest.raises(WireError, match="cannot encode numpy dtype"):
            codec.encode(StepRequest(actions=bad))


def test_arrays_with_too_many_dimensions_are_refused() -> None:
    with pytest.raises(WireError, match="33 dimensions, over the limit of 32"):
        codec.encode(StepRequest(actions=np.zeros((1,) * 33)))
    assert codec.decode(codec.encode(StepRequest(actions=np.zeros((1,) * 32))))


def test_unsupported_values_are_named_with_their_field() -> None:
    with pytest.raises(
        WireError,
        match=r"field 'options' of ResetRequest: cannot encode a value of type builtins.set",
    ):
        codec.encode(ResetRequest(seed=None, options={"a": {1, 2}}))
    with pytest.raises(WireError, match=r"field 'options'.*(out of range|too big)"):
        codec.encode(ResetRequest(seed=None, options=2**70))
    with pytest.raises(WireError, match=r"options\['a'\]\[1\] has the map key 3 of type int"):
        codec.encode(ResetRequest(seed=None, options={"a": (0, {3: "x"})}))


def test_fields_are_checked_against_their_annotations_when_encoding() -> None:
    with pytest.raises(
        WireError, match="field 'seed' of ResetRequest: expected int or None, got int64"
    ):
        codec.encode(ResetRequest(seed=np.int64(3), options=None))  # type: ignore[arg-type]
    with pytest.raises(
        WireError, match="field 'reward' of StepResult: expected a numpy array, got list"
    ):
        codec.encode(dataclasses.replace(STEP_RESULT, reward=[1.0, 2.0]))  # type: ignore[arg-type]
    with pytest.raises(
        WireError, match="expected a numpy array, got a numpy array of dtype object"
    ):
        codec.encode(dataclasses.replace(STEP_RESULT, reward=_object_array([1.0])))
    with pytest.raises(WireError, match="expected int, got bool"):
        codec.encode(dataclasses.replace(hello(), num_envs=True))
    with pytest.raises(WireError, match="expected a gymnasium space, got int"):
        codec.encode(Ready(observation_space=3, action_space=gym.spaces.Discrete(2), num_envs=1))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="Text"):
        codec.encode(
            Ready(
                observation_space=gym.spaces.Text(2),
                action_space=gym.spaces.Discrete(2),
                num_envs=1,
            )
        )


def test_encoding_a_non_message_is_refused() -> None:
    with pytest.raises(
        WireError, match="not an aps message type; known tags: challenge, chunk, env_call, "
    ):
        codec.encode("hello")  # type: ignore[arg-type]


def hello() -> Hello:
    return Hello(
        protocol_version=1, proof=b"", env_id="X", num_envs=2, seed=None, host="h", pid=1, label=""
    )


# --------------------------------------------------------------------------------------------
# The decoding contract: a message or a WireError, nothing else.


def decodes_or_wire_error(data: bytes) -> None:
    try:
        message = codec.decode(data)
    except WireError:
        return
    assert isinstance(message, Message)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_decode_or_raise_wire_error(data: bytes) -> None:
    decodes_or_wire_error(data)


def _large_weights() -> Weights:
    """A weights message with arrays over the 64 KiB at which they travel without copies."""
    rng = np.random.default_rng(7)
    return Weights(
        version=2,
        arrays={
            "big": rng.standard_normal((130, 140)).astype(np.float32),  # 72,800 bytes
            "small": np.arange(5, dtype=np.int16),
            "swapped": rng.standard_normal(9000).astype(">f8"),  # big-endian, 72,000 bytes
            "strided": rng.standard_normal((300, 200))[::2, ::-3],  # not contiguous
            "fortran": np.asfortranarray(rng.integers(0, 9, (90, 100), dtype=np.int64)),
            "nested": {"deep": [rng.standard_normal(20_000).astype(np.float32), 3]},
        },
        epsilon=0.25,
    )


_valid_frames = [
    codec.encode(STEP_RESULT),
    codec.encode(_large_weights()),
    codec.encode(hello()),
    codec.encode(
        Ready(
            observation_space=gym.spaces.Dict({"a": gym.spaces.Box(0, 1, (2,))}),
            action_space=gym.spaces.Discrete(2),
            num_envs=2,
        )
    ),
    codec.encode(
        ResetRequest(seed=3, options={"o": _object_array([np.zeros(2), None]), "s": np.int8(2)})
    ),
]


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from(_valid_frames),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=4),
    st.integers(0, 10_000),
    st.booleans(),
)
def test_mutated_frames_decode_or_raise_wire_error(
    valid: bytes, flips: list[tuple[int, int]], cut: int, truncate: bool
) -> None:
    data = bytearray(valid)
    for position, value in flips:
        data[position % len(data)] = value
    if truncate:
        del data[cut % len(data) :]
    decodes_or_wire_error(bytes(data))


def test_frames_over_the_limit_are_refused_before_parsing() -> None:
    encoded = codec.encode(STEP_RESULT)
    with pytest.raises(FrameTooLarge) as info:
        codec.decode(encoded, max_frame_size=len(encoded) - 1)
    assert (info.value.size, info.value.limit) == (len(encoded), len(encoded) - 1)
    assert "raise max_frame_size" in str(info.value)
    assert same_message(codec.decode(encoded, max_frame_size=len(encoded)), STEP_RESULT)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "not valid msgpack"),
        (b"\xc1", "not valid msgpack"),
        (msgpack.packb([1, 2]), "must hold a msgpack map, got tuple"),
        (
            frame({"t": "nope"}),
            "unknown message tag 'nope'; known tags: challenge, chunk, env_call, env_call_result,",
        ),
        (frame({"x": 1}), "unknown message tag None"),
        (frame({"t": 3}), "unknown message tag 3"),
        (frame({"t": "goodbye"}), r"missing fields \['reason'\]"),
        (frame({"t": "goodbye", "reason": "x", "more": 1}), r"extra fields \[\"'more'\"\]"),
        (frame({"t": "goodbye", "reason": 3}), "field 'reason' must be str, got int"),
        (
            frame({"t": "reset", "seed": True, "options": None}),
            "field 'seed' must be int or None, got bool",
        ),
        (frame({"t": "reset", "seed": 1.5, "options": None}), "got float"),
        (
            frame({"t": "challenge", "protocol_version": 1, "nonce": "text"}),
            "field 'nonce' must be bytes",
        ),
        (frame({"t": "heartbeat", 1: 2}), "not valid msgpack"),  # strict_map_key
        (frame({"t": "heartbeat", b"t": 2}), "map key b't' is not a str"),
        (frame({"t": "reset", "seed": None, "options": {"a": {b"k": 1}}}), "map key b'k'"),
        (
            frame(
                {
                    "t": "reset",
                    "seed": None,
                    "options": msgpack.ExtType(EXT_OBJECT_ARRAY, msgpack.packb([[1], [{b"k": 1}]])),
                }
            ),
            "map key b'k'",
        ),
        (
            frame({"t": "step", "actions": msgpack.ExtType(9, b"")}),
            "unknown msgpack extension code 9",
        ),
        (frame({"t": "step", "actions": msgpack.ExtType(EXT_NDARRAY, b"")}), "truncated"),
        (
            frame({"t": "step", "actions": array_ext("<c8", [1], b"\0" * 8)}),
            "array dtype '<c8' is not supported",
        ),
        (
            frame({"t": "step", "actions": array_ext(">f4", [1], b"\0" * 4)}),
            "array dtype '>f4' is not supported",
        ),
        (frame({"t": "step", "actions": array_ext("|O", [1], b"\0" * 8)}), "'|O' is not supported"),
        (
            frame({"t": "step", "actions": array_ext("<f4", [1000], b"\0" * 8)}),
            r"shape \(1000,\) of float32 \(4000 bytes\) but 15 bytes follow it",  # 7 padding
        ),
        (
            frame({"t": "step", "actions": array_ext("<f4", [2**64 - 1] * 32, b"")}),
            "but 0 bytes follow",
        ),
        (frame({"t": "step", "actions": array_ext("<f4", [0, 2**63], b"")}), "cannot be built"),
        (
            frame({"t": "step", "actions": array_ext("<f4", [1] * 33, b"")}),
            "33 dimensions, over the limit of 32",
        ),
        (frame({"t": "step", "actions": array_ext("<f4", [-1], b"")}), "non-negative ints"),
        (frame({"t": "step", "actions": array_ext("<f4", [1.0], b"")}), "non-negative ints"),  # type: ignore[list-item]
        (
            frame({"t": "step", "actions": array_ext("<i8", [1], b"\1" * 16, pad=False)}),
            "padding is not zero bytes",
        ),
        (
            frame({"t": "step", "actions": array_ext("<i8", [1], bytes(72), pad=False)}),
            "only 0 to 63 zero bytes of padding fit",
        ),
        (
            frame(
                {"t": "step", "actions": msgpack.ExtType(EXT_NDARRAY, msgpack.packb(["<f4", 1]))}
            ),
            "shape must be a msgpack array",
        ),
        (
            frame(
                {
                    "t": "step",
                    "actions": msgpack.ExtType(
                        EXT_SCALAR, msgpack.packb(["<f4", [1]]) + b"\0" + b"\0" * 4
                    ),
                }
            ),
            r"numpy scalar must have shape \(\)",
        ),
        (
            frame(
                {
                    "t": "step",
                    "actions": msgpack.ExtType(EXT_OBJECT_ARRAY, msgpack.packb([[3], [1, 2]])),
                }
            ),
            "needs 3 elements, got 2",
        ),
        (
            frame(
                {
                    "t": "step",
                    "actions": msgpack.ExtType(EXT_OBJECT_ARRAY, msgpack.packb([[-1], []])),
                }
            ),
            "shape must be",
        ),
        (
            frame(
                {"t": "step", "actions": msgpack.ExtType(EXT_OBJECT_ARRAY, msgpack.packb({"a": 1}))}
            ),
            r"must be \[shape, \[elements\]\]",
        ),
        (
            frame({"t": "step", "actions": msgpack.ExtType(EXT_OBJECT_ARRAY, b"\xc1")}),
            "not valid msgpack",
        ),
        (
            frame(
                {
                    "t": "step_result",
                    "obs": 0,
                    "reward": 1.0,
                    "terminated": 0,
                    "truncated": 0,
                    "info": {},
                }
            ),
            "field 'reward' must be a numpy array, got float",
        ),
        (
            frame(
                {
                    "t": "ready",
                    "observation_space": {"type": "Text"},
                    "action_space": {"type": "Discrete"},
                    "num_envs": 1,
                }
            ),
            "field 'observation_space': space has the unknown space type 'Text'",
        ),
    ],
)
def test_malformed_frames_raise_wire_error(data: bytes, match: str) -> None:
    with pytest.raises(WireError, match=match):
        codec.decode(data)


def test_msgpack_errors_are_chained() -> None:
    with pytest.raises(WireError) as info:
        codec.decode(b"\x92\x01")
    assert isinstance(info.value.__cause__, ValueError)


def test_decode_refuses_non_bytes() -> None:
    with pytest.raises(WireError, match="a frame must be bytes, got int"):
        codec.decode(3)  # type: ignore[arg-type]


def test_float_annotations_accept_ints_but_int_excludes_bool() -> None:
    float_field = _specs.field_for("x", float)
    assert float_field.check(1) and float_field.check(1.5) and not float_field.check("1")
    int_field = _specs.field_for("x", int)
    assert int_field.check(1) and not int_field.check(True) and not int_field.check(1.0)
    with pytest.raises(TypeError, match="cannot carry a field annotated"):
        _specs.field_for("x", list[int])


def test_array_annotations_through_a_type_alias_are_arrays() -> None:
    # NumPy 2.3 and later define NDArray with a `type` statement: NDArray[Any] is then an
    # alias whose value names np.ndarray, and messages annotated with it must still load.
    typing_extensions = pytest.importorskip("typing_extensions")
    scalar = typing_extensions.TypeVar("scalar")
    alias = typing_extensions.TypeAliasType(
        "alias", np.ndarray[tuple[Any, ...], np.dtype[scalar]], type_params=(scalar,)
    )
    field = _specs.field_for("reward", alias[Any])
    assert field.check(np.zeros(2)) and not field.check([0.0, 0.0])
    optional = _specs.field_for("final_obs", alias[Any] | None)
    assert optional.check(None) and optional.check(np.zeros(2)) and not optional.check(1)
