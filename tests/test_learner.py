"""The await-based Learner with real workers: the happy path and every kind of bad peer.

Bad-peer tests run over real TCP sockets on 127.0.0.1; each checks the specific error, that the
offending connection is closed, and that the learner keeps serving honest workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ssl
import struct
from typing import Any

import gymnasium as gym
import msgpack
import numpy as np
import pytest

import aps
from aps import transports
from aps.transports.tcp import TCPFactory
from aps.wire import codec
from aps.wire.messages import (
    PROTOCOL_VERSION,
    Challenge,
    Hello,
    Ready,
    Reject,
    StepRequest,
    Welcome,
)
from aps.worker.steps import StepServer
from tests.conftest import FAST, WorkerTasks

TCP = "tcp://127.0.0.1:0"


class Exploding(gym.Env[np.ndarray, np.int64]):
    """Raises on its third step."""

    observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2, np.float32), {}

    def step(self, action: Any) -> Any:
        self.t += 1
        if self.t == 3:
            raise RuntimeError("the env exploded")
        return np.zeros(2, np.float32), 1.0, False, False, {}


async def test_reset_and_step_two_workers(workers: WorkerTasks) -> None:
    async with aps.Learner(TCP, num_workers=2, timeouts=FAST) as learner:
        workers.start(learner.url, num_envs=3)
        workers.start(learner.url, num_envs=2)
        obs, info = await learner.reset(seed=0)
        assert obs.shape == (5, 4) and info == {}
        assert learner.num_envs == 5
        assert [w.env_offset for w in learner.workers] == [0, learner.workers[0].num_envs]
        assert learner.action_space == gym.spaces.MultiDiscrete([2] * 5)
        for _ in range(20):
            obs, rew, term, trunc, info = await learner.step(np.ones(5, np.int64))
            assert obs.shape == (5, 4) and rew.dtype == np.float64
            assert term.dtype == trunc.dtype == np.bool_ and isinstance(info, dict)
            assert obs.flags.writeable  # users may normalise observations in place


async def test_seeds_follow_global_env_order(workers: WorkerTasks) -> None:
    async with aps.Learner("memory://", num_workers=2, timeouts=FAST) as learner:
        workers.start(learner.url, num_envs=2)
        workers.start(learner.url, num_envs=2)
        obs, _ = await learner.reset(seed=7)
    expected, _ = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 4).reset(seed=7)
    np.testing.assert_array_equal(obs, expected)


async def test_env_error_arrives_as_worker_error_and_learner_goes_on(workers: WorkerTasks) -> None:
    async with aps.Learner(TCP, num_workers=1, timeouts=FAST) as learner:
        workers.start(learner.url, env=Exploding, num_envs=1)
        await learner.reset(seed=0)
        await learner.step(np.zeros(1, np.int64))
        await learner.step(np.zeros(1, np.int64))
        with pytest.raises(aps.WorkerError) as caught:
            await learner.step(np.zeros(1, np.int64))
        assert caught.value.remote_type == "builtins.RuntimeError"
        assert "the env exploded" in str(caught.value)
        assert (
            "Traceback" in caught.value.remote_traceback and "def step" not in caught.value.message
        )
        obs, _ = await learner.reset(seed=1)  # the worker still serves
        assert obs.shape == (1, 2)


@pytest.mark.parametrize(
    ("actions", "match"),
    [
        (np.zeros(3, np.int64), r"shape \(3,\), expected \(4,\)"),
        (np.zeros((4, 1), np.int64), r"shape \(4, 1\)"),
        (np.zeros(4, np.float32), "dtype"),
    ],
)
async def test_bad_actions_are_refused_before_sending(
    workers: WorkerTasks, actions: Any, match: str
) -> None:
    async with aps.Learner(TCP, num_workers=2, timeouts=FAST) as learner:
        workers.start(learner.url, num_envs=2)
        workers.start(learner.url, num_envs=2)
        await learner.reset(seed=0)
        with pytest.raises(aps.ConfigError, match=match):
            await learner.step(actions)
        await learner.step(np.zeros(4, np.int64))  # still in lockstep


class MiscountingServer(StepServer):
    """An honest step server whose answers are then tampered with as ``tamper`` says."""

    def __init__(self, *args: Any, tamper: str) -> None:
        super().__init__(*args)
        self.tamper = tamper

    def _step(self, request: Any) -> Any:
        answer = super()._step(request)
        if self.tamper == "reward":  # one reward too many
            return dataclasses.replace(answer, reward=np.append(answer.reward, 1.0))
        if self.tamper == "terminated":  # floats where bools belong
            return dataclasses.replace(answer, terminated=answer.terminated.astype(np.float32))
        return dataclasses.replace(answer, obs=np.concatenate([answer.obs, answer.obs]))

    def _reset(self, request: Any) -> Any:
        answer = super()._reset(request)
        if self.tamper == "reset":  # one observation too many
            return dataclasses.replace(answer, obs=np.concatenate([answer.obs, answer.obs]))
        return answer


class Miscounting(aps.Worker):
    """An honest worker whose answers are tampered with (see MiscountingServer)."""

    def __init__(self, *args: Any, tamper: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tamper = tamper

    def _new_server(self, envs: Any, collector: Any) -> StepServer:
        return MiscountingServer(envs, collector, None, tamper=self.tamper)


@pytest.mark.parametrize(
    ("tamper", "named"),
    [
        ("reward", "reward is an array of shape (2,)"),
        ("terminated", "terminated"),
        ("obs", "obs is an array of shape (2, 4)"),
    ],
)
async def test_a_step_answer_for_other_envs_is_refused(
    workers: WorkerTasks, tamper: str, named: str
) -> None:
    async with aps.Learner(TCP, num_workers=2, timeouts=FAST) as learner:
        workers.start(learner.url, num_envs=1)
        bad = Miscounting(learner.url, "CartPole-v1", num_envs=1, timeouts=FAST, tamper=tamper)
        workers.tasks.append(asyncio.create_task(bad.run()))
        await learner.reset(seed=0)
        with pytest.raises(
            aps.ProtocolError, match=r"not a compatible aps worker|same spaces"
        ) as caught:
            await learner.step(np.zeros(2, np.int64))
        assert named in str(caught.value)
        # The batch would be wrong for every env after it: the learner does not go on.
        with pytest.raises(aps.InvalidState, match="can no longer step"):
            await learner.step(np.zeros(2, np.int64))


async def test_a_reset_answer_for_other_envs_is_refused(workers: WorkerTasks) -> None:
    async with aps.Learner(TCP, num_workers=2, timeouts=FAST) as learner:
        workers.start(learner.url, num_envs=1)
        bad = Miscounting(learner.url, "CartPole-v1", num_envs=1, timeouts=FAST, tamper="reset")
        workers.tasks.append(asyncio.create_task(bad.run()))
        with pytest.raises(aps.ProtocolError, match=r"worker 1 sent a reset whose obs .* \(1, 4\)"):
            await learner.reset(seed=0)
        with pytest.raises(aps.InvalidState, match="reset"):
            await learner.step(np.zeros(2, np.int64))  # no batch was returned: not reset


class SlowServer(StepServer):
    """An honest step server that answers each step 0.3 s late (without blocking the loop)."""

    async def answer(self, session: Any, request: Any) -> bool:
        if isinstance(request, StepRequest):
            await asyncio.sleep(0.3)
        return await super().answer(session, request)


class Slow(aps.Worker):
    def _new_server(self, envs: Any, collector: Any) -> StepServer:
        return SlowServer(envs, collector, None)


async def test_a_partial_answer_for_other_envs_is_refused(workers: WorkerTasks) -> None:
    async with aps.Learner(TCP, num_workers=2, timeouts=FAST) as learner:
        bad = Miscounting(learner.url, "CartPole-v1", num_envs=1, timeouts=FAST, tamper="reward")
        workers.tasks.append(asyncio.create_task(bad.run()))
        slow = Slow(learner.url, "CartPole-v1", num_envs=1, timeouts=FAST)
        workers.tasks.append(asyncio.create_task(slow.run()))
        await learner.reset(seed=0)
        await learner.send(np.zeros(2, np.int64))
        with pytest.raises(aps.ProtocolError, match="sent a step whose reward"):
            await learner.recv(min_workers=1)  # the bad worker's answer, the slow one's pending
        # The learner is broken: not even the worker whose step was cancelled is stepped.
        for worker in learner.workers:
            with pytest.raises(aps.InvalidState, match="can no longer send"):
                await learner.send(np.zeros(1, np.int64), [worker.worker_id])


async def test_step_before_reset_is_invalid(workers: WorkerTasks) -> None:
    async with aps.Learner(TCP, num_workers=1, timeouts=FAST) as learner:
        workers.start(learner.url)
        await learner.wait_for_workers()
        with pytest.raises(aps.InvalidState, match="reset"):
            await learner.step(np.zeros(1, np.int64))


async def test_wrong_token_is_refused_and_others_are_served(
    workers: WorkerTasks, caplog: pytest.LogCaptureFixture
) -> None:
    async with aps.Learner(TCP, num_workers=1, token="right", timeouts=FAST) as learner:
        bad = workers.start(learner.url, token="wrong")
        with pytest.raises(aps.AuthError, match="token"):
            await asyncio.wait_for(bad, 10)
        anonymous = workers.start(learner.url)
        with pytest.raises(aps.AuthError, match="no proof"):
            await asyncio.wait_for(anonymous, 10)
        workers.start(learner.url, token="right")
        obs, _ = await learner.reset(seed=0)
        assert obs.shape == (1, 4)
    assert any("AuthError" in r.getMessage() for r in caplog.records)


async def test_non_loopback_without_token_is_refused() -> None:
    learner = aps.Learner("tcp://0.0.0.0:0", num_workers=1)
    with pytest.raises(aps.ConfigError, match="without a token"):
        await learner.start()
    await learner.aclose()
    async with aps.Learner("tcp://0.0.0.0:0", num_workers=1, insecure=True) as learner:
        assert learner.url.startswith("tcp://")


async def test_spaces_that_disagree_are_refused(workers: WorkerTasks) -> None:
    async with aps.Learner(TCP, num_workers=2, timeouts=FAST) as learner:
        workers.start(learner.url, num_envs=1)
        await asyncio.sleep(0)  # let the first worker in first
        while not learner._pool.slots.admitted:  # noqa: ASYNC110 - polling a test-only condition
            await asyncio.sleep(0.01)
        odd = workers.start(learner.url, env="Pendulum-v1")
        with pytest.raises(aps.ConfigError, match="same spaces"):
            await asyncio.wait_for(odd, 10)
        workers.start(learner.url, num_envs=1)
        obs, _ = await learner.reset(seed=0)
        assert obs.shape == (2, 4)


async def test_extra_worker_is_refused(workers: WorkerTasks) -> None:
    async with aps.Learner(TCP, num_workers=1, timeouts=FAST) as learner:
        workers.start(learner.url)
        await learner.wait_for_workers()
        extra = workers.start(learner.url)
        with pytest.raises(aps.ConfigError, match="already has its 1 workers"):
            await asyncio.wait_for(extra, 10)
        await learner.reset(seed=0)


async def test_missing_workers_time_out_with_a_count(workers: WorkerTasks) -> None:
    async with aps.Learner(TCP, num_workers=2, timeouts=FAST) as learner:
        workers.start(learner.url)
        with pytest.raises(aps.Timeout, match="1 of 2 workers arrived"):
            await learner.wait_for_workers(timeout=1.0)


async def test_worker_lost_mid_run(workers: WorkerTasks) -> None:
    async with aps.Learner(TCP, num_workers=2, timeouts=FAST) as learner:
        workers.start(learner.url)
        doomed = workers.start(learner.url)
        await learner.reset(seed=0)
        doomed.cancel()
        await asyncio.wait([doomed])
        with pytest.raises(aps.WorkerLost) as caught:
            for _ in range(3):
                await learner.step(np.zeros(2, np.int64))
        assert caught.value.worker_id in (0, 1)
        with pytest.raises(aps.InvalidState, match="no longer"):
            await learner.step(np.zeros(2, np.int64))


# Raw peers: speak just enough of the protocol to misbehave at a chosen point.


async def raw_client(url: str) -> tuple[transports.Transport, Challenge]:
    transport = await transports.connect(url, timeout=5)
    challenge = codec.decode(await transport.receive())
    assert isinstance(challenge, Challenge)
    return transport, challenge


async def expect_closed(transport: transports.Transport) -> list[Any]:
    """Read until the learner closes; return what it sent."""
    received = []
    with pytest.raises((aps.EndOfStream, aps.ConnectionLost)):
        async with asyncio.timeout(5):
            while True:
                received.append(codec.decode(await transport.receive()))
    await transport.aclose()
    return received


def hello(version: int = PROTOCOL_VERSION) -> Hello:
    return Hello(
        protocol_version=version,
        proof=b"",
        env_id="raw",
        num_envs=1,
        seed=None,
        host="h",
        pid=0,
        label="",
    )


BAD_FRAMES = {
    "garbage": b"\xc1\xc1\xc1 not msgpack",
    "truncated": codec.encode(hello())[:-3],
    "unknown type": msgpack.packb({"t": "launch_missiles"}),
    "wrong field type": msgpack.packb(
        {**msgpack.unpackb(codec.encode(hello())), "num_envs": "many"}
    ),
    "not a map": msgpack.packb([1, 2, 3]),
    "out of order": codec.encode(Reject(kind="x", reason="a worker cannot reject")),
}


@pytest.mark.parametrize("name", list(BAD_FRAMES))
@pytest.mark.parametrize("url", [TCP, "ws://127.0.0.1:0"], ids=["tcp", "ws"])
async def test_bad_frames_close_only_the_offender(
    workers: WorkerTasks, url: str, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with aps.Learner(url, num_workers=1, timeouts=FAST) as learner:
        transport, _ = await raw_client(learner.url)
        await transport.send(BAD_FRAMES[name])
        sent = await expect_closed(transport)
        assert [type(m).__name__ for m in sent] in ([], ["Goodbye"])
        workers.start(learner.url)
        obs, _ = await learner.reset(seed=0)
        assert obs.shape == (1, 4)
    assert any("refused a worker" in r.getMessage() for r in caplog.records)


async def test_wrong_protocol_version_is_rejected_by_name(workers: WorkerTasks) -> None:
    async with aps.Learner(TCP, num_workers=1, timeouts=FAST) as learner:
        transport, _ = await raw_client(learner.url)
        await transport.send(codec.encode(hello(version=PROTOCOL_VERSION + 1)))
        sent = await expect_closed(transport)
        assert isinstance(sent[0], Reject) and sent[0].kind == "VersionMismatch"
        assert f"version {PROTOCOL_VERSION + 1}" in sent[0].reason
        workers.start(learner.url)
        await learner.reset(seed=0)


async def test_oversized_frame_header_closes_the_connection(workers: WorkerTasks) -> None:
    async with aps.Learner(TCP, num_workers=1, timeouts=FAST) as learner:
        host, port = learner.url.removeprefix("tcp://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(struct.pack("<I", 2**31) + b"x" * 16)  # announces 2 GiB, sends 16 bytes
        await writer.drain()
        async with asyncio.timeout(5):
            while await reader.read(65536):
                pass  # the learner closes; read to EOF
        writer.close()
        workers.start(learner.url)
        await learner.reset(seed=0)


async def test_silent_client_is_dropped_after_the_handshake_deadline(workers: WorkerTasks) -> None:
    timeouts = aps.Timeouts(handshake=0.3, connect=10, step=10)
    async with aps.Learner(TCP, num_workers=1, timeouts=timeouts) as learner:
        transport, _ = await raw_client(learner.url)
        await expect_closed(transport)  # we never answer the challenge
        workers.start(learner.url)
        await learner.reset(seed=0)


async def handshake_as_raw_worker(url: str) -> transports.Transport:
    """Complete a real handshake by hand, then hand the transport to the test."""
    transport, _ = await raw_client(url)
    await transport.send(codec.encode(hello()))
    welcome = codec.decode(await transport.receive())
    assert type(welcome).__name__ == "Welcome"
    space = gym.spaces.Box(-1, 1, (4,), np.float32)
    ready = Ready(observation_space=space, action_space=gym.spaces.Discrete(2), num_envs=1)
    await transport.send(codec.encode(ready))
    return transport


async def test_a_worker_that_never_answers_times_out_the_step() -> None:
    """Under "raise", a silent worker is a lost one: WorkerLost, caused by the Timeout."""
    timeouts = aps.Timeouts(connect=5, handshake=2, step=0.5, heartbeat_interval=0.1)
    async with aps.Learner(TCP, num_workers=1, timeouts=timeouts) as learner:
        transport = await handshake_as_raw_worker(learner.url)
        try:
            with pytest.raises(aps.WorkerLost) as caught:
                await learner.reset(seed=0)  # the raw worker reads nothing, answers nothing
            cause = caught.value.__cause__
            assert isinstance(cause, aps.Timeout)
            assert cause.operation == "worker 0's reset" and cause.seconds == 0.5
        finally:
            await transport.aclose()


async def test_a_silent_learner_times_out_the_worker() -> None:
    factory = transports.get_factory("tcp")
    listener = await factory.listen(TCP)
    timeouts = aps.Timeouts(connect=5, handshake=2, heartbeat_timeout=0.5)
    worker = asyncio.create_task(aps.Worker(listener.url, "CartPole-v1", timeouts=timeouts).run())
    transport = await listener.accept()
    try:
        # Play a learner that welcomes the worker and then says nothing at all.
        await transport.send(
            codec.encode(Challenge(protocol_version=PROTOCOL_VERSION, nonce=b"n" * 32))
        )
        assert isinstance(codec.decode(await transport.receive()), Hello)
        await transport.send(
            codec.encode(Welcome(worker_id=0, autoreset_mode="NextStep", policy=None))
        )
        assert isinstance(codec.decode(await transport.receive()), Ready)
        with pytest.raises(aps.Timeout, match="nothing from"):
            await asyncio.wait_for(worker, 10)
    finally:
        worker.cancel()
        await transport.aclose()
        await listener.aclose()


async def test_heartbeats_keep_an_idle_worker_alive(workers: WorkerTasks) -> None:
    timeouts = aps.Timeouts(connect=5, handshake=2, heartbeat_interval=0.05, heartbeat_timeout=0.3)
    async with aps.Learner(TCP, num_workers=1, timeouts=timeouts) as learner:
        task = workers.start(learner.url, timeouts=timeouts)
        await learner.reset(seed=0)
        await asyncio.sleep(1.0)  # idle for three worker timeouts: heartbeats must cover it
        assert not task.done()
        await learner.step(np.zeros(1, np.int64))


async def test_tls_with_token_end_to_end(
    workers: WorkerTasks, tls: tuple[ssl.SSLContext, ssl.SSLContext]
) -> None:
    server, client = tls
    learner_factory = TCPFactory(server_ssl_context=server)
    async with aps.Learner(
        TCP, num_workers=1, token="t", factory=learner_factory, timeouts=FAST
    ) as learner:
        worker_url = learner.url.replace("127.0.0.1", "localhost")
        workers.start(worker_url, token="t", factory=TCPFactory(client_ssl_context=client))
        obs, _ = await learner.reset(seed=0)
        assert obs.shape == (1, 4)
        # A worker that does not speak TLS never gets in.
        plain = workers.start(learner.url, token="t", timeouts=aps.Timeouts(connect=1, handshake=1))
        with pytest.raises((aps.Timeout, aps.TransportError)):
            await asyncio.wait_for(plain, 10)


async def test_a_flood_of_silent_connections_is_capped(workers: WorkerTasks) -> None:
    """Handshakes that never say hello are capped, and the newest connection is the one
    served: the oldest silent one makes room, so a flood cannot keep anyone out."""
    from aps.learner import MAX_HANDSHAKES, MAX_HANDSHAKES_PER_HOST

    timeouts = aps.Timeouts(connect=10, handshake=30.0, step=10)
    async with aps.Learner(TCP, num_workers=1, timeouts=timeouts) as learner:
        silent = [await transports.connect(learner.url, timeout=5) for _ in range(MAX_HANDSHAKES)]
        for transport in silent:  # each gets its challenge (or is dropped to make room)
            with contextlib.suppress(aps.EndOfStream, aps.ConnectionLost):
                assert isinstance(codec.decode_handshake(await transport.receive()), Challenge)
        extra = await transports.connect(learner.url, timeout=5)
        async with asyncio.timeout(5):  # the newest is challenged at once
            assert isinstance(codec.decode_handshake(await extra.receive()), Challenge)
        # All came from one address: only the newest few of them still hold a slot.
        dropped = 0
        for transport in silent:
            try:
                async with asyncio.timeout(0.2):
                    while True:
                        await transport.receive()
            except (aps.EndOfStream, aps.ConnectionLost):
                dropped += 1
            except TimeoutError:
                pass
            await transport.aclose()
        assert dropped >= MAX_HANDSHAKES + 1 - MAX_HANDSHAKES_PER_HOST
        await extra.aclose()
        workers.start(learner.url)
        await learner.reset(seed=0)
