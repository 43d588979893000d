"""The Slurm launcher against a real single-node Slurm started here, and its batch script.

The fixture writes a minimal slurm.conf (this host, one node, one partition), starts munged,
slurmctld and slurmd from the Debian packages ``slurm-wlm`` and ``munge``, waits until the
node is idle, and stops them all afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import SyncVectorEnv

import aps
import aps.launch
from aps.launch.slurm import sbatch_script
from tests.test_cluster_env import assert_same

WORKERS, ENVS_PER_WORKER, STEPS = 2, 3, 40
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scancel", "sinfo")
SECRET = "s3cret-t0ken"


# The script, without a cluster.


def spec(**kwargs: object) -> aps.launch.WorkerSpec:
    fields: dict[str, object] = {"env": "CartPole-v1", "num_workers": 4, "envs_per_worker": 8}
    fields.update(kwargs)
    return aps.launch.WorkerSpec(**fields).for_learner(  # type: ignore[arg-type]
        "tcp://learner.example:7000", token=SECRET
    )


def test_script_runs_one_worker_per_task_with_seeds_from_the_task_id() -> None:
    text = sbatch_script(
        spec(seed=5, env_kwargs=({"g": 9.8},) * 4),
        nodes=2,
        tasks_per_node=2,
        partition="cpu",
        time="01:30:00",
        cpus_per_task=2,
        extra_sbatch=["--qos=high", "#SBATCH --constraint=skylake"],
        output="/shared/aps-%j.out",
        python="/opt/venv/bin/python",
        token_file="/shared/.token",
    )
    assert text.startswith("#!/bin/bash\n")
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert directives == [
        "#SBATCH --job-name=aps-workers",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=2",
        "#SBATCH --cpus-per-task=2",
        "#SBATCH --partition=cpu",
        "#SBATCH --time=01:30:00",
        "#SBATCH --output=/shared/aps-%j.out",
        "#SBATCH --qos=high",
        "#SBATCH --constraint=skylake",
    ]
    # sbatch reads directives only before the first command.
    first_command = next(
        i for i, line in enumerate(text.splitlines()) if line and not line.startswith("#")
    )
    assert first_command > text.splitlines().index("#SBATCH --constraint=skylake")
    assert "exec /opt/venv/bin/python -P -m aps worker tcp://learner.example:7000" in text
    assert "--env CartPole-v1 \\\n" in text and "--num-envs 8 \\\n" in text
    assert "local SEED=5 ENVS_PER_WORKER=8" in text
    assert '--seed "$((SEED + SLURM_PROCID * ENVS_PER_WORKER))"' in text
    assert "--env-kwargs '{\"g\": 9.8}'" in text  # the same for every task: no case table
    assert "--token-file /shared/.token" in text
    assert text.rstrip().endswith("srun --kill-on-bad-exit=0 bash -c aps_worker")
    assert SECRET not in text
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)  # valid shell


def test_script_gives_each_task_its_own_kwargs_and_runs_them(tmp_path: Path) -> None:
    kwargs: tuple[dict[str, object], ...] = ({"g": 9.8}, {"g": 4.0}, {"name": "it's"}, {})
    text = sbatch_script(spec(env_kwargs=kwargs, comm_delays=(0.0, 0.5, 0.0, 0.0)), nodes=4)
    assert 'case "$SLURM_PROCID" in' in text
    assert "--env-kwargs" in text and "--comm-delay 0.5" in text
    assert "APS_TOKEN" in text and SECRET not in text  # no token file: the environment
    # Run the task function as srun would (stopping before exec): each task gets its own.
    shim = text.replace("    exec ", "    printf '%s\\n' ").split("srun ")[0]
    for task, expected in enumerate(kwargs):
        out = subprocess.run(
            ["bash", "-c", shim + "aps_worker"],
            env={**os.environ, "SLURM_PROCID": str(task)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
        if expected:
            assert out[out.index("--env-kwargs") + 1] == json.dumps(expected)
        else:
            assert "--env-kwargs" not in out
        assert ("--comm-delay" in out) == (task == 1)


def test_script_refuses_bad_input() -> None:
    with pytest.raises(aps.ConfigError, match="4 workers but the job runs 1 nodes x 2 tasks"):
        sbatch_script(spec(), nodes=1, tasks_per_node=2)
    with pytest.raises(aps.ConfigError, match="sbatch options"):
        sbatch_script(spec(), nodes=4, extra_sbatch=["qos=high"])
    with pytest.raises(aps.ConfigError, match="sbatch options"):
        aps.launch.slurm("CartPole-v1", extra_sbatch=["--qos=high\nrm -rf /"])


def test_cli_prints_the_script() -> None:
    out = subprocess.run(
        [
            sys.executable, "-m", "aps", "slurm-script", "tcp://learner.example:7000",
            "--env", "CartPole-v1", "--num-envs", "8", "--nodes", "2", "--tasks-per-node", "2",
            "--partition", "cpu", "--seed", "5", "--extra-sbatch=--qos=high",
            "--token-file", "/shared/.token", "--python", "/opt/venv/bin/python",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout  # fmt: skip
    assert out == sbatch_script(
        spec(seed=5, log_level="INFO"),
        nodes=2,
        tasks_per_node=2,
        partition="cpu",
        extra_sbatch=["--qos=high"],
        python="/opt/venv/bin/python",
        token_file="/shared/.token",
    )


def token_files(directory: Path) -> list[Path]:
    return list(directory.glob(".aps-token-*"))


async def test_missing_sbatch_is_a_launch_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no Slurm commands on it
    launcher = aps.launch.slurm("CartPole-v1", tasks_per_node=2, directory=tmp_path / "job")
    learner = aps.Learner("tcp://127.0.0.1:0", num_workers=2, launcher=launcher)
    with pytest.raises(aps.LaunchError, match="'sbatch' is not on PATH") as error:
        await learner.start()
    assert "command not found" in error.value.stderr
    assert not token_files(tmp_path / "job")  # nothing left readable
    with pytest.raises(aps.InvalidState):
        await learner.start()  # the failed start closed the learner


# A real single-node Slurm.


@dataclass
class Slurm:
    directory: Path
    host: str

    def squeue(self, job_id: str) -> str:
        """The job's line in the default squeue view (pending and running jobs only)."""
        return subprocess.run(
            ["squeue", "--noheader", "--jobs", job_id, "--format=%T"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _logs(directory: Path) -> str:
    return "\n".join(
        f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}"
        for path in sorted(directory.glob("*.log"))
    )


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    found = {name: shutil.which(name, path=search) or "" for name in BINARIES}
    missing = [name for name, path in found.items() if not path]
    if missing:
        pytest.skip(
            f"Slurm is not installed here ({', '.join(missing)} missing); on Debian: "
            "apt-get install slurm-wlm munge"
        )
    started = time.monotonic()
    directory = tmp_path_factory.mktemp("slurm")
    host = socket.gethostname().split(".")[0]
    user = subprocess.run(["id", "-un"], capture_output=True, text=True, check=True).stdout
    user = user.strip()
    for name in ("munge", "state", "spool"):
        (directory / name).mkdir(mode=0o700)
    key = directory / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    socket_path = directory / "munge" / "munge.socket"
    conf = directory / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=apstest",
                f"SlurmctldHost={host}(127.0.0.1)",
                f"SlurmctldPort={free_port()}",
                f"SlurmdPort={free_port()}",
                f"SlurmUser={user}",
                f"SlurmdUser={user}",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={socket_path}",
                f"StateSaveLocation={directory / 'state'}",
                f"SlurmdSpoolDir={directory / 'spool'}",
                f"SlurmctldPidFile={directory / 'slurmctld.pid'}",
                f"SlurmdPidFile={directory / 'slurmd.pid'}",
                f"SlurmctldLogFile={directory / 'slurmctld.log'}",
                f"SlurmdLogFile={directory / 'slurmd.log'}",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "SlurmdParameters=config_overrides",  # trust the CPUs below, not the machine
                "ReturnToService=2",
                "MpiDefault=none",
                "JobCompType=jobcomp/none",
                "AccountingStorageType=accounting_storage/none",
                f"NodeName={host} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN",
                f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )
    )
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(conf)  # every Slurm command here, and the jobs, read it
    daemons: list[subprocess.Popen[bytes]] = []

    def start(*command: str, log: str) -> None:
        with open(directory / log, "wb") as out:
            daemons.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT))

    try:
        start(
            found["munged"], "--foreground", "--force",
            f"--socket={socket_path}", f"--key-file={key}",
            f"--pid-file={directory / 'munge' / 'munged.pid'}",
            f"--seed-file={directory / 'munge' / 'munged.seed'}",
            f"--log-file={directory / 'munged.log'}",
            log="munged.out.log",
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while not socket_path.exists():
            assert time.monotonic() < deadline, f"munged did not start:\n{_logs(directory)}"
            time.sleep(0.1)
        start(found["slurmctld"], "-D", "-c", "-f", str(conf), log="slurmctld.out.log")
        start(found["slurmd"], "-D", "-N", host, "-f", str(conf), log="slurmd.out.log")
        deadline = time.monotonic() + 60
        while True:
            state = subprocess.run(
                ["sinfo", "--noheader", "--format=%T"], capture_output=True, text=True
            ).stdout.strip()
            if state == "idle":
                break
            assert time.monotonic() < deadline, f"node not idle ({state!r}):\n{_logs(directory)}"
            time.sleep(0.25)
        print(f"single-node Slurm up in {time.monotonic() - started:.1f} s")
        yield Slurm(directory, host)
    finally:
        subprocess.run(["scancel", f"--user={user}"], capture_output=True, check=False)
        for daemon in reversed(daemons):
            daemon.terminate()
        for daemon in reversed(daemons):
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous


def cluster_timeouts(connect: float = 60.0) -> aps.Timeouts:
    return aps.Timeouts(connect=connect, step=30.0, heartbeat_interval=0.5)


def test_slurm_workers_step_like_sync_vector_env(slurm: Slurm, tmp_path: Path) -> None:
    launcher = aps.launch.slurm(
        "CartPole-v1",
        nodes=1,
        tasks_per_node=WORKERS,
        envs_per_worker=ENVS_PER_WORKER,
        partition="debug",
        time="00:10:00",
        directory=tmp_path,
        seed=100,
        poll_interval=0.5,
    )
    expected = SyncVectorEnv([lambda: gym.make("CartPole-v1")] * (WORKERS * ENVS_PER_WORKER))
    envs = aps.ClusterEnv(
        "tcp://127.0.0.1:0",
        num_workers=WORKERS,
        token=SECRET,
        launcher=launcher,
        timeouts=cluster_timeouts(),
    )
    try:
        job_id = launcher.job_id
        assert job_id is not None and slurm.squeue(job_id) == "RUNNING"
        assert {w.host for w in envs.workers} == {socket.gethostname()}
        # The token is in a file only its owner reads, never in the script.
        assert launcher.token_path is not None and launcher.script_path is not None
        assert stat.S_IMODE(launcher.token_path.stat().st_mode) == 0o600
        assert launcher.token_path.read_text().strip() == SECRET
        assert SECRET not in launcher.script_path.read_text()

        # Without a seed from the learner, task i seeds its envs from 100 + i * 3.
        obs, _ = envs.reset()
        first, _ = expected.reset(seed=100)
        blocks = [obs[:ENVS_PER_WORKER], obs[ENVS_PER_WORKER:]]
        tasks = [first[:ENVS_PER_WORKER], first[ENVS_PER_WORKER:]]
        matches = sorted(
            next(i for i, task in enumerate(tasks) if np.array_equal(block, task))
            for block in blocks
        )
        assert matches == [0, 1]

        assert_same(envs.reset(seed=0), expected.reset(seed=0), "reset")
        rng = np.random.default_rng(0)
        for t in range(STEPS):
            actions = rng.integers(0, 2, size=WORKERS * ENVS_PER_WORKER)
            assert_same(envs.step(actions), expected.step(actions), f"step {t}")
        status = envs.call_learner(lambda learner: launcher.status())
        assert status.launcher == "slurm" and status.state == "RUNNING"
        assert f"job {job_id}" in status.detail and slurm.host in status.detail
    finally:
        envs.close()
        expected.close()
    assert slurm.squeue(job_id) == ""  # the workers left after the goodbye; the job ended
    assert not launcher.token_path.exists()
    assert launcher.log_path is not None and launcher.log_path.exists()


async def test_close_cancels_a_running_job(slurm: Slurm, tmp_path: Path) -> None:
    # The learner closes before the workers arrive: they would keep dialing for 60 s.
    launcher = aps.launch.slurm(
        "CartPole-v1", tasks_per_node=2, directory=tmp_path, connect_timeout=60
    )
    async with aps.Learner(
        "tcp://127.0.0.1:0", num_workers=2, token=SECRET, launcher=launcher
    ) as learner:
        assert learner.launcher is launcher and launcher.job_id is not None
        deadline = time.monotonic() + 30
        while (await launcher.status()).state != "RUNNING":
            assert time.monotonic() < deadline
            await asyncio.sleep(0.2)
    assert (await launcher.status()).state == "CANCELLED"
    assert slurm.squeue(launcher.job_id) == ""


async def test_sbatch_refusal_is_a_launch_error_with_slurms_words(
    slurm: Slurm, tmp_path: Path
) -> None:
    launcher = aps.launch.slurm(
        "CartPole-v1", tasks_per_node=2, partition="no-such-partition", directory=tmp_path
    )
    learner = aps.Learner("tcp://127.0.0.1:0", num_workers=2, token=SECRET, launcher=launcher)
    with pytest.raises(aps.LaunchError, match="sbatch refused the job") as error:
        await learner.start()
    assert "invalid partition" in error.value.stderr.lower()
    assert "invalid partition" in str(error.value).lower()
    assert launcher.job_id is None
    assert not token_files(tmp_path)


async def test_workers_that_never_connect_time_out_and_the_job_is_cancelled(
    slurm: Slurm, tmp_path: Path
) -> None:
    launcher = aps.launch.slurm(
        "CartPole-v1",
        tasks_per_node=2,
        directory=tmp_path,
        extra_sbatch=["--begin=now+3600"],  # pending for an hour: nobody will connect
        poll_interval=0.5,
    )
    async with aps.Learner(
        "tcp://127.0.0.1:0",
        num_workers=2,
        token=SECRET,
        launcher=launcher,
        timeouts=cluster_timeouts(connect=3.0),
    ) as learner:
        with pytest.raises(aps.Timeout) as timeout:
            await learner.wait_for_workers()
        message = str(timeout.value)
        assert "0 of 2 workers arrived" in message
        assert f"slurm launcher: PENDING (job {launcher.job_id}, reason BeginTime)" in message
        assert "the launcher has been stopped" in message
        # Cancelled at once, not only when the learner closes.
        assert launcher.job_id is not None and slurm.squeue(launcher.job_id) == ""
        assert (await launcher.status()).state == "CANCELLED"


async def test_failed_job_ends_the_wait_with_its_log(slurm: Slurm, tmp_path: Path) -> None:
    launcher = aps.launch.slurm(
        f"{tmp_path / 'missing.py'}:make", tasks_per_node=2, directory=tmp_path, poll_interval=0.5
    )
    async with aps.Learner(
        "tcp://127.0.0.1:0",
        num_workers=2,
        token=SECRET,
        launcher=launcher,
        timeouts=cluster_timeouts(connect=60.0),
    ) as learner:
        with pytest.raises(aps.LaunchError, match=r"Slurm job \d+ ended \(FAILED") as error:
            await learner.wait_for_workers()
        assert "does not exist" in error.value.stderr  # the workers' own words, from the log
