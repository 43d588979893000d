"""Turn the suite's run results into CSVs, a results page and plots.

Statistics: every figure is the mean over seeds with a 95% percentile-bootstrap confidence
interval (10,000 resamples of the seeds, fixed generator seed, so the page is reproducible).
A strategy is *indistinguishable from always-sync* on a task when the bootstrap 95% interval
of the difference of mean final returns (strategy minus always-sync, seeds resampled
independently in each group) contains 0. With 5 seeds such intervals are wide: failing to
tell two strategies apart is weak evidence that they are equal, and the page says so.
"""

from __future__ import annotations

import csv
import json
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from experiments.aps.grid import STRATEGIES

RESAMPLES = 10_000
CURVE_POINTS = 60  # learning-curve points kept per run in curves.csv

RUN_FIELDS = [
    "task",
    "objective",
    "strategy",
    "seed",
    "env_id",
    "timesteps",
    "final_return",
    "syncs",
    "weight_bytes",
    "bytes_per_version",
    "versions",
    "lag_mean",
    "lag_p95",
    "lag_max",
    "final_lag_max",
    "stalled",
    "sps",
    "seconds",
]
CURVE_FIELDS = ["task", "objective", "strategy", "seed", "global_step", "seconds", "mean_return"]


INT_FIELDS = {"seed", "timesteps", "syncs", "weight_bytes", "bytes_per_version", "versions"}
INT_FIELDS |= {"lag_p95", "lag_max", "final_lag_max", "stalled", "global_step"}
TEXT_FIELDS = {"task", "objective", "strategy", "env_id"}


def collect(out: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Read ``out/runs/*.json`` into run rows and learning-curve rows (and write both CSVs).

    The per-run JSON files are kept for resuming but not committed; the CSVs are. A run in
    ``out/runs.csv`` without a JSON file here (one run on another checkout) is kept as the
    CSV has it, with its curve, so adding tasks to a suite never drops the results before.
    """
    runs, curves = [], []
    for path in sorted((out / "runs").glob("*.json")):
        task, objective, strategy, seed = path.stem.split("__")
        figures = json.loads(path.read_text())
        metrics = figures["metrics"]
        final_lags = [metrics["version"] - w["version"] for w in metrics["workers"]]
        final_lag_max = max(final_lags, default=0)
        row = {
            "task": task,
            "objective": "" if objective == "-" else objective,
            "strategy": strategy,
            "seed": int(seed.removeprefix("s")),
            "env_id": figures["env_id"],
            "timesteps": figures["global_step"],
            "final_return": figures["final_return"],
            "syncs": figures["syncs"],
            "weight_bytes": figures["weight_bytes"],
            "bytes_per_version": figures["bytes_per_version"],
            "versions": figures["versions"],
            "lag_mean": figures["lag_mean"],
            "lag_p95": figures["lag_p95"],
            "lag_max": figures["lag_max"],
            "final_lag_max": final_lag_max,
            # A worker that ends more than half the run's versions behind kept one policy for
            # most of the run: the stall the staleness bound exists to prevent.
            "stalled": int(final_lag_max > figures["versions"] / 2),
            "sps": figures["sps"],
            "seconds": figures["seconds"],
        }
        runs.append(row)
        points = figures["curve"]
        stride = max(len(points) // CURVE_POINTS, 1)
        for point in [*points[stride - 1 :: stride][:-1], points[-1]] if points else []:
            curves.append(
                {
                    **{k: row[k] for k in ("task", "objective", "strategy", "seed")},
                    "global_step": point["global_step"],
                    "seconds": round(point["seconds"], 3),
                    "mean_return": point["mean_return"],
                }
            )
    fresh = {_key(row) for row in runs}
    runs += [row for row in read_csv(out / "runs.csv") if _key(row) not in fresh]
    curves += [row for row in read_csv(out / "curves.csv") if _key(row) not in fresh]
    runs.sort(key=_key)
    curves.sort(key=lambda row: (*_key(row), row["global_step"]))
    write_csv(out / "runs.csv", RUN_FIELDS, runs)
    write_csv(out / "curves.csv", CURVE_FIELDS, curves)
    return runs, curves


def _key(row: dict[str, Any]) -> tuple[str, str, str, int]:
    return (row["task"], row["objective"], row["strategy"], int(row["seed"]))


def read_csv(path: Path) -> list[dict[str, Any]]:
    """The rows of a CSV this module wrote, with its numbers typed back ([] without one)."""
    if not path.exists():
        return []
    with path.open(newline="") as file:
        return [
            {
                name: value
                if name in TEXT_FIELDS
                else int(value)
                if name in INT_FIELDS
                else float(value)
                for name, value in row.items()
            }
            for row in csv.DictReader(file)
        ]


def write_csv(path: Path, fields: list[str], rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def mean_ci(values: list[float], rng: np.random.Generator) -> tuple[float, float, float]:
    """Mean and 95% percentile-bootstrap interval; a single value has a zero-width one."""
    data = np.asarray(values, dtype=np.float64)
    mean = float(data.mean())
    if data.size < 2:
        return mean, mean, mean
    means = rng.choice(data, size=(RESAMPLES, data.size)).mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return mean, float(low), float(high)


def diff_ci(a: list[float], b: list[float], rng: np.random.Generator) -> tuple[float, float, float]:
    """Mean of ``a`` minus mean of ``b``, with a 95% bootstrap interval (independent groups)."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    diff = float(x.mean() - y.mean())
    if x.size < 2 or y.size < 2:
        return diff, math.nan, math.nan
    boot = rng.choice(x, size=(RESAMPLES, x.size)).mean(axis=1) - rng.choice(
        y, size=(RESAMPLES, y.size)
    ).mean(axis=1)
    low, high = np.percentile(boot, [2.5, 97.5])
    return diff, float(low), float(high)


@dataclass
class Summary:
    """One (task, objective, strategy) group over its seeds."""

    task: str
    objective: str
    strategy: str
    seeds: int
    ret: tuple[float, float, float]
    syncs: tuple[float, float, float]
    weight_bytes: tuple[float, float, float]
    lag_mean: float
    lag_p95: float
    sps: tuple[float, float, float]
    seconds: tuple[float, float, float]
    stalled: int
    byte_ratio: float = math.nan
    vs_always: tuple[float, float, float] = (math.nan, math.nan, math.nan)

    @property
    def indistinguishable(self) -> bool:
        """The 95% interval of the return difference from always-sync contains 0."""
        low, high = self.vs_always[1], self.vs_always[2]
        return bool(low <= 0.0 <= high)

    @property
    def not_worse(self) -> bool:
        """The 95% interval of the return difference from always-sync reaches 0 or above."""
        return bool(self.vs_always[2] >= 0.0)


def summarize(runs: list[dict[str, Any]]) -> list[Summary]:
    """Per-group statistics, with each group compared to always-sync of its task/objective."""
    rng = np.random.default_rng(0)
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for row in runs:
        if row["final_return"] is not None:
            groups[(row["task"], row["objective"], row["strategy"])].append(row)
    order = {name: i for i, name in enumerate(STRATEGIES)}
    summaries = []
    for (task, objective, strategy), rows in sorted(
        groups.items(), key=lambda kv: (kv[0][0], kv[0][1], order.get(kv[0][2], 99), kv[0][2])
    ):

        def col(name: str, rows: list[dict[str, Any]] = rows) -> list[float]:
            return [float(r[name]) for r in rows]

        summaries.append(
            Summary(
                task=task,
                objective=objective,
                strategy=strategy,
                seeds=len(rows),
                ret=mean_ci(col("final_return"), rng),
                syncs=mean_ci(col("syncs"), rng),
                weight_bytes=mean_ci(col("weight_bytes"), rng),
                lag_mean=float(np.mean(col("lag_mean"))),
                lag_p95=float(np.mean(col("lag_p95"))),
                sps=mean_ci(col("sps"), rng),
                seconds=mean_ci(col("seconds"), rng),
                stalled=int(sum(col("stalled"))),
            )
        )
    for summary in summaries:
        always = groups.get((summary.task, summary.objective, "always"))
        if not always:
            continue
        rows = groups[(summary.task, summary.objective, summary.strategy)]
        always_bytes = float(np.mean([r["weight_bytes"] for r in always]))
        summary.byte_ratio = summary.weight_bytes[0] / always_bytes if always_bytes else math.nan
        summary.vs_always = diff_ci(
            [r["final_return"] for r in rows], [r["final_return"] for r in always], rng
        )
    return summaries


def cheapest_match(
    summaries: list[Summary], task: str, objective: str, *, test: str = "indistinguishable"
) -> Summary | None:
    """The strategy with the fewest weight bytes that passes ``test`` against always-sync.

    ``test`` is ``"indistinguishable"`` (the interval of the difference contains 0) or
    ``"not_worse"`` (it reaches 0 or above: indistinguishable or better).
    """
    matches = [
        s
        for s in summaries
        if s.task == task
        and s.objective == objective
        and s.strategy != "always"
        and getattr(s, test)
    ]
    return min(matches, key=lambda s: s.weight_bytes[0], default=None)
