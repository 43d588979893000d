"""The examples run to their end with tiny budgets, started as a user would start them."""

from __future__ import annotations

import itertools
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
def test_ppo_cluster_overlapping_rollouts(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    run(
        "ppo_cluster.py",
        *TINY,
        "--sync",
        "always",
        "--overlap-rollouts",
        "--no-progress",
        "--json",
        str(out),
        cwd=tmp_path,
    )
    result = json.loads(out.read_text())
    assert result["global_step"] == 256 and result["overlap_rollouts"]
    # The first two batches are both acted with version 1 (the second starts before the
    # first is trained on), so 4 batches take 3 versions, where 4 rollouts take 4.
    assert result["versions"] == 3


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


def mlp_params(sizes: list[int]) -> int:
    """Weights and biases of fully connected layers of these widths, input first."""
    return sum(n_in * n_out + n_out for n_in, n_out in itertools.pairwise(sizes))


@pytest.mark.timeout(120)
def test_ppo_cluster_sized_policy_reaches_the_workers(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    run(
        "ppo_cluster.py",
        *TINY,
        "--hidden-size",
        "48",
        "--num-layers",
        "3",
        "--sync",
        "always",
        "--no-progress",
        "--json",
        str(out),
        cwd=tmp_path,
    )
    result = json.loads(out.read_text())
    # CartPole: 4 observations, 2 actions; an actor and a critic of 3 layers of 48 units.
    params = mlp_params([4, 48, 48, 48, 2]) + mlp_params([4, 48, 48, 48, 1])
    assert result["bytes_per_version"] == 4 * params
    # The workers loaded every version the learner sent: their arrays fit their own agents.
    assert result["syncs"] == 2 * result["versions"]
    assert 0 <= result["lag_p95"] <= result["lag_max"]
    assert [row["global_step"] for row in result["curve"]] == [64, 128, 192, 256]


@pytest.mark.timeout(120)
def test_ppo_cluster_takes_a_compression_setting(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    run(
        "ppo_cluster.py",
        *TINY,
        "--compression",
        "zstd",
        "--sync",
        "always",
        "--no-progress",
        "--json",
        str(out),
        cwd=tmp_path,
    )
    result = json.loads(out.read_text())
    assert result["compression"] == "zstd"
    assert result["global_step"] == 256
    assert result["syncs"] == 2 * result["versions"]  # every version reached both workers


@pytest.mark.timeout(120)
def test_ppo_cluster_refuses_an_unknown_compression(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "ppo_cluster.py"), "--compression", "gzip"],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "--compression must be one of auto, zstd, lz4, none, got 'gzip'" in proc.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [["--hidden-size", "0"], ["--num-layers", "0"]])
def test_ppo_cluster_refuses_an_empty_policy(tmp_path: Path, size: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "ppo_cluster.py"), *size],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "must be an int >= 1, got 0" in proc.stderr


@pytest.mark.timeout(120)
def test_ppo_cluster_continuous_pendulum(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    run(
        "ppo_cluster.py",
        *TINY,
        "--env-id",
        "Pendulum-v1",
        "--total-timesteps",
        "1024",  # 256 steps of each env: every env ends a 200-step episode
        "--num-steps",
        "32",
        "--norm-reward",
        "--sync",
        "aps",
        "--no-progress",
        "--json",
        str(out),
        cwd=tmp_path,
    )
    result = json.loads(out.read_text())
    # Pendulum: 3 observations, 1 action; a Gaussian actor (mean and log-std) and a critic.
    params = mlp_params([3, 64, 64, 1]) + 1 + mlp_params([3, 64, 64, 1])
    assert result["bytes_per_version"] == 4 * params
    assert result["global_step"] == 1024
    assert result["final_episodes"] == 4
    assert result["final_return"] < 0  # its rewards are never positive: they are the env's


@pytest.mark.timeout(120)
def test_ppo_cluster_continuous_mujoco(tmp_path: Path) -> None:
    pytest.importorskip("mujoco")
    out = tmp_path / "result.json"
    run(
        "ppo_cluster.py",
        *TINY,
        "--env-id",
        "HalfCheetah-v5",
        "--norm-obs",
        "--norm-reward",
        "--no-progress",
        "--json",
        str(out),
        cwd=tmp_path,
    )
    result = json.loads(out.read_text())
    params = mlp_params([17, 64, 64, 6]) + 6 + mlp_params([17, 64, 64, 1])
    assert result["bytes_per_version"] == 4 * params
    assert result["global_step"] == 256


@pytest.mark.timeout(120)
def test_dqn_async_sized_q_network(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    run(
        "dqn_async.py",
        *TINY,
        "--learning-starts",
        "64",
        "--batch-size",
        "16",
        "--hidden-size",
        "40",
        "--num-layers",
        "3",
        "--sync",
        "always",
        "--no-progress",
        "--json",
        str(out),
        cwd=tmp_path,
    )
    result = json.loads(out.read_text())
    assert result["hidden_sizes"] == [40, 40, 40]
    assert result["bytes_per_version"] == 4 * mlp_params([4, 40, 40, 40, 2])
    assert result["syncs"] >= 2  # the workers loaded the sized Q-network's weights
    assert result["curve"][-1]["global_step"] == result["global_step"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("variant", [[], ["--backend", "gym-sync"], ["--no-lstm"]])
def test_ppo_lstm(tmp_path: Path, variant: list[str]) -> None:
    out = tmp_path / "result.json"
    tiny = ["--total-timesteps", "256", "--num-steps", "16", "--envs-per-worker", "4"]
    stdout = run("ppo_lstm.py", *tiny, *variant, "--json", str(out), cwd=tmp_path)
    assert "summary: final mean return" in stdout
    result = json.loads(out.read_text())
    assert result["global_step"] == 256  # 2 rollouts of 16 steps x 8 envs
    assert result["lstm"] == ("--no-lstm" not in variant)


def test_ppo_lstm_help_shows_defaults() -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "ppo_lstm.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0
    assert "(default: 100000)" in proc.stdout and "(default: gym-sync)" not in proc.stdout
