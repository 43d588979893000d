"""python -m experiments.nigt runs, writes its CSV and summary, and resumes from saved runs."""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("tqdm")

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["--env", "Pendulum-v1", "--workers", "3", "--batch", "4", "--budget", "250"]


def run(out: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "experiments.nigt", *ARGS, "--seeds", "0", "--out", str(out)]
    return subprocess.run(command, capture_output=True, text=True, timeout=280, cwd=ROOT, env=env)


def saved_rounds(out: Path) -> list[dict[str, str]]:
    """Every round of every saved run (``runs/``), in file name order."""
    rows: list[dict[str, str]] = []
    for path in sorted((out / "runs").iterdir()):
        with path.open(newline="") as handle:
            rows += list(csv.DictReader(handle))
    return rows


@pytest.mark.timeout(300)
def test_the_experiment_runs_and_resumes(tmp_path: Path) -> None:
    first = run(tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "rennala / synchronous" in first.stdout and "rennala / afedpg" in first.stdout
    rows = saved_rounds(tmp_path)
    methods = ("rennala", "malenia", "synchronous", "afedpg")
    assert {(r["scenario"], r["method"]) for r in rows} == {
        (s, m) for s in ("equal", "sqrt", "comm") for m in methods
    }
    assert all(float(r["time"]) > 0 for r in rows)
    # AFedPG takes one step per gradient; the NIGT methods one per round of several.
    afedpg = [r for r in rows if r["method"] == "afedpg"]
    assert afedpg and all(r["used"] == "1" for r in afedpg)
    # The summary CSV (named by its worker count, not the paper's n = 10): every run's curve
    # at 100 times, with the totals of its saved rounds.
    with (tmp_path / "nigt_sim_pendulum_n3.csv").open(newline="") as handle:
        curves = list(csv.DictReader(handle))
    assert len(curves) == 12 * 100 and all(c["chosen"] == "1" for c in curves)
    for c in curves:
        mine = [r for r in rows if (r["scenario"], r["method"]) == (c["scenario"], c["method"])]
        assert int(c["rounds"]) == len(mine)
        assert int(c["used"]) == sum(int(r["used"]) for r in mine)
    saved = sorted((tmp_path / "runs").iterdir())
    assert len(saved) == 12
    stamps = [p.stat().st_mtime_ns for p in saved]
    again = run(tmp_path)  # every run is saved: nothing is run twice
    assert again.returncode == 0, again.stderr[-3000:]
    assert [p.stat().st_mtime_ns for p in saved] == stamps
    assert again.stdout == first.stdout


@pytest.mark.timeout(300)
def test_the_heterogeneous_experiment_evaluates_both_envs(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [
        sys.executable, "-m", "experiments.nigt", "--env", "Pendulum-v1", "--batch", "4",
        "--budget", "1000", "--scenarios", "hetero", "--methods", "malenia,afedpg",
        "--seeds", "0", "--eval-points", "2", "--eval-episodes", "2", "--out", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=280, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "malenia / afedpg" in done.stdout
    rows = saved_rounds(tmp_path)
    for method in ("malenia", "afedpg"):
        runs = [r for r in rows if r["method"] == method]
        # The initial policy (the same for both methods), then one evaluation after each
        # round that passes one of the two evaluation times, the budget included.
        evaluated = [r for r in runs if r["eval_avg"] not in ("", "nan")]
        assert int(evaluated[0]["iteration"]) == -1 and 2 <= len(evaluated) <= 3
        assert evaluated[-1] is runs[-1]
        for r in evaluated:
            mean = (float(r["eval_0"]) + float(r["eval_1"])) / 2
            assert float(r["eval_avg"]) == pytest.approx(mean)
        # Malenia waits for the slow worker (h = 10) every round; AFedPG takes whatever comes.
        if method == "malenia":
            assert all(float(r["compute"]) >= 500 for r in runs if int(r["iteration"]) >= 0)
    initial = {r["method"]: r["eval_avg"] for r in rows if r["iteration"] == "-1"}
    assert initial["malenia"] == initial["afedpg"]


def test_tanh_squashing_maps_any_sample_into_the_bounds() -> None:
    from experiments.nigt.__main__ import make

    env = make("Pendulum-v1", squash="tanh")()
    assert env.action_space.shape == (1,) and not env.action_space.is_bounded()
    wrapped: Any = env
    assert wrapped.action(np.array([0.0], dtype=np.float32)) == pytest.approx([0.0])
    assert wrapped.action(np.array([50.0], dtype=np.float32)) == pytest.approx([2.0])
    assert wrapped.action(np.array([-50.0], dtype=np.float32)) == pytest.approx([-2.0])
    assert wrapped.action(np.array([1.0], dtype=np.float32)) == pytest.approx([2 * np.tanh(1.0)])
    env.close()


def test_a_step_size_grid_keeps_the_best_per_method() -> None:
    from experiments.nigt.__main__ import step_sizes, tune

    assert step_sizes("2^-5,0.5") == [2**-5, 0.5]
    with pytest.raises(argparse.ArgumentTypeError):
        step_sizes("0")

    def run(method: str, lr: float, seed: int, level: float) -> list[dict[str, Any]]:
        return [
            {"iteration": i, "time": 10.0 * (i + 1), "used": 1, "mean_return": level + i}
            for i in range(10)
        ]

    args = argparse.Namespace(
        env="X", budget=100.0, window=1, scenarios=["equal"], methods=["rennala", "afedpg"],
        lr=[0.1, 0.2], seeds=[0, 1], tune_seeds=None,
    )  # fmt: skip
    # Rennala is best at lr 0.2, AFedPG at 0.1: each method keeps its own best.
    levels = {("rennala", 0.1): 0.0, ("rennala", 0.2): 5.0, ("afedpg", 0.1): 3.0}
    levels[("afedpg", 0.2)] = -3.0
    every = {
        ("equal", m, seed, lr): run(m, lr, seed, level)
        for (m, lr), level in levels.items()
        for seed in (0, 1)
    }
    chosen, lines = tune(args, every)
    assert set(chosen) == {("equal", m, s) for m in ("rennala", "afedpg") for s in (0, 1)}
    assert chosen["equal", "rennala", 0] is every["equal", "rennala", 0, 0.2]
    assert chosen["equal", "afedpg", 1] is every["equal", "afedpg", 1, 0.1]
    assert any("rennala: lr 0.2 chosen" in line for line in lines)
    assert any("afedpg: lr 0.1 chosen" in line for line in lines)
    # Tuning seeds: only they decide. Seed 1 alone prefers Rennala's lr 0.1.
    every["equal", "rennala", 1, 0.1] = run("rennala", 0.1, 1, 50.0)
    args.tune_seeds = [1]
    chosen, _ = tune(args, every)
    assert chosen["equal", "rennala", 0] is every["equal", "rennala", 0, 0.1]
    args.tune_seeds = [0]
    chosen, _ = tune(args, every)
    assert chosen["equal", "rennala", 0] is every["equal", "rennala", 0, 0.2]
