"""Trees of values in messages: the checks and walks the codec applies to nested fields.

What msgpack would pack but a peer would refuse (non-str keys, nesting past
:data:`~aps.wire._wire.MAX_OBJECT_DEPTH`), whether a value is an array tree (a structured
observation), a map over a tree's leaves, and the frame-delta leaves of a chunk's ``obs``.
Part of :mod:`aps.wire.codec`, which assembles them; nothing here imports it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from aps.errors import WireError
from aps.wire import frame_delta
from aps.wire._wire import DTYPES, MAX_OBJECT_DEPTH


class PathError(WireError):
    """A bad value deep in a tree; the path to it is collected while the error unwinds."""

    def __init__(self, problem: str) -> None:
        self.problem = problem
        self.path: list[str] = []
        super().__init__(problem)


# Values whose subtree needs no walk: plain scalars and numpy scalars of wire dtypes.
LEAVES = frozenset(
    [type(None), bool, int, float, str, bytes, *(np.dtype(name).type for name in DTYPES)]
)


def check_tree(value: Any, depth: int) -> None:
    """Refuse what msgpack would pack but the peer would refuse: non-str keys, deep nesting.

    Only containers are walked; the inline tests skip leaves and numeric arrays without a
    call, which matters for object arrays such as ``final_obs`` (one element per env).
    """
    if type(value) is np.ndarray:
        if value.dtype.hasobject:
            if depth >= MAX_OBJECT_DEPTH:
                raise PathError(
                    f"object arrays nest deeper than {MAX_OBJECT_DEPTH} levels; flatten the value"
                )
            for index, item in enumerate(value.flat):
                kind = type(item)
                if kind in LEAVES or (kind is np.ndarray and not item.dtype.hasobject):
                    continue
                try:
                    check_tree(item, depth + 1)
                except PathError as exc:
                    exc.path.append(f"[{index}]")
                    raise
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if type(key) is not str:
                raise PathError(
                    f"has the map key {key!r} of type {type(key).__name__}; only str keys "
                    "travel; convert the keys with str()"
                )
            kind = type(item)
            if kind in LEAVES or (kind is np.ndarray and not item.dtype.hasobject):
                continue
            try:
                check_tree(item, depth)
            except PathError as exc:
                exc.path.append(f"[{key!r}]")
                raise
    elif isinstance(value, tuple | list):
        for index, item in enumerate(value):
            kind = type(item)
            if kind in LEAVES or (kind is np.ndarray and not item.dtype.hasobject):
                continue
            try:
                check_tree(item, depth)
            except PathError as exc:
                exc.path.append(f"[{index}]")
                raise


def is_array_tree(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is an :data:`~aps._base._typing.ArrayTree`.

    A numeric array, or dicts and tuples of them nested at most :data:`MAX_OBJECT_DEPTH` levels.
    """
    kind = type(value)
    if kind is np.ndarray:
        return not value.dtype.hasobject
    if depth >= MAX_OBJECT_DEPTH:
        return False
    if kind is dict:
        return all(
            type(key) is str and is_array_tree(item, depth + 1) for key, item in value.items()
        )
    if kind is tuple:
        return all(is_array_tree(item, depth + 1) for item in value)
    return False


def split_leaves(obs: Any) -> Any:
    """``obs`` (a dict or tuple of arrays) with each frame stack in it as a Delta, or ``None``.

    ``None`` when none of its arrays is a frame stack (see :func:`aps.wire.frame_delta.split`).
    """
    found = False

    def split(array: Any) -> Any:
        nonlocal found
        delta = frame_delta.split(array)
        found = found or delta is not None
        return array if delta is None else delta

    tree = map_tree(split, obs, 0)
    return tree if found else None


def map_tree(function: Callable[[Any], Any], value: Any, depth: int) -> Any:
    """Apply ``function`` to each leaf of dicts and tuples nested at most MAX_OBJECT_DEPTH deep.

    Deeper containers are handed to ``function`` whole, for the field's check to refuse.
    """
    if depth < MAX_OBJECT_DEPTH:
        if type(value) is dict:
            return {key: map_tree(function, item, depth + 1) for key, item in value.items()}
        if type(value) is tuple:
            return tuple(map_tree(function, item, depth + 1) for item in value)
    return function(value)


def pending_leaves(obs: Any) -> list[frame_delta.Pending]:
    """The frame-delta placeholders at the leaves of a decoded chunk's ``obs``.

    In the order msgpack decoded them: depth first, as the tree is laid out in the frame.
    """
    found: list[frame_delta.Pending] = []

    def visit(leaf: Any) -> Any:
        if type(leaf) is frame_delta.Pending:
            found.append(leaf)
        return leaf

    map_tree(visit, obs, 0)
    return found


def rebuilt(leaf: Any) -> Any:
    return leaf.rebuild() if type(leaf) is frame_delta.Pending else leaf
