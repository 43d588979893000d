"""What one APS sync decision costs the learner: the divergence's two forward passes.

A DETACH learner asks its sync strategy, before each rollout request to a worker that acts
with an older version, whether to send the newest one; APS answers by measuring the mean
``KL(pi_worker || pi_learner)`` on the states of the worker's latest chunk
(:meth:`aps.learner.rollouts.PolicyVersions.divergence`), two forward passes with no
gradient, on the learner's event loop. Always-sync and fixed intervals never measure.

For each workload it builds the policy, publishes two versions that differ, and times one
decision on a chunk of ``T x E`` states (the probe reloaded each time, as when workers hold
different versions), once with every state up to 1024 (``max_sample_bytes`` unbounded: how
aps measured before the byte budget) and once with the default budget
(:meth:`~aps.learner.rollouts.PolicyVersions.states_for`):

- ``cartpole``: CleanRL's 64-64 MLP agent, 128 x 8 states of 4 floats;
- ``pong``: ``aps.policy.NatureCNN``, 128 x 8 Atari frames of 4 x 84 x 84 bytes.

It reports the states measured, the milliseconds per decision (median of ``--repeats``) and
the KL, per torch thread count in ``--threads``.

    python benchmarks/decision_cost.py --json benchmarks/results/decision-cost.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np


def workload(name: str) -> tuple[Any, Any, np.ndarray]:
    """The agent, its one-env spaces stand-in and a chunk's observations for ``name``."""
    from torch import nn

    from aps.policy import NatureCNN

    rng = np.random.default_rng(0)
    if name == "pong":
        obs_space = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
        chunk = rng.integers(0, 256, (128, 8, 4, 84, 84), dtype=np.uint8)
    else:
        obs_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
        chunk = rng.standard_normal((128, 8, 4)).astype(np.float32)

    class Spaces:
        single_observation_space = obs_space
        single_action_space = gym.spaces.Discrete(6 if name == "pong" else 2)

    if name == "pong":
        return NatureCNN(Spaces()), Spaces, chunk

    class Agent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.critic = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 1))
            self.actor = nn.Sequential(
                nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2)
            )

    return Agent(), Spaces, chunk


def measure(name: str, budget: int | None, repeats: int) -> dict[str, Any]:
    import torch

    from aps.learner.rollouts import PolicyVersions, sample_states

    torch.manual_seed(0)  # the same two versions for both budgets
    agent, spaces, chunk = workload(name)
    kwargs = {} if budget is not None else {"max_sample_bytes": 2**62}
    versions = PolicyVersions(spaces.single_observation_space, spaces.single_action_space, **kwargs)
    versions.publish(agent)
    with torch.no_grad():
        for parameter in agent.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
    versions.publish(agent)
    states = versions.states_for(chunk)
    versions.divergence(1, sample_states(chunk, states))  # warm: both copies loaded once
    times = []
    for _ in range(repeats):
        versions._probe_version = -1  # another worker's version measured in between
        start = time.perf_counter()
        kl = versions.divergence(1, sample_states(chunk, states))
        times.append(time.perf_counter() - start)
    return {
        "workload": name,
        "budget": "default" if budget is not None else "none (max_states only)",
        "states": states,
        "ms": 1e3 * statistics.median(times),
        "kl": kl,
    }


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="cartpole,pong")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    rows = []
    print("| workload | torch threads | states measured | ms per decision | KL |")
    print("|---|---:|---:|---:|---:|")
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        for name in args.workloads.split(","):
            for budget in (None, 1):
                row = {"threads": threads, **measure(name, budget, args.repeats)}
                rows.append(row)
                print(
                    f"| {name}, budget {row['budget']} | {threads} | {row['states']} "
                    f"| {row['ms']:.1f} | {row['kl']:.2e} |",
                    flush=True,
                )
    if args.json is not None:
        report = {
            "benchmark": "decision_cost",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": " ".join(["decision_cost.py", *(argv or sys.argv[1:])]),
            "machine": {
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "torch": torch.__version__,
            },
            "rows": rows,
        }
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
