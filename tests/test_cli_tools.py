"""``aps --version``, ``aps token`` and ``aps check``, run as real subprocesses."""

from __future__ import annotations

import asyncio
import re
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import aps
from tests.conftest import FAST, WorkerTasks

ROOT = Path(__file__).resolve().parent.parent


def aps_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aps", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=60,
        check=False,
    )


async def aps_cli_async(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "aps", *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(process.communicate(), 60)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def test_version_is_the_package_version() -> None:
    result = aps_cli("--version")
    assert result.returncode == 0
    # The one source of the version (pyproject.toml reads it from there).
    source = re.search(r'^__version__ = "(.+)"$', (ROOT / "aps/_version.py").read_text(), re.M)
    assert source is not None
    version = source.group(1)
    assert result.stdout.strip() == f"aps {version}" == f"aps {aps.__version__}"


def test_token_prints_a_fresh_hex_token() -> None:
    first, second = aps_cli("token"), aps_cli("token")
    assert first.returncode == second.returncode == 0
    tokens = [first.stdout.strip(), second.stdout.strip()]
    assert all(len(token) == 64 and int(token, 16) >= 0 for token in tokens)
    assert tokens[0] != tokens[1]


def test_token_output_is_private_and_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "token.txt"
    assert aps_cli("token", "--output", str(path)).returncode == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    token = path.read_text()
    assert len(token.strip()) == 64 and token.endswith("\n")
    again = aps_cli("token", "--output", str(path))
    assert again.returncode == 1
    assert "exists" in again.stderr and "remove it first" in again.stderr
    assert path.read_text() == token  # untouched


async def test_check_proves_the_token_without_taking_a_slot(
    tmp_path: Path, workers: WorkerTasks
) -> None:
    token_file = tmp_path / "token.txt"
    assert aps_cli("token", "--output", str(token_file)).returncode == 0
    token = token_file.read_text().strip()
    async with aps.Learner(
        "tcp://127.0.0.1:0", num_workers=1, token=token, timeouts=FAST
    ) as learner:
        code, out, err = await aps_cli_async("check", learner.url, "--token-file", str(token_file))
        assert code == 0, err
        assert f"learner:      {learner.url}, protocol" in out
        assert "token:        accepted" in out and "round trip:" in out
        assert len(learner.workers) == 0
        # The learner's one slot is still free: a real worker takes it.
        workers.start(learner.url, num_envs=2, token=token)
        obs, _ = await learner.reset(seed=0)
        assert obs.shape == (2, 4) and len(learner.workers) == 1


async def test_check_reports_a_wrong_or_missing_token(tmp_path: Path) -> None:
    wrong = tmp_path / "wrong.txt"
    wrong.write_text("not-the-token\n")
    wrong.chmod(0o600)  # a token file open to others is refused
    async with aps.Learner(
        "tcp://127.0.0.1:0", num_workers=1, token="the-token", timeouts=FAST
    ) as learner:
        code, out, err = await aps_cli_async("check", learner.url, "--token-file", str(wrong))
        assert code == 1 and out == ""
        assert "AuthError" in err and "token proof is wrong" in err
        code, _, err = await aps_cli_async("check", learner.url)
        assert code == 1 and "requires a token" in err


async def test_check_without_a_token_on_loopback() -> None:
    async with aps.Learner("tcp://127.0.0.1:0", num_workers=1, timeouts=FAST) as learner:
        code, out, err = await aps_cli_async("check", learner.url)
        assert code == 0, err
        assert "token:        none given, none needed" in out


async def test_check_of_something_that_is_not_a_learner() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # accepts, says nothing, waits for the client to leave
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        code, _, err = await aps_cli_async("check", f"tcp://127.0.0.1:{port}", "--timeout", "1")
        assert code == 1 and "Timeout" in err and "--timeout" in err
    finally:
        server.close()
        await server.wait_closed()


def test_check_of_a_closed_port_and_bad_timeout() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connections are refused
        closed = aps_cli("check", f"tcp://127.0.0.1:{port}", "--timeout", "5")
    assert closed.returncode == 1 and "ConnectError" in closed.stderr
    bad = aps_cli("check", "tcp://127.0.0.1:1", "--timeout", "0")
    assert bad.returncode == 1 and "--timeout must be a positive number" in bad.stderr


@pytest.mark.parametrize("command", ["token", "check"])
def test_help_names_the_file_mode_and_the_join(command: str) -> None:
    out = aps_cli(command, "--help").stdout
    assert {"token": "0600", "check": "without joining"}[command] in out
