"""Fragmented WebSocket messages: assembled as they arrive, within the frame size limit.

A plain ``websockets`` client on 127.0.0.1 sends the fragments, so that their sizes, their
order and their timing are the test's to choose; an aps listener receives them.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect

import aps.transports._websocket_connections as connections
import aps.transports.websocket as ws
from aps.errors import ConnectionLost, FrameTooLarge, TransportClosed
from aps.testing import until
from aps.transports.websocket import (
    _DIRECT,
    FRAGMENT_SIZE,
    WebSocketFactory,
    WebSocketTransport,
)

DEADLINE = 10.0  # seconds for any one network wait


@contextlib.asynccontextmanager
async def raw_to_aps(
    limit: int = 64 * 2**20,
) -> AsyncIterator[tuple[ClientConnection, WebSocketTransport]]:
    """A plain websockets client connected to an aps listener; the accepted aps transport."""
    async with asyncio.timeout(DEADLINE):
        listener = await WebSocketFactory(max_frame_size=limit).listen("ws://127.0.0.1:0")
    async with listener:
        async with asyncio.timeout(DEADLINE):
            raw = await connect(listener.url, max_size=None, compression=None, **_DIRECT)
            server = await listener.accept()
        try:
            yield raw, server
        finally:
            async with asyncio.timeout(DEADLINE):
                await raw.close()
                await server.aclose()


def cut(message: bytes, sizes: list[int]) -> Iterator[bytes]:
    """``message`` in pieces of ``sizes`` (the last piece takes the rest)."""
    start = 0
    for size in sizes:
        yield message[start : start + size]
        start += size
    yield message[start:]


@pytest.fixture
def allocations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes the websocket transport asks aps._base._buffers for, in order."""
    sizes: list[int] = []
    real = connections.allocate

    def spy(size: int) -> Any:
        sizes.append(size)
        return real(size)

    monkeypatch.setattr(connections, "allocate", spy)
    return sizes


async def receive(transport: WebSocketTransport) -> bytes:
    async with asyncio.timeout(DEADLINE):
        return await transport.receive()


async def test_fragmented_messages_of_every_shape_arrive_whole(allocations: list[int]) -> None:
    rng = random.Random(21)
    base = rng.randbytes(3 * FRAGMENT_SIZE + 5)
    same = rng.randbytes(len(base))
    longer = rng.randbytes(len(base) + FRAGMENT_SIZE // 2)
    shorter = rng.randbytes(len(base) - 7)
    uneven = rng.randbytes(len(shorter))
    plan = [
        (base, [FRAGMENT_SIZE] * 3),  # the first: joined (no size to expect yet)
        (same, [FRAGMENT_SIZE] * 3),  # the same size: into a buffer of that size
        (longer, [FRAGMENT_SIZE] * 3),  # longer than that buffer: joined instead
        (shorter, [FRAGMENT_SIZE] * 3),  # shorter: copied out of the buffer
        (uneven, [1, 0, 70_000, 3, FRAGMENT_SIZE + 9]),  # odd pieces, an empty one too
        (b"whole", []),  # a single-frame message between fragmented ones
        (same, [len(same) - 1]),  # a first piece over the expected size: joined
    ]
    async with raw_to_aps() as (raw, server):
        for message, sizes in plan:
            async with asyncio.timeout(DEADLINE):
                await raw.send(cut(message, sizes) if sizes else message)
            got = await receive(server)
            assert type(got) is bytes
            assert got == message
    # A buffer of the previous fragmented message's size was taken whenever the message
    # could still be of that size: for the second to the fifth.
    assert allocations == [len(base), len(base), len(longer), len(shorter)]


async def test_control_frames_between_fragments_do_not_break_the_message() -> None:
    message = random.Random(5).randbytes(2 * FRAGMENT_SIZE + 1)
    release = asyncio.Event()

    async def pieces() -> AsyncIterator[bytes]:
        yield message[:FRAGMENT_SIZE]
        await release.wait()
        yield message[FRAGMENT_SIZE:]

    async with raw_to_aps() as (raw, server):
        sending = asyncio.create_task(raw.send(pieces()))
        await asyncio.sleep(0.05)
        async with asyncio.timeout(DEADLINE):
            await (await raw.ping())  # answered by the listener in the middle of the message
        release.set()
        assert await receive(server) == message
        await sending


async def test_a_receive_cancelled_in_the_middle_of_a_message_loses_nothing() -> None:
    message = random.Random(6).randbytes(3 * FRAGMENT_SIZE)
    release = asyncio.Event()

    async def pieces() -> AsyncIterator[bytes]:
        yield message[:FRAGMENT_SIZE]
        await release.wait()
        yield message[FRAGMENT_SIZE:]

    async with raw_to_aps() as (raw, server):
        sending = asyncio.create_task(raw.send(pieces()))
        waiting = asyncio.create_task(server.receive())
        gatherer = server._connection.aps_gatherer  # type: ignore[union-attr]
        await until(lambda: gatherer._size > 0, DEADLINE)  # the first fragment has arrived
        assert not waiting.done()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        release.set()
        assert await receive(server) == message
        async with asyncio.timeout(DEADLINE):
            await sending
            await raw.send(b"next")
        assert await receive(server) == b"next"


async def test_fragments_over_the_limit_are_refused_before_anything_that_large_is_allocated(
    allocations: list[int],
) -> None:
    limit = 3 * FRAGMENT_SIZE
    async with raw_to_aps(limit=limit) as (raw, server):
        first = bytes(limit)  # at the limit: received, and its size becomes the expected one
        await raw.send(cut(first, [FRAGMENT_SIZE] * 2))
        assert await receive(server) == first
        server.max_frame_size = 2 * FRAGMENT_SIZE  # now the expected size is over the limit
        # Fragments adding up to more than the limit: refused on the fragment that crosses it.
        with contextlib.suppress(Exception):  # the listener closes the connection meanwhile
            async with asyncio.timeout(DEADLINE):
                await raw.send(cut(bytes(limit), [FRAGMENT_SIZE] * 2))
        with pytest.raises(FrameTooLarge) as info:
            await receive(server)
        assert info.value.limit == 2 * FRAGMENT_SIZE
        with pytest.raises(TransportClosed):
            await receive(server)
    # Nothing was allocated for the refused message, and never more than the limit.
    assert allocations == []


async def test_an_unaccepted_connection_allocates_nothing_for_fragments(
    allocations: list[int],
) -> None:
    async with asyncio.timeout(DEADLINE):
        listener = await WebSocketFactory().listen("ws://127.0.0.1:0")
    async with listener:
        async with asyncio.timeout(DEADLINE):
            raw = await connect(listener.url, max_size=None, compression=None, **_DIRECT)
        async with raw:
            # Nobody accepted the connection: its limit is the small pre-accept one.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(DEADLINE):
                    await raw.send(cut(bytes(4 * ws.UNACCEPTED_FRAME_SIZE), [1000] * 3))
                    await raw.wait_closed()
            assert raw.close_code == 1009  # message too big
    assert allocations == []


async def test_large_frames_from_an_aps_client_arrive_whole_at_the_listener() -> None:
    # Client-to-server frames are masked: the other direction from weights.
    rng = random.Random(7)
    frames = [rng.randbytes(2 * FRAGMENT_SIZE + 3) for _ in range(3)]
    async with asyncio.timeout(DEADLINE):
        listener = await WebSocketFactory().listen("ws://127.0.0.1:0")
    async with listener:
        async with asyncio.timeout(DEADLINE):
            client = await WebSocketFactory().connect(listener.url, timeout=DEADLINE)
            server = await listener.accept()
        async with client, server:
            for frame in frames:
                await client.send(frame)
            for frame in frames:
                assert await receive(server) == frame
            await server.send(frames[0])
            assert await receive(client) == frames[0]


async def test_a_connection_lost_in_the_middle_of_a_message_lets_its_buffer_go(
    allocations: list[int],
) -> None:
    message = random.Random(8).randbytes(3 * FRAGMENT_SIZE)
    never = asyncio.Event()

    async def pieces() -> AsyncIterator[bytes]:
        yield message[:FRAGMENT_SIZE]
        await never.wait()  # the rest never comes
        yield message[FRAGMENT_SIZE:]

    async with raw_to_aps() as (raw, server):
        await raw.send(cut(message, [FRAGMENT_SIZE] * 2))
        assert await receive(server) == message  # its size is now the expected one
        sending = asyncio.create_task(raw.send(pieces()))
        gatherer = server._connection.aps_gatherer  # type: ignore[union-attr]
        for _ in range(int(DEADLINE / 0.01)):  # until the first fragment is in a buffer
            if gatherer._view is not None:
                break
            await asyncio.sleep(0.01)
        assert gatherer._view is not None
        assert allocations == [len(message)]
        raw.transport.abort()
        with pytest.raises(ConnectionLost):
            await receive(server)
        assert gatherer._view is None and gatherer._buffer is None
        sending.cancel()
        with contextlib.suppress(BaseException):
            await sending


async def test_a_listener_sends_large_frames_whole() -> None:
    rng = random.Random(9)
    sizes = [ws.UNCOPIED_SIZE - 1, ws.UNCOPIED_SIZE, FRAGMENT_SIZE, 5 * FRAGMENT_SIZE + 1]
    frames = [rng.randbytes(n) for n in sizes]
    mutable = bytearray(rng.randbytes(FRAGMENT_SIZE // 2))
    async with raw_to_aps() as (raw, server):
        async with asyncio.timeout(DEADLINE):
            for frame in frames:
                await server.send(frame)
                await server.send(memoryview(frame)[1:])
            await server.send(mutable)
            for frame in frames:
                assert await raw.recv() == frame
                assert await raw.recv() == frame[1:]
            assert await raw.recv() == mutable


def test_only_immutable_large_payloads_are_written_without_a_copy() -> None:
    from websockets.frames import Frame, Opcode
    from websockets.server import ServerProtocol
    from websockets.streams import StreamReader

    def sent(payload: bytes | bytearray | memoryview) -> list[Any]:
        """What a listener's protocol writes for one binary frame of ``payload``."""
        server = ServerProtocol()
        connections.send_uncopied(server, server.send_frame, Frame(Opcode.BINARY, payload))
        return server.data_to_send()

    def parsed(writes: list[Any]) -> Frame:
        """The frame a client reads from ``writes`` (websockets' own frame parser)."""
        reader = StreamReader()
        reader.feed_data(b"".join(writes))
        reader.feed_eof()
        parser = Frame.parse(reader.read_exact, mask=False, max_size=None, extensions=None)
        with pytest.raises(StopIteration) as done:
            next(parser)
        frame: Frame = done.value.value
        return frame

    big = random.Random(10).randbytes(ws.UNCOPIED_SIZE + 3)
    writes = sent(big)
    assert len(writes) == 2 and writes[1] is big  # a header, then the payload itself
    assert parsed(writes) == Frame(Opcode.BINARY, big)
    view = memoryview(big)[3:]
    writes = sent(view)
    assert writes[1] is view
    assert parsed(writes).data == big[3:]
    mutable = bytearray(big)
    writes = sent(mutable)  # copied into the frame websockets builds
    mutable[:] = bytes(len(mutable))
    assert len(writes) == 1 and parsed(writes).data == big
    small = big[: ws.UNCOPIED_SIZE - 1]
    writes = sent(small)  # websockets' own frame
    assert len(writes) == 1 and parsed(writes).data == small
