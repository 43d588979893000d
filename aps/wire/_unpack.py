"""Decoding numpy values out of msgpack, and viewing large arrays in the frame without a copy.

The ext hooks here turn the codec's extension payloads back into numpy values: arrays (read-only
views of their payload), numpy scalars, and object arrays, nested at most
:data:`~aps.wire._wire.MAX_OBJECT_DEPTH` deep, with one hook per depth so that decoding keeps no
shared mutable state. Every error is a :class:`~aps.errors.WireError`.

The second half is the zero-copy walk that :func:`aps.wire.codec.decode` runs on a frame of more
than :data:`~aps.wire._wire.LARGE_ARRAY` bytes, so that its large arrays are views of the frame
itself rather than of copies; the comment that opens it says how.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from typing import Any, Final

import msgpack
import numpy as np

from aps.errors import WireError
from aps.wire._wire import (
    EXT_COMPRESSED,
    EXT_FRAME_DELTA,
    EXT_NDARRAY,
    EXT_OBJECT_ARRAY,
    EXT_SCALAR,
    LARGE_ARRAY,
    LONGEST_HEADER,
    MAX_NDIM,
    MAX_OBJECT_DEPTH,
    MAX_PADDING,
    data_offset,
    parse_payload,
)

# What aps.wire.codec (and aps.wire.compression) use; the module stays private by its file name.
__all__ = [
    "DECODE_FLOOR",
    "DECODE_RATIO",
    "SCAN_FROM",
    "TOP_HOOK",
    "decode_budget",
    "make_ext_hook",
    "reference_hook",
    "scan",
    "str_keys",
    "with_references",
]


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
        dtype, shape, end, nbytes = parse_payload(data)
        offset = data_offset(data, len(data), end, dtype, shape, nbytes)
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


def str_keys(pairs: list[tuple[Any, Any]] | tuple[tuple[Any, Any], ...]) -> dict[Any, Any]:
    """The map msgpack read as ``pairs`` (its ``object_pairs_hook``), its keys checked.

    Raises:
        WireError: a key that is not a str (``strict_map_key`` lets bytes through; the
            encoder never sends them), or a key the map holds twice: msgpack would keep the
            last value silently, after decoding (and inflating) every one.
    """
    mapping = dict(pairs)
    if len(mapping) != len(pairs):
        seen: set[Any] = set()
        for key, _ in pairs:
            if key in seen:
                raise WireError(
                    f"map holds the key {key!r:.80} more than once; an aps peer never sends "
                    "a key twice"
                )
            seen.add(key)
    for key in mapping:
        if type(key) is not str:
            raise WireError(f"map key {key!r:.80} is not a str; maps on the wire have str keys")
    return mapping


def _unpack_object_array(data: bytes, ext_hook: Callable[[int, bytes], Any]) -> Any:
    body = msgpack.unpackb(
        data, ext_hook=ext_hook, object_pairs_hook=str_keys, use_list=False, raw=False
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


def make_ext_hook(
    depth: int,
    inflate: Callable[[bytes], np.ndarray[Any, Any]] | None = None,
    rebuild: Callable[[bytes], Any] | None = None,
) -> Callable[[int, bytes], Any]:
    """The ext hook for values nested ``depth`` object arrays deep.

    ``inflate`` turns the payload of a compressed array into the array (see
    :func:`aps.wire.compression.inflater`), ``rebuild`` that of a frame-delta array (see
    :func:`aps.wire.frame_delta.unpacker`: a placeholder the codec rebuilds once it knows where
    it is); without them such arrays are refused. Either may itself refuse the array. A hook with
    either is made per frame (they count what the frame inflated), the nested ones on use.
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
            inner = (
                _EXT_HOOKS[depth + 1]
                if inflate is None and rebuild is None
                else make_ext_hook(depth + 1, inflate, rebuild)
            )
            return _unpack_object_array(data, inner)
        if code == EXT_COMPRESSED:
            if inflate is None:
                raise WireError(
                    "compressed array on a connection that negotiated no compression; the "
                    "peer is not a compatible aps peer"
                )
            return inflate(data)
        if code == EXT_FRAME_DELTA:
            if rebuild is None:
                raise WireError(
                    "frame-delta array on a connection that did not negotiate frame delta; "
                    "the peer is not a compatible aps peer"
                )
            return rebuild(data)
        raise WireError(
            f"unknown msgpack extension code {code}; known: {EXT_NDARRAY} (array), "
            f"{EXT_SCALAR} (numpy scalar), {EXT_OBJECT_ARRAY} (object array), "
            f"{EXT_COMPRESSED} (compressed array), {EXT_FRAME_DELTA} (frame-delta array)"
        )

    return ext_hook


# One hook per object-array depth, so the depth needs no shared mutable state: decoding is
# safe from many threads, and the bounded depth bounds the C stack msgpack uses per level.
_EXT_HOOKS = [make_ext_hook(depth) for depth in range(MAX_OBJECT_DEPTH + 1)]
TOP_HOOK = _EXT_HOOKS[0]


# --------------------------------------------------------------------------------------------
# What a decode costs. msgpack builds one Python object per msgpack object, and a small object
# costs far more memory than its bytes on the wire: an empty map is 1 byte and a 64-byte dict,
# a one-element array ext about 20 bytes and 300 in numpy. Before a frame of more than
# SCAN_FROM bytes is unpacked, scan walks its structure (a cheap scan of headers, in Python)
# and charges each object an upper bound of what unpacking it allocates; a frame whose charge
# passes decode_budget(size) is refused before msgpack builds anything. A smaller frame cannot
# cost more than SCAN_FROM times the worst amplification (about 100x), within the floor.
#
# The same walk finds the frame's large arrays. msgpack hands every ext payload to ext_hook as a
# new bytes object, so an array decoded the ordinary way is a view of a copy; decode() instead
# unpacks a copy of the frame in which each large array's ext is replaced by a 6-byte
# reference, and ext_hook turns each reference into a view of the frame itself.

DECODE_FLOOR: Final = 2**20
"""Bytes any frame may cost to decode, whatever its size (see :func:`decode_budget`)."""

DECODE_RATIO: Final = 2
"""Bytes a frame may cost to decode per byte of frame, above :data:`DECODE_FLOOR`."""


def decode_budget(size: int) -> int:
    """The most bytes decoding a frame of ``size`` bytes may allocate, by the scan's account.

    The account is an upper bound of what msgpack, numpy and the message checks allocate
    (measured with :mod:`tracemalloc`), so a frame within the budget costs less than
    ``DECODE_RATIO * size + DECODE_FLOOR`` bytes: under 3x its size for any frame of a few
    MiB or more, whatever its structure.
    """
    return DECODE_RATIO * size + DECODE_FLOOR


SCAN_FROM = DECODE_FLOOR // 128

# Upper bounds of the bytes unpacking allocates per object, on top of the bytes its payload
# copies (str, bin and ext payloads are copied once, an object array's elements once more).
_SLOT = 18  # the pointer in the list msgpack fills, and in the tuple it becomes
_NUMBER = _SLOT + 32  # an int or float object (small ints and None, True, False are shared)
_STRING = _SLOT + 64  # a str or bytes object's header
_ARRAY = _SLOT + 64  # a tuple's and its list's headers; the items are charged on their own
_MAP = _SLOT + 240  # a dict with room for a few entries
_ENTRY = 104  # a dict's slots and index per entry, doubled while the dict grows
_EXT = _SLOT + 288  # a numpy array and its dims, or an object array and its elements' list

_REFERENCE_CODE: Final = 127
"""Extension code of a reference to a large array of the frame being decoded. It exists only
inside decode(): a frame that holds it is refused, like any unknown code."""

_REFERENCE = struct.Struct(">BbI")  # fixext 4, the code, the index of the array

# The longest array header with its padding.
_MAX_ARRAY_HEADER = LONGEST_HEADER + MAX_PADDING


def scan(frame: Any, size: int, find_large: bool) -> list[tuple[int, int, int]]:
    """Charge ``frame``'s objects against the decode budget; find its large arrays.

    Returns the large arrays to view in place, ``(ext start, payload start, payload
    length)``, when ``find_large`` and the frame is exactly one well-formed msgpack object
    with at least one; else ``[]`` (a malformed frame is left to msgpack, which refuses it at
    the same place this walk stops, having built no more than the walk charged).

    Raises:
        WireError: the frame would cost more than :func:`decode_budget` to decode.
    """
    budget = decode_budget(size)
    found: list[tuple[int, int, int]] = []
    charged = _walk(frame, 0, size, budget, 0, found if find_large else None)
    if found:
        # decode() unpacks a copy of the frame without the large arrays' payloads.
        charged += size - sum(length for _, _, length in found)
    if charged > budget:
        raise WireError(
            f"frame of {size} bytes would take at least {charged} bytes to decode, more than "
            f"its limit of {budget} bytes ({DECODE_RATIO}x the frame plus {DECODE_FLOOR}): it "
            "holds too many small objects for its size; a sender packs many values into "
            "fewer, larger numpy arrays"
        )
    return found


def _walk(
    frame: Any,
    pos: int,
    end: int,
    budget: int,
    depth: int,
    found: list[tuple[int, int, int]] | None,
) -> int:
    """Charge the one msgpack object at ``frame[pos:end]``, and what it holds; return it.

    The walk stops as soon as the charge passes ``budget`` (the caller refuses the frame).
    Large arrays are recorded in ``found`` (when given); a malformed object stops the walk,
    and ``found`` is then cleared so that decode() unpacks the frame the ordinary way.
    """
    step, add, cost = _STEP, _ADD, _COST
    charged = 0
    remaining = 1  # objects still to read; a container adds its elements
    while remaining and charged <= budget and pos < end:
        b = frame[pos]
        if b in _ONE_BYTE and pos + 1 < end and frame[pos + 1] in _ONE_BYTE:
            # A run of one-byte objects (small ints, nil, bools, empty containers and strs)
            # is charged at C speed: it is what a frame of many tiny objects is made of.
            run = _RUN.match(frame, pos, min(end, pos + remaining))
            if run is not None:
                stop = run.end()
                empty_maps = frame.count(b"\x80", pos, stop)
                empty_arrays = frame.count(b"\x90", pos, stop)
                empty_strs = frame.count(b"\xa0", pos, stop)
                charged += (
                    _SLOT * (stop - pos - empty_maps - empty_arrays - empty_strs)
                    + _MAP * empty_maps
                    + _ARRAY * empty_arrays
                    + _STRING * empty_strs
                )
                remaining -= stop - pos
                pos = stop
                continue
        size = step[b]
        if size:  # a header of known size, and its payload if it has one
            pos += size
            remaining += add[b] - 1
            charged += cost[b]
            continue
        remaining -= 1
        if 0xD4 <= b <= 0xD8:  # fixext 1..16
            length = 1 << (b - 0xD4)
            if pos + 1 < end and frame[pos + 1] in _PLAIN_EXT:
                charged += _EXT + length
            else:
                charged += _ext(frame, pos + 1, length, end, budget - charged, depth)
            pos += 2 + length
            continue
        width = _LENGTH_WIDTH.get(b)
        if width is None or pos + 1 + width > end:  # 0xC1 (never used), or truncated
            break
        if width == 1:
            count = frame[pos + 1]
        elif width == 2:
            count = frame[pos + 1] << 8 | frame[pos + 2]
        else:
            count = int.from_bytes(frame[pos + 1 : pos + 5], "big")
        pos += 1 + width
        if b in (0xDC, 0xDD):  # array16, array32
            remaining += count
            charged += _ARRAY
        elif b in (0xDE, 0xDF):  # map16, map32
            remaining += 2 * count
            charged += _MAP + _ENTRY * count
        elif b in (0xC7, 0xC8, 0xC9):  # ext8, ext16, ext32: a type byte, then the payload
            if pos >= end:
                break
            if (
                found is not None
                and frame[pos] == EXT_NDARRAY
                and count >= LARGE_ARRAY
                and pos + 1 + count <= end
            ):
                found.append((pos - 1 - width, pos + 1, count))
                charged += _EXT  # viewed in the frame, not copied
            elif frame[pos] in _PLAIN_EXT:
                charged += _EXT + count
            else:
                charged += _ext(frame, pos, count, end, budget - charged, depth)
            pos += 1 + count
        else:  # bin, str: the payload
            charged += _STRING + count
            pos += count
    if found and (remaining or pos != end):
        found.clear()  # malformed: msgpack says how, from the frame itself
    return charged


def _tables() -> tuple[list[int], list[int], list[int]]:
    """Tables by the first byte of a msgpack object: its size, elements added, charge.

    The size includes the payload; it is 0 where the byte does not tell it (ext, and the
    types whose length follows).
    """
    step, add, cost = [0] * 256, [0] * 256, [0] * 256
    for b in range(256):
        if b <= 0x7F or b >= 0xE0 or b in (0xC0, 0xC2, 0xC3):  # fixint, nil, bool
            step[b], cost[b] = 1, _SLOT
        elif b <= 0x8F:  # fixmap
            step[b], add[b], cost[b] = 1, 2 * (b & 0x0F), _MAP + _ENTRY * (b & 0x0F)
        elif b <= 0x9F:  # fixarray
            step[b], add[b], cost[b] = 1, b & 0x0F, _ARRAY
        elif b <= 0xBF:  # fixstr
            step[b], cost[b] = 1 + (b & 0x1F), _STRING + (b & 0x1F)
        elif b in (0xCA, 0xCB):  # float32, float64
            step[b], cost[b] = 5 if b == 0xCA else 9, _NUMBER
        elif 0xCC <= b <= 0xD3:  # uint8..uint64, int8..int64
            step[b], cost[b] = 1 + (1 << ((b - 0xCC) % 4)), _NUMBER
    return step, add, cost


_STEP, _ADD, _COST = _tables()
# Exts charged without a look inside: arrays, scalars, and codes the ext hook refuses.
_PLAIN_EXT = frozenset(range(256)) - {EXT_OBJECT_ARRAY, _REFERENCE_CODE}
_ONE_BYTE = frozenset([*range(0x80), *range(0xE0, 0x100), 0xC0, 0xC2, 0xC3, 0x80, 0x90, 0xA0])
_RUN = re.compile(rb"[\x00-\x7f\x80\x90\xa0\xc0\xc2\xc3\xe0-\xff]{2,}")


def _ext(frame: Any, code_at: int, length: int, end: int, budget: int, depth: int) -> int:
    """The charge of the ext whose type byte is at ``code_at``, its payload copied."""
    if code_at >= end:
        return 0
    charged = _EXT + length
    if frame[code_at] == _REFERENCE_CODE:
        raise WireError(
            f"unknown msgpack extension code {_REFERENCE_CODE}; known: {EXT_NDARRAY} (array), "
            f"{EXT_SCALAR} (numpy scalar), {EXT_OBJECT_ARRAY} (object array)"
        )
    if frame[code_at] == EXT_OBJECT_ARRAY and depth < MAX_OBJECT_DEPTH:
        # Its elements are unpacked from the copy of the payload: charge them too.
        start = code_at + 1
        charged += _walk(frame, start, min(start + length, end), budget - charged, depth + 1, None)
    return charged


# The width of the length field that follows these type bytes (bin, ext, str, array, map).
_LENGTH_WIDTH = {
    0xC4: 1, 0xC5: 2, 0xC6: 4,  # bin
    0xC7: 1, 0xC8: 2, 0xC9: 4,  # ext
    0xD9: 1, 0xDA: 2, 0xDB: 4,  # str
    0xDC: 2, 0xDD: 4,  # array
    0xDE: 2, 0xDF: 4,  # map
}  # fmt: skip


def with_references(frame: bytes, found: list[tuple[int, int, int]]) -> bytes:
    """A copy of ``frame`` with each large array's ext replaced by a reference to it."""
    parts: list[bytes | memoryview] = []
    done = 0
    with memoryview(frame) as view:
        for index, (start, payload, length) in enumerate(found):
            parts.append(view[done:start])
            parts.append(_REFERENCE.pack(0xD6, _REFERENCE_CODE, index))
            done = payload + length
        parts.append(view[done:])
        return b"".join(parts)


def reference_hook(
    frame: bytes, found: list[tuple[int, int, int]], base: Callable[[int, bytes], Any] = TOP_HOOK
) -> Callable[[int, bytes], Any]:
    def ext_hook(code: int, data: bytes) -> Any:
        if code != _REFERENCE_CODE:
            return base(code, data)
        _, payload, length = found[int.from_bytes(data, "big")]
        return _view_array(frame, payload, length)

    return ext_hook


def _view_array(frame: bytes, start: int, length: int) -> np.ndarray[Any, Any]:
    """The array whose ext payload is ``frame[start : start + length]``, as a view of it."""
    head = frame[start : start + min(length, _MAX_ARRAY_HEADER)]
    dtype, shape, end, nbytes = parse_payload(head)
    offset = data_offset(head, length, end, dtype, shape, nbytes)
    try:
        return np.ndarray(shape, dtype, frame, start + offset)
    except ValueError as exc:  # zero-size arrays with absurd dims pass the length check
        raise WireError(f"array of shape {shape} cannot be built: {exc}") from exc
