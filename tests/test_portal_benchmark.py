"""``benchmarks/portal.py`` runs end to end on a tiny budget and reports what it measured.

The figures themselves move with load and are not checked; what is checked is that every
hand-off it names was measured and that both sides of the step comparison ran every round.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import benchmark_module


@pytest.fixture(scope="module")
def portal() -> Iterator[ModuleType]:
    with benchmark_module("portal") as module:
        yield module


@pytest.mark.timeout(180)
def test_portal_benchmark_reports_every_handoff_and_both_step_loops(
    portal: ModuleType, tmp_path: Path
) -> None:
    out = tmp_path / "portal.json"
    assert portal.main(["--calls", "50", "--rounds", "2", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert set(record["handoff_us"]) == {
        "floor",
        "hand-off uvloop",
        "hand-off asyncio",
        "borrowed uvloop",
        "borrowed asyncio",
        "reentry uvloop main thread",
        "reentry uvloop other thread",
        "reentry asyncio main thread",
        "reentry asyncio other thread",
    }
    assert all(us > 0 for us in record["handoff_us"].values())
    step = record["step"]
    assert set(step["us_per_call"]) == set(portal.STEPPERS)
    assert all(len(us) == 2 for us in step["us_per_call"].values())
    assert step["ratio_per_round"]["await Learner.step, uvloop"] == [1.0, 1.0]
    for low, high in [*step["median_ratio_95ci"].values(), step["same_loop_median_ratio_95ci"]]:
        assert 0 < low <= high
    assert len(step["same_loop_ratio_per_round"]) == 2
    assert 0 < record["ceiling"] < 1
