"""The sans-I/O protocol: the transition table, heartbeats, goodbyes, the token proof."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from aps.errors import AuthError, InvalidState, ProtocolError, VersionMismatch
from aps.session.protocol import (
    Connection,
    Role,
    State,
    check_hello,
    check_learner_proof,
    learner_proof,
    prove,
    worker_proof,
)
from aps.wire.messages import (
    PROTOCOL_VERSION,
    Challenge,
    ErrorReport,
    Goodbye,
    GradientReport,
    GradientRound,
    GradientsStopped,
    Heartbeat,
    Hello,
    Ready,
    Reject,
    ResetRequest,
    ResetResult,
    RolloutChunk,
    RolloutRequest,
    StepRequest,
    StepResult,
    StopGradients,
    Weights,
    Welcome,
)

NONCE = b"n" * 32
WORKER_NONCE = b"w" * 32
CHALLENGE = Challenge(protocol_version=PROTOCOL_VERSION, nonce=NONCE)


def hello(proof: bytes = b"", version: int = PROTOCOL_VERSION) -> Hello:
    return Hello(
        protocol_version=version,
        proof=proof,
        env_id="X",
        num_envs=2,
        seed=None,
        host="h",
        pid=1,
        label="",
        nonce=WORKER_NONCE,
    )


WELCOME = Welcome(worker_id=0, autoreset_mode="NextStep", policy=None)
READY = Ready(
    observation_space=gym.spaces.Discrete(3), action_space=gym.spaces.Discrete(2), num_envs=2
)
STEP = StepRequest(actions=np.zeros(2, np.int64))
STEP_RESULT = StepResult(
    obs=np.zeros(2),
    reward=np.zeros(2),
    terminated=np.zeros(2, bool),
    truncated=np.zeros(2, bool),
    info={},
)
ERROR = ErrorReport(remote_type="ValueError", message="boom", traceback="")


def learner_at_idle() -> Connection:
    c = Connection(Role.LEARNER)
    c.send(CHALLENGE)
    c.receive(hello())
    c.send(WELCOME)
    c.receive(READY)
    assert c.state is State.IDLE
    return c


def worker_at_idle() -> Connection:
    c = Connection(Role.WORKER)
    c.receive(CHALLENGE)
    c.send(hello())
    c.receive(WELCOME)
    c.send(READY)
    assert c.state is State.IDLE
    return c


def test_learner_lockstep_cycle() -> None:
    c = learner_at_idle()
    for _ in range(3):
        c.send(STEP)
        assert c.state is State.AWAIT_STEP
        c.receive(STEP_RESULT)
        assert c.state is State.IDLE
    c.send(ResetRequest(seed=1, options=None))
    c.receive(ERROR)
    assert c.state is State.IDLE


def test_worker_lockstep_cycle() -> None:
    c = worker_at_idle()
    c.receive(ResetRequest(seed=None, options=None))
    c.send(ResetResult(obs=np.zeros(2), info={}))
    c.receive(STEP)
    c.send(ERROR)
    assert c.state is State.IDLE


@pytest.mark.parametrize(
    "message",
    [STEP_RESULT, READY, hello(), ResetResult(obs=np.zeros(2), info={})],
    ids=lambda m: type(m).__name__,
)
def test_learner_refuses_unexpected_messages_from_peer(message: object) -> None:
    c = learner_at_idle()
    with pytest.raises(ProtocolError, match="peer sent"):
        c.receive(message)  # type: ignore[arg-type]


def test_two_requests_in_flight_are_a_caller_bug() -> None:
    c = learner_at_idle()
    c.send(STEP)
    with pytest.raises(InvalidState):
        c.send(STEP)


def test_worker_refuses_a_request_before_the_handshake() -> None:
    c = Connection(Role.WORKER)
    with pytest.raises(ProtocolError):
        c.receive(STEP)


def test_worker_refuses_a_second_request_while_stepping() -> None:
    c = worker_at_idle()
    c.receive(STEP)
    with pytest.raises(ProtocolError):
        c.receive(STEP)


def test_heartbeats_only_after_the_handshake() -> None:
    c = Connection(Role.LEARNER)
    c.send(CHALLENGE)
    with pytest.raises(ProtocolError):
        c.receive(Heartbeat())
    c = learner_at_idle()
    c.send(STEP)
    c.receive(Heartbeat())
    c.send(Heartbeat())
    assert c.state is State.AWAIT_STEP


def test_goodbye_closes_from_any_state() -> None:
    for c in (Connection(Role.LEARNER), learner_at_idle(), worker_at_idle()):
        c.receive(Goodbye(reason="bye"))
        assert c.state is State.CLOSED
        with pytest.raises(ProtocolError):
            c.receive(Heartbeat())


def test_reject_closes_the_worker() -> None:
    c = Connection(Role.WORKER)
    c.receive(CHALLENGE)
    c.send(hello())
    c.receive(Reject(kind="AuthError", reason="no"))
    assert c.state is State.CLOSED


def test_proof_is_hmac_and_checked() -> None:
    token = b"secret"
    check_hello(hello(worker_proof(token, NONCE, WORKER_NONCE)), nonce=NONCE, token=token)
    check_hello(hello(b""), nonce=NONCE, token=None)  # no token required: anything goes
    with pytest.raises(AuthError, match="wrong"):
        check_hello(hello(worker_proof(b"other", NONCE, WORKER_NONCE)), nonce=NONCE, token=token)
    with pytest.raises(AuthError, match="no proof"):
        check_hello(hello(b""), nonce=NONCE, token=token)
    with pytest.raises(AuthError):  # a proof for another nonce is a replay
        check_hello(hello(worker_proof(token, b"x" * 32, WORKER_NONCE)), nonce=NONCE, token=token)
    with pytest.raises(AuthError):  # the bare HMAC of the nonce (protocol 3) is no proof now
        check_hello(hello(prove(token, NONCE)), nonce=NONCE, token=token)
    assert token not in worker_proof(token, NONCE, WORKER_NONCE)


def test_the_learner_proves_the_token_too() -> None:
    """Mutual: the worker checks the learner's proof, which differs from its own."""
    token = b"secret"
    good = learner_proof(token, NONCE, WORKER_NONCE)
    check_learner_proof(good, token=token, learner_nonce=NONCE, worker_nonce=WORKER_NONCE, peer="p")
    assert good != worker_proof(token, NONCE, WORKER_NONCE)  # no reflecting a worker's proof
    for bad in (b"", worker_proof(token, NONCE, WORKER_NONCE), learner_proof(b"x", NONCE, NONCE)):
        with pytest.raises(AuthError, match="learner at p"):
            check_learner_proof(
                bad, token=token, learner_nonce=NONCE, worker_nonce=WORKER_NONCE, peer="p"
            )
    # A worker without a token has nothing to check against.
    check_learner_proof(b"", token=None, learner_nonce=NONCE, worker_nonce=WORKER_NONCE, peer="p")


def test_version_mismatch_names_both_versions() -> None:
    with pytest.raises(VersionMismatch, match=f"version 99, this side speaks {PROTOCOL_VERSION}"):
        check_hello(hello(version=99), nonce=NONCE, token=None)


def chunk() -> RolloutChunk:
    z = np.zeros((2, 2))
    return RolloutChunk(
        version=1, obs=z, actions=z, logprob=z, value=None, reward=z, terminated=z, truncated=z,
        next_obs=z, episode_return=z, episode_length=z, episode_env=z, truncated_obs=z,
        truncated_index=z,
    )  # fmt: skip


def test_rollouts_may_be_pipelined_and_are_counted() -> None:
    learner, worker = learner_at_idle(), worker_at_idle()
    weights = Weights(version=1, arrays={}, epsilon=None)
    for side, out in ((learner, learner.send), (worker, worker.receive)):
        out(weights)
        out(RolloutRequest(num_steps=4))
        out(RolloutRequest(num_steps=4))
        out(weights)  # weights between pipelined requests apply before the next chunk
        assert side.state is State.COLLECTING and side.rollouts_pending == 2
    learner.receive(chunk())
    worker.send(chunk())
    assert learner.state is State.COLLECTING and learner.rollouts_pending == 1
    learner.receive(ERROR)
    worker.send(ERROR)
    assert learner.state is worker.state is State.IDLE
    with pytest.raises(ProtocolError):
        learner.receive(chunk())  # nothing outstanding


def test_no_lockstep_step_while_rollouts_are_outstanding() -> None:
    learner = learner_at_idle()
    learner.send(RolloutRequest(num_steps=1))
    with pytest.raises(InvalidState):
        learner.send(STEP)
    worker = worker_at_idle()
    worker.receive(RolloutRequest(num_steps=1))
    with pytest.raises(ProtocolError):
        worker.receive(STEP)


def test_a_worker_that_cannot_build_its_envs_reports_and_closes() -> None:
    learner, worker = Connection(Role.LEARNER), Connection(Role.WORKER)
    learner.send(CHALLENGE)
    worker.receive(CHALLENGE)
    worker.send(hello())
    learner.receive(hello())
    learner.send(WELCOME)
    worker.receive(WELCOME)
    worker.send(ERROR)
    learner.receive(ERROR)
    assert learner.state is worker.state is State.CLOSED


def test_gradient_mode_until_stopped() -> None:
    learner, worker = learner_at_idle(), worker_at_idle()
    round_ = GradientRound(round=0, arrays={}, horizon=5, gamma=0.9)
    report = GradientReport(round=0, gradient={}, count=1, episode_return=np.zeros(1))
    learner.send(round_)
    worker.receive(round_)
    for _ in range(3):
        worker.send(report)
        learner.receive(report)
    learner.send(round_)  # a new round replaces the last
    worker.receive(round_)
    with pytest.raises(InvalidState):
        learner.send(STEP)  # no lockstep during gradient mode
    learner.send(StopGradients())
    worker.receive(StopGradients())
    learner.receive(report)  # late reports may still arrive
    worker.send(GradientsStopped())
    learner.receive(GradientsStopped())
    assert learner.state is worker.state is State.IDLE
    with pytest.raises(ProtocolError):
        learner.receive(report)
