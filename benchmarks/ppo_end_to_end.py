"""End to end: CleanRL's PPO on aps against the same PPO on an in-process vector env.

Runs of the same budget, one after the other, in the same invocation, each repeated
``--repeats`` times in interleaved rounds:

- ``gym-sync``: ``examples/ppo_vector.py --backend gym-sync``, Gymnasium's ``SyncVectorEnv``
  of ``workers x envs`` envs in the learner's process (CleanRL as written): the reference.
- ``gym-async``: the same with Gymnasium's ``AsyncVectorEnv`` (one subprocess per env).
- ``sb3-subproc``: the same CleanRL PPO stepping Stable-Baselines3's ``SubprocVecEnv``
  through :class:`SubprocVectorEnv`, a small adapter to Gymnasium's vector API (not SB3's
  PPO: the contender is the vector env, the algorithm stays the same).
- ``aps-lockstep``: ``examples/ppo_vector.py``, the envs on worker processes, the learner
  choosing every action (``ClusterEnv`` lockstep).
- ``aps-detach``: ``examples/ppo_cluster.py --sync aps``, the workers acting with their own
  policy copy (DETACH) under Adaptive Policy Synchronization.
- ``aps-detach-overlap``: the same with ``--overlap-rollouts``: the workers act the next
  batch while the learner trains on this one.

``--pixels``: Atari frames instead (``--env-id Pong-v5`` by default there), CleanRL's
``ppo_atari_envpool.py`` as ``examples/ppo_atari.py`` runs it, the same Nature CNN PPO and
budget in every run:

- ``envpool-inprocess``: ``--mode inprocess``, EnvPool's envs in the learner's process, the
  learner acting (CleanRL as written): the reference;
- ``aps-lockstep``: the envs on worker processes, the learner choosing every action;
- ``aps-detach-always`` and ``aps-detach-aps``: the workers acting with their own copy of
  the CNN on their CPUs, every version sent, or Adaptive Policy Synchronization.

``--env-id`` takes a comma-separated list, e.g. ``CartPole-v1,Hopper-v5,Humanoid-v5``: an
env whose step costs more than a message (MuJoCo) is where envs on other processes pay.
Box action spaces get CleanRL's continuous PPO (``ppo_continuous_action.py``'s Gaussian
agent) in both examples. ``--compression X`` is passed to the aps runs when given.

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
    python benchmarks/ppo_end_to_end.py --env-id Humanoid-v5 --envs-per-worker 8 \
        --total-timesteps 65536 --num-steps 256  # pip install "gymnasium[mujoco]"
    python benchmarks/ppo_end_to_end.py --pixels --envs-per-worker 8 \
        --total-timesteps 8192 --repeats 3     # Pong, the Nature CNN

Writes ``results/ppo_end_to_end.json`` (one entry per env under ``"envs"``; a run's
``curve`` is its learning curve, ``[env-step, mean return]``); ``benchmarks/results_page.py``
turns it into tables. Nothing asserts on timings.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

ROOT = Path(__file__).resolve().parent
EXAMPLES = ROOT.parent / "examples"
RESULTS = ROOT / "results"
SUMMARY = re.compile(r"([\d,]+) env-steps in ([\d.]+) s, ([\d,]+) env-steps/s")
FINAL = re.compile(r"final mean return ([-\d.na]+)")
ITERATION = re.compile(r"iteration \d+: step (\d+), return ([-\d.na]+)")
RUNS = ("gym-sync", "gym-async", "sb3-subproc", "aps-lockstep", "aps-detach", "aps-detach-overlap")
PIXEL_RUNS = ("envpool-inprocess", "aps-lockstep", "aps-detach-always", "aps-detach-aps")
REFERENCES = ("gym-sync", "gym-async", "sb3-subproc", "envpool-inprocess")  # in process
SB3_CHILD = "--sb3-child"  # argv[1] of this script when it runs ppo_vector.py on SB3's envs


class SubprocVectorEnv(gym.vector.VectorEnv):  # type: ignore[type-arg]
    """Stable-Baselines3's ``SubprocVecEnv`` behind Gymnasium's vector API, SameStep autoreset.

    SB3 resets a finished env inside the step that ended it and returns the next episode's
    first observation, which is Gymnasium's ``SameStep`` mode; its ``dones`` are split into
    terminations and truncations by the ``TimeLimit.truncated`` info. ``reset(seed=s)``
    seeds env ``i`` with ``s + i``, as Gymnasium's vector envs do.
    """

    def __init__(self, env_id: str, num_envs: int) -> None:
        from functools import partial

        from stable_baselines3.common.vec_env import SubprocVecEnv

        self.venv = SubprocVecEnv([partial(gym.make, env_id) for _ in range(num_envs)])
        self.num_envs = num_envs
        self.single_observation_space = self.venv.observation_space
        self.single_action_space = self.venv.action_space
        self.observation_space = gym.vector.utils.batch_space(self.venv.observation_space, num_envs)
        self.action_space = gym.vector.utils.batch_space(self.venv.action_space, num_envs)
        self.metadata = {"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}

    def reset(self, *, seed: Any = None, options: Any = None) -> tuple[Any, dict[str, Any]]:
        if seed is not None:
            self.venv.seed(seed)
        return self.venv.reset(), {}

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        obs, rewards, dones, infos = self.venv.step(actions)
        truncated = np.array([bool(i.get("TimeLimit.truncated", False)) for i in infos])
        return obs, rewards, dones & ~truncated, truncated, {}

    def close_extras(self, **kwargs: Any) -> None:
        self.venv.close()


def sb3_child(argv: list[str]) -> int:
    """Run ``examples/ppo_vector.py`` with ``argv`` on :class:`SubprocVectorEnv`."""
    spec = importlib.util.spec_from_file_location("ppo_vector", EXAMPLES / "ppo_vector.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(argv, envs_factory=lambda a: SubprocVectorEnv(a.env_id, a.num_envs))
    return 0


def commands(args: argparse.Namespace, env_id: str, seed: int) -> dict[str, list[str]]:
    shared = [
        "--env-id",
        env_id,
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
    compression = [] if args.compression is None else ["--compression", args.compression]
    every = {
        "gym-sync": [*vector, "--backend", "gym-sync"],
        "gym-async": [*vector, "--backend", "gym-async"],
        "sb3-subproc": [sys.executable, str(Path(__file__).resolve()), SB3_CHILD, *shared],
        "aps-lockstep": [*vector, *compression],
        "aps-detach": [
            sys.executable,
            str(EXAMPLES / "ppo_cluster.py"),
            *shared,
            "--sync",
            "aps",
            "--no-progress",
            *compression,
        ],
    }
    every["aps-detach-overlap"] = [*every["aps-detach"], "--overlap-rollouts"]
    return every


def pixel_commands(args: argparse.Namespace, env_id: str, seed: int) -> dict[str, list[str]]:
    """The pixel runs: ``examples/ppo_atari.py`` in each mode, the same PPO and budget."""
    atari = [
        sys.executable, str(EXAMPLES / "ppo_atari.py"),
        "--env-id", env_id,
        "--backend", "envpool",
        "--total-timesteps", str(args.total_timesteps),
        "--workers", str(args.workers),
        "--envs-per-worker", str(args.envs_per_worker),
        "--num-steps", str(args.num_steps),
        "--seed", str(seed),
    ]  # fmt: skip
    compression = [] if args.compression is None else ["--compression", args.compression]
    return {
        "envpool-inprocess": [*atari, "--mode", "inprocess"],
        "aps-lockstep": [*atari, "--mode", "lockstep", *compression],
        "aps-detach-always": [*atari, "--mode", "detach", "--sync", "always", *compression],
        "aps-detach-aps": [*atari, "--mode", "detach", "--sync", "aps", *compression],
    }


def run(name: str, command: list[str], scratch: Path) -> dict[str, Any]:
    """Run one example; its env-steps, seconds, env-steps per second and final return.

    ``ppo_cluster.py`` and ``ppo_atari.py`` write their figures as JSON (their curve rows
    named differently); ``ppo_vector.py``'s are read from what it prints.
    """
    figures = scratch / f"{name}.json"
    atari = "ppo_atari.py" in command[1]
    writes_json = atari or name.startswith("aps-detach")
    if writes_json:
        command = [*command, "--json", str(figures)]
    out = subprocess.run(command, capture_output=True, text=True, check=False, timeout=3600)
    text = out.stdout + out.stderr
    if out.returncode != 0:
        raise SystemExit(f"{name} failed ({out.returncode}):\n{text[-3000:]}")
    if writes_json:
        result = json.loads(figures.read_text())
        step, ret = ("step", "return") if atari else ("global_step", "mean_return")
        return {
            "env_steps": result["global_step"],
            "seconds": result["seconds"],
            "sps": result["sps"],
            "final_return": result["final_return"],
            "weight_bytes": result["weight_bytes"],
            "curve": [[row[step], row[ret]] for row in result["curve"]],
        }
    # ppo_vector.py prints the mean of the last 20 returns every 10 iterations.
    curve = [[int(m[1]), float(m[2])] for m in map(ITERATION.search, text.splitlines()) if m]
    for line in text.splitlines():
        match, returns = SUMMARY.search(line), FINAL.search(line)
        if match and returns:
            # The rate as printed: the seconds are rounded to 0.1 s, the rate is not.
            return {
                "env_steps": int(match.group(1).replace(",", "")),
                "seconds": float(match.group(2)),
                "sps": float(match.group(3).replace(",", "")),
                "final_return": float(returns.group(1)),
                "curve": curve,
            }
    raise SystemExit(f"{name} printed no summary line:\n{text[-3000:]}")


def mean_interval(values: list[float]) -> str:
    """``mean (low, high)``: the mean and its 95% percentile-bootstrap interval."""
    data = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if data.size == 0:
        return "n/a"
    if data.size < 2:
        return f"{data.mean():.1f}"
    rng = np.random.default_rng(0)
    means = rng.choice(data, size=(10_000, data.size)).mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return f"{data.mean():.1f} ({low:.1f}, {high:.1f})"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--env-id", default=None, help="one id, or several: a,b,c (CartPole-v1)")
    p.add_argument("--pixels", action="store_true", help="Atari frames (Pong-v5), ppo_atari.py")
    p.add_argument("--total-timesteps", type=int, default=None, help="131072 (quick 16384)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--envs-per-worker", type=int, default=32)
    p.add_argument("--num-steps", type=int, default=128)
    p.add_argument("--repeats", type=int, default=None, help="rounds, one seed each (5; quick 1)")
    p.add_argument("--runs", default=None, help="which runs (all of the workload's)")
    p.add_argument("--compression", default=None, help="passed to the aps runs when given")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", type=Path, default=RESULTS / "ppo_end_to_end.json")
    return p


def table(env_id: str, runs: dict[str, list[dict[str, Any]]]) -> tuple[dict[str, float], str]:
    """The medians of one env's runs, and its markdown table (ratios to each reference)."""
    medians = {name: statistics.median(s["sps"] for s in samples) for name, samples in runs.items()}
    references = [name for name in REFERENCES if name in medians]
    lines = [
        "| run | env-steps/s (median) | min-max | "
        + "".join(f"vs {name} | " for name in references)
        + "final return (95% CI) |",
        "|---|---:|---:|" + "---:|" * len(references) + "---:|",
    ]
    for name, samples in runs.items():
        values = [s["sps"] for s in samples]
        ratios = "".join(f"{medians[name] / medians[ref]:.2f}x | " for ref in references)
        final = mean_interval([s["final_return"] for s in samples])
        lines.append(
            f"| {name} | {medians[name]:,.0f} | {min(values):,.0f}-{max(values):,.0f} | "
            f"{ratios}{final} |"
        )
    return medians, "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [SB3_CHILD]:
        return sb3_child(argv[1:])
    args = parser().parse_args(argv)
    args.total_timesteps = args.total_timesteps or (16_384 if args.quick else 131_072)
    repeats = args.repeats or (1 if args.quick else 5)
    known = PIXEL_RUNS if args.pixels else RUNS
    names = [n for n in (args.runs or ",".join(known)).split(",") if n]
    unknown = set(names) - set(known)
    if unknown:
        raise SystemExit(f"unknown runs {sorted(unknown)}; choose from {sorted(known)}")
    default_env = "Pong-v5" if args.pixels else "CartPole-v1"
    env_ids = [e for e in (args.env_id or default_env).split(",") if e]
    make_commands = pixel_commands if args.pixels else commands
    samples = {env_id: {name: [] for name in names} for env_id in env_ids}
    scratch = Path(tempfile.mkdtemp(prefix="aps-e2e-"))
    for round_ in range(1, repeats + 1):
        for env_id in env_ids:
            every = make_commands(args, env_id, seed=round_)
            for name in names:
                result = run(name, every[name], scratch)
                samples[env_id][name].append(result)
                print(
                    f"round {round_}/{repeats} {env_id} {name:18} {result['sps']:9,.0f} "
                    f"env-steps/s ({result['env_steps']:,} in {result['seconds']:.1f} s), "
                    f"final return {result['final_return'] or float('nan'):.1f}",
                    flush=True,
                )
    by_env = {}
    for env_id, runs in samples.items():
        medians, text = table(env_id, runs)
        print(
            f"\nCleanRL PPO, {env_id}, {args.workers} x {args.envs_per_worker} envs, "
            f"{args.num_steps} steps, {args.total_timesteps:,} env-steps; median of {repeats} "
            f"(seeds 1-{repeats})\n"
        )
        print(text)
        by_env[env_id] = {"samples": runs, "medians": medians}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k != "json"}
    payload: dict[str, Any] = {
        "benchmark": "ppo_end_to_end",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/ppo_end_to_end.py", *argv]),
        "config": config,
        "envs": by_env,
    }
    if len(env_ids) == 1:  # the layout of earlier runs, for one env
        payload.update(by_env[env_ids[0]])
    args.json.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
