"""A transport plug-in: Unix-domain sockets as ``uds:///path/to/socket``.

A transport is three small classes that satisfy the protocols in ``aps.transports.base``
(no base class to inherit). This one uses asyncio's Unix streams and the sans-I/O framing in
``aps.wire.framing``, maps every backend error to ``aps.errors``, and proves itself with the
public conformance suite. Run it:

    python examples/custom_transport.py

Once registered (``aps.transports.register("uds", UnixFactory())``, or an entry point in
the ``aps.transports`` group), ``uds://`` URLs work wherever aps takes a URL.

aps has Unix sockets built in as ``unix://`` (:mod:`aps.transports.unix`, on the TCP
transport's machinery); this plug-in builds the same thing from scratch, under its own
scheme, because it is small enough to read in one sitting.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from urllib.parse import urlsplit

import aps.transports
from aps.errors import (
    ConfigError,
    ConnectError,
    ConnectionLost,
    EndOfStream,
    FrameTooLarge,
    InvalidState,
    Timeout,
    TransportClosed,
)
from aps.testing import TRANSPORT_CHECKS, check_factory, check_transport, pair_from_factory
from aps.transports import DEFAULT_MAX_FRAME_SIZE
from aps.wire.framing import FrameDecoder, encode_frame

READ_SIZE = 256 * 1024  # bytes per read(); the decoder reassembles frames across reads
CLOSE_TIMEOUT = 5.0  # seconds aclose() waits for buffered frames before aborting


class UnixTransport:
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        peer: str,
        max_frame_size: int,
    ) -> None:
        self._reader, self._writer = reader, writer
        self._peer = peer
        self.max_frame_size = max_frame_size  # the conformance suite reads this attribute
        self._decoder = FrameDecoder(max_frame_size)
        self._send_lock = asyncio.Lock()
        self._receiving = False
        self._closed = False

    @property
    def peer(self) -> str:
        return self._peer

    async def send(self, frame: bytes | bytearray | memoryview) -> None:
        if self._closed:
            raise TransportClosed(f"cannot send to {self._peer}: this transport is closed")
        # One copy: header + payload. It checks the limit (FrameTooLarge) and means that a
        # bytearray mutated after send() returns cannot change what is sent.
        data = encode_frame(frame, max_frame_size=self.max_frame_size)
        async with self._send_lock:  # one frame at a time: concurrent senders never interleave
            if self._closed:
                raise TransportClosed(f"cannot send to {self._peer}: this transport is closed")
            try:
                # write() queues the whole frame synchronously, so a send cancelled in drain()
                # still delivers it whole: the peer never sees half a frame.
                self._writer.write(data)
                await self._writer.drain()
            except OSError as exc:
                if self._closed:
                    raise TransportClosed(f"{self._peer}: closed while sending") from None
                raise ConnectionLost(f"connection to {self._peer} lost: {exc}") from exc

    async def receive(self) -> bytes:
        if self._receiving:
            raise InvalidState(f"receive() on {self._peer} is already running in another task")
        if self._closed:
            raise TransportClosed(f"cannot receive from {self._peer}: this transport is closed")
        self._receiving = True
        try:
            while (frame := self._decoder.next_frame()) is None:
                # Cancelling read() loses nothing: unread bytes stay in the StreamReader, and
                # a partial frame stays in the decoder for the next call.
                chunk = await self._reader.read(READ_SIZE)
                if self._closed:
                    raise TransportClosed(f"{self._peer}: closed while receiving")
                if not chunk:
                    if self._decoder.at_boundary:
                        raise EndOfStream(f"{self._peer} closed the connection")
                    raise ConnectionLost(f"{self._peer} closed the connection mid-frame")
                self._decoder.feed(chunk)
            return frame
        except FrameTooLarge:
            await self.aclose()  # the stream position is lost: this connection is done
            raise
        except OSError as exc:
            if self._closed:
                raise TransportClosed(f"{self._peer}: closed while receiving") from None
            raise ConnectionLost(f"connection to {self._peer} lost: {exc}") from exc
        finally:
            self._receiving = False

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._writer.close()
        # close() stops reading at once, so EOF can be fed now: it wakes a pending receive(),
        # which then sees _closed and raises TransportClosed.
        self._reader.feed_eof()
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT):
                await self._writer.wait_closed()
        except (OSError, TimeoutError):
            self._writer.transport.abort()


class UnixListener:
    def __init__(self, url: str, path: str, max_frame_size: int) -> None:
        self._url, self._path = url, path
        self._max_frame_size = max_frame_size
        self._server: asyncio.Server | None = None
        # None in the queue means "closed"; each woken accept() puts it back for the next.
        self._queue: asyncio.Queue[UnixTransport | None] = asyncio.Queue()
        self._closed = False
        self._count = 0

    @property
    def url(self) -> str:
        return self._url

    async def accept(self) -> UnixTransport:
        transport = await self._queue.get()
        if transport is None:
            self._queue.put_nowait(None)
            raise TransportClosed(f"listener {self._url} is closed")
        return transport

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)  # so the same url can be bound again
        while not self._queue.empty():  # close connections nobody accepted
            pending = self._queue.get_nowait()
            if pending is not None:
                await pending.aclose()
        self._queue.put_nowait(None)

    def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._closed:
            writer.close()
            return
        self._count += 1
        peer = f"{self._url}#client-{self._count}"
        self._queue.put_nowait(
            UnixTransport(reader, writer, peer=peer, max_frame_size=self._max_frame_size)
        )


class UnixFactory:
    def __init__(self, *, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        self.max_frame_size = max_frame_size

    async def connect(self, url: str, *, timeout: float | None = None) -> UnixTransport:
        path = _path_of(url)
        try:
            async with asyncio.timeout(timeout) as deadline:
                reader, writer = await asyncio.open_unix_connection(path)
        except TimeoutError as exc:
            if deadline.expired():
                raise Timeout(
                    f"connecting to {url!r} took longer than {timeout} s",
                    operation="connect",
                    seconds=timeout,
                ) from exc
            raise ConnectError(f"cannot connect to {url!r}: {exc}", url=url) from exc
        except OSError as exc:
            raise ConnectError(f"cannot connect to {url!r}: {exc.strerror}", url=url) from exc
        return UnixTransport(reader, writer, peer=url, max_frame_size=self.max_frame_size)

    async def listen(self, url: str) -> UnixListener:
        path = _path_of(url)
        listener = UnixListener(url, path, self.max_frame_size)
        try:
            listener._server = await asyncio.start_unix_server(listener._on_connect, path)
        except OSError as exc:
            raise ConnectError(f"cannot listen on {url!r}: {exc.strerror}", url=url) from exc
        return listener


def _path_of(url: str) -> str:
    parts = urlsplit(url)
    if parts.netloc or not parts.path.startswith("/"):
        raise ConfigError(f"uds url {url!r} is malformed; write it as uds:///absolute/path")
    return parts.path


async def main() -> None:
    aps.transports.register("uds", UnixFactory(max_frame_size=2**20), replace=True)
    factory = aps.transports.get_factory("uds")
    with tempfile.TemporaryDirectory() as directory:
        url = f"uds://{directory}/aps.sock"
        await check_factory(factory, url)
        await check_transport(pair_from_factory(factory, url))
    print(f"uds:// passed the factory checks and all {len(TRANSPORT_CHECKS)} transport checks")


if __name__ == "__main__":
    asyncio.run(main())
