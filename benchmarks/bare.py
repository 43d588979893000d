"""The bare ceiling of lockstep stepping: no aps code at all, at either end.

The learner sends each worker its actions and reads back one step, over asyncio TCP
streams (uvloop when installed), with plain msgpack maps of raw array bytes behind a 4-byte
length; each worker process steps a real Gymnasium ``SyncVectorEnv`` with the actions it
received. Nothing of aps runs: not its codec, framing, session, learner, worker or vector
env. This is what any library built on asyncio and msgpack could reach for lockstep on this
machine, the figure the matrix compares aps's await loop and ``ClusterEnv`` with (beside the
step limit, which uses aps's codec and vector env).

The ``bare-protocol`` contender is the strictest form of the same ceiling: both ends are
``asyncio.Protocol`` objects that parse the length-prefixed frames out of their own
``bytearray`` in ``data_received`` (:class:`FrameProtocol`), so no ``StreamReader``, no
coroutine per read and no task wake-up per frame stand between the socket and the msgpack
decode. Same frames, same payloads, same envs.

This module is the learner side's helpers and the worker program (``python bare.py
--worker HOST:PORT ...``, with ``--protocol`` for the Protocol worker, started by the
``bare-ceiling`` and ``bare-protocol`` contenders, not by hand). It imports no aps module.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import struct
import sys
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any, cast

import gymnasium as gym
import msgpack
import numpy as np
from gymnasium.vector import SyncVectorEnv

__all__ = [
    "FrameProtocol",
    "decode_step",
    "encode_actions",
    "framed",
    "main",
    "read_frame",
    "run",
]

HEADER = struct.Struct("<I")
START_TIMEOUT = 60.0


def framed(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return await reader.readexactly(size)


class FrameProtocol(asyncio.Protocol):
    """Length-prefixed frames from one connection, parsed from this protocol's own buffer.

    ``on_frame(self, frame)`` is called with every whole frame, in order, from
    ``data_received`` (so it runs on the event loop and must not block for long). When the
    received bytes hold whole frames and nothing is pending, they are sliced straight out of
    ``data`` without passing through the buffer. ``closed`` completes when the connection is
    lost (with its error, if any, as the result, never raised).
    """

    def __init__(self, on_frame: Callable[[FrameProtocol, bytes], None]) -> None:
        self._on_frame = on_frame
        self._buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.closed: asyncio.Future[BaseException | None] = (
            asyncio.get_running_loop().create_future()
        )

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        if buffer:
            buffer += data
            if (
                len(buffer) < HEADER.size
                or len(buffer) < HEADER.size + HEADER.unpack_from(buffer)[0]
            ):
                return  # the first frame is still partial: copy nothing out yet
            data = bytes(buffer)
            buffer.clear()
        start, end = 0, len(data)
        while end - start >= HEADER.size:
            (size,) = HEADER.unpack_from(data, start)
            stop = start + HEADER.size + size
            if stop > end:
                break
            self._on_frame(self, data[start + HEADER.size : stop])
            start = stop
        if start < end:
            buffer += data[start:]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(exc)


def _array(array: np.ndarray[Any, Any]) -> list[Any]:
    return [array.dtype.str, list(array.shape), array.tobytes()]


def _from(item: list[Any]) -> np.ndarray[Any, Any]:
    dtype, shape, data = item
    return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)


def encode_actions(actions: np.ndarray[Any, Any]) -> bytes:
    return framed(msgpack.packb(_array(np.ascontiguousarray(actions))))


def decode_step(frame: bytes) -> tuple[np.ndarray[Any, Any], ...]:
    """``(obs, reward, terminated, truncated)`` of one worker's step."""
    obs, reward, terminated, truncated = msgpack.unpackb(frame)
    return _from(obs), _from(reward), _from(terminated), _from(truncated)


def run(main: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """Run ``main()`` on uvloop when it is installed, else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    return uvloop.run(main())


async def _serve(host: str, port: int, index: int, envs: SyncVectorEnv) -> None:
    async with asyncio.timeout(START_TIMEOUT):
        reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(framed(str(index).encode()))
        while True:
            try:
                actions = _from(msgpack.unpackb(await read_frame(reader)))
            except asyncio.IncompleteReadError:
                return  # the learner closed the connection: done
            obs, reward, terminated, truncated, _ = envs.step(actions)
            items = [_array(a) for a in (obs, reward, terminated, truncated)]
            writer.write(framed(msgpack.packb(items)))
    finally:
        writer.close()


async def _serve_protocol(host: str, port: int, index: int, envs: SyncVectorEnv) -> None:
    """The worker of ``bare-protocol``: each actions frame is stepped in ``data_received``."""

    def on_frame(protocol: FrameProtocol, frame: bytes) -> None:
        actions = _from(msgpack.unpackb(frame))
        obs, reward, terminated, truncated, _ = envs.step(actions)
        items = [_array(a) for a in (obs, reward, terminated, truncated)]
        assert protocol.transport is not None
        protocol.transport.write(framed(msgpack.packb(items)))

    loop = asyncio.get_running_loop()
    async with asyncio.timeout(START_TIMEOUT):
        transport, protocol = await loop.create_connection(
            lambda: FrameProtocol(on_frame), host, port
        )
    try:
        transport.write(framed(str(index).encode()))
        await protocol.closed  # the learner closed the connection: done
    finally:
        transport.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="a bare-ceiling worker (started by the benchmark)")
    p.add_argument("--worker", metavar="HOST:PORT", required=True)
    p.add_argument("--env", required=True)
    p.add_argument("--num-envs", type=int, required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--protocol", action="store_true", help="the asyncio.Protocol worker")
    args = p.parse_args(argv)
    envs = SyncVectorEnv([partial(gym.make, args.env)] * args.num_envs)
    try:
        envs.reset(seed=args.seed)
        host, _, port = args.worker.rpartition(":")
        with contextlib.suppress(KeyboardInterrupt):
            serve = _serve_protocol if args.protocol else _serve
            run(partial(serve, host, int(port), args.index, envs))
    finally:
        envs.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
