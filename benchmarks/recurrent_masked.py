"""Recurrent DETACH PPO on velocity-masked CartPole against in-process recurrent PPO and an MLP.

Runs ``examples/ppo_lstm.py`` once per seed and variant, one process at a time, seed by seed
(so a run stopped early holds every variant for the seeds it finished), and writes
``results/recurrent_masked.json`` and ``results/recurrent_masked.png``: per variant the mean
final return (mean of each run's last 20 episodes) over seeds, with a 95% bootstrap interval.

    nice -n 19 python benchmarks/recurrent_masked.py --seeds 1 2 3 4 5 --total-timesteps 100000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {
    "lstm-detach": [],
    "lstm-in-process": ["--backend", "gym-sync"],
    "mlp-detach": ["--no-lstm"],
}


def bootstrap(values: list[float], rounds: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """The 95% percentile bootstrap interval of the mean of ``values``."""
    rng = np.random.default_rng(seed)
    data = np.asarray(values, dtype=np.float64)
    means = rng.choice(data, size=(rounds, len(data))).mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(low), float(high)


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for name, results in runs.items():
        finals = [r["final_return"] for r in results]
        if finals:
            low, high = bootstrap(finals)
            summary[name] = {
                "seeds": [r["seed"] for r in results],
                "final_returns": finals,
                "mean": float(np.mean(finals)),
                "ci95": [low, high],
                "seconds_mean": float(np.mean([r["seconds"] for r in results])),
            }
    return summary


def plot(summary: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    means = [summary[n]["mean"] for n in names]
    errors = np.array(
        [
            [m - summary[n]["ci95"][0], summary[n]["ci95"][1] - m]
            for n, m in zip(names, means, strict=True)
        ]
    ).T
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(names, means, yerr=errors, capsize=6, color=["C0", "C1", "C2"][: len(names)])
    for i, n in enumerate(names):
        finals = summary[n]["final_returns"]
        ax.scatter([i] * len(finals), finals, color="k", s=10, zorder=3)
    ax.set_ylabel("final return (mean of last 20 episodes)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def merge(folders: list[Path], out: Path) -> None:
    """Join the reports in ``folders`` (same budget) into one, with its summary and plot."""
    reports = [json.loads((folder / "recurrent_masked.json").read_text()) for folder in folders]
    budgets = {report["total_timesteps"] for report in reports}
    if len(budgets) != 1:
        raise SystemExit(f"the reports ran different budgets: {sorted(budgets)}")
    runs: dict[str, list[dict[str, Any]]] = {}
    for report in reports:
        for name, variant_runs in report["runs"].items():
            runs.setdefault(name, []).extend(variant_runs)
    summary = summarize(runs)
    commands = [report["command"] for report in reports]
    merged = {"command": commands, "total_timesteps": budgets.pop(), "summary": summary}
    (out / "recurrent_masked.json").write_text(json.dumps({**merged, "runs": runs}, indent=2))
    seeds = sorted({run["seed"] for variant in runs.values() for run in variant})
    title = (
        f"masked CartPole-v1, {merged['total_timesteps']} steps, 8 envs, seeds {seeds}; "
        "95% bootstrap CI"
    )
    plot(summary, out / "recurrent_masked.png", title)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--total-timesteps", type=int, default=100_000)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=None,
        help="run nothing: join the recurrent_masked.json of these folders (variants run as "
        "separate processes) into --out's, with the plot",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        merge(args.merge, args.out)
        return
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.variants}
    title = (
        f"masked CartPole-v1, {args.total_timesteps} steps, 8 envs, seeds {args.seeds}; "
        "95% bootstrap CI"
    )
    for seed in args.seeds:
        for name in args.variants:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "result.json"
                command = [
                    sys.executable,
                    str(ROOT / "examples" / "ppo_lstm.py"),
                    "--seed",
                    str(seed),
                    "--total-timesteps",
                    str(args.total_timesteps),
                    "--json",
                    str(out),
                    *VARIANTS[name],
                ]
                subprocess.run(command, check=True, cwd=tmp, stdout=subprocess.DEVNULL)
                result = json.loads(out.read_text())
            result.pop("returns", None)
            runs[name].append(result)
            print(f"{name} seed {seed}: {result['final_return']:.1f} in {result['seconds']:.0f}s")
            summary = summarize(runs)
            report = {
                "command": " ".join(sys.argv),
                "total_timesteps": args.total_timesteps,
                "summary": summary,
                "runs": runs,
            }
            (args.out / "recurrent_masked.json").write_text(json.dumps(report, indent=2))
            plot(summary, args.out / "recurrent_masked.png", title)


if __name__ == "__main__":
    main()
