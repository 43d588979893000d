"""The APS reproduction suite runs end to end on a tiny budget, and resumes."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parent.parent


def suite(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "experiments.aps", *args],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=ROOT,
    )


@pytest.mark.timeout(170)
def test_quick_suite_writes_the_page_and_resumes(tmp_path: Path) -> None:
    args = [
        "--quick",
        "--tasks",
        "ppo-cartpole",
        "--strategies",
        "always,aps-0.05",
        "--objectives",
        "paper",
        "--seeds",
        "2",
        "--timesteps",
        "512",
        "--out",
        str(tmp_path / "out"),
        "--docs",
        str(tmp_path / "docs"),
    ]
    first = suite(*args)
    assert first.returncode == 0, first.stderr[-4000:]
    with (tmp_path / "out" / "runs.csv").open() as file:
        rows = list(csv.DictReader(file))
    assert sorted((r["strategy"], r["seed"]) for r in rows) == [
        ("always", "1"),
        ("always", "2"),
        ("aps-0.05", "1"),
        ("aps-0.05", "2"),
    ]
    for row in rows:
        assert int(row["timesteps"]) == 512
        assert int(row["weight_bytes"]) == int(row["syncs"]) * int(row["bytes_per_version"])
    page = (tmp_path / "docs" / "aps.md").read_text()
    assert "| ppo-cartpole | paper |" in page
    assert "--strategies always,aps-0.05" in page  # the page names the command it ran
    for figure in ("aps_pareto.png", "aps_curves_steps.png", "aps_curves_time.png"):
        assert (tmp_path / "docs" / figure).stat().st_size > 0

    again = suite(*args)  # every result exists: nothing runs again
    assert again.returncode == 0, again.stderr[-4000:]
    assert "4 of 4 runs already have results" in again.stdout


def test_unknown_strategy_is_refused(tmp_path: Path) -> None:
    proc = suite("--strategies", "aps-fast", "--out", str(tmp_path), "--docs", str(tmp_path))
    assert proc.returncode == 2
    assert "unknown strategy 'aps-fast'" in proc.stderr
