"""Every transport against the conformance suite, plus backend-specific cases and the registry."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import pathlib
import random
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import AsyncIterator, Callable, Iterator
from types import ModuleType
from typing import Any

import pytest

import aps
import aps.session._loop
import aps.testing
import aps.transports
import aps.wire.framing
from aps.errors import (
    AuthError,
    ConfigError,
    ConnectError,
    ConnectionLost,
    EndOfStream,
    FrameTooLarge,
    MissingDependency,
    Timeout,
    TransportClosed,
)
from aps.testing import (
    TRANSPORT_CHECKS,
    TransportCheck,
    check_buffer_types,
    check_concurrent_receive,
    check_factory,
    check_frame_size_limit,
    check_only_transport_errors,
    check_transport,
    pair_from_factory,
)
from aps.transports import Listener, Transport, TransportFactory, memory_transport_pair, registry
from aps.transports.memory import MemoryFactory, MemoryTransport
from aps.transports.tcp import TCPFactory, TCPTransport
from aps.transports.unix import MAX_PATH_BYTES, UnixFactory, UnixTransport
from aps.transports.websocket import WebSocketFactory

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIMIT = 2**20  # small enough for the exact-limit check to be cheap, big enough for real frames


# Fixtures: TLS material, IPv6, the example plug-in.


def _has_ipv6() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


HAS_IPV6 = _has_ipv6()


def _load_example() -> ModuleType:
    path = ROOT / "examples" / "custom_transport.py"
    spec = importlib.util.spec_from_file_location("aps_example_custom_transport", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def example() -> ModuleType:
    if sys.platform == "win32":
        pytest.skip("unix sockets")
    return _load_example()


@pytest.fixture
def short_dir() -> Iterator[pathlib.Path]:
    # Unix socket paths are limited to about 100 bytes: pytest's tmp_path can be longer.
    directory = tempfile.mkdtemp(prefix="aps-")
    try:
        yield pathlib.Path(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# Every transport, as (factory, url) for the factory checks and a pair maker for the rest.

KINDS = ["memory", "tcp", "tcp-ipv6", "tls", "ws", "wss", "unix", "uds-example"]


def _setup(kind: str, request: pytest.FixtureRequest) -> tuple[TransportFactory, str]:
    if kind == "memory":
        return MemoryFactory(max_frame_size=LIMIT), "memory://"
    if kind == "tcp":
        return TCPFactory(max_frame_size=LIMIT), "tcp://127.0.0.1:0"
    if kind == "tcp-ipv6":
        if not HAS_IPV6:
            pytest.skip("no IPv6 loopback on this machine")
        return TCPFactory(max_frame_size=LIMIT), "tcp://[::1]:0"
    if kind == "ws":
        return WebSocketFactory(max_frame_size=LIMIT), "ws://127.0.0.1:0"
    if kind in ("tls", "wss"):
        server, client = request.getfixturevalue("tls")
        factory_class = TCPFactory if kind == "tls" else WebSocketFactory
        factory = factory_class(
            server_ssl_context=server, client_ssl_context=client, max_frame_size=LIMIT
        )
        return factory, ("tcp" if kind == "tls" else "wss") + "://127.0.0.1:0"
    if kind == "unix":
        if not hasattr(socket, "AF_UNIX"):
            pytest.skip("no unix sockets on this platform")
        directory = request.getfixturevalue("short_dir")
        return UnixFactory(max_frame_size=LIMIT), f"unix://{directory}/s.sock"
    if kind == "uds-example":
        module = request.getfixturevalue("example")
        directory = request.getfixturevalue("short_dir")
        return module.UnixFactory(max_frame_size=LIMIT), f"uds://{directory}/s.sock"
    raise AssertionError(kind)


async def _memory_pair() -> tuple[Transport, Transport]:
    return memory_transport_pair(LIMIT)


@pytest.mark.parametrize("check", TRANSPORT_CHECKS, ids=lambda check: check.__name__)
@pytest.mark.parametrize("kind", ["memory-pair", *KINDS])
async def test_conformance(
    kind: str, check: TransportCheck, request: pytest.FixtureRequest
) -> None:
    if kind == "memory-pair":
        await check(_memory_pair)
    else:
        await check(pair_from_factory(*_setup(kind, request)))


@pytest.mark.parametrize("kind", KINDS)
async def test_factory_conformance(kind: str, request: pytest.FixtureRequest) -> None:
    await check_factory(*_setup(kind, request))


def test_the_example_runs_the_suite_as_a_script() -> None:
    if sys.platform == "win32":
        pytest.skip("unix sockets")
    result = subprocess.run(
        [
            sys.executable,
            "-X",
            "dev",
            "-W",
            "error",
            str(ROOT / "examples" / "custom_transport.py"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(ROOT), "PATH": ""},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "passed the factory checks and all 13 transport checks" in result.stdout


# The suite catches broken transports.


class Broken:
    """Wraps a memory transport and breaks one contract point."""

    def __init__(self, inner: MemoryTransport, flaw: str) -> None:
        self.inner, self.flaw = inner, flaw
        self.max_frame_size = inner.max_frame_size
        self.lock = asyncio.Lock()

    @property
    def peer(self) -> str:
        return self.inner.peer

    async def send(self, frame: Any) -> None:
        if self.flaw == "no limit" and len(frame) > self.max_frame_size:
            self.inner.max_frame_size = len(frame)
            self.inner._other.max_frame_size = len(frame)  # type: ignore[union-attr]
        if self.flaw == "raw errors" and self.inner._peer_closed:
            raise BrokenPipeError("peer gone")
        if self.flaw == "aliases buffers" and isinstance(frame, bytearray):
            # Keep the caller's buffer and copy it only after send() returned.
            self.later = asyncio.get_running_loop().call_soon(self.inner._other._deliver, frame)  # type: ignore[union-attr]
            return
        await self.inner.send(frame)

    async def receive(self) -> bytes:
        if self.flaw == "concurrent receive":
            # Queue concurrent receives instead of refusing the second one.
            async with self.lock:
                return await self.inner.receive()
        return await self.inner.receive()

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.mark.parametrize(
    ("flaw", "check"),
    [
        ("no limit", check_frame_size_limit),
        ("raw errors", check_only_transport_errors),
        ("aliases buffers", check_buffer_types),
        ("concurrent receive", check_concurrent_receive),
    ],
)
async def test_the_suite_catches_a_broken_transport(flaw: str, check: TransportCheck) -> None:
    async def broken_pair() -> tuple[Transport, Transport]:
        a, b = memory_transport_pair(LIMIT)
        return Broken(a, flaw), Broken(b, flaw)

    with pytest.raises(AssertionError):
        await check(broken_pair, time_limit=0.5)


async def test_check_transport_reports_every_failure() -> None:
    async def broken_pair() -> tuple[Transport, Transport]:
        a, b = memory_transport_pair(LIMIT)
        return Broken(a, "no limit"), Broken(b, "no limit")

    with pytest.raises(AssertionError, match=r"1 of 13 transport checks failed") as info:
        await check_transport(broken_pair)
    assert "check_frame_size_limit" in str(info.value)


async def test_a_hanging_transport_fails_instead_of_hanging() -> None:
    class Deaf:
        peer = "deaf"
        max_frame_size = LIMIT

        async def send(self, frame: Any) -> None:
            pass

        async def receive(self) -> bytes:
            await asyncio.Event().wait()
            raise AssertionError

        async def aclose(self) -> None:
            pass

    async def deaf_pair() -> tuple[Transport, Transport]:
        return Deaf(), Deaf()

    with pytest.raises(AssertionError, match=r"did not finish within 0\.3 s"):
        await TRANSPORT_CHECKS[0](deaf_pair, time_limit=0.3)


# TCP specifics.


@contextlib.asynccontextmanager
async def raw_server(
    handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Any],
) -> AsyncIterator[str]:
    """A plain asyncio server on 127.0.0.1, for speaking to transports byte by byte."""
    writers: list[asyncio.StreamWriter] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await handler(reader, writer)

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.close()
        for writer in writers:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def test_tcp_refuses_an_oversized_header_and_closes() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(
            aps.wire.framing.frame_header(100) + b"x" * 100 + aps.wire.framing.frame_header(101)
        )
        await reader.read()

    async with raw_server(handler) as address:
        transport = await TCPFactory(max_frame_size=100).connect(f"tcp://{address}", timeout=5)
        assert await transport.receive() == b"x" * 100
        with pytest.raises(FrameTooLarge) as info:
            await transport.receive()
        assert (info.value.size, info.value.limit) == (101, 100)
        with pytest.raises(TransportClosed):
            await transport.receive()
        await transport.aclose()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="127.0.0.0/8 is all loopback")
async def test_tcp_connect_binds_the_source_address_it_is_given() -> None:
    factory = TCPFactory()
    async with asyncio.timeout(10), await factory.listen("tcp://127.0.0.1:0") as listener:
        for source in ("127.0.0.2", "127.0.0.3"):
            client = await TCPFactory(source=source).connect(listener.url, timeout=5)
            server = await listener.accept()
            assert client.peer == listener.url
            assert server.peer.startswith(f"tcp://{source}:")
            await client.send(b"from " + source.encode())
            assert await server.receive() == b"from " + source.encode()
            await client.aclose()
            await server.aclose()


async def test_tcp_source_of_the_other_family_is_a_connect_error() -> None:
    factory = TCPFactory()
    async with asyncio.timeout(10), await factory.listen("tcp://127.0.0.1:0") as listener:
        with pytest.raises(ConnectError):
            await TCPFactory(source="::1").connect(listener.url, timeout=5)


@pytest.mark.parametrize("source", ["", "localhost", "127.0.0.256", "127.0.0.1:80", 2130706433])
def test_tcp_source_must_be_an_ip_literal(source: object) -> None:
    with pytest.raises(ConfigError, match="source must be an IP address"):
        TCPFactory(source=source)  # type: ignore[arg-type]
    assert TCPFactory(source="::1").source == "::1"
    assert "source='127.0.0.2'" in repr(TCPFactory(source="127.0.0.2"))


@pytest.mark.parametrize(
    ("wire", "error", "message"),
    [
        (b"", EndOfStream, "closed the connection"),
        (b"\x05\x00", ConnectionLost, r"middle of a frame \(2 of 4 bytes"),
        (b"\x05\x00\x00\x00abc", ConnectionLost, r"middle of a frame \(3 of 5 bytes"),
        (b"\x01\x00\x00\x00a", EndOfStream, "closed the connection"),
    ],
)
async def test_tcp_end_of_stream_only_at_a_frame_boundary(
    wire: bytes, error: type[Exception], message: str
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(wire)
        writer.close()

    async with raw_server(handler) as address:
        transport = await TCPFactory().connect(f"tcp://{address}", timeout=5)
        if wire.endswith(b"a"):
            assert await transport.receive() == b"a"
        with pytest.raises(error, match=message):
            await transport.receive()
        await transport.aclose()


async def test_tcp_aclose_unblocks_a_send_to_a_peer_that_never_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from aps.transports import tcp

    monkeypatch.setattr(tcp, "_CLOSE_TIMEOUT", 0.2)
    stop = asyncio.Event()

    async def never_reads(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await stop.wait()

    async with raw_server(never_reads) as address:
        transport = await TCPFactory(max_frame_size=LIMIT).connect(f"tcp://{address}", timeout=5)

        async def flood() -> None:
            while True:
                await transport.send(bytes(LIMIT))

        sender = asyncio.create_task(flood())
        await asyncio.sleep(0.3)  # long enough for the socket buffers to fill
        assert not sender.done()
        # A peer that never reads must not hold aclose up (a hang, not a speed, is the bug).
        await asyncio.wait_for(transport.aclose(), timeout=30)
        with pytest.raises(TransportClosed):
            await sender
        stop.set()


# TCP reads straight into each frame's buffer (an asyncio.BufferedProtocol). These run on
# asyncio's own loop and on uvloop, whose buffered-read paths differ.

LOOPS = ["asyncio", "uvloop"] if importlib.util.find_spec("uvloop") else ["asyncio"]


def run_on(loop: str, main: Callable[[], Any], seconds: float = 60) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(seconds):
            await main()

    aps.session._loop.run(bounded(), use_uvloop=loop == "uvloop")


async def until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(10_000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"gave up waiting for {what}")


def _decoder(transport: Transport) -> aps.wire.framing.FrameDecoder:
    assert isinstance(transport, TCPTransport)
    return transport._connection.decoder


_SMALL = [b"hello", b"", b"\x00" * 7, bytes(range(256)), b"", b"x"]
_LARGE = bytes(range(251)) * 400  # 100,400 bytes: read into a buffer of its own
_MIXED = [b"a", _LARGE, b"", _LARGE[::-1], b"z"]


def _wire(frames: list[bytes]) -> bytes:
    return b"".join(aps.wire.framing.encode_frame(frame) for frame in frames)


def _splits(frames: list[bytes]) -> list[int]:
    """Every byte boundary of small frames; around the headers and body ends of large ones."""
    points: set[int] = set()
    position = 0
    for frame in frames:
        end = position + aps.wire.framing.HEADER_SIZE + len(frame)
        if len(frame) < 1000:
            points.update(range(position, end + 1))
        else:
            for anchor in (position, position + aps.wire.framing.HEADER_SIZE, end):
                points.update(range(max(0, anchor - 5), anchor + 6))
            points.update(range(position, end, 4099))
        position = end
    return sorted(p for p in points if p <= position)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("frames", [_SMALL, _MIXED], ids=["small", "mixed"])
def test_tcp_frames_split_at_every_byte_boundary(loop: str, frames: list[bytes]) -> None:
    wire = _wire(frames)
    cuts = _splits(frames)

    async def main() -> None:
        go: asyncio.Queue[int] = asyncio.Queue()

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            for cut in cuts:
                writer.write(wire[:cut])
                await writer.drain()
                await go.get()  # the first part was read: now the rest
                writer.write(wire[cut:])
                await writer.drain()
            await reader.read()

        async with raw_server(handler) as address:
            factory = TCPFactory(max_frame_size=LIMIT)
            async with await factory.connect(f"tcp://{address}", timeout=5) as transport:
                decoder = _decoder(transport)
                for cut in cuts:
                    # Wait until the first part was read, so that the frames really are
                    # split across two reads at this byte.
                    await until(lambda cut=cut: decoder.buffered >= cut, f"{cut} bytes read")
                    go.put_nowait(cut)
                    for frame in frames:
                        got = await transport.receive()
                        assert type(got) is bytes and got == frame, cut

    run_on(loop, main)


@pytest.mark.parametrize("loop", LOOPS)
def test_tcp_many_frames_in_one_read(loop: str) -> None:
    frames = [bytes([i % 256]) * (i % 41) for i in range(20_000)]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(_wire(frames))  # one write: most reads hold hundreds of frames
        await writer.drain()
        await reader.read()

    async def main() -> None:
        async with raw_server(handler) as address:
            async with await TCPFactory().connect(f"tcp://{address}", timeout=5) as transport:
                for i, frame in enumerate(frames):
                    assert await transport.receive() == frame, i

    run_on(loop, main)


@pytest.mark.parametrize("loop", LOOPS)
def test_tcp_frame_at_the_limit_and_one_over(loop: str) -> None:
    payload = random.Random(5).randbytes(LIMIT)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(_wire([payload]) + aps.wire.framing.frame_header(LIMIT + 1) + b"body")
        await reader.read()

    async def main() -> None:
        async with raw_server(handler) as address:
            factory = TCPFactory(max_frame_size=LIMIT)
            async with await factory.connect(f"tcp://{address}", timeout=5) as transport:
                assert await transport.receive() == payload
                with pytest.raises(FrameTooLarge, match="1048577 bytes exceeds the limit") as info:
                    await transport.receive()
                assert (info.value.size, info.value.limit) == (LIMIT + 1, LIMIT)
                assert _decoder(transport).partial is None  # refused before any allocation
                with pytest.raises(TransportClosed):
                    await transport.receive()

    run_on(loop, main)


@pytest.mark.parametrize("loop", LOOPS)
def test_tcp_end_of_stream_inside_a_large_frame(loop: str) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(aps.wire.framing.frame_header(LIMIT) + bytes(100_000))
        await writer.drain()
        writer.close()

    async def main() -> None:
        async with raw_server(handler) as address:
            factory = TCPFactory(max_frame_size=LIMIT)
            async with await factory.connect(f"tcp://{address}", timeout=5) as transport:
                with pytest.raises(ConnectionLost, match=r"frame \(100000 of 1048576 bytes"):
                    await transport.receive()

    run_on(loop, main)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("tls_on", [False, True], ids=["plain", "tls"])
def test_tcp_large_frames_round_trip_both_ways(
    loop: str, tls_on: bool, request: pytest.FixtureRequest
) -> None:
    size = 24 * 2**20
    rng = random.Random(11)
    frames = [rng.randbytes(size), rng.randbytes(size // 3) * 3, bytes(size)]
    if tls_on:
        server_context, client_context = request.getfixturevalue("tls")
        factory = TCPFactory(
            server_ssl_context=server_context,
            client_ssl_context=client_context,
            max_frame_size=size,
        )
    else:
        factory = TCPFactory(max_frame_size=size)

    async def main() -> None:
        async with await factory.listen("tcp://127.0.0.1:0") as listener:
            client = await factory.connect(listener.url, timeout=5)
            async with client, await listener.accept() as server:

                async def pump(sender: Transport, receiver: Transport) -> None:
                    async def send_all() -> None:
                        for frame in frames:
                            await sender.send(frame)

                    task = asyncio.create_task(send_all())
                    for frame in frames:
                        got = await receiver.receive()
                        assert type(got) is bytes and len(got) == size and got == frame
                    await task

                await asyncio.gather(pump(client, server), pump(server, client))

    run_on(loop, main, seconds=100)


@pytest.mark.parametrize("loop", LOOPS)
def test_tcp_send_queues_small_frames_behind_a_large_one_then_waits(loop: str) -> None:
    size = 48 * 2**20  # more than the kernel's socket buffers take
    large = bytes(range(256)) * (size // 256)
    small = [bytes([i % 256]) * 1000 for i in range(200)]  # 1004 bytes each on the wire

    async def main() -> None:
        reading = asyncio.Event()
        received: list[bytes] = []

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reading.wait()
            while header := await reader.read(4):
                header += await reader.readexactly(4 - len(header))
                received.append(await reader.readexactly(aps.wire.framing.parse_header(header)))

        async with raw_server(handler) as address:
            factory = TCPFactory(max_frame_size=size)
            async with await factory.connect(f"tcp://{address}", timeout=5) as transport:
                assert isinstance(transport, TCPTransport)
                await transport.send(large)  # nobody reads, yet send() returns
                assert transport._transport.get_write_buffer_size() > 2**20
                sent = 0

                async def send_small() -> None:
                    nonlocal sent
                    for frame in small:
                        await transport.send(frame)
                        sent += 1

                blocked = asyncio.create_task(send_small())
                await asyncio.sleep(0.2)
                # Small frames queue behind the large one up to 64 KiB, then wait for it.
                assert not blocked.done()
                assert 60 <= sent <= 66, sent
                reading.set()
                await blocked
                await until(lambda: len(received) == 1 + len(small), "every frame")
        assert received == [large, *small]

    run_on(loop, main)


@pytest.mark.parametrize("loop", LOOPS)
def test_tcp_reading_pauses_while_whole_frames_wait(loop: str) -> None:
    from aps.transports import stream

    frames = [bytes([i % 256]) * 65_000 for i in range(400)]  # 26 MB in all

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(_wire(frames))
        await writer.drain()
        await reader.read()

    async def main() -> None:
        async with raw_server(handler) as address:
            async with await TCPFactory().connect(f"tcp://{address}", timeout=5) as transport:
                assert isinstance(transport, TCPTransport)
                connection = transport._connection
                await until(lambda: connection._reading_paused, "reading to pause")
                # Bounded: the limit plus what one read brought past it.
                assert connection.decoder.ready_bytes < stream.READ_LIMIT + 2**20
                for i, frame in enumerate(frames):
                    assert await transport.receive() == frame, i

    run_on(loop, main)


async def test_tcp_connect_errors() -> None:
    factory = TCPFactory()
    listener = await factory.listen("tcp://127.0.0.1:0")
    url = listener.url
    await listener.aclose()
    with pytest.raises(ConnectError, match="cannot connect to") as info:
        await factory.connect(url, timeout=5)
    assert info.value.url == url
    assert isinstance(info.value.__cause__, OSError)


async def test_tcp_listen_on_a_busy_port() -> None:
    factory = TCPFactory()
    async with await factory.listen("tcp://127.0.0.1:0") as listener:
        with pytest.raises(ConnectError, match=r"cannot listen on .*pick another port") as info:
            await factory.listen(listener.url)
        assert info.value.url == listener.url


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("tcp://127.0.0.1", "has no port"),
        ("tcp://127.0.0.1:99999", "malformed"),
        ("tcp://[::1:5", "malformed"),
        ("tcp://127.0.0.1:5/path", "path, query"),
        ("tcp://:5", "no host to connect to"),
        ("tcp://127.0.0.1:0", "cannot connect to port 0"),
        ("127.0.0.1:5", "malformed"),
    ],
)
async def test_tcp_url_errors(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        await TCPFactory().connect(url)


async def test_tcp_listen_url_reports_the_bound_address() -> None:
    factory = TCPFactory()
    async with await factory.listen("tcp://localhost:0") as listener:
        host, _, port = listener.url.removeprefix("tcp://").rpartition(":")
        assert host in ("127.0.0.1", "[::1]")
        assert int(port) > 0
        async with await factory.connect(listener.url, timeout=5) as client:
            async with await listener.accept() as server:
                await client.send(b"hi")
                assert await server.receive() == b"hi"
                assert server.peer.startswith("tcp://")
                assert client.peer == listener.url


async def test_tcp_connect_timeout() -> None:
    # A TLS client facing a server that never answers the handshake: only the timeout ends it.
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    async with raw_server(silent) as address:
        factory = TCPFactory(ssl_context=ssl.create_default_context())
        with pytest.raises(Timeout, match=r"took longer than 0\.2 s") as info:
            await factory.connect(f"tcp://{address}", timeout=0.2)
    assert (info.value.operation, info.value.seconds) == ("connect", 0.2)
    assert isinstance(info.value, TimeoutError)


async def test_tls_refuses_an_untrusted_certificate(
    tls: tuple[ssl.SSLContext, ssl.SSLContext],
) -> None:
    server_context, _ = tls
    async with await TCPFactory(ssl_context=server_context).listen("tcp://127.0.0.1:0") as listener:
        stranger = TCPFactory(ssl_context=ssl.create_default_context())
        # An AuthError, not a ConnectError: dialing again meets the same certificate, so a
        # worker fails at once with the TLS reason instead of retrying until its deadline.
        with pytest.raises(AuthError, match=r"certificate .*failed verification") as info:
            await stranger.connect(listener.url, timeout=5)
        assert isinstance(info.value.__cause__, ssl.SSLCertVerificationError)


async def test_ssl_context_for_the_wrong_side(tls: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    server_context, client_context = tls
    with pytest.raises(ConfigError, match="server-side ssl context; pass client_ssl_context="):
        await TCPFactory(ssl_context=server_context).connect("tcp://127.0.0.1:1")
    with pytest.raises(ConfigError, match="client-side ssl context; pass server_ssl_context="):
        await TCPFactory(ssl_context=client_context).listen("tcp://127.0.0.1:0")
    with pytest.raises(ConfigError, match="server-side ssl context"):
        await WebSocketFactory(ssl_context=server_context).connect("wss://127.0.0.1:1")


def test_factory_arguments_are_validated() -> None:
    for factory_class in (TCPFactory, WebSocketFactory, MemoryFactory):
        with pytest.raises(ConfigError, match="max_frame_size"):
            factory_class(max_frame_size=0)
    with pytest.raises(ConfigError, match="max_frame_size"):
        TCPFactory(max_frame_size=2**32)  # the 4-byte header cannot announce more
    with pytest.raises(ConfigError):
        memory_transport_pair(max_frame_size=-1)


# WebSocket specifics.


# The unix transport: paths, stale and live sockets, cleanup. Its frames and flow control are
# the TCP transport's, checked above and by the conformance suite.


def _kind_of(path: pathlib.Path) -> str:
    """What is at ``path``: "socket", "file", "dir" or "none" (synchronous: tiny stat calls)."""
    if path.is_socket():
        return "socket"
    if path.is_dir():
        return "dir"
    return "file" if path.exists() else "none"


def _make_dirs(path: pathlib.Path) -> None:
    path.mkdir(parents=True)


def _entries(path: pathlib.Path) -> list[pathlib.Path]:
    return list(path.iterdir())


@pytest.mark.parametrize("loop", LOOPS)
def test_unix_fresh_path_is_private_and_removed_on_close(loop: str) -> None:
    async def main() -> None:
        factory = UnixFactory()
        listener = await factory.listen("unix://")
        path = pathlib.Path(listener.url.removeprefix("unix://"))
        assert _kind_of(path) == "socket"
        assert os.stat(path.parent).st_mode & 0o777 == 0o700  # this user only
        async with await factory.connect(listener.url, timeout=5) as client:
            async with await listener.accept() as server:
                assert isinstance(server, UnixTransport)
                assert client.peer == server.peer == listener.url
                big = bytes(range(256)) * 32768  # 8 MiB: both ways, past every buffer
                await asyncio.gather(client.send(big), server.send(b"small"))
                assert await server.receive() == big
                assert await client.receive() == b"small"
                await server.send(big)
                assert await client.receive() == big
        await listener.aclose()
        assert _kind_of(path) == _kind_of(path.parent) == "none"
        await listener.aclose()  # idempotent

    run_on(loop, main)


def _wmem_max() -> int:
    return int(pathlib.Path("/proc/sys/net/core/wmem_max").read_text())


@pytest.mark.skipif(sys.platform != "linux", reason="reads Linux's socket buffer limit")
async def test_unix_sockets_queue_megabytes_not_the_default_208_kib() -> None:
    # Both ends send weights: each gets a send buffer near loopback TCP's, not Linux's
    # Unix-socket default, as far as the system's limit allows.
    limit = _wmem_max()
    factory = UnixFactory()
    async with await factory.listen("unix://") as listener:
        async with await factory.connect(listener.url, timeout=5) as client:
            async with await listener.accept() as server:
                for transport in (client, server):
                    sock = transport._transport.get_extra_info("socket")
                    got = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
                    assert got == 2 * min(4 * 2**20, limit)  # Linux doubles what it is given


async def test_unix_fresh_path_leaves_a_temporary_directory_too_long_for_sockets(
    short_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    deep = short_dir / ("d" * 60) / ("e" * 60)
    _make_dirs(deep)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    async with await UnixFactory().listen("unix://") as listener:
        assert listener.url.startswith("unix:///tmp/aps-")
        async with await UnixFactory().connect(listener.url, timeout=5):
            pass
    assert _entries(deep) == []  # the too-long attempt was removed again


async def test_unix_fresh_path_without_a_writable_temporary_directory(
    short_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(short_dir / "missing"))
    with pytest.raises(ConnectError, match="no directory for the socket could be made") as info:
        await UnixFactory().listen("unix://")
    assert info.value.url == "unix://"


async def test_unix_named_path_is_removed_on_close_and_can_be_bound_again(
    short_dir: pathlib.Path,
) -> None:
    url = f"unix://{short_dir}/learner.sock"
    factory = UnixFactory()
    for _ in range(2):
        async with await factory.listen(url) as listener:
            assert listener.url == url
            assert repr(listener) == f"<UnixListener {url}>"
            async with await factory.connect(url, timeout=5) as client:
                assert repr(client) == f"<UnixTransport peer={url!r} open>"
        assert _kind_of(short_dir / "learner.sock") == "none"
    assert _kind_of(short_dir) == "dir"  # not made by the listener: left alone


async def test_unix_replaces_a_stale_socket_file(short_dir: pathlib.Path) -> None:
    path = short_dir / "stale.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))  # bound, never listening, then gone: what a killed learner leaves
    dead.close()
    assert _kind_of(path) == "socket"
    async with await UnixFactory().listen(f"unix://{path}") as listener:
        async with await UnixFactory().connect(listener.url, timeout=5) as client:
            async with await listener.accept() as server:
                await client.send(b"hi")
                assert await server.receive() == b"hi"


async def test_unix_refuses_a_path_in_use_or_not_a_socket(short_dir: pathlib.Path) -> None:
    factory = UnixFactory()
    async with await factory.listen(f"unix://{short_dir}/live.sock") as listener:
        with pytest.raises(ConnectError, match="another listener is using it") as info:
            await factory.listen(listener.url)
        assert info.value.url == listener.url
        async with await factory.connect(listener.url, timeout=5):  # still the first's
            pass
    regular = short_dir / "notes.txt"
    regular.write_bytes(b"keep me")
    with pytest.raises(ConnectError, match="exists and is not a socket"):
        await factory.listen(f"unix://{regular}")
    assert regular.read_bytes() == b"keep me"
    with pytest.raises(ConnectError, match="check that the directory exists"):
        await factory.listen(f"unix://{short_dir}/no/such/dir.sock")


async def test_unix_connect_errors(short_dir: pathlib.Path) -> None:
    url = f"unix://{short_dir}/nobody.sock"
    with pytest.raises(ConnectError, match=r"cannot connect to .*check that a listener") as info:
        await UnixFactory().connect(url, timeout=5)
    assert info.value.url == url
    assert isinstance(info.value.__cause__, OSError)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("unix://relative/learner.sock", "has a host"),
        ("unix:///tmp/learner.sock?mode=1", "has a host, query"),
        ("unix://", "no path to connect to"),
        ("unix:///tmp/dir/", "names no socket file"),
        ("unix:///" + "x" * MAX_PATH_BYTES, "bytes, over this system's limit"),
    ],
)
async def test_unix_url_errors(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        await UnixFactory().connect(url)


async def test_unix_is_a_builtin_scheme_and_local_enough_for_no_token() -> None:
    assert isinstance(registry.get_factory("unix"), UnixFactory)
    # Like loopback, a Unix socket is reachable from this host only: no token is demanded.
    async with aps.Learner("unix://", num_workers=1) as learner:
        assert learner.url.startswith("unix:///")


async def test_websocket_text_message_is_a_broken_connection() -> None:
    from websockets.asyncio.client import connect

    from aps.transports.websocket import _DIRECT

    async with await WebSocketFactory().listen("ws://127.0.0.1:0") as listener:
        async with connect(listener.url, **_DIRECT) as raw:
            server = await listener.accept()
            await raw.send("hello")
            with pytest.raises(ConnectionLost, match="sent a text message"):
                await server.receive()
            with pytest.raises(TransportClosed):
                await server.receive()
        await server.aclose()


async def test_websocket_refuses_an_oversized_message() -> None:
    small = WebSocketFactory(max_frame_size=100)
    large = WebSocketFactory(max_frame_size=1000)
    async with await small.listen("ws://127.0.0.1:0") as listener:
        client = await large.connect(listener.url, timeout=5)
        server = await listener.accept()
        await client.send(b"x" * 100)
        assert await server.receive() == b"x" * 100
        await client.send(b"x" * 101)
        with pytest.raises(FrameTooLarge) as info:
            await server.receive()
        assert info.value.limit == 100
        assert info.value.size > 100
        with pytest.raises((EndOfStream, ConnectionLost)):
            await client.receive()
        await client.aclose()
        await server.aclose()


@contextlib.asynccontextmanager
async def ws_pair(
    server_limit: int = 64 * 2**20, client_limit: int = 64 * 2**20
) -> AsyncIterator[tuple[Transport, Transport]]:
    async with await WebSocketFactory(max_frame_size=server_limit).listen(
        "ws://127.0.0.1:0"
    ) as listener:
        client = await WebSocketFactory(max_frame_size=client_limit).connect(
            listener.url, timeout=5
        )
        server = await listener.accept()
        try:
            yield server, client
        finally:
            await client.aclose()
            await server.aclose()


async def test_websocket_large_frames_travel_as_fragments_and_arrive_whole_in_order() -> None:
    from websockets.asyncio.client import connect

    from aps.transports.websocket import _DIRECT, FRAGMENT_SIZE

    rng = random.Random(3)
    big = rng.randbytes(3 * FRAGMENT_SIZE + 5)
    async with await WebSocketFactory().listen("ws://127.0.0.1:0") as listener:
        # A plain websockets client sees the fragments (the receiver's buffers stay small).
        async with connect(listener.url, max_size=None, **_DIRECT) as raw:
            server = await listener.accept()
            await server.send(big)
            fragments = [bytes(f) async for f in raw.recv_streaming()]
            assert len(fragments) >= 4 and b"".join(fragments) == big
        await server.aclose()
    async with ws_pair() as (server, client):
        frames = [
            big,
            b"small",
            rng.randbytes(FRAGMENT_SIZE + 1),
            b"",
            rng.randbytes(FRAGMENT_SIZE),
        ]

        async def send(tag: bytes) -> None:
            for frame in frames:
                await server.send(tag + frame)

        async with asyncio.TaskGroup() as tasks:  # two senders: frames never interleave
            tasks.create_task(send(b"a"))
            tasks.create_task(send(b"b"))
            got = [await client.receive() for _ in range(2 * len(frames))]
        for tag in (b"a", b"b"):
            assert [g[1:] for g in got if g[:1] == tag] == frames


async def test_websocket_a_fragmented_message_over_the_limit_is_refused() -> None:
    from aps.transports.websocket import FRAGMENT_SIZE

    async with ws_pair(server_limit=2 * FRAGMENT_SIZE) as (server, client):
        await client.send(bytes(3 * FRAGMENT_SIZE))  # over the server's limit in total
        with pytest.raises(FrameTooLarge):
            await server.receive()


async def test_websocket_aclose_after_a_large_send_delivers_it_first() -> None:
    from aps.transports.websocket import FRAGMENT_SIZE

    big = random.Random(4).randbytes(8 * FRAGMENT_SIZE)
    async with ws_pair() as (server, client):
        await server.send(big)  # handed over: it leaves in the background
        closing = asyncio.create_task(server.aclose())
        assert await client.receive() == big
        with pytest.raises(EndOfStream):
            await client.receive()
        await closing


async def test_websocket_a_send_cancelled_behind_a_large_frame_sends_nothing() -> None:
    from aps.transports.websocket import FRAGMENT_SIZE

    first, second = bytes(32 * FRAGMENT_SIZE), b"\x01" * (2 * FRAGMENT_SIZE)
    async with ws_pair() as (server, client):
        await server.send(first)  # nobody reads yet: it cannot all leave
        waiting = asyncio.create_task(server.send(second))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not waiting.done()  # it waits for the first frame to leave
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        async with asyncio.TaskGroup() as tasks:  # "after" waits for the first to leave
            tasks.create_task(server.send(b"after"))
            assert await client.receive() == first
            assert await client.receive() == b"after"


async def test_websocket_to_a_server_that_is_not_one() -> None:
    async def not_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"garbage\r\n\r\n")
        writer.close()

    async with raw_server(not_http) as address:
        with pytest.raises(ConnectError, match="cannot connect to") as info:
            await WebSocketFactory().connect(f"ws://{address}/", timeout=5)
        assert info.value.url == f"ws://{address}/"


async def test_websocket_connect_timeout() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    async with raw_server(silent) as address:
        with pytest.raises(Timeout) as info:
            await WebSocketFactory().connect(f"ws://{address}/", timeout=0.2)
    assert info.value.operation == "connect"


@pytest.mark.parametrize(
    ("call", "url", "message"),
    [
        ("listen", "wss://127.0.0.1:0", "without a certificate"),
        ("listen", "ws://127.0.0.1", "no port to listen on"),
        ("connect", "ws://127.0.0.1:0/", "cannot connect to port 0"),
        ("connect", "http://127.0.0.1:5/", "malformed"),
        ("connect", "ws://[::1/", "malformed"),
    ],
)
async def test_websocket_url_errors(call: str, url: str, message: str) -> None:
    factory = WebSocketFactory()
    with pytest.raises(ConfigError, match=message):
        await (factory.listen(url) if call == "listen" else factory.connect(url))


async def test_websocket_ignores_proxy_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    factory = WebSocketFactory()
    async with await factory.listen("ws://127.0.0.1:0") as listener:
        async with await factory.connect(listener.url, timeout=5) as client:
            async with await listener.accept() as server:
                await client.send(b"direct")
                assert await server.receive() == b"direct"


async def test_websocket_listener_keeps_the_path() -> None:
    async with await WebSocketFactory().listen("ws://127.0.0.1:0/aps") as listener:
        assert listener.url.endswith("/aps")
        async with await aps.transports.connect(listener.url, timeout=5) as client:
            async with await listener.accept() as server:
                await server.send(b"hello")
                assert await client.receive() == b"hello"


# Memory specifics.


async def test_memory_names() -> None:
    factory = MemoryFactory()
    first = await factory.listen("memory://")
    second = await factory.listen("memory://")
    assert first.url != second.url
    assert first.url.startswith("memory://auto-")
    named = await factory.listen("memory://learner")
    assert named.url == "memory://learner"
    with pytest.raises(ConnectError, match="already has the name 'learner'"):
        await factory.listen("memory://learner")
    for listener in (first, second, named):
        await listener.aclose()
    # Closing unbinds the name.
    again = await factory.listen("memory://learner")
    await again.aclose()
    with pytest.raises(ConnectError, match="no memory listener is bound to 'learner'"):
        await factory.connect("memory://learner")
    with pytest.raises(ConfigError, match="memory://name"):
        await factory.connect("learner")


async def test_memory_listener_closes_unaccepted_connections() -> None:
    factory = MemoryFactory()
    listener = await factory.listen("memory://")
    client = await factory.connect(listener.url)
    await listener.aclose()
    with pytest.raises(EndOfStream):
        await client.receive()
    with pytest.raises(ConnectionLost):
        await client.send(b"x")


# The registry.


@pytest.fixture
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_factories", {})


def _run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": ""},
        check=False,
    )


def test_importing_aps_imports_no_websockets() -> None:
    result = _run_python(
        """
        import sys
        import aps, aps.transports, aps.testing
        assert "websockets" not in sys.modules, "websockets imported eagerly"
        assert "aps.transports.websocket" not in sys.modules
        factory = aps.transports.get_factory("ws")
        assert "websockets" in sys.modules
        assert aps.transports.get_factory("wss") is not None
        """
    )
    assert result.returncode == 0, result.stderr


def test_missing_websockets_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, fresh_registry: None
) -> None:
    monkeypatch.setitem(sys.modules, "websockets", None)  # makes "import websockets" fail
    for name in [m for m in sys.modules if m.startswith("websockets.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delitem(sys.modules, "aps.transports.websocket", raising=False)
    with pytest.raises(MissingDependency, match=r"pip install 'aps-rl\[websocket\]'") as info:
        aps.transports.get_factory("ws")
    assert isinstance(info.value, ImportError)


def test_builtin_factories_are_cached(fresh_registry: None) -> None:
    tcp = aps.transports.get_factory("tcp")
    assert isinstance(tcp, TCPFactory)
    assert aps.transports.get_factory("TCP") is tcp
    assert isinstance(aps.transports.get_factory("memory"), MemoryFactory)


class Dummy:
    async def connect(self, url: str, *, timeout: float | None = None) -> Transport:
        a, _ = memory_transport_pair()
        return a

    async def listen(self, url: str) -> Listener:
        raise NotImplementedError


def test_register(fresh_registry: None) -> None:
    dummy = Dummy()
    aps.transports.register("Dummy+v1", dummy)
    assert aps.transports.get_factory("dummy+v1") is dummy
    with pytest.raises(ConfigError, match="'dummy\\+v1' is already registered; pass replace=True"):
        aps.transports.register("dummy+v1", Dummy())
    other = Dummy()
    aps.transports.register("dummy+v1", other, replace=True)
    assert aps.transports.get_factory("dummy+v1") is other
    with pytest.raises(ConfigError, match="already registered"):
        aps.transports.register("tcp", Dummy())  # built-ins count as registered
    aps.transports.register("tcp", other, replace=True)
    assert aps.transports.get_factory("tcp") is other


def test_register_checks_its_arguments(fresh_registry: None) -> None:
    with pytest.raises(TypeError, match=r"is a class; pass an instance, for example Dummy\(\)"):
        aps.transports.register("dummy", Dummy)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not a transport factory"):
        aps.transports.register("dummy", object())  # type: ignore[arg-type]
    for bad in ("", "tcp://", "1abc", "a b", None):
        with pytest.raises(ConfigError, match=r"scheme .* is invalid"):
            aps.transports.register(bad, Dummy())  # type: ignore[arg-type]


def test_unknown_scheme_says_how_to_register(fresh_registry: None) -> None:
    with pytest.raises(ConfigError) as info:
        aps.transports.get_factory("nosuchscheme")
    message = str(info.value)
    assert "unknown transport scheme 'nosuchscheme'" in message
    assert "memory, tcp, unix, ws, wss" in message
    assert "aps.transports.register('nosuchscheme', factory)" in message
    assert '[project.entry-points."aps.transports"]' in message


def test_scheme_of() -> None:
    assert aps.transports.scheme_of("TCP://127.0.0.1:5") == "tcp"
    assert aps.transports.scheme_of("memory://") == "memory"
    for bad in ("127.0.0.1:5", "", "/tmp/x"):
        with pytest.raises(ConfigError, match="has no scheme; write it as tcp://host:port"):
            aps.transports.scheme_of(bad)


async def test_connect_and_listen_by_url() -> None:
    async with await aps.transports.listen("memory://") as listener:
        async with await aps.transports.connect(listener.url) as client:
            async with await listener.accept() as server:
                await client.send(b"ok")
                assert await server.receive() == b"ok"
    with pytest.raises(ConfigError, match="unknown transport scheme 'nope'"):
        await aps.transports.connect("nope://x")


def _install_plugin(root: pathlib.Path, dist: str, module: str, entry: str) -> None:
    (root / f"{module}.py").write_text(
        textwrap.dedent(
            """
            from aps.transports.memory import MemoryFactory

            class PluginFactory(MemoryFactory):
                pass

            INSTANCE = PluginFactory()
            """
        )
    )
    info = root / f"{dist}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[aps.transports]\n{entry}\n")


def test_entry_point_is_found_lazily(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, fresh_registry: None
) -> None:
    _install_plugin(
        tmp_path, "aps_plugin_a", "aps_plugin_a", "pluginproto = aps_plugin_a:PluginFactory"
    )
    _install_plugin(tmp_path, "aps_plugin_b", "aps_plugin_b", "pluginobj = aps_plugin_b:INSTANCE")
    monkeypatch.syspath_prepend(str(tmp_path))
    for module in ("aps_plugin_a", "aps_plugin_b"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    assert "aps_plugin_a" not in sys.modules
    factory = aps.transports.get_factory("pluginproto")  # a class: instantiated
    assert type(factory).__name__ == "PluginFactory"
    assert "aps_plugin_a" in sys.modules
    assert aps.transports.get_factory("pluginproto") is factory
    instance = aps.transports.get_factory("pluginobj")  # an instance: used as is
    assert instance is sys.modules["aps_plugin_b"].INSTANCE


def test_entry_point_problems(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, fresh_registry: None
) -> None:
    _install_plugin(tmp_path, "aps_dup_a", "aps_dup_a", "dupe = aps_dup_a:PluginFactory")
    _install_plugin(tmp_path, "aps_dup_b", "aps_dup_b", "dupe = aps_dup_b:PluginFactory")
    _install_plugin(tmp_path, "aps_bad", "aps_bad", "broken = aps_bad_missing_module:Factory")
    _install_plugin(tmp_path, "aps_wrong", "aps_wrong", "wrong = textwrap:dedent")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="declared by several installed packages"):
        aps.transports.get_factory("dupe")
    with pytest.raises(ConfigError, match="failed to load"):
        aps.transports.get_factory("broken")
    with pytest.raises(TypeError, match="not a transport factory"):
        aps.transports.get_factory("wrong")


def test_conformance_suite_imports_no_pytest() -> None:
    result = _run_python(
        """
        import sys
        import aps.testing
        assert "pytest" not in sys.modules
        """
    )
    assert result.returncode == 0, result.stderr


def test_public_names() -> None:
    assert set(aps.transports.__all__) == {
        "Transport",
        "Listener",
        "TransportFactory",
        "DEFAULT_MAX_FRAME_SIZE",
        "is_local",
        "PreauthBudget",
        "register",
        "get_factory",
        "scheme_of",
        "connect",
        "listen",
        "local_transports",
        "default_local_transports",
        "local_listen_url",
        "tls_client_factory",
        "memory_transport_pair",
    }
    for name in aps.transports.__all__:
        assert hasattr(aps.transports, name)
    for name in aps.testing.__all__:
        assert hasattr(aps.testing, name)
    assert len(TRANSPORT_CHECKS) == len({check.__name__ for check in TRANSPORT_CHECKS})


async def test_a_tls_scheme_by_registration(
    tls: tuple[ssl.SSLContext, ssl.SSLContext], fresh_registry: None
) -> None:
    server_context, client_context = tls
    aps.transports.register(
        "tls", TCPFactory(server_ssl_context=server_context, client_ssl_context=client_context)
    )
    async with await aps.transports.listen("tls://127.0.0.1:0") as listener:
        assert listener.url.startswith("tls://127.0.0.1:")
        async with await aps.transports.connect(listener.url, timeout=5) as client:
            async with await listener.accept() as server:
                await client.send(b"secret")
                assert await server.receive() == b"secret"
                assert client.peer.startswith("tls://")


async def test_a_tls_client_factory_for_a_url_dials_a_tls_listener(
    tls: tuple[ssl.SSLContext, ssl.SSLContext],
) -> None:
    server_context, client_context = tls
    async with asyncio.timeout(10):
        factory = TCPFactory(server_ssl_context=server_context)
        async with await factory.listen("tcp://127.0.0.1:0") as listener:
            for url in (listener.url, listener.url.replace("tcp://", "tls://")):
                dialer = aps.transports.tls_client_factory(url, client_context)
                async with await dialer.connect(url, timeout=5) as client:
                    async with await listener.accept() as server:
                        await client.send(b"secret")
                        assert await server.receive() == b"secret"
    assert isinstance(
        aps.transports.tls_client_factory("wss://127.0.0.1:1/", client_context), WebSocketFactory
    )
    for url in ("ws://127.0.0.1:1/", "unix:///tmp/x", "memory://"):
        with pytest.raises(ConfigError, match=r"tcp://, tls://, wss:// URLs, not \w+://"):
            aps.transports.tls_client_factory(url, client_context)


@pytest.mark.parametrize("name", aps.transports.local_transports())
async def test_every_local_transport_binds_its_local_listen_url(name: str) -> None:
    async with asyncio.timeout(10):
        listener = await aps.transports.listen(aps.transports.local_listen_url(name))
        try:
            assert aps.transports.scheme_of(listener.url) == name
            assert aps.transports.is_local(listener)
        finally:
            await listener.aclose()


def test_local_listen_url_names_the_transports_it_knows() -> None:
    assert set(aps.transports.default_local_transports()) <= set(aps.transports.local_transports())
    assert aps.transports.default_local_transports()[-1] == "tcp"  # every platform has it
    for bad in ("quic", "TCP", "", None, 1):
        with pytest.raises(ConfigError, match=r"transport must be one of \['memory', "):
            aps.transports.local_listen_url(bad)  # type: ignore[arg-type]


# Capabilities: a transport says whether its peer is on this host.


@pytest.mark.parametrize(
    ("url", "local"),
    [
        ("tcp://127.0.0.1:0", True),
        ("tcp://[::1]:0", True),
        ("tcp://0.0.0.0:0", False),
        ("ws://127.0.0.1:0", True),
        ("unix://", True),
        ("memory://", True),
    ],
)
async def test_is_local_follows_the_bound_address_and_the_peer(url: str, local: bool) -> None:
    if url.startswith("tcp://[::1]") and not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    async with asyncio.timeout(10):
        listener = await aps.transports.listen(url)
        try:
            assert aps.transports.is_local(listener) is local
            dial = listener.url.replace("0.0.0.0", "127.0.0.1")
            client = await aps.transports.connect(dial, timeout=5)
            server = await listener.accept()
            # Dialed over loopback, both ends are local, whatever the listener is bound to.
            assert aps.transports.is_local(client)
            assert aps.transports.is_local(server)
            await client.aclose()
            await server.aclose()
        finally:
            await listener.aclose()


def test_is_local_is_false_for_an_endpoint_that_does_not_declare_it() -> None:
    class Plain:
        peer = "quic://example:1"

    assert aps.transports.is_local(Plain()) is False  # type: ignore[arg-type]
