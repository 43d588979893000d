"""CPU microseconds of a worker's step, encode and decode, NextStep against SameStep.

Usage: python benchmarks/samestep.py [--env CartPole-v1] [--envs 32] [--repeats 7]
[--steps 2000] [--messages 1000]. In one process, for each autoreset mode: the worker's
vector env (``aps.vector.LeanSyncVectorEnv``, ``copy=False``) stepped with random actions
from a pool made beforehand, then ``aps.wire.codec.encode`` of the ``StepResult`` messages of
``--messages`` such steps and ``aps.wire.codec.decode`` of their frames. Prints the median over
``--repeats`` of the CPU time (``time.process_time``) per call, the range, and the mean
frame size. SameStep's extra cost is its infos: ``final_obs`` (an object array) and the
masks of the envs that ended on the step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode

from aps.vector import LeanSyncVectorEnv
from aps.wire import codec
from aps.wire.messages import StepResult


def per_call(run: Callable[[], Any], calls: int, repeats: int) -> list[float]:
    """CPU microseconds per call of ``run`` (which makes ``calls`` calls), once per repeat."""
    times = []
    for _ in range(repeats):
        start = time.process_time()
        run()
        times.append((time.process_time() - start) / calls * 1e6)
    return times


def measure(mode: AutoresetMode, args: argparse.Namespace) -> None:
    """Measure one autoreset mode and print its row."""
    envs = LeanSyncVectorEnv(
        [lambda: gym.make(args.env)] * args.envs, copy=False, autoreset_mode=mode
    )
    envs.action_space.seed(0)
    envs.reset(seed=0)
    actions = [envs.action_space.sample() for _ in range(64)]
    messages = []
    for i in range(args.messages):
        obs, reward, terminated, truncated, info = envs.step(actions[i % 64])
        # copy=False reuses the observation buffer; the infos are fresh every step.
        messages.append(
            StepResult(
                obs=obs.copy(),
                reward=reward,
                terminated=terminated,
                truncated=truncated,
                info=info,
                seq=i,
            )
        )
    frames = [codec.encode(message) for message in messages]

    def step() -> None:
        for i in range(args.steps):
            envs.step(actions[i % 64])

    def encode() -> None:
        for message in messages:
            codec.encode(message)

    def decode() -> None:
        for frame in frames:
            codec.decode(frame)

    results = {
        "step": per_call(step, args.steps, args.repeats),
        "encode": per_call(encode, len(messages), args.repeats),
        "decode": per_call(decode, len(frames), args.repeats),
    }
    envs.close()
    cells = [
        f"{name} {statistics.median(t):7.1f} [{min(t):.1f}-{max(t):.1f}]"
        for name, t in results.items()
    ]
    size = np.mean([len(frame) for frame in frames])
    print(f"{mode.value:9s} " + "  ".join(cells) + f"  frame {size:.0f} B")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--env", default="CartPole-v1")
    parser.add_argument("--envs", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--messages", type=int, default=1000)
    args = parser.parse_args()
    print(f"{args.env}, {args.envs} envs, CPU us per call: median of {args.repeats} [range]")
    for mode in (AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP):
        measure(mode, args)


if __name__ == "__main__":
    main()
