"""``aps check URL``: dial a learner, prove the token, and leave without joining.

The check introduces itself with ``Hello(probe=True)``. A learner checks the protocol version
and the token proof first, exactly as for a worker; a wrong or missing proof gets the
refusal a worker would get, and nothing else. Once the proof checked out, the learner
answers a probe instead of admitting it: a :class:`~aps.wire.messages.ProbeResult` (its own
proof, its aps version, how many workers it expects and has, its autoreset mode and policy)
and, once the check asks with a :class:`~aps.wire.messages.SpacesRequest`, a
:class:`~aps.wire.messages.ProbeSpaces` with its observation and action spaces, if a worker has
joined. The probe never takes a worker's place and is not logged as a refusal.

The check is mutual, as a worker's handshake is: with a token, the result must carry the
learner's own proof over both nonces, so a check that passes also shows that what answered
at the URL holds the token. Only after that proof is checked does the check read a frame
larger than a handshake's: it raises its limit, then asks for the spaces, so no large frame
is on its way before the limit is raised.

``aps top URL`` opens the same conversation and stays: once it has the spaces it asks for
the learner's figures (:class:`~aps.wire.messages.MetricsRequest`) as often as it redraws, and
each answer (:class:`~aps.wire.messages.ProbeMetrics`) is :meth:`aps.metrics.Metrics.as_dict` of
the learner's snapshot then. :func:`watch_learner` is that connection; the learner paces and
bounds such views (see :mod:`aps.learner.admission`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import gymnasium as gym

from aps.errors import AuthError, ConfigError, ProtocolError, Timeout, VersionMismatch
from aps.session import Session
from aps.session.protocol import NONCE_SIZE, Role, check_learner_proof, worker_proof
from aps.transports import connect
from aps.transports.base import TransportFactory
from aps.wire.messages import (
    PROTOCOL_VERSION,
    Challenge,
    Hello,
    MetricsRequest,
    ProbeMetrics,
    ProbeResult,
    ProbeSpaces,
    Reject,
    SpacesRequest,
)

__all__ = ["CheckResult", "Watch", "check_learner", "watch_learner"]

T = TypeVar("T")

PROBE_LABEL = "aps check"
"""The label the check's Hello carries, for a learner's debug output."""


@dataclass(frozen=True)
class CheckResult:
    """What a check found, with its times in seconds.

    Attributes:
        url: the address dialed.
        protocol_version: the protocol the learner speaks (this aps speaks the same).
        connect_seconds: from dialing to an open connection (TLS included).
        round_trip_seconds: from the check's Hello to the learner's answer: one round trip
            plus the learner's check of the proof.
        aps_version: the learner's aps release.
        num_workers: the workers the learner was started for.
        workers: the workers connected to it now.
        spares: workers beyond ``num_workers`` waiting to replace a lost one.
        num_envs: the envs of its admitted workers, together.
        autoreset_mode: the autoreset mode its workers use.
        policy: the policy import path its workers act with (``None``: the learner chooses
            the actions).
        observation_space, action_space: the learner's single-env spaces; ``None`` until a
            worker has joined (a learner learns them from its first worker).
    """

    url: str
    protocol_version: int
    connect_seconds: float
    round_trip_seconds: float
    aps_version: str
    num_workers: int
    workers: int
    spares: int
    num_envs: int
    autoreset_mode: str
    policy: str | None
    observation_space: gym.Space[Any] | None
    action_space: gym.Space[Any] | None


async def check_learner(
    url: str,
    *,
    token: str | None,
    factory: TransportFactory | None = None,
    timeout: float = 10.0,
) -> CheckResult:
    """Dial the learner at ``url``, prove ``token``, ask about the learner and leave.

    Args:
        url: the learner's address, as a worker dials it.
        token: the learner's token (``None``: prove none, as a worker without one would).
        factory: dial with this factory (TLS, say) instead of the scheme's own.
        timeout: the longest the whole check may take, in seconds.

    Returns:
        What the learner said about itself, and the times measured.

    Raises:
        AuthError: the learner refused the token (or needs one and none was given), or did
            not prove it knows the token itself.
        VersionMismatch: the learner speaks another protocol version.
        ConnectError | Timeout: nothing answered at ``url`` within ``timeout``.
        ProtocolError: what answered is not an aps learner this aps can check.
        ConfigError: the learner is busy, or refused the check for another reason.
    """
    session, result = await _within(timeout, url, _open(url, token, factory))
    await session.aclose()
    return result


async def _within(timeout: float, url: str, opening: Awaitable[T]) -> T:
    """``opening``, bounded by ``timeout`` seconds: a :class:`Timeout` that says what to check."""
    try:
        async with asyncio.timeout(timeout):
            return await opening
    except TimeoutError as exc:
        if isinstance(exc, Timeout):
            raise
        raise Timeout(
            f"the learner at {url} did not finish the check within {timeout} s; is it an aps "
            "learner on the same transport (TLS or not)? Raise it with --timeout",
            operation="check",
            seconds=timeout,
        ) from None


async def _open(
    url: str, token: str | None, factory: TransportFactory | None
) -> tuple[Session, CheckResult]:
    """The check's conversation up to the spaces; returns the session, still open, with it.

    The caller closes the session (a check at once; a live view once it is done watching).
    """
    started = time.perf_counter()
    transport = await (connect(url) if factory is None else factory.connect(url))
    connected = time.perf_counter()
    session = Session(transport, Role.WORKER)
    try:
        challenge = await session.receive(timeout=None, operation="the learner's challenge")
        if isinstance(challenge, Reject):
            raise ConfigError(
                f"the learner at {url} is busy ({challenge.reason}); check again in "
                f"{challenge.retry_after} s"
            )
        assert isinstance(challenge, Challenge)  # the protocol table allows nothing else
        if challenge.protocol_version != PROTOCOL_VERSION:
            raise VersionMismatch(PROTOCOL_VERSION, challenge.protocol_version)
        sent = time.perf_counter()
        nonce = os.urandom(NONCE_SIZE)
        secret = None if token is None else token.encode()
        await session.send(
            Hello(
                protocol_version=PROTOCOL_VERSION,
                nonce=nonce,
                proof=b"" if secret is None else worker_proof(secret, challenge.nonce, nonce),
                env_id="",
                num_envs=0,
                seed=None,
                host=socket.gethostname(),
                pid=os.getpid(),
                label=PROBE_LABEL,
                probe=True,
            )
        )
        answer = await session.receive(timeout=None, operation="the learner's answer")
        answered = time.perf_counter()
        if isinstance(answer, Reject):
            if answer.kind == "AuthError":
                raise AuthError(f"the learner refused the token: {answer.reason}")
            if answer.kind == "VersionMismatch":
                raise ProtocolError(f"the learner refused the protocol version: {answer.reason}")
            raise ConfigError(f"the learner refused the check: {answer.kind}: {answer.reason}")
        if not isinstance(answer, ProbeResult):
            raise ProtocolError(
                f"the learner at {url} answered the check with {type(answer).__name__}; it "
                "is not a learner this aps version can check"
            )
        check_learner_proof(
            answer.proof, token=secret, learner_nonce=challenge.nonce, worker_nonce=nonce, peer=url
        )
        # The learner proved the token (or neither side has one): its spaces may come in a
        # frame of any allowed size, once this side reads such frames.
        session.authenticated()
        await session.send(SpacesRequest())
        spaces = await session.receive(timeout=None, operation="the learner's spaces")
        assert isinstance(spaces, ProbeSpaces)  # the protocol table allows nothing else
    except BaseException:
        await session.aclose()
        raise
    return session, CheckResult(
        url=url,
        protocol_version=challenge.protocol_version,
        connect_seconds=connected - started,
        round_trip_seconds=answered - sent,
        aps_version=answer.aps_version,
        num_workers=answer.num_workers,
        workers=answer.workers,
        spares=answer.spares,
        num_envs=answer.num_envs,
        autoreset_mode=answer.autoreset_mode,
        policy=answer.policy,
        observation_space=spaces.observation_space,
        action_space=spaces.action_space,
    )


class Watch:
    """A live view's open connection to a learner (``aps top``): its figures, when asked.

    Made by :func:`watch_learner`, which closes it. One request at a time: the protocol
    allows a view one outstanding request, and the learner answers at most
    ``aps.learner.admission.WATCH_RATE`` of them a second (a faster view is paced).

    Attributes:
        result: what the learner said when the view opened (as :func:`check_learner`
            returns it): its expected workers and spaces, its versions, the round trip.
    """

    def __init__(self, session: Session, result: CheckResult, timeout: float) -> None:
        self._session = session
        self._timeout = timeout
        self.result = result

    async def figures(self) -> dict[str, Any]:
        """Ask for the learner's figures now.

        Returns:
            :meth:`aps.metrics.Metrics.as_dict` of the learner's snapshot, with
            ``workers_connected``: its workers connected now.

        Raises:
            Timeout: no answer within the view's ``timeout`` of the request.
            EndOfStream: the learner ended the view (closing, or already serving as many
                views as it allows: its goodbye says which).
            ProtocolError: the answer is not a learner's figures.
        """
        session = self._session
        await session.send(MetricsRequest())
        answer = await session.receive(
            timeout=self._timeout,
            operation="the learner's figures",
            since=asyncio.get_running_loop().time(),
        )
        assert isinstance(answer, ProbeMetrics)  # the protocol table allows nothing else
        if not isinstance(answer.metrics, dict):
            raise ProtocolError(
                f"the learner at {self.result.url} sent figures of type "
                f"{type(answer.metrics).__name__}, expected a mapping (Metrics.as_dict())"
            )
        return answer.metrics


@contextlib.asynccontextmanager
async def watch_learner(
    url: str,
    *,
    token: str | None,
    factory: TransportFactory | None = None,
    timeout: float = 10.0,
) -> AsyncIterator[Watch]:
    """Open a live view of the learner at ``url``: the check's conversation, kept open.

    The view proves ``token`` and checks the learner's proof exactly as
    :func:`check_learner` does, and reads frames larger than a handshake's only after that;
    then it stays, and :meth:`Watch.figures` asks for the figures. Leaving the block says
    goodbye.

    Args:
        url: the learner's address, as a worker dials it.
        token: the learner's token (``None``: prove none).
        factory: dial with this factory (TLS, say) instead of the scheme's own.
        timeout: the longest the opening may take, and then each answer, in seconds.

    Raises:
        The errors of :func:`check_learner`, on opening.
    """
    session, result = await _within(timeout, url, _open(url, token, factory))
    try:
        yield Watch(session, result, timeout)
    finally:
        await session.aclose()
