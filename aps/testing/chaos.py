"""Faults on demand, to test a training setup against them: a TCP relay that loses and cuts.

Put a :class:`Relay` between workers and a learner and break the links at chosen moments::

    relay = Relay(learner.url)
    await relay.start()          # workers dial relay.url
    relay.lose_to_learner = True # the workers' next answers vanish on the way...
    relay.cut()                  # ...and the connections reset: the workers resume
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from urllib.parse import urlsplit

__all__ = ["Relay", "until"]


class Relay:
    """Forwards TCP connections from 127.0.0.1 to a learner; the test breaks them at will.

    ``lose_to_learner`` / ``lose_to_worker`` make the relay swallow what flows that way (the
    bytes are lost as if the link died before they arrived), and :meth:`cut` resets every
    connection, as a network failure does. Workers dial :attr:`url` and come back through it.
    """

    def __init__(self, learner_url: str) -> None:
        self.retarget(learner_url)
        self._server: asyncio.Server | None = None
        self._links: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self.lose_to_learner = False
        self.lose_to_worker = False
        self.cuts = 0
        self.url = ""

    def retarget(self, learner_url: str) -> None:
        """Send new connections to another learner (one that took over after a restart)."""
        parts = urlsplit(learner_url)
        if parts.scheme != "tcp" or parts.hostname is None or parts.port is None:
            raise ValueError(f"a relay forwards to tcp://host:port, got {learner_url!r}")
        self._target = (parts.hostname, parts.port)

    async def start(self) -> str:
        """Listen on a free 127.0.0.1 port; returns the URL workers dial (also :attr:`url`)."""
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"tcp://127.0.0.1:{port}"
        return self.url

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.transport.abort()
            return
        link = (writer, up_writer)
        self._links.add(link)
        try:
            await asyncio.gather(
                self._pipe(reader, up_writer, lambda: self.lose_to_learner),
                self._pipe(up_reader, writer, lambda: self.lose_to_worker),
            )
        finally:
            self._links.discard(link)

    @staticmethod
    async def _pipe(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, lose: Callable[[], bool]
    ) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(1 << 16):
                if lose():
                    continue
                writer.write(data)
                await writer.drain()
        writer.transport.abort()

    def cut(self) -> None:
        """Reset every connection through the relay (both ends see the link die)."""
        self.cuts += 1
        for worker_side, learner_side in list(self._links):
            worker_side.transport.abort()
            learner_side.transport.abort()
        self.lose_to_learner = self.lose_to_worker = False

    async def aclose(self) -> None:
        """Cut every connection and stop listening."""
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


async def until(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    """Wait until ``condition()`` holds; fail the test after ``timeout`` seconds."""
    async with asyncio.timeout(timeout):
        # Polling: the conditions are other objects' counters, which signal nothing.
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.005)
