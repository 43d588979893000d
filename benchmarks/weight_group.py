"""What a version costs the learner, per worker count: over the sessions, or by the weight group.

A DETACH learner (``tcp://127.0.0.1``) with ``--workers`` :class:`aps.Worker` instances (one
CartPole env each, as tasks in ``--hosts`` processes) acting with a wide two-layer agent whose
weights are ``--megabytes`` (6.7 MB: the Nature CNN's) under always-sync. Per version, after
two warm-up versions, the learner publishes and runs one rollout of one step (every worker
takes the version); measured in the learner's process: the bytes it wrote (``wchar`` of
``/proc/self/io``: sockets included) in copies of the version's frame, and its CPU seconds
(user + system), for the publish alone and for publish plus rollout. Two paths, each run in
turn on the same machine:

- ``sessions``: aps's default; the learner sends each worker its copy over its session.
- ``group``: :meth:`aps.Learner.form_weight_group`; each version leaves in one collective
  (:func:`aps.gradients.spread`) and the sessions carry only the decision.

The goal checked (issue: a thousand workers): at 64 workers, the learner's bytes and CPU per
version at most 4x those at one worker. Reported as ratios to the same path's 1-worker row.

    python benchmarks/weight_group.py --workers 1,8,64 --json results/weight-group.json

Linux only (``/proc``); needs torch with gloo. Nothing asserts on timings.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from fanout import written
from fleet import cpu_seconds, parse_ints, rss_bytes
from torch import nn

import aps
from aps import sync
from aps.session import Timeouts
from aps.session._loop import run as run_loop

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
POLICY = f"{Path(__file__).resolve()}:WideAgent"
ENV = "CartPole-v1"
TIMEOUTS = Timeouts(connect=300.0, step=120.0)


class WideAgent(nn.Module):
    """CleanRL's discrete agent with one wide hidden layer: ``hidden`` units (``13 x hidden``
    parameters for CartPole: ``hidden=128_800`` is 6.7 MB of float32)."""

    def __init__(self, envs: Any, hidden: int = 128_800) -> None:
        super().__init__()
        size = int(envs.single_observation_space.shape[0])
        actions = int(envs.single_action_space.n)
        self.critic = nn.Sequential(nn.Linear(size, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        self.actor = nn.Sequential(nn.Linear(size, hidden), nn.Tanh(), nn.Linear(hidden, actions))

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        value: torch.Tensor = self.critic(x)
        return value

    def get_action_and_value(self, x: torch.Tensor, action: torch.Tensor | None = None) -> Any:
        logits = self.actor(x)
        probs = torch.distributions.Categorical(logits=logits)
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


class Spaces:
    def __init__(self) -> None:
        import gymnasium as gym

        env = gym.make(ENV)
        self.single_observation_space = env.observation_space
        self.single_action_space = env.action_space


def hidden_for(megabytes: float) -> int:
    """The hidden width whose agent holds ``megabytes`` of float32 parameters for CartPole."""
    # Parameters: actor 4h + h + 2h + 2, critic 4h + h + h + 1: 13h + 3.
    return max(1, round((megabytes * 1e6 / 4 - 3) / 13))


async def host(url: str, count: int) -> None:
    """Run ``count`` workers until the learner says goodbye."""
    # A gloo group is a full mesh: each member holds a connection to every other.
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    workers = [
        aps.Worker(url, ENV, num_envs=1, timeouts=TIMEOUTS, allow_policy=(POLICY,))
        for _ in range(count)
    ]
    await asyncio.gather(*(w.run() for w in workers), return_exceptions=True)


async def measure(
    workers: int, path: str, hosts: int, hidden: int, versions: int
) -> dict[str, Any]:
    procs: list[asyncio.subprocess.Process] = []
    row: dict[str, Any] = {"workers": workers, "path": path}
    try:
        async with aps.Learner(
            "tcp://127.0.0.1:0",
            num_workers=workers,
            policy=POLICY,
            policy_kwargs={"hidden": hidden},
            sync=sync.AlwaysSync(),
            timeouts=TIMEOUTS,
        ) as learner:
            shares = [workers // hosts + (i < workers % hosts) for i in range(hosts)]
            for share in filter(None, shares):
                procs.append(
                    await asyncio.create_subprocess_exec(
                        sys.executable, __file__, "--host", learner.url, "--count", str(share)
                    )
                )
            await learner.wait_for_workers(timeout=300)
            await learner.reset(seed=0)
            agent = WideAgent(Spaces(), hidden)
            await learner.publish(agent)
            await learner.rollout(1)
            if path == "group":
                started = time.perf_counter()
                await learner.form_weight_group(timeout=120)
                row["form_s"] = time.perf_counter() - started
            frame = 0
            publish_bytes = publish_cpu = total_bytes = total_cpu = 0.0
            for index in range(versions + 2):
                with torch.no_grad():
                    for p in agent.parameters():
                        p.add_(1e-3)
                bytes0, cpu0 = written(), cpu_seconds()
                version = await learner.publish(agent)
                bytes1, cpu1 = written(), cpu_seconds()
                await learner.rollout(1)
                bytes2, cpu2 = written(), cpu_seconds()
                if index >= 2:  # two warm-up versions
                    publish_bytes += bytes1 - bytes0
                    publish_cpu += cpu1 - cpu0
                    total_bytes += bytes2 - bytes0
                    total_cpu += cpu2 - cpu0
                frame = len(learner._detach.versions.frame(version))  # type: ignore[union-attr]
            group = learner.weight_group
            row.update(
                frame_bytes=frame,
                publish_copies=publish_bytes / versions / frame,
                publish_cpu_ms=1e3 * publish_cpu / versions,
                copies=total_bytes / versions / frame,
                cpu_ms=1e3 * total_cpu / versions,
                group_intact=group is not None if path == "group" else None,
                learner_rss_bytes=rss_bytes(),
            )
    finally:
        for proc in procs:
            try:
                async with asyncio.timeout(60):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()
    return row


def render(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| path | workers | learner's copies per version | CPU ms per version | vs 1 worker: "
        "bytes, CPU | publish alone: copies, CPU ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['path']} | {row['workers']} | {row['copies']:.2f} | {row['cpu_ms']:.1f} "
            f"| {row['bytes_ratio']:.2f}x, {row['cpu_ratio']:.2f}x "
            f"| {row['publish_copies']:.2f}, {row['publish_cpu_ms']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--workers", type=parse_ints, default=[1, 8, 64])
    p.add_argument("--paths", default="sessions,group")
    p.add_argument("--hosts", type=int, default=4, help="worker processes (default 4)")
    p.add_argument("--megabytes", type=float, default=6.7)
    p.add_argument("--versions", type=int, default=5, help="measured versions (default 5)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--host", help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.host:
        run_loop(host(args.host, args.count))
        return 0
    hidden = hidden_for(args.megabytes)
    rows = []
    for path in args.paths.split(","):
        base: dict[str, Any] | None = None
        for count in args.workers:
            row = run_loop(measure(count, path, args.hosts, hidden, args.versions))
            base = base or row
            row["bytes_ratio"] = row["copies"] / base["copies"]
            row["cpu_ratio"] = row["cpu_ms"] / base["cpu_ms"]
            rows.append(row)
            print(render([row]).splitlines()[-1], flush=True)
    print()
    print(render(rows))
    if args.json is not None:
        report = {
            "benchmark": "weight_group",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": " ".join(["weight_group.py", *(argv or sys.argv[1:])]),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
            "megabytes": args.megabytes,
            "rows": rows,
        }
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
