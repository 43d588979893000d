"""Messages to bytes and back: msgpack maps, with numpy arrays as extension types.

One message is one msgpack map, ``{"t": TAG, <field>: value, ...}``, in the order the dataclass
declares its fields. Values are ``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``,
tuples or lists (both decode as tuples), dicts with ``str`` keys, numpy arrays and numpy
scalars; a Gymnasium space field travels as the plain description of :mod:`aps.spaces`.
Nothing is ever pickled: bytes from a peer are data, never code.

numpy values are msgpack extension types:

- :data:`EXT_NDARRAY`: a msgpack header ``[dtype.str, shape]``, 0 to 63 zero bytes, then the
  raw little-endian C-order bytes (the data starts where the payload's length less the
  data's size says). Dtypes: see :data:`DTYPES`. The padding aligns the data: an array under
  64 KiB is padded to a multiple of 8 from the start of its payload, which msgpack hands
  over as a bytes object of its own; a larger one, decoded as a view of the frame itself,
  to a multiple of :data:`ALIGNMENT` from the start of the frame. Either way a decoded
  array's data is aligned as numpy and BLAS want it when the frame's bytes are (CPython
  aligns the contents of a ``bytes`` object to 16 bytes): misaligned float arrays make
  numpy fall back from BLAS to loops an order of magnitude slower.
- :data:`EXT_SCALAR`: a numpy scalar (``np.float32(1)``, ``np.bool_(True)``), laid out as a
  0-d array; it decodes to a numpy scalar of the same dtype.
- :data:`EXT_OBJECT_ARRAY`: an object array (Gymnasium puts odd info values such as
  ``final_obs`` in them): the msgpack array ``[shape, [element, ...]]``, each element encoded
  by these same rules; it decodes to an object array of that shape.

Decoded arrays are read-only views over the received payload: copy them (``np.array(x)``)
before writing to them.

Small messages whose values are all simple (``None``, ``bool``, ``int``, ``float``, ``str``,
``bytes``, arrays under 64 KiB, numpy scalars, and dicts, lists, tuples and object arrays of
these: a step's requests and results, SameStep's ``final_obs`` included) are encoded by a
fast path that writes the frame directly instead of through msgpack's callbacks; its frames
are byte for byte those of the general path.
"""

from __future__ import annotations

import dataclasses
import functools
import struct
import types
import typing
from collections.abc import Callable
from typing import Any, Final

import gymnasium as gym
import msgpack
import numpy as np

from aps._buffers import allocate, seal
from aps._typing import Frame
from aps.errors import FrameTooLarge, WireError
from aps.messages import MESSAGE_TYPES, Message
from aps.spaces import space_from_wire, space_to_wire

__all__ = [
    "ALIGNMENT",
    "DEFAULT_MAX_FRAME_SIZE",
    "DTYPES",
    "EXT_NDARRAY",
    "EXT_OBJECT_ARRAY",
    "EXT_SCALAR",
    "HANDSHAKE_FRAME_SIZE",
    "HANDSHAKE_TAGS",
    "MAX_NDIM",
    "MAX_OBJECT_DEPTH",
    "MAX_PADDING",
    "decode",
    "decode_handshake",
    "encode",
]

ALIGNMENT: Final = 16
"""The data of an array of 64 KiB or more starts at a multiple of this from the frame's start."""
MAX_PADDING: Final = 63
"""The most zero bytes an array header may carry between ``[dtype.str, shape]`` and the data."""
EXT_NDARRAY: Final = 1
"""msgpack extension code of a numpy array of a whitelisted dtype."""

EXT_SCALAR: Final = 2
"""msgpack extension code of a numpy scalar of a whitelisted dtype."""

EXT_OBJECT_ARRAY: Final = 3
"""msgpack extension code of a numpy object array (its elements encoded one by one)."""

DEFAULT_MAX_FRAME_SIZE: Final = 256 * 2**20
"""The largest frame :func:`decode` accepts unless told otherwise, in bytes."""

DTYPES: Final = (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
)
"""The dtypes arrays and scalars may have on the wire (always sent little-endian)."""

MAX_NDIM: Final = 32
"""The most dimensions a decoded array may have (numpy's own limit is 64)."""

MAX_OBJECT_DEPTH: Final = 8
"""How deeply object arrays may nest inside object arrays."""

_LITTLE: dict[str, np.dtype[Any]] = {
    np.dtype(name).newbyteorder("<").str: np.dtype(name).newbyteorder("<") for name in DTYPES
}
# Equal dtypes hash equally, so native-order and little-endian dtypes find the same name.
_WIRE_NAME: dict[np.dtype[Any], str] = {dtype: name for name, dtype in _LITTLE.items()}
# Big-endian inputs are sent as their little-endian twins.
_SWAPPED: dict[str, np.dtype[Any]] = {
    dtype.newbyteorder(">").str: dtype for dtype in _LITTLE.values() if dtype.itemsize > 1
}
# The decoder looks dtype strings up as the raw bytes of the header, skipping a utf-8 decode.
_BY_WIRE_NAME: dict[bytes, np.dtype[Any]] = {s.encode(): dtype for s, dtype in _LITTLE.items()}
_PADDING = [b"\0" * (-k % 8) for k in range(8)]

_DTYPE_HINT = ", ".join(DTYPES)


def _dtype_error(dtype: np.dtype[Any]) -> WireError:
    return WireError(
        f"cannot encode numpy dtype {dtype} ({dtype.str!r}); supported dtypes: {_DTYPE_HINT} "
        "(and object arrays of supported values); convert with .astype() first"
    )


# --------------------------------------------------------------------------------------------
# Encoding


def _header(name: str, shape: tuple[int, ...]) -> bytes:
    """The msgpack bytes of ``[name, shape]`` plus zero bytes up to a multiple of 8, cached.

    Packing it with msgpack would need a second Packer while the outer one runs, and each
    Packer allocates its buffer: the hand-built header keeps encoding a small array ~10x
    cheaper.
    """
    key = (name, shape)
    header = _HEADERS.get(key)
    if header is not None:
        return header
    header = _unpadded_header(name, shape)
    header += _PADDING[len(header) % 8]
    if len(_HEADERS) >= 4096:  # shapes vary little in practice; bound the cache anyway
        _HEADERS.clear()
    _HEADERS[key] = header
    return header


@functools.lru_cache(maxsize=4096)  # each large array of a frame needs it: build it once
def _unpadded_header(name: str, shape: tuple[int, ...]) -> bytes:
    """The msgpack bytes of ``[name, shape]``."""
    ndim = len(shape)
    if ndim > MAX_NDIM:
        raise WireError(
            f"cannot encode an array of {ndim} dimensions, over the limit of {MAX_NDIM}; reshape it"
        )
    out = bytearray(_NAME_PREFIX[name])
    out += bytes([0x90 | ndim]) if ndim < 16 else b"\xdc" + ndim.to_bytes(2, "big")
    for dim in shape:
        if dim < 0x80:
            out.append(dim)
        elif dim < 2**8:
            out += b"\xcc" + dim.to_bytes(1, "big")
        elif dim < 2**16:
            out += b"\xcd" + dim.to_bytes(2, "big")
        elif dim < 2**32:
            out += b"\xce" + dim.to_bytes(4, "big")
        else:
            out += b"\xcf" + dim.to_bytes(8, "big")
    return bytes(out)


_HEADERS: dict[tuple[str, tuple[int, ...]], bytes] = {}
_NAME_PREFIX = {name: b"\x92" + bytes([0xA0 | len(name)]) + name.encode() for name in _LITTLE}


def _new_ext(code: int, data: bytes) -> msgpack.ExtType:
    # ExtType is a namedtuple whose __new__ re-validates its arguments in Python, which costs
    # as much as packing a small array; ours are valid by construction.
    ext: msgpack.ExtType = tuple.__new__(msgpack.ExtType, (code, data))
    return ext


def _ext_array(array: np.ndarray[Any, Any], code: int) -> msgpack.ExtType:
    # Looked up by the dtype object: dtype.str builds a new string on every call.
    name = _WIRE_NAME.get(array.dtype)
    if name is None:
        little = _SWAPPED.get(array.dtype.str)
        if little is None:
            raise _dtype_error(array.dtype)
        array = array.astype(little)
        name = little.str
    # tobytes() writes C order whatever the layout, so non-contiguous inputs need no extra step.
    return _new_ext(code, _header(name, array.shape) + array.tobytes())


def _ext_object_array(array: np.ndarray[Any, Any]) -> msgpack.ExtType:
    if array.dtype != object:
        raise _dtype_error(array.dtype)  # a structured dtype holding objects
    # Object arrays hold odd, rare values; a Python loop over them is the only way anyway.
    payload = _packb([array.shape, list(array.reshape(-1))])
    return _new_ext(EXT_OBJECT_ARRAY, payload)


def _default(value: Any) -> Any:
    """Turn what msgpack cannot pack natively (with ``strict_types``) into what it can."""
    if type(value) is np.ndarray:
        if value.dtype.hasobject:
            return _ext_object_array(value)
        return _ext_array(value, EXT_NDARRAY)
    # Checked before the built-ins: np.float64 is a float subclass but must stay a numpy scalar.
    if isinstance(value, np.generic):
        name = _WIRE_NAME.get(value.dtype)
        if name is not None:
            return _new_ext(EXT_SCALAR, _header(name, ()) + value.tobytes())
        if isinstance(value, np.str_ | np.bytes_):
            # Text has no numeric dtype to keep; it arrives as plain str or bytes.
            return str(value) if isinstance(value, str) else bytes(value)
        raise _dtype_error(value.dtype)
    # strict_types sends subclasses and tuples here, so that numpy scalars reach the branch
    # above; plain equivalents are returned for everything else.
    if isinstance(value, tuple | list):
        return list(value)
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, np.ndarray):
        return _default(np.asarray(value))
    if isinstance(value, bool | int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, bytes):
        return bytes(value)
    kind = type(value)
    raise WireError(
        f"cannot encode a value of type {kind.__module__}.{kind.__qualname__}; supported: None, "
        "bool, int, float, str, bytes, tuples, lists, dicts with str keys, numpy arrays and "
        "scalars; convert the value to one of these"
    )


def _packb(value: Any) -> bytes:
    # A fresh Packer per call keeps encode() safe to call from many threads. Its buffer starts
    # small: msgpack's default of 256 KiB costs a fresh allocation (~15 us) whenever a second
    # Packer runs inside default(), and the buffer grows by doubling for large arrays anyway.
    packer = msgpack.Packer(default=_default, use_bin_type=True, strict_types=True, buf_size=1024)
    result: bytes = packer.pack(value)
    return result


# Arrays whose payload (header and data) is at least this many bytes are not copied into
# msgpack's buffer: the frame is assembled once around them (see _pack_frame), and decode()
# views them in the frame.
_LARGE_ARRAY = 64 * 2**10
# The longest array header: the dtype, and up to MAX_NDIM dims of up to 9 bytes each.
_LONGEST_HEADER = 16 + 9 * MAX_NDIM


def _is_large(header: bytes, nbytes: int) -> bool:
    """Whether an array travels as a large array, aligned within the frame.

    ``header`` is its :func:`_header`. An array is large when its payload, packed inline,
    would be :data:`_LARGE_ARRAY` bytes or more: the size at which the decoder views an
    array in the frame instead of in a copy.
    """
    return len(header) + nbytes >= _LARGE_ARRAY


# What msgpack writes for ExtType(EXT_NDARRAY, b""): the stand-in for a large array while the
# rest of the message is packed. A real array's payload is never empty (it has a header).
_STAND_IN = msgpack.ExtType(EXT_NDARRAY, b"")
_STAND_IN_BYTES = b"\xc7\x00" + bytes([EXT_NDARRAY])


def _ext_prefix(length: int) -> bytes:
    """The msgpack ext header of an EXT_NDARRAY payload of ``length`` bytes (over 255)."""
    if length <= 0xFFFF:
        return b"\xc8" + length.to_bytes(2, "big") + bytes([EXT_NDARRAY])
    if length <= 0xFFFFFFFF:
        return b"\xc9" + length.to_bytes(4, "big") + bytes([EXT_NDARRAY])
    raise ValueError(f"an array of {length} bytes is too large for a msgpack ext (4 GiB - 1)")


def _pack_frame(body: dict[str, Any]) -> bytes:
    """Pack ``body``, copying each large array's data exactly once, into the frame itself.

    msgpack would copy a large array three times (``tobytes()``, the ext payload, its own
    buffer) plus once more into the result, each time into fresh memory. Instead the
    message is packed with a 3-byte stand-in for each large array, noting where it lands;
    then the frame is allocated at its final size and filled: the packed bytes around the
    stand-ins, and each array's ext header, array header and data (written by numpy, which
    also lays out non-contiguous and big-endian arrays on the way). Each large array's
    header is padded so that its data starts at a multiple of :data:`ALIGNMENT` from the
    start of the frame, where the decoder views it.
    """
    large: list[tuple[int, np.ndarray[Any, Any], np.dtype[Any], bytes]] = []
    # default() reaches the packer through this list, emptied once packing ends: a closure
    # over the packer itself would make a cycle (packer -> default -> packer) on every call,
    # garbage that only the cyclic collector frees.
    packing: list[msgpack.Packer] = []

    def default(value: Any) -> Any:
        if (
            type(value) is not np.ndarray
            or value.nbytes < _LARGE_ARRAY - _LONGEST_HEADER
            or value.dtype.hasobject
        ):
            return _default(value)
        name = _WIRE_NAME.get(value.dtype)
        if name is None:
            little = _SWAPPED.get(value.dtype.str)
            if little is None:
                raise _dtype_error(value.dtype)
            name = little.str
        if _is_large(_header(name, value.shape), value.nbytes):
            with packing[0].getbuffer() as packed:
                offset = packed.nbytes  # where msgpack writes what this call returns
            large.append((offset, value, _LITTLE[name], _unpadded_header(name, value.shape)))
            return _STAND_IN
        return _default(value)

    packer = msgpack.Packer(
        default=default, use_bin_type=True, strict_types=True, buf_size=1024, autoreset=False
    )
    packing.append(packer)
    try:
        packer.pack(body)
    finally:
        packing.clear()
    if not large:
        result: bytes = packer.bytes()
        return result
    with packer.getbuffer() as packed:
        # Lay the frame out first: where each array's parts go, and the total size.
        parts: list[tuple[int, bytes, np.ndarray[Any, Any], np.dtype[Any]]] = []
        at = 0  # the frame's size so far
        done = 0  # bytes of the packed message placed so far
        for offset, array, dtype, header in large:
            at += offset - done
            # The payload's length fixes the ext prefix's; large payloads need the 6-byte
            # one whatever their padding, so the data's position is known before the padding.
            padding = -(at + 6 + len(header)) % ALIGNMENT
            if len(header) + padding + array.nbytes < _LARGE_ARRAY:
                padding += ALIGNMENT  # still large to the decoder, which views it in place
            head = header + bytes(padding)
            prefix = _ext_prefix(len(head) + array.nbytes)
            parts.append((offset, prefix + head, array, dtype))
            at += len(prefix) + len(head) + array.nbytes
            done = offset + len(_STAND_IN_BYTES)
        frame, view = allocate(at + packed.nbytes - done)
        done = 0
        at = 0
        for offset, head, array, dtype in parts:
            assert packed[offset : offset + len(_STAND_IN_BYTES)] == _STAND_IN_BYTES
            for part in (packed[done:offset], head):
                view[at : at + len(part)] = part
                at += len(part)
            target = np.ndarray(array.shape, dtype, view, at)
            np.copyto(target, array, casting="equiv")
            at += array.nbytes
            done = offset + len(_STAND_IN_BYTES)
        view[at:] = packed[done:]
    del target
    view.release()
    return seal(frame)


class _PathError(WireError):
    """A bad value deep in a tree; the path to it is collected while the error unwinds."""

    def __init__(self, problem: str) -> None:
        self.problem = problem
        self.path: list[str] = []
        super().__init__(problem)


# Values whose subtree needs no walk: plain scalars and numpy scalars of wire dtypes.
_LEAVES = frozenset(
    [type(None), bool, int, float, str, bytes, *(np.dtype(name).type for name in DTYPES)]
)


def _check_tree(value: Any, depth: int) -> None:
    """Refuse what msgpack would pack but the peer would refuse: non-str keys, deep nesting.

    Only containers are walked; the inline tests skip leaves and numeric arrays without a
    call, which matters for object arrays such as ``final_obs`` (one element per env).
    """
    if type(value) is np.ndarray:
        if value.dtype.hasobject:
            if depth >= MAX_OBJECT_DEPTH:
                raise _PathError(
                    f"object arrays nest deeper than {MAX_OBJECT_DEPTH} levels; flatten the value"
                )
            for index, item in enumerate(value.flat):
                kind = type(item)
                if kind in _LEAVES or (kind is np.ndarray and not item.dtype.hasobject):
                    continue
                try:
                    _check_tree(item, depth + 1)
                except _PathError as exc:
                    exc.path.append(f"[{index}]")
                    raise
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if type(key) is not str:
                raise _PathError(
                    f"has the map key {key!r} of type {type(key).__name__}; only str keys "
                    "travel; convert the keys with str()"
                )
            kind = type(item)
            if kind in _LEAVES or (kind is np.ndarray and not item.dtype.hasobject):
                continue
            try:
                _check_tree(item, depth)
            except _PathError as exc:
                exc.path.append(f"[{key!r}]")
                raise
    elif isinstance(value, tuple | list):
        for index, item in enumerate(value):
            kind = type(item)
            if kind in _LEAVES or (kind is np.ndarray and not item.dtype.hasobject):
                continue
            try:
                _check_tree(item, depth)
            except _PathError as exc:
                exc.path.append(f"[{index}]")
                raise


# --------------------------------------------------------------------------------------------
# Field specs, built once per message class from its annotations.

_ANY, _SPACE, _PLAIN = 0, 1, 2


@dataclasses.dataclass(frozen=True, slots=True)
class _Field:
    name: str
    kind: int  # _ANY, _SPACE or _PLAIN
    check: Callable[[Any], bool]  # for _PLAIN (and None-ness of an optional _SPACE)
    expected: str  # for error messages


@dataclasses.dataclass(frozen=True, slots=True)
class _Spec:
    cls: type[Message]
    tag: str
    fields: tuple[_Field, ...]
    names: frozenset[str]
    head: bytes  # the packed map header, "t" and the tag: how every frame of the type starts
    # Per field, in order: its name, its packed name, its kind and its check (_pack_small's).
    plan: tuple[tuple[str, bytes, int, Callable[[Any], bool]], ...]


def _is_array(value: Any) -> bool:
    return type(value) is np.ndarray and not value.dtype.hasobject


_ATOMS: dict[object, tuple[Callable[[Any], bool], str]] = {
    # type() is, not isinstance: bool is an int subclass, and msgpack yields exact types.
    int: (lambda v: type(v) is int, "int"),
    float: (lambda v: type(v) is float or type(v) is int, "float"),
    bool: (lambda v: type(v) is bool, "bool"),
    str: (lambda v: type(v) is str, "str"),
    bytes: (lambda v: type(v) is bytes, "bytes"),
    type(None): (lambda v: v is None, "None"),
}


def _field_for(name: str, hint: object) -> _Field:
    if hint is Any:
        return _Field(name, _ANY, lambda v: True, "any plain data")
    options = (
        typing.get_args(hint)
        if typing.get_origin(hint) in (typing.Union, types.UnionType)
        else (hint,)
    )
    optional = type(None) in options
    rest = [o for o in options if o is not type(None)]
    if len(rest) == 1 and (rest[0] is gym.Space or typing.get_origin(rest[0]) is gym.Space):
        if optional:
            return _Field(name, _SPACE, lambda v: v is None, "a gymnasium space or None")
        return _Field(name, _SPACE, lambda v: False, "a gymnasium space")
    checks: list[Callable[[Any], bool]] = []
    words: list[str] = []
    for option in options:
        if option is np.ndarray or typing.get_origin(option) is np.ndarray:
            checks.append(_is_array)
            words.append("a numpy array")
        elif option in _ATOMS:
            check, word = _ATOMS[option]
            checks.append(check)
            words.append(word)
        else:
            raise TypeError(f"aps.codec cannot carry a field annotated {hint!r} ({name})")
    if len(checks) == 1:
        return _Field(name, _PLAIN, checks[0], words[0])
    return _Field(name, _PLAIN, lambda v: any(c(v) for c in checks), " or ".join(words))


def _spec_for(cls: type[Message]) -> _Spec:
    hints = typing.get_type_hints(cls)
    fields = tuple(_field_for(f.name, hints[f.name]) for f in dataclasses.fields(cls))
    names = frozenset(f.name for f in fields)
    if "t" in names:
        raise TypeError(f"{cls.__name__} has a field named 't', which the codec uses for the tag")
    count = len(fields) + 1
    head = bytes([0x80 | count]) if count < 16 else b"\xde" + count.to_bytes(2, "big")
    head += _packb("t") + _packb(cls.TAG)
    plan = tuple((f.name, _packb(f.name), f.kind, f.check) for f in fields)
    return _Spec(cls, cls.TAG, fields, names, head, plan)


_SPECS_BY_TAG: dict[str, _Spec] = {tag: _spec_for(cls) for tag, cls in MESSAGE_TYPES.items()}
_SPECS_BY_CLASS: dict[type[Message], _Spec] = {s.cls: s for s in _SPECS_BY_TAG.values()}
_KNOWN_TAGS = ", ".join(sorted(_SPECS_BY_TAG))


def _type_name(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"a numpy array of dtype {value.dtype}"
    return type(value).__qualname__


def encode(message: Message) -> bytes:
    """Encode one message as one frame.

    Arrays are copied into the frame; the message may be reused or mutated afterwards.

    Args:
        message: an instance of one of the types in :data:`aps.messages.MESSAGE_TYPES`.

    Returns:
        The frame, a msgpack map.

    Raises:
        WireError: the message is not a known message type, a field does not match its
            annotation, or a value cannot travel (a type or dtype outside the supported set,
            a map key that is not a str, an int beyond 64 bits); the message names the field.
        ConfigError: a space field holds a space type that cannot travel (see
            :mod:`aps.spaces`).
    """
    spec = _SPECS_BY_CLASS.get(type(message))
    if spec is None:
        raise WireError(
            f"cannot encode {type(message).__qualname__}: not an aps message type; "
            f"known tags: {_KNOWN_TAGS}"
        )
    frame = _pack_small(spec, message, containers=True)
    if frame is not None:
        return frame
    body = _body(spec, message)
    try:
        return _pack_frame(body)
    except Exception as exc:
        raise _locate(spec, body, exc) from exc


def _body(spec: _Spec, message: Message) -> dict[str, Any]:
    """The map ``{"t": tag, field: value, ...}`` that encodes ``message``, its fields checked."""
    body: dict[str, Any] = {"t": spec.tag}
    for field in spec.fields:
        value = getattr(message, field.name)
        if field.kind == _ANY:
            if type(value) not in _LEAVES and not _is_array(value):
                try:
                    _check_tree(value, 0)
                except _PathError as exc:
                    path = "".join(reversed(exc.path))
                    raise WireError(
                        f"cannot encode field {field.name!r} of {spec.cls.__name__}: "
                        f"{field.name}{path} {exc.problem}"
                    ) from None
        elif field.kind == _SPACE:
            if not field.check(value):
                if not isinstance(value, gym.Space):
                    raise _field_error(spec, field, value, "encode")
                value = space_to_wire(value)
        elif not field.check(value):
            raise _field_error(spec, field, value, "encode")
        body[field.name] = value
    return body


def _field_error(spec: _Spec, field: _Field, value: Any, verb: str) -> WireError:
    return WireError(
        f"cannot {verb} field {field.name!r} of {spec.cls.__name__}: expected "
        f"{field.expected}, got {_type_name(value)}"
    )


def _locate(spec: _Spec, body: dict[str, Any], exc: Exception) -> WireError:
    """Name the field that failed to pack (runs only on the error path)."""
    for field in spec.fields:
        try:
            _packb(body[field.name])
        except Exception as field_exc:
            return WireError(
                f"cannot encode field {field.name!r} of {spec.cls.__name__}: {field_exc}"
            )
    return WireError(f"cannot encode {spec.cls.__name__}: {exc}")


# --------------------------------------------------------------------------------------------
# The fast path for small messages. A step's messages hold a few ints and small arrays, and
# msgpack reaches every array through a Python default() that builds an ExtType: most of the
# cost of encoding them. _pack_small writes such a message directly, in Python, from bytes
# prepared once per message type and once per array dtype and shape, in one pass over the
# fields: no body map is built unless the generic path takes over.


def _pack_small(spec: _Spec, message: Message, *, containers: bool = False) -> bytes | None:
    """The frame of ``message`` when every field holds a simple value that fits it, else ``None``.

    Simple values: ``None``, ``bool``, ``int`` and ``float`` (exact types), ``str``,
    ``bytes``, the empty dict, and numpy arrays of a wire dtype in native or little-endian
    order whose payload is under :data:`_LARGE_ARRAY` bytes. With ``containers`` (as
    :func:`encode` calls it), also what :func:`_pack_tree` writes: dicts, lists, tuples and
    object arrays of simple values and numpy scalars, such as a SameStep step's infos. A
    field's value must also pass the field's check (as in :func:`_body`). The frame is byte
    for byte what :func:`_pack_frame` makes of the message's body (the tests compare them);
    for anything else, including every value that fails its check or that msgpack or
    :func:`_check_tree` would refuse, ``None`` leaves the work and the error to the generic
    path.
    """
    parts = [spec.head]
    append = parts.append
    for name, key, field_kind, check in spec.plan:
        value = getattr(message, name)
        if field_kind != _ANY and not check(value):
            return None  # a space to describe, or a value of the wrong type: _body's work
        append(key)
        kind = type(value)
        if kind is np.ndarray:
            prefix = _PREFIXES.get((value.dtype, value.shape))
            if prefix is None:
                prefix = _array_prefix(value)
                if prefix is None:
                    if containers and _pack_object_array(value, append, 0, 0):
                        continue
                    return None
            append(prefix)
            # tobytes() writes C order whatever the layout, as in _ext_array.
            append(value.tobytes())
        elif kind is int:
            packed = _pack_int(value)
            if packed is None:
                return None
            append(packed)
        elif value is None:
            append(b"\xc0")
        elif kind is bool:
            append(b"\xc3" if value else b"\xc2")
        elif kind is float:
            append(_FLOAT64.pack(0xCB, value))  # msgpack sends Python floats as float64
        elif kind is str:
            try:
                data = value.encode()
            except UnicodeEncodeError:  # lone surrogates: msgpack refuses them too
                return None
            size = len(data)
            head = _FIXSTR[size] if size < 32 else _length_header(size, 0xD9, 0xDA, 0xDB)
            if head is None:
                return None
            append(head)
            append(data)
        elif kind is bytes:
            head = _length_header(len(value), 0xC4, 0xC5, 0xC6)
            if head is None:
                return None
            append(head)
            append(value)
        elif kind is dict and not value:
            append(b"\x80")
        elif not containers or not _pack_tree(value, append, 0, 0):
            return None
    return b"".join(parts)


def _pack_tree(value: Any, append: Callable[[bytes], Any], nesting: int, depth: int) -> bool:
    """Append the msgpack bytes of ``value`` as the generic path packs it; ``False``: refused.

    Writes exact ``dict`` (str keys), ``list``, ``tuple`` and object arrays holding values
    of the kinds :func:`_pack_small` writes, numpy scalars of a wire dtype, and more such
    containers. ``nesting`` counts the containers around ``value``, ``depth`` the object
    arrays (as :func:`_check_tree` counts them). Anything else returns ``False`` (with
    parts already appended: the caller drops them), so that the generic path packs it or
    raises its error: other types and subclasses, non-str keys, object arrays nested
    :data:`MAX_OBJECT_DEPTH` deep, large or big-endian arrays, ints beyond 64 bits.
    """
    kind = type(value)
    if kind is np.ndarray:
        if value.dtype.hasobject:
            return _pack_object_array(value, append, nesting, depth)
        prefix = _PREFIXES.get((value.dtype, value.shape))
        if prefix is None:
            prefix = _array_prefix(value)
            if prefix is None:
                return False
        append(prefix)
        append(value.tobytes())
    elif value is None:
        append(b"\xc0")
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
            if not _pack_tree(item, append, nesting + 1, depth):
                return False
    elif kind is list or kind is tuple:
        if nesting >= _MAX_FAST_NESTING:
            return False
        head = _container_header(len(value), 0x90, 0xDC, 0xDD)
        if head is None:
            return False
        append(head)
        for item in value:
            if not _pack_tree(item, append, nesting + 1, depth):
                return False
    elif kind is int:
        packed = _pack_int(value)
        if packed is None:
            return False
        append(packed)
    elif kind is bool:
        append(b"\xc3" if value else b"\xc2")
    elif kind is float:
        append(_FLOAT64.pack(0xCB, value))
    elif kind is str:
        try:
            data = value.encode()
        except UnicodeEncodeError:
            return False
        size = len(data)
        head = _FIXSTR[size] if size < 32 else _length_header(size, 0xD9, 0xDA, 0xDB)
        if head is None:
            return False
        append(head)
        append(data)
    elif kind is bytes:
        head = _length_header(len(value), 0xC4, 0xC5, 0xC6)
        if head is None:
            return False
        append(head)
        append(value)
    else:
        prefix = _SCALAR_PREFIXES.get(kind)
        if prefix is None:
            return False
        append(prefix)
        append(value.tobytes())
    return True


def _pack_object_array(
    array: np.ndarray[Any, Any], append: Callable[[bytes], Any], nesting: int, depth: int
) -> bool:
    """Append an object array as :func:`_ext_object_array` packs it; ``False``: refused."""
    if array.dtype != _OBJECT or depth >= MAX_OBJECT_DEPTH or nesting >= _MAX_FAST_NESTING:
        return False  # a structured dtype, or too deep: the generic path's error
    shape = array.shape
    head = _OBJECT_HEADS.get(shape)
    if head is None:
        # [shape, [elements...]]: the shape's ints and the elements' count, as msgpack packs
        # the list [list(shape), list(elements)].
        ndim = _container_header(len(shape), 0x90, 0xDC, 0xDD)
        count = _container_header(array.size, 0x90, 0xDC, 0xDD)
        dims = [_pack_int(dim) for dim in shape]
        if ndim is None or count is None or None in dims:
            return False
        head = b"".join([b"\x92", ndim, *typing.cast("list[bytes]", dims), count])
        if len(_OBJECT_HEADS) >= 4096:
            _OBJECT_HEADS.clear()
        _OBJECT_HEADS[shape] = head
    parts = [head]
    add = parts.append
    # tolist() of an object array hands over its elements themselves, and a list iterates
    # faster than an array; most of a final_obs is None (the envs that did not end).
    for item in array.reshape(-1).tolist():
        if item is None:
            add(b"\xc0")
        elif not _pack_tree(item, add, nesting + 1, depth + 1):
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
    if len(_KEYS) >= 4096:  # bounded, as _HEADERS
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
    """Per numpy scalar type of a wire dtype: the bytes before its data, as _default packs it."""
    prefixes: dict[type, bytes] = {}
    for name in DTYPES:
        dtype = np.dtype(name)
        wire = _WIRE_NAME.get(dtype)
        if wire is None:  # a big-endian host: its scalars take the generic path
            continue
        header = _header(wire, ())
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


def _pack_int(value: int) -> bytes | None:
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


def _array_prefix(array: np.ndarray[Any, Any]) -> bytes | None:
    """What precedes the data of ``array`` in a frame: the ext header and the array header.

    ``None`` for arrays the fast path leaves to the generic one: other dtypes (big-endian,
    object, unsupported ones, whose errors it raises), too many dimensions, large arrays.
    The result is cached per dtype and shape.
    """
    name = _WIRE_NAME.get(array.dtype)
    if name is None or array.ndim > MAX_NDIM:
        return None
    header = _header(name, array.shape)
    if _is_large(header, array.nbytes):
        return None
    length = len(header) + array.nbytes
    # The ext header msgpack writes for a payload of this length: fixext where one fits.
    fixext = _FIXEXT.get(length)
    if fixext is not None:
        prefix = bytes([fixext, EXT_NDARRAY]) + header
    elif length <= 0xFF:
        prefix = bytes([0xC7, length, EXT_NDARRAY]) + header
    else:
        prefix = _ext_prefix(length) + header
    if len(_PREFIXES) >= 4096:  # as for _HEADERS: few shapes in practice, bounded anyway
        _PREFIXES.clear()
    _PREFIXES[(array.dtype, array.shape)] = prefix
    return prefix


_PREFIXES: dict[tuple[np.dtype[Any], tuple[int, ...]], bytes] = {}
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


# --------------------------------------------------------------------------------------------
# Decoding


def _parse_header(data: bytes) -> tuple[np.dtype[Any], tuple[int, ...], int]:
    """Read ``[dtype.str, shape]``; return the dtype, the shape and where the header ends.

    Hand-parsed rather than unpacked: it checks every byte before numpy sees any, and it
    finds where the header ends without copying the payload into an Unpacker.
    """
    if data[0] != 0x92:
        raise WireError("array header must be a 2-element msgpack array")
    b = data[1]
    if 0xA0 <= b <= 0xBF:
        pos = 2 + (b - 0xA0)
        name = data[2:pos]
    elif b == 0xD9:
        pos = 3 + data[2]
        name = data[3:pos]
    else:
        raise WireError("array header must start with the dtype as a msgpack str")
    dtype = _BY_WIRE_NAME.get(name)
    if dtype is None:
        raise WireError(
            f"array dtype {name.decode('utf-8', 'replace')!r} is not supported; "
            f"supported: {', '.join(s for s in _LITTLE)}"
        )
    b = data[pos]
    if 0x90 <= b <= 0x9F:
        ndim = b - 0x90
        pos += 1
    elif b == 0xDC:
        ndim = int.from_bytes(data[pos + 1 : pos + 3], "big")
        pos += 3
    else:
        raise WireError("array shape must be a msgpack array")
    if ndim > MAX_NDIM:
        raise WireError(f"array has {ndim} dimensions, over the limit of {MAX_NDIM}")
    shape = []
    for _ in range(ndim):
        b = data[pos]
        if b < 0x80:
            dim = b
            pos += 1
        elif 0xCC <= b <= 0xCF:
            width = 1 << (b - 0xCC)
            dim = int.from_bytes(data[pos + 1 : pos + 1 + width], "big")
            pos += 1 + width
        else:
            raise WireError("array shape must hold non-negative ints")
        shape.append(dim)
    return dtype, tuple(shape), pos


def _parse_payload(data: bytes) -> tuple[np.dtype[Any], tuple[int, ...], int, int]:
    """Parse the header of an array ext payload (or of its start).

    Returns the dtype, the shape, where the header ends and the data's size in bytes.

    Raises:
        WireError: a malformed or truncated header.
    """
    try:
        dtype, shape, end = _parse_header(data)
    except IndexError:
        raise WireError("array header is truncated") from None
    nbytes = dtype.itemsize
    for dim in shape:
        nbytes *= dim  # Python ints: a lying header cannot overflow this product
    return dtype, shape, end, nbytes


def _data_offset(
    payload: bytes, length: int, end: int, dtype: np.dtype[Any], shape: tuple[int, ...], nbytes: int
) -> int:
    """Where the data of a payload of ``length`` bytes starts; its header ends at ``end``.

    ``payload`` holds at least the header and the padding.

    Raises:
        WireError: the bytes after the header do not hold the data, or its padding (at most
            :data:`MAX_PADDING` zero bytes) in front.
    """
    offset = length - nbytes
    if not end <= offset <= end + MAX_PADDING:
        raise WireError(
            f"array header says shape {shape} of {dtype} ({nbytes} bytes) but {length - end} "
            f"bytes follow it; between them only 0 to {MAX_PADDING} zero bytes of padding fit"
        )
    if payload[end:offset] != _ZEROS[: offset - end]:
        raise WireError("array header's padding is not zero bytes")
    return offset


_ZEROS = bytes(MAX_PADDING)


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


def _make_ext_hook(depth: int) -> Callable[[int, bytes], Any]:
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
            return _unpack_object_array(data, _EXT_HOOKS[depth + 1])
        raise WireError(
            f"unknown msgpack extension code {code}; known: {EXT_NDARRAY} (array), "
            f"{EXT_SCALAR} (numpy scalar), {EXT_OBJECT_ARRAY} (object array)"
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


def _reference_hook(frame: bytes, found: list[tuple[int, int, int]]) -> Callable[[int, bytes], Any]:
    def ext_hook(code: int, data: bytes) -> Any:
        if code != _EXT_REFERENCE:
            return _TOP_HOOK(code, data)
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


def decode(frame: Frame, *, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> Message:
    """Decode one frame into the message it holds.

    The contract: for any input this returns a valid message or raises :class:`WireError`;
    whatever msgpack or numpy raise is chained as ``__cause__``. Every field is checked
    against its annotation (``int`` excludes ``bool``, ``float`` accepts ``int``, arrays of
    the ``Array`` fields have a numeric or bool dtype). Arrays in the message are read-only
    views of the frame's payload.

    Args:
        frame: the bytes one transport frame carried.
        max_frame_size: the largest frame accepted, in bytes; checked before any parsing.

    Returns:
        The message, an instance of the type its tag names.

    Raises:
        FrameTooLarge: the frame is larger than ``max_frame_size``.
        WireError: the frame is not valid msgpack, has an unknown tag, lacks or adds fields,
            or holds values of the wrong type (a bad array header, an unknown dtype, a
            malformed space description, ...).
    """
    size = _frame_size(frame, max_frame_size)
    data: Frame = frame
    ext_hook = _TOP_HOOK
    # Only bytes are viewed in place: a view of a caller's bytearray would not be read-only.
    if type(frame) is bytes and size > _LARGE_ARRAY:
        found = _large_arrays(frame)
        if found is not None:
            data = _with_references(frame, found)
            ext_hook = _reference_hook(frame, found)
    try:
        # No container can hold more items than the frame has bytes.
        body = msgpack.unpackb(
            data,
            ext_hook=ext_hook,
            object_hook=_str_keys,
            use_list=False,
            raw=False,
            strict_map_key=True,
            max_str_len=size,
            max_bin_len=size,
            max_ext_len=size,
            max_array_len=size,
            max_map_len=size // 2,
        )
    except WireError:
        raise
    except Exception as exc:
        raise WireError(f"frame of {size} bytes is not valid msgpack: {exc}") from exc
    return _message(body, _SPECS_BY_TAG, _KNOWN_TAGS)


HANDSHAKE_FRAME_SIZE = 16 * 1024
"""The largest frame read before the peer proved the token, in bytes.

A handshake message is a few hundred bytes (names, nonces, proofs); a policy or env import
path of a few KiB still fits.
"""

HANDSHAKE_TAGS = frozenset({"challenge", "hello", "welcome", "reject", "goodbye", "probe_result"})
"""The messages that may arrive before the peer proved the token."""

_HANDSHAKE_SPECS = {tag: spec for tag, spec in _SPECS_BY_TAG.items() if tag in HANDSHAKE_TAGS}
_HANDSHAKE_KNOWN = ", ".join(sorted(HANDSHAKE_TAGS))


def _refuse_ext(code: int, data: bytes) -> Any:
    raise WireError(f"extension type {code} before the handshake; handshake messages hold none")


def decode_handshake(frame: Frame, *, max_frame_size: int = HANDSHAKE_FRAME_SIZE) -> Message:
    """Decode one frame from a peer that has not proved the token yet.

    The bounded form of :func:`decode`: the frame must be handshake-sized, and msgpack is
    decoded with no extension types (numpy arrays, spaces), arrays of at most 256 items and
    maps of at most 64 entries (a Welcome's ``policy_kwargs`` are plain data), strings no
    longer than the frame, and msgpack's own nesting limit, so what an unauthenticated peer
    can make this side build is bounded by a small multiple of ``max_frame_size``. Only the
    tags in :data:`HANDSHAKE_TAGS` are accepted.

    Raises:
        FrameTooLarge: the frame is larger than ``max_frame_size``.
        WireError: anything else that is not a well-formed handshake message.
    """
    size = _frame_size(frame, max_frame_size)
    # The first byte must open a map: refuse anything else before msgpack builds it.
    first = bytes(frame[:1])
    if not first or not (0x80 <= first[0] <= 0x8F or first[0] == 0xDE):
        raise WireError("a handshake frame must hold a msgpack map of at most 65535 entries")
    try:
        body = msgpack.unpackb(
            frame,
            ext_hook=_refuse_ext,
            use_list=False,
            raw=False,
            strict_map_key=True,
            max_str_len=size,
            max_bin_len=size,
            max_ext_len=0,
            max_array_len=256,
            max_map_len=64,
        )
    except WireError:
        raise
    except Exception as exc:
        raise WireError(f"handshake frame of {size} bytes is not valid msgpack: {exc}") from exc
    return _message(body, _HANDSHAKE_SPECS, _HANDSHAKE_KNOWN)


def _frame_size(frame: Frame, max_frame_size: int) -> int:
    """``frame``'s size in bytes, checked against ``max_frame_size`` before any parsing."""
    try:
        size = frame.nbytes if isinstance(frame, memoryview) else len(frame)
    except TypeError as exc:
        raise WireError(f"a frame must be bytes, got {type(frame).__qualname__}") from exc
    if size > max_frame_size:
        raise FrameTooLarge(size, max_frame_size)
    return size


def _message(body: Any, specs: dict[str, _Spec], known: str) -> Message:
    """The message a decoded frame body describes, every field checked."""
    if type(body) is not dict:
        raise WireError(f"a frame must hold a msgpack map, got {_type_name(body)}")
    tag = body.pop("t", None)
    spec = specs.get(tag) if type(tag) is str else None
    if spec is None:
        raise WireError(f"unknown message tag {tag!r:.80}; known tags: {known}")
    if body.keys() != spec.names:
        missing = sorted(spec.names - body.keys())
        extra = sorted(repr(k)[:80] for k in body.keys() - spec.names)
        raise WireError(
            f"{spec.tag} message has missing fields {missing} and extra fields {extra}; "
            "both sides must run the same aps release"
        )
    for field in spec.fields:
        if field.kind == _ANY:
            continue
        value = body[field.name]
        if field.check(value):
            continue
        if field.kind == _SPACE:
            try:
                body[field.name] = space_from_wire(value)
            except WireError as exc:
                raise WireError(f"{spec.tag} message field {field.name!r}: {exc}") from exc
            except Exception as exc:  # the contract: nothing but WireError leaves decode()
                raise WireError(f"{spec.tag} message field {field.name!r}: {exc}") from exc
            continue
        raise WireError(
            f"{spec.tag} message field {field.name!r} must be {field.expected}, "
            f"got {_type_name(value)}"
        )
    try:
        return spec.cls(**body)
    except Exception as exc:  # a message type with its own __post_init__ checks
        raise WireError(f"{spec.tag} message is invalid: {exc}") from exc
