"""Two builds of aps against each other: the matrix's aps rows, interleaved, as ratios.

What a change costs in throughput (the learner's figures, a refactor) is measured here: the
same ``benchmarks/matrix.py`` columns run for the build under test and a reference build (a
git revision, checked out in a temporary worktree), alternating round by round so that the
machine's load falls on both alike. Each round gives one ratio per column (test / reference,
medians of the round's windows); the report gives the median ratio and a 95% bootstrap
interval over rounds.

Usage::

    python benchmarks/builds.py --reference main~3 --rounds 6 --json out.json

Each build's own ``benchmarks/matrix.py`` runs with its own ``aps`` first on the path.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_COLUMNS = "CartPole-v1:1,CartPole-v1:64"


def run_matrix(
    tree: Path, columns: str, contender: str, seconds: float, out: Path
) -> dict[str, Any]:
    """One matrix run of ``tree``'s aps: its rates per column."""
    command = [
        sys.executable,
        str(tree / "benchmarks" / "matrix.py"),
        "--columns",
        columns,
        "--contenders",
        contender,
        "--seconds",
        str(seconds),
        "--repeats",
        "1",
        "--json",
        str(out),
    ]
    env = {"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}
    subprocess.run(command, check=True, env=env, capture_output=True, timeout=600)
    results = json.loads(out.read_text())["results"]
    return {column: results[column][contender]["median"] for column in results}


def interval(ratios: list[float], seed: int = 0, draws: int = 10_000) -> tuple[float, float]:
    """The 95% bootstrap interval of the median of ``ratios``."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", required=True, help="git revision to compare against")
    parser.add_argument("--columns", default=DEFAULT_COLUMNS, help="as matrix.py's")
    parser.add_argument("--contender", default="aps-tcp", help="one of matrix.py's")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds (default 6)")
    parser.add_argument("--seconds", type=float, default=3.0, help="timed window per run")
    parser.add_argument("--json", type=Path, default=None, help="where to write the results")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        reference = Path(scratch) / "reference"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(reference), args.reference],
            check=True,
            capture_output=True,
        )
        try:
            rows: list[dict[str, Any]] = []
            for index in range(args.rounds):
                # Alternate which build goes first, so a trend in the load favours neither.
                order = [("test", ROOT), ("reference", reference)]
                if index % 2:
                    order.reverse()
                row: dict[str, Any] = {}
                for name, tree in order:
                    out = Path(scratch) / f"{name}-{index}.json"
                    row[name] = run_matrix(tree, args.columns, args.contender, args.seconds, out)
                rows.append(row)
                print(f"round {index + 1}/{args.rounds}: {row}", flush=True)
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(reference)],
                check=False,
                capture_output=True,
            )
    report: dict[str, Any] = {
        "benchmark": "builds",
        "command": " ".join(sys.argv),
        "reference": args.reference,
        "contender": args.contender,
        "rounds": rows,
        "ratios": {},
    }
    for column in rows[0]["test"]:
        ratios = [row["test"][column] / row["reference"][column] for row in rows]
        low, high = interval(ratios)
        report["ratios"][column] = {
            "per_round": ratios,
            "median": statistics.median(ratios),
            "interval_95": [low, high],
        }
        print(f"{column}: test/reference {statistics.median(ratios):.3f} ({low:.3f}, {high:.3f})")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
