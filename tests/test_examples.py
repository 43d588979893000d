"""The examples run to their end with tiny budgets, started as a user would start them."""

from __future__ import annotations

import csv
import itertools
import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TINY = ["--total-timesteps", "256", "--num-steps", "16", "--workers", "2", "--envs-per-worker", "2"]


BOUNDS = ("env-bound", "inference-bound", "wire-bound", "learner-bound", "straggler", "unknown")
"""How a verdict line starts (aps.metrics.verdict)."""


def run_process(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run an example with pipes (no terminal) for stdout and stderr; it must succeed."""
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=cwd,
    )
    assert proc.returncode == 0, f"{script} exited with {proc.returncode}:\n{proc.stderr[-4000:]}"
    return proc


def run(script: str, *args: str, cwd: Path) -> str:
    return run_process(script, *args, cwd=cwd).stdout


def verdict_line(stdout: str, prefix: str = "verdict: ") -> str:
    """The verdict an example printed after ``prefix``; it names one of the bounds."""
    lines = [line for line in stdout.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, stdout
    line = lines[0].removeprefix(prefix)
    assert line.startswith(BOUNDS), line
    return line


@pytest.mark.timeout(120)
def test_ppo_cluster(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    proc = run_process(
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
    assert "summary: final mean return" in proc.stdout
    result = json.loads(out.read_text())
    assert verdict_line(proc.stdout) == result["verdict"]
    # stderr is no terminal: the progress line is one plain line per iteration.
    progress = [line for line in proc.stderr.splitlines() if " sps=" in line]
    done = [line.split("] ")[1].split()[0] for line in progress]
    assert done == ["64/256", "128/256", "192/256", "256/256"]
    assert all(re.search(r" lag=\d+\.\d\d wire=\d+\.\d\dMB/s ", line) for line in progress)
    assert "\r" not in proc.stderr
    assert result["global_step"] == 256
    assert result["versions"] == 4  # 256 steps / (16 steps x 4 envs)
    assert result["syncs"] >= 2  # the first version reaches both workers
    assert result["weight_bytes"] == result["syncs"] * result["bytes_per_version"]
    assert result["always_sync_weight_bytes"] == 4 * 2 * result["bytes_per_version"]


@pytest.mark.timeout(120)
def test_ppo_cluster_with_a_weight_group(tmp_path: Path) -> None:
    """Versions leave the learner once, through the group; the run trains as without it."""
    pytest.importorskip("torch.distributed")
    out = tmp_path / "result.json"
    run(
        "ppo_cluster.py",
        *TINY,
        "--sync",
        "always",
        "--weight-group",
        "--no-progress",
        "--json",
        str(out),
        cwd=tmp_path,
    )
    result = json.loads(out.read_text())
    assert result["weight_group"] and result["global_step"] == 256
    frame_share = result["weight_group_bytes"] / result["versions"]
    # Two workers: the learner's share of each version is one piece in the scatter and one
    # in the all-gather, a third of the frame each, where the sessions would carry two frames.
    assert 0 < frame_share < result["bytes_per_version"] * 2
    assert result["syncs"] == 2 * result["versions"]  # every worker took every version


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("flags", "correction"), [(["--no-decoupled"], "none"), (["--correction", "vtrace"], "vtrace")]
)
def test_ppo_cluster_corrections_with_worker_values_in_process(
    tmp_path: Path, flags: list[str], correction: str
) -> None:
    out = tmp_path / "result.json"
    stdout = run(
        "ppo_cluster.py",
        *TINY,
        "--sync",
        "fixed",
        *flags,
        "--no-recompute-values",
        "--transport",
        "memory",
        "--no-progress",
        "--json",
        str(out),
        cwd=tmp_path,
    )
    assert "summary: final mean return" in stdout
    result = json.loads(out.read_text())
    assert result["correction"] == correction and result["global_step"] == 256


@pytest.mark.timeout(120)
def test_ppo_cluster_minatar_frames_with_the_relative_signal(tmp_path: Path) -> None:
    """Frames channels last get the CNN on both sides; RelativeAPS decides the syncs."""
    pytest.importorskip("minatar")
    out = tmp_path / "result.json"
    run(
        "ppo_cluster.py",
        *TINY,
        "--env-id",
        "MinAtar/Breakout-v1",
        "--hidden-size",
        "32",
        "--sync",
        "relative",
        "--drift-updates",
        "2",
        "--max-lag",
        "3",
        "--correction",
        "vtrace",
        "--no-progress",
        "--json",
        str(out),
        cwd=tmp_path,
    )
    result = json.loads(out.read_text())
    assert result["env_id"] == "MinAtar/Breakout-v1" and result["global_step"] == 256
    assert result["sync"] == "relative"
    # 4 versions: each worker synced to the first; later ones only by the signal or the
    # bound of 3, so never more than 2 per worker in all and never a lag past 3.
    assert 2 <= result["syncs"] <= 8 and result["lag_max"] <= 3
    # The workers built the learner's CNN from the import path: the bytes are its size.
    agent_bytes = 4 * sum(
        (16 * 4 * 9 + 16) + (16 * 8 * 8 * 32 + 32) + (32 * out_size + out_size)
        for out_size in (1, 3)
    )
    assert result["bytes_per_version"] == agent_bytes


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
    assert stdout.rstrip().splitlines()[-1].startswith("where the APS run's time went: ")
    verdict_line(stdout, "where the APS run's time went: ")


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


@pytest.mark.timeout(120)
def test_ppo_lstm_writes_the_learners_figures(tmp_path: Path) -> None:
    figures = tmp_path / "figures"
    tiny = ["--total-timesteps", "384", "--num-steps", "16", "--envs-per-worker", "4"]
    stdout = run(
        "ppo_lstm.py", *tiny, "--figures", str(figures), "--figures-interval", "0", cwd=tmp_path
    )
    # 3 rollouts of 16 steps x 8 envs; a row after each (interval 0) and a last one at the end.
    steps = [128.0, 256.0, 384.0, 384.0]
    with (figures / "figures.csv").open(newline="") as file:
        rows = list(csv.DictReader(file))
    assert [float(row["env_steps"]) for row in rows] == steps
    assert [float(row["transitions"]) for row in rows] == steps  # DETACH: chunks of them
    per_worker = [float(v) for k, v in rows[-1].items() if re.fullmatch(r"worker/\d+/env_steps", k)]
    assert per_worker == [192.0, 192.0]  # 2 workers of 4 envs
    assert all(float(row["window/env_steps_per_second"]) > 0 for row in rows[:3])
    assert float(rows[-1]["window/env_steps_per_second"]) == 0  # nothing stepped since row 3
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    events = accumulator.EventAccumulator(str(figures), size_guidance={"scalars": 0})
    events.Reload()
    scalars = events.Scalars("aps/env_steps")
    assert [point.value for point in scalars] == steps
    assert [point.step for point in scalars] == steps  # on the env-steps axis
    assert len(events.Scalars("aps/window/bytes_received_per_second")) == 4
    # stdout is no terminal: one progress line per rollout, then the summary and the verdict.
    progress = [line for line in stdout.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in progress] == [
        "step 128/384",
        "step 256/384",
        "step 384/384",
    ]
    assert all(re.search(r" \| lag \d+\.\d\d \| \d+\.\d\d MB/s wire$", line) for line in progress)
    verdict_line(stdout)


@pytest.mark.timeout(120)
def test_ppo_lstm_rewrites_its_progress_line_on_a_terminal(tmp_path: Path) -> None:
    parent, child = pty.openpty()
    tiny = ["--total-timesteps", "256", "--num-steps", "16", "--envs-per-worker", "4"]
    with subprocess.Popen(
        [sys.executable, str(EXAMPLES / "ppo_lstm.py"), *tiny, "--backend", "gym-sync"],
        stdout=child,
        stderr=subprocess.DEVNULL,
        cwd=tmp_path,
    ) as proc:
        os.close(child)
        output = b""
        deadline = time.monotonic() + 100
        while time.monotonic() < deadline:
            if not select.select([parent], [], [], deadline - time.monotonic())[0]:
                break
            try:
                data = os.read(parent, 65536)
            except OSError:  # the child closed the terminal: it ended
                break
            if not data:
                break
            output += data
        os.close(parent)
        assert proc.wait(timeout=10) == 0, output[-2000:]
    text = output.decode()
    # The second rollout's line overwrites the first's in place; the last ends with a newline.
    assert text.startswith("\rstep 128/256 | "), text
    assert "\x1b[K\rstep 256/256 | " in text
    assert text.count("\n") == 2  # after the last progress line, after the summary
    assert "\x1b[K\r\nsummary: final mean return" in text  # the terminal turns \n into \r\n


def test_ppo_lstm_figures_need_a_learner(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "ppo_lstm.py"), "--backend", "gym-sync", "--figures", "x"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "--figures needs --backend aps (a learner), got --backend gym-sync" in proc.stderr
    assert not (tmp_path / "x").exists()


def test_ppo_lstm_help_shows_defaults() -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "ppo_lstm.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0
    assert "(default: 100000)" in proc.stdout and "(default: gym-sync)" not in proc.stdout
