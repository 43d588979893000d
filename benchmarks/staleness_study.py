"""Does DETACH learn as well as always-sync on pixels once stale data is corrected? MinAtar.

Runs ``examples/ppo_cluster.py`` (DETACH PPO, 2 worker processes x 8 envs over TCP, the
learner's small CNN) on ``MinAtar/Breakout-v1`` once per seed, sync strategy and correction:

- strategies: ``always`` (every version to every worker), ``aps`` (``APS(kl_threshold=0.05)``
  with its default ``max_lag=16``: the old signal), ``relative`` (``RelativeAPS(updates=4)``:
  the new signal, same bound), ``fixed4`` and ``fixed16`` (a worker synced once it is 4 or 16
  versions behind);
- corrections: ``none`` (PPO clipped against the behaviour policy), ``decoupled`` (the clip
  anchored at the learner's policy, samples weighted by the truncated ratio) and ``vtrace``
  (V-trace targets and advantages), all from :mod:`aps.correction`.

Seeds are outermost and the cells interleave within a seed, so a study cut short still has
every cell on its first seeds and the machine's load falls alike on every cell.

Per cell it reports the final mean return (the last 50 episodes) and the weight bytes, each
as the mean over seeds with a 95% percentile-bootstrap interval; the bytes as a ratio to
always-sync's under the same correction; the mean lag. Then the issue's questions, each
answered from those figures:

- APS (either signal) with the chosen correction: its mean return inside always-sync's
  interval, at <= 0.2x always-sync's bytes?
- ``fixed16`` with the correction: its mean return inside always-sync's interval?

The plot has one column per correction: mean return against env-steps (top) and against
wall time (bottom), one line per strategy (the mean over seeds on a common grid).

    nice -n 5 python benchmarks/staleness_study.py --seeds 1,2,3,4,5 \\
        --total-timesteps 150000 --parallel 2 \\
        --json benchmarks/results/staleness-study-minatar.json
    python benchmarks/staleness_study.py --replot \\
        --json benchmarks/results/staleness-study-minatar.json

Needs ``pip install minatar`` (and matplotlib for the plot). Each run's JSON stays in
``--out`` (not committed); the summary keeps every run's curve, thinned to 30 points.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import itertools
import json
import os
import platform
import subprocess
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from cluster import format_interval, mean_interval

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "ppo_cluster.py"
RESULTS = REPO / "benchmarks" / "results"
# The strategies and the example's flags that make each.
STRATEGIES = {
    "always": ["--sync", "always"],
    "aps": ["--sync", "aps", "--kl-threshold", "0.05"],
    "relative": ["--sync", "relative", "--drift-updates", "4"],
    "fixed4": ["--sync", "fixed", "--fixed-versions", "4"],
    "fixed16": ["--sync", "fixed", "--fixed-versions", "16"],
}
CORRECTIONS = ("none", "decoupled", "vtrace")
RUN_KEYS = (
    "seed", "final_return", "global_step", "seconds", "sps", "syncs", "weight_bytes", "lag_mean",
    "lag_max",
)  # fmt: skip
CURVE_POINTS = 30


def run_one(args: argparse.Namespace, strategy: str, correction: str, seed: int) -> Path:
    """One ``ppo_cluster.py`` run; its JSON path (absent if the run failed, see its log)."""
    name = f"{strategy}-{correction}-{seed}"
    out = args.out / f"{name}.json"
    if out.exists() and not args.rerun:
        return out
    command = [
        sys.executable, str(EXAMPLE),
        "--env-id", args.env_id,
        "--hidden-size", str(args.hidden_size),
        "--num-steps", str(args.num_steps),
        "--workers", str(args.workers),
        "--envs-per-worker", str(args.envs_per_worker),
        "--total-timesteps", str(args.total_timesteps),
        "--correction", correction,
        "--seed", str(seed),
        "--no-progress",
        "--json", str(out),
        *STRATEGIES[strategy],
    ]  # fmt: skip
    with (args.out / f"{name}.log").open("w") as log:
        proc = subprocess.run(
            command, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout, check=False
        )
    print(f"{name}: exit {proc.returncode}", flush=True)
    return out


def thin(curve: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """At most ``CURVE_POINTS`` rows of a curve, the last one always kept."""
    keep = np.unique(np.linspace(0, len(curve) - 1, min(CURVE_POINTS, len(curve))).astype(int))
    rows = []
    for i in keep:
        ret = curve[i]["mean_return"]
        rows.append(
            {
                "global_step": curve[i]["global_step"],
                "seconds": round(curve[i]["seconds"], 2),
                "mean_return": None if ret is None else round(ret, 3),
                "weight_bytes": curve[i]["weight_bytes"],
            }
        )
    return rows


def load_runs(out: Path) -> list[dict[str, Any]]:
    runs = []
    for path in sorted(out.glob("*.json")):
        strategy, correction, _seed = path.stem.rsplit("-", 2)
        run = json.loads(path.read_text())
        if strategy in STRATEGIES and correction in CORRECTIONS:
            kept = {key: run.get(key) for key in (*RUN_KEYS, "correction", "verdict")}
            runs.append({"strategy": strategy, **kept, "curve": thin(run["curve"])})
    return runs


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per (correction, strategy): returns, bytes and their ratio to always-sync; verdicts."""
    cells: dict[str, dict[str, Any]] = {}
    for correction in CORRECTIONS:
        row: dict[str, Any] = {}
        for strategy in STRATEGIES:
            group = sorted(
                (r for r in runs if r["strategy"] == strategy and r["correction"] == correction),
                key=lambda r: r["seed"],
            )
            if group:
                row[strategy] = {
                    "return": mean_interval([r["final_return"] for r in group]),
                    "weight_bytes": mean_interval([float(r["weight_bytes"]) for r in group]),
                    "lag_mean": float(np.mean([r["lag_mean"] for r in group])),
                    "sps": float(np.mean([r["sps"] for r in group])),
                    "seeds": [{k: r.get(k) for k in RUN_KEYS} for r in group],
                }
        always = row.get("always")
        for cell in row.values():
            ratio = None
            if always is not None and always["weight_bytes"]["mean"]:
                ratio = cell["weight_bytes"]["mean"] / always["weight_bytes"]["mean"]
            cell["bytes_ratio"] = ratio
            inside = None
            if always is not None and None not in (always["return"]["low"], cell["return"]["mean"]):
                low, high = always["return"]["low"], always["return"]["high"]
                inside = bool(low <= cell["return"]["mean"] <= high)
            cell["inside_always"] = inside
        cells[correction] = row
    verdicts = {}
    for correction, row in cells.items():
        for strategy in ("aps", "relative"):
            cell = row.get(strategy)
            if cell is not None and cell["bytes_ratio"] is not None:
                verdicts[f"{strategy}/{correction}"] = bool(
                    cell["inside_always"] and cell["bytes_ratio"] <= 0.2
                )
        if "fixed16" in row:
            verdicts[f"fixed16/{correction}"] = row["fixed16"]["inside_always"]
    return {"cells": cells, "verdicts": verdicts}


def table(summary: dict[str, Any]) -> str:
    """The summary as markdown: one block per correction, a row per strategy; the verdicts."""

    def ci(x: dict[str, Any], fmt: str = ".2f", scale: float = 1.0) -> str:
        return format_interval(x, fmt, scale)

    lines = [
        "| correction | strategy | seeds | final return, mean (95% CI) | inside always's CI "
        "| weight MB (95% CI) | bytes / always | lag mean | env-steps/s |",
        "|---|---|---:|---:|:-:|---:|---:|---:|---:|",
    ]
    word = {True: "yes", False: "no", None: "n/a"}
    for correction, row in summary["cells"].items():
        for strategy, cell in row.items():
            ratio = "n/a" if cell["bytes_ratio"] is None else f"{cell['bytes_ratio']:.3f}x"
            lines.append(
                f"| {correction} | {strategy} | {len(cell['seeds'])} | {ci(cell['return'])} "
                f"| {word[cell['inside_always']]} | {ci(cell['weight_bytes'], '.0f', 1e6)} "
                f"| {ratio} | {cell['lag_mean']:.2f} | {cell['sps']:,.0f} |"
            )
    lines.append("")
    for key, met in summary["verdicts"].items():
        strategy, correction = key.split("/")
        goal = (
            "inside always-sync's interval"
            if strategy == "fixed16"
            else "inside always-sync's interval at <= 0.2x its bytes"
        )
        lines.append(f"- {strategy} with {correction}: {goal}: {word[met]}")
    return "\n".join(lines)


def mean_curve(runs: Sequence[dict[str, Any]], axis: str, grid: np.ndarray) -> np.ndarray | None:
    """The runs' mean return on ``grid`` of ``axis`` (held from each run's last point before)."""
    rows = []
    for run in runs:
        points = [(p[axis], p["mean_return"]) for p in run["curve"] if p["mean_return"] is not None]
        if points:
            x, y = map(np.asarray, zip(*points, strict=True))
            rows.append(np.interp(grid, x, y, left=np.nan, right=np.nan))
    if not rows:
        return None
    with warnings.catch_warnings():  # past the shortest run's end a column is all NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        mean: np.ndarray = np.nanmean(np.asarray(rows), axis=0)
    return mean


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    fig, axes = plt.subplots(2, len(CORRECTIONS), figsize=(5 * len(CORRECTIONS), 7), sharey=True)
    for column, correction in enumerate(CORRECTIONS):
        for row, axis in enumerate(("global_step", "seconds")):
            ax = axes[row][column]
            group = [r for r in runs if r["correction"] == correction]
            if not group:
                continue
            end = min(r["curve"][-1][axis] for r in group)
            grid = np.linspace(0, end, 100)
            for index, strategy in enumerate(STRATEGIES):
                curve = mean_curve([r for r in group if r["strategy"] == strategy], axis, grid)
                if curve is not None:
                    ax.plot(grid, curve, color=f"C{index}", label=strategy)
            ax.set_xlabel("env-steps" if axis == "global_step" else "wall seconds")
            if column == 0:
                ax.set_ylabel("mean return (last 50 episodes)")
            ax.set_title(f"correction: {correction}")
            ax.legend(fontsize=8)
    fig.suptitle(f"{report['config']['env_id']}: DETACH PPO, the mean over seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env-id", default="MinAtar/Breakout-v1")
    p.add_argument("--seeds", default="1,2,3,4,5")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--corrections", default=",".join(CORRECTIONS))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--envs-per-worker", type=int, default=8)
    p.add_argument("--num-steps", type=int, default=64, help="per env per rollout")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--total-timesteps", type=int, default=150_000)
    p.add_argument("--parallel", type=int, default=1, help="runs at a time")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    p.add_argument("--out", type=Path, default=Path("runs/staleness-study"), help="runs' JSON")
    p.add_argument("--json", type=Path, default=RESULTS / "staleness-study-minatar.json")
    p.add_argument("--rerun", action="store_true", help="run cells whose JSON exists again")
    p.add_argument("--replot", action="store_true", help="summarize and plot the saved JSON")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        report = json.loads(args.json.read_text())
        report["summary"] = summarize(report["runs"])
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        seeds = [int(s) for s in args.seeds.split(",")]
        strategies = args.strategies.split(",")
        corrections = args.corrections.split(",")
        for name in strategies:
            if name not in STRATEGIES:
                raise SystemExit(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
        cells = list(itertools.product(seeds, corrections, strategies))
        with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
            list(pool.map(lambda c: run_one(args, c[2], c[1], c[0]), cells))
        runs = load_runs(args.out)
        report = {
            "benchmark": "staleness_study",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
            "machine": {
                "platform": platform.platform(),
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
            },
            "config": {
                "env_id": args.env_id,
                "workers": args.workers,
                "envs_per_worker": args.envs_per_worker,
                "num_steps": args.num_steps,
                "hidden_size": args.hidden_size,
                "total_timesteps": args.total_timesteps,
                "parallel": args.parallel,
                "strategies": {k: STRATEGIES[k] for k in strategies},
            },
            "runs": runs,
        }
        report["summary"] = summarize(runs)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    # One line per run: the curves are most of the file.
    text = json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1)
    runs = ",\n".join(json.dumps(run) for run in report["runs"])
    args.json.write_text(text[:-2] + ',\n "runs": [\n' + runs + "\n ]\n}\n")
    print(table(report["summary"]))
    try:
        plot(report, args.json.with_suffix(".png"))
    except ImportError:
        print("matplotlib is not installed: no plot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
