"""The ``aps worker`` command line, run as a real subprocess against a real learner."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import aps
from tests.conftest import FAST


def test_help_explains_every_option() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "aps", "worker", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for option in ("--env", "--num-envs", "--seed", "--token-file", "--env-kwargs", "--no-uvloop"):
        assert option in out
    assert "module:factory" in out and "path/to/envs.py:factory" in out
    # Each option's help is whole: --policy's ends its sentence before --allow-policy starts.
    flat = " ".join(out.split())
    policy = flat[flat.index("--policy IMPORT_PATH ") : flat.index("--allow-policy PATTERN ")]
    assert policy.rstrip().endswith("pass the learner's own policy here"), policy


async def run_cli_worker(
    url: str, *args: str, env: dict[str, str] | None = None
) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "aps", "worker", url, *args,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


async def test_worker_with_token_file_and_env_file(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    token_file.chmod(0o600)  # a token file open to others is refused
    env_file = tmp_path / "my_envs.py"
    env_file.write_text(
        textwrap.dedent(
            """
            import gymnasium as gym

            def make(length=200):
                return gym.make("Pendulum-v1", max_episode_steps=length)
            """
        )
    )
    async with aps.Learner(
        "tcp://127.0.0.1:0", num_workers=1, token="s3cret", timeouts=FAST
    ) as learner:
        process = await run_cli_worker(
            learner.url,
            "--env", f"{env_file}:make",
            "--num-envs", "3",
            "--token-file", str(token_file),
            "--env-kwargs", '{"length": 5}',
        )  # fmt: skip
        try:
            await learner.reset(seed=0)
            for t in range(1, 6):
                _, _, _, truncated, _ = await learner.step(np.zeros((3, 1), np.float32))
                # Pendulum never terminates: only the time limit from --env-kwargs ends it.
                assert truncated.tolist() == [t == 5] * 3
            assert learner.workers[0].env_id == f"{env_file}:make"
            assert learner.workers[0].pid == process.pid
        finally:
            await learner.aclose()
            assert await asyncio.wait_for(process.wait(), 10) == 0


async def test_wrong_token_exits_nonzero_with_a_clear_message(tmp_path: Path) -> None:
    async with aps.Learner(
        "tcp://127.0.0.1:0", num_workers=1, token="right", timeouts=FAST
    ) as learner:
        process = await run_cli_worker(
            learner.url, "--env", "CartPole-v1", env={"APS_TOKEN": "wrong"}
        )
        _, stderr = await asyncio.wait_for(process.communicate(), 20)
    assert process.returncode == 1
    assert b"AuthError" in stderr and b"token" in stderr


async def test_unreachable_learner_times_out() -> None:
    process = await run_cli_worker(
        "tcp://127.0.0.1:9", "--env", "CartPole-v1", "--connect-timeout", "0.5"
    )
    _, stderr = await asyncio.wait_for(process.communicate(), 20)
    assert process.returncode == 1
    assert b"could not reach the learner" in stderr


@pytest.mark.parametrize("bad", ["[1, 2]", "not json"])
def test_bad_env_kwargs(bad: str) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "aps",
            "worker",
            "tcp://127.0.0.1:9",
            "--env",
            "X",
            "--env-kwargs",
            bad,
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2  # argparse's usage error, not a traceback
    message = out.stderr.strip().splitlines()[-1]
    assert message.startswith("aps worker: error: argument --env-kwargs: ")
    assert repr(bad) in message and "JSON object" in message and "--env-kwargs '{" in message
    assert "invalid loads value" not in out.stderr and "Traceback" not in out.stderr


def test_cluster_env_waits_for_workers_started_elsewhere(tmp_path: Path) -> None:
    import socket

    with socket.socket() as probe:  # a free port to give the workers before the learner binds
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"tcp://127.0.0.1:{port}"
    token_file = tmp_path / "token"
    token_file.write_text("t0ken")
    token_file.chmod(0o600)
    command = [sys.executable, "-m", "aps", "worker", url, "--env", "CartPole-v1"]
    command += ["--num-envs", "2", "--token-file", str(token_file), "--log-level", "WARNING"]
    workers = [subprocess.Popen(command) for _ in range(2)]
    try:
        envs = aps.ClusterEnv(url, num_workers=2, token="t0ken")  # workers keep dialing till up
        try:
            obs, _ = envs.reset(seed=0)
            assert obs.shape == (4, 4) and envs.num_envs == 4
            envs.step(np.zeros(4, np.int64))
        finally:
            envs.close()
        assert [w.wait(timeout=20) for w in workers] == [0, 0]  # they leave on goodbye
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
