"""The sans-I/O length-prefix framing: headers, the decoder, buffer views."""

from __future__ import annotations

import array
import ast
import itertools
import pathlib
import struct
import sys

import pytest
from hypothesis import given, settings, strategies as st

import aps.wire.framing
from aps.errors import ConfigError, FrameTooLarge
from aps.wire.framing import (
    HEADER_SIZE,
    MAX_FRAME_LENGTH,
    FrameDecoder,
    check_max_frame_size,
    encode_frame,
    frame_header,
    frame_view,
    parse_header,
)

FRAMES = [b"hello", b"", b"\x00" * 7, bytes(range(256)), b"", b"x"]
WIRE = b"".join(encode_frame(frame) for frame in FRAMES)


def decode_chunks(chunks: list[bytes], limit: int = 1024) -> list[bytes]:
    decoder = FrameDecoder(limit)
    frames: list[bytes] = []
    for chunk in chunks:
        decoder.feed(chunk)
        frames.extend(decoder)
    assert decoder.at_boundary
    assert decoder.buffered == 0
    return frames


def test_header_is_four_bytes_little_endian() -> None:
    assert HEADER_SIZE == 4
    assert frame_header(0) == b"\x00\x00\x00\x00"
    assert frame_header(0x01020304) == b"\x04\x03\x02\x01"
    assert frame_header(MAX_FRAME_LENGTH) == b"\xff\xff\xff\xff"
    for n in (0, 1, 255, 256, 2**31, MAX_FRAME_LENGTH):
        assert parse_header(frame_header(n)) == n


def test_header_limits() -> None:
    with pytest.raises(FrameTooLarge) as info:
        frame_header(MAX_FRAME_LENGTH + 1)
    assert (info.value.size, info.value.limit) == (2**32, MAX_FRAME_LENGTH)
    with pytest.raises(ConfigError, match="negative"):
        frame_header(-1)
    with pytest.raises(ConfigError, match="4 bytes"):
        parse_header(b"\x00\x00\x00")


def test_encode_frame_checks_the_limit() -> None:
    assert encode_frame(b"abc", max_frame_size=3) == b"\x03\x00\x00\x00abc"
    with pytest.raises(FrameTooLarge, match="4 bytes exceeds the limit of 3 bytes"):
        encode_frame(b"abcd", max_frame_size=3)


def test_every_split_point() -> None:
    for i in range(len(WIRE) + 1):
        assert decode_chunks([WIRE[:i], WIRE[i:]]) == FRAMES, i


def test_every_pair_of_split_points() -> None:
    for i in range(len(WIRE) + 1):
        for j in range(i, len(WIRE) + 1, 7):
            assert decode_chunks([WIRE[:i], WIRE[i:j], WIRE[j:]]) == FRAMES, (i, j)


def test_byte_by_byte_and_all_at_once() -> None:
    assert decode_chunks([WIRE[i : i + 1] for i in range(len(WIRE))]) == FRAMES
    assert decode_chunks([WIRE]) == FRAMES
    assert decode_chunks([WIRE * 3]) == FRAMES * 3


def test_partial_state() -> None:
    decoder = FrameDecoder(100)
    assert decoder.at_boundary
    decoder.feed(b"\x05\x00")
    assert decoder.next_frame() is None
    assert not decoder.at_boundary
    assert decoder.buffered == 2
    decoder.feed(b"\x00\x00ab")
    assert decoder.next_frame() is None
    assert decoder.buffered == 6  # header (consumed, still counted) plus two body bytes
    decoder.feed(memoryview(b"cde"))
    assert decoder.next_frame() == b"abcde"
    assert decoder.at_boundary
    assert decoder.next_frame() is None


def test_oversized_header_is_refused_before_the_body() -> None:
    decoder = FrameDecoder(max_frame_size=10)
    decoder.feed(encode_frame(b"0123456789"))  # exactly the limit: fine
    decoder.feed(frame_header(11))  # only the header of a too-large frame
    assert decoder.next_frame() == b"0123456789"
    with pytest.raises(FrameTooLarge) as info:
        decoder.next_frame()
    assert (info.value.size, info.value.limit) == (11, 10)
    assert decoder.buffered == 0  # nothing kept
    # The stream position is lost: the decoder stays failed.
    with pytest.raises(FrameTooLarge):
        decoder.next_frame()
    with pytest.raises(FrameTooLarge):
        decoder.feed(b"more")


def test_huge_announced_size_allocates_nothing() -> None:
    decoder = FrameDecoder(max_frame_size=2**20)
    decoder.feed(frame_header(MAX_FRAME_LENGTH))
    with pytest.raises(FrameTooLarge, match="4294967295 bytes exceeds the limit of 1048576"):
        list(decoder)


def test_many_small_frames_in_one_large_chunk_compact_the_buffer() -> None:
    frames = [bytes([i % 256]) * (i % 50) for i in range(20_000)]
    wire = b"".join(encode_frame(frame) for frame in frames)
    # A trailing partial frame keeps the buffer from being cleared outright, so consumed
    # bytes must be dropped by compaction.
    decoder = FrameDecoder(1000)
    decoder.feed(wire + frame_header(3) + b"a")
    assert list(decoder) == frames
    assert decoder.buffered == 5
    decoder.feed(b"bc")
    assert list(decoder) == [b"abc"]


def test_max_frame_size_validation() -> None:
    assert check_max_frame_size(1) == 1
    assert check_max_frame_size(MAX_FRAME_LENGTH) == MAX_FRAME_LENGTH
    for bad in (0, -1, True, 1.5, "10", MAX_FRAME_LENGTH + 1, None):
        with pytest.raises(ConfigError, match="max_frame_size must be an int between 1 and"):
            check_max_frame_size(bad)  # type: ignore[arg-type]
    assert check_max_frame_size(2**40, ceiling=2**62) == 2**40
    with pytest.raises(ConfigError):
        FrameDecoder(0)


def test_frame_view_counts_bytes_not_items() -> None:
    words = memoryview(array.array("I", range(10)))
    assert len(words) == 10
    view = frame_view(words)
    assert view.nbytes == len(view) == 40
    assert view.format == "B"
    assert frame_view(b"abc").obj == b"abc"  # no copy for bytes
    grid = memoryview(bytes(range(12))).cast("B", (3, 4))
    assert frame_view(grid).tobytes() == bytes(range(12))
    strided = memoryview(bytes(range(10)))[::3]
    assert frame_view(strided).tobytes() == bytes([0, 3, 6, 9])
    assert encode_frame(words) == struct.pack("<I", 40) + words.tobytes()


@settings(max_examples=200, deadline=None)
@given(
    frames=st.lists(st.binary(max_size=300), max_size=20),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=10),
)
def test_any_frames_any_chunking(frames: list[bytes], cuts: list[int]) -> None:
    wire = b"".join(encode_frame(frame) for frame in frames)
    points = sorted({0, len(wire), *(c % (len(wire) + 1) for c in cuts)})
    chunks = [wire[a:b] for a, b in itertools.pairwise(points)]
    assert decode_chunks(chunks, limit=300) == frames


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=200), limit=st.integers(min_value=1, max_value=64))
def test_arbitrary_bytes_yield_frames_or_frame_too_large(data: bytes, limit: int) -> None:
    decoder = FrameDecoder(limit)
    decoder.feed(data)
    try:
        frames = list(decoder)
    except FrameTooLarge as exc:
        assert exc.size > limit
    else:
        assert all(len(frame) <= limit for frame in frames)
        consumed = sum(HEADER_SIZE + len(frame) for frame in frames)
        assert consumed + decoder.buffered == len(data)


def test_framing_does_no_io() -> None:
    tree = ast.parse(pathlib.Path(aps.wire.framing.__file__).read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        (node.module or "").split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
    }
    assert not imported & {"asyncio", "socket", "ssl", "selectors", "trio", "anyio"}


# Reading straight into the decoder (get_buffer / buffer_updated, as asyncio.BufferedProtocol).


def read_into(decoder: FrameDecoder, data: bytes, most: int | None = None) -> None:
    """Write ``data`` the way a socket read does: at most ``most`` bytes per get_buffer()."""
    view = memoryview(data)
    while view.nbytes:
        target = decoder.get_buffer()
        assert target.nbytes > 0 and not target.readonly
        count = min(target.nbytes, view.nbytes, most or view.nbytes)
        target[:count] = view[:count]
        decoder.buffer_updated(count)
        view = view[count:]


LARGE = bytes(range(256)) * 300  # 76,800 bytes: over 64 KiB, so it gets a buffer of its own
MIXED = [b"a", LARGE, b"", b"xyz" * 1000, LARGE[::-1], b"z"]
MIXED_WIRE = b"".join(encode_frame(frame) for frame in MIXED)


def test_buffered_reads_split_at_every_byte_boundary() -> None:
    for i in range(len(WIRE) + 1):
        decoder = FrameDecoder(1024)
        read_into(decoder, WIRE[:i])
        read_into(decoder, WIRE[i:])
        assert list(decoder) == FRAMES, i
        assert decoder.at_boundary and decoder.buffered == 0


def test_buffered_reads_of_large_frames_split_anywhere() -> None:
    # Every boundary near the headers and the start and end of each large body, plus a
    # stride through the rest.
    edges: set[int] = set()
    position = 0
    for frame in MIXED:
        for anchor in (position, position + HEADER_SIZE, position + HEADER_SIZE + len(frame)):
            edges.update(range(max(0, anchor - 6), anchor + 7))
        position += HEADER_SIZE + len(frame)
    edges.update(range(0, len(MIXED_WIRE), 997))
    for i in sorted(e for e in edges if e <= len(MIXED_WIRE)):
        decoder = FrameDecoder(len(LARGE))
        read_into(decoder, MIXED_WIRE[:i])
        read_into(decoder, MIXED_WIRE[i:])
        assert list(decoder) == MIXED, i


def test_buffered_reads_byte_by_byte_and_in_odd_sizes() -> None:
    for most in (1, 3, 4096, 65_537, None):
        decoder = FrameDecoder(len(LARGE))
        read_into(decoder, MIXED_WIRE, most)
        frames = list(decoder)
        assert frames == MIXED, most
        assert all(type(frame) is bytes for frame in frames)


def test_a_large_frame_is_read_into_its_own_buffer_and_no_further() -> None:
    decoder = FrameDecoder(2**20)
    read_into(decoder, encode_frame(b"s") + frame_header(len(LARGE)) + LARGE[:10])
    assert decoder.next_frame() == b"s"
    target = decoder.get_buffer()
    # The rest of the large frame exactly: a read cannot take bytes of the next frame.
    assert target.nbytes == len(LARGE) - 10
    assert decoder.partial == (10, len(LARGE))
    assert decoder.buffered == HEADER_SIZE + 10
    target[:] = LARGE[10:]
    decoder.buffer_updated(target.nbytes)
    assert decoder.ready_bytes == HEADER_SIZE + len(LARGE)
    assert decoder.next_frame() == LARGE
    assert decoder.at_boundary and decoder.partial is None and decoder.ready_bytes == 0


def test_many_frames_in_one_buffered_read() -> None:
    frames = [bytes([i % 256]) * (i % 37) for i in range(30_000)]
    wire = b"".join(encode_frame(frame) for frame in frames)
    decoder = FrameDecoder(100)
    read_into(decoder, wire)
    assert decoder.ready_bytes == len(wire)
    assert list(decoder) == frames


def test_buffered_frames_at_the_limit_and_one_over() -> None:
    decoder = FrameDecoder(len(LARGE))
    read_into(decoder, encode_frame(LARGE) + frame_header(len(LARGE) + 1) + b"never read")
    assert decoder.failed
    assert decoder.next_frame() == LARGE  # the frame before the bad header still arrives
    with pytest.raises(FrameTooLarge) as info:
        decoder.next_frame()
    assert (info.value.size, info.value.limit) == (len(LARGE) + 1, len(LARGE))
    assert decoder.buffered == 0 and decoder.partial is None  # nothing kept, nothing allocated
    read_into(decoder, b"more bytes are dropped")
    with pytest.raises(FrameTooLarge):
        decoder.next_frame()


def test_partial_reports_the_header_or_body_being_read() -> None:
    decoder = FrameDecoder(100)
    assert decoder.partial is None
    read_into(decoder, b"\x05\x00")
    assert decoder.partial == (2, HEADER_SIZE)
    read_into(decoder, b"\x00\x00ab")
    assert decoder.partial == (2, 5)
    read_into(decoder, b"cde")
    assert decoder.partial is None
    assert decoder.next_frame() == b"abcde"


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([0, 1, 5, 300, 70_000, 200_000]), max_size=8),
    reads=st.lists(st.integers(min_value=1, max_value=300_000), max_size=20),
)
def test_any_frames_any_buffered_reads(sizes: list[int], reads: list[int]) -> None:
    frames = [bytes([i + 1]) * size for i, size in enumerate(sizes)]
    wire = memoryview(b"".join(encode_frame(frame) for frame in frames))
    decoder = FrameDecoder(200_000)
    for most in [*reads, len(wire)]:
        part, wire = wire[:most], wire[most:]
        read_into(decoder, bytes(part))
    assert list(decoder) == frames
    assert decoder.at_boundary


def test_large_frames_are_filled_in_place_or_copied_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import aps._base._buffers

    data, view = aps._base._buffers.allocate(len(LARGE))
    view[:] = LARGE
    del view
    sealed = aps._base._buffers.seal(data)
    assert type(sealed) is bytes and sealed == LARGE
    if sys.implementation.name == "cpython":
        assert sealed is data  # filled in place: one allocation, no copy
    # Without in-place filling (other interpreters) the frames are the same, copied once.
    monkeypatch.setattr(aps._base._buffers, "_FILLABLE", None)
    decoder = FrameDecoder(len(LARGE))
    read_into(decoder, MIXED_WIRE, 5000)
    frames = list(decoder)
    assert frames == MIXED and all(type(frame) is bytes for frame in frames)
