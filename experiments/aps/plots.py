"""The suite's figures: the return/bytes Pareto front and learning curves, per task."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from experiments.aps.report import Summary

CURVE_STRATEGIES = (
    "always",
    "fixed-4",
    "aps-0.01",
    "aps-0.05",
    "aps-0.2",
    "aps-1",
    "aps-0.05-nolag",
    "aps-1-nolag",
)
"""The strategies drawn in the learning curves, where present (all 18 would not read)."""


def _family(strategy: str) -> tuple[str, str]:
    if strategy == "always":
        return "always-sync", "black"
    if strategy.startswith("fixed"):
        return "fixed interval", "tab:blue"
    if strategy.endswith("-nolag"):
        return "APS, no max_lag", "tab:red"
    return "APS, default max_lag", "tab:green"


def _label(task: str, objective: str) -> str:
    return task if not objective else f"{task} ({objective} objective)"


def panels(summaries: list[Summary]) -> list[tuple[str, str]]:
    """The (task, objective) pairs that have results, in order."""
    return list(dict.fromkeys((s.task, s.objective) for s in summaries))


def _grid(n: int) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(n, 2)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.6 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, axes.flat


def pareto(summaries: list[Summary], path: Path) -> None:
    """Final return (mean, 95% CI) against weight bytes, per task, with the Pareto front."""
    keys = panels(summaries)
    fig, axes = _grid(len(keys))
    for ax, (task, objective) in zip(axes, keys, strict=False):
        group = [s for s in summaries if s.task == task and s.objective == objective]
        seen = set()
        for s in group:
            label, color = _family(s.strategy)
            mean, low, high = s.ret
            ax.errorbar(
                s.weight_bytes[0] / 1e6,
                mean,
                yerr=[[mean - low], [high - mean]],
                fmt="o",
                color=color,
                capsize=3,
                label=None if label in seen else label,
            )
            seen.add(label)
            ax.annotate(s.strategy, (s.weight_bytes[0] / 1e6, mean), fontsize=7, alpha=0.8)
        # The front: points no other point beats on both fewer bytes and a higher return.
        front = sorted(
            (s for s in group if not any(_dominates(o, s) for o in group)),
            key=lambda s: s.weight_bytes[0],
        )
        ax.plot(
            [s.weight_bytes[0] / 1e6 for s in front],
            [s.ret[0] for s in front],
            "--",
            color="gray",
            linewidth=1,
            label="Pareto front",
        )
        ax.set_xscale("log")
        ax.set_xlabel("weight bytes sent, MB (log)")
        ax.set_ylabel("final return (mean, 95% CI)")
        ax.set_title(_label(task, objective))
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _dominates(a: Summary, b: Summary) -> bool:
    cheaper = a.weight_bytes[0] <= b.weight_bytes[0]
    better = a.ret[0] >= b.ret[0]
    return cheaper and better and (a.weight_bytes[0], a.ret[0]) != (b.weight_bytes[0], b.ret[0])


def curves(rows: list[dict[str, Any]], summaries: list[Summary], path: Path, x: str) -> None:
    """Mean learning curves over seeds against ``x`` (``global_step`` or ``seconds``)."""
    keys = panels(summaries)
    fig, axes = _grid(len(keys))
    by_run: dict[tuple[str, str, str, int], list[tuple[float, float]]] = defaultdict(list)
    for row in rows:
        if row["mean_return"] is None or not math.isfinite(float(row["mean_return"])):
            continue
        key = (row["task"], row["objective"], row["strategy"], int(row["seed"]))
        by_run[key].append((float(row[x]), float(row["mean_return"])))
    for ax, (task, objective) in zip(axes, keys, strict=False):
        present = {s.strategy for s in summaries if s.task == task and s.objective == objective}
        chosen = [s for s in CURVE_STRATEGIES if s in present] or sorted(present)
        for strategy in chosen:
            runs = [
                sorted(points)
                for (t, o, st, _), points in by_run.items()
                if (t, o, st) == (task, objective, strategy) and points
            ]
            if not runs:
                continue
            end = min(points[-1][0] for points in runs)  # where every seed has data
            grid = np.linspace(0.0, end, 100)
            stacked = np.array(
                [
                    np.interp(grid, [p[0] for p in points], [p[1] for p in points], left=np.nan)
                    for points in runs
                ]
            )
            style = ":" if strategy.endswith("-nolag") else "-"
            seen = np.isfinite(stacked)
            total = np.where(seen, stacked, 0.0).sum(axis=0)
            count = seen.sum(axis=0)
            mean = np.divide(total, count, out=np.full_like(total, np.nan), where=count > 0)
            ax.plot(grid, mean, style, label=strategy, linewidth=1.3)
        ax.set_xlabel("env steps" if x == "global_step" else "wall time, s")
        ax.set_ylabel("return (last 50 episodes, mean over seeds)")
        ax.set_title(_label(task, objective))
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
