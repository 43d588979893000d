"""End to end: CleanRL's PPO on aps against the same PPO on an in-process vector env.

Three runs of the same budget, one after the other, in the same invocation, each repeated
``--repeats`` times in interleaved rounds:

- ``gym-sync``: ``examples/ppo_vector.py --backend gym-sync``, Gymnasium's ``SyncVectorEnv``
  of ``workers x envs`` envs in the learner's process (CleanRL as written): the reference.
- ``aps-lockstep``: ``examples/ppo_vector.py``, the envs on worker processes, the learner
  choosing every action (``ClusterEnv`` lockstep).
- ``aps-detach``: ``examples/ppo_cluster.py --sync aps``, the workers acting with their own
  policy copy (DETACH) under Adaptive Policy Synchronization.
- ``aps-detach-overlap``: the same with ``--overlap-rollouts``: the workers act the next
  batch while the learner trains on this one.

Each run's env-steps per second (from the learner's first reset to its last update, as the
examples print it) is divided by the reference's median. On two cores the ceiling for the
aps runs is about 2x: the reference runs envs and training on one core.

Round ``r`` runs every example with seed ``r`` (1, 2, ...), so the rounds are seeds too: the
table also gives each run's final mean return (the examples' last 50 episodes), as a mean
over the rounds with a 95% percentile-bootstrap interval. Runs that learn differently (the
overlapping one trains on batches acted one update behind) show it there.

Usage::

    python benchmarks/ppo_end_to_end.py               # 131,072 env-steps, 2 x 32 envs, 5 rounds
    python benchmarks/ppo_end_to_end.py --quick       # 16,384 env-steps, 1 round

Writes ``results/ppo_end_to_end.json``. Nothing asserts on timings.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent
EXAMPLES = ROOT.parent / "examples"
RESULTS = ROOT / "results"
SUMMARY = re.compile(r"([\d,]+) env-steps in ([\d.]+) s, ([\d,]+) env-steps/s")
FINAL = re.compile(r"final mean return ([-\d.na]+)")
RUNS = ("gym-sync", "aps-lockstep", "aps-detach", "aps-detach-overlap")


def commands(args: argparse.Namespace, seed: int) -> dict[str, list[str]]:
    shared = [
        "--env-id",
        args.env_id,
        "--total-timesteps",
        str(args.total_timesteps),
        "--workers",
        str(args.workers),
        "--envs-per-worker",
        str(args.envs_per_worker),
        "--num-steps",
        str(args.num_steps),
        "--seed",
        str(seed),
    ]
    vector = [sys.executable, str(EXAMPLES / "ppo_vector.py"), *shared]
    every = {
        "gym-sync": [*vector, "--backend", "gym-sync"],
        "aps-lockstep": vector,
        "aps-detach": [
            sys.executable,
            str(EXAMPLES / "ppo_cluster.py"),
            *shared,
            "--sync",
            "aps",
            "--no-progress",
        ],
    }
    every["aps-detach-overlap"] = [*every["aps-detach"], "--overlap-rollouts"]
    return every


def run(name: str, command: list[str], scratch: Path) -> dict[str, Any]:
    """Run one example; its env-steps, seconds, env-steps per second and final return."""
    figures = scratch / f"{name}.json"
    if name.startswith("aps-detach"):  # ppo_cluster.py writes its figures as JSON
        command = [*command, "--json", str(figures)]
    out = subprocess.run(command, capture_output=True, text=True, check=False, timeout=3600)
    text = out.stdout + out.stderr
    if out.returncode != 0:
        raise SystemExit(f"{name} failed ({out.returncode}):\n{text[-3000:]}")
    if name.startswith("aps-detach"):
        result = json.loads(figures.read_text())
        return {
            "env_steps": result["global_step"],
            "seconds": result["seconds"],
            "sps": result["sps"],
            "final_return": result["final_return"],
        }
    for line in text.splitlines():
        match, returns = SUMMARY.search(line), FINAL.search(line)
        if match and returns:
            # The rate as printed: the seconds are rounded to 0.1 s, the rate is not.
            return {
                "env_steps": int(match.group(1).replace(",", "")),
                "seconds": float(match.group(2)),
                "sps": float(match.group(3).replace(",", "")),
                "final_return": float(returns.group(1)),
            }
    raise SystemExit(f"{name} printed no summary line:\n{text[-3000:]}")


def mean_interval(values: list[float]) -> str:
    """``mean (low, high)``: the mean and its 95% percentile-bootstrap interval."""
    data = np.asarray(values, dtype=np.float64)
    if data.size < 2:
        return f"{data.mean():.1f}"
    rng = np.random.default_rng(0)
    means = rng.choice(data, size=(10_000, data.size)).mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return f"{data.mean():.1f} ({low:.1f}, {high:.1f})"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--env-id", default="CartPole-v1")
    p.add_argument("--total-timesteps", type=int, default=None, help="131072 (quick 16384)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--envs-per-worker", type=int, default=32)
    p.add_argument("--num-steps", type=int, default=128)
    p.add_argument("--repeats", type=int, default=None, help="rounds, one seed each (5; quick 1)")
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", type=Path, default=RESULTS / "ppo_end_to_end.json")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.total_timesteps = args.total_timesteps or (16_384 if args.quick else 131_072)
    repeats = args.repeats or (1 if args.quick else 5)
    names = [n for n in args.runs.split(",") if n]
    unknown = set(names) - set(RUNS)
    if unknown:
        raise SystemExit(f"unknown runs {sorted(unknown)}; choose from {sorted(RUNS)}")
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    scratch = Path(tempfile.mkdtemp(prefix="aps-e2e-"))
    for round_ in range(1, repeats + 1):
        every = commands(args, seed=round_)
        for name in names:
            result = run(name, every[name], scratch)
            samples[name].append(result)
            print(
                f"round {round_}/{repeats} {name:18} {result['sps']:9,.0f} env-steps/s "
                f"({result['env_steps']:,} in {result['seconds']:.1f} s), "
                f"final return {result['final_return']:.1f}",
                flush=True,
            )
    medians = {name: statistics.median(s["sps"] for s in runs) for name, runs in samples.items()}
    reference = medians.get("gym-sync")
    print(
        f"\nCleanRL PPO, {args.env_id}, {args.workers} x {args.envs_per_worker} envs, "
        f"{args.num_steps} steps, {args.total_timesteps:,} env-steps; median of {repeats} "
        f"(seeds 1-{repeats})\n"
    )
    print("| run | env-steps/s (median) | min-max | vs gym-sync | final return (95% CI) |")
    print("|---|---:|---:|---:|---:|")
    for name, runs in samples.items():
        values = [s["sps"] for s in runs]
        ratio = f"{medians[name] / reference:.2f}x" if reference else "-"
        final = mean_interval([s["final_return"] for s in runs])
        print(
            f"| {name} | {medians[name]:,.0f} | {min(values):,.0f}-{max(values):,.0f} | {ratio} "
            f"| {final} |"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k != "json"}
    payload = {"config": config, "samples": samples, "medians": medians}
    args.json.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
