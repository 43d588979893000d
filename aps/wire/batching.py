"""Stitch per-worker batches into one batch, and cut one batch into per-worker parts.

The learner sees all envs of all workers in one stable order: worker 0's envs, then worker
1's, and so on. Each worker runs a Gymnasium vector env over its own envs and sends batched
observations and merged info dicts; these helpers make the result identical to what one
``gymnasium.vector.SyncVectorEnv`` over all the envs would return. They are pure functions:
no I/O, no clock, no asyncio.

A *batch* of a space is what Gymnasium's vector utilities produce for it: an array with a
leading env axis for ``Box``, ``Discrete``, ``MultiDiscrete`` and ``MultiBinary``, a dict of
batches for ``Dict`` (in the space's key order) and a tuple of batches for ``Tuple``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces as gs

from aps._base._typing import Array, Info
from aps.errors import ConfigError, ProtocolError

__all__ = [
    "action_layout",
    "batch_layout",
    "check_batch",
    "check_info",
    "check_part",
    "check_space",
    "concat",
    "empty_batch",
    "map_arrays",
    "merge_infos",
    "misfit",
    "split",
]

_ARRAY_SPACES = (gs.Box, gs.Discrete, gs.MultiDiscrete, gs.MultiBinary)
_SUPPORTED = "Box, Discrete, MultiDiscrete, MultiBinary, Dict and Tuple"


def _unsupported(space: object) -> ConfigError:
    return ConfigError(
        f"cannot batch a {type(space).__qualname__} space ({space!r}); supported spaces: "
        f"{_SUPPORTED}; wrap the env so its spaces use these types"
    )


def _batch_dtype(space: gym.Space[Any]) -> np.dtype[Any]:
    # batch_space keeps the single space's dtype for all four array spaces.
    dtype = space.dtype
    assert dtype is not None  # only Dict and Tuple (and custom spaces) have none
    return dtype


def _shape(space: gym.Space[Any]) -> tuple[int, ...]:
    shape = space.shape
    assert shape is not None  # only Dict and Tuple (and custom spaces) have none
    return shape


# --------------------------------------------------------------------------------------------
# concat / split


def concat(space: gym.Space[Any], parts: Sequence[Any], counts: Sequence[int] | None = None) -> Any:
    """Join per-worker batches along the env axis, as Gymnasium batches ``space``.

    Args:
        space: the single-env space (``single_observation_space``).
        parts: one batch per worker, in env order; each with ``E_i`` envs.
        counts: the ``E_i``, when they are known: a part with another number of envs is
            refused. ``None`` takes each part's own.

    Returns:
        A new batch of ``sum(E_i)`` envs with the dtypes and shapes of
        ``gymnasium.vector.utils.batch_space(space, sum(E_i))``; arrays are fresh, writable
        and C-contiguous.

    Raises:
        ConfigError: ``parts`` is empty, or ``space`` is of an unsupported type.
        ProtocolError: a part does not match the space (wrong structure, shape or dtype).
    """
    if len(parts) == 0:
        raise ConfigError("concat needs at least one part; got an empty list of batches")
    if counts is not None and len(counts) != len(parts):
        raise ConfigError(f"concat got {len(parts)} parts but {len(counts)} counts")
    return _concat(space, parts, "batch", counts)


def _concat(
    space: gym.Space[Any], parts: Sequence[Any], where: str, counts: Sequence[int] | None
) -> Any:
    if isinstance(space, _ARRAY_SPACES):
        dtype = _batch_dtype(space)
        shape = _shape(space)
        for index, part in enumerate(parts):
            if not (
                isinstance(part, np.ndarray)
                and part.ndim == 1 + len(shape)
                and part.shape[1:] == shape
                and part.dtype == dtype
                and (counts is None or part.shape[0] == counts[index])
            ):
                envs = "E" if counts is None else counts[index]
                raise ProtocolError(
                    f"part {index} of {where} is {_describe(part)}, expected an array of shape "
                    f"({envs},) + {shape} and dtype {dtype} for {space}; all workers must "
                    "run envs with the same spaces"
                )
        return np.concatenate(parts, axis=0)
    if isinstance(space, gs.Dict):
        for index, part in enumerate(parts):
            if not isinstance(part, Mapping) or set(part.keys()) != set(space.spaces):
                got = sorted(map(repr, part.keys())) if isinstance(part, Mapping) else part
                raise ProtocolError(
                    f"part {index} of {where} must be a dict with keys "
                    f"{list(space.spaces)}, got {_describe(got)}"
                )
        return {
            key: _concat(sub, [part[key] for part in parts], f"{where}[{key!r}]", counts)
            for key, sub in space.spaces.items()
        }
    if isinstance(space, gs.Tuple):
        for index, part in enumerate(parts):
            if not isinstance(part, tuple | list) or len(part) != len(space.spaces):
                raise ProtocolError(
                    f"part {index} of {where} must be a tuple of {len(space.spaces)} batches, "
                    f"got {_describe(part)}"
                )
        return tuple(
            _concat(sub, [part[i] for part in parts], f"{where}[{i}]", counts)
            for i, sub in enumerate(space.spaces)
        )
    raise _unsupported(space)


def batch_layout(
    space: gym.Space[Any], count: int | tuple[int, ...]
) -> tuple[tuple[int, ...], np.dtype[Any]] | None:
    """The shape and dtype of a batch of ``count`` envs of an array space (``None``: not one).

    What :func:`check_part` requires of such a batch, for a caller on a hot path to test
    an ndarray against first (and call :func:`check_part` for anything else, or its error).
    ``count`` may be a tuple of leading axes (``(T, E)`` for a chunk's observations).
    """
    if not isinstance(space, _ARRAY_SPACES):
        return None
    leading = count if isinstance(count, tuple) else (count,)
    return (*leading, *_shape(space)), _batch_dtype(space)


def check_part(
    space: gym.Space[Any],
    part: Any,
    count: int | tuple[int, ...],
    where: str,
    *,
    exact_dtype: bool = True,
) -> None:
    """Check that ``part`` is a batch of ``count`` envs of ``space`` (one worker's, say).

    What :func:`concat` checks of each part, without joining anything: the structure, and
    each array's shape and dtype. ``where`` names the part in the error (``"obs"``).
    ``count`` may be a tuple of leading axes: a DETACH chunk's observations are checked
    with ``(T, E)``, its ``next_obs`` with ``(E,)`` and its truncated observations with
    ``(K,)``, by this same rule. ``exact_dtype=False`` accepts any numeric or bool dtype
    (what a policy converts to floats anyway).

    Raises:
        ProtocolError: ``part`` does not fit; the message says where, what was expected
            and what came.
        ConfigError: ``space`` is of an unsupported type.
    """
    layout = batch_layout(space, count)
    if layout is not None:
        shape, dtype = layout
        if not (
            isinstance(part, np.ndarray)
            and part.shape == shape
            and (part.dtype == dtype or (not exact_dtype and part.dtype.kind in "biuf"))
        ):
            wanted = f"dtype {dtype}" if exact_dtype else "a numeric dtype"
            raise ProtocolError(
                f"{where} is {_describe(part)}, expected an array of shape {shape} and {wanted}"
            )
    elif isinstance(space, gs.Dict):
        if not isinstance(part, Mapping) or set(part.keys()) != set(space.spaces):
            got = sorted(map(repr, part.keys())) if isinstance(part, Mapping) else part
            raise ProtocolError(
                f"{where} must be a dict with keys {list(space.spaces)}, got {_describe(got)}"
            )
        for key, sub in space.spaces.items():
            check_part(sub, part[key], count, f"{where}[{key!r}]", exact_dtype=exact_dtype)
    elif isinstance(space, gs.Tuple):
        if not isinstance(part, tuple | list) or len(part) != len(space.spaces):
            raise ProtocolError(
                f"{where} must be a tuple of {len(space.spaces)} batches, got {_describe(part)}"
            )
        for index, sub in enumerate(space.spaces):
            check_part(sub, part[index], count, f"{where}[{index}]", exact_dtype=exact_dtype)
    else:
        raise _unsupported(space)


def check_space(space: gym.Space[Any], what: str) -> bool:
    """Whether batches of ``space`` are structured (``Dict`` or ``Tuple``) rather than one array.

    ``what`` names the use in the error (``"worker-side inference"``).

    Raises:
        ConfigError: ``space`` is, or holds, a space type other than ``Box``, ``Discrete``,
            ``MultiDiscrete``, ``MultiBinary``, ``Dict`` and ``Tuple``.
    """
    if isinstance(space, _ARRAY_SPACES):
        return False
    if isinstance(space, gs.Dict | gs.Tuple):
        subspaces = space.spaces.values() if isinstance(space, gs.Dict) else space.spaces
        if not subspaces:
            raise ConfigError(
                f"{what} cannot take the empty space {space!r:.120}: it holds no array; give "
                "it at least one subspace"
            )
        for sub in subspaces:
            if not isinstance(sub, (*_ARRAY_SPACES, gs.Dict, gs.Tuple)):
                raise ConfigError(
                    f"{what} cannot take the {type(sub).__qualname__} space {sub!r:.80} inside "
                    f"{space!r:.120}; supported spaces: {_SUPPORTED}; wrap the env so its "
                    "observations use these types, or step it in lockstep mode"
                )
            check_space(sub, what)
        return True
    raise ConfigError(
        f"{what} cannot take the {type(space).__qualname__} space {space!r:.120}; supported "
        f"spaces: {_SUPPORTED}; wrap the env so its observations use these types, or step it "
        "in lockstep mode"
    )


def empty_batch(space: gym.Space[Any], leading: tuple[int, ...]) -> Any:
    """Uninitialised arrays ``(*leading, *shape)`` of ``space``'s dtypes, in its structure.

    A dict (the space's key order) for ``Dict``, a tuple for ``Tuple``, nested as the space.

    Raises:
        ConfigError: ``space`` is of an unsupported type.
    """
    layout = batch_layout(space, leading)
    if layout is not None:
        return np.empty(*layout)
    if isinstance(space, gs.Dict):
        return {key: empty_batch(sub, leading) for key, sub in space.spaces.items()}
    if isinstance(space, gs.Tuple):
        return tuple(empty_batch(sub, leading) for sub in space.spaces)
    raise _unsupported(space)


def map_arrays(function: Any, batch: Any, *others: Any) -> Any:
    """Apply ``function`` to each array of ``batch`` and those at the same place in ``others``.

    The result has ``batch``'s structure (dicts and tuples, nested; an array is its own one
    leaf); the others must hold at least its keys and items.
    """
    if type(batch) is dict:
        return {
            key: map_arrays(function, item, *(other[key] for other in others))
            for key, item in batch.items()
        }
    if type(batch) is tuple:
        return tuple(
            map_arrays(function, item, *(other[index] for other in others))
            for index, item in enumerate(batch)
        )
    return function(batch, *others)


def split(space: gym.Space[Any], batch: Any, counts: Sequence[int]) -> list[Any]:
    """Cut a batch into per-worker parts along the env axis (the inverse of :func:`concat`).

    Args:
        space: the single-env space.
        batch: a batch of ``sum(counts)`` envs, as :func:`check_batch` returns it.
        counts: the number of envs of each worker, in env order.

    Returns:
        ``len(counts)`` batches; their arrays are C-contiguous views of ``batch`` (of a
        contiguous copy when ``batch`` itself is not contiguous).

    Raises:
        ConfigError: the batch does not hold ``sum(counts)`` envs, a count is negative, or
            the space is of an unsupported type.
    """
    if any(count < 0 for count in counts):
        raise ConfigError(f"counts must be non-negative, got {list(counts)}")
    bounds = [0, *itertools.accumulate(counts)]
    return _split(space, batch, bounds, "batch")


def _split(space: gym.Space[Any], batch: Any, bounds: list[int], where: str) -> list[Any]:
    parts = len(bounds) - 1
    if isinstance(space, _ARRAY_SPACES):
        array = np.ascontiguousarray(batch)
        if array.ndim == 0 or array.shape[0] != bounds[-1]:
            raise ConfigError(
                f"{where} has shape {array.shape}, expected a leading axis of {bounds[-1]} envs "
                "(the sum of the counts); pass one entry per env"
            )
        return [array[bounds[i] : bounds[i + 1]] for i in range(parts)]
    if isinstance(space, gs.Dict):
        columns = {
            key: _split(sub, batch[key], bounds, f"{where}[{key!r}]")
            for key, sub in space.spaces.items()
        }
        return [{key: column[i] for key, column in columns.items()} for i in range(parts)]
    if isinstance(space, gs.Tuple):
        columns_t = [
            _split(sub, batch[j], bounds, f"{where}[{j}]") for j, sub in enumerate(space.spaces)
        ]
        return [tuple(column[i] for column in columns_t) for i in range(parts)]
    raise _unsupported(space)


# --------------------------------------------------------------------------------------------
# check_batch


def action_layout(space: gym.Space[Any], num_envs: int) -> tuple[tuple[int, ...], str] | None:
    """The one-array batches :func:`check_batch` accepts for ``num_envs`` envs of ``space``.

    Returns:
        ``(shape, kinds)``: a batch of an array space is an array of that shape whose
        ``dtype.kind`` is one of ``kinds`` (numeric for ``Box``, integer or bool for the
        others); :func:`check_batch` returns such an array as it is, so a caller on a hot
        path may test an ndarray against this first and call :func:`check_batch` for
        anything else. ``None`` for ``Dict``, ``Tuple`` and unsupported spaces.
    """
    if not isinstance(space, _ARRAY_SPACES):
        return None
    return (num_envs, *_shape(space)), "fiub" if isinstance(space, gs.Box) else "iub"


def misfit(arrays: Sequence[tuple[str, Any, tuple[int, ...], str | None]]) -> str | None:
    """Which of ``arrays`` is not what a peer must send; ``None`` when they all fit.

    Each entry is ``(name, value, shape, kinds)``: ``value`` must be a numpy array of
    ``shape`` whose ``dtype.kind`` is one of ``kinds`` (``None``: any dtype). The one rule for
    the per-env arrays of an answer (a step's rewards, a chunk's ``(T, E)`` arrays), so that
    every mode's error reads the same.

    Returns:
        For the first that does not fit: ``"NAME is an array of shape ... and dtype ...,
        expected ..."``, for the caller to put after who sent it.
    """
    for name, value, shape, kinds in arrays:
        if (
            type(value) is not np.ndarray
            or value.shape != shape
            or (kinds is not None and value.dtype.kind not in kinds)
        ):
            wanted = "" if kinds is None else f" and {_KIND_NAMES.get(kinds, kinds)} dtype"
            return f"{name} is {_describe(value)}, expected shape {shape}{wanted}"
    return None


_KIND_NAMES = {"b": "a bool", "fiu": "a numeric", "iub": "an integer or bool"}


def check_batch(
    space: gym.Space[Any],
    value: Any,
    num_envs: int,
    *,
    name: str = "actions",
    space_name: str = "single_action_space",
) -> Any:
    """Check a user's batched value against ``space`` and return it as arrays.

    The value must have one entry per env: shape ``(num_envs, *space.shape)`` for the array
    spaces, the space's exact keys for ``Dict``, its length for ``Tuple``. ``Discrete``,
    ``MultiDiscrete`` and ``MultiBinary`` need an integer or bool dtype; ``Box`` a numeric
    one. Lists are accepted and converted with ``np.asarray``; dtypes are kept (Gymnasium
    hands each env its slice of the batch unconverted, and so does aps).

    Args:
        space: the single-env space (``single_action_space``).
        value: the batch to check.
        num_envs: the number of envs the batch must cover.
        name: what the value is called in error messages.
        space_name: what ``space`` is called in error messages.

    Returns:
        The batch with arrays in place of lists (a dict in the space's key order for
        ``Dict``, a tuple for ``Tuple``); arrays already given are returned as they are.

    Raises:
        ConfigError: the value does not fit; the message names its shape or dtype, the
            expected one and the fix.
    """
    return _check(space, value, num_envs, name, space_name)


def _check(space: gym.Space[Any], value: Any, num_envs: int, name: str, space_name: str) -> Any:
    if isinstance(space, _ARRAY_SPACES):
        try:
            array = np.asarray(value)
        except Exception as exc:  # ragged lists and other values numpy refuses
            raise ConfigError(
                f"{name} cannot be turned into an array ({exc}); pass one action per env"
            ) from exc
        layout = action_layout(space, num_envs)
        assert layout is not None  # an array space
        expected, kinds = layout
        if array.shape != expected:
            raise ConfigError(
                f"{name} has shape {array.shape}, expected {expected} = (num_envs,) + "
                f"{space_name}.shape; pass one action per env"
            )
        if array.dtype.kind not in kinds:
            wanted = "a numeric" if isinstance(space, gs.Box) else "an integer or bool"
            cast = space.dtype if isinstance(space, gs.Box) else "np.int64"
            raise ConfigError(
                f"{name} has dtype {array.dtype}, expected {wanted} dtype for {space}; "
                f"convert with .astype({_dtype_text(cast)})"
            )
        return array
    if isinstance(space, gs.Dict):
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"{name} is a {type(value).__qualname__}, expected a dict with keys "
                f"{list(space.spaces)} for {space_name}; pass a dict of batches"
            )
        if set(value.keys()) != set(space.spaces):
            missing = [k for k in space.spaces if k not in value]
            extra = [k for k in value if k not in space.spaces]
            raise ConfigError(
                f"{name} has keys {list(value)}, expected {list(space.spaces)} "
                f"(missing {missing}, extra {extra}); pass exactly the keys of {space_name}"
            )
        return {
            key: _check(sub, value[key], num_envs, f"{name}[{key!r}]", f"{space_name}[{key!r}]")
            for key, sub in space.spaces.items()
        }
    if isinstance(space, gs.Tuple):
        if not isinstance(value, tuple | list) or len(value) != len(space.spaces):
            got = f"of length {len(value)}" if isinstance(value, tuple | list) else "not a tuple"
            raise ConfigError(
                f"{name} is {got}, expected a tuple of {len(space.spaces)} batches for "
                f"{space_name}; pass one batch per subspace"
            )
        return tuple(
            _check(sub, value[i], num_envs, f"{name}[{i}]", f"{space_name}[{i}]")
            for i, sub in enumerate(space.spaces)
        )
    raise _unsupported(space)


def _dtype_text(dtype: object) -> str:
    if isinstance(dtype, np.dtype):
        return f"np.{dtype.name}"
    return str(dtype)


def _describe(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"an array of shape {value.shape} and dtype {value.dtype}"
    return f"{type(value).__qualname__} {value!r:.80}"


# --------------------------------------------------------------------------------------------
# merge_infos


def check_info(info: Any, count: int, where: str = "info") -> None:
    """Check that ``info`` is the info dict of a vector env over ``count`` envs (one worker's).

    Gymnasium's vector info convention, as :func:`merge_infos` reads it: a dict with str
    keys; each key ``k`` comes with its mask ``"_k"``, a 1-d bool array of ``count`` envs;
    each value is an array whose leading axis is ``count`` envs, or a dict checked the same
    way (its mask sits beside it, at the parent level). What one answer can be blamed for is
    checked here, so a worker whose info reaches outside its own envs is refused before its
    info is merged with the others'; whether workers agree with each other (a key's per-env
    shape and dtype) is :func:`merge_infos`'s to check.

    Raises:
        ProtocolError: naming the key, what was expected and what came.
    """
    if type(info) is not dict:
        raise ProtocolError(f"{where} must be a dict, got {_describe(info)}")
    for key, value in info.items():
        mask_key = _mask_key(info, key, where)
        if mask_key is None:
            continue  # the mask of another key, checked with that key
        mask = info[mask_key]
        if not (
            type(mask) is np.ndarray
            and mask.dtype == np.bool_
            and mask.ndim == 1
            and mask.shape[0] == count
        ):
            raise ProtocolError(
                f"{where}[{mask_key!r:.80}] must be a bool array of shape ({count},), one "
                f"entry per env of this worker, got {_describe(mask)}"
            )
        if type(value) is dict:
            check_info(value, count, f"{where}[{key!r:.80}]")
        elif not (type(value) is np.ndarray and value.ndim >= 1 and value.shape[0] == count):
            raise ProtocolError(
                f"{where}[{key!r:.80}] must be a dict or an array with a leading axis of "
                f"{count} envs, one per env of this worker, got {_describe(value)}"
            )


def _mask_key(info: dict[Any, Any], key: Any, where: str) -> str | None:
    """The key of ``key``'s mask in a vector env's ``info``; ``None`` if ``key`` is a mask.

    Raises:
        ProtocolError: ``key`` is not a str, or neither has a mask nor is one.
    """
    if type(key) is not str:
        raise ProtocolError(f"{where} has the non-str key {key!r:.80}; keys must be str")
    mask_key = "_" + key
    if mask_key in info:
        return mask_key
    if key[:1] == "_" and key[1:] in info:
        return None
    raise ProtocolError(
        f"{where}[{key!r:.80}] has no {mask_key!r:.80} mask; each key of a vector env's info "
        "comes with a bool mask of the envs that have it"
    )


def merge_infos(parts: Sequence[tuple[int, Info]], num_envs: int) -> Info:
    """Merge per-worker vector-env info dicts into the one a single vector env would return.

    Each part is ``(env_offset, info)``: ``info`` is what a Gymnasium vector env over one
    worker's ``E`` envs returned (arrays with a leading axis of ``E`` and ``_key`` bool
    masks, object arrays for odd values and ``final_obs``, nested dicts for dict values), and
    ``env_offset`` is the global index of that worker's first env. The rules are those of
    ``gymnasium.vector.VectorEnv._add_info``: a key's dtype is chosen by the first env that
    has it (later values are cast into it), envs without the key hold zeros (``None`` in
    object arrays) and a ``False`` mask, and nested dicts merge recursively with their mask
    at the parent level. Key order is the order of first appearance.

    One difference cannot be undone: when envs give one key values of different types (an
    int in one env, a float in the next), each worker's vector env has already cast its
    values into its own first env's dtype, so a fraction that one vector env would have kept
    or dropped may differ. Gymnasium's rule is lossy there itself; give a key one type.

    Args:
        parts: ``(env_offset, info)`` per worker, in env order.
        num_envs: the total number of envs.

    Returns:
        A new info dict; its arrays are fresh and writable (elements of object arrays, such
        as ``final_obs`` observations, are shared with the parts, not copied).

    Workers that disagree on a key (a dict in one and an array in another, another per-env
    shape, a dtype that cannot be cast to the first's) cannot be merged as one vector env
    would, and none of them is wrong alone: that key becomes an object array holding each
    env's own value (a dict of its values where its worker sent a dict), ``None`` where an
    env has none, beside the usual mask.

    Raises:
        ProtocolError: a part is malformed: a value is neither an array with a leading axis
            of its ``E`` envs nor a dict, a mask is missing or not a bool array, or a
            worker's envs fall outside ``num_envs``.
    """
    result: Info = {}
    for _, info in parts:
        # Most steps of most envs carry no info at all: nothing to check or merge then.
        if type(info) is not dict or info:
            _merge_into(result, parts, num_envs, "info")
            break
    return result


def _merge_into(out: Info, parts: Sequence[tuple[int, Any]], num_envs: int, where: str) -> None:
    # First pass: check each part and collect, per data key, which parts carry it.
    order: dict[str, list[tuple[int, int, Any, Array]]] = {}
    for offset, info in parts:
        if not isinstance(info, dict):
            raise ProtocolError(f"{where} of the worker at env {offset} is not a dict")
        for key, value in info.items():
            mask_key = _mask_key(info, key, f"{where} of the worker at env {offset}")
            if mask_key is None:
                continue  # the mask of another key, handled with that key
            mask = info[mask_key]
            if not (isinstance(mask, np.ndarray) and mask.dtype == np.bool_ and mask.ndim == 1):
                raise ProtocolError(
                    f"{where}[{mask_key!r}] of the worker at env {offset} must be a 1-d bool "
                    f"array, got {_describe(mask)}"
                )
            count = mask.shape[0]
            if offset < 0 or offset + count > num_envs:
                raise ProtocolError(
                    f"{where}[{key!r}] covers envs {offset}..{offset + count - 1}, outside "
                    f"the {num_envs} envs"
                )
            if not isinstance(value, dict) and not (
                isinstance(value, np.ndarray) and value.ndim >= 1 and value.shape[0] == count
            ):
                raise ProtocolError(
                    f"{where}[{key!r}] of the worker at env {offset} must be a dict or an array "
                    f"with a leading axis of {count} envs, got {_describe(value)}"
                )
            order.setdefault(key, []).append((offset, count, value, mask))

    for key, carriers in order.items():
        mask_out = np.zeros(num_envs, dtype=np.bool_)
        for offset, count, _, mask in carriers:
            mask_out[offset : offset + count] = mask
        kinds = {isinstance(value, dict) for _, _, value, _ in carriers}
        if kinds == {True}:
            nested: Info = {}
            subparts = [(offset, value) for offset, _, value, _ in carriers]
            _merge_into(nested, subparts, num_envs, f"{where}[{key!r}]")
            out[key] = nested
        else:
            merged = None if len(kinds) > 1 else _merge_array(carriers, num_envs)
            # Workers that disagree on a key (a dict in one, an array in another, another
            # per-env shape, dtypes that do not cast) cannot be merged as one vector env's
            # would be, and no worker is wrong on its own: the key becomes an object array
            # of each env's own value, so nothing is lost and no worker is blamed.
            out[key] = merged if merged is not None else _per_env_values(carriers, num_envs)
        out["_" + key] = mask_out


def _merge_array(carriers: list[tuple[int, int, Any, Array]], num_envs: int) -> Array | None:
    """The workers' arrays of one key as one array.

    ``None`` where they disagree on its per-env shape or on a dtype one cannot be cast to.
    """
    # The first worker in which some env has the key chooses the dtype, as its first such
    # env would have in one vector env.
    first: Array = next((c[2] for c in carriers if c[3].any()), carriers[0][2])
    if first.dtype.hasobject and first.ndim == 1:
        # Gymnasium's object arrays ("final_obs", str or None values, numpy bools) start as
        # None; object arrays made from ndarray values start as 0, but a worker's own block
        # already holds its defaults, so only envs of workers without the key differ.
        out = np.full(num_envs, None, dtype=object)
    else:
        out = np.zeros((num_envs, *first.shape[1:]), dtype=first.dtype)
    for offset, count, value, mask in carriers:
        if value.shape[1:] != out.shape[1:]:
            return None
        block = out[offset : offset + count]
        try:
            if value.dtype == out.dtype:
                # The same dtype means the same defaults, so the whole block is copied at once.
                block[...] = value
            else:
                # Gymnasium casts each later value into the first env's dtype; only envs that
                # have the key are cast, the others keep this array's defaults.
                block[mask] = value[mask]
        except (TypeError, ValueError):
            return None
    return out


def _per_env_values(carriers: list[tuple[int, int, Any, Array]], num_envs: int) -> Array:
    """An object array of each env's own value of one key (``None`` where it has none)."""
    out = np.full(num_envs, None, dtype=object)
    for offset, count, value, mask in carriers:
        if isinstance(value, dict):
            # Only its top level was read so far: the split below walks all of it.
            check_info(value, count, f"info of the worker at env {offset}")
        for index in np.flatnonzero(mask[:count]):
            out[offset + index] = _env_value(value, int(index))
    return out


def _env_value(value: Any, index: int) -> Any:
    """Env ``index``'s own value in a worker's info value: an array's row, or a dict of them."""
    if not isinstance(value, dict):
        return value[index]
    own: dict[str, Any] = {}
    for key, item in value.items():
        mask_key = _mask_key(value, key, "info")
        if mask_key is not None and value[mask_key][index]:
            own[key] = _env_value(item, index)
    return own
