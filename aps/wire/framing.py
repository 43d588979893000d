"""Length-prefix framing for byte-stream transports, without I/O.

A byte stream (TCP, a Unix socket, a pipe) has no message boundaries, so each frame travels
behind a header: its length as a 4-byte little-endian unsigned integer. Frames are therefore
at most ``2**32 - 1`` bytes; a transport usually sets a much lower ``max_frame_size``.

Sending is :func:`encode_frame` (or :func:`frame_header` followed by the payload, which avoids
copying a large payload). Receiving is a :class:`FrameDecoder`: feed it whatever bytes arrived
(or let the reader write straight into its buffers, as :class:`asyncio.BufferedProtocol`
does), then take whole frames out. The decoder checks each header against its limit before it
allocates the body, so a peer cannot make it allocate more than the limit.

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

import collections
import struct
from collections.abc import Iterator

from aps._base._buffers import allocate, seal
from aps._base._typing import Frame
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

# The decoder's reused buffer for headers and small frames. Many small frames arrive in one
# read of up to this size; consumed bytes are only moved once the room left drops below
# _MIN_READ, so the cost stays linear in the bytes received.
_SCRATCH_SIZE = 256 * 2**10
_MIN_READ = 64 * 2**10

# A frame longer than this gets a buffer of its own, read into directly. Smaller frames are
# copied out of the scratch buffer once whole (one small copy each).
_OWN_BUFFER_AFTER = 64 * 2**10


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

    Bytes go in one of two ways, which may be mixed:

    - :meth:`feed` copies a chunk read from the stream into the decoder;
    - :meth:`get_buffer` and :meth:`buffer_updated` let the reader write straight into the
      decoder's memory, as :class:`asyncio.BufferedProtocol` does: the bytes of a large
      frame then land in the frame's own buffer, allocated once at its announced size, and
      are never copied again.

    Then call :meth:`next_frame` until it returns ``None`` (or iterate over the decoder,
    which does the same). The decoder keeps any partial frame between calls, so a cancelled
    read loses nothing.

    Frames up to 64 KiB are assembled in one reused 256 KiB buffer and copied out when whole
    (many small frames may arrive in one read). A larger frame gets a buffer of its own as
    soon as its header is parsed, after the header is checked against the limit.

    Args:
        max_frame_size: the largest frame accepted, in bytes. A header announcing more makes
            :meth:`next_frame` raise :class:`~aps.errors.FrameTooLarge` (after the frames
            before it) before any of the body is buffered; the decoder is then unusable,
            since the stream position is lost.

    Raises:
        ConfigError: ``max_frame_size`` is not an int between 1 and :data:`MAX_FRAME_LENGTH`.
    """

    __slots__ = (
        "_body",
        "_body_view",
        "_end",
        "_error",
        "_expected",
        "_filled",
        "_max_frame_size",
        "_ready",
        "_ready_bytes",
        "_reported",
        "_scratch",
        "_scratch_view",
        "_start",
    )

    def __init__(self, max_frame_size: int) -> None:
        self._max_frame_size = check_max_frame_size(max_frame_size)
        # Small frames and headers: the unread bytes are _scratch[_start:_end]. Allocated
        # on first use; bytearray(n) costs no memory until it is written.
        self._scratch = bytearray()
        self._scratch_view = memoryview(self._scratch)
        self._start = 0
        self._end = 0
        # The body length of the small frame whose header was already consumed, or None.
        self._expected: int | None = None
        # The large frame being filled: its buffer, a view of it, and the bytes written.
        self._body: bytes | bytearray | None = None
        self._body_view: memoryview | None = None
        self._filled = 0
        # Whole frames not yet returned, and their total length.
        self._ready: collections.deque[bytes] = collections.deque()
        self._ready_bytes = 0
        self._error: FrameTooLarge | None = None
        self._reported = False

    @property
    def max_frame_size(self) -> int:
        """The largest frame accepted, in bytes; a new limit applies to headers not yet read.

        Raises:
            ConfigError: (on assignment) not an int between 1 and :data:`MAX_FRAME_LENGTH`.
        """
        return self._max_frame_size

    @max_frame_size.setter
    def max_frame_size(self, value: int) -> None:
        self._max_frame_size = check_max_frame_size(value)

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as frames (headers included)."""
        partial = self._end - self._start
        if self._expected is not None:
            partial += HEADER_SIZE
        if self._body is not None:
            partial += HEADER_SIZE + self._filled
        return self.ready_bytes + partial

    @property
    def ready_bytes(self) -> int:
        """Bytes of the whole frames not yet returned, headers included.

        A reader that pauses above some amount bounds the memory a slow consumer costs,
        without ever pausing in the middle of a frame.
        """
        return self._ready_bytes + HEADER_SIZE * len(self._ready)

    @property
    def partial(self) -> tuple[int, int] | None:
        """``(arrived, expected)`` bytes of the header or body being read, or ``None``.

        For error messages about a stream that ended in the middle of a frame.
        """
        if self._body is not None:
            return self._filled, len(self._body)
        if self._expected is not None:
            return self._end - self._start, self._expected
        if self._start != self._end:
            return self._end - self._start, HEADER_SIZE
        return None

    @property
    def at_boundary(self) -> bool:
        """True when no partial frame is buffered: an end of stream here is a clean one."""
        return self._expected is None and self._body is None and self._start == self._end

    @property
    def failed(self) -> bool:
        """True once a header over ``max_frame_size`` arrived: bytes after it are dropped."""
        return self._error is not None

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Copy bytes read from the stream into the decoder.

        Raises:
            FrameTooLarge: an earlier call to :meth:`next_frame` already refused a header.
        """
        if self._reported:
            assert self._error is not None
            raise self._error
        view = frame_view(data)
        position, size = 0, view.nbytes
        while position < size:
            target = self.get_buffer()
            count = min(target.nbytes, size - position)
            target[:count] = view[position : position + count]
            self.buffer_updated(count)
            position += count

    def get_buffer(self) -> memoryview:
        """Return the (non-empty, writable) memory where the next bytes of the stream go.

        Write up to ``nbytes`` of it from its start, then call :meth:`buffer_updated`
        before calling this again. During a large frame, this is the rest of that frame's
        own buffer, so a read never takes bytes of the next frame.
        """
        if self._body_view is not None:
            return self._body_view[self._filled :]
        if not self._scratch:
            self._scratch = bytearray(_SCRATCH_SIZE)
            self._scratch_view = memoryview(self._scratch)
        elif self._end > _SCRATCH_SIZE - _MIN_READ:
            # Too little room left at the end: move the unread bytes (less than one small
            # frame) to the front.
            unread = self._end - self._start
            self._scratch_view[:unread] = self._scratch_view[self._start : self._end]
            self._start, self._end = 0, unread
        return self._scratch_view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        """Take the ``nbytes`` just written at the start of the last :meth:`get_buffer`.

        Never raises for a bad header: :meth:`next_frame` does, after the frames before it.
        """
        if self._error is not None:
            return  # the stream position is lost; nothing after the bad header is a frame
        if self._body is not None:
            self._filled += nbytes
            if self._filled == len(self._body):
                body = self._body
                self._body = None
                self._body_view = None
                self._filled = 0
                self._push(seal(body))
            return
        self._end += nbytes
        self._parse()

    def next_frame(self) -> bytes | None:
        """Return the next whole frame, or ``None`` until more bytes arrive.

        Raises:
            FrameTooLarge: the next header announces more than ``max_frame_size``; raised
                again by every later call.
        """
        if self._ready:
            frame = self._ready.popleft()
            self._ready_bytes -= len(frame)
            return frame
        if self._error is not None:
            self._reported = True
            raise self._error
        return None

    def __iter__(self) -> Iterator[bytes]:
        """Yield every whole frame buffered so far (see :meth:`next_frame`)."""
        while (frame := self.next_frame()) is not None:
            yield frame

    def _push(self, frame: bytes) -> None:
        self._ready.append(frame)
        self._ready_bytes += len(frame)

    def _parse(self) -> None:
        """Move every whole frame out of the scratch buffer; start a large one's buffer."""
        scratch, view = self._scratch, self._scratch_view
        start, end = self._start, self._end
        while True:
            length = self._expected
            if length is None:
                if end - start < HEADER_SIZE:
                    break
                (length,) = _HEADER.unpack_from(scratch, start)
                start += HEADER_SIZE
                if length > self._max_frame_size:
                    self._fail(FrameTooLarge(length, self._max_frame_size))
                    return
            if end - start >= length:
                self._push(view[start : start + length].tobytes())
                start += length
                self._expected = None
                continue
            if length > _OWN_BUFFER_AFTER:
                # Checked against the limit above: only now is the frame's memory allocated.
                body, body_view = allocate(length)
                have = end - start
                body_view[:have] = view[start:end]
                self._body, self._body_view, self._filled = body, body_view, have
                self._expected = None
                start = end
                break
            self._expected = length
            if start + length > _SCRATCH_SIZE:
                # The rest of this small frame would not fit behind it: make room now.
                unread = end - start
                view[:unread] = view[start:end]
                start, end = 0, unread
            break
        if start == end:
            start = end = 0  # everything consumed: reuse the buffer from its start
        self._start, self._end = start, end

    def _fail(self, error: FrameTooLarge) -> None:
        self._error = error
        self._expected = None
        self._start = self._end = 0
        # The body will never be read: free the memory now.
        self._scratch = bytearray()
        self._scratch_view = memoryview(self._scratch)
