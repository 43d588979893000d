"""benchmarks/atari_learning.py: the learning check's summary from runs' figures.

The runs themselves take minutes of many cores (see docs/pixels.md); the example they run is
tested on a tiny budget in tests/test_atari.py. Here the summary is fed runs shaped as the
example writes them, so each verdict is shown to turn both ways.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # it imports cluster.py
    spec = importlib.util.spec_from_file_location(
        "atari_learning", ROOT / "benchmarks" / "atari_learning.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "atari_learning", module)
    spec.loader.exec_module(module)
    return module


def run(sync: str, seed: int, returns: list[float | None], weight_bytes: int) -> dict[str, Any]:
    """A run as ppo_atari.py's JSON has it: one curve row per iteration of 1,000 env-steps."""
    curve = [
        {"step": 1000 * (i + 1), "seconds": i + 1.0, "return": r, "weight_bytes": weight_bytes}
        for i, r in enumerate(returns)
    ]
    return {
        "sync": sync,
        "seed": seed,
        "final_return": returns[-1],
        "global_step": curve[-1]["step"],
        "complete": True,
        "seconds": curve[-1]["seconds"],
        "sps": 1000.0,
        "syncs": 2,
        "versions": len(returns),
        "weight_bytes": weight_bytes,
        "lag_mean": 0.0,
        "curve": curve,
    }


def test_return_at_reads_the_last_iteration_by_that_step(bench: ModuleType) -> None:
    curve = run("aps", 1, [None, 2.0, 3.0], 0)["curve"]
    assert bench.return_at(curve, 999) is None
    assert bench.return_at(curve, 1000) is None  # no episode had ended yet
    assert bench.return_at(curve, 2500) == 2.0
    assert bench.return_at(curve, 10**6) == 3.0


def test_verdicts_turn_both_ways(bench: ModuleType) -> None:
    random = [1.0, 2.0, 1.5, 1.5]
    always = [run("always", s, [2.0, 8.0 + s], 100) for s in (1, 2, 3)]
    close = [run("aps", s, [2.0, 9.0 + s / 2], 10) for s in (1, 2, 3)]
    summary = bench.summarize([*always, *close], random)
    assert summary["verdicts"] == {"learns": True, "bytes": True, "return": True}
    assert summary["weight_bytes_ratio"] == pytest.approx(0.1)

    # One seed at random's level fails "learns"; 30% of the bytes fails "bytes"; a mean far
    # under always-sync's interval fails "return".
    slow = [run("aps", s, [2.0, r], 30) for s, r in ((1, 1.5), (2, 4.0), (3, 4.0))]
    summary = bench.summarize([*always, *slow], random)
    assert summary["verdicts"] == {"learns": False, "bytes": False, "return": False}


def test_runs_cut_short_compare_at_the_fewest_env_steps(bench: ModuleType) -> None:
    runs = [run("always", 1, [1.0, 5.0, 9.0], 100), run("aps", 1, [1.0, 3.0], 10)]
    summary = bench.summarize(runs, [1.0, 1.0])
    assert summary["common_step"] == 2000
    assert summary["strategies"]["always"]["return_at_common_step"]["mean"] == 5.0
    assert summary["strategies"]["aps"]["return_at_common_step"]["mean"] == 3.0
    # Without always-sync there is nothing to compare against.
    alone = bench.summarize([run("aps", 1, [3.0], 10)], [1.0, 1.0])
    assert alone["verdicts"]["bytes"] is None and alone["verdicts"]["return"] is None


def test_replot_writes_the_table_json_and_plot_from_saved_runs(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "runs"
    out.mkdir()
    for r in (run("always", 1, [1.0, 6.0], 100), run("aps", 1, [1.0, 5.0], 10)):
        (out / f"Breakout-v5-{r['sync']}-1.json").write_text(json.dumps(r))
    (out / "run.json").write_text(
        json.dumps({"command": "python benchmarks/atari_learning.py", "date": "d",
                    "machine": {}, "random": [1.0, 2.0]})
    )  # fmt: skip
    report_path = tmp_path / "report.json"
    code = bench.main(["--replot", "--seeds", "1", "--out", str(out), "--json", str(report_path)])
    assert code == 0
    report = json.loads(report_path.read_text())
    assert report["missing"] == [] and set(report["curves"]) == {"always-1", "aps-1"}
    assert report_path.with_suffix(".png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "| aps | 5.0 |" in printed and "0.10x (goal <= 0.2x): yes" in printed
