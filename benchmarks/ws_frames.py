"""One frame at a time from a listener to receiver processes, over tcp:// or ws://: wall and CPU.

The transports alone, without a learner or a worker: this process listens, ``--receivers``
subprocesses connect, and each repetition sends one frame of ``--size`` bytes to every
receiver (``transport.send``, all handed over before any answer is awaited) and waits for
each receiver's 1-byte answer, sent once the whole frame is in (``transport.receive``). The
direction is the one weights travel: from the listener (a WebSocket server, whose frames
are not masked) to the connecting side.

Reported per repetition: the median wall time, and the mean CPU time (user + system) of this
process (the sender) and of the receivers together (theirs read from ``/proc``, Linux only,
in clock ticks: means over many repetitions are exact enough, single ones are not).
``--fragment-size`` overrides :data:`aps.transports.websocket.FRAGMENT_SIZE` in the sender,
to compare fragment sizes. Small ``--size`` with many ``--reps`` measures the per-message
cost instead. Nothing asserts on timings.

Usage::

    python benchmarks/ws_frames.py                                   # 40 MB to 2, tcp and ws
    python benchmarks/ws_frames.py --receivers 1 --fragment-size 262144
    python benchmarks/ws_frames.py --size 300 --reps 3000 --receivers 1
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from throughput import LOOPBACK, START_TIMEOUT, STOP_GRACE, cpu_seconds  # noqa: E402

from aps.session._loop import run  # noqa: E402

ACK = b"k"
SCRIPT = str(Path(__file__).resolve())
DEADLINE = 60.0  # seconds for any one network wait
LIMIT = 1 << 30  # max_frame_size on both ends


def factory(scheme: str) -> Any:
    if scheme == "ws":
        from aps.transports.websocket import WebSocketFactory

        return WebSocketFactory(max_frame_size=LIMIT)
    from aps.transports.tcp import TCPFactory

    return TCPFactory(max_frame_size=LIMIT)


async def receiver(url: str, size: int) -> None:
    """Answer every frame of ``size`` bytes with one byte, until the sender closes."""
    scheme = url.partition("://")[0]
    async with await factory(scheme).connect(url, timeout=DEADLINE) as transport:
        while True:
            try:
                frame = await asyncio.wait_for(transport.receive(), DEADLINE)
            except Exception:
                return  # the sender closed (or vanished): leave
            if len(frame) != size:
                raise RuntimeError(f"received {len(frame)} bytes, expected {size}")
            del frame
            await transport.send(ACK)


async def measure(scheme: str, size: int, receivers: int, reps: int) -> dict[str, Any]:
    async with await factory(scheme).listen(f"{scheme}://{LOOPBACK}:0") as listener:
        command = [SCRIPT, "--receiver", listener.url, "--size", str(size)]
        processes = [
            await asyncio.create_subprocess_exec(sys.executable, *command) for _ in range(receivers)
        ]
        try:
            transports = [
                await asyncio.wait_for(listener.accept(), START_TIMEOUT) for _ in processes
            ]
            pids = [p.pid for p in processes]
            payload = os.urandom(size)
            walls: list[float] = []
            here_total = there_total = 0.0
            known = True
            for rep in range(reps + 1):  # the first is a warm-up
                here_before, there_before = cpu_seconds(pids)
                start = time.perf_counter()
                for transport in transports:
                    await transport.send(payload)
                for transport in transports:
                    answer = await asyncio.wait_for(transport.receive(), DEADLINE)
                    if answer != ACK:
                        raise RuntimeError(f"a receiver answered {answer!r}")
                wall = time.perf_counter() - start
                here_after, there_after = cpu_seconds(pids)
                if rep == 0:
                    continue
                walls.append(wall)
                here_total += here_after - here_before
                if there_before is None or there_after is None:
                    known = False
                else:
                    there_total += there_after - there_before
            for transport in transports:
                await transport.aclose()
        finally:
            for process in processes:
                if process.returncode is None:
                    process.terminate()
            for process in processes:
                try:
                    await asyncio.wait_for(process.wait(), STOP_GRACE)
                except TimeoutError:
                    process.kill()
                    await process.wait()
    return {
        "wall_median_s": statistics.median(walls),
        "wall_min_s": min(walls),
        "cpu_sender_s": here_total / reps,
        "cpu_receivers_s": there_total / reps if known else None,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--size", type=int, default=40_000_000, help="frame bytes (default 40 MB)")
    p.add_argument("--receivers", type=int, default=2, help="receiver processes (default 2)")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions (default 10)")
    p.add_argument("--rounds", type=int, default=3, help="rounds over the schemes (default 3)")
    p.add_argument("--schemes", default="tcp,ws", help="comma-separated: tcp, ws")
    p.add_argument("--fragment-size", type=int, default=None, help="ws fragment size (bytes)")
    p.add_argument("--receiver", metavar="URL", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.receiver:
        run(receiver(args.receiver, args.size))
        return 0
    if args.fragment_size is not None:
        import aps.transports.websocket as websocket

        websocket.FRAGMENT_SIZE = args.fragment_size
    schemes = [s for s in args.schemes.split(",") if s]
    print(
        f"{args.size:,} bytes to {args.receivers} receivers, {args.reps} reps x {args.rounds} "
        f"rounds; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    for round_ in range(args.rounds):
        for scheme in schemes:
            r = run(measure(scheme, args.size, args.receivers, args.reps))
            there = r["cpu_receivers_s"]
            print(
                f"round {round_ + 1} {scheme:<4} wall {r['wall_median_s'] * 1e3:8.2f} ms "
                f"(min {r['wall_min_s'] * 1e3:.2f})  cpu sender {r['cpu_sender_s'] * 1e3:7.2f} ms"
                f"  receivers {'-' if there is None else f'{there * 1e3:7.2f} ms'}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
