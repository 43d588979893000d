"""The workloads results page: markdown tables from the JSON the benchmarks save.

Reads what ``benchmarks/cluster.py`` (the CartPole table over seeds, and ``--workload pong``),
``benchmarks/ppo_end_to_end.py`` and ``benchmarks/atari_learning.py`` wrote, and writes one
page of tables. Every figure on the page comes from those files; a file that is missing is
named on the page, not guessed.

    python benchmarks/results_page.py        # the INPUTS below, into docs/results/workloads.md
    python benchmarks/results_page.py --inputs a.json b.json --out /tmp/workloads.md
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import atari_learning

RESULTS = Path(__file__).resolve().parent / "results"
PAGE = RESULTS.parent.parent / "docs" / "results" / "workloads.md"
# The runs the page quotes, each written by the command saved inside it.
INPUTS = (
    "cluster-seeds-20mbit.json",
    "cluster-seeds-100mbit.json",
    "cluster-pong.json",
    "cluster-pong-1gbit-rounds.json",
    "ppo_end_to_end-mujoco.json",
    "atari-learning-breakout.json",
)


def num(value: float | None, fmt: str, scale: float = 1.0) -> str:
    return "n/a" if value is None else format(value / scale, fmt)


def mean_ci(interval: dict[str, Any], fmt: str = ".1f", scale: float = 1.0) -> str:
    """``mean (low, high)`` of :func:`cluster.mean_interval`'s figures."""
    if interval["mean"] is None:
        return "n/a"
    mean = num(interval["mean"], fmt, scale)
    if interval["present"] < 2:
        return mean
    return f"{mean} ({num(interval['low'], fmt, scale)}, {num(interval['high'], fmt, scale)})"


def median_q(interval: dict[str, Any], fmt: str = ".1f") -> str:
    """``median (q20, q80), reached/n`` of :func:`cluster.median_interval`'s figures."""

    def value(x: float | None) -> str:
        return "not reached" if x is None else format(x, fmt)

    if interval["n"] == 0:
        return "n/a"
    counts = f"{interval['reached']}/{interval['n']} reached"
    if interval["n"] < 2:
        return f"{value(interval['median'])}, {counts}"
    return (
        f"{value(interval['median'])} ({value(interval['q20'])}, {value(interval['q80'])}), "
        f"{counts}"
    )


def cluster_tables(report: dict[str, Any]) -> str:
    """The tables of one ``benchmarks/cluster.py`` report."""
    config = report["config"]
    lines = []
    if report.get("aggregate"):
        seeds = config.get("seeds", [config.get("seed")])
        lines += [
            f"DETACH PPO on {config['env_id']}, {config['workers']} x "
            f"{config['envs_per_worker']} envs, {config['total_timesteps']:,} env-steps, "
            f"hidden size {config['hidden_size']}, seeds {', '.join(map(str, seeds))}; "
            f"target return {report['aggregate'][0]['target']:g}. Times: median (20%, 80%) "
            "over seeds, a run that never reached the target counted as such; returns and "
            "bytes: mean (95% bootstrap interval).",
            "",
            "| rate | strategy | s to target | vs always (same seed) | return at equal wall "
            "(s) | final return | weight MB |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in report["aggregate"]:
            lines.append(
                f"| {row['rate']} | {row['strategy']} | {median_q(row['seconds_to_target'])} | "
                f"{median_q(row['time_ratio_vs_always'], '.2f')} | "
                f"{mean_ci(row['return_at_equal_wall'])} ({row['equal_wall_s']:.1f} s) | "
                f"{mean_ci(row['final_return'])} | {mean_ci(row['weight_bytes'], ',.1f', 1e6)} |"
            )
        lines.append("")
    elif report.get("rows"):  # saved before the seeds: its one-seed rows are in the JSON
        lines += ["A one-seed report without intervals: its rows are in the JSON.", ""]
    if report.get("lockstep"):
        lines += ["| rate | lockstep step p50 ms | p95 ms |", "|---|---|---|"]
        for row in report["lockstep"]:
            lines.append(f"| {row['rate']} | {row['step_ms_p50']:.2f} | {row['step_ms_p95']:.2f} |")
        lines.append("")
    if report.get("pixels"):
        lines += [
            f"Pixels: {config['pixel_env']} ({config['pixel_vector']}), {config['workers']} x "
            f"{config['envs_per_worker']} envs. Bytes are the learner's link counters per "
            "env-step; CPU per MB is the extra CPU seconds over the uncompressed run per MB "
            "of frames it carried.",
            "",
            "| rate | mode | compression | env-steps/s | bytes in / step | bytes out / step | "
            "in vs none | learner CPU s / MB | workers CPU s / MB |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for row in report["pixels"]:
            lines.append(
                f"| {row['rate']} | {row['mode']} | {row['compression']} | {row['sps']:,.0f} | "
                f"{row['bytes_in_per_step']:,.0f} | {row['bytes_out_per_step']:,.0f} | "
                f"{num(row['wire_ratio_in'], '.2f')} | {num(row['learner_cpu_per_mb'], '.3f')} | "
                f"{num(row['workers_cpu_per_mb'], '.3f')} |"
            )
        lines.append("")
    rounds = report.get("pixel_rounds") or []
    if any(row["rounds"] > 1 for row in rounds):
        lines += [
            "Over the rounds (settings interleaved in each): the median env-steps/s, and the "
            "ratio to the uncompressed run of the same round, median (min, max).",
            "",
            "| rate | mode | compression | rounds | env-steps/s, median | vs none |",
            "|---|---|---|---|---|---|",
        ]
        for row in rounds:
            ratio = (
                "n/a"
                if row["vs_none_median"] is None
                else f"{row['vs_none_median']:.2f} ({row['vs_none_min']:.2f}, "
                f"{row['vs_none_max']:.2f})"
            )
            lines.append(
                f"| {row['rate']} | {row['mode']} | {row['compression']} | {row['rounds']} | "
                f"{row['sps_median']:,.0f} | {ratio} |"
            )
        lines.append("")
    return "\n".join(lines)


def end_to_end_tables(report: dict[str, Any]) -> str:
    """The tables of one ``benchmarks/ppo_end_to_end.py`` report, one per env."""
    config = report["config"]
    by_env = report.get("envs") or {config["env_id"]: report}  # the one-env layout of old runs
    references = ("gym-sync", "gym-async", "sb3-subproc")
    lines = []
    for env_id, figures in by_env.items():
        medians, samples = figures["medians"], figures["samples"]
        refs = [r for r in references if r in medians]
        rounds = len(next(iter(samples.values()))) if samples else 0
        lines += [
            f"CleanRL PPO on {env_id}, {config['workers']} x {config['envs_per_worker']} envs, "
            f"{config['total_timesteps']:,} env-steps, {rounds} round{'' if rounds == 1 else 's'} "
            "(one seed each): "
            "env-steps/s medians.",
            "",
            "| run | env-steps/s | " + "".join(f"vs {r} | " for r in refs) + "final return |",
            "|---|---:|" + "---:|" * len(refs) + "---:|",
        ]
        for name, median in medians.items():
            # Runs saved before the examples reported a final return have none.
            returns = [
                s["final_return"] for s in samples[name] if s.get("final_return") is not None
            ]
            final = sum(returns) / len(returns) if returns else None
            ratios = "".join(f"{median / medians[r]:.2f}x | " for r in refs)
            lines.append(f"| {name} | {median:,.0f} | {ratios}{num(final, '.1f')} |")
        lines.append("")
    return "\n".join(lines)


def page(paths: Sequence[Path]) -> str:
    """The whole page: a section per input file, in order; missing files are named."""
    parts = [
        "# Workloads",
        "",
        "Generated by `python benchmarks/results_page.py` from the benchmarks' JSON; the "
        "command and date of each run are given with its tables. The runs were made on a "
        "shared 2-core machine with other work beside them, so absolute times are loose; "
        "the ratios compare strategies within one run.",
        "",
    ]
    for path in paths:
        if not path.exists():
            parts += [f"## {path.name}", "", f"Not run yet: no `{path.name}`.", ""]
            continue
        report = json.loads(path.read_text())
        kind = report.get("benchmark", "ppo_end_to_end" if "samples" in report else "cluster")
        title = {
            "cluster": "Emulated cluster",
            "ppo_end_to_end": "PPO end to end",
            "atari_learning": "Learning from pixels",
        }.get(kind, kind)
        parts += [f"## {title} ({path.name})", ""]
        if report.get("command") or report.get("date"):
            parts += [f"`{report.get('command', '')}`, {report.get('date', 'undated')}", ""]
        if kind == "atari_learning":
            parts += [atari_learning.table(report), ""]
        else:
            parts.append(cluster_tables(report) if kind == "cluster" else end_to_end_tables(report))
    return "\n".join(parts).rstrip() + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--inputs", type=Path, nargs="*", default=[RESULTS / n for n in INPUTS])
    parser.add_argument("--out", type=Path, default=PAGE)
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(page(args.inputs))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
