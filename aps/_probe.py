"""``aps check URL``: dial a learner, prove the token, and leave without joining.

The handshake has no probe of its own, so the check sends the learner a worker's ``Hello``
that offers no envs (``num_envs=0``). A learner checks the protocol version and the token
proof before anything else, then refuses a worker without envs, before it takes a slot: the
answer says whether the token was accepted, and the check never counts as a worker. The
learner logs it as a refused worker (``num_envs must be >= 1, got 0``).

The check is mutual, as a worker's handshake is: with a token, the learner's refusal must
carry the learner's own proof over both nonces, so a check that passes also shows that what
answered at the URL holds the token.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from dataclasses import dataclass

from aps.errors import AuthError, ConfigError, ProtocolError, Timeout, VersionMismatch
from aps.messages import PROTOCOL_VERSION, Challenge, Hello, Reject, Welcome
from aps.protocol import NONCE_SIZE, Role, check_learner_proof, worker_proof
from aps.session import Session
from aps.transports import connect
from aps.transports.base import TransportFactory

__all__ = ["CheckResult", "check_learner"]

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
    """

    url: str
    protocol_version: int
    connect_seconds: float
    round_trip_seconds: float


async def check_learner(
    url: str,
    *,
    token: str | None,
    factory: TransportFactory | None = None,
    timeout: float = 10.0,
) -> CheckResult:
    """Dial the learner at ``url``, prove ``token`` and leave before joining.

    Args:
        url: the learner's address, as a worker dials it.
        token: the learner's token (``None``: prove none, as a worker without one would).
        factory: dial with this factory (TLS, say) instead of the scheme's own.
        timeout: the longest the whole check may take, in seconds.

    Returns:
        The learner's protocol version and the times measured.

    Raises:
        AuthError: the learner refused the token (or needs one and none was given), or did
            not prove it knows the token itself.
        VersionMismatch: the learner speaks another protocol version.
        ConnectError | Timeout: nothing answered at ``url`` within ``timeout``.
        ProtocolError: what answered is not an aps learner, or it admitted the check.
    """
    try:
        async with asyncio.timeout(timeout):
            return await _check(url, token, factory)
    except TimeoutError as exc:
        if isinstance(exc, Timeout):
            raise
        raise Timeout(
            f"the learner at {url} did not finish the check within {timeout} s; is it an aps "
            "learner on the same transport (TLS or not)? Raise it with --timeout",
            operation="check",
            seconds=timeout,
        ) from None


async def _check(url: str, token: str | None, factory: TransportFactory | None) -> CheckResult:
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
                num_envs=0,  # refused after the token is checked, before a slot is taken
                seed=None,
                host=socket.gethostname(),
                pid=os.getpid(),
                label=PROBE_LABEL,
            )
        )
        answer = await session.receive(timeout=None, operation="the learner's answer")
        answered = time.perf_counter()
    finally:
        await session.aclose()
    if isinstance(answer, Welcome):
        raise ProtocolError(
            f"the learner at {url} admitted a worker without envs; it is not a learner "
            "this aps version can check"
        )
    assert isinstance(answer, Reject)
    if answer.kind == "AuthError":
        raise AuthError(f"the learner refused the token: {answer.reason}")
    if answer.kind == "VersionMismatch":
        raise ProtocolError(f"the learner refused the protocol version: {answer.reason}")
    if answer.kind != "ConfigError" or "num_envs" not in answer.reason:
        raise ConfigError(f"the learner refused the check: {answer.kind}: {answer.reason}")
    check_learner_proof(
        answer.proof, token=secret, learner_nonce=challenge.nonce, worker_nonce=nonce, peer=url
    )
    return CheckResult(
        url=url,
        protocol_version=challenge.protocol_version,
        connect_seconds=connected - started,
        round_trip_seconds=answered - sent,
    )
