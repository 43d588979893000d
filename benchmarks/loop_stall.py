"""How long a large frame holds a session's event loop while it is decoded.

Usage: python benchmarks/loop_stall.py [--mib 64] [--frames 10] [--codec zstd]

A sender writes ``--frames`` weights versions of about ``--mib`` MiB (compressible arrays,
so that the receiving side inflates them) over an in-memory transport; the receiving
session decodes them while a ticker task on the same loop records the longest gap between
its turns. It runs twice in one process: as aps runs (frames of at least
``aps.session.OFF_LOOP_BYTES`` decoded in a thread) and with every frame decoded on the loop,
as before, and prints the longest and median gap of each and their ratio. The protocol's
checks are bypassed on both sessions: what is measured is where a frame is decoded, not
which message the protocol allows (the tests hold that part).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import numpy as np

import aps.session
from aps.session import Session
from aps.session.protocol import Role
from aps.transports.memory import memory_transport_pair
from aps.wire import codec
from aps.wire.messages import Weights


def sessions(codec_name: str) -> tuple[Session, Session]:
    """A sender and a receiver past the handshake, compressing with ``codec_name``."""
    near, far = memory_transport_pair()
    sender, receiver = Session(near, Role.LEARNER), Session(far, Role.WORKER)
    for session in (sender, receiver):
        session.authenticated()
        session.compress(codec_name)
        session._connection.receive = lambda message: None  # type: ignore[method-assign]
        session._connection.send = lambda message: None  # type: ignore[method-assign]
    return sender, receiver


async def run(mib: float, frames: int, codec_name: str, off_loop: bool) -> dict[str, Any]:
    """The ticker's gaps, in ms, while ``frames`` versions are received and decoded."""
    threshold = aps.session.OFF_LOOP_BYTES
    aps.session.OFF_LOOP_BYTES = threshold if off_loop else 2**62  # type: ignore[misc]
    try:
        return await _received(mib, frames, codec_name, off_loop)
    finally:
        aps.session.OFF_LOOP_BYTES = threshold  # type: ignore[misc]


async def _received(mib: float, frames: int, codec_name: str, off_loop: bool) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    # Small integers as float32: zstd shrinks them about 4x, so the receiver inflates.
    arrays = {"w": rng.integers(0, 16, int(mib * 2**20) // 4).astype(np.float32)}
    sender, receiver = sessions(codec_name)
    gaps: list[float] = []
    done = asyncio.Event()

    async def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0)
            now = time.perf_counter()
            gaps.append((now - last) * 1e3)
            last = now

    # Encoded once, before the clock starts: compressing is the sender's work, on its host.
    version = Weights(version=7, arrays=arrays, epsilon=None)
    frame = codec.encode(version, compressor=sender._compressor)
    ticker = asyncio.create_task(tick())
    began = time.perf_counter()
    for _ in range(frames):
        await sender.send(version, frame=frame)
        got = await receiver.receive(timeout=60, operation="weights")
        assert isinstance(got, Weights) and got.version == 7
    seconds = time.perf_counter() - began
    done.set()
    await ticker
    return {
        "off_loop": off_loop,
        "longest_gap_ms": round(max(gaps), 2),
        "median_gap_ms": round(statistics.median(gaps), 4),
        "seconds": round(seconds, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--mib", type=float, default=64.0, help="size of each version, in MiB")
    parser.add_argument("--frames", type=int, default=10, help="versions received per run")
    parser.add_argument("--codec", default="zstd", choices=("zstd", "lz4"), help="compression")
    args = parser.parse_args()
    rows = [asyncio.run(run(args.mib, args.frames, args.codec, off)) for off in (True, False)]
    for row in rows:
        print(json.dumps({"mib": args.mib, "codec": args.codec, **row}))
    ratio = rows[0]["longest_gap_ms"] / rows[1]["longest_gap_ms"]
    print(f"longest loop gap, decoded in a thread / on the loop: {ratio:.3f}")


if __name__ == "__main__":
    main()
