"""CPU time per lockstep worker step: aps's ``await Learner.step`` against the transport limit.

The matrix's CPU column sums every process; this script splits it. It runs two contenders
of the matrix (``benchmarks/matrix.py``), built the same way, at one column (CartPole-v1 on
2 workers x 1 env by default):

- ``transport-limit``: aps's step messages over asyncio TCP with pre-built replies, no env,
  no aps session, learner or worker code (see ``contenders.py``);
- ``step-limit``: the same, with workers that step their real envs (aps's vector env) and
  encode each result: everything a lockstep step must do, with no aps code;
- ``aps-tcp-async``: ``await aps.Learner.step`` with ``python -m aps worker`` subprocesses.

For each timed window it reads the CPU time (user + system) of the learner process and of
the worker processes, and reports per worker step (one worker answering one request):

- learner µs: the learner process's CPU per worker step;
- worker µs: one worker process's CPU per step it answers.

CPU time moves much less than the rate with the load of a shared machine. ``aps`` minus
``step-limit`` is aps's own per-message cost; ``aps`` minus ``transport-limit`` adds the
env's step to it, as it costs inside a worker that also handles the messages (several times
what the same step costs in a tight loop of its own). Windows run round-robin, the medians
are printed. Nothing asserts on timings.

Usage::

    python benchmarks/lockstep_cpu.py                          # CartPole 2 x 1, 3 s x 5 rounds
    python benchmarks/lockstep_cpu.py --envs-per-worker 64 --seconds 2 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence

from contenders import ALL
from throughput import Setup, close_all, make_action_pool

CONTENDERS = ("transport-limit", "step-limit", "aps-tcp-async")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--env", default="CartPole-v1")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--envs-per-worker", type=int, default=1)
    p.add_argument("--seconds", type=float, default=3.0, help="timed window (default 3)")
    p.add_argument("--repeats", type=int, default=5, help="rounds (default 5)")
    args = p.parse_args(argv)
    setup = Setup(args.env, args.workers, args.envs_per_worker)
    pool = make_action_pool(setup)
    live = {name: ALL[name](setup, pool) for name in CONTENDERS}
    learner_us: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    worker_us: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    rates: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    try:
        for contender in live.values():
            contender.start()
            contender.run(0.5)
        for round_ in range(args.repeats):
            shift = round_ % len(CONTENDERS)
            order = list(CONTENDERS)[shift:] + list(CONTENDERS)[:shift]
            for name in order:
                contender = live[name]
                contender.run(0.0)
                window = contender.window(args.seconds)
                assert window.workers_cpu is not None, "worker CPU time needs /proc"
                worker_steps = window.env_steps // args.envs_per_worker
                learner_us[name].append(window.learner_cpu * 1e6 / worker_steps)
                worker_us[name].append(window.workers_cpu * 1e6 / worker_steps)
                rates[name].append(window.rate)
                print(
                    f"round {round_ + 1}/{args.repeats} {name:<16} {window.rate:>10,.0f} "
                    f"env-steps/s  learner {learner_us[name][-1]:6.1f} µs  "
                    f"worker {worker_us[name][-1]:6.1f} µs per worker step",
                    flush=True,
                )
    finally:
        close_all(list(live.values()))
    print()
    print(
        f"{args.env} {args.workers} x {args.envs_per_worker}, medians of {args.repeats} "
        f"windows of {args.seconds:g} s (CPU µs per worker step; rate for reference only)"
    )
    for name in CONTENDERS:
        print(
            f"  {name:<16} learner {statistics.median(learner_us[name]):6.1f} µs  "
            f"worker {statistics.median(worker_us[name]):6.1f} µs  "
            f"{statistics.median(rates[name]):>10,.0f} env-steps/s"
        )
    aps, bounds = CONTENDERS[-1], CONTENDERS[:-1]
    for bound in bounds:
        learner = statistics.median(learner_us[aps]) - statistics.median(learner_us[bound])
        worker = statistics.median(worker_us[aps]) - statistics.median(worker_us[bound])
        print(
            f"  {aps} beyond {bound}: learner {learner:+.1f} µs + worker {worker:+.1f} µs "
            f"= {learner + worker:+.1f} µs per worker step"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
