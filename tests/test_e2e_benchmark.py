"""benchmarks/ppo_end_to_end.py: its contenders step the same envs, and CleanRL's continuous
PPO trains the same on aps as on Gymnasium's SyncVectorEnv."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import gymnasium as gym
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "ppo_end_to_end.py"
EXAMPLE = ROOT / "examples" / "ppo_vector.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ppo_end_to_end", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_commands_pass_compression_only_when_given() -> None:
    e2e = load()
    args = e2e.parser().parse_args(["--env-id", "Hopper-v5,Humanoid-v5"])
    every = e2e.commands(args, "Humanoid-v5", seed=3)
    assert set(every) == set(e2e.RUNS)
    assert all("--compression" not in command for command in every.values())
    assert every["gym-async"][-2:] == ["--backend", "gym-async"]
    assert e2e.SB3_CHILD in every["sb3-subproc"]
    for command in every.values():
        assert command[command.index("--env-id") + 1] == "Humanoid-v5"
        assert command[command.index("--seed") + 1] == "3"
    args = e2e.parser().parse_args(["--compression", "zstd"])
    every = e2e.commands(args, "CartPole-v1", seed=1)
    for name in ("aps-lockstep", "aps-detach", "aps-detach-overlap"):
        assert every[name][every[name].index("--compression") + 1] == "zstd"
    for name in ("gym-sync", "gym-async", "sb3-subproc"):
        assert "--compression" not in every[name]


@pytest.mark.timeout(120)
def test_subproc_adapter_steps_as_gymnasium_does() -> None:
    pytest.importorskip("stable_baselines3")
    e2e = load()
    ours = e2e.SubprocVectorEnv("CartPole-v1", 3)
    reference = gym.make_vec(
        "CartPole-v1",
        3,
        vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
    )
    try:
        assert ours.single_action_space == reference.single_action_space
        obs, _ = ours.reset(seed=7)
        expected, _ = reference.reset(seed=7)
        np.testing.assert_array_equal(obs, expected)
        rng = np.random.default_rng(0)
        ended = 0
        for _ in range(120):  # random CartPole episodes end within this: autoreset is tested
            actions = rng.integers(0, 2, size=3)
            got, want = ours.step(actions), reference.step(actions)
            for mine, theirs in zip(got[:4], want[:4], strict=True):
                np.testing.assert_array_equal(mine, theirs)
            ended += int(np.sum(got[2] | got[3]))
        assert ended > 0
    finally:
        ours.close()
        reference.close()


def returns(backend: str, cwd: Path) -> list[str]:
    """ppo_vector.py's printed returns on Pendulum (Box actions), without the timings."""
    command = [sys.executable, str(EXAMPLE), "--env-id", "Pendulum-v1", "--backend", backend]
    command += ["--total-timesteps", "1024", "--num-steps", "128"]
    command += ["--workers", "2", "--envs-per-worker", "1"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=150, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [
        re.sub(r", SPS \d+$| \| [\d,]+ env-steps in .*$", "", line)
        for line in proc.stdout.splitlines()
        if line.startswith(("iteration ", "summary: "))
    ]
    assert lines and lines[-1].startswith("summary: final mean return "), proc.stdout
    return lines


@pytest.mark.timeout(300)
def test_continuous_ppo_on_aps_prints_what_cleanrl_prints(tmp_path: Path) -> None:
    on_aps, on_gymnasium = returns("aps", tmp_path), returns("gym-sync", tmp_path)
    assert on_aps == on_gymnasium
    assert "return nan" not in on_aps[-1]  # Pendulum's 200-step episodes ended


@pytest.mark.timeout(300)
def test_a_tiny_mujoco_round_writes_one_table_per_env(tmp_path: Path) -> None:
    # Raw MuJoCo observations are float64: DETACH must bootstrap them in the critic's dtype.
    pytest.importorskip("mujoco")
    e2e = load()
    out = tmp_path / "e2e.json"
    argv = ["--env-id", "Hopper-v5", "--runs", "gym-sync,aps-detach", "--repeats", "1"]
    argv += ["--total-timesteps", "256", "--num-steps", "32", "--envs-per-worker", "2"]
    assert e2e.main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    runs = report["envs"]["Hopper-v5"]["samples"]
    assert set(runs) == {"gym-sync", "aps-detach"}
    for samples in runs.values():
        assert samples[0]["env_steps"] == 256
        assert samples[0]["curve"]  # a learning curve, [env-step, mean return] rows
    assert [row[0] for row in runs["aps-detach"][0]["curve"]] == [128, 256]


@pytest.mark.timeout(400)
def test_a_tiny_pixel_round_runs_every_mode_on_the_same_budget(tmp_path: Path) -> None:
    # Pong through EnvPool: in process (the reference), lockstep and DETACH on workers.
    pytest.importorskip("envpool")
    e2e = load()
    out = tmp_path / "e2e.json"
    argv = ["--pixels", "--repeats", "1", "--total-timesteps", "128", "--num-steps", "16"]
    assert e2e.main([*argv, "--envs-per-worker", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    runs = report["envs"]["Pong-v5"]["samples"]
    assert set(runs) == set(e2e.PIXEL_RUNS)
    for name, samples in runs.items():
        assert samples[0]["env_steps"] == 128, name
        assert [row[0] for row in samples[0]["curve"]] == [64, 128], name
    # Weights travel only in DETACH: every version to both workers under always-sync.
    assert runs["envpool-inprocess"][0]["weight_bytes"] == 0
    assert runs["aps-lockstep"][0]["weight_bytes"] == 0
    always = runs["aps-detach-always"][0]["weight_bytes"]
    assert always > 0 and runs["aps-detach-aps"][0]["weight_bytes"] <= always
    assert "envpool-inprocess" in report["medians"]
