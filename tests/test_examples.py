"""The examples run to their end with tiny budgets, started as a user would start them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TINY = ["--total-timesteps", "256", "--num-steps", "16", "--workers", "2", "--envs-per-worker", "2"]


def run(script: str, *args: str, cwd: Path) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=cwd,
    )
    assert proc.returncode == 0, f"{script} exited with {proc.returncode}:\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.mark.timeout(120)
def test_ppo_cluster(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    stdout = run(
        "ppo_cluster.py",
        *TINY,
        "--sync",
        "aps",
        "--kl-threshold",
        "0.01",
        "--track-tb",
        "--logdir",
        str(tmp_path / "runs"),
        "--json",
        str(out),
        cwd=tmp_path,
    )
    assert "summary: final mean return" in stdout
    result = json.loads(out.read_text())
    assert result["global_step"] == 256
    assert result["versions"] == 4  # 256 steps / (16 steps x 4 envs)
    assert result["syncs"] >= 2  # the first version reaches both workers
    assert result["weight_bytes"] == result["syncs"] * result["bytes_per_version"]
    assert result["always_sync_weight_bytes"] == 4 * 2 * result["bytes_per_version"]


@pytest.mark.timeout(120)
def test_ppo_cluster_paper_objective_worker_values_in_process(tmp_path: Path) -> None:
    stdout = run(
        "ppo_cluster.py",
        *TINY,
        "--sync",
        "fixed",
        "--no-decoupled",
        "--no-recompute-values",
        "--transport",
        "memory",
        "--no-progress",
        cwd=tmp_path,
    )
    assert "summary: final mean return" in stdout


@pytest.mark.timeout(120)
def test_dqn_async(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    stdout = run(
        "dqn_async.py",
        *TINY,
        "--learning-starts",
        "64",
        "--batch-size",
        "16",
        "--gradient-steps",
        "2",
        "--sync",
        "always",
        "--json",
        str(out),
        cwd=tmp_path,
    )
    assert "summary: final mean return" in stdout
    result = json.loads(out.read_text())
    assert result["global_step"] >= 256
    assert result["gradient_steps"] > 0
    assert result["versions"] == 1 + result["gradient_steps"]  # a version per gradient step


@pytest.mark.timeout(120)
def test_dqn_async_over_memory_transport(tmp_path: Path) -> None:
    stdout = run(
        "dqn_async.py",
        *TINY,
        "--learning-starts",
        "64",
        "--batch-size",
        "16",
        "--transport",
        "memory",
        "--no-progress",
        cwd=tmp_path,
    )
    assert "summary: final mean return" in stdout


@pytest.mark.timeout(120)
def test_ppo_vector(tmp_path: Path) -> None:
    stdout = run("ppo_vector.py", *TINY, cwd=tmp_path)
    assert "summary: final mean return" in stdout


@pytest.mark.timeout(120)
def test_demo(tmp_path: Path) -> None:
    stdout = run(
        "demo.py",
        "--total-timesteps",
        "256",
        "--num-steps",
        "16",
        "--envs-per-worker",
        "2",
        cwd=tmp_path,
    )
    assert "always-sync" in stdout
    assert "summary: APS final return" in stdout
    assert "(measured)" in stdout


@pytest.mark.timeout(120)
def test_custom_transport(tmp_path: Path) -> None:
    stdout = run("custom_transport.py", cwd=tmp_path)
    assert "passed the factory checks" in stdout
