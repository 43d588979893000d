"""The learner's CPU per DETACH chunk: decode, checks and bookkeeping, isolated from acting.

In DETACH every worker streams :class:`~aps.wire.messages.RolloutChunk` messages into one
learner, so the learner's CPU time per chunk bounds how many workers (and env-steps per
second) one learner core can take. This benchmark measures that cost alone: the learner is
the real :class:`aps.Learner` consuming ``learner.chunks(T)`` over TCP on 127.0.0.1, and the
workers are real :class:`aps.Worker` instances (``--hosts`` processes, each running its share
as tasks of one event loop) whose acting is replayed: each worker acts its first chunk for
real (its env, the published policy, the collector) and then answers every further request
with that same chunk under the request's number, re-encoded by aps's codec like any answer.
A worker then costs one encode and one send per chunk, not an episode of env steps and
inference, so a few processes come close to keeping the learner busy.

Two shapes, both uncompressed:

- ``cartpole``: 16 steps of one ``CartPole-v1`` env per chunk (the issue's small chunk).
- ``pong``: 128 steps of 8 envs with Atari-sized observations (``uint8`` frames
  ``4 x 84 x 84``, random bytes, ``Discrete(6)`` actions), the issue's large chunk.

Over ``--windows`` timed windows of ``--seconds`` each, the learner process's CPU time (user
+ system, ``resource.getrusage``) per chunk received, and for the payload (the bytes of the
chunk's arrays) MB per learner CPU-second; the median over the windows is the figure.
The training loop does nothing with a chunk but count it, so the CPU is aps's own.

Usage::

    python benchmarks/chunk_ingest.py --shape cartpole --workers 8
    python benchmarks/chunk_ingest.py --shape pong --workers 4
    python benchmarks/chunk_ingest.py --shape cartpole --profile 3   # cProfile of the learner

Writes ``--json`` when given. Nothing asserts on timings.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import dataclasses
import json
import os
import platform
import pstats
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

import aps
from aps.session import Timeouts

ROOT = Path(__file__).resolve().parent
POLICY = f"{ROOT / 'mlp_policy.py'}:Agent"
HERE = Path(__file__).resolve()
SHAPES: dict[str, dict[str, Any]] = {
    "cartpole": {"env": "CartPole-v1", "envs": 1, "steps": 16, "policy": POLICY},
    "pong": {
        "env": f"{HERE}:make_frames_env",
        "envs": 8,
        "steps": 128,
        "policy": f"{HERE}:frames_agent",
    },
}
BATCH = 16  # workers a host starts at once, so that handshakes never pile up


class FramesEnv(gym.Env[np.ndarray, int]):
    """Atari-sized observations without an emulator: ``uint8`` frames ``4 x 84 x 84``.

    The frames are random bytes drawn once (a step costs a copy, not a draw); episodes end
    after 500 steps, so chunks carry episode ends and truncations as a game's do.
    """

    observation_space = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
    action_space = gym.spaces.Discrete(6)

    def __init__(self) -> None:
        self._frames = np.random.default_rng(0).integers(0, 256, (8, 4, 84, 84), dtype=np.uint8)
        self._t = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._t = 0
        return self._frames[0].copy(), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self._t += 1
        obs = self._frames[self._t % len(self._frames)].copy()
        return obs, float(action == 0), False, self._t >= 500, {}


def make_frames_env() -> FramesEnv:
    """The ``pong`` shape's env (workers import it by path)."""
    return FramesEnv()


def frames_agent(envs: Any) -> Any:
    """The ``pong`` shape's policy: one linear layer each for the logits and the value.

    Only each worker's first chunk is acted, so its size matters little; it keeps the
    workers' start cheap.
    """
    from torch import nn

    inputs = int(np.prod(envs.single_observation_space.shape))
    agent = nn.Module()
    agent.actor = nn.Sequential(nn.Flatten(), nn.Linear(inputs, int(envs.single_action_space.n)))
    agent.critic = nn.Sequential(nn.Flatten(), nn.Linear(inputs, 1))
    return agent


def cpu_seconds() -> tuple[float, float]:
    """User and system CPU time of this process, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


# The worker hosts.


def replay_chunks() -> None:
    """Make every collector of this process act one chunk per version and replay it.

    The replayed chunk is the real one the collector acted, answering the new request's
    number; the worker encodes and sends it as it would any chunk.
    """
    from aps.worker.collector import Collector

    acted = Collector.collect_async

    async def collect_async(self: Collector, num_steps: int, seq: int = 0) -> Any:
        kept = getattr(self, "_replayed", None)
        if kept is None or kept.version != self.version or kept.reward.shape[0] != num_steps:
            kept = await acted(self, num_steps, seq)
            self._replayed = kept  # type: ignore[attr-defined]
        return dataclasses.replace(kept, seq=seq)

    Collector.collect_async = collect_async  # type: ignore[method-assign]


async def host(url: str, count: int, shape: str) -> None:
    """Run ``count`` replaying workers in this process until the learner says goodbye."""
    replay_chunks()
    spec = SHAPES[shape]
    timeouts = Timeouts(connect=300.0, step=300.0)
    tasks = []
    for start in range(0, count, BATCH):
        for _ in range(min(BATCH, count - start)):
            worker = aps.Worker(
                url, spec["env"], num_envs=spec["envs"], timeouts=timeouts, policy=spec["policy"]
            )
            tasks.append(asyncio.create_task(worker.run()))
        await asyncio.sleep(0.2)
    await asyncio.gather(*tasks)


def start_hosts(url: str, workers: int, hosts: int, shape: str) -> list[subprocess.Popen[bytes]]:
    shares = [workers // hosts + (i < workers % hosts) for i in range(hosts)]
    return [
        subprocess.Popen(
            [sys.executable, __file__, "--host", url, "--count", str(share), "--shape", shape]
        )
        for share in shares
        if share
    ]


# The learner.


def payload_bytes(chunk: aps.Chunk) -> int:
    """The bytes of a chunk's arrays (observations, actions, rewards, flags, episodes)."""
    wire = chunk.wire
    total = 0
    for field in dataclasses.fields(wire):
        value = getattr(wire, field.name)
        if isinstance(value, np.ndarray):
            total += value.nbytes
    return total


async def measure(
    shape: str,
    workers: int,
    *,
    hosts: int,
    windows: int,
    seconds: float,
    warmup: float,
    profile: cProfile.Profile | None,
) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    from mlp_policy import Agent  # the workers import the same file by path

    spec = SHAPES[shape]
    make_agent = Agent if shape == "cartpole" else frames_agent
    timeouts = Timeouts(connect=300.0, step=300.0)
    rows: list[dict[str, float]] = []
    async with aps.Learner(
        "tcp://127.0.0.1:0", num_workers=workers, policy=spec["policy"], timeouts=timeouts
    ) as learner:
        procs = start_hosts(learner.url, workers, hosts, shape)
        try:
            await learner.reset(seed=0)
            await learner.publish(make_agent(learner))
            stream = learner.chunks(spec["steps"])
            nbytes = 0
            count = 0
            start = time.perf_counter()
            cpu0, t0 = (0.0, 0.0), 0.0
            async for chunk in stream:
                if not nbytes:
                    nbytes = payload_bytes(chunk)
                now = time.perf_counter()
                if not t0:
                    if now - start >= warmup:
                        cpu0, t0, count = cpu_seconds(), now, 0
                        if profile is not None:
                            profile.enable()
                    continue
                count += 1
                if now - t0 >= seconds:
                    user, system = cpu_seconds()
                    cpu = (user - cpu0[0], system - cpu0[1])
                    rows.append(_window(count, cpu, now - t0, nbytes))
                    if len(rows) == windows:
                        break
                    cpu0, t0, count = cpu_seconds(), time.perf_counter(), 0
            if profile is not None:
                profile.disable()
            await stream.aclose()
        finally:
            await learner.aclose()
            for proc in procs:
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    us = [row["cpu_us_per_chunk"] for row in rows]
    user = [row["user_us_per_chunk"] for row in rows]
    system = [row["system_us_per_chunk"] for row in rows]
    mb = [row["mb_per_cpu_s"] for row in rows]
    return {
        "shape": shape,
        "workers": workers,
        "steps": spec["steps"],
        "envs": spec["envs"],
        "payload_bytes": nbytes,
        "cpu_us_per_chunk_median": statistics.median(us),
        "user_us_per_chunk_median": statistics.median(user),
        "system_us_per_chunk_median": statistics.median(system),
        "mb_per_cpu_s_median": statistics.median(mb),
        "chunks_per_s_median": statistics.median(row["chunks_per_s"] for row in rows),
        "windows": rows,
    }


def _window(chunks: int, times: tuple[float, float], wall: float, nbytes: int) -> dict[str, float]:
    cpu = sum(times)
    return {
        "chunks": chunks,
        "learner_cpu_s": cpu,
        "user_us_per_chunk": times[0] / chunks * 1e6 if chunks else float("nan"),
        "system_us_per_chunk": times[1] / chunks * 1e6 if chunks else float("nan"),
        "wall_s": wall,
        "cpu_us_per_chunk": cpu / chunks * 1e6 if chunks else float("nan"),
        "mb_per_cpu_s": chunks * nbytes / cpu / 1e6 if cpu else float("nan"),
        "chunks_per_s": chunks / wall if wall else float("nan"),
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--shape", choices=sorted(SHAPES), default="cartpole")
    p.add_argument("--workers", type=int, default=8, help="workers (default 8)")
    p.add_argument("--hosts", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--windows", type=int, default=5, help="timed windows (default 5)")
    p.add_argument("--seconds", type=float, default=3.0, help="each window (default 3)")
    p.add_argument("--warmup", type=float, default=2.0, help="before the first (default 2)")
    p.add_argument("--profile", type=int, default=0, help="print the top N of a cProfile")
    p.add_argument("--json", type=Path, default=None, help="write the result here")
    p.add_argument("--host", help=argparse.SUPPRESS)  # a worker host's learner URL
    p.add_argument("--count", type=int, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.host:
        asyncio.run(host(args.host, args.count, args.shape))
        return 0
    # CPU time, not wall time: on a shared machine a preempted call would look costly.
    profile = cProfile.Profile(time.thread_time) if args.profile else None
    row = asyncio.run(
        measure(
            args.shape,
            args.workers,
            hosts=args.hosts,
            windows=args.windows,
            seconds=args.seconds,
            warmup=args.warmup,
            profile=profile,
        )
    )
    windows = ", ".join(f"{w['cpu_us_per_chunk']:.1f}" for w in row["windows"])
    print(
        f"{row['shape']}: {row['workers']} workers, {row['payload_bytes']:,} payload bytes a "
        f"chunk: {row['cpu_us_per_chunk_median']:.1f} µs learner CPU per chunk (median; "
        f"windows {windows}; user {row['user_us_per_chunk_median']:.1f}, system "
        f"{row['system_us_per_chunk_median']:.1f}), {row['mb_per_cpu_s_median']:,.0f} MB/s "
        f"per learner CPU-second, {row['chunks_per_s_median']:,.0f} chunks/s here",
        flush=True,
    )
    if profile is not None:
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)
    if args.json is not None:
        meta = {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "aps": str(Path(aps.__file__).resolve().parent.parent.name),
            "hosts": args.hosts,
            "seconds": args.seconds,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "row": row}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
