"""The hand-written msgpack writer of the codec's fast path for small messages.

A step's messages hold a few ints and small arrays, and msgpack reaches every array through
a Python ``default()`` that builds an ExtType: most of the cost of encoding them.
``aps.wire.codec._pack_small`` writes such a message directly instead, with the writers here:
ints, strs, bins, containers and object arrays as msgpack packs them (always the shortest
form), and array and scalar prefixes (ext header and array header) prepared once per dtype
and shape and cached.

The contract of every writer: the bytes are exactly those the codec's generic path (msgpack
with ``aps.wire.codec._default``) produces for the same value, and anything the writer does not
handle (a type it does not know, a subclass, a large or big-endian array, a value beyond
msgpack's limits) is refused with ``None`` or ``False``, never an error, so that the generic
path packs it or raises its own error.
"""

from __future__ import annotations

import struct
import typing
from collections.abc import Callable
from typing import Any

import numpy as np

from aps.wire._wire import (
    DTYPES,
    EXT_NDARRAY,
    EXT_OBJECT_ARRAY,
    EXT_SCALAR,
    MAX_NDIM,
    MAX_OBJECT_DEPTH,
    WIRE_NAME,
    array_header,
    ext_prefix,
    is_large,
)

# What aps.wire.codec (and aps.wire.compression) use; the module stays private by its file name.
__all__ = [
    "ATOM_KINDS",
    "PREFIXES",
    "array_prefix",
    "pack_atom",
    "pack_int",
    "pack_object_array",
    "pack_tree",
]


def pack_tree(value: Any, append: Callable[[bytes], Any], nesting: int, depth: int) -> bool:
    """Append the msgpack bytes of ``value`` as the generic path packs it; ``False``: refused.

    Writes exact ``dict`` (str keys), ``list``, ``tuple`` and object arrays holding values
    of the kinds :func:`aps.wire.codec._pack_small` writes, numpy scalars of a wire dtype, and
    more such containers. ``nesting`` counts the containers around ``value``, ``depth`` the
    object arrays (as :func:`aps.wire._trees.check_tree` counts them). Anything else returns
    ``False`` (with parts already appended: the caller drops them), so that the generic path
    packs it or raises its error: other types and subclasses, non-str keys, object arrays
    nested :data:`MAX_OBJECT_DEPTH` deep, large or big-endian arrays, ints beyond 64 bits.
    """
    kind = type(value)
    if kind is np.ndarray:
        if value.dtype.hasobject:
            return pack_object_array(value, append, nesting, depth)
        prefix = PREFIXES.get((value.dtype, value.shape))
        if prefix is None:
            prefix = array_prefix(value)
            if prefix is None:
                return False
        append(prefix)
        append(value.tobytes())
    elif kind is dict:
        if nesting >= _MAX_FAST_NESTING:
            return False
        head = _container_header(len(value), 0x80, 0xDE, 0xDF)
        if head is None:
            return False
        append(head)
        for key, item in value.items():
            if type(key) is not str:
                return False
            packed_key = _KEYS.get(key)
            if packed_key is None:
                packed_key = _pack_key(key)
                if packed_key is None:
                    return False
            append(packed_key)
            if not pack_tree(item, append, nesting + 1, depth):
                return False
    elif kind is list or kind is tuple:
        if nesting >= _MAX_FAST_NESTING:
            return False
        head = _container_header(len(value), 0x90, 0xDC, 0xDD)
        if head is None:
            return False
        append(head)
        for item in value:
            if not pack_tree(item, append, nesting + 1, depth):
                return False
    elif kind is int:
        packed = pack_int(value)
        if packed is None:
            return False
        append(packed)
    elif kind in ATOM_KINDS:
        return pack_atom(value, kind, append)
    else:
        prefix = _SCALAR_PREFIXES.get(kind)
        if prefix is None:
            return False
        append(prefix)
        append(value.tobytes())
    return True


def pack_atom(value: Any, kind: type, append: Callable[[bytes], Any]) -> bool:
    """Append ``None``, a ``bool``, ``float``, ``str`` or ``bytes`` as msgpack packs it.

    ``kind`` is ``type(value)``, one of :data:`ATOM_KINDS`. ``False``: refused (a str with
    lone surrogates, a length beyond 32 bits), nothing appended.
    """
    if value is None:
        append(b"\xc0")
    elif kind is bool:
        append(b"\xc3" if value else b"\xc2")
    elif kind is float:
        append(_FLOAT64.pack(0xCB, value))  # msgpack sends Python floats as float64
    elif kind is str:
        try:
            data = value.encode()
        except UnicodeEncodeError:  # lone surrogates: msgpack refuses them too
            return False
        size = len(data)
        head = _FIXSTR[size] if size < 32 else _length_header(size, 0xD9, 0xDA, 0xDB)
        if head is None:
            return False
        append(head)
        append(data)
    else:
        head = _length_header(len(value), 0xC4, 0xC5, 0xC6)
        if head is None:
            return False
        append(head)
        append(value)
    return True


ATOM_KINDS = frozenset({type(None), bool, float, str, bytes})
"""The kinds :func:`pack_atom` writes."""


def pack_object_array(
    array: np.ndarray[Any, Any], append: Callable[[bytes], Any], nesting: int, depth: int
) -> bool:
    """Append an object array as ``codec._ext_object_array`` packs it; ``False``: refused."""
    if array.dtype != _OBJECT or depth >= MAX_OBJECT_DEPTH or nesting >= _MAX_FAST_NESTING:
        return False  # a structured dtype, or too deep: the generic path's error
    shape = array.shape
    head = _OBJECT_HEADS.get(shape)
    if head is None:
        # [shape, [elements...]]: the shape's ints and the elements' count, as msgpack packs
        # the list [list(shape), list(elements)].
        ndim = _container_header(len(shape), 0x90, 0xDC, 0xDD)
        count = _container_header(array.size, 0x90, 0xDC, 0xDD)
        dims = [pack_int(dim) for dim in shape]
        if ndim is None or count is None or None in dims:
            return False
        head = b"".join([b"\x92", ndim, *typing.cast("list[bytes]", dims), count])
        if len(_OBJECT_HEADS) >= 4096:
            _OBJECT_HEADS.clear()
        _OBJECT_HEADS[shape] = head
    parts = [head]
    add = parts.append
    # An object array's flat iterator hands over its elements themselves, with no list made
    # of them; most of a final_obs is None (the envs that did not end).
    for item in array.flat:
        if item is None:
            add(b"\xc0")
        elif not pack_tree(item, add, nesting + 1, depth + 1):
            return False
    payload = b"".join(parts)
    size = len(payload)
    fixext = _FIXEXT.get(size)
    if fixext is not None:
        append(bytes((fixext, EXT_OBJECT_ARRAY)))
    elif size <= 0xFF:
        append(bytes((0xC7, size, EXT_OBJECT_ARRAY)))
    elif size <= 0xFFFF:
        append(_HEAD16.pack(0xC8, size) + _EXT_OBJECT_CODE)
    elif size <= 0xFFFFFFFF:
        append(_HEAD32.pack(0xC9, size) + _EXT_OBJECT_CODE)
    else:
        return False
    append(payload)
    return True


def _pack_key(key: str) -> bytes | None:
    """A map key as msgpack packs it, cached (keys repeat from step to step); ``None``: refused."""
    try:
        data = key.encode()
    except UnicodeEncodeError:
        return None
    size = len(data)
    head = _FIXSTR[size] if size < 32 else _length_header(size, 0xD9, 0xDA, 0xDB)
    if head is None:
        return None
    if len(_KEYS) >= 4096:  # bounded, as _wire._HEADERS
        _KEYS.clear()
    packed = _KEYS[key] = head + data
    return packed


def _container_header(size: int, fix: int, code16: int, code32: int) -> bytes | None:
    """The header msgpack writes before a map or array of ``size`` entries.

    ``fix`` is the fixmap or fixarray code, ``code16`` and ``code32`` those of the 16- and
    32-bit forms; ``None`` beyond 32 bits.
    """
    if size < 16:
        return _UINT8[fix | size]
    if size <= 0xFFFF:
        return _HEAD16.pack(code16, size)
    if size <= 0xFFFFFFFF:
        return _HEAD32.pack(code32, size)
    return None


def _scalar_prefixes() -> dict[type, bytes]:
    """Per numpy scalar type of a wire dtype: the bytes before its data.

    As ``aps.wire.codec._default`` packs it.
    """
    prefixes: dict[type, bytes] = {}
    for name in DTYPES:
        dtype = np.dtype(name)
        wire = WIRE_NAME.get(dtype)
        if wire is None:  # a big-endian host: its scalars take the generic path
            continue
        header = array_header(wire, ())
        length = len(header) + dtype.itemsize
        fixext = _FIXEXT.get(length)
        ext = bytes((fixext, EXT_SCALAR)) if fixext else bytes((0xC7, length, EXT_SCALAR))
        prefixes[dtype.type] = ext + header
    return prefixes


# Containers nested deeper than this take the generic path (msgpack's own limit is 511).
_MAX_FAST_NESTING = 32
_OBJECT_HEADS: dict[tuple[int, ...], bytes] = {}
_KEYS: dict[str, bytes] = {}
_EXT_OBJECT_CODE = bytes([EXT_OBJECT_ARRAY])
_OBJECT = np.dtype(object)


def _length_header(size: int, code8: int, code16: int, code32: int) -> bytes | None:
    """The header msgpack writes before a str or bin payload of ``size`` bytes.

    ``code8``, ``code16`` and ``code32`` are the type codes of its 8-, 16- and 32-bit length
    forms (a fixstr is the caller's); ``None`` beyond 32 bits.
    """
    if size <= 0xFF:
        return bytes((code8, size))
    if size <= 0xFFFF:
        return _HEAD16.pack(code16, size)
    if size <= 0xFFFFFFFF:
        return _HEAD32.pack(code32, size)
    return None


def pack_int(value: int) -> bytes | None:
    """An int as msgpack packs it (the shortest form), or ``None`` beyond 64 bits."""
    if value >= 0:
        if value <= 0x7F:
            return _UINT8[value]  # positive fixint
        if value <= 0xFF:
            return b"\xcc" + _UINT8[value]
        if value <= 0xFFFF:
            return _HEAD16.pack(0xCD, value)
        if value <= 0xFFFFFFFF:
            return _HEAD32.pack(0xCE, value)
        if value <= 0xFFFFFFFFFFFFFFFF:
            return _UINT64.pack(0xCF, value)
        return None
    if value >= -32:
        return _UINT8[value + 0x100]  # negative fixint, 0xe0 to 0xff
    if value >= -0x80:
        return b"\xd0" + _UINT8[value + 0x100]
    if value >= -0x8000:
        return _INT16.pack(0xD1, value)
    if value >= -0x80000000:
        return _INT32.pack(0xD2, value)
    if value >= -0x8000000000000000:
        return _INT64.pack(0xD3, value)
    return None


def array_prefix(array: np.ndarray[Any, Any]) -> bytes | None:
    """What precedes the data of ``array`` in a frame: the ext header and the array header.

    ``None`` for arrays the fast path leaves to the generic one: other dtypes (big-endian,
    object, unsupported ones, whose errors it raises), too many dimensions, large arrays.
    The result is cached per dtype and shape.
    """
    name = WIRE_NAME.get(array.dtype)
    if name is None or array.ndim > MAX_NDIM:
        return None
    header = array_header(name, array.shape)
    if is_large(header, array.nbytes):
        return None
    length = len(header) + array.nbytes
    # The ext header msgpack writes for a payload of this length: fixext where one fits.
    fixext = _FIXEXT.get(length)
    if fixext is not None:
        prefix = bytes([fixext, EXT_NDARRAY]) + header
    elif length <= 0xFF:
        prefix = bytes([0xC7, length, EXT_NDARRAY]) + header
    else:
        prefix = ext_prefix(length) + header
    if len(PREFIXES) >= 4096:  # as for _wire._HEADERS: few shapes in practice, bounded anyway
        PREFIXES.clear()
    PREFIXES[(array.dtype, array.shape)] = prefix
    return prefix


PREFIXES: dict[tuple[np.dtype[Any], tuple[int, ...]], bytes] = {}
_FIXEXT = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}
_UINT8 = [bytes([b]) for b in range(256)]
_FIXSTR = [bytes([0xA0 | size]) for size in range(32)]
_FLOAT64 = struct.Struct(">Bd")
_HEAD16 = struct.Struct(">BH")
_HEAD32 = struct.Struct(">BI")
_UINT64 = struct.Struct(">BQ")
_INT16 = struct.Struct(">Bh")
_INT32 = struct.Struct(">Bi")
_INT64 = struct.Struct(">Bq")
_SCALAR_PREFIXES = _scalar_prefixes()
