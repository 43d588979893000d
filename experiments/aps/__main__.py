"""The APS reproduction suite: ``python -m experiments.aps [--quick] [--tasks ...]``.

Runs every (task, PPO objective, sync strategy, seed) of the grid in ``grid.py`` one at a
time, each as its own example process, then writes the CSVs, the results page and the
figures. Resumable: a run whose result file exists is skipped, so stopping the suite (Ctrl-C)
and starting it again loses at most the run in progress. ``--report-only`` rebuilds the page
from the results there are.

    python -m experiments.aps                      # the full suite: one night on 2 cores
    python -m experiments.aps --quick --out /tmp/q --docs /tmp/q    # a few minutes, for CI
    python -m experiments.aps --tasks ppo-cartpole --strategies always,fixed-4,aps-0.05
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from experiments.aps import grid, page, plots, report
from experiments.aps.run import run_all

DEFAULT_OUT = grid.ROOT / "experiments" / "aps" / "results"
DEFAULT_DOCS = grid.ROOT / "docs" / "results"
DEFAULT_NOTES = grid.ROOT / "experiments" / "aps" / "notes.md"

INTRO = (
    "The claim under test (the ClusterEnv paper): Adaptive Policy Synchronization keeps the "
    "return of always-sync while sending far fewer weights. Every run is one process of "
    "`examples/ppo_cluster.py` or `examples/dqn_async.py`: 2 local worker processes over "
    "loopback TCP acting with their own policy copy, the learner in the main process. "
    "*decoupled* is the examples' default PPO objective (clip against the learner's policy, "
    "importance weights against the behaviour policy); *paper* is `--no-decoupled`, PPO "
    "clipped against the stale behaviour policy as in the paper's prototype. The final "
    "return is the mean of a run's last 50 episodes. Env-steps/s and wall time come from a "
    "2-core machine shared with other jobs, so they carry that contention and compare "
    "strategies only loosely; on loopback, weight bytes cost little time (see "
    "`benchmarks/cluster.py` for shaped links)."
)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m experiments.aps", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny budgets and 2 seeds (CI)")
    parser.add_argument(
        "--tasks", default=None, help=f"comma-separated, of: {', '.join(grid.TASKS)}"
    )
    parser.add_argument(
        "--strategies", default=None, help=f"comma-separated, of: {', '.join(grid.STRATEGIES)}"
    )
    parser.add_argument("--objectives", default=None, help="decoupled, paper or both (default)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds 1..N (default 5; quick 2)")
    parser.add_argument("--timesteps", type=int, default=None, help="override every budget")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results and CSVs")
    parser.add_argument("--docs", type=Path, default=DEFAULT_DOCS, help="page and figures")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    parser.add_argument("--report-only", action="store_true", help="run nothing; rebuild")
    parser.add_argument(
        "--notes",
        type=Path,
        default=None,
        help="a markdown file of observations put on the page under 'Reading' (default: "
        "experiments/aps/notes.md when the page goes to docs/results)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    options = parse(argv)
    quick = options.quick
    tasks = (
        options.tasks.split(",")
        if options.tasks
        else (["ppo-cartpole", "dqn-cartpole"] if quick else list(grid.TASKS))
    )
    strategies = (
        options.strategies.split(",")
        if options.strategies
        else list(grid.QUICK_STRATEGIES if quick else grid.STRATEGIES)
    )
    objectives = options.objectives.split(",") if options.objectives else None
    seeds = options.seeds or (2 if quick else 5)
    try:
        runs = grid.plan(tasks, strategies, objectives, seeds, quick)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if options.timesteps is not None:
        runs = [grid.Run(r.task, r.objective, r.strategy, r.seed, options.timesteps) for r in runs]
    out, docs = options.out.resolve(), options.docs.resolve()
    out.mkdir(parents=True, exist_ok=True)
    docs.mkdir(parents=True, exist_ok=True)
    if not options.report_only:
        command = shlex.join(["python", "-m", "experiments.aps", *(argv or sys.argv[1:])])
        with (out / "invocations.txt").open("a") as log:
            log.write(command + "\n")
        run_all(runs, out, timeout=options.timeout)

    rows, curve_rows = report.collect(out)
    if not rows:
        print("no results yet; nothing to report", file=sys.stderr)
        return 1
    summaries = report.summarize(rows)
    figures = {
        "Final return against weight bytes (Pareto front)": "aps_pareto.png",
        "Learning curves against env steps": "aps_curves_steps.png",
        "Learning curves against wall time": "aps_curves_time.png",
    }
    plots.pareto(summaries, docs / figures["Final return against weight bytes (Pareto front)"])
    plots.curves(curve_rows, summaries, docs / "aps_curves_steps.png", "global_step")
    plots.curves(curve_rows, summaries, docs / "aps_curves_time.png", "seconds")
    invocations_file = out / "invocations.txt"
    invocations = invocations_file.read_text().splitlines() if invocations_file.exists() else []
    try:
        csv_dir = str(out.relative_to(grid.ROOT))
    except ValueError:
        csv_dir = str(out)
    notes = options.notes
    if notes is None and docs == DEFAULT_DOCS.resolve() and DEFAULT_NOTES.exists():
        notes = DEFAULT_NOTES
    page.write(
        docs / "aps.md",
        summaries,
        rows,
        invocations=invocations,
        figures=figures,
        csv_dir=csv_dir,
        intro=INTRO,
        notes=notes.read_text() if notes is not None else None,
    )
    print(f"wrote {docs / 'aps.md'} and its figures; CSVs in {out}")
    for line in page.headline(summaries):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
