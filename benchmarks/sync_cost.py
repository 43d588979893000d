"""Sync cost: weight traffic and return of APS against always-sync and fixed-interval sync.

For each example (``examples/ppo_cluster.py``, the same with ``--no-decoupled``, and
``examples/dqn_async.py``) on CartPole-v1 with 2 workers, every strategy runs with the same
seeds and the same budget:

- ``always``: every published version to every worker;
- ``fixed``: a worker is synced once it is k versions behind (the example's default k);
- ``aps`` at each KL threshold (0.001, 0.01, 0.05, 0.1, 0.2, 0.5 by default).

Each run is the example itself, started as a subprocess with ``--json``; runs go one at a
time so that they do not share the cores. The table per example gives the final mean return
(mean over the last 50 episodes of a run; mean and spread over seeds), syncs, weight bytes,
their ratio to always-sync, mean and max policy lag, and env-steps per second. Then it checks
the goal: some APS threshold reaches a return within noise of always-sync (its seed mean at
least always-sync's minus the two spreads) while sending at most a fifth of always-sync's
weight bytes. Nothing asserts: the benchmark reports.

Usage::

    python benchmarks/sync_cost.py                 # 2 seeds, the full budgets (~15-20 min)
    python benchmarks/sync_cost.py --quick         # a smoke run: tiny budgets, 4 strategies
    python benchmarks/sync_cost.py --seeds 3 --examples dqn_async --thresholds 0.05,0.5
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
RESULTS = Path(__file__).resolve().parent / "results" / "sync_cost.json"
THRESHOLDS = (0.001, 0.01, 0.05, 0.1, 0.2, 0.5)


@dataclass(frozen=True)
class Example:
    name: str
    script: str
    extra: tuple[str, ...]
    budget: int
    quick_budget: int
    describe: str


EXAMPLES_RUN = (
    Example(
        "ppo_cluster",
        "ppo_cluster.py",
        (),
        60_000,
        4_096,
        "PPO, one rollout of 32 steps x 16 envs per iteration, one version per iteration; "
        "decoupled objective (clip against the learner's policy, behaviour importance weights)",
    ),
    Example(
        "ppo_cluster --no-decoupled",
        "ppo_cluster.py",
        ("--no-decoupled",),
        60_000,
        4_096,
        "the same PPO with the paper's objective: the ratio is taken against the workers' "
        "behaviour log-probs",
    ),
    Example(
        "dqn_async",
        "dqn_async.py",
        (),
        50_000,
        4_096,
        "DQN on a chunk stream (16 steps x 4 envs per chunk, 2 in flight per worker), 8 "
        "gradient steps per chunk, a version published after every gradient step",
    ),
)


def strategies(thresholds: tuple[float, ...]) -> list[tuple[str, list[str]]]:
    return [
        ("always", ["--sync", "always"]),
        ("fixed", ["--sync", "fixed"]),
        *((f"aps {t:g}", ["--sync", "aps", "--kl-threshold", str(t)]) for t in thresholds),
    ]


def run_one(example: Example, flags: list[str], seed: int, budget: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [
            sys.executable,
            str(EXAMPLES / example.script),
            *example.extra,
            *flags,
            "--seed",
            str(seed),
            "--total-timesteps",
            str(budget),
            "--workers",
            "2",
            "--no-progress",
            "--json",
            str(out),
        ]
        started = time.perf_counter()
        proc = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
        if proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(command)} exited with {proc.returncode}:\n{proc.stderr[-3000:]}"
            )
        result: dict[str, Any] = json.loads(out.read_text())
    result["wall_seconds"] = time.perf_counter() - started
    # The command as run from the repository root, without the temporary --json path.
    result["command"] = ["python", f"examples/{example.script}", *command[2:-2]]
    return result


def spread(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    returns = [r["final_return"] for r in runs if r["final_return"] is not None]
    return {
        "return_mean": statistics.fmean(returns) if returns else None,
        "return_sd": spread(returns) if returns else None,
        "returns": returns,
        "syncs": statistics.fmean(r["syncs"] for r in runs),
        "weight_bytes": statistics.fmean(r["weight_bytes"] for r in runs),
        "versions": statistics.fmean(r["versions"] for r in runs),
        "lag_mean": statistics.fmean(r["lag_mean"] for r in runs),
        "lag_max": max(r["lag_max"] for r in runs),
        "sps": statistics.fmean(r["sps"] for r in runs),
    }


def table(name: str, rows: dict[str, dict[str, Any]], seeds: int) -> list[str]:
    always = rows["always"]["weight_bytes"]
    ret_head = "final return" if seeds == 1 else f"final return (mean ± sd, {seeds} seeds)"
    lines = [
        f"| strategy | {ret_head} | syncs | weight MB | vs always | lag mean | lag max | "
        "env-steps/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for strategy, s in rows.items():
        if s["return_mean"] is None:
            ret = "n/a"
        elif seeds == 1:
            ret = f"{s['return_mean']:.1f}"
        else:
            ret = f"{s['return_mean']:.1f} ± {s['return_sd']:.1f}"
        ratio = s["weight_bytes"] / always if always else float("nan")
        lines.append(
            f"| {strategy} | {ret} | {s['syncs']:.0f} | {s['weight_bytes'] / 1e6:.2f} | "
            f"{ratio:.2f} | {s['lag_mean']:.2f} | {s['lag_max']} | {s['sps']:,.0f} |"
        )
    return lines


def goal(rows: dict[str, dict[str, Any]]) -> tuple[bool, str]:
    """Some APS threshold within noise of always-sync's return with <= 1/5 of its bytes."""
    always = rows["always"]
    if always["return_mean"] is None:
        return False, "always-sync finished no episode; cannot judge"
    met = []
    for strategy, s in rows.items():
        if not strategy.startswith("aps") or s["return_mean"] is None:
            continue
        noise = always["return_sd"] + s["return_sd"]
        close = s["return_mean"] >= always["return_mean"] - noise
        cheap = s["weight_bytes"] <= always["weight_bytes"] / 5
        if close and cheap:
            met.append(
                f"{strategy} (return {s['return_mean']:.1f} vs {always['return_mean']:.1f}, "
                f"{s['weight_bytes'] / always['weight_bytes']:.0%} of the bytes)"
            )
    if met:
        return True, "holds: " + "; ".join(met)
    return False, "does NOT hold: no APS threshold is both within noise and at <= 1/5 of the bytes"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny budgets, 4 strategies")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per strategy (default 2)")
    parser.add_argument(
        "--examples",
        default=None,
        help="comma-separated subset of: " + ", ".join(e.name for e in EXAMPLES_RUN),
    )
    parser.add_argument("--thresholds", default=None, help="comma-separated APS thresholds")
    parser.add_argument(
        "--json",
        default=None,
        help=f"where the results are written (default: {RESULTS.relative_to(ROOT)}; none for "
        "--quick)",
    )
    args = parser.parse_args()

    seeds = args.seeds or (1 if args.quick else 2)
    if args.thresholds:
        thresholds = tuple(float(t) for t in args.thresholds.split(","))
    else:
        thresholds = (0.01, 0.2) if args.quick else THRESHOLDS
    chosen = EXAMPLES_RUN
    if args.examples:
        names = [n.strip() for n in args.examples.split(",")]
        unknown = set(names) - {e.name for e in EXAMPLES_RUN}
        if unknown:
            parser.error(f"unknown examples: {', '.join(sorted(unknown))}")
        chosen = tuple(e for e in EXAMPLES_RUN if e.name in names)
    plan = strategies(thresholds)
    total = len(chosen) * len(plan) * seeds
    print(
        f"sync cost: {len(chosen)} examples x {len(plan)} strategies x {seeds} seeds = {total} "
        "runs, one at a time",
        flush=True,
    )

    started = time.perf_counter()
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
        "quick": args.quick,
        "seeds": list(range(1, seeds + 1)),
        "thresholds": list(thresholds),
        "examples": {},
    }
    done = 0
    tables = []
    for example in chosen:
        budget = example.quick_budget if args.quick else example.budget
        rows: dict[str, dict[str, Any]] = {}
        runs: dict[str, list[dict[str, Any]]] = {}
        for strategy, flags in plan:
            runs[strategy] = []
            for seed in range(1, seeds + 1):
                result = run_one(example, flags, seed, budget)
                runs[strategy].append(result)
                done += 1
                final = result["final_return"]
                print(
                    f"[{done}/{total}] {example.name} {strategy} seed {seed}: return "
                    f"{'n/a' if final is None else f'{final:.1f}'}, {result['syncs']} syncs, "
                    f"{result['weight_bytes'] / 1e6:.2f} MB, {result['sps']:,.0f} env-steps/s "
                    f"({result['wall_seconds']:.0f} s)",
                    flush=True,
                )
            rows[strategy] = summarize(runs[strategy])
        holds, verdict = goal(rows)
        lines = table(example.name, rows, seeds)
        tables.append((example, budget, lines, verdict))
        report["examples"][example.name] = {
            "description": example.describe,
            "total_timesteps": budget,
            "strategies": rows,
            "goal_holds": holds,
            "goal": verdict,
            "runs": runs,
        }
    report["wall_seconds"] = time.perf_counter() - started

    for example, budget, lines, verdict in tables:
        print(f"\n{example.name}: CartPole-v1, 2 workers, {budget:,} env-steps per run")
        print(f"({example.describe})\n")
        print("\n".join(lines))
        print(f"\ngoal (APS within noise of always-sync at <= 1/5 of its weight bytes): {verdict}")
    print(f"\n{total} runs in {report['wall_seconds'] / 60:.1f} min")
    if args.json or not args.quick:
        out = Path(args.json) if args.json else RESULTS
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        shown = out.resolve().relative_to(ROOT) if out.resolve().is_relative_to(ROOT) else out
        print(f"results: {shown}")


if __name__ == "__main__":
    main()
