"""``aps check``'s probe: what a learner tells a check that proved the token, and nothing more.

Real learners on 127.0.0.1 (TCP, and WebSocket when installed), real workers, and a bare
listener playing an older learner frame by frame.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

import aps
from aps import transports
from aps.cli._probe import check_learner
from aps.errors import AuthError, EndOfStream, InvalidState, ProtocolError, VersionMismatch
from aps.session import Session
from aps.session.protocol import Connection, Role, State, worker_proof
from aps.wire import codec
from aps.wire.codec import HANDSHAKE_FRAME_SIZE
from aps.wire.messages import (
    PROTOCOL_VERSION,
    Challenge,
    Hello,
    MetricsRequest,
    ProbeMetrics,
    ProbeResult,
    ProbeSpaces,
    Reject,
    ResetRequest,
    SpacesRequest,
)
from tests.conftest import FAST, WorkerTasks
from tests.test_cli_tools import aps_cli_async

TCP = "tcp://127.0.0.1:0"
TOKEN = "a token of enough entropy for a test, 0123456789abcdef"
pytestmark = pytest.mark.timeout(60)


class BigObservations(gym.Env[np.ndarray, int]):
    """An env whose observation space alone is larger than a handshake frame."""

    observation_space = gym.spaces.Box(0, 255, (64, 64, 3), np.uint8)
    action_space = gym.spaces.Discrete(3)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        return np.zeros((64, 64, 3), np.uint8), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        return np.zeros((64, 64, 3), np.uint8), 1.0, False, False, {}


def _probe_hello(proof: bytes, nonce: bytes) -> Hello:
    return Hello(
        protocol_version=PROTOCOL_VERSION,
        nonce=nonce,
        proof=proof,
        env_id="",
        num_envs=0,
        seed=None,
        host="test",
        pid=os.getpid(),
        label="probe test",
        probe=True,
    )


def test_a_probe_gets_its_result_then_the_spaces_then_the_figures_it_asks_for() -> None:
    learner, worker = Connection(Role.LEARNER), Connection(Role.WORKER)
    result = ProbeResult(
        proof=b"",
        aps_version="0",
        num_workers=1,
        workers=0,
        spares=0,
        num_envs=0,
        autoreset_mode="NextStep",
        policy=None,
    )
    spaces = ProbeSpaces(observation_space=None, action_space=None)
    challenge = Challenge(protocol_version=PROTOCOL_VERSION, nonce=b"n" * 32)
    with pytest.raises(InvalidState):  # never before the peer's hello (and its proof)
        learner.send(result)
    for side, direction in ((learner, "send"), (worker, "receive")):
        getattr(side, direction)(challenge)
    hello = _probe_hello(b"", b"w" * 32)
    worker.send(hello)
    learner.receive(hello)
    with pytest.raises(ProtocolError):  # the spaces follow the result, never lead
        worker.receive(spaces)
    learner.send(result)
    worker.receive(result)
    with pytest.raises(InvalidState):  # nothing large before the probe asked for it
        learner.send(spaces)
    worker.send(SpacesRequest())
    learner.receive(SpacesRequest())
    learner.send(spaces)
    worker.receive(spaces)
    # Then it may watch (aps top): each request for the figures answered, nothing else.
    assert learner.state is worker.state is State.WATCHING
    figures = ProbeMetrics(metrics={"version": 0})
    with pytest.raises(InvalidState):  # never unasked
        learner.send(figures)
    for _ in range(2):
        worker.send(MetricsRequest())
        learner.receive(MetricsRequest())
        with pytest.raises(InvalidState):  # one request, one answer
            worker.send(MetricsRequest())
        learner.send(figures)
        worker.receive(figures)
    with pytest.raises(InvalidState):  # a probe never takes part in the work
        learner.send(ResetRequest(seed=None, options=None))


def test_a_worker_hello_is_no_probe_and_the_result_is_a_handshake_frame() -> None:
    fields = vars_of(_probe_hello(b"", b""))
    del fields["probe"]
    hello = codec.decode_handshake(codec.encode(Hello(**fields)))
    assert isinstance(hello, Hello) and hello.probe is False
    result = ProbeResult(
        proof=b"p" * 32,
        aps_version="0.1.0",
        num_workers=2,
        workers=1,
        spares=0,
        num_envs=4,
        autoreset_mode="SameStep",
        policy="pkg.module:make",
    )
    assert codec.decode_handshake(codec.encode(result)) == result


def vars_of(message: Any) -> dict[str, Any]:
    return {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}


async def test_before_any_worker_the_spaces_are_not_known() -> None:
    async with aps.Learner(
        TCP, num_workers=2, token=TOKEN, timeouts=FAST, policy="tests.agents:Agent"
    ) as learner:
        result = await check_learner(learner.url, token=TOKEN, timeout=10)
        assert result.protocol_version == PROTOCOL_VERSION
        assert result.aps_version == aps.__version__
        assert (result.num_workers, result.workers, result.spares, result.num_envs) == (2, 0, 0, 0)
        assert result.observation_space is None and result.action_space is None
        assert result.policy == "tests.agents:Agent"
        assert result.autoreset_mode == "NextStep"
        # Not a worker: no slot taken, no refusal counted or remembered.
        assert len(learner.workers) == 0
        assert learner._pool.refused == 0 and learner._pool.refusals == []


async def test_after_a_worker_joined_the_spaces_are_known_and_steps_go_on(
    workers: WorkerTasks,
) -> None:
    async with aps.Learner(TCP, num_workers=1, token=TOKEN, timeouts=FAST) as learner:
        workers.start(learner.url, num_envs=3, token=TOKEN)
        obs, _ = await learner.reset(seed=0)
        result = await check_learner(learner.url, token=TOKEN, timeout=10)
        assert (result.num_workers, result.workers, result.num_envs) == (1, 1, 3)
        assert result.observation_space == gym.make("CartPole-v1").observation_space
        assert result.action_space == gym.spaces.Discrete(2)
        assert result.policy is None
        # The lockstep learner is undisturbed: the next step goes to the same worker.
        obs, reward, _, _, _ = await learner.step(learner.action_space.sample())
        assert obs.shape == (3, 4) and reward.shape == (3,)
        assert len(learner.workers) == 1 and learner._pool.refused == 0


async def test_spaces_larger_than_a_handshake_frame_arrive(workers: WorkerTasks) -> None:
    space = BigObservations.observation_space
    assert space.low.nbytes + space.high.nbytes > HANDSHAKE_FRAME_SIZE  # the point of it
    async with aps.Learner(TCP, num_workers=1, token=TOKEN, timeouts=FAST) as learner:
        workers.start(learner.url, env=BigObservations, num_envs=1, token=TOKEN)
        await learner.reset(seed=0)
        result = await check_learner(learner.url, token=TOKEN, timeout=10)
        assert result.observation_space == space
        assert result.action_space == gym.spaces.Discrete(3)


async def test_a_probe_with_a_wrong_token_learns_nothing_but_the_refusal() -> None:
    async with aps.Learner(TCP, num_workers=1, token=TOKEN, timeouts=FAST) as learner:
        with pytest.raises(AuthError, match="token proof is wrong"):
            await check_learner(learner.url, token="not " + TOKEN, timeout=10)
        with pytest.raises(AuthError, match="requires a token"):
            await check_learner(learner.url, token=None, timeout=10)
        # Frame by frame: a Reject without the learner's proof, then the end; no result.
        session = Session(await transports.get_factory("tcp").connect(learner.url), Role.WORKER)
        try:
            challenge = await session.receive(timeout=10, operation="challenge")
            assert isinstance(challenge, Challenge)
            nonce = os.urandom(32)
            wrong = worker_proof(b"not the token", challenge.nonce, nonce)
            await session.send(_probe_hello(wrong, nonce))
            answer = await session.receive(timeout=10, operation="answer")
            assert isinstance(answer, Reject)
            assert answer.kind == "AuthError" and answer.proof == b""
            assert "token proof is wrong" in answer.reason
            assert not any(s in answer.reason for s in ("CartPole", "NextStep", aps.__version__))
            with pytest.raises(EndOfStream):
                await session.receive(timeout=10, operation="nothing more")
        finally:
            await session.aclose()
        # Refused like any worker with a wrong token, as before.
        await learner._pool.settle_admissions()
        assert learner._pool.refused == 3 and len(learner.workers) == 0


async def test_a_probe_that_never_asks_for_the_spaces_is_dropped_at_the_deadline(
    workers: WorkerTasks,
) -> None:
    async with aps.Learner(TCP, num_workers=1, token=TOKEN, timeouts=FAST) as learner:
        session = Session(await transports.get_factory("tcp").connect(learner.url), Role.WORKER)
        try:
            challenge = await session.receive(timeout=10, operation="challenge")
            assert isinstance(challenge, Challenge)
            nonce = os.urandom(32)
            proof = worker_proof(TOKEN.encode(), challenge.nonce, nonce)
            await session.send(_probe_hello(proof, nonce))
            result = await session.receive(timeout=10, operation="result")
            assert isinstance(result, ProbeResult) and result.proof
            # Silent from here on: the handshake deadline ends the conversation.
            with pytest.raises(EndOfStream):
                await session.receive(timeout=10 * FAST.handshake, operation="the end")
        finally:
            await session.aclose()
        assert learner._pool.refused == 0
        workers.start(learner.url, num_envs=1, token=TOKEN)  # the slot is still free
        obs, _ = await learner.reset(seed=0)
        assert obs.shape == (1, 4)


async def test_an_older_learner_is_refused_by_name() -> None:
    listener = await transports.get_factory("tcp").listen(TCP)

    async def old_learner() -> None:
        transport = await listener.accept()
        old = Challenge(protocol_version=PROTOCOL_VERSION - 1, nonce=os.urandom(32))
        await transport.send(codec.encode(old))
        await transport.receive()  # the check leaves without a hello
        await transport.aclose()

    serving = asyncio.create_task(old_learner())
    try:
        with pytest.raises(VersionMismatch, match=f"version {PROTOCOL_VERSION - 1}"):
            await check_learner(listener.url, token=TOKEN, timeout=10)
    finally:
        serving.cancel()
        await asyncio.wait([serving])
        await listener.aclose()


async def test_a_probe_over_websocket() -> None:
    pytest.importorskip("websockets")
    async with aps.Learner(
        "ws://127.0.0.1:0", num_workers=3, token=TOKEN, timeouts=FAST
    ) as learner:
        result = await check_learner(learner.url, token=TOKEN, timeout=10)
        assert (result.num_workers, result.workers) == (3, 0)
        assert result.observation_space is None


@pytest.fixture
def token_file(tmp_path: Any) -> str:
    path = tmp_path / "token.txt"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)  # a token file open to others is refused
    return str(path)


async def test_the_cli_prints_the_learner_and_its_spaces(
    token_file: str, workers: WorkerTasks
) -> None:
    async with aps.Learner(TCP, num_workers=2, token=TOKEN, timeouts=FAST) as learner:
        code, out, err = await aps_cli_async("check", learner.url, "--token-file", token_file)
        assert code == 0, err
        assert f"learner:      {learner.url}, protocol {PROTOCOL_VERSION}, aps " in out
        assert "workers:      0 of 2 connected, 0 envs\n" in out
        assert "observations: not known yet: no worker has joined\n" in out
        assert "actions:      not known yet: no worker has joined\n" in out
        assert "policy:       none: the learner chooses the actions\n" in out
        workers.start(learner.url, num_envs=2, token=TOKEN)
        workers.start(learner.url, num_envs=1, token=TOKEN)
        await learner.reset(seed=0)
        code, out, err = await aps_cli_async("check", learner.url, "--token-file", token_file)
        assert code == 0, err
        assert "workers:      2 of 2 connected, 3 envs\n" in out
        observation_space = gym.make("CartPole-v1").observation_space
        assert f"observations: {observation_space!r}\n" in out
        assert "actions:      Discrete(2)\n" in out
        code, out, err = await aps_cli_async(
            "check", learner.url, "--token-file", token_file, "--json"
        )
        assert code == 0, err
        report = json.loads(out)
        assert report["workers"] == report["num_workers"] == 2 and report["num_envs"] == 3
        assert report["action_space"] == "Discrete(2)"
        assert report["observation_space"] == repr(observation_space)
        assert report["token"] == "accepted" and report["protocol_version"] == PROTOCOL_VERSION
        assert report["round_trip_seconds"] > 0
        assert len(learner.workers) == 2 and learner._pool.refused == 0
