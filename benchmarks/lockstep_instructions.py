"""Instructions per lockstep worker step, counted by valgrind: a figure that load cannot move.

CPU time per step moves by tens of percent on a shared machine; an instruction count does not.
This script runs ``await Learner.step`` with the learner and its workers (``aps.Worker``
tasks, CartPole-v1, ``--envs`` envs each, 1 by default) in one process, over TCP on 127.0.0.1, under
``valgrind --tool=cachegrind``, twice: ``--steps`` timed steps and ``--steps + --extra``
steps, after the same start-up and warm-up. The difference of the two counts, divided by
``--extra`` and by the number of workers, is the user-space instructions of one worker step,
learner and worker sides together (codec, session, transport, event loop, the env's step).
Kernel work (the syscalls) is not counted.

Counts under valgrind are not CPU time (valgrind runs its own CPU model, and numpy may take
other code paths under it); compare them with each other, between two versions of aps, not
with the µs of other benchmarks.

Usage::

    python benchmarks/lockstep_instructions.py              # 2 workers, 100 and 1,100 steps
    python benchmarks/lockstep_instructions.py --workers 1 --extra 2000
    python benchmarks/lockstep_instructions.py --envs 64   # per-byte costs too

Needs ``valgrind`` on the path; takes about a minute. Nothing asserts on the result.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence

import numpy as np

import aps
from aps.session._loop import run as run_loop

ENV = "CartPole-v1"
WARMUP = 200  # steps before the counted ones, in both runs


async def _steps(workers: int, envs: int, steps: int) -> None:
    async with aps.Learner("tcp://127.0.0.1:0", num_workers=workers) as learner:
        tasks = [
            asyncio.create_task(aps.Worker(learner.url, ENV, num_envs=envs).run())
            for _ in range(workers)
        ]
        await learner.wait_for_workers(timeout=60)
        await learner.reset(seed=0)
        actions = [np.arange(i, i + workers * envs) % 2 for i in range(64)]
        for i in range(WARMUP + steps):
            await learner.step(actions[i % 64])
    await asyncio.wait(tasks, timeout=10)


def _count(workers: int, envs: int, steps: int) -> int:
    """Instructions of one run of this script's inner mode under cachegrind."""
    command = ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null"]
    command += [sys.executable, __file__, "--inner", str(steps), "--workers", str(workers)]
    command += ["--envs", str(envs)]
    env = {**os.environ, "PYTHONHASHSEED": "0"}  # the same dict layouts in both runs
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    found = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"valgrind run failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--envs", type=int, default=1, help="envs per worker (default 1)")
    p.add_argument("--steps", type=int, default=100, help="steps of the shorter run")
    p.add_argument("--extra", type=int, default=1000, help="steps the longer run adds")
    p.add_argument("--inner", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.inner is not None:
        run_loop(_steps(args.workers, args.envs, args.inner))
        return 0
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not on the path; install it to count instructions")
    short = _count(args.workers, args.envs, args.steps)
    long = _count(args.workers, args.envs, args.steps + args.extra)
    per_step = (long - short) / args.extra / args.workers
    print(
        f"{ENV}, {args.workers} workers x {args.envs} envs, learner and workers in one process "
        "over TCP: "
        f"{per_step:,.0f} instructions per worker step "
        f"({long:,} - {short:,} over {args.extra} steps)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
