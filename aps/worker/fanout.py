"""A worker's side of the weight group: the versions the learner fanned out, kept until used.

The learner's weight group (:mod:`aps.learner.fanout`) sends each version once through a
gloo group of the learner and its workers (:func:`aps.gradients.spread`) instead of once per
worker over the sessions. The session still decides which version the worker acts with: a
:class:`~aps.wire.messages.GroupWeights` announces a collective (the worker joins it at once,
in the receiver's one thread, so every rank runs the collectives in the same order), and a
``Weights(version, arrays=None)`` later says to act with a version that came that way. What
the collective delivered must match the SHA-256 the session announced (the members pass
the pieces among themselves: one could alter them, none can forge the session), and is
decoded like any frame from the network, within the session's frame limit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hashlib
from typing import Any

from aps.errors import ProtocolError
from aps.gradients import join_group, spread, spread_buffer
from aps.wire import codec
from aps.wire.messages import GroupWeights, JoinWeightGroup, Weights

__all__ = ["GroupReceiver"]

DIGEST_SIZE = 32
"""Bytes of the SHA-256 digest a :class:`~aps.wire.messages.GroupWeights` carries."""

KEEP = 4
"""Versions a receiver keeps that the learner has not told it to act with yet: the newest.

The learner tells a worker to act with the version that is newest when it decides, so only
versions announced after that decision can be newer; older ones are never asked for again."""


class GroupReceiver:
    """One worker's membership of a weight group, from :meth:`join` to :meth:`close`.

    Args:
        group: the gloo group (:func:`aps.gradients.join_group`).
        request: the learner's :class:`~aps.wire.messages.JoinWeightGroup`.
        max_frame_size: the largest version frame accepted (the session's limit).
    """

    def __init__(
        self,
        group: Any,
        request: JoinWeightGroup,
        max_frame_size: int,
        thread: concurrent.futures.ThreadPoolExecutor | None = None,
    ) -> None:
        self._group = group
        self._rank, self._world = request.rank, request.world_size
        self._timeout = request.timeout
        self._max_frame_size = max_frame_size
        # One thread of its own: the collectives run in the order they were announced, as on
        # every rank, and never wait for a thread of the loop's shared pool (which a process
        # of many workers, each blocked in the same collective, would exhaust).
        self._thread = thread or _group_thread()
        self._frames: dict[int, asyncio.Future[memoryview]] = {}
        self._announced = 0

    @classmethod
    async def join(
        cls, request: JoinWeightGroup, learner_host: str, max_frame_size: int
    ) -> GroupReceiver:
        """Join the group ``request`` names; returns once every rank has joined.

        Raises:
            ProtocolError: the request is malformed (a rank outside the group).
            RuntimeError: gloo failed (a rank did not join within ``request.timeout``).
        """
        if not 0 < request.rank < request.world_size or not 0 < request.timeout:
            raise ProtocolError(
                f"a weight group's rank must be in 1..world_size - 1 and its timeout "
                f"positive, got rank {request.rank} of {request.world_size}, timeout "
                f"{request.timeout}"
            )
        thread = _group_thread()
        try:
            group = await asyncio.get_running_loop().run_in_executor(
                thread,
                functools.partial(
                    join_group,
                    host=request.host or learner_host,
                    port=request.port,
                    prefix=request.prefix,
                    rank=request.rank,
                    world_size=request.world_size,
                    timeout=request.timeout,
                ),
            )
        except BaseException:
            thread.shutdown(wait=False)
            raise
        return cls(group, request, max_frame_size, thread)

    def announce(self, message: GroupWeights) -> None:
        """Take part in the collective that carries ``message.version``: it starts now.

        Raises:
            ProtocolError: a size over the frame limit, or a version not newer than the last
                one announced (the collective is not joined: the learner's times out).
        """
        version, nbytes = message.version, message.nbytes
        if len(message.sha256) != DIGEST_SIZE:
            raise ProtocolError(
                f"the learner announced version {version} by the weight group with a digest of "
                f"{len(message.sha256)} bytes; a SHA-256 digest is {DIGEST_SIZE}"
            )
        if not 0 < nbytes <= self._max_frame_size:
            raise ProtocolError(
                f"the learner announced version {version} by the weight group at {nbytes} "
                f"bytes; a version's frame must be 1 to {self._max_frame_size} bytes (this "
                "worker's frame limit: raise max_frame_size on both sides for larger models)"
            )
        if version <= self._announced:
            raise ProtocolError(
                f"the learner announced version {version} by the weight group after version "
                f"{self._announced}; versions go out in order"
            )
        self._announced = version
        loop = asyncio.get_running_loop()
        self._frames[version] = loop.run_in_executor(
            self._thread, self._collect, version, nbytes, message.sha256
        )
        for old in sorted(self._frames)[:-KEEP]:
            self._frames.pop(old).add_done_callback(_consume)

    async def take(self, version: int) -> Weights:
        """The :class:`~aps.wire.messages.Weights` of ``version``, as the collective brought it.

        Raises:
            ProtocolError: ``version`` was not announced (or is older than the kept ones), or
                its frame is not the Weights of that version.
            WireError: the frame does not decode.
            RuntimeError: the collective failed (a rank was lost, the group broke).
            TimeoutError: the collective took longer than the group's timeout.
        """
        future = self._frames.get(version)
        if future is None:
            raise ProtocolError(
                f"the learner said to act with version {version} from the weight group, which "
                f"did not announce it (this worker keeps {sorted(self._frames) or 'none'})"
            )
        frame = await asyncio.wait_for(asyncio.shield(future), self._timeout)
        for old in [v for v in self._frames if v <= version]:
            del self._frames[old]
        weights = codec.decode(frame, max_frame_size=self._max_frame_size)
        if type(weights) is not Weights or weights.version != version or weights.arrays is None:
            raise ProtocolError(
                f"the weight group's frame for version {version} holds "
                f"{type(weights).__name__} {getattr(weights, 'version', '')}, not its weights"
            )
        return weights

    def close(self) -> None:
        """Leave the group once the collectives under way have ended (each within its timeout)."""
        for future in self._frames.values():
            future.add_done_callback(_consume)
        self._frames.clear()
        self._thread.submit(self._group.shutdown)
        self._thread.shutdown(wait=False)

    def _collect(self, version: int, nbytes: int, digest: bytes) -> memoryview:
        buffer = spread_buffer(nbytes, self._world)
        spread(self._group, self._rank, self._world, buffer)
        # The version's arrays will be views of this buffer, which nothing else holds.
        frame = memoryview(buffer.numpy())[:nbytes]
        if hashlib.sha256(frame).digest() != digest:
            raise ProtocolError(
                f"version {version} came by the weight group altered: its SHA-256 is not the "
                "one the learner announced over the session. A member of the group changed the "
                "pieces it passed on; form a weight group only of workers you trust"
            )
        return frame


def _group_thread() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aps-weight-group")


def _consume(future: asyncio.Future[memoryview]) -> None:
    # A version nobody will take: its failure (the group broke) was reported elsewhere.
    if not future.cancelled():
        future.exception()
