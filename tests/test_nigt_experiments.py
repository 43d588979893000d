"""python -m experiments.nigt runs, writes its CSV and summary, and resumes from saved runs."""

from __future__ import annotations

import argparse
import csv
import gzip
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
        assert path.name.endswith(".csv.gz"), path  # saved compressed
        rows += _rows(path)
    return rows


def _rows(path: Path) -> list[dict[str, str]]:
    from experiments.nigt.__main__ import read

    return read(path)


def test_saved_runs_round_trip_compressed_and_plain(tmp_path: Path) -> None:
    from experiments.nigt.__main__ import read, saved_run, write

    rows = [{"iteration": 0, "time": 1.5, "eval_avg": ""}, {"iteration": 1, "time": 2.25}]
    text = [{"iteration": "0", "time": "1.5", "eval_avg": ""},
            {"iteration": "1", "time": "2.25", "eval_avg": ""}]  # fmt: skip
    packed = tmp_path / "run.csv.gz"
    write(packed, rows)
    first = packed.read_bytes()
    write(packed, rows)  # the same rows, the same bytes: no mtime or name in the header
    assert packed.read_bytes() == first and gzip.decompress(first).startswith(b"iteration,")
    assert read(packed) == text
    plain = tmp_path / "run.csv"  # runs saved before compression are still read
    write(plain, rows)
    assert read(plain) == text and saved_run(tmp_path, "run.csv") == plain
    assert saved_run(tmp_path, "other.csv") == tmp_path / "other.csv.gz"
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.timeout(300)
def test_the_experiment_runs_and_resumes(tmp_path: Path) -> None:
    first = run(tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "rennala / synchronous" in first.stdout and "rennala / afedpg" in first.stdout
    rows = saved_rounds(tmp_path)
    methods = ("rennala", "malenia", "synchronous", "synchronous-same-batch", "afedpg")
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
    assert len(curves) == 15 * 100 and all(c["chosen"] == "1" for c in curves)
    for c in curves:
        mine = [r for r in rows if (r["scenario"], r["method"]) == (c["scenario"], c["method"])]
        assert int(c["rounds"]) == len(mine)
        assert int(c["used"]) == sum(int(r["used"]) for r in mine)
    saved = sorted((tmp_path / "runs").iterdir())
    assert len(saved) == 15
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


def test_a_grid_keeps_the_best_setting_per_method_in_fixed_form() -> None:
    from experiments.nigt.__main__ import Setting, step_sizes, tune

    assert step_sizes("2^-5,0.5") == [2**-5, 0.5]
    with pytest.raises(argparse.ArgumentTypeError):
        step_sizes("0")

    def run(level: float) -> list[dict[str, Any]]:
        return [
            {"iteration": i, "time": 10.0 * (i + 1), "used": 1, "mean_return": level + i}
            for i in range(10)
        ]

    args = argparse.Namespace(
        env="X", budget=100.0, window=1, scenarios=["equal"], methods=["rennala", "afedpg"],
        seeds=[0, 1], tune_seeds=None,
    )  # fmt: skip
    # Rennala is best at M = 50, lr = 2^-7; AFedPG at alpha 0.01, lr = 2^-9: each its own.
    levels = {
        ("rennala", Setting(2**-7, 20, 0.1)): 0.0,
        ("rennala", Setting(2**-7, 50, 0.1)): 5.0,
        ("afedpg", Setting(2**-9, 0, 0.01)): 3.0,
        ("afedpg", Setting(2**-7, 0, 0.1)): -3.0,
    }
    every = {
        ("equal", m, seed, st): run(level) for (m, st), level in levels.items() for seed in (0, 1)
    }
    best, chosen, lines = tune(args, every)
    assert best == {
        ("equal", "rennala"): Setting(2**-7, 50, 0.1),
        ("equal", "afedpg"): Setting(2**-9, 0, 0.01),
    }
    assert chosen["equal", "rennala", 0] is every["equal", "rennala", 0, Setting(2**-7, 50, 0.1)]
    assert any("rennala: chosen M = 50, lr = 2^-7, score " in line for line in lines)
    assert any("afedpg: chosen alpha = 0.01, lr = 2^-9, score " in line for line in lines)
    # Tuning seeds: only they decide. Seed 1 alone prefers M = 20.
    every["equal", "rennala", 1, Setting(2**-7, 20, 0.1)] = run(50.0)
    args.tune_seeds = [1]
    best, _, _ = tune(args, every)
    assert best["equal", "rennala"].batch == 20
    args.tune_seeds = [0]
    best, _, _ = tune(args, every)
    assert best["equal", "rennala"].batch == 50
    # A failed run rules its setting out as diverged, whatever its other seeds scored.
    every["equal", "rennala", 0, Setting(2**-7, 50, 0.1)] = [{**run(0.0)[0], "failed": "x: nan"}]
    best, _, lines = tune(args, every)
    assert best["equal", "rennala"].batch == 20
    assert any("ruled out M = 50, lr = 2^-7: diverged (x: nan)" in line for line in lines)


def test_a_pilot_rules_out_what_diverged_made_no_progress_or_fell_behind() -> None:
    from experiments.nigt.__main__ import Setting, prune

    def run(start: float, end: float) -> list[dict[str, Any]]:
        return [
            {"iteration": i, "time": 10.0 * (i + 1), "used": 1, "mean_return": v}
            for i, v in enumerate(np.linspace(start, end, 10))
        ]

    args = argparse.Namespace(pilot_budget=100.0, seeds=[3, 4], tune_seeds=None, window=1,
                              pilot_keep=2)  # fmt: skip
    grid = [Setting(2.0**-k, 20, 0.1) for k in range(1, 7)]
    pilot = {
        ("sqrt", "rennala", 3, grid[0]): [{**run(0, 0)[0], "failed": "ConfigError: nan"}],
        ("sqrt", "rennala", 3, grid[1]): run(0, -5),  # no progress
        ("sqrt", "rennala", 3, grid[2]): run(0, 10),
        ("sqrt", "rennala", 3, grid[3]): run(0, 2),  # progress, but behind the best two
        ("sqrt", "rennala", 3, grid[4]): run(0, 20),
        ("sqrt", "rennala", 4, grid[3]): run(0, 99),  # not the pilot's seed
        # Its first round ended after the pilot's budget: not judged, kept.
        ("sqrt", "rennala", 3, grid[5]): [{**run(0, 0)[0], "time": 150.0}],
    }
    keep, lines = prune(args, pilot, "sqrt", "rennala", grid)
    assert keep == sorted([grid[2], grid[4], grid[5]])
    text = "\n".join(lines)
    assert "M = 20, lr = 2^-1: diverged (ConfigError: nan)" in text
    assert "M = 20, lr = 2^-2: no progress (0.0 to -5.0)" in text
    assert "M = 20, lr = 2^-4: below the best 2 in the pilot" in text
    assert len(lines) == 3


def test_the_time_unit_charges_h_per_step_or_per_gradient_and_kappa_as_the_paper() -> None:
    from experiments.nigt.__main__ import rule, times

    d = 10_000  # d^(1/4) = 10
    h, kappa = times("comm", 4, 50, d, "step")
    assert h == pytest.approx([50 * np.sqrt(i) for i in range(1, 5)])
    assert kappa == pytest.approx([10 * np.sqrt(i) for i in range(1, 5)])
    h, kappa_g = times("comm", 4, 50, d, "gradient")
    assert h == pytest.approx([np.sqrt(i) for i in range(1, 5)])
    assert kappa_g == kappa  # kappa_i is the paper's in both units
    assert times("hetero", 2, 50, d, "gradient") == ([1.0, 10.0], [0.0, 0.0])
    assert times("equal", 3, 50, d, "gradient") == ([1.0] * 3, [0.0] * 3)
    # The same-batch baseline's round holds at least M: ceil(M / n) per worker.
    assert rule("synchronous-same-batch", 50, 1, 10).share == 5
    assert rule("synchronous-same-batch", 30, 1, 100).share == 1
    assert rule("synchronous-same-batch", 25, 1, 10).share == 3
    assert rule("synchronous", 50, 1, 10).share == 1


def test_the_softplus_policy_has_a_state_dependent_std_with_gradients() -> None:
    import torch

    from aps.policy import Policy
    from experiments.nigt.__main__ import Agent, make

    env = make("Pendulum-v1")()
    agent = Agent(env.observation_space, env.action_space, std="softplus")
    policy = Policy(agent, env.observation_space, env.action_space)
    obs = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    _, log_probs, _ = policy.act(obs)
    # At the start the std is exp(-0.5) to within the small initial weights.
    agent.actor_mean(torch.as_tensor(obs))
    np.testing.assert_allclose(agent.actor_logstd.detach().numpy(), -0.5, atol=0.05)
    with torch.no_grad():
        agent.actor_mean.spread.weight.fill_(1.0)
    agent.actor_mean(torch.as_tensor(obs))
    stds = agent.actor_logstd.detach().numpy()
    assert stds.shape == (64, 1) and np.ptp(stds) > 0.5  # depends on the state
    actions, _, _ = policy.act(obs)
    policy.log_prob(obs, actions).sum().backward()
    grad = agent.actor_mean.spread.weight.grad
    assert grad is not None and float(grad.abs().sum()) > 0
    names = set(policy.get_weights())
    assert {"actor_mean.spread.weight", "actor_mean.mean.weight"} <= names
    assert log_probs.shape == (64,)
    env.close()


@pytest.mark.parametrize(
    ("ratios", "side", "expected"),
    [
        ([0.5, 0.6, 0.7, 0.8, 0.9], "faster", "reproduced"),
        ([1.1, 1.2, 1.3, 1.4, 2.0], "faster", "contradicted"),
        ([0.5, 0.8, 1.0, 1.2, 1.5], "faster", "undecided"),
        ([0.5, 0.6, 0.7, float("inf"), float("inf")], "faster", "undecided"),
        ([float("nan")] * 3, "faster", "undecided (no run reached the target)"),
        ([0.8, 0.9, 1.0, 1.1, 1.2], "tie", "reproduced"),
        ([0.5, 0.6, 0.7, 0.8, 0.9], "tie", "contradicted"),
    ],
)
def test_the_verdict_rule(ratios: list[float], side: str, expected: str) -> None:
    from experiments.nigt.protocol import verdict

    assert verdict(ratios, side) == expected


def test_the_page_settles_a_claim_from_runs() -> None:
    from experiments.nigt.__main__ import Result, Setting
    from experiments.nigt.protocol import page

    def run(speed: float) -> list[dict[str, Any]]:
        return [
            {"iteration": i, "time": 10.0 * (i + 1), "used": 1, "mean_return": speed * i}
            for i in range(10)
        ]

    args = argparse.Namespace(
        scenarios=["comm"], budget=100.0, window=1, seeds=[0, 1, 2], tune_seeds=[0, 1],
        methods=["rennala", "synchronous", "synchronous-same-batch", "afedpg"],
        time_unit="step",
    )  # fmt: skip
    every: dict[Any, Any] = {}
    runs: dict[Any, Any] = {}
    for seed in range(3):
        # Rennala twice as fast as every baseline at M = 20; at M = 50 slower than them.
        for method, st, speed in (
            ("rennala", Setting(2**-7, 20, 0.1), 2.0),
            ("synchronous", Setting(2**-7, 0, 0.1), 1.0),
            ("synchronous-same-batch", Setting(2**-7, 20, 0.1), 1.0),
            ("afedpg", Setting(2**-7, 0, 0.1), 1.0),
        ):
            every["comm", method, seed, st] = runs["comm", method, seed] = run(speed)
        if seed < 2:
            every["comm", "rennala", seed, Setting(2**-8, 50, 0.1)] = run(0.5)
    best = {("comm", m): k[3] for k in every for m in [k[1]] if k[3].batch != 50}
    text = page({"reacher": Result(args, every, best, runs, "x")})
    line = next(x for x in text.splitlines() if "clear win (rennala / synchronous)" in x)
    assert "0.56 (0.56, 0.56), 3 seeds" in line and "**reproduced**" in line
    assert "0.0 -> 18.0" in line and "0.0 -> 9.0" in line  # every run's start and end
    sens = [x for x in text.splitlines() if "clear win (rennala / synchronous)" in x][1]
    cells = [c.strip() for c in sens.split("|")]
    assert cells[3] == "not run"  # no per-gradient configuration given
    assert cells[4] == "0.56 (0.56, 0.56), 3 seeds"  # M = 20: the choice, every seed
    assert cells[6].startswith("inf")  # M = 50: never reached the target
    assert "vs synchronous-same-batch" in cells[7]
    assert "| humanoid, equal times" not in text and "pending" in text
    assert "`M = 20, lr = 2^-7`" in text


def test_the_suite_estimate_lists_every_configuration() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "experiments.nigt", "--suite", "--dry-run"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    from experiments.nigt.__main__ import SUITE

    for name, _ in SUITE:
        assert f"{name}: " in done.stdout
    assert "CPU hours" in done.stdout


@pytest.mark.timeout(200)
def test_a_suite_replot_without_runs_writes_a_pending_page_and_nothing_else(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [
        sys.executable, "-m", "experiments.nigt", "--suite", "--only", "pendulum-hetero",
        "--replot", "--out", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nigt_protocol.md"]
    text = (tmp_path / "nigt_protocol.md").read_text()
    verdicts = [line for line in text.splitlines() if "| not run |" in line]
    from experiments.nigt.protocol import CLAIMS

    assert len(verdicts) == len(CLAIMS) and all(line.endswith("| pending |") for line in verdicts)


@pytest.mark.parametrize(
    ("ratios", "expected"),
    [
        ([0.5, 0.6, 0.7], "0.60 (0.54, 0.66), 3 seeds"),
        ([0.0, 0.0, 0.5], "0.00 (0.00, 0.30), 3 seeds; the baseline never reached the target on 2"),
        (
            [0.5, float("inf"), float("inf")],
            "inf (0.50, inf), 3 seeds; the paper's method never reached it on 2",
        ),
    ],
)
def test_a_ratio_says_which_side_never_reached_the_target(
    ratios: list[float], expected: str
) -> None:
    from experiments.nigt.protocol import show

    assert show(ratios) == expected
