"""examples/nigt_heterogeneous.py runs to its end with --quick and writes its CSVs."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "nigt_heterogeneous.py"


@pytest.mark.timeout(150)
def test_nigt_heterogeneous_quick(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=140,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, f"exited with {proc.returncode}:\n{proc.stderr[-4000:]}"
    assert "time-to-reward ratio Rennala NIGT / Synchronized NIGT" in proc.stdout
    for setting in ("speeds", "envs"):
        with (out / f"nigt_{setting}.csv").open(newline="") as handle:
            rows = list(csv.DictReader(handle))
        assert {row["method"] for row in rows} == {"rennala", "malenia", "synchronous"}
        assert all(row["setting"] == setting for row in rows)
        # Every run starts with the initial policy's evaluation and ends at the budget.
        starts = [row for row in rows if row["iteration"] == "-1"]
        assert len(starts) == 3 and all(row["eval_avg"] for row in starts)
        for method in ("rennala", "malenia", "synchronous"):
            last = [row for row in rows if row["method"] == method][-1]
            assert int(last["cum_used"]) >= 12 and last["eval_avg"]
