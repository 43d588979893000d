"""The aps conversation as a state machine, without I/O.

Each side of a connection owns a :class:`Connection`; it sees every message that goes out
(:meth:`Connection.send`) and comes in (:meth:`Connection.receive`) and refuses the ones the
protocol does not allow at that point. The rules are one literal table per role,
:data:`TRANSITIONS`, in the style of h11: nothing about the order of messages lives in
scattered ``if`` statements in the roles.

The handshake's proofs of the shared token are here too. Each side picks a random nonce (the
learner's travels in the Challenge, the worker's in its Hello) and each proves the token over
both, under a label naming its role: ``HMAC-SHA256(token, label + learner_nonce +
worker_nonce)``, compared in constant time. The worker proves first, bound to a nonce of its
own choosing, so its proof is good for this one handshake only and cannot be replayed; the
learner's proof, in its Welcome, tells the worker it reached a holder of the token before it
acts on anything the learner said. The token itself never crosses the wire.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
from collections.abc import Callable
from typing import Any

from aps.errors import AuthError, ConfigError, InvalidState, ProtocolError, VersionMismatch
from aps.wire import codec
from aps.wire.messages import (
    PROTOCOL_VERSION,
    Challenge,
    CollectGradients,
    EnvCall,
    EnvCallResult,
    ErrorReport,
    Goodbye,
    GradientProgress,
    GradientReport,
    GradientRound,
    GradientsReduced,
    GradientsStopped,
    GroupWeights,
    Heartbeat,
    Hello,
    JoinWeightGroup,
    Message,
    MetricsRequest,
    ProbeMetrics,
    ProbeResult,
    ProbeSpaces,
    Ready,
    ReduceGradients,
    Reject,
    ResetRequest,
    ResetResult,
    RolloutChunk,
    RolloutRequest,
    SpacesRequest,
    StepRequest,
    StepResult,
    StopGradients,
    WeightGroupJoined,
    Weights,
    Welcome,
)

__all__ = [
    "ANSWERS",
    "MAX_IN_FLIGHT",
    "REQUESTS",
    "NONCE_SIZE",
    "TRANSITIONS",
    "Connection",
    "Direction",
    "RequestKind",
    "Role",
    "State",
    "check_hello",
    "check_learner_proof",
    "learner_proof",
    "prove",
    "register_request",
    "worker_proof",
]

NONCE_SIZE = 32
"""Bytes of randomness in a :class:`~aps.wire.messages.Challenge` nonce."""

MAX_IN_FLIGHT = 64
"""The most requests a learner keeps unanswered per worker; also the most answers a worker
keeps for a resume (an unacknowledged answer is one of them)."""


class Role(enum.Enum):
    """Which end of the connection this state machine describes."""

    LEARNER = "learner"
    WORKER = "worker"


class Direction(enum.Enum):
    """Whether a message is being sent or was received by this side."""

    SEND = "send"
    RECEIVE = "receive"

    # Members are singletons, so identity hashing is exact; Enum's own __hash__ is a Python
    # call, and the transition table is looked up with a state and a direction per message.
    __hash__ = object.__hash__


class State(enum.Enum):
    """Where a connection stands; the names read from this side's point of view."""

    START = "start"
    # Learner side.
    SENT_CHALLENGE = "sent_challenge"
    GOT_HELLO = "got_hello"
    AWAIT_READY = "await_ready"
    AWAIT_RESET = "await_reset"
    AWAIT_STEP = "await_step"
    AWAIT_CALL = "await_call"  # an env call (get_attr, set_attr, call, render) sent
    AWAIT_ANSWER = "await_answer"  # a request of a mode's own kind sent (see RequestKind)
    COLLECTING = "collecting"  # rollout requests outstanding (both sides; counted)
    GRADIENTS = "gradients"  # gradient rounds running (both sides)
    STOPPING = "stopping"  # gradient mode asked to end, the worker's last reports may follow
    # Worker side.
    GOT_CHALLENGE = "got_challenge"
    AWAIT_WELCOME = "await_welcome"
    WELCOMED = "welcomed"
    RESETTING = "resetting"
    STEPPING = "stepping"
    CALLING = "calling"
    SERVING = "serving"  # answering a request of a mode's own kind (see RequestKind)
    # Both.
    PROBED = "probed"  # a probe's proofs were sent: it may ask for the spaces, then it ends
    PROBE_SPACES = "probe_spaces"  # the probe asked for the spaces
    WATCHING = "watching"  # the probe has the spaces; it may ask for the figures (aps top)
    METRICS_ASKED = "metrics_asked"  # the probe asked for the figures
    IDLE = "idle"
    CLOSED = "closed"

    __hash__ = object.__hash__  # see Direction


_S, _R = Direction.SEND, Direction.RECEIVE

TRANSITIONS: dict[Role, dict[tuple[State, Direction, type[Message]], State]] = {
    Role.LEARNER: {
        (State.START, _S, Challenge): State.SENT_CHALLENGE,
        (State.START, _S, Reject): State.CLOSED,  # busy: a retry-after instead of a challenge
        (State.SENT_CHALLENGE, _R, Hello): State.GOT_HELLO,
        (State.GOT_HELLO, _S, Welcome): State.AWAIT_READY,
        (State.GOT_HELLO, _S, Reject): State.CLOSED,
        (State.GOT_HELLO, _S, ProbeResult): State.PROBED,
        (State.PROBED, _R, SpacesRequest): State.PROBE_SPACES,
        (State.PROBE_SPACES, _S, ProbeSpaces): State.WATCHING,
        (State.WATCHING, _R, MetricsRequest): State.METRICS_ASKED,
        (State.METRICS_ASKED, _S, ProbeMetrics): State.WATCHING,
        (State.AWAIT_READY, _R, Ready): State.IDLE,
        (State.AWAIT_READY, _R, ErrorReport): State.CLOSED,
        (State.IDLE, _S, Reject): State.CLOSED,
        (State.IDLE, _S, Weights): State.IDLE,
        (State.COLLECTING, _S, Weights): State.COLLECTING,
        (State.IDLE, _S, GroupWeights): State.IDLE,
        (State.COLLECTING, _S, GroupWeights): State.COLLECTING,
        (State.IDLE, _S, GradientRound): State.GRADIENTS,
        (State.GRADIENTS, _S, GradientRound): State.GRADIENTS,
        (State.GRADIENTS, _R, GradientReport): State.GRADIENTS,
        (State.GRADIENTS, _R, ErrorReport): State.GRADIENTS,
        (State.GRADIENTS, _S, StopGradients): State.STOPPING,
        (State.STOPPING, _R, GradientReport): State.STOPPING,
        (State.STOPPING, _R, ErrorReport): State.STOPPING,
        (State.STOPPING, _R, GradientsStopped): State.IDLE,
        (State.GRADIENTS, _R, GradientProgress): State.GRADIENTS,
        (State.GRADIENTS, _S, CollectGradients): State.GRADIENTS,
        (State.STOPPING, _R, GradientProgress): State.STOPPING,
        (State.GRADIENTS, _S, ReduceGradients): State.GRADIENTS,
        (State.GRADIENTS, _R, GradientsReduced): State.GRADIENTS,
        (State.STOPPING, _R, GradientsReduced): State.STOPPING,
    },
    Role.WORKER: {
        (State.START, _R, Challenge): State.GOT_CHALLENGE,
        (State.START, _R, Reject): State.CLOSED,
        (State.GOT_CHALLENGE, _S, Hello): State.AWAIT_WELCOME,
        (State.AWAIT_WELCOME, _R, Welcome): State.WELCOMED,
        (State.AWAIT_WELCOME, _R, Reject): State.CLOSED,
        (State.AWAIT_WELCOME, _R, ProbeResult): State.PROBED,
        (State.PROBED, _S, SpacesRequest): State.PROBE_SPACES,
        (State.PROBE_SPACES, _R, ProbeSpaces): State.WATCHING,
        (State.WATCHING, _S, MetricsRequest): State.METRICS_ASKED,
        (State.METRICS_ASKED, _R, ProbeMetrics): State.WATCHING,
        (State.WELCOMED, _S, Ready): State.IDLE,
        (State.WELCOMED, _S, ErrorReport): State.CLOSED,
        (State.IDLE, _R, Reject): State.CLOSED,
        (State.IDLE, _R, Weights): State.IDLE,
        (State.COLLECTING, _R, Weights): State.COLLECTING,
        (State.IDLE, _R, GroupWeights): State.IDLE,
        (State.COLLECTING, _R, GroupWeights): State.COLLECTING,
        (State.IDLE, _R, GradientRound): State.GRADIENTS,
        (State.GRADIENTS, _R, GradientRound): State.GRADIENTS,
        (State.GRADIENTS, _S, GradientReport): State.GRADIENTS,
        (State.GRADIENTS, _S, ErrorReport): State.GRADIENTS,
        (State.GRADIENTS, _R, StopGradients): State.STOPPING,
        (State.STOPPING, _S, GradientsStopped): State.IDLE,
        (State.GRADIENTS, _S, GradientProgress): State.GRADIENTS,
        (State.GRADIENTS, _R, CollectGradients): State.GRADIENTS,
        # The sampling loop may still be sending when the reader has taken StopGradients.
        (State.STOPPING, _S, GradientProgress): State.STOPPING,
        (State.STOPPING, _S, GradientReport): State.STOPPING,
        (State.GRADIENTS, _R, ReduceGradients): State.GRADIENTS,
        (State.GRADIENTS, _S, GradientsReduced): State.GRADIENTS,
        (State.STOPPING, _S, GradientsReduced): State.STOPPING,
    },
}
"""``(state, direction, message type) -> next state`` for each role; anything else is refused.

The rows of the numbered requests are not written here: each :class:`RequestKind` in
:data:`REQUESTS` adds its own (see :meth:`RequestKind.transitions`).

``COLLECTING`` also counts the requests outstanding of a pipelined kind (rollouts): each
request adds one, each answer (or error report) answers one, and the last answer returns the
connection to ``IDLE``.
"""


@dataclasses.dataclass(frozen=True, slots=True)
class RequestKind:
    """One kind of numbered request: the one row the protocol, delivery and the worker read.

    From it come the request's rows in :data:`TRANSITIONS`, what answers it
    (:data:`ANSWERS`, which :class:`aps.session.delivery.Outbox` checks every answer against), and
    how the worker's step server (:class:`aps.worker.steps.StepServer`) answers it. A mode
    adds its kind with :func:`register_request` from its own module.

    ``request`` must have the int fields ``seq`` and ``acked`` (defaulting to 0), and
    ``answer`` the int field ``seq``, as :class:`~aps.wire.messages.StepRequest` and
    :class:`~aps.wire.messages.StepResult` do; an :class:`~aps.wire.messages.ErrorReport`
    answers any request.
    """

    request: type[Message]
    answer: type[Message]
    serve: str | Callable[[Any, Any], Any]
    """How the worker answers: a function called as ``serve(server, request)`` with the
    worker's step server, returning the answer (or an awaitable of it); or, for the built-in
    kinds, the name of the step server's method that does. An exception it raises is sent to
    the learner as an :class:`~aps.wire.messages.ErrorReport` by the server for the built-in
    kinds; a mode's function returns ``ErrorReport.of(exc, request.seq)`` itself."""
    awaiting: State = State.AWAIT_ANSWER
    """The learner's state while the answer is owed."""
    serving: State = State.SERVING
    """The worker's state while it answers."""
    weights: bool = False
    """Whether the learner may send :class:`~aps.wire.messages.Weights` while the answer is owed:
    weights need no answer, so they may follow a reset or a step the worker has not answered
    (a replacement worker is reset while a new version is published)."""
    pipelined: bool = False
    """Whether the learner may have several outstanding (rollouts): both sides are then in
    the counted state ``COLLECTING`` (``awaiting`` and ``serving`` are not read), which
    :class:`~aps.wire.messages.Weights` may enter and leave as well."""

    def transitions(self, role: Role) -> dict[tuple[State, Direction, type[Message]], State]:
        """This kind's rows of ``role``'s table."""
        ask, get = (_S, _R) if role is Role.LEARNER else (_R, _S)
        request, answer = self.request, self.answer
        rows: dict[tuple[State, Direction, type[Message]], State]
        if self.pipelined:
            on = State.COLLECTING
            rows = {
                (State.IDLE, ask, request): on,
                (on, ask, request): on,
                (on, get, answer): on,
                (on, get, ErrorReport): on,
            }
            return rows
        on = self.awaiting if role is Role.LEARNER else self.serving
        rows = {
            (State.IDLE, ask, request): on,
            (on, get, answer): State.IDLE,
            (on, get, ErrorReport): State.IDLE,
        }
        if self.weights and role is Role.LEARNER:
            rows[on, _S, Weights] = on
            rows[on, _S, GroupWeights] = on
        return rows


REQUESTS: dict[type[Message], RequestKind] = {}
"""Every kind of numbered request by its request type: the built-in ones, then any a mode
registered (see :func:`register_request`)."""

ANSWERS: dict[type[Message], type[Message]] = {}
"""What answers each kind of request (an :class:`~aps.wire.messages.ErrorReport` answers any),
read from :data:`REQUESTS`."""

_COUNTED: set[type[Message]] = set()  # the pipelined requests: COLLECTING counts them


def register_request(kind: RequestKind) -> None:
    """Add ``kind`` to :data:`REQUESTS`: its rows, its answer, its worker's handler.

    Call it from the module of the mode that owns ``kind``, at import, on both sides (the
    learner's and the worker's processes import the mode's module). Its message types are
    registered with the codec (:func:`aps.wire.codec.register`). Registering the same row again
    changes nothing.

    Raises:
        ConfigError: another row holds ``kind.request``; its types lack the numbering
            fields, are no message types the codec can carry, or their tags are taken; or
            its transitions clash with the table's (a row there leads to another state).
    """
    held = REQUESTS.get(kind.request)
    if held == kind:
        return
    if held is not None:
        raise ConfigError(
            f"{kind.request.__qualname__} is a request kind already (answered by "
            f"{held.answer.__qualname__}, served by {held.serve!r}); register each request "
            "type once, with one row"
        )
    bare = [
        message.__qualname__
        for message, names in ((kind.request, ("seq", "acked")), (kind.answer, ("seq",)))
        if not set(getattr(message, "__dataclass_fields__", ())) >= set(names)
    ]
    if bare:
        raise ConfigError(
            f"{' and '.join(bare)} lack the numbering fields of a request kind: a request "
            "needs `seq: int = 0` and `acked: int = 0`, an answer `seq: int = 0`"
        )
    rows = {role: kind.transitions(role) for role in Role}
    for role, table in TRANSITIONS.items():
        # A row two kinds share (an ErrorReport's in a state both use) must lead to the
        # same state in both.
        taken = sorted(
            f"{state.value} {direction.value} {message.__name__}"
            for (state, direction, message), following in rows[role].items()
            if table.get((state, direction, message), following) is not following
        )
        if taken:
            raise ConfigError(
                f"{kind.request.__qualname__}'s rows for the {role.value} clash with rows "
                f"that lead elsewhere: {', '.join(taken)}; give the kind other states "
                "(awaiting=, serving=; the defaults suit one answer at a time)"
            )
    codec.register(kind.request)
    codec.register(kind.answer)
    for role, table in TRANSITIONS.items():
        table.update(rows[role])
    REQUESTS[kind.request] = kind
    ANSWERS[kind.request] = kind.answer
    if kind.pipelined:
        _COUNTED.add(kind.request)


# The built-in kinds, served by the step server's own methods. Here rather than beside each
# mode: the learner's modes and the worker's server both read them, and a learner's table
# must hold them whether or not the worker's package was imported.
for _kind in (
    RequestKind(
        ResetRequest,
        ResetResult,
        "_reset",
        awaiting=State.AWAIT_RESET,
        serving=State.RESETTING,
        weights=True,
    ),
    RequestKind(
        StepRequest,
        StepResult,
        "_step",
        awaiting=State.AWAIT_STEP,
        serving=State.STEPPING,
        weights=True,
    ),
    RequestKind(
        EnvCall, EnvCallResult, "_env_call", awaiting=State.AWAIT_CALL, serving=State.CALLING
    ),
    RequestKind(RolloutRequest, RolloutChunk, "_rollout", pipelined=True),
    RequestKind(JoinWeightGroup, WeightGroupJoined, "_join_weight_group"),
):
    register_request(_kind)
del _kind

_HANDSHAKING = frozenset(
    {
        State.START,
        State.SENT_CHALLENGE,
        State.GOT_HELLO,
        State.GOT_CHALLENGE,
        State.AWAIT_WELCOME,
        State.PROBED,  # a probe's conversation is short and ends: no heartbeats
        State.PROBE_SPACES,
        State.WATCHING,  # a live view asks and is answered: heartbeats would only add frames
        State.METRICS_ASKED,
    }
)
"""States in which heartbeats are not yet allowed: the peer has not proved who it is."""


class Connection:
    """The protocol state of one connection, seen from one side.

    Heartbeats are allowed in both directions once the handshake is done and change nothing;
    a Goodbye is allowed in any state and closes the connection.
    """

    def __init__(self, role: Role) -> None:
        self.role = role
        self.state = State.START
        self.rollouts_pending = 0
        """Rollout requests sent (learner) or received (worker) and not answered yet."""
        self._table = TRANSITIONS[role]

    def send(self, message: Message) -> None:
        """Record that this side sends ``message``.

        Raises:
            InvalidState: the protocol does not allow this side to send it now (a bug in the
                caller, never the peer's fault).
        """
        if not self._advance(message, Direction.SEND):
            raise InvalidState(
                f"the {self.role.value} cannot send {type(message).__name__} in state "
                f"{self.state.value!r}; this is a bug in aps or in a custom role"
            )

    def receive(self, message: Message) -> None:
        """Record that the peer sent ``message``.

        Raises:
            ProtocolError: the peer sent something the protocol does not allow now.
        """
        if not self._advance(message, Direction.RECEIVE):
            raise ProtocolError(
                f"peer sent {type(message).__name__} while the {self.role.value} was in state "
                f"{self.state.value!r}; the peer is not a compatible aps "
                f"{'worker' if self.role is Role.LEARNER else 'learner'}"
            )

    def _advance(self, message: Message, direction: Direction) -> bool:
        kind = type(message)
        if kind is Goodbye:
            self.state = State.CLOSED
            return True
        if kind is Heartbeat:
            return self.state not in _HANDSHAKING and self.state is not State.CLOSED
        following = self._table.get((self.state, direction, kind))
        if following is None:
            return False
        if following is State.COLLECTING:
            if kind in _COUNTED:
                self.rollouts_pending += 1
            elif kind is not Weights and kind is not GroupWeights:
                # A chunk or an error report answers one request.
                self.rollouts_pending -= 1
                if self.rollouts_pending == 0:
                    following = State.IDLE
        self.state = following
        return True


def prove(token: bytes, nonce: bytes) -> bytes:
    """Return HMAC-SHA256 of ``nonce`` under ``token``: the primitive both proofs use."""
    return hmac.new(token, nonce, hashlib.sha256).digest()


_WORKER_LABEL = b"aps worker proof\0"
_LEARNER_LABEL = b"aps learner proof\0"


def worker_proof(token: bytes, learner_nonce: bytes, worker_nonce: bytes) -> bytes:
    """The worker's proof of ``token`` for the handshake of these two nonces."""
    return prove(token, _WORKER_LABEL + learner_nonce + worker_nonce)


def learner_proof(token: bytes, learner_nonce: bytes, worker_nonce: bytes) -> bytes:
    """The learner's proof of ``token`` for the handshake of these two nonces.

    The labels differ, so neither side's proof can be reflected back as the other's.
    """
    return prove(token, _LEARNER_LABEL + learner_nonce + worker_nonce)


def check_hello(hello: Hello, *, nonce: bytes, token: bytes | None) -> None:
    """Check a worker's Hello against this learner's version and token.

    The order is part of the contract (``aps check`` relies on it): version, then token,
    and only then anything about the worker's envs, or an answer to a probe.

    Raises:
        VersionMismatch: the worker speaks another protocol version.
        AuthError: a token is required and the proof is missing or wrong.
    """
    if hello.protocol_version != PROTOCOL_VERSION:
        raise VersionMismatch(PROTOCOL_VERSION, hello.protocol_version)
    if token is None:
        return
    if not hello.proof:
        raise AuthError(
            "the learner requires a token and the worker sent no proof; "
            "start the worker with --token-file (or token=) holding the learner's token"
        )
    if len(hello.nonce) != NONCE_SIZE:
        raise AuthError(
            f"the worker's nonce has {len(hello.nonce)} bytes, not {NONCE_SIZE}; "
            "the worker is not a compatible aps worker"
        )
    # compare_digest takes time independent of where the bytes differ.
    if not hmac.compare_digest(hello.proof, worker_proof(token, nonce, hello.nonce)):
        raise AuthError(
            "the worker's token proof is wrong; give the worker the same token as the learner"
        )


def check_learner_proof(
    proof: bytes, *, token: bytes | None, learner_nonce: bytes, worker_nonce: bytes, peer: str
) -> None:
    """Check the learner's proof (from its Welcome or Reject) before acting on its word.

    Raises:
        AuthError: this worker has a token and the learner did not prove it knows it.
    """
    if token is None:
        return  # nothing to check against; a learner with a token refuses this worker
    if not proof:
        raise AuthError(
            f"the learner at {peer} did not prove it knows the token (it sent no proof): it "
            "runs without a token, or it is not the learner this worker was started for; "
            "give the learner the same token as the worker"
        )
    if not hmac.compare_digest(proof, learner_proof(token, learner_nonce, worker_nonce)):
        raise AuthError(
            f"the learner at {peer} answered with a wrong token proof: it holds another "
            "token, or it is not the learner this worker was started for"
        )
