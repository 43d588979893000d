"""Pixels: Atari through ale_py on workers, the Nature-CNN agent, and the Atari example."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("ale_py")
pytest.importorskip("cv2")

import aps  # noqa: E402
from aps.errors import ConfigError  # noqa: E402
from aps.policy import NatureCNN, Policy  # noqa: E402
from aps.vector import atari_env  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
FRAMES = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)


def spaces_of(obs: gym.Space[Any], actions: gym.Space[Any]) -> Any:
    return aps.policy.VectorEnvSpaces.of(obs, actions)


def frames(batch: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (batch, 4, 84, 84), dtype=np.uint8)


# -- the env ------------------------------------------------------------------------------------


def test_atari_env_gives_stacked_grayscale_frames_as_gymnasium_wrappers_do() -> None:
    env = atari_env("ALE/Pong-v5")
    import ale_py

    gym.register_envs(ale_py)
    reference = gym.wrappers.FrameStackObservation(
        gym.wrappers.AtariPreprocessing(
            gym.make("ALE/Pong-v5", frameskip=1, repeat_action_probability=0.0), noop_max=30
        ),
        4,
    )
    try:
        assert env.observation_space == FRAMES
        obs, _ = env.reset(seed=3)
        ref, _ = reference.reset(seed=3)
        np.testing.assert_array_equal(obs, ref)
        for action in [0, 2, 3, 1, 2, 2, 5, 4]:
            step, ref_step = env.step(action), reference.step(action)
            np.testing.assert_array_equal(step[0], ref_step[0])
            assert step[1:4] == ref_step[1:4]
    finally:
        env.close()
        reference.close()


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"frame_skip": 0}, "frame_skip must be an int >= 1, got 0"),
        ({"frame_stack": 2.0}, "frame_stack must be an int >= 1, got 2.0"),
        ({"noop_max": True}, "noop_max must be an int >= 0, got True"),
        ({"repeat_action_probability": 1.5}, "must be in [0, 1], got 1.5"),
        ({"env_id": "ALE/NoSuchGame-v5"}, "could not make 'ALE/NoSuchGame-v5'"),
    ],
)
def test_atari_env_refuses_bad_settings_naming_them(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        atari_env(**kwargs)
    assert needle in str(info.value)


@pytest.mark.timeout(120)
def test_workers_build_atari_env_by_import_path_and_match_a_local_vector_env() -> None:
    """Lockstep over TCP equals a local SyncVectorEnv of the same factory, frame for frame."""
    kwargs = {"env_id": "ALE/Pong-v5"}
    local = gym.vector.SyncVectorEnv(
        [lambda: atari_env(**kwargs)] * 2, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
    )
    remote = aps.ClusterEnv.local(
        "aps.vector:atari_env",
        env_kwargs=kwargs,
        num_workers=2,
        envs_per_worker=1,
        transport="tcp",
        autoreset_mode="SameStep",
    )
    try:
        obs, _ = remote.reset(seed=11)
        ref, _ = local.reset(seed=11)
        assert obs.dtype == np.uint8 and obs.shape == (2, 4, 84, 84)
        np.testing.assert_array_equal(obs, ref)
        rng = np.random.default_rng(0)
        for _ in range(12):
            actions = rng.integers(0, 6, size=2)
            got, want = remote.step(actions), local.step(actions)
            for a, b in zip(got[:4], want[:4], strict=True):
                np.testing.assert_array_equal(a, b)
    finally:
        remote.close()
        local.close()


# -- the agent ----------------------------------------------------------------------------------


def test_nature_cnn_has_the_nature_conv_stack() -> None:
    agent = NatureCNN(spaces_of(FRAMES, gym.spaces.Discrete(6)))
    convs = [m for m in agent.network if isinstance(m, torch.nn.Conv2d)]
    assert [(c.out_channels, c.kernel_size, c.stride) for c in convs] == [
        (32, (8, 8), (4, 4)),
        (64, (4, 4), (2, 2)),
        (64, (3, 3), (1, 1)),
    ]
    linear = [m for m in agent.network if isinstance(m, torch.nn.Linear)]
    assert [(lin.in_features, lin.out_features) for lin in linear] == [(64 * 7 * 7, 512)]
    assert agent.policy_head.out_features == 6


def test_nature_cnn_acts_through_the_policy_adapter_and_its_heads_match_training() -> None:
    policy = Policy.load("aps.policy:NatureCNN", FRAMES, gym.spaces.Discrete(6))
    assert policy.kind == "categorical" and policy.has_critic and policy.inference == "torch"
    policy.seed(0)
    x = frames(5)
    actions, log_probs, values = policy.act(x)
    assert actions.shape == (5,) and actions.dtype == np.int64 and values is not None
    agent = policy.module
    with torch.no_grad():
        _, want_log_probs, _, want_values = agent.get_action_and_value(
            torch.as_tensor(x), torch.as_tensor(actions)
        )
    np.testing.assert_allclose(log_probs, want_log_probs.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(values, want_values.reshape(-1).numpy(), rtol=1e-5, atol=1e-6)


def test_nature_cnn_reuses_the_trunk_only_for_the_same_batch_and_weights() -> None:
    agent = NatureCNN(spaces_of(FRAMES, gym.spaces.Discrete(6)))
    x = torch.as_tensor(frames(3), dtype=torch.float32)
    with torch.no_grad():
        agent.actor(x)
        for p in agent.parameters():
            p.mul_(0.5)  # weights change between the heads: no reuse
        value = agent.critic(x)
        want = agent.value_head(agent.network(x / 255.0))
    torch.testing.assert_close(value, want)
    with torch.no_grad():
        agent.actor(x)
        other = x.clone()
        other[0] = 0.0
        torch.testing.assert_close(
            agent.critic(other), agent.value_head(agent.network(other / 255.0))
        )


def test_nature_cnn_weights_round_trip_and_kl_tells_versions_apart() -> None:
    behaviour = Policy.load("aps.policy:NatureCNN", FRAMES, gym.spaces.Discrete(6))
    learner = behaviour.clone()
    x = frames(16, seed=1)
    assert behaviour.kl(learner, x) == 0.0
    weights = behaviour.get_weights()
    assert aps.policy.weights_nbytes(weights) == sum(
        t.numel() * 4 for t in behaviour.module.state_dict().values()
    )
    changed = {name: array * 1.5 for name, array in weights.items()}
    learner.set_weights(changed)
    assert behaviour.kl(learner, x) > 0.0
    behaviour.set_weights(changed)
    assert behaviour.kl(learner, x) == 0.0


@pytest.mark.parametrize(
    ("obs", "act", "needle"),
    [
        (gym.spaces.Box(0, 255, (84, 84), np.uint8), gym.spaces.Discrete(6), "[channels, height"),
        (gym.spaces.Box(0, 255, (4, 20, 20), np.uint8), gym.spaces.Discrete(6), ">= 36"),
        (FRAMES, gym.spaces.Box(-1, 1, (2,), np.float32), "needs a Discrete action space"),
    ],
)
def test_nature_cnn_refuses_spaces_it_cannot_handle(
    obs: gym.Space[Any], act: gym.Space[Any], needle: str
) -> None:
    with pytest.raises(ConfigError) as info:
        NatureCNN(spaces_of(obs, act))
    assert needle in str(info.value)


# -- the example --------------------------------------------------------------------------------

TINY = [
    "--total-timesteps", "128", "--num-steps", "16", "--workers", "2",
    "--envs-per-worker", "2", "--update-epochs", "1", "--num-minibatches", "2",
]  # fmt: skip


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("mode", "backend", "sync"),
    [
        ("detach", "envpool", "aps"),
        ("lockstep", "ale", "always"),
        ("detach", "ale", "always"),
        ("inprocess", "envpool", "always"),
    ],
)
def test_ppo_atari_example_runs_on_a_tiny_budget(
    tmp_path: Path, mode: str, backend: str, sync: str
) -> None:
    if backend == "envpool":
        pytest.importorskip("envpool")
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "examples" / "ppo_atari.py"),
            *TINY,
            "--mode",
            mode,
            "--backend",
            backend,
            "--sync",
            sync,
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=140,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "summary: " + mode in proc.stdout
    result = json.loads(out.read_text())
    assert result["global_step"] == 128
    if mode != "detach":
        assert result["weight_bytes"] == 0 and result["syncs"] == 0
        # aps's figures name the run's bound; in process there are none
        assert (result["verdict"] is None) == (mode == "inprocess")
        return
    assert result["versions"] == 2
    assert result["weight_bytes"] == result["syncs"] * result["bytes_per_version"]
    if sync == "always":
        assert result["syncs"] == 4  # each of the 2 versions reaches each of the 2 workers
    else:
        assert result["syncs"] >= 2  # the first version reaches both workers
        # the second rollout measured each worker's KL to version 2
        assert len(result["last_divergences"]) == 2
        assert all(d >= 0.0 for d in result["last_divergences"])


@pytest.mark.timeout(150)
def test_ppo_atari_listens_prints_the_worker_command_and_trains_compressed(
    tmp_path: Path,
) -> None:
    from aps.launch.local import terminate

    out = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("APS_TOKEN", None)  # the example writes its token to ./aps-token
    learner = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "examples" / "ppo_atari.py"),
            *TINY,
            "--backend",
            "ale",
            "--sync",
            "always",
            "--listen",
            "tcp://127.0.0.1:0",
            "--compression",
            "zstd",
            "--json",
            str(out),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    workers: list[subprocess.Popen[bytes]] = []
    try:
        assert learner.stdout is not None
        command = next((x.strip() for x in learner.stdout if "aps worker " in x), "")
        words = shlex.split(command)
        assert words[:2] == ["aps", "worker"] and words[2].startswith("tcp://127.0.0.1:")
        for flag, value in [
            ("--policy", "aps.policy:NatureCNN"),
            ("--compression", "zstd"),
            ("--num-envs", "2"),
        ]:
            assert words[words.index(flag) + 1] == value, command
        token_at = words.index("--token-file") + 1
        words[token_at] = str(tmp_path / words[token_at])  # the file, "copied" here
        # As long as the token aps token writes: 256 random bits as 64 hex digits.
        assert re.fullmatch(r"[0-9a-f]{64}", Path(words[token_at]).read_text().strip())
        for _ in range(2):
            workers.append(subprocess.Popen([sys.executable, "-m", "aps", *words[1:]], env=env))
        rest = learner.stdout.read()
        assert learner.wait(timeout=120) == 0
        assert "summary: detach" in rest
        result = json.loads(out.read_text())
        assert result["compression"] == "zstd"
        assert result["global_step"] == 128
        assert result["syncs"] == 4  # each of the 2 versions reaches each of the 2 workers
    finally:
        learner.kill()
        learner.wait()
        if learner.stdout is not None:
            learner.stdout.close()
        terminate(workers, grace=5.0)
