"""The in-process transport: ``memory://name`` URLs and :func:`memory_transport_pair`.

Frames move between two objects in one event loop, without sockets, so role and facade tests
run fast and deterministically. It implements the same contract as the network transports
(the conformance suite in :mod:`aps.testing` checks it), with these specifics:

- ``send`` copies a ``bytearray`` or ``memoryview`` to ``bytes`` before it returns, so mutating
  the buffer afterwards cannot change what the peer receives; ``bytes`` pass without a copy.
- Buffering is unbounded (there is no network to fill); ``send`` still yields to the event
  loop once per frame, so a sending loop cannot starve the receiver.
- ``send`` after the peer closed raises :class:`~aps.errors.ConnectionLost`.
- Listeners live in a process-wide registry keyed by name. ``memory://`` (an empty name)
  binds a fresh generated name such as ``memory://auto-1``, the analogue of TCP port 0.
  Connecting and listening must happen in the same event loop.

Example:
    >>> import asyncio
    >>> async def main():
    ...     client, server = memory_transport_pair()
    ...     await client.send(b"ping")
    ...     return await server.receive()
    >>> asyncio.run(main())
    b'ping'
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import sys

from aps._base._resource import AsyncResource
from aps._base._typing import Frame
from aps.errors import (
    ConfigError,
    ConnectError,
    ConnectionLost,
    EndOfStream,
    FrameTooLarge,
    InvalidState,
    TransportClosed,
)
from aps.transports._util import AcceptQueue
from aps.transports.base import DEFAULT_MAX_FRAME_SIZE
from aps.wire.framing import check_max_frame_size, frame_view

__all__ = ["MemoryFactory", "MemoryListener", "MemoryTransport", "memory_transport_pair"]

# Listeners by name, for every event loop in the process; a listener removes itself on aclose.
_listeners: dict[str, MemoryListener] = {}
_auto_names = itertools.count(1)
_pair_ids = itertools.count(1)
# No header limits an in-process frame.
_CEILING = sys.maxsize


class MemoryTransport(AsyncResource):
    """One end of an in-process connection. Create pairs with :func:`memory_transport_pair`.

    Attributes:
        max_frame_size: the largest frame this end sends or receives, in bytes.
    """

    def __init__(self, *, peer: str, max_frame_size: int) -> None:
        self._peer_name = peer
        self.max_frame_size = check_max_frame_size(max_frame_size, ceiling=_CEILING)
        self._other: MemoryTransport | None = None
        self._inbox: collections.deque[bytes] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._receiving = False
        self._closed = False
        self._peer_closed = False

    @property
    def peer(self) -> str:
        """The other end's address, for logs and errors."""
        return self._peer_name

    @property
    def is_local(self) -> bool:
        """Always ``True``: the other end is in this process."""
        return True

    async def send(self, frame: Frame) -> None:
        """Deliver one whole frame to the peer's inbox, then yield to the event loop once.

        Cancellation: the frame is delivered whole before the only suspension point.

        Raises:
            TransportClosed: this side already closed.
            FrameTooLarge: the frame exceeds ``max_frame_size``; nothing was sent.
            ConnectionLost: the peer already closed.
        """
        if self._closed:
            raise TransportClosed(f"cannot send to {self.peer}: this transport is closed")
        view = frame_view(frame)
        if view.nbytes > self.max_frame_size:
            raise FrameTooLarge(view.nbytes, self.max_frame_size)
        other = self._other
        if other is None or self._peer_closed:
            raise ConnectionLost(f"cannot send to {self.peer}: the peer closed the connection")
        # Copy anything mutable so later changes by the caller cannot reach the peer.
        other._deliver(frame if type(frame) is bytes else view.tobytes())
        await asyncio.sleep(0)

    async def receive(self) -> bytes:
        """Wait for the next frame.

        Cancellation: no frame is lost; a frame is removed from the inbox only when returned.

        Raises:
            EndOfStream: the peer closed and every frame it sent was received.
            TransportClosed: this side closed (also wakes a pending call).
            FrameTooLarge: the peer sent more than this end's ``max_frame_size``
                (the transport closes).
            InvalidState: another task is already receiving.
        """
        if self._receiving:
            raise InvalidState(
                f"receive() on the transport to {self.peer} is already running in another "
                "task; receive from one task at a time"
            )
        self._receiving = True
        try:
            while not self._inbox:
                if self._closed:
                    raise TransportClosed(
                        f"cannot receive from {self.peer}: this transport is closed"
                    )
                if self._peer_closed:
                    raise EndOfStream(f"{self.peer} closed the connection")
                self._waiter = asyncio.get_running_loop().create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
            frame = self._inbox.popleft()
        finally:
            self._receiving = False
        if len(frame) > self.max_frame_size:
            await self.aclose()
            raise FrameTooLarge(len(frame), self.max_frame_size)
        return frame

    async def aclose(self) -> None:
        """Close both directions; the peer receives its pending frames, then EndOfStream.

        Idempotent; wakes a pending ``receive`` on this side, which raises TransportClosed.
        """
        if self._closed:
            return
        self._closed = True
        self._inbox.clear()
        self._wake()
        other = self._other
        if other is not None:
            other._peer_closed = True
            other._wake()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<MemoryTransport peer={self.peer!r} {state}>"

    def _deliver(self, frame: bytes) -> None:
        if self._closed:
            # The peer closed between our checks and now; dropping matches a socket whose
            # reader has gone away.
            return
        self._inbox.append(frame)
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


def _connect_ends(
    a_peer: str, b_peer: str, a_limit: int, b_limit: int
) -> tuple[MemoryTransport, MemoryTransport]:
    a = MemoryTransport(peer=a_peer, max_frame_size=a_limit)
    b = MemoryTransport(peer=b_peer, max_frame_size=b_limit)
    a._other = b
    b._other = a
    return a, b


def memory_transport_pair(
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
) -> tuple[MemoryTransport, MemoryTransport]:
    """Return two connected in-process transports.

    Args:
        max_frame_size: the frame limit of both ends, in bytes.

    Raises:
        ConfigError: ``max_frame_size`` is not a positive int.
    """
    check_max_frame_size(max_frame_size, ceiling=_CEILING)
    n = next(_pair_ids)
    return _connect_ends(
        f"memory://pair-{n}#b", f"memory://pair-{n}#a", max_frame_size, max_frame_size
    )


class MemoryListener(AsyncResource):
    """Accepts in-process connections made with :meth:`MemoryFactory.connect`.

    Closing it unbinds the name; connections nobody accepted are closed, accepted ones stay
    open.
    """

    def __init__(self, name: str, *, max_frame_size: int) -> None:
        self._name = name
        self._max_frame_size = max_frame_size
        self._loop = asyncio.get_running_loop()
        self._queue: AcceptQueue[MemoryTransport] = AcceptQueue(f"listener {self.url}")
        self._clients = itertools.count(1)

    @property
    def url(self) -> str:
        """``memory://`` plus the bound name (generated if the URL named none)."""
        return f"memory://{self._name}"

    @property
    def is_local(self) -> bool:
        """Always ``True``: only this process can connect."""
        return True

    async def accept(self) -> MemoryTransport:
        """Wait for the next connection.

        Cancellation: no connection is lost.

        Raises:
            TransportClosed: the listener was closed (also wakes a pending call).
        """
        return await self._queue.get()

    async def aclose(self) -> None:
        """Unbind the name and wake pending ``accept`` calls; idempotent."""
        if self._queue.closed:
            return
        if _listeners.get(self._name) is self:
            del _listeners[self._name]
        for transport in self._queue.close():
            await transport.aclose()

    def __repr__(self) -> str:
        return f"<MemoryListener {self.url}>"

    def _connect(self, client_limit: int) -> MemoryTransport:
        k = next(self._clients)
        client, server = _connect_ends(
            self.url, f"{self.url}#client-{k}", client_limit, self._max_frame_size
        )
        if not self._queue.put(server):
            raise ConnectError(f"cannot connect to {self.url}: the listener closed", url=self.url)
        return client


class MemoryFactory:
    """Creates ``memory://name`` listeners and connections within one process.

    Args:
        max_frame_size: the frame limit of every transport it creates, in bytes.

    Raises:
        ConfigError: ``max_frame_size`` is not a positive int.
    """

    def __init__(self, *, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        self.max_frame_size = check_max_frame_size(max_frame_size, ceiling=_CEILING)

    async def connect(self, url: str, *, timeout: float | None = None) -> MemoryTransport:
        """Connect to the listener bound to ``url``'s name; never waits, so ``timeout`` is unused.

        Raises:
            ConnectError: no listener has that name, or it runs in another event loop.
            ConfigError: ``url`` is not ``scheme://name``.
        """
        name = _name_of(url)
        listener = _listeners.get(name)
        if listener is None:
            raise ConnectError(
                f"cannot connect to {url!r}: no memory listener is bound to {name!r}; "
                "call listen() on that url first, in this process",
                url=url,
            )
        if listener._loop is not asyncio.get_running_loop():
            raise ConnectError(
                f"cannot connect to {url!r}: its listener runs in another event loop; "
                "memory transports work within one event loop",
                url=url,
            )
        return listener._connect(self.max_frame_size)

    async def listen(self, url: str) -> MemoryListener:
        """Bind ``url``'s name (``memory://`` alone binds a generated one).

        Raises:
            ConnectError: another listener in this process already has that name.
            ConfigError: ``url`` is not ``scheme://name``.
        """
        name = _name_of(url)
        if not name:
            name = next(n for n in (f"auto-{i}" for i in _auto_names) if n not in _listeners)
        elif name in _listeners:
            raise ConnectError(
                f"cannot listen on {url!r}: a memory listener already has the name {name!r}; "
                "close it first or use memory:// to get a fresh name",
                url=url,
            )
        listener = MemoryListener(name, max_frame_size=self.max_frame_size)
        _listeners[name] = listener
        return listener

    def __repr__(self) -> str:
        return f"MemoryFactory(max_frame_size={self.max_frame_size})"


def _name_of(url: str) -> str:
    scheme, sep, name = url.partition("://")
    if not sep or not scheme:
        raise ConfigError(
            f"memory transport url {url!r} is malformed; write it as memory://name "
            "(or memory:// for a generated name)"
        )
    return name
