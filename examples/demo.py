"""Demo: step CartPole-v1 on 2 local worker processes over TCP and report steps/second.

python examples/demo.py [--workers 2] [--envs-per-worker 64] [--seconds 10]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import aps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="CartPole-v1")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--envs-per-worker", type=int, default=64)
    parser.add_argument("--transport", default="tcp", choices=["tcp", "ws", "memory"])
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()

    print(
        f"starting {args.workers} workers x {args.envs_per_worker} {args.env} over {args.transport}"
    )
    envs = aps.ClusterEnv.local(
        args.env,
        num_workers=args.workers,
        envs_per_worker=args.envs_per_worker,
        transport=args.transport,
        seed=0,
    )
    try:
        for w in envs.workers:
            last = w.env_offset + w.num_envs - 1
            print(f"  worker {w.worker_id}: pid {w.pid}, envs {w.env_offset}..{last}")
        envs.reset()
        envs.action_space.seed(0)
        rng = np.random.default_rng(0)
        n = envs.single_action_space.n  # type: ignore[attr-defined]
        steps = episodes = 0
        start = last = time.perf_counter()
        while (now := time.perf_counter()) - start < args.seconds:
            actions = rng.integers(0, n, size=envs.num_envs)
            _, _, terminated, truncated, _ = envs.step(actions)
            steps += envs.num_envs
            episodes += int(np.count_nonzero(terminated | truncated))
            if now - last >= 0.5:
                last = now
                done = min((now - start) / args.seconds, 1.0)
                bar = "#" * int(30 * done)
                print(
                    f"\r[{bar:<30}] {steps:>9,} env-steps  {episodes:>6,} episodes  "
                    f"{steps / (now - start):>9,.0f} steps/s",
                    end="",
                    flush=True,
                )
        elapsed = time.perf_counter() - start
    finally:
        envs.close()
    print(f"\n{steps:,} env-steps in {elapsed:.1f} s: {steps / elapsed:,.0f} env-steps/second")


if __name__ == "__main__":
    sys.exit(main())
