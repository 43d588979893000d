"""The bare ceiling of lockstep stepping: no aps code at all, at either end.

The learner sends each worker its actions and reads back one step, over asyncio TCP
streams (uvloop when installed), with plain msgpack maps of raw array bytes behind a 4-byte
length; each worker process steps a real Gymnasium ``SyncVectorEnv`` with the actions it
received. Nothing of aps runs: not its codec, framing, session, learner, worker or vector
env. This is what any library built on asyncio and msgpack could reach for lockstep on this
machine, the figure the matrix compares aps's await loop and ``ClusterEnv`` with (beside the
step limit, which uses aps's codec and vector env).

This module is the learner side's helpers and the worker program (``python bare.py
--worker HOST:PORT ...``, started by the ``bare-ceiling`` contender, not by hand). It imports
no aps module.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import struct
import sys
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any

import gymnasium as gym
import msgpack
import numpy as np
from gymnasium.vector import SyncVectorEnv

__all__ = ["decode_step", "encode_actions", "main", "read_frame", "framed", "run"]

HEADER = struct.Struct("<I")
START_TIMEOUT = 60.0


def framed(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return await reader.readexactly(size)


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="a bare-ceiling worker (started by the benchmark)")
    p.add_argument("--worker", metavar="HOST:PORT", required=True)
    p.add_argument("--env", required=True)
    p.add_argument("--num-envs", type=int, required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    envs = SyncVectorEnv([partial(gym.make, args.env)] * args.num_envs)
    try:
        envs.reset(seed=args.seed)
        host, _, port = args.worker.rpartition(":")
        with contextlib.suppress(KeyboardInterrupt):
            run(partial(_serve, host, int(port), args.index, envs))
    finally:
        envs.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
