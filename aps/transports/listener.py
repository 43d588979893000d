"""The bases of the built-in socket listeners (TCP, Unix, WebSocket) and of their factories.

A :class:`SocketListener` accepts its sockets itself with an
:class:`~aps.transports.stream.Acceptor`, so that every connection takes a
:class:`~aps.transports.budget.Ticket` of the listener's pre-auth budget from its first byte;
transports whose connection opened wait in an accept queue for :meth:`~SocketListener.accept`.
A subclass says what one connection is:

- :meth:`~SocketListener._prepare`: what it needs before accepting starts, if anything;
- :meth:`~SocketListener._protocol`: the protocol the acceptor hands a socket to (with its
  ticket), which calls :meth:`~SocketListener._arrived` with its transport once it opened;
- :meth:`~SocketListener._take`: whether a queued transport is still open when ``accept``
  takes it (and what taking it changes);
- :meth:`~SocketListener._stopped`: what closing the listener leaves to do, if anything.

:func:`bind` makes the listening socket of a TCP host and port, and :class:`SocketFactory`
holds what the TCP and WebSocket factories are given: TLS contexts per side, the frame limit
and each listener's pre-auth limits. The work here is per connection: nothing runs per frame.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import os
import socket
import ssl
from typing import Any, Generic, Protocol, TypeVar
from urllib.parse import urlsplit

from aps._base._resource import AsyncResource
from aps.errors import ConnectError
from aps.transports._util import AcceptQueue, address_url, detach, is_loopback_host
from aps.transports.base import DEFAULT_MAX_FRAME_SIZE
from aps.transports.budget import DEFAULT_LIMIT, DEFAULT_PER_HOST, PreauthBudget, Ticket
from aps.transports.stream import Acceptor, reason
from aps.wire.framing import MAX_FRAME_LENGTH, check_max_frame_size

__all__ = ["ACCEPT_BACKLOG", "SocketFactory", "SocketListener", "bind"]

ACCEPT_BACKLOG = 2048
"""Connections the kernel queues for ``accept()`` while a listener is busy or paused.

A cluster job starts every worker at once. With a queue of 128, a storm of 1,024 workers
overflowed it: the kernel dropped the handshakes' last packets, the dropped workers believed
they were connected, waited out their 10 s handshake deadline for a challenge that never
came and dialed again, and the storm took 22.4-22.6 s to admit; with 2048 it took 1.9-2.7 s
(``benchmarks/fleet.py --workers 1024 --addresses 16``, interleaved). The queue holds
connections the kernel completed; the pre-auth budget still bounds what the learner spends
on them once accepted (every one is accepted at once, and the budget evicts or turns away
what it cannot hold). The kernel caps the number at ``net.core.somaxconn``."""


class Accepted(Protocol):
    """What a listener's queue holds: a transport, with its connection's pre-auth ticket."""

    @property
    def preauth(self) -> Ticket | None:
        """The connection's ticket while its budget still counts it, else ``None``."""
        ...

    async def aclose(self) -> None:
        """Close the transport; idempotent."""
        ...


T = TypeVar("T", bound=Accepted)


class SocketListener(AsyncResource, Generic[T]):
    """A listener on a bound socket whose connections count against :attr:`preauth`.

    Accepting starts when it is made, once :meth:`_prepare` set up what :meth:`_protocol`
    needs.

    Args:
        sock: a bound, listening socket; the listener owns it from here.
        url: the bound address (``tcp://127.0.0.1:54321``): :attr:`url`, and the scheme
            of the peers' names.
        max_frame_size: the largest frame an accepted transport sends or receives.
        ssl_context: a server-side context for TLS, or ``None``.
        preauth: the pre-auth budget; a fresh one with the default limits if ``None``.
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        url: str,
        max_frame_size: int,
        ssl_context: ssl.SSLContext | None = None,
        preauth: PreauthBudget | None = None,
    ) -> None:
        self._url = url
        self._scheme = url.partition("://")[0]
        self._max_frame_size = max_frame_size
        self._ssl = ssl_context
        self.preauth = preauth if preauth is not None else PreauthBudget()
        """The pre-auth budget of this listener's connections; see :mod:`aps.transports.budget`."""
        self._queue: AcceptQueue[T] = AcceptQueue(f"listener {url}")
        self._prepare()
        self._acceptor = Acceptor(
            sock,
            budget=self.preauth,
            ssl_context=ssl_context,
            protocol=self._protocol,
            peer=self._peer_at,
            what=f"listener {url}",
        )

    @property
    def url(self) -> str:
        """The bound address: port 0 resolved (``tcp://127.0.0.1:54321``), or a fresh path."""
        return self._url

    @property
    def is_local(self) -> bool:
        """Whether only this host can connect: the bound address is a loopback one."""
        return is_loopback_host(urlsplit(self._url).hostname or "")

    async def accept(self) -> T:
        """Wait for the next connection that opened (its TLS and opening handshakes done).

        A connection that ended while it waited (evicted, timed out, or closed by its peer)
        is skipped. Unless the budget was adopted (by a learner's gate), the connection's
        ticket is released here.

        Cancellation: no connection is lost.

        Raises:
            TransportClosed: the listener was closed (also wakes a pending call).
        """
        while True:
            transport = await self._queue.get()
            if not self._take(transport):
                detach(transport.aclose)
                continue
            ticket = transport.preauth
            if ticket is not None and not self.preauth.holds_after_accept:
                ticket.release()
            return transport

    async def aclose(self) -> None:
        """Stop listening and wake pending ``accept`` calls; idempotent.

        Connections already accepted stay open; connections nobody accepted (in their
        handshakes or in the queue) are closed.
        """
        if self._queue.closed:
            return
        unaccepted = self._queue.close()
        await self._acceptor.aclose()
        for transport in unaccepted:
            await transport.aclose()
        self._stopped()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url}>"

    # What a subclass defines.

    def _prepare(self) -> None:
        """Set up what :meth:`_protocol` needs; called once, before accepting starts."""

    @abc.abstractmethod
    def _protocol(self, ticket: Ticket) -> asyncio.BaseProtocol:
        """The protocol of one accepted socket, which holds ``ticket``."""

    @abc.abstractmethod
    def _take(self, transport: T) -> bool:
        """``accept`` takes ``transport`` from the queue: whether it is still open.

        One that is not is closed and skipped.
        """

    def _stopped(self) -> None:
        """What closing leaves to do once accepting stopped and the queue was emptied."""

    # For subclasses.

    def _arrived(self, transport: T) -> None:
        """Queue ``transport``, whose connection opened; close it if the listener closed."""
        if not self._queue.put(transport):
            detach(transport.aclose)

    def _peer_at(self, address: object) -> str:
        """How logs name the peer at ``address`` (what ``accept`` returned)."""
        return address_url(self._scheme, address, f"{self._scheme}://unknown")


class SocketFactory:
    """What a factory of socket transports is given; its class says what it dials and binds.

    Args:
        ssl_context: TLS for both sides; ``None`` means none.
        server_ssl_context: TLS for ``listen`` only (overrides ``ssl_context``).
        client_ssl_context: TLS for ``connect`` only (overrides ``ssl_context``).
        max_frame_size: the largest frame sent or received, in bytes (at most
            :attr:`max_frame_ceiling`).
        preauth_limit: connections each listener holds before they proved the token (its
            handshakes included); see :mod:`aps.transports.budget`.
        preauth_per_host: of those, idle ones from one source address.

    Raises:
        ConfigError: ``max_frame_size`` or a pre-auth limit is out of range.
    """

    max_frame_ceiling = MAX_FRAME_LENGTH
    """The largest ``max_frame_size`` the wire format can announce (4 GiB - 1 by default)."""

    def __init__(
        self,
        *,
        ssl_context: ssl.SSLContext | None = None,
        server_ssl_context: ssl.SSLContext | None = None,
        client_ssl_context: ssl.SSLContext | None = None,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        preauth_limit: int = DEFAULT_LIMIT,
        preauth_per_host: int = DEFAULT_PER_HOST,
    ) -> None:
        self.max_frame_size = check_max_frame_size(max_frame_size, ceiling=self.max_frame_ceiling)
        self._preauth_limits = {"limit": preauth_limit, "per_host": preauth_per_host}
        self._preauth()  # refuses bad limits now, not at listen
        self._server_ssl = server_ssl_context or ssl_context
        self._client_ssl = client_ssl_context or ssl_context

    def _preauth(self) -> PreauthBudget:
        """A fresh budget for one listener, with this factory's limits."""
        return PreauthBudget(**self._preauth_limits)


async def bind(url: str, host: str | None, port: int, *, dual_stack: bool) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening, for the listener of ``url``.

    ``host=None`` means every interface. The first address the host resolves to is bound (as
    ``localhost`` may resolve to IPv4 and IPv6), so that one port reaches the listener. With
    ``dual_stack``, every interface means IPv6 and IPv4 on one socket where the system can.

    Raises:
        ConnectError: the address is in use, not local, or does not resolve.
    """
    every_family = dual_stack and host is None
    try:
        family, address = await _address(host, port, every_family=every_family)
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            if os.name == "posix":  # as asyncio does: rebinding a port in TIME_WAIT
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and every_family:
                with contextlib.suppress(OSError):  # both families, where it can
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind(address)
            sock.listen(ACCEPT_BACKLOG)
        except BaseException:
            sock.close()
            raise
    except OSError as exc:
        raise ConnectError(
            f"cannot listen on {url!r}: {reason(exc)}; pick another port "
            "(0 picks a free one) or stop the process that holds it",
            url=url,
        ) from exc
    return sock


async def _address(
    host: str | None, port: int, *, every_family: bool
) -> tuple[int, tuple[Any, ...]]:
    """The family and address to bind: the first that resolves, IPv6 first if asked."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    if every_family and socket.has_dualstack_ipv6():
        for family, _, _, _, address in infos:
            if family == socket.AF_INET6:
                return family, address
    family, _, _, _, address = infos[0]
    return family, address
