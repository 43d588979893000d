"""Shared fixtures: fast timeouts and helpers to run workers as tasks."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import pathlib
import shutil
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from types import ModuleType
from typing import Any

import pytest

import aps

FAST = aps.Timeouts(
    connect=10.0, handshake=2.0, step=10.0, heartbeat_interval=0.2, heartbeat_timeout=10.0
)


TEST_POLICIES = (f"{pathlib.Path(__file__).with_name('agents.py')}:*",)
"""The policies the tests' workers may run: the agents of tests/agents.py."""

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


@contextlib.contextmanager
def benchmark_module(name: str) -> Iterator[ModuleType]:
    """Import ``benchmarks/<name>.py`` as the scripts import each other: as a top-level module."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.fixture
def fast_timeouts() -> aps.Timeouts:
    return FAST


class WorkerTasks:
    """Runs workers as tasks on the test's loop and cancels leftovers at the end."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task[None]] = []

    def start(self, url: str, env: Any = "CartPole-v1", **kwargs: Any) -> asyncio.Task[None]:
        kwargs.setdefault("timeouts", FAST)
        # A worker runs only the policies its side allows: these run the test agents.
        kwargs.setdefault("allow_policy", TEST_POLICIES)
        worker = aps.Worker(url, env, **kwargs)
        task = asyncio.create_task(worker.run())
        self.tasks.append(task)
        return task

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=5)


@pytest.fixture
async def workers() -> AsyncIterator[WorkerTasks]:
    tasks = WorkerTasks()
    try:
        yield tasks
    finally:
        await tasks.close()


def make_env_fn(env_cls: Callable[..., Any], **kwargs: Any) -> Callable[[], Any]:
    return lambda: env_cls(**kwargs)


def _self_signed(directory: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path] | None:
    cert, key = directory / "cert.pem", directory / "key.pem"
    names = "DNS:localhost,IP:127.0.0.1,IP:0:0:0:0:0:0:0:1"
    if shutil.which("openssl"):
        result = subprocess.run(
            [
                "openssl", "req", "-x509", "-nodes", "-days", "2",
                "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                "-keyout", str(key), "-out", str(cert),
                "-subj", "/CN=localhost", "-addext", f"subjectAltName={names}",
            ],
            capture_output=True,
            check=False,
        )  # fmt: skip
        if result.returncode == 0:
            return cert, key
    try:
        import datetime
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        return None
    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("localhost"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    x509.IPAddress(ipaddress.ip_address("::1")),
                ]
            ),
            critical=False,
        )
        .sign(private, hashes.SHA256())
    )
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert, key


@pytest.fixture(scope="session")
def tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server context, client context) trusting a throwaway self-signed certificate."""
    files = _self_signed(tmp_path_factory.mktemp("tls"))
    if files is None:
        pytest.skip("no openssl command and no cryptography package to make a certificate")
    cert, key = files
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    client = ssl.create_default_context(cafile=str(cert))
    # The certificate is its own issuer; strict X.509 checks (default in newer Pythons) want
    # a separate CA, which a test does not need.
    client.verify_flags &= ~ssl.VERIFY_X509_STRICT
    return server, client
