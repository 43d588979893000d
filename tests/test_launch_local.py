"""The launcher protocol, the worker spec, the local launcher behind Learner(launcher=...),
and workers that dial a TLS learner from the command line (--tls-ca)."""

from __future__ import annotations

import asyncio
import os
import ssl
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aps
import aps.launch
from aps.launch.base import client_factory, per_worker
from aps.transports.tcp import TCPFactory
from tests.conftest import FAST, _self_signed


def test_every_launcher_implements_the_protocol() -> None:
    launchers: list[Any] = [
        aps.launch.local("CartPole-v1", num_workers=2),
        aps.launch.LocalWorkers("CartPole-v1", num_workers=1, envs_per_worker=1),
        aps.launch.slurm("CartPole-v1", nodes=2, tasks_per_node=2),
    ]
    try:
        launchers.append(aps.launch.ray("CartPole-v1", num_workers=2))
    except aps.MissingDependency:
        pass
    for launcher in launchers:
        assert isinstance(launcher, aps.launch.Launcher), launcher
        assert isinstance(launcher.spec, aps.launch.WorkerSpec)
    assert launchers[2].spec.num_workers == 4


def test_worker_spec_seeds_kwargs_and_arguments() -> None:
    spec = aps.launch.WorkerSpec(
        env="CartPole-v1",
        num_workers=3,
        envs_per_worker=4,
        seed=10,
        env_kwargs=({"a": 1}, {}, {"a": 3}),
        comm_delays=(0.0, 0.0, 0.25),
    )
    assert [spec.seed_of(i) for i in range(3)] == [10, 14, 18]
    assert spec.env_kwargs_of(1) == {} and spec.comm_delay_of(2) == 0.25
    assert spec.worker_arguments(2) == [
        "--env", "CartPole-v1", "--num-envs", "4", "--no-check-env", "--log-level", "WARNING",
        "--connect-timeout", "60.0", "--label", "2", "--seed", "18", "--env-kwargs", '{"a": 3}',
        "--comm-delay", "0.25",
    ]  # fmt: skip
    bound = spec.for_learner("tcp://h:1", token=b"tok", policy="m:f")
    assert (bound.url, bound.token, bound.policy) == ("tcp://h:1", "tok", "m:f")
    assert "tok" not in repr(bound)  # the token stays out of logs and reprs
    with pytest.raises(aps.ConfigError, match="another token"):
        bound.for_learner("tcp://h:1", token="other")
    with pytest.raises(aps.ConfigError, match="3 workers"):
        aps.launch.WorkerSpec(env="CartPole-v1", num_workers=3, env_kwargs=({}, {}))
    with pytest.raises(aps.ConfigError, match="envs_per_worker"):
        aps.launch.WorkerSpec(env="CartPole-v1", num_workers=1, envs_per_worker=0)
    with pytest.raises(aps.ConfigError, match="log_level"):
        aps.launch.WorkerSpec(env="CartPole-v1", num_workers=1, log_level="LOUD")
    assert per_worker("env_kwargs", {"g": 1}, 2, kind=dict) == ({"g": 1}, {"g": 1})
    with pytest.raises(aps.ConfigError, match="give one each"):
        per_worker("compute_delays", [0.1], 2, kind=float)


def test_dialable_url_replaces_only_wildcards() -> None:
    assert aps.launch.dialable_url("tcp://0.0.0.0:7000", default_host="node7") == (
        "tcp://node7:7000"
    )
    assert aps.launch.dialable_url("ws://[::]:80/", default_host="::1") == "ws://[::1]:80/"
    assert aps.launch.dialable_url("tcp://10.0.0.5:7000") == "tcp://10.0.0.5:7000"
    assert aps.launch.dialable_url("tcp://10.0.0.5:7000", "login1") == "tcp://login1:7000"
    assert aps.launch.dialable_url("memory://x") == "memory://x"


@pytest.mark.parametrize("url", ["memory://", "tcp://127.0.0.1:0"])
async def test_learner_starts_watches_and_stops_a_local_launcher(url: str) -> None:
    launcher = aps.launch.local("CartPole-v1", num_workers=2, envs_per_worker=2, timeouts=FAST)
    assert (await launcher.status()).state == "not started"
    async with aps.Learner(
        url, num_workers=2, token="t0k", launcher=launcher, timeouts=FAST
    ) as learner:
        obs, _ = await learner.reset(seed=0)
        assert obs.shape == (4, 4)
        await learner.step(np.zeros(4, np.int64))
        status = await launcher.status()
        assert status.launcher == "local" and status.state == "running"
        assert len(status.workers) == 2 and all("running" in w for w in status.workers)
        if url.startswith("tcp"):
            assert os.getpid() not in {w.pid for w in learner.workers}
    assert (await launcher.status()).state == "stopped"


async def test_a_dead_local_worker_ends_the_wait_and_stops_the_others() -> None:
    # One worker of the two cannot build its envs: the wait ends with its story at once.
    launcher = aps.launch.local(
        "CartPole-v1",
        num_workers=2,
        env_kwargs=[{}, {"no_such_argument": 1}],
        timeouts=FAST,
    )
    async with aps.Learner("memory://", num_workers=2, launcher=launcher, timeouts=FAST) as learner:
        with pytest.raises(aps.WorkerLost, match="local worker task 1"):
            await learner.wait_for_workers(timeout=60)
        assert (await launcher.status()).state == "stopped"


async def test_cluster_env_takes_a_launcher() -> None:
    launcher = aps.launch.local("CartPole-v1", num_workers=2, envs_per_worker=3)

    def run() -> tuple[int, Any]:
        envs = aps.ClusterEnv(num_workers=2, token="t0k", launcher=launcher)
        try:
            envs.reset(seed=0)
            return envs.num_envs, envs.call_learner(lambda learner: launcher.status())
        finally:
            envs.close()

    num_envs, status = await asyncio.to_thread(run)
    assert num_envs == 6 and status.state == "running"
    assert (await launcher.status()).state == "stopped"


def test_client_factory_needs_a_tls_scheme(tmp_path: Path) -> None:
    assert client_factory("tcp://h:1", None) is None
    with pytest.raises(aps.ConfigError, match="cannot load"):
        client_factory("tcp://h:1", str(tmp_path / "missing.pem"))


async def test_cli_worker_dials_a_tls_learner_with_tls_ca(tmp_path: Path) -> None:
    files = _self_signed(tmp_path)
    if files is None:
        pytest.skip("no openssl command and no cryptography package to make a certificate")
    cert, key = files
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    with pytest.raises(aps.ConfigError, match="wss://"):
        client_factory("ws://127.0.0.1:1/", str(cert))
    assert isinstance(client_factory("tls://127.0.0.1:1", str(cert)), TCPFactory)
    async with aps.Learner(
        "tcp://127.0.0.1:0",
        num_workers=1,
        token="t0k",
        factory=TCPFactory(ssl_context=server),
        timeouts=FAST,
    ) as learner:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "aps", "worker", learner.url,
            "--env", "CartPole-v1", "--num-envs", "2", "--tls-ca", str(cert),
            env={**os.environ, "APS_TOKEN": "t0k"},
        )  # fmt: skip
        try:
            obs, _ = await learner.reset(seed=0)
            assert obs.shape == (2, 4)
        finally:
            await learner.aclose()
            assert await asyncio.wait_for(process.wait(), 20) == 0


@pytest.mark.parametrize("url", ["tcp://127.0.0.1:0", "unix://"])
async def test_local_workers_restart_a_killed_worker_into_its_slots(url: str) -> None:
    launcher = aps.launch.local("CartPole-v1", num_workers=2, envs_per_worker=2, restart=True)
    async with aps.Learner(
        url,
        num_workers=2,
        launcher=launcher,
        timeouts=FAST,
        on_worker_lost="wait",
        reconnect_timeout=60,
    ) as learner:
        await learner.wait_for_workers(timeout=60)
        await asyncio.wait_for(learner.reset(seed=0), 30)
        victim = learner.workers[0]
        os.kill(victim.pid, 9)
        *_, truncated, info = await asyncio.wait_for(learner.step(np.zeros(4, np.int64)), 60)
        assert truncated[:2].all() and info["worker_restarted"][:2].all()
        assert not info["_worker_restarted"][2:].any()
        assert launcher.restarts == 1 and learner.restarts == 1
        assert learner.workers[0].pid != victim.pid


async def test_local_tls_ca_goes_to_subprocesses_and_not_to_memory_tasks() -> None:
    launcher = aps.launch.local("CartPole-v1", num_workers=1, tls_ca="/etc/aps/ca.pem")
    arguments = launcher.spec.worker_arguments(0)
    assert arguments[arguments.index("--tls-ca") + 1] == "/etc/aps/ca.pem"
    with pytest.raises(aps.ConfigError, match="memory:// workers have no TLS"):
        await launcher.start("memory://tls-test")
