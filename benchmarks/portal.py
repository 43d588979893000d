"""What the blocking facade pays per call to reach its event loop, against a thread hand-off.

``ClusterEnv``'s blocking calls run coroutines on aps's event loop (``aps.session._portal``). A loop
on a private thread costs two thread hand-offs per call; borrowing the loop, as ``ClusterEnv``
does (the caller's thread runs it for the length of the call), costs a restart of the loop.
This script measures, in one run:

- ``floor``: two Python threads passing a turn back and forth through two locks, the least a
  round trip between threads costs in CPython on this host (two wake-ups, two GIL hand-offs);
- ``hand-off``: ``Portal.submit(...).result()`` of a coroutine that does nothing (the keeper
  thread runs it), on uvloop and on asyncio's own loop: the floor plus aps's hand-off code;
- ``borrowed``: ``Portal.call`` of the same coroutine (the caller's thread runs the loop);
- ``reentry``: a bare ``run_until_complete`` of it, from the main thread and from another
  thread, on both loops (uvloop sets up its signal handling each time it starts in the main
  thread);
- ``step``: two ``ClusterEnv.local`` envs alive at once (asyncio's loop, the default, and
  uvloop), ``--envs`` envs on each of ``--workers`` workers (CartPole-v1), stepped in
  alternating windows five ways (:data:`STEPPERS`): ``ClusterEnv.step`` on each loop, a
  hand-off per step on uvloop (the design before the loop was borrowed), and an await loop
  of ``Learner.step`` on each env's own loop (``ClusterEnv.call_learner``). Each is
  reported against the await loop on uvloop, the fastest way aps steps, and the default
  ``ClusterEnv`` also against the await loop on its own loop: the median of the same-round
  ratios with a 95% bootstrap interval (many short windows narrow it more than few long
  ones: the host's load drifts less within a round).

The ceiling a design that crosses threads once each way could reach is
``await_step / (await_step + floor)``; it is printed with the ratios.

Usage::

    python benchmarks/portal.py                      # about three minutes
    python benchmarks/portal.py --calls 5000 --rounds 5 --json results/portal.json

Figures move with load; nothing asserts on them.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import aps
from aps.session._loop import new_event_loop
from aps.session._portal import Portal

ENV = "CartPole-v1"


def floor(calls: int) -> float:
    """µs per round trip of a turn passed between two threads through two locks."""
    mine, theirs = threading.Lock(), threading.Lock()
    mine.acquire()
    theirs.acquire()

    def other() -> None:
        for _ in range(calls):
            mine.acquire()
            theirs.release()

    thread = threading.Thread(target=other)
    thread.start()
    start = time.perf_counter()
    for _ in range(calls):
        mine.release()
        theirs.acquire()
    elapsed = time.perf_counter() - start
    thread.join()
    return elapsed / calls * 1e6


async def _nothing() -> None:
    return None


def portal(calls: int, use_uvloop: bool, borrowed: bool) -> float:
    """µs per call of a coroutine that does nothing: ``Portal.call``, or a hand-off."""
    through = Portal(use_uvloop)
    try:
        start = time.perf_counter()
        if borrowed:
            for _ in range(calls):
                through.call(_nothing())
        else:
            for _ in range(calls):
                through.submit(_nothing()).result()
        return (time.perf_counter() - start) / calls * 1e6
    finally:
        through.close()


def reentry(calls: int, use_uvloop: bool, main_thread: bool) -> float:
    """µs per start and stop of an event loop, in this thread or another, around a no-op."""
    result: list[float] = []

    def measure() -> None:
        loop = new_event_loop(use_uvloop)
        try:
            start = time.perf_counter()
            for _ in range(calls):
                loop.run_until_complete(_nothing())
            result.append((time.perf_counter() - start) / calls * 1e6)
        finally:
            loop.close()

    if main_thread:
        measure()
    else:
        thread = threading.Thread(target=measure)
        thread.start()
        thread.join()
    return result[0]


STEPPERS = (
    "ClusterEnv.step, asyncio (default)",
    "ClusterEnv.step, uvloop",
    "hand-off per step, uvloop",
    "await Learner.step, uvloop",
    "await Learner.step, asyncio",
)
"""The ways ``step`` measures; ratios are taken against the await loop on uvloop."""


def step(calls: int, rounds: int, workers: int, envs: int) -> dict[str, Any]:
    """Every way of :data:`STEPPERS`, two envs alive at once, windows alternating.

    The hand-off steps the uvloop env through ``Portal.submit(...).result()``: the keeper
    thread runs the loop and each step crosses threads twice, as every blocking call did
    before the loop was borrowed (plus a lock and a notify the old portal did not take).
    """
    rng = np.random.default_rng(0)
    actions = [rng.integers(0, 2, size=workers * envs) for _ in range(64)]
    envs_of = {
        uv: aps.ClusterEnv.local(ENV, num_workers=workers, envs_per_worker=envs, use_uvloop=uv)
        for uv in (False, True)
    }

    async def await_loop(learner: aps.Learner) -> None:
        for i in range(calls):
            await learner.step(actions[i % 64])

    def blocking(env: aps.ClusterEnv) -> Callable[[], None]:
        def run() -> None:
            for i in range(calls):
                env.step(actions[i % 64])

        return run

    def handed(env: aps.ClusterEnv) -> Callable[[], None]:
        portal, learner = env._portal, env._learner

        def run() -> None:
            for i in range(calls):
                portal.submit(learner.step(actions[i % 64])).result()

        return run

    def awaited(env: aps.ClusterEnv) -> Callable[[], None]:
        return lambda: env.call_learner(await_loop)

    runs: dict[str, Callable[[], None]] = dict(
        zip(
            STEPPERS,
            (
                blocking(envs_of[False]),
                blocking(envs_of[True]),
                handed(envs_of[True]),
                awaited(envs_of[True]),
                awaited(envs_of[False]),
            ),
            strict=True,
        )
    )
    per_call: dict[str, list[float]] = {name: [] for name in runs}
    try:
        for env in envs_of.values():
            env.reset(seed=0)
        for run in runs.values():
            run()  # warm-up
        for round_ in range(rounds):
            order = list(runs) if round_ % 2 == 0 else list(reversed(runs))
            for name in order:
                start = time.perf_counter()
                runs[name]()
                per_call[name].append((time.perf_counter() - start) / calls * 1e6)
    finally:
        for env in envs_of.values():
            env.close()
    base = per_call["await Learner.step, uvloop"]
    ratios = {name: [b / us for b, us in zip(base, v, strict=True)] for name, v in per_call.items()}
    same_loop = [
        b / us
        for b, us in zip(
            per_call["await Learner.step, asyncio"],
            per_call["ClusterEnv.step, asyncio (default)"],
            strict=True,
        )
    ]
    return {
        "workers": workers,
        "envs_per_worker": envs,
        "us_per_call": per_call,
        "ratio_per_round": ratios,  # the await loop on uvloop's µs over each way's, per round
        "median_ratio": {name: statistics.median(r) for name, r in ratios.items()},
        "median_ratio_95ci": {name: median_interval(r) for name, r in ratios.items()},
        # ClusterEnv's default against the await loop on the same (asyncio's) loop
        "same_loop_ratio_per_round": same_loop,
        "same_loop_median_ratio": statistics.median(same_loop),
        "same_loop_median_ratio_95ci": median_interval(same_loop),
    }


def median_interval(values: Sequence[float], resamples: int = 2000) -> tuple[float, float]:
    """A 95% bootstrap interval of the median of ``values`` (fixed seed: reruns agree)."""
    draw = random.Random(0)
    medians = sorted(
        statistics.median(draw.choices(values, k=len(values))) for _ in range(resamples)
    )
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--calls", type=int, default=3000, help="calls per window (default 3000)")
    p.add_argument("--rounds", type=int, default=3, help="windows per measurement (default 3)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--envs", type=int, default=1, help="envs per worker (default 1)")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    args = p.parse_args(argv)

    def median_of(measure: Callable[[], float]) -> float:
        return statistics.median(measure() for _ in range(args.rounds))

    n = args.calls * 4  # the hand-offs are short: more calls per window
    handoff = {
        "floor": median_of(lambda: floor(n)),
        "hand-off uvloop": median_of(lambda: portal(n, True, False)),
        "hand-off asyncio": median_of(lambda: portal(n, False, False)),
        "borrowed uvloop": median_of(lambda: portal(n, True, True)),
        "borrowed asyncio": median_of(lambda: portal(n, False, True)),
        "reentry uvloop main thread": median_of(lambda: reentry(n, True, True)),
        "reentry uvloop other thread": median_of(lambda: reentry(n, True, False)),
        "reentry asyncio main thread": median_of(lambda: reentry(n, False, True)),
        "reentry asyncio other thread": median_of(lambda: reentry(n, False, False)),
    }
    print("µs per call (median of", args.rounds, "windows):")
    for name, us in handoff.items():
        print(f"  {name:30} {us:7.1f}")
    stepped = step(args.calls, args.rounds, args.workers, args.envs)
    base = statistics.median(stepped["us_per_call"]["await Learner.step, uvloop"])
    ceiling = base / (base + handoff["floor"])
    print(f"{ENV} {args.workers} x {args.envs}, µs per step and the await loop on uvloop's")
    print("µs over each way's (median of the same-round ratios, min-max, 95% interval):")
    for name, us in stepped["us_per_call"].items():
        ratios = stepped["ratio_per_round"][name]
        low, high = stepped["median_ratio_95ci"][name]
        print(
            f"  {name:36} {statistics.median(us):8.1f}   {statistics.median(ratios):.2f} "
            f"({min(ratios):.2f}-{max(ratios):.2f}; 95% interval of the median "
            f"{low:.2f}-{high:.2f})"
        )
    low, high = stepped["same_loop_median_ratio_95ci"]
    print(
        "ClusterEnv.step against the await loop on the same (asyncio's) loop: "
        f"{stepped['same_loop_median_ratio']:.2f} (95% interval {low:.2f}-{high:.2f})"
    )
    print(f"crossing threads once each way would allow at most {ceiling:.2f}")
    if args.json:
        record = {
            "command": "python benchmarks/portal.py "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "python": sys.version.split()[0],
            "handoff_us": handoff,
            "step": stepped,
            "ceiling": ceiling,
        }
        with open(args.json, "w") as out:
            json.dump(record, out, indent=2)
            out.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
