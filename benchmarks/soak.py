"""Soak: a learner steps worker processes for a long time while workers die and links drop.

``--workers`` worker processes (``python -m aps worker``) step CartPole for a learner with
``on_worker_lost="wait"``. They dial it through :class:`aps.testing.Relay`, so that every
``--cut-every`` seconds every connection can be reset (the workers resume their sessions),
and every ``--kill-every`` seconds one worker is killed with SIGKILL and a new process is
started (it takes the lost worker's envs). The learner steps random actions all along.

At the end it reports env-steps, steps/s, resumes, restarts, errors, and the resident memory
(RSS) of the learner process and of the workers: the peak over the first and over the last
tenth of the run, and the growth between them, which should stay under 10%. A step that
raises, or a step that takes longer than ``--step-deadline``, ends the run as an error.

Usage::

    python benchmarks/soak.py                      # 10 minutes, 4 workers x 16 envs
    python benchmarks/soak.py --minutes 1 --kill-every 10 --cut-every 7
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from throughput import machine, write_json

import aps
from aps.launch.local import terminate
from aps.session._loop import run
from aps.testing import Relay

ROOT = Path(__file__).resolve().parent
DEFAULT_JSON = ROOT / "results" / "soak.json"
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss(pid: int) -> int | None:
    """Resident bytes of process ``pid`` now (Linux), or ``None`` when it is gone."""
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return None


def start_worker(url: str, envs: int, token: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "aps", "worker", url, "--env", "CartPole-v1"]
    return subprocess.Popen(
        [*command, "--num-envs", str(envs)],
        env={**os.environ, "APS_TOKEN": token},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.processes: list[subprocess.Popen[bytes]] = []
        self.samples: list[tuple[float, int, int]] = []  # (seconds, learner RSS, worker RSS)
        self.kills = 0
        self.cuts = 0
        self.errors: list[str] = []

    async def run(self) -> dict[str, Any]:
        args = self.args
        token = os.urandom(16).hex()
        timeouts = aps.Timeouts(step=args.step_deadline, heartbeat_timeout=30.0)
        async with aps.Learner(
            "tcp://127.0.0.1:0",
            num_workers=args.workers,
            token=token,
            timeouts=timeouts,
            on_worker_lost="wait",
            reconnect_timeout=60.0,
        ) as learner:
            relay = Relay(learner.url)
            await relay.start()
            try:
                self.processes = [
                    start_worker(relay.url, args.envs, token) for _ in range(args.workers)
                ]
                await learner.wait_for_workers(timeout=120)
                return await self._soak(learner, relay, token)
            finally:
                await relay.aclose()
                terminate(self.processes, 5.0)

    async def _soak(self, learner: aps.Learner, relay: Relay, token: str) -> dict[str, Any]:
        args = self.args
        rng = np.random.default_rng(0)
        pool = [rng.integers(0, 2, size=learner.num_envs) for _ in range(64)]
        await learner.reset(seed=0)
        steps = restarted_envs = 0
        started = time.monotonic()
        duration = args.minutes * 60.0
        next_kill = started + args.kill_every
        next_cut = started + args.cut_every
        next_sample = started
        while (now := time.monotonic()) - started < duration:
            if now >= next_sample:
                self._sample(now - started)
                next_sample += 1.0
            if now >= next_kill:
                self._kill_one(learner, relay.url, token, rng)
                next_kill += args.kill_every
            if now >= next_cut:
                relay.cut()
                self.cuts += 1
                next_cut += args.cut_every
            try:
                *_, info = await asyncio.wait_for(
                    learner.step(pool[steps % len(pool)]), args.step_deadline
                )
            except (aps.ApsError, TimeoutError) as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
                break
            steps += 1
            if "worker_restarted" in info:
                restarted_envs += int(np.count_nonzero(info["worker_restarted"]))
        elapsed = time.monotonic() - started
        self._sample(elapsed)
        metrics = learner.metrics
        return {
            "seconds": round(elapsed, 1),
            "steps": steps,
            "env_steps": steps * learner.num_envs,
            "env_steps_per_s": round(steps * learner.num_envs / elapsed, 1),
            "kills": self.kills,
            "cuts": self.cuts,
            "restarts": learner.restarts,
            "restarted_envs_reported": restarted_envs,
            "resumes": sum(w.resumes for w in metrics.workers),
            "errors": self.errors,
            "memory": self._memory(),
        }

    def _kill_one(
        self, learner: aps.Learner, url: str, token: str, rng: np.random.Generator
    ) -> None:
        serving = {w.pid for w in learner.workers}
        alive = [p for p in self.processes if p.poll() is None and p.pid in serving]
        if not alive:
            return
        victim = alive[int(rng.integers(len(alive)))]
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=10)
        self.processes.remove(victim)
        self.processes.append(start_worker(url, self.args.envs, token))
        self.kills += 1

    def _sample(self, seconds: float) -> None:
        learner = rss(os.getpid()) or 0
        workers = max((rss(p.pid) or 0 for p in self.processes), default=0)
        self.samples.append((seconds, learner, workers))

    def _memory(self) -> dict[str, Any]:
        """Peak RSS over the first and the last tenth of the run, per kind of process."""
        total = self.samples[-1][0]
        window = max(total / 10, 5.0)
        first = [s for s in self.samples if s[0] <= window]
        last = [s for s in self.samples if s[0] >= total - window]
        report: dict[str, Any] = {"window_s": round(window, 1)}
        for index, name in ((1, "learner"), (2, "largest_worker")):
            start = max(s[index] for s in first)
            end = max(s[index] for s in last)
            report[name] = {
                "start_mib": round(start / 2**20, 1),
                "end_mib": round(end / 2**20, 1),
                "growth_pct": round(100 * (end - start) / start, 1) if start else None,
            }
        return report


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="how long (default 10)")
    p.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    p.add_argument("--envs", type=int, default=16, help="envs per worker (default 16)")
    p.add_argument("--kill-every", type=float, default=30.0, help="seconds between kills (30)")
    p.add_argument("--cut-every", type=float, default=20.0, help="seconds between cuts (20)")
    p.add_argument(
        "--step-deadline", type=float, default=120.0, help="longest step before it is an error"
    )
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write the result")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    soak = Soak(args)
    result = run(soak.run())
    result["config"] = {k: v for k, v in vars(args).items() if k != "json"}
    result["machine"] = machine()
    print(json.dumps(result, indent=2))
    write_json(args.json, result)
    memory = result["memory"]
    for name in ("learner", "largest_worker"):
        growth = memory[name]["growth_pct"]
        verdict = "held" if growth is not None and growth < 10 else "NOT held"
        print(f"{name} RSS growth {growth}% (target < 10%): {verdict}")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
