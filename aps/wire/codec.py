"""Messages to bytes and back: msgpack maps, with numpy arrays as extension types.

One message is one msgpack map, ``{"t": TAG, <field>: value, ...}``, in the order the dataclass
declares its fields. Values are ``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``,
tuples or lists (both decode as tuples), dicts with ``str`` keys, numpy arrays and numpy
scalars; a Gymnasium space field travels as the plain description of :mod:`aps.wire.spaces`.
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
- :data:`~aps.wire.compression.EXT_COMPRESSED`: a numeric array compressed with the codec the
  connection negotiated in its handshake (see :mod:`aps.wire.compression`); only
  :func:`encode` with a compressor writes it, and only :func:`decode` told the codec reads it.
- :data:`~aps.wire.frame_delta.EXT_FRAME_DELTA`: a rollout chunk's ``obs`` whose frame stacks
  travel as their newest frames (see :mod:`aps.wire.frame_delta`); only :func:`encode` with
  ``frame_delta`` writes it, and only :func:`decode` with ``frame_delta`` reads it, as a
  :class:`~aps.wire.messages.RolloutChunk`'s ``obs`` (or an array of an ``obs`` that is a dict or
  tuple of arrays, each delta-coded on its own) and nowhere else.

Decoded arrays are read-only views over the received payload: copy them (``np.array(x)``)
before writing to them.

Small messages whose values are all simple (``None``, ``bool``, ``int``, ``float``, ``str``,
``bytes``, arrays under 64 KiB, numpy scalars, and dicts, lists, tuples and object arrays of
these: a step's requests and results, SameStep's ``final_obs`` included) are encoded by a
fast path that writes the frame directly instead of through msgpack's callbacks; its frames
are byte for byte those of the general path. On the way back, a small chunk frame laid out
like one decoded before (a worker's next chunk) is read without msgpack, into the message the
full decode would make of it (see :mod:`aps.wire._layouts`).

The codec is split so that each part reads in one sitting. This module holds the public API,
the general encoder (msgpack with a ``default`` callback; large arrays written once, aligned,
into the frame), the registry of the message types' field specs, the fast path's entry point
and the decoders' last step, a frame body to a message. Below it, importing nothing of it:

- :mod:`aps.wire._wire`: the constants and dtype tables, and the array header ``[dtype.str,
  shape]`` written and parsed; what every other part shares.
- :mod:`aps.wire._fast_pack`: the hand-written msgpack writer of the fast path.
- :mod:`aps.wire._unpack`: the ext hooks that decode numpy values, and the zero-copy walk that
  views large arrays in the frame.
- :mod:`aps.wire._specs`: the field specs, what each message type's fields must be.
- :mod:`aps.wire._layouts`: the layouts of chunk frames decoded before, learned and matched.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Final

import gymnasium as gym
import msgpack
import numpy as np

from aps._base._buffers import allocate, seal
from aps._base._typing import Frame
from aps.errors import FrameTooLarge, WireError
from aps.wire import frame_delta as _frame_delta
from aps.wire._fast_pack import (
    ATOM_KINDS,
    PREFIXES,
    array_prefix,
    pack_atom,
    pack_int,
    pack_object_array,
    pack_tree,
)
from aps.wire._guards import (
    ANY_ARRAYS,
    COMPRESSED_CODE,
    FRAME_DELTA_CODE,
    NO_ARRAYS,
    PLAIN_ARRAYS,
    check_ready,
    inflating_hook,
    may_hold,
    peek_tag,
)
from aps.wire._layouts import learn, recognize
from aps.wire._specs import ANY, SPACE, Field, Spec, is_array, spec_for
from aps.wire._trees import (
    LEAVES,
    PathError,
    check_tree,
    map_tree,
    pending_leaves,
    rebuilt,
    split_leaves,
)
from aps.wire._unpack import (
    SCAN_FROM,
    TOP_HOOK,
    reference_hook,
    scan,
    str_keys,
    with_references,
)
from aps.wire._wire import (
    ALIGNMENT,
    DTYPES,
    EXT_NDARRAY,
    EXT_OBJECT_ARRAY,
    EXT_SCALAR,
    LARGE_ARRAY,
    LITTLE,
    LONGEST_HEADER,
    MAX_NDIM,
    MAX_OBJECT_DEPTH,
    MAX_PADDING,
    SWAPPED,
    WIRE_NAME,
    Allowance,
    InflationRate,
    array_header,
    dtype_error,
    ext_prefix,
    is_large,
    unpadded_header,
)
from aps.wire.compression import Compressor
from aps.wire.messages import MESSAGE_TYPES, Message, Ready, register_message
from aps.wire.spaces import space_from_wire, space_to_wire

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
    "InflationRate",
    "MAX_OBJECT_DEPTH",
    "MAX_PADDING",
    "decode",
    "decode_handshake",
    "encode",
    "register",
]

DEFAULT_MAX_FRAME_SIZE: Final = 256 * 2**20
"""The largest frame :func:`decode` accepts unless told otherwise, in bytes."""


# --------------------------------------------------------------------------------------------
# Encoding


def _new_ext(code: int, data: bytes) -> msgpack.ExtType:
    # ExtType is a namedtuple whose __new__ re-validates its arguments in Python, which costs
    # as much as packing a small array; ours are valid by construction.
    ext: msgpack.ExtType = tuple.__new__(msgpack.ExtType, (code, data))
    return ext


def _ext_array(array: np.ndarray[Any, Any], code: int) -> msgpack.ExtType:
    # Looked up by the dtype object: dtype.str builds a new string on every call.
    name = WIRE_NAME.get(array.dtype)
    if name is None:
        little = SWAPPED.get(array.dtype.str)
        if little is None:
            raise dtype_error(array.dtype)
        array = array.astype(little)
        name = little.str
    # tobytes() writes C order whatever the layout, so non-contiguous inputs need no extra step.
    return _new_ext(code, array_header(name, array.shape) + array.tobytes())


def _ext_object_array(
    array: np.ndarray[Any, Any], compressor: Compressor | None = None
) -> msgpack.ExtType:
    if array.dtype != object:
        raise dtype_error(array.dtype)  # a structured dtype holding objects
    # Object arrays hold odd, rare values; a Python loop over them is the only way anyway.
    payload = _packb([array.shape, list(array.reshape(-1))], compressor)
    return _new_ext(EXT_OBJECT_ARRAY, payload)


def _default(value: Any, compressor: Compressor | None = None) -> Any:
    """Turn what msgpack cannot pack natively (with ``strict_types``) into what it can.

    With a ``compressor``, numeric arrays it finds worth compressing become
    :data:`~aps.wire.compression.EXT_COMPRESSED` extensions.
    """
    if type(value) is np.ndarray:
        if value.dtype.hasobject:
            return _ext_object_array(value, compressor)
        if compressor is not None:
            packed = compressor.pack(value)
            if packed is not None:
                return packed
        return _ext_array(value, EXT_NDARRAY)
    if type(value) is _frame_delta.Delta:
        return _frame_delta.pack(value, functools.partial(_packb, compressor=compressor))
    # Checked before the built-ins: np.float64 is a float subclass but must stay a numpy scalar.
    if isinstance(value, np.generic):
        name = WIRE_NAME.get(value.dtype)
        if name is not None:
            return _new_ext(EXT_SCALAR, array_header(name, ()) + value.tobytes())
        if isinstance(value, np.str_ | np.bytes_):
            # Text has no numeric dtype to keep; it arrives as plain str or bytes.
            return str(value) if isinstance(value, str) else bytes(value)
        raise dtype_error(value.dtype)
    # strict_types sends subclasses and tuples here, so that numpy scalars reach the branch
    # above; plain equivalents are returned for everything else.
    if isinstance(value, tuple | list):
        return list(value)
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, np.ndarray):
        return _default(np.asarray(value), compressor)
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


def _packb(value: Any, compressor: Compressor | None = None) -> bytes:
    # A fresh Packer per call keeps encode() safe to call from many threads. Its buffer starts
    # small: msgpack's default of 256 KiB costs a fresh allocation (~15 us) whenever a second
    # Packer runs inside default(), and the buffer grows by doubling for large arrays anyway.
    default = _default if compressor is None else functools.partial(_default, compressor=compressor)
    packer = msgpack.Packer(default=default, use_bin_type=True, strict_types=True, buf_size=1024)
    result: bytes = packer.pack(value)
    return result


# What msgpack writes for ExtType(EXT_NDARRAY, b""): the stand-in for a large array while the
# rest of the message is packed. A real array's payload is never empty (it has a header).
_STAND_IN = msgpack.ExtType(EXT_NDARRAY, b"")
_STAND_IN_BYTES = b"\xc7\x00" + bytes([EXT_NDARRAY])


def _pack_frame(body: dict[str, Any], compressor: Compressor | None = None) -> bytes:
    """Pack ``body``, copying each large array's data exactly once, into the frame itself.

    msgpack would copy a large array three times (``tobytes()``, the ext payload, its own
    buffer) plus once more into the result, each time into fresh memory. Instead the
    message is packed with a 3-byte stand-in for each large array, noting where it lands;
    then the frame is allocated at its final size and filled: the packed bytes around the
    stand-ins, and each array's ext header, array header and data (written by numpy, which
    also lays out non-contiguous and big-endian arrays on the way). Each large array's
    header is padded so that its data starts at a multiple of :data:`ALIGNMENT` from the
    start of the frame, where the decoder views it.

    With a ``compressor``, an array it compresses is packed as its compressed extension
    instead, however large.
    """
    large: list[tuple[int, np.ndarray[Any, Any], np.dtype[Any], bytes]] = []
    # default() reaches the packer through this list, emptied once packing ends: a closure
    # over the packer itself would make a cycle (packer -> default -> packer) on every call,
    # garbage that only the cyclic collector frees.
    packing: list[msgpack.Packer] = []

    def default(value: Any) -> Any:
        if (
            type(value) is not np.ndarray
            or value.nbytes < LARGE_ARRAY - LONGEST_HEADER
            or value.dtype.hasobject
        ):
            return _default(value, compressor)
        if compressor is not None:
            packed = compressor.pack(value)
            if packed is not None:
                return packed
        name = WIRE_NAME.get(value.dtype)
        if name is None:
            little = SWAPPED.get(value.dtype.str)
            if little is None:
                raise dtype_error(value.dtype)
            name = little.str
        if is_large(array_header(name, value.shape), value.nbytes):
            with packing[0].getbuffer() as packed:
                offset = packed.nbytes  # where msgpack writes what this call returns
            large.append((offset, value, LITTLE[name], unpadded_header(name, value.shape)))
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
            if len(header) + padding + array.nbytes < LARGE_ARRAY:
                padding += ALIGNMENT  # still large to the decoder, which views it in place
            head = header + bytes(padding)
            prefix = ext_prefix(len(head) + array.nbytes)
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


def _head(spec: Spec, message: Message) -> bytes:
    """The map header, "t" and tag of a message whose ``OMIT_NONE`` fields may be left out."""
    count = len(spec.fields) + 1
    for name in spec.omitted:
        if getattr(message, name) is None:
            count -= 1
    head = bytes([0x80 | count]) if count < 16 else b"\xde" + count.to_bytes(2, "big")
    return head + spec.tail


_SPECS_BY_TAG: dict[str, Spec] = {tag: spec_for(cls) for tag, cls in MESSAGE_TYPES.items()}
_SPECS_BY_CLASS: dict[type[Message], Spec] = {s.cls: s for s in _SPECS_BY_TAG.values()}


def _arrays_of(spec: Spec) -> int:
    kinds = {field.kind for field in spec.fields}
    if SPACE in kinds:
        return PLAIN_ARRAYS
    if ANY in kinds or any("numpy array" in field.expected for field in spec.fields):
        return ANY_ARRAYS
    return NO_ARRAYS


_ARRAYS_BY_TAG: dict[str, int] = {tag: _arrays_of(spec) for tag, spec in _SPECS_BY_TAG.items()}
_KNOWN_TAGS = ", ".join(sorted(_SPECS_BY_TAG))


def register(cls: type[Message]) -> None:
    """Carry ``cls``, a message type of a mode's own, from now on (on both sides).

    It joins :data:`aps.wire.messages.MESSAGE_TYPES` (see
    :func:`aps.wire.messages.register`) and the codec's tables: its fields are checked as
    every built-in type's are. A mode registers its types through
    :func:`aps.session.protocol.register_request`, which calls this.

    Raises:
        ConfigError: ``cls`` is no frozen message dataclass, or its tag is taken.
        TypeError: a field's annotation is one the codec cannot carry (the field is named).
    """
    global _KNOWN_TAGS
    if _SPECS_BY_CLASS.get(cls) is not None:
        return
    spec = spec_for(cls)  # before it is registered: a field the codec cannot carry refuses
    register_message(cls)
    _SPECS_BY_TAG[cls.TAG] = spec
    _SPECS_BY_CLASS[cls] = spec
    _ARRAYS_BY_TAG[cls.TAG] = _arrays_of(spec)
    _KNOWN_TAGS = ", ".join(sorted(_SPECS_BY_TAG))


def _type_name(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"a numpy array of dtype {value.dtype}"
    return type(value).__qualname__


def encode(
    message: Message, *, compressor: Compressor | None = None, frame_delta: bool = False
) -> bytes:
    """Encode one message as one frame.

    Arrays are copied into the frame; the message may be reused or mutated afterwards.

    Args:
        message: an instance of one of the types in :data:`aps.wire.messages.MESSAGE_TYPES`.
        compressor: the connection's negotiated compression (see :mod:`aps.wire.compression`),
            or ``None`` to send every array plain. A frame made with one decodes only where
            :func:`decode` is given its codec.
        frame_delta: the connection negotiated frame delta: a
            :class:`~aps.wire.messages.RolloutChunk` whose ``obs`` are frame stacks sends them
            as newest frames (see :mod:`aps.wire.frame_delta`), and so does each array of an
            ``obs`` that is a dict or tuple of arrays that is a frame stack; a frame made so
            decodes only where :func:`decode` is told.

    Returns:
        The frame, a msgpack map.

    Raises:
        WireError: the message is not a known message type, a field does not match its
            annotation, or a value cannot travel (a type or dtype outside the supported set,
            a map key that is not a str, an int beyond 64 bits); the message names the field.
        ConfigError: a space field holds a space type that cannot travel (see
            :mod:`aps.wire.spaces`).
    """
    spec = _SPECS_BY_CLASS.get(type(message))
    if spec is None:
        raise WireError(
            f"cannot encode {type(message).__qualname__}: not an aps message type; "
            f"known tags: {_KNOWN_TAGS}"
        )
    if compressor is not None and _ARRAYS_BY_TAG[spec.tag] == PLAIN_ARRAYS:
        compressor = None  # a space's bounds travel uncompressed: the decoder refuses them so
    placed = type(message).FRAME_DELTA if frame_delta else None
    if placed is not None:
        obs = getattr(message, placed)
        # Each array of a structured obs (a Dict or Tuple space's) is split on its own.
        delta = _frame_delta.split(obs) if type(obs) is np.ndarray else split_leaves(obs)
        if delta is not None:
            body = _body(spec, message)
            body[placed] = delta
            try:
                return _pack_frame(body, compressor)
            except Exception as exc:
                raise _locate(spec, body, exc) from exc
    frame = _pack_small(spec, message, containers=True)
    # A frame under the threshold holds no array worth compressing: the fast path's is final.
    if frame is not None and (compressor is None or len(frame) < compressor.threshold):
        return frame
    body = _body(spec, message)
    try:
        return _pack_frame(body, compressor)
    except Exception as exc:
        raise _locate(spec, body, exc) from exc


def _body(spec: Spec, message: Message) -> dict[str, Any]:
    """The map ``{"t": tag, field: value, ...}`` that encodes ``message``, its fields checked."""
    body: dict[str, Any] = {"t": spec.tag}
    for field in spec.fields:
        value = getattr(message, field.name)
        if value is None and field.name in spec.omitted:
            continue
        if field.kind == ANY:
            if type(value) not in LEAVES and not is_array(value):
                try:
                    check_tree(value, 0)
                except PathError as exc:
                    path = "".join(reversed(exc.path))
                    raise WireError(
                        f"cannot encode field {field.name!r} of {spec.cls.__name__}: "
                        f"{field.name}{path} {exc.problem}"
                    ) from None
        elif field.kind == SPACE:
            if not field.check(value):
                if not isinstance(value, gym.Space):
                    raise _field_error(spec, field, value, "encode")
                value = space_to_wire(value)
        elif not field.check(value):
            raise _field_error(spec, field, value, "encode")
        body[field.name] = value
    return body


def _field_error(spec: Spec, field: Field, value: Any, verb: str) -> WireError:
    return WireError(
        f"cannot {verb} field {field.name!r} of {spec.cls.__name__}: expected "
        f"{field.expected}, got {_type_name(value)}"
    )


def _locate(spec: Spec, body: dict[str, Any], exc: Exception) -> WireError:
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
# The writers it shares with pack_tree are in aps.wire._fast_pack.


def _pack_small(spec: Spec, message: Message, *, containers: bool = False) -> bytes | None:
    """The frame of ``message`` when every field holds a simple value that fits it, else ``None``.

    Simple values: ``None``, ``bool``, ``int`` and ``float`` (exact types), ``str``,
    ``bytes``, the empty dict, and numpy arrays of a wire dtype in native or little-endian
    order whose payload is under :data:`LARGE_ARRAY` bytes. With ``containers`` (as
    :func:`encode` calls it), also what :func:`pack_tree` writes: dicts, lists, tuples and
    object arrays of simple values and numpy scalars, such as a SameStep step's infos. A
    field's value must also pass the field's check (as in :func:`_body`). The frame is byte
    for byte what :func:`_pack_frame` makes of the message's body (the tests compare them);
    for anything else, including every value that fails its check or that msgpack or
    :func:`check_tree` would refuse, ``None`` leaves the work and the error to the generic
    path.
    """
    parts = [_head(spec, message) if spec.omitted else spec.head]
    append = parts.append
    for name, key, field_kind, check in spec.plan:
        value = getattr(message, name)
        if value is None and name in spec.omitted:
            continue
        if field_kind != ANY and not check(value):
            return None  # a space to describe, or a value of the wrong type: _body's work
        append(key)
        kind = type(value)
        if kind is np.ndarray:
            prefix = PREFIXES.get((value.dtype, value.shape))
            if prefix is None:
                prefix = array_prefix(value)
                if prefix is None:
                    if containers and pack_object_array(value, append, 0, 0):
                        continue
                    return None
            append(prefix)
            # tobytes() writes C order whatever the layout, as in _ext_array.
            append(value.tobytes())
        elif kind is int:
            packed = pack_int(value)
            if packed is None:
                return None
            append(packed)
        elif kind in ATOM_KINDS:
            if not pack_atom(value, kind, append):
                return None
        elif kind is dict and not value:
            append(b"\x80")
        elif not containers or not pack_tree(value, append, 0, 0):
            return None
    return b"".join(parts)


# --------------------------------------------------------------------------------------------
# Decoding (the ext hooks and the zero-copy walk are in aps.wire._unpack)


def decode(
    frame: Frame,
    *,
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    compression: str = "none",
    frame_delta: bool = False,
    rate: InflationRate | None = None,
) -> Message:
    """Decode one frame into the message it holds.

    The contract: for any input this returns a valid message or raises :class:`WireError`;
    whatever msgpack or numpy raise is chained as ``__cause__``. Every field is checked
    against its annotation (``int`` excludes ``bool``, ``float`` accepts ``int``, arrays of
    the ``Array`` fields have a numeric or bool dtype). Arrays in the message are read-only
    views of the frame's payload.

    What decoding costs is bounded by the frame before it is spent: see
    ``docs/security.md``. A map that holds a key twice is refused. Compressed and frame-delta
    arrays are inflated only in message types whose fields hold arrays (the frame's map
    must start with its tag, as :func:`encode` writes it), a space description's arrays
    never compressed; a :class:`~aps.wire.messages.Ready` whose envs' observations or actions
    could never fit a frame of ``max_frame_size`` is refused before its spaces are built.

    Args:
        frame: the bytes one transport frame carried.
        max_frame_size: the largest frame accepted, in bytes; checked before any parsing.
            The compressed arrays of one frame may inflate to this many bytes together.
        compression: the codec the connection negotiated (``"none"``: a compressed array
            is refused); see :mod:`aps.wire.compression`.
        frame_delta: whether the connection negotiated frame delta; without it a
            frame-delta array is refused, and with it one is accepted only as a
            :class:`~aps.wire.messages.RolloutChunk`'s ``obs`` or as an array of an ``obs`` that
            is a dict or tuple of arrays (see :mod:`aps.wire.frame_delta`), rebuilt only once it
            is known to be there. Rebuilt and inflated arrays share
            ``max_frame_size``.
        rate: the connection's :class:`InflationRate`, which inflated and rebuilt bytes are
            charged to as well (``None``: no rate, only the per-frame limit).

    Returns:
        The message, an instance of the type its tag names.

    Raises:
        FrameTooLarge: the frame is larger than ``max_frame_size``.
        WireError: the frame is not valid msgpack, has an unknown tag, lacks or adds fields,
            or holds values of the wrong type (a bad array header, an unknown dtype, a
            malformed space description, ...), or would inflate past ``rate``.
    """
    size = _frame_size(frame, max_frame_size)
    data: Frame = frame
    ext_hook = TOP_HOOK
    pending: list[_frame_delta.Pending] = []
    # A compressed array's ext code is a byte of the frame: a small frame without that byte
    # (most of a step's) needs no hook that inflates, which costs a few us to make.
    inflates = compression != "none" and may_hold(COMPRESSED_CODE, frame, size)
    rebuilds = frame_delta and may_hold(FRAME_DELTA_CODE, frame, size)
    if (inflates or rebuilds) and rate is not None:
        rate.frame(size)
    learns = False
    if size <= SCAN_FROM and type(frame) is bytes:
        # A small frame laid out as one decoded before (a worker's next chunk) is read
        # without msgpack; see aps.wire._layouts for why that is the same message. A layout
        # holds plain arrays only: nothing in such a frame is inflated or rebuilt.
        known = recognize(frame)
        if known is not None:
            return known
        learns = True
    allowance: Allowance | None = None
    tag: str | None = None
    if inflates or rebuilds:
        allowance = Allowance(max_frame_size, rate)
        tag = peek_tag(frame)
        arrays = _ARRAYS_BY_TAG.get(tag, -1) if tag is not None else -1
        spec = _SPECS_BY_TAG.get(tag) if tag is not None else None
        delta = spec is not None and spec.cls.FRAME_DELTA is not None
        ext_hook = inflating_hook(
            tag, arrays, delta, _delta_fields, compression, frame_delta, allowance, pending
        )
    if size > SCAN_FROM:
        # What decoding will allocate is charged before msgpack builds anything (a frame of
        # many small objects is refused), and the large arrays are found on the way. Only
        # bytes are viewed in place: a view of a caller's bytearray would not be read-only.
        found = scan(frame, size, find_large=type(frame) is bytes and size > LARGE_ARRAY)
        if found and isinstance(frame, bytes):
            data = with_references(frame, found)
            ext_hook = reference_hook(frame, found, ext_hook)
    try:
        # No container can hold more items than the frame has bytes.
        body = msgpack.unpackb(
            data,
            ext_hook=ext_hook,
            object_pairs_hook=str_keys,
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
    if pending:
        # Only the hook of a message type with a FRAME_DELTA field (a chunk's) makes
        # placeholders: where they are is all that is left to check before the work of
        # rebuilding one. They may sit at that field, or at leaves of a dict or tuple of
        # arrays it holds (a structured observation space's), each its own frame stack;
        # nowhere else.
        assert tag is not None  # a hook that makes placeholders was made for a known tag
        spec = _SPECS_BY_TAG[tag]
        field = spec.cls.FRAME_DELTA
        assert field is not None
        obs = body.get(field) if type(body) is dict else None
        placed = [obs] if type(obs) is _frame_delta.Pending else pending_leaves(obs)
        if len(placed) != len(pending) or not all(
            a is b for a, b in zip(placed, pending, strict=False)
        ):
            inside = {0: "none", 1: "one"}.get(len(placed), str(len(placed)))
            raise WireError(
                f"{tag} message holds {len(pending)} frame-delta arrays, {inside} of them its "
                f"{field} or an array of its {field}; only a {_words(spec.cls)}'s {field} (or "
                "an array of its dict or tuple) may travel as one"
            )
        keys = spec.names | {"t"}
        if keys - spec.omitted <= body.keys() <= keys:  # else _message names it
            body[field] = map_tree(rebuilt, obs, 0)
    if type(body) is dict and body.get("t") == Ready.TAG:
        check_ready(body, max_frame_size)
    message = _message(body, _SPECS_BY_TAG, _KNOWN_TAGS)
    if allowance is not None and rate is not None:
        rate.expanded += allowance.expanded
    if learns and type(frame) is bytes and _SPECS_BY_CLASS[type(message)].build is not None:
        learn(frame, message)
    return message


def _delta_fields() -> str:
    """Where frame-delta arrays may travel, for an error's text."""
    places = [
        f"a {_words(spec.cls)}'s {spec.cls.FRAME_DELTA}"
        for spec in _SPECS_BY_TAG.values()
        if spec.cls.FRAME_DELTA is not None
    ]
    return " or ".join(places) + " may travel as one"


def _words(cls: type[Message]) -> str:
    """``RolloutChunk`` as "rollout chunk": a message type's name in an error's text."""
    return re.sub(r"(?<!^)(?=[A-Z])", " ", cls.__name__).lower()


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
            object_pairs_hook=str_keys,
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


def _message(body: Any, specs: dict[str, Spec], known: str) -> Message:
    """The message a decoded frame body describes, every field checked."""
    if type(body) is not dict:
        raise WireError(f"a frame must hold a msgpack map, got {_type_name(body)}")
    tag = body.pop("t", None)
    spec = specs.get(tag) if type(tag) is str else None
    if spec is None:
        raise WireError(f"unknown message tag {tag!r:.80}; known tags: {known}")
    if spec.omitted and spec.required <= body.keys() <= spec.names:
        # Every field is there once the omitted ones are None.
        for name in spec.omitted:
            body.setdefault(name, None)
    elif body.keys() != spec.names:
        missing = sorted(spec.names - body.keys())
        extra = sorted(repr(k)[:80] for k in body.keys() - spec.names)
        raise WireError(
            f"{spec.tag} message has missing fields {missing} and extra fields {extra}; "
            "both sides must run the same aps release"
        )
    if spec.passes(body):
        fields: tuple[Field, ...] = ()  # every check passed (the loop below tells which not)
    else:
        fields = spec.fields
    for field in fields:
        if field.kind == ANY:
            continue
        value = body[field.name]
        if field.check(value):
            continue
        if field.kind == SPACE:
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
    if spec.build is not None:
        return spec.build(body)
    try:
        return spec.cls(**body)
    except Exception as exc:  # a message type with its own __post_init__ checks
        raise WireError(f"{spec.tag} message is invalid: {exc}") from exc
