"""python -m experiments.nigt runs, writes its CSV and summary, and resumes from saved runs."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("tqdm")

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["--env", "Pendulum-v1", "--workers", "3", "--batch", "4", "--budget", "250"]


def run(out: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "experiments.nigt", *ARGS, "--seeds", "0", "--out", str(out)]
    return subprocess.run(command, capture_output=True, text=True, timeout=280, cwd=ROOT, env=env)


@pytest.mark.timeout(300)
def test_the_experiment_runs_and_resumes(tmp_path: Path) -> None:
    first = run(tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "Rennala / synchronous" in first.stdout
    with (tmp_path / "nigt_sim_pendulum.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert {(r["scenario"], r["method"]) for r in rows} == {
        (s, m) for s in ("equal", "sqrt", "comm") for m in ("rennala", "malenia", "synchronous")
    }
    assert all(float(r["time"]) > 0 for r in rows)
    saved = sorted((tmp_path / "runs").iterdir())
    assert len(saved) == 9
    stamps = [p.stat().st_mtime_ns for p in saved]
    again = run(tmp_path)  # every run is saved: nothing is run twice
    assert again.returncode == 0, again.stderr[-3000:]
    assert [p.stat().st_mtime_ns for p in saved] == stamps
    assert again.stdout == first.stdout
