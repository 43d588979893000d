"""Helpers shared by the built-in transports (private: plug-ins should not rely on them)."""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import ssl
from collections.abc import Awaitable, Callable
from typing import Generic, Literal, TypeVar

from aps.errors import AuthError, ConfigError, TransportClosed

__all__ = [
    "AcceptQueue",
    "address_url",
    "check_ssl_side",
    "detach",
    "format_host",
    "is_loopback_host",
    "owned_payload",
]

T = TypeVar("T")


def owned_payload(view: memoryview) -> bytes | memoryview:
    """Return ``view`` if nobody can mutate its bytes, else an immutable copy.

    Event-loop transports may keep a reference to a written buffer until it is flushed
    (asyncio does since Python 3.12, and TLS always queues application data). Mutating a
    ``bytearray`` after ``send`` returned would then change bytes still waiting to go out, so
    anything not backed by ``bytes`` is copied once.
    """
    if isinstance(view.obj, bytes):
        return view
    return view.tobytes()


def format_host(host: str) -> str:
    """Return ``host`` ready for a URL: IPv6 literals go in brackets."""
    return f"[{host}]" if ":" in host else host


def address_url(scheme: str, address: object, fallback: str) -> str:
    """``scheme://host:port`` for a socket's ``(host, port, ...)`` address, else ``fallback``.

    How logs and errors name a peer; IPv6 hosts go in brackets.
    """
    if isinstance(address, tuple) and len(address) >= 2:
        return f"{scheme}://{format_host(str(address[0]))}:{address[1]}"
    return fallback


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (an address literal or ``localhost``) can only be reached from this host.

    A name other than ``localhost`` is not resolved: it counts as remote.
    """
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_ssl_side(
    context: ssl.SSLContext | None,
    side: Literal["client", "server"],
    url: str,
    factory: str,
) -> ssl.SSLContext | None:
    """Return ``context`` if it can serve ``side``.

    Raises:
        ConfigError: it was made for the other side (``ssl.PROTOCOL_TLS_SERVER`` cannot
            connect, ``ssl.PROTOCOL_TLS_CLIENT`` cannot listen).
    """
    wrong = ssl.PROTOCOL_TLS_SERVER if side == "client" else ssl.PROTOCOL_TLS_CLIENT
    if context is not None and context.protocol == wrong:
        other = "server" if side == "client" else "client"
        verb = "connect to" if side == "client" else "listen on"
        raise ConfigError(
            f"cannot {verb} {url!r} with a {other}-side ssl context; pass "
            f"{side}_ssl_context= (an ssl.PROTOCOL_TLS_{side.upper()} context) to {factory}"
        )
    return context


def detach(close: Callable[[], Awaitable[None]]) -> None:
    """Run ``close()`` in a background task whose failures are ignored.

    Used from synchronous callbacks (an accept that lost the race with ``aclose``) that must
    close a transport but cannot await.
    """
    task = asyncio.get_running_loop().create_task(_quietly(close))
    _background.add(task)
    task.add_done_callback(_background.discard)


# Strong references to detached tasks: the event loop keeps only weak ones.
_background: set[asyncio.Task[None]] = set()


async def _quietly(close: Callable[[], Awaitable[None]]) -> None:
    try:
        await close()
    except Exception:
        # Closing is best effort, and aclose() is documented never to raise anyway.
        pass


class AcceptQueue(Generic[T]):
    """Connections waiting for ``Listener.accept``; closing it wakes every waiter.

    Args:
        what: how errors name the listener (``"listener tcp://127.0.0.1:5555"``).
    """

    def __init__(self, what: str) -> None:
        self._what = what
        self._items: collections.deque[T] = collections.deque()
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._closed = False

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    def put(self, item: T) -> bool:
        """Queue ``item``; return False (and keep nothing) if the queue is closed."""
        if self._closed:
            return False
        self._items.append(item)
        self._wake_one()
        return True

    async def get(self) -> T:
        """Wait for the next item.

        Cancellation loses nothing: an item is removed only when it is returned.

        Raises:
            TransportClosed: the queue was closed (also wakes a pending call).
        """
        while not self._items:
            if self._closed:
                raise TransportClosed(f"{self._what} is closed; accept() needs an open listener")
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                # If this waiter was woken for an item, pass the wake-up on so that the
                # item is not stranded while another task waits.
                if waiter.done() and not waiter.cancelled():
                    self._wake_one()
                raise
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        return self._items.popleft()

    def close(self) -> list[T]:
        """Close the queue, wake every waiter and return the items nobody accepted."""
        self._closed = True
        items = list(self._items)
        self._items.clear()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
        return items

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


def tls_refused(url: str, exc: ssl.SSLCertVerificationError) -> AuthError:
    """The error for a peer whose TLS certificate failed verification, with the TLS reason."""
    reason = exc.verify_message or exc.reason or str(exc)
    return AuthError(
        f"the TLS certificate of {url!r} failed verification: {reason}; give the worker the "
        "CA that signed the learner's certificate (--tls-ca), or a certificate that names "
        "the host the worker dials"
    )
