"""CPU milliseconds per trajectory gradient of aps.learner.simulate (NIGT in virtual time).

Usage: python benchmarks/simulate_speed.py ENV N [--iterations 10] [--horizon 50]
[--threads 1] [--pool 64]. Runs Rennala(batch=30) with h_i = H sqrt(i) and the paper's MLP
policy (experiments.nigt) and prints CPU time (time.process_time) and wall time per
trajectory gradient used. Env creation is included.
"""

from __future__ import annotations

import argparse
import math
import time

import gymnasium as gym
import torch

from aps import pg
from aps.learner.simulate import simulate
from experiments.nigt.__main__ import Agent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("env")
    parser.add_argument("workers", type=int)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--horizon", type=int, default=50)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--pool", type=int, default=64)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    probe = gym.make(args.env)
    agent = Agent(probe.observation_space, probe.action_space)
    h = [args.horizon * math.sqrt(i) for i in range(1, args.workers + 1)]
    cpu, wall, used = time.process_time(), time.perf_counter(), 0
    for r in simulate(
        agent,
        lambda: gym.make(args.env),
        h=h,
        aggregator=pg.Rennala(batch=30),
        horizon=args.horizon,
        iterations=args.iterations,
        pool=args.pool,
    ):
        used += r.used
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    print(
        f"{args.env} n={args.workers} trajectories={used} threads={torch.get_num_threads()} "
        f"cpu_ms_per_traj={1000 * cpu / used:.2f} wall_ms_per_traj={1000 * wall / used:.2f}"
    )


if __name__ == "__main__":
    main()
