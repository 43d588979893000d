"""Hostile peers against a live learner."""

from __future__ import annotations

import asyncio
import contextlib
import struct

import aps
from aps import codec
from aps.framing import FrameDecoder
from aps.messages import Challenge, Goodbye, Message

MAX_FRAME = 64 * 2**10


def decode_all(data: bytes) -> list[Message]:
    decoder = FrameDecoder(MAX_FRAME)
    decoder.feed(data)
    frames = list(decoder)
    assert decoder.at_boundary, f"the learner sent a partial frame: {data!r}"
    return [codec.decode(f) for f in frames]


async def read_to_eof(reader: asyncio.StreamReader, seconds: float, what: str) -> bytes:
    """Everything until the learner closes; a reset counts as closed."""
    received = bytearray()
    try:
        async with asyncio.timeout(seconds):
            while chunk := await reader.read(65536):
                received += chunk
    except (ConnectionResetError, BrokenPipeError):  # a write after the learner closed
        pass
    except TimeoutError:
        raise AssertionError(f"{what} was still open {seconds} s after its last byte") from None
    return bytes(received)


def host_port(url: str) -> tuple[str, int]:
    host, port = url.split("://", 1)[1].rstrip("/").rsplit(":", 1)
    return host, int(port)


async def goodbye_reason(url: str, data: bytes, *, half_close: bool) -> str:
    """Answer a learner's Challenge with ``data``; return the reason of its Goodbye."""
    reader, writer = await asyncio.open_connection(*host_port(url))
    try:
        async with asyncio.timeout(10):
            (length,) = struct.unpack("<I", await reader.readexactly(4))
            assert isinstance(codec.decode(await reader.readexactly(length)), Challenge)
        writer.write(data)
        if half_close:
            writer.write_eof()
        received = await read_to_eof(reader, 10.0, "the refused connection")
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    [goodbye] = decode_all(received)
    assert isinstance(goodbye, Goodbye), goodbye
    return goodbye.reason


async def test_a_peer_refused_without_a_reject_is_told_why_in_its_goodbye() -> None:
    # Regression: a silent, truncated or closed handshake used to end with an empty Goodbye,
    # so the peer never learned what the learner logged.
    timeouts = aps.Timeouts(connect=5.0, handshake=0.5, step=5.0)
    async with aps.Learner("tcp://127.0.0.1:0", num_workers=1, timeouts=timeouts) as learner:
        silent = await goodbye_reason(learner.url, b"", half_close=False)
        assert silent.startswith("Timeout: no hello from tcp://127.0.0.1:"), silent
        assert "within 0.5 s" in silent
        truncated = await goodbye_reason(learner.url, b"\x10\x00", half_close=True)
        assert truncated.startswith("ConnectionLost: "), truncated
        assert "in the middle of a frame (2 of 4 bytes arrived)" in truncated
        closed = await goodbye_reason(learner.url, b"", half_close=True)
        assert closed.startswith("EndOfStream: ") and "closed the connection" in closed
