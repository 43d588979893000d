"""The learner's ceiling: worker messages per second of one learner core, from 2 to 256 workers.

A learner sends one message to each worker per lockstep step and receives one back; in a
DETACH chunk stream it receives one chunk per request. What caps how many machines one learner
can drive is its CPU time per worker message, which should stay flat as workers are added.

Many light workers share a few processes here (``--hosts`` processes, each running its share
of :class:`aps.Worker` instances as tasks of one event loop, one CartPole env each), so 256
connected workers fit on two cores. For each worker count the benchmark measures, over timed
windows:

- ``lockstep``: ``await learner.step(actions)`` in a loop; messages = steps x workers.
- ``chunks``: ``learner.chunks(T)`` with workers acting with CleanRL's PPO agent
  (``mlp_policy.py``); messages = chunks received.

and reports the learner process's CPU time (user + system) per message, and its inverse, the
ceiling in messages per second of one learner core. Throughput itself is bounded by the
workers' share of the machine and is printed for reference only.

Usage::

    python benchmarks/learner_ceiling.py                  # 2, 8, 32, 128, 256 workers
    python benchmarks/learner_ceiling.py --quick          # 2, 32, 256; short windows
    python benchmarks/learner_ceiling.py --workers 2,64 --modes lockstep

Writes ``results/learner_ceiling.json``. Nothing asserts on timings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

import aps
from aps.session import Timeouts

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
POLICY = f"{ROOT / 'mlp_policy.py'}:Agent"
ENV = "CartPole-v1"
MODES = ("lockstep", "chunks")
BATCH = 16  # workers a host starts at once, so that handshakes never pile up


def cpu_seconds() -> float:
    """User + system CPU time of this process, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# The worker hosts.


async def host(url: str, count: int) -> None:
    """Run ``count`` workers in this process until the learner says goodbye."""
    timeouts = Timeouts(connect=300.0, step=300.0)
    tasks = []
    for start in range(0, count, BATCH):
        for _ in range(min(BATCH, count - start)):
            worker = aps.Worker(url, ENV, num_envs=1, timeouts=timeouts, policy=POLICY)
            tasks.append(asyncio.create_task(worker.run()))
        await asyncio.sleep(0.2)
    await asyncio.gather(*tasks)


def start_hosts(url: str, workers: int, hosts: int) -> list[subprocess.Popen[bytes]]:
    shares = [workers // hosts + (i < workers % hosts) for i in range(hosts)]
    return [
        subprocess.Popen([sys.executable, __file__, "--host", url, "--count", str(share)])
        for share in shares
        if share
    ]


# The learner.


async def measure(
    workers: int, mode: str, *, hosts: int, seconds: float, warmup: float, chunk: int
) -> dict[str, Any]:
    policy = POLICY if mode == "chunks" else None
    timeouts = Timeouts(connect=300.0, step=300.0)
    async with aps.Learner(
        "tcp://127.0.0.1:0", num_workers=workers, policy=policy, timeouts=timeouts
    ) as learner:
        procs = start_hosts(learner.url, workers, hosts)
        try:
            await learner.reset(seed=0)
            if mode == "lockstep":
                messages_per, cpu, wall = await _lockstep(learner, seconds, warmup)
            else:
                messages_per, cpu, wall = await _chunks(learner, seconds, warmup, chunk)
        finally:
            await learner.aclose()
            for proc in procs:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    us = cpu / messages_per * 1e6 if messages_per else float("nan")
    return {
        "workers": workers,
        "mode": mode,
        "messages": messages_per,
        "seconds": wall,
        "learner_cpu_s": cpu,
        "cpu_us_per_message": us,
        "ceiling_messages_per_core_s": 1e6 / us if messages_per else float("nan"),
        "messages_per_s": messages_per / wall if wall else float("nan"),
    }


async def _lockstep(
    learner: aps.Learner, seconds: float, warmup: float
) -> tuple[int, float, float]:
    actions = np.zeros(learner.num_envs, dtype=np.int64)
    deadline = time.perf_counter() + warmup
    while time.perf_counter() < deadline:
        await learner.step(actions)
    steps = 0
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        await learner.step(actions)
        steps += 1
    return steps * len(learner.workers), cpu_seconds() - cpu0, time.perf_counter() - t0


async def _chunks(
    learner: aps.Learner, seconds: float, warmup: float, chunk: int
) -> tuple[int, float, float]:
    sys.path.insert(0, str(ROOT))
    from mlp_policy import Agent  # the workers import the same file by path

    await learner.publish(Agent(learner))
    received = 0
    cpu0 = t0 = 0.0
    start = time.perf_counter()
    stream = learner.chunks(chunk)
    async for _ in stream:
        now = time.perf_counter()
        if not t0 and now - start >= warmup:
            cpu0, t0 = cpu_seconds(), now
        elif t0:
            received += 1
            if now - t0 >= seconds:
                break
    await stream.aclose()
    return received, cpu_seconds() - cpu0, time.perf_counter() - t0


def render(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| mode | workers | learner CPU per message | ceiling (messages/s per core) "
        "| messages/s here |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['mode']} | {row['workers']} | {row['cpu_us_per_message']:.1f} µs "
            f"| {row['ceiling_messages_per_core_s']:,.0f} | {row['messages_per_s']:,.0f} |"
        )
    return "\n".join(lines)


def parse_ints(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--workers", type=parse_ints, default=None, help="2,8,32,128,256")
    p.add_argument("--modes", default=",".join(MODES), help="lockstep,chunks")
    p.add_argument("--hosts", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--seconds", type=float, default=None, help="timed window (5; quick 2)")
    p.add_argument("--warmup", type=float, default=None, help="warm-up (1; quick 0.5)")
    p.add_argument("--chunk", type=int, default=16, help="steps per chunk (default 16)")
    p.add_argument("--quick", action="store_true", help="2, 32 and 256 workers; short windows")
    p.add_argument("--json", type=Path, default=RESULTS / "learner_ceiling.json")
    p.add_argument("--host", help=argparse.SUPPRESS)  # a worker host's learner URL
    p.add_argument("--count", type=int, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.host:
        asyncio.run(host(args.host, args.count))
        return 0
    workers = args.workers or ([2, 32, 256] if args.quick else [2, 8, 32, 128, 256])
    seconds = args.seconds or (2.0 if args.quick else 5.0)
    warmup = args.warmup or (0.5 if args.quick else 1.0)
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    rows = []
    for mode in modes:
        for count in workers:
            row = asyncio.run(
                measure(
                    count,
                    mode,
                    hosts=args.hosts,
                    seconds=seconds,
                    warmup=warmup,
                    chunk=args.chunk,
                )
            )
            rows.append(row)
            print(
                f"{mode:8} {count:4} workers: {row['cpu_us_per_message']:7.1f} µs learner CPU "
                f"per message, ceiling {row['ceiling_messages_per_core_s']:9,.0f}/s per core "
                f"({row['messages_per_s']:,.0f}/s here)",
                flush=True,
            )
    print()
    print(render(rows))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "aps": aps.__version__ if hasattr(aps, "__version__") else None,
        "seconds": seconds,
        "hosts": args.hosts,
        "chunk": args.chunk,
    }
    args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
