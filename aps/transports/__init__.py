"""Transports move opaque frames between a learner and its workers.

The contracts are in :mod:`aps.transports.base`; URL schemes map to factories through
:func:`register` and :func:`get_factory`. The built-in factories live in
:mod:`aps.transports.tcp`, :mod:`aps.transports.unix`, :mod:`aps.transports.websocket` and
:mod:`aps.transports.memory`; the first three are imported only when a URL needs them. Every
built-in listener counts its connections from their first byte against a
:class:`PreauthBudget` (:mod:`aps.transports.budget`); the socket listeners (TCP, Unix,
WebSocket) build on :mod:`aps.transports.listener`, and stream transports share
:mod:`aps.transports.stream`.

Example:
    >>> import asyncio
    >>> async def main():
    ...     listener = await listen("memory://")
    ...     client = await connect(listener.url)
    ...     server = await listener.accept()
    ...     await client.send(b"ping")
    ...     frame = await server.receive()
    ...     for resource in (client, server, listener):
    ...         await resource.aclose()
    ...     return frame
    >>> asyncio.run(main())
    b'ping'
"""

from __future__ import annotations

from aps.transports.base import (
    DEFAULT_MAX_FRAME_SIZE,
    Listener,
    Transport,
    TransportFactory,
    is_local,
)
from aps.transports.budget import PreauthBudget
from aps.transports.memory import memory_transport_pair
from aps.transports.registry import (
    connect,
    default_local_transports,
    get_factory,
    listen,
    local_listen_url,
    local_transports,
    register,
    scheme_of,
    tls_client_factory,
)

__all__ = [
    # contracts
    "Transport",
    "Listener",
    "TransportFactory",
    "DEFAULT_MAX_FRAME_SIZE",
    # capabilities
    "is_local",
    "PreauthBudget",
    # schemes
    "register",
    "get_factory",
    "scheme_of",
    "connect",
    "listen",
    "local_transports",
    "default_local_transports",
    "local_listen_url",
    "tls_client_factory",
    # in-process pairs, for tests
    "memory_transport_pair",
]
