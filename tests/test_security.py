"""Secure by default, in both directions, tried as a hostile peer would on 127.0.0.1.

Each test plays one attack against the public entry points: a learner without the token on
the port a worker dials, pre-authentication frames of every size and shape, floods of idle
connections, handshakes that fail forever, a worker that stalls, blank tokens, untrusted
certificates. Sizes are measured with the process's own counters (``ru_maxrss``) and rates
as counts of connections, never as wall-clock times.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import ssl
import struct
import subprocess
import sys
import textwrap
import types
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

import aps
from aps import transports
from aps.learner import MAX_HANDSHAKES
from aps.session.protocol import learner_proof, prove
from aps.testing import until
from aps.transports.base import Transport
from aps.wire import codec
from aps.wire.messages import PROTOCOL_VERSION, Challenge, Hello, Ready, Reject, Welcome
from tests.conftest import FAST, TEST_POLICIES

TCP = "tcp://127.0.0.1:0"
TOKEN = "a token of enough entropy for a test, 0123456789abcdef"
AGENT = TEST_POLICIES[0].replace("*", "Agent")


def _evil_policy(tmp_path: Path) -> tuple[str, Path]:
    """A policy file that leaves a marker when it runs: whoever imports it ran its code."""
    marker = tmp_path / "the rogue's code ran"
    script = tmp_path / "rogue_policy.py"
    script.write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\nAgent = object\n"
    )
    return f"{script}:Agent", marker


async def _challenge(transport: Transport) -> tuple[bytes, Hello]:
    """Play a learner's first move; return its nonce and the worker's hello."""
    nonce = os.urandom(32)
    await transport.send(codec.encode(Challenge(protocol_version=PROTOCOL_VERSION, nonce=nonce)))
    hello = codec.decode_handshake(await transport.receive())
    assert isinstance(hello, Hello)
    return nonce, hello


@pytest.fixture
async def listener() -> AsyncIterator[transports.Listener]:
    """A bare TCP listener on which a test plays the learner, frame by frame."""
    bound = await transports.get_factory("tcp").listen(TCP)
    try:
        yield bound
    finally:
        await bound.aclose()


def _spawn(command: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """Start a worker process (the caller waits for it and kills it in a finally)."""
    return subprocess.Popen(command, **kwargs)


# 1. Workers authenticate the learner and decide what they run.


async def test_a_rogue_learner_on_the_port_a_worker_redials_runs_nothing(
    listener: transports.Listener, tmp_path: Path
) -> None:
    """The real learner vanishes; a peer without the token takes its port; the resuming
    worker answers its challenges but acts on none of its welcomes."""
    evil, marker = _evil_policy(tmp_path)
    timeouts = aps.Timeouts(connect=30, handshake=2, heartbeat_interval=0.1)
    worker = aps.Worker(listener.url, "CartPole-v1", token=TOKEN, timeouts=timeouts)
    task = asyncio.create_task(worker.run())
    try:
        # The real learner: it knows the token, and gives the worker a session to resume.
        real = await listener.accept()
        nonce, hello = await _challenge(real)
        session_id = b"s" * 16
        proof = learner_proof(TOKEN.encode(), nonce, hello.nonce)
        welcome = Welcome(
            worker_id=0,
            autoreset_mode="NextStep",
            policy=None,
            session_id=session_id,
            proof=proof,
            resume_window=3.0,
        )
        await real.send(codec.encode(welcome))
        assert isinstance(codec.decode(await real.receive()), Ready)
        await real.aclose()  # killed: the connection drops, no goodbye
        # The rogue, on the same port: it answers every redial with a welcome naming its file.
        rounds = 0
        while not task.done():
            try:
                async with asyncio.timeout(10):
                    rogue = await listener.accept()
                rogue_nonce, hello = await _challenge(rogue)
            except (TimeoutError, aps.TransportError):
                break
            assert hello.resume == session_id
            # The worker's proof is bound to its own nonce: no replay of the bare HMAC.
            assert hello.proof and hello.proof != prove(TOKEN.encode(), rogue_nonce)
            forged = Welcome(
                worker_id=0,
                autoreset_mode="NextStep",
                policy=evil,
                session_id=session_id,
                resumed=False,
                proof=os.urandom(32),
            )
            await rogue.send(codec.encode(forged))
            rounds += 1
            await rogue.aclose()
        with pytest.raises(aps.AuthError, match=r"did not prove|wrong token proof"):
            await asyncio.wait_for(task, 30)
        assert rounds >= 2  # it kept dialing for the real learner, not for the rogue
        assert not marker.exists()
        assert worker.resumes == 0
    finally:
        task.cancel()
        await asyncio.wait([task])


async def test_a_new_worker_refuses_a_learner_that_cannot_prove_the_token(
    listener: transports.Listener, tmp_path: Path
) -> None:
    evil, marker = _evil_policy(tmp_path)
    worker = aps.Worker(listener.url, "CartPole-v1", token=TOKEN, timeouts=FAST, policy=evil)
    task = asyncio.create_task(worker.run())
    try:
        rogue = await listener.accept()
        await _challenge(rogue)
        welcome = Welcome(worker_id=0, autoreset_mode="NextStep", policy=evil, session_id=b"x")
        await rogue.send(codec.encode(welcome))
        with pytest.raises(aps.AuthError, match="did not prove it knows the token"):
            await asyncio.wait_for(task, 20)
        assert not marker.exists()  # even a policy the worker pinned runs only for the learner
        await rogue.aclose()
    finally:
        task.cancel()
        await asyncio.wait([task])


async def test_a_worker_runs_only_the_policy_its_side_names(tmp_path: Path) -> None:
    evil, marker = _evil_policy(tmp_path)
    timeouts = aps.Timeouts(connect=10, handshake=5, step=60)
    async with aps.Learner(TCP, num_workers=1, token=TOKEN, policy=evil, timeouts=timeouts) as bad:
        unpinned = aps.Worker(bad.url, "CartPole-v1", token=TOKEN, timeouts=timeouts)
        with pytest.raises(aps.ConfigError, match=r"not allowed to run.*--policy"):
            await asyncio.wait_for(unpinned.run(), 30)
        other = aps.Worker(bad.url, "CartPole-v1", token=TOKEN, timeouts=timeouts, policy=AGENT)
        with pytest.raises(aps.ConfigError, match="not allowed to run"):
            await asyncio.wait_for(other.run(), 30)
        assert not marker.exists()
    # The learner's side says why, too.
    async with aps.Learner(TCP, num_workers=1, token=TOKEN, policy=AGENT, timeouts=timeouts) as ok:
        pinned = aps.Worker(ok.url, "CartPole-v1", token=TOKEN, timeouts=timeouts, policy=AGENT)
        task = asyncio.create_task(pinned.run())
        try:
            await ok.wait_for_workers(30)
        finally:
            await ok.aclose()
            await asyncio.wait_for(task, 30)  # a goodbye: the worker ends cleanly


def test_launchers_pass_the_learner_policy_as_the_pin() -> None:
    from aps.launch import WorkerSpec

    spec = WorkerSpec(env="CartPole-v1", num_workers=2).for_learner(
        "tcp://127.0.0.1:7000", policy=AGENT
    )
    arguments = spec.worker_arguments(0)
    assert arguments[arguments.index("--policy") + 1] == AGENT
    assert "--policy" in spec.worker_arguments(None)  # Slurm's static options too


# 2. Bounded pre-authentication cost.

_LEARNER_SCRIPT = textwrap.dedent(
    """
    import asyncio, gc, resource, sys
    import aps

    async def main():
        async with aps.Learner("tcp://127.0.0.1:0", num_workers=1, token=sys.argv[1]) as learner:
            gc.collect()
            baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            print(learner.url, flush=True)
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, sys.stdin.readline)
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            print(baseline, peak, learner._pool.refused, flush=True)

    asyncio.run(main())
    """
)


def _hostile_frames() -> list[bytes]:
    """Pre-authentication frames of many sizes and shapes, each with its length header."""
    pairs = 2 * 2**20  # one 4 MiB frame of 1-tuples: ~2 M objects if decoded
    ones = b"\xdd" + struct.pack(">I", pairs) + b"\x91\x01" * pairs
    shapes = [
        ones,
        b"\x91" * 16_000,  # deep nesting
        msgpack.packb({"t": "hello", "proof": [[1]] * 2000}),
        msgpack.packb({"t": "ready", "observation_space": "x" * 10_000}),
        msgpack.packb({"t": "hello", **{f"k{i}": i for i in range(1000)}}),
        msgpack.packb([1] * 4000),
        b"\xc1" * 100,  # never valid msgpack
    ]
    frames = [struct.pack("<I", len(body)) + body for body in shapes]
    frames += frames[:1] * 3  # the costliest shape, again
    # Announced, never sent in full: 64 MiB and nearly 4 GiB, with a first MiB of body.
    frames += [struct.pack("<I", size) + b"\x91\x01" * 2**19 for size in (2**26, 2**32 - 1)]
    return frames


async def test_pre_auth_frames_keep_the_learner_rss_within_a_small_bound() -> None:
    """No frame from a peer that proved nothing makes the learner allocate much.

    The learner runs in a fresh process, so its peak RSS (``ru_maxrss``) starts clean.
    """
    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _LEARNER_SCRIPT,
        TOKEN,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        url = (await asyncio.wait_for(child.stdout.readline(), 60)).decode().strip()
        host, port = url.removeprefix("tcp://").rsplit(":", 1)
        frames = _hostile_frames()
        for frame in frames:
            reader, writer = await asyncio.open_connection(host, int(port))
            challenge = await reader.readexactly(4)
            await reader.readexactly(struct.unpack("<I", challenge)[0])
            writer.write(frame)
            with contextlib.suppress(OSError):
                await writer.drain()
                await asyncio.wait_for(reader.read(), 10)  # the learner hangs up
            writer.close()
        child.stdin.write(b"report\n")
        await child.stdin.drain()
        line = await asyncio.wait_for(child.stdout.readline(), 60)
        baseline, peak, refused = (int(field) for field in line.split())
        assert refused >= len(frames)  # every one was refused
        grown_mib = (peak - baseline) / 1024  # ru_maxrss is in KiB on Linux
        assert grown_mib < 32, f"the learner's peak RSS grew by {grown_mib:.0f} MiB"
    finally:
        if child.returncode is None:
            child.kill()
        await child.wait()


async def test_pre_auth_frames_are_handshake_sized() -> None:
    """The session of an unauthenticated peer reads only handshake-sized frames."""
    factory = transports.get_factory("tcp")
    async with await factory.listen(TCP) as bound:
        accepting = asyncio.create_task(bound.accept())
        client = await factory.connect(bound.url, timeout=5)
        server = await accepting
        session = aps.session.Session(server, aps.session.protocol.Role.LEARNER)
        assert server.max_frame_size == codec.HANDSHAKE_FRAME_SIZE  # type: ignore[attr-defined]
        await client.send(b"\x80" * (codec.HANDSHAKE_FRAME_SIZE + 1))
        with pytest.raises(aps.FrameTooLarge):
            await session.receive(timeout=5, operation="a hello")
        session.authenticated()
        assert server.max_frame_size == codec.DEFAULT_MAX_FRAME_SIZE  # type: ignore[attr-defined]
        await session.aclose()
        await client.aclose()


# 3. Admission that honest workers survive.


async def test_idle_connections_do_not_keep_an_honest_worker_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Three times MAX_HANDSHAKES idle connections, held open within the handshake deadline,
    and an honest worker still joins; the refusals are summed up in the log, not listed."""
    caplog.set_level(logging.WARNING, logger="aps.learner.admission")
    timeouts = aps.Timeouts(connect=30, handshake=30, step=30)
    async with aps.Learner(TCP, num_workers=1, token=TOKEN, timeouts=timeouts) as learner:
        host, port = learner.url.removeprefix("tcp://").rsplit(":", 1)
        idle: list[asyncio.StreamWriter] = []
        try:
            for _ in range(3 * MAX_HANDSHAKES):  # none says hello, none hangs up
                _, writer = await asyncio.open_connection(host, int(port))
                idle.append(writer)
            await until(lambda: learner._pool.refused >= 2 * MAX_HANDSHAKES)
            worker = aps.Worker(learner.url, "CartPole-v1", token=TOKEN, timeouts=timeouts)
            task = asyncio.create_task(worker.run())
            await learner.wait_for_workers(30)
            obs, _ = await learner.reset(seed=0)
            assert obs.shape == (1, 4)
        finally:
            for writer in idle:
                writer.close()
            for writer in idle:  # closed here, not by the collector after the loop ends
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
        refusals = [r for r in caplog.records if "refused" in r.getMessage()]
        assert len(refusals) <= 2 * aps.learner.admission.REFUSAL_LOG_BURST + 2, len(refusals)
    await asyncio.wait_for(task, 30)


async def test_a_busy_learner_says_when_to_dial_again(listener: transports.Listener) -> None:
    """A Reject with retry-after, sent instead of a challenge, is not the end of a worker."""
    worker = aps.Worker(listener.url, "CartPole-v1", timeouts=FAST)
    task = asyncio.create_task(worker.run())
    try:
        busy = await listener.accept()
        await busy.send(codec.encode(Reject(kind="Busy", reason="busy", retry_after=0.05)))
        await busy.aclose()
        again = await asyncio.wait_for(listener.accept(), 10)  # it dialed again
        _, hello = await _challenge(again)
        assert hello.num_envs == 1
        await again.aclose()
    finally:
        task.cancel()
        await asyncio.wait([task])


async def test_redials_after_failed_handshakes_back_off(listener: transports.Listener) -> None:
    """A learner whose port accepts and hangs up (a proxy in front of a dead learner): the
    worker's dials grow apart exponentially, so their count over its window stays small."""
    timeouts = aps.Timeouts(connect=30, handshake=2, heartbeat_interval=0.1)
    worker = aps.Worker(listener.url, "CartPole-v1", timeouts=timeouts)
    task = asyncio.create_task(worker.run())
    try:
        first = await listener.accept()
        await _challenge(first)
        welcome = Welcome(
            worker_id=0, autoreset_mode="NextStep", policy=None, session_id=b"s", resume_window=3.0
        )
        await first.send(codec.encode(welcome))
        assert isinstance(codec.decode(await first.receive()), Ready)
        await first.aclose()
        dials = 0
        while not task.done():
            try:
                async with asyncio.timeout(5):
                    hung_up = await listener.accept()
            except TimeoutError:
                break
            dials += 1
            await hung_up.aclose()  # the handshake fails: nothing but a close
        with pytest.raises(aps.Timeout, match="could not reach the learner"):
            await asyncio.wait_for(task, 30)
        # Backoff from 50 ms doubling to 2 s within a 3 s window: about 7 dials (thousands
        # without it).
        assert 2 <= dials <= 20
    finally:
        task.cancel()
        await asyncio.wait([task])


# 5, 8, 10. Stalls, losses and a learner that is gone.


async def test_a_stalled_worker_resumes_under_wait(tmp_path: Path) -> None:
    """SIGSTOP past the step deadline, then SIGCONT: the worker resumes its session, the
    step completes, and nobody waits for reconnect_timeout."""
    timeouts = aps.Timeouts(connect=30, handshake=10, step=1.0, heartbeat_interval=0.2)
    learner = aps.Learner(
        TCP, num_workers=1, timeouts=timeouts, on_worker_lost="wait", reconnect_timeout=60
    )
    async with learner:
        command = [sys.executable, "-m", "aps", "worker", learner.url, "--env", "CartPole-v1"]
        process = _spawn(command, stderr=subprocess.DEVNULL)
        try:
            await learner.reset(seed=0)
            process.send_signal(signal.SIGSTOP)
            stepping = asyncio.create_task(learner.step(np.zeros(1, np.int64)))
            await until(lambda: not learner._pool.slots.admitted[0].attached.is_set(), timeout=30)
            process.send_signal(signal.SIGCONT)
            async with asyncio.timeout(50):  # well below reconnect_timeout
                await stepping
            assert learner._pool.slots.admitted[0].metrics.resumes == 1
        finally:
            process.send_signal(signal.SIGCONT)
            await learner.aclose()
            try:
                assert await asyncio.to_thread(process.wait, 30) == 0  # a goodbye: success
            finally:
                process.kill()


async def test_closing_after_a_loss_under_wait_does_not_wait() -> None:
    timeouts = aps.Timeouts(connect=30, handshake=5, step=10)
    learner = aps.Learner(
        TCP, num_workers=1, timeouts=timeouts, on_worker_lost="wait", reconnect_timeout=600
    )
    await learner.start()
    worker = asyncio.create_task(aps.Worker(learner.url, "CartPole-v1", timeouts=FAST).run())
    try:
        await learner.reset(seed=0)
        worker.cancel()
        await asyncio.wait([worker])
        stepping = asyncio.create_task(learner.step(np.zeros(1, np.int64)))
        await until(lambda: not learner._pool.slots.admitted[0].attached.is_set())
        async with asyncio.timeout(30):  # far below reconnect_timeout
            await learner.aclose()
            with pytest.raises(aps.WorkerLost, match="closed before it resumed"):
                await stepping
    finally:
        await learner.aclose()


async def test_leaving_a_chunk_stream_after_a_loss_under_wait_does_not_wait() -> None:
    """The lost worker's owed chunks are dropped whenever it comes back; the stream ends now."""
    import gymnasium as gym

    from tests.agents import Agent

    timeouts = aps.Timeouts(connect=30, handshake=5, step=10)
    learner = aps.Learner(
        TCP,
        num_workers=1,
        timeouts=timeouts,
        policy=AGENT,
        on_worker_lost="wait",
        reconnect_timeout=600,
    )
    async with learner:
        command = [sys.executable, "-m", "aps", "worker", learner.url, "--env", "CartPole-v1"]
        process = _spawn([*command, "--policy", AGENT], stderr=subprocess.DEVNULL)
        try:
            await learner.reset(seed=0)
            env = gym.make("CartPole-v1")
            spaces = types.SimpleNamespace(
                single_observation_space=env.observation_space,
                single_action_space=env.action_space,
            )
            env.close()
            await learner.publish(Agent(spaces))
            stream = learner.chunks(3000, max_in_flight=2)  # long chunks: one stays owed
            async with asyncio.timeout(60):  # far below reconnect_timeout
                async for _ in stream:
                    process.kill()  # the worker goes away, the stream still owes a chunk
                    await until(lambda: not learner._pool.slots.admitted[0].attached.is_set())
                    break
                await stream.aclose()  # leaving the stream
        finally:
            process.kill()
            await asyncio.to_thread(process.wait)
        assert learner._pool.slots.admitted[0].outbox.discarding > 0


async def test_a_worker_whose_learner_is_gone_exits_non_zero_after_its_window(
    listener: transports.Listener,
) -> None:
    """The learner dies without a goodbye: the worker process dials for the learner's resume
    window (not its 60 s connect timeout), then exits 1 so a scheduler sees the failure."""
    command = [sys.executable, "-m", "aps", "worker", listener.url, "--env", "CartPole-v1"]
    process = _spawn([*command, "--connect-timeout", "60"], stderr=subprocess.PIPE)
    try:
        real = await asyncio.wait_for(listener.accept(), 60)
        await _challenge(real)
        welcome = Welcome(
            worker_id=0, autoreset_mode="NextStep", policy=None, session_id=b"s", resume_window=1.0
        )
        await real.send(codec.encode(welcome))
        assert isinstance(codec.decode(await real.receive()), Ready)
        await listener.aclose()
        await real.aclose()  # gone, no goodbye
        _, errors = await asyncio.to_thread(process.communicate, timeout=45)
        assert process.returncode == 1
        assert b"could not reach the learner" in errors
    finally:
        process.kill()
        process.communicate()


# 6, 7. Tokens that are no secret, certificates that do not verify.


def test_an_empty_or_blank_token_is_refused(tmp_path: Path) -> None:
    for blank in ("", "   ", b"\n"):
        with pytest.raises(aps.ConfigError, match="token is empty"):
            aps.Learner("tcp://0.0.0.0:0", num_workers=1, token=blank)
        with pytest.raises(aps.ConfigError, match="token is empty"):
            aps.Worker("tcp://127.0.0.1:1", "CartPole-v1", token=blank)
    token_file = tmp_path / "token"
    token_file.write_text("\n")
    token_file.chmod(0o600)
    command = [sys.executable, "-m", "aps", "worker", "tcp://127.0.0.1:1", "--env", "CartPole-v1"]
    result = subprocess.run(
        [*command, "--token-file", str(token_file)],
        capture_output=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert b"is blank" in result.stderr


@pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")
@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o660, 0o666])
def test_a_token_file_open_to_others_is_refused_like_an_ssh_key(
    tmp_path: Path, mode: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aps.cli import _read_token

    monkeypatch.delenv("APS_TOKEN", raising=False)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(mode)
    with pytest.raises(aps.ConfigError, match=rf"mode {mode:04o}.*chmod 600.*APS_TOKEN"):
        _read_token(token_file)
    token_file.chmod(0o600)
    assert _read_token(token_file) == TOKEN
    token_file.chmod(0o400)
    assert _read_token(token_file) == TOKEN


def test_the_worker_command_refuses_a_token_file_open_to_others(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o644)
    command = [sys.executable, "-m", "aps", "worker", "tcp://127.0.0.1:1", "--env", "CartPole-v1"]
    result = subprocess.run(
        [*command, "--token-file", str(token_file)], capture_output=True, timeout=60
    )
    assert result.returncode == 1
    assert b"chmod 600" in result.stderr


async def test_a_certificate_that_fails_verification_fails_at_once(
    tls: tuple[ssl.SSLContext, ssl.SSLContext],
) -> None:
    """Not retried for the connect timeout: the worker ends with the TLS reason."""
    server_context, _ = tls
    factory = transports.tcp.TCPFactory(server_ssl_context=server_context)
    async with aps.Learner(TCP, num_workers=1, factory=factory) as learner:
        stranger = transports.tcp.TCPFactory(client_ssl_context=ssl.create_default_context())
        timeouts = aps.Timeouts(connect=300)
        worker = aps.Worker(learner.url, "CartPole-v1", timeouts=timeouts, factory=stranger)
        with pytest.raises(aps.AuthError, match="certificate"):
            await asyncio.wait_for(worker.run(), 60)  # far below the connect timeout


# 9. WebSocket opening handshakes are capped too.


async def test_idle_websocket_connections_are_capped_before_the_upgrade() -> None:
    pytest.importorskip("websockets")
    from aps.transports.websocket import MAX_OPENING, WebSocketFactory

    bound = await WebSocketFactory().listen("ws://127.0.0.1:0")
    timeouts = aps.Timeouts(connect=60, handshake=5, step=30)
    async with aps.Learner(bound, num_workers=1, timeouts=timeouts) as learner:
        host, port = learner.url.removeprefix("ws://").rstrip("/").rsplit(":", 1)
        idle = [await asyncio.open_connection(host, int(port)) for _ in range(MAX_OPENING + 40)]
        await until(lambda: bound.refused >= 40)
        assert bound.opening <= MAX_OPENING
        worker = aps.Worker(learner.url, "CartPole-v1", timeouts=timeouts)
        task = asyncio.create_task(worker.run())
        try:
            await learner.wait_for_workers(60)
        finally:
            for _, writer in idle:
                writer.close()
            for _, writer in idle:  # closed here, not by the collector after the loop ends
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
    await asyncio.wait_for(task, 30)


# EnvCall reaches public names only, unless the worker's operator allows more.


async def refused_env_call(
    kind: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any] | None, match: str
) -> None:
    """Make an env call on a worker that allows no private names; it must be refused."""
    timeouts = aps.Timeouts(connect=10, handshake=5, step=30)
    async with aps.Learner(TCP, num_workers=1, token=TOKEN, timeouts=timeouts) as learner:
        worker = aps.Worker(learner.url, "CartPole-v1", token=TOKEN, timeouts=timeouts)
        task = asyncio.create_task(worker.run())
        try:
            await learner.wait_for_workers(30)
            with pytest.raises(aps.WorkerError, match=match):
                values = [0] if kind == "set_attr" else None
                call = learner.env_call(kind, name, args=args, kwargs=kwargs, values=values)
                await asyncio.wait_for(call, 30)
            # The worker goes on: public names still answer.
            assert await asyncio.wait_for(learner.get_attr("gravity"), 30) == (9.8,)
        finally:
            await learner.aclose()
            await asyncio.wait_for(task, 30)


@pytest.mark.parametrize(
    ("kind", "name", "args", "kwargs"),
    [
        ("get_attr", "__class__", (), None),
        ("get_attr", "_np_random", (), None),
        ("call", "__reduce__", (), None),
        ("set_attr", "_elapsed_steps", (), None),
        ("call", "get_wrapper_attr", ("__dict__",), None),
        ("call", "set_wrapper_attr", ("_max_episode_steps", 10**9), None),
        # The same lookups with the name passed by keyword.
        ("call", "get_wrapper_attr", (), {"name": "_max_episode_steps"}),
        ("call", "set_wrapper_attr", (), {"name": "_max_episode_steps", "value": 10**9}),
        ("call", "has_wrapper_attr", (), {"name": "__dict__"}),
    ],
)
async def test_env_calls_by_private_or_dunder_names_are_refused_by_the_worker(
    kind: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any] | None
) -> None:
    refused = name
    if kind == "call" and kwargs:
        refused = kwargs["name"]
    elif kind == "call" and args:
        refused = args[0]
    await refused_env_call(kind, name, args, kwargs, rf"{refused}.*--allow-private-env-calls")


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((), None),  # no name at all
        (("gravity",), {"name": "_max_episode_steps"}),  # two names: which would bind?
        ((10**9,), {"name": "_max_episode_steps"}),  # set_wrapper_attr's value first
        ((b"_np_random",), None),  # not a str
        ((), {"name": ["_np_random"]}),
    ],
)
async def test_a_lookup_by_name_whose_name_is_not_one_str_is_refused(
    args: tuple[Any, ...], kwargs: dict[str, Any] | None
) -> None:
    await refused_env_call("call", "get_wrapper_attr", args, kwargs, "exactly one name, a str")


async def test_a_worker_that_allows_private_env_calls_answers_them() -> None:
    timeouts = aps.Timeouts(connect=10, handshake=5, step=30)
    async with aps.Learner(TCP, num_workers=1, token=TOKEN, timeouts=timeouts) as learner:
        worker = aps.Worker(
            learner.url,
            "CartPole-v1",
            token=TOKEN,
            timeouts=timeouts,
            allow_private_env_calls=True,
        )
        task = asyncio.create_task(worker.run())
        try:
            await learner.wait_for_workers(30)
            steps = await asyncio.wait_for(learner.get_attr("_max_episode_steps"), 30)
            assert steps == (500,)
        finally:
            await learner.aclose()
            await asyncio.wait_for(task, 30)
