"""Every connection counts from its first byte: the pre-auth budget, played as an attacker.

The budget is tried alone (eviction order, deadlines, busy tickets), then through real
listeners on 127.0.0.1: idle TLS connections that never send a ClientHello, WebSocket
connections that never finish their opening, an answered probe holding the token, TLS and
plain peers that meet each other, a process out of file descriptors, and the flood script in
``benchmarks/`` on a small scale. Checks are functional (who got in, what was closed), never
timings; deadlines only keep a broken run from hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import socket
import ssl
import subprocess
import sys
import textwrap
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

import aps
from aps import transports
from aps.errors import ConfigError, ConnectError, ConnectionLost, EndOfStream, TransportError
from aps.learner import MAX_HANDSHAKES
from aps.session import Session
from aps.session.protocol import Role, worker_proof
from aps.testing import until
from aps.transports.budget import PreauthBudget, Stage
from aps.transports.stream import TLS_RECORD, looks_like_tls
from aps.transports.tcp import TCPFactory
from aps.wire import codec
from aps.wire.messages import PROTOCOL_VERSION, Challenge, ProbeResult
from tests.conftest import FAST, WorkerTasks
from tests.test_check_probe import _probe_hello

TCP = "tcp://127.0.0.1:0"
TOKEN = "a token of enough entropy for a test, 0123456789abcdef"
ROOT = Path(__file__).resolve().parent.parent


class _Aborts:
    """Records which connections the budget aborted."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def __call__(self, name: str) -> object:
        return lambda: self.aborted.append(name)


# The budget alone.


async def test_a_newcomer_evicts_the_oldest_idle_connection_at_once() -> None:
    aborts = _Aborts()
    budget = PreauthBudget(limit=3, per_host=3)
    reported: list[str] = []
    budget.adopt(deadline=30, report=reported.append)
    tickets = [budget.enter(f"p{i}", f"h{i}", aborts(f"p{i}")) for i in range(3)]
    assert all(t is not None and not t.busy for t in tickets)
    newcomer = budget.enter("p3", "h3", aborts("p3"))
    assert newcomer is not None and not newcomer.busy
    assert aborts.aborted == ["p0"]  # called synchronously, not left for later
    assert tickets[0] is not None and tickets[0].ended == "evicted" and not tickets[0].held
    assert budget.held == 3 and budget.evicted == 1
    assert len(reported) == 1 and "p0" in reported[0] and "make room" in reported[0]


async def test_one_address_cannot_hold_more_than_its_share() -> None:
    aborts = _Aborts()
    budget = PreauthBudget(limit=10, per_host=2)
    for i in range(2):
        budget.enter(f"a{i}", "attacker", aborts(f"a{i}"))
    honest = budget.enter("w", "worker", aborts("w"))
    budget.enter("a2", "attacker", aborts("a2"))
    assert aborts.aborted == ["a0"]  # the attacker's own oldest, not the worker
    assert honest is not None and honest.held


async def test_a_flood_from_several_addresses_cannot_evict_a_newcomer_from_another() -> None:
    """8 addresses, each under its own limit but together over the budget: newcomers evict
    from the address holding the most, so an honest newcomer keeps its slot."""
    aborts = _Aborts()
    budget = PreauthBudget(limit=64, per_host=16)
    honest = None
    for i in range(2_000):
        if i == 1_000:
            honest = budget.enter("worker", "127.0.0.1", aborts("worker"))
        budget.enter(f"a{i}", f"127.0.0.{2 + i % 8}", aborts(f"a{i}"))
    assert honest is not None and honest.held and "worker" not in aborts.aborted
    assert budget.held == 64 and budget.evicted == 2_001 - 64


async def test_the_address_holding_the_most_loses_its_oldest_first() -> None:
    aborts = _Aborts()
    budget = PreauthBudget(limit=4, per_host=4)
    budget.enter("b0", "b", aborts("b0"))  # the oldest, from an address holding one
    for i in range(3):
        budget.enter(f"a{i}", "a", aborts(f"a{i}"))
    budget.enter("c0", "c", aborts("c0"))
    assert aborts.aborted == ["a0"]  # not b0, the oldest: "a" held three
    budget.enter("c1", "c", aborts("c1"))
    assert aborts.aborted == ["a0", "a1"]  # a and c at 2 (the newcomer counts): a's is older
    budget.enter("b1", "b", aborts("b1"))
    assert aborts.aborted == ["a0", "a1", "b0"]  # b and c at 2: b's own oldest goes


async def test_an_answered_probe_is_evicted_before_idle_connections() -> None:
    aborts = _Aborts()
    budget = PreauthBudget(limit=2, per_host=2)
    idle = budget.enter("idle", "h", aborts("idle"))
    probe = budget.enter("probe", "h2", aborts("probe"))
    assert idle is not None and probe is not None
    probe.answered()
    assert probe.stage is Stage.ANSWERED
    budget.enter("new", "h3", aborts("new"))
    assert aborts.aborted == ["probe"]


async def test_greeted_handshakes_are_kept_and_newcomers_are_told_busy() -> None:
    aborts = _Aborts()
    budget = PreauthBudget(limit=2, per_host=2)
    for i in range(2):
        ticket = budget.enter(f"g{i}", f"h{i}", aborts(f"g{i}"))
        assert ticket is not None
        ticket.greeted()
    busy = [budget.enter(f"b{i}", "x", aborts(f"b{i}")) for i in range(2)]
    assert all(t is not None and t.busy for t in busy)
    assert budget.enter("dropped", "x", aborts("dropped")) is None
    assert aborts.aborted == [] and budget.refused == 1
    for ticket in busy:
        assert ticket is not None
        ticket.release()
        ticket.release()  # idempotent
    assert budget.enter("again", "x", aborts("again")) is not None


async def test_the_deadline_from_accept_aborts_a_silent_connection() -> None:
    aborts = _Aborts()
    budget = PreauthBudget(deadline=0.05)
    silent = budget.enter("silent", "h", aborts("silent"))
    proved = budget.enter("proved", "h", aborts("proved"))
    assert silent is not None and proved is not None
    proved.release()
    await until(lambda: aborts.aborted == ["silent"])
    assert silent.ended == "expired" and budget.expired == 1
    await asyncio.sleep(0.1)
    assert aborts.aborted == ["silent"]  # a released ticket is never aborted


@pytest.mark.parametrize(
    "kwargs", [{"limit": 0}, {"per_host": -1}, {"limit": True}, {"deadline": 0}]
)
def test_budget_limits_are_checked(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match=r"PreauthBudget|pre-auth deadline"):
        PreauthBudget(**kwargs)  # type: ignore[arg-type]


def test_a_tls_record_is_recognised_by_its_first_bytes() -> None:
    assert looks_like_tls(TLS_RECORD + b"\x01\x02") and looks_like_tls(b"\x16")
    assert not looks_like_tls(b"") and not looks_like_tls(
        codec.encode(Challenge(protocol_version=1, nonce=b"n" * 32))
    )


# Real listeners.


_Pair = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def _open_idle(url: str, count: int) -> list[_Pair]:
    host, port = url.split("://")[1].rstrip("/").rsplit(":", 1)
    return [await asyncio.open_connection(host, int(port)) for _ in range(count)]


async def _closed_by_peer(reader: asyncio.StreamReader) -> bool:
    try:
        async with asyncio.timeout(10):
            return await reader.read(1) == b""
    except ConnectionError:
        return True


async def _close_all(idle: list[_Pair]) -> None:
    for _, writer in idle:
        writer.close()
    for _, writer in idle:
        try:
            await writer.wait_closed()
        except OSError:
            pass


@pytest.mark.parametrize("scheme", ["tcp", "wss"])
async def test_idle_connections_to_a_tls_listener_are_counted_before_their_hello(
    tls: tuple[ssl.SSLContext, ssl.SSLContext], scheme: str
) -> None:
    """No ClientHello, ever: each still takes a ticket at accept, the oldest are closed at
    once for newcomers, and a TLS client then connects (TCP+TLS and wss:// alike)."""
    server, client = tls
    factory: transports.TransportFactory
    if scheme == "wss":
        pytest.importorskip("websockets")
        from aps.transports.websocket import WebSocketFactory

        factory = WebSocketFactory(server_ssl_context=server, client_ssl_context=client)
    else:
        factory = TCPFactory(server_ssl_context=server, client_ssl_context=client)
    async with await factory.listen(f"{scheme}://127.0.0.1:0") as listener:
        budget = listener.preauth  # type: ignore[attr-defined]
        idle = await _open_idle(listener.url, 3 * budget.limit)
        try:
            await until(lambda: budget.evicted >= 2 * budget.limit)
            assert budget.held <= budget.limit
            # The first connections were closed by the listener, not left open.
            assert all([await _closed_by_peer(r) for r, _ in idle[: budget.limit]])
            dialed = await factory.connect(listener.url, timeout=10)
            accepted = await asyncio.wait_for(listener.accept(), 10)
            await dialed.send(b"ping")
            assert await accepted.receive() == b"ping"
            await dialed.aclose()
            await accepted.aclose()
        finally:
            await _close_all(idle)


async def test_evicted_handshakes_are_closed_at_once() -> None:
    """40 simultaneous silent connections from one address to a learner: the 24 evicted for
    newcomers are closed then, long before any deadline; the 16 kept stay open."""
    timeouts = aps.Timeouts(connect=30, handshake=30, step=30)
    async with aps.Learner(TCP, num_workers=1, token=TOKEN, timeouts=timeouts) as learner:
        idle = await _open_idle(learner.url, 40)
        try:

            async def closed(reader: asyncio.StreamReader) -> bool:
                try:
                    while await reader.read(4096):  # the challenge, then the end or nothing
                        pass
                except ConnectionError:
                    pass
                return True

            waits = [asyncio.create_task(closed(reader)) for reader, _ in idle]
            # Far below the 30 s deadline: what is closed now was closed for newcomers.
            done, pending = await asyncio.wait(waits, timeout=5)
            for task in pending:
                task.cancel()
            assert len(done) == 40 - aps.learner.MAX_HANDSHAKES_PER_HOST
            assert learner._pool.refused == len(done)
        finally:
            await _close_all(idle)


@contextlib.contextmanager
def _no_collector() -> Iterator[None]:
    """Run without the garbage collector: what is closed is closed explicitly."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _served(url: str) -> tuple[int, int]:
    """The listener's side of its TCP connections: (established, in CLOSE_WAIT).

    Read from ``/proc/net/tcp``: sockets whose local port is the listener's. The test's own
    client sockets have other local ports.
    """
    port = int(url.split("://")[1].split("/")[0].rsplit(":", 1)[1])
    established = close_wait = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].rsplit(":", 1)[1], 16) != port:
            continue
        established += fields[3] == "01"
        close_wait += fields[3] == "08"
    return established, close_wait


needs_proc = pytest.mark.skipif(
    not Path("/proc/net/tcp").exists(), reason="reads the socket table from /proc (Linux)"
)


async def _burst(url: str, count: int, at_once: int = 64) -> list[_Pair]:
    """``count`` idle connections, dialed ``at_once`` at a time without yielding to the loop,
    so that the listener accepts each batch in one burst."""
    host, port = url.split("://")[1].rstrip("/").rsplit(":", 1)
    pairs: list[_Pair] = []
    while len(pairs) < count:
        socks = [socket.socket() for _ in range(min(at_once, count - len(pairs)))]
        for sock in socks:  # within the kernel's accept backlog (128)
            sock.connect((host, int(port)))
        pairs += [await asyncio.open_connection(sock=sock) for sock in socks]
    return pairs


@needs_proc
async def test_connections_evicted_in_one_burst_are_closed_without_the_collector() -> None:
    """40 silent connections at once from one address, the collector off: the 24 evicted in
    the burst that accepted them (before their opening task ran a step) are closed at once,
    and nothing is left in CLOSE_WAIT once the clients leave."""
    timeouts = aps.Timeouts(connect=30, handshake=30, step=30)
    with _no_collector():
        async with aps.Learner(TCP, num_workers=1, token=TOKEN, timeouts=timeouts) as learner:
            readers = await _burst(learner.url, 40)
            try:
                kept = aps.learner.MAX_HANDSHAKES_PER_HOST
                # Far below the 30 s deadline: what is closed now was closed for newcomers.
                await until(lambda: _served(learner.url)[0] <= kept, timeout=10)
                closed = [await _closed_by_peer(r) for r, _ in readers[: 40 - kept]]
                assert all(closed)
            finally:
                await _close_all(readers)
            await until(lambda: _served(learner.url) == (0, 0), timeout=10)


async def test_handshakes_the_gate_evicts_are_closed_without_the_collector() -> None:
    """A listener without a budget of its own (memory://): the gate counts its handshakes,
    and the 24 of 40 simultaneous connections it evicts are closed, not left to the
    collector, even those whose handshake task never ran."""
    timeouts = aps.Timeouts(connect=30, handshake=30, step=30)
    with _no_collector():
        async with aps.Learner(
            "memory://preauth-burst", num_workers=1, token=TOKEN, timeouts=timeouts
        ) as learner:
            factory = transports.get_factory("memory")
            clients = [await factory.connect(learner.url, timeout=10) for _ in range(40)]

            async def closed(client: transports.Transport) -> None:
                with contextlib.suppress(TransportError):
                    while True:  # the challenge, then the end or nothing
                        await client.receive()

            waits = [asyncio.create_task(closed(client)) for client in clients]
            try:
                # Far below the 30 s deadline: what is closed now was closed for newcomers.
                evicted = 40 - aps.learner.MAX_HANDSHAKES_PER_HOST
                await until(lambda: sum(task.done() for task in waits) >= evicted, timeout=10)
                await asyncio.sleep(0.1)
                assert sum(task.done() for task in waits) == evicted
            finally:
                for task in waits:
                    task.cancel()
                for client in clients:
                    await client.aclose()


@needs_proc
@pytest.mark.parametrize("scheme", ["tcp", "tls", "ws", "wss"])
async def test_an_idle_flood_leaves_at_most_the_budget_open_without_the_collector(
    tls: tuple[ssl.SSLContext, ssl.SSLContext], scheme: str
) -> None:
    """Three budgets' worth of idle connections at once, the collector off: the listener
    keeps at most its limit open, the evicted ones closed without the collector."""
    server, client = tls
    factory: transports.TransportFactory
    if scheme in ("ws", "wss"):
        pytest.importorskip("websockets")
        from aps.transports.websocket import WebSocketFactory

        factory = WebSocketFactory(server_ssl_context=server, client_ssl_context=client)
    else:
        factory = TCPFactory(server_ssl_context=server if scheme == "tls" else None)
    url = f"{'tcp' if scheme == 'tls' else scheme}://127.0.0.1:0"
    with _no_collector():
        async with await factory.listen(url) as listener:
            budget = listener.preauth  # type: ignore[attr-defined]
            budget.adopt(deadline=30, report=lambda _: None)  # as a learner's gate does
            idle = await _burst(listener.url, 3 * budget.limit)
            try:
                await until(lambda: budget.evicted >= 2 * budget.limit)
                await until(lambda: _served(listener.url)[0] <= budget.limit, timeout=10)
            finally:
                await _close_all(idle)
            # Nobody accepts here, so a connection in the accept queue holds its ticket (and
            # may sit in CLOSE_WAIT) until its deadline; a learner's gate reads each at once.
            assert sum(_served(listener.url)) <= budget.limit


async def test_idle_probes_holding_the_token_do_not_keep_a_worker_out(
    workers: WorkerTasks,
) -> None:
    """More authenticated probes than handshake slots, each silent after its answer."""
    async with aps.Learner(TCP, num_workers=1, token=TOKEN, timeouts=FAST) as learner:
        factory = transports.get_factory("tcp")
        probes: list[Session] = []
        try:
            for _ in range(MAX_HANDSHAKES + 8):
                session = Session(await factory.connect(learner.url), Role.WORKER)
                probes.append(session)
                challenge = await session.receive(timeout=10, operation="challenge")
                assert isinstance(challenge, Challenge)
                nonce = os.urandom(32)
                proof = worker_proof(TOKEN.encode(), challenge.nonce, nonce)
                await session.send(_probe_hello(proof, nonce))
                result = await session.receive(timeout=10, operation="result")
                assert isinstance(result, ProbeResult)
            workers.start(learner.url, num_envs=1, token=TOKEN)
            await learner.wait_for_workers(30)
            obs, _ = await learner.reset(seed=0)
            assert obs.shape == (1, 4)
            assert learner._pool.refused == 0  # answered probes are not refused workers
        finally:
            for session in probes:
                await session.aclose()


async def test_a_plain_listener_names_a_tls_hello() -> None:
    async with await TCPFactory().listen(TCP) as listener:
        host, port = listener.url.removeprefix("tcp://").rsplit(":", 1)
        with socket.create_connection((host, int(port))) as raw:
            raw.sendall(TLS_RECORD + b"\x01\x02\x00" + b"\x00" * 64)
            accepted = await asyncio.wait_for(listener.accept(), 10)
            accepted.max_frame_size = codec.HANDSHAKE_FRAME_SIZE  # as a learner's session does
            with pytest.raises(ConnectionLost, match="looks like TLS: it sent a TLS ClientHello"):
                await asyncio.wait_for(accepted.receive(), 10)


async def test_a_tls_client_names_a_plain_listener(
    tls: tuple[ssl.SSLContext, ssl.SSLContext],
) -> None:
    _, client = tls
    async with await TCPFactory().listen(TCP) as listener:

        async def answer_plainly() -> None:
            accepted = await listener.accept()
            challenge = Challenge(protocol_version=PROTOCOL_VERSION, nonce=b"n" * 32)
            await accepted.send(codec.encode(challenge))
            with contextlib.suppress(TransportError):
                await accepted.receive()  # until the client gives up
            await accepted.aclose()

        task = asyncio.create_task(answer_plainly())
        try:
            with pytest.raises(ConnectError, match="does not look like TLS"):
                await TCPFactory(client_ssl_context=client).connect(listener.url, timeout=10)
        finally:
            await asyncio.wait_for(task, 10)


async def test_a_tls_listener_closes_plain_bytes_and_a_silent_plain_client(
    tls: tuple[ssl.SSLContext, ssl.SSLContext],
) -> None:
    server, _ = tls
    async with await TCPFactory(server_ssl_context=server).listen(TCP) as listener:
        reported: list[str] = []
        listener.preauth.adopt(deadline=0.5, report=reported.append)
        host, port = listener.url.removeprefix("tcp://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"\x05\x00\x00\x00hello")  # an aps frame, not a TLS hello
        assert await _closed_by_peer(reader)
        await until(lambda: any("does not look like TLS" in r for r in reported))
        writer.close()
        # A plain aps client says nothing first: the deadline closes it, and it is told why.
        plain = await TCPFactory().connect(listener.url, timeout=10)
        with pytest.raises(EndOfStream, match="before sending anything; if it listens with TLS"):
            await asyncio.wait_for(plain.receive(), 10)
        await plain.aclose()
        assert listener.preauth.held == 0


def _ws_request(host: str, port: str, padding: int = 0) -> bytes:
    head = (
        f"GET / HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
    )
    return head.encode() + b"X-Pad: " + b"a" * padding + b"\r\n\r\n"


async def test_websocket_opening_handshakes_are_capped_in_bytes() -> None:
    pytest.importorskip("websockets")
    from aps.transports.websocket import MAX_OPENING_BYTES, WebSocketFactory

    async with await WebSocketFactory().listen("ws://127.0.0.1:0") as listener:
        host, port = listener.url.removeprefix("ws://").rstrip("/").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        request = _ws_request(host, port, padding=2 * MAX_OPENING_BYTES)
        for start in range(0, len(request) - 4, 4096):  # slowly, never finishing
            writer.write(request[start : start + 4096])
            await asyncio.sleep(0)
        assert await _closed_by_peer(reader)
        assert listener.oversized == 1 and listener.preauth.held == 0
        writer.close()


def _ws_frame(opcode: int, payload: bytes = b"", *, fin: bool = False) -> bytes:
    """A client's WebSocket frame (masked with a zero mask, which leaves the bytes as is)."""
    return bytes([(0x80 if fin else 0) | opcode, 0x80 | len(payload)]) + bytes(4) + payload


_FLOODS = {
    # 16,000 one-frame pieces of one message that never ends, or as many pings: each was
    # kept as an object (a frame in websockets' queue, a pong) before the token.
    "binary fragments": _ws_frame(2, b"x") + _ws_frame(0) * 16_000,
    "text fragments": _ws_frame(1, b"x") + _ws_frame(0) * 16_000,
    "pings": _ws_frame(9, b"p" * 125, fin=True) * 16_000,
}


@pytest.mark.parametrize("accepted", [False, True], ids=["pending", "accepted"])
@pytest.mark.parametrize("flood", list(_FLOODS))
async def test_a_websocket_cannot_park_many_tiny_frames_before_the_token(
    flood: str, accepted: bool
) -> None:
    """Waiting to be accepted, or accepted by a gate and not yet proved: the connection is
    closed after a few dozen frames, and what it cost the listener is gone with it."""
    pytest.importorskip("websockets")
    from aps.transports.websocket import WebSocketFactory

    async with await WebSocketFactory().listen("ws://127.0.0.1:0") as listener:
        if accepted:
            listener.preauth.adopt(deadline=30, report=lambda _: None)  # as a gate does
        host, port = listener.url.removeprefix("ws://").rstrip("/").rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
        try:
            sock.sendall(_ws_request(host, port))
            response = await asyncio.wait_for(asyncio.to_thread(sock.recv, 4096), 10)
            assert response.startswith(b"HTTP/1.1 101")
            server = await asyncio.wait_for(listener.accept(), 10) if accepted else None
            if server is not None:
                server.max_frame_size = codec.HANDSHAKE_FRAME_SIZE  # as a session does
            gc.collect()
            tracemalloc.start()
            try:
                # A blocking socket in a thread: the listener's allocations alone are traced.
                with contextlib.suppress(OSError):
                    await asyncio.wait_for(asyncio.to_thread(sock.sendall, _FLOODS[flood]), 10)
                sock.settimeout(10)
                with contextlib.suppress(ConnectionError):
                    while await asyncio.to_thread(sock.recv, 65536):
                        pass  # a pong or two, then the end
                await until(lambda: listener.opening == 0 and listener.preauth.held == 0)
                retained, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            # Memory, not time: generous bounds. Before the frames were counted, 16,000 of
            # them kept 1.4 MiB and more until the connection ended.
            assert retained < 64 * 1024
            assert peak < 768 * 1024  # a 256 KiB read of the socket, at most, and little else
            if server is not None:
                await server.aclose()
        finally:
            sock.close()


def test_running_out_of_descriptors_pauses_accepting_and_logs_once() -> None:
    """In a child with a low fd limit: accept fails with EMFILE, a line says so once, and
    the listener accepts again once descriptors are free."""
    script = textwrap.dedent(
        """
        import asyncio, logging, resource, socket, sys
        from aps.transports.tcp import TCPFactory
        lines = []
        class Keep(logging.Handler):
            def emit(self, record):
                lines.append(record.getMessage())
        logging.getLogger("aps").addHandler(Keep())
        logging.getLogger("aps").setLevel(logging.INFO)

        async def main():
            listener = await TCPFactory().listen("tcp://127.0.0.1:0")
            host, port = listener.url.removeprefix("tcp://").rsplit(":", 1)
            client = socket.socket()
            resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
            hoard = []
            try:
                while True:
                    hoard.append(socket.socket())
            except OSError:
                pass
            hoard.pop().close()  # one left: the client's connect
            client.connect((host, int(port)))
            await asyncio.sleep(1.5)
            failures = listener._acceptor.trouble.failures
            for s in hoard:
                s.close()
            accepted = await asyncio.wait_for(listener.accept(), 10)
            about = [l for l in lines if "accept failed" in l]
            print(failures, len(about), flush=True)
            await accepted.aclose()
            client.close()
            await listener.aclose()

        asyncio.run(main())
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env
    )
    assert result.returncode == 0, result.stderr
    failures, lines = map(int, result.stdout.split())
    assert failures >= 2  # it retried while out of descriptors
    assert lines == 1  # and said so once


@pytest.mark.parametrize(("transport", "sources"), [("tcp", 1), ("tls", 8), ("ws", 1), ("wss", 8)])
def test_the_flood_script_admits_a_worker_and_leaves_nothing_open(
    transport: str, sources: int
) -> None:
    """benchmarks/preauth_flood.py on a small scale: 100 idle connections from one address or
    eight, 256 descriptors, the learner's garbage collector off."""
    if transport in ("ws", "wss"):
        pytest.importorskip("websockets")
    if transport in ("tls", "wss"):
        pytest.importorskip("cryptography")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "preauth_flood.py"),
            *("--transport", transport, "--connections", "100", "--fd-limit", "256"),
            *("--sources", str(sources), "--warmup", "1", "--deadline", "60"),
        ],
        capture_output=True,
        text=True,
        timeout=110,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["admitted_s"] is not None  # the honest worker got in
    assert figures["dials"] > 100  # the flood was closed and dialed again
    assert figures["gc"] == "off"
    # While the flood ran: the budget's connections, the worker's, the listening socket.
    assert figures["flood_established"] <= MAX_HANDSHAKES + 1
    assert figures["close_wait"] == 0
    # The listening socket and the worker's connection, give or take a closing one.
    assert figures["learner_sockets"] < 16
    if transport == "ws":
        assert figures["fragments_open"] == 0  # 16,000 fragments each closed them all


async def test_a_plain_worker_dialing_a_tls_learner_says_why_once(
    tls: tuple[ssl.SSLContext, ssl.SSLContext], caplog: pytest.LogCaptureFixture
) -> None:
    server, _ = tls
    factory = TCPFactory(server_ssl_context=server)
    timeouts = aps.Timeouts(connect=4.0, handshake=0.5, step=10.0)
    async with aps.Learner(TCP, num_workers=1, factory=factory, timeouts=timeouts) as learner:
        worker = aps.Worker(learner.url, "CartPole-v1", timeouts=timeouts)
        with caplog.at_level(logging.DEBUG, logger="aps"), pytest.raises(aps.Timeout):
            await asyncio.wait_for(worker.run(), 60)
    failed = [r for r in caplog.records if "joining the learner failed" in r.getMessage()]
    assert len(failed) >= 2, "the worker should have tried more than once"
    warned = [r for r in failed if r.levelno >= logging.WARNING]
    # One warning for the outage, naming TLS; the retries that follow stay at debug level.
    assert len(warned) == 1
    assert "TLS" in warned[0].getMessage()
