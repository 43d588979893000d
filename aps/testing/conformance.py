"""The transport conformance suite: every built-in and every plug-in must pass it.

Modelled on ``trio.testing.check_two_way_stream``. Each check is an ``async`` function that
takes a :data:`PairMaker` (an async callable returning two connected transports), runs under
its own ``asyncio.timeout`` so a broken transport fails instead of hanging, closes every
transport it opened, and raises :class:`AssertionError` on a contract violation. This module
does not import pytest: the checks are plain coroutines, usable from any test runner.

The checks read a transport's ``max_frame_size`` attribute when it has one, to keep frames
within the limit; :func:`check_frame_size_limit` requires it. Build pair makers with a small
limit (one MiB is plenty): that check sends one frame of exactly the limit, but only when the
limit is at most 16 MiB, to stay fast.

With pytest, one test item per check::

    import pytest
    from aps.testing import TRANSPORT_CHECKS, check_factory, pair_from_factory

    @pytest.mark.parametrize("check", TRANSPORT_CHECKS, ids=lambda c: c.__name__)
    async def test_transport(check):
        await check(pair_from_factory(MyFactory(max_frame_size=2**20), "my://127.0.0.1:0"))

    async def test_factory():
        await check_factory(MyFactory(), "my://127.0.0.1:0")

Without pytest: ``asyncio.run(check_transport(make_pair))``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol
from urllib.parse import urlsplit

from aps.errors import (
    ConnectError,
    ConnectionLost,
    EndOfStream,
    FrameTooLarge,
    InvalidState,
    Timeout,
    TransportClosed,
    TransportError,
)
from aps.transports.base import DEFAULT_MAX_FRAME_SIZE, Listener, Transport, TransportFactory

__all__ = [
    "CHECK_TIMEOUT",
    "TRANSPORT_CHECKS",
    "PairMaker",
    "TransportCheck",
    "check_aclose_wakes_receive",
    "check_buffer_types",
    "check_cancelled_receive",
    "check_cancelled_send",
    "check_concurrent_receive",
    "check_concurrent_senders",
    "check_duplex",
    "check_factory",
    "check_frame_size_limit",
    "check_local_close",
    "check_many_frames",
    "check_only_transport_errors",
    "check_peer_close",
    "check_round_trip",
    "check_transport",
    "pair_from_factory",
]

PairMaker = Callable[[], Awaitable[tuple[Transport, Transport]]]
"""An async callable returning two fresh transports connected to each other."""

CHECK_TIMEOUT = 10.0
"""Seconds each check may take before it fails as a hang."""

# How long a woken operation (a receive after aclose, an accept after aclose) may take.
_PROMPT = 2.0
# Exact-limit frames are sent only up to this size, to keep the suite fast.
_MAX_EXACT_FRAME = 16 * 2**20


class TransportCheck(Protocol):
    """A conformance check: ``await check(make_pair)`` raises AssertionError on failure."""

    __name__: str

    def __call__(self, make_pair: PairMaker, /, *, time_limit: float = ...) -> Awaitable[None]:
        """Run the check on fresh pairs from ``make_pair``, within ``time_limit`` seconds."""
        ...


def _check(body: Callable[[PairMaker], Awaitable[None]]) -> TransportCheck:
    """Give a check body its timeout and its hang message."""

    @functools.wraps(body)
    async def check(make_pair: PairMaker, /, *, time_limit: float = CHECK_TIMEOUT) -> None:
        try:
            async with asyncio.timeout(time_limit) as deadline:
                await body(make_pair)
        except ExceptionGroup as group:
            # A failure inside a task group: report it as itself, not as a group.
            raise _first_leaf(group) from group
        except TimeoutError as exc:
            if deadline.expired():
                raise AssertionError(
                    f"{body.__name__} did not finish within {time_limit} s: a send, receive, "
                    "accept or aclose hangs"
                ) from exc
            raise

    return check


# Helpers.


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


@contextlib.asynccontextmanager
async def _pair(make_pair: PairMaker) -> AsyncIterator[tuple[Transport, Transport]]:
    pair = await make_pair()
    try:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise AssertionError(f"the pair maker returned {pair!r}, not a tuple of 2 transports")
        for transport in pair:
            if not isinstance(transport, Transport):
                raise AssertionError(
                    f"{transport!r} is not a Transport: it needs peer, send, receive and aclose"
                )
        yield pair
    finally:
        for transport in pair:
            await _close_quietly(transport)


async def _close_quietly(resource: Transport | Listener) -> None:
    # Cleanup must not hide the real failure, nor hang on a broken aclose.
    with contextlib.suppress(Exception):
        async with asyncio.timeout(_PROMPT):
            await resource.aclose()


def _limit(*transports: Transport) -> int:
    limits = [getattr(t, "max_frame_size", DEFAULT_MAX_FRAME_SIZE) for t in transports]
    return min(limit for limit in limits if isinstance(limit, int))


def _describe(frame: object) -> str:
    if not isinstance(frame, bytes | bytearray | memoryview):
        return f"{type(frame).__name__} {frame!r:.60}"
    data = bytes(frame)
    head = data[:8].hex()
    return f"{len(data)} bytes ({head}{'...' if len(data) > 8 else ''})"


def _expect_frame(got: object, expected: bytes, what: str) -> None:
    if not isinstance(got, bytes):
        raise AssertionError(f"{what}: receive() returned {type(got).__name__}, not bytes")
    if got != expected:
        raise AssertionError(f"{what}: expected {_describe(expected)}, got {_describe(got)}")


async def _expect_raises(
    expected: type[BaseException] | tuple[type[BaseException], ...],
    awaitable: Awaitable[object],
    what: str,
) -> BaseException:
    names = (
        expected.__name__
        if isinstance(expected, type)
        else " or ".join(e.__name__ for e in expected)
    )
    try:
        result = await awaitable
    except expected as exc:
        return exc
    except Exception as exc:
        raise AssertionError(
            f"{what} raised {type(exc).__name__}({exc}); expected {names}"
        ) from exc
    raise AssertionError(f"{what} returned {_describe(result)}; expected it to raise {names}")


def _being_cancelled() -> bool:
    # Tells our own cancellation (the check's timeout) from the one we sent to a sub-task.
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def _settle() -> None:
    # Long enough for a task to reach its first real suspension point on any event loop.
    await asyncio.sleep(0.01)


# The pair checks.


@_check
async def check_round_trip(make_pair: PairMaker) -> None:
    """Frames, the empty one included, go both ways byte-identical, as ``bytes``."""
    async with _pair(make_pair) as (a, b):
        for t in (a, b):
            if not isinstance(t.peer, str) or not t.peer:
                raise AssertionError(f"peer must be a non-empty str, got {t.peer!r}")
        payloads = [b"hello", b"", bytes(range(256)), b"\x00" * 1000, b"\xff"]
        for sender, receiver, direction in ((a, b, "a->b"), (b, a, "b->a")):
            for i, payload in enumerate(payloads):
                await sender.send(payload)
                _expect_frame(await receiver.receive(), payload, f"{direction} frame {i}")


@_check
async def check_many_frames(make_pair: PairMaker) -> None:
    """1000 frames of random sizes, including 0, arrive whole and in order."""
    async with _pair(make_pair) as (a, b):
        rng = random.Random(1000)
        cap = min(_limit(a, b), 16 * 2**10)
        sizes = [rng.choice((0, 1, 2, 3, 4, 5, 100, rng.randrange(cap + 1))) for _ in range(1000)]
        sizes[-1] = cap
        frames = [rng.randbytes(n) for n in sizes]

        async def send_all() -> None:
            for frame in frames:
                await a.send(frame)

        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(send_all())
            for i, frame in enumerate(frames):
                _expect_frame(await b.receive(), frame, f"frame {i} of {len(frames)}")


@_check
async def check_buffer_types(make_pair: PairMaker) -> None:
    """``bytearray`` and any ``memoryview`` are accepted; later mutation changes nothing."""
    async with _pair(make_pair) as (a, b):
        mutable = bytearray(b"abcdefgh" * 1000)
        await a.send(mutable)
        mutable[:4] = b"XXXX"
        _expect_frame(await b.receive(), b"abcdefgh" * 1000, "bytearray (mutated after send)")

        words = memoryview(bytearray(range(64))).cast("I")  # 4 bytes per item: len() is 16
        cases: list[tuple[str, bytearray | memoryview, bytes]] = [
            ("empty bytearray", bytearray(), b""),
            ("memoryview of bytes", memoryview(b"0123456789"), b"0123456789"),
            ("memoryview slice", memoryview(b"0123456789")[2:7], b"23456"),
            ("memoryview of 32-bit items", words, bytes(range(64))),
            ("2-d memoryview", memoryview(bytes(range(24))).cast("B", (4, 6)), bytes(range(24))),
            (
                "non-contiguous memoryview",
                memoryview(bytes(range(20)))[::2],
                bytes(range(0, 20, 2)),
            ),
        ]
        for sender, receiver, direction in ((a, b, "a->b"), (b, a, "b->a")):
            for what, frame, expected in cases:
                await sender.send(frame)
                _expect_frame(await receiver.receive(), expected, f"{direction} {what}")


@_check
async def check_frame_size_limit(make_pair: PairMaker) -> None:
    """A frame of exactly ``max_frame_size`` passes; one byte more raises FrameTooLarge.

    The refused frame sends nothing: the transport stays usable.
    """
    async with _pair(make_pair) as (a, b):
        for sender, receiver, direction in ((a, b, "a->b"), (b, a, "b->a")):
            limit = getattr(sender, "max_frame_size", None)
            if not isinstance(limit, int):
                raise AssertionError(
                    f"{sender!r} has no int max_frame_size attribute; expose the limit so "
                    "callers (and this check) can read it"
                )
            # bytes(n) is zero-filled lazily by the OS: an oversized frame costs no memory
            # unless the transport copies it before checking the size.
            await _expect_raises(
                FrameTooLarge,
                sender.send(bytes(limit + 1)),
                f"{direction} send() of max_frame_size + 1 = {limit + 1} bytes",
            )
            if limit <= _MAX_EXACT_FRAME:
                frame = random.Random(limit).randbytes(limit)
                async with asyncio.TaskGroup() as tasks:
                    tasks.create_task(sender.send(frame))
                    got = await receiver.receive()
                _expect_frame(got, frame, f"{direction} frame of exactly max_frame_size")
            await sender.send(b"after")
            _expect_frame(await receiver.receive(), b"after", f"{direction} frame after refusal")


@_check
async def check_duplex(make_pair: PairMaker) -> None:
    """Several MiB flow both ways at once in randomly sized frames (no deadlock, no loss)."""
    async with _pair(make_pair) as (a, b):
        cap = min(_limit(a, b), 64 * 2**10)
        total = 3 * 2**20

        def chunks(seed: int) -> list[bytes]:
            rng = random.Random(seed)
            data = rng.randbytes(total)
            out, pos = [], 0
            while pos < total:
                n = rng.choice((0, rng.randrange(1, 100), rng.randrange(cap + 1)))
                out.append(data[pos : pos + n])
                pos += n
            return out

        async def send(transport: Transport, frames: list[bytes]) -> None:
            for frame in frames:
                await transport.send(frame)

        async def receive(transport: Transport, frames: list[bytes], direction: str) -> None:
            for i, frame in enumerate(frames):
                _expect_frame(await transport.receive(), frame, f"{direction} frame {i}")

        forward, backward = chunks(1), chunks(2)
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(send(a, forward))
            tasks.create_task(send(b, backward))
            tasks.create_task(receive(b, forward, "a->b"))
            tasks.create_task(receive(a, backward, "b->a"))


_TAG = struct.Struct("<II")


@_check
async def check_concurrent_senders(make_pair: PairMaker) -> None:
    """Frames sent from several tasks at once never interleave and keep per-task order."""
    async with _pair(make_pair) as (a, b):
        rng = random.Random(7)
        big = min(_limit(a, b), 192 * 2**10)
        choices = [n for n in (_TAG.size, 64, 4096, 40_000, big) if n <= big]
        senders, per_sender = 6, 25
        sizes = [[rng.choice(choices) for _ in range(per_sender)] for _ in range(senders)]

        def frame(sender: int, seq: int) -> bytes:
            body = bytes([sender + 1]) * (sizes[sender][seq] - _TAG.size)
            return _TAG.pack(sender, seq) + body

        async def send_all(sender: int) -> None:
            for seq in range(per_sender):
                await a.send(frame(sender, seq))

        async with asyncio.TaskGroup() as tasks:
            for sender in range(senders):
                tasks.create_task(send_all(sender))
            # Let the senders fill the buffers first, so that sends block part-way.
            await asyncio.sleep(0.05)
            next_seq = [0] * senders
            for i in range(senders * per_sender):
                got = await b.receive()
                if len(got) < _TAG.size:
                    raise AssertionError(f"frame {i} is {_describe(got)}: frames interleaved")
                sender, seq = _TAG.unpack_from(got)
                if sender >= senders or seq != next_seq[sender]:
                    raise AssertionError(
                        f"frame {i} claims sender {sender} seq {seq}; expected seq "
                        f"{next_seq[sender] if sender < senders else '?'}: frames interleaved "
                        "or reordered"
                    )
                _expect_frame(got, frame(sender, seq), f"frame {i} (sender {sender})")
                next_seq[sender] += 1


@_check
async def check_concurrent_receive(make_pair: PairMaker) -> None:
    """A second concurrent ``receive`` raises InvalidState and does not disturb the first."""
    async with _pair(make_pair) as (a, b):
        first = asyncio.ensure_future(b.receive())
        try:
            await _settle()
            await _expect_raises(InvalidState, b.receive(), "a second concurrent receive()")
            await a.send(b"one")
            _expect_frame(await first, b"one", "the first receive()")
        finally:
            first.cancel()
        await a.send(b"two")
        _expect_frame(await b.receive(), b"two", "a receive() after the busy one")


@_check
async def check_peer_close(make_pair: PairMaker) -> None:
    """After the peer's ``aclose``, its pending frames arrive, then EndOfStream (repeatedly)."""
    for closer_index in (0, 1):
        async with _pair(make_pair) as pair:
            closer, other = pair[closer_index], pair[1 - closer_index]
            frames = [b"first", b"", random.Random(3).randbytes(min(_limit(*pair), 100_000))]
            for frame in frames:
                await closer.send(frame)
            await closer.aclose()
            for i, frame in enumerate(frames):
                _expect_frame(await other.receive(), frame, f"pending frame {i} after peer aclose")
            for attempt in ("first", "second"):
                await _expect_raises(
                    EndOfStream, other.receive(), f"the {attempt} receive() after peer aclose"
                )


@_check
async def check_local_close(make_pair: PairMaker) -> None:
    """After ``aclose``, send and receive raise TransportClosed; ``aclose`` is idempotent."""
    for closer_index in (0, 1):
        async with _pair(make_pair) as pair:
            closer, other = pair[closer_index], pair[1 - closer_index]
            await closer.send(b"unread")
            await closer.aclose()
            await closer.aclose()
            await _expect_raises(TransportClosed, closer.send(b"x"), "send() after aclose()")
            await _expect_raises(TransportClosed, closer.receive(), "receive() after aclose()")
            await closer.aclose()
            _expect_frame(await other.receive(), b"unread", "a frame sent before aclose()")
            await _expect_raises(EndOfStream, other.receive(), "the peer's receive()")


@_check
async def check_aclose_wakes_receive(make_pair: PairMaker) -> None:
    """``aclose`` wakes a ``receive`` blocked in another task with TransportClosed, promptly."""
    for closer_index in (0, 1):
        async with _pair(make_pair) as pair:
            closer, other = pair[closer_index], pair[1 - closer_index]
            blocked = asyncio.ensure_future(closer.receive())
            try:
                await _settle()
                await closer.aclose()
                try:
                    async with asyncio.timeout(_PROMPT):
                        await _expect_raises(
                            TransportClosed, blocked, "a receive() blocked in aclose"
                        )
                except TimeoutError:
                    raise AssertionError(
                        f"aclose() did not wake a blocked receive() within {_PROMPT} s"
                    ) from None
            finally:
                blocked.cancel()
            await _expect_raises(EndOfStream, other.receive(), "the peer's receive()")


@_check
async def check_cancelled_receive(make_pair: PairMaker) -> None:
    """Cancelling ``receive`` at any point loses no frame and keeps the stream in step."""
    async with _pair(make_pair) as (a, b):
        # A receive cancelled while idle.
        idle = asyncio.ensure_future(b.receive())
        await _settle()
        idle.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await idle
        await a.send(b"kept")
        _expect_frame(await b.receive(), b"kept", "the frame after a cancelled receive()")

        # Receives cancelled at random points while large frames stream in.
        # Frames of up to 1 MiB span several socket reads, so some cancellations land in
        # the middle of a frame.
        rng = random.Random(11)
        cap = min(_limit(a, b), 2**20)
        frames = [rng.randbytes(rng.choice((0, 100, 5000, cap // 2, cap))) for _ in range(40)]

        async def send_all() -> None:
            for frame in frames:
                await a.send(frame)

        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(send_all())
            received: list[bytes] = []
            while len(received) < len(frames):
                attempt = asyncio.ensure_future(b.receive())
                for _ in range(rng.randrange(4)):
                    await asyncio.sleep(0)
                attempt.cancel()
                try:
                    received.append(await attempt)
                except asyncio.CancelledError:
                    if _being_cancelled():
                        raise
            for i, (got, frame) in enumerate(zip(received, frames, strict=True)):
                _expect_frame(got, frame, f"frame {i} with cancelled receives in between")


@_check
async def check_cancelled_send(make_pair: PairMaker) -> None:
    """A cancelled ``send`` delivers its frame whole or not at all (or closes the transport)."""
    async with _pair(make_pair) as (a, b):
        rng = random.Random(13)
        cap = min(_limit(a, b), 256 * 2**10)
        count = 40

        def frame(i: int) -> bytes:
            size = rng.choice((_TAG.size, 1000, cap))
            return _TAG.pack(i, size) + bytes([i % 251]) * (size - _TAG.size)

        async def send_and_cancel() -> None:
            for i in range(count):
                attempt = asyncio.ensure_future(a.send(frame(i)))
                for _ in range(rng.randrange(3)):
                    await asyncio.sleep(0)
                attempt.cancel()
                try:
                    await attempt
                except asyncio.CancelledError:
                    if _being_cancelled():
                        raise
                except TransportClosed:
                    return  # The transport closed itself after a cancelled send: allowed.
            await a.send(_TAG.pack(count, _TAG.size))
            await a.aclose()

        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(send_and_cancel())
            last = -1
            while True:
                try:
                    got = await b.receive()
                except (EndOfStream, ConnectionLost):
                    break
                if len(got) < _TAG.size:
                    raise AssertionError(f"received a corrupt frame: {_describe(got)}")
                index, size = _TAG.unpack_from(got)
                if size != len(got) or index <= last or index > count:
                    raise AssertionError(
                        f"received a corrupt or reordered frame after cancelled sends: "
                        f"{_describe(got)} (index {index}, previous {last})"
                    )
                expected = bytes([index % 251]) * (size - _TAG.size)
                if got[_TAG.size :] != expected:
                    raise AssertionError(f"frame {index} arrived corrupted after cancelled sends")
                last = index


@_check
async def check_only_transport_errors(make_pair: PairMaker) -> None:
    """Using a transport whose peer is gone raises only TransportError subclasses."""
    async with _pair(make_pair) as (a, b):
        await a.aclose()
        # Sending to a closed peer may succeed a few times (the bytes sit in buffers) before
        # the failure is noticed; whatever is raised must be mapped.
        for i in range(20):
            try:
                await b.send(b"x" * 1000)
            except TransportError:
                break
            except Exception as exc:
                raise AssertionError(
                    f"send() to a closed peer raised {type(exc).__name__}({exc}); map backend "
                    "errors to aps.errors.TransportError subclasses"
                ) from exc
            await asyncio.sleep(0.005 * i)
        await _expect_raises(
            (EndOfStream, ConnectionLost), b.receive(), "receive() from a closed peer"
        )
        await b.aclose()
        await _expect_raises(TransportClosed, b.send(b"x"), "send() after aclose()")


TRANSPORT_CHECKS: tuple[TransportCheck, ...] = (
    check_round_trip,
    check_many_frames,
    check_buffer_types,
    check_frame_size_limit,
    check_duplex,
    check_concurrent_senders,
    check_concurrent_receive,
    check_peer_close,
    check_local_close,
    check_aclose_wakes_receive,
    check_cancelled_receive,
    check_cancelled_send,
    check_only_transport_errors,
)
"""Every pair check, in a sensible order: parametrize a test over it."""


async def check_transport(make_pair: PairMaker, *, time_limit: float = CHECK_TIMEOUT) -> None:
    """Run every check in :data:`TRANSPORT_CHECKS` and report all failures at once.

    Raises:
        AssertionError: one or more checks failed; the message names each, and the first
            failure is chained as the cause.
    """
    failures: list[tuple[str, Exception]] = []
    for check in TRANSPORT_CHECKS:
        try:
            await check(make_pair, time_limit=time_limit)
        except Exception as exc:
            failures.append((check.__name__, exc))
    if failures:
        lines = "\n".join(f"  {name}: {type(exc).__name__}: {exc}" for name, exc in failures)
        raise AssertionError(
            f"{len(failures)} of {len(TRANSPORT_CHECKS)} transport checks failed:\n{lines}"
        ) from failures[0][1]


# Factory-level checks.


def pair_from_factory(
    factory: TransportFactory, url: str, *, timeout: float = _PROMPT
) -> PairMaker:
    """Return a :data:`PairMaker` that connects a client to a fresh listener on ``url``.

    Each pair is ``(client, server)``; the listener is closed as soon as it accepted, so
    the pair also checks that accepted transports outlive their listener.
    """

    async def make_pair() -> tuple[Transport, Transport]:
        listener = await factory.listen(url)
        try:
            client = await factory.connect(listener.url, timeout=timeout)
            try:
                async with asyncio.timeout(timeout):
                    server = await listener.accept()
            except BaseException:
                await _close_quietly(client)
                raise
        finally:
            await _close_quietly(listener)
        return client, server

    return make_pair


async def check_factory(
    factory: TransportFactory, url: str, *, time_limit: float = CHECK_TIMEOUT
) -> None:
    """Check listening and connecting through ``factory`` on ``url``.

    ``url`` should let the factory pick a free address (``tcp://127.0.0.1:0``,
    ``memory://``). Checked: the listener reports a usable, resolved ``url``; several clients
    are accepted and paired correctly; accepted transports outlive the listener; ``aclose``
    is idempotent and wakes a pending ``accept``; connecting to the closed address raises
    ConnectError (or Timeout) promptly.

    Raises:
        AssertionError: a contract point failed, or the check took over ``time_limit`` seconds.
    """
    try:
        async with asyncio.timeout(time_limit) as deadline:
            await _check_factory(factory, url)
    except TimeoutError as exc:
        if deadline.expired():
            raise AssertionError(
                f"check_factory did not finish within {time_limit} s: listen, connect, accept "
                "or aclose hangs"
            ) from exc
        raise


async def _check_factory(factory: TransportFactory, url: str) -> None:
    if not isinstance(factory, TransportFactory):
        raise AssertionError(f"{factory!r} is not a TransportFactory (connect and listen)")
    listener = await factory.listen(url)
    transports: list[Transport] = []
    try:
        if not isinstance(listener, Listener):
            raise AssertionError(f"{listener!r} is not a Listener: it needs url, accept, aclose")
        bound = listener.url
        if not isinstance(bound, str) or urlsplit(bound).scheme != urlsplit(url).scheme:
            raise AssertionError(f"listener.url is {bound!r}; expected a {url!r}-like url")
        with contextlib.suppress(ValueError):
            if urlsplit(bound).port == 0:
                raise AssertionError(
                    f"listener.url {bound!r} still says port 0; report the real one"
                )

        # Several clients, each paired with the right accepted transport.
        clients = list(
            await asyncio.gather(*(factory.connect(bound, timeout=_PROMPT) for _ in range(3)))
        )
        transports += clients
        servers = [await listener.accept() for _ in clients]
        transports += servers
        for i, client in enumerate(clients):
            await client.send(b"client %d" % i)
        by_name = {await server.receive(): server for server in servers}
        if set(by_name) != {b"client %d" % i for i in range(len(clients))}:
            raise AssertionError(f"accepted transports received {sorted(by_name)}")
        for i, client in enumerate(clients):
            await by_name[b"client %d" % i].send(b"reply %d" % i)
            _expect_frame(await client.receive(), b"reply %d" % i, f"reply to client {i}")

        # Closing the listener leaves accepted transports open, and is idempotent.
        await listener.aclose()
        await listener.aclose()
        await clients[0].send(b"still open")
        _expect_frame(
            await by_name[b"client 0"].receive(), b"still open", "a frame after listener.aclose()"
        )
        await _expect_raises(TransportClosed, listener.accept(), "accept() after aclose()")
    finally:
        await _close_quietly(listener)
        for transport in transports:
            await _close_quietly(transport)

    # aclose wakes a pending accept; afterwards the address refuses connections.
    listener = await factory.listen(url)
    try:
        pending = asyncio.ensure_future(listener.accept())
        try:
            await _settle()
            await listener.aclose()
            try:
                async with asyncio.timeout(_PROMPT):
                    await _expect_raises(TransportClosed, pending, "an accept() pending in aclose")
            except TimeoutError:
                raise AssertionError(
                    f"listener.aclose() did not wake a pending accept() within {_PROMPT} s"
                ) from None
        finally:
            pending.cancel()
    finally:
        await _close_quietly(listener)
    loop = asyncio.get_running_loop()
    started = loop.time()
    await _expect_raises(
        (ConnectError, Timeout),
        factory.connect(listener.url, timeout=_PROMPT),
        f"connect() to the closed listener {listener.url!r}",
    )
    if loop.time() - started > 2 * _PROMPT:
        raise AssertionError(f"connect() to a closed address took over {2 * _PROMPT} s")
