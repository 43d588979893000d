"""Attack a real learner with idle connections that never prove the token, and measure it.

A learner runs in a child process on 127.0.0.1 with its file-descriptor limit lowered (soft
and hard, so aps cannot raise it), the garbage collector off (what is closed must be closed
explicitly), and logs to a file. This process opens ``--connections`` idle connections to it
(plain TCP, TCP+TLS without a ClientHello, WebSocket without an HTTP request, wss:// without
a ClientHello), each dialed again as soon as the learner closes it, from ``--sources``
addresses (127.0.0.2, 127.0.0.3, ...: bound before connect). After ``--warmup`` seconds an
honest worker (another child, from 127.0.0.1) dials in; the script reports:

- ``admitted_s``: from the worker's start to the learner's ``wait_for_workers`` returning;
- ``worker_failures``: the worker's failed attempts to join before that (evicted, say);
- ``rss_growth_mb``: the learner's peak RSS during the flood minus its RSS before;
- ``log_lines``: lines the learner logged during the run (refusals are summed up);
- ``flood_sockets`` / ``flood_established``: the learner's sockets, and those established,
  as the worker starts (the flood running);
- ``learner_sockets`` / ``established`` / ``close_wait``: the learner's sockets, those
  established and those in CLOSE_WAIT, 1 s after the attacker left (read from
  ``/proc/<pid>/fd`` and ``/proc/net/tcp*``);
- ``pending_kib``: the learner's RSS growth per pending connection while 64 of them (from
  the attackers' addresses, 4 at least, so that the budget holds them all) hold a ticket
  each, having sent what costs most on that transport before proving the token (the aps
  challenge left unanswered; a TLS ClientHello; 8 KiB of HTTP headers);
- ``fragments_kib`` and ``fragments_open`` (WebSocket): the learner's RSS growth per
  connection, and the connections still open, after 64 connections each sent 16,000 empty
  fragments of one message after their opening handshake.

Goals: admitted within 5 s whatever the sources, RSS +<100 MB, <100 log lines, at most 64
pending sockets plus the worker's and none in CLOSE_WAIT 1 s after the flood, <=26 KiB per
pending connection. Linux only (``/proc``); every address is in 127.0.0.0/8. Example::

    python benchmarks/preauth_flood.py --transport tls --connections 2500 --sources 8
    python benchmarks/preauth_flood.py --transport ws --connections 100 --json out.json
    python benchmarks/preauth_flood.py --transport wss --sources 8 --jsonl runs.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import resource
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TOKEN = "a token for the pre-auth flood benchmark, 0123456789abcdef"
TRANSPORTS = ("tcp", "tls", "ws", "wss")
PENDING = 64  # tickets a learner's budget holds by default


def _certificate(directory: Path) -> tuple[Path, Path]:
    """A throwaway self-signed certificate for 127.0.0.1."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def _factory(transport: str, tls_dir: str | None, *, server: bool) -> Any:
    from aps.transports.tcp import TCPFactory
    from aps.transports.websocket import WebSocketFactory

    if transport == "ws":
        return WebSocketFactory()
    if transport == "tcp":
        return TCPFactory()
    assert tls_dir is not None
    kind = WebSocketFactory if transport == "wss" else TCPFactory
    if server:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(Path(tls_dir) / "cert.pem", Path(tls_dir) / "key.pem")
        return kind(server_ssl_context=context)
    context = ssl.create_default_context(cafile=str(Path(tls_dir) / "cert.pem"))
    context.verify_flags &= ~ssl.VERIFY_X509_STRICT
    return kind(client_ssl_context=context)


# The learner child.


def learner_main(args: argparse.Namespace) -> None:
    """Run a learner under a lowered fd limit until stdin closes."""
    import logging

    import aps
    from aps.session._loop import run

    resource.setrlimit(resource.RLIMIT_NOFILE, (args.fd_limit, args.fd_limit))
    if not args.gc:
        gc.disable()  # a socket the collector would close counts as left open
    logging.basicConfig(filename=args.log, level=logging.INFO, format="%(name)s %(message)s")

    async def main() -> None:
        scheme = {"ws": "ws", "wss": "wss"}.get(args.transport, "tcp")
        factory = _factory(args.transport, args.tls_dir, server=True)
        timeouts = aps.Timeouts(connect=120, handshake=args.handshake, step=60)
        url = f"{scheme}://127.0.0.1:0"
        async with aps.Learner(
            url, num_workers=1, token=TOKEN, factory=factory, timeouts=timeouts
        ) as learner:
            print(f"url {learner.url}", flush=True)
            loop = asyncio.get_running_loop()
            stdin = asyncio.StreamReader()
            await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
            waiting = asyncio.create_task(learner.wait_for_workers(120))
            ended = asyncio.create_task(stdin.read())
            done, _ = await asyncio.wait({waiting, ended}, return_when=asyncio.FIRST_COMPLETED)
            if waiting in done:
                print(f"admitted {time.monotonic()}", flush=True)
                await learner.reset(seed=0)
                await ended
            waiting.cancel()

    run(main())


def worker_main(args: argparse.Namespace) -> None:
    """Run an honest worker until the learner ends, logging its failed attempts to a file."""
    import logging

    import aps
    from aps.session._loop import run

    logging.basicConfig(filename=args.log, level=logging.DEBUG, format="%(name)s %(message)s")
    if args.worker_nice:
        os.nice(args.worker_nice)  # a worker on a busy host: slow to say hello

    factory = _factory(args.transport, args.tls_dir, server=False)
    worker = aps.Worker(
        args.url,
        "CartPole-v1",
        token=TOKEN,
        factory=factory,
        timeouts=aps.Timeouts(connect=120, handshake=args.handshake),
    )
    with contextlib.suppress(Exception):
        run(worker.run())


# Measurements of the learner process.


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _sockets(pid: int) -> tuple[int, int, int]:
    """The process's sockets, and how many of its TCP sockets are established, in CLOSE_WAIT."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    established = close_wait = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[9] in inodes:
                    established += fields[3] == "01"
                    close_wait += fields[3] == "08"
    return len(inodes), established, close_wait


# The attacker.


def _sources(count: int) -> list[str]:
    """``count`` attacker addresses: 127.0.0.2, 127.0.0.3, ... (the worker dials from .1)."""
    if not 1 <= count <= 250:
        raise SystemExit(f"--sources must be between 1 and 250, got {count}")
    return [f"127.0.0.{2 + i}" for i in range(count)]


async def _dial(host: str, port: int, source: str) -> socket.socket:
    """A non-blocking TCP connection to ``host:port`` from ``source`` (bound first)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.bind((source, 0))
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
    except BaseException:
        sock.close()
        raise
    return sock


class Flood:
    """``count`` idle connections to ``host:port`` from ``sources`` in turn, each dialed
    again when it is closed."""

    def __init__(self, host: str, port: int, count: int, sources: list[str]) -> None:
        self.host, self.port, self.count = host, port, count
        self.sources = sources
        self.dials = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._hold(self.sources[i % len(self.sources)]))
            for i in range(self.count)
        ]

    async def _hold(self, source: str) -> None:
        while True:
            try:
                reader, writer = await asyncio.open_connection(
                    self.host, self.port, local_addr=(source, 0)
                )
            except OSError:
                await asyncio.sleep(0.05)
                continue
            self.dials += 1
            self._writers.add(writer)
            try:
                # Idle: read whatever comes (a challenge) until the learner closes.
                while await reader.read(65536):
                    pass
            except OSError:
                pass
            finally:
                self._writers.discard(writer)
                writer.close()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for writer in list(self._writers):
            writer.close()


def _client_hello() -> bytes:
    """The bytes of a TLS ClientHello, made with a memory BIO (nothing is dialed)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_side=False)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


async def _pending(host: str, port: int, transport: str, sources: list[str]) -> list[socket.socket]:
    """``PENDING`` connections that each sent what costs most before proving the token."""
    loop = asyncio.get_running_loop()
    hello = _client_hello()
    headers = b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"a" * 8000 + b"\r\n"
    held = []
    # At most 16 per address, or the budget would evict some and the figure be per
    # connection held by nobody: from 4 addresses at least.
    addresses = _sources(max(len(sources), -(-PENDING // 16)))
    for i in range(PENDING):
        sock = await _dial(host, port, addresses[i % len(addresses)])
        if transport in ("tls", "wss"):
            await loop.sock_sendall(sock, hello)
        elif transport == "ws":
            await loop.sock_sendall(sock, headers)  # an unfinished request, 8 KiB in
        held.append(sock)
    await asyncio.sleep(1.0)
    return held


def _ws_frame(opcode: int, payload: bytes = b"", *, fin: bool = False) -> bytes:
    """A client's WebSocket frame, masked with a zero mask (which leaves the bytes as is)."""
    return bytes([(0x80 if fin else 0) | opcode, 0x80 | len(payload)]) + bytes(4) + payload


FRAGMENTS = 16_000


async def _fragments(learner: int, host: str, port: int, sources: list[str]) -> tuple[float, int]:
    """64 WebSocket connections that each send ``FRAGMENTS`` empty fragments of one message.

    Returns the learner's peak RSS growth per connection (KiB) while they do, and how many
    of them the learner still holds open 1 s later.
    """
    loop = asyncio.get_running_loop()
    request = (
        f"GET / HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
        "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        "Sec-WebSocket-Version: 13\r\n\r\n"
    ).encode()
    flood = _ws_frame(2, b"x") + _ws_frame(0) * FRAGMENTS
    baseline = _rss_kib(learner)
    held = []
    for i in range(PENDING):
        sock = await _dial(host, port, sources[i % len(sources)])
        await loop.sock_sendall(sock, request)
        held.append(sock)
    await asyncio.sleep(0.5)  # the opening handshakes answered
    peak = baseline

    async def send(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            await loop.sock_sendall(sock, flood)

    sending = asyncio.gather(*(send(sock) for sock in held))
    for _ in range(10):
        peak = max(peak, _rss_kib(learner))
        await asyncio.sleep(0.1)
    await sending
    peak = max(peak, _rss_kib(learner))
    await asyncio.sleep(1.0)
    still_open = sum(_open(sock) for sock in held)
    for sock in held:
        sock.close()
    return (peak - baseline) / PENDING, still_open


def _open(sock: socket.socket) -> bool:
    """Whether the peer still holds ``sock`` open (what it sent first, a challenge, is read)."""
    try:
        while sock.recv(65536, socket.MSG_DONTWAIT):
            pass
    except BlockingIOError:
        return True  # nothing more to read, and not closed
    except OSError:
        return False  # reset
    return False  # closed


async def attack(args: argparse.Namespace) -> dict[str, Any]:
    """Run one attack against a fresh learner; return the figures."""
    sources = _sources(args.sources)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, args.connections + 2 * PENDING + 256)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    here = Path(__file__).resolve()  # noqa: ASYNC240  # once, before anything runs
    with tempfile.TemporaryDirectory() as scratch:
        tls_dir = None
        if args.transport in ("tls", "wss"):
            _certificate(Path(scratch))
            tls_dir = scratch
        log_path = Path(scratch) / "learner.log"
        common = ["--transport", args.transport, "--handshake", str(args.handshake)]
        if args.gc:
            common.append("--gc")
        if tls_dir:
            common += ["--tls-dir", tls_dir]
        # Popen returns at once; the children are waited for in the finally, briefly.
        learner = subprocess.Popen(  # noqa: ASYNC220
            [
                *(sys.executable, str(here), "--learner"),
                *("--fd-limit", str(args.fd_limit), "--log", str(log_path), *common),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        worker: subprocess.Popen[str] | None = None
        flood: Flood | None = None
        try:
            assert learner.stdout is not None and learner.stdin is not None
            url = learner.stdout.readline().split()[1]
            host, port = url.split("://")[1].rstrip("/").rsplit(":", 1)
            await asyncio.sleep(0.5)
            baseline = _rss_kib(learner.pid)

            # Memory per pending connection, before the flood.
            held = await _pending(host, int(port), args.transport, sources)
            pending_kib = (_rss_kib(learner.pid) - baseline) / PENDING
            for sock in held:
                sock.close()
            await asyncio.sleep(1.0)
            fragments: dict[str, Any] = {}
            if args.transport == "ws":
                kib, still_open = await _fragments(learner.pid, host, int(port), sources)
                fragments = {"fragments_kib": round(kib, 1), "fragments_open": still_open}
                await asyncio.sleep(0.5)
                baseline = _rss_kib(learner.pid)

            flood = Flood(host, int(port), args.connections, sources)
            flood.start()
            peak = baseline
            started = time.monotonic()
            while time.monotonic() - started < args.warmup:
                peak = max(peak, _rss_kib(learner.pid))
                await asyncio.sleep(0.2)
            during = _sockets(learner.pid)  # while the flood runs
            worker_started = time.monotonic()
            worker_log = Path(scratch) / "worker.log"
            worker = subprocess.Popen(  # noqa: ASYNC220
                [
                    *(sys.executable, str(here), "--worker", "--url", url),
                    *("--log", str(worker_log), "--worker-nice", str(args.worker_nice)),
                    *common,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            line = await asyncio.wait_for(
                asyncio.get_running_loop().run_in_executor(None, learner.stdout.readline),
                args.deadline,
            )
            admitted_s = float(line.split()[1]) - worker_started if line else None
            peak = max(peak, _rss_kib(learner.pid))
            dials = flood.dials
            await flood.stop()
            flood = None
            await asyncio.sleep(1.0)
            sockets, established, close_wait = _sockets(learner.pid)
            log_lines = len(log_path.read_text().splitlines()) if log_path.exists() else 0
            worker_lines = worker_log.read_text() if worker_log.exists() else ""
            failed = worker_lines.count("joining the learner failed")
            return {
                "transport": args.transport,
                "sources": args.sources,
                "connections": args.connections,
                "gc": "on" if args.gc else "off",
                "fd_limit": args.fd_limit,
                "dials": dials,
                "admitted_s": admitted_s,
                "worker_failures": failed,
                "worker_nice": args.worker_nice,
                "rss_before_mb": round(baseline / 1024, 1),
                "rss_growth_mb": round((peak - baseline) / 1024, 1),
                "log_lines": log_lines,
                "flood_sockets": during[0],
                "flood_established": during[1],
                "learner_sockets": sockets,
                "established": established,
                "close_wait": close_wait,
                "pending_kib": round(pending_kib, 1),
                **fragments,
            }
        finally:
            if flood is not None:
                await flood.stop()
            if worker is not None:
                worker.kill()
                worker.wait()
            with contextlib.suppress(OSError):
                assert learner.stdin is not None
                learner.stdin.close()
            try:
                learner.wait(10)
            except subprocess.TimeoutExpired:
                learner.kill()
                learner.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--transport", choices=TRANSPORTS, default="tcp")
    parser.add_argument("--connections", type=int, default=2500)
    parser.add_argument("--fd-limit", type=int, default=1024)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--deadline", type=float, default=60.0)
    parser.add_argument("--handshake", type=float, default=5.0)
    parser.add_argument("--sources", type=int, default=1, help="attacker addresses")
    parser.add_argument(
        "--worker-nice", type=int, default=0, help="the worker's niceness (0-19): a busy host"
    )
    parser.add_argument(
        "--gc", action="store_true", help="leave the learner's garbage collector on"
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--jsonl", type=Path, help="append the figures as one line")
    # Internal: the child processes.
    parser.add_argument("--learner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--log", help=argparse.SUPPRESS)
    parser.add_argument("--tls-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.learner:
        learner_main(args)
        return
    if args.worker:
        worker_main(args)
        return
    result = asyncio.run(attack(args))
    print(json.dumps(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.jsonl is not None:
        with args.jsonl.open("a") as out:
            out.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
