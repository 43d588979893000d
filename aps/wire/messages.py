"""Every message aps sends, as frozen dataclasses.

One message is one frame. :mod:`aps.wire.codec` turns them into bytes and back. Field values are
plain data: ``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes``, numpy arrays, Gymnasium
spaces (sent declaratively, see :mod:`aps.wire.spaces`) and tuples/dicts of these (``Any`` fields).

The conversation (``L`` learner, ``W`` worker)::

    L -> W  Challenge(protocol_version, nonce)
    W -> L  Hello(protocol_version, nonce, proof, env_id, num_envs, seed, host, pid, label,
                  resume, served, version, probe, compression)
    L -> W  Welcome(worker_id, autoreset_mode, policy, session_id, resumed, policy_kwargs,
                    proof, resume_window, compression)
            or  Reject(kind, reason, retry_after, proof)
            or  ProbeResult(proof, aps_version, ...), to a Hello(probe=True); then
    W -> L  SpacesRequest()               L -> W  ProbeSpaces(observation_space, action_space)
    W -> L  Ready(observation_space, action_space, num_envs)
    L -> W  ResetRequest(seed, options)   W -> L  ResetResult(obs, info)
    L -> W  StepRequest(actions)          W -> L  StepResult(obs, reward, ..., info)
    L -> W  Weights(version, arrays)      no answer; applied before the next rollout
    L -> W  JoinWeightGroup(host, ...)    W -> L  WeightGroupJoined()
    L -> W  GroupWeights(version, nbytes, sha256)  no answer; the frame follows by the group
    L -> W  RolloutRequest(num_steps)     W -> L  RolloutChunk(version, obs, actions, ...)
    L -> W  GradientRound(round, arrays)  W -> L  GradientProgress(round, count), ...
    L -> W  CollectGradients(round)       W -> L  GradientReport(round, gradient, count)
    L -> W  ReduceGradients(round, ...)   W -> L  GradientsReduced(round, count, ...)
    L -> W  EnvCall(kind, name, ...)      W -> L  EnvCallResult(values)
    L -> W  StopGradients()               W -> L  GradientsStopped()
    W -> L  ErrorReport(...)              instead of a result, when an env raised

Both sides prove the token over both nonces (see :mod:`aps.session.protocol`): the worker in its
Hello, the learner in its Welcome (or Reject), which the worker checks before it acts on
anything the learner said. A learner too busy to start a handshake answers a new connection
with ``Reject(retry_after > 0)`` instead of a Challenge.

Resets, steps and env calls are lockstep: one request, one answer. Rollout requests may be
pipelined: the learner may have several outstanding, and the worker answers them in order.

Requests (reset, step, rollout, env call) are numbered per worker session: ``seq`` counts from 0 and
every answer (result, chunk or error report) carries the ``seq`` it answers. ``acked`` tells
the worker how many answers the learner has received, so it may forget them. A worker whose
connection drops dials again and sends ``Hello(resume=session_id, served=n)``; the learner
sends every unanswered request again, and the worker answers those it already served from
its cache of unacknowledged answers, so no request runs twice and no answer is lost. Gradient
rounds are a mode: after each ``GradientRound`` the worker samples trajectories, sums their
gradients locally and reports only its count, until ``CollectGradients`` asks for the sum
(sent once); each new round replaces the last, until ``StopGradients``.
    either  Heartbeat()                   at any time after the handshake
    either  Goodbye(reason)               the sender is closing
"""

from __future__ import annotations

import struct
import traceback
from dataclasses import dataclass, field
from typing import Any, ClassVar

import gymnasium as gym

from aps._base._typing import Array, ArrayTree
from aps.errors import ConfigError

__all__ = [
    "ENV_CALL_KINDS",
    "MESSAGE_TYPES",
    "OMIT_NONE",
    "Answer",
    "Request",
    "PROTOCOL_VERSION",
    "Challenge",
    "EnvCall",
    "EnvCallResult",
    "ErrorReport",
    "Goodbye",
    "GradientReport",
    "GradientRound",
    "GradientsStopped",
    "GroupWeights",
    "JoinWeightGroup",
    "GradientProgress",
    "CollectGradients",
    "ReduceGradients",
    "GradientsReduced",
    "Heartbeat",
    "Hello",
    "Message",
    "MetricsRequest",
    "ProbeMetrics",
    "ProbeResult",
    "ProbeSpaces",
    "Ready",
    "Reject",
    "ResetRequest",
    "ResetResult",
    "SpacesRequest",
    "RolloutChunk",
    "RolloutRequest",
    "StepRequest",
    "StepResult",
    "StopGradients",
    "TIMINGS",
    "TIMINGS_FORMAT",
    "Weights",
    "WeightGroupJoined",
    "Welcome",
    "register_message",
]

PROTOCOL_VERSION = 10
"""Bumped on every incompatible change of the wire format; the handshake checks it.

Version 5 added ``Hello.probe`` and the probe's conversation (:class:`ProbeResult`,
:class:`SpacesRequest`, :class:`ProbeSpaces`). The codec refuses a message whose fields
differ from its own, so a version 4 peer could not even decode a version 5 Hello (nor the
reverse): the bump makes the mismatch a :class:`~aps.errors.VersionMismatch` named at the
Challenge instead of a malformed frame, and ``aps check`` stops at an older learner's
Challenge before it could be taken for a worker.

Version 6 added the all-reduce aggregation of gradient rounds (:class:`ReduceGradients`,
:class:`GradientsReduced`), which a version 5 worker could not decode.

Version 7 added compression negotiated in the handshake (``Hello.compression``,
``Welcome.compression``) and the compressed array extension of :mod:`aps.wire.compression`, and
carries spaces, env specs and numpy Generators in :class:`EnvCallResult` as tagged maps
(:func:`aps.wire.spaces.value_to_wire`), which a version 6 learner would hand on unread.

Version 8 made decoding stricter where a version 7 peer could send what is now refused: a
space description's arrays travel uncompressed (a version 7 worker compressed large Box
bounds in its Ready), a map's tag comes first and no key twice, and a ``Ready`` whose
``num_envs`` could never fit a frame is refused; it also added the optional chunk fields
``initial_state``, ``episode_start`` (recurrent policies) and ``agent_active`` (multi-agent
envs). The bump names the mismatch at the Challenge rather than as a refused Ready.

Version 9 added the worker's own timings to its answers (``timings`` on
:class:`ResetResult`, :class:`StepResult` and :class:`RolloutChunk`), the heartbeat's round
trip (``Heartbeat.ping`` and ``pong``), and the live view's request for the learner's figures
(:class:`MetricsRequest`, :class:`ProbeMetrics`), which a version 8 peer would refuse.

Version 10 added the weight group (:class:`JoinWeightGroup`, :class:`WeightGroupJoined`,
:class:`GroupWeights`, and a :class:`Weights` whose ``arrays`` is ``None``), which a version 9
worker could not decode."""


TIMINGS = ("env_seconds", "inference_seconds", "encode_seconds")
"""What a worker's answers (:class:`ResetResult`, :class:`StepResult`, :class:`RolloutChunk`)
carry in their ``timings`` field, in this order: its envs' time for this answer, its policy's
(DETACH's forward passes; 0 in lockstep), and its own work on the answers (encoding,
compression included, of the previous answer; for a chunk, packing it as well), in seconds,
as :data:`TIMINGS_FORMAT` packs them. 22 bytes per answer, never a message of their own; the
learner adds them to the worker's :class:`aps.metrics.WorkerMetrics` after checking each is
a finite number in range. One field of bytes that every answer holds, rather than three
optional numbers: the codec writes and reads it as fast as any plain field."""

TIMINGS_FORMAT = struct.Struct("<3f")
"""How ``timings`` are packed: three little-endian float32, 12 bytes."""


OMIT_NONE = "aps.omit_none"
"""Field metadata key of an optional field that frames not using it leave out.

A field declared ``field(default=None, metadata={OMIT_NONE: True})`` is left out of the frame
while it is ``None`` and read as ``None`` when a frame lacks it, so frames that do not use it
are byte for byte those of a message type without the field (a feed-forward policy's chunks
are unchanged by the recurrent fields). New fields still come with a protocol bump (version
8 added these): a peer that does not know a field refuses a frame that holds it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    """Base of all messages; ``TAG`` is the short name that identifies the type on the wire.

    ``FRAME_DELTA`` names the one field whose frame stacks may travel as their newest frames
    on a connection that negotiated frame delta (see :mod:`aps.wire.frame_delta`): the array it
    holds, or each array of a dict or tuple of arrays it holds. ``None``: no field may; the
    codec refuses a frame-delta array anywhere in such a message.
    """

    TAG: ClassVar[str] = ""
    FRAME_DELTA: ClassVar[str | None] = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Challenge(Message):
    """The learner's first frame: its protocol version and a random nonce to prove against."""

    TAG: ClassVar[str] = "challenge"
    protocol_version: int
    nonce: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello(Message):
    """The worker's answer: who it is, what it hosts, its own nonce and its token proof.

    ``proof`` is :func:`aps.session.protocol.worker_proof` over the challenge's nonce and ``nonce``
    (empty without a token).

    ``label`` is free text from whoever started the worker (a launcher's worker index, a host
    role), shown in :class:`~aps.learner.WorkerInfo`.
    """

    TAG: ClassVar[str] = "hello"
    protocol_version: int
    proof: bytes
    env_id: str
    num_envs: int
    seed: int | None
    host: str
    pid: int
    label: str
    resume: bytes = b""
    """The session id of the session this worker resumes (empty: a new worker)."""
    served: int = 0
    """Requests of the resumed session the worker has answered (sent or not)."""
    version: int = -1
    """The policy version the worker holds (-1: none)."""
    nonce: bytes = b""
    """The worker's random nonce, which the learner's proof covers too."""
    probe: bool = False
    """Not a worker: ``aps check`` asking about the learner. Once its proof is checked the
    learner answers with a :class:`ProbeResult` (and its spaces when asked) and closes; the
    probe takes no worker's place."""
    compression: str = ""
    """The codecs this worker can compress arrays with, comma-separated in its order of
    preference (``"zstd,lz4"``; empty: none), then ``frame-delta`` if it can send its chunks'
    frame stacks as newest frames; see :mod:`aps.wire.compression` and
    :mod:`aps.wire.frame_delta`."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Welcome(Message):
    """The learner accepts the worker.

    It names the worker's id, the autoreset mode its vector env must use, and the import path
    of the policy it acts with (``None``: the learner chooses the actions).
    """

    TAG: ClassVar[str] = "welcome"
    worker_id: int
    autoreset_mode: str
    policy: str | None
    session_id: bytes = b""
    """The id the worker resumes this session with after its connection drops."""
    resumed: bool = False
    """The learner took the worker back into its old session (envs and state kept)."""
    policy_kwargs: Any = None
    """Keyword arguments for the policy factory (plain data; ``None``: none). Like the rest of
    the Welcome it must fit in a handshake frame (``aps.wire.codec.HANDSHAKE_FRAME_SIZE``)."""
    proof: bytes = b""
    """:func:`aps.session.protocol.learner_proof` over both nonces (empty without a token)."""
    resume_window: float = 0.0
    """Seconds the learner keeps a lost worker's session for it to resume (0: unknown);
    a worker whose connection drops dials again for no longer than this."""
    compression: str = "none"
    """The codec both directions compress large arrays with from the next frame on: one the
    worker's Hello offered, or ``"none"``; see :mod:`aps.wire.compression`. ``",frame-delta"``
    after it (only if the Hello offered it): chunks' frame stacks travel as newest frames
    (:mod:`aps.wire.frame_delta`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Reject(Message):
    """The learner refuses the worker; ``kind`` names the error class the worker raises."""

    TAG: ClassVar[str] = "reject"
    kind: str
    reason: str
    retry_after: float = 0.0
    """Above 0: the learner is busy, not refusing this worker; dial again after that many
    seconds (a Reject sent instead of a Challenge)."""
    proof: bytes = b""
    """:func:`aps.session.protocol.learner_proof` when the worker's proof was checked and right."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Ready(Message):
    """The worker built its envs: their single-env spaces and count."""

    TAG: ClassVar[str] = "ready"
    observation_space: gym.Space[Any]
    action_space: gym.Space[Any]
    num_envs: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ResetRequest(Message):
    """Reset every env of the worker.

    With an int ``seed`` the worker's env ``j`` gets ``seed + j``; with ``None`` the worker
    uses its own seed (from its Hello) on its first reset and no seed afterwards. ``seeds``
    (a tuple of ints or ``None``, one per env of the worker, with ``seed`` ``None``) seeds
    each env on its own, as a Gymnasium vector env's ``reset(seed=[...])`` does.
    """

    TAG: ClassVar[str] = "reset"
    seed: int | None
    options: Any
    seq: int = 0
    acked: int = 0
    seeds: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ResetResult(Message):
    """Batched observations and the merged info dict of the worker's envs."""

    TAG: ClassVar[str] = "reset_result"
    obs: Any
    info: Any
    seq: int = 0
    timings: bytes | None = None
    """The worker's own timings for this answer: see :data:`TIMINGS` (``None``: none)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StepRequest(Message):
    """One batched action for the worker's envs."""

    TAG: ClassVar[str] = "step"
    actions: Any
    seq: int = 0
    acked: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class StepResult(Message):
    """The worker's envs after one step, batched exactly as a Gymnasium vector env returns."""

    TAG: ClassVar[str] = "step_result"
    obs: Any
    reward: Array
    terminated: Array
    truncated: Array
    info: Any
    seq: int = 0
    timings: bytes | None = None
    """The worker's own timings for this answer: see :data:`TIMINGS` (``None``: none)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Weights(Message):
    """A new policy version: parameter arrays by name (a torch state dict's names).

    ``epsilon`` is the exploration rate of epsilon-greedy Q-policies (``None``: unchanged).
    ``arrays`` ``None`` (with ``epsilon`` ``None``): the version came by the worker's weight
    group (:class:`GroupWeights`), and the worker takes it from there.
    """

    TAG: ClassVar[str] = "weights"
    version: int
    arrays: Any
    epsilon: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class JoinWeightGroup(Message):
    """Join the learner's weight group: a gloo group that fans versions out (see :mod:`aps.fanout`).

    The worker joins through the learner's store at ``host:port`` (``host`` empty: the host it
    reached the learner at) under the key ``prefix``, as ``rank`` of ``world_size`` (the learner
    is rank 0), within ``timeout`` seconds, and answers :class:`WeightGroupJoined` (or an
    :class:`ErrorReport`) once the whole group has formed. From then on each
    :class:`GroupWeights` is one collective the worker takes part in.
    """

    TAG: ClassVar[str] = "weight_group_join"
    host: str
    port: int
    prefix: str
    rank: int
    world_size: int
    timeout: float
    seq: int = 0
    acked: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightGroupJoined(Message):
    """The worker is a member of the weight group a :class:`JoinWeightGroup` named."""

    TAG: ClassVar[str] = "weight_group_joined"
    seq: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupWeights(Message):
    """Version ``version`` goes out by the weight group now: ``nbytes`` of its encoded frame.

    No answer. The worker takes part in the group's next collective, which carries the
    :class:`Weights` frame of ``version`` (uncompressed), checks it against ``sha256`` (its
    SHA-256 digest: the members pass the pieces among themselves, so one of them could alter
    what the others receive, and the session, which only the learner writes, says what it
    must be), and keeps it until a ``Weights(version, arrays=None)`` tells it to act with it.
    """

    TAG: ClassVar[str] = "group_weights"
    version: int
    nbytes: int
    sha256: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutRequest(Message):
    """Act ``num_steps`` times on every env with the local policy and send one chunk."""

    TAG: ClassVar[str] = "rollout"
    num_steps: int
    seq: int = 0
    acked: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutChunk(Message):
    """``T = num_steps`` steps of the worker's ``E`` envs, acted with policy ``version``.

    Arrays lead with ``[T, E]``: ``obs`` (the observation each action was chosen on),
    ``actions``, ``logprob`` (behaviour log-probabilities), ``value`` (the worker's critic, or
    ``None``), ``reward``, ``terminated``, ``truncated``. ``next_obs`` ``[E, ...]`` is the
    observation after the last step, for bootstrapping. ``episode_return``,
    ``episode_length`` and ``episode_env`` describe the episodes that ended in the chunk.
    ``truncated_obs`` ``[K, ...]`` holds the last observation of each of the ``K`` truncated
    steps, at ``truncated_index`` ``[K, 2]`` (step, env), for bootstrapping.

    For a ``Dict`` or ``Tuple`` observation space (nested), ``obs``, ``next_obs`` and
    ``truncated_obs`` hold the space's structure, a dict (the space's key order) or tuple
    of arrays, each array with the leading axes above.
    """

    TAG: ClassVar[str] = "chunk"
    FRAME_DELTA: ClassVar[str | None] = "obs"
    version: int
    obs: ArrayTree
    actions: Array
    logprob: Array
    value: Array | None
    reward: Array
    terminated: Array
    truncated: Array
    next_obs: ArrayTree
    episode_return: Array
    episode_length: Array
    episode_env: Array
    truncated_obs: ArrayTree
    truncated_index: Array
    seq: int = 0
    initial_state: Any = field(default=None, metadata={OMIT_NONE: True})
    """A recurrent policy's state before the chunk's first step: a list of float arrays with
    the env axis at axis 1 (``[layers, E, hidden]``; an LSTM's ``h`` and ``c``), as the worker
    held it after zeroing the envs whose episode starts at that step. ``None`` (and absent
    from the frame) for a feed-forward policy."""
    episode_start: Array | None = field(default=None, metadata={OMIT_NONE: True})
    """``[T, E]`` bools of a recurrent policy's chunk: true where that step's observation is
    the first of an episode, so the state was zeroed before acting on it (the ``done`` the
    policy's ``get_states`` was given). ``None`` (and absent) for a feed-forward policy."""
    agent_active: Array | None = field(default=None, metadata={OMIT_NONE: True})
    """``[T, E]`` bools of a multi-agent env (:mod:`aps.multiagent`): true where the slot's
    observation was a live agent's, so its action was used and its reward, ``terminated`` and
    ``truncated`` are that agent's; false where the slot held no agent (reward 0, no flags,
    the action ignored). ``None`` (and absent) for any other env."""
    timings: bytes | None = None
    """The worker's own timings for this answer: see :data:`TIMINGS` (``None``: none)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GradientRound(Message):
    """Start (or replace) a policy-gradient round at the point ``arrays``.

    The worker drops unfinished trajectories, loads ``arrays`` (parameters by name), resets
    its envs, and from then on samples trajectories of at most ``horizon`` steps with that
    policy and reports REINFORCE gradients computed at the same point (discount ``gamma``).
    """

    TAG: ClassVar[str] = "gradient_round"
    round: int
    arrays: Any
    horizon: int
    gamma: float


@dataclass(frozen=True, slots=True, kw_only=True)
class GradientReport(Message):
    """The sum of ``count`` trajectory gradients (by parameter name) sampled in ``round``.

    ``episode_return`` holds those trajectories' undiscounted returns.
    """

    TAG: ClassVar[str] = "gradient_report"
    round: int
    gradient: Any
    count: int
    episode_return: Array


@dataclass(frozen=True, slots=True, kw_only=True)
class StopGradients(Message):
    """Leave gradient mode; the worker answers with :class:`GradientsStopped`."""

    TAG: ClassVar[str] = "stop_gradients"


@dataclass(frozen=True, slots=True, kw_only=True)
class GradientsStopped(Message):
    """The worker left gradient mode; nothing more of it will follow."""

    TAG: ClassVar[str] = "gradients_stopped"


@dataclass(frozen=True, slots=True, kw_only=True)
class GradientProgress(Message):
    """The worker holds ``count`` trajectory gradients of ``round``, summed, not sent yet.

    Sent whenever the count grows, so that the learner can apply its aggregation rule
    without moving gradients: a few bytes per message.
    """

    TAG: ClassVar[str] = "gradient_progress"
    round: int
    count: int


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectGradients(Message):
    """End ``round`` on the worker: it sends its sum once, as a :class:`GradientReport`.

    The report holds every gradient the worker summed in the round (``count`` may be 0, with
    an empty ``gradient``); then the worker samples nothing until the next round.
    """

    TAG: ClassVar[str] = "gradient_collect"
    round: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ReduceGradients(Message):
    """End ``round`` on the worker by one all-reduce over the sums instead of a report.

    The worker joins a gloo group through the learner's store at ``host:port`` (``host``
    empty: the host it reached the learner at) under the key ``prefix``, as ``rank`` of
    ``world_size`` (the learner is rank 0), and all-reduces (sums) one float32 vector of
    ``size + world_size - 1`` entries: its sum flattened in the order of the round's arrays
    (divided by its count when ``mean``), then its count in slot ``size + rank - 1``, zeros
    elsewhere. ``timeout`` is the seconds the group may take. It then answers
    :class:`GradientsReduced` (or :class:`ErrorReport`).
    """

    TAG: ClassVar[str] = "gradient_reduce"
    round: int
    host: str
    port: int
    prefix: str
    rank: int
    world_size: int
    size: int
    mean: bool
    timeout: float


@dataclass(frozen=True, slots=True, kw_only=True)
class GradientsReduced(Message):
    """The worker's part of ``round``'s all-reduce is done: ``count`` gradients went in.

    ``episode_return`` holds those trajectories' undiscounted returns.
    """

    TAG: ClassVar[str] = "gradients_reduced"
    round: int
    count: int
    episode_return: Array


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorReport(Message):
    """An env (or the worker) raised instead of answering a request.

    ``seq`` is the request it answers; ``None`` outside requests (the handshake, gradient mode).
    """

    TAG: ClassVar[str] = "error"
    remote_type: str
    message: str
    traceback: str
    seq: int | None = None

    @classmethod
    def of(cls, exc: BaseException, seq: int | None = None) -> ErrorReport:
        """The report of ``exc``: its qualified type name, message and formatted traceback."""
        return cls(
            remote_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
            message=str(exc),
            traceback="".join(traceback.format_exception(exc)),
            seq=seq,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat(Message):
    """Proof of life, and the round trip's measure.

    A heartbeat with a ``ping`` is answered at once with one whose ``pong`` is that number,
    so the side that pinged measures the round trip (the learner pings; see
    :attr:`aps.metrics.WorkerMetrics.rtt`). Both are absent from a plain heartbeat's frame.
    """

    TAG: ClassVar[str] = "heartbeat"
    ping: int | None = field(default=None, metadata={OMIT_NONE: True})
    pong: int | None = field(default=None, metadata={OMIT_NONE: True})


@dataclass(frozen=True, slots=True, kw_only=True)
class Goodbye(Message):
    """The sender is closing the session on purpose."""

    TAG: ClassVar[str] = "goodbye"
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class EnvCall(Message):
    """Reach each of the worker's envs by name, as Gymnasium's ``VectorEnv`` methods do.

    ``kind`` is one of :data:`ENV_CALL_KINDS`: ``"call"`` calls ``name(*args, **kwargs)`` on
    each env (an attribute that is not callable is returned as it is), ``"get_attr"`` reads
    attribute ``name``, ``"set_attr"`` sets it to ``args[0][k]`` on the ``k``-th env reached,
    ``"render"`` renders each env, and ``"is_wrapped"`` says whether a wrapper whose class
    (or a base class) is named ``name`` (``"module.QualName"``) wraps the env. ``indices``
    (the worker's own env indices, in the order the values are wanted) reaches some envs
    only; ``None`` reaches all. The answer is an :class:`EnvCallResult` holding one value per
    env reached, or an :class:`ErrorReport` when an env raised or a value is not plain data.
    """

    TAG: ClassVar[str] = "env_call"
    kind: str
    name: str
    args: Any = ()
    kwargs: Any = None
    seq: int = 0
    acked: int = 0
    indices: Any = None


ENV_CALL_KINDS = frozenset({"call", "get_attr", "set_attr", "render", "is_wrapped"})
"""The kinds of :class:`EnvCall`."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EnvCallResult(Message):
    """What an :class:`EnvCall` returned on each of the worker's envs: a tuple, one per env."""

    TAG: ClassVar[str] = "env_call_result"
    values: Any
    seq: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeResult(Message):
    """The learner's answer to a ``Hello(probe=True)`` whose token proof it checked.

    It is sent only to a peer that proved the token (a wrong proof gets the usual
    :class:`Reject`), and is handshake-sized. The spaces may be large: the probe asks for
    them with a :class:`SpacesRequest` once it has checked ``proof`` and reads frames of any
    size, and they come in a :class:`ProbeSpaces`.
    """

    TAG: ClassVar[str] = "probe_result"
    proof: bytes
    """:func:`aps.session.protocol.learner_proof` over both nonces (empty without a token)."""
    aps_version: str
    """The learner's aps release."""
    num_workers: int
    """The workers the learner was started for."""
    workers: int
    """The workers connected now, serving env slots."""
    spares: int
    """Workers admitted beyond ``num_workers``, waiting to replace a lost one."""
    num_envs: int
    """Envs of the admitted workers, together."""
    autoreset_mode: str
    """The autoreset mode the learner's workers use."""
    policy: str | None
    """The policy import path workers act with (``None``: the learner chooses the actions)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SpacesRequest(Message):
    """The probe checked the learner's proof and reads large frames now: send the spaces.

    A learner sends nothing large to a peer before it says so (the peer's frame limit is a
    handshake's until then), as it waits for a worker's Ready before its first request.
    """

    TAG: ClassVar[str] = "spaces_request"


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeSpaces(Message):
    """The learner's single-env spaces, the answer to a :class:`SpacesRequest`.

    ``None`` until known: a learner learns its spaces from the first worker that joins.
    """

    TAG: ClassVar[str] = "probe_spaces"
    observation_space: gym.Space[Any] | None
    action_space: gym.Space[Any] | None


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricsRequest(Message):
    """A probe that proved the token asks for the learner's figures (``aps top``).

    Sent after the probe's :class:`SpacesRequest` was answered, as often as the probe wants a
    fresh view; each is answered with a :class:`ProbeMetrics`. Read-only: the learner changes
    nothing for it.
    """

    TAG: ClassVar[str] = "metrics_request"


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeMetrics(Message):
    """The learner's figures now, the answer to a :class:`MetricsRequest`.

    ``metrics`` is :meth:`aps.metrics.Metrics.as_dict` of the learner's snapshot: plain data.
    """

    TAG: ClassVar[str] = "probe_metrics"
    metrics: Any


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TAG: cls
    for cls in (
        Challenge,
        Hello,
        Welcome,
        Reject,
        Ready,
        ResetRequest,
        ResetResult,
        StepRequest,
        StepResult,
        Weights,
        JoinWeightGroup,
        WeightGroupJoined,
        GroupWeights,
        RolloutRequest,
        RolloutChunk,
        GradientRound,
        GradientReport,
        StopGradients,
        GradientsStopped,
        GradientProgress,
        CollectGradients,
        ReduceGradients,
        GradientsReduced,
        ErrorReport,
        Heartbeat,
        Goodbye,
        EnvCall,
        EnvCallResult,
        ProbeResult,
        SpacesRequest,
        ProbeSpaces,
        MetricsRequest,
        ProbeMetrics,
    )
}
"""Every message type by its wire tag: the built-in ones, then any a mode registered (see
:func:`register_message`)."""


def register_message(cls: type[Message]) -> None:
    """Add ``cls``, a message type of a mode's own, to :data:`MESSAGE_TYPES`.

    Registering the same class again changes nothing. A mode calls
    :func:`aps.session.protocol.register_request`, which registers its types here and with the
    codec.

    Raises:
        ConfigError: ``cls`` is not a frozen, slotted, keyword-only dataclass subclass of
            :class:`Message` with a ``TAG`` of its own, or another type holds its tag.
    """
    params = getattr(cls, "__dataclass_params__", None)
    if not (
        isinstance(cls, type)
        and issubclass(cls, Message)
        and params is not None
        and params.frozen
        and "__slots__" in cls.__dict__
        and cls.TAG
        and cls.TAG != Message.TAG
    ):
        raise ConfigError(
            f"{cls!r} cannot be a message type: declare it "
            "@dataclass(frozen=True, slots=True, kw_only=True) as a subclass of "
            "aps.wire.messages.Message with a TAG of its own"
        )
    held = MESSAGE_TYPES.get(cls.TAG)
    if held is not None and held is not cls:
        raise ConfigError(
            f"the tag {cls.TAG!r} of {cls.__qualname__} is taken by {held.__module__}."
            f"{held.__qualname__}; give {cls.__qualname__} another TAG"
        )
    MESSAGE_TYPES[cls.TAG] = cls


Request = ResetRequest | StepRequest | RolloutRequest | EnvCall | JoinWeightGroup
"""The numbered messages a worker answers (see ``seq``)."""

Answer = ResetResult | StepResult | RolloutChunk | EnvCallResult | WeightGroupJoined | ErrorReport
"""What answers a :data:`Request`."""
