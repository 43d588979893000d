"""The sans-I/O length-prefix framing: headers, the decoder, buffer views."""

from __future__ import annotations

import array
import ast
import itertools
import pathlib
import struct

import pytest
from hypothesis import given, settings, strategies as st

import aps.framing
from aps.errors import ConfigError, FrameTooLarge
from aps.framing import (
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
    tree = ast.parse(pathlib.Path(aps.framing.__file__).read_text())
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
