"""URL schemes to transport factories: the convenience layer over explicit objects.

Where a factory comes from, in order:

1. :func:`register` — a factory object registered in this process;
2. the built-ins, imported on first use: ``tcp``, ``unix``, ``ws``, ``wss`` and ``memory``;
3. the ``aps.transports`` entry-point group, read only when a scheme is not found above.
   A package provides the scheme ``quic`` with::

       [project.entry-points."aps.transports"]
       quic = "aps_quic:QUICFactory"

   The entry point may name a factory class (called without arguments) or an instance.

Nothing is imported or scanned at ``import aps``: the ``websockets`` package is imported the
first time a ``ws://`` URL is used, and entry points are read on the first unknown scheme.
Explicit objects never need the registry: roles accept a ``Transport`` or ``Listener`` too.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import re
import socket
import ssl
from urllib.parse import urlsplit

from aps.errors import ConfigError
from aps.transports.base import Listener, Transport, TransportFactory

__all__ = [
    "ENTRY_POINT_GROUP",
    "connect",
    "default_local_transports",
    "get_factory",
    "listen",
    "local_listen_url",
    "local_transports",
    "register",
    "scheme_of",
    "tls_client_factory",
]

ENTRY_POINT_GROUP = "aps.transports"
"""The entry-point group searched for schemes that are not registered or built in."""

_BUILTINS: dict[str, str] = {
    "memory": "aps.transports.memory:MemoryFactory",
    "tcp": "aps.transports.tcp:TCPFactory",
    "unix": "aps.transports.unix:UnixFactory",
    "ws": "aps.transports.websocket:WebSocketFactory",
    "wss": "aps.transports.websocket:WebSocketFactory",
}

# The built-ins a learner can bind on this host with no address chosen, and the URL it binds
# (port 0 or a fresh private directory: nothing to collide with).
_LOCAL_LISTEN_URLS: dict[str, str] = {
    "tcp": "tcp://127.0.0.1:0",
    "unix": "unix://",
    "ws": "ws://127.0.0.1:0",
    "memory": "memory://",
}

# The built-ins a worker can dial with TLS given only a client context. "tls" is the scheme
# docs/transports.md suggests a learner register as its TLS flavour of TCP; a worker started
# elsewhere does not see that registration.
_TLS_CLIENTS: dict[str, str] = {
    "tcp": "aps.transports.tcp:TCPFactory",
    "tls": "aps.transports.tcp:TCPFactory",
    "wss": "aps.transports.websocket:WebSocketFactory",
}

# Registered factories, plus built-ins and entry points once loaded.
_factories: dict[str, TransportFactory] = {}

# RFC 3986: a scheme is a letter followed by letters, digits, "+", "-" or ".".
_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*")


def _check_scheme(scheme: object) -> str:
    if not isinstance(scheme, str) or not _SCHEME.fullmatch(scheme.lower()):
        raise ConfigError(
            f"transport scheme {scheme!r} is invalid; use a letter followed by letters, "
            "digits, '+', '-' or '.', without '://' (for example 'quic')"
        )
    return scheme.lower()


def _check_factory(factory: object, where: str) -> TransportFactory:
    if isinstance(factory, type):
        raise TypeError(
            f"{where}: {factory.__qualname__} is a class; pass an instance, "
            f"for example {factory.__qualname__}()"
        )
    if not isinstance(factory, TransportFactory):
        raise TypeError(
            f"{where}: {factory!r} is not a transport factory; it needs async methods "
            "connect(url, *, timeout=None) and listen(url) (see aps.transports.TransportFactory)"
        )
    return factory


def register(scheme: str, factory: TransportFactory, *, replace: bool = False) -> None:
    """Make ``scheme://...`` URLs use ``factory``.

    Args:
        scheme: the URL scheme, without ``://`` (case-insensitive).
        factory: an object with ``connect`` and ``listen`` (see
            :class:`~aps.transports.TransportFactory`).
        replace: allow replacing an existing registration or a built-in.

    Raises:
        ConfigError: ``scheme`` is invalid, or already registered and ``replace`` is false.
        TypeError: ``factory`` is a class, or lacks ``connect``/``listen``.
    """
    name = _check_scheme(scheme)
    checked = _check_factory(factory, f"register({name!r})")
    if not replace and (name in _factories or name in _BUILTINS):
        raise ConfigError(
            f"transport scheme {name!r} is already registered; pass replace=True to "
            "override it, or choose another scheme"
        )
    _factories[name] = checked


def _load(target: str) -> type:
    module_name, _, attribute = target.partition(":")
    loaded: type = getattr(importlib.import_module(module_name), attribute)
    return loaded


def get_factory(scheme: str) -> TransportFactory:
    """Return the factory for ``scheme``, importing a built-in or entry point if needed.

    Raises:
        ConfigError: no factory is known for ``scheme``, or its entry point failed to load.
        MissingDependency: the scheme needs an optional extra (``ws``: ``aps-rl[websocket]``).
    """
    name = _check_scheme(scheme)
    factory = _factories.get(name)
    if factory is not None:
        return factory
    target = _BUILTINS.get(name)
    if target is not None:
        factory = _check_factory(_load(target)(), f"built-in scheme {name!r}")
    else:
        factory = _from_entry_point(name)
    # setdefault: a concurrent register() during the import wins over the default.
    return _factories.setdefault(name, factory)


def _from_entry_point(name: str) -> TransportFactory:
    found = list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP, name=name))
    if not found:
        schemes = sorted(set(_factories) | set(_BUILTINS))
        close = difflib.get_close_matches(name, schemes, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"unknown transport scheme {name!r}{hint}; known schemes: {', '.join(schemes)}. "
            "Register one with "
            f"aps.transports.register({name!r}, factory), or install a package that declares "
            f'it under [project.entry-points."{ENTRY_POINT_GROUP}"]'
        )
    if len({entry.value for entry in found}) > 1:
        sources = ", ".join(sorted(entry.value for entry in found))
        raise ConfigError(
            f"transport scheme {name!r} is declared by several installed packages ({sources}); "
            f"uninstall all but one, or call aps.transports.register({name!r}, factory, "
            "replace=True)"
        )
    entry = found[0]
    try:
        loaded = entry.load()
    except Exception as exc:
        raise ConfigError(
            f"the entry point {entry.value!r} for transport scheme {name!r} failed to load: "
            f"{exc!r}; fix or reinstall the package that provides it"
        ) from exc
    return _check_factory(
        loaded() if isinstance(loaded, type) else loaded,
        f"entry point {entry.value!r} for scheme {name!r}",
    )


def local_transports() -> tuple[str, ...]:
    """The transport names :func:`local_listen_url` knows, sorted."""
    return tuple(sorted(_LOCAL_LISTEN_URLS))


def default_local_transports() -> tuple[str, ...]:
    """The transports to try, in order, for a learner whose workers all run on this host.

    A Unix socket first where the platform has them (less CPU per message than loopback
    TCP), then TCP on 127.0.0.1, which every platform has.
    """
    return ("unix", "tcp") if hasattr(socket, "AF_UNIX") else ("tcp",)


def local_listen_url(transport: str) -> str:
    """The URL a learner binds for workers on this host over the built-in ``transport``.

    ``"tcp"`` and ``"ws"`` bind 127.0.0.1 on a free port, ``"unix"`` a socket in a fresh
    private directory, ``"memory"`` a fresh in-process name.

    Raises:
        ConfigError: ``transport`` is not one of :func:`local_transports`.
    """
    url = _LOCAL_LISTEN_URLS.get(transport) if isinstance(transport, str) else None
    if url is None:
        raise ConfigError(
            f"transport must be one of {list(local_transports())}, got {transport!r}; "
            "for another transport pass a listen URL or a Listener instead"
        )
    return url


def tls_client_factory(url: str, context: ssl.SSLContext) -> TransportFactory:
    """A factory that dials ``url`` with TLS, trusting what ``context`` trusts.

    TCP for ``tcp://`` and ``tls://`` URLs, WebSocket for ``wss://``.

    Raises:
        ConfigError: the URL is malformed, or its scheme has no TLS flavour among the
            built-ins.
    """
    scheme = scheme_of(url)
    target = _TLS_CLIENTS.get(scheme)
    if target is None:
        schemes = ", ".join(f"{name}://" for name in _TLS_CLIENTS)
        raise ConfigError(
            f"aps dials with TLS over {schemes} URLs, not {scheme}://; use one of those, "
            "or pass a transport factory built with your own TLS context"
        )
    return _check_factory(_load(target)(client_ssl_context=context), f"TLS for {scheme!r}")


def scheme_of(url: str) -> str:
    """Return the lowercase scheme of a transport URL (``"tcp"`` for ``tcp://host:1``).

    Raises:
        ConfigError: ``url`` has no ``scheme://`` prefix.
    """
    scheme = urlsplit(url).scheme if isinstance(url, str) and "://" in url else ""
    if not scheme:
        raise ConfigError(
            f"transport url {url!r} has no scheme; write it as tcp://host:port, "
            "ws://host:port, unix:///path/to/socket or memory://name"
        )
    return scheme.lower()


async def connect(url: str, *, timeout: float | None = None) -> Transport:
    """Connect to ``url`` with the factory registered for its scheme.

    Raises:
        ConnectError: nothing answered, or the answer was not this transport.
        Timeout: no connection within ``timeout`` seconds (``None``: no limit).
        ConfigError: the URL is malformed or its scheme unknown.
        MissingDependency: the scheme needs an optional extra that is not installed.
    """
    return await get_factory(scheme_of(url)).connect(url, timeout=timeout)


async def listen(url: str) -> Listener:
    """Bind ``url`` with the factory registered for its scheme.

    Raises:
        ConnectError: the address cannot be bound.
        ConfigError: the URL is malformed or its scheme unknown.
        MissingDependency: the scheme needs an optional extra that is not installed.
    """
    return await get_factory(scheme_of(url)).listen(url)
