"""Gymnasium spaces as plain data, so a worker can tell the learner what its envs look like.

A space travels declaratively: :func:`space_to_wire` turns it into a small dict of ints,
strings and numpy arrays (which :mod:`aps.codec` carries), and :func:`space_from_wire` builds
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

from collections.abc import Callable, Mapping
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces as gs

from aps.errors import ConfigError, WireError

__all__ = [
    "MAX_MULTI_BINARY_SIZE",
    "MAX_SPACE_DEPTH",
    "SUPPORTED_SPACES",
    "space_from_wire",
    "space_to_wire",
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
    """Describe ``space`` as plain data for :mod:`aps.codec`.

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


def _wire_dtype(value: object, allowed: frozenset[str], where: str) -> np.dtype[Any]:
    if not isinstance(value, str) or value not in allowed:
        raise WireError(
            f"{where} has dtype {value!r}; expected one of {', '.join(sorted(allowed))}"
        )
    return np.dtype(value)


def _wire_array(value: object, dtype: np.dtype[Any], where: str) -> np.ndarray[Any, Any]:
    if not isinstance(value, np.ndarray) or value.dtype != dtype:
        got = f"array of {value.dtype}" if isinstance(value, np.ndarray) else type(value).__name__
        raise WireError(f"{where} must be an array of {dtype}, got {got}")
    # A writable copy: Gymnasium keeps (and may edit) the arrays it is given, and decoded
    # arrays are read-only views of the frame.
    return np.array(value, copy=True)


def _wire_int(value: object, where: str) -> int:
    if type(value) is not int:
        raise WireError(f"{where} must be an int, got {type(value).__name__}")
    return value


def _build_box(data: Mapping[str, Any], where: str, depth: int) -> gym.Space[Any]:
    dtype = _wire_dtype(data["dtype"], _BOX_DTYPES, where)
    low = _wire_array(data["low"], dtype, f"{where}.low")
    high = _wire_array(data["high"], dtype, f"{where}.high")
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
