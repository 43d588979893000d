"""A live learner under attack: thousands of hostile frames while honest workers step.

One real :class:`aps.Learner` per test (TCP or WebSocket on 127.0.0.1, with a token and a
small frame limit) admits two honest workers, which then reset and step CartPole with fixed
actions without a pause. Meanwhile hypothesis opens batches of concurrent raw connections that
send what an attacker or a broken peer would: random bytes, valid frames with mutated bytes,
truncated frames, length prefixes announcing oversized frames, well-formed msgpack of the
wrong types, valid messages out of order, replayed and forged handshakes, text and oversized
WebSocket messages, bytes that are not even an HTTP request. A few connections stall, and real
workers arrive after the learner is full.

What the learner must do with each connection follows from the protocol's rules alone (the
oracle below decodes what was sent): the Reject or Goodbye it sends after its Challenge, with
the reason, and the error it logs when it refuses the connection. Every connection must be
closed within a deadline. Afterwards the honest run must equal a plain Gymnasium
SyncVectorEnv with the same seeds and actions, step by step; nothing may be logged at ERROR
level and the event loop may see no stray exception; every handshake slot must be free again
and no socket may leak.

The learner runs in a background thread's event loop for the whole test, so hypothesis drives
plain synchronous examples (one batch of connections each) against one long-lived learner.
Run with ``-rA`` to see the counts. ``APS_FUZZ_EXAMPLES`` sets the examples per test, for a
longer local run (with ``-o timeout=1200``)::

    APS_FUZZ_EXAMPLES=3000 pytest tests/test_fuzz_live.py -o timeout=1200 -rA
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import hashlib
import hmac
import inspect
import itertools
import logging
import os
import re
import struct
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import gymnasium as gym
import msgpack
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from hypothesis import given, settings, strategies as st
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, ConnectionClosedError

import aps
from aps import transports
from aps.learner import MAX_HANDSHAKES_PER_HOST
from aps.session.protocol import worker_proof
from aps.transports import TransportFactory
from aps.transports.tcp import TCPFactory
from aps.transports.websocket import WebSocketFactory
from aps.wire import codec
from aps.wire.framing import FrameDecoder
from aps.wire.messages import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Challenge,
    Goodbye,
    Hello,
    Message,
    Reject,
)
from tests.conftest import FAST
from tests.test_codec import any_message

TOKEN = b"fuzz token"
SEED = 11
ENVS_PER_WORKER = 2
NUM_ENVS = 2 * ENVS_PER_WORKER
MAX_FRAME = 64 * 2**10
PRE_AUTH_FRAME = min(MAX_FRAME, codec.HANDSHAKE_FRAME_SIZE)
"""The learner reads frames up to this size until the peer proved the token."""
"""The learner's frame limit: far above CartPole's frames, and cheap to exceed."""
TIMEOUTS = aps.Timeouts(
    connect=10.0, handshake=2.0, step=10.0, heartbeat_interval=0.2, heartbeat_timeout=10.0
)
CLOSE_DEADLINE = 5.0
"""Seconds a hostile connection may stay open after its last byte (stalls: after the deadline)."""
EXAMPLES = int(os.environ.get("APS_FUZZ_EXAMPLES", "400"))

# websockets 15 and later dial through the proxy the environment names, unless told not to.
DIRECT: dict[str, Any] = (
    {"proxy": None} if "proxy" in inspect.signature(ws_connect.__init__).parameters else {}
)

_T = TypeVar("_T")


def honest_actions(t: int) -> np.ndarray[Any, Any]:
    """The fixed action of step ``t``: env ``e`` alternates every ``e + 1`` steps."""
    return np.array([(t // (e + 1)) % 2 for e in range(NUM_ENVS)], np.int64)


# --------------------------------------------------------------------------------------------
# What hostile connections send.


@dataclass(frozen=True)
class ForgedHello:
    """A Hello made for the nonce of the connection that sends it."""

    proof: Literal["right", "wrong token", "empty"]
    protocol_version: int
    num_envs: int
    env_id: str

    def frame(self, nonce: bytes) -> bytes:
        mine = b"w" * 32
        proofs = {
            "right": worker_proof(TOKEN, nonce, mine),
            "wrong token": worker_proof(b"not the " + TOKEN, nonce, mine),
            "empty": b"",
        }
        hello = Hello(
            protocol_version=self.protocol_version,
            proof=proofs[self.proof],
            env_id=self.env_id,
            num_envs=self.num_envs,
            seed=None,
            host="fuzz",
            pid=0,
            label="",
            nonce=mine,
        )
        return codec.encode(hello)


Payload = bytes | ForgedHello


def payload_bytes(payload: Payload, nonce: bytes) -> bytes:
    return payload if isinstance(payload, bytes) else payload.frame(nonce)


@dataclass(frozen=True)
class TcpPlan:
    """One hostile TCP connection: it writes a stream in pieces, then half-closes.

    The stream is the payload behind a length prefix (``framing="prefixed"``, announcing
    ``announce`` bytes instead of the true length if set) or the payload alone
    (``"raw"``), cut to its first ``keep`` bytes. A stalled connection never half-closes.
    """

    label: str
    payload: Payload
    framing: Literal["prefixed", "raw"] = "prefixed"
    announce: int | None = None
    keep: int | None = None
    cuts: tuple[int, ...] = ()
    stall: bool = False

    def stream(self, nonce: bytes) -> bytes:
        data = payload_bytes(self.payload, nonce)
        if self.framing == "prefixed":
            length = len(data) if self.announce is None else self.announce
            data = struct.pack("<I", length) + data
        return data if self.keep is None else data[: self.keep]


@dataclass(frozen=True)
class WsPlan:
    """One hostile WebSocket connection: it sends one message, then reads until closed.

    ``send_as``: one binary message, the same cut into ``cuts`` fragments, a text message,
    or (``"http"``) the payload over plain TCP with no WebSocket upgrade at all. ``filler``
    zero bytes are appended (oversized messages, without a huge repr).
    """

    label: str
    payload: Payload
    send_as: Literal["binary", "fragments", "text", "http"] = "binary"
    filler: int = 0
    cuts: tuple[int, ...] = ()
    stall: bool = False

    def message(self, nonce: bytes) -> bytes:
        return payload_bytes(self.payload, nonce) + bytes(self.filler)


Plan = TcpPlan | WsPlan


def pieces(data: bytes, cuts: tuple[int, ...]) -> list[bytes]:
    """``data`` split at ``cuts`` (clamped to its length); at least one piece."""
    bounds = [0, *sorted({min(c, len(data)) for c in cuts} - {0, len(data)}), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


# Arbitrary msgpack values, including extension types with the codec's codes (1-3).
msgpack_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(),
        st.text(max_size=16),
        st.binary(max_size=16),
        st.builds(
            msgpack.ExtType,
            st.sampled_from([1, 2, 3]) | st.integers(0, 127),
            st.binary(max_size=40),
        ),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.text(max_size=8), inner, max_size=4),
        st.dictionaries(
            st.integers(-(2**63), 2**63 - 1) | st.binary(max_size=4), inner, max_size=2
        ),
    ),
    max_leaves=12,
)


def wrong_types(valid: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """Well-formed msgpack that is no valid message: any value, a known tag with random
    fields, or a valid message with one field (or the tag) replaced by a random value."""

    def replace_one(frame: bytes, data: st.DataObject) -> bytes:
        # ExtType values stay ExtType objects, so the rest of the message packs back as it was.
        body = msgpack.unpackb(frame, raw=False, strict_map_key=False)
        body[data.draw(st.sampled_from(sorted(body)))] = data.draw(msgpack_values)
        return bytes(msgpack.packb(body, use_bin_type=True))

    known_tag = st.builds(
        lambda tag, fields: {**fields, "t": tag},
        st.sampled_from(sorted(MESSAGE_TYPES)),
        st.dictionaries(st.text(max_size=12), msgpack_values, max_size=4),
    )
    return st.one_of(
        msgpack_values.map(lambda v: bytes(msgpack.packb(v, use_bin_type=True))),
        known_tag.map(lambda v: bytes(msgpack.packb(v, use_bin_type=True))),
        st.builds(replace_one, valid, st.data()),
    )


@st.composite
def mutated(draw: st.DrawFn, frames: st.SearchStrategy[bytes]) -> bytes:
    """A frame with up to four bytes flipped, overwritten, inserted or deleted."""
    data = bytearray(draw(frames))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "insert" or not data:
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[at]
        elif op == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        else:
            data[at] = draw(st.integers(0, 255))
    return bytes(data)


def payloads(honest_hello: bytes) -> st.SearchStrategy[tuple[str, Payload]]:
    """``(label, payload)``: the frames a hostile connection sends, by kind."""
    valid = any_message.map(codec.encode)  # every message type, with random fields
    seeds = valid | st.just(honest_hello)
    labelled: list[st.SearchStrategy[tuple[str, Payload]]] = [
        st.tuples(st.just("random bytes"), st.binary(max_size=256)),
        st.tuples(st.just("mutated frame"), mutated(seeds)),
        st.tuples(
            st.just("truncated frame"),
            seeds.flatmap(lambda f: st.integers(0, max(len(f) - 1, 0)).map(lambda k: f[:k])),
        ),
        st.tuples(st.just("wrong types"), wrong_types(seeds)),
        st.tuples(st.just("valid message out of order"), valid),
        st.tuples(st.just("replayed honest hello"), st.just(honest_hello)),
        st.tuples(
            st.just("forged hello"),
            st.builds(
                ForgedHello,
                proof=st.sampled_from(["right", "wrong token", "empty"]),
                protocol_version=st.just(PROTOCOL_VERSION) | st.integers(-(2**63), 2**64 - 1),
                num_envs=st.just(ENVS_PER_WORKER) | st.integers(-(2**63), 2**63 - 1),
                env_id=st.text(max_size=40),
            ),
        ),
    ]
    return st.one_of(labelled)


def tcp_plans(honest_hello: bytes) -> st.SearchStrategy[TcpPlan]:
    cuts = st.lists(st.integers(1, 300), max_size=3).map(tuple)

    def plan(labelled: tuple[str, Payload], shape: str, data: st.DataObject) -> TcpPlan:
        label, payload = labelled
        if shape == "whole frame":
            return TcpPlan(label, payload, cuts=data.draw(cuts))
        if shape == "stream cut short":
            keep = data.draw(st.integers(0, 300))
            return TcpPlan(f"{label}, stream cut short", payload, keep=keep, cuts=data.draw(cuts))
        if shape == "oversized prefix":
            announce = data.draw(st.integers(MAX_FRAME + 1, 2**32 - 1))
            return TcpPlan(f"{label}, oversized prefix", payload, announce=announce)
        return TcpPlan(f"{label}, no prefix", payload, framing="raw", cuts=data.draw(cuts))

    shapes = st.sampled_from(
        ["whole frame", "whole frame", "whole frame", "stream cut short", "oversized prefix", "raw"]
    )
    return st.builds(plan, payloads(honest_hello), shapes, st.data())


def ws_plans(honest_hello: bytes) -> st.SearchStrategy[WsPlan]:
    def plan(labelled: tuple[str, Payload], shape: str, data: st.DataObject) -> WsPlan:
        label, payload = labelled
        if shape == "fragments":
            cuts = data.draw(st.lists(st.integers(1, 300), min_size=1, max_size=3).map(tuple))
            return WsPlan(f"{label}, fragmented", payload, send_as="fragments", cuts=cuts)
        if shape == "oversized":
            filler = data.draw(st.integers(MAX_FRAME + 1, 2 * MAX_FRAME))
            return WsPlan(f"{label}, oversized", payload, filler=filler)
        if shape == "text":
            return WsPlan(f"{label}, as text", payload, send_as="text")
        if shape == "http" and isinstance(payload, bytes):
            return WsPlan(f"{label}, no websocket upgrade", payload, send_as="http")
        return WsPlan(label, payload)

    shapes = st.sampled_from(
        ["message", "message", "message", "fragments", "oversized", "text", "http"]
    )
    return st.builds(plan, payloads(honest_hello), shapes, st.data())


# --------------------------------------------------------------------------------------------
# What the learner must answer: the oracle, from the protocol's rules.


@dataclass(frozen=True)
class Expect:
    """What the learner must do with one hostile connection.

    Attributes:
        refusal: the error type the learner logs when it refuses the connection (empty: it
            never sees the connection).
        reply: the one message it sends after its Challenge, if any.
        kind: the Reject's kind.
        reason: a Reject's reason contains it; a Goodbye's reason starts with it.
        close_code: the WebSocket close code.
    """

    refusal: str
    reply: type[Message] | None = None
    kind: str = ""
    reason: str = ""
    close_code: int = 1000


def expect_frame(frame: bytes, nonce: bytes) -> Expect:
    """The answer to one whole frame sent right after the Challenge."""
    if len(frame) > PRE_AUTH_FRAME:
        return Expect("FrameTooLarge", close_code=1009)
    try:
        message = codec.decode_handshake(frame, max_frame_size=PRE_AUTH_FRAME)
    except aps.WireError as exc:
        return Expect("ProtocolError", Goodbye, reason=f"protocol error: {exc}"[:200])
    if isinstance(message, Goodbye):
        return Expect("EndOfStream")  # a clean goodbye is answered by a close
    if not isinstance(message, Hello):
        state = (
            f"peer sent {type(message).__name__} while the learner was in state 'sent_challenge'"
        )
        return Expect("ProtocolError", Goodbye, reason=f"protocol error: {state}")
    if message.protocol_version != PROTOCOL_VERSION:
        version = f"peer speaks aps protocol version {message.protocol_version!r}"
        return Expect("VersionMismatch", Reject, "VersionMismatch", version)
    if not message.proof:
        return Expect("AuthError", Reject, "AuthError", "sent no proof")
    if len(message.nonce) != 32:
        return Expect("AuthError", Reject, "AuthError", "nonce has")
    label = b"aps worker proof\0"  # the protocol's rule, written out again here
    right = hmac.new(TOKEN, label + nonce + message.nonce, hashlib.sha256).digest()
    if not hmac.compare_digest(message.proof, right):
        return Expect("AuthError", Reject, "AuthError", "token proof is wrong")
    if message.num_envs < 1:
        return Expect("ConfigError", Reject, "ConfigError", f"got {message.num_envs}")
    return Expect("ConfigError", Reject, "ConfigError", "already has its 2 workers")


def expect_tcp(plan: TcpPlan, nonce: bytes) -> tuple[bytes, Expect]:
    """The bytes worth sending for ``plan``, and the learner's answer to them."""
    stream = plan.stream(nonce)
    if plan.stall:
        return stream, Expect("Timeout", Goodbye, reason="Timeout: no hello from")
    if len(stream) < 4:
        refusal = "ConnectionLost" if stream else "EndOfStream"
        return stream, Expect(refusal, Goodbye, reason=f"{refusal}: ")
    (length,) = struct.unpack_from("<I", stream)
    if length > PRE_AUTH_FRAME:
        # The transport closes at once, before anything could be said.
        return stream, Expect("FrameTooLarge")
    if len(stream) < 4 + length:
        return stream, Expect("ConnectionLost", Goodbye, reason="ConnectionLost: ")
    # Nothing after the first frame: bytes left unread when the learner closes make the kernel
    # reset the connection, which may discard the answer on its way.
    return stream[: 4 + length], expect_frame(stream[4 : 4 + length], nonce)


def expect_ws(plan: WsPlan, nonce: bytes) -> tuple[bytes, Expect]:
    message = plan.message(nonce)
    if plan.stall:
        return message, Expect("Timeout", Goodbye, reason="Timeout: no hello from")
    if plan.send_as == "http":
        return message, Expect("")
    if plan.send_as == "text":
        # Before the token a text message aborts the connection at once (no close frame, so
        # the client sees 1006), as other refusals before the token do: docs/security.md.
        return message, Expect("ConnectionLost", close_code=1006)
    return message, expect_frame(message, nonce)


# --------------------------------------------------------------------------------------------
# Hostile clients.


@dataclass
class Seen:
    """What one hostile connection saw after the learner's Challenge."""

    peer: str
    """The connection as the learner names it (``tcp://127.0.0.1:PORT``)."""
    expect: Expect
    replies: list[Message] = field(default_factory=list)
    close_code: int | None = None
    refusal: str = ""
    """The error the learner logged when it refused the connection."""
    http: bytes = b""


def decode_all(data: bytes) -> list[Message]:
    decoder = FrameDecoder(MAX_FRAME)
    decoder.feed(data)
    frames = list(decoder)
    assert decoder.at_boundary, f"the learner sent a partial frame: {data!r}"
    return [codec.decode(f) for f in frames]


async def read_to_eof(reader: asyncio.StreamReader, seconds: float, what: str) -> bytes:
    """Everything until the learner closes; a reset counts as closed."""
    received = bytearray()
    try:
        async with asyncio.timeout(seconds):
            while chunk := await reader.read(65536):
                received += chunk
    except (ConnectionResetError, BrokenPipeError):  # a write after the learner closed
        pass
    except TimeoutError:
        raise AssertionError(f"{what} was still open {seconds} s after its last byte") from None
    return bytes(received)


def host_port(url: str) -> tuple[str, int]:
    host, port = url.split("://", 1)[1].rstrip("/").rsplit(":", 1)
    return host, int(port)


async def tcp_attack(url: str, plan: TcpPlan, refusals: Refusals) -> Seen:
    async with asyncio.timeout(CLOSE_DEADLINE):
        reader, writer = await asyncio.open_connection(*host_port(url))
    try:
        peer = f"tcp://127.0.0.1:{writer.get_extra_info('sockname')[1]}"
        async with asyncio.timeout(CLOSE_DEADLINE):
            (length,) = struct.unpack("<I", await reader.readexactly(4))
            challenge = codec.decode(await reader.readexactly(length))
        assert isinstance(challenge, Challenge), challenge
        stream, expect = expect_tcp(plan, challenge.nonce)
        with contextlib.suppress(OSError):  # refused mid-stream
            for piece in pieces(stream, plan.cuts):
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.001)  # separate reads on the learner's side
            if not plan.stall:
                writer.write_eof()
        seconds = CLOSE_DEADLINE + (TIMEOUTS.handshake if plan.stall else 0)
        received = await read_to_eof(reader, seconds, f"{peer} ({plan})")
        refusal = await refusals.take(peer)
        return Seen(peer, expect, replies=decode_all(received), refusal=refusal)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def ws_attack(url: str, plan: WsPlan, refusals: Refusals) -> Seen:
    if plan.send_as == "http":
        async with asyncio.timeout(CLOSE_DEADLINE):
            reader, writer = await asyncio.open_connection(*host_port(url))
        try:
            writer.write(plan.message(b""))
            # Half-closed: websockets holds an unfinished request for its open_timeout (10 s).
            writer.write_eof()
            response = await read_to_eof(reader, CLOSE_DEADLINE, f"plain TCP ({plan})")
            return Seen("", Expect(""), http=response)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
    async with ws_connect(
        url, compression=None, ping_interval=None, max_size=None, open_timeout=5, **DIRECT
    ) as ws:
        peer = f"ws://127.0.0.1:{ws.local_address[1]}"
        async with asyncio.timeout(CLOSE_DEADLINE):
            challenge = codec.decode(await ws.recv(decode=False))
        assert isinstance(challenge, Challenge), challenge
        message, expect = expect_ws(plan, challenge.nonce)
        with contextlib.suppress(ConnectionClosed):  # refused while sending
            if plan.stall:
                pass
            elif plan.send_as == "text":
                await ws.send(message.decode("utf-8", "replace"))
            elif plan.send_as == "fragments":
                await ws.send(pieces(message, plan.cuts))
            else:
                await ws.send(message)
        replies = []
        seconds = CLOSE_DEADLINE + (TIMEOUTS.handshake if plan.stall else 0)
        try:
            async with asyncio.timeout(seconds):
                async for frame in ws:
                    assert isinstance(frame, bytes), frame
                    replies.append(codec.decode(frame))
        except ConnectionClosedError:
            pass  # a close code other than 1000; checked below
        except TimeoutError:
            raise AssertionError(f"{peer} ({plan}) was still open after {seconds} s") from None
        refusal = await refusals.take(peer)
        return Seen(peer, expect, replies=replies, close_code=ws.close_code, refusal=refusal)


def check(plan: Plan, seen: Seen) -> None:
    """The learner answered ``plan`` as the oracle says."""
    expect = seen.expect
    where = f"{plan} -> {seen}"
    if isinstance(plan, WsPlan) and plan.send_as == "http":
        # websockets answers what is not a WebSocket upgrade itself (or just closes).
        assert seen.http == b"" or seen.http.startswith(b"HTTP/1.1 4"), where
        return
    assert seen.refusal == expect.refusal, where
    wanted = [] if expect.reply is None else [expect.reply]
    assert [type(m) for m in seen.replies] == wanted, where
    if seen.replies:
        reply = seen.replies[0]
        if isinstance(reply, Reject):
            assert reply.kind == expect.kind and expect.reason in reply.reason, where
        else:
            assert isinstance(reply, Goodbye) and reply.reason.startswith(expect.reason), where
    if isinstance(plan, WsPlan):
        assert seen.close_code == expect.close_code, where


# --------------------------------------------------------------------------------------------
# The live learner.


class Refusals(logging.Handler):
    """The learner's refusals ("refused a worker at PEER: TYPE: message"), by peer."""

    def __init__(self) -> None:
        super().__init__()
        self.by_peer: dict[str, collections.deque[str]] = collections.defaultdict(collections.deque)

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg == "refused a worker at %s":
            assert isinstance(record.args, tuple)
            peer, kind, _ = str(record.args[0]).split(": ", 2)
            with self.lock or contextlib.nullcontext():
                self.by_peer[peer].append(kind)

    async def take(self, peer: str) -> str:
        """The next refusal of ``peer`` (it may be logged just after the close); "" if none.

        Taken while the connection still holds its port, so that it cannot be mistaken for
        the refusal of a later connection from the same port.
        """
        deadline = time.monotonic() + CLOSE_DEADLINE
        while time.monotonic() < deadline:
            with self.lock or contextlib.nullcontext():
                if self.by_peer.get(peer):
                    return self.by_peer[peer].popleft()
            await asyncio.sleep(0.01)
        return ""

    def drain(self) -> list[str]:
        """Take every refusal not taken yet; return their kinds, sorted."""
        with self.lock or contextlib.nullcontext():
            kinds = sorted(kind for kinds in self.by_peer.values() for kind in kinds)
            self.by_peer.clear()
        return kinds


class Errors(logging.Handler):
    """Every record at ERROR level or above, from any logger."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.name}: {record.getMessage()} {record.exc_text or ''}")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class LiveLearner:
    """A learner and two honest workers stepping CartPole, in a background event loop.

    Use it as a context manager; :meth:`call` runs a coroutine on its loop.
    """

    def __init__(self, scheme: Literal["tcp", "ws"]) -> None:
        self.scheme = scheme
        self.loop = asyncio.new_event_loop()
        self.loop_errors: list[dict[str, Any]] = []
        self.loop.set_exception_handler(lambda _, context: self.loop_errors.append(context))
        self.thread = threading.Thread(target=self.loop.run_forever, name="live learner")
        self.steps: list[tuple[np.ndarray[Any, Any], ...]] = []
        self.first_obs: np.ndarray[Any, Any] | None = None
        self.refusals = Refusals()
        self.errors = Errors()

    def __enter__(self) -> LiveLearner:
        # Refusals past a few per window are logged at debug level (the warnings sum a
        # flood up); every one of them is counted here.
        learner_log = logging.getLogger("aps.learner")
        self._level = learner_log.level
        learner_log.setLevel(logging.DEBUG)
        learner_log.addHandler(self.refusals)
        logging.getLogger().addHandler(self.errors)
        self.thread.start()
        try:
            self.call(self._start())
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.call(self._cancel_everything(), timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()
            logging.getLogger("aps.learner").removeHandler(self.refusals)
            logging.getLogger("aps.learner").setLevel(self._level)
            logging.getLogger().removeHandler(self.errors)

    def call(self, coroutine: Coroutine[Any, Any, _T], timeout: float = 60.0) -> _T:
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    async def _start(self) -> None:
        self.honest_hello = await capture_honest_hello()
        factory: TransportFactory
        if self.scheme == "tcp":
            factory = TCPFactory(max_frame_size=MAX_FRAME)
        else:
            factory = WebSocketFactory(max_frame_size=MAX_FRAME)
        self.learner = aps.Learner(
            f"{self.scheme}://127.0.0.1:0",
            num_workers=2,
            token=TOKEN,
            timeouts=TIMEOUTS,
            factory=factory,
        )
        await self.learner.start()
        self.url = self.learner.url
        self.workers = [
            asyncio.create_task(
                aps.Worker(
                    self.url, "CartPole-v1", num_envs=ENVS_PER_WORKER, token=TOKEN, timeouts=FAST
                ).run()
            )
            for _ in range(2)
        ]
        await self.learner.wait_for_workers()
        self.stop = asyncio.Event()
        self.stepping = asyncio.create_task(self._step_until_stopped())

    async def _step_until_stopped(self) -> None:
        self.first_obs, _ = await self.learner.reset(seed=SEED)
        t = 0
        while not self.stop.is_set():
            obs, reward, terminated, truncated, _ = await self.learner.step(honest_actions(t))
            self.steps.append((obs, reward, terminated, truncated))
            t += 1

    async def attack(self, plans: list[Plan]) -> list[Seen]:
        """Run every plan on its own connection, all at once."""
        if self.scheme == "tcp":
            runs = [tcp_attack(self.url, p, self.refusals) for p in plans if isinstance(p, TcpPlan)]
        else:
            runs = [ws_attack(self.url, p, self.refusals) for p in plans if isinstance(p, WsPlan)]
        assert len(runs) == len(plans)
        return list(await asyncio.gather(*runs))

    async def late_workers(self) -> list[BaseException | None]:
        """Real workers that arrive after the learner is full: right, wrong and no token."""
        timeouts = aps.Timeouts(connect=5, handshake=5)
        runs = [
            aps.Worker(self.url, "CartPole-v1", token=token, timeouts=timeouts).run()
            for token in (TOKEN, b"wrong", None)
        ]
        return list(await asyncio.gather(*runs, return_exceptions=True))

    async def probe_handshake_slots(self) -> tuple[int, bool]:
        """Open MAX_HANDSHAKES_PER_HOST connections, then one more.

        Returns how many of the first got a Challenge (all of them unless handshake slots
        leaked) and whether the extra one took the oldest one's place (so the cap holds).
        """
        opened = [
            await transports.connect(self.url, timeout=5) for _ in range(MAX_HANDSHAKES_PER_HOST)
        ]
        try:
            challenged = 0
            challenged_extra = False
            for transport in opened:
                with contextlib.suppress(aps.TransportError):
                    async with asyncio.timeout(5):
                        frame = await transport.receive()
                    challenged += isinstance(codec.decode(frame), Challenge)
            extra = await transports.connect(self.url, timeout=5)
            try:
                async with asyncio.timeout(5):
                    challenged_extra = isinstance(codec.decode(await extra.receive()), Challenge)
                    while True:
                        await opened[0].receive()  # the oldest is dropped for it
            except (aps.EndOfStream, aps.ConnectionLost, TimeoutError) as exc:
                capped = challenged_extra and not isinstance(exc, TimeoutError)
            finally:
                await extra.aclose()
        finally:
            await asyncio.gather(*(t.aclose() for t in opened))
        return challenged, capped

    async def finish(self) -> list[BaseException | None]:
        """Stop stepping (raising what the stepping raised), close, return the workers' ends."""
        self.stop.set()
        await self.stepping
        await self.learner.aclose()
        async with asyncio.timeout(10):
            return list(await asyncio.gather(*self.workers, return_exceptions=True))

    async def _cancel_everything(self) -> None:
        with contextlib.suppress(Exception):
            if hasattr(self, "learner"):
                await self.learner.aclose()
        tasks = asyncio.all_tasks() - {asyncio.current_task()}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.loop.shutdown_asyncgens()


async def capture_honest_hello() -> bytes:
    """An honest worker's Hello, as a bare listener playing the learner records it.

    Its proof is for that listener's nonce, so a replay of it proves nothing to the learner.
    """
    listener = await transports.listen("tcp://127.0.0.1:0")
    worker = asyncio.create_task(
        aps.Worker(listener.url, "CartPole-v1", num_envs=ENVS_PER_WORKER, token=TOKEN).run()
    )
    try:
        async with asyncio.timeout(10):
            transport = await listener.accept()
            nonce = os.urandom(32)
            challenge = Challenge(protocol_version=PROTOCOL_VERSION, nonce=nonce)
            await transport.send(codec.encode(challenge))
            frame = await transport.receive()
        await transport.aclose()
    finally:
        worker.cancel()  # it would dial again: a failed handshake is retried
        await asyncio.wait([worker])
        await listener.aclose()
    hello = codec.decode(frame)
    assert isinstance(hello, Hello) and hello.proof == worker_proof(TOKEN, nonce, hello.nonce)
    return frame


def reference_run(
    steps: int,
) -> tuple[np.ndarray[Any, Any], list[tuple[np.ndarray[Any, Any], ...]]]:
    """The same seeds and actions on a plain Gymnasium SyncVectorEnv."""
    envs = SyncVectorEnv(
        [lambda: gym.make("CartPole-v1")] * NUM_ENVS, autoreset_mode=AutoresetMode.NEXT_STEP
    )
    first, _ = envs.reset(seed=SEED)
    out: list[tuple[np.ndarray[Any, Any], ...]] = []
    for t in range(steps):
        obs, reward, terminated, truncated, _ = envs.step(honest_actions(t))
        out.append((obs.copy(), reward, terminated, truncated))
    envs.close()
    return first, out


def assert_same_run(live: LiveLearner) -> None:
    first, reference = reference_run(len(live.steps))
    assert live.first_obs is not None
    np.testing.assert_array_equal(live.first_obs, first)
    for index, name in enumerate(["observations", "rewards", "terminations", "truncations"]):
        got = np.stack([s[index] for s in live.steps])
        want = np.stack([s[index] for s in reference])
        if not np.array_equal(got, want):
            step = int(np.flatnonzero((got != want).reshape(len(got), -1).any(axis=1))[0])
            raise AssertionError(f"{name} differ at step {step}: {got[step]} != {want[step]}")


def summary(title: str, counts: dict[str, collections.Counter[str]]) -> str:
    lines = [title]
    for name, counter in counts.items():
        lines.append(f"  {name}: {sum(counter.values())}")
        lines += [f"    {n:6d}  {what}" for what, n in counter.most_common()]
    return "\n".join(lines)


def answer_name(seen: Seen) -> str:
    """What the connection got, with addresses, numbers and quoted values blurred."""
    if not seen.peer:
        return f"plain HTTP answer {seen.http[:12]!r}"
    words = []
    for message in seen.replies:
        if isinstance(message, Reject):
            words.append(f"Reject {message.kind}")
        elif isinstance(message, Goodbye):
            reason = re.sub(r"\w+://[\d.]+:\d+", "PEER", message.reason)
            reason = re.sub(r"b?'[^']*'|\"[^\"]*\"", "'.'", reason)
            words.append(f"Goodbye {re.sub(r'[0-9]+', 'N', reason)[:60]!r}")
    if seen.close_code is not None:
        words.append(f"close code {seen.close_code}")
    return ", ".join(words) or "closed without a word"


# --------------------------------------------------------------------------------------------
# The tests.


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open sockets in /proc")
@pytest.mark.parametrize("scheme", ["tcp", "ws"])
def test_a_live_learner_survives_hostile_connections(scheme: Literal["tcp", "ws"]) -> None:
    counts: dict[str, collections.Counter[str]] = {
        "hostile connections, by input": collections.Counter(),
        "by framing": collections.Counter(),
        "answers seen": collections.Counter(),
        "refusals the learner logged": collections.Counter(),
    }
    with LiveLearner(scheme) as live:
        sockets_before = open_fds()
        steps_before = len(live.steps)
        # Real workers that arrive after the learner is full, while the honest ones step.
        late_ends = live.call(live.late_workers())
        assert isinstance(late_ends[0], aps.ConfigError), late_ends
        assert "already has its 2 workers" in str(late_ends[0])
        assert all(isinstance(e, aps.AuthError) for e in late_ends[1:]), late_ends
        # Taken now: their ports may be reused by the connections below.
        late_refusals: list[str] = []
        deadline = time.monotonic() + CLOSE_DEADLINE
        while len(late_refusals) < len(late_ends) and time.monotonic() < deadline:
            late_refusals += live.refusals.drain()
            time.sleep(0.01)
        assert sorted(late_refusals) == ["AuthError", "AuthError", "ConfigError"]
        # Alongside the fuzzing: connections that stall.
        if scheme == "tcp":
            stalls: list[Plan] = [
                TcpPlan("stalled: silent", b"", framing="raw", stall=True),
                TcpPlan("stalled: half a header", b"\x10\x00", framing="raw", stall=True),
                TcpPlan(
                    "stalled: half a frame", codec.encode(Goodbye(reason="")), keep=6, stall=True
                ),
            ]
        else:
            stalls = [WsPlan("stalled: silent", b"", stall=True)]
        stalled = asyncio.run_coroutine_threadsafe(live.attack(stalls), live.loop)

        plans = tcp_plans(live.honest_hello) if scheme == "tcp" else ws_plans(live.honest_hello)

        @settings(max_examples=EXAMPLES, deadline=None)
        @given(st.lists(plans, min_size=1, max_size=8))
        def fuzz(batch: list[Plan]) -> None:
            for plan, seen in zip(batch, live.call(live.attack(batch)), strict=True):
                check(plan, seen)
                what, _, framing = plan.label.partition(", ")
                counts["hostile connections, by input"][what] += 1
                counts["by framing"][framing or "one whole frame"] += 1
                counts["answers seen"][answer_name(seen)] += 1
                counts["refusals the learner logged"][seen.refusal or "none"] += 1

        fuzz()

        for plan, seen in zip(stalls, stalled.result(30), strict=True):
            check(plan, seen)
            counts["hostile connections, by input"][plan.label] += 1
            counts["answers seen"][answer_name(seen)] += 1
            counts["refusals the learner logged"][seen.refusal] += 1
        # Each connection took its own refusal: none was refused twice, no honest worker was.
        assert live.refusals.drain() == []
        assert len(live.steps) > steps_before, "the honest workers did not step meanwhile"

        # Every handshake slot is free again (polled: the last closes may still be finishing).
        deadline = time.monotonic() + 10
        # The probe's own oldest connection makes room for its extra one once no handshake of
        # the attacks is left pending.
        while True:
            challenged, capped = live.call(live.probe_handshake_slots())
            if challenged == MAX_HANDSHAKES_PER_HOST and capped:
                break
            assert time.monotonic() < deadline, (
                f"{challenged} of {MAX_HANDSHAKES_PER_HOST} slots free; the one past them "
                f"{'took' if capped else 'did not take'} the oldest one's place"
            )
            time.sleep(0.2)
        deadline = time.monotonic() + 10
        while (sockets := open_fds()) != sockets_before:
            assert time.monotonic() < deadline, f"{sockets} open files, {sockets_before} before"
            time.sleep(0.05)

        worker_ends = live.call(live.finish())
        assert worker_ends == [None, None]  # both honest workers were told goodbye, no error
        assert [w.worker_id for w in live.learner.workers] == [0, 1]
        assert_same_run(live)
        assert not live.loop_errors, live.loop_errors
        assert not live.errors.records, live.errors.records
        print(summary(f"{scheme}: {len(live.steps)} honest steps of {NUM_ENVS} envs", counts))


async def goodbye_reason(url: str, data: bytes, *, half_close: bool) -> str:
    """Answer a learner's Challenge with ``data``; return the reason of its Goodbye."""
    async with asyncio.timeout(10):
        reader, writer = await asyncio.open_connection(*host_port(url))
    try:
        async with asyncio.timeout(10):
            (length,) = struct.unpack("<I", await reader.readexactly(4))
            assert isinstance(codec.decode(await reader.readexactly(length)), Challenge)
        writer.write(data)
        if half_close:
            writer.write_eof()
        received = await read_to_eof(reader, 10.0, "the refused connection")
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    [goodbye] = decode_all(received)
    assert isinstance(goodbye, Goodbye), goodbye
    return goodbye.reason


async def test_a_peer_refused_without_a_reject_is_told_why_in_its_goodbye() -> None:
    # Regression: a silent, truncated or closed handshake used to end with an empty Goodbye,
    # so the peer never learned what the learner logged.
    timeouts = aps.Timeouts(connect=5.0, handshake=0.5, step=5.0)
    async with aps.Learner("tcp://127.0.0.1:0", num_workers=1, timeouts=timeouts) as learner:
        silent = await goodbye_reason(learner.url, b"", half_close=False)
        assert silent.startswith("Timeout: no hello from tcp://127.0.0.1:"), silent
        assert "within 0.5 s" in silent
        truncated = await goodbye_reason(learner.url, b"\x10\x00", half_close=True)
        assert truncated.startswith("ConnectionLost: "), truncated
        assert "in the middle of a frame (2 of 4 bytes arrived)" in truncated
        closed = await goodbye_reason(learner.url, b"", half_close=True)
        assert closed.startswith("EndOfStream: ") and "closed the connection" in closed
