"""The three transport contracts: :class:`Transport`, :class:`Listener`, :class:`TransportFactory`.

A transport moves opaque frames. It never looks inside them: transports do not import the
codec or the messages, so a plug-in author needs only this module.

Contract (the conformance suite in :mod:`aps.testing` checks every point):

- A frame sent is a frame received: byte-identical, in order, never merged or split.
- ``send`` may be called from several tasks at once; frames never interleave.
- Two concurrent ``receive`` calls: the second raises :class:`~aps.errors.InvalidState`.
- A cancelled ``receive`` loses no frame; a cancelled ``send`` either delivers the whole
  frame or closes the transport, so the peer never sees a corrupt frame.
- Frames sent before the peer's ``aclose`` are delivered, then ``receive`` raises
  :class:`~aps.errors.EndOfStream`. After this side's ``aclose``, ``send`` and ``receive``
  raise :class:`~aps.errors.TransportClosed`; ``aclose`` is idempotent and wakes a
  blocked ``receive``.
- A frame longer than the transport's ``max_frame_size`` is refused with
  :class:`~aps.errors.FrameTooLarge` before it is sent or allocated.
- Backend exceptions never escape: they are mapped to :class:`~aps.errors.TransportError`
  subclasses with ``raise ... from exc``.

Capabilities are optional attributes, read through a function of this module so that a
transport without them still satisfies the contracts:

- ``is_local`` (read with :func:`is_local`): ``True`` when the other end of a transport, or
  every peer a listener can accept, is on this host (in-process, a Unix socket, a loopback
  address). Absent means remote: aps then asks for a token and may compress.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from aps._base._typing import Frame

__all__ = [
    "DEFAULT_MAX_FRAME_SIZE",
    "Listener",
    "Transport",
    "TransportFactory",
    "is_local",
]

DEFAULT_MAX_FRAME_SIZE = 256 * 2**20
"""Default limit on one frame, in bytes (256 MiB: room for a large weights message)."""


@runtime_checkable
class Transport(Protocol):
    """A reliable, ordered, message-preserving duplex channel of opaque frames."""

    @property
    def peer(self) -> str:
        """A human-readable address of the other end, for logs and errors only."""
        ...

    async def send(self, frame: Frame) -> None:
        """Send one whole frame.

        Raises:
            FrameTooLarge: the frame exceeds ``max_frame_size``; nothing was sent.
            TransportClosed: this side already closed.
            ConnectionLost: the connection broke.
        """
        ...

    async def receive(self) -> bytes:
        """Wait for the next whole frame.

        Raises:
            EndOfStream: the peer closed cleanly and every frame it sent was received.
            TransportClosed: this side closed (also wakes a pending call).
            ConnectionLost: the connection broke.
            FrameTooLarge: the peer announced a frame over the limit (the transport closes).
            InvalidState: another task is already receiving.
        """
        ...

    async def aclose(self) -> None:
        """Close the transport; idempotent, never raises a backend error."""
        ...


@runtime_checkable
class Listener(Protocol):
    """Accepts incoming transports on one bound address."""

    @property
    def url(self) -> str:
        """The address actually bound, with port 0 resolved to the real port."""
        ...

    async def accept(self) -> Transport:
        """Wait for the next incoming connection.

        Raises:
            TransportClosed: the listener was closed (also wakes a pending call).
        """
        ...

    async def aclose(self) -> None:
        """Stop listening; idempotent. Transports already accepted stay open."""
        ...


@runtime_checkable
class TransportFactory(Protocol):
    """Creates transports and listeners for one or more URL schemes."""

    async def connect(self, url: str, *, timeout: float | None = None) -> Transport:
        """Dial ``url``.

        Raises:
            ConnectError: nothing answered, or the answer was not this transport.
            Timeout: no connection within ``timeout`` seconds.
            ConfigError: ``url`` is malformed for this factory.
        """
        ...

    async def listen(self, url: str) -> Listener:
        """Bind ``url`` and start accepting.

        Raises:
            ConnectError: the address cannot be bound.
            ConfigError: ``url`` is malformed for this factory.
        """
        ...


def is_local(endpoint: Transport | Listener) -> bool:
    """Whether ``endpoint``'s peers are on this host, by its optional ``is_local`` capability.

    A transport or listener that does not declare the capability counts as remote, the safe
    answer: it never lets a learner listen without a token.
    """
    return getattr(endpoint, "is_local", False) is True
