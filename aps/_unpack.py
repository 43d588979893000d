"""Decoding numpy values out of msgpack, and viewing large arrays in the frame without a copy.

The ext hooks here turn the codec's extension payloads back into numpy values: arrays (read-only
views of their payload), numpy scalars, and object arrays, nested at most
:data:`~aps._wire.MAX_OBJECT_DEPTH` deep, with one hook per depth so that decoding keeps no
shared mutable state. Every error is a :class:`~aps.errors.WireError`.

The second half is the zero-copy walk that :func:`aps.codec.decode` runs on a frame of more
than :data:`~aps._wire._LARGE_ARRAY` bytes, so that its large arrays are views of the frame
itself rather than of copies; the comment that opens it says how.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, Final

import msgpack
import numpy as np

from aps._wire import (
    _LARGE_ARRAY,
    _LONGEST_HEADER,
    EXT_COMPRESSED,
    EXT_NDARRAY,
    EXT_OBJECT_ARRAY,
    EXT_SCALAR,
    MAX_NDIM,
    MAX_OBJECT_DEPTH,
    MAX_PADDING,
    _data_offset,
    _parse_payload,
)
from aps.errors import WireError


def _unpack_array(data: bytes) -> np.ndarray[Any, Any]:
    # Most headers (with padding) are 8 or 16 bytes long; msgpack is prefix-free, so a prefix
    # equal to a header seen before parses the same way and the parse can be reused. Such a
    # header padded to a multiple of 8 is what the encoder writes for every array that is
    # unpacked here; other paddings take the long way.
    parsed = _PARSED.get(data[:8]) or _PARSED.get(data[:16])
    if parsed is not None:
        dtype, shape, offset, nbytes = parsed
        if nbytes != len(data) - offset:
            parsed = None
    if parsed is None:
        dtype, shape, end, nbytes = _parse_payload(data)
        offset = _data_offset(data, len(data), end, dtype, shape, nbytes)
        if offset == end + (-end % 8) and offset <= 16:
            if len(_PARSED) >= 4096:
                _PARSED.clear()
            _PARSED[data[:offset]] = (dtype, shape, offset, nbytes)
    try:
        # A read-only view of the payload, like np.frombuffer, in one call.
        return np.ndarray(shape, dtype, data, offset)
    except ValueError as exc:  # zero-size arrays with absurd dims pass the length check
        raise WireError(f"array of shape {shape} cannot be built: {exc}") from exc


_PARSED: dict[bytes, tuple[np.dtype[Any], tuple[int, ...], int, int]] = {}


def _str_keys(mapping: dict[Any, Any]) -> dict[Any, Any]:
    # strict_map_key lets bytes keys through as well; the encoder never sends them.
    for key in mapping:
        if type(key) is not str:
            raise WireError(f"map key {key!r:.80} is not a str; maps on the wire have str keys")
    return mapping


def _unpack_object_array(data: bytes, ext_hook: Callable[[int, bytes], Any]) -> Any:
    body = msgpack.unpackb(
        data, ext_hook=ext_hook, object_hook=_str_keys, use_list=False, raw=False
    )
    if not (type(body) is tuple and len(body) == 2 and type(body[1]) is tuple):
        raise WireError("object array must be [shape, [elements]]")
    shape, elements = body
    if not (
        type(shape) is tuple
        and len(shape) <= MAX_NDIM
        and all(type(d) is int and d >= 0 for d in shape)
    ):
        raise WireError(f"object array shape must be at most {MAX_NDIM} non-negative ints")
    count = 1
    for dim in shape:
        count *= dim
    if count != len(elements):
        raise WireError(
            f"object array of shape {shape} needs {count} elements, got {len(elements)}"
        )
    # fromiter stores each element as is; np.array() would try to broadcast sequences.
    array = np.fromiter(elements, dtype=object, count=count).reshape(shape)
    array.flags.writeable = False
    return array


def _make_ext_hook(
    depth: int, inflate: Callable[[bytes], np.ndarray[Any, Any]] | None = None
) -> Callable[[int, bytes], Any]:
    """The ext hook for values nested ``depth`` object arrays deep.

    ``inflate`` turns the payload of a compressed array into the array (see
    :func:`aps.compression.inflater`); without it a compressed array is refused. A hook
    with it is made per frame (it counts what the frame inflated), the nested ones on use.
    """

    def ext_hook(code: int, data: bytes) -> Any:
        if code == EXT_NDARRAY:
            return _unpack_array(data)
        if code == EXT_SCALAR:
            array = _unpack_array(data)
            if array.ndim != 0:
                raise WireError(f"numpy scalar must have shape (), got {array.shape}")
            return array[()]
        if code == EXT_OBJECT_ARRAY:
            if depth >= MAX_OBJECT_DEPTH:
                raise WireError(f"object arrays nest deeper than {MAX_OBJECT_DEPTH} levels")
            inner = _EXT_HOOKS[depth + 1] if inflate is None else _make_ext_hook(depth + 1, inflate)
            return _unpack_object_array(data, inner)
        if code == EXT_COMPRESSED:
            if inflate is None:
                raise WireError(
                    "compressed array on a connection that negotiated no compression; the "
                    "peer is not a compatible aps peer"
                )
            return inflate(data)
        raise WireError(
            f"unknown msgpack extension code {code}; known: {EXT_NDARRAY} (array), "
            f"{EXT_SCALAR} (numpy scalar), {EXT_OBJECT_ARRAY} (object array), "
            f"{EXT_COMPRESSED} (compressed array)"
        )

    return ext_hook


# One hook per object-array depth, so the depth needs no shared mutable state: decoding is
# safe from many threads, and the bounded depth bounds the C stack msgpack uses per level.
_EXT_HOOKS = [_make_ext_hook(depth) for depth in range(MAX_OBJECT_DEPTH + 1)]
_TOP_HOOK = _EXT_HOOKS[0]


# --------------------------------------------------------------------------------------------
# Large arrays without a copy. msgpack hands every ext payload to ext_hook as a new bytes
# object, so an array decoded the ordinary way is a view of a copy. For a frame holding large
# arrays, decode() first walks the msgpack structure (a cheap scan of headers, in Python),
# and unpacks a copy of the frame in which each large array's ext is replaced by a 6-byte
# reference; ext_hook turns each reference into a view of the frame itself.

_EXT_REFERENCE: Final = 127
"""Extension code of a reference to a large array of the frame being decoded. It exists only
inside decode(): a frame that holds it is refused, like any unknown code."""

_REFERENCE = struct.Struct(">BbI")  # fixext 4, the code, the index of the array

# The walk gives up (and the frame is unpacked the ordinary way) after this many objects: a
# frame with large arrays has few objects, and the scan must stay cheap for the others.
_MAX_SCAN_OBJECTS = 4096

# The longest array header with its padding.
_MAX_ARRAY_HEADER = _LONGEST_HEADER + MAX_PADDING


def _large_arrays(frame: bytes) -> list[tuple[int, int, int]] | None:
    """Find the large arrays of a frame: ``(ext start, payload start, payload length)``.

    Returns ``None`` when there are none, when the frame is not exactly one well-formed
    msgpack object, or when it holds too many objects to scan; decode() then unpacks it the
    ordinary way, which also produces the proper error for a malformed frame.
    """
    size = len(frame)
    found: list[tuple[int, int, int]] = []
    pos = 0
    remaining = 1  # objects still to read; a container adds its elements
    for _ in range(_MAX_SCAN_OBJECTS):
        if pos >= size:
            return None
        b = frame[pos]
        if b <= 0x7F or b >= 0xE0 or b in (0xC0, 0xC2, 0xC3):  # fixint, nil, bool
            pos += 1
        elif b <= 0x8F:  # fixmap
            remaining += 2 * (b & 0x0F)
            pos += 1
        elif b <= 0x9F:  # fixarray
            remaining += b & 0x0F
            pos += 1
        elif b <= 0xBF:  # fixstr
            pos += 1 + (b & 0x1F)
        elif b in (0xCA, 0xCB):  # float32, float64
            pos += 5 if b == 0xCA else 9
        elif 0xCC <= b <= 0xD3:  # uint8..uint64, int8..int64
            pos += 1 + (1 << ((b - 0xCC) % 4))
        elif 0xD4 <= b <= 0xD8:  # fixext 1..16
            if pos + 1 >= size or frame[pos + 1] == _EXT_REFERENCE:
                return None
            pos += 2 + (1 << (b - 0xD4))
        else:
            width = _LENGTH_WIDTH.get(b)
            if width is None or pos + 1 + width > size:  # 0xC1 (never used), or truncated
                return None
            count = int.from_bytes(frame[pos + 1 : pos + 1 + width], "big")
            pos += 1 + width
            if b in (0xDC, 0xDD):  # array16, array32
                remaining += count
            elif b in (0xDE, 0xDF):  # map16, map32
                remaining += 2 * count
            elif b in (0xC7, 0xC8, 0xC9):  # ext8, ext16, ext32: a type byte, then the payload
                if pos >= size or frame[pos] == _EXT_REFERENCE:
                    return None
                if frame[pos] == EXT_NDARRAY and count >= _LARGE_ARRAY:
                    found.append((pos - 1 - width, pos + 1, count))
                pos += 1 + count
            else:  # bin, str: the payload
                pos += count
        remaining -= 1
        if remaining == 0:
            return found if found and pos == size else None
    return None


# The width of the length field that follows these type bytes (bin, ext, str, array, map).
_LENGTH_WIDTH = {
    0xC4: 1, 0xC5: 2, 0xC6: 4,  # bin
    0xC7: 1, 0xC8: 2, 0xC9: 4,  # ext
    0xD9: 1, 0xDA: 2, 0xDB: 4,  # str
    0xDC: 2, 0xDD: 4,  # array
    0xDE: 2, 0xDF: 4,  # map
}  # fmt: skip


def _with_references(frame: bytes, found: list[tuple[int, int, int]]) -> bytes:
    """A copy of ``frame`` with each large array's ext replaced by a reference to it."""
    parts: list[bytes | memoryview] = []
    done = 0
    with memoryview(frame) as view:
        for index, (start, payload, length) in enumerate(found):
            parts.append(view[done:start])
            parts.append(_REFERENCE.pack(0xD6, _EXT_REFERENCE, index))
            done = payload + length
        parts.append(view[done:])
        return b"".join(parts)


def _reference_hook(
    frame: bytes, found: list[tuple[int, int, int]], base: Callable[[int, bytes], Any] = _TOP_HOOK
) -> Callable[[int, bytes], Any]:
    def ext_hook(code: int, data: bytes) -> Any:
        if code != _EXT_REFERENCE:
            return base(code, data)
        _, payload, length = found[int.from_bytes(data, "big")]
        return _view_array(frame, payload, length)

    return ext_hook


def _view_array(frame: bytes, start: int, length: int) -> np.ndarray[Any, Any]:
    """The array whose ext payload is ``frame[start : start + length]``, as a view of it."""
    head = frame[start : start + min(length, _MAX_ARRAY_HEADER)]
    dtype, shape, end, nbytes = _parse_payload(head)
    offset = _data_offset(head, length, end, dtype, shape, nbytes)
    try:
        return np.ndarray(shape, dtype, frame, start + offset)
    except ValueError as exc:  # zero-size arrays with absurd dims pass the length check
        raise WireError(f"array of shape {shape} cannot be built: {exc}") from exc
