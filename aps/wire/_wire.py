"""The layout of one numpy value on the wire, shared by the codec's encoders and decoders.

:mod:`aps.wire.codec` describes the wire format; this module holds what every part of it needs to
agree on: the extension codes, the dtype whitelist and its lookup tables, and the array
header ``[dtype.str, shape]`` that starts every array and scalar payload, both written
(:func:`array_header`, cached per dtype and shape) and parsed (:func:`parse_payload`, which checks
every byte before numpy sees any). It also fixes :data:`LARGE_ARRAY`, the payload size from
which an array is written aligned within the frame and decoded as a view of it.

The public constants are re-exported by :mod:`aps.wire.codec`, where users find them. Nothing here
imports the rest of the codec, so each of its parts can import this one.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, Final

import numpy as np

from aps.errors import WireError

# What aps.wire.codec (and aps.wire.compression) use; the module stays private by its file name.
__all__ = [
    "ALIGNMENT",
    "DTYPES",
    "EXT_COMPRESSED",
    "EXT_FRAME_DELTA",
    "EXT_NDARRAY",
    "EXT_OBJECT_ARRAY",
    "EXT_SCALAR",
    "LARGE_ARRAY",
    "LITTLE",
    "LONGEST_HEADER",
    "MAX_NDIM",
    "MAX_OBJECT_DEPTH",
    "MAX_PADDING",
    "SWAPPED",
    "WIRE_NAME",
    "Allowance",
    "InflationRate",
    "array_header",
    "data_offset",
    "dtype_error",
    "ext_prefix",
    "is_large",
    "parse_payload",
    "unpadded_header",
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

EXT_COMPRESSED: Final = 4
"""msgpack extension code of a compressed numpy array (see :mod:`aps.wire.compression`)."""

EXT_FRAME_DELTA: Final = 5
"""msgpack extension code of a chunk of frame stacks sent as newest frames (see
:mod:`aps.wire.frame_delta`)."""

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

LITTLE: dict[str, np.dtype[Any]] = {
    np.dtype(name).newbyteorder("<").str: np.dtype(name).newbyteorder("<") for name in DTYPES
}
# Equal dtypes hash equally, so native-order and little-endian dtypes find the same name.
WIRE_NAME: dict[np.dtype[Any], str] = {dtype: name for name, dtype in LITTLE.items()}
# Big-endian inputs are sent as their little-endian twins.
SWAPPED: dict[str, np.dtype[Any]] = {
    dtype.newbyteorder(">").str: dtype for dtype in LITTLE.values() if dtype.itemsize > 1
}
# The decoder looks dtype strings up as the raw bytes of the header, skipping a utf-8 decode.
_BY_WIRE_NAME: dict[bytes, np.dtype[Any]] = {s.encode(): dtype for s, dtype in LITTLE.items()}
_PADDING = [b"\0" * (-k % 8) for k in range(8)]

_DTYPE_HINT = ", ".join(DTYPES)

INFLATION_PER_BYTE: Final = 4096
"""Bytes a frame may inflate and rebuild to per byte of it, whatever the rate (see
:class:`InflationRate`): a DETACH chunk of Pong frame stacks, zstd and frame delta, reaches
about 600 (``T=128, E=8``: 27.6 MiB from 47 KB)."""

INFLATION_PER_SECOND: Final = 64 * 2**20
"""Bytes per second one connection may inflate beyond :data:`INFLATION_PER_BYTE`."""

INFLATION_BURST: Final = 128 * 2**20
"""The most bytes one connection may inflate at once beyond :data:`INFLATION_PER_BYTE`."""

INFLATION_START: Final = 16 * 2**20
"""What a new connection's bucket holds (:class:`InflationRate`)."""


class InflationRate:
    """What one connection may inflate and rebuild over time: a token bucket of bytes.

    A frame's compressed and frame-delta arrays are bounded per frame by the
    :class:`Allowance`; this bounds them per second too, so that a peer holding the token
    cannot keep the receiver inflating (each frame a loop stall and fresh memory) by sending
    small frames of highly compressible arrays. Every frame earns ``per_byte`` bytes of
    inflation per byte it has, spent on that frame or lost; beyond that a frame spends from a
    bucket that holds at most ``burst`` bytes and refills at ``per_second`` bytes per second.

    The defaults leave honest traffic far inside: a DETACH chunk of Pong frame stacks
    inflates and rebuilds to about 600x its bytes, weights and MuJoCo observations to about
    1.5x; a peer's frames that inflate over 4,096x at over 64 MiB/s are refused. A sender
    of 64 KB/s of hostile frames makes the receiver inflate at most
    ``64 KB x per_byte + per_second`` bytes a second (320 MiB/s). The bucket starts with
    ``start`` bytes (what an honest peer's first frames may need before it filled: arrays
    of zeros compress 10,000x) and fills from the moment the connection is made, so a peer
    that reconnects gains little.

    One object per connection, used from one thread (its session's event loop).
    """

    __slots__ = (
        "burst",
        "clock",
        "credit",
        "expanded",
        "last",
        "per_byte",
        "per_second",
        "tokens",
    )

    def __init__(
        self,
        *,
        per_byte: int = INFLATION_PER_BYTE,
        per_second: int = INFLATION_PER_SECOND,
        burst: int = INFLATION_BURST,
        start: int = INFLATION_START,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.per_byte = per_byte
        self.per_second = per_second
        self.burst = burst
        self.clock = clock
        self.tokens = float(min(start, burst))
        self.last = clock()
        self.credit = 0
        self.expanded = 0
        """Bytes the connection's compressed and frame-delta arrays grew by when rebuilt,
        all frames (their full size less their payload): a frame's size at full width is
        its wire size plus what it added here (the learner's ``bytes_received_raw``)."""

    def frame(self, size: int) -> None:
        """A frame of ``size`` bytes arrived: refill the bucket, and give it its own credit."""
        now = self.clock()
        self.tokens = min(float(self.burst), self.tokens + (now - self.last) * self.per_second)
        self.last = now
        self.credit = self.per_byte * size

    def spend(self, nbytes: int, what: str) -> None:
        """Charge ``nbytes`` of inflation for ``what`` (named in the error).

        Raises:
            WireError: the frame's credit and the bucket together hold fewer than ``nbytes``;
                nothing is charged then.
        """
        if nbytes <= self.credit:
            self.credit -= nbytes
            return
        rest = nbytes - self.credit
        if rest > self.tokens:
            raise WireError(
                f"{what} would inflate {nbytes} bytes, over the {self.credit + int(self.tokens)} "
                f"bytes this connection may inflate now ({self.per_byte} per byte received, "
                f"plus {self.per_second} per second up to {self.burst}); the peer sends "
                "compressed arrays that inflate faster than any aps peer does: it is not a "
                "compatible aps peer, or its arrays should travel uncompressed "
                "(compression='none')"
            )
        self.credit = 0
        self.tokens -= rest


class Allowance:
    """What the arrays of one frame may still inflate or rebuild to, in bytes.

    Compressed arrays (:mod:`aps.wire.compression`) and frame-delta arrays
    (:mod:`aps.wire.frame_delta`) allocate more than their bytes on the wire; each declares its
    size, which is charged here before anything is allocated, so that together they stay
    within the receiving side's frame limit, and to the connection's :class:`InflationRate`
    (when given), so that they stay within its rate.
    """

    __slots__ = ("expanded", "left", "limit", "rate")

    def __init__(self, limit: int, rate: InflationRate | None = None) -> None:
        self.limit = limit
        self.left = limit
        self.rate = rate
        self.expanded = 0
        """Bytes the frame's arrays grew by when rebuilt (full size less payload), noted by
        the code that rebuilds them; added to the rate's count once the frame decoded."""

    def take(self, nbytes: int, what: str) -> None:
        """Charge ``nbytes`` for ``what`` (named in the error).

        Raises:
            WireError: fewer than ``nbytes`` are left, of the frame's limit or of the rate.
        """
        if nbytes > self.left:
            raise WireError(
                f"{what} declares {nbytes} bytes, over the {self.left} bytes left of this "
                f"side's limit of {self.limit} bytes per frame; raise max_frame_size on both "
                "sides if such arrays are intended"
            )
        if self.rate is not None:
            self.rate.spend(nbytes, what)
        self.left -= nbytes


def dtype_error(dtype: np.dtype[Any]) -> WireError:
    return WireError(
        f"cannot encode numpy dtype {dtype} ({dtype.str!r}); supported dtypes: {_DTYPE_HINT} "
        "(and object arrays of supported values); convert with .astype() first"
    )


# --------------------------------------------------------------------------------------------
# Array headers, written


def array_header(name: str, shape: tuple[int, ...]) -> bytes:
    """The msgpack bytes of ``[name, shape]`` plus zero bytes up to a multiple of 8, cached.

    Packing it with msgpack would need a second Packer while the outer one runs, and each
    Packer allocates its buffer: the hand-built header keeps encoding a small array ~10x
    cheaper.
    """
    key = (name, shape)
    header = _HEADERS.get(key)
    if header is not None:
        return header
    header = unpadded_header(name, shape)
    header += _PADDING[len(header) % 8]
    if len(_HEADERS) >= 4096:  # shapes vary little in practice; bound the cache anyway
        _HEADERS.clear()
    _HEADERS[key] = header
    return header


@functools.lru_cache(maxsize=4096)  # each large array of a frame needs it: build it once
def unpadded_header(name: str, shape: tuple[int, ...]) -> bytes:
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
_NAME_PREFIX = {name: b"\x92" + bytes([0xA0 | len(name)]) + name.encode() for name in LITTLE}

# Arrays whose payload (header and data) is at least this many bytes are not copied into
# msgpack's buffer: the frame is assembled once around them (see codec._pack_frame), and decode()
# views them in the frame.
LARGE_ARRAY = 64 * 2**10
# The longest array header: the dtype, and up to MAX_NDIM dims of up to 9 bytes each.
LONGEST_HEADER = 16 + 9 * MAX_NDIM


def is_large(header: bytes, nbytes: int) -> bool:
    """Whether an array travels as a large array, aligned within the frame.

    ``header`` is its :func:`array_header`. An array is large when its payload, packed inline,
    would be :data:`LARGE_ARRAY` bytes or more: the size at which the decoder views an
    array in the frame instead of in a copy.
    """
    return len(header) + nbytes >= LARGE_ARRAY


def ext_prefix(length: int) -> bytes:
    """The msgpack ext header of an EXT_NDARRAY payload of ``length`` bytes (over 255)."""
    if length <= 0xFFFF:
        return b"\xc8" + length.to_bytes(2, "big") + bytes([EXT_NDARRAY])
    if length <= 0xFFFFFFFF:
        return b"\xc9" + length.to_bytes(4, "big") + bytes([EXT_NDARRAY])
    raise ValueError(f"an array of {length} bytes is too large for a msgpack ext (4 GiB - 1)")


# --------------------------------------------------------------------------------------------
# Array headers, read


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
            f"supported: {', '.join(s for s in LITTLE)}"
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


def parse_payload(data: bytes) -> tuple[np.dtype[Any], tuple[int, ...], int, int]:
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


def data_offset(
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
