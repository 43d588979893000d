"""Gymnasium spaces as plain data, so a worker can tell the learner what its envs look like.

A space travels declaratively: :func:`space_to_wire` turns it into a small dict of ints,
strings and numpy arrays (which :mod:`aps.wire.codec` carries), and :func:`space_from_wire` builds
an equal space back. Nothing is pickled, so a peer can never make the other side run code.

Supported: ``Box``, ``Discrete``, ``MultiDiscrete``, ``MultiBinary``, ``Dict`` and ``Tuple``,
nested in any way. The wire forms::

    {"type": "Box", "dtype": "float32", "low": ndarray, "high": ndarray}
    {"type": "Discrete", "dtype": "int64", "n": int, "start": int}
    {"type": "MultiDiscrete", "dtype": "int64", "nvec": ndarray, "start": ndarray}
    {"type": "MultiBinary", "n": int | [int, ...]}
    {"type": "Dict", "sort_keys": bool, "spaces": [[key, space], ...]}
    {"type": "Tuple", "spaces": [space, ...]}

The random state of a space (its seed) does not travel.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces as gs
from gymnasium.envs.registration import EnvSpec, WrapperSpec

from aps.errors import ConfigError, WireError

__all__ = [
    "MAX_MULTI_BINARY_SIZE",
    "MAX_SPACE_DEPTH",
    "SUPPORTED_SPACES",
    "VALUE_TAG",
    "sample_nbytes",
    "space_from_wire",
    "space_to_wire",
    "value_from_wire",
    "value_to_wire",
]

MAX_SPACE_DEPTH = 32
"""How deeply ``Dict`` and ``Tuple`` spaces may nest on the wire."""

MAX_MULTI_BINARY_SIZE = 2**28
"""The most elements a received ``MultiBinary`` may have (its shape is not backed by bytes)."""

SUPPORTED_SPACES: tuple[type[gym.Space[Any]], ...] = (
    gs.Box,
    gs.Discrete,
    gs.MultiDiscrete,
    gs.MultiBinary,
    gs.Dict,
    gs.Tuple,
)
"""The space types that travel; anything else is refused with :class:`~aps.errors.ConfigError`."""

# Dtype names a space may declare. Box takes all of them; the discrete spaces take the ints.
_INT_DTYPES = frozenset(
    ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"],
)
_BOX_DTYPES = _INT_DTYPES | {"bool", "float16", "float32", "float64"}

_SUPPORTED_NAMES = "Box, Discrete, MultiDiscrete, MultiBinary, Dict and Tuple"


def space_to_wire(space: gym.Space[Any]) -> dict[str, Any]:
    """Describe ``space`` as plain data for :mod:`aps.wire.codec`.

    Args:
        space: a Gymnasium space built only from the supported types.

    Returns:
        A dict of str, int, bool, numpy arrays, lists and nested dicts of these.

    Raises:
        ConfigError: the space (or a space nested in it) is of a type that cannot travel, such
            as ``Text``, ``Graph``, ``Sequence``, ``OneOf`` or a user subclass, or it has a
            dtype or a ``Dict`` key that cannot travel.
    """
    return _to_wire(space, "space", 0)


def _to_wire(space: object, where: str, depth: int) -> dict[str, Any]:
    if depth > MAX_SPACE_DEPTH:
        raise ConfigError(
            f"{where} nests deeper than {MAX_SPACE_DEPTH} levels of Dict/Tuple spaces; "
            "flatten the space"
        )
    # Exact type checks: a subclass may add state or behaviour that a plain rebuild would lose.
    kind = type(space)
    if kind is gs.Box:
        assert isinstance(space, gs.Box)
        dtype = _dtype_name(space.dtype, _BOX_DTYPES, where)
        # Copies, so later edits of the space never alter a message waiting to be sent.
        return {"type": "Box", "dtype": dtype, "low": space.low.copy(), "high": space.high.copy()}
    if kind is gs.Discrete:
        assert isinstance(space, gs.Discrete)
        dtype = _dtype_name(space.dtype, _INT_DTYPES, where)
        return {"type": "Discrete", "dtype": dtype, "n": int(space.n), "start": int(space.start)}
    if kind is gs.MultiDiscrete:
        assert isinstance(space, gs.MultiDiscrete)
        dtype = _dtype_name(space.dtype, _INT_DTYPES, where)
        return {
            "type": "MultiDiscrete",
            "dtype": dtype,
            "nvec": space.nvec.copy(),
            "start": space.start.copy(),
        }
    if kind is gs.MultiBinary:
        assert isinstance(space, gs.MultiBinary)
        n = space.n
        return {"type": "MultiBinary", "n": int(n) if isinstance(n, int) else [int(i) for i in n]}
    if kind is gs.Dict:
        assert isinstance(space, gs.Dict)
        pairs: list[list[Any]] = []
        for key, sub in space.spaces.items():
            if type(key) is not str:
                raise ConfigError(
                    f"{where} has the key {key!r} of type {type(key).__name__}; only str keys "
                    "travel (observations are dicts with str keys); rename the key"
                )
            pairs.append([key, _to_wire(sub, f"{where}[{key!r}]", depth + 1)])
        return {"type": "Dict", "sort_keys": bool(space.sort_keys), "spaces": pairs}
    if kind is gs.Tuple:
        assert isinstance(space, gs.Tuple)
        return {
            "type": "Tuple",
            "spaces": [
                _to_wire(sub, f"{where}[{i}]", depth + 1) for i, sub in enumerate(space.spaces)
            ],
        }
    name = kind.__qualname__ if isinstance(space, gym.Space) else f"non-space {kind.__qualname__}"
    raise ConfigError(
        f"{where} is a {name} ({space!r}), which cannot be sent to a peer; only {_SUPPORTED_NAMES} "
        "spaces travel (exact types, no subclasses); wrap the env so its spaces use these types, "
        "for example with gymnasium.wrappers.FlattenObservation"
    )


def _dtype_name(dtype: np.dtype[Any], allowed: frozenset[str], where: str) -> str:
    name = dtype.name
    if name not in allowed:
        raise ConfigError(
            f"{where} has dtype {name}, which cannot travel; supported dtypes here: "
            f"{', '.join(sorted(allowed))}; build the space with one of them"
        )
    return name


def space_from_wire(data: object) -> gym.Space[Any]:
    """Build the space that :func:`space_to_wire` described.

    Args:
        data: the decoded wire form (lists may arrive as tuples).

    Returns:
        A new space equal (``==``) to the one that was sent, with a fresh random state.

    Raises:
        WireError: ``data`` is not a valid space description: an unknown type, missing or
            extra fields, wrong field types, nesting deeper than :data:`MAX_SPACE_DEPTH`, or
            values Gymnasium rejects (its ``ValueError``/``TypeError`` is chained).
    """
    return _from_wire(data, "space", 0)


def _from_wire(data: object, where: str, depth: int) -> gym.Space[Any]:
    if depth > MAX_SPACE_DEPTH:
        raise WireError(f"{where} nests deeper than {MAX_SPACE_DEPTH} levels of spaces")
    if not isinstance(data, Mapping):
        raise WireError(f"{where} must be a map describing a space, got {type(data).__name__}")
    kind = data.get("type")
    builder = _BUILDERS.get(kind) if isinstance(kind, str) else None
    if builder is None:
        raise WireError(
            f"{where} has the unknown space type {kind!r}; known types: {_SUPPORTED_NAMES}"
        )
    fields, build = builder
    keys = set(data.keys())
    if keys != fields:
        missing = sorted(fields - keys)
        extra = sorted(map(repr, keys - fields))
        raise WireError(
            f"{where} ({kind}) has missing fields {missing} and extra fields {extra}; "
            "both sides must run the same aps release"
        )
    try:
        return build(data, where, depth)
    except WireError:
        raise
    except Exception as exc:
        # Gymnasium validates its own arguments (low > high, n <= 0, ...) with ValueError,
        # TypeError or assertions; whatever it raises, bytes from a peer end as a WireError.
        raise WireError(f"{where} ({kind}) is not a valid space: {exc}") from exc


def sample_nbytes(data: object) -> int:
    """The bytes one sample of the space ``data`` describes takes, read from the description.

    Runs before the space is built, so that a receiver can bound what it would build for
    many envs of it (see :func:`aps.wire.codec.decode` for a :class:`~aps.wire.messages.Ready`): a
    ``Box`` or ``MultiDiscrete`` counts its bounds' bytes, a ``Discrete`` its dtype's, a
    ``MultiBinary`` one byte per element, a ``Dict`` or ``Tuple`` the sum of its spaces. A
    description too malformed to count counts 0: :func:`space_from_wire` refuses it.
    """
    return _sample_nbytes(data, 0)


def _sample_nbytes(data: object, depth: int) -> int:
    if depth > MAX_SPACE_DEPTH or not isinstance(data, Mapping):
        return 0
    kind = data.get("type")
    if kind == "Box":
        low = data.get("low")
        return low.nbytes if isinstance(low, np.ndarray) else 0
    if kind == "MultiDiscrete":
        nvec = data.get("nvec")
        return nvec.nbytes if isinstance(nvec, np.ndarray) else 0
    if kind == "Discrete":
        name = data.get("dtype")
        return np.dtype(name).itemsize if isinstance(name, str) and name in _INT_DTYPES else 0
    if kind == "MultiBinary":
        n = data.get("n")
        dims = (n,) if type(n) is int else n if isinstance(n, list | tuple) else ()
        size = 1
        for dim in dims[:32]:
            size *= dim if type(dim) is int and dim > 0 else 0
        return size
    subs = data.get("spaces")
    if kind not in ("Dict", "Tuple") or not isinstance(subs, list | tuple):
        return 0
    if kind == "Dict":
        subs = [pair[1] for pair in subs if isinstance(pair, list | tuple) and len(pair) == 2]
    return sum(_sample_nbytes(sub, depth + 1) for sub in subs)


def _wire_dtype(value: object, allowed: frozenset[str], where: str) -> np.dtype[Any]:
    if not isinstance(value, str) or value not in allowed:
        raise WireError(
            f"{where} has dtype {value!r}; expected one of {', '.join(sorted(allowed))}"
        )
    return np.dtype(value)


def _wire_array(
    value: object, dtype: np.dtype[Any], where: str, *, copy: bool = True
) -> np.ndarray[Any, Any]:
    if not isinstance(value, np.ndarray) or value.dtype != dtype:
        got = f"array of {value.dtype}" if isinstance(value, np.ndarray) else type(value).__name__
        raise WireError(f"{where} must be an array of {dtype}, got {got}")
    # A writable copy: Gymnasium keeps (and may edit) the arrays it is given, and decoded
    # arrays are read-only views of the frame. A Box copies its bounds itself (astype), so
    # they are passed as they are: one copy fewer of what may be most of the frame.
    return np.array(value, copy=True) if copy else value


def _wire_int(value: object, where: str) -> int:
    if type(value) is not int:
        raise WireError(f"{where} must be an int, got {type(value).__name__}")
    return value


def _build_box(data: Mapping[str, Any], where: str, depth: int) -> gym.Space[Any]:
    dtype = _wire_dtype(data["dtype"], _BOX_DTYPES, where)
    low = _wire_array(data["low"], dtype, f"{where}.low", copy=False)
    high = _wire_array(data["high"], dtype, f"{where}.high", copy=False)
    if low.shape != high.shape:
        raise WireError(f"{where} has low of shape {low.shape} but high of shape {high.shape}")
    return gs.Box(low=low, high=high, dtype=dtype)


def _build_discrete(data: Mapping[str, Any], where: str, depth: int) -> gym.Space[Any]:
    dtype = _wire_dtype(data["dtype"], _INT_DTYPES, where)
    n = _wire_int(data["n"], f"{where}.n")
    start = _wire_int(data["start"], f"{where}.start")
    info = np.iinfo(dtype)
    # Gymnasium would silently wrap an out-of-range n or start into the dtype.
    if not (0 < n and info.min <= start and start + n - 1 <= info.max):
        raise WireError(
            f"{where} has n={n}, start={start}, which does not fit dtype {dtype} "
            f"([{info.min}, {info.max}])"
        )
    return gs.Discrete(n, start=start, dtype=dtype)


def _build_multi_discrete(data: Mapping[str, Any], where: str, depth: int) -> gym.Space[Any]:
    dtype = _wire_dtype(data["dtype"], _INT_DTYPES, where)
    nvec = _wire_array(data["nvec"], dtype, f"{where}.nvec")
    start = _wire_array(data["start"], dtype, f"{where}.start")
    return gs.MultiDiscrete(nvec, dtype=dtype, start=start)


def _build_multi_binary(data: Mapping[str, Any], where: str, depth: int) -> gym.Space[Any]:
    n = data["n"]
    if type(n) is int:
        shape: tuple[int, ...] = (n,)
    elif isinstance(n, list | tuple) and len(n) <= 32 and all(type(i) is int for i in n):
        shape = tuple(n)
    else:
        raise WireError(f"{where}.n must be an int or a list of at most 32 ints, got {n!r:.80}")
    # The shape is the one size on the wire not backed by bytes in the frame; bound it before
    # anyone batches the space (an int8 sample larger than a default frame could never travel).
    size = 1
    for dim in shape:
        size *= max(dim, 0)
    if size > MAX_MULTI_BINARY_SIZE:
        raise WireError(
            f"{where} has shape {shape} ({size} elements), over the limit of "
            f"{MAX_MULTI_BINARY_SIZE}"
        )
    return gs.MultiBinary(n if type(n) is int else shape)


def _build_dict(data: Mapping[str, Any], where: str, depth: int) -> gym.Space[Any]:
    sort_keys = data["sort_keys"]
    pairs = data["spaces"]
    if type(sort_keys) is not bool:
        raise WireError(f"{where}.sort_keys must be a bool, got {type(sort_keys).__name__}")
    if not isinstance(pairs, list | tuple):
        raise WireError(f"{where}.spaces must be a list of [key, space] pairs")
    built: list[tuple[str, gym.Space[Any]]] = []
    seen: set[str] = set()
    for pair in pairs:
        if not (isinstance(pair, list | tuple) and len(pair) == 2 and type(pair[0]) is str):
            raise WireError(f"{where}.spaces must hold [str key, space] pairs, got {pair!r:.80}")
        key = pair[0]
        if key in seen:
            raise WireError(f"{where} repeats the key {key!r}")
        seen.add(key)
        built.append((key, _from_wire(pair[1], f"{where}[{key!r}]", depth + 1)))
    # A sequence of pairs keeps the order that was sent, whatever sort_keys says.
    return gs.Dict(built, sort_keys=sort_keys)


def _build_tuple(data: Mapping[str, Any], where: str, depth: int) -> gym.Space[Any]:
    subs = data["spaces"]
    if not isinstance(subs, list | tuple):
        raise WireError(f"{where}.spaces must be a list of spaces, got {type(subs).__name__}")
    return gs.Tuple([_from_wire(sub, f"{where}[{i}]", depth + 1) for i, sub in enumerate(subs)])


_Builder = Callable[[Mapping[str, Any], str, int], gym.Space[Any]]

_BUILDERS: dict[str, tuple[frozenset[str], _Builder]] = {
    "Box": (frozenset(["type", "dtype", "low", "high"]), _build_box),
    "Discrete": (frozenset(["type", "dtype", "n", "start"]), _build_discrete),
    "MultiDiscrete": (frozenset(["type", "dtype", "nvec", "start"]), _build_multi_discrete),
    "MultiBinary": (frozenset(["type", "n"]), _build_multi_binary),
    "Dict": (frozenset(["type", "sort_keys", "spaces"]), _build_dict),
    "Tuple": (frozenset(["type", "spaces"]), _build_tuple),
}


# Values that env calls return (get_attr("observation_space"), ("spec"), ("np_random")).

VALUE_TAG = "__aps__"
"""The key of a map that stands for a value the codec does not carry itself (see below)."""

_BIT_GENERATORS = ("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64")
_MAX_STATE_DIGITS = 80  # a bit generator's state words are at most 128 bits: 39 digits


def value_to_wire(value: Any) -> Any:
    """``value`` with spaces, env specs and numpy Generators replaced by tagged maps.

    What an env call returns must travel as data. Three Gymnasium values are data without
    being plain: a space (:func:`space_to_wire`), an
    :class:`~gymnasium.envs.registration.EnvSpec` (its fields, an entry point that is a
    callable as its ``"module:qualname"``), and a :class:`numpy.random.Generator` (its bit
    generator's name and state, the state's integers as decimal strings, since they exceed
    64 bits). Each becomes ``{VALUE_TAG: kind, ...}``; a user's dict that holds the key
    :data:`VALUE_TAG` is wrapped (``{VALUE_TAG: "map", "items": ...}``) so that nothing a
    user returns is read as one. Tuples, lists and dicts are walked; anything else is left
    for the codec to carry or refuse.

    Raises:
        ConfigError: a space of a type that cannot travel, or a Generator whose bit
            generator is none of numpy's own.
    """
    if isinstance(value, tuple | list):
        converted = [value_to_wire(item) for item in value]
        return tuple(converted) if isinstance(value, tuple) else converted
    if isinstance(value, dict):
        items = {key: value_to_wire(item) for key, item in value.items()}
        return {VALUE_TAG: "map", "items": items} if VALUE_TAG in items else items
    if isinstance(value, gym.Space):
        return {VALUE_TAG: "space", "space": space_to_wire(value)}
    if isinstance(value, EnvSpec):
        return {VALUE_TAG: "env_spec", "fields": _spec_fields(value)}
    if isinstance(value, np.random.Generator):
        bits = value.bit_generator
        name = type(bits).__name__
        if name not in _BIT_GENERATORS or type(bits).__module__.split(".")[0] != "numpy":
            raise ConfigError(
                f"a Generator over {type(bits).__qualname__} cannot travel; only numpy's own bit "
                f"generators do ({', '.join(_BIT_GENERATORS)})"
            )
        # The name travels on its own: every other string in the state is a number.
        state = {key: item for key, item in bits.state.items() if key != "bit_generator"}
        return {VALUE_TAG: "generator", "bit_generator": name, "state": _ints_as_text(state)}
    return value


def value_from_wire(value: Any) -> Any:
    """Undo :func:`value_to_wire` on a decoded value.

    A Generator comes back as a new Generator in the state the env's was in when it was
    read: a copy, whose draws are those the env's next draws would have been, and which
    leaves the env's own random state untouched.

    Raises:
        WireError: a tagged map that describes no valid space, env spec or Generator.
    """
    if isinstance(value, tuple | list):
        converted = [value_from_wire(item) for item in value]
        return tuple(converted) if isinstance(value, tuple) else converted
    if not isinstance(value, Mapping):
        return value
    kind = value.get(VALUE_TAG)
    if kind is None:
        return {key: value_from_wire(item) for key, item in value.items()}
    _check_tagged(value, kind)
    if kind == "map":
        items = value["items"]
        if not isinstance(items, Mapping):
            raise WireError(f"a wrapped map holds {type(items).__name__}, not a map")
        return {key: value_from_wire(item) for key, item in items.items()}
    if kind == "space":
        return space_from_wire(value["space"])
    if kind == "env_spec":
        return _build_spec(value["fields"])
    return _build_generator(value["bit_generator"], value["state"])


_TAGGED: dict[str, frozenset[str]] = {
    "map": frozenset([VALUE_TAG, "items"]),
    "space": frozenset([VALUE_TAG, "space"]),
    "env_spec": frozenset([VALUE_TAG, "fields"]),
    "generator": frozenset([VALUE_TAG, "bit_generator", "state"]),
}


def _check_tagged(value: Mapping[str, Any], kind: object) -> None:
    fields = _TAGGED.get(kind) if isinstance(kind, str) else None
    if fields is None:
        raise WireError(f"a tagged value is of unknown kind {kind!r}; known: {sorted(_TAGGED)}")
    if set(value) != fields:
        raise WireError(
            f"a tagged {kind} value has the fields {sorted(value)}, expected {sorted(fields)}"
        )


# EnvSpec's fields that its constructor takes (namespace, name and version follow from id).
_SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(EnvSpec) if f.init)
_WRAPPER_FIELDS = ("name", "entry_point", "kwargs")


def _entry_point(entry: object) -> object:
    """An entry point as data: a string as it is, a callable as its ``"module:qualname"``."""
    if entry is None or isinstance(entry, str):
        return entry
    module = getattr(entry, "__module__", None)
    qualname = getattr(entry, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str):
        return f"{module}:{qualname}"
    return repr(entry)


def _spec_fields(spec: EnvSpec) -> dict[str, Any]:
    fields = {name: getattr(spec, name) for name in _SPEC_FIELDS}
    fields["entry_point"] = _entry_point(spec.entry_point)
    fields["vector_entry_point"] = _entry_point(spec.vector_entry_point)
    fields["kwargs"] = value_to_wire(dict(spec.kwargs))
    fields["additional_wrappers"] = [
        {
            "name": wrapper.name,
            "entry_point": _entry_point(wrapper.entry_point),
            "kwargs": value_to_wire(wrapper.kwargs),
        }
        for wrapper in spec.additional_wrappers
    ]
    return fields


def _build_spec(fields: object) -> EnvSpec:
    if not isinstance(fields, Mapping) or set(fields) != set(_SPEC_FIELDS):
        got = sorted(fields) if isinstance(fields, Mapping) else type(fields).__name__
        raise WireError(f"an env spec must have the fields {sorted(_SPEC_FIELDS)}, got {got}")
    wrappers = fields["additional_wrappers"]
    if not isinstance(wrappers, list | tuple) or not all(
        isinstance(w, Mapping) and set(w) == set(_WRAPPER_FIELDS) for w in wrappers
    ):
        raise WireError(
            f"an env spec's additional_wrappers must be maps of {list(_WRAPPER_FIELDS)}, got "
            f"{wrappers!r:.200}"
        )
    kwargs = value_from_wire(fields["kwargs"])
    if not isinstance(kwargs, dict):
        raise WireError(f"an env spec's kwargs must be a map, got {type(kwargs).__name__}")
    arguments = dict(fields)
    arguments["kwargs"] = kwargs
    arguments["additional_wrappers"] = tuple(
        WrapperSpec(w["name"], w["entry_point"], value_from_wire(w["kwargs"])) for w in wrappers
    )
    try:
        return EnvSpec(**arguments)
    except Exception as exc:  # whatever Gymnasium's checks raise: the peer's data is bad
        raise WireError(f"an env spec that Gymnasium refuses: {exc}") from exc


def _ints_as_text(state: Any) -> Any:
    """A bit generator's state with its integers (up to 128 bits) as decimal strings."""
    if isinstance(state, dict):
        return {key: _ints_as_text(item) for key, item in state.items()}
    if isinstance(state, int) and not isinstance(state, bool):
        return str(state)
    return state


def _ints_from_text(state: Any, where: str) -> Any:
    if isinstance(state, Mapping):
        return {key: _ints_from_text(item, f"{where}[{key!r}]") for key, item in state.items()}
    if isinstance(state, str):
        digits = state[1:] if state.startswith("-") else state
        if not (0 < len(digits) <= _MAX_STATE_DIGITS and digits.isascii() and digits.isdigit()):
            raise WireError(f"{where} must be an integer in decimal, got {state!r:.100}")
        return int(state)
    if isinstance(state, np.ndarray):
        return state.copy()  # decoded arrays are read-only; a bit generator takes its own
    return state


def _build_generator(name: object, state: object) -> np.random.Generator:
    if name not in _BIT_GENERATORS:
        raise WireError(f"a Generator over {name!r:.100}; known: {', '.join(_BIT_GENERATORS)}")
    if not isinstance(state, Mapping):
        raise WireError(f"a Generator's state must be a map, got {type(state).__name__}")
    bits = getattr(np.random, str(name))()
    state = _ints_from_text(state, "the Generator's state")
    assert isinstance(state, dict)
    state["bit_generator"] = name  # the key is the name again, not a number
    try:
        bits.state = state
    except Exception as exc:  # whatever numpy's checks raise: the peer's data is bad
        raise WireError(f"a {name} state that numpy refuses: {exc!r:.200}") from exc
    return np.random.Generator(bits)
