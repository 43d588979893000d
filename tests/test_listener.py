"""The listener base that TCP, Unix and WebSocket share, through each of them, on real sockets.

What the base does for all three: ``accept`` skips a connection that ended while it waited
and releases the tickets of those it hands out (unless a gate adopted the budget), ``aclose``
closes the connections nobody accepted and keeps the accepted ones, and :func:`bind` names
the address it cannot bind. (The Unix listener's socket file: tests/test_transports.py.)
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest

from aps import transports
from aps.errors import ConnectError, EndOfStream, TransportClosed
from aps.testing import until
from aps.transports import Listener, Transport
from aps.transports.listener import SocketListener, bind

DEADLINE = 10.0  # seconds for any one network wait

URLS = ["tcp://127.0.0.1:0", "unix://", "ws://127.0.0.1:0"]

Bound = SocketListener[Any]


@pytest.fixture(params=URLS)
async def listener(request: pytest.FixtureRequest) -> AsyncIterator[Bound]:
    if request.param.startswith("ws"):
        pytest.importorskip("websockets")
    async with asyncio.timeout(DEADLINE):
        bound = await transports.listen(request.param)
    assert isinstance(bound, SocketListener)
    async with bound:
        yield bound


def queued(listener: Bound) -> int:
    """Transports whose connection opened and that nobody accepted yet."""
    return len(listener._queue._items)


async def dial(listener: Listener) -> Transport:
    async with asyncio.timeout(DEADLINE):
        return await transports.connect(listener.url, timeout=DEADLINE)


async def take(listener: Bound) -> Any:
    async with asyncio.timeout(DEADLINE):
        return await listener.accept()


async def connected(client: Transport, server: Transport) -> bool:
    """Whether a frame ``client`` sends is what ``server`` receives."""
    async with asyncio.timeout(DEADLINE):
        await client.send(b"through")
        return await server.receive() == b"through"


async def test_accept_skips_a_connection_that_ended_while_it_waited(
    listener: Bound,
) -> None:
    listener.preauth.limit = 1  # a newcomer evicts the connection waiting in the queue
    gone = await dial(listener)
    await until(lambda: queued(listener) == 1, DEADLINE)
    kept = await dial(listener)
    await until(lambda: listener.preauth.evicted == 1, DEADLINE)
    accepted = await take(listener)
    assert await connected(kept, accepted)
    assert queued(listener) == 0
    for transport in (gone, kept, accepted):
        await transport.aclose()


async def test_accept_releases_the_ticket_unless_a_gate_adopted_the_budget(
    listener: Bound,
) -> None:
    first = await dial(listener)
    accepted = await take(listener)
    assert listener.preauth.held == 0
    assert accepted.preauth is None
    listener.preauth.adopt(deadline=30, report=lambda _: None)
    second = await dial(listener)
    held = await take(listener)
    assert listener.preauth.held == 1
    ticket = held.preauth
    assert ticket is not None and ticket.held
    ticket.release()  # the gate's part, once the peer proved the token
    assert listener.preauth.held == 0
    for transport in (first, accepted, second, held):
        await transport.aclose()


async def test_aclose_closes_the_unaccepted_and_keeps_the_accepted(
    listener: Bound,
) -> None:
    accepted_client = await dial(listener)
    accepted = await take(listener)
    waiting_client = await dial(listener)
    await until(lambda: queued(listener) == 1, DEADLINE)
    # aclose empties the queue before this task first runs: it finds the listener closed.
    pending = asyncio.create_task(listener.accept())
    await listener.aclose()
    await listener.aclose()  # idempotent
    with pytest.raises(TransportClosed, match="accept\\(\\) needs an open listener"):
        await asyncio.wait_for(pending, DEADLINE)
    with pytest.raises(EndOfStream):  # the listener closed it
        await asyncio.wait_for(waiting_client.receive(), DEADLINE)
    assert await connected(accepted_client, accepted)
    for transport in (accepted_client, accepted, waiting_client):
        await transport.aclose()


async def test_bind_names_the_address_it_cannot_take_and_the_fix() -> None:
    taken = await bind("tcp://127.0.0.1:0", "127.0.0.1", 0, dual_stack=False)
    port = taken.getsockname()[1]
    try:
        for url in (f"tcp://127.0.0.1:{port}", f"ws://127.0.0.1:{port}/"):
            if url.startswith("ws"):
                pytest.importorskip("websockets")
            with pytest.raises(ConnectError, match=f"cannot listen on '{url}': .*pick another"):
                await transports.listen(url)
    finally:
        taken.close()


async def test_an_empty_host_binds_every_interface_as_before() -> None:
    # TCP takes both families on one socket where it can; WebSocket the first address.
    tcp = await transports.listen("tcp://:0")
    assert isinstance(tcp, SocketListener)
    async with tcp:
        assert tcp.url.startswith(("tcp://[::]:", "tcp://0.0.0.0:"))
        if socket.has_dualstack_ipv6():
            assert tcp.url.startswith("tcp://[::]:")
        port = tcp.url.rsplit(":", 1)[1]
        client = await transports.connect(f"tcp://127.0.0.1:{port}", timeout=DEADLINE)
        server = await take(tcp)
        assert await connected(client, server)
        await client.aclose()
        await server.aclose()
    pytest.importorskip("websockets")
    ws = await transports.listen("ws://:0/")
    assert isinstance(ws, SocketListener)
    async with ws:
        infos = socket.getaddrinfo(None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family = infos[0][0]
        assert ws.url.startswith("ws://[::]:" if family == socket.AF_INET6 else "ws://0.0.0.0:")
