"""CleanRL's PPO trains the same on aps as on Gymnasium's SyncVectorEnv (docs/cleanrl.md).

``examples/ppo_vector.py`` runs with ``--backend aps`` (envs on two worker processes) and
``--backend gym-sync`` (CleanRL's own line) from the same seed; since the envs' outputs are
bit-identical (tests/test_cluster_env.py), so is the training: the returns it prints match.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ppo_vector.py"
ARGS = [
    "--total-timesteps",
    "2048",
    "--num-steps",
    "64",
    "--workers",
    "2",
    "--envs-per-worker",
    "2",
]


def returns(backend: str, cwd: Path) -> list[str]:
    """The training's printed results, without the timings."""
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), *ARGS, "--backend", backend],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [
        re.sub(r", SPS \d+$| \| [\d,]+ env-steps in .*$", "", line)
        for line in proc.stdout.splitlines()
        if line.startswith(("iteration ", "summary: "))
    ]
    assert lines and lines[-1].startswith("summary: final mean return "), proc.stdout
    return lines


@pytest.mark.timeout(300)
def test_ppo_vector_on_aps_prints_what_cleanrl_prints(tmp_path: Path) -> None:
    on_aps, on_gymnasium = returns("aps", tmp_path), returns("gym-sync", tmp_path)
    assert on_aps == on_gymnasium
    assert "return nan" not in on_aps[-1]  # episodes ended, so the returns say something
