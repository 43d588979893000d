"""Decoding a small frame laid out like one decoded before, without msgpack.

A DETACH worker streams :class:`~aps.wire.messages.RolloutChunk` messages of the same arrays
over and over: frame after frame, every byte is the same but the arrays' data, the ints'
values and the ``timings`` bytes. Unpacking such a frame with msgpack costs a Python call and
a copy per array, and checking the map it makes costs as much again (about 15 us of a small
chunk's decode, 13 arrays). So :func:`learn` records, for a frame that the codec decoded and
checked in full, a :class:`Layout`: the frame's bytes with those values left out, as one
regular expression, and where each value sits. :func:`recognize` gives the message of a frame
that matches a known layout byte for byte outside those values.

Why that is the full decode: msgpack reads a frame from its bytes alone, and the bytes that
tell it what is where (the map, its keys, each value's type and length, each array's
extension code and header, that is its dtype, shape and padding) are the layout's own, those
of a frame that passed every check. What may differ is what no check looks at as structure:
an array's data (any bytes are values of its dtype), an int's value within the same width
(every value of that width is an int; the learner checks ranges on the message, as for any
frame), and a bytes value of the same length. So a matching frame's message is the one
msgpack and the codec's checks would make of it: each field has the layout frame's type,
each array its dtype and shape, read-only over a copy of its data, as decoding copies it. A
frame that matches no layout takes the full decode, which names what is wrong.

Only frames of :data:`LEARNED` message types are learned, when they hold nothing but arrays,
ints, bytes, ``None`` and bools (a recurrent chunk's state list, a structured space's dict of
observations take the full decode every time). Learning a layout costs about a millisecond
(a walk of the frame, then compiling its expression and its reader), so at most one is
learned per :data:`LEARN_EVERY` frames of those types decoded in full, and at most
:data:`MAX_LAYOUTS` are kept: a peer that sends ever new layouts, or chunks whose layouts
outnumber them, costs a few microseconds more per frame than the full decode, never memory.
Layouts are facts about bytes, shared by all connections; decoding stays safe from many
threads (a layout is never changed once made, only added or forgotten).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any, Final, NamedTuple

import msgpack
import numpy as np

from aps.errors import WireError
from aps.wire._unpack import TOP_HOOK, str_keys
from aps.wire._wire import EXT_NDARRAY
from aps.wire.messages import Message, RolloutChunk

__all__ = ["LEARNED", "LEARN_EVERY", "MAX_LAYOUTS", "Layout", "learn", "recognize"]

LEARNED: Final = frozenset({RolloutChunk.TAG})
"""The tags of the message types whose frames are learned: what a worker streams."""

MAX_LAYOUTS: Final = 64
"""Layouts kept at most; learning one more forgets them all (they are learned again)."""

LEARN_EVERY: Final = 256
"""At most one layout is learned per this many frames of :data:`LEARNED` types decoded in
full (the first at once): learning costs about as much as 50 full decodes of a small chunk."""

# How a value is read from a frame that matches its layout (see _reader).
_ARRAY, _INT, _SIGNED, _FIXINT, _BYTES, _CONSTANT = range(6)

# Where an extension's code is, after its first byte: fixext 1..16, ext 8, 16, 32.
_CODE_AT = {0xD4: 1, 0xD5: 1, 0xD6: 1, 0xD7: 1, 0xD8: 1, 0xC7: 2, 0xC8: 3, 0xC9: 5}

# The widths of msgpack's ints after their type byte: uint8..uint64, int8..int64.
_INT_WIDTHS = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}


class Layout(NamedTuple):
    """The frames that decode as one known frame did, but for their values' bytes."""

    pattern: re.Pattern[bytes]
    """Matches (``fullmatch``) exactly the frames of this layout."""
    read: Callable[[bytes], Message]
    """The message of a frame that matches (see :func:`_reader`)."""


_LAYOUTS: dict[int, list[Layout]] = {}  # by frame size
_unlearned = LEARN_EVERY  # frames decoded in full since a layout was last looked for


def recognize(frame: bytes) -> Message | None:
    """The message of ``frame`` if it has a known layout, else ``None`` (decode it in full)."""
    layouts = _LAYOUTS.get(len(frame))
    if layouts is None:
        return None
    for layout in layouts:
        if layout.pattern.fullmatch(frame) is not None:
            return layout.read(frame)
    return None


def learn(frame: bytes, message: Message) -> None:
    """Keep the layout of ``frame``, which decoded as ``message`` with every check passed.

    The caller makes sure that ``message``'s type is one the codec builds field by field
    (:func:`aps.wire._specs._builder`): its layout's reader builds it so. Nothing is kept for
    a type outside :data:`LEARNED`, a frame holding another kind of value, or within
    :data:`LEARN_EVERY` frames of the last layout looked for (see the module's docstring).
    """
    global _unlearned
    if message.TAG not in LEARNED:
        return
    _unlearned += 1
    if _unlearned < LEARN_EVERY:
        return
    _unlearned = 0
    try:
        layout = _layout_of(frame, message)
    except WireError:
        return  # an extension only a connection's own hook reads (compressed, frame delta)
    if layout is None:
        return
    if sum(len(known) for known in _LAYOUTS.values()) >= MAX_LAYOUTS:
        _LAYOUTS.clear()
    _LAYOUTS.setdefault(len(frame), []).append(layout)


def _layout_of(frame: bytes, message: Message) -> Layout | None:
    """The layout of ``frame`` (a map that decoded and passed its checks), or ``None``."""
    unpacker = msgpack.Unpacker(
        ext_hook=TOP_HOOK,
        object_pairs_hook=str_keys,
        use_list=False,
        raw=False,
        strict_map_key=True,
        max_buffer_size=len(frame),
    )
    unpacker.feed(frame)
    pattern: list[bytes] = []
    values: list[tuple[str, int, int, Any]] = []
    done = 0  # the frame's bytes described so far
    read: set[str] = set()  # the fields the frame holds

    def variable(start: int, length: int) -> None:
        # Literal bytes up to start, then length bytes of any value.
        nonlocal done
        pattern.append(re.escape(frame[done:start]) + b".{%d}" % length)
        done = start + length

    for _ in range(unpacker.read_map_header()):
        name = unpacker.unpack()
        start = unpacker.tell()
        value = unpacker.unpack()
        end = unpacker.tell()
        kind = type(value)
        read.add(name)
        if name == "t":
            continue  # the tag: literal, as every other byte not read below
        if kind is np.ndarray:
            # An array's data ends its extension: the bytes before are its type, length,
            # extension code and header, literal.
            if frame[start + _CODE_AT.get(frame[start], 0)] != EXT_NDARRAY:
                return None  # an object array (or not an extension at all)
            nbytes = value.nbytes
            variable(end - nbytes, nbytes)
            values.append((name, _ARRAY, end - nbytes, (value.shape, value.dtype, nbytes)))
        elif kind is int:
            first = frame[start]
            width = _INT_WIDTHS.get(first)
            if width is not None:  # the type byte literal, then the value
                variable(start + 1, width)
                values.append((name, _SIGNED if first >= 0xD0 else _INT, start + 1, width))
            else:  # a fixint: a value of the same sign is one byte of the same range
                pattern.append(re.escape(frame[done:start]))
                pattern.append(rb"[\x00-\x7f]" if first < 0x80 else rb"[\xe0-\xff]")
                done = end
                values.append((name, _FIXINT, start, None))
        elif kind is bytes:
            variable(end - len(value), len(value))
            values.append((name, _BYTES, end - len(value), len(value)))
        elif value is None or kind is bool:
            values.append((name, _CONSTANT, start, value))
        else:
            return None  # a str, float, container or other extension: decoded in full
    if unpacker.tell() != len(frame):
        return None
    # The fields the frame leaves out (see OMIT_NONE), as the message holds them.
    for field in dataclasses.fields(message):
        name = field.name
        if name not in read:
            value = getattr(message, name)
            if value is not None:
                return None
            values.append((name, _CONSTANT, 0, None))
    pattern.append(re.escape(frame[done:]))
    return Layout(re.compile(b"".join(pattern), re.DOTALL), _reader(type(message), values))


def _reader(
    cls: type[Message], values: list[tuple[str, int, int, Any]]
) -> Callable[[bytes], Message]:
    """A function making the message of a frame laid out as ``values`` say, one line a field.

    Per field: its name, how it is read (``_ARRAY`` ...), where its bytes start, and what
    reading needs: an array's ``(shape, dtype, nbytes)``, a wide int's width, a bytes
    value's length, a constant itself. Each field is stored in its slot, as
    :func:`aps.wire._specs._builder`'s function does (``learn`` is given one only for a class
    it serves). The source holds only ints (offsets, widths); the rest is in its scope.
    """
    scope: dict[str, Any] = {"new": object.__new__, "cls": cls, "ndarray": np.ndarray}
    lines = ["def read(frame):", "    message = new(cls)"]
    for index, (name, kind, at, how) in enumerate(values):
        scope[f"set_{index}"] = cls.__dict__[name].__set__
        if kind == _ARRAY:
            shape, dtype, nbytes = how
            scope[f"shape_{index}"], scope[f"dtype_{index}"] = shape, dtype
            # A copy of the data (bytes are immutable: the array is read-only), as msgpack
            # copies each array's payload.
            value = f"ndarray(shape_{index}, dtype_{index}, frame[{at}:{at + nbytes}])"
        elif kind == _FIXINT:
            lines.append(f"    byte = frame[{at}]")
            value = "byte if byte < 0x80 else byte - 0x100"
        elif kind == _INT or kind == _SIGNED:
            signed = kind == _SIGNED
            value = f"int.from_bytes(frame[{at}:{at + how}], 'big', signed={signed})"
        elif kind == _BYTES:
            value = f"frame[{at}:{at + how}]"
        else:
            scope[f"constant_{index}"] = how
            value = f"constant_{index}"
        lines.append(f"    set_{index}(message, {value})")
    lines.append("    return message")
    exec("\n".join(lines), scope)  # ints in the source; all else in scope
    read: Callable[[bytes], Message] = scope["read"]
    return read
