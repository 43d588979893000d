"""Length-prefix framing for byte-stream transports, without I/O.

A byte stream (TCP, a Unix socket, a pipe) has no message boundaries, so each frame travels
behind a header: its length as a 4-byte little-endian unsigned integer. Frames are therefore
at most ``2**32 - 1`` bytes; a transport usually sets a much lower ``max_frame_size``.

Sending is :func:`encode_frame` (or :func:`frame_header` followed by the payload, which avoids
copying a large payload). Receiving is a :class:`FrameDecoder`: feed it whatever bytes arrived,
then take whole frames out. The decoder checks each header against its limit before it buffers
the body, so a peer cannot make it allocate more than one read's worth beyond the limit.

This module does no I/O and imports no event loop, so it is tested with plain function calls.

Example:
    >>> decoder = FrameDecoder(max_frame_size=1024)
    >>> wire = encode_frame(b"hello", max_frame_size=1024) + encode_frame(b"", max_frame_size=1024)
    >>> for i in range(len(wire)):  # one byte at a time: boundaries do not matter
    ...     decoder.feed(wire[i : i + 1])
    >>> list(decoder)
    [b'hello', b'']
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

from aps._typing import Frame
from aps.errors import ConfigError, FrameTooLarge

__all__ = [
    "HEADER_SIZE",
    "MAX_FRAME_LENGTH",
    "FrameDecoder",
    "check_max_frame_size",
    "encode_frame",
    "frame_header",
    "frame_view",
    "parse_header",
]

_HEADER = struct.Struct("<I")

HEADER_SIZE = _HEADER.size
"""Bytes in a frame header (4)."""

MAX_FRAME_LENGTH = 2**32 - 1
"""The largest length a header can announce, in bytes (4 GiB - 1)."""

# Once this many consumed bytes sit at the front of the decoder's buffer, they are dropped in
# one move. Compacting on every frame would copy the unread tail each time (quadratic when
# many small frames arrive in one read); compacting after a fixed amount keeps the cost
# linear while bounding the wasted memory.
_COMPACT_AFTER = 64 * 2**10


def check_max_frame_size(max_frame_size: int, *, ceiling: int = MAX_FRAME_LENGTH) -> int:
    """Validate a ``max_frame_size`` argument and return it.

    Raises:
        ConfigError: it is not an int between 1 and ``ceiling``.
    """
    if (
        isinstance(max_frame_size, bool)
        or not isinstance(max_frame_size, int)
        or not 1 <= max_frame_size <= ceiling
    ):
        raise ConfigError(
            f"max_frame_size must be an int between 1 and {ceiling} bytes, got {max_frame_size!r}"
        )
    return max_frame_size


def frame_view(frame: Frame) -> memoryview:
    """Return a flat, unsigned-byte view of ``frame`` without copying when possible.

    ``len()`` of a memoryview counts items, not bytes (a view of float32 data has four bytes
    per item), so transports measure and slice this view instead of the caller's object.
    A non-contiguous view is copied once, because sockets need contiguous memory.
    """
    view = memoryview(frame)
    if not view.c_contiguous:
        return memoryview(view.tobytes())
    if view.format == "B" and view.ndim == 1:
        return view
    return view.cast("B")


def frame_header(length: int) -> bytes:
    """Return the 4-byte header announcing a frame of ``length`` bytes.

    Raises:
        FrameTooLarge: ``length`` exceeds :data:`MAX_FRAME_LENGTH`.
        ConfigError: ``length`` is negative.
    """
    if length < 0:
        raise ConfigError(f"a frame length cannot be negative, got {length!r}")
    if length > MAX_FRAME_LENGTH:
        raise FrameTooLarge(length, MAX_FRAME_LENGTH)
    return _HEADER.pack(length)


def parse_header(header: bytes | bytearray | memoryview) -> int:
    """Return the frame length announced by a 4-byte header.

    Raises:
        ConfigError: ``header`` is not exactly :data:`HEADER_SIZE` bytes long.
    """
    if len(header) != HEADER_SIZE:
        raise ConfigError(
            f"a frame header is {HEADER_SIZE} bytes, got {len(header)}; "
            "pass exactly the first 4 bytes of a frame"
        )
    (length,) = _HEADER.unpack(header)
    return int(length)


def encode_frame(frame: Frame, *, max_frame_size: int = MAX_FRAME_LENGTH) -> bytes:
    """Return ``frame`` behind its header, as one new ``bytes`` object.

    This copies the payload once. Transports that send large payloads may prefer to write
    :func:`frame_header` and the payload separately.

    Raises:
        FrameTooLarge: the payload exceeds ``max_frame_size``.
    """
    view = frame_view(frame)
    if view.nbytes > max_frame_size:
        raise FrameTooLarge(view.nbytes, max_frame_size)
    return frame_header(view.nbytes) + view


class FrameDecoder:
    """Reassemble whole frames from arbitrarily split or merged chunks of a byte stream.

    Feed every chunk read from the stream to :meth:`feed`, then call :meth:`next_frame` until
    it returns ``None`` (or iterate over the decoder, which does the same). The decoder keeps
    any partial frame between calls, so a cancelled read loses nothing.

    Args:
        max_frame_size: the largest frame accepted, in bytes. A header announcing more makes
            :meth:`next_frame` raise :class:`~aps.errors.FrameTooLarge` before the body is
            buffered; the decoder is then unusable, since the stream position is lost.

    Raises:
        ConfigError: ``max_frame_size`` is not an int between 1 and :data:`MAX_FRAME_LENGTH`.
    """

    __slots__ = ("_buffer", "_error", "_expected", "_max_frame_size", "_offset")

    def __init__(self, max_frame_size: int) -> None:
        self._max_frame_size = check_max_frame_size(max_frame_size)
        self._buffer = bytearray()
        # Where the unread bytes start in _buffer: consuming a frame moves the offset
        # instead of shifting the rest of the buffer.
        self._offset = 0
        # The body length of the frame whose header was already consumed, or None.
        self._expected: int | None = None
        self._error: FrameTooLarge | None = None

    @property
    def max_frame_size(self) -> int:
        """The largest frame accepted, in bytes."""
        return self._max_frame_size

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as frames (a partial frame, headers included)."""
        pending = len(self._buffer) - self._offset
        return pending if self._expected is None else pending + HEADER_SIZE

    @property
    def at_boundary(self) -> bool:
        """True when no partial frame is buffered: an end of stream here is a clean one."""
        return self._expected is None and self._offset == len(self._buffer)

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Append bytes read from the stream.

        Raises:
            FrameTooLarge: an earlier call to :meth:`next_frame` already refused a header.
        """
        if self._error is not None:
            raise self._error
        self._buffer += data

    def next_frame(self) -> bytes | None:
        """Return the next whole frame, or ``None`` until more bytes are fed.

        Raises:
            FrameTooLarge: the next header announces more than ``max_frame_size``; raised
                again by every later call.
        """
        if self._error is not None:
            raise self._error
        buffer = self._buffer
        if self._expected is None:
            if len(buffer) - self._offset < HEADER_SIZE:
                self._compact()
                return None
            (length,) = _HEADER.unpack_from(buffer, self._offset)
            self._offset += HEADER_SIZE
            if length > self._max_frame_size:
                self._error = FrameTooLarge(length, self._max_frame_size)
                # The body will never be read: free the buffer now.
                self._buffer = bytearray()
                self._offset = 0
                raise self._error
            self._expected = length
        length = self._expected
        start = self._offset
        if len(buffer) - start < length:
            self._compact()
            return None
        # Slicing the bytearray itself would copy twice (a bytearray, then bytes).
        with memoryview(buffer) as view:
            frame = view[start : start + length].tobytes()
        self._offset = start + length
        self._expected = None
        self._compact()
        return frame

    def __iter__(self) -> Iterator[bytes]:
        """Yield every whole frame buffered so far (see :meth:`next_frame`)."""
        while (frame := self.next_frame()) is not None:
            yield frame

    def _compact(self) -> None:
        if self._offset == len(self._buffer):
            # Everything was consumed: reuse the allocation without copying anything.
            self._buffer.clear()
            self._offset = 0
        elif self._offset >= _COMPACT_AFTER:
            del self._buffer[: self._offset]
            self._offset = 0
