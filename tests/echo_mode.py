"""A toy mode in one module: the learner sends ``Echo(payload)``, every worker answers ``Echoed``.

It shows what a mode of numbered requests needs, and that it needs nothing else: its message
types, its row (:class:`aps.session.protocol.RequestKind`, registered when this module is imported),
the worker's handler, and the learner's side over the pool's ``exchange``. Importing this
module registers the mode in the process that imports it; both sides must (here the learner
and its workers share the test's process). No file of ``aps`` names it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, cast

import aps
from aps.session.protocol import RequestKind, register_request
from aps.wire.messages import Message, Request

__all__ = ["ECHO", "Echo", "Echoed", "echo"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Echo(Message):
    """Ask a worker to send ``payload`` back (plain data); numbered like every request."""

    TAG: ClassVar[str] = "echo"
    payload: Any
    seq: int = 0
    acked: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Echoed(Message):
    """A worker's answer to an :class:`Echo`: its ``payload`` and the worker's env count."""

    TAG: ClassVar[str] = "echoed"
    payload: Any
    num_envs: int
    seq: int = 0


def serve(server: Any, request: Echo) -> Echoed:
    """The worker's handler: the step server and the request in, the answer out.

    A payload of ``"raise"`` raises, to show that what a handler raises reaches the learner
    as the worker's error (an :class:`aps.WorkerError`), and the worker serves on.
    """
    if request.payload == "raise":
        raise ValueError("the echo handler was asked to raise")
    return Echoed(payload=request.payload, num_envs=server.envs.num_envs, seq=request.seq)


ECHO = RequestKind(Echo, Echoed, serve)
"""The mode's row: its own states are the protocol's for a mode's kind (AWAIT_ANSWER,
SERVING), one request outstanding at a time."""

register_request(ECHO)


async def echo(learner: aps.Learner, payload: Any) -> list[Echoed]:
    """Send ``payload`` to every worker; their answers, in worker order.

    Raises:
        WorkerError: a worker's handler raised (the others' answers were still received).
        InvalidState: another operation holds the workers.
    """
    pool = learner._pool  # the learner's side of a mode is written over its pool
    requests = [Echo(payload=payload) for _ in pool.slots.admitted]

    async def redo(slot: Any, request: Request, operation: str) -> Message:
        # A replacement took the worker over before it answered: ask the replacement.
        return await pool.requests.call_until_answered(slot, request, operation)

    answers = await pool.exchange(cast("list[Request]", requests), "echo", redo=redo)
    return cast("list[Echoed]", answers)
