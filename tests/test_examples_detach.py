"""DETACH across machines from the example: the learner listens, workers are started by hand."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from aps.launch.local import terminate

REPO = Path(__file__).resolve().parent.parent
TINY = ["--total-timesteps", "128", "--num-steps", "16", "--workers", "2", "--envs-per-worker", "2"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("example", ["ppo_cluster.py", "dqn_async.py"])
def test_the_example_prints_the_worker_command_and_trains_with_external_workers(
    tmp_path: Path, example: str
) -> None:
    out = tmp_path / "result.json"
    learner = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "examples" / example),
            *TINY,
            "--listen",
            "tcp://127.0.0.1:0",
            "--external-workers",
            "--no-progress",
            "--json",
            str(out),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    workers: list[subprocess.Popen[bytes]] = []
    try:
        assert learner.stdout is not None
        command = ""
        for line in learner.stdout:
            if line.strip().startswith("aps worker "):
                command = line.strip()
                break
        assert command, "the example printed no worker command"
        words = shlex.split(command)
        assert "--token-file" in words and words[2].startswith("tcp://127.0.0.1:")
        token_at = words.index("--token-file") + 1
        words[token_at] = str(tmp_path / words[token_at])  # the file, "copied" here
        # As long as the token aps token writes: 256 random bits as 64 hex digits.
        assert re.fullmatch(r"[0-9a-f]{64}", Path(words[token_at]).read_text().strip())
        for _ in range(2):
            workers.append(
                subprocess.Popen(
                    [sys.executable, "-m", "aps", *words[1:]],
                    cwd=REPO,  # a checkout of the repository: the policy's path resolves
                    env={**os.environ, "PYTHONPATH": str(REPO)},
                )
            )
        rest = learner.stdout.read()
        assert learner.wait(timeout=100) == 0
        assert "summary: final mean return" in rest
        result = json.loads(out.read_text())
        assert result["global_step"] == 128
    finally:
        learner.kill()
        learner.wait()
        if learner.stdout is not None:
            learner.stdout.close()
        terminate(workers, grace=5.0)
