"""What a live view (``aps top``) costs a learner with many workers, and how fast it answers.

A learner with ``--workers`` workers (CartPole, one env each, as asyncio tasks in two worker
processes) holds them connected (heartbeats only), or with ``--step`` steps them in lockstep
as fast as they answer. For ``--seconds`` the learner runs alone, then as long again with a
live view asking for its figures every second, in ``--rounds`` alternating rounds; its
process's CPU time is read in each phase. Idle, the view's cost stands out of the learner's
own; stepping, a core's worth of lockstep hides it in the noise. Reported: the
learner's CPU share with and without the view, the view's extra share of one core (goal:
under 1%), and the view's answer times (goal: a refresh within 1 s).

Usage::

    python benchmarks/top_cost.py --workers 64 --seconds 20 --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import time
from typing import Any

import numpy as np

import aps
from aps.cli._probe import watch_learner

TOKEN = "top-cost-benchmark-token-0123456789abcdef"


def workers_process(url: str, count: int) -> None:
    """``count`` workers as tasks of one process, serving until the learner closes."""

    async def serve() -> None:
        tasks = [
            asyncio.create_task(aps.Worker(url, "CartPole-v1", num_envs=1, token=TOKEN).run())
            for _ in range(count)
        ]
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(serve())


def view_process(url: str, seconds: float, out: Any) -> None:
    """A live view in a process of its own (its CPU is not the learner's): answer times."""

    async def view() -> list[float]:
        answers: list[float] = []
        async with watch_learner(url, token=TOKEN) as live:
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                asked = time.perf_counter()
                await live.figures()
                answers.append(time.perf_counter() - asked)
                await asyncio.sleep(max(0.0, 1.0 - (time.perf_counter() - asked)))
        return answers

    out.put(asyncio.run(view()))


async def phase(
    learner: aps.Learner, seconds: float, watch: bool, url: str, step: bool
) -> dict[str, Any]:
    """Run ``seconds`` (with a view asking each second when ``watch``); the CPU used."""
    actions = np.zeros(learner.num_envs, np.int64)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    viewer = None
    if watch:
        viewer = context.Process(target=view_process, args=(url, seconds, queue))
        viewer.start()
        await asyncio.sleep(2.0)  # the view's process starts and connects before the timing
    cpu, start = time.process_time(), time.perf_counter()
    steps = 0
    while time.perf_counter() - start < seconds - (2.0 if watch else 0.0):
        if step:
            await learner.step(actions)
            steps += 1
        else:
            await asyncio.sleep(0.1)
    elapsed, used = time.perf_counter() - start, time.process_time() - cpu
    answers: list[float] = []
    if viewer is not None:
        answers = await asyncio.to_thread(queue.get, True, 60)
        viewer.join(30)
    return {
        "watch": watch,
        "seconds": elapsed,
        "cpu_share": used / elapsed,
        "steps_per_second": steps / elapsed,
        "answers": len(answers),
        "answer_ms_max": 1e3 * max(answers, default=float("nan")),
        "answer_ms_median": 1e3 * statistics.median(answers) if answers else None,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    async with aps.Learner("tcp://127.0.0.1:0", num_workers=args.workers, token=TOKEN) as learner:
        context = multiprocessing.get_context("spawn")
        halves = [args.workers // 2, args.workers - args.workers // 2]
        processes = [context.Process(target=workers_process, args=(learner.url, n)) for n in halves]
        for process in processes:
            process.start()
        try:
            await learner.reset(seed=0)
            phases = []
            for index in range(args.rounds):
                for watch in (False, True) if index % 2 == 0 else (True, False):
                    phases.append(await phase(learner, args.seconds, watch, learner.url, args.step))
                    print(phases[-1], flush=True)
        finally:
            await learner.aclose()
            for process in processes:
                process.join(30)
                if process.is_alive():
                    process.kill()
    alone = [p["cpu_share"] for p in phases if not p["watch"]]
    watched = [p["cpu_share"] for p in phases if p["watch"]]
    extra = [w - a for w, a in zip(watched, alone, strict=True)]
    return {
        "benchmark": "top_cost",
        "command": " ".join(sys.argv),
        "workers": args.workers,
        "phases": phases,
        "cpu_share_alone_median": statistics.median(alone),
        "cpu_share_watched_median": statistics.median(watched),
        "view_extra_cpu_share_per_round": extra,
        "view_answer_ms_max": max(p["answer_ms_max"] for p in phases if p["watch"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step", action="store_true", help="step the workers meanwhile")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    report = asyncio.run(run(args))
    print(
        f"{args.workers} workers: learner CPU {report['cpu_share_alone_median']:.1%} of a core "
        f"alone, {report['cpu_share_watched_median']:.1%} watched; the view's share per round "
        f"{[f'{x:+.2%}' for x in report['view_extra_cpu_share_per_round']]}; slowest answer "
        f"{report['view_answer_ms_max']:.1f} ms"
    )
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=2)


if __name__ == "__main__":
    main()
